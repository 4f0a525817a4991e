"""Levenberg-Marquardt on cross-entropy losses (generalised Gauss-Newton)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gradkit.core.lm import ggn

F64 = tf.float64
CASES = [("categorical", True), ("categorical", False), ("sparse_categorical", True),
         ("binary", True), ("binary", False)]


def _linear_problem(kind, from_logits, classes=3):
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(6, 4))
    w = tf.Variable(rng.randn(4, classes) * 0.5)
    labels = rng.randint(0, classes, 6)
    if kind == "sparse_categorical":
        y = tf.constant(labels)
    elif kind == "categorical":
        y = tf.constant(np.eye(classes)[labels])
    else:
        y = tf.constant((rng.rand(6, classes) > 0.5).astype("float64"))
    weights = tf.constant(rng.rand(6) + 0.5)

    def output():
        z = tf.matmul(x, w)
        if from_logits:
            return z
        return tf.nn.softmax(z) if kind != "binary" else tf.sigmoid(z)

    return w, y, weights, output


@pytest.mark.parametrize("kind,from_logits", CASES)
def test_gradient_equals_autodiff(kind, from_logits):
    w, y, weights, output = _linear_problem(kind, from_logits)
    lin = ggn.linearize_cross_entropy(output, y, weights, [w], kind, from_logits, F64)
    with tf.GradientTape() as tape:
        cost = ggn.cross_entropy_cost(output(), y, weights, kind, from_logits, F64)
    grad = tf.reshape(tape.gradient(cost, w), [-1])
    np.testing.assert_allclose(lin.jtr.numpy(), grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(float(lin.cost), float(cost), rtol=1e-12)


@pytest.mark.parametrize("kind", ["categorical", "binary"])
def test_ggn_equals_hessian_for_linear_logits(kind):
    # With logits linear in the parameters, G = J^T H J is the exact Hessian.
    w, y, weights, output = _linear_problem(kind, True)
    lin = ggn.linearize_cross_entropy(output, y, weights, [w], kind, True, F64)
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            cost = ggn.cross_entropy_cost(output(), y, weights, kind, True, F64)
        grad = tf.reshape(inner.gradient(cost, w), [-1])
    hessian = tf.reshape(outer.jacobian(grad, w), [grad.shape[0], -1])
    np.testing.assert_allclose(lin.jtj.numpy(), hessian.numpy(), rtol=1e-9, atol=1e-12)
    assert np.all(np.linalg.eigvalsh(lin.jtj.numpy()) > -1e-12)  # PSD


def _blobs(n=600, classes=5, dim=8, seed=0):
    rng = np.random.RandomState(seed)
    centers = rng.randn(classes, dim) * 2.0
    labels = rng.randint(0, classes, n)
    x = (centers[labels] + rng.randn(n, dim) * 1.5).astype("float32")
    return x, labels


def _classifier(K, classes, activation=None):
    model = K.Sequential([K.Input((8,)), K.layers.Dense(12, activation="tanh"),
                          K.layers.Dense(classes, activation=activation)])
    rng = np.random.RandomState(1)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.3
                       for w in model.get_weights()])
    return model


def _epochs_to(history, key, level):
    hits = [i + 1 for i, a in enumerate(history.history[key]) if a >= level]
    return hits[0] if hits else np.inf


@pytest.mark.parametrize("jit", [False, True])
def test_lm_reaches_adams_accuracy_in_fewer_epochs(K, gk, jit):
    x, labels = _blobs()
    lm_model = _classifier(K, 5)
    lm_model.compile(optimizer=gk.LevenbergMarquardt(lm_model),
                     loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
                     metrics=["accuracy"], jit_compile=jit)
    lm_hist = lm_model.fit(x, labels, batch_size=300, epochs=6, verbose=0)
    adam_model = _classifier(K, 5)
    adam_model.compile(optimizer=K.optimizers.Adam(1e-2),
                       loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
                       metrics=["accuracy"], jit_compile=jit)
    adam_hist = adam_model.fit(x, labels, batch_size=300, epochs=6, verbose=0)
    target = max(adam_hist.history["accuracy"])
    assert _epochs_to(lm_hist, "accuracy", target) < _epochs_to(adam_hist, "accuracy", target)
    assert {"damping", "attempts"} <= set(lm_hist.history)


def test_lm_on_probabilities_and_binary(K, gk):
    x, labels = _blobs(classes=2)
    for loss, activation, y in [
            ("categorical_crossentropy", "softmax", np.eye(2)[labels].astype("float32")),
            ("binary_crossentropy", "sigmoid", labels[:, None].astype("float32"))]:
        model = _classifier(K, y.shape[1], activation)
        model.compile(optimizer=gk.LevenbergMarquardt(model), loss=loss,
                      metrics=["accuracy"])
        hist = model.fit(x, y, batch_size=300, epochs=4, verbose=0)
        assert hist.history["loss"][-1] < 0.5 * hist.history["loss"][0], loss
