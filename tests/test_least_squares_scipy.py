"""`least_squares` against scipy: bounds, robust losses, x_scale and the
result (Jacobian, gradient, covariance, active set, stopping reason).

References: ``scipy.optimize.least_squares(method="trf")`` run to tight
tolerances on the same residuals in numpy, ``curve_fit``'s ``pcov``, the
NIST StRD certified standard deviations, and hand-written loss formulas.
"""

import numpy as np
import pytest
import scipy.optimize as so
import tensorflow as tf

import tf_gradkit
from nist_problems import PROBLEMS, lre, residual_fn_for, variables_at
from tf_gradkit.core.lm import damping, linear_solvers

pytestmark = pytest.mark.keras_free

TIGHT = dict(method="trf", xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=5000)
LOSSES = ("linear", "soft_l1", "huber", "cauchy", "arctan")


def _decay_with_outliers():
    """y = 3 exp(-0.4 t) + 0.5 with noise 0.05 and three gross outliers."""
    rng = np.random.default_rng(0)
    t = np.linspace(0.0, 10.0, 50)
    y = 3.0 * np.exp(-0.4 * t) + 0.5 + rng.normal(0.0, 0.05, t.size)
    y[[5, 20, 33]] += [4.0, -3.0, 5.0]
    return t, y


T, Y = _decay_with_outliers()


def _decay_np(p):
    return p[0] * np.exp(-p[1] * T) + p[2] - Y


def _decay_fit(start, **kwargs):
    """Compiled with XLA only where a test says so: the compiled loop is
    the same graph (test_levenberg_marquardt.py runs both), and compiling
    each small solve costs more than running it."""
    kwargs.setdefault("jit_compile", False)
    v = tf.Variable(start, dtype=tf.float64)
    t, y = tf.constant(T), tf.constant(Y)
    result = tf_gradkit.least_squares(
        lambda: v[0] * tf.exp(-v[1] * t) + v[2] - y, [v], **kwargs)
    return v, result


def _rho(loss, z):
    """scipy's documented rho(z), written out independently."""
    return {"linear": z, "soft_l1": 2 * (np.sqrt(1 + z) - 1),
            "huber": np.where(z <= 1, z, 2 * np.sqrt(z) - 1),
            "cauchy": np.log1p(z), "arctan": np.arctan(z)}[loss]


# -- robust losses ---------------------------------------------------------

