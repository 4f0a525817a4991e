"""Linear solvers for the damped Gauss-Newton step (swappable parts).

Each solves ``(J^T J + lambda D^2) d = -J^T r`` for the step ``d`` and says
whether the solve succeeded; a failed solve makes the caller raise the damping
and retry, inside the same compiled step.

- `Cholesky`: factors the P x P damped normal matrix. Fast, memory P^2 (the
  Jacobian is never stored, only accumulated). Squares the condition number.
- `QR`: least squares on the augmented system ``[J; sqrt(lambda) D] d = [-r; 0]``
  with a Householder QR of the (N+P) x P matrix: never forms J^T J, so it keeps
  the precision ill-conditioned problems need (NIST Hahn1, Kirby2, Lanczos).
- `NormalEquationsDual`: the ``J J^T`` form ``d = D^-2 J^T (J D^-2 J^T + lambda I)^-1 (-r)``,
  for fewer residuals than parameters (N x N instead of P x P).
- `Auto`: `NormalEquationsDual` where a step's residuals are statically fewer
  than its parameters, else `Cholesky` (the two give the same step: the
  push-through identity ``(J^T J + lambda D^2)^-1 J^T = D^-2 J^T (J D^-2 J^T +
  lambda I)^-1``); the Keras optimizer's default.
- `ConjugateGradient`: matrix-free; applies ``J^T J`` as a Jacobian-vector
  product followed by a vector-Jacobian product, so neither J nor J^T J is
  ever formed (memory O(N + P), for models whose P^2 does not fit).

All use only ops with XLA and GPU kernels (Cholesky, QR, triangular solves;
under XLA on a CPU the Cholesky solves run `tf_gradkit.core.spd`'s loop,
faster than XLA's expansion there up to 256 parameters: docs/gpu_and_xla.md),
and form their products through `tf_gradkit.core.precision`, so TF32 on a
GPU does not lower them to a 10-bit mantissa.
"""

from typing import Callable, NamedTuple, Optional

import tensorflow as tf

from tf_gradkit.core import precision
from tf_gradkit.core import spd


# What a linear solver consumes (its ``consumes`` ability), which decides how
# the problem is linearised (`linearize.linearize_as`):
NORMAL_EQUATIONS = "normal_equations"  # J^T J and J^T r (sums over rows/replicas)
JACOBIAN = "jacobian"                  # J and r themselves (and the above)
MATRIX_FREE = "matrix_free"            # J^T r and v -> J^T J v, nothing P x P
FORMS = (NORMAL_EQUATIONS, JACOBIAN, MATRIX_FREE)


class Linearization(NamedTuple):
    """The model linearised at the current parameters.

    ``residuals`` [N] and ``jacobian`` [N, P] are present only when the solver
    consumes `JACOBIAN`; ``jtr`` [P] always; ``jtj`` [P, P] unless the
    linearisation is `MATRIX_FREE`, in which case ``matvec(v)`` computes
    ``J^T J v``.
    """

    cost: tf.Tensor
    jtj: Optional[tf.Tensor]
    jtr: tf.Tensor
    residuals: Optional[tf.Tensor] = None
    jacobian: Optional[tf.Tensor] = None
    matvec: Optional[Callable] = None
    jtj_diag: Optional[tf.Tensor] = None


def gauss_newton_matvec(lin, v):
    """``J^T J v`` from whichever form the linearisation holds."""
    if lin.jtj is not None:
        return precision.matvec(lin.jtj, v)
    return lin.matvec(v)


def _finite(x):
    return tf.reduce_all(tf.math.is_finite(x))


class Solver:
    """A linear solver part: the damped Gauss-Newton step.

    - ``consumes``: the linearisation form it solves from (one of `FORMS`;
      `linearize.linearize_as` forms it), an ability, not a type switch.
    - ``solve(lin, damping, d2) -> (step, ok)``: ``d`` with
      ``(J^T J + damping diag(d2)) d = -J^T r`` from the `Linearization`
      ``lin``, and whether the solve succeeded (a failure makes the caller
      raise the damping and retry). Graph code, XLA-compilable.
    - ``get_config() -> dict``: the constructor's arguments.
    - ``reads_normal_matrix``: whether ``solve`` reads ``lin.jtj`` (a
      `JACOBIAN` solver that does not lets the caller skip forming it).
    - ``for_shape(rows, columns) -> Solver``: the solver to use for a step
      with that many residuals (None when not known statically) and
      parameters; itself, unless the part chooses by shape (`Auto`).

    Register a new one in `SOLVERS` to make it known by name.
    """

    consumes = NORMAL_EQUATIONS
    reads_normal_matrix = True

    def for_shape(self, rows, columns):
        del rows, columns
        return self

    def solve(self, lin, damping, d2):
        raise NotImplementedError

    def get_config(self):
        return {}


# The name before the base was documented (kept for subclasses elsewhere).
_Solver = Solver


