"""Batch-normalisation statistics pooled over an accumulation window (no Keras).

Why this file exists: with gradient accumulation the optimizer sees one big
batch per window, but plain BatchNormalization still updates its moving
statistics once per *micro*-batch, from small-batch estimates. This module
keeps, per feature, the sufficient statistics of the window and turns them
into the mean and biased variance of the concatenated window, so the moving
statistics can be updated once per window from big-batch estimates.

For micro-batches ``t = 1..k`` with ``n_t`` elements per feature, mean ``m_t``
and biased variance ``v_t``::

    N  = sum_t n_t
    S1 = sum_t n_t * (m_t - c)
    S2 = sum_t n_t * (v_t + (m_t - c)**2)
    d  = S1 / N
    pooled_mean     = c + d
    pooled_variance = S2 / N - d**2

which is exactly the mean and biased variance of all ``N`` elements (the
example-weighted mean of the variances plus the variance of the means). ``c`` is
a shift held fixed for the whole window: the mean of the window's first
micro-batch. With ``c = 0`` this is the textbook ``E[x^2] - E[x]^2``, which in
float32 loses the variance when ``|mean| >> std`` (catastrophic cancellation:
a feature with mean 1e4 and std 1 would get a variance wrong by O(1)); a shift
near the mean keeps the terms small. The shift cancels in exact arithmetic, so
any fixed ``c`` gives the same answer.

The sums are linear in the micro-batch contributions, so they live in plain
variables that the adapter creates (and places, for ``tf.distribute``) like
the layer's own moving statistics.

Reference: Chan, Golub & LeVeque, "Algorithms for computing the sample
variance" (1983), the pairwise/pooled variance formula.
"""

import numbers
from typing import Callable, NamedTuple

import tensorflow as tf


class WindowMomentsState(NamedTuple):
    """Variables of one open window of batch statistics.

    Attributes:
      micro_step: int64 scalar, training calls already in the open window
        (``0 .. steps - 1``).
      count: per-feature element count ``N`` of the open window.
      sum_mean: per-feature ``S1 = sum_t n_t * (m_t - c)``.
      sum_sq: per-feature ``S2 = sum_t n_t * (v_t + (m_t - c)**2)``.
      shift: per-feature ``c``, the mean of the window's first micro-batch.
    """

    micro_step: tf.Variable
    count: tf.Variable
    sum_mean: tf.Variable
    sum_sq: tf.Variable
    shift: tf.Variable


def check_accumulation_steps(value, name="accumulation_steps"):
    """Returns ``value`` as a Python int, or raises if it is not an int >= 1.

    Args:
      value: the user's argument.
      name: the argument's name, for the message.

    Raises:
      ValueError: ``value`` is not an integer (bools excluded) or is < 1.
    """
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or value < 1):
        raise ValueError(
            f"`{name}` must be an integer >= 1 (the number of training calls "
            "whose batch statistics are pooled into one moving-average "
            "update; 1 behaves like plain BatchNormalization). "
            f"Received: {name}={value!r} (of type {type(value).__name__}).")
    return int(value)


def init_window_moments(make_variable: Callable):
    """Creates zeroed state for one window.

    Args:
      make_variable: ``make_variable(name, per_feature) -> variable`` creating a
        zero variable: float, shaped like the moving mean, if ``per_feature``;
        an int64 scalar otherwise. The adapter chooses placement and replica
        synchronisation (per replica: each replica pools what it sees).

    Returns:
      A `WindowMomentsState`.
    """
    return WindowMomentsState(
        micro_step=make_variable("window_micro_step", False),
        count=make_variable("window_count", True),
        sum_mean=make_variable("window_sum_mean", True),
        sum_sq=make_variable("window_sum_sq", True),
        shift=make_variable("window_shift", True),
    )


def element_count(inputs, reduction_axes, mask=None, keepdims=False):
    """Elements per feature that a micro-batch's moments average over.

    Args:
      inputs: the layer's input.
      reduction_axes: the axes the moments reduce over.
      mask: optional mask shaped like ``inputs`` without its last axis (the
        Keras convention); masked-out positions do not count.
      keepdims: keep the reduced axes (only used with a mask).

    Returns:
      float32: a scalar without a mask (the same for every feature), otherwise
      per-feature counts.
    """
    if mask is None:
        shape = tf.shape(inputs)
        return tf.cast(
            tf.reduce_prod(tf.gather(shape, reduction_axes)), tf.float32)
    weights = tf.expand_dims(tf.cast(mask, tf.float32), axis=-1)
    weights = tf.broadcast_to(weights, tf.shape(inputs))
    return tf.reduce_sum(weights, axis=reduction_axes, keepdims=keepdims)


