"""Frank-Wolfe over the nuclear-norm ball vs projected gradient with a full SVD.

Compares, per step on one ``n x n`` float32 weight with a fixed gradient:

  (a) pgd  projected gradient: ``w <- P(w - lr g)`` where ``P`` projects onto
           ``{sum sigma_i <= r}`` exactly: a full ``tf.linalg.svd``, the
           singular values projected onto the l1 ball
           (`tf_gradkit.core.projections.project_l1_ball`), ``U diag(s) V^T``.
           The baseline: what a "constraint" costs done the usual way.
  (b) fw   ``tf_gradkit.keras3.ConditionalGradient(ord="nuclear")`` through
           ``apply_gradients`` (Keras 3): two warm-started power iterations
           (four matrix-vector products) and a rank-1 update. It carries the
           Keras optimizer's own overhead (iteration counter, learning-rate
           read); (a) is a bare ``tf.Variable`` assign.

Sizes 128 and 256 in eager, ``tf.function`` and ``tf.function(jit_compile=True)``;
512 in eager and ``tf.function`` only: XLA's CPU SVD is very slow (about 1.5 s
per 128 x 128 and 25 s per 256 x 256 call on a loaded 2-core box, vs ms
without XLA), which is the point of the comparison but makes 512 under XLA
take minutes.

Method (see benchmarks/README.md): one warm-up call per contender (tracing and
XLA compilation, reported apart), then repeats in which the contenders run
interleaved; each repeat times a batch of steps of each contender, sized to
take about ``--target`` seconds (at least one step), and ends with a host read
of the variable so the work is done. The ratio pgd/fw is the median of the
per-repeat ratios, [min-max] beside it. Whole run: about 2-3 minutes, most of
it in the 256 x 256 XLA SVD.

Run: ``.venv/bin/python benchmarks/frank_wolfe.py`` (``--skip-slow-xla``
drops 256 under XLA: ~30 s).
"""

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from tf_gradkit.core import projections
from tf_gradkit.keras3 import ConditionalGradient
from timing import spread, write_result

LR = 0.1
RADIUS = 10.0
CONFIGS = [(128, "eager"), (128, "graph"), (128, "jit"),
           (256, "eager"), (256, "graph"), (256, "jit"),
           (512, "eager"), (512, "graph")]


def compile_fn(fn, mode):
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=(mode == "jit"))


def project_nuclear_ball(w, radius):
    """Exact Euclidean projection onto the nuclear ball (full SVD)."""
    s, u, v = tf.linalg.svd(w)
    s = projections.project_l1_ball(s, radius)  # s >= 0: stays >= 0
    return tf.matmul(u * s[None, :], v, transpose_b=True)


def make_contenders(n, mode, seed=0):
    rng = np.random.RandomState(seed)
    w0 = rng.randn(n, n).astype("float32") * (RADIUS / n ** 1.5)  # feasible
    g = tf.constant(rng.randn(n, n).astype("float32"))

    pgd_var = tf.Variable(w0)

    def pgd_step():
        pgd_var.assign(project_nuclear_ball(pgd_var - LR * g, RADIUS))

    fw_var = keras.Variable(w0, name="w")
    opt = ConditionalGradient(LR, lambda_=RADIUS, ord="nuclear")
    opt.build([fw_var])

    def fw_step():
        opt.apply_gradients([(g, fw_var)])

    return {"pgd": (compile_fn(pgd_step, mode), pgd_var),
            "fw": (compile_fn(fw_step, mode), fw_var)}


def run_steps(step, var, count):
    start = time.perf_counter()
    for _ in range(count):
        step()
    np.asarray(var.numpy()[0, 0])  # wait for the work to finish
    return (time.perf_counter() - start) / count


def bench(n, mode, repeats, target):
    contenders = make_contenders(n, mode)
    warmup, counts = {}, {}
    for name, (step, var) in contenders.items():
        warmup[name] = run_steps(step, var, 1)              # trace + compile + 1 step
        # A step slower than a second needs no probe: one step per repeat.
        probe = warmup[name] if warmup[name] > 1.0 else run_steps(step, var, 1)
        counts[name] = max(1, int(target / max(probe, 1e-6)))
    per_step = {name: [] for name in contenders}
    slow = max(warmup.values()) > 5.0
    for _ in range(2 if slow else repeats):
        for name, (step, var) in contenders.items():       # interleaved
            per_step[name].append(run_steps(step, var, counts[name]))
    ratios = [p / f for p, f in zip(per_step["pgd"], per_step["fw"])]
    ratio, lo, hi = spread(ratios)
    return {
        "n": n, "mode": mode,
        "fw_ms": 1e3 * statistics.median(per_step["fw"]),
        "pgd_ms": 1e3 * statistics.median(per_step["pgd"]),
        "ratio": ratio, "lo": lo, "hi": hi,
        "warm_fw": warmup["fw"], "warm_pgd": warmup["pgd"],
        "repeats": len(ratios),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.2,
                        help="seconds per contender per repeat")
    parser.add_argument("--skip-slow-xla", action="store_true")
    args = parser.parse_args()
    configs = [c for c in CONFIGS
               if not (args.skip_slow_xla and c == (256, "jit"))]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = []
    for n, mode in configs:
        row = bench(n, mode, args.repeats, args.target)
        rows.append(row)
        print(f"  {n}x{n} {mode}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    lines = [
        "# Frank-Wolfe (nuclear) vs projected gradient with full SVD",
        "",
        f"TF {tf.__version__}, Keras {keras.__version__}, {platform.machine()}, "
        f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}, "
        f"{time.perf_counter() - t0:.0f} s total",
        "",
        "| size | mode | fw ms/step | pgd (SVD) ms/step | pgd / fw [min-max] | "
        "first call fw / pgd (s) | repeats |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']}x{r['n']} | {r['mode']} | {r['fw_ms']:.3f} | "
            f"{r['pgd_ms']:.2f} | {r['ratio']:.1f}x [{r['lo']:.1f}-{r['hi']:.1f}] | "
            f"{r['warm_fw']:.2f} / {r['warm_pgd']:.2f} | {r['repeats']} |")
    table = "\n".join(lines)
    print(table)
    write_result("frank_wolfe.md", table)


if __name__ == "__main__":
    main()
