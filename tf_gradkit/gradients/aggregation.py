"""Weighted aggregation of several gradient (or update) sets into one.

The federated-averaging pattern: K clients (or K micro-batches, or K layers'
proposals) each produce a set of tensors ``g_k`` (one per variable); the one
update applies their weighted mean

    g = sum_k w_k g_k / sum_k w_k

with ``w_k`` the examples client k trained on (FedAvg, McMahan et al. 2017)
or any per-set weight, and optionally a different weight per variable
(per layer). Pure TensorFlow; works eagerly, in ``tf.function`` and under
XLA.

Where the sets arrive one at a time (a loop over clients that cannot hold
them all), `GradientAccumulator` does the same sum without keeping the sets:
``apply_gradients(zip(g_k, variables), sample_count=w_k)`` for k = 1..K with
``steps=K`` applies exactly ``sum_k w_k g_k / sum_k w_k`` once, through any
inner optimizer. For deltas (client weights minus the server's) pass
``-delta_k`` as the gradient to an ``SGD(learning_rate=1.0)`` inner optimizer:
the server then moves by the weighted mean delta (docs/weighted_aggregation.md).
"""

import tensorflow as tf

__all__ = ["weighted_average"]


def weighted_average(sets, weights, normalize=True):
    """The weighted mean (or sum) of K same-shaped sets of tensors.

    Args:
      sets: a list of K sets, each a list (or nest) of tensors with one
        entry per variable, all sets of the same structure and shapes;
        ``None`` entries (a variable a set has no gradient for) count as
        zeros and do not add their weight to that variable's total.
        ``tf.IndexedSlices`` are densified.
      weights: K non-negative numbers (a list or a [K] tensor), one per set;
        or a list of K lists, one weight per set and per variable (e.g.
        per-layer example counts).
      normalize: True (default) divides by the weights' sum per variable
        (the weighted mean); False returns the weighted sum.

    Returns:
      One set with the structure of ``sets[0]``. A variable that no set
      weighs (total weight 0) gets zeros, not NaN.

    Raises:
      ValueError: ``sets`` is empty, the sets' structures differ, or
        ``weights`` does not have one entry per set (or per set and
        variable), naming what was received.

    Example:

    >>> import tensorflow as tf
    >>> from tf_gradkit.gradients import weighted_average
    >>> a = [tf.constant([1.0, 1.0])]; b = [tf.constant([4.0, 0.0])]
    >>> [t.numpy().tolist() for t in weighted_average([a, b], [3, 1])]
    [[1.75, 0.75]]
    """
    if not isinstance(sets, (list, tuple)) or not sets:
        raise ValueError("weighted_average: `sets` must be a non-empty list of "
                         f"gradient sets. Received: sets={sets!r}")
    flat_sets = [tf.nest.flatten(s, expand_composites=False) for s in sets]
    for k, s in enumerate(sets[1:], 1):
        try:
            tf.nest.assert_same_structure(sets[0], s)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"weighted_average: every set must have the structure of sets[0]; "
                f"sets[{k}] differs ({error}).") from None
    num_sets, num_vars = len(sets), len(flat_sets[0])
    per_variable = _weights_per_variable(weights, num_sets, num_vars)
    out = []
    for j in range(num_vars):
        terms = [(flat_sets[k][j], per_variable[k][j]) for k in range(num_sets)
                 if flat_sets[k][j] is not None]
        if not terms:
            out.append(None)
            continue
        dtype = _dense(terms[0][0]).dtype
        total = tf.add_n([tf.cast(_dense(g), dtype) * tf.cast(w, dtype)
                          for g, w in terms])
        if normalize:
            weight = tf.add_n([tf.cast(w, dtype) for _, w in terms])
            total = tf.math.divide_no_nan(total, weight)
        out.append(total)
    return tf.nest.pack_sequence_as(sets[0], out)


def _dense(g):
    return tf.convert_to_tensor(g)


def _weights_per_variable(weights, num_sets, num_vars):
    """``[K][V]`` scalar weights from ``[K]`` or ``[K][V]``."""
    if isinstance(weights, (tf.Tensor, tf.Variable)) or hasattr(weights, "shape"):
        weights = tf.convert_to_tensor(weights)
        if weights.shape.rank == 1 and weights.shape[0] == num_sets:
            return [[weights[k]] * num_vars for k in range(num_sets)]
        if weights.shape.rank == 2 and tuple(weights.shape) == (num_sets, num_vars):
            return [[weights[k, j] for j in range(num_vars)] for k in range(num_sets)]
        raise ValueError(
            f"weighted_average: `weights` must have shape [{num_sets}] (one per "
            f"set) or [{num_sets}, {num_vars}] (per set and variable). Received: "
            f"shape {weights.shape.as_list()}.")
    weights = list(weights)
    if len(weights) != num_sets:
        raise ValueError(
            f"weighted_average: `weights` needs one entry per set ({num_sets}). "
            f"Received: {len(weights)} entries.")
    out = []
    for k, w in enumerate(weights):
        if isinstance(w, (list, tuple)):
            if len(w) != num_vars:
                raise ValueError(
                    f"weighted_average: weights[{k}] has {len(w)} entries; per "
                    f"variable weights need one per tensor of a set ({num_vars}).")
            out.append(list(w))
        else:
            out.append([w] * num_vars)
    for k, row in enumerate(out):
        for w in row:
            if isinstance(w, (int, float)) and not w >= 0:
                raise ValueError(
                    "weighted_average: weights must be non-negative numbers. "
                    f"Received: weights[{k}] containing {w!r}.")
    return out
