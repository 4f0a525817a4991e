"""The Keras LM optimizer with few parameters (up to
`linearize.RULE_COLUMNS_MAX_PARAMS`, in a `tf.function` or under XLA) forms
its Jacobian's columns by `forward_columns.variable_columns` (a rule per op
over the model's own ops, each read of a Keras variable a seed) instead of
TensorFlow's vectorised forward mode; `least_squares` does too
(tests/test_forward_columns.py checks the columns themselves). Here: the
steps through `model.fit` and a custom loop's `minimize` (by automatic
differentiation, not layer taps) are those the same optimizer takes with TensorFlow's forward mode (the threshold patched to 0),
under both Keras flavours.

Tolerance: the two forward modes apply the chain rule to the same ops but
may order a product differently, float32 round-off (about 1e-7 of each
column); four damped steps of this 9-parameter fit keep that well below
1e-5 of the largest weight (measured: equal to the bit, both flavours),
while a wrong column moves a step by O(1) of it (a wrong tanh rule: 0.74).
"""

import numpy as np
import pytest
import tensorflow as tf
from helpers import mlp, record_rule_columns, regression_data, weights_of

from tf_gradkit.core.lm import linearize


@pytest.mark.parametrize("entry", ["fit", "custom_loop"])
def test_rule_columns_take_tensorflows_forward_mode_steps(K, gk, entry, monkeypatch):
    x, y = regression_data(n=32, d=2)
    taken = record_rule_columns(monkeypatch)

    def train(max_params):
        monkeypatch.setattr(linearize, "RULE_COLUMNS_MAX_PARAMS", max_params)
        model = mlp(K, d=2, hidden=2)
        assert sum(int(np.prod(w.shape)) for w in model.get_weights()) == 9
        opt = gk.LevenbergMarquardt(model, linearization="autodiff")   # not layer taps
        if entry == "fit":
            model.compile(optimizer=opt, loss="mse", jit_compile=True)
            model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
        else:
            step = tf.function(lambda: opt.minimize(
                lambda: model(x) - y, model.trainable_variables), jit_compile=True)
            for _ in range(4):
                step()
        return weights_of(model)

    taken.clear()
    rules = train(linearize.RULE_COLUMNS_MAX_PARAMS)
    assert taken and all(taken)    # the rules formed every linearisation traced
    taken.clear()
    reference = train(0)
    assert not taken
    largest = max(np.abs(w).max() for w in reference)
    for got, want in zip(rules, reference):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * largest)
    start = mlp(K, d=2, hidden=2).get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(reference, start)) > 1e-2   # it trained
