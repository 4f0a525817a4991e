"""Levenberg-Marquardt peak memory: ``chunk_size`` keeps it flat as the batch grows.

``LevenbergMarquardt(model, chunk_size=k)`` folds the Jacobian into J^T J and
J^T r chunk by chunk inside a ``tf.while_loop``, so what it holds should be
``O(k * P + P^2)`` whatever the batch; without ``chunk_size`` the whole batch
is linearised at once. This script trains a 1-50(tanh)-50(tanh)-1 MLP
(2701 parameters, so P^2 is small) for a few LM steps with ``model.fit`` and
``jit_compile=True`` (full-batch: one step per epoch), for batch sizes 1000
and 10000 (``--big`` adds 100000), with ``chunk_size=1000`` and
``chunk_size=None``, each with the Jacobian from layer taps (``linearization=
"auto"``, the default here) and by forward mode (``"autodiff"``).

Why it is built this way:

- Peak RSS only grows, so every configuration runs in a fresh subprocess
  (``--worker``); it reports the growth of ``ru_maxrss`` over a baseline taken
  after the imports (model, data, tracing, compilation and the steps all count).
- A configuration can need more memory than the machine has (without
  ``chunk_size`` the forward-mode Jacobian materialises a tangent per
  parameter for every row). Each worker runs under ``RLIMIT_DATA`` set to
  ``--mem-cap-gb`` (default 80% of MemAvailable at launch), so such a run fails
  with TensorFlow's out-of-memory error instead of pushing the machine into the
  OOM killer; the table then shows the allocation XLA asked for.
- Times per step are reported too (median of the steps after the first, which
  includes compilation), but this script is about memory; see ``lm_sinc.py``
  for speed.

Run: ``.venv/bin/python benchmarks/lm_memory.py`` (about 4-5 minutes on 2 CPU
cores). Writes ``benchmarks/results/lm_memory.md``.
"""

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULT_TAG = "@@RESULT "


# --------------------------------------------------------------------------
# Worker: runs in its own process, the only place TensorFlow is imported.
# --------------------------------------------------------------------------
def worker(batch, chunk, width, steps, jit, linearization="auto"):
    import keras
    import numpy as np
    import tensorflow as tf
    from tf_gradkit.keras3 import LevenbergMarquardt
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    x = np.linspace(-1.0, 1.0, batch, dtype=np.float32)[:, None]
    y = np.sinc(10.0 * x).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(width, activation="tanh"),
                              keras.layers.Dense(width, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=LevenbergMarquardt(model, chunk_size=chunk,
                                               linearization=linearization),
                  loss="mse", jit_compile=jit)
    step_seconds = []

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            step_seconds.append(time.perf_counter() - self.start)

    history = model.fit(x, y, batch_size=batch, epochs=steps, shuffle=False, verbose=0,
                        callbacks=[StepTimer()])
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "params": model.count_params(),
        "baseline_mb": baseline_kb / 1024,
        "growth_mb": (peak_kb - baseline_kb) / 1024,
        "first_step_s": step_seconds[0],
        "step_s": statistics.median(step_seconds[1:]) if len(step_seconds) > 1 else None,
        "loss": [float(v) for v in history.history["loss"]],
        "attempts": [int(v) for v in history.history["attempts"]],
        "tf": tf.__version__,
        "keras": keras.__version__,
    }
    print(RESULT_TAG + json.dumps(result), flush=True)


# --------------------------------------------------------------------------
# Parent: never imports TensorFlow.
# --------------------------------------------------------------------------
def mem_available_gb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024 ** 2
    return None


def run_config(batch, chunk, args, linearization="auto"):
    cap_gb = args.mem_cap_gb or 0.8 * mem_available_gb()
    cap_bytes = int(cap_gb * 1024 ** 3)

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, cap_bytes))

    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(batch),
           "--chunk", str(chunk or 0), "--width", str(args.width), "--steps",
           str(args.steps), "--linearization", linearization] + (
               [] if args.jit else ["--no-jit"])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT,
                          preexec_fn=limit_memory)
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            result.update(batch=batch, chunk=chunk, wall_s=wall, cap_gb=cap_gb,
                          linearization=linearization)
            return result
    oom = re.search(r"Out of memory while trying to allocate ([0-9.]+\s*\w+)", proc.stderr)
    error = (f"out of memory under the {cap_gb:.1f} GB cap (XLA asked for "
             f"{oom.group(1)})" if oom else
             f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-5:]))
    return {"batch": batch, "chunk": chunk, "error": error, "wall_s": wall, "cap_gb": cap_gb,
            "linearization": linearization}


def sizes_mb(batch, chunk, params, width):
    rows = chunk or batch
    jacobian = rows * params * 4 / 1024 ** 2
    tangents = params * rows * width * 4 / 1024 ** 2  # one hidden layer's JVP tangents
    return jacobian, tangents


