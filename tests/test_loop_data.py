"""The data a compiled fit's residuals close over ride in its loop's state
behind an XLA optimization barrier (`loop_data`, issue 39): so the P JVPs'
copies of the model merge instead of each being hoisted apart. Checked: the
rebuilt residuals are the same function; a compiled `curve_fit` and
`least_squares_batched` carry their data (main loop and the compacted loop
of the last few fits); with and without carrying, a compiled fit takes the
same steps (the mixed ragged batch against single solves is
tests/test_batched_least_squares.py's compiled test)."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.lm import batched, fitting, loop_data, solve_cache

pytestmark = pytest.mark.keras_free

LOWER = [0.0, 0.05, 0.0, 0.05, 0.0]
UPPER = [np.inf, 50.0, np.inf, 50.0, np.inf]


def decay_problems(batch, seed=0):
    """Bi-exponential decays (amplitudes, lifetimes, offset), float64,
    shared time bins, starts off the truth (the case of
    benchmarks/bounded_decay.py, smaller)."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 20.0, 60)
    low, high = np.array([200, 0.5, 100, 4.0, 5]), np.array([800, 1.5, 400, 8.0, 20])
    truth = low + (high - low) * rng.random((batch, 5))
    y = model_np(t, truth) + rng.normal(0, 5.0, (batch, t.size))
    return t, y, truth * rng.uniform(0.8, 1.2, truth.shape)


def model_np(t, p):
    return sum(p[:, i:i + 1] * np.exp(-t / p[:, i + 1:i + 2]) for i in (0, 2)) + p[:, 4:]


def test_rebuilt_residuals_are_the_same_function():
    """`carried` hands over the data's floating-point tensors only (None,
    Python values, integer and boolean tensors stay in place) and `rebuild`
    of those tensors is the same residual function; nothing to carry without
    the ability or without a floating-point tensor."""
    t = tf.constant(np.linspace(0.0, 1.0, 7))
    y = tf.constant(np.arange(7.0))
    keep = tf.constant([True] * 6 + [False])
    size = tf.constant(7)

    def residuals_of(data):
        (times, values), missing, scale, mask, n = data
        assert missing is None and scale == 2.0 and mask is keep and n is size

        def fn(x):
            r = scale * x[:, :1] * tf.exp(-times) - values
            return tf.where(mask, r, tf.zeros_like(r))
        return loop_data.attach(fn, data, residuals_of)

    fn = residuals_of(((t, y), None, 2.0, keep, size))
    tensors, rebuild = loop_data.carried(fn)
    assert len(tensors) == 2 and tensors[0] is t and tensors[1] is y
    x = tf.constant([[1.5], [-2.0]], tf.float64)
    np.testing.assert_array_equal(rebuild([t, y])(x).numpy(), fn(x).numpy())
    doubled = rebuild([t, 2.0 * y])(x).numpy()   # it reads the tensors given
    np.testing.assert_allclose(doubled, fn(x).numpy() - np.where(keep, y, 0.0),
                               rtol=1e-14)
    assert loop_data.carried(lambda x: x) is None
    assert loop_data.carried(loop_data.attach(lambda x: x, (None, 3.0, keep, size),
                                              lambda d: None)) is None


def _spy(monkeypatch):
    seen = []
    original = loop_data.barrier

    def spy(tensors):
        seen.append([tuple(t.shape) for t in tensors])
        return original(tensors)

    monkeypatch.setattr(loop_data, "barrier", spy)
    return seen


