"""GradientAccumulator in a custom GradientTape loop, with uneven micro-batches.

Run: .venv/bin/python examples/accumulate_custom_loop.py   (a few seconds)

A compiled (XLA) train step passes `sample_count` so that a short micro-batch
counts for the examples it holds; `flush()` applies the partial window at the
end of the data. Also shows a NaN micro-batch being skipped safely.
"""

import numpy as np
import tensorflow as tf

import tf_gradkit

K = tf.keras


def main():
    rng = np.random.RandomState(0)
    x = rng.randn(90, 4).astype("float32")
    y = (x @ rng.randn(4, 1)).astype("float32")
    model = K.Sequential([K.Input((4,)), K.layers.Dense(1)])
    opt = tf_gradkit.optimizers.GradientAccumulator(K.optimizers.SGD(0.1), steps=4)

    @tf.function(jit_compile=True)
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables),
                            sample_count=tf.shape(xb)[0])
        return loss

    for epoch in range(20):
        for start in range(0, 90, 16):  # 16, 16, ..., and a last one of 10
            train_step(x[start:start + 16], y[start:start + 16])
        opt.flush()  # the data ended mid-window: apply what it holds
    mse = float(np.mean((model(x).numpy() - y) ** 2))
    print(f"updates: {int(opt.iterations.numpy())}, micro-batches: "
          f"{int(opt.micro_steps.numpy())}, final mse: {mse:.2e}")

    bad = y[:16].copy()
    bad[3] = np.nan
    before = [w.numpy() for w in model.weights]
    for xb, yb in [(x[:16], bad), (x[16:32], y[16:32]), (x[32:48], y[32:48]),
                   (x[48:64], y[48:64])]:
        train_step(xb, yb)
    unchanged = all(np.array_equal(a, b.numpy()) for a, b in zip(before, model.weights))
    print(f"window with a NaN skipped: {int(opt.skipped_windows.numpy())}, "
          f"weights unchanged: {unchanged}")
    assert mse < 1e-3 and unchanged


if __name__ == "__main__":
    main()
