"""What the backward pass costs: its FLOPs and its time, next to the forward's.

The rule of thumb is that a backward pass costs about twice the forward (a
Dense layer's forward is one product ``x W``; its backward two, ``dL/dW =
x^T g`` and ``dL/dx = g W^T``), but what a model actually pays depends on
which gradients are needed (the first layer's ``dL/dx`` is not), on
recomputation and on fusion. `backward_cost` measures it for one function:

- **FLOPs** from TensorFlow's graph cost analysis (the ``flops`` statistics
  each op kernel registers, read by ``tf.compat.v1.profiler`` over the traced
  graph) of two graphs: the forward alone, and the forward with the
  gradients. The backward's FLOPs are their difference. Ops without
  registered statistics count 0 (element-wise transcendental functions such
  as ``tanh``; the matrix products and convolutions, which dominate, are
  counted: ``2 m n k`` for a ``[m, k] x [k, n]`` product; for a
  convolution's input gradient TensorFlow's statistic is the full
  convolution at every input position, an upper bound).
- **Time**: the median over ``repeats`` calls of each compiled function
  (after a warm-up call that compiles it), synchronised by reading the
  result back; backward = (forward + backward) - forward.
"""

import statistics
import time
from typing import NamedTuple

import tensorflow as tf

__all__ = ["BackwardCost", "backward_cost"]


class BackwardCost(NamedTuple):
    """`backward_cost`'s report.

    Attributes:
      forward_flops: FLOPs of the forward pass (graph cost analysis).
      backward_flops: FLOPs the gradients add.
      forward_ms: median milliseconds of one compiled forward call.
      backward_ms: median milliseconds the gradients add to it.
      flops_by_op: ``{op type: FLOPs}`` of the forward-and-backward graph.
    """
    forward_flops: int
    backward_flops: int
    forward_ms: float
    backward_ms: float
    flops_by_op: dict

    @property
    def flops_ratio(self):
        """Backward FLOPs over forward FLOPs (about 2 for dense layers)."""
        return self.backward_flops / self.forward_flops if self.forward_flops else float("nan")

    @property
    def time_ratio(self):
        """Backward time over forward time."""
        return self.backward_ms / self.forward_ms if self.forward_ms > 0 else float("nan")

    def __str__(self):
        return (f"forward {self.forward_flops:,} FLOPs, {self.forward_ms:.3f} ms; "
                f"backward {self.backward_flops:,} FLOPs ({self.flops_ratio:.2f}x), "
                f"{self.backward_ms:.3f} ms ({self.time_ratio:.2f}x)")


def backward_cost(loss_fn, variables, *args, jit_compile=False, repeats=20):
    """FLOPs and times of ``loss_fn(*args)`` and of its gradients.

    Args:
      loss_fn: a function of ``args`` returning a scalar loss (e.g.
        ``lambda x, y: loss(y, model(x, training=True))``).
      variables: what the gradients are taken with respect to (e.g.
        ``model.trainable_variables``).
      *args: the tensors ``loss_fn`` takes (a batch).
      jit_compile: time XLA-compiled functions (the FLOPs are always read
        from the TensorFlow graph, which XLA does not change the products of).
      repeats: timed calls of each function (an integer >= 1).

    Returns:
      A `BackwardCost`.

    Raises:
      ValueError: ``variables`` is empty or ``repeats`` is not an integer >= 1.

    Example:

    >>> import tensorflow as tf
    >>> from tf_gradkit.gradients import backward_cost
    >>> w = tf.Variable(tf.ones([64, 32]))
    >>> x = tf.ones([16, 64])
    >>> cost = backward_cost(lambda x: tf.reduce_sum(x @ w), [w], x)
    >>> cost.forward_flops >= 2 * 16 * 64 * 32, cost.backward_flops >= 2 * 16 * 64 * 32
    (True, True)
    """
    variables = list(variables)
    if not variables:
        raise ValueError("backward_cost: `variables` is empty; pass what the "
                         "gradients are taken with respect to, e.g. "
                         "model.trainable_variables.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError("backward_cost: `repeats` must be an integer >= 1. "
                         f"Received: repeats={repeats!r}")

    def forward(*inputs):
        return loss_fn(*inputs)

    def forward_backward(*inputs):
        with tf.GradientTape() as tape:
            loss = loss_fn(*inputs)
        grads = tape.gradient(loss, variables)
        return loss, [g for g in grads if g is not None]

    forward_fn = tf.function(forward, jit_compile=jit_compile)
    both_fn = tf.function(forward_backward, jit_compile=jit_compile)
    forward_flops, _ = graph_flops(forward_fn, *args)
    total_flops, by_op = graph_flops(both_fn, *args)
    forward_ms = _median_ms(forward_fn, args, repeats)
    total_ms = _median_ms(both_fn, args, repeats)
    return BackwardCost(forward_flops=forward_flops,
                        backward_flops=max(total_flops - forward_flops, 0),
                        forward_ms=forward_ms,
                        backward_ms=max(total_ms - forward_ms, 0.0),
                        flops_by_op=by_op)


def graph_flops(function, *args):
    """(total FLOPs, {op type: FLOPs}) of ``function``'s graph for ``args``
    (a ``tf.function``), from the kernels' registered ``flops`` statistics."""
    graph = function.get_concrete_function(*args).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder(
        tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    ).with_empty_output().build()
    profile = tf.compat.v1.profiler.profile(graph, cmd="op", options=options)
    by_op, nodes = {}, list(profile.children)
    while nodes:  # the "op" view nests each op type under the previous one
        node = nodes.pop()
        if node.float_ops:
            by_op[node.name] = by_op.get(node.name, 0) + int(node.float_ops)
        nodes.extend(node.children)
    return int(profile.total_float_ops), by_op


def _median_ms(function, args, repeats):
    _sync(function(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _sync(function(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _sync(result):
    for tensor in tf.nest.flatten(result):
        tensor.numpy()  # waits for the device
