"""Rows of a Jacobian from a layer's input and output gradients (pure TF).

For residuals ``R [B, m]`` (``m`` per example) of a model whose examples do
not interact, a layer whose output for example ``i`` is ``z_i = a_i W (+ b)``
(rows ``t`` of ``a_i``: positions, time steps or image patches) has

    dR_ik / dW = a_i^T g_ik,    g_ik = d(sum_j R_jk) / dz_i

so one forward pass and ``m`` backward passes (one per residual column,
or one vectorised pass) give every row of the Jacobian, instead of one
forward-mode product per parameter. Each function below returns the rows
of one variable as ``[B, m, *variable.shape]`` from ``g [m, B, ...]``.
This is `ghost_norms`' per-example gradient, kept instead of squared.

Reference: Goodfellow, "Efficient per-example gradient computations", 2015.
"""

import tensorflow as tf

__all__ = ["matmul_rows", "bias_rows", "embedding_rows", "scale_shift_rows"]


def _rows(t, lead):
    """``[*lead, T, d]`` from ``[*lead, d]`` or ``[*lead, ..., d]``."""
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([shape[:lead], [-1], shape[-1:]], 0))


def matmul_rows(a, g, dtype):
    """Kernel rows ``[B, m, d, p]`` from ``a [B, ..., d]`` and
    ``g [m, B, ..., p]`` (the same middle axes)."""
    a, g = _rows(tf.cast(a, dtype), 1), _rows(tf.cast(g, dtype), 2)
    if a.shape[1] == 1 and g.shape[2] == 1:
        return a[:, None, 0, :, None] * tf.transpose(g[:, :, 0], [1, 0, 2])[:, :, None, :]
    return tf.einsum("btd,mbtp->bmdp", a, g)


def bias_rows(g, dtype):
    """A bias's rows ``[B, m, p]``: ``sum_t g_ikt``."""
    g = _rows(tf.cast(g, dtype), 2)
    return tf.transpose(tf.reduce_sum(g, 2), [1, 0, 2])


def embedding_rows(ids, g, vocabulary, dtype):
    """An embedding table's rows ``[B, m, V, d]``: example ``i``'s column
    ``k`` adds ``g_ikt`` to row ``ids_it`` of the table."""
    ids = tf.reshape(tf.cast(ids, tf.int32), [tf.shape(ids)[0], -1])
    g = _rows(tf.cast(g, dtype), 2)
    return tf.einsum("btv,mbtd->bmvd", tf.one_hot(ids, vocabulary, dtype=dtype), g)


def scale_shift_rows(normalized, g, param_axes, dtype):
    """``y = gamma * xhat + beta``: the rows ``([B, m, *gamma], [B, m, *beta])``
    from ``xhat [B, ...]`` and ``g [m, B, ...]`` (``gamma`` varies along
    ``param_axes`` of ``xhat`` and is shared along its other axes)."""
    normalized, g = tf.cast(normalized, dtype), tf.cast(g, dtype)
    rank = normalized.shape.rank
    kept = {a % rank for a in param_axes}
    shared = [a + 1 for a in range(1, rank) if a not in kept]   # axes of g
    gamma = g * normalized[None]
    if shared:
        gamma, g = tf.reduce_sum(gamma, shared), tf.reduce_sum(g, shared)
    perm = lambda t: tf.transpose(t, [1, 0] + list(range(2, t.shape.rank)))  # noqa: E731
    return perm(gamma), perm(g)
