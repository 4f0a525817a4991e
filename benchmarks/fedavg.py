"""Federated averaging weighted by example counts against the plain mean.

Five clients hold 10, 20, 40, 80 and 850 examples of a linear regression
whose inputs and offsets differ per client (non-IID). Every round each client
takes one full-batch gradient step from the server's weights (FedSGD) and
returns its delta; the server moves by

  weighted   `weighted_average(deltas, counts)` (FedAvg), or the same through
             `GradientAccumulator(SGD(1.0), steps=5)` fed ``-delta_k`` with
             ``sample_count=n_k`` (checked equal each round);
  unweighted the plain mean of the deltas (each client counts once).

The weighted mean of the deltas is a gradient step on all 1,000 examples at
once, so it converges to the pooled least-squares optimum; the plain mean
descends another loss (each client's mean loss, averaged) and stops at its
minimum. Prints the loss on all the data after 500 rounds and the gap to the
pooled optimum; plots both losses per round to
docs/weighted_aggregation.png (with matplotlib). Under a minute.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import tf_gradkit
from tf_gradkit.gradients import weighted_average
import plotting

SIZES = (10, 20, 40, 80, 850)
ROUNDS = 500


def clients():
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(4, 1))
    out = []
    for k, n in enumerate(SIZES):
        x = rng.normal(loc=k - 2.0, size=(n, 4))
        bias = 0.5 * k  # each client's data has its own offset: the optimum depends on counts
        y = x @ w_true + bias + 0.1 * rng.normal(size=(n, 1))
        out.append((x.astype("float32"), y.astype("float32")))
    return out


def loss(w, b, data):
    x = np.concatenate([d[0] for d in data])
    y = np.concatenate([d[1] for d in data])
    return float(np.mean(np.square(x @ w + b - y)))


def local_delta(w0, b0, x, y, lr=0.05):
    """One full-batch gradient step on the client's data (FedSGD): the
    example-weighted mean of these deltas is exactly a step on the pooled
    data."""
    w, b = tf.Variable(w0), tf.Variable(b0)
    with tf.GradientTape() as tape:
        value = tf.reduce_mean(tf.square(x @ w + b - y))
    gw, gb = tape.gradient(value, [w, b])
    return [-lr * gw, -lr * gb]


def main():
    data = clients()
    x_all = np.concatenate([d[0] for d in data])
    y_all = np.concatenate([d[1] for d in data])
    design = np.hstack([x_all, np.ones((len(x_all), 1), "float32")]).astype("float64")
    coef = np.linalg.lstsq(design, y_all.astype("float64"), rcond=None)[0]
    optimum = loss(coef[:4], coef[4:], data)
    histories = {}
    for mode in ("weighted", "unweighted"):
        w = tf.Variable(tf.zeros([4, 1]))
        b = tf.Variable(tf.zeros([1]))
        server = tf_gradkit.optimizers.GradientAccumulator(tf.keras.optimizers.SGD(1.0),
                                                           steps=len(SIZES))
        history = []
        for _ in range(ROUNDS):
            deltas = [local_delta(w.numpy(), b.numpy(), x, y) for x, y in data]
            if mode == "weighted":
                mean = weighted_average(deltas, list(SIZES))
                before = [w.numpy(), b.numpy()]
                for delta, n in zip(deltas, SIZES):
                    server.apply_gradients(zip([-d for d in delta], [w, b]), sample_count=n)
                moved = [w.numpy() - before[0], b.numpy() - before[1]]
                for m, got in zip(mean, moved):
                    assert np.allclose(m.numpy(), got, atol=1e-5), "window != weighted_average"
            else:
                mean = weighted_average(deltas, [1.0] * len(SIZES))
                w.assign_add(mean[0])
                b.assign_add(mean[1])
            history.append(loss(w.numpy(), b.numpy(), data))
        histories[mode] = history
    print(f"clients {SIZES}, {ROUNDS} rounds of one full-batch step; pooled least-squares "
          f"optimum: loss {optimum:.4f}")
    print("| server step | loss on all data | above the optimum |")
    print("|---|---:|---:|")
    for mode, history in histories.items():
        print(f"| {mode} | {history[-1]:.4f} | {history[-1] - optimum:.4f} |")
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, history in histories.items():
        ax.plot(range(1, ROUNDS + 1), history, label=mode)
    ax.axhline(optimum, color="grey", lw=0.8, ls="--", label="pooled optimum")
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("loss on all clients' data")
    ax.set_title("FedAvg: deltas weighted by example counts vs plain mean")
    ax.legend()
    plotting.save(fig, "weighted_aggregation.png")


if __name__ == "__main__":
    main()
