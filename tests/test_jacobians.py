"""Jacobians of any tensor and gradient hooks (`tf_gradkit.gradients`),
against central finite differences in float64 and tf.GradientTape.jacobian."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.gradients import gradient_of, jacobian, layer_jacobian


def _central_differences(fn, x0, h=1e-6):
    """d fn / d x at x0 (float64 numpy), column by column."""
    x0 = np.asarray(x0, np.float64)
    f0 = np.asarray(fn(x0))
    out = np.zeros(f0.shape + x0.shape)
    for idx in np.ndindex(x0.shape):
        e = np.zeros_like(x0)
        e[idx] = h
        out[(...,) + idx] = (np.asarray(fn(x0 + e)) - np.asarray(fn(x0 - e))) / (2 * h)
    return out


@pytest.mark.keras_free
@pytest.mark.parametrize("jac_mode", ["auto", "forward", "reverse"])
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_jacobian_of_a_function_equals_finite_differences(jac_mode, mode):
    a = tf.Variable(np.linspace(0.1, 1.2, 6).reshape(2, 3), dtype=tf.float64)
    b = tf.Variable([0.3, -0.7], dtype=tf.float64)

    def f_np(a_, b_):
        return np.tanh(b_[:, None] * a_) ** 2 + a_.sum()

    fn = lambda: tf.tanh(b[:, None] * a) ** 2 + tf.reduce_sum(a)  # noqa: E731
    ja, jb = compile_fn(lambda: jacobian(fn, [a, b], mode=jac_mode), mode)()
    assert ja.shape == (2, 3, 2, 3) and jb.shape == (2, 3, 2)
    # Central differences in float64: error ~h^2 f''' + eps/h ~ 1e-10.
    np.testing.assert_allclose(ja.numpy(), _central_differences(
        lambda v: f_np(v, b.numpy()), a.numpy()), atol=1e-8)
    np.testing.assert_allclose(jb.numpy(), _central_differences(
        lambda v: f_np(a.numpy(), v), b.numpy()), atol=1e-8)


@pytest.mark.keras_free
def test_jacobian_with_respect_to_a_tensor_and_unconnected_inputs():
    x = tf.constant([1.0, 2.0, 3.0], tf.float64)
    unused = tf.Variable([5.0], dtype=tf.float64)
    for jac_mode in ("forward", "reverse"):
        jx, ju = jacobian(lambda: tf.stack([x[0] * x[1], tf.sin(x[2])]), [x, unused],
                          mode=jac_mode)
        np.testing.assert_allclose(jx.numpy(), [[2.0, 1.0, 0.0], [0.0, 0.0, np.cos(3.0)]],
                                   atol=1e-15)
        np.testing.assert_array_equal(ju.numpy(), np.zeros((2, 1)))
    with pytest.raises(ValueError, match="`wrt` is empty"):
        jacobian(lambda: x, [])
    with pytest.raises(TypeError, match=r"Received: wrt\[0\] of type list"):
        jacobian(lambda: x, [[1.0]])


def _model(K):
    """A float64 model. Each layer says its dtype: Keras 3 fixes its global
    dtype policy at the first layer built in the process, so set_floatx
    would not reach layers built after other tests."""
    K.utils.set_random_seed(0)
    inp = K.Input((3,), dtype="float64")
    h1 = K.layers.Dense(4, activation="tanh", name="h1", dtype="float64")(inp)
    h2 = K.layers.Dense(3, activation="tanh", name="h2", dtype="float64")(h1)
    out = K.layers.Dense(2, name="out", dtype="float64")(h2)
    model = K.Model(inp, out)
    assert all(v.dtype == tf.float64 for v in model.trainable_variables)
    return model


def test_layer_jacobians_equal_gradient_tape_and_finite_differences(K, mode):
    model = _model(K)
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 3)), tf.float64)
    h1_of = K.Model(model.inputs, model.get_layer("h1").output)
    # Of the intermediate h2 with respect to the intermediate h1.
    jac = compile_fn(lambda x: layer_jacobian(model, x, of="h2", wrt="h1"), mode)(x)
    h1 = h1_of(x).numpy()
    h2_from_h1 = lambda h: model.get_layer("h2")(tf.constant(h)).numpy()  # noqa: E731
    np.testing.assert_allclose(jac.numpy(), _central_differences(h2_from_h1, h1), atol=1e-8)
    # Of the model's output with respect to the variables: as GradientTape.jacobian.
    jacs = compile_fn(lambda x: layer_jacobian(model, x, of=None), mode)(x)
    with tf.GradientTape() as tape:
        y = model(x)
    want = tape.jacobian(y, model.trainable_variables)
    for got, ref in zip(jacs, want):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=1e-12)
    with pytest.raises(ValueError, match=r"no layer named 'nope'"):
        layer_jacobian(model, x, of="nope")


def test_gradient_of_reads_and_transforms_the_gradient_through_a_layer(K, mode):
    model = _model(K)
    x = tf.constant(np.random.default_rng(1).normal(size=(2, 3)), tf.float64)
    layer = model.get_layer("h1")

    def grads_with(fn):
        def step(x):
            with gradient_of(layer, fn):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(model(x) ** 2)
                return tape.gradient(loss, model.trainable_variables)
        return compile_fn(step, mode)(x)

    plain = grads_with(lambda g: None)
    zeroed = grads_with(tf.zeros_like)
    doubled = grads_with(lambda g: 2.0 * g)
    # Variables after h1 (h2, out) are untouched; h1's own kernel and bias
    # receive the transformed gradient.
    h1_vars = {id(v) for v in layer.trainable_variables}
    for v, p, z, d in zip(model.trainable_variables, plain, zeroed, doubled):
        if id(v) in h1_vars:
            np.testing.assert_array_equal(z.numpy(), 0.0)
            np.testing.assert_allclose(d.numpy(), 2.0 * p.numpy(), rtol=1e-14)
        else:
            np.testing.assert_allclose(z.numpy(), p.numpy(), rtol=1e-14)
    # Reading: the gradient seen equals dL/dh1 from a tape on the activation.
    seen = []
    with gradient_of(layer, seen.append):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        tape.gradient(loss, model.trainable_variables)
    h1 = K.Model(model.inputs, layer.output)(x)
    with tf.GradientTape() as tape:
        tape.watch(h1)
        rest = model.get_layer("out")(model.get_layer("h2")(h1))
        loss = tf.reduce_sum(rest ** 2)
    np.testing.assert_allclose(seen[0].numpy(), tape.gradient(loss, h1).numpy(), rtol=1e-12)
    # The hook is gone after the block.
    assert "call" not in layer.__dict__


@pytest.mark.keras_free
@pytest.mark.parametrize("jac_mode", ["forward", "reverse"])
def test_jacobian_shapes_scalars_and_dynamic_shapes(jac_mode):
    x = tf.Variable(2.0, dtype=tf.float64)
    # A scalar of a scalar, with tf.GradientTape.jacobian's shapes.
    np.testing.assert_allclose(jacobian(lambda: x ** 3, x, mode=jac_mode).numpy(), 12.0)
    v = tf.Variable([1.0, 2.0, 3.0], dtype=tf.float64)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float64)])
    def of_dynamic(scale):
        return jacobian(lambda: scale[:, None] * v[None, :], v, mode=jac_mode)

    got = of_dynamic(tf.constant([1.0, -2.0], tf.float64))
    with tf.GradientTape() as tape:
        y = tf.constant([1.0, -2.0], tf.float64)[:, None] * v[None, :]
    np.testing.assert_array_equal(got.numpy(), tape.jacobian(y, v).numpy())
    with pytest.raises(ValueError, match=r"`mode` must be one of .*Received: mode='fwd'"):
        jacobian(lambda: v, v, mode="fwd")


def test_gradient_of_refuses_a_gradient_of_another_shape(K):
    model = _model(K)
    x = tf.ones([2, 3], tf.float64)
    with gradient_of(model.get_layer("h1"), lambda g: g[:, :2]):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        with pytest.raises(ValueError, match=r"`fn` must return None or a gradient "
                                             r"shaped like h1's output .*Received: shape"):
            tape.gradient(loss, model.trainable_variables)
