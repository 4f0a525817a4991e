"""Residuals and their Jacobian, reduced to J^T J and J^T r.

The Jacobian comes from forward mode (one vectorised JVP per parameter) when
there are at least as many residuals as parameters, the usual least-squares
case, else from reverse mode (one vectorised VJP per residual); the times of
both: docs/levenberg_marquardt.md (its table of how the Keras optimizer works).

Two ways to linearise:

- `linearize`: a zero-argument residual function; the Jacobian comes from one
  vectorised reverse-mode pass (``GradientTape.jacobian`` with pfor), kept only
  if the solver needs it.
- `linearize_chunked`: residuals produced chunk by chunk (rows of a batch);
  each chunk's Jacobian is folded into J^T J and J^T r inside a
  ``tf.while_loop`` and dropped, so memory does not grow with the batch:
  ``chunk * P + P^2`` for J and J^T J, plus the vectorised Jacobian's
  intermediates, about ``chunk * P * width`` for the widest layer (measured
  by benchmarks/lm_memory.py: docs/levenberg_marquardt.md, "Memory").
"""

import contextlib
import warnings
from typing import NamedTuple

import tensorflow as tf

from tf_gradkit.core import forward_columns
from tf_gradkit.core import precision
from tf_gradkit.core.lm import linear_solvers
from tf_gradkit.core.lm.linear_solvers import Linearization


class Support(NamedTuple):
    """The parameters LM solves for: ``indices`` [k] into the flat parameter
    vector, ``valid`` [k] (False for padding). Pruned weights are left out, so
    the Jacobian has k columns and the damped system is k x k; a static ``k``
    (padding with frozen entries) keeps the step compilable by XLA."""

    indices: tf.Tensor
    valid: tf.Tensor

    @property
    def size(self):
        return self.indices.shape[0]


def support_from_mask(flat_mask, capacity):
    """The first ``capacity`` entries where ``flat_mask != 0``, in index order
    (``top_k`` keeps the lower index first among ties), padded with frozen
    entries when fewer are kept."""
    keep = tf.cast(tf.not_equal(flat_mask, 0), tf.float32)
    _, indices = tf.math.top_k(keep, k=capacity, sorted=True)
    return Support(indices=indices, valid=tf.gather(keep, indices) > 0)


def to_full(step, support, num_params):
    """Scatters a step over the support into the full parameter vector."""
    if support is None:
        return step
    step = tf.where(support.valid, step, tf.zeros_like(step))
    return tf.scatter_nd(support.indices[:, None], step, [num_params])


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


JACOBIAN_MODES = ("auto", "forward", "reverse")

# Up to this many parameters, forward mode's columns come by per-op rules
# over the residual function's own traced ops (`forward_columns`: each
# column only where its entry reaches), not by one vectorised JVP of
# TensorFlow's forward mode: a graph of at most P times the model's ops,
# where TensorFlow's JVP adds a traced function per op. Why: a repeated
# small `least_squares` is mostly its ops' dispatch (benchmarks/lsq_latency.py).
RULE_COLUMNS_MAX_PARAMS = 10


