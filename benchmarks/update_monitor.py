"""UpdateMonitor: its step-time overhead, and a plot from a real run.

scikit-learn's bundled digits (1,797 8x8 images, no download), a 64-128-64-10
MLP, Adam(1e-3), batch 32, compiled (XLA). The same fit with and without the
monitor (every batch and every 10th), interleaved, epochs 2..6 timed, five
rounds: the median epoch (and the fastest, less sensitive to other load on
the machine); the ratio to the plain fit is the overhead. Times are the
process's CPU time by default (``UPDATE_MONITOR_WALL=1``: wall time). Then one run logs every batch
and its per-layer update/weight ratios and gradient norms are plotted to
docs/update_monitor.png.

Run: ``.venv/bin/python benchmarks/update_monitor.py`` (needs scikit-learn and
matplotlib: ``pip install -e ".[bench]"``; about a minute).
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tf_gradkit
import plotting
import timing

K = tf.keras
# The process's CPU time (all its threads) instead of wall time: on a
# machine shared with other jobs, wall time measures their load as much as
# ours. Set UPDATE_MONITOR_WALL=1 for wall time.
CPU_TIME = os.environ.get("UPDATE_MONITOR_WALL") != "1"


def data():
    digits = load_digits()
    return (digits.data / 16.0).astype("float32"), digits.target.astype("int32")


def model():
    K.utils.set_random_seed(0)
    m = K.Sequential([K.Input((64,)), K.layers.Dense(128, activation="relu", name="dense_1"),
                      K.layers.Dense(64, activation="relu", name="dense_2"),
                      K.layers.Dense(10, name="logits")])
    m.compile(optimizer=K.optimizers.Adam(1e-3), jit_compile=True,
              loss=K.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


EpochTimer = timing.epoch_timer_class(
    K.callbacks.Callback, clock=time.process_time if CPU_TIME else time.perf_counter)


def epoch_ms(x, y, monitor):
    timer = EpochTimer()
    callbacks = [timer] + ([monitor] if monitor is not None else [])
    model().fit(x, y, batch_size=32, epochs=6, verbose=0, callbacks=callbacks)
    return [1e3 * t for t in timer.times[1:]]


def main():
    x, y = data()
    rows = {"plain": [], "monitor every 10": [], "monitor every batch": []}
    for _ in range(5):
        rows["plain"] += epoch_ms(x, y, None)
        rows["monitor every 10"] += epoch_ms(
            x, y, tf_gradkit.callbacks.UpdateMonitor(every=10))
        rows["monitor every batch"] += epoch_ms(
            x, y, tf_gradkit.callbacks.UpdateMonitor(every=1))
    plain, fastest = float(np.median(rows["plain"])), float(np.min(rows["plain"]))
    print("digits MLP (64-128-64-10), batch 32, XLA, 57 batches per epoch, "
          + ("process CPU time" if CPU_TIME else "wall time"))
    print("| fit | median ms per epoch | x plain | fastest ms | x plain |")
    print("|---|---:|---:|---:|---:|")
    for name, values in rows.items():
        ms, low = float(np.median(values)), float(np.min(values))
        print(f"| {name} | {ms:.1f} | {ms / plain:.2f} | {low:.1f} | {low / fastest:.2f} |")

    monitor = tf_gradkit.callbacks.UpdateMonitor(every=1)
    model().fit(x, y, batch_size=32, epochs=5, verbose=0, callbacks=[monitor])
    plt = plotting.pyplot()
    if plt is None:
        return
    steps = [r["step"] for r in monitor.history]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for name in monitor.history[0]["layers"]:
        axes[0].plot(steps, [r["layers"][name]["update_ratio"] for r in monitor.history],
                     label=name, lw=0.8)
        axes[1].plot(steps, [r["layers"][name]["grad_norm"] for r in monitor.history],
                     label=name, lw=0.8)
    axes[0].set_yscale("log")
    axes[0].set_title("update / weight norm per layer")
    axes[1].set_yscale("log")
    axes[1].set_title("gradient norm per layer")
    for ax in axes:
        ax.set_xlabel("update")
        ax.legend(fontsize=8)
    fig.suptitle("UpdateMonitor on digits (Adam 1e-3, batch 32, 5 epochs)", fontsize=10)
    plotting.save(fig, "update_monitor.png")


if __name__ == "__main__":
    main()
