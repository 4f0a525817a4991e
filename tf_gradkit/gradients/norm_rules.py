"""The per-example norm rule of each layer kind (`per_example_gradient_norms`).

A rule knows, for one layer:

- ``variables(layer)``: which of its variables it gives norms for (a
  variable it does not name, e.g. a LoRA factor, stays uncovered and is
  refused by the caller);
- ``supports(layer, training)``: whether its math holds for this layer and
  mode, and if not, why (a transposed convolution's math differs; a
  BatchNormalization in training mixes the examples);
- ``tap``: what the forward pass must record, the output before the
  activation (``"pre_activation"``: Dense, convolutions) or the layer's
  output (``"output"``);
- ``sq_norms(layer, calls)``: from each call's ``(record, g)``, with ``g``
  the gradient of the summed loss with respect to the recorded output, the
  ``[B]`` squared norms of each of ``variables(layer)``.

Rules are looked up by *kind*; which of a flavour's layer classes make a
kind is said once, by the flavour's host (`_hosts.<flavour>.layer_kinds`,
read through `_layer_taps.kind_of`). The math is `core.ghost_norms`.
"""

from typing import Callable, NamedTuple

import tensorflow as tf

from tf_gradkit.core import ghost_norms

__all__ = ["NormRule", "RULES"]


class NormRule(NamedTuple):
    variables: Callable
    supports: Callable
    tap: str
    sq_norms: Callable
    # Takes ragged inputs (the tap then records the output's flat values).
    ragged: bool = False


def _kernel_and_bias(layer):
    return [layer.kernel] + ([layer.bias] if getattr(layer, "use_bias", False) else [])


def _always(layer, training):
    del layer, training
    return None


def _conv_supports(layer, training):
    del training
    if getattr(layer, "groups", 1) != 1:
        return f"groups={layer.groups} (the rule covers groups=1)"
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return f"data_format={layer.data_format!r} (the rule covers channels_last)"
    return None


def _layer_norm_supports(layer, training):
    del training
    if getattr(layer, "rms_scaling", False):
        return "rms_scaling=True (deprecated in Keras; not covered)"
    return None


def _batch_norm_supports(layer, training):
    del layer
    if training is None or training is False:
        return None
    return ("training=True: BatchNormalization then normalises with the batch's "
            "statistics, which mixes the examples, so no example has a gradient of "
            "its own. Pass training=False (the moving statistics: a per-example "
            "affine map, covered) or use LayerNormalization/GroupNormalization")


def _rows(t):
    t = tf.convert_to_tensor(t)
    shape = tf.shape(t)
    return tf.reshape(t, [shape[0], -1, shape[-1]])


def _matmul_layer(layer, a, g):
    """Kernel (and bias) squared norms from rows ``a`` and output gradients ``g``."""
    out = [ghost_norms.matmul_sq_norms(a, g)]
    if getattr(layer, "use_bias", False):
        out.append(ghost_norms.bias_sq_norms(g))
    return out


def _dense_sq_norms(layer, calls):
    # A layer called several times: its calls' rows concatenate (gradients add).
    a = tf.concat([_rows(r["input"]) for r, _ in calls], 1)
    g = tf.concat([_rows(gz) for _, gz in calls], 1)
    return _matmul_layer(layer, a, g)


def conv_patches_of(layer, inputs):
    """``[B, positions, prod(kernel_size) * c_in]``: the patches a Conv1D or
    Conv2D (channels last) multiplies by its kernel, in the kernel's order."""
    inputs = tf.convert_to_tensor(inputs)
    kernel, strides = tuple(layer.kernel_size), tuple(layer.strides)
    dilation, padding = tuple(layer.dilation_rate), layer.padding
    if len(kernel) == 1:  # Conv1D as a 1 x k Conv2D
        if padding == "causal":
            inputs = tf.pad(inputs, [[0, 0], [dilation[0] * (kernel[0] - 1), 0],
                                     [0, 0]])
            padding = "valid"
        inputs = inputs[:, None]
        kernel, strides, dilation = (1,) + kernel, (1,) + strides, (1,) + dilation
    return ghost_norms.conv_patches(inputs, kernel, strides, padding, dilation)


def _conv_sq_norms(layer, calls):
    patches = [conv_patches_of(layer, record["input"]) for record, _ in calls]
    outs = [_rows(gz) for _, gz in calls]
    return _matmul_layer(layer, tf.concat(patches, 1), tf.concat(outs, 1))


