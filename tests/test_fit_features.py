"""Fixed parameters, Poisson maximum likelihood and the progress bar of
`curve_fit` / `least_squares_batched` (issue 39's Gpufit parity).

Oracles: scipy's ``curve_fit`` on the reduced model (fixed parameters
closed over) and ``scipy.optimize.minimize`` of the Poisson deviance (BFGS
with its analytic gradient), each with a control showing that the feature
changes the answer. Float64 throughout; models run as plain tf.functions
(``jit_compile=False``: XLA compiles cost seconds each and the compiled
path is the same solve, covered by tests/test_batched_least_squares.py).
"""

import importlib

import numpy as np
import pytest
import scipy.optimize
import tensorflow as tf

import tf_gradkit

pytestmark = pytest.mark.keras_free
# the module (the package's `least_squares` names the function)
least_squares_lib = importlib.import_module("tf_gradkit.core.lm.least_squares")

T = np.linspace(0.0, 4.0, 30)
TRUTH = np.array([[3.0, 0.7, 0.5], [2.0, 1.5, 0.2]])


def decay(t, p):
    return p[:, :1] * tf.exp(-p[:, 1:2] * t) + p[:, 2:3]


def decay_jac(t, p):
    e = tf.exp(-p[:, 1:2] * t)
    return tf.stack([e, -p[:, :1] * t * e, tf.ones_like(e)], axis=2)


def np_decay(p):
    return p[0] * np.exp(-p[1] * T) + p[2]


def noisy():
    rng = np.random.default_rng(0)
    return np.stack([np_decay(p) for p in TRUTH]) + 0.01 * rng.normal(size=(2, 30))


def fit(y, p0, **kw):
    kw.setdefault("jit_compile", False)
    return tf_gradkit.curve_fit(decay, T, y, np.asarray(p0, np.float64), **kw)


# -- fixed parameters -----------------------------------------------------------

P0 = np.array([[1.0, 1.0, 0.4], [1.0, 1.0, 0.3]])


@pytest.mark.parametrize("mask", [[1, 1, 0], [True, True, False]])
def test_fixed_parameter_matches_scipy_on_the_reduced_model(mask):
    y = noisy()
    res = fit(y, P0, parameters_to_fit=mask)
    assert bool(np.all(res.converged)), res.reason
    x = res.x.numpy()
    np.testing.assert_array_equal(x[:, 2], P0[:, 2])   # never moved, exactly
    for b in range(2):
        ref, ref_cov = scipy.optimize.curve_fit(
            lambda t, a, k, b=b: a * np.exp(-k * t) + P0[b, 2], T, y[b], P0[b, :2],
            xtol=1e-15, ftol=1e-15, gtol=1e-15)
        # Both converge on a well-conditioned 2-parameter fit: round-off
        # of the stopping points, far below the brief's 1e-6.
        np.testing.assert_allclose(x[b, :2], ref, rtol=1e-6, atol=1e-9)
        cov = res.covariance.numpy()[b]
        np.testing.assert_allclose(cov[:2, :2], ref_cov, rtol=1e-5)
        # Gpufit's convention: a fixed parameter was not estimated.
        np.testing.assert_array_equal(cov[2], 0.0)
        np.testing.assert_array_equal(cov[:, 2], 0.0)
    np.testing.assert_array_equal(res.perr.numpy()[:, 2], 0.0)
    # Control: free, the third parameter moves off its start.
    free = fit(y, P0)
    assert np.all(np.abs(free.x.numpy()[:, 2] - P0[:, 2]) > 1e-3)


def test_fixed_parameter_each_fit_as_alone_with_jac_and_bounds():
    y = noisy()
    kw = dict(parameters_to_fit=[1, 0, 1], bounds=([0, 0, 0], [10, 10, 10]),
              jac=decay_jac, full_output=True)
    both = fit(y, P0, **kw)
    for b in range(2):
        alone = fit(y[b], P0[b], **kw)
        assert int(alone.status) == int(both.status[b])
        assert int(alone.iterations) == int(both.iterations[b])
        np.testing.assert_allclose(both.x.numpy()[b], alone.x.numpy(), rtol=1e-12,
                                   atol=1e-14)
    np.testing.assert_array_equal(both.x.numpy()[:, 1], P0[:, 1])
    np.testing.assert_array_equal(both.jac.numpy()[:, :, 1], 0.0)
    # The same fit by forward-mode derivatives (no jac): same solution to
    # round-off of a converged fit.
    auto = fit(y, P0, parameters_to_fit=[1, 0, 1], bounds=([0, 0, 0], [10, 10, 10]))
    np.testing.assert_allclose(auto.x.numpy(), both.x.numpy(), rtol=1e-9)


