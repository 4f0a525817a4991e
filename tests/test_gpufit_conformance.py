"""Gpufit's own tests, ported to `tf_gradkit.curve_fit` and
`tf_gradkit.least_squares_batched`.

Each Boost test of Gpufit's ``Gpufit/tests/*.cpp`` and ``tests/Consistency.cpp``
(github.com/gpufit/Gpufit, MIT licence, (c) 2017 Mark Bates, Adrian
Przybylski, Bjoern Thiel, Jan Keller-Findeisen) appears here under its name:
the same model (written here in TensorFlow from Gpufit's model definitions),
data, start, iteration limit and acceptance thresholds. Gpufit's
``chi_square`` is ``sum r^2``, i.e. ``2 * cost``; its ``state == 0`` is our
``converged``. Gpufit runs in float32 (``REAL``); these run in float64, where
its absolute thresholds (1e-6 on parameters of order 1-10) are meaningful.
Gpufit's MLE estimator is ``estimator="mle"`` (its chi-square, the
deviance, is ``2 * cost`` too; Gpufit ignores weights with MLE, we refuse
them, so the MLE part passes none) and ``parameters_to_fit`` is ours by
the same name. Models are
module-level functions run as plain ``tf.function``s (``jit_compile=False``)
except in ``test_consistency`` (slow), Gpufit's CPU-vs-GPU check ported as
graph-vs-XLA; ``test_consistency_in_a_batch`` checks a fit alone and in a batch.
"""

import warnings

import numpy as np
import pytest
import scipy.optimize
import tensorflow as tf

import tf_gradkit

pytestmark = pytest.mark.keras_free



def fit(f, x, y, p0, **kw):
    kw.setdefault("jit_compile", False)
    return tf_gradkit.curve_fit(f, x, np.asarray(y, np.float64),
                                np.asarray(p0, np.float64), **kw)


def check(res, truth, max_iterations, tol=1e-6, chi_square=1e-6):
    """Gpufit's checks: state 0, chi_square, iterations, parameters."""
    assert bool(np.all(res.converged)), res.reason
    assert np.all(2.0 * res.cost.numpy() < chi_square)
    assert np.all(res.iterations.numpy() <= max_iterations)
    np.testing.assert_array_less(np.abs(res.x.numpy() - np.asarray(truth)), tol)


# -- Gpufit's models (Gpufit/models/*.cuh) ------------------------------------

def gauss_1d(x, p):
    a, x0, s, b = (p[:, i:i + 1] for i in range(4))
    return a * tf.exp(-(x - x0) ** 2 / (2 * s * s)) + b


def grid(size):
    """Gpufit's 2-D point order: x the fast index."""
    yy, xx = np.meshgrid(np.arange(size, dtype=np.float64),
                         np.arange(size, dtype=np.float64), indexing="ij")
    return np.stack([xx.reshape(-1), yy.reshape(-1)])


def gauss_2d(xy, p):
    a, x0, y0, s, b = (p[:, i:i + 1] for i in range(5))
    return a * tf.exp(-((xy[0] - x0) ** 2 + (xy[1] - y0) ** 2) / (2 * s * s)) + b


def gauss_2d_elliptic(xy, p):
    a, x0, y0, sx, sy, b = (p[:, i:i + 1] for i in range(6))
    return a * tf.exp(-(xy[0] - x0) ** 2 / (2 * sx * sx)
                      - (xy[1] - y0) ** 2 / (2 * sy * sy)) + b


def gauss_2d_rotated(xy, p):
    a, x0, y0, sx, sy, b, r = (p[:, i:i + 1] for i in range(7))
    u = (xy[0] - x0) * tf.cos(r) - (xy[1] - y0) * tf.sin(r)
    v = (xy[0] - x0) * tf.sin(r) + (xy[1] - y0) * tf.cos(r)
    return a * tf.exp(-0.5 * ((u / sx) ** 2 + (v / sy) ** 2)) + b


def cauchy_2d_elliptic(xy, p):
    a, x0, y0, sx, sy, b = (p[:, i:i + 1] for i in range(6))
    return a / (((x0 - xy[0]) / sx) ** 2 + 1) / (((y0 - xy[1]) / sy) ** 2 + 1) + b


