"""Misuse gets Keras's errors or a clear one of ours, and changes nothing:
plain ``tf.Variable``s, gradients that are all None, counters read before the
first step, tensors where variables belong, parts named as the user named
them, and a Keras 3 backend other than TensorFlow."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from conftest import FLAVOUR, keras_module
from tf_gradkit import constraints as C


def _all_ours(K, gk, var):
    """Every optimizer of ours (and wrappers over Adam) for variable ``var``."""
    out = {
        "accumulator": gk.GradientAccumulator(K.optimizers.Adam(0.1), 2),
        "projected": gk.Projected(K.optimizers.Adam(0.1), {var.ref(): C.NonNeg()}),
        "lagrangian": gk.AugmentedLagrangian(
            K.optimizers.Adam(0.1), [gk.Inequality(lambda: tf.reduce_sum(var) - 1.0)]),
        "frank-wolfe": gk.ConditionalGradient(0.2, lambda_=2.0),
        "frank-wolfe-patterns": gk.ConditionalGradient(0.2, lambda_={".*": 2.0},
                                                       ord="nuclear"),
        "mask-aware": gk.MaskAware(K.optimizers.Adam(0.1), masks={var.ref(): np.ones((2, 2))}),
    }
    return out


@pytest.mark.parametrize("name", ["accumulator", "projected", "lagrangian",
                                  "frank-wolfe", "frank-wolfe-patterns", "mask-aware"])
def test_plain_tf_variables_work_everywhere(K, gk, name):
    # Keras optimizers accept a plain tf.Variable; so do ours.
    var = tf.Variable([[1.0, -2.0], [0.5, 3.0]], name="w")
    opt = _all_ours(K, gk, var)[name]
    target = tf.constant([[0.2, 0.1], [0.3, 0.4]])
    start = var.numpy().copy()
    for _ in range(4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(var - target))
        extra = {"sample_count": 1} if name == "accumulator" else {}
        opt.apply_gradients([(tape.gradient(loss, var), var)], **extra)
    assert np.all(np.isfinite(var.numpy())) and not np.allclose(var.numpy(), start)


def test_lm_minimizes_over_a_plain_tf_variable(gk):
    var = tf.Variable([1.0, 1.0])
    x = tf.constant([0.0, 1.0, 2.0])
    opt = gk.LevenbergMarquardt()
    for _ in range(5):
        opt.minimize(lambda: var[0] * tf.exp(var[1] * x) - [2.0, 2.7, 3.6], [var])
    assert float(opt.iterations.numpy()) == 5


@pytest.mark.parametrize("name", ["accumulator", "projected", "lagrangian", "mask-aware"])
def test_gradients_that_are_all_none_raise_like_keras(K, gk, name):
    var = tf.Variable([[1.0, -2.0], [0.5, 3.0]])
    opt = _all_ours(K, gk, var)[name]
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        opt.apply_gradients([(None, var)])
    assert np.array_equal(var.numpy(), [[1.0, -2.0], [0.5, 3.0]])
    # Keras itself says the same for its own optimizers.
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        K.optimizers.Adam(0.1).apply_gradients([(None, var)])


def test_counters_read_before_the_first_step_are_zero(K, gk):
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), 3)
    assert int(opt.micro_steps) == 0 and int(opt.window_micro_step) == 0


def test_least_squares_says_it_needs_variables():
    x = tf.constant([1.0, 2.0], tf.float64)
    with pytest.raises(TypeError, match=r"`var_list` must hold the tf.Variables.*"
                       r"var_list\[0\] of type EagerTensor"):
        tf_gradkit.least_squares(lambda: x - 1.0, [x])


def test_lm_errors_name_parts_as_the_user_did(gk):
    with pytest.raises(ValueError, match=r"solver='cg'.*scaling='marquardt'"):
        gk.LevenbergMarquardt(solver="cg")
    # The hybrid scaling restarts whole solves: least_squares only.
    with pytest.raises(ValueError, match=r"scaling='hybrid' restarts a whole solve.*"
                                         r"Use scaling='marquardt' or 'levenberg'"):
        gk.LevenbergMarquardt(scaling="hybrid")
    model = keras_module().Sequential([keras_module().Input((2,)),
                                       keras_module().layers.Dense(1)])
    opt = gk.LevenbergMarquardt(model, solver="qr", chunk_size=2)
    model.compile(optimizer=opt, loss="mse")
    with pytest.raises(ValueError, match=r"Received: solver='qr'"):
        model.fit(np.ones((4, 2), "float32"), np.ones((4, 1), "float32"), verbose=0)


@pytest.mark.skipif(FLAVOUR != "keras3", reason="Keras 3 only has other backends")
@pytest.mark.parametrize("backend", ["jax", "torch", "numpy"])
def test_keras3_on_another_backend_fails_at_construction_with_one_clear_error(
        K, gk, monkeypatch, backend):
    # Every Keras 3 class asks `keras.backend.backend()` when constructed (a
    # real JAX/torch backend is not installed here: this is what it answers).
    monkeypatch.setattr(K.backend, "backend", lambda: backend)
    makers = {
        "GradientAccumulator": lambda: gk.GradientAccumulator(K.optimizers.SGD(0.1), 2),
        "LevenbergMarquardt": lambda: gk.LevenbergMarquardt(),
        "Projected": lambda: gk.Projected(K.optimizers.SGD(0.1), {"k": lambda w: w}),
        "ConditionalGradient": lambda: gk.ConditionalGradient(0.1),
        "AugmentedLagrangian": lambda: gk.AugmentedLagrangian(
            K.optimizers.SGD(0.1), [gk.Inequality(lambda: tf.constant(0.0))]),
        "NonNeg": lambda: C.NonNeg(),
        "AccumBatchNormalization": lambda: gk.AccumBatchNormalization(2),
    }
    for name, make in makers.items():
        with pytest.raises(RuntimeError, match=rf"{name} needs Keras's TensorFlow "
                           rf"backend.*'{backend}'.*KERAS_BACKEND=tensorflow"):
            make()
