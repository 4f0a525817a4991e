"""Levenberg-Marquardt: the core parts by hand, the step, and the Keras paths."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from conftest import MODES, compile_fn, keras_module, mode_with_function_slow
from helpers import (MATMUL_UNIT, float32_matmuls, max_abs_diff, mlp, regression_data,
                     weights_of)
from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib
from tf_gradkit.core.lm import step as step_lib


# "function" (tf.function without XLA) runs under `make test-slow` only: each
# test taking `mode` keeps its "jit" case, the graph-mode run of the same
# assertion (conftest.mode_with_function_slow).
mode = mode_with_function_slow()

F64 = tf.float64


# ------------------------------------------------------------ damping rules
@pytest.mark.keras_free   # tf_gradkit.core only: run once
def test_nielsen_rule_by_hand():
    rule = damping_lib.Nielsen(initial=1.0)
    state = rule.init(F64)
    # rho = 1 (perfect model): lambda /= 3; rho = 0.5: 1 - 0^3 = 1, unchanged.
    assert float(rule.accept(state, tf.constant(1.0, F64)).damping) == pytest.approx(1 / 3)
    assert float(rule.accept(state, tf.constant(0.5, F64)).damping) == pytest.approx(1.0)
    # rho = 0.25: 1 - (-0.5)^3 = 1.125.
    assert float(rule.accept(state, tf.constant(0.25, F64)).damping) == pytest.approx(1.125)
    once = rule.reject(state)
    twice = rule.reject(once)
    assert (float(once.damping), float(once.nu)) == (2.0, 4.0)
    assert (float(twice.damping), float(twice.nu)) == (8.0, 8.0)
    assert float(rule.accept(twice, tf.constant(1.0, F64)).nu) == 2.0


@pytest.mark.keras_free   # tf_gradkit.core only: run once
def test_multiply_divide_rule_and_clipping():
    rule = damping_lib.MultiplyDivide(initial=1e-3, floor=1e-4, ceiling=1e-1)
    state = rule.init(F64)
    assert float(rule.reject(state).damping) == pytest.approx(1e-2)
    assert float(rule.accept(state, tf.constant(0.9, F64)).damping) == pytest.approx(1e-4)
    low = rule.accept(rule.accept(state, tf.constant(0.9, F64)), tf.constant(0.9, F64))
    assert float(low.damping) == pytest.approx(1e-4)  # floor
    high = rule.reject(rule.reject(rule.reject(state)))
    assert float(high.damping) == pytest.approx(1e-1)  # ceiling


@pytest.mark.parametrize("cls,kwargs,match", [
    (damping_lib.Nielsen, {"initial": -1.0}, "`initial` must be a positive"),
    (damping_lib.Nielsen, {"initial": 10.0, "ceiling": 1.0}, "floor <= initial <= ceiling"),
    (damping_lib.MultiplyDivide, {"increase": 0.5}, "increase > 1"),
])
@pytest.mark.keras_free   # tf_gradkit.core only: run once
def test_bad_damping_arguments(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.keras_free   # tf_gradkit.core only: run once
def test_marquardt_scaling_is_a_running_max():
    scaling = damping_lib.Marquardt()
    scale = scaling.update(scaling.init(2, F64), tf.constant([4.0, 1.0], F64))
    scale = scaling.update(scale, tf.constant([2.0, 3.0], F64))
    np.testing.assert_array_equal(scale.numpy(), [4.0, 3.0])


# ------------------------------------------------------------ linear solvers
def _hand_problem():
    rng = np.random.RandomState(0)
    jac = rng.randn(7, 3)
    res = rng.randn(7)
    lin = solvers_lib.Linearization(
        cost=tf.constant(0.5 * res @ res), jtj=tf.constant(jac.T @ jac),
        jtr=tf.constant(jac.T @ res), residuals=tf.constant(res),
        jacobian=tf.constant(jac))
    return jac, res, lin


@pytest.mark.keras_free   # tf_gradkit.core only: run once
@pytest.mark.parametrize("solver", ["cholesky", "qr", "dual"])
def test_solvers_match_the_damped_normal_equations(solver):
    jac, res, lin = _hand_problem()
    d2 = np.array([1.0, 2.0, 0.5])
    lam = 0.3
    expected = np.linalg.solve(jac.T @ jac + lam * np.diag(d2), -jac.T @ res)
    step, ok = solvers_lib.SOLVERS[solver]().solve(lin, tf.constant(lam, F64),
                                                   tf.constant(d2))
    assert bool(ok)
    # float64 solves of a 3x3 system with condition ~10: 1e-12 is generous.
    np.testing.assert_allclose(step.numpy(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.keras_free   # tf_gradkit.core only: run once
def test_cholesky_reports_failure_instead_of_nan_step():
    lin = solvers_lib.Linearization(
        cost=tf.constant(1.0, F64), jtj=-tf.eye(2, dtype=F64),
        jtr=tf.ones([2], F64))
    step, ok = solvers_lib.Cholesky().solve(lin, tf.constant(0.0, F64),
                                            tf.ones([2], F64))
    assert not bool(ok)


@pytest.mark.keras_free   # tf_gradkit.core only: run once
def test_forward_and_reverse_jacobians_agree():
    a = tf.Variable([1.0, 2.0], dtype=F64)
    b = tf.Variable(0.5, dtype=F64)
    x = tf.constant(np.linspace(0, 1, 5))

    def fn():
        return a[0] * tf.exp(-b * x) + a[1] * x

    _, fwd = lin_lib.residuals_and_jacobian(fn, [a, b], F64, "forward")
    _, rev = lin_lib.residuals_and_jacobian(fn, [a, b], F64, "reverse")
    manual = np.stack([np.exp(-0.5 * x.numpy()), x.numpy(),
                       -x.numpy() * np.exp(-0.5 * x.numpy())], axis=1)
    np.testing.assert_allclose(fwd.numpy(), manual, rtol=1e-12)
    np.testing.assert_allclose(rev.numpy(), manual, rtol=1e-12)


# ------------------------------------------------------------ the step
def _step(variables, residual_fn, solver="cholesky", max_attempts=10, initial=1e-3):
    controller = damping_lib.Nielsen(initial=initial, floor=1e-300)
    scaling = damping_lib.Marquardt()
    solver = solvers_lib.SOLVERS[solver]()
    lin = lin_lib.linearize_as(solver.consumes, residual_fn, variables, F64)
    state = step_lib.init_state(controller, scaling, 2, F64)
    return step_lib.levenberg_marquardt_step(
        lin, lambda: 0.5 * tf.reduce_sum(tf.square(residual_fn())), variables,
        state, controller=controller, scaling=scaling, solver=solver,
        max_attempts=max_attempts)


@pytest.mark.parametrize("solver", ["cholesky", "qr", "dual"])
@pytest.mark.keras_free  # tf_gradkit.core/least_squares only: the same in either process
def test_linear_problem_solved_in_one_nearly_undamped_step(solver, mode):
    x = tf.constant(np.linspace(0, 1, 6))
    y = 3.0 * x - 1.0
    w = tf.Variable(0.0, dtype=F64)
    c = tf.Variable(0.0, dtype=F64)
    fn = compile_fn(lambda: _step([w, c], lambda: w * x + c - y, solver,
                                  initial=1e-12)[1], mode)
    info = fn()
    assert bool(info.accepted) and int(info.attempts) == 1
    # lambda = 1e-12 perturbs the exact solution by ~1e-12 relative.
    assert float(w) == pytest.approx(3.0, abs=1e-9)
    assert float(c) == pytest.approx(-1.0, abs=1e-9)


@pytest.mark.keras_free  # tf_gradkit.core/least_squares only: the same in either process
def test_rejected_steps_restore_weights_exactly(mode):
    w = tf.Variable(0.7, dtype=F64)
    c = tf.Variable(-0.2, dtype=F64)
    x = tf.constant(np.linspace(0, 1, 6))
    # A float counter: TensorFlow keeps an int32 variable in host memory on
    # a GPU, where an XLA step cannot reach it.
    calls = tf.Variable(0.0, dtype=F64)

    def residuals():
        # Finite at the starting point (linearisation), NaN at every trial.
        calls.assign_add(1.0)
        bad = tf.cast(calls > 1.5, F64) * np.nan
        return w * x + c + tf.where(calls > 1.5, bad, tf.zeros_like(x))

    def run():
        return _step([w, c], residuals, max_attempts=4)

    state, info = compile_fn(run, mode)()
    assert not bool(info.accepted) and int(info.attempts) == 4
    assert float(w) == 0.7 and float(c) == -0.2   # bit for bit
    assert float(state.damping) > 1e-3             # damping was raised


# ------------------------------------------------------------ least_squares
# "function" here is least_squares called inside a tf.function of the
# caller's (not the jit_compile flag): its only test, so it keeps all three.
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.keras_free  # tf_gradkit.core/least_squares only: the same in either process
def test_least_squares_reports_convergence(mode):
    a = tf.Variable(1.0, dtype=F64)
    b = tf.Variable(0.1, dtype=F64)
    x = tf.constant([1.0, 2.0, 3.0, 4.0], F64)
    y = 2.5 * tf.exp(-0.3 * x) + tf.constant([1e-3, -1e-3, 2e-3, 0.0], F64)

    def solve():
        return tf_gradkit.least_squares(lambda: a * tf.exp(-b * x) - y, [a, b],
                                        jit_compile=(mode == "jit"))

    def gradient():   # J^T r
        with tf.GradientTape() as tape:
            cost = 0.5 * tf.reduce_sum(tf.square(a * tf.exp(-b * x) - y))
        return np.array([float(g) for g in tape.gradient(cost, [a, b])])

    start = np.max(np.abs(gradient()))
    result = solve() if mode != "function" else tf.function(solve)()
    assert bool(result.converged)
    assert int(result.iterations) < 50
    expected_reasons = {"gradient tolerance", "step tolerance", "cost tolerance"}
    reason = result.reason if isinstance(result.reason, str) else result.reason.numpy().decode()
    assert reason in expected_reasons
    # Reference: scipy-free check of optimality, J^T r = 0 at the minimum, to
    # the default tolerances (1e-8) relative to the start's. (The engines stop
    # at different tests: XLA on the cost's at |J^T r| = 1.5e-12, the others
    # on the step's at 7e-16; both are minima to 1e-8.)
    final = gradient()
    assert np.all(np.isfinite(final)) and np.max(np.abs(final)) <= 1e-8 * start


@pytest.mark.keras_free  # tf_gradkit.core/least_squares only: the same in either process
def test_least_squares_iteration_limit_is_not_convergence():
    a = tf.Variable(10.0, dtype=F64)
    x = tf.constant(np.linspace(0, 3, 20))
    result = tf_gradkit.least_squares(lambda: tf.exp(-a * x) - tf.exp(-x), [a],
                                      max_iterations=1)
    assert result.reason == "iteration limit" and not bool(result.converged)


@pytest.mark.parametrize("kwargs,match", [
    ({"var_list": []}, "`var_list` is empty"),
    ({"max_iterations": -1}, "`max_iterations` must be an integer >= 0"),
    ({"solver": "svd"}, "`solver` must be one of"),
    ({"controller": "gauss"}, "`controller` must be one of"),
])
def test_least_squares_bad_input(kwargs, match):
    a = tf.Variable(1.0, dtype=F64)
    args = {"residual_fn": lambda: a - 1.0, "var_list": [a]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        tf_gradkit.least_squares(**args)
    assert float(a) == 1.0


# ------------------------------------------------------------ Keras paths
def _relative_diff(a, b):
    """Max difference relative to the largest weight: float32 normal equations
    lose eps * cond(J^T J + lambda D^2) ~ 6e-8 * 1e3 relative, so 1e-4 leaves
    room for summation order while a wrong weighting shows at 1e-2."""
    scale = max(float(np.max(np.abs(w))) for w in a)
    return max_abs_diff(a, b) / scale


def test_fit_reports_metrics_damping_and_attempts(K, gk):
    x, y = regression_data(n=64)
    model = mlp(K, hidden=8)
    model.compile(optimizer=gk.LevenbergMarquardt(model), loss="mse",
                  metrics=["mae"])
    history = model.fit(x, y, batch_size=64, epochs=5, verbose=0)
    keys = set(history.history)
    assert {"loss", "mae", "damping", "attempts"} <= keys
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
    assert int(model.optimizer.iterations.numpy()) == 5


# Graph mode without XLA (jit=False) under `make test-slow`: the same check
# as the XLA case's.
@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow), True])
def test_fit_sample_weights_count_like_the_loss(K, gk, jit):
    # Zero-weight rows contribute nothing: one LM step on the weighted batch
    # equals one step on the rows that carry weight. (Float32 products: with
    # TF32 the two batch shapes' kernels round differently, 1.3e-3 apart
    # under XLA on an H200.)
    x, y = regression_data(n=32)
    w = np.r_[np.ones(20), np.zeros(12)].astype("float32")
    with float32_matmuls():
        weighted = mlp(K)
        weighted.compile(optimizer=gk.LevenbergMarquardt(weighted), loss="mse",
                         jit_compile=jit)
        weighted.fit(x, y, sample_weight=w, batch_size=32, epochs=1, shuffle=False,
                     verbose=0)
        subset = mlp(K)
        subset.compile(optimizer=gk.LevenbergMarquardt(subset), loss="mse",
                       jit_compile=jit)
        subset.fit(x[:20], y[:20], batch_size=20, epochs=1, shuffle=False, verbose=0)
    assert _relative_diff(weights_of(weighted), weights_of(subset)) < 1e-4


def test_chunked_jacobian_equals_whole(K, gk):
    x, y = regression_data(n=26)
    whole = mlp(K)
    whole.compile(optimizer=gk.LevenbergMarquardt(whole), loss="mse")
    whole.fit(x, y, batch_size=26, epochs=1, shuffle=False, verbose=0)
    chunked = mlp(K)
    chunked.compile(optimizer=gk.LevenbergMarquardt(chunked, chunk_size=7),
                    loss="mse")
    chunked.fit(x, y, batch_size=26, epochs=1, shuffle=False, verbose=0)
    assert _relative_diff(weights_of(whole), weights_of(chunked)) < 1e-4


def test_minimize_fits_a_curve(gk, mode):
    a = tf.Variable(1.0)
    b = tf.Variable(0.1)
    x = tf.constant(np.linspace(0, 2, 30), tf.float32)
    y = 2.0 * tf.exp(-1.5 * x)
    opt = gk.LevenbergMarquardt()
    step = compile_fn(lambda: opt.minimize(lambda: a * tf.exp(-b * x) - y, [a, b]),
                      mode)
    # The cost falls below 1e-8 at the 4th step and is 0.0 from the 5th
    # (float32, seed 0, both flavours): 10 steps leave twice that.
    for _ in range(10):
        cost = step()
    assert float(cost) < 1e-8
    assert float(a) == pytest.approx(2.0, rel=1e-3)
    assert float(b) == pytest.approx(1.5, rel=1e-3)
    assert int(opt.iterations.numpy()) == 10


def test_minimize_with_ensure_shape_takes_the_jacobian_by_reverse_mode(gk):
    """TensorFlow's forward mode cannot trace `tf.ensure_shape` in a
    tf.function: the Keras LM's Jacobian then comes from reverse mode
    (`linearize.forward_or_reverse`, with a warning), and its steps are those
    of the same residuals written with `set_shape` (forward mode). Float32:
    the two modes round differently, about 1e-7 of each column, which five
    damped steps of this well-conditioned fit keep below 1e-4."""
    x = tf.constant(np.linspace(0, 2, 30), tf.float32)
    y = 2.0 * tf.exp(-1.5 * x)

    def ensure(r):
        return tf.ensure_shape(r, [30])

    def set_shape(r):
        r.set_shape([30])
        return r

    def run(shaped):
        a, b = tf.Variable(1.0), tf.Variable(0.1)
        opt = gk.LevenbergMarquardt()
        step = compile_fn(
            lambda: opt.minimize(lambda: shaped(a * tf.exp(-b * x) - y), [a, b]), "jit")
        for _ in range(5):
            step()
        return np.array([float(a), float(b)])

    with pytest.warns(UserWarning, match=r"reverse-mode.*tf\.ensure_shape.*set_shape"):
        got = run(ensure)
    want = run(set_shape)
    assert np.all(np.isfinite(got)) and not np.allclose(want, [1.0, 0.1])   # it moved
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_wrong_use_raises_with_how_to(K, gk):
    x, y = regression_data(n=16)
    model = mlp(K)
    model.compile(optimizer=gk.LevenbergMarquardt(), loss="mse")  # no model
    with pytest.raises(ValueError, match="needs residuals"):
        model.fit(x, y, epochs=1, verbose=0)
    opt = gk.LevenbergMarquardt()
    with pytest.raises(ValueError, match="needs residuals"):
        opt.apply_gradients([(tf.zeros([1]), tf.Variable([0.0]))])
    with pytest.raises(ValueError, match="zero-argument callable"):
        opt.minimize(tf.constant(1.0), [tf.Variable(1.0)])
    other = mlp(K)
    other.compile(optimizer=gk.LevenbergMarquardt(other), loss="msle")
    with pytest.raises(ValueError, match="mean squared error"):
        other.fit(x, y, epochs=1, verbose=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"max_attempts": 0}, "`max_attempts` must be an integer >= 1"),
    ({"chunk_size": -3}, "`chunk_size` must be None or an integer >= 1"),
    ({"solver": "lu"}, "`solver` must be one of"),
    ({"model": "net"}, "`model` must be a"),
    ({"initial_damping": 0.0}, "`initial_damping` must be a positive number"),
    ({"initial_damping": "1e-2"}, "`initial_damping` must be a positive number"),
    ({"initial_damping": 1e-2, "controller": "trust_region"}, "has none"),
    ({"initial_damping": 1e20}, "between the controller's floor"),
])
def test_bad_constructor_arguments(gk, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        gk.LevenbergMarquardt(**kwargs)


@pytest.mark.parametrize("controller", ["nielsen", "multiply_divide"])
def test_initial_damping_without_importing_the_core(gk, controller):
    """`initial_damping=` is the controller's `initial`: the same steps as
    passing the controller object, saved with it; a passed object is not
    changed."""
    x = tf.constant(np.linspace(-1.0, 1.0, 30))
    y = tf.sin(2.0 * x)

    def run(opt):
        w = tf.Variable([0.5, 0.5], dtype=tf.float64)
        for _ in range(2):  # the second step starts from the first's damping
            opt.minimize(lambda: w[0] * tf.sin(w[1] * x) - y, [w])
        return w.numpy(), float(opt.damping)

    by_name = gk.LevenbergMarquardt(controller=controller, initial_damping=0.7)
    part = damping_lib.CONTROLLERS[controller](initial=0.7)
    by_object = gk.LevenbergMarquardt(controller=part)
    np.testing.assert_array_equal(run(by_name)[0], run(by_object)[0])
    assert run(gk.LevenbergMarquardt(controller=controller))[0].tolist() != \
        run(by_name)[0].tolist()
    assert by_name.get_config()["controller"]["config"]["initial"] == 0.7
    clone = gk.LevenbergMarquardt.from_config(by_name.get_config())
    assert clone.get_config() == by_name.get_config()
    shared = damping_lib.Nielsen(initial=1e-3)
    gk.LevenbergMarquardt(controller=shared, initial_damping=0.7)
    assert shared.initial == 1e-3


def test_get_config_round_trip(gk):
    opt = gk.LevenbergMarquardt(controller="multiply_divide", scaling="levenberg",
                                solver="qr", max_attempts=4, chunk_size=100)
    clone = gk.LevenbergMarquardt.from_config(opt.get_config())
    assert clone.get_config() == opt.get_config()


def test_mixed_precision_model_trains_with_float32_solve(K, gk):
    x = np.linspace(-1, 1, 400, dtype="float32")[:, None]
    y = np.sinc(5 * x).astype("float32")
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = K.Sequential([K.Input((1,)), K.layers.Dense(10, activation="tanh"),
                              K.layers.Dense(1, dtype="float32")])
        opt = gk.LevenbergMarquardt(model)
        model.compile(optimizer=opt, loss="mse")
        history = model.fit(x, y, batch_size=400, epochs=30, verbose=0)
    finally:
        K.mixed_precision.set_global_policy("float32")
    assert opt.damping.dtype == tf.float32
    # 30 epochs: over 12 seeds x 2 flavours the worst final/initial ratio was
    # 0.026 (10 epochs ranged up to 0.61 -- too early to judge). 0.1 leaves 4x.
    assert history.history["loss"][-1] < 0.1 * history.history["loss"][0]


def test_multi_output_residuals_match_the_compiled_loss(K, gk):
    # 0.5 |r|^2 must be 0.5 * batch * (Keras's loss) with loss_weights and
    # sample weights, so LM minimises exactly what fit reports.
    from tf_gradkit._algorithms import lm_losses  # noqa: PLC0415
    inputs = K.Input((3,))
    model = K.Model(inputs, {"a": K.layers.Dense(1, name="a")(inputs),
                             "b": K.layers.Dense(2, name="b")(inputs)})
    model.compile(optimizer=gk.LevenbergMarquardt(model),
                  loss={"a": "mse", "b": "mse"}, loss_weights={"a": 2.0, "b": 0.5})
    rng = np.random.RandomState(0)
    x = rng.randn(10, 3).astype("float32")
    y = {"a": rng.randn(10, 1).astype("float32"), "b": rng.randn(10, 2).astype("float32")}
    sw = rng.rand(10).astype("float32")
    pred = model(x)
    # What fit's step runs: each output's term read from the compiled loss,
    # then its residual rows.
    terms = lm_losses.read_output_losses(model.optimizer, model, y, pred)
    r = lm_losses.residual_rows(terms, y, pred, sw, tf.float64)
    pa, pb = pred["a"].numpy(), pred["b"].numpy()

    def by_hand(wa, wb):
        return (wa * np.mean(sw * np.mean((pa - y["a"]) ** 2, 1))
                + wb * np.mean(sw * np.mean((pb - y["b"]) ** 2, 1)))

    # float32 data and predictions: 1e-5 relative.
    got = 0.5 * float(tf.reduce_sum(r ** 2))
    assert got == pytest.approx(0.5 * 10 * by_hand(2.0, 0.5), rel=1e-5)
    assert got != pytest.approx(0.5 * 10 * by_hand(0.5, 2.0), rel=1e-3)  # control
    history = model.fit(x, y, sample_weight=sw, batch_size=10, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


@pytest.mark.keras_free  # tf_gradkit.core/least_squares only: the same in either process
def test_matrix_free_cg_step_equals_cholesky_step(mode):
    # One LM iteration: CG run to a tight tolerance gives the Cholesky step.
    from tf_gradkit.core.lm import linearize as lin_lib  # noqa: PLC0415
    rng = np.random.RandomState(0)
    x = tf.constant(np.linspace(0, 1, 12))
    y = tf.constant(rng.randn(12))

    def run(solver):
        a = tf.Variable([1.0, -0.5, 0.3], dtype=F64)
        b = tf.Variable(0.7, dtype=F64)
        controller = damping_lib.Nielsen(initial=1e-2)
        scaling = damping_lib.Levenberg()

        def residual_fn():
            return a[0] * tf.exp(-b * x) + a[1] * x + a[2] * x ** 2 - y

        def one_iteration():
            lin = lin_lib.linearize_as(solver.consumes, residual_fn, [a, b], F64)
            state = step_lib.init_state(controller, scaling, 4, F64)
            return step_lib.levenberg_marquardt_step(
                lin, lambda: 0.5 * tf.reduce_sum(tf.square(residual_fn())),
                [a, b], state, controller=controller, scaling=scaling,
                solver=solver, max_attempts=5)[1]

        info = compile_fn(one_iteration, mode)()
        assert bool(info.accepted)
        return np.r_[a.numpy(), b.numpy()]

    cg = run(solvers_lib.ConjugateGradient(max_iterations=20, tolerance=1e-13))
    chol = run(solvers_lib.Cholesky())
    assert np.max(np.abs(chol - np.array([1.0, -0.5, 0.3, 0.7]))) > 1e-3  # it moved
    np.testing.assert_allclose(cg, chol, rtol=1e-9, atol=1e-11)


def test_cg_solver_trains_through_fit_and_needs_levenberg(K, gk):
    with pytest.raises(ValueError, match="needs scaling='levenberg'"):
        gk.LevenbergMarquardt(solver="cg")
    x, y = regression_data(n=64)
    model = mlp(K, hidden=8)
    model.compile(optimizer=gk.LevenbergMarquardt(model, solver="cg",
                                                  scaling="levenberg"),
                  loss="mse", jit_compile=True)
    history = model.fit(x, y, batch_size=64, epochs=8, verbose=0)
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]


@pytest.mark.keras_free  # tf_gradkit.core/least_squares only: the same in either process
def test_least_squares_with_cg():
    a = tf.Variable(1.0, dtype=F64)
    b = tf.Variable(0.1, dtype=F64)
    x = tf.constant(np.linspace(0, 3, 20))
    y = 2.5 * tf.exp(-0.3 * x)
    result = tf_gradkit.least_squares(lambda: a * tf.exp(-b * x) - y, [a, b],
                                      solver="cg", scaling="levenberg")
    assert bool(result.converged)
    assert float(a) == pytest.approx(2.5, rel=1e-8)
    assert float(b) == pytest.approx(0.3, rel=1e-8)


def _damped_system(model, opt, x, y, loss):
    """``(cond(S A S), s)`` for the damped matrix ``A = J^T J + lambda D^2``
    (or the GGN's) of the next LM step and its Jacobi scaling
    ``S = diag(s) = diag(A)^-1/2``, in float64."""
    from tf_gradkit.core.lm import ggn as ggn_lib  # noqa: PLC0415

    tf_vars = [opt._tf_variable(v) for v in model.trainable_variables]
    if loss == "mse":
        lin = lin_lib.linearize(lambda: model(x, training=True) - y, tf_vars,
                                False, tf.float32)
    else:
        lin = ggn_lib.linearize_cross_entropy(
            lambda: model(x, training=True), y, tf.fill([len(x)], 1.0 / len(x)),
            tf_vars, "sparse_categorical", True, tf.float32)
    jtj = lin.jtj.numpy().astype("float64")
    d2 = np.maximum(opt._lm_vars.scale.numpy(), np.diag(jtj))
    a = jtj + float(opt.damping.numpy()) * np.diag(d2)
    s = 1.0 / np.sqrt(np.diag(a))
    return np.linalg.cond(a * s[:, None] * s[None, :]), s


@pytest.mark.distributed
@pytest.mark.parametrize("loss", ["mse", "sparse_categorical_crossentropy"])
def test_mirrored_strategy_equals_single_device(K, gk, mirrored, loss):
    # J^T J and J^T r are summed across replicas and every replica takes the
    # same step: full-batch LM on two replicas equals one device. Compared
    # one step at a time from identical states (weights and LM state copied
    # over after each step), so round-off is not amplified across steps. The
    # two runs differ only in the order J^T J, J^T r and the cost are
    # summed (two halves of the batch, then the all-reduce): componentwise
    # error <= N u |J|^T |J| (u = the matmul unit round-off, N = 32 rows).
    # In the Jacobi-scaled coordinates z = diag(A)^1/2 d of the damped matrix
    # A that is a relative error <= N u in the scaled matrix, so the scaled
    # step moves by at most cond(S A S) N u relative; 4x that is the bound.
    # (One batch per epoch, so both
    # see the same examples per step: Keras composes distributed batches
    # from non-contiguous examples.)
    x, y = regression_data(n=32)
    if loss != "mse":
        y = (x[:, :1] > 0).astype("int32") + (x[:, 1:2] > 0).astype("int32")

    def build():
        model = mlp(K, hidden=6) if loss == "mse" else _three_class(K)
        model.compile(optimizer=gk.LevenbergMarquardt(model), loss=loss)
        return model

    ref = build()
    ref.optimizer.build(ref.trainable_variables)
    with mirrored.scope():
        model = build()
    for _ in range(4):
        condition, scale = _damped_system(ref, ref.optimizer, x, y, loss)
        bound = 4 * condition * 32 * MATMUL_UNIT
        before = weights_of(ref)
        ref_hist = ref.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        hist = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        assert hist.history["attempts"] == ref_hist.history["attempts"]
        flat = lambda ws: np.concatenate([  # noqa: E731 - scaled step z
            (a - b).ravel() for a, b in zip(ws, before)]) / scale
        step, mirrored_step = flat(weights_of(ref)), flat(weights_of(model))
        # (A step whose attempts were all rejected is exactly 0 on both.)
        assert np.linalg.norm(step - mirrored_step) <= bound * np.linalg.norm(step)
        np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"],
                                   rtol=32 * MATMUL_UNIT)
        # Continue both from the reference state.
        model.set_weights(ref.get_weights())
        for mine, theirs in zip(tf.nest.flatten(model.optimizer._lm_vars),
                                tf.nest.flatten(ref.optimizer._lm_vars)):
            mine.assign(theirs)


def _three_class(K):
    model = K.Sequential([K.Input((3,)), K.layers.Dense(6, activation="tanh"),
                          K.layers.Dense(3)])
    rng = np.random.RandomState(1)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                       for w in model.get_weights()])
    return model


@pytest.mark.keras_free   # tf_gradkit.core only: run once
@pytest.mark.parametrize("alpha,expected", [(4.0, 1.0 + 1.5 - 1.125), (0.75, 1.0 + 1.5)])
def test_geodesic_acceleration_by_hand(alpha, expected):
    # r(x) = x^2 - 4 at x = 1: J = 2, r = -3, velocity v = 1.5 (no damping);
    # r_vv = 2 v^2 = 4.5 exactly (central difference of a quadratic);
    # a = -J r_vv / J^2 = -2.25 and 2|a|/|v| = 3: kept when alpha = 4
    # (step v + a/2), replaced by the plain step v when alpha = 0.75.
    from tf_gradkit.core.lm import geodesic  # noqa: PLC0415
    x = tf.Variable(1.0, dtype=F64)

    def residual_fn():
        return tf.reshape(x * x - 4.0, [1])

    lin = lin_lib.linearize(residual_fn, [x], False, F64)
    solver = solvers_lib.Cholesky()
    tiny = tf.constant(1e-14, F64)
    velocity, _ = solver.solve(lin, tiny, tf.ones([1], F64))
    accel = geodesic.GeodesicAcceleration(residual_fn, alpha=alpha)
    step, ok = accel.correct(lin, velocity, tiny, tf.ones([1], F64), solver, [x],
                             [tf.identity(x)])
    assert bool(ok) and float(x) == 1.0   # variables left where they were
    assert 1.0 + float(step[0]) == pytest.approx(expected, rel=1e-9)


@pytest.mark.keras_free  # tf_gradkit.core/least_squares only: the same in either process
def test_least_squares_with_geodesic_acceleration_converges():
    a = tf.Variable(1.0, dtype=F64)
    b = tf.Variable(0.1, dtype=F64)
    x = tf.constant(np.linspace(0, 3, 20))
    y = 2.5 * tf.exp(-0.3 * x)
    result = tf_gradkit.least_squares(lambda: a * tf.exp(-b * x) - y, [a, b],
                                      geodesic_acceleration=True)
    assert bool(result.converged)
    assert float(b) == pytest.approx(0.3, rel=1e-8)


def test_subclassed_unbuilt_model_with_steps_per_execution(K, gk):
    # Seeded initializers: the global Keras RNG's state depends on the tests
    # that ran before (one start in eight halves the loss only by 0.51x).
    class TwoLayer(K.Model):
        def __init__(self):
            super().__init__()
            self.hidden = K.layers.Dense(
                8, activation="tanh", kernel_initializer=K.initializers.GlorotUniform(seed=0))
            self.out = K.layers.Dense(
                1, kernel_initializer=K.initializers.GlorotUniform(seed=100))

        def call(self, inputs):
            return self.out(self.hidden(inputs))

    x, y = regression_data(n=64)
    model = TwoLayer()  # not built: LM builds its state at the first step
    model.compile(optimizer=gk.LevenbergMarquardt(model), loss="mse",
                  steps_per_execution=2)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 16
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]


def test_targets_not_matching_outputs_raise(K, gk):
    from tf_gradkit._algorithms import lm_losses  # noqa: PLC0415
    inputs = K.Input((3,))
    two = K.Model(inputs, [K.layers.Dense(1, name="a")(inputs),
                           K.layers.Dense(2, name="b")(inputs)])
    two.compile(optimizer=gk.LevenbergMarquardt(two), loss=["mse", "mse"])
    preds = two(np.zeros((4, 3), "float32"))
    terms = lm_losses.read_output_losses(two.optimizer, two,
                                         [tf.zeros([4, 1]), tf.zeros([4, 2])], preds)
    with pytest.raises(ValueError, match="2 outputs with a loss but the data has 1 targets"):
        lm_losses.residual_rows(terms, tf.zeros([4, 1]), preds, None, tf.float32)
    model = mlp(K)
    model.compile(optimizer=gk.LevenbergMarquardt(model), loss="mse")
    x, _ = regression_data(n=8)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):  # (8, 3) vs (8, 1)
        model.fit(x, np.zeros((8, 3), "float32"), epochs=1, verbose=0)


# -- the mini-batch guard ----------------------------------------------------

def _guard_data():
    """384 examples, 10 features, a smooth target plus noise: a 10-20-1 MLP
    has 241 parameters, more than a batch of 48 has residuals."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(384, 10)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=10) / 2) + 0.3 * x[:, 0] * x[:, 1]
         + 0.3 * rng.normal(size=384)).astype("float32")[:, None]
    return x, y


