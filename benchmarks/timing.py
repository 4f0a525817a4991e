"""The benchmarks' timing: warm-up, median of repeats, spreads, epoch timers
and the results/ copy of a table (benchmarks/README.md: "The one rule").

Plain Python: importing it imports neither TensorFlow nor Keras, so a script
still sets its environment before its first TensorFlow import.
"""

import os
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def wait(out):
    """Waits for ``out`` (a tensor, or a list, tuple or dict of them) by
    reading each one to the host; anything else passes through."""
    if isinstance(out, dict):
        return {k: wait(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return [wait(v) for v in out]
    return out.numpy() if hasattr(out, "numpy") else out


def median_ms(fn, repeats=20, warmup=1):
    """Median milliseconds of one ``fn()`` call over ``repeats`` calls, after
    ``warmup`` untimed calls (tracing, compiling); each call waits for its
    result."""
    for _ in range(warmup):
        wait(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        wait(fn())
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def spread(values):
    """``(median, min, max)`` of ``values`` (per-repeat times or ratios)."""
    values = list(values)
    return statistics.median(values), min(values), max(values)


def spread_text(values, spec=".3g"):
    """``"median [min-max]"`` of ``values``, each formatted with ``spec``."""
    med, lo, hi = spread(values)
    return f"{med:{spec}} [{lo:{spec}}-{hi:{spec}}]"


def epoch_timer_class(callback_base, clock=time.perf_counter):
    """A Keras callback class (on ``callback_base``, the flavour's
    ``keras.callbacks.Callback``) whose ``times`` holds each epoch's seconds
    by ``clock`` (``time.process_time`` for the process's CPU time)."""

    class EpochTimer(callback_base):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = clock()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(clock() - self._start)

    return EpochTimer


def write_result(name, text):
    """Writes ``text`` (and a newline) to benchmarks/results/``name``
    (git-ignored); returns the path."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return path
