"""The Keras LM optimizer with few parameters (up to
`linearize.RULE_COLUMNS_MAX_PARAMS`, in a `tf.function` or under XLA) forms
its Jacobian's columns by `forward_columns.variable_columns` (a rule per op
over the model's own ops, each read of a Keras variable a seed) instead of
TensorFlow's vectorised forward mode; `least_squares` does too
(tests/test_forward_columns.py checks the columns themselves). Here: the
steps through `model.fit` and a custom loop's `minimize` (by automatic
differentiation, not layer taps) are those the same optimizer takes with
TensorFlow's forward mode (the threshold patched to 0), under both Keras
flavours, for three models of at most 10 parameters (the first through
both, the others through `fit`):

- ``mlp``: a 2-2-1 tanh MLP (9 parameters);
- ``mixed``: the same under the ``mixed_float16`` policy, its output layer
  float32 (the hidden layer reads float32 variables and casts them to
  float16: the `Cast` rule over float16 tangents);
- ``two_outputs``: one input, a tanh trunk and two named heads (10
  parameters, the threshold itself), compiled with a loss and a weight per
  output. In float64: its J^T J has a condition number of about 1e5, so
  float32's round-off in the columns (1e-7, equal between the two modes to
  that) could move four steps by 1e-4 of a weight (measured in float32 in
  a custom loop: 1.1e-4), too close to what a wrong column does to tell
  the two apart.

Tolerance: the two forward modes apply the chain rule to the same ops but
may order a product differently, one rounding of the compute dtype per
product (2^-24 in float32, 2^-11 in float16 for ``mixed``, 2^-53 in float64),
times the conditioning of the damped system over four steps: below 1e-5
(float32, ``mlp``), 1e-3 (float16: two roundings) and 1e-9 (float64, cond
1e5) of the largest weight (measured: equal to the bit for ``mlp`` and
``mixed``, 9e-15 for ``two_outputs``), while a wrong column moves a step by
O(1) of it (a wrong tanh rule: 0.74; a `Cast` rule 1% off moves ``mixed``
by 9.3e-3).
"""

import numpy as np
import pytest
import tensorflow as tf
from helpers import record_rule_columns, regression_data, weights_of

from tf_gradkit.core.lm import linearize

TOLERANCE = {"mlp": 1e-5, "mixed": 1e-3, "two_outputs": 1e-9}
POLICY = {"mlp": "float32", "mixed": "mixed_float16", "two_outputs": "float64"}


def build(K, kind):
    """(model, compile's loss options, the custom loop's residual function
    of x and y, or None), with weights fixed by seed."""
    if kind == "two_outputs":
        inputs = K.Input((1,))
        trunk = K.layers.Dense(2, activation="tanh")(inputs)
        model = K.Model(inputs, {"a": K.layers.Dense(1, name="a")(trunk),
                                 "b": K.layers.Dense(1, name="b", activation="tanh")(trunk)})
        losses = {"loss": {"a": "mse", "b": "mse"}, "loss_weights": {"a": 2.0, "b": 0.5}}
        residuals = None   # through `fit` only
    else:
        model = K.Sequential([K.Input((2,)), K.layers.Dense(2, activation="tanh"),
                              K.layers.Dense(1, dtype="float32")])
        losses = {"loss": "mse"}

        def residuals(x, y):
            return model(x) - y
    rng = np.random.RandomState(1)
    model.set_weights([rng.randn(*w.shape) * 0.5 for w in model.get_weights()])
    return model, losses, residuals


def data(kind, x, y):
    if kind == "two_outputs":   # one input: 10 parameters
        x = x.astype("float64")
        return x[:, :1], {"a": y.astype("float64"), "b": np.tanh(x[:, :1] - x[:, 1:])}
    return x, y


@pytest.fixture
def kind(K, request):
    """The model's kind, with its dtype policy set for the test."""
    kind = request.param
    K.mixed_precision.set_global_policy(POLICY[kind])
    try:
        yield kind
    finally:
        K.mixed_precision.set_global_policy("float32")


# The MLP through both entries; the mixed-precision and two-output models
# through `fit` (where Keras's policy and compiled per-output losses are
# read): their columns come by the same rules in a custom loop, and each
# cell costs about 10 s of compiling.
@pytest.mark.parametrize("entry, kind", [
    ("fit", "mlp"), ("custom_loop", "mlp"), ("fit", "mixed"), ("fit", "two_outputs")],
    indirect=["kind"])
def test_rule_columns_take_tensorflows_forward_mode_steps(K, gk, entry, kind,
                                                          monkeypatch):
    x, y = regression_data(n=32, d=2)
    x, y = data(kind, x, y)
    taken = record_rule_columns(monkeypatch)

    def train(max_params):
        monkeypatch.setattr(linearize, "RULE_COLUMNS_MAX_PARAMS", max_params)
        model, losses, residuals = build(K, kind)
        size = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
        assert size == (10 if kind == "two_outputs" else 9)
        opt = gk.LevenbergMarquardt(model, linearization="autodiff")   # not layer taps
        if entry == "fit":
            model.compile(optimizer=opt, jit_compile=True, **losses)
            model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
        else:
            step = tf.function(lambda: opt.minimize(
                lambda: residuals(x, y), model.trainable_variables), jit_compile=True)
            for _ in range(4):
                step()
        return model, weights_of(model)

    taken.clear()
    model, rules = train(linearize.RULE_COLUMNS_MAX_PARAMS)
    assert taken and all(taken)    # the rules formed every linearisation traced
    if kind == "mixed":
        assert model.layers[0].compute_dtype == "float16"
    taken.clear()
    _, reference = train(0)
    assert not taken
    largest = max(np.abs(w).max() for w in reference)
    for got, want in zip(rules, reference):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[kind] * largest)
    start = weights_of(build(K, kind)[0])
    assert max(np.abs(a - b).max() for a, b in zip(reference, start)) > 1e-2   # it trained
