"""`least_squares` reuses its traced solve (`core/lm/solve_cache.py`).

A repeated call with the same residual function, variables, shapes, dtypes
and trace-time options only runs (no new trace, counted by a counter in the
residual function's Python body, which runs only while tracing); its result
equals an uncached call's bit for bit; any change that alters the trace (a
shape, a dtype, an option, a rebound capture) traces anew and is right; the
cache is a bounded LRU.
"""

import numpy as np
import pytest
import scipy.optimize as so
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.lm import solve_cache

pytestmark = pytest.mark.keras_free

T = np.linspace(0.0, 4.0, 40)
Y = 2.5 * np.exp(-1.3 * T) + 0.5 + 0.01 * np.sin(7.0 * T)
FIELDS = ("cost", "iterations", "converged", "reason_code", "damping",
          "optimality", "stationarity", "x", "fun", "jac", "grad",
          "active_mask", "covariance")


@pytest.fixture(autouse=True)
def fresh_cache():
    solve_cache.SOLVES.clear()
    yield
    solve_cache.SOLVES.clear()


class Decay:
    """``p0 exp(-p1 t) + p2 - y`` with a trace counter."""

    def __init__(self, dtype=tf.float64, y=Y):
        self.p = tf.Variable([1.0, 1.0, 0.0], dtype=dtype)
        self.t = tf.constant(T, dtype)
        self.y = tf.Variable(y, dtype=dtype)
        self.traces = 0

        def residuals():
            self.traces += 1
            p = self.p
            return p[0] * tf.exp(-p[1] * self.t) + p[2] - self.y

        self.residuals = residuals

    def fit(self, start=(1.0, 1.0, 0.0), **options):
        self.p.assign(start)
        options.setdefault("jit_compile", False)
        return tf_gradkit.least_squares(self.residuals, [self.p], **options)


def assert_same(a, b):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def test_a_repeated_call_only_runs_and_equals_an_uncached_call():
    problem = Decay()
    first = problem.fit()
    traces = problem.traces
    assert traces > 0
    again = problem.fit()
    assert problem.traces == traces  # no new trace
    info = solve_cache.SOLVES.info()
    assert (info.hits, info.misses, info.size) == (1, 1, 1)
    uncached = problem.fit(cache=False)
    assert problem.traces > traces
    assert_same(first, again)
    assert_same(again, uncached)
    np.testing.assert_allclose(first.x.numpy(), [2.5, 1.3, 0.5], atol=0.02)


def test_new_start_new_data_and_new_tolerances_are_inputs():
    """Start values, data held in a variable, tolerances and bound values
    change without a new trace, and give the uncached result."""
    problem = Decay()
    problem.fit(gtol=1e-10, bounds=([0, 0, -1], [10, 10, 1]))
    traces = problem.traces
    problem.y.assign(3.0 * np.exp(-0.7 * T) - 0.2)
    cases = [dict(start=(2.0, 0.5, 0.1), gtol=1e-12, bounds=([0, 0, -1], [10, 10, 1])),
             dict(start=(1.0, 1.0, 0.0), gtol=1e-9, xtol=1e-3,
                  bounds=([1, 0, -0.5], [4, 3, 0.5]))]
    for case in cases:
        cached = problem.fit(**case)
        assert problem.traces == traces, case
        assert_same(cached, problem.fit(cache=False, **case))
        problem.traces = traces
    np.testing.assert_allclose(problem.fit(**cases[0]).x.numpy(), [3.0, 0.7, -0.2],
                               atol=1e-6)


def _scipy_fit(**options):
    def residuals(p):
        return p[0] * np.exp(-p[1] * T) + p[2] - Y

    return so.least_squares(residuals, [1.0, 1.0, 0.0], method="trf", xtol=1e-15,
                            ftol=1e-15, gtol=1e-15, **options).x


@pytest.mark.parametrize("change, expected", [
    (dict(max_iterations=2), None),
    (dict(bounds=([-np.inf, -np.inf, -np.inf], [np.inf, np.inf, 0.4])),
     dict(bounds=([-np.inf, -np.inf, -np.inf], [np.inf, np.inf, 0.4]))),
    (dict(loss="soft_l1", f_scale=0.005), dict(loss="soft_l1", f_scale=0.005)),
    (dict(solver="cholesky"), {})])
def test_options_that_change_the_trace_are_separate_entries(change, expected):
    problem = Decay()
    problem.fit()
    size, traces = len(solve_cache.SOLVES), problem.traces
    changed = problem.fit(**change)
    assert problem.traces > traces and len(solve_cache.SOLVES) == size + 1
    traces = problem.traces
    assert_same(changed, problem.fit(**change))
    assert problem.traces == traces and solve_cache.SOLVES.info().hits == 1
    if expected is None:
        assert int(changed.iterations) == 2 and not bool(changed.converged)
    else:  # float64 round-off of well-conditioned fits
        np.testing.assert_allclose(changed.x.numpy(), _scipy_fit(**expected),
                                   rtol=1e-7, atol=1e-9)


def test_dtypes_shapes_and_variables_are_in_the_key():
    double, single = Decay(tf.float64), Decay(tf.float32)
    x64 = double.fit().x.numpy()
    x32 = single.fit().x.numpy()
    assert x32.dtype == np.float32 and x64.dtype == np.float64
    np.testing.assert_allclose(x32, x64, atol=1e-4)  # float32 round-off
    assert len(solve_cache.SOLVES) == 2
    # Another problem of the same shapes but its own variables: its own entry.
    other = Decay(y=2.0 * np.exp(-0.5 * T))
    np.testing.assert_allclose(other.fit().x.numpy(), [2.0, 0.5, 0.0], atol=1e-6)
    assert len(solve_cache.SOLVES) == 3