def _flat_embedding_call(record, gz):
    """``(example [N], ids [N], g [N, p])`` of one call: ragged ids (their
    output's flat values were tapped) or dense ones, one entry per id."""
    ids = record["input"]
    gz = tf.convert_to_tensor(gz)
    if isinstance(ids, tf.RaggedTensor):
        example = ids.nested_value_rowids()[-1]
        for rowids in reversed(ids.nested_value_rowids()[:-1]):
            example = tf.gather(rowids, example)
        values = ids.flat_values
        batch = ids.nrows()
    else:
        values = tf.convert_to_tensor(ids)
        batch = tf.shape(values, out_type=tf.int64)[0]
        example = tf.range(batch)
        values = tf.reshape(values, [batch, -1])
    per_row = tf.size(values, out_type=tf.int64) // tf.maximum(
        tf.cast(tf.shape(example)[0], tf.int64), 1)
    example = tf.repeat(example, per_row)
    return (example, tf.reshape(values, [-1]),
            tf.reshape(gz, [-1, tf.shape(gz)[-1]]), batch)


def _embedding_sq_norms(layer, calls):
    if not any(isinstance(r["input"], tf.RaggedTensor) for r, _ in calls):
        ids = tf.concat([tf.reshape(r["input"], [tf.shape(r["input"])[0], -1])
                         for r, _ in calls], 1)
        g = tf.concat([_rows(gz) for _, gz in calls], 1)
        return [ghost_norms.embedding_sq_norms(ids, g)]
    flat = [_flat_embedding_call(r, gz) for r, gz in calls]
    example, ids, g = (tf.concat([f[i] for f in flat], 0) for i in range(3))
    return [ghost_norms.grouped_sq_norms(example, ids, g, flat[0][3], layer.input_dim)]


def _axes(layer):
    return list(layer.axis) if isinstance(layer.axis, (list, tuple)) else [layer.axis]


def _scale_shift(layer):
    return ([layer.gamma] if getattr(layer, "scale", True) else []) + \
        ([layer.beta] if getattr(layer, "center", True) else [])


def _scale_shift_sq_norms(layer, calls, normalize):
    """``y = gamma * xhat + beta``: per-example gradients are small, so they
    are formed, summed over the layer's calls, then squared."""
    gammas, betas = [], []
    for record, gz in calls:
        inputs = tf.convert_to_tensor(record["input"])
        inputs = tf.cast(inputs, ghost_norms.working_dtype(inputs.dtype))
        gamma, beta = ghost_norms.scale_shift_grads(normalize(layer, inputs), gz,
                                                    _axes(layer))
        gammas.append(gamma)
        betas.append(beta)
    out = []
    if getattr(layer, "scale", True):
        out.append(ghost_norms.sq_norms(tf.add_n(gammas)))
    if getattr(layer, "center", True):
        out.append(ghost_norms.sq_norms(tf.add_n(betas)))
    return out


def _layer_normalized(layer, inputs):
    mean, var = tf.nn.moments(inputs, _axes(layer), keepdims=True)
    return (inputs - mean) * tf.math.rsqrt(var + layer.epsilon)


def _batch_normalized(layer, inputs):
    """With the moving statistics, broadcast along the layer's axes."""
    rank = inputs.shape.rank
    axes = sorted(a % rank for a in _axes(layer))
    shape = [1] * rank
    for a in axes:
        shape[a] = -1 if len(axes) == 1 else inputs.shape[a]
    mean = tf.reshape(tf.cast(layer.moving_mean, inputs.dtype), shape)
    var = tf.reshape(tf.cast(layer.moving_variance, inputs.dtype), shape)
    return (inputs - mean) * tf.math.rsqrt(var + layer.epsilon)


RULES = {
    "dense": NormRule(_kernel_and_bias, _always, "pre_activation", _dense_sq_norms),
    "conv": NormRule(_kernel_and_bias, _conv_supports, "pre_activation",
                     _conv_sq_norms),
    "embedding": NormRule(lambda layer: [layer.embeddings], _always, "output",
                          _embedding_sq_norms, ragged=True),
    "layer_norm": NormRule(_scale_shift, _layer_norm_supports, "output",
                           lambda layer, calls: _scale_shift_sq_norms(
                               layer, calls, _layer_normalized)),
    "batch_norm": NormRule(_scale_shift, _batch_norm_supports, "output",
                           lambda layer, calls: _scale_shift_sq_norms(
                               layer, calls, _batch_normalized)),
}