def add_moments(count, sum_mean, sum_sq, n, mean, variance, shift):
    """Adds one micro-batch's moments to the window sums.

    Args:
      count, sum_mean, sum_sq: the window so far (see `WindowMomentsState`).
      n: elements per feature in the micro-batch (scalar or per feature).
      mean, variance: the micro-batch's per-feature mean and biased variance.
      shift: the window's fixed shift ``c``.

    Returns:
      ``(count, sum_mean, sum_sq)`` including the micro-batch.
    """
    centred = mean - shift
    return (count + n,
            sum_mean + n * centred,
            sum_sq + n * (variance + tf.square(centred)))


def pool_moments(count, sum_mean, sum_sq, shift):
    """Mean and biased variance of the whole window from its sums.

    Args:
      count, sum_mean, sum_sq: the window's sums (see `WindowMomentsState`).
      shift: the shift ``c`` the sums were taken about.

    Returns:
      ``(mean, variance)``; the variance is clipped at 0 against round-off. An
      empty window (``count == 0``) gives ``(shift, 0)``.
    """
    safe_count = tf.maximum(count, tf.ones_like(count))
    offset = tf.where(count > 0, sum_mean / safe_count, tf.zeros_like(sum_mean))
    second = tf.where(count > 0, sum_sq / safe_count, tf.zeros_like(sum_sq))
    variance = tf.maximum(second - tf.square(offset), tf.zeros_like(second))
    return shift + offset, variance


def moving_average(moving, value, momentum):
    """``moving * momentum + value * (1 - momentum)``, as Keras BN updates."""
    return moving * momentum + value * (1.0 - momentum)


def update_window_moments(state: WindowMomentsState, moving_mean,
                          moving_variance, n, mean, variance, *, momentum,
                          steps):
    """Adds one training call to the window; at its end, updates the moving
    statistics once with the pooled moments and empties the window.

    Branch-free (``tf.where``), so it runs unchanged in eager mode, in
    ``tf.function``, under ``jit_compile=True`` and per replica; between window
    ends the moving statistics are reassigned their own value, bit for bit.

    Args:
      state: the `WindowMomentsState`.
      moving_mean, moving_variance: the layer's moving-statistics variables.
      n: elements per feature in this micro-batch (see `element_count`).
      mean, variance: this micro-batch's per-feature mean and biased variance.
      momentum: Python float, the moving-average momentum.
      steps: Python int, training calls per window.

    Returns:
      Boolean scalar tensor: True when this call closed the window.
    """
    dtype = state.sum_mean.dtype
    mean = tf.broadcast_to(tf.cast(mean, dtype), tf.shape(state.shift))
    micro_step = tf.convert_to_tensor(state.micro_step)
    shift = tf.where(micro_step == 0, mean, tf.convert_to_tensor(state.shift))
    count, sum_mean, sum_sq = add_moments(
        tf.convert_to_tensor(state.count), tf.convert_to_tensor(state.sum_mean),
        tf.convert_to_tensor(state.sum_sq), tf.cast(n, dtype), mean,
        tf.cast(variance, dtype), shift)

    step = micro_step + 1
    window_done = step >= steps
    pooled_mean, pooled_variance = pool_moments(count, sum_mean, sum_sq, shift)
    update = tf.logical_and(window_done, count > 0)
    old_mean = tf.convert_to_tensor(moving_mean)
    old_variance = tf.convert_to_tensor(moving_variance)
    moving_mean.assign(tf.where(
        update,
        tf.cast(moving_average(tf.cast(old_mean, dtype), pooled_mean,
                               momentum), old_mean.dtype),
        old_mean))
    moving_variance.assign(tf.where(
        update,
        tf.cast(moving_average(tf.cast(old_variance, dtype), pooled_variance,
                               momentum), old_variance.dtype),
        old_variance))

    zeros = tf.zeros_like(count)
    state.count.assign(tf.where(window_done, zeros, count))
    state.sum_mean.assign(tf.where(window_done, zeros, sum_mean))
    state.sum_sq.assign(tf.where(window_done, zeros, sum_sq))
    state.shift.assign(shift)
    state.micro_step.assign(tf.where(window_done, tf.zeros_like(step), step))
    return window_done
