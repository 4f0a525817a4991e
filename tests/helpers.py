"""Small models and loops shared by the tests (flavour-agnostic: pass `K`)."""

import contextlib

import numpy as np
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.core import forward_columns
from tf_gradkit.core import precision


def regression_data(n=26, d=3, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, d).astype("float32")
    y = (np.sin(x @ rng.randn(d, 1)) + 0.1 * rng.randn(n, 1)).astype("float32")
    return x, y


def mlp(K, d=3, hidden=4, seed=1):
    """A d-hidden-1 tanh MLP with weights fixed by `seed` (not by Keras RNG)."""
    model = K.Sequential([
        K.Input((d,)),
        K.layers.Dense(hidden, activation="tanh"),
        K.layers.Dense(1),
    ])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                       for w in model.get_weights()])
    return model


def alternate_mask(model):
    """``[(first kernel, mask)]``: every other entry of ``model``'s first
    kernel masked (explicit masks for `MaskAware`)."""
    kernel = model.trainable_variables[0]
    size = int(np.prod(kernel.shape))
    return [(kernel, (np.arange(size) % 2).reshape(tuple(kernel.shape)).astype("float32"))]


def embedding_model(K, vocab=50, dim=4, seq=5, seed=2):
    model = K.Sequential([
        K.Input((seq,), dtype="int32"),
        K.layers.Embedding(vocab, dim),
        K.layers.GlobalAveragePooling1D(),
        K.layers.Dense(1),
    ])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                       for w in model.get_weights()])
    return model


def mse_grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    return loss, tape.gradient(loss, model.trainable_variables)


def make_train_step(model, optimizer, mode):
    """A custom GradientTape step, eager / tf.function / jit_compile."""

    def step(x, y, **kwargs):
        loss, grads = mse_grads(model, x, y)
        optimizer.apply_gradients(zip(grads, model.trainable_variables), **kwargs)
        return loss

    return compile_fn(step, mode)


def max_abs_diff(a_list, b_list):
    """The largest |a - b| over pairs of arrays: NaN if either side holds a
    NaN (numpy's max keeps NaN; Python's `max` would drop it unless it came
    first), and an error if the lists differ in length or shape."""
    a_list, b_list = list(a_list), list(b_list)
    assert len(a_list) == len(b_list), (len(a_list), len(b_list))
    diffs = []
    for a, b in zip(a_list, b_list):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        assert a.shape == b.shape, (a.shape, b.shape)
        # Equal values (equal infinities too) differ by 0; NaN stays NaN.
        with np.errstate(invalid="ignore"):
            diffs.append(np.max(np.where(a == b, 0.0, np.abs(a - b))) if a.size else 0.0)
    return float(np.max(diffs)) if diffs else 0.0


def weights_of(model):
    return [w.numpy() for w in model.weights]


def variables_of(optimizer):
    return [np.array(v.numpy()) for v in optimizer.variables]


# The unit round-off of float32 matrix products on this device: 2^-24 on a
# CPU (or with TF32 off), 2^-11 where TensorFlow may run them in TF32 (a GPU
# with its default settings). The model's own products run at that
# precision, so tolerances on anything a model computes derive from it.
MATMUL_UNIT = 2.0 ** -11 if precision.tf32_may_apply() else 2.0 ** -24


@contextlib.contextmanager
def float32_matmuls():
    """Float32 matrix products in the block (TF32 off, where a GPU would use
    it): for tests of an identity of the math (two formulations, or two
    batch layouts, agreeing to float32 round-off). TF32 rounds each side's
    product inputs to 11 significant bits, differently for each (about 5e-4
    relative on an H200), which says nothing about the identity."""
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(was)

# Round-off bound for these tiny problems: a handful (~6) of updates of
# O(0.1) on O(1) weights, each summing <= 26 per-example terms at relative
# error MATMUL_UNIT: 168 * MATMUL_UNIT (1.0e-5 in float32) leaves room for the
# different summation orders (micro-batch sums vs one big reduction) without
# hiding a wrong weighting, which shows up at 1e-2 or more in float32. (With
# TF32 the bound is 0.08: `make test-gpu` also runs these with TF32 off.)
ROUNDOFF = 168 * MATMUL_UNIT


def record_rule_columns(monkeypatch):
    """A list that gets, for each `forward_columns.variable_columns` call
    traced from now on (the test's), whether the rules formed the columns
    (False where they fell back)."""
    taken = []
    original = forward_columns.variable_columns

    def recording(fn, variables):
        found = original(fn, variables)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(forward_columns, "variable_columns", recording)
    return taken
