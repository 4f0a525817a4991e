"""A custom `tf.function` loop with a tf_gradkit wrapper traces without
AutoGraph warnings (issue 40: "AutoGraph could not transform `_gcd_import`"
on Keras 3, where the same loop with a plain optimizer was silent).

AutoGraph warns once per process for a function it cannot convert, then
remembers it; each test here forgets what the process remembered (its
allow-list cache) and records AutoGraph's warnings while a fresh
`tf.function` traces, so an earlier test cannot hide a warning. The control
shows that a traced `importlib.import_module` call, the cause fixed in
`_hosts.host_of`, is caught by the same recording.
"""

import importlib

import pytest
import tensorflow as tf
from tensorflow.python.autograph.impl import conversion
from tensorflow.python.autograph.utils import ag_logging

import tf_gradkit
from tf_gradkit.core.augmented_lagrangian import Equality


@pytest.fixture
def autograph_warnings(monkeypatch):
    """The texts of AutoGraph's warnings while the test traces."""
    monkeypatch.setattr(conversion, "_ALLOWLIST_CACHE", type(conversion._ALLOWLIST_CACHE)())
    seen = []
    real = ag_logging.warning

    def record(msg, *args):
        seen.append(msg % args if args else msg)
        return real(msg, *args)

    monkeypatch.setattr(ag_logging, "warning", record)
    return seen


def _loop(K, wrap):
    model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
    opt = wrap(K, model)
    x, y = tf.ones([4, 3]), tf.zeros([4, 1])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables), **(
            {"sample_count": 4} if hasattr(opt, "micro_steps") else {}))
        return loss

    return step


WRAPPERS = {
    "GradientAccumulator": lambda K, model: tf_gradkit.optimizers.GradientAccumulator(
        K.optimizers.SGD(0.1), steps=2),
    "AugmentedLagrangian": lambda K, model: tf_gradkit.optimizers.AugmentedLagrangian(
        K.optimizers.SGD(0.1), [Equality(lambda: tf.reduce_sum(model.weights[0]) - 1.0)]),
    "Projected": lambda K, model: tf_gradkit.optimizers.Projected(
        K.optimizers.SGD(0.1), {"kernel": tf_gradkit.constraints.NonNeg()}),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_custom_loop_traces_without_autograph_warnings(K, wrapper, autograph_warnings):
    step = _loop(K, WRAPPERS[wrapper])
    step()
    step()
    assert not [w for w in autograph_warnings if "could not transform" in w], autograph_warnings


def test_control_a_traced_import_module_call_is_caught(autograph_warnings):
    # What host_of did before it was kept from AutoGraph: the recording sees it.
    tf.function(lambda: importlib.import_module("math") and tf.constant(1.0))()
    assert any("_gcd_import" in w for w in autograph_warnings), autograph_warnings
