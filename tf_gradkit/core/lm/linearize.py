"""Residuals and their Jacobian, reduced to J^T J and J^T r.

Two ways to linearise:

- `linearize`: a zero-argument residual function; the Jacobian comes from one
  vectorised reverse-mode pass (``GradientTape.jacobian`` with pfor), kept only
  if the solver needs it.
- `linearize_chunked`: residuals produced chunk by chunk (rows of a batch);
  each chunk's Jacobian is folded into J^T J and J^T r inside a
  ``tf.while_loop`` and dropped, so memory is ``chunk * P + P^2`` whatever the
  batch size.
"""

import tensorflow as tf

from tf_gradkit.core.lm.solvers import Linearization


def flatten(tensors, dtype=None):
    """Concatenates tensors into one vector (optionally cast)."""
    parts = [tf.reshape(t, [-1]) for t in tensors]
    vec = tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]
    return tf.cast(vec, dtype) if dtype is not None else vec


def unflatten(vector, variables):
    """Splits a vector into tensors shaped (and typed) like ``variables``."""
    sizes = [v.shape.num_elements() for v in variables]
    parts = tf.split(vector, sizes) if len(sizes) > 1 else [vector]
    return [tf.cast(tf.reshape(p, v.shape), v.dtype)
            for p, v in zip(parts, variables)]


def _jacobian_matrix(tape, residuals, variables, dtype):
    jac = tape.jacobian(residuals, variables,
                        unconnected_gradients=tf.UnconnectedGradients.ZERO,
                        experimental_use_pfor=True)
    n = tf.shape(residuals)[0]
    return tf.concat([tf.cast(tf.reshape(j, [n, -1]), dtype) for j in jac],
                     axis=1)


def linearize(residual_fn, variables, needs_jacobian, dtype):
    """Linearises ``residual_fn`` (zero arguments) at the current variables."""
    with tf.GradientTape() as tape:
        residuals = tf.reshape(residual_fn(), [-1])
    jacobian = _jacobian_matrix(tape, residuals, variables, dtype)
    residuals = tf.cast(residuals, dtype)
    return Linearization(
        cost=0.5 * tf.reduce_sum(tf.square(residuals)),
        jtj=tf.matmul(jacobian, jacobian, transpose_a=True),
        jtr=tf.linalg.matvec(jacobian, residuals, transpose_a=True),
        residuals=residuals if needs_jacobian else None,
        jacobian=jacobian if needs_jacobian else None)


def linearize_chunked(chunk_residual_fn, num_chunks, variables, dtype):
    """Accumulates J^T J, J^T r and the cost over ``num_chunks`` row chunks.

    Args:
      chunk_residual_fn: ``fn(i) -> residuals of chunk i`` (int32 scalar ``i``),
        every chunk the same static size (pad with zero-weight rows).
      num_chunks: Python int.
      variables: the parameters.
      dtype: the solve's dtype.
    """
    p = sum(v.shape.num_elements() for v in variables)

    def body(i, jtj, jtr, cost):
        with tf.GradientTape() as tape:
            r = tf.reshape(chunk_residual_fn(i), [-1])
        jac = _jacobian_matrix(tape, r, variables, dtype)
        r = tf.cast(r, dtype)
        return (i + 1, jtj + tf.matmul(jac, jac, transpose_a=True),
                jtr + tf.linalg.matvec(jac, r, transpose_a=True),
                cost + 0.5 * tf.reduce_sum(tf.square(r)))

    zero = tf.constant(0.0, dtype)
    _, jtj, jtr, cost = tf.while_loop(
        lambda i, *_: i < num_chunks, body,
        (tf.constant(0), tf.zeros([p, p], dtype), tf.zeros([p], dtype), zero))
    return Linearization(cost=cost, jtj=jtj, jtr=jtr)
