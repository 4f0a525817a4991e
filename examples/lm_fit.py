"""Train a Keras model with Levenberg-Marquardt through model.fit.

Run: .venv/bin/python examples/lm_fit.py   (about 20 s)

The optimizer takes over the model's train step (it needs residuals and their
Jacobian, not a gradient); fit, callbacks, validation and jit_compile work as
usual, and the progress bar shows the damping and the attempts per step.
"""

import numpy as np
import tensorflow as tf

import tf_gradkit

K = tf.keras  # Keras 3 by default; tf_keras with TF_USE_LEGACY_KERAS=1


def main():
    x = np.linspace(-1, 1, 4000, dtype="float32")[:, None]
    y = np.sinc(10 * x).astype("float32")
    order = np.random.RandomState(0).permutation(len(x))  # validation: a random 10%
    x, y = x[order], y[order]
    model = K.Sequential([K.Input((1,)), K.layers.Dense(20, activation="tanh"),
                          K.layers.Dense(1)])
    model.compile(optimizer=tf_gradkit.optimizers.LevenbergMarquardt(model),
                  loss="mse", metrics=["mae"], jit_compile=True)
    history = model.fit(x, y, batch_size=1000, epochs=40, validation_split=0.1,
                        verbose=0)
    h = history.history
    print(f"final loss {h['loss'][-1]:.2e}, val_loss {h['val_loss'][-1]:.2e}, "
          f"damping {h['damping'][-1]:.1e}, attempts {h['attempts'][-1]:.0f}")
    assert h["loss"][-1] < 1e-3 and h["val_loss"][-1] < 1e-3


if __name__ == "__main__":
    main()