def _guard_model(K, seed=0):
    K.utils.set_random_seed(seed)
    return K.Sequential([K.Input((10,)), K.layers.Dense(20, activation="tanh"),
                         K.layers.Dense(1)])


def test_minibatch_guard_keeps_small_batches_from_collapsing(K, gk):
    """Batches of 48 (fewer residuals than parameters), 20 epochs under fit,
    two seeds pooled. Without the guard each step fits its own batch, lambda
    sinks and the training MSE ends 0.24-0.66 over seeds 0-5; with it
    0.07-0.21. One seed alone is a chaotic training's outcome: a change of
    round-off (XLA's CPU emitters) moved seed 0 at 40 epochs from a ratio of
    0.49 to 0.77, and its final damping from 5x to 0.9x the unguarded one.
    Pooled over seeds 0 and 1 (both flavours, both emitters) the MSE ratio
    was 0.19-0.43 (0.75 leaves margin) and the geometric mean of the damping
    ratios 5.6-12.7 (single seeds 1.6-16.5; 2 leaves margin)."""
    x, y = _guard_data()
    mse = {True: 0.0, False: 0.0}
    damping = {True: [], False: []}
    for seed in (0, 1):
        for guard in (True, False):
            model = _guard_model(K, seed)
            opt = gk.LevenbergMarquardt(model, minibatch_guard=guard)
            model.compile(optimizer=opt, loss="mse", jit_compile=True)
            model.fit(x, y, batch_size=48, epochs=20, verbose=0, shuffle=True)
            mse[guard] += float(np.mean((model.predict(x, verbose=0) - y) ** 2))
            damping[guard].append(float(opt.damping))
    assert np.isfinite(list(mse.values())).all(), mse
    assert mse[True] < 0.75 * mse[False], (mse, damping)
    # The unguarded damping sank below the guarded one.
    ratios = np.array(damping[True]) / np.array(damping[False])
    assert np.exp(np.mean(np.log(ratios))) > 2, (mse, damping)


