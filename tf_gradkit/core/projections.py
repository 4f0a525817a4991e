"""Exact Euclidean projections onto convex sets, in pure TensorFlow.

Each function returns ``argmin_{z in C} |z - x|`` for its set ``C`` (the
closed-form or sort-based exact projection, not an approximation), is
idempotent (projecting a feasible point returns it), and uses only ops with
XLA and GPU kernels (sorts and cumulative sums; no SVD, no host syncs), so it
can run inside a compiled train step right after the update.

Cost per call, for ``n`` entries: ``O(n)`` for `project_nonneg`,
`project_box`, `project_l2_ball`, `project_max_norm`, `project_unit_norm` and
`apply_mask`; ``O(n log n)`` (one sort) for `project_l1_ball` and
`project_simplex`.

References:
  J. Duchi, S. Shalev-Shwartz, Y. Singer, T. Chandra, "Efficient projections
  onto the l1-ball for learning in high dimensions", ICML 2008 (the sort-based
  simplex and l1-ball projections).
"""

import tensorflow as tf


def project_nonneg(x):
    """Onto ``{z >= 0}``: ``max(x, 0)``."""
    return tf.maximum(x, tf.zeros_like(x))


def project_box(x, lower, upper):
    """Onto ``{lower <= z <= upper}`` (scalars or tensors broadcasting to x)."""
    lower = tf.cast(lower, x.dtype)
    upper = tf.cast(upper, x.dtype)
    return tf.minimum(tf.maximum(x, lower), upper)


def wide_dtype(x):
    """The dtype to compute norms and iterations of ``x`` in: float32 for
    half precision (bfloat16/float16 norms overflow or lose digits), else
    ``x``'s own."""
    return tf.float32 if x.dtype in (tf.bfloat16, tf.float16) else x.dtype


def _norm(x, axis):
    wide = wide_dtype(x)
    xw = tf.cast(x, wide)
    return tf.sqrt(tf.reduce_sum(tf.square(xw), axis=axis, keepdims=True)), wide


def project_l2_ball(x, radius):
    """Onto ``{|z|_2 <= radius}`` (the whole tensor): rescale if outside."""
    norm, wide = _norm(x, axis=None)
    radius = tf.cast(radius, wide)
    scale = tf.minimum(tf.ones_like(norm), radius / tf.maximum(norm, 1e-30))
    return tf.cast(tf.cast(x, wide) * scale, x.dtype)


def project_max_norm(x, max_value, axis=0):
    """Slices along ``axis`` (Keras's MaxNorm convention: the norm is taken
    over ``axis``) rescaled so their L2 norm is at most ``max_value``."""
    norm, wide = _norm(x, axis=axis)
    max_value = tf.cast(max_value, wide)
    scale = tf.minimum(tf.ones_like(norm), max_value / tf.maximum(norm, 1e-30))
    return tf.cast(tf.cast(x, wide) * scale, x.dtype)


def project_unit_norm(x, axis=0):
    """Onto the unit sphere along ``axis`` (norms over ``axis`` equal 1).

    The sphere is not convex; this is its nearest point, ``x / |x|``, for any
    nonzero slice. An all-zero slice has no nearest point and is mapped to
    ``e_1 = (1, 0, ..., 0)`` so the result is always feasible.
    """
    norm, wide = _norm(x, axis=axis)
    xw = tf.cast(x, wide)
    first = tf.one_hot(0, tf.shape(x)[axis], dtype=wide)
    shape = [1] * len(x.shape)
    shape[axis] = -1
    fallback = tf.broadcast_to(tf.reshape(first, shape), tf.shape(xw))
    out = tf.where(norm > 0, xw / tf.maximum(norm, 1e-30), fallback)
    return tf.cast(out, x.dtype)


def project_simplex(x, axis=-1, total=1.0):
    """Each slice along ``axis`` onto ``{z >= 0, sum z = total}``.

    Sort-based (Duchi et al.): with ``u`` sorted descending and ``c`` its
    cumulative sum, ``rho = max{j : u_j - (c_j - total) / j > 0}`` and
    ``theta = (c_rho - total) / rho``; the projection is ``max(x - theta, 0)``.
    """
    wide = tf.float32 if x.dtype in (tf.bfloat16, tf.float16) else x.dtype
    moved = tf.experimental.numpy.moveaxis(tf.cast(x, wide), axis, -1)
    n = tf.shape(moved)[-1]
    u = tf.sort(moved, axis=-1, direction="DESCENDING")
    css = tf.cumsum(u, axis=-1) - tf.cast(total, wide)
    j = tf.cast(tf.range(1, n + 1), wide)
    cond = tf.cast(u - css / j > 0, wide)
    rho = tf.reduce_sum(cond, axis=-1, keepdims=True)            # >= 1 always
    idx = tf.cast(rho, tf.int32) - 1
    theta = tf.gather(css, idx, batch_dims=len(moved.shape) - 1) / rho
    out = tf.maximum(moved - theta, 0.0)
    return tf.cast(tf.experimental.numpy.moveaxis(out, -1, axis), x.dtype)


def project_l1_ball(x, radius):
    """Onto ``{|z|_1 <= radius}`` (the whole tensor).

    Inside the ball: unchanged. Outside: ``sign(x) * max(|x| - theta, 0)``
    with ``theta`` from the simplex projection of ``|x|`` onto total
    ``radius``.
    """
    flat = tf.reshape(x, [1, -1])
    wide = tf.float32 if x.dtype in (tf.bfloat16, tf.float16) else x.dtype
    flat_w = tf.cast(flat, wide)
    radius = tf.cast(radius, wide)
    inside = tf.reduce_sum(tf.abs(flat_w)) <= radius
    onto = tf.sign(flat_w) * project_simplex(tf.abs(flat_w), axis=-1, total=radius)
    out = tf.where(inside, flat_w, onto)
    return tf.cast(tf.reshape(out, tf.shape(x)), x.dtype)


def apply_mask(x, mask):
    """Onto ``{z : z = 0 where mask == 0}``: zero the masked-out entries."""
    return tf.where(tf.cast(mask, tf.bool), x, tf.zeros_like(x))
