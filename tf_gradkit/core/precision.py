"""Float32 products that keep float32 precision where TF32 is on.

Why: on Ampere and newer NVIDIA GPUs TensorFlow runs float32 matrix products
in TF32 by default: each input is rounded to a 10-bit mantissa (unit
round-off ``u = 2**-11``, against ``2**-24`` for float32) before the exact
products are summed in float32 (docs/gpu_and_xla.md gives the error
measured on an H100, against float64 and with TF32 off). For a
network's forward pass that is the user's choice of precision. For the
matrices an algorithm forms from it, it is not:

- ``J^T r``, the gradient of a least-squares problem, tends to 0 at a
  minimum while ``|J|^T |r|`` does not. An error bounded by
  ``u |J|^T |r|`` is a floor on the gradient: with TF32, Levenberg-Marquardt
  cannot resolve stationarity below ``2**-11 ~ 5e-4`` of that scale (8192x
  coarser than float32), so it stops improving far from the float32 optimum.
- ``J^T J`` with a relative error of ``u`` is the exact normal matrix of a
  Jacobian perturbed by ``u |J|``: directions with eigenvalues below
  ``u * |J^T J|`` are noise, so the damping has to stay high.
- A Newton-Schulz polar iteration converges to ``|Q^T Q - I| ~ u``: a
  projection onto orthonormal frames becomes orthonormal to 5e-4 only.

What this module does (trace-time choice, no run-time cost on a CPU):

- matrix-vector and vector products (`matvec`, `dot`) are written as an
  elementwise multiply and a sum: no matrix-multiply kernel, so TF32 never
  applies and the products are float32-exact on every device (XLA fuses the
  two into one reduction);
- matrix products (`matmul`, `gram`) where TF32 may apply split each float32
  operand into three parts exactly representable in TF32,
  ``x = hi + mid + lo`` (``hi`` keeps the sign, exponent and top 10 mantissa
  bits by masking the bit pattern, ``mid`` the next 11, ``lo`` the last 2):
  TF32 leaves such parts unchanged, their pairwise products are exact in
  float32, and the sum of the five leading part products equals the float32
  product up to terms below ``2**-30`` relative, so only float32's own
  summation error is left. Cost: the equivalent of 4 (``gram``) or 6
  (``matmul``) TF32 products, still faster than one true float32 product on
  an H100 (TF32 tensor cores run about 7x the float32 rate). This is the
  "3xTF32" idea of NVIDIA's CUTLASS, with a split chosen so that no TF32
  rounding mode can change a part;
- where TF32 cannot apply (no GPU visible, TF32 disabled with
  ``tf.config.experimental.enable_tensor_float_32_execution(False)``, or
  float64 operands) ``matmul`` and ``gram`` are plain ``tf.matmul``.

``use_split(mode)`` overrides the choice ("auto", "split" or "plain") for a
block of code; tests use it to run the split on a CPU.
"""

import os

import tensorflow as tf

from tf_gradkit.core.trace_choice import TraceChoice

_CHOICE = TraceChoice("use_split", ("auto", "split", "plain"))
# The top 10 mantissa bits, with sign and exponent: a TF32-exact value.
_TF32_MASK = 0xFFFFE000


def use_split(mode):
    """Within the block, `matmul`/`gram` split float32 operands for TF32
    ("split"), never split ("plain"), or decide by the device ("auto").
    The choice is read when a function is traced. A context manager."""
    return _CHOICE.use(mode)


def tf32_may_apply():
    """True when float32 matrix products may run in TF32 here: a GPU is
    visible, TensorFlow's TF32 execution is enabled (its default) and
    ``NVIDIA_TF32_OVERRIDE=0`` does not turn it off in the driver."""
    if not tf.config.experimental.tensor_float_32_execution_enabled():
        return False
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    return bool(tf.config.list_logical_devices("GPU"))


