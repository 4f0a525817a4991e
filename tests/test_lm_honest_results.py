"""Least-squares fits that never claim what they aren't (issue 38, items 5-10).

- NaN guards that survive Grappler (eager, graph and XLA);
- an undetermined parameter gives an ``inf`` covariance and a flag;
- no data is refused (one fit) or gets its own status (a batch row);
- a stop on a bound the residuals ignore is not "converged";
- fits that never ran have a NaN covariance;
- refusals name the argument.
"""

import numpy as np
import pytest
import scipy.optimize as so
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.lm import batched, damping, fitting
from tf_gradkit.core.lm.fit_report import CovarianceWarning
from tf_gradkit.core.lm.least_squares import OFF_BOUNDS_TEXT, REASONS, StopReason

pytestmark = pytest.mark.keras_free

F64 = tf.float64
MODES = {"eager": lambda f: f,
         "graph": lambda f: tf.function(f),
         "xla": lambda f: tf.function(f, jit_compile=True)}


# -- item 5: the trust region's NaN guards, in each mode ------------------------

def _update(new_cost, slope, actual):
    state = damping.DampingState(tf.constant(1.0, F64), tf.constant(4.0, F64))
    trial = damping.Trial(
        rho=tf.constant(0.0, F64), scaled_norm=tf.constant(1.0, F64),
        actual=actual, slope=slope, cost=tf.constant(1.0, F64), new_cost=new_cost)
    return damping.TrustRegion().reject(state, trial)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_trust_region_guards_take_nan_as_blown(mode):
    update = MODES[mode](_update)
    nan = tf.constant(np.nan, F64)
    # radius = temp * min(4, 10 * |D d| = 10): temp 0.1 for a NaN trial cost
    # (blown) and for a NaN shrink factor (quad of a NaN slope).
    blown = update(nan, tf.constant(-1.0, F64), nan)
    bad_quad = update(tf.constant(2.0, F64), nan, tf.constant(-1.0, F64))
    # Control: a finite trial that rose a little shrinks by the quadratic's
    # factor, here 0.5 * -1 / (-1 + 0.5 * -1) = 1/3.
    finite = update(tf.constant(2.0, F64), tf.constant(-1.0, F64),
                    tf.constant(-1.0, F64))
    np.testing.assert_allclose(float(blown.nu), 0.4, rtol=1e-12)
    np.testing.assert_allclose(float(bad_quad.nu), 0.4, rtol=1e-12)
    np.testing.assert_allclose(float(finite.nu), 4.0 / 3.0, rtol=1e-12)
    assert np.isfinite(float(blown.damping)) and np.isfinite(float(bad_quad.damping))


X_LOG = np.linspace(1, 10, 30)
Y_LOG = 2 * np.log(X_LOG + 0.5)


@pytest.mark.parametrize("jit", [False, True])
def test_log_model_from_a_nan_trial_converges(jit):
    # a * log(x + b) from (1, 5): the first trial steps to x + b < 0 (NaN);
    # scipy converges, and so must the graph (Grappler on) and XLA solves.
    a, b = tf.Variable(1.0, dtype=F64), tf.Variable(5.0, dtype=F64)
    x, y = tf.constant(X_LOG), tf.constant(Y_LOG)
    result = tf_gradkit.least_squares(lambda: a * tf.math.log(x + b) - y, [a, b],
                                      jit_compile=jit, cache=False)
    assert bool(result.converged), result.reason
    np.testing.assert_allclose([float(a), float(b)], [2.0, 0.5], rtol=1e-8)


def test_log_model_curve_fit_graph():
    fit = tf_gradkit.curve_fit(lambda x, p: p[:, :1] * tf.math.log(x + p[:, 1:]),
                               X_LOG, Y_LOG, np.array([1.0, 5.0]), jit_compile=False)
    assert bool(fit.converged), fit.reason
    np.testing.assert_allclose(fit.x.numpy(), [2.0, 0.5], rtol=1e-8)


# -- item 6: undetermined parameters --------------------------------------------