def linear_1d(x, p):
    return p[:, :1] + p[:, 1:2] * x


def helix(p):
    """FLETCHER_POWELL_HELIX, zero data: the residuals themselves."""
    pi = np.pi
    theta = 0.5 * tf.atan(p[:, 1] / p[:, 0]) / pi
    theta = tf.where(p[:, 0] < 0, theta + 0.5, theta)
    arg = p[:, 0] ** 2 + p[:, 1] ** 2
    return tf.stack([10 * (p[:, 2] - 10 * theta), 10 * (tf.sqrt(arg) - 1), p[:, 2]],
                    axis=1)


def brown_dennis(p):
    """BROWN_DENNIS, zero data: 20 points at t = i / 5, i = 0..19."""
    t = tf.constant(np.arange(20) / 5.0, p.dtype)
    arg1 = p[:, :1] + p[:, 1:2] * t - tf.exp(t)
    arg2 = p[:, 2:3] + p[:, 3:4] * tf.sin(t) - tf.cos(t)
    return arg1 ** 2 + arg2 ** 2


def data(model, x, truth):
    return model(tf.constant(x, tf.float64), tf.constant([truth], tf.float64))[0].numpy()


# -- Gauss_Fit_1D.cpp -----------------------------------------------------------

def test_gauss_fit_1d():
    truth = [4, 2, .5, 1]
    x = np.arange(5.0)
    res = fit(gauss_1d, x, data(gauss_1d, x, truth), [2, 1.5, .3, 0])
    check(res, truth, max_iterations=10)


def test_gauss_fit_1d_custom_x():
    # Two fits, each with its own x (Gpufit's user_info).
    truths = np.array([[4, 0, .25, 1], [6, .5, .15, 2]])
    x = np.array([[-1, -.5, 0, .5, 1], [0, .25, .5, .75, 1]])
    y = np.stack([data(gauss_1d, x[i], truths[i]) for i in range(2)])
    res = fit(gauss_1d, x, y, [[2, .25, .15, 0], [8, .75, .2, 3]], xdata_per_fit=True)
    check(res, truths, max_iterations=20)


# -- Gauss_Fit_2D.cpp -----------------------------------------------------------

@pytest.mark.parametrize("weights", [False, True])
def test_gauss_fit_2d(weights):
    truth = [4, 2, 2, .5, 1]
    xy = grid(5)
    sigma = np.ones(25) if weights else None  # Gpufit's unit weights
    res = fit(gauss_2d, xy, data(gauss_2d, xy, truth), [3, 1.8, 2.2, .4, 0],
              sigma=sigma)
    check(res, truth, max_iterations=10)


@pytest.mark.parametrize("weights", [
    False, pytest.param(True, marks=pytest.mark.slow)])  # 2500 points each
def test_gauss_fit_2d_large_dataset(weights):
    truth = [4, 24.5, 24.5, 5, 1]
    xy = grid(50)
    sigma = np.ones(2500) if weights else None
    res = fit(gauss_2d, xy, data(gauss_2d, xy, truth), [3, 24, 25, 4, 0], sigma=sigma)
    check(res, truth, max_iterations=10)


# -- Gauss_Fit_2D_Elliptic.cpp, Gauss_Fit_2D_Rotated.cpp, Cauchy_Fit_2D_Elliptic.cpp

def test_gauss_fit_2d_elliptic():
    truth = [4, 2, 2, .4, .6, 1]
    xy = grid(5)
    res = fit(gauss_2d_elliptic, xy, data(gauss_2d_elliptic, xy, truth),
              [2, 1.8, 2.2, .5, .5, 0], sigma=np.ones(25))
    check(res, truth, max_iterations=10)


def test_gauss_fit_2d_rotated():
    truth = [10, 3.5, 3.5, .4, .5, 1, np.pi / 16]
    xy = grid(8)
    res = fit(gauss_2d_rotated, xy, data(gauss_2d_rotated, xy, truth),
              [8, 3.4, 3.6, .4, .5, 2, 0], sigma=np.ones(64))
    # Gpufit allows 2e-5 on the amplitude, 1e-6 on the others.
    check(res, truth, max_iterations=10, tol=[2e-5] + [1e-6] * 6)


