"""Watching what the optimizer really does, and precise batch-norm statistics.

A small CNN with BatchNormalization on a synthetic image task (bright
horizontal or vertical bars on noise, 4 classes), trained with a small batch
through a `GradientAccumulator` (windows of 4 micro-batches of 8):

1. `tf_gradkit.callbacks.UpdateMonitor` logs, per layer and per *real*
   update (one per window, not per micro-batch), the gradient the inner Adam
   was handed, the update it made and the update-to-weight ratio; the
   progress bar shows the largest ratio, ``monitor.history`` keeps them all.
2. `tf_gradkit.callbacks.PreciseBatchNorm` then replaces BatchNormalization's
   moving averages (noisy with micro-batches of 8) by the exact statistics of
   each layer's inputs over the training set
   (`tf_gradkit.gradients.recompute_batch_norm_statistics`).

No downloads; under a minute on 2 CPU cores. Runs in either Keras flavour
(``TF_USE_LEGACY_KERAS=1`` for tf_keras).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tf_gradkit

K = tf.keras


def make_data(n, seed):
    """12x12 images: class c has a bright bar in row/column position c."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, size=n)
    x = rng.normal(0.5, 0.6, size=(n, 12, 12, 1))
    for i, c in enumerate(y):
        if c < 2:
            x[i, 3 + 5 * c, :, 0] += 0.9
        else:
            x[i, :, 3 + 5 * (c - 2), 0] += 0.9
    return x.astype("float32"), y.astype("int32")


def make_model():
    K.utils.set_random_seed(0)
    return K.Sequential([
        K.Input((12, 12, 1)),
        K.layers.Conv2D(8, 3, use_bias=False, name="conv_1"),
        K.layers.BatchNormalization(name="bn_1"), K.layers.Activation("relu"),
        K.layers.Conv2D(16, 3, strides=2, use_bias=False, name="conv_2"),
        K.layers.BatchNormalization(name="bn_2"), K.layers.Activation("relu"),
        K.layers.GlobalAveragePooling2D(),
        K.layers.Dense(4, name="logits"),
    ])


def accuracy(model, x, y):
    return float(np.mean(np.argmax(model.predict(x, verbose=0), 1) == y))


def main():
    x, y = make_data(1024, seed=1)
    x_test, y_test = make_data(512, seed=2)
    model = make_model()
    model.compile(
        optimizer=tf_gradkit.optimizers.GradientAccumulator(
            K.optimizers.Adam(3e-3), steps=4, model=model),
        loss=K.losses.SparseCategoricalCrossentropy(from_logits=True))

    monitor = tf_gradkit.callbacks.UpdateMonitor(every=4)
    precise = tf_gradkit.callbacks.PreciseBatchNorm(
        tf.data.Dataset.from_tensor_slices(x).batch(256))

    class MovingAccuracy(K.callbacks.Callback):
        """Test accuracy with the moving averages, just before PreciseBatchNorm."""

        def on_train_end(self, logs=None):
            self.value = accuracy(self.model, x_test, y_test)

    moving = MovingAccuracy()
    model.fit(x, y, batch_size=8, epochs=3, verbose=2,
              callbacks=[monitor, moving, precise])

    print(f"\n{len(monitor.history)} monitored real updates "
          f"(3 epochs x 128 micro-batches / windows of 4 / every 4th)")
    print("layer     grad norm   update norm   update/weight")
    for name, v in monitor.history[-1]["layers"].items():
        print(f"{name:8s} {v['grad_norm']:10.4f} {v['update_norm']:13.5f} "
              f"{v['update_ratio']:15.2e}")
    assert len(monitor.history) == 3 * 128 // 4 // 4
    assert all(v["update_norm"] > 0 for r in monitor.history for v in r["layers"].values())

    after = accuracy(model, x_test, y_test)
    print(f"\nBatchNormalization statistics over {precise.counts} elements per feature")
    print(f"test accuracy: moving averages {moving.value:.4f}, precise {after:.4f}")
    assert after > 0.8, after


if __name__ == "__main__":
    main()
