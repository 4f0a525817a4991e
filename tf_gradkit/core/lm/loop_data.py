"""The data a compiled fit's residuals close over, carried through its loop.

Why: the batched loop (`batched._loop`) linearises with one forward-mode JVP
per parameter (`small.jacobian_columns`), and each JVP computes the user's
model again. Under XLA, the copies are merged by common-subexpression
elimination, except where a copy starts from data the loop never changes
(``-t`` of a decay ``a exp(-t / tau)``): XLA's while-loop-invariant code
motion first hoists each copy's data-only ops out of the loop as a value of
its own, and the model's ops that follow (the ``exp``) then read P different
loop inputs and are computed P times per pass. On the float64 bounded decay
(benchmarks/bounded_decay.py) the exponentials were 253 of 777 ms of the
kernels' time, each computed 10 times for 2 in the model.

So when the residuals carry the ``loop_data`` ability (`attach`: the tensors
they close over and how to build them again from those), the loop carries
those tensors in its state and passes them through an XLA optimization
barrier at the start of each pass (`barrier`): to XLA they change every pass,
nothing computed from them is hoisted, and the P copies merge. Data-only work
is then done once per pass instead of once per chunk; it is elementwise work
on the data, small beside the model and its JVPs it lets merge. The fit's
arithmetic is unchanged (the same ops, fused differently).
"""

import tensorflow as tf

try:  # TensorFlow's XLA op (tf2xla), not in tf.raw_ops
    from tensorflow.compiler.tf2xla.python.xla import optimization_barrier as _barrier
except ImportError:  # pragma: no cover - without it the data are not carried
    _barrier = None


def attach(residual_fn, data, rebuild):
    """Gives ``residual_fn`` the ``loop_data`` ability.

    Args:
      residual_fn: ``x [B, P] -> residuals [B, N]``.
      data: a nest of what it closes over (tensors, None, Python values).
      rebuild: ``data -> residual_fn``, the same residuals over the tensors
        given in place of those of ``data`` (same structure).

    Returns:
      ``residual_fn``.
    """
    residual_fn.loop_data = (data, rebuild)
    return residual_fn


def carried(residual_fn):
    """What a loop carries for ``residual_fn``.

    Returns:
      ``(tensors, rebuild)``: ``tensors`` the data's floating-point tensors
      in order, ``rebuild(tensors) -> residual_fn`` (every other leaf as it
      was); or None (no ability, no floating-point tensor in the data, or no
      barrier op in this TensorFlow).
    """
    found = getattr(residual_fn, "loop_data", None)
    if found is None or _barrier is None:
        return None
    data, rebuild = found
    leaves = tf.nest.flatten(data)
    where = [i for i, t in enumerate(leaves) if isinstance(t, tf.Tensor)
             and (t.dtype.is_floating or t.dtype.is_complex)]
    if not where:
        return None

    def rebuilt(tensors):
        new = list(leaves)
        for i, t in zip(where, tensors):
            new[i] = t
        return rebuild(tf.nest.pack_sequence_as(data, new))

    return [leaves[i] for i in where], rebuilt


def barrier(tensors):
    """``tensors`` through one XLA optimization barrier (the same values;
    XLA cannot see through it)."""
    return list(_barrier(*tensors))
