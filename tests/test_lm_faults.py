"""LevenbergMarquardt under faults: non-finite batches, iterations that
accept nothing, and variable constraints (issues 27 and 28)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn, mode_with_function_slow
from helpers import max_abs_diff, mlp, regression_data


# "function" (tf.function without XLA) runs under `make test-slow` only: each
# test taking `mode` keeps its "jit" case, the graph-mode run of the same
# assertion (conftest.mode_with_function_slow).
mode = mode_with_function_slow()
FUNCTION_SLOW = pytest.param("function", marks=pytest.mark.slow)  # as `mode` above


# -- non-finite batches ----------------------------------------------------

def _with_bad_batch(x, y, batch, where, kind):
    """``x, y`` with one extra batch inserted after the ``where``-th, made
    non-finite at any weights by a NaN input or an infinite target."""
    bad_x, bad_y = x[:batch].copy(), y[:batch].copy()
    if kind == "nan_input":
        bad_x[3, 1] = np.nan
    else:
        bad_y[5, 0] = np.inf
    cut = where * batch
    return (np.concatenate([x[:cut], bad_x, x[cut:]]),
            np.concatenate([y[:cut], bad_y, y[cut:]]))


def _state(opt):
    """Every LM state variable but the skip counter."""
    lm = opt._lm_vars  # pylint: disable=protected-access
    return [np.array(v.numpy()) for v in (
        lm.control.damping, lm.control.nu, lm.scale, opt.iterations,
        opt._previous_x, opt._previous_gain)]  # pylint: disable=protected-access


def _fit(K, gk, x, y, mode, epochs, **kwargs):
    model = mlp(K, hidden=4)
    opt = gk.LevenbergMarquardt(model, **kwargs)
    model.compile(optimizer=opt, loss="mse", run_eagerly=mode == "eager",
                  jit_compile=mode == "jit")
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, opt, history


# "function" cases: under `make test-slow`; the "jit" case is the default
# run's graph-mode test of the same assertion.
@pytest.mark.parametrize("mode,kind", [("eager", "nan_input"),
                                       pytest.param("function", "nan_input",
                                                    marks=pytest.mark.slow),
                                       ("jit", "nan_input"),
                                       pytest.param("jit", "inf_target",
                                                    marks=pytest.mark.slow)])
def test_fit_skips_a_nonfinite_batch_and_ends_where_the_clean_run_does(
        K, gk, mode, kind):
    """Reported: after one NaN batch the damping went to its 1e15 ceiling
    and every later batch was rejected, silently. Now the bad batch takes no
    step, leaves every piece of LM state alone and is counted; the run ends
    bit for bit where the run without it does (batches of 16 of 64: the
    mini-batch guard watches them, so its memory is checked too)."""
    x, y = regression_data(n=64)
    epochs = 2 if mode == "eager" else 3
    clean_model, clean_opt, _ = _fit(K, gk, x, y, mode, epochs)
    bx, by = _with_bad_batch(x, y, 16, where=2, kind=kind)
    model, opt, history = _fit(K, gk, bx, by, mode, epochs)
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in model.get_weights()]),
                                  np.concatenate([w.ravel() for w in clean_model.get_weights()]))
    for got, want in zip(_state(opt), _state(clean_opt)):
        np.testing.assert_array_equal(got, want)
    assert int(opt.skipped_batches.numpy()) == epochs
    assert int(clean_opt.skipped_batches.numpy()) == 0
    assert history.history["skipped_batches"][-1] == epochs
    # The clean batches kept training: the damping never left the normal range.
    assert float(opt.damping.numpy()) < 1.0


def test_fit_skips_a_batch_with_a_nonfinite_jacobian(K, gk):
    """Finite residuals and cost, a NaN Jacobian: a residual function of
    one's own with a term ``sqrt(|0 * y_pred|)``, 0 with an infinite
    derivative (times 0: NaN)."""
    x, y = regression_data(n=16)
    model = mlp(K, hidden=4)

    def residuals(model, xb, yb, wb):
        del wb
        y_pred = model(xb, training=True)
        return y_pred - yb + tf.sqrt(tf.abs(0.0 * y_pred))

    opt = gk.LevenbergMarquardt(model, residuals=residuals)
    model.compile(optimizer=opt, loss="mse")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert max_abs_diff(model.get_weights(), before) == 0.0
    assert int(opt.skipped_batches.numpy()) == 1
    assert int(opt.iterations.numpy()) == 0


@pytest.mark.parametrize("mode_", ["eager", FUNCTION_SLOW, "jit"])
def test_minimize_skips_a_nonfinite_batch(gk, mode_):
    """A custom loop over batches, one of them NaN: ``minimize`` returns its
    NaN cost, changes nothing, and the loop ends where the clean loop does."""
    rng = np.random.RandomState(0)
    xs = rng.uniform(0, 2, size=(6, 20)).astype("float32")
    ys = (2.0 * np.exp(-1.5 * xs) + 0.01 * rng.randn(6, 20)).astype("float32")
    bad_x = xs[0].copy()
    bad_x[4] = np.nan

    def run(batches):
        a, b = tf.Variable(1.0), tf.Variable(0.1)
        opt = gk.LevenbergMarquardt()
        step = compile_fn(lambda xb, yb: opt.minimize(
            lambda: a * tf.exp(-b * xb) - yb, [a, b]), mode_)
        costs = [float(step(tf.constant(xb), tf.constant(yb))) for xb, yb in batches]
        return [a.numpy(), b.numpy()], opt, costs

    clean = list(zip(xs, ys))
    want, clean_opt, _ = run(clean)
    got, opt, costs = run(clean[:3] + [(bad_x, ys[0])] + clean[3:])
    assert np.isnan(costs[3])
    np.testing.assert_array_equal(np.array(got), np.array(want))
    for g, w in zip(_state(opt), _state(clean_opt)):
        np.testing.assert_array_equal(g, w)
    assert int(opt.skipped_batches.numpy()) == 1
    assert int(opt.iterations.numpy()) == 6
    assert abs(float(got[1]) - 1.5) < 0.05


# -- an iteration that accepts nothing --------------------------------------

def _lying_residuals(a, b, xb, yb, lie):
    """The curve's residuals, with a Jacobian of the wrong sign when ``lie``:
    every damped step then climbs, and every attempt is rejected."""
    r = a * tf.exp(-b * xb) - yb
    return tf.where(lie, tf.stop_gradient(2.0 * r) - r, r)


@pytest.mark.parametrize("mode,controller", [
    pytest.param("eager", "nielsen", marks=pytest.mark.slow), ("function", "nielsen"),
    ("jit", "nielsen"),
    ("jit", "multiply_divide"), ("jit", "trust_region")])
def test_a_batch_that_accepts_nothing_does_not_stall_the_next_ones(gk, mode, controller):
    """Reported: a run of rejected attempts left the damping at its ceiling
    (Nielsen: ten rejections raise it 2^55-fold), where no step is
    resolvable in float32 and every later batch is rejected too. Now the
    next batch starts from the failed one's damping restrained once, and
    training goes on."""
    x = tf.constant(np.linspace(0, 2, 30), tf.float32)
    y = 2.0 * tf.exp(-1.5 * x)
    a, b = tf.Variable(1.0), tf.Variable(0.1)
    opt = gk.LevenbergMarquardt(controller=controller, minibatch_guard=False)
    step = compile_fn(lambda lie: opt.minimize(
        lambda: _lying_residuals(a, b, x, y, lie), [a, b]), mode)
    for _ in range(2):
        step(tf.constant(False))
    before = [a.numpy(), b.numpy()]
    damping_before = opt.damping.numpy(), opt._lm_vars.control.nu.numpy()  # pylint: disable=protected-access
    step(tf.constant(True))
    assert int(opt.last_attempts.numpy()) == 10
    assert [a.numpy(), b.numpy()] == before  # restored exactly
    damping, nu = opt.damping.numpy(), opt._lm_vars.control.nu.numpy()  # pylint: disable=protected-access
    if controller == "trust_region":
        assert nu == pytest.approx(0.5 * damping_before[1])  # the radius halves
    else:
        assert damping == pytest.approx(2.0 * damping_before[0])
    # Before: stuck at the failed batch's cost (4e-3) for good. Now the
    # clean batches converge as fast as ever (1e-12 after 2 more steps).
    for _ in range(5):
        cost = step(tf.constant(False))
    assert float(cost) < 1e-8
    assert float(b) == pytest.approx(1.5, rel=1e-3)


# -- variable constraints ----------------------------------------------------

def _negative_slope_data():
    """y = -2 x0 + x1 + 0.5 x2 + 0.3: a non-negative kernel must hold its
    first entry at 0 (every Keras optimizer ends there)."""
    rng = np.random.RandomState(0)
    x = rng.randn(64, 3).astype("float32")
    return x, (x @ np.array([[-2.0], [1.0], [0.5]]) + 0.3).astype("float32")


def _constrained_model(K):
    model = K.Sequential([K.Input((3,)),
                          K.layers.Dense(1, kernel_constraint=K.constraints.NonNeg())])
    model.set_weights([np.full((3, 1), 0.5, "float32"), np.zeros(1, "float32")])
    return model


def test_fit_applies_variable_constraints(K, gk, mode):
    """Reported: the kernel ended at -2 (the constraint ignored). The
    constraint now holds after every step, and the accept test measures the
    constrained point, so on a full batch the cost of the weights kept never
    rises. The free entries head for the constrained optimum (a least-squares
    fit with the first column dropped: cost 4.3787); projecting the
    Gauss-Newton step gets there slowly (4.45 after 20 epochs)."""
    x, y = _negative_slope_data()
    model = _constrained_model(K)
    model.compile(optimizer=gk.LevenbergMarquardt(model), loss="mse",
                  run_eagerly=mode == "eager", jit_compile=mode == "jit")
    kernels = []
    record = K.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: kernels.append(model.get_weights()[0].ravel()))
    # The logged loss is the batch's cost at the weights before each step.
    costs = model.fit(x, y, batch_size=64, epochs=6 if mode == "eager" else 20,
                      verbose=0, callbacks=[record]).history["loss"]
    kernels = np.array(kernels)
    assert np.min(kernels) >= 0.0
    np.testing.assert_array_equal(kernels[:, 0], 0.0)
    # Keras's mean and LM's half sum of squares round differently (1e-6).
    assert np.all(np.diff(costs) <= 1e-6 * costs[0]), costs
    assert costs[-1] < (4.5 if mode != "eager" else 4.7) < costs[0], costs


@pytest.mark.parametrize("mode_", ["eager", FUNCTION_SLOW, "jit"])
def test_minimize_applies_variable_constraints(K, gk, mode_):
    """Reported: ``minimize`` left min(v) = -0.9995. Keras variables (a
    layer's ``kernel_constraint``) and ``tf.Variable(constraint=...)``."""
    x, y = _negative_slope_data()
    model = _constrained_model(K)
    v = tf.Variable([0.5, -0.2, 1.0], constraint=lambda w: tf.clip_by_value(w, 0.0, 1.5))
    target = tf.constant([-1.0, 2.0, -3.0])
    opt = gk.LevenbergMarquardt()

    def step():
        return opt.minimize(
            lambda: tf.concat([tf.reshape(model(x) - y, [-1]), v - target], 0),
            model.trainable_variables + [v])

    step = compile_fn(step, mode_)
    for _ in range(3):
        step()
    kernel = model.get_weights()[0].ravel()
    assert np.min(kernel) >= 0.0 and kernel[0] == 0.0
    np.testing.assert_array_equal(v.numpy(), [0.0, 1.5, 0.0])


def test_a_constraint_that_does_not_act_changes_nothing(K, gk):
    """A constraint whose projection leaves the steps alone (NonNeg on the
    positive kernel of y = 2x) gives bit for bit the unconstrained run:
    applying constraints adds no rounding of its own to the step."""
    rng = np.random.RandomState(1)
    x = rng.randn(32, 1).astype("float32")
    y = 2.0 * x + 0.1
    weights = {}
    for constraint in (None, K.constraints.NonNeg()):
        model = K.Sequential([K.Input((1,)),
                              K.layers.Dense(1, kernel_constraint=constraint)])
        model.set_weights([np.ones((1, 1), "float32"), np.zeros(1, "float32")])
        model.compile(optimizer=gk.LevenbergMarquardt(model), loss="mse")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        weights[constraint is None] = model.get_weights()
    assert max_abs_diff(weights[True], weights[False]) == 0.0
