"""Levenberg-Marquardt past the size where J^T J fits: parameter subsets and
the matrix-free step, measured against full LM and Adam.

Problem: y = sin(3 x1) cos(2 x2) + x3 x4 / 2 on 2000 points in 4-D (x
uniform in [-1, 1]^4; variance 0.14), MSE, full batch, Keras 3 ``fit``
with ``jit_compile=True``, one seed.

Part 1, a 4-64-64-1 tanh MLP (4,545 parameters; J^T J has 20.7M entries):
  - ``lm-full``: ``LevenbergMarquardt(model)``, the defaults: the Jacobian
    from layer taps, and ``solver="auto"``, which here (2000 residuals,
    4,545 parameters) solves the 2000^2 dual system ``J D^-2 J^T``;
  - ``lm-full-cholesky``: the same with ``solver="cholesky"`` (the
    4,545^2 normal equations: the same step);
  - ``lm-full-cholesky-autodiff``: Cholesky with ``linearization="autodiff"``
    (the Jacobian by forward mode, one product per parameter): the defaults
    before the taps and the dual;
  - ``lm-full-autodiff``: the dual with the forward-mode Jacobian;
  - ``lm-subset-0.1``: ``subset=0.1`` (455 random parameters per step);
  - ``lm-layers``: ``subset="layers"`` (one layer per step; the system is
    padded to the largest layer's 4,160, so it saves little here);
  - ``adam``: ``Adam(0.01)``.
Part 2, a 4-400-250-1 tanh MLP (102,651 parameters; J^T J would take 42 GB
in float32):
  - ``lm-cg``: ``LevenbergMarquardt(model, solver="cg", scaling="levenberg")``
    (conjugate gradients; ``J^T (J v)`` from layer taps: contractions of the
    stored layer inputs and output gradients, memory O(N * width + P));
  - ``lm-cg-autodiff``: the same with ``linearization="autodiff"`` (one
    forward-mode and one reverse-mode pass through the model per product);
  - ``lm-subset-0.01``: ``subset=0.01`` (1,027 parameters per step);
  - ``adam``.

Each contender trains for the same wall-clock budget (``--seconds``, after
a first epoch that includes compilation) and reports ms per step (median)
and the final training MSE. Ratios are to Adam in the same run.

``--steps N`` trains each for N steps instead (the same steps: a tapped and
an autodiff contender then end at the same result, up to round-off);
``--only a,b`` runs those contenders alone.

Run: ``.venv/bin/python benchmarks/lm_scale.py`` (about 6 minutes).
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tf_gradkit

K = tf.keras


def data():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (2000, 4)).astype("float32")
    y = (np.sin(3 * x[:, :1]) * np.cos(2 * x[:, 1:2])
         + 0.5 * x[:, 2:3] * x[:, 3:4]).astype("float32")
    return x, y


def network(widths):
    K.utils.set_random_seed(0)
    layers = [K.Input((4,))] + [K.layers.Dense(w, activation="tanh") for w in widths]
    return K.Sequential(layers + [K.layers.Dense(1)])


def run(name, widths, seconds, x, y, steps=None):
    model = network(widths)
    if name == "adam":
        optimizer = K.optimizers.Adam(0.01)
    elif name.startswith("lm-cg"):
        optimizer = tf_gradkit.optimizers.LevenbergMarquardt(
            model, solver="cg", scaling="levenberg",
            linearization="autodiff" if name.endswith("autodiff") else "auto")
    elif name.startswith("lm-subset-"):
        optimizer = tf_gradkit.optimizers.LevenbergMarquardt(
            model, subset=float(name.rsplit("-", 1)[1]))
    elif name == "lm-layers":
        optimizer = tf_gradkit.optimizers.LevenbergMarquardt(model, subset="layers")
    else:  # lm-full[-cholesky][-autodiff]
        optimizer = tf_gradkit.optimizers.LevenbergMarquardt(
            model, linearization="autodiff" if name.endswith("autodiff") else "auto",
            solver="cholesky" if "-cholesky" in name else "auto")
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # compile
    times, start = [], time.perf_counter()
    while (len(times) < steps if steps else
           time.perf_counter() - start < seconds):
        t0 = time.perf_counter()
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
        times.append(time.perf_counter() - t0)
    mse = float(np.mean((model.predict(x, verbose=0, batch_size=len(x)) - y) ** 2))
    params = sum(int(np.prod(w.shape)) for w in model.trainable_variables)
    return params, float(np.median(times)) * 1e3, len(times), mse


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", default=None)
    args = parser.parse_args()
    x, y = data()
    parts = [((64, 64), ("lm-full", "lm-full-cholesky", "lm-full-cholesky-autodiff",
                         "lm-full-autodiff", "lm-subset-0.1", "lm-layers", "adam")),
             ((400, 250), ("lm-cg", "lm-cg-autodiff", "lm-subset-0.01", "adam"))]
    if args.only:
        keep = args.only.split(",")
        parts = [(w, tuple(n for n in names if n in keep)) for w, names in parts]
    print(f"sin(3 x1) cos(2 x2) + x3 x4 / 2, 2000 points, full batch, "
          f"{args.seconds:.0f} s each")
    print("| model | contender | parameters | ms/step | steps | final MSE | ms/step vs adam |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for widths, names in parts:
        rows = {n: run(n, widths, args.seconds, x, y, args.steps) for n in names}
        for n in names:
            params, ms, steps, mse = rows[n]
            print(f"| 4-{'-'.join(map(str, widths))}-1 | {n} | {params} | {ms:.1f} | "
                  f"{steps} | {mse:.2e} | "
                  f"{ms / rows['adam'][1] if 'adam' in rows else float('nan'):.1f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
