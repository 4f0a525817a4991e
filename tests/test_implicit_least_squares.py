"""Gradients through `solve_least_squares` (implicit function theorem)
against a closed form and central finite differences."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit

pytestmark = pytest.mark.keras_free

RNG = np.random.default_rng(1)
T = tf.constant(np.linspace(0.0, 5.0, 20))
Y0 = 3.0 * np.exp(-0.4 * T.numpy()) + 0.5 + RNG.normal(0.0, 0.05, 20)
START = np.array([1.0, 0.1, 1.0])
WEIGHTS = tf.constant([0.3, -1.0, 2.0], tf.float64)


def decay(p, y):
    return p[0] * tf.exp(-p[1] * T) + p[2] - y


def _objective(y, **options):
    """L(y) = w . x*(y) and its gradient in y (solved without XLA: the
    same graph, and faster to build for the many small solves here)."""
    options.setdefault("jit_compile", False)
    y = tf.constant(y)
    with tf.GradientTape() as tape:
        tape.watch(y)
        x, result = tf_gradkit.solve_least_squares(decay, START, args=(y,), **options)
        value = tf.reduce_sum(WEIGHTS * x)
    assert bool(result.converged), result.reason
    return float(value), tape.gradient(value, y).numpy(), x.numpy(), result


def _numeric(f, h=1e-3):
    """Five-point central difference of f at 0: truncation ~h^4 (1e-12), and
    the solves' own error (~1e-8 in L where a cost tolerance stops them)
    over h stays near 1e-5 of the derivative."""
    return (-f(2 * h) + 8 * f(h) - 8 * f(-h) + f(-2 * h)) / (12 * h)


def test_linear_model_gradient_is_the_pseudo_inverse():
    """r = A x - y: x* = (A^T A)^-1 A^T y, so dx*/dy is that matrix exactly."""
    a = tf.constant(RNG.normal(size=(12, 4)))
    y = tf.constant(RNG.normal(size=12))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(y)
        x, _ = tf_gradkit.solve_least_squares(lambda p, y: tf.linalg.matvec(a, p) - y,
                                              np.zeros(4), args=(y,))
        rows = [x[i] for i in range(4)]
    jacobian = np.stack([tape.gradient(r, y).numpy() for r in rows])
    np.testing.assert_allclose(jacobian, np.linalg.pinv(a.numpy()), atol=1e-12)


@pytest.mark.parametrize("options", [
    {}, {"loss": "soft_l1", "f_scale": 0.05},
    pytest.param({"loss": "cauchy", "f_scale": 0.1}, marks=pytest.mark.slow),
], ids=["linear", "soft_l1", "cauchy"])
def test_gradient_matches_finite_differences(options):
    """The directional derivative along a random direction."""
    _, grad, _, _ = _objective(Y0, **options)
    v = RNG.normal(size=Y0.size)
    numeric = _numeric(lambda h: _objective(Y0 + h * v, **options)[0])
    np.testing.assert_allclose(grad @ v, numeric, rtol=1e-4)


def test_a_parameter_held_on_a_bound_does_not_move():
    bounds = ([0.0, 0.0, 0.7], [10.0, 10.0, 10.0])
    _, grad, x, result = _objective(Y0, bounds=bounds)
    assert list(result.active_mask.numpy()) == [0, 0, -1] and x[2] == 0.7
    v = RNG.normal(size=Y0.size)
    numeric = _numeric(lambda h: _objective(Y0 + h * v, bounds=bounds)[0])
    np.testing.assert_allclose(grad @ v, numeric, rtol=1e-4)
    y = tf.constant(Y0)
    with tf.GradientTape() as tape:
        tape.watch(y)
        x, _ = tf_gradkit.solve_least_squares(decay, START, args=(y,), bounds=bounds)
        held = x[2]
    np.testing.assert_array_equal(tape.gradient(held, y).numpy(), 0.0)


def test_gradient_to_a_hyperparameter_inside_a_tf_function():
    """A ridge weight as the differentiated input, the solve in a graph."""
    prior = tf.constant([2.0, 0.3, 0.0], tf.float64)
    y = tf.constant(Y0)

    def ridge(p, y, lam):
        return tf.concat([decay(p, y), tf.sqrt(lam) * (p - prior)], axis=0)

    @tf.function
    def objective(lam):
        with tf.GradientTape() as tape:
            tape.watch(lam)
            x, _ = tf_gradkit.solve_least_squares(ridge, START, args=(y, lam))
            value = tf.reduce_sum(WEIGHTS * x)
        return value, tape.gradient(value, lam)

    lam = tf.constant(0.5, tf.float64)
    value, grad = objective(lam)
    numeric = _numeric(lambda h: float(objective(lam + h)[0]))
    np.testing.assert_allclose(float(grad), numeric, rtol=1e-4)


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="`args` must be a tuple"):
        tf_gradkit.solve_least_squares(decay, START, args=tf.constant(Y0))
    with pytest.raises(TypeError, match="`residual_fn` must be callable"):
        tf_gradkit.solve_least_squares(None, START)
    with pytest.raises(ValueError, match="`loss` must be one of"):
        tf_gradkit.solve_least_squares(decay, START, args=(Y0,), loss="l2")


def test_repeated_eager_solves_reuse_the_compiled_solve_and_stay_exact():
    """Eager calls with new data of the same shapes run the cached solve (one
    trace, then hits) and give what a solve traced for that data alone gives,
    gradients included; x and an argument of the same shape and dtype are
    held apart (each has a scratch variable of its own)."""
    from tf_gradkit.core.lm import solve_cache  # noqa: PLC0415
    a = tf.constant(RNG.normal(size=(3, 3)))
    def mixed(p, q):  # x and the argument q: both [3] float64
        return tf.concat([tf.linalg.matvec(a, p) - q, 0.1 * (p - 2.0 * q)], axis=0)

    def solve(q, **options):
        q = tf.constant(q)
        with tf.GradientTape() as tape:
            tape.watch(q)
            x, result = tf_gradkit.solve_least_squares(mixed, np.zeros(3), args=(q,),
                                                       jit_compile=False, **options)
            value = tf.reduce_sum(WEIGHTS * x)
        return x.numpy(), tape.gradient(value, q).numpy(), int(result.iterations)

    solve_cache.SOLVES.clear()
    qs = [RNG.normal(size=3) for _ in range(3)]
    cached = [solve(q) for q in qs]
    info = solve_cache.SOLVES.info()
    assert (info.misses, info.hits) == (1, 2), info
    for q, (x, grad, iterations) in zip(qs, cached):
        x_ref, grad_ref, iterations_ref = solve(q, cache=False)
        np.testing.assert_array_equal(x, x_ref)
        np.testing.assert_array_equal(grad, grad_ref)
        assert iterations == iterations_ref
        # The minimiser in closed form: the stacked linear system's solution.
        big = np.vstack([a.numpy(), 0.1 * np.eye(3)])
        rhs = np.concatenate([q, 0.2 * q])
        np.testing.assert_allclose(x, np.linalg.lstsq(big, rhs, rcond=None)[0],
                                   rtol=1e-8, atol=1e-10)