def test_fixed_parameter_in_least_squares_batched():
    y = noisy()

    def fun(x, yb):
        return decay(T, x) - yb

    res = tf_gradkit.least_squares_batched(fun, P0, (y,), parameters_to_fit=[0, 1, 1],
                                           jit_compile=False)
    ref = fit(y, P0, parameters_to_fit=[0, 1, 1])
    np.testing.assert_array_equal(res.x.numpy()[:, 0], P0[:, 0])
    np.testing.assert_allclose(res.x.numpy(), ref.x.numpy(), rtol=1e-12)


@pytest.mark.parametrize("mask,match", [
    ([1, 1], r"\[P\] = \[3\]"), ([1, 2, 0], "Received"), ([0, 0, 0], "nothing to fit"),
    ([[1, 1, 0]], r"shape \(1, 3\)")])
def test_fixed_parameter_refusals(mask, match):
    with pytest.raises(ValueError, match="parameters_to_fit") as err:
        fit(noisy(), P0, parameters_to_fit=mask)
    assert err.match(match)


# -- Poisson maximum likelihood --------------------------------------------------

def counts():
    rng = np.random.default_rng(1)
    # Low counts (means 0.4-7): zeros occur (10 of 60), where the deviance
    # has no log term.
    return rng.poisson(2 * np.stack([np_decay(p) for p in TRUTH])).astype(np.float64)


P0_MLE = np.array([[4.0, 1.0, 0.5], [4.0, 1.0, 0.5]])


def deviance(p, y):
    mu = np_decay(p)
    if np.any(mu <= 0):
        return np.inf, np.zeros(3)
    ratio = np.where(y > 0, mu / np.where(y > 0, y, 1.0), 1.0)
    value = 2.0 * np.sum(mu - y - np.where(y > 0, y * np.log(ratio), 0.0))
    e = np.exp(-p[1] * T)
    dmu = np.stack([e, -p[0] * T * e, np.ones_like(T)])
    return value, 2.0 * dmu @ (1.0 - y / mu)


@pytest.mark.parametrize("jac", [None, decay_jac])
def test_mle_matches_the_deviance_minimum(jac):
    y = counts()
    assert np.any(y == 0)
    res = fit(y, P0_MLE, estimator="mle", jac=jac)
    assert bool(np.all(res.converged)), res.reason
    lse = fit(y, P0_MLE)
    for b in range(2):
        ref = scipy.optimize.minimize(deviance, P0_MLE[b], args=(y[b],), jac=True,
                                      method="BFGS", options=dict(gtol=1e-10))
        assert np.linalg.norm(ref.jac) < 1e-6   # the oracle is at a minimum
        # Both at the same smooth minimum: the brief's 1e-6 (relative
        # to parameters of order 1-60).
        np.testing.assert_allclose(res.x.numpy()[b], ref.x, rtol=1e-6, atol=1e-8)
        # Gpufit's chi-square for MLE is the deviance, 2 * cost.
        np.testing.assert_allclose(2.0 * res.cost.numpy()[b], ref.fun, rtol=1e-9)
        # Control: least squares lands elsewhere on counts.
        assert np.max(np.abs(lse.x.numpy()[b] - ref.x) / np.abs(ref.x)) > 1e-3


def test_mle_non_positive_model_is_that_fits_status():
    y = counts()
    start = P0_MLE.copy()
    start[1] = [-4.0, 1.0, -0.5]   # model < 0 everywhere at the start
    res = fit(y, start, estimator="mle")
    alone = fit(y[0], P0_MLE[0], estimator="mle")
    assert res.status.numpy().tolist()[1] == 7
    np.testing.assert_array_equal(res.x.numpy()[1], start[1])   # not moved
    # The other fit runs as alone: same iterations and stop; its solution
    # to round-off (a batch of another size sums in another order; the
    # flat deviance valley of (rate, offset) amplifies that to ~1e-8 here).
    assert int(res.iterations[0]) == int(alone.iterations)
    assert int(res.status[0]) == int(alone.status)
    np.testing.assert_allclose(res.x.numpy()[0], alone.x.numpy(), rtol=1e-7)


@pytest.mark.parametrize("kw,match", [
    (dict(estimator="poisson"), "estimator"),
    (dict(estimator="mle", sigma=np.ones(30)), "sigma"),
    (dict(estimator="mle", loss="soft_l1"), "loss"),
    (dict(estimator="mle", absolute_sigma=False), "absolute_sigma"),
])
def test_mle_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        fit(counts(), P0_MLE, **kw)


def test_mle_refuses_negative_counts():
    y = counts()
    y[1, 4] = -1.0
    with pytest.raises(ValueError, match=r"ydata.*>= 0"):
        fit(y, P0_MLE, estimator="mle")


# -- progress ---------------------------------------------------------------------

def test_progress_bar_across_chunks(capsys):
    y = noisy()
    fit(y, P0, progress=True, batch_size=1)
    out = capsys.readouterr().out
    assert "1/2 fits" in out and "2/2 fits" in out
    fit(y, P0, batch_size=1)
    assert capsys.readouterr().out == ""   # control: silent by default


# -- least_squares(verbose=) ---------------------------------------------------------