def report(results, args, load_start, total):
    params = next((r["params"] for r in results if "params" in r), None)
    p2_mb = params * params * 4 / 1024 ** 2 if params else float("nan")
    lines = [
        "# Levenberg-Marquardt peak memory vs batch size, with and without chunk_size", "",
        f"1-{args.width}-{args.width}-1 tanh MLP ({params} parameters; J^T J is "
        f"{p2_mb:.0f} MB in float32), `model.fit` full batch, "
        f"jit_compile={args.jit}, {args.steps} LM steps per configuration, each in a fresh "
        f"process. TensorFlow {next((r['tf'] for r in results if 'tf' in r), '?')}, Keras "
        f"{next((r['keras'] for r in results if 'keras' in r), '?')}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs. Load average (1 min) "
        f"{load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end. Total {total:.0f} s.",
        "",
        "Growth = peak `ru_maxrss` minus the same process's peak right after the imports. "
        "J = rows x P float32 with rows = chunk_size (or the batch); tangents = P x rows x "
        "width float32, what a vectorised forward-mode Jacobian holds for one hidden layer "
        "(an estimate, for scale).", "",
        "| linearization | chunk_size | batch | peak RSS growth MB | growth / batch-1000 growth | "
        "s/step (median, steps 2..) | first step s (compile) | attempts per step | "
        "J MB | tangents MB (est.) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    base = {(r["chunk"], r["linearization"]): r["growth_mb"] for r in results
            if r["batch"] == args.batches[0] and "growth_mb" in r}
    for r in results:
        chunk, key = r["chunk"] or "None", (r["chunk"], r["linearization"])
        if "error" in r:
            lines.append(f"| {r['linearization']} | {chunk} | {r['batch']} | failed: "
                         f"{r['error']} | | | | | | |")
            continue
        ratio = r["growth_mb"] / base[key] if key in base else float("nan")
        jac, tan = sizes_mb(r["batch"], r["chunk"], r["params"], args.width)
        step = "n/a" if r["step_s"] is None else f"{r['step_s']:.2f}"
        lines.append(
            f"| {r['linearization']} | {chunk} | {r['batch']} | {r['growth_mb']:.0f} | {ratio:.2f} | {step} | "
            f"{r['first_step_s']:.1f} | {','.join(map(str, r['attempts']))} | {jac:.0f} | "
            f"{tan:.0f} |")
    lines += ["", "## Peak memory at larger batches relative to batch "
              f"{args.batches[0]}", "", "| linearization | chunk_size | " + " | ".join(
                  f"{b // args.batches[0]}x batch ({b})" for b in args.batches[1:]) + " |",
              "|---|---|" + "---:|" * (len(args.batches) - 1)]
    for lin in args.linearizations:
        for chunk in args.chunks:
            cells = []
            for b in args.batches[1:]:
                r = next((r for r in results if r["batch"] == b and r["chunk"] == chunk
                          and r["linearization"] == lin), None)
                if r is None:
                    cells.append("not run")
                elif "error" in r or (chunk, lin) not in base:
                    cells.append("failed")
                else:
                    cells.append(f"{r['growth_mb'] / base[(chunk, lin)]:.2f}x")
            lines.append(f"| {lin} | {chunk or 'None'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also batch 100000")
    parser.add_argument("--width", type=int, default=50, help="hidden layer width")
    parser.add_argument("--steps", type=int, default=4, help="LM steps per configuration")
    parser.add_argument("--no-jit", dest="jit", action="store_false")
    parser.add_argument("--mem-cap-gb", type=float, default=None,
                        help="RLIMIT_DATA per worker (default: 80%% of MemAvailable)")
    parser.add_argument("--linearizations", default="auto,autodiff",
                        help="comma-separated LevenbergMarquardt(linearization=...)")
    parser.add_argument("--linearization", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.batch, args.chunk or None, args.width, args.steps, args.jit,
               args.linearization)
        return

    args.batches = [1000, 10_000] + ([100_000] if args.big else [])
    args.chunks = [1000, None]
    args.linearizations = args.linearizations.split(",")
    load_start = os.getloadavg()
    start = time.perf_counter()
    results = []
    for batch, chunk, lin in [(b, c, lin) for lin in args.linearizations
                              for b in args.batches for c in args.chunks]:
        print(f"batch {batch}, chunk_size={chunk}, {lin} ...", flush=True)
        res = run_config(batch, chunk, args, lin)
        results.append(res)
        print("  " + (res["error"] if "error" in res else
                      f"growth {res['growth_mb']:.0f} MB, {res['step_s']} s/step, "
                      f"{res['wall_s']:.0f} s in all"), flush=True)
    text = report(results, args, load_start, time.perf_counter() - start)
    print("\n" + text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "lm_memory.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
