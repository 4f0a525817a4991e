"""Gradient accumulation as a pure TensorFlow rule (no Keras).

A *window* collects ``steps`` micro-batch gradients and turns them into the one
gradient that a single large batch holding the same examples would have given::

    acc   = sum_t w_t * g_t          (w_t = examples in micro-batch t, or 1)
    total = sum_t w_t
    g     = acc / total              reduction "example" or "microbatch"
    g     = acc                      reduction "sum"

With ``w_t`` = examples, a window whose last micro-batch is short gives the same
update as the big batch of the same examples (mean-reduced losses have
``g_t = mean of per-example gradients``, so ``w_t * g_t`` is their sum).

State lives in variables, not tensors, because sparse gradients are added with
``scatter_add`` (O(rows touched), never a densified embedding table) and because
the window spans calls. The adapter supplies the variable factory, so Keras 3
and tf_keras variables (and ``tf.distribute`` per-replica variables) all fit.

References: TF1 ``ConditionalAccumulator`` (averaging, staleness);
optax ``MultiSteps`` (a named state per rule).
"""

from typing import Callable, List, NamedTuple

import tensorflow as tf

REDUCTIONS = ("example", "microbatch", "sum")


class AccumulationState(NamedTuple):
    """Variables of one accumulation window.

    Attributes:
      micro_step: int64 scalar, micro-batches accepted into the open window.
      weight: float32 scalar, sum of micro-batch weights (examples) so far.
      nonfinite: int64 scalar, micro-batches in the window with a NaN or Inf.
      acc_grads: one variable per parameter, the weighted gradient sum.
    """

    micro_step: tf.Variable
    weight: tf.Variable
    nonfinite: tf.Variable
    acc_grads: List[tf.Variable]


def init_accumulation(params, make_variable: Callable, make_scalar: Callable):
    """Creates zeroed state for ``params``.

    Args:
      params: the trainable variables the window accumulates for.
      make_variable: ``make_variable(reference, name) -> variable`` creating a
        zero variable shaped like ``reference`` (the adapter decides placement
        and replica synchronisation).
      make_scalar: ``make_scalar(dtype, name, per_replica) -> variable``.

    Returns:
      An `AccumulationState`.
    """
    return AccumulationState(
        micro_step=make_scalar(tf.int64, "micro_step", False),
        weight=make_scalar(tf.float32, "window_weight", True),
        nonfinite=make_scalar(tf.int64, "window_nonfinite", True),
        acc_grads=[make_variable(p, "acc_grad") for p in params],
    )


def all_finite(grads):
    """True when no gradient (dense or ``IndexedSlices``) holds a NaN or Inf."""
    checks = []
    for g in grads:
        if g is None:
            continue
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        checks.append(tf.reduce_all(tf.math.is_finite(values)))
    if not checks:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(checks))


def accumulate(state: AccumulationState, grads, weight):
    """Adds one micro-batch: ``acc += weight * g``; counts weight and NaNs.

    ``IndexedSlices`` are scatter-added, so an embedding gradient costs the rows
    it touches, not the table. ``None`` gradients add nothing.

    Args:
      state: the window's `AccumulationState`.
      grads: gradients aligned with ``state.acc_grads``.
      weight: float32 scalar, how much this micro-batch counts.
    """
    for acc, g in zip(state.acc_grads, grads):
        if g is None:
            continue
        w = tf.cast(weight, acc.dtype)
        if isinstance(g, tf.IndexedSlices):
            acc.scatter_add(tf.IndexedSlices(
                tf.cast(g.values, acc.dtype) * w, g.indices, g.dense_shape))
        else:
            acc.assign_add(tf.cast(g, acc.dtype) * w)
    state.weight.assign_add(tf.cast(weight, state.weight.dtype))
    state.nonfinite.assign_add(
        tf.cast(tf.logical_not(all_finite(grads)), state.nonfinite.dtype))
    state.micro_step.assign_add(tf.constant(1, state.micro_step.dtype))


def window_gradients(state: AccumulationState, reduction, total_weight,
                     num_replicas=1):
    """The gradient of the whole window, as this replica should hand it on.

    Under ``tf.distribute`` each replica holds its own partial sum and the
    inner optimizer later all-reduces with SUM (Keras divides each replica's
    loss by the replica count, so that SUM gives the global mean). Scaling the
    local sum by ``num_replicas / total_weight`` (global weight) makes that one
    SUM produce exactly the big-batch gradient: one reduction per window.

    Args:
      state: the window's state (local values, read in replica context).
      reduction: one of `REDUCTIONS`.
      total_weight: the window's weight summed over replicas.
      num_replicas: replicas in sync.

    Returns:
      A list of dense gradients aligned with ``state.acc_grads``.
    """
    if reduction == "sum":
        return [tf.identity(acc) for acc in state.acc_grads]
    out = []
    for acc in state.acc_grads:
        scale = tf.cast(num_replicas, acc.dtype) / tf.maximum(
            tf.cast(total_weight, acc.dtype), tf.constant(1e-30, acc.dtype))
        out.append(acc * scale)
    return out


def reset(state: AccumulationState):
    """Empties the window (zero sums and counters)."""
    for acc in state.acc_grads:
        acc.assign(tf.zeros_like(acc))
    state.weight.assign(tf.zeros_like(state.weight))
    state.nonfinite.assign(tf.zeros_like(state.nonfinite))
    state.micro_step.assign(tf.zeros_like(state.micro_step))