def residuals_and_jacobian(residual_fn, variables, dtype, mode="auto",
                           support=None):
    """Flat residuals [N] and the Jacobian [N, P] of ``residual_fn``.

    Args:
      residual_fn: zero-argument callable.
      variables: the parameters (plain ``tf.Variable``s, or tensors that
        ``residual_fn`` computes from).
      dtype: dtype of the returned tensors.
      mode: "forward", "reverse", or "auto" (forward when N >= P statically,
        or when N is unknown).
      support: optional `Support`: only those columns (k of them) are formed.
    """
    if mode not in JACOBIAN_MODES:
        raise ValueError(f"`jacobian_mode` must be one of {JACOBIAN_MODES}. "
                         f"Received: jacobian_mode={mode!r}")
    num_params = sum(v.shape.num_elements() for v in variables)
    columns = num_params if support is None else support.size

    def reverse():
        with tf.GradientTape() as tape:
            # Tensors (not variables) are differentiated too when watched
            # (`tf_gradkit.gradients.jacobian` of intermediate activations).
            tape.watch([v for v in variables if not isinstance(v, tf.Variable)])
            residuals = tf.reshape(residual_fn(), [-1])
        jac = tape.jacobian(residuals, variables,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO,
                            experimental_use_pfor=True)
        n = tf.shape(residuals)[0]
        jacobian = tf.concat([tf.cast(tf.reshape(j, [n, -1]), dtype) for j in jac],
                             axis=1)
        return tf.cast(residuals, dtype), on_support(jacobian, support)

    if mode != "reverse":
        found = None
        if support is None and num_params <= RULE_COLUMNS_MAX_PARAMS:
            found = forward_columns.variable_columns(residual_fn, variables)
        residuals = tf.reshape(residual_fn() if found is None else found[0], [-1])
        n = residuals.shape[0]
        if mode == "forward" or n is None or n >= columns:
            if found is not None:
                return tf.cast(residuals, dtype), tf.stack(
                    [tf.cast(tf.reshape(c, [-1]), dtype) for c in found[1]], axis=1)
            return forward_or_reverse(lambda: (tf.cast(residuals, dtype), _forward_jacobian(
                residual_fn, variables, num_params, dtype, support)), reverse)
    return reverse()


# TensorFlow 2.21's forward mode inside a tf.function fails on an op whose
# attribute is a shape (`tf.ensure_shape`): its per-op JVP function cannot
# be keyed on that attribute, and the error names neither the op nor a way
# out. A Jacobian formed whole then comes from reverse mode instead
# (`forward_or_reverse`: the same Jacobian); where only forward mode will do
# (the matrix-free products of `linearize_matrix_free`) the error is
# explained (`forward_mode_errors`).
FORWARD_MODE_BUG = "Could not generate a generic TraceType"
FORWARD_MODE_TEXT = (
    "A matrix-free step (solver='cg') needs the residuals' products by forward-mode "
    "differentiation, and in a tf.function TensorFlow's "
    "tf.autodiff.ForwardAccumulator cannot trace an op whose attribute is a shape "
    "(`tf.ensure_shape` is one). Give the tensor its static shape with "
    "`tensor.set_shape(...)` instead, or use a solver that forms the Jacobian "
    "(solver='cholesky' or 'qr'), which falls back to reverse mode.")
REVERSE_INSTEAD_TEXT = (
    "The residuals' Jacobian is taken by reverse-mode differentiation instead of "
    "forward mode: in a tf.function, TensorFlow's tf.autodiff.ForwardAccumulator "
    "cannot trace an op whose attribute is a shape (`tf.ensure_shape` is one). It "
    "is the same Jacobian, at the cost of a backward pass per residual "
    "(vectorised); `tensor.set_shape(...)` instead of `tf.ensure_shape` keeps "
    "forward mode.")


def forward_or_reverse(forward, reverse):
    """``forward()``; where TensorFlow's forward mode fails to trace an op
    with a shape attribute (`FORWARD_MODE_BUG`), ``reverse()`` (the same
    Jacobian by reverse mode), with a warning that says why and how to keep
    forward mode. Any other error passes unchanged."""
    try:
        return forward()
    except (TypeError, ValueError) as error:
        if not _forward_mode_bug(error):
            raise
    warnings.warn(REVERSE_INSTEAD_TEXT, stacklevel=2)
    return reverse()


def _forward_mode_bug(error):
    """Whether ``error`` is TensorFlow's forward-mode tracing failure on a
    shape attribute (`FORWARD_MODE_BUG`)."""
    return FORWARD_MODE_BUG in str(error)


