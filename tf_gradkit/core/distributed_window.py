"""Runs one accumulation micro-step and, when the window is full, the real update.

Why this file exists: the real update is conditional (every ``steps`` calls),
and under ``tf.distribute.MirroredStrategy`` the inner optimizer's update uses
``merge_call`` and an all-reduce, which must never sit inside a ``tf.cond``
built in replica context (that is the "merge_call called while defining a new
graph" crash of Keras 3's ``gradient_accumulation_steps``). So:

1. In replica context each replica adds its gradient to its *own* per-replica
   sums (sync-on-read variables): no communication per micro-batch.
2. One ``merge_call`` (free at run time; it only switches context while
   tracing) enters cross-replica context, where the ``tf.cond`` on "window
   full" is built. Its true branch reads the window's weight across replicas
   and calls ``call_for_each_replica`` to run the inner optimizer, whose
   single all-reduce is the only gradient reduction of the window.

Without a strategy (or where the strategy needs no ``merge_call``, e.g. XLA on
GPUs) one integer ``switch_case`` decides between keeping the window open,
applying it and skipping it (the finiteness test before it runs in a small
conditional of its own, entered by the closing step only), and its "keep the
window open" branch is empty: the sums and counters are written outside it
(see the lazy reset in `accumulation`), so under XLA an open micro-step is
the adds and a few scalar writes. (XLA turns a two-way ``cond`` on a boolean
into selects that run both branches; an integer ``switch_case`` stays a
conditional.)
"""

import tensorflow as tf

from tf_gradkit.core import accumulation


def concurrent_workers(strategy):
    """Whether workers run steps against shared state at the same time, not
    in lock-step: ``ParameterServerStrategy`` (`core.exclusive`)."""
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def _num_replicas():
    return tf.distribute.get_strategy().num_replicas_in_sync


def micro_step(state, grads, *, weight, accept, steps, force=False,
               apply_window, skip_window, count_dropped, count=None,
               gradients_finite=None):
    """Accumulates ``grads`` (if ``accept``) and applies the window when full.

    Must be called in replica context (or with no strategy).

    Args:
      state: `accumulation.AccumulationState`.
      grads: gradients for ``state.acc_grads`` (``None`` entries allowed).
      weight: float32 scalar weight of this micro-batch, or ``None`` when the
        call only closes the window (``flush``).
      count: what it adds to the window's count (`accumulation.accumulate`;
        default ``weight``).
      accept: boolean scalar tensor or Python bool: False drops the gradient
        (stale ``local_step``).
      steps: Python int, micro-batches per window.
      force: apply whatever the window holds now (``flush``), if non-empty.
      apply_window: ``apply_window(total_weight)``, run per replica, performs
        the inner update from `accumulation.window_sums`.
      skip_window: ``skip_window(total_weight)``, run per replica, for a window
        holding a NaN or Inf (records it; the window is dropped either way).
      count_dropped: ``count_dropped(n)`` adds ``n`` (int64) dropped gradients.
      gradients_finite: optional ``gradients_finite(total_weight)``, run per
        replica where the window closes: False when the gradient this replica
        would hand on holds a NaN or Inf although its sums do not (a float32
        sum narrowed to a 16-bit variable's dtype). The window is then skipped
        on every replica, as for a non-finite sum.
    """
    def bad_gradients(total_weight):
        if gradients_finite is None:
            return tf.constant(0.0)
        return tf.cast(tf.logical_not(gradients_finite(total_weight)), tf.float32)

    if weight is not None:
        accumulation.accumulate(state, grads, weight, accept, count)
        if accept is not True:
            count_dropped(tf.cast(tf.logical_not(accept), tf.int64))

    micro = state.micro_step.read_value()
    ready = micro > 0 if force else micro >= steps

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        def run(fn, args):
            return fn(*args)

        if _num_replicas() == 1:
            # The finiteness test runs in a small conditional only the closing
            # step enters; one more conditional then keeps the window open,
            # applies it or skips it (not nested: a nested one slowed the
            # closing step under XLA; docs/gradient_accumulation.md).
            def closing_finite():
                return tf.logical_and(
                    accumulation.window_finite(state),
                    tf.equal(bad_gradients(state.weight.read_value()), 0.0))

            finite = tf.switch_case(tf.cast(ready, tf.int32), [
                lambda: tf.constant(True), closing_finite])
            index = tf.where(ready, tf.where(finite, 1, 2), 0)
            tf.switch_case(index, [lambda: tf.constant(0),
                                   *_apply_and_skip(state.weight.read_value(), apply_window,
                                                    skip_window, run)])
        else:
            def close():
                # Over replicas, and only when the window closes.
                context = tf.distribute.get_replica_context()
                total_weight, nonfinite = context.all_reduce(
                    tf.distribute.ReduceOp.SUM, [state.weight.read_value(), _nonfinite(state)])
                if gradients_finite is not None:  # needs the window's total weight
                    nonfinite += context.all_reduce(tf.distribute.ReduceOp.SUM,
                                                    bad_gradients(total_weight))
                _apply_or_skip(total_weight, nonfinite, apply_window, skip_window, run)
                return tf.constant(1)

            tf.switch_case(tf.cast(ready, tf.int32), [lambda: tf.constant(0), close])
    else:
        def _cross_replica(distribution, ready):
            ready = distribution.experimental_local_results(ready)[0]

            def run(fn, args):
                return distribution.extended.call_for_each_replica(fn, args=args)

            def close():
                # Read here: sync-on-read sums over replicas, and only when the
                # window closes, so an open micro-step does no cross-replica work.
                total_weight = state.weight.read_value()
                nonfinite = distribution.reduce(
                    tf.distribute.ReduceOp.SUM,
                    distribution.extended.call_for_each_replica(
                        lambda total: _nonfinite(state) + bad_gradients(total),
                        args=(total_weight,)),
                    axis=None)
                _apply_or_skip(total_weight, nonfinite, apply_window, skip_window, run)
                return tf.constant(1)

            tf.cond(ready, close, lambda: tf.constant(0))

        tf.distribute.get_replica_context().merge_call(_cross_replica, args=(ready,))

    accumulation.start_next_window(state, ready)