def test_compiled_curve_fit_carries_its_data(monkeypatch):
    """Under XLA both loops of a chunk (all fits, then the few left,
    gathered: 600 fits, padded to 640, are past `batched.COMPACT_MIN_BATCH`,
    and the call is given the tail by `fitting.TAIL_MIN_FITS`)
    pass the data through the barrier: the shared time bins and the per-fit
    ``ydata`` and ``sigma`` of the fits each loop runs (not the boolean
    mask); the model and the user's ``jac`` read the barrier's output; a
    plain tf.function has no barrier. (One compile, with ``jac``: the model
    is called for the residuals there too. A model's Jacobian by autodiff
    through the barrier: `test_carried_or_not_the_same_steps`; the tail's
    gathered data with it: tests/test_small_fits.py.)"""
    seen = _spy(monkeypatch)
    monkeypatch.setattr(fitting, "TAIL_MIN_FITS", 600)   # a call with the tail
    t, y, p0 = decay_problems(600)
    sigma = np.full_like(y, 5.0)
    read = {"model": set(), "jac": set()}

    def model(t, p):   # a function of its own: traced here, with the spy
        read["model"].add(t.op.type)
        return (p[:, 0:1] * tf.exp(-t / p[:, 1:2]) + p[:, 2:3] * tf.exp(-t / p[:, 3:4])
                + p[:, 4:5])

    def jac(t, p):
        read["jac"].add(t.op.type)
        e1, e2 = tf.exp(-t / p[:, 1:2]), tf.exp(-t / p[:, 3:4])
        return tf.stack([e1, p[:, 0:1] * e1 * t / p[:, 1:2] ** 2, e2,
                         p[:, 2:3] * e2 * t / p[:, 3:4] ** 2, tf.ones_like(e1)], axis=-1)

    fit = tf_gradkit.curve_fit(model, t, y, p0, sigma=sigma, bounds=(LOWER, UPPER),
                               jit_compile=True, jac=jac)
    assert np.all(fit.converged.numpy())
    shapes = {s for call in seen for s in call}
    assert (60,) in shapes and (640, 60) in shapes, seen   # padded to 640
    tail = 640 // batched.COMPACT_FRACTION
    assert any(call.count((tail, 60)) == 2 for call in seen), seen   # compacted
    assert "XlaOptimizationBarrier" in read["model"], read
    assert "XlaOptimizationBarrier" in read["jac"], read
    del seen[:]
    tf_gradkit.curve_fit(model, t, y[:8], p0[:8], sigma=sigma[:8],
                         bounds=(LOWER, UPPER), jit_compile=False)
    assert seen == []


def test_integer_data_stay_constants(monkeypatch):
    """An integer tensor in ``xdata`` that the model uses as a shape (a
    compile-time constant to XLA) stays in the closure, not carried: the
    fit compiles and runs."""
    seen = _spy(monkeypatch)
    t, y, p0 = decay_problems(8, seed=3)

    def model(x, p):
        times, n = x
        e = (p[:, 0:1] * tf.exp(-times / p[:, 1:2])
             + p[:, 2:3] * tf.exp(-times / p[:, 3:4]) + p[:, 4:5])
        r = tf.reshape(e, [-1, n])   # n: a compile-time constant to XLA
        r.set_shape(e.shape)
        return r

    fit = tf_gradkit.curve_fit(model, (t, np.int32(60)), y, p0, bounds=(LOWER, UPPER),
                               jit_compile=True)
    assert np.all(fit.converged.numpy())
    assert seen and all((60,) in call and () not in call for call in seen), seen


def test_compiled_least_squares_batched_carries_its_args(monkeypatch):
    """`least_squares_batched`'s per-problem ``args`` ride in the loop."""
    seen = _spy(monkeypatch)
    t, y, p0 = decay_problems(8, seed=1)

    def fun(p, t, y):
        return (p[:, 0:1] * tf.exp(-t / p[:, 1:2]) + p[:, 2:3] * tf.exp(-t / p[:, 3:4])
                + p[:, 4:5]) - y

    fit = tf_gradkit.least_squares_batched(
        fun, p0, args=(np.broadcast_to(t, y.shape), y), bounds=(LOWER, UPPER),
        jit_compile=True)
    assert np.all(fit.converged.numpy())
    assert any(call.count((8, 60)) == 2 for call in seen), seen


def test_carried_or_not_the_same_steps(monkeypatch):
    """With tolerances above round-off (1e-10, float64), a compiled fit
    takes the same steps whether its data ride in the loop or not: the same
    status and iterations for every fit, and the same solution to 1e-8 (the
    two programs fuse differently, so they round differently)."""
    t, y, p0 = decay_problems(64, seed=2)
    tolerances = dict(ftol=1e-10, xtol=1e-10, gtol=1e-10)

    traces = []

    def fit_with(barrier):
        monkeypatch.setattr(loop_data, "_barrier", barrier)
        solve_cache.SOLVES.clear()   # traced anew: the same model's key

        def model(t, p):
            traces.append(barrier)
            return (p[:, 0:1] * tf.exp(-t / p[:, 1:2])
                    + p[:, 2:3] * tf.exp(-t / p[:, 3:4]) + p[:, 4:5])
        return tf_gradkit.curve_fit(model, t, y, p0, bounds=(LOWER, UPPER),
                                    jit_compile=True, **tolerances)

    seen = _spy(monkeypatch)
    carried = fit_with(loop_data._barrier)
    assert seen and traces
    del seen[:], traces[:]
    plain = fit_with(None)
    assert seen == [] and traces and all(b is None for b in traces)
    assert np.all(carried.converged.numpy())
    np.testing.assert_array_equal(carried.status.numpy(), plain.status.numpy())
    np.testing.assert_array_equal(carried.iterations.numpy(), plain.iterations.numpy())
    np.testing.assert_allclose(carried.x.numpy(), plain.x.numpy(), rtol=1e-8)
    np.testing.assert_allclose(carried.cost.numpy(), plain.cost.numpy(), rtol=1e-10)
