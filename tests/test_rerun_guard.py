"""`batched._if_any`: the hybrid restart and the off-bounds rerun run under a
``tf.cond``, only in a chunk where some problem needs them. A compiled,
chunked fit whose first chunk needs the off-bounds rerun and whose second
does not must give, to the bit, what running the rerun in every chunk gives
(the code before the guard), and the rerun must really run where needed:
without it the fit that needs it does not converge (the control)."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.lm import batched, solve_cache

pytestmark = pytest.mark.keras_free

F64 = tf.float64
# scipy's gh-7117 hyperbola (tests/test_lm_honest_results.py): from this
# start a step lands on c = 0, a bound the model ignores there, and only the
# off-bounds rerun from inside the box reaches the exact fit.
LOWER = np.array([-3.0, 0.0, -2.0, -10.0, 0.0])
UPPER = np.array([0.0, 3.0, 3.0, 0.0, 10.0])
TRUTH = np.array([-2, .4, -1, -5, 9.5])
BLIND_START = np.array([-2.5 / 3.0, 4 / 3.0, 1.0, -4.0, 0.5])
T = np.array([-32., -16, -8, 4, 4, 8, 16, 32])


def _model(p):
    t = tf.constant(T, F64)[None, :]
    b_2, b_1 = (p[:, 0:1] + p[:, 1:2]) / 2, (p[:, 1:2] - p[:, 0:1]) / 2
    return p[:, 3:4] + b_1 * (t - p[:, 2:3]) + b_2 * tf.sqrt(
        (t - p[:, 2:3]) ** 2 + p[:, 4:5] ** 2 / 4)


def _fit(monkeypatch, guard):
    monkeypatch.setattr(batched, "_if_any", guard)
    solve_cache.SOLVES.clear()   # a fresh trace with this guard
    rng = np.random.default_rng(0)
    starts = TRUTH + rng.uniform(-0.05, 0.05, (8, 5))   # near the truth: no rerun
    starts[1] = BLIND_START                              # in the first chunk of 4
    y = _model(tf.constant(TRUTH[None])).numpy()   # [1, N]: every fit the same data
    return tf_gradkit.least_squares_batched(
        lambda x: _model(x) - y, starts, bounds=(LOWER, UPPER), batch_size=4,
        jit_compile=True)


def test_rerun_only_where_needed_is_the_same_fit_to_the_bit(monkeypatch):
    guarded = _fit(monkeypatch, batched._if_any)
    always = _fit(monkeypatch, lambda flags, rerun, out: rerun())
    never = _fit(monkeypatch, lambda flags, rerun, out: out)
    solve_cache.SOLVES.clear()
    assert np.all(guarded.converged.numpy())
    np.testing.assert_allclose(guarded.x.numpy()[1], TRUTH, rtol=1e-8)
    for field in ("x", "cost", "status", "iterations", "grad", "optimality",
                  "stationarity", "damping", "active_mask"):
        np.testing.assert_array_equal(getattr(guarded, field).numpy(),
                                      getattr(always, field).numpy(), err_msg=field)
    # The control: without the rerun the blind-bound fit stalls on c = 0.
    assert not bool(never.converged.numpy()[1])
    np.testing.assert_array_equal(never.x.numpy()[4:], guarded.x.numpy()[4:])
