"""Mini-batch Levenberg-Marquardt: the guard against its collapse, measured.

Problem: scikit-learn's diabetes regression (442 examples, 10 features,
standardised), a 10-20(tanh)-1 MLP (241 parameters), MSE, 100 epochs of
shuffled batches, Keras 3 ``fit`` with ``jit_compile=True``. Contenders from
the same initial weights (``keras.utils.set_random_seed``) per seed:

  - ``lm``: ``LevenbergMarquardt(model)`` (the mini-batch guard on, default);
  - ``lm-noguard``: ``LevenbergMarquardt(model, minibatch_guard=False)``;
  - ``adam``: ``Adam(0.01)``, same batches and epochs (the baseline a
    mini-batch user would otherwise pick).

For each batch size (442 = full batch, 256, 128, 64) it prints the final
training MSE on all 442 examples (one forward pass, after training), the
final damping, and seconds per epoch (median over epochs 2..), per seed and
as medians, plus the ratios of ``lm`` to the others.

Run: ``.venv/bin/python benchmarks/lm_minibatch.py`` (about 5 minutes on 2
cores; ``--seeds 1`` for a quick look). Needs scikit-learn (``.[bench]``).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_diabetes

import tf_gradkit
import timing

K = tf.keras


def data():
    x, y = load_diabetes(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype("float32")
    y = ((y - y.mean()) / y.std()).astype("float32")[:, None]
    return x, y


EpochTimer = timing.epoch_timer_class(K.callbacks.Callback)


def run(kind, batch, epochs, seed, x, y):
    K.utils.set_random_seed(seed)
    model = K.Sequential([K.Input((10,)), K.layers.Dense(20, activation="tanh"),
                          K.layers.Dense(1)])
    if kind == "adam":
        optimizer = K.optimizers.Adam(0.01)
    else:
        optimizer = tf_gradkit.optimizers.LevenbergMarquardt(
            model, minibatch_guard=kind == "lm")
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    timer = EpochTimer()
    history = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0,
                        shuffle=True, callbacks=[timer])
    mse = float(np.mean((model.predict(x, verbose=0, batch_size=442) - y) ** 2))
    damping = history.history.get("damping", [float("nan")])[-1]
    return mse, damping, float(np.median(timer.times[1:]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batches", default="442,256,128,64")
    args = parser.parse_args()
    x, y = data()
    kinds = ("lm", "lm-noguard", "adam")
    print(f"diabetes, 10-20-1 MLP, {args.epochs} epochs, seeds 0..{args.seeds - 1}; "
          "final training MSE (damping) [s/epoch]")
    summary = []
    for batch in (int(b) for b in args.batches.split(",")):
        results = {k: [run(k, batch, args.epochs, s, x, y) for s in range(args.seeds)]
                   for k in kinds}
        for k in kinds:
            cells = "  ".join(f"{m:.3f} ({d:.1e}) [{t * 1e3:.1f} ms]"
                              for m, d, t in results[k])
            print(f"batch {batch:3d} {k:10s} {cells}")
        med = {k: (np.median([r[0] for r in results[k]]),
                   np.median([r[2] for r in results[k]])) for k in kinds}
        summary.append((batch, med))
    print("\nmedians over seeds: training MSE, and lm's epoch time / adam's")
    print("| batch | lm | lm, no guard | adam | lm time / adam time |")
    print("|---:|---:|---:|---:|---:|")
    for batch, med in summary:
        print(f"| {batch} | {med['lm'][0]:.3f} | {med['lm-noguard'][0]:.3f} | "
              f"{med['adam'][0]:.3f} | {med['lm'][1] / med['adam'][1]:.2f}x |")


if __name__ == "__main__":
    main()
