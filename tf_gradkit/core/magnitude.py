"""Magnitude pruning masks (pure TensorFlow, XLA-compatible).

The rules of tensorflow-model-optimization 0.8.1's ``pruning_impl`` (read
there; our own code), so that a sparsity gives the same count of zeros:

- `magnitude_mask(w, s)`: keep ``k = max(round(float32(size) * (1 - s)), 1)``
  weights (``round`` half to even, as ``tf.round``), those with ``|w| >=`` the
  k-th largest ``|w|`` of this tensor; ties at a positive threshold are all
  kept (tfmot's rule). Where the k-th largest ``|w|`` is 0 (fewer than ``k``
  non-zero weights: the sparsity went down after pruned weights were set to
  exactly zero), exactly ``k`` are kept: every non-zero weight and the zeros
  of lowest flat index. tfmot keeps every tie there, but its pruned weights
  are not zero when it recomputes a mask (the optimizer moved them since the
  last forward pass), so it keeps ``k`` too, choosing the zeros its last update
  moved most; ours have no such update (pruned stays pruned).
- with ``block_size`` (2-D weights only): ``|w|`` pooled over blocks
  (``"avg"`` over the block's real entries, or ``"max"``; edge blocks are
  partial), the same rule counted in blocks, the block mask expanded back.
  Blocks start at row and column 0. tfmot pools with ``"SAME"`` padding,
  which puts ``p = (ceil(n / b) * b - n) // 2`` padding rows (columns) before
  its first block, but expands its block mask from row 0: where ``p > 0``
  (a block size ``b >= 3`` that does not divide ``n``, e.g. ``b = 3, n = 4``),
  tfmot's block ``i`` is decided by rows ``[i*b - p, (i+1)*b - p)`` and masks
  rows ``[i*b, (i+1)*b)``; ours is decided by the rows it masks. Where
  ``p == 0`` on both axes the masks are tfmot's.
- `m_by_n_mask(w, m, n)`: in every group of ``n`` consecutive weights along
  the input axis, the ``n - m`` largest ``|w|`` are kept (ties: the lower
  index), i.e. ``m`` of every ``n`` are zero (2:4). A Dense kernel
  ``[in, out]`` groups along ``in`` for each output; a Conv2D kernel
  ``[h, w, in, out]`` along ``in`` for each output and kernel position (the
  layout sparse tensor cores and TFLite read). Other ranks are refused.

Every mask has the weights' shape and dtype, 0 or 1.
"""

import tensorflow as tf

__all__ = ["magnitude_mask", "m_by_n_mask", "kept_count", "BLOCK_POOLINGS"]

BLOCK_POOLINGS = ("avg", "max")


def kept_count(size, sparsity):
    """Weights kept at ``sparsity`` among ``size``: tfmot's rounding."""
    kept = tf.round(tf.cast(size, tf.float32) * (1.0 - tf.cast(sparsity, tf.float32)))
    return tf.cast(tf.maximum(kept, 1.0), tf.int32)


def _mask_by_threshold(magnitudes, sparsity):
    flat = tf.reshape(magnitudes, [-1])
    ordered = tf.sort(flat, direction="DESCENDING")
    kept = kept_count(tf.size(flat), sparsity)
    threshold = tf.gather(ordered, kept - 1)
    # A zero threshold: every non-zero, then the zeros of lowest index up to k.
    is_zero = tf.equal(flat, 0.0)
    zeros_before = tf.cumsum(tf.cast(is_zero, tf.int32), exclusive=True)
    nonzero = tf.size(flat) - tf.reduce_sum(tf.cast(is_zero, tf.int32))
    revived = tf.logical_and(is_zero, zeros_before < kept - nonzero)
    keep = tf.where(threshold > 0.0, flat >= threshold,
                    tf.logical_or(tf.logical_not(is_zero), revived))
    return tf.cast(tf.reshape(keep, tf.shape(magnitudes)), magnitudes.dtype)


def _pool(magnitudes, block, pooling):
    """``|w|`` of a 2-D tensor pooled over ``block`` (partial edge blocks:
    the average over their real entries)."""
    rows, cols = magnitudes.shape
    bh, bw = block
    pad = [[0, -rows % bh], [0, -cols % bw]]
    padded = tf.pad(magnitudes, pad)
    shape = [(rows + pad[0][1]) // bh, bh, (cols + pad[1][1]) // bw, bw]
    blocks = tf.reshape(padded, shape)
    if pooling == "max":
        return tf.reduce_max(blocks, axis=[1, 3])
    counts = tf.reshape(tf.pad(tf.ones_like(magnitudes), pad), shape)
    return tf.reduce_sum(blocks, axis=[1, 3]) / tf.reduce_sum(counts, axis=[1, 3])


def magnitude_mask(weights, sparsity, block_size=(1, 1), pooling="avg"):
    """The 0/1 mask of ``weights`` at ``sparsity`` (see the module doc).

    Args:
      weights: a tensor or variable (float).
      sparsity: scalar in [0, 1): the fraction to zero (rounded as tfmot).
      block_size: ``(rows, cols)`` blocks pruned together (2-D weights only).
      pooling: how a block's magnitude is read, ``"avg"`` or ``"max"``.
    """
    weights = tf.convert_to_tensor(weights)
    magnitudes = tf.abs(weights)
    block = tuple(block_size)
    if block == (1, 1):
        return _mask_by_threshold(magnitudes, sparsity)
    if weights.shape.rank != 2:
        raise ValueError("magnitude_mask: `block_size` needs 2-D weights. Received: "
                         f"weights of shape {weights.shape}, block_size={block}")
    block_mask = _mask_by_threshold(_pool(magnitudes, block, pooling), sparsity)
    expanded = tf.repeat(tf.repeat(block_mask, block[0], axis=0), block[1], axis=1)
    return expanded[:weights.shape[0], :weights.shape[1]]


def _to_groups(weights):
    """Rows whose last axis is the input axis, and how to undo it."""
    rank = weights.shape.rank
    if rank == 2:  # [in, out] -> [out, in]
        return tf.transpose(weights), lambda m: tf.transpose(m)
    if rank == 4:  # [h, w, in, out] -> [out * h * w, in]
        h, w, cin, cout = weights.shape
        rows = tf.reshape(tf.transpose(weights, [3, 0, 1, 2]), [cout * h * w, cin])
        return rows, lambda m: tf.transpose(tf.reshape(m, [cout, h, w, cin]), [1, 2, 3, 0])
    raise ValueError(
        "m_by_n_mask: M:N sparsity groups along the input axis of a Dense kernel "
        f"[in, out] or a Conv2D kernel [h, w, in, out]. Received: weights of shape "
        f"{weights.shape}")


def m_by_n_mask(weights, m, n):
    """The 0/1 mask with ``m`` zeros in every ``n`` along the input axis."""
    weights = tf.convert_to_tensor(weights)
    if not (isinstance(m, int) and isinstance(n, int) and 0 < m < n):
        raise ValueError(f"m_by_n_mask: need integers 0 < m < n. Received: m={m!r}, "
                         f"n={n!r}")
    rows, undo = _to_groups(tf.abs(weights))
    length = rows.shape[1]
    padded = tf.pad(rows, [[0, 0], [0, -length % n]])  # zeros sort last
    groups = tf.reshape(padded, [-1, n])
    _, keep = tf.math.top_k(groups, k=n - m)  # ties: the lower index
    mask = tf.reduce_sum(tf.one_hot(keep, n, dtype=weights.dtype), axis=1)
    mask = tf.reshape(mask, tf.shape(padded))[:, :length]
    return undo(mask)
