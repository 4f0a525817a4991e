"""XLA's CPU emitters: what `XLA_FLAGS=--xla_cpu_use_fusion_emitters=false` does
to tf_gradkit's compiled fits, beside XLA's default, in the same run.

TensorFlow 2.21's XLA compiles each CPU fusion through its own MLIR pipeline
(the "fusion emitters", the default). The flag takes XLA's older emitters.
This script measures both on the same data, each in fresh child processes
(a compile is paid per process), rounds interleaved (default first, then the
older, then the older first...):

  first   one `curve_fit(..., jit_compile=True)` call in a new process: the
          trace, the XLA compile and the fits (CPU seconds, all threads);
  repeat  the best of three further calls: fits per CPU-second;
  lsq     a `least_squares(..., jit_compile=True)` first call (80 points,
          3 parameters, float64: `lsq_latency.py`'s case).

Cases: Gpufit's 2-D Gaussian, 5x5 (10^5 fits) and 15x15 (2 x 10^4 fits),
float32, made as Cpufit's driver makes them (`cpufit_side_by_side.generated`,
also `kernel_profile.py`'s data), Cpufit's stopping rule (``ftol=1e-4, max_iterations=10``,
``solver="cholesky"``). Each fit's status is compared between the two.

A process-wide flag, read once when XLA first compiles: set it in the
environment before the process starts (tf_gradkit never sets it; `make test`
does, for the suite's hundreds of small compiles). Only CPU compiles use it.

Run: ``.venv/bin/python benchmarks/xla_emitters.py`` (about 3 minutes;
``--rounds 1`` for one round).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from timing import write_result

FLAG = "--xla_cpu_use_fusion_emitters=false"

CHILD = r"""
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf, tf_gradkit
case = sys.argv[1]
if case == "lsq":
    t = np.linspace(0.0, 4.0, 80)
    y = 3.0 * np.exp(-1.2 * t) + 0.1 + 0.01 * np.random.default_rng(0).standard_normal(80)
    t_tf, y_tf = tf.constant(t), tf.constant(y)
    p = tf.Variable([1.0, 1.0, 0.0], dtype=tf.float64)
    c0 = time.process_time()
    r = tf_gradkit.least_squares(lambda: p[0] * tf.exp(-p[1] * t_tf) + p[2] - y_tf, [p],
                                 jit_compile=True)
    print(json.dumps({"first": time.process_time() - c0, "x": r.x.numpy().tolist()}))
    sys.exit()
side, fits = (5, 10 ** 5) if case == "5x5" else (15, 2 * 10 ** 4)
sys.path.insert(0, sys.argv[2])   # benchmarks/
from cpufit_side_by_side import gaussian, generated
xy, ydata, p0 = generated(side, fits)

def call():
    fit = tf_gradkit.curve_fit(gaussian, xy, ydata, p0, jit_compile=True, ftol=1e-4,
                               max_iterations=10, solver="cholesky")
    return np.asarray(fit.status)

c0 = time.process_time()
status = call()
first = time.process_time() - c0
best = None
for _ in range(3):
    c0 = time.process_time()
    call()
    spent = time.process_time() - c0
    best = spent if best is None else min(best, spent)
print(json.dumps({"first": first, "rate": fits / best,
                  "status": np.bincount(status.ravel(), minlength=10).tolist()}))
"""


def child(case, older):
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f != FLAG]
    env["XLA_FLAGS"] = " ".join(flags + ([FLAG] if older else []))
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", CHILD, case, here], env=env, capture_output=True,
                         text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for case in ("5x5", "15x15", "lsq"):
        runs = {False: [], True: []}
        for r in range(args.rounds):
            for older in ((False, True) if r % 2 == 0 else (True, False)):
                runs[older].append(child(case, older))
        default, older = runs[False], runs[True]
        same = all(a.get("status") == b.get("status") for a, b in zip(default, older))
        first = [b["first"] / a["first"] for a, b in zip(default, older)]
        row = [case, statistics.median(a["first"] for a in default),
               statistics.median(b["first"] for b in older), statistics.median(first)]
        if case != "lsq":
            rate = [b["rate"] / a["rate"] for a, b in zip(default, older)]
            row += [statistics.median(a["rate"] for a in default),
                    statistics.median(b["rate"] for b in older), statistics.median(rate),
                    min(rate), max(rate), "yes" if same else "no"]
        rows.append(row)
    load = os.getloadavg()[0]
    lines = [f"load average at the end: {load:.1f} on {os.cpu_count()} cores",
             "", "| case | first call, CPU s: default | older emitters | ratio | "
             "fits per CPU-second: default | older | ratio [min-max] | same statuses |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        text = f"| {row[0]} | {row[1]:.2f} | {row[2]:.2f} | {row[3]:.2f}x |"
        if len(row) > 4:
            text += (f" {row[4]:,.0f} | {row[5]:,.0f} | {row[6]:.2f}x "
                     f"[{row[7]:.2f}-{row[8]:.2f}] | {row[9]} |")
        else:
            text += " | | | |"
        lines.append(text)
    table = "\n".join(lines)
    print(table)
    print("written to", write_result("xla_emitters.md", table))


if __name__ == "__main__":
    main()