def test_least_squares_undetermined_parameter_has_inf_covariance():
    x = tf.constant(X_LOG)
    v = tf.Variable([1.0, 2.0], dtype=F64)
    result = tf_gradkit.least_squares(lambda: v[0] * x + 0.0 * v[1] - 3 * x, [v])
    assert bool(result.undetermined)
    np.testing.assert_array_equal(result.covariance.numpy(), np.full([2, 2], np.inf))
    # Control: the same fit with the parameter used is determined, as scipy.
    w = tf.Variable([1.0, 2.0], dtype=F64)
    y = 3 * X_LOG + np.sin(X_LOG)
    good = tf_gradkit.least_squares(lambda: w[0] * x + w[1] - y, [w])
    ref = so.curve_fit(lambda t, p, q: p * t + q, X_LOG, y)[1]
    assert not bool(good.undetermined)
    np.testing.assert_allclose(good.covariance.numpy(), ref, rtol=1e-6)


def test_batched_flags_each_row():
    y = np.stack([3 * X_LOG + np.sin(X_LOG), 2 * X_LOG + np.cos(X_LOG)])

    def model(x, p):  # row 1 ignores its second parameter
        return p[:, :1] * x + p[:, 1:] * tf.constant([[1.0], [0.0]], F64)

    with pytest.warns(CovarianceWarning, match="1 of 2"):
        fit = tf_gradkit.curve_fit(model, X_LOG, y, np.ones([2, 2]), jit_compile=False)
    np.testing.assert_array_equal(fit.undetermined.numpy(), [False, True])
    assert np.all(np.isfinite(fit.covariance.numpy()[0]))
    assert np.all(np.isinf(fit.covariance.numpy()[1]))


# -- items 7 and 9: no data, infeasible start ----------------------------------

def test_masked_row_has_its_own_status_and_the_others_are_untouched():
    y = np.stack([3 * X_LOG, 2 * X_LOG, 5 * X_LOG])
    mask = np.ones([3, 30], bool)
    mask[1] = False

    def model(x, p):
        return p * x

    fit = tf_gradkit.curve_fit(model, X_LOG, y, np.ones([3, 1]), mask=mask,
                               jit_compile=False)
    assert int(fit.status[1]) == batched.NO_DATA
    assert fit.reason[1].startswith("no data") and not bool(fit.converged[1])
    assert np.all(np.isnan(fit.covariance.numpy()[1]))
    np.testing.assert_array_equal(fit.x.numpy()[1], [1.0])
    np.testing.assert_allclose(fit.x.numpy()[[0, 2], 0], [3.0, 5.0], rtol=1e-12)
    assert np.all(fit.converged.numpy()[[0, 2]])


def test_empty_data_is_refused():
    with pytest.raises(ValueError, match="ydata"):
        tf_gradkit.curve_fit(lambda x, p: p * x, np.zeros([0]), np.zeros([0]),
                             np.ones(1))
    v = tf.Variable([1.0], dtype=F64)
    with pytest.raises(ValueError, match="residual_fn"):
        tf_gradkit.least_squares(lambda: v[:0], [v], cache=False)


def test_infeasible_start_has_nan_covariance():
    fit = tf_gradkit.least_squares_batched(
        lambda x: x - tf.constant([[1.0], [2.0]], F64), np.array([[0.5], [5.0]]),
        bounds=(0.0, 3.0), jit_compile=False)
    np.testing.assert_array_equal(fit.status.numpy(), [1, batched.INFEASIBLE_START])
    assert np.all(np.isnan(fit.covariance.numpy()[1]))
    assert np.all(np.isfinite(fit.covariance.numpy()[0]) | np.isinf(
        fit.covariance.numpy()[0]))


# -- item 8: a stop on a bound the residuals ignore ----------------------------

def test_blind_bound_is_detected():
    box = batched.parts.BatchedBounds(tf.constant([[0.0, 0.0]], F64),
                                      tf.constant([[1.0, 1.0]], F64))
    x = tf.constant([[0.0, 0.0]], F64)
    # Parameter 0 on its bound with its column vanished (it once mattered);
    # parameter 1 on its bound with a live column; control: a column that
    # never mattered (largest 0) is rank deficiency, not a blind bound.
    blind = box.blind(x, tf.constant([[0.0, 2.0]], F64), tf.constant([[3.0, 2.0]], F64),
                      1e-16)
    np.testing.assert_array_equal(blind.numpy(), [[True, False]])
    never = box.blind(x, tf.constant([[0.0, 2.0]], F64), tf.constant([[0.0, 2.0]], F64),
                      1e-16)
    np.testing.assert_array_equal(never.numpy(), [[False, False]])
    inside = box.inside(x, tf.constant([[0.5, 0.5]], F64), blind)
    np.testing.assert_array_equal(inside.numpy(), [[0.25, 0.0]])


