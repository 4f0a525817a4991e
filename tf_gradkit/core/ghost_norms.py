"""Per-example gradient norms of one layer without its per-example gradients.

For a loss ``L = sum_i L_i`` over a batch, a layer whose output for example
``i`` is ``z_i = a_i W (+ b)`` (rows ``t`` of ``a_i``: positions, time steps
or image patches) has the per-example gradient ``G_i = a_i^T g_i`` with
``g_i = dL/dz_i`` (the gradient of the *summed* loss: example ``i``'s rows
only see ``L_i`` when examples do not interact). Its squared norm needs no
``G_i``:

    ||a_i^T g_i||_F^2 = sum_{t,s} (a_it . a_is) (g_it . g_is)
                      = <a_i a_i^T, g_i g_i^T>_F            (the "ghost norm")

which costs ``T^2 (d + p)`` per example instead of ``T d p`` memory; with one
row (``T = 1``) it is ``|a_i|^2 |g_i|^2``. Each function below returns
squared norms ``[B]`` and picks whichever of the two forms is cheaper.

References: Goodfellow, "Efficient per-example gradient computations", 2015;
Li et al., "Large language models can be strong differentially private
learners" (ghost clipping), 2021; Bu et al., "Differentially private
optimization on large model at small cost" (book-keeping), 2023.
"""

import tensorflow as tf

__all__ = ["matmul_sq_norms", "bias_sq_norms", "embedding_sq_norms", "grouped_sq_norms",
           "conv_patches", "scale_shift_grads", "sq_norms", "working_dtype"]


def working_dtype(dtype):
    """float32 for half-precision inputs (a mixed-precision model's taps),
    else ``dtype``: squared norms overflow float16 quickly."""
    dtype = tf.as_dtype(dtype)
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def _rows(t):
    """``[B, T, d]`` from ``[B, d]`` or ``[B, ..., d]``."""
    shape = tf.shape(t)
    return tf.reshape(t, [shape[0], -1, shape[-1]])


def matmul_sq_norms(a, g):
    """``||a_i^T g_i||_F^2`` for ``a [B, ..., d]`` and ``g [B, ..., p]``
    with the same middle axes: a kernel's per-example squared norms."""
    dtype = working_dtype(a.dtype)
    a, g = _rows(tf.cast(a, dtype)), _rows(tf.cast(g, dtype))
    if a.shape[1] == 1:
        return tf.reduce_sum(tf.square(a), [1, 2]) * tf.reduce_sum(tf.square(g), [1, 2])
    rows = a.shape[1]
    d, p = a.shape[-1], g.shape[-1]
    if rows is not None and d is not None and p is not None and rows * rows > d * p:
        # Materialising a_i^T g_i [B, d, p] is cheaper than the T x T Grams.
        return tf.reduce_sum(tf.square(tf.einsum("btd,btp->bdp", a, g)), [1, 2])
    return tf.reduce_sum(tf.einsum("btd,bsd->bts", a, a) *
                         tf.einsum("btp,bsp->bts", g, g), [1, 2])


def bias_sq_norms(g):
    """``||sum_t g_it||^2``: a bias's per-example squared norms."""
    g = tf.cast(g, working_dtype(g.dtype))
    return tf.reduce_sum(tf.square(tf.reduce_sum(_rows(g), 1)), 1)


def embedding_sq_norms(ids, g):
    """An embedding table's per-example squared norms.

    Example ``i``'s gradient adds ``g_it`` to row ``ids_it`` of the table, so
    ``||G_i||^2 = sum_{t,s} [ids_it == ids_is] (g_it . g_is)``.
    """
    ids = tf.reshape(ids, [tf.shape(ids)[0], -1])
    g = _rows(tf.cast(g, working_dtype(g.dtype)))
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g.dtype)
    return tf.reduce_sum(same * tf.einsum("btp,bsp->bts", g, g), [1, 2])