@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow), "jit"])
def test_minibatch_guard_changes_nothing_on_a_full_batch(K, gk, mode):
    """The same batch every step: all of a step's decrease carries over, the
    guard never fires, and the weights equal the unguarded run's. (8 steps:
    the guard compares each step with the last, so it could fire from the
    second on; 20 steps under XLA checked the same.)"""
    x, y = _guard_data()
    weights = {}
    for guard in (True, False):
        model = _guard_model(K)
        model.compile(optimizer=gk.LevenbergMarquardt(model, minibatch_guard=guard),
                      loss="mse", jit_compile=mode == "jit", run_eagerly=mode == "eager")
        model.fit(x, y, batch_size=384, epochs=8, verbose=0)
        weights[guard] = [w.numpy() for w in model.trainable_variables]
    # The guard adds operations to the compiled step, which may round the
    # step's own sums differently (fusion): float32 round-off over 8 steps.
    assert max_abs_diff(weights[True], weights[False]) < 1e-5


def test_minibatch_guard_in_a_custom_loop(K, gk):
    """minimize() over mini-batches: the same guard, same effect. 20 epochs:
    the guarded/unguarded MSE ratio was 0.37, 0.31, 0.16, 0.20 at epoch 20
    against 0.34, 0.34, 0.24, 0.42 at epoch 40 (seeds 0-3, Keras 3), so the
    shorter run separates the two as clearly."""
    x, y = _guard_data()
    results = {}
    for guard in (True, False):
        model = _guard_model(K)
        opt = gk.LevenbergMarquardt(minibatch_guard=guard)

        @tf.function(jit_compile=True)
        def step(xb, yb):
            return opt.minimize(lambda: model(xb, training=True) - yb,
                                model.trainable_variables)

        rng = np.random.default_rng(0)
        for _ in range(20):
            order = rng.permutation(384)
            for i in range(0, 384, 48):
                step(x[order[i:i + 48]], y[order[i:i + 48]])
        results[guard] = float(np.mean((model(x).numpy() - y) ** 2))
    assert results[True] < 0.75 * results[False], results


