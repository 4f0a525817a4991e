"""Solves with a symmetric positive definite matrix, fast under XLA on a CPU.

Why: XLA has no Cholesky kernel for the CPU; it expands ``tf.linalg.cholesky``
into a generic blocked loop, much slower than TensorFlow's own CPU kernel
and a large share of a compiled Levenberg-Marquardt step (measured:
docs/gpu_and_xla.md, "Speed under XLA").

What this module does (a trace-time choice, nothing at run time):

- under XLA (``jit_compile=True``) with only CPUs visible, for static sizes up
  to `LOOP_MAX_SIZE`, `solve` runs an outer-product (right-looking) Cholesky
  as one ``tf.while_loop`` of rank-1 updates over the matrix bordered by the
  right-hand sides, so the forward substitution comes out of the same loop,
  then a second loop for the back substitution. Each iteration is one fused
  pass over the matrix: it does ``n^3`` multiply-adds where the textbook
  order does ``n^3 / 3``, which stops paying above a few hundred.
  `benchmarks/spd_solve.py` measures it against XLA's expansion and against
  TensorFlow without XLA (docs/gpu_and_xla.md, "Speed under XLA": no faster
  above 256, hence the limit);
- everywhere else (GPUs and TPUs have their own kernels; TensorFlow without
  XLA has its LAPACK-style one) it is ``tf.linalg.cholesky`` and
  ``tf.linalg.cholesky_solve``.

Both report failure the same way: ``ok`` is False when a pivot is not
positive or anything is not finite, and the returned solution is then zeros
(never NaN), so callers can ``tf.where`` on ``ok`` and raise their damping.

``use_kernel(mode)`` overrides the choice ("auto", "loop" or "library") for a
block of code; tests use it to check both kernels against each other.
"""

import tensorflow as tf
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import control_flow_util as _cf_util

from tf_gradkit.core.trace_choice import TraceChoice

LOOP_MAX_SIZE = 256
_CHOICE = TraceChoice("use_kernel", ("auto", "loop", "library"))


def use_kernel(mode):
    """Forces the kernel `solve` picks while tracing: "auto", "loop" or
    "library". A context manager."""
    return _CHOICE.use(mode)


def _in_xla():
    return _cf_util.GraphOrParentsInXlaContext(_ops.get_default_graph())


def _only_cpus():
    return all(d.device_type == "CPU" for d in tf.config.list_logical_devices())


def uses_loop(size):
    """Whether `solve` of a ``size`` x ``size`` system traced here runs the
    loop kernel."""
    mode = _CHOICE.mode
    if mode != "auto":
        return mode == "loop" and size is not None
    return (size is not None and size <= LOOP_MAX_SIZE and _in_xla()
            and _only_cpus())


def solve(a, rhs):
    """Solves ``a x = rhs`` for symmetric positive definite ``a``.

    Args:
      a: [n, n] float tensor (only its lower triangle is read by the library
        kernel; the loop kernel reads it whole and expects symmetry).
      rhs: [n, k] float tensor.

    Returns:
      ``(x, ok)``: the [n, k] solution (zeros when not ``ok``) and a bool
      scalar, False when ``a`` is not numerically positive definite or a
      value is not finite.

    Raises:
      ValueError: when ``a`` is not a square matrix, ``rhs`` not a matrix
        with as many rows, or the dtypes are not the same floating type.
    """
    a, rhs = tf.convert_to_tensor(a), tf.convert_to_tensor(rhs)
    _check(a, rhs)
    n = a.shape[0]
    if uses_loop(n):
        x, ok = _loop_solve(a, rhs)
    else:
        x, ok = _library_solve(a, rhs)
    ok = tf.logical_and(ok, tf.reduce_all(tf.math.is_finite(x)))
    return tf.where(ok, x, tf.zeros_like(x)), ok


def _check(a, rhs):
    if a.shape.rank != 2 or (a.shape[0] is not None and a.shape[1] is not None
                              and a.shape[0] != a.shape[1]):
        raise ValueError("spd.solve: `a` must be a square matrix [n, n]. "
                         f"Received: shape {a.shape}")
    if rhs.shape.rank != 2 or (a.shape[0] is not None and rhs.shape[0] is not None
                                and rhs.shape[0] != a.shape[0]):
        raise ValueError("spd.solve: `rhs` must be a matrix [n, k] with as many "
                         f"rows as `a`. Received: `a` {a.shape}, `rhs` {rhs.shape}")
    if not a.dtype.is_floating or rhs.dtype != a.dtype:
        raise ValueError("spd.solve: `a` and `rhs` must share one floating dtype. "
                         f"Received: {a.dtype.name} and {rhs.dtype.name}")


def _library_solve(a, rhs):
    chol = tf.linalg.cholesky(a)
    # On failure the factor holds NaNs (XLA does not raise): report it.
    ok = tf.logical_and(tf.reduce_all(tf.math.is_finite(chol)),
                        tf.reduce_all(tf.linalg.diag_part(chol) > 0))
    safe = tf.where(ok, chol, tf.eye(tf.shape(a)[0], dtype=a.dtype))
    return tf.linalg.cholesky_solve(safe, rhs), ok


def _loop_solve(a, rhs):
    """Outer-product Cholesky of ``[[a, rhs], [rhs^T, 0]]`` over its first n
    pivots: row j of the result is row j of ``R = L^T`` followed by row j of
    ``L^-1 rhs``; then back substitution ``R x = L^-1 rhs``, row by row."""
    n, k = a.shape[0], rhs.shape[1]
    dtype = a.dtype
    top = tf.concat([a, rhs], axis=1)
    bottom = tf.concat([tf.transpose(rhs), tf.zeros([k, k], dtype)], axis=1)
    augmented = tf.concat([top, bottom], axis=0)
    index = tf.range(n + k)

    def factor(j, work, min_pivot):
        # Row j of the trailing matrix becomes row j of R (= L^T): one fused
        # pass writes the rank-1 update and the finished row together.
        row = work[j]
        pivot = row[j]
        scaled = tf.where(index >= j, row, tf.zeros_like(row)) / tf.sqrt(pivot)
        work = tf.where(tf.equal(index, j)[:, None], scaled[None, :],
                        work - scaled[:, None] * scaled[None, :])
        return j + 1, work, tf.minimum(min_pivot, pivot)

    _, work, min_pivot = tf.while_loop(
        lambda j, *_: j < n, factor,
        (tf.constant(0), augmented, tf.constant(float("inf"), dtype)),
        maximum_iterations=n)
    upper = tf.linalg.band_part(work[:n, :n], 0, -1)   # R = L^T
    forward = work[:n, n:]                              # L^-1 rhs
    row_index = tf.range(n)

    def back(step, x):
        j = n - 1 - step
        r = upper[j]
        value = (forward[j] - tf.reduce_sum(r[:, None] * x, axis=0)) / r[j]
        x = tf.where(tf.equal(row_index, j)[:, None], value[None, :], x)
        return step + 1, x

    _, x = tf.while_loop(lambda step, _: step < n, back,
                         (tf.constant(0), tf.zeros([n, k], dtype)),
                         maximum_iterations=n)
    return x, min_pivot > 0