@pytest.mark.parametrize("batch", [False, True])
def test_bound_the_model_ignores_does_not_end_the_fit(batch, capsys):
    # scipy's gh-7117 hyperbola: a step may land on c = 0, where the model
    # ignores c; the fit goes on from inside the box and is exact, as trf.
    # The single solve runs with verbose=2, which reports both runs.
    lower = np.array([-3.0, 0.0, -2.0, -10.0, 0.0])
    upper = np.array([0.0, 3.0, 3.0, 0.0, 10.0])
    truth = np.array([-2, .4, -1, -5, 9.5])
    t = tf.constant([-32., -16, -8, 4, 4, 8, 16, 32], F64)

    def model(p):
        b_2, b_1 = (p[0] + p[1]) / 2, (p[1] - p[0]) / 2
        return p[3] + b_1 * (t - p[2]) + b_2 * tf.sqrt((t - p[2]) ** 2 + p[4] ** 2 / 4)

    y = model(tf.constant(truth))
    start = np.array([-2.5 / 3.0, 4 / 3.0, 1.0, -4.0, 0.5])
    if batch:
        res = tf_gradkit.least_squares_batched(
            lambda q: tf.stack([model(q[0]) - y]), start[None], bounds=(lower, upper),
            jit_compile=False)
        converged, x = bool(res.converged[0]), res.x.numpy()[0]
    else:
        p = tf.Variable(start, dtype=F64)
        result = tf_gradkit.least_squares(lambda: model(p) - y, [p],
                                          bounds=(lower, upper), jit_compile=False,
                                          verbose=2)
        converged, x = bool(result.converged), p.numpy()
        lines = capsys.readouterr().out.splitlines()
        assert f"Run 2: {OFF_BOUNDS_TEXT}" in lines
        ended = [line for line in lines if " ended: " in line]
        assert ended[0].startswith("Run 1 ended: stalled") and len(ended) == 2
        assert "Kept: run 2's point (the lowest cost)" in lines
        np.testing.assert_allclose(float(ended[1].rsplit("cost ", 1)[1]),
                                   float(result.cost), rtol=1e-4)
        rows = [line for line in lines[1:-1] if line.split()[0].isdigit()]
        assert len(rows) == int(result.iterations)   # both runs' iterations
    assert converged
    np.testing.assert_allclose(x, truth, rtol=1e-8)


# -- item 10: words --------------------------------------------------------------

def test_stalled_label_names_the_tolerances_and_docs_agree():
    label = REASONS[StopReason.STALLED]  # by status alone: which is not known
    assert "xtol or ftol" in label and "tighten" in label
    with open("docs/levenberg_marquardt.md") as f:
        text = f.read()
    for tolerance in ("xtol", "ftol", "gtol"):
        assert f"`stalled: {tolerance} ...`" in text
    with open("docs/batched_fits.md") as f:
        assert "`stalled: ftol ...`" in f.read()


# r = exp(x) - 1 (one residual, minimum 0 at x = 0), stopped after its first
# step by one loose tolerance, the other at its default (1e-8, far below the
# step of ~1 and the decrease of ~half the cost that step makes):
# - xtol=1e3: |dx| <= xtol (xtol + |x|) holds for any step (the step test);
# - ftol=0.9: the first (full Gauss-Newton) step from x = 3 lowers the cost
#   by 87% of it, within ftol (the decrease test), to x = 2.05.
# Both stop where exp(x1) / exp(x0) (the cosine, `stationarity`) is far above
# 1e-3 and r is not round-off, and (ftol) where the Gauss-Newton step would
# take all of the cost away, more than ftol of it (`whole_solve.within_ftol`;
# with ftol >= 1 any stop is within ftol): status 6, and the text names the
# one set loose.
STOPS = {"xtol": (3.0, {"xtol": 1e3}), "ftol": (3.0, {"ftol": 0.9})}