def test_minibatch_guard_is_checked_and_saved(gk):
    with pytest.raises(ValueError, match="`minibatch_guard` must be True or False"):
        gk.LevenbergMarquardt(minibatch_guard="yes")
    opt = gk.LevenbergMarquardt(minibatch_guard=False)
    assert gk.LevenbergMarquardt.from_config(opt.get_config()).minibatch_guard is False


# -- robust losses under fit ---------------------------------------------------

def _outlier_data():
    """sin(3x) with noise 0.05 and 10% gross outliers (+-3)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (400, 1)).astype("float32")
    y = (np.sin(3 * x) + 0.05 * rng.normal(size=x.shape)).astype("float32")
    hit = rng.choice(400, 40, replace=False)
    y[hit] += rng.choice([-1.0, 1.0], (40, 1)).astype("float32") * 3.0
    return x, y, np.sin(3 * x)


# The MSE fit each robust loss is compared with, per mode: seeded and
# deterministic, so it is trained once per process (Huber's case, then MAE's).
_MSE_BASELINE = {}


@pytest.mark.parametrize("loss", ["huber", "mae"])
@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow), "jit"])
def test_robust_losses_train_through_fit(K, gk, loss, mode):
    """Huber (delta 0.1) and MAE as robust residuals: LM minimises the
    compiled loss itself (on a full batch every accepted step lowers it, so
    the logged loss never rises) and ignores the outliers that pull an MSE
    fit away: measured RMS error to the clean curve 0.010 (Huber), 0.013
    (MAE) against MSE's 0.177 (seed 0, 60 epochs under XLA); after the 30
    epochs run here 0.009 (Huber), 0.011-0.012 (MAE) against MSE's 0.142 (both
    flavours), the same separation. Eagerly, 10 epochs check the same
    path: the loss falls without ever rising."""
    x, y, clean = _outlier_data()
    errors = {}
    for name in (loss, "mse"):
        if name == "mse" and mode in _MSE_BASELINE:  # the same seeded fit
            errors[name] = _MSE_BASELINE[mode]
            continue
        K.utils.set_random_seed(0)
        model = K.Sequential([K.Input((1,)), K.layers.Dense(10, activation="tanh"),
                              K.layers.Dense(1)])
        compiled = K.losses.Huber(0.1) if name == "huber" else name
        model.compile(optimizer=gk.LevenbergMarquardt(model), loss=compiled,
                      run_eagerly=mode == "eager", jit_compile=mode == "jit")
        history = model.fit(x, y, batch_size=400, epochs=30 if mode == "jit" else 10,
                            verbose=0)
        losses = np.array(history.history["loss"])
        assert np.all(np.diff(losses) <= 1e-6 * losses[:-1]), losses
        errors[name] = float(np.sqrt(np.mean((model.predict(x, verbose=0) - clean) ** 2)))
        if name == loss:
            robust_losses = losses
        else:
            _MSE_BASELINE[mode] = errors[name]
    losses = robust_losses
    if mode == "jit":
        assert errors[loss] < 0.05 and errors[loss] < 0.3 * errors["mse"], errors
    else:
        assert losses[-1] < 0.85 * losses[0], losses  # measured 0.78 (Huber)


def test_huber_delta_is_read_from_the_loss(K, gk):
    # `classify` is what fit's step reads each compiled loss with (a name
    # as compile resolves it).
    from tf_gradkit._algorithms import lm_losses  # noqa: PLC0415
    host = gk.LevenbergMarquardt(mlp(K))
    read = lambda loss: lm_losses.classify(host, "o", K.losses.get(loss))  # noqa: E731
    assert read(K.losses.Huber(0.25)).robust.f_scale == 0.25
    assert read("huber").robust.f_scale == 1.0
    assert read("mae").robust.name == "absolute"
    assert read("mse").family == "squared" and read("mse").robust is None


# -- residuals of your own under fit ---------------------------------------------

@keras_module().saving.register_keras_serializable(package="tests")
def scaled_residuals(model, x, y, sample_weight):
    """A residual function registered with Keras: saved by name."""
    del sample_weight
    return 2.0 * (model(x, training=True) - y)


def _sine():
    x = np.linspace(-1, 1, 200, dtype="float32")[:, None]
    return x, np.sin(3 * x).astype("float32")


def _small_net(K):
    K.utils.set_random_seed(0)
    return K.Sequential([K.Input((1,)), K.layers.Dense(8, activation="tanh"),
                         K.layers.Dense(1)])


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_own_residuals_equal_the_compiled_mse(K, gk, mode):
    """residuals = y_pred - y is what LM forms for a one-output MSE: the same
    steps, exactly; the compiled loss is only reported. (Both linearised by
    automatic differentiation: a residual function of one's own never uses
    the layer taps, whose Jacobian equals it to round-off, test_lm_taps.py.)"""
    x, y = _sine()
    weights = []
    for residuals in (None, lambda model, x, y, w: model(x, training=True) - y):
        model = _small_net(K)
        model.compile(optimizer=gk.LevenbergMarquardt(model, residuals=residuals,
                                                      linearization="autodiff"),
                      loss="mse", run_eagerly=mode == "eager",
                      jit_compile=mode == "jit")
        with float32_matmuls():  # (eagerly 2 steps: each is slow, the check the same)
            model.fit(x, y, batch_size=200, epochs=5 if mode == "jit" else 2, verbose=0)
        weights.append([w.numpy() for w in model.trainable_variables])
    if mode == "jit" and tf.config.list_physical_devices("GPU"):
        # XLA on a GPU fuses the two programs (the built-in residual and the
        # lambda) differently, so their float32 sums round differently: an
        # H200 gave 1.2e-7 (Keras 3) and 4.2e-6 (tf_keras) on weights up to 16
        # after 25 steps. A wrong residual (sign, scale, weighting) moves the
        # weights by O(0.1) or more; 1e-5 of the largest weight separates them.
        scale = float(np.max(np.abs(np.concatenate([w.ravel() for w in weights[0]]))))
        assert max_abs_diff(weights[0], weights[1]) <= 1e-5 * scale
    else:  # on a CPU: the same float32 operations in the same order
        assert max_abs_diff(weights[0], weights[1]) == 0


def test_own_residuals_in_a_saved_model(K, gk, tmp_path):
    """Saved by name and used again after loading; a lambda is not saved,
    and the loaded optimizer refuses to train until it is set again."""
    x, y = _sine()
    for residuals, name in ((scaled_residuals, "named"),
                            (lambda model, x, y, w: model(x) - y, "lambda")):
        model = _small_net(K)
        model.compile(optimizer=gk.LevenbergMarquardt(model, residuals=residuals),
                      loss="mae")
        model.fit(x, y, batch_size=200, epochs=2, verbose=0)
        path = str(tmp_path / f"{name}.keras")
        model.save(path)
        loaded = K.models.load_model(path)
        if name == "named":
            assert loaded.optimizer.residuals is scaled_residuals
            loaded.fit(x, y, batch_size=200, epochs=1, verbose=0)
            model.fit(x, y, batch_size=200, epochs=1, verbose=0)
            assert max_abs_diff([w.numpy() for w in loaded.trainable_variables],
                                [w.numpy() for w in model.trainable_variables]) < 1e-6
        else:
            before = [w.numpy() for w in loaded.trainable_variables]
            with pytest.raises(ValueError, match="optimizer.residuals = "):
                loaded.fit(x, y, batch_size=200, epochs=1, verbose=0)
            assert max_abs_diff(before, [w.numpy() for w in loaded.trainable_variables]) == 0
            loaded.optimizer.residuals = residuals
            loaded.fit(x, y, batch_size=200, epochs=1, verbose=0)


def test_own_residuals_arguments_are_checked(gk):
    with pytest.raises(ValueError, match="`residuals` must be None or a function"):
        gk.LevenbergMarquardt(residuals="mse")
    with pytest.raises(ValueError, match="use chunk_size=None with `residuals`"):
        gk.LevenbergMarquardt(residuals=scaled_residuals, chunk_size=10)


# -- a subset of the parameters per step -------------------------------------------

def _three_layers(K):
    K.utils.set_random_seed(0)
    return K.Sequential([K.Input((1,)), K.layers.Dense(12, activation="tanh"),
                         K.layers.Dense(12, activation="tanh"), K.layers.Dense(1)])


def _changed(model, before):
    return [int(np.sum(w.numpy() != b)) for w, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_subset_layers_steps_one_layer_at_a_time(K, gk, mode):
    x, y = _sine()
    model = _three_layers(K)
    model.compile(optimizer=gk.LevenbergMarquardt(model, subset="layers"), loss="mse",
                  run_eagerly=mode == "eager", jit_compile=mode == "jit")
    for step in range(4):
        before = [w.numpy() for w in model.trainable_variables]
        model.fit(x, y, batch_size=200, epochs=1, verbose=0)
        changed = _changed(model, before)
        layer = step % 3  # kernel and bias of that layer only
        assert all(c > 0 for c in changed[2 * layer:2 * layer + 2]), changed
        assert sum(changed) == sum(changed[2 * layer:2 * layer + 2]), changed


@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow), "jit"])
def test_subset_fraction_draws_new_parameters_each_step(K, gk, mode):
    x, y = _sine()
    model = _three_layers(K)
    total = sum(int(np.prod(w.shape)) for w in model.trainable_variables)
    k = int(np.ceil(0.2 * total))
    opt = gk.LevenbergMarquardt(model, subset=0.2)
    model.compile(optimizer=opt, loss="mse", run_eagerly=mode == "eager",
                  jit_compile=mode == "jit")
    moved = []
    for _ in range(3):
        before = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
        model.fit(x, y, batch_size=200, epochs=1, verbose=0)
        after = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
        moved.append(set(np.flatnonzero(after != before)))
        assert 0 < len(moved[-1]) <= k
    assert moved[0] != moved[1] != moved[2]
    history = model.fit(x, y, batch_size=200, epochs=40, verbose=0)
    assert history.history["loss"][-1] < 0.2 * history.history["loss"][0]


def test_subset_of_every_parameter_is_the_plain_step(K, gk):
    x, y = _sine()
    weights = []
    for subset in (None, 1.0):
        model = _three_layers(K)
        model.compile(optimizer=gk.LevenbergMarquardt(model, subset=subset),
                      loss="mse", jit_compile=True)
        model.fit(x, y, batch_size=200, epochs=5, verbose=0)
        weights.append([w.numpy() for w in model.trainable_variables])
    # The same system with its columns gathered: float32 round-off only.
    assert max_abs_diff(weights[0], weights[1]) < 1e-5


def test_subset_in_a_custom_loop(K, gk):
    x, y = _sine()
    model = _three_layers(K)
    opt = gk.LevenbergMarquardt(subset="layers")

    @tf.function(jit_compile=True)
    def step():
        return opt.minimize(lambda: model(x, training=True) - y,
                            model.trainable_variables)

    first = float(step())
    for _ in range(60):
        last = float(step())
    assert last < 0.2 * first


def test_subset_is_checked_and_saved(gk):
    for bad in (0.0, 1.5, "layer", True):
        with pytest.raises(ValueError, match="`subset` must be None"):
            gk.LevenbergMarquardt(subset=bad)
    opt = gk.LevenbergMarquardt(subset=0.25)
    assert gk.LevenbergMarquardt.from_config(opt.get_config()).subset == 0.25


def test_minibatch_guard_leaves_large_batches_alone(K, gk):
    """Batches with at least 4 residuals per parameter (here 100 for 25
    parameters) estimate the data's cost well: the guard does not watch
    them, so mini-batch steps equal the unguarded ones. (In float32
    products: the two programs differ, and on a GPU TF32 rounds their
    products differently, 2e-4 apart on an H200.)"""
    x, y = _sine()
    weights = []
    for guard in (True, False):
        model = _small_net(K)
        model.compile(optimizer=gk.LevenbergMarquardt(model, minibatch_guard=guard),
                      loss="mse", jit_compile=True)
        with float32_matmuls():
            model.fit(x, y, batch_size=100, epochs=5, shuffle=False, verbose=0)
        weights.append([w.numpy() for w in model.trainable_variables])
    assert max_abs_diff(weights[0], weights[1]) < 1e-6