def grouped_sq_norms(example, ids, g, num_examples, num_ids):
    """An embedding table's per-example squared norms from flat rows: row
    ``t`` of ``g [N, p]`` belongs to example ``example[t]`` and adds to
    table row ``ids[t]``. Rows are grouped by ``(example, id)`` (a sort, no
    ``N x N`` Gram, no padding: ragged ids), each group's gradient summed
    and squared, and the squares summed per example:
    ``||G_i||^2 = sum_k ||sum_{t: example_t = i, ids_t = k} g_t||^2``.
    Every shape is static given ``N``, so it compiles under XLA."""
    g = tf.cast(g, working_dtype(g.dtype))
    example = tf.cast(example, tf.int64)
    keys = example * tf.cast(num_ids, tf.int64) + tf.cast(ids, tf.int64)
    order = tf.argsort(keys, stable=True)
    keys, example = tf.gather(keys, order), tf.gather(example, order)
    starts = tf.concat([tf.ones([1], tf.bool), keys[1:] != keys[:-1]], 0)
    group = tf.cumsum(tf.cast(starts, tf.int32)) - 1
    rows = tf.shape(keys)[0]
    sums = tf.math.unsorted_segment_sum(tf.gather(g, order), group, rows)
    # Each group's example; groups past the last are empty (zero sums).
    owner = tf.math.unsorted_segment_max(example, group, rows)
    owner = tf.clip_by_value(owner, 0, tf.cast(num_examples, tf.int64) - 1)
    return tf.math.unsorted_segment_sum(tf.reduce_sum(tf.square(sums), 1),
                                        owner, num_examples)


def conv_patches(inputs, kernel_size, strides, padding, dilation_rate):
    """``[B, positions, k_h * k_w * c_in]``: the input patches a 2-D
    convolution (channels last) multiplies by its kernel, in the kernel's
    ``[k_h, k_w, c_in]`` order; with ``g [B, positions, c_out]`` the
    kernel's per-example norms are `matmul_sq_norms`."""
    patches = tf.image.extract_patches(
        inputs, sizes=[1, kernel_size[0], kernel_size[1], 1],
        strides=[1, strides[0], strides[1], 1],
        rates=[1, dilation_rate[0], dilation_rate[1], 1],
        padding=padding.upper())
    return _rows(patches)


def scale_shift_grads(normalized, g, param_axes):
    """Example ``i``'s gradients of ``gamma`` and ``beta`` in
    ``y = gamma * xhat + beta`` (LayerNormalization; BatchNormalization at
    inference, where ``xhat`` uses the moving statistics).

    ``gamma`` varies along ``param_axes`` of ``xhat [B, ...]`` and is shared
    along the others, so ``dL_i/dgamma = sum_{shared} g_i * xhat_i`` and
    ``dL_i/dbeta = sum_{shared} g_i``: small (``B x`` the parameter's size),
    so they are formed, and a layer called several times adds them up before
    they are squared (`sq_norms`).

    Args:
      normalized: ``xhat``, ``[B, ...]``.
      g: ``dL/dy``, the same shape.
      param_axes: axes (>= 1, or negative) along which the parameters vary.

    Returns:
      ``(gamma_grads, beta_grads)``, each ``[B, *parameter shape]``.
    """
    dtype = working_dtype(normalized.dtype)
    normalized, g = tf.cast(normalized, dtype), tf.cast(g, dtype)
    rank = normalized.shape.rank
    kept = {a % rank for a in param_axes}
    if 0 in kept:
        raise ValueError("scale_shift_grads: `param_axes` must not contain the "
                         f"batch axis 0. Received: param_axes={param_axes!r}")
    shared = [a for a in range(1, rank) if a not in kept]
    if not shared:
        return g * normalized, g
    return tf.reduce_sum(g * normalized, shared), tf.reduce_sum(g, shared)


def sq_norms(per_example):
    """``||t_i||^2`` of a ``[B, ...]`` tensor of per-example gradients."""
    per_example = tf.cast(per_example, working_dtype(per_example.dtype))
    return tf.reduce_sum(tf.square(tf.reshape(per_example, [tf.shape(per_example)[0], -1])), 1)
