"""Which parameters a LevenbergMarquardt step solves for (the algorithm
class inherits `Supports`): every one, the unpruned weights when
`pruning.MaskAware` handed the optimizer its masks (``masks``), or
``subset=``'s share. Uses the algorithm's ``subset``, ``masks``,
``iterations`` and the host hook ``_path``.
"""

import numpy as np
import tensorflow as tf

from tf_gradkit.core.lm import linearize as lin_lib


def check_subset(subset):
    fraction = isinstance(subset, (int, float)) and not isinstance(subset, bool) \
        and 0 < subset <= 1
    if subset is not None and subset != "layers" and not fraction:
        raise ValueError(
            "LevenbergMarquardt: `subset` must be None (every parameter), a "
            "fraction in (0, 1] (drawn at random each step) or 'layers' (one "
            f"layer per step, in turn). Received: subset={subset!r}")


def count_nonzero_now(mask, size):
    """Non-zeros of a mask variable at trace time; ``size`` if it cannot be
    read then (a graph tensor), which keeps every entry in the system."""
    try:
        with tf.init_scope():
            return int(tf.math.count_nonzero(tf.convert_to_tensor(mask)).numpy())
    except Exception:  # noqa: BLE001 - a symbolic tensor: no value yet
        return size


class Supports:
    """The support of a step (a part of the algorithm class)."""

    def _support(self, variables, tf_vars):
        """The parameters to solve for, when `pruning.MaskAware` handed this
        optimizer its masks (``self.masks``): only the unpruned weights.

        The Jacobian then has one column per unpruned weight, so at 80%
        sparsity the damped system is 5x smaller. The system's size is read
        from the masks when the step is traced (eagerly: every step); a traced
        step keeps it, padding with frozen entries as more weights are pruned,
        so after a pruning schedule ends, re-trace (e.g.
        ``model.make_train_function(force=True)``) to get the full saving.
        """
        if self.subset is not None:
            if self.masks is not None:
                raise ValueError(
                    "LevenbergMarquardt: `subset` chooses the parameters each step "
                    "solves for, and so do the pruning masks it was handed; use "
                    "one of the two (subset=None under pruning).")
            return self._subset_support(variables, tf_vars)
        if self.masks is None:
            return None
        masks = [self.masks.mask_for(v, cast=False) for v in variables]
        if all(m is None for m in masks):
            return None
        parts, capacity = [], 0
        for v, m in zip(tf_vars, masks):
            n = v.shape.num_elements()
            if m is None:
                parts.append(tf.ones([n], tf.float32))
                capacity += n
                continue
            parts.append(tf.reshape(tf.cast(tf.not_equal(m, 0), tf.float32), [-1]))
            capacity += count_nonzero_now(m, n)
        return lin_lib.support_from_mask(tf.concat(parts, axis=0), max(capacity, 1))

    def _subset_support(self, variables, tf_vars):
        """`subset`'s parameters for this step (from ``iterations``)."""
        sizes = [v.shape.num_elements() for v in tf_vars]
        total = sum(sizes)
        step = tf.cast(self.iterations, tf.int64)
        if self.subset == "layers":
            groups = {}
            offset = 0
            for v, n in zip(variables, sizes):
                path = self._path(v).split(":")[0]
                layer = path.rsplit("/", 1)[0] if "/" in path else path
                groups.setdefault(layer, []).append((offset, n))
                offset += n
            indices = [np.concatenate([np.arange(o, o + n) for o, n in parts])
                       for parts in groups.values()]
            capacity = max(len(i) for i in indices)
            table = np.stack([np.pad(i, (0, capacity - len(i)), mode="edge")
                              for i in indices]).astype(np.int32)
            valid = np.stack([np.arange(capacity) < len(i) for i in indices])
            which = tf.cast(step % len(indices), tf.int32)
            return lin_lib.Support(indices=tf.gather(tf.constant(table), which),
                                   valid=tf.gather(tf.constant(valid), which))
        k = max(1, int(np.ceil(self.subset * total)))
        draw = tf.random.stateless_uniform([total], seed=tf.stack([step, step * 0 + 7]))
        chosen = tf.sort(tf.math.top_k(draw, k=k, sorted=False).indices)
        return lin_lib.Support(indices=chosen, valid=tf.ones([k], tf.bool))
