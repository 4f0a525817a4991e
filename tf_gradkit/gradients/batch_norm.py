"""Precise batch-norm statistics: BatchNormalization's population mean and
variance recomputed exactly over N batches, instead of the moving average.

A BatchNormalization layer normalises at inference with ``moving_mean`` and
``moving_variance``, exponential averages of the training batches' moments
taken while the weights were still moving (and, with a small batch, noisy).
After training, `recompute_batch_norm_statistics` replaces them with the exact
mean and (biased) variance of each layer's input over all examples of N
batches, as the model computes it at inference (``training=False``):

- layer by layer in the order the forward pass calls them, each pass with
  the earlier layers already holding their new statistics, so every layer's
  statistics are those of the inputs it will see at inference (PyTorch's
  ``update_bn`` and fvcore's ``update_bn_stats`` use training-mode passes
  instead, where earlier layers normalise with batch moments);
- pooled exactly across batches of any sizes (`core.batch_stats`:
  ``N = sum n_b``, mean and variance of the concatenation, about a shift for
  float32 accuracy);
- the biased variance (over ``N`` elements, ``N`` large): Keras normalises
  with ``moving_variance`` as is.

No trainable weight, optimizer state or other variable changes. It works for
both Keras flavours' BatchNormalization and subclasses (tf_gradkit's
AccumBatchNormalization, SyncBatchNormalization), whichever flavour the
process's ``tf.keras`` is. The callback is `tf_gradkit._algorithms.precise_bn`.
"""

import contextlib

import tensorflow as tf

from tf_gradkit import _layer_taps as _taps
from tf_gradkit.core import batch_stats


def batch_norm_layers(model):
    """The model's BatchNormalization layers (their flavour's class or a
    subclass), in the order the forward pass calls them once built; the
    layer kinds are those of the model's own flavour (a TypeError for an
    object no Keras flavour serves)."""
    kinds = _taps.layer_kinds(model, "recompute_batch_norm_statistics")
    return [layer for layer in _taps.flat_layers(model)
            if _taps.kind_of(layer, kinds) == "batch_norm"]


def _reduction_axes(layer, rank):
    axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    kept = {a % rank for a in axis}
    return [a for a in range(rank) if a not in kept]


def _first(batch):
    """The model input of a dataset element: ``x`` of ``(x, y[, w])``."""
    return batch[0] if isinstance(batch, tuple) else batch


def recompute_batch_norm_statistics(model, data, num_batches=None):
    """Sets every BatchNormalization's moving statistics to the exact
    statistics of its inputs over ``num_batches`` batches of ``data``.

    Args:
      model: a built Keras model (either flavour).
      data: a ``tf.data.Dataset`` or an iterable of batches: ``x`` or
        ``(x, y[, sample_weight])`` (only ``x`` is used).
      num_batches: how many batches (None: all of ``data``; a dataset that
        repeats forever needs a number).

    Returns:
      ``{layer name: number of elements per feature}`` the statistics of
      each layer were computed over.

    Raises:
      ValueError: ``num_batches`` is not None or an integer >= 1, or
        ``data`` holds no batch.

    Example:

    >>> model.fit(x, y, batch_size=8)
    >>> recompute_batch_norm_statistics(
    ...     model, tf.data.Dataset.from_tensor_slices(x).batch(256), num_batches=20)
    """
    if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(
            num_batches, int) or num_batches < 1):
        raise ValueError("recompute_batch_norm_statistics: `num_batches` must be None "
                         f"or an integer >= 1. Received: num_batches={num_batches!r}")
    layers = batch_norm_layers(model)
    if not layers:
        return {}
    batches = []
    for i, batch in enumerate(data):
        if num_batches is not None and i >= num_batches:
            break
        batches.append(tf.nest.map_structure(tf.convert_to_tensor, _first(batch)))
    if not batches:
        raise ValueError("recompute_batch_norm_statistics: `data` holds no batch.")
    layers = _in_call_order(model, layers, batches[0])
    counts = {}
    for layer in layers:
        counts[layer.name] = _recompute_one(model, layer, batches)
    return counts


def _in_call_order(model, layers, x):
    order = []

    def seen(layer):
        def on_call(inputs, outputs):
            del inputs
            if layer not in order:
                order.append(layer)
            return outputs
        return on_call

    with contextlib.ExitStack() as stack:
        for layer in layers:
            stack.enter_context(_taps.tapped(layer, seen(layer)))
        model(x, training=False)
    return order + [layer for layer in layers if layer not in order]


def _recompute_one(model, layer, batches):
    def moments_of(x):
        seen = {}

        def on_call(inputs, outputs):
            if "moments" not in seen:
                inputs = tf.cast(tf.convert_to_tensor(inputs), tf.float64)
                axes = _reduction_axes(layer, len(inputs.shape))
                mean, variance = tf.nn.moments(inputs, axes)
                n = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), tf.float64)
                seen["moments"] = (n, mean, variance)
            return outputs

        with _taps.tapped(layer, on_call):
            model(x, training=False)
        return seen["moments"]

    moments_fn = tf.function(moments_of, reduce_retracing=True)
    count = sum_mean = sum_sq = shift = None
    for x in batches:
        n, mean, variance = moments_fn(x)
        if shift is None:
            shift = mean
            count = tf.zeros_like(mean)
            sum_mean, sum_sq = tf.zeros_like(mean), tf.zeros_like(mean)
        count, sum_mean, sum_sq = batch_stats.add_moments(
            count, sum_mean, sum_sq, n, mean, variance, shift)
    mean, variance = batch_stats.pool_moments(count, sum_mean, sum_sq, shift)
    moving_mean, moving_variance = layer.moving_mean, layer.moving_variance
    moving_mean.assign(tf.cast(tf.reshape(mean, moving_mean.shape), moving_mean.dtype))
    moving_variance.assign(tf.cast(tf.reshape(variance, moving_variance.shape),
                                   moving_variance.dtype))
    return int(count[0].numpy()) if count.shape.rank else int(count.numpy())


