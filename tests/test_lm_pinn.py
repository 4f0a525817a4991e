"""Residuals that contain derivatives of the network in its inputs (a
physics-informed network): LM's Jacobian differentiates them once more in
the weights. 1-D Poisson, u'' = -pi^2 sin(pi x), u(0) = u(1) = 0, whose
solution is sin(pi x); both flavours, `least_squares` and `minimize`."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit

PI = np.pi
X = tf.constant(np.linspace(0.0, 1.0, 64)[:, None], tf.float32)
ENDS = tf.constant([[0.0], [1.0]])
TEST = np.linspace(0.0, 1.0, 201)[:, None].astype("float32")


def _network(K):
    K.utils.set_random_seed(0)
    return K.Sequential([K.Input((1,)), K.layers.Dense(16, activation="tanh"),
                         K.layers.Dense(16, activation="tanh"), K.layers.Dense(1)])


def _pde_residuals(model, x, y, sample_weight):
    """The PDE at the points ``x`` (scaled by 1/8, the size of pi^2 sin),
    then the boundary values; a residual model for fit as well (``y`` and
    ``sample_weight`` unused)."""
    del y, sample_weight
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            u = model(x)
        du = inner.gradient(u, x)
    d2u = outer.gradient(du, x)
    pde = (d2u + PI ** 2 * tf.sin(PI * x)) / 8.0
    return tf.concat([tf.reshape(pde, [-1]), tf.reshape(model(ENDS), [-1])], axis=0)


def _residuals(model):
    return _pde_residuals(model, X, None, None)


def _max_error(model):
    return float(np.max(np.abs(model(TEST).numpy() - np.sin(PI * TEST))))


def test_pinn_with_least_squares(K):
    """100 iterations reach 1.8e-6 (seed 0, both flavours); the network's
    float32 evaluation and the discretisation leave room: 1e-4."""
    model = _network(K)
    assert _max_error(model) > 0.1
    tf_gradkit.least_squares(lambda: _residuals(model), model.trainable_variables,
                             max_iterations=100, solver="cholesky",
                             controller="nielsen")
    assert _max_error(model) < 1e-4


# "dual" (66 residuals, 321 parameters: the small system) runs by default;
# "cholesky" on the same PINN Jacobian is test_pinn_with_least_squares's.
@pytest.mark.parametrize("solver", [pytest.param("cholesky", marks=pytest.mark.slow),
                                    "dual"])
def test_pinn_with_minimize_in_a_compiled_loop(K, gk, solver):
    model = _network(K)
    opt = gk.LevenbergMarquardt(solver=solver)

    @tf.function(jit_compile=True)
    def step():
        return opt.minimize(lambda: _residuals(model), model.trainable_variables)

    for _ in range(100):
        step()
    assert _max_error(model) < 1e-4


def test_pinn_through_fit_with_a_residual_model(K, gk):
    model = _network(K)
    model.compile(optimizer=gk.LevenbergMarquardt(model, residuals=_pde_residuals),
                  loss="mse", jit_compile=True)
    # 100 steps on the same 64 points, as one epoch of the points repeated
    # (not 100 epochs: the same steps without fit's per-epoch overhead).
    x = np.tile(X.numpy(), (100, 1))
    model.fit(x, np.zeros_like(x), batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 100
    assert _max_error(model) < 1e-4