def test_cauchy_fit_2d_elliptic():
    truth = [4, 2, 2, .4, .6, 1]
    xy = grid(5)
    res = fit(cauchy_2d_elliptic, xy, data(cauchy_2d_elliptic, xy, truth),
              [2, 1.8, 2.2, .5, .5, 0], sigma=np.ones(25))
    check(res, truth, max_iterations=10)


# -- Linear_Fit_1D.cpp ----------------------------------------------------------

def test_linear_fit_1d():
    # Two points, two parameters: an exact fit (LSE part). Its covariance
    # cannot be estimated (no degree of freedom): inf, flagged (scipy's
    # convention; Gpufit returns none).
    with pytest.warns(UserWarning, match="could not be estimated"):
        res = fit(linear_1d, np.array([0., 1.]), [1., 2.], [1., 0.], sigma=np.ones(2))
    check(res, [1, 1], max_iterations=10)
    assert bool(res.undetermined)


def test_linear_fit_1d_mle():
    # Gpufit's MLE part: the same exact data, start and thresholds (its
    # weights are ignored by Gpufit's MLE; here none are passed).
    res = fit(linear_1d, np.array([0., 1.]), [1., 2.], [1., 0.], estimator="mle")
    check(res, [1, 1], max_iterations=10)
    # The Poisson covariance is absolute (the variance is the mean), so,
    # unlike the LSE part, two points give one: finite here.
    assert np.all(np.isfinite(res.covariance.numpy()))


# -- Fletcher_Powell_Helix_Fit.cpp, Brown_Dennis_Fit.cpp ------------------------

@pytest.mark.parametrize("scale,limit,chi_square,tol", [
    (1., 9, 1e-26, 1e-13), (10., 21, 1e-26, 1e-13), (100., 29, 1e-20, 1e-10)])
def test_fletcher_powell_helix(scale, limit, chi_square, tol):
    # Gpufit's iteration counts (9, 21, 29) are its own iteration's; ours
    # differ, so the limit is its max_n_iterations (50) and the solution
    # and chi-square thresholds are Gpufit's.
    del limit
    res = tf_gradkit.least_squares_batched(
        helix, np.array([[-1., 0., 0.]]) * scale, max_iterations=50,
        jit_compile=False)
    assert bool(res.converged[0]), res.reason
    assert 2.0 * float(res.cost[0]) < chi_square
    np.testing.assert_array_less(np.abs(res.x.numpy()[0] - [1., 0., 0.]), tol)


@pytest.mark.parametrize("scale,tol", [(1., 1e-2), (10., 1e-2), (100., 1e-1)])
def test_brown_dennis(scale, tol):
    truth = [-7.3027296, 10.800486, -0.33427560, 0.13945465]
    res = tf_gradkit.least_squares_batched(
        brown_dennis, np.array([[25., 5., -5., 1.]]) * scale, max_iterations=1000,
        jit_compile=False)
    assert bool(res.converged[0]), res.reason
    assert 2.0 * float(res.cost[0]) < 38821.5  # Gpufit's expected_chi_square
    np.testing.assert_array_less(np.abs(res.x.numpy()[0] - truth), tol)


# -- Error_Handling.cpp ---------------------------------------------------------

def test_error_handling():
    # Gpufit: initial_parameters NULL -> status -1, "invalid argument".
    # Ours: refused before anything runs, naming the argument.
    with pytest.raises(ValueError, match="p0"):
        tf_gradkit.curve_fit(linear_1d, np.array([0., 1.]), np.array([0., 1.]), None)


# -- Consistency.cpp: Cpufit and Gpufit agree; here graph and XLA -------------

CONSISTENCY = {
    "linear_fit_1d": (linear_1d, np.array([0., 1.]), [0., 1.], [0., 0.], 10),
    "gauss_fit_1d": (gauss_1d, np.arange(5.), [4., 2., .5, 1.], [2., 1.5, .3, 0.], 10),
    "gauss_fit_2d": (gauss_2d, grid(5), [4., 1.8, 2.2, .5, 1.], [2., 1.8, 2.2, .4, 0.],
                     20),
}