X4 = tf.constant([1., 2., 3., 4.], tf.float64)
Y4 = 2.5 * tf.exp(-0.3 * X4)


def _single_fit(verbose, **kw):
    a = tf.Variable(1.0, dtype=tf.float64)
    b = tf.Variable(0.1, dtype=tf.float64)
    return tf_gradkit.least_squares(lambda: a * tf.exp(-b * X4) - Y4, [a, b],
                                    verbose=verbose, **kw)


def test_least_squares_verbose_termination_report(capsys):
    res = _single_fit(1)
    out = capsys.readouterr().out
    assert f"least_squares: {res.reason}." in out
    assert f"Iterations {int(res.iterations)}," in out
    _single_fit(0)
    assert capsys.readouterr().out == ""   # control: silent by default


# Eagerly with bounds that never bind (one run: its rows unheaded, as without
# bounds; a second run off bounds: tests/test_lm_honest_results.py), under
# XLA without.
@pytest.mark.parametrize("jit_compile,bounds", [(False, ([0., 0.], [10., 10.])),
                                                (True, None)])
def test_least_squares_verbose_2_reports_each_iteration(capsys, jit_compile, bounds):
    res = _single_fit(2, jit_compile=jit_compile, bounds=bounds)
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[1:-1]]
    assert len(rows) == int(res.iterations)
    # Row 0's cost is the start's, by hand: 0.5 * sum r^2 at (1.0, 0.1).
    start = 0.5 * np.sum((np.exp(-0.1 * X4.numpy()) - Y4.numpy()) ** 2)
    np.testing.assert_allclose(float(rows[0][1]), start, rtol=1e-4)  # 5 digits printed
    costs = [float(r[1]) for r in rows]
    assert all(b <= a for a, b in zip(costs, costs[1:]))   # LM never goes up
    assert rows[0][4] == "accepted"
    assert lines[-1].startswith(f"least_squares: {res.reason}.")


def _runs(lines):
    """verbose=2's output parsed: ``({run: [row, ...]}, {run: ended line},
    kept run)`` (run numbers from 1; one unheaded run is run 1)."""
    rows, ended, kept, run = {}, {}, None, 1
    for line in lines[1:-1]:
        if line.startswith("Run ") and " ended: " in line:
            ended[run] = line
        elif line.startswith("Run "):
            run = int(line.split()[1].rstrip(":"))
        elif line.startswith("Kept: run "):
            kept = int(line.split()[2].rstrip("'s"))
        else:
            rows.setdefault(run, []).append(line.split())
    return rows, ended, kept


def _ended_cost(line):
    return float(line.rsplit("cost ", 1)[1])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_least_squares_verbose_2_reports_each_run_of_a_restart(capsys, jit_compile):
    # scaling="hybrid" stopped by max_iterations: the first phase ends
    # unconverged, so the second restarts from the start; the lower cost is kept.
    res = _single_fit(2, jit_compile=jit_compile, scaling="hybrid", max_iterations=2)
    lines = capsys.readouterr().out.splitlines()
    rows, ended, kept = _runs(lines)
    assert "Run 1: from the start" in lines
    assert f"Run 2: {least_squares_lib.RESTART_TEXT}" in lines
    assert [len(rows[1]), len(rows[2])] == [2, 2] and int(res.iterations) == 4
    assert [r[0] for r in rows[1] + rows[2]] == ["0", "1", "2", "3"]  # numbered across
    start = 0.5 * np.sum((np.exp(-0.1 * X4.numpy()) - Y4.numpy()) ** 2)
    for run in (1, 2):   # each run starts from the start
        np.testing.assert_allclose(float(rows[run][0][1]), start, rtol=1e-4)
        assert "iteration limit" in ended[run]
    costs = {run: _ended_cost(ended[run]) for run in (1, 2)}
    assert kept == min(costs, key=costs.get)
    np.testing.assert_allclose(costs[kept], float(res.cost), rtol=1e-4)
    assert costs[3 - kept] > float(res.cost)


def test_least_squares_verbose_2_without_iterations(capsys):
    # max_iterations=0: the heading, no row, and the report of 0 iterations.
    res = _single_fit(2, max_iterations=0, bounds=([0., 0.], [10., 10.]))
    lines = capsys.readouterr().out.splitlines()
    assert int(res.iterations) == 0 and len(lines) == 2
    assert lines[0].split() == ["Iteration", "Cost", "Step", "norm", "Damping", "Step"]
    assert lines[1].startswith(f"least_squares: {res.reason}. Iterations 0,")


@pytest.mark.parametrize("verbose,kw,match", [
    (3, {}, "0 .silent., 1"), (True, {}, "0 .silent., 1")])
def test_least_squares_verbose_refusals(verbose, kw, match):
    with pytest.raises(ValueError, match=match):
        _single_fit(verbose, **kw)


def test_least_squares_verbose_refused_while_tracing():
    @tf.function
    def traced():
        return _single_fit(1).cost

    with pytest.raises(ValueError, match="needs an eager call"):
        traced()
