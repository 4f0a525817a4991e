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
   full" is built. Its true branch reads the scalar totals and calls
   ``call_for_each_replica`` to run the inner optimizer, whose single all-reduce
   is the only gradient reduction of the window.

Without a strategy (or where the strategy needs no ``merge_call``, e.g. XLA on
GPUs) the same branches run directly.
"""

import tensorflow as tf

from tf_gradkit.core import accumulation


def _num_replicas():
    return tf.distribute.get_strategy().num_replicas_in_sync


def micro_step(state, grads, *, weight, accept, steps, force=False,
               apply_window, skip_window, count_dropped):
    """Accumulates ``grads`` (if ``accept``) and applies the window when full.

    Must be called in replica context (or with no strategy).

    Args:
      state: `accumulation.AccumulationState`.
      grads: gradients for ``state.acc_grads`` (``None`` entries allowed).
      weight: float32 scalar weight of this micro-batch, or ``None`` when the
        call only closes the window (``flush``).
      accept: boolean scalar tensor or Python bool: False drops the gradient
        (stale ``local_step``).
      steps: Python int, micro-batches per window.
      force: apply whatever the window holds now (``flush``), if non-empty.
      apply_window: ``apply_window(total_weight)``, run per replica, performs
        the inner update from the window and resets it.
      skip_window: ``skip_window()``, run per replica, discards a window that
        holds a non-finite gradient and resets it.
      count_dropped: ``count_dropped()`` records one dropped gradient.
    """
    if weight is not None:
        if isinstance(accept, bool):
            if accept:
                accumulation.accumulate(state, grads, weight)
            else:
                count_dropped()
        else:
            def _add():
                accumulation.accumulate(state, grads, weight)
                return tf.constant(True)

            def _drop():
                count_dropped()
                return tf.constant(False)

            tf.cond(accept, _add, _drop)

    if force:
        ready = state.micro_step > 0
    else:
        ready = state.micro_step >= steps

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        totals = [state.weight.read_value(), state.nonfinite.read_value()]
        if _num_replicas() > 1:
            totals = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, totals)
        _close_if_ready(ready, totals, apply_window, skip_window,
                        run=lambda fn, args=(): fn(*args))
    else:
        def _cross_replica(distribution, ready):
            ready = distribution.experimental_local_results(ready)[0]

            def _run(fn, args=()):
                return distribution.extended.call_for_each_replica(fn, args=args)

            def _totals():
                # Sync-on-read variables read here are summed over replicas.
                return [state.weight.read_value(), state.nonfinite.read_value()]

            _close_if_ready(ready, _totals, apply_window, skip_window, run=_run)

        tf.distribute.get_replica_context().merge_call(
            _cross_replica, args=(ready,))


def _close_if_ready(ready, totals, apply_window, skip_window, run):
    """One branch point: keep the window open, apply it, or skip it.

    ``totals`` is either the (weight, nonfinite) pair already at hand, or a
    function reading them across replicas. With tensors (no strategy, or XLA
    on GPUs) a single ``switch_case`` decides: under XLA, nested ``cond``s were
    turned into ``select``s that ran the whole window close on every
    micro-step. With a function (cross-replica context, never XLA) the
    reduction of the two scalars happens inside the ``ready`` branch, so an
    open micro-step does no cross-replica work at all.
    """
    def _apply(total_weight):
        run(apply_window, args=(total_weight,))
        return tf.constant(1)

    def _skip():
        run(skip_window)
        return tf.constant(2)

    if callable(totals):
        def _close():
            total_weight, nonfinite = totals()
            return tf.cond(tf.equal(nonfinite, 0),
                           lambda: _apply(total_weight), _skip)

        tf.cond(ready, _close, lambda: tf.constant(0))
        return
    total_weight, nonfinite = totals
    branch = tf.where(ready, tf.where(tf.equal(nonfinite, 0), 1, 2), 0)
    tf.switch_case(branch, [lambda: tf.constant(0),
                            lambda: _apply(total_weight), _skip])