@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("f_scale", [0.1, pytest.param(1.0, marks=pytest.mark.slow)])
def test_robust_loss_matches_scipy(loss, f_scale):
    start = [1.0, 0.1, 0.0]
    v, result = _decay_fit(start, loss=loss, f_scale=f_scale,
                           jit_compile=f_scale == 0.1)
    ref = so.least_squares(_decay_np, start, loss=loss, f_scale=f_scale, **TIGHT)
    assert bool(result.converged), result.reason
    # Both stop at round-off of a well-posed 3-parameter fit.
    np.testing.assert_allclose(v.numpy(), ref.x, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(float(result.cost), ref.cost, rtol=1e-10)
    # The cost is scipy's 0.5 C^2 sum rho((f/C)^2), by the written formula.
    z = (_decay_np(v.numpy()) / f_scale) ** 2
    np.testing.assert_allclose(float(result.cost),
                               0.5 * f_scale ** 2 * _rho(loss, z).sum(), rtol=1e-12)
    np.testing.assert_allclose(result.fun.numpy(), _decay_np(v.numpy()), atol=1e-12)
    # scipy's scaled Jacobian and the gradient, at (nearly) the same point.
    np.testing.assert_allclose(result.jac.numpy(), ref.jac, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.grad.numpy(), ref.grad, atol=1e-5)


def test_robust_loss_resists_outliers():
    """The point of a robust loss: with three gross outliers, soft_l1 lands
    near the generating parameters where plain least squares does not."""
    truth = np.array([3.0, 0.4, 0.5])
    plain, _ = _decay_fit([1.0, 0.1, 0.0])
    robust, _ = _decay_fit([1.0, 0.1, 0.0], loss="soft_l1", f_scale=0.1)
    assert np.abs(robust.numpy() - truth).max() < 0.1
    assert np.abs(plain.numpy() - truth).max() > 3 * np.abs(robust.numpy() - truth).max()


@pytest.mark.parametrize("name", ["Misra1a", "Chwirut2", "DanWood", "MGH17"])
def test_robust_nist_matches_scipy(name):
    """soft_l1 with f_scale at the certified residual RMS, from NIST start 2."""
    problem = PROBLEMS[name]
    f_scale = float(np.sqrt(problem.certified_rss / problem.y.size))
    vs = variables_at(problem.starts[1])
    result = tf_gradkit.least_squares(residual_fn_for(problem, vs), vs,
                                      max_iterations=1000, loss="soft_l1",
                                      f_scale=f_scale)
    ref = so.least_squares(lambda b: problem.model(b, problem.x, xp=np) - problem.y,
                           problem.starts[1], loss="soft_l1", f_scale=f_scale,
                           **TIGHT)
    assert bool(result.converged), result.reason
    np.testing.assert_allclose([float(v) for v in vs], ref.x, rtol=1e-6)
    np.testing.assert_allclose(float(result.cost), ref.cost, rtol=1e-9)


# -- bounds ----------------------------------------------------------------

BOUND_CASES = {
    # name: (start, lower, upper): active upper on a, lower on b, both inside,
    # and one side unbounded.
    "upper and lower active": ([1.0, 0.6, 0.0], [0.0, 0.5, -1.0], [2.5, 10.0, 10.0]),
    "none active": ([1.0, 0.6, 0.7], [0.0, 0.0, 0.6], [10.0, 10.0, 10.0]),
    "one-sided": ([1.0, 0.1, 1.0], [-np.inf, -np.inf, 0.9], np.inf),
    "start on a bound": ([2.0, 0.5, 0.0], [2.0, 0.5, -np.inf], [4.0, 0.8, np.inf]),
}


@pytest.mark.parametrize("case", sorted(BOUND_CASES))
def test_bounds_match_scipy(case):
    start, lower, upper = BOUND_CASES[case]
    v, result = _decay_fit(start, bounds=(lower, upper))
    # scipy's trf needs a strictly feasible start.
    ref = so.least_squares(_decay_np, np.clip(start, np.add(lower, 1e-9),
                                              np.subtract(upper, 1e-9)),
                           bounds=(lower, upper), **TIGHT)
    x = v.numpy()
    assert bool(result.converged), result.reason
    # Never outside the box; on a bound exactly where active.
    lo, hi = np.broadcast_to(lower, 3), np.broadcast_to(upper, 3)
    assert np.all(x >= lo) and np.all(x <= hi)
    np.testing.assert_array_equal(result.active_mask.numpy(), ref.active_mask)
    mask = result.active_mask.numpy()
    np.testing.assert_array_equal(x[mask == -1], lo[mask == -1])
    np.testing.assert_array_equal(x[mask == 1], hi[mask == 1])
    np.testing.assert_allclose(x, ref.x, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(float(result.cost), ref.cost, rtol=1e-10)
    np.testing.assert_allclose(result.x.numpy(), x)


def test_bounds_with_a_robust_loss_and_per_variable_entries():
    """Two variables, bounds given per variable, a robust loss on top."""
    a = tf.Variable([1.0, 0.1], dtype=tf.float64)
    c = tf.Variable(1.0, dtype=tf.float64)
    t, y = tf.constant(T), tf.constant(Y)
    result = tf_gradkit.least_squares(
        lambda: a[0] * tf.exp(-a[1] * t) + c - y, [a, c],
        bounds=([[0.0, 0.0], 0.6], [[2.8, 1.0], 5.0]), loss="cauchy", f_scale=0.1)
    ref = so.least_squares(_decay_np, [1.0, 0.1, 1.0],
                           bounds=([0.0, 0.0, 0.6], [2.8, 1.0, 5.0]),
                           loss="cauchy", f_scale=0.1, **TIGHT)
    assert bool(result.converged), result.reason
    np.testing.assert_allclose(np.r_[a.numpy(), c.numpy()], ref.x, rtol=1e-7,
                               atol=1e-9)
    np.testing.assert_array_equal(result.active_mask.numpy(), ref.active_mask)


def test_bounded_nist_fit_matches_scipy():
    """Misra1a with b1 held above its certified value (238.9)."""
    problem = PROBLEMS["Misra1a"]
    lower, upper = [245.0, 0.0], [1000.0, 1.0]
    vs = variables_at(problem.starts[1])
    result = tf_gradkit.least_squares(residual_fn_for(problem, vs), vs,
                                      max_iterations=1000, bounds=(lower, upper))
    ref = so.least_squares(lambda b: problem.model(b, problem.x, xp=np) - problem.y,
                           problem.starts[1], bounds=(lower, upper), **TIGHT)
    assert bool(result.converged), result.reason
    assert float(vs[0]) == 245.0 and list(result.active_mask.numpy()) == [-1, 0]
    np.testing.assert_allclose([float(v) for v in vs], ref.x, rtol=1e-7)


def test_bounds_inside_a_tf_function():
    """In a graph the start is clipped into the box (no eager check there)."""
    v = tf.Variable([5.0, 0.6, 0.0], dtype=tf.float64)
    t, y = tf.constant(T), tf.constant(Y)

    @tf.function
    def fit():
        return tf_gradkit.least_squares(
            lambda: v[0] * tf.exp(-v[1] * t) + v[2] - y, [v],
            bounds=([0.0, 0.5, -1.0], [2.5, 10.0, 10.0])).cost

    fit()
    ref, _ = _decay_fit([1.0, 0.6, 0.0], bounds=([0.0, 0.5, -1.0], [2.5, 10.0, 10.0]))
    np.testing.assert_allclose(v.numpy(), ref.numpy(), rtol=1e-9)


# -- x_scale ---------------------------------------------------------------

@pytest.mark.parametrize("x_scale", ["jac", 2.0, [1.0, 0.1, 1.0]])
def test_x_scale_reaches_scipys_solution(x_scale):
    start = [1.0, 0.1, 0.0]
    v, result = _decay_fit(start, x_scale=x_scale)
    ref = so.least_squares(_decay_np, start, x_scale=x_scale, **TIGHT)
    assert bool(result.converged), result.reason
    np.testing.assert_allclose(v.numpy(), ref.x, rtol=1e-7)


@pytest.mark.parametrize("iterations", [1, 4])
def test_x_scale_is_a_change_of_variables(iterations):
    """x_scale=s on x runs the same iterates as x_scale=1 on u = x / s (the
    trust region is a sphere in x / s), so the scales decide the steps."""
    scales = np.array([1.0, 1e-3, 10.0])
    start = np.array([1.0, 0.1, 0.0])
    t, y = tf.constant(T), tf.constant(Y)
    x = tf.Variable(start, dtype=tf.float64)
    tf_gradkit.least_squares(lambda: x[0] * tf.exp(-x[1] * t) + x[2] - y, [x],
                             x_scale=scales, max_iterations=iterations,
                             jit_compile=False)
    u = tf.Variable(start / scales, dtype=tf.float64)
    s = tf.constant(scales)
    tf_gradkit.least_squares(
        lambda: s[0] * u[0] * tf.exp(-s[1] * u[1] * t) + s[2] * u[2] - y, [u],
        x_scale=1.0, max_iterations=iterations, jit_compile=False)
    np.testing.assert_allclose(x.numpy(), scales * u.numpy(), rtol=1e-9, atol=1e-12)
    plain = tf.Variable(start, dtype=tf.float64)
    tf_gradkit.least_squares(lambda: plain[0] * tf.exp(-plain[1] * t) + plain[2] - y,
                             [plain], x_scale=1.0, max_iterations=iterations,
                             jit_compile=False)
    if iterations == 1:  # and they do change the step
        assert np.abs(plain.numpy() - x.numpy()).max() > 1e-3


# -- the result: covariance, Jacobian ----------------------------------------

def test_covariance_matches_curve_fit():
    def model(t, a, b, c):
        return a * np.exp(-b * t) + c

    popt, pcov = so.curve_fit(model, T, Y, p0=[1.0, 0.1, 0.0], method="trf",
                              xtol=1e-15, ftol=1e-15, gtol=1e-15)
    v, result = _decay_fit([1.0, 0.1, 0.0])
    # Both at the minimum to what float64 resolves of this fit (~1e-8).
    np.testing.assert_allclose(v.numpy(), popt, rtol=1e-7)
    np.testing.assert_allclose(result.covariance.numpy(), pcov, rtol=1e-6)


def test_covariance_with_a_robust_loss_matches_curve_fit():
    def model(t, a, b, c):
        return a * np.exp(-b * t) + c

    popt, pcov = so.curve_fit(model, T, Y, p0=[1.0, 0.1, 0.0], method="trf",
                              loss="huber",
                              f_scale=0.1, xtol=1e-15, ftol=1e-15, gtol=1e-15)
    v, result = _decay_fit([1.0, 0.1, 0.0], loss="huber", f_scale=0.1)
    np.testing.assert_allclose(v.numpy(), popt, rtol=1e-7)
    np.testing.assert_allclose(result.covariance.numpy(), pcov, rtol=1e-5)


@pytest.mark.parametrize("name", ["Misra1a", "Chwirut2", "DanWood", "Lanczos3",
                                  "Kirby2"])
def test_standard_errors_match_nist_certified(name):
    """sqrt(diag(covariance)) is NIST's certified standard deviation."""
    problem = PROBLEMS[name]
    vs = variables_at(problem.starts[1])
    result = tf_gradkit.least_squares(residual_fn_for(problem, vs), vs,
                                      max_iterations=1000)
    sd = np.sqrt(np.diag(result.covariance.numpy()))
    assert lre(sd, problem.certified_sd).min() >= 6


def test_covariance_is_infinite_without_degrees_of_freedom():
    v = tf.Variable([1.0, 2.0], dtype=tf.float64)
    result = tf_gradkit.least_squares(lambda: v * v - [4.0, 9.0], [v])
    assert np.all(np.isinf(result.covariance.numpy()))


def test_matrix_free_solver_has_no_jacobian():
    v = tf.Variable([1.0, 2.0, 3.0], dtype=tf.float64)
    result = tf_gradkit.least_squares(lambda: v - [4.0, 9.0, 1.0], [v], solver="cg",
                                      scaling="levenberg")
    assert result.jac is None and result.covariance is None
    np.testing.assert_allclose(result.grad.numpy(), 0.0, atol=1e-9)


def test_matrix_free_products_stay_at_the_linearisation_point():
    # A tiny starting damping on a curved problem: the first attempts are
    # rejected, so their trial points are in the variables when the next
    # attempt solves. CG, run to convergence, must take the Cholesky step
    # (J^T J v at the linearisation point), not one with J of a trial point.
    x = tf.constant(np.linspace(0.0, 3.0, 40))
    y = 2.0 * tf.exp(-1.3 * x) + 0.3

    def run(solver):
        v = tf.Variable([0.5, -3.0, 1.0], dtype=tf.float64)
        result = tf_gradkit.least_squares(
            lambda: v[0] * tf.exp(v[1] * x) + v[2] - y, [v], solver=solver,
            scaling="levenberg", controller=damping.Nielsen(initial=1e-9),
            max_iterations=1, jit_compile=False, cache=False)
        return v.numpy(), result

    cg_x, cg = run(linear_solvers.ConjugateGradient(max_iterations=50, tolerance=1e-14))
    ch_x, ch = run("cholesky")
    assert float(ch.damping) > 1e-6  # attempts were rejected (each raised it)
    np.testing.assert_allclose(cg_x, ch_x, rtol=1e-7)


# -- argument checks -------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(bounds=([0.0, 2.0, 0.0], [1.0, 1.0, 1.0])), "lower bound must be below"),
    (dict(bounds=([0.0, 0.0], [1.0, 1.0])), "bounds` lower must be a scalar"),
    (dict(bounds=0.0), "must be a pair"),
    (dict(bounds=(5.0, 10.0)), "outside `bounds`"),
    (dict(loss="l1"), "`loss` must be one of"),
    (dict(f_scale=-1.0), "`f_scale` must be a positive"),
    (dict(x_scale="auto"), "`x_scale` must be 'jac'"),
    (dict(x_scale=[1.0, -1.0, 1.0]), "positive finite"),
    (dict(x_scale=[1.0, 1.0]), "2 values but there are 3"),
    (dict(x_scale="jac", scaling="levenberg"), "not both"),
    (dict(loss="huber", geodesic_acceleration=True), "geodesic_acceleration"),
])
def test_bad_arguments_are_refused_before_anything_moves(kwargs, match):
    start = [1.0, 0.1, 0.0]
    with pytest.raises(ValueError, match=match):
        v, _ = _decay_fit(start, **kwargs)
    v = tf.Variable(start, dtype=tf.float64)
    with pytest.raises(ValueError, match=match):
        tf_gradkit.least_squares(lambda: v - 1.0, [v], **kwargs)
    np.testing.assert_array_equal(v.numpy(), start)
