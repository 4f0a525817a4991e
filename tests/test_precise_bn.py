"""Precise batch-norm statistics against the exact statistics computed with
numpy over the same inputs."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gradkit.gradients import recompute_batch_norm_statistics


def _np(value, dtype=None):
    """A variable's or tensor's value as numpy."""
    value = value.numpy() if hasattr(value, "numpy") else value
    return value.astype(dtype) if dtype is not None else value


def _model(K, gk, accum=False):
    K.utils.set_random_seed(0)
    bn2 = (gk.AccumBatchNormalization(accumulation_steps=2, name="bn2") if accum
           else K.layers.BatchNormalization(name="bn2"))
    return K.Sequential([
        K.Input((6, 6, 2)),
        K.layers.Conv2D(3, 3, name="conv"),
        K.layers.BatchNormalization(name="bn1", momentum=0.9),
        K.layers.Activation("relu"),
        K.layers.Flatten(),
        K.layers.Dense(5, name="dense"),
        bn2,
        K.layers.Dense(2, name="out"),
    ])


def _data(n=70, seed=0):
    rng = np.random.default_rng(seed)
    # A mean far from 0 next to a small spread: float32 E[x^2] - E[x]^2
    # would lose the variance; the pooled sums about a shift keep it.
    return (rng.normal(loc=3.0, scale=0.5, size=(n, 6, 6, 2)).astype("float32"),
            rng.normal(size=(n, 2)).astype("float32"))


@pytest.mark.parametrize("accum", [False, True])
def test_statistics_are_the_exact_moments_of_each_layers_inputs(K, gk, accum):
    model = _model(K, gk, accum)
    x, y = _data()
    model.compile(optimizer=K.optimizers.SGD(0.01), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # noisy moving averages
    before = [_np(w) for w in model.weights]
    optimizer_before = [_np(v) for v in model.optimizer.variables]
    # Batches of 32, 32 and 6 (the last one short).
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    counts = recompute_batch_norm_statistics(model, dataset)
    for name, axes in (("bn1", (0, 1, 2)), ("bn2", (0,))):
        layer = model.get_layer(name)
        # Its input at inference, through the earlier layers as they are now
        # (bn1's new statistics included), over all 70 examples at once.
        inputs = K.Model(model.inputs, layer.input)(x, training=False)
        inputs = _np(inputs, np.float64)
        np.testing.assert_allclose(_np(layer.moving_mean), inputs.mean(axes),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_np(layer.moving_variance), inputs.var(axes),
                                   rtol=1e-4, atol=1e-6)
        assert counts[name] == int(np.prod([inputs.shape[a] for a in axes]))
    # Only the moving statistics changed.
    for w, b in zip(model.weights, before):
        if "moving" not in getattr(w, "path", w.name):
            np.testing.assert_array_equal(_np(w), b)
    for v, b in zip(model.optimizer.variables, optimizer_before):
        np.testing.assert_array_equal(_np(v), b)


def test_num_batches_limits_the_data_and_bad_input_is_named(K, gk):
    model = _model(K, gk)
    x, _ = _data(40)
    model(x[:2])
    recompute_batch_norm_statistics(model, [x[:10], x[10:20], x[20:]], num_batches=2)
    layer = model.get_layer("bn1")
    inputs = _np(K.Model(model.inputs, layer.input)(x[:20], training=False))
    np.testing.assert_allclose(_np(layer.moving_mean), inputs.mean((0, 1, 2)),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"`num_batches` must be None or an integer "
                                         r">= 1. Received: num_batches=0"):
        recompute_batch_norm_statistics(model, [x], num_batches=0)
    with pytest.raises(ValueError, match=r"`data` holds no batch"):
        recompute_batch_norm_statistics(model, [])
    with pytest.raises(ValueError, match=r"Received: num_batches=1.5"):
        gk.callbacks.PreciseBatchNorm([x], num_batches=1.5)


def test_callback_recomputes_at_the_end_of_training(K, gk):
    model = _model(K, gk)
    x, y = _data()
    model.compile(optimizer=K.optimizers.SGD(0.01), loss="mse")
    data = tf.data.Dataset.from_tensor_slices(x).batch(35)
    callback = gk.callbacks.PreciseBatchNorm(data)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
    layer = model.get_layer("bn1")
    inputs = _np(K.Model(model.inputs, layer.input)(x, training=False), np.float64)
    np.testing.assert_allclose(_np(layer.moving_mean), inputs.mean((0, 1, 2)),
                               rtol=1e-5, atol=1e-6)
    assert callback.counts["bn1"] == 70 * 4 * 4