def test_a_rebound_capture_traces_anew_never_a_stale_result():
    """Data captured as a tensor, a NumPy array (mutated in place) or a
    Python number is part of the key: a change is a new trace."""
    p = tf.Variable([1.0, 1.0], dtype=tf.float64)
    t = tf.constant(T)
    data = {"y": tf.constant(2.0 * np.exp(-0.5 * T))}
    gain = np.ones([1])

    def residuals():
        return gain[0] * p[0] * tf.exp(-p[1] * t) - data["y"]

    def fit():
        p.assign([1.0, 1.0])
        return tf_gradkit.least_squares(residuals, [p], jit_compile=False).x.numpy()

    np.testing.assert_allclose(fit(), [2.0, 0.5], atol=1e-8)
    data["y"] = tf.constant(3.0 * np.exp(-0.25 * T))  # a captured dict's item
    np.testing.assert_allclose(fit(), [3.0, 0.25], atol=1e-8)
    gain[0] = 3.0  # an array changed in place: its bytes are keyed
    np.testing.assert_allclose(fit(), [1.0, 0.25], atol=1e-8)
    assert solve_cache.SOLVES.info().misses == 3

    scale = 2.0

    def scaled():
        return scale * (p[0] * tf.exp(-p[1] * t)) - data["y"]

    p.assign([1.0, 1.0])
    tf_gradkit.least_squares(scaled, [p], jit_compile=False)
    np.testing.assert_allclose(p.numpy(), [1.5, 0.25], atol=1e-8)
    scale = 3.0  # a closure cell rebound
    p.assign([1.0, 1.0])
    tf_gradkit.least_squares(scaled, [p], jit_compile=False)
    np.testing.assert_allclose(p.numpy(), [1.0, 0.25], atol=1e-8)


def test_a_new_lambda_from_the_same_line_finds_the_entry():
    p = tf.Variable([1.0, 1.0], dtype=tf.float64)
    t, y = tf.constant(T), tf.constant(2.0 * np.exp(-0.5 * T))
    results = []
    for _ in range(3):
        p.assign([1.0, 1.0])
        results.append(tf_gradkit.least_squares(
            lambda: p[0] * tf.exp(-p[1] * t) - y, [p], jit_compile=False))
    info = solve_cache.SOLVES.info()
    assert (info.misses, info.hits) == (1, 2)
    assert_same(results[0], results[2])


def test_the_cache_is_a_bounded_lru():
    cache = solve_cache.SolveCache(maxsize=2)
    builds = []

    def build(name):
        return lambda: builds.append(name) or name

    assert cache.lookup("a", build("a")) == ("a", False)
    assert cache.lookup("b", build("b")) == ("b", False)
    assert cache.lookup("a", build("a")) == ("a", True)  # "a" most recent
    assert cache.lookup("c", build("c")) == ("c", False)  # evicts "b"
    assert len(cache) == 2
    assert cache.lookup("b", build("b")) == ("b", False)
    assert builds == ["a", "b", "c", "b"]
    cache.maxsize = 0
    assert len(cache) == 0 and cache.lookup("a", build("a")) == ("a", False)
    assert len(cache) == 0
    with pytest.raises(ValueError, match=r"`maxsize` must be an integer >= 0\. "
                                         r"Received: maxsize=-1"):
        solve_cache.SolveCache(maxsize=-1)


def test_the_process_cache_stays_within_its_size():
    solve_cache.SOLVES.maxsize = 2
    try:
        for a in (1.0, 2.0, 3.0):
            problem = Decay(y=a * np.exp(-0.5 * T))
            np.testing.assert_allclose(problem.fit(max_iterations=50).x.numpy(),
                                       [a, 0.5, 0.0], atol=1e-7)
            assert len(solve_cache.SOLVES) <= 2
    finally:
        solve_cache.SOLVES.maxsize = solve_cache.DEFAULT_MAXSIZE


def test_keys_of_values():
    key = solve_cache.value_key
    assert key(0.0) != key(-0.0) and key(float("nan")) == key(float("nan"))
    assert key(1) != key(1.0) and key(True) != key(1)
    a = np.arange(3.0)
    before = key(a)
    a[0] = 5.0
    assert key(a) != before
    t = tf.constant(1.0)
    assert key(t) == key(t) and key(t) != key(tf.constant(1.0))

    def f():
        return a

    g = lambda: a  # noqa: E731
    assert solve_cache.function_key(f) == solve_cache.function_key(f)
    assert solve_cache.function_key(f) != solve_cache.function_key(g)


def test_inside_a_tf_function_nothing_is_cached():
    problem = Decay()

    @tf.function(autograph=False)
    def solve():
        return tf_gradkit.least_squares(problem.residuals, [problem.p],
                                        jit_compile=False).cost

    problem.p.assign([1.0, 1.0, 0.0])
    solve()
    assert len(solve_cache.SOLVES) == 0
    np.testing.assert_allclose(problem.p.numpy(), problem.fit().x.numpy(), atol=1e-12)


def test_jit_compile_is_checked():
    problem = Decay()
    with pytest.raises(ValueError, match=r"`jit_compile` must be True, False or "
                                         r"'auto'\. Received: jit_compile='yes'"):
        problem.fit(jit_compile="yes")