class Cholesky(Solver):
    """Cholesky factorisation of ``J^T J + lambda D^2``."""

    consumes = NORMAL_EQUATIONS

    def solve(self, lin, damping, d2):
        a = lin.jtj + tf.linalg.diag(damping * d2)
        step, ok = spd.solve(a, -lin.jtr[:, None])
        return step[:, 0], ok


class QR(Solver):
    """Householder QR of the augmented system ``[J; sqrt(lambda) D]``."""

    consumes = JACOBIAN
    reads_normal_matrix = False

    def solve(self, lin, damping, d2):
        p = tf.shape(lin.jtr)[0]
        augmented = tf.concat(
            [lin.jacobian, tf.linalg.diag(tf.sqrt(damping * d2))], axis=0)
        rhs = tf.concat([-lin.residuals, tf.zeros([p], lin.jtr.dtype)], axis=0)
        q, r = tf.linalg.qr(augmented)
        qtb = precision.matvec(q, rhs, transpose_a=True)
        step = tf.linalg.triangular_solve(r, qtb[:, None], lower=False)[:, 0]
        return step, _finite(step)


class NormalEquationsDual(Solver):
    """The ``J J^T`` form, for problems with fewer residuals than parameters:
    ``d = D^-2 J^T y`` with ``(J D^-2 J^T + lambda I) y = -r``, an N x N
    system (the same step as `Cholesky`'s P x P one, for N < P at a cost of
    ``N^2 P`` to form and ``N^3 / 3`` to factor, against ``N P^2`` and
    ``P^3 / 3``)."""

    consumes = JACOBIAN
    reads_normal_matrix = False

    def solve(self, lin, damping, d2):
        # (J D^-1)(J D^-1)^T: one symmetric product.
        scaled = lin.jacobian * tf.math.rsqrt(d2)[None, :]
        n = tf.shape(lin.residuals)[0]
        a = precision.matmul(scaled, scaled, transpose_b=True) + damping * tf.eye(
            n, dtype=lin.jtr.dtype)
        y, ok = spd.solve(a, -lin.residuals[:, None])
        step = precision.matvec(lin.jacobian, y[:, 0], transpose_a=True) / d2
        return step, tf.logical_and(ok, _finite(step))


class Auto(Cholesky):
    """`Cholesky` on whichever damped system is smaller: ``J^T J`` (P x P),
    or ``J D^-2 J^T`` (N x N, `NormalEquationsDual`) when a step's N
    residuals are statically fewer than its P parameters and its caller
    holds the whole Jacobian (not chunks, not a sum over replicas, not a
    generalised Gauss-Newton matrix: there it is `Cholesky`). Both give the
    same step up to round-off. The Keras optimizer's default."""

    def for_shape(self, rows, columns):
        if rows is not None and columns is not None and rows < columns:
            return NormalEquationsDual()
        return Cholesky()


class ConjugateGradient(Solver):
    """Matrix-free conjugate gradients on ``(J^T J + lambda D^2) d = -J^T r``.

    Args:
      max_iterations: CG iterations per damped solve (a fixed bound keeps the
        compiled loop static; CG is exact after P iterations in exact
        arithmetic, and LM only needs an approximate step).
      tolerance: stop when the residual norm falls below ``tolerance`` times
        the right-hand side's norm.
    """

    consumes = MATRIX_FREE

    def __init__(self, max_iterations=50, tolerance=1e-6):
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) \
                or max_iterations < 1:
            raise ValueError("ConjugateGradient: `max_iterations` must be an integer "
                             f">= 1. Received: max_iterations={max_iterations!r}")
        if not tolerance > 0:
            raise ValueError("ConjugateGradient: `tolerance` must be positive. "
                             f"Received: tolerance={tolerance!r}")
        self.max_iterations, self.tolerance = max_iterations, tolerance

    def get_config(self):
        return {"max_iterations": self.max_iterations, "tolerance": self.tolerance}

    def solve(self, lin, damping, d2):
        def apply(v):
            return gauss_newton_matvec(lin, v) + damping * d2 * v

        b = -lin.jtr
        limit = tf.cast(self.tolerance, b.dtype) * tf.norm(b)
        tiny = tf.constant(1e-30, b.dtype)

        def body(i, x, r, p, rr):
            ap = apply(p)
            alpha = rr / tf.maximum(precision.dot(p, ap), tiny)
            x = x + alpha * p
            r = r - alpha * ap
            rr_new = precision.dot(r, r)
            p = r + (rr_new / tf.maximum(rr, tiny)) * p
            return i + 1, x, r, p, rr_new

        zero = tf.zeros_like(b)
        _, step, _, _, _ = tf.while_loop(
            lambda i, x, r, p, rr: (i < self.max_iterations) & (tf.sqrt(rr) > limit),
            body, (tf.constant(0), zero, b, b, precision.dot(b, b)),
            maximum_iterations=self.max_iterations)
        return step, _finite(step)


SOLVERS = {"auto": Auto, "cholesky": Cholesky, "qr": QR, "dual": NormalEquationsDual,
           "cg": ConjugateGradient}
