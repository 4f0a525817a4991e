"""The benchmarks' timing: warm-up, median of repeats, spreads, epoch timers
and the results/ copy of a table (benchmarks/README.md: "The one rule").

Plain Python: importing it imports neither TensorFlow nor Keras, so a script
still sets its environment before its first TensorFlow import.
"""

import json
import os
import statistics
import subprocess
import sys
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


ONE_THREAD = """
import importlib, json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path[:0] = [{here!r}, {root!r}]
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)   # before any op
tf.config.threading.set_inter_op_parallelism_threads(1)
out = getattr(importlib.import_module({module!r}), {function!r})(**json.loads({kwargs!r}))
print(json.dumps(out))
"""


def on_one_thread(module, function, timeout=900, **kwargs):
    """``module.function(**kwargs)`` (a benchmarks/ module; JSON in and out)
    in a child process whose TensorFlow runs on one thread: intra- and
    inter-op pools of 1, set before its first op (TensorFlow reads them once
    per process). The setting of a user who runs one process per core, and
    the like-for-like one beside a single-threaded peer per CPU-second: two
    threads finish sooner but spend more CPU on the same work. The child's
    times are its own (``process_time`` there); the persistent XLA cache is
    not asked for."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = ONE_THREAD.format(here=here, root=os.path.dirname(here), module=module,
                             function=function, kwargs=json.dumps(kwargs))
    env = dict(os.environ)
    env.pop("TF_GRADKIT_XLA_CACHE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"on_one_thread: {module}.{function} exited with "
                           f"{done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
