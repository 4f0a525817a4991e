"""Precise batch-norm statistics: test accuracy with BatchNormalization's moving
averages against the statistics recomputed exactly after training.

scikit-learn's bundled digits as 8x8x1 images (1,347 train / 450 test), a
small CNN with three BatchNormalization layers, trained with batch 4 (where
the moving averages come from tiny, noisy batches) and momentum 0.99, for 3
epochs. Then `recompute_batch_norm_statistics` over the training set
(batches of 256). Three seeds; the median and each seed are printed.

Also for training batches 16 and 64 (medians), plotted to docs/precise_bn.png.

Run: ``.venv/bin/python benchmarks/precise_bn.py`` (needs scikit-learn and
matplotlib: ``pip install -e ".[bench]"``; about two minutes).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

from tf_gradkit.gradients import recompute_batch_norm_statistics
import plotting

K = tf.keras


def data():
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1347], y[:1347]), (x[1347:], y[1347:])


def cnn(seed):
    K.utils.set_random_seed(seed)
    return K.Sequential([
        K.Input((8, 8, 1)),
        K.layers.Conv2D(16, 3, padding="same", use_bias=False),
        K.layers.BatchNormalization(momentum=0.99), K.layers.Activation("relu"),
        K.layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False),
        K.layers.BatchNormalization(momentum=0.99), K.layers.Activation("relu"),
        K.layers.Flatten(), K.layers.Dense(64, use_bias=False),
        K.layers.BatchNormalization(momentum=0.99), K.layers.Activation("relu"),
        K.layers.Dense(10),
    ])


def accuracy(model, x, y):
    return float(np.mean(np.argmax(model.predict(x, verbose=0), 1) == y))


def run(batch, seed, train, test):
    (x, y), (x_test, y_test) = train, test
    model = cnn(seed)
    model.compile(optimizer=K.optimizers.Adam(1e-3), jit_compile=True,
                  loss=K.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, epochs=3, verbose=0)
    moving = accuracy(model, x_test, y_test)
    recompute_batch_norm_statistics(model, tf.data.Dataset.from_tensor_slices(x).batch(256))
    return moving, accuracy(model, x_test, y_test)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="4,16,64",
                        help="training batch sizes; the first is reported per seed")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    train, test = data()
    medians = []
    for k, batch in enumerate(int(b) for b in args.batches.split(",")):
        rows = []
        for seed in range(3):
            moving, precise = run(batch, seed, train, test)
            rows.append((moving, precise))
            if k == 0:
                print(f"batch {batch}, seed {seed}: test accuracy moving averages "
                      f"{moving:.4f}, precise statistics {precise:.4f}", flush=True)
        moving, precise = np.median(np.array(rows), 0)
        medians.append((batch, moving, precise))
        print(f"batch {batch}: median moving averages {moving:.4f}, precise {precise:.4f}, "
              f"change {100 * (precise - moving):+.2f} points", flush=True)
    if args.no_plot:
        return
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    batches = [m[0] for m in medians]
    ax.plot(batches, [100 * m[1] for m in medians], "o--", label="moving averages")
    ax.plot(batches, [100 * m[2] for m in medians], "s-", label="precise statistics")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training batch size")
    ax.set_ylabel("test accuracy, % (median of 3)")
    ax.set_title("BatchNormalization statistics on digits (CNN, 3 epochs)")
    ax.legend()
    plotting.save(fig, "precise_bn.png")


if __name__ == "__main__":
    main()
