"""A physics-informed network trained by Levenberg-Marquardt: 1-D Poisson.

Run: .venv/bin/python examples/pinn_poisson.py   (about 20 seconds)

Solves u''(x) = -pi^2 sin(pi x) on [0, 1] with u(0) = u(1) = 0, whose
solution is u = sin(pi x), with a 1-16-16-1 tanh network (321 parameters).
The residuals are the PDE at 64 collocation points, u'' taken by automatic
differentiation of the network in its input, plus the two boundary values:
LM differentiates those residuals once more in the weights (its Jacobian).
Adam gets the same wall-clock time on the same residuals' mean square.
"""

import time

import numpy as np
import tensorflow as tf

import tf_gradkit

K = tf.keras
PI = np.pi
X = tf.constant(np.linspace(0.0, 1.0, 64)[:, None], tf.float32)
ENDS = tf.constant([[0.0], [1.0]])
TEST = np.linspace(0.0, 1.0, 201)[:, None].astype("float32")


def network(seed=0):
    K.utils.set_random_seed(seed)
    return K.Sequential([K.Input((1,)), K.layers.Dense(16, activation="tanh"),
                         K.layers.Dense(16, activation="tanh"), K.layers.Dense(1)])


def residuals(model):
    """The PDE residual at the collocation points (scaled by 1/8, the size
    of pi^2 sin) and the boundary values."""
    with tf.GradientTape() as outer:
        outer.watch(X)
        with tf.GradientTape() as inner:
            inner.watch(X)
            u = model(X)
        du = inner.gradient(u, X)
    d2u = outer.gradient(du, X)
    pde = (d2u + PI ** 2 * tf.sin(PI * X)) / 8.0
    return tf.concat([tf.reshape(pde, [-1]), tf.reshape(model(ENDS), [-1])], axis=0)


def max_error(model):
    return float(np.max(np.abs(model(TEST).numpy() - np.sin(PI * TEST))))


def main():
    model = network()
    start = time.perf_counter()
    result = tf_gradkit.least_squares(lambda: residuals(model),
                                      model.trainable_variables, max_iterations=100,
                                      solver="cholesky", controller="nielsen")
    lm_seconds = time.perf_counter() - start
    lm_error = max_error(model)
    print(f"LM:   {int(result.iterations)} iterations in {lm_seconds:.1f} s, "
          f"max |u - sin(pi x)| = {lm_error:.1e}")

    model = network()
    adam = K.optimizers.Adam(1e-3)

    @tf.function(jit_compile=True)
    def adam_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(residuals(model)))
        grads = tape.gradient(loss, model.trainable_variables)
        adam.apply_gradients(zip(grads, model.trainable_variables))

    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < lm_seconds:
        for _ in range(100):
            adam_step()
        steps += 100
    adam_error = max_error(model)
    print(f"Adam: {steps} steps in the same time, max |u - sin(pi x)| = "
          f"{adam_error:.1e}")
    assert lm_error < 1e-3 and lm_error < adam_error


if __name__ == "__main__":
    main()
