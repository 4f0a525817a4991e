"""Train with 4x the batch your memory holds: GradientAccumulator under model.fit.

Run: .venv/bin/python examples/accumulate_fit.py   (about 20 s on 2 CPU cores)

Micro-batches of 16 accumulate into windows of 4 (64 examples); Adam steps once
per window. The data (1000 examples) does not divide into windows: the last
window of each epoch holds 40 examples and is applied at the epoch end with the
weight of what it holds, as a batch of 40 would be. The result is compared with
plain Adam on real batches of 64 (same examples, same order).
"""

import os

import numpy as np
import tensorflow as tf

import tf_gradkit

K = tf.keras  # Keras 3 by default; tf_keras with TF_USE_LEGACY_KERAS=1


def make_model(seed=0):
    model = K.Sequential([K.Input((8,)), K.layers.Dense(32, activation="relu"),
                          K.layers.Dense(1)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.3
                       for w in model.get_weights()])
    return model


def main():
    rng = np.random.RandomState(1)
    x = rng.randn(1000, 8).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] ** 2).astype("float32")

    model = make_model()
    optimizer = tf_gradkit.optimizers.GradientAccumulator(
        K.optimizers.Adam(1e-2), steps=4, model=model)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    history = model.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0)

    reference = make_model()
    reference.compile(optimizer=K.optimizers.Adam(1e-2), loss="mse")
    reference.fit(x, y, batch_size=64, epochs=5, shuffle=False, verbose=0)

    diff = max(float(np.max(np.abs(a - b))) for a, b in
               zip(model.get_weights(), reference.get_weights()))
    print(f"flavour: {'tf_keras' if os.environ.get('TF_USE_LEGACY_KERAS') == '1' else 'Keras 3'}")
    print(f"loss per epoch: {[round(v, 4) for v in history.history['loss']]}")
    print(f"micro-batches: {int(optimizer.micro_steps.numpy())}, "
          f"Adam updates (iterations): {int(optimizer.iterations.numpy())}")
    print(f"max |w_accumulated - w_batch64| = {diff:.2e}")
    assert int(optimizer.iterations.numpy()) == 5 * 16  # 15 full windows + 1 partial
    assert diff < 1e-4, "accumulation should match the large batch"


if __name__ == "__main__":
    main()
