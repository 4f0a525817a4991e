"""LM on an MNIST-style classifier of torch-levenberg-marquardt's size, next to
its published figure and to Adam in the same run.

torch-levenberg-marquardt 1.2 publishes MNIST with a 1,026-parameter network:
97.59% test accuracy in 22.1 s (their hardware). MNIST cannot be downloaded
here, so this uses scikit-learn's bundled digits (8x8 images, 1,347 train /
450 test): a 64-14-10 MLP, 1,060 parameters, the closest size. It is an
easier dataset than MNIST, so only the sizes and the time budget match: the
accuracies are not comparable across datasets.

``LevenbergMarquardt`` on the sparse categorical cross-entropy (generalised
Gauss-Newton) with full batches, and ``Adam(1e-2)`` with batch 64, each for
the same wall-clock budget; test accuracy and time, median of 3 seeds.

Run: ``.venv/bin/python benchmarks/lm_digits.py`` (needs scikit-learn; about
2 minutes).
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tf_gradkit

K = tf.keras
PUBLISHED = "torch-LM 1.2 (published, MNIST, 1,026 parameters): 97.59% in 22.1 s"


def data():
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1347], y[:1347]), (x[1347:], y[1347:])


class Budget(K.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.elapsed = time.perf_counter() - self.start
        self.epochs = epoch + 1
        if self.elapsed >= self.seconds:
            self.model.stop_training = True


def run(name, seed, seconds, train, test):
    K.utils.set_random_seed(seed)
    model = K.Sequential([K.Input((64,)), K.layers.Dense(14, activation="tanh"),
                          K.layers.Dense(10)])
    assert model.count_params() == 1060
    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "lm":
        optimizer, batch = tf_gradkit.optimizers.LevenbergMarquardt(model), len(train[0])
    else:
        optimizer, batch = K.optimizers.Adam(1e-2), 64
    model.compile(optimizer=optimizer, loss=loss, jit_compile=True)
    budget = Budget(seconds)
    model.fit(*train, batch_size=batch, epochs=100000, verbose=0, callbacks=[budget])
    accuracy = float(np.mean(np.argmax(model.predict(test[0], verbose=0), 1) == test[1]))
    return accuracy, budget.elapsed, budget.epochs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    train, test = data()
    print(f"digits 64-14-10 MLP (1,060 parameters), {args.seconds:.0f} s each, "
          f"{os.cpu_count()} CPUs\n{PUBLISHED}")
    for name in ("lm", "adam"):
        results = [run(name, seed, args.seconds, train, test) for seed in range(args.seeds)]
        acc = [r[0] for r in results]
        print(f"{name}: test accuracy median {100 * np.median(acc):.2f}% "
              f"(seeds {', '.join(f'{100 * a:.2f}' for a in acc)}), "
              f"{np.median([r[1] for r in results]):.1f} s, "
              f"{int(np.median([r[2] for r in results]))} epochs", flush=True)


if __name__ == "__main__":
    main()