def _names_only(reason, tolerance):
    other = "ftol" if tolerance == "xtol" else "xtol"
    assert reason.startswith(f"stalled: {tolerance} stopped the fit"), reason
    assert f"tighten {tolerance} to go on" in reason and other not in reason, reason


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("tolerance", sorted(STOPS))
def test_single_stall_names_the_tolerance_that_stopped_it(tolerance, mode):
    start, loose = STOPS[tolerance]
    x = tf.Variable([start], dtype=F64)

    def fit():
        x.assign([start])
        result = tf_gradkit.least_squares(lambda: tf.exp(x) - 1.0, [x],
                                          jit_compile=mode == "xla", **loose)
        return result.reason_code, result.stopped_by, result.reason, result.iterations

    # The solve inside a tf.function for "graph" (the text is a string
    # tensor there); its own XLA compile for "xla".
    code, stopped_by, reason, iterations = (tf.function(fit) if mode == "graph"
                                            else fit)()
    assert int(code) == StopReason.STALLED and int(iterations) == 1
    assert int(stopped_by) == {"xtol": 2, "ftol": 3}[tolerance]
    _names_only(reason.numpy().decode() if mode == "graph" else reason, tolerance)
    # The independent check: the named test holds at the point reached, the
    # other does not (x moved ~1, the cost fell by more than 1e-8 of itself).
    x1 = float(x[0])
    step, drop = abs(x1 - start), (np.expm1(start) ** 2 - np.expm1(x1) ** 2) / 2
    assert step > 1e-8 * (1e-8 + abs(x1)) and drop > 1e-8 * np.expm1(start) ** 2 / 2
    assert 0.0 < x1 < start


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("tolerance", sorted(STOPS))
def test_batched_stall_names_the_tolerance_that_stopped_it(tolerance, jit_compile):
    start, loose = STOPS[tolerance]
    # Row 1 starts at the minimum: gtol stops it there, converged, no stall.
    res = tf_gradkit.least_squares_batched(
        lambda q: tf.exp(q) - 1.0, np.array([[start], [0.0]]),
        jit_compile=jit_compile, **loose)
    np.testing.assert_array_equal(res.status.numpy(), [6, 1])
    np.testing.assert_array_equal(res.stopped_by.numpy(),
                                  [{"xtol": 2, "ftol": 3}[tolerance], 0])
    _names_only(res.reason[0], tolerance)
    assert res.reason[1] == REASONS[StopReason.GRADIENT_TOLERANCE]
    # Statuses 7-9 keep their numbers and texts.
    assert batched.BATCHED_REASONS[batched.INFEASIBLE_START].startswith("infeasible")
    assert (batched.NON_FINITE_START, batched.INFEASIBLE_START,
            batched.NO_DATA) == (7, 8, 9)


def test_one_table_of_stall_texts():
    from tf_gradkit.core.lm import whole_solve  # noqa: PLC0415
    texts = whole_solve.reason_text(fitting.BATCHED_REASONS,
                                    np.array([6, 6, 6, 6, 6, 2, 9]),
                                    np.array([0, 1, 2, 3, 4, 0, 0]))
    assert list(texts) == list(whole_solve.STALLED_TEXTS) + [
        REASONS[2], fitting.BATCHED_REASONS[9]]
    assert texts[0] == REASONS[StopReason.STALLED]
    assert texts[1].startswith("stalled: gtol") and "tighten gtol" in texts[1]
    # A step below round-off: no tolerance would have let it go on.
    assert texts[4].startswith("stalled: a step below round-off")
    assert "tighten" not in texts[4]


def test_refusals_name_the_argument():
    x = np.arange(5.0)
    with pytest.raises(ValueError, match="`ydata`"):
        tf_gradkit.curve_fit(lambda x, p: p * x, x, 3.0, np.ones(1))
    with pytest.raises(ValueError, match="`xdata`"):
        tf_gradkit.curve_fit(lambda x, p: p * x, None, x, np.ones(1))
    with pytest.raises(ValueError, match="`p0`"):
        tf_gradkit.curve_fit(lambda x, p: p * x, x, np.stack([x, x]), None)
    with pytest.raises(ValueError, match="`fun"):
        tf_gradkit.least_squares_batched(lambda x: tf.reduce_sum(x), np.ones([2, 1]))
    assert fitting.BATCHED_REASONS[batched.NO_DATA].startswith("no data")