@contextlib.contextmanager
def forward_mode_errors():
    """Re-raises TensorFlow's forward-mode tracing failure on a shape
    attribute (`FORWARD_MODE_BUG`) as a ValueError that says what to do;
    any other error passes unchanged."""
    try:
        yield
    except (TypeError, ValueError) as error:
        if not _forward_mode_bug(error):
            raise
        raise ValueError(f"{FORWARD_MODE_TEXT} Received: {error}") from error


def _forward_jacobian(residual_fn, variables, num_params, dtype, support=None):
    def jvp(tangent):
        tangents = unflatten(tangent, variables)
        with tf.autodiff.ForwardAccumulator(variables, tangents) as acc:
            r = tf.reshape(residual_fn(), [-1])
        return tf.cast(acc.jvp(r, unconnected_gradients=tf.UnconnectedGradients.ZERO),
                       dtype)

    if support is None:
        basis = tf.eye(num_params, dtype=variables[0].dtype)
    else:  # one tangent per kept parameter; padding gets a zero tangent
        basis = tf.one_hot(support.indices, num_params,
                           dtype=variables[0].dtype) * tf.cast(
                               support.valid, variables[0].dtype)[:, None]
    return tf.transpose(tf.vectorized_map(jvp, basis))


def on_support(jacobian, support):
    """The columns of ``jacobian`` on ``support`` (padding columns zero)."""
    if support is None:
        return jacobian
    return tf.gather(jacobian, support.indices, axis=1) * tf.cast(
        support.valid, jacobian.dtype)


def linearize(residual_fn, variables, needs_jacobian, dtype, mode="auto",
              support=None):
    """Linearises ``residual_fn`` (zero arguments) at the current variables
    (over ``support`` only, when given)."""
    residuals, jacobian = residuals_and_jacobian(residual_fn, variables, dtype,
                                                 mode, support)
    return from_rows(residuals, jacobian, needs_jacobian)


def from_rows(residuals, jacobian, needs_jacobian, normal_matrix=True):
    """The `Linearization` of residuals [N] and their Jacobian [N, P] however
    formed (automatic differentiation, or layer taps).

    ``normal_matrix=False`` (with ``needs_jacobian``: for a solver whose
    ``reads_normal_matrix`` is False) skips ``J^T J``, an ``N P^2`` product:
    the linearisation then holds ``diag(J^T J)`` and ``v -> J^T (J v)``
    from ``J``.
    """
    if not normal_matrix:
        if not needs_jacobian:
            raise ValueError("from_rows: normal_matrix=False needs "
                             "needs_jacobian=True (the solver reads J instead).")

        def matvec(v):
            return precision.matvec(jacobian, precision.matvec(jacobian, v),
                                    transpose_a=True)

        return Linearization(
            cost=0.5 * tf.reduce_sum(tf.square(residuals)), jtj=None,
            jtr=precision.matvec(jacobian, residuals, transpose_a=True),
            residuals=residuals, jacobian=jacobian, matvec=matvec,
            jtj_diag=tf.reduce_sum(tf.square(jacobian), axis=0))
    jtj, jtr = normal_equations(jacobian, residuals)
    return Linearization(
        cost=0.5 * tf.reduce_sum(tf.square(residuals)),
        jtj=jtj, jtr=jtr,
        residuals=residuals if needs_jacobian else None,
        jacobian=jacobian if needs_jacobian else None)


def normal_equations(jacobian, residuals):
    """``(J^T J, J^T r)`` from one product ``[J r]^T [J r]``: one pass over
    ``J`` (and float32-accurate under TF32, see `precision.gram`)."""
    p = tf.shape(jacobian)[1]
    gram = precision.gram(tf.concat([jacobian, residuals[:, None]], axis=1))
    return gram[:p, :p], gram[:p, p]


