"""What TF32 does to Levenberg-Marquardt, emulated on a CPU.

On an Ampere/Hopper GPU TensorFlow runs float32 matrix products in TF32 by
default: inputs rounded to a 10-bit mantissa, exact products, float32 sums.
`tf_gradkit.core.precision.emulate_tf32` applies that rounding on a CPU, so
the effect on LM's own products can be measured without a GPU. Three
variants, each from the same start:

  float32      the products in float32 (what a CPU, or TF32 off, gives);
  tf32-before  every product LM forms (J^T J, J^T r, J^T J d, the dot
               products of the gain ratio) rounded as TF32 would: the code
               before `precision` existed, on a GPU with TF's defaults;
  tf32-now     TF32 kernels under today's code: J^T J through the
               TF32-exact split, matrix-vector and dot products as
               multiply-and-sum (no TF32).

The model's own forward pass and Jacobian are not emulated: they are the
user's precision (TF32 on a GPU), the same for every optimizer, and only a
GPU run measures them (`make test-gpu`, docs/gpu_and_xla.md).

Cases: the sinc fit of `lm_sinc.py` (Keras 3, ``jit_compile=True``, final
MSE on all 20000 points), and the NIST StRD problems in float32 from start 2
(LRE of the certified parameters; float32 caps it near 5-7).

Run: ``.venv/bin/python benchmarks/tf32_lm.py [--epochs 100] [--seeds 2]``.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import tensorflow as tf  # noqa: E402

import tf_gradkit  # noqa: E402
from tf_gradkit.core import precision  # noqa: E402

VARIANTS = ("float32", "tf32-before", "tf32-now")


def _tf32(t):
    return precision.emulate_tf32(t) if t.dtype == tf.float32 else t


def _tf32_kernel(a, b, transpose_a=False, transpose_b=False):
    return tf.matmul(_tf32(a), _tf32(b), transpose_a=transpose_a,
                     transpose_b=transpose_b)


@contextlib.contextmanager
def variant(name):
    """Patches `precision` (read when a step is traced) for one variant."""
    saved = {k: getattr(precision, k) for k in ("_raw_matmul", "gram", "matmul",
                                                 "matvec", "dot")}
    try:
        if name == "tf32-before":
            precision.gram = lambda a: _tf32_kernel(a, a, transpose_a=True)
            precision.matmul = _tf32_kernel
            precision.matvec = lambda a, x, transpose_a=False: saved["matvec"](
                _tf32(a), _tf32(x), transpose_a=transpose_a)
            precision.dot = lambda x, y: saved["dot"](_tf32(x), _tf32(y))
            with precision.use_split("plain"):
                yield
        elif name == "tf32-now":
            precision._raw_matmul = _tf32_kernel
            with precision.use_split("split"):
                yield
        else:
            with precision.use_split("plain"):
                yield
    finally:
        for k, v in saved.items():
            setattr(precision, k, v)


def sinc(epochs, seed):
    import keras
    import lm_sinc

    keras.utils.set_random_seed(seed)
    weights = lm_sinc.build_keras3_model().get_weights()
    out = {}
    for name in VARIANTS:
        with variant(name):
            model = lm_sinc.build_keras3_model(weights)
            model.compile(optimizer=tf_gradkit.keras3.LevenbergMarquardt(model),
                          loss="mse", jit_compile=True)
            began = time.perf_counter()
            model.fit(lm_sinc.make_dataset(seed), epochs=epochs, verbose=0)
            out[name] = (lm_sinc.full_mse(model), time.perf_counter() - began)
    return out


def nist():
    from nist_problems import PROBLEMS, lre

    rows = []
    for problem in PROBLEMS.values():
        row = [problem.name]
        for name in VARIANTS:
            with variant(name):
                variables = [tf.Variable(v, dtype=tf.float32)
                             for v in problem.starts[1]]
                x = tf.constant(problem.x, tf.float32)
                y = tf.constant(problem.y, tf.float32)
                tf_gradkit.least_squares(
                    lambda: problem.model(variables, x) - y, variables,
                    max_iterations=1000)
            estimate = np.array([float(v.numpy()) for v in variables])
            row.append(float(np.min(lre(estimate, problem.certified))))
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--skip-nist", action="store_true")
    args = parser.parse_args()
    print(f"TF {tf.__version__}, emulated TF32 on a CPU, load {os.getloadavg()[0]:.1f}\n")
    print(f"## Sinc fit, {args.epochs} epochs, final MSE (all 20000 points)\n")
    print("| seed | " + " | ".join(VARIANTS) + " | before / float32 | now / float32 |")
    print("|---|" + "---:|" * (len(VARIANTS) + 2))
    for seed in range(args.seeds):
        res = sinc(args.epochs, seed)
        mse = [res[v][0] for v in VARIANTS]
        print(f"| {seed} | " + " | ".join(f"{m:.3g}" for m in mse)
              + f" | {mse[1] / mse[0]:.2f} | {mse[2] / mse[0]:.2f} |", flush=True)
    if args.skip_nist:
        return
    print("\n## NIST StRD in float32 from start 2: min LRE of the certified parameters\n")
    print("| problem | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---:|" * len(VARIANTS))
    rows = nist()
    for row in rows:
        print(f"| {row[0]} | " + " | ".join(f"{v:.1f}" for v in row[1:]) + " |")
    for i, name in enumerate(VARIANTS, start=1):
        values = [row[i] for row in rows]
        print(f"\n{name}: median LRE {statistics.median(values):.1f}, "
              f"LRE >= 4 on {sum(v >= 4 for v in values)}/{len(values)}")


if __name__ == "__main__":
    main()