def widened_sums_on_one_replica(sums, dtypes):
    """Each replica's window ``sums`` ready to be handed on, for sums kept in
    a wider dtype than their variable's (``dtypes``; `accumulation.sum_dtype`).

    The inner optimizer sums the replicas' gradients in the variable's
    dtype: rounding each replica's float32 share to bfloat16 first would
    round once per replica, not once per window. So such sums are summed
    over replicas here, in their own dtype (one more all-reduce per window,
    of those sums only), and the first replica hands on the total while the
    others hand on zeros, which the inner optimizer's sum adds exactly.
    Other sums, and a single replica, are returned as they are. Call in
    replica context, where the window closes."""
    context = tf.distribute.get_replica_context()
    wide = [i for i, (s, d) in enumerate(zip(sums, dtypes)) if s.dtype != tf.as_dtype(d)]
    if not wide or context is None or context.num_replicas_in_sync == 1:
        return list(sums)
    totals = context.all_reduce(tf.distribute.ReduceOp.SUM, [sums[i] for i in wide])
    first = tf.equal(context.replica_id_in_sync_group, 0)
    out = list(sums)
    for i, total in zip(wide, totals):
        out[i] = tf.where(first, total, tf.zeros_like(total))
    return out


def _apply_and_skip(total_weight, apply_window, skip_window, run):
    """The two ways a window closes, as branches of a ``switch_case``."""
    def apply():
        run(apply_window, (total_weight,))
        return tf.constant(1)

    def skip():
        run(skip_window, (total_weight,))
        return tf.constant(2)

    return apply, skip


def _nonfinite(state):
    """1.0 when this replica's window holds a NaN or Inf, else 0.0 (summed
    over replicas)."""
    return tf.cast(tf.logical_not(accumulation.window_finite(state)), tf.float32)


def _apply_or_skip(total_weight, nonfinite, apply_window, skip_window, run):
    """Applies the window, or skips it when a replica's held a NaN or Inf."""
    tf.switch_case(tf.cast(nonfinite > 0, tf.int32),
                   list(_apply_and_skip(total_weight, apply_window, skip_window, run)))