def linearize_as(form, residual_fn, variables, dtype, mode="auto", support=None):
    """The linearisation of ``form`` (a solver's ``consumes``, one of
    `linear_solvers.FORMS`) at the current variables."""
    if form == linear_solvers.MATRIX_FREE:
        if support is not None:
            raise ValueError(
                "Levenberg-Marquardt: with pruning masks the step solves over the "
                "unpruned weights only, which needs a formed J^T J or J "
                "(solver='cholesky', 'qr' or 'dual'), not a matrix-free solver "
                "such as solver='cg'.")
        return linearize_matrix_free(residual_fn, variables, dtype)
    if form not in linear_solvers.FORMS:
        raise ValueError(f"A linear solver's `consumes` must be one of "
                         f"{linear_solvers.FORMS}. Received: {form!r}")
    return linearize(residual_fn, variables, form == linear_solvers.JACOBIAN,
                     dtype, mode, support)


def linearize_matrix_free(residual_fn, variables, dtype):
    """Linearises without forming J: ``matvec(v) = J^T (J v)`` by one JVP
    (forward mode) and one VJP (reverse mode) through ``residual_fn``."""
    with tf.GradientTape() as tape:
        residuals = tf.reshape(residual_fn(), [-1])
    jtr = flatten(tape.gradient(residuals, variables, output_gradients=residuals,
                                unconnected_gradients=tf.UnconnectedGradients.ZERO),
                  dtype)
    residuals = tf.cast(residuals, dtype)
    # J belongs to this point; a step's attempts write trial points into the
    # variables, so each product moves them back here for its passes and
    # then restores them (it used to differentiate at the last rejected
    # trial: later attempts solved, and measured their predicted decrease,
    # with another point's J).
    anchor = [tf.identity(v) for v in variables]

    def matvec(v):
        tangents = unflatten(v, variables)
        current = [tf.identity(var) for var in variables]
        for var, value in zip(variables, anchor):
            var.assign(value)
        with tf.GradientTape() as back, forward_mode_errors():
            with tf.autodiff.ForwardAccumulator(variables, tangents) as acc:
                r = tf.reshape(residual_fn(), [-1])
            jv = acc.jvp(r, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        jtjv = back.gradient(r, variables, output_gradients=tf.stop_gradient(jv),
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)
        product = flatten(jtjv, dtype)
        with tf.control_dependencies([product]):
            for var, value in zip(variables, current):
                var.assign(value)
        return tf.identity(product)

    return Linearization(cost=0.5 * tf.reduce_sum(tf.square(residuals)),
                         jtj=None, jtr=jtr, matvec=matvec)


def linearize_chunked(chunk_residual_fn, num_chunks, variables, dtype,
                      mode="auto", support=None, chunk_rows_fn=None):
    """Accumulates J^T J, J^T r and the cost over ``num_chunks`` row chunks.

    Args:
      chunk_residual_fn: ``fn(i) -> residuals of chunk i`` (int32 scalar ``i``),
        every chunk the same static size (pad with zero-weight rows).
      num_chunks: int or int32 scalar tensor (a batch's size may be dynamic).
      variables: the parameters.
      dtype: the solve's dtype.
      chunk_rows_fn: optional ``fn(i) -> (residuals, Jacobian)`` of chunk i
        (over ``support``), formed another way (layer taps); then
        ``chunk_residual_fn`` is not called.
    """
    p = (sum(v.shape.num_elements() for v in variables) if support is None
         else support.size)

    def body(i, jtj, jtr, cost):
        if chunk_rows_fn is not None:
            r, jac = chunk_rows_fn(i)
        else:
            r, jac = residuals_and_jacobian(lambda: chunk_residual_fn(i), variables,
                                            dtype, mode, support)
        chunk_jtj, chunk_jtr = normal_equations(jac, r)
        return (i + 1, jtj + chunk_jtj, jtr + chunk_jtr,
                cost + 0.5 * tf.reduce_sum(tf.square(r)))

    zero = tf.constant(0.0, dtype)
    _, jtj, jtr, cost = tf.while_loop(
        lambda i, *_: i < num_chunks, body,
        (tf.constant(0), tf.zeros([p, p], dtype), tf.zeros([p], dtype), zero))
    return Linearization(cost=cost, jtj=jtj, jtr=jtr)