@pytest.mark.slow  # each XLA compile costs seconds (test_consistency_in_a_batch is fast)
@pytest.mark.parametrize("name", sorted(CONSISTENCY))
def test_consistency(name):
    model, x, truth, start, limit = CONSISTENCY[name]
    y = data(model, x, truth)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # linear_fit_1d: N == P, no covariance
        graph = fit(model, x, y, start, max_iterations=limit)
        xla = fit(model, x, y, start, max_iterations=limit, jit_compile=True)
    # Same iteration in another compiler. On noise-free data the last
    # iteration ends at round-off, where gtol (gradient ~ 0) and xtol (step
    # ~ 0) may trip in either order or one iteration apart: both must call
    # it converged (or both not), at the same point.
    assert bool(graph.converged) == bool(xla.converged), (graph.reason, xla.reason)
    assert abs(int(graph.iterations) - int(xla.iterations)) <= 1
    np.testing.assert_allclose(xla.x.numpy(), graph.x.numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(xla.cost.numpy(), graph.cost.numpy(), atol=1e-20)


def test_consistency_in_a_batch():
    # Cpufit's and Gpufit's fits are independent per fit; here one fit alone
    # and the same fit as a row of a batch (beside another start) agree.
    model, x, truth, start, limit = CONSISTENCY["gauss_fit_1d"]
    y = data(model, x, truth)
    alone = fit(model, x, y, start, max_iterations=limit)
    pair = fit(model, x, np.stack([y, y]), [start, [3., 2.2, .6, .5]],
               max_iterations=limit)
    assert int(alone.status) == int(pair.status[0])
    assert int(alone.iterations) == int(pair.iterations[0])
    np.testing.assert_allclose(pair.x.numpy()[0], alone.x.numpy(), rtol=1e-12,
                               atol=1e-14)


def test_consistency_gauss_fit_2d_elliptic_fixed_parameter():
    # Consistency.cpp's gauss_fit_2d_elliptic passes parameters_to_fit
    # {1, 1, 1, 1, 1} for six parameters: the background (its sixth,
    # zero-filled) is fixed at its start 0 while the data's is 1. Gpufit
    # checks Cpufit == Gpufit; here: the background never moves, a fit
    # alone equals the same fit in a batch, and both equal scipy's fit of
    # the reduced model (an independent oracle).
    xy = grid(5)
    truth, start = [4., 2., 2., .4, .6, 1.], [2., 1.8, 2.2, .5, .5, 0.]
    y = data(gauss_2d_elliptic, xy, truth)
    mask = [1, 1, 1, 1, 1, 0]
    alone = fit(gauss_2d_elliptic, xy, y, start, max_iterations=10,
                parameters_to_fit=mask)
    pair = fit(gauss_2d_elliptic, xy, np.stack([y, y]), [start, [3., 2.1, 1.9, .45, .5, 0.]],
               max_iterations=10, parameters_to_fit=mask)
    assert float(alone.x[5]) == 0.0 and np.all(pair.x.numpy()[:, 5] == 0.0)
    assert int(alone.status) == int(pair.status[0])
    assert int(alone.iterations) == int(pair.iterations[0])
    np.testing.assert_allclose(pair.x.numpy()[0], alone.x.numpy(), rtol=1e-12,
                               atol=1e-14)

    def reduced(flat, a, x0, y0, sx, sy):
        return gauss_2d_elliptic(tf.constant(flat.reshape(2, -1)),
                                 tf.constant([[a, x0, y0, sx, sy, 0.]]))[0].numpy()

    ref, _ = scipy.optimize.curve_fit(reduced, xy.reshape(-1), y, start[:5],
                                      xtol=1e-15, ftol=1e-15, gtol=1e-15)
    # Gpufit's 10 iterations end this misfit (background held at 0 under a
    # background of 1) at the limit, Cpufit and Gpufit alike; run to the
    # end, it converges where scipy does (round-off of the stops).
    done = fit(gauss_2d_elliptic, xy, y, start, max_iterations=200,
               parameters_to_fit=mask)
    assert bool(done.converged), done.reason
    assert float(done.x[5]) == 0.0
    np.testing.assert_allclose(done.x.numpy()[:5], ref, rtol=1e-6, atol=1e-8)
