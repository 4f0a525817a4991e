"""Positive definite solves under XLA: `tf_gradkit.core.spd`'s loop vs XLA's Cholesky.

What it measures: one ``solve(A + eps_i I, b)`` for float32 ``A = J^T J``
(``J`` 1000 x n, Gaussian), as LM's damped step does, for n in 16..512.
Three contenders in the same run:

  loop      ``spd.solve`` with the loop kernel, ``jit_compile=True``;
  library   ``spd.solve`` with ``tf.linalg.cholesky``/``cholesky_solve``,
            ``jit_compile=True`` (XLA's expansion of both);
  no-XLA    the library kernel in ``tf.function`` without XLA (TensorFlow's
            own CPU kernels): the baseline a user had before compiling.

Why it is built this way: a single call costs a few microseconds of dispatch
on top of the solve, so each timed call runs ``K`` solves in a
``tf.while_loop`` whose matrix changes every iteration (``+ i * 1e-3 I``,
so XLA cannot hoist the solve out of the loop) and the time is divided by
``K``. Repeats are interleaved contender by contender; the table shows the
median and the ratio library / loop and no-XLA / loop per repeat (median
[min-max]). Each contender's answer is checked against numpy in float64.

Run: ``.venv/bin/python benchmarks/spd_solve.py`` (about a minute).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # this script only, before TF loads

import numpy as np

from timing import spread_text as spread, write_result

INNER = 20  # solves per timed call


def make_system(n, seed=0):
    rng = np.random.default_rng(seed)
    j = rng.normal(size=(1000, n)).astype(np.float32)
    return j.T @ j, rng.normal(size=(n, 1)).astype(np.float32)


def contender(kernel, jit, n):
    import tensorflow as tf
    from tf_gradkit.core import spd

    def many(a, b):
        def body(i, total):
            shifted = a + tf.cast(i, a.dtype) * 1e-3 * tf.eye(n, dtype=a.dtype)
            x, _ = spd.solve(shifted, b)
            return i + 1, total + x
        with spd.use_kernel(kernel):
            return tf.while_loop(lambda i, _: i < INNER, body,
                                 (tf.constant(0), tf.zeros_like(b)))[1]

    def once(a, b):
        with spd.use_kernel(kernel):
            return spd.solve(a, b)[0]

    return tf.function(many, jit_compile=jit), tf.function(once, jit_compile=jit)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,61,128,256,512")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import tensorflow as tf
    sizes = [int(s) for s in args.sizes.split(",")]
    names = {"loop": ("loop", True), "library": ("library", True),
             "no-XLA": ("library", False)}
    load = os.getloadavg()[0]
    rows = []
    for n in sizes:
        a_np, b_np = make_system(n)
        a, b = tf.constant(a_np), tf.constant(b_np)
        exact = np.linalg.solve(a_np.astype(np.float64), b_np.astype(np.float64))
        fns, errors, times = {}, {}, {k: [] for k in names}
        for name, (kernel, jit) in names.items():
            many, once = contender(kernel, jit, n)
            x = once(a, b).numpy().astype(np.float64)
            errors[name] = float(np.max(np.abs(x - exact)) / np.max(np.abs(exact)))
            many(a, b).numpy()  # trace and compile
            fns[name] = many
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(a, b).numpy()
                times[name].append((time.perf_counter() - start) / INNER * 1e3)
        ratio = {k: [t / l for t, l in zip(times[k], times["loop"])]
                 for k in ("library", "no-XLA")}
        rows.append((n, {k: statistics.median(v) for k, v in times.items()}, ratio, errors))

    lines = ["# Positive definite solve: spd loop vs XLA's Cholesky vs TensorFlow without XLA",
             "", f"TensorFlow {tf.__version__}, {os.cpu_count()} CPUs, load {load:.1f} at "
             f"start, {os.getloadavg()[0]:.1f} at end; float32; ms per solve (median of "
             f"{args.repeats} interleaved repeats of {INNER} solves); ratio = contender / "
             "loop per repeat; error = max |x - x64| / max |x64|.", "",
             "| n | loop (jit) ms | library (jit) ms | no-XLA ms | library / loop | "
             "no-XLA / loop | errors loop, library, no-XLA |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for n, med, ratio, err in rows:
        lines.append(f"| {n} | {med['loop']:.4f} | {med['library']:.4f} | "
                     f"{med['no-XLA']:.4f} | {spread(ratio['library'])} | "
                     f"{spread(ratio['no-XLA'])} | {err['loop']:.1e}, {err['library']:.1e}, "
                     f"{err['no-XLA']:.1e} |")
    text = "\n".join(lines)
    print(text)
    write_result("spd_solve.md", text)


if __name__ == "__main__":
    main()
