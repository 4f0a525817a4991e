"""One ``fit`` epoch of Levenberg-Marquardt against one of Adam, same batches.

The peer's sinc problem (20000 points, ``y = sinc(10 x)``, a 1-20(tanh)-1
MLP, 61 parameters, batches of 1000, shuffled): 20 steps per epoch. Both
compiled with ``jit_compile=True``, in this process's Keras flavour. For
each contender it reports the median epoch time over epochs 2.. (the first
includes compilation) and the final MSE, and the ratio of each LM variant's
epoch to Adam's:

  - ``lm``: ``LevenbergMarquardt(model)`` (the mini-batch guard on, default);
  - ``lm-noguard``: ``minibatch_guard=False``;
  - ``adam``: ``Adam(0.01)``.

``--steps-per-execution N`` runs N steps per call for every contender (less
of Keras's per-step work, which is most of a step here).

Run: ``.venv/bin/python benchmarks/lm_epoch.py`` (about a minute);
``TF_USE_LEGACY_KERAS=1`` for tf_keras.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_gradkit  # noqa: E402

K = tf.keras


class EpochTimer(K.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def run(name, epochs, steps_per_execution, x, y):
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((1,)), K.layers.Dense(20, activation="tanh"),
                          K.layers.Dense(1)])
    if name == "adam":
        optimizer = K.optimizers.Adam(0.01)
    else:
        optimizer = tf_gradkit.optimizers.LevenbergMarquardt(
            model, minibatch_guard=name == "lm")
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True,
                  steps_per_execution=steps_per_execution)
    timer = EpochTimer()
    model.fit(x, y, batch_size=1000, epochs=epochs, verbose=0, shuffle=True,
              callbacks=[timer])
    mse = float(np.mean((model.predict(x, verbose=0, batch_size=20000) - y) ** 2))
    return float(np.median(timer.times[1:])) * 1e3, mse


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=21)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    x = np.linspace(-1, 1, 20000, dtype="float32")[:, None]
    y = np.sinc(10 * x).astype("float32")
    names = ("lm", "lm-noguard", "adam")
    flavour = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "Keras 3"
    print(f"{flavour}, sinc 1-20-1, batch 1000, {args.epochs} epochs, "
          f"steps_per_execution={args.steps_per_execution}")
    for repeat in range(args.repeats):
        rows = {n: run(n, args.epochs, args.steps_per_execution, x, y) for n in names}
        for n in names:
            ms, mse = rows[n]
            print(f"repeat {repeat}: {n:10s} {ms:7.1f} ms/epoch  final MSE {mse:.2e}  "
                  f"epoch / adam's {ms / rows['adam'][0]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