def _split_now(dtype):
    if tf.as_dtype(dtype) != tf.float32:
        return False
    mode = _CHOICE.mode
    if mode == "auto":
        return tf32_may_apply()
    return mode == "split"


def truncate_to_tf32(x):
    """``x`` (float32) with the low 13 mantissa bits cleared: TF32-exact."""
    bits = tf.bitcast(x, tf.uint32)
    return tf.bitcast(tf.bitwise.bitwise_and(bits, tf.constant(_TF32_MASK, tf.uint32)),
                      tf.float32)


def emulate_tf32(x):
    """What a TF32 tensor core does to a float32 input: round to the nearest
    value with a 10-bit mantissa (ties to even). For tests and CPU studies
    of TF32's effect; not used by the optimizers."""
    bits = tf.cast(tf.bitcast(tf.convert_to_tensor(x, tf.float32), tf.uint32),
                   tf.int64)
    odd = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 13), 1)
    bits = tf.bitwise.bitwise_and(bits + 0xFFF + odd, ~tf.constant(0x1FFF, tf.int64))
    return tf.bitcast(tf.cast(tf.bitwise.bitwise_and(bits, 0xFFFFFFFF), tf.uint32),
                      tf.float32)


def split_tf32(x):
    """``(hi, mid, lo)`` with ``hi + mid + lo == x`` exactly, each part
    exactly representable in TF32 (float32 ``x``, finite, ``|x| > 2**-100``:
    TensorFlow flushes denormal parts to zero, which no product notices)."""
    hi = truncate_to_tf32(x)
    rest = x - hi            # exact: the low 13 bits of x's mantissa
    mid = truncate_to_tf32(rest)
    return hi, mid, rest - mid  # lo: at most 2 significant bits, exact


def _flip(t, transpose):
    return tf.linalg.matrix_transpose(t) if transpose else t


def _raw_matmul(a, b, transpose_a=False, transpose_b=False):
    # The one place a matrix-multiply kernel runs (tests emulate TF32 here).
    return tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


def matmul(a, b, transpose_a=False, transpose_b=False):
    """``op(a) @ op(b)`` with float32 precision wherever TF32 may apply."""
    if not _split_now(a.dtype):
        return _raw_matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    a_parts = split_tf32(_flip(a, transpose_a))
    b_parts = split_tf32(_flip(b, transpose_b))
    # The six part products above 2**-30 relative, as one product along the
    # contracted axis: [ah ah am ah al am] @ [bh; bm; bh; bl; bh; bm].
    pairs = ((0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1))
    left = tf.concat([a_parts[i] for i, _ in pairs], axis=-1)
    right = tf.concat([b_parts[j] for _, j in pairs], axis=-2)
    return _raw_matmul(left, right)


def gram(a):
    """``a^T a`` (a symmetric ``[P, P]`` from ``[N, P]``) with float32
    precision wherever TF32 may apply."""
    if not _split_now(a.dtype):
        return _raw_matmul(a, a, transpose_a=True)
    hi, mid, lo = split_tf32(a)
    # hi'hi + mid'mid, then the cross terms hi'mid + hi'lo once, mirrored.
    square = _raw_matmul(tf.concat([hi, mid], 0), tf.concat([hi, mid], 0),
                         transpose_a=True)
    cross = _raw_matmul(tf.concat([hi, hi], 0), tf.concat([mid, lo], 0),
                        transpose_a=True)
    return square + (cross + tf.linalg.matrix_transpose(cross))


def matvec(a, x, transpose_a=False):
    """``op(a) @ x`` for a matrix ``a`` [M, N] and vector ``x``, as a multiply
    and a sum: no matrix-multiply kernel, so never TF32."""
    if transpose_a:
        return tf.reduce_sum(a * x[:, None], axis=0)
    return tf.reduce_sum(a * x[None, :], axis=1)


def dot(x, y):
    """``sum(x * y)`` of two vectors (never TF32)."""
    return tf.reduce_sum(x * y)
