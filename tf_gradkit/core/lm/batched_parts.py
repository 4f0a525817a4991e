"""The Levenberg-Marquardt parts of `least_squares`, over a batch of problems.

`batched.py` solves B independent problems at once; each part here is the
one-problem part of `step.py`, `linearize.py`, `bounds.py`, `robust.py`,
`linear_solvers.py` and `damping.TrustRegion` with a leading batch axis on
every tensor: parameters ``[B, P]``, residuals ``[B, N]``, Jacobians
``[B, N, P]``, scalars ``[B]``. The elementwise parts are reused as they are
(the damping controllers' ``accept``/``reject``, the scalings' ``update`` and
``diagonal``, `robust.LOSSES`); what reads a whole problem (a norm, a solve,
a radius fit with its own loop) is written here once more, vectorised, with
a per-problem mask where the one-problem code has a branch or a loop exit.

The normal equations go through `tf_gradkit.core.precision.matmul` and the
other products are sums of elementwise products, so TF32 on a GPU does not
lower their precision.
"""

from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_gradkit.core import precision
from tf_gradkit.core import spd
from tf_gradkit.core.lm import bounds as bounds_lib
from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import fit_report
from tf_gradkit.core.lm import linearize
from tf_gradkit.core.lm import robust as robust_lib
from tf_gradkit.core.lm import small


class BatchedLinearization(NamedTuple):
    """`linear_solvers.Linearization` of B problems: ``cost`` [B], ``jtj``
    [B, P, P], ``jtr`` [B, P], ``residuals`` [B, M], ``jacobian`` [B, M, P]."""

    cost: tf.Tensor
    jtj: tf.Tensor
    jtr: tf.Tensor
    residuals: Optional[tf.Tensor] = None
    jacobian: Optional[tf.Tensor] = None


def dot(a, b):
    """``sum(a * b)`` over the last axis."""
    return tf.reduce_sum(a * b, axis=-1)


def norm(a):
    return tf.norm(a, axis=-1)


def jacobian(residual_fn, x):
    """``(residual_fn(x), J)``: ``[B, N]`` and ``[B, N, P]`` by forward mode:
    one JVP per parameter column for the whole batch at once, the P columns
    vectorised (`tf.vectorized_map`: the residuals themselves are computed
    once, only the tangents P times); for few parameters one JVP per column
    (`small.jacobian_columns`: under XLA the columns fuse into the sums of
    the normal equations; in a plain ``tf.function`` its one traced JVP
    traces in a third of the vectorised map's time, at the same speed); the
    user's own when ``residual_fn`` carries one (its ``jacobian`` ability:
    ``jac=`` of `curve_fit`)."""
    p = x.shape[-1]
    analytic = getattr(residual_fn, "jacobian", None)
    if analytic is not None:
        return residual_fn(x), analytic(x)
    if p is not None and p <= small.COLUMNS_MAX_PARAMS:
        residuals, columns = small.jacobian_columns(residual_fn, x)
        return residuals, tf.stack(columns, axis=-1)

    def column(direction):
        tangent = tf.broadcast_to(direction, tf.shape(x))
        with tf.autodiff.ForwardAccumulator(x, tangent) as acc:
            r = residual_fn(x)
        return acc.jvp(r, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    def forward():
        columns = tf.vectorized_map(column, tf.eye(p, dtype=x.dtype))
        return residual_fn(x), tf.transpose(columns, [1, 2, 0])

    return linearize.forward_or_reverse(
        forward, lambda: small.reverse_jacobian(residual_fn, x))


def normal_equations(jac, residuals):
    """``(J^T J, J^T r)`` per problem from one product ``[J r]^T [J r]``, as
    `linearize.normal_equations` (float32-accurate under TF32,
    `precision.matmul`); for few parameters sums of elementwise products of
    the columns (`small.normal_equations`: no product to lower under TF32)."""
    p = jac.shape[-1]
    if small.by_columns(p):
        return small.normal_equations([jac[..., j] for j in range(p)], residuals)
    both = tf.concat([jac, residuals[..., None]], axis=-1)
    gram = precision.matmul(both, both, transpose_a=True)
    return gram[:, :p, :p], gram[:, :p, p]


class BatchedRobustLoss:
    """`robust.RobustLoss` over rows: the same ``rho``, with the mean
    ``|f|`` of the first-order losses taken over each problem's own points
    (``counts`` [B], the unmasked ones; masked residuals are 0)."""

    def __init__(self, loss, counts):
        self.loss, self.counts = loss, counts
        self._rho = robust_lib.LOSSES[loss.name]

    @property
    def is_linear(self):
        return self.loss.is_linear

    def cost(self, f):
        if self.is_linear:
            return 0.5 * small.point_sum(tf.square(f))
        c = tf.constant(self.loss.f_scale, f.dtype)
        rho, _, _ = self._rho(tf.square(f / c))
        return 0.5 * c * c * small.point_sum(rho)

    def weights(self, f):
        c = tf.constant(self.loss.f_scale, f.dtype)
        z = tf.square(f / c)
        eps = tf.constant(tf.experimental.numpy.finfo(f.dtype.as_numpy_dtype).eps,
                          f.dtype)
        if self.loss.first_order:  # the part's own flag, as `RobustLoss.weights`
            mean = small.point_sum(tf.abs(f)) / self.counts
            floor = robust_lib.FIRST_ORDER_FLOOR * mean / c
            z = tf.maximum(z, tf.maximum(tf.square(floor), eps)[:, None])
            _, d1, _ = self._rho(z)
            j_factor = tf.sqrt(d1)
        else:
            _, d1, d2 = self._rho(z)
            j_factor = tf.sqrt(tf.maximum(d1 + 2.0 * z * d2, eps))
        return d1 / j_factor, j_factor

    def residuals(self, f):
        """The step residuals of ``linearize`` from the residuals ``f``."""
        return self._rescaled(f)[0]

    def _rescaled(self, f):
        if self.is_linear:
            return f, None
        f_factor, j_factor = self.weights(f)
        return j_factor * f + (f_factor - j_factor) * f, j_factor

    def linearize(self, residual_fn, x, needs_jacobian=True):
        """`BatchedLinearization` of the step residuals (scipy's rescaling
        for a robust loss, `robust.py`) at ``x``."""
        f, jac = jacobian(residual_fn, x)
        r, j_factor = self._rescaled(f)
        if j_factor is not None:
            jac = j_factor[..., None] * jac
        jtj, jtr = normal_equations(jac, r)
        return BatchedLinearization(cost=self.cost(f), jtj=jtj, jtr=jtr,
                                    residuals=r if needs_jacobian else None,
                                    jacobian=jac if needs_jacobian else None)


class BatchedBounds(bounds_lib.Bounds):
    """`bounds.Bounds` with ``lower``/``upper`` [B, P]: clip, project,
    frozen and coleman_li are elementwise there already."""

    def infeasible(self, x):
        return tf.reduce_any((x < self.lower) | (x > self.upper), axis=-1)

    def active_mask(self, x):
        """scipy's ``active_mask`` (int64: no int32 tensor on a GPU's host)."""
        return (tf.cast(x >= self.upper, tf.int64)
                - tf.cast(x <= self.lower, tf.int64))

    def freeze(self, lin, x):
        """`bounds.freeze` per problem: the parameters held on a bound taken
        out of the damped system."""
        frozen = self.frozen(x, lin.jtr)
        dtype = lin.jtr.dtype
        keep, hold = tf.cast(~frozen, dtype), tf.cast(frozen, dtype)
        diag = tf.linalg.diag_part(lin.jtj)
        own = tf.where(diag > 0, diag, tf.ones_like(diag))
        jtj = (lin.jtj * keep[..., :, None] * keep[..., None, :]
               + tf.linalg.diag(hold * own))
        jac, residuals = lin.jacobian, lin.residuals
        if jac is not None:
            norms = tf.sqrt(tf.reduce_sum(tf.square(jac), axis=-2))
            norms = tf.where(norms > 0, norms, tf.ones_like(norms))
            jac = tf.concat([jac * keep[..., None, :],
                             tf.linalg.diag(hold * norms)], axis=-2)
            residuals = tf.concat([residuals, tf.zeros_like(lin.jtr)], axis=-1)
        return BatchedLinearization(cost=lin.cost, jtj=jtj, jtr=lin.jtr * keep,
                                    residuals=residuals, jacobian=jac)


def _all_finite(x):
    return tf.reduce_all(tf.math.is_finite(x), axis=-1)


class BatchedQR:
    """`linear_solvers.QR` per problem: Householder QR of ``[J; sqrt(lambda) D]``."""

    needs_jacobian = True

    def solve(self, lin, damping, d2):
        augmented = tf.concat(
            [lin.jacobian, tf.linalg.diag(tf.sqrt(damping[:, None] * d2))], axis=-2)
        rhs = tf.concat([-lin.residuals, tf.zeros_like(d2)], axis=-1)
        q, r = tf.linalg.qr(augmented)
        qtb = tf.reduce_sum(q * rhs[..., None], axis=-2)
        step = tf.linalg.triangular_solve(r, qtb[..., None], lower=False)[..., 0]
        return step, _all_finite(step)


# Up to this many parameters the Cholesky solve is unrolled under XLA: P^3/6
# elementwise operations on [B] vectors, which XLA fuses, where its own
# batched Cholesky expansion runs a loop over small matrices (measured on the
# 2-D Gaussian, P = 5: see docs/batched_fits.md). Outside XLA the library
# kernels run, as `least_squares`'s (`spd.solve`).
UNROLL_MAX_PARAMS = 16


def unrolled_cholesky_solve(a, rhs):
    """Solves ``a x = rhs`` per problem (``a`` [B, P, P] positive definite,
    ``rhs`` [B, P]) by a Cholesky factorisation unrolled over the P columns
    (`small.cholesky_entries`): ``(x, ok)``."""
    p = a.shape[-1]
    low, ok = small.cholesky_entries(a)
    z = []
    for i in range(p):
        t = rhs[:, i]
        for k in range(i):
            t = t - low[i][k] * z[k]
        z.append(t / low[i][i])
    x = [None] * p
    for i in reversed(range(p)):
        t = z[i]
        for k in range(i + 1, p):
            t = t - low[k][i] * x[k]
        x[i] = t / low[i][i]
    x = tf.stack(x, axis=-1)
    ok = ok & _all_finite(x)
    return tf.where(ok[:, None], x, tf.zeros_like(x)), ok


def unrolled_qr(a, rhs=None):
    """Householder QR per problem, unrolled over the P columns (for XLA, as
    `unrolled_cholesky_solve`): ``a`` [B, M, P] -> ``R`` [B, K, P] (upper
    triangular, K = min(M, P), as ``tf.linalg.qr``) and, with ``rhs``
    [B, M], ``Q^T rhs`` [B, K]. (As the damped
    solve it measured no faster than XLA's own QR, both far slower than the
    Cholesky solve on the 2-D Gaussian; it factors the final Jacobian for
    the covariance where `triangular_factor` does not take the Cholesky
    factor.)"""
    m, p = a.shape[-2], a.shape[-1]
    row = np.arange(m)
    cols = [a[:, :, j] for j in range(p)]   # full length: rows < j are done
    rows = [[None] * p for _ in range(min(m, p))]   # R is K x P, K = min(M, P)
    qtb = []
    for j in range(min(m, p)):
        # The reflector of column j's rows j.. as a full-length vector, zero
        # above row j (no shrinking copies: one elementwise pass per column).
        x = tf.where(tf.constant(row >= j), cols[j], tf.zeros_like(cols[j]))
        x_norm = norm(x)
        head = cols[j][:, j]
        alpha = -tf.where(head >= 0, tf.ones_like(head), -tf.ones_like(head)) * x_norm
        v = tf.where(tf.constant(row == j), (head - alpha)[:, None], x)
        v2 = dot(v, v)
        beta = tf.where(v2 > 0, 2.0 / tf.where(v2 > 0, v2, tf.ones_like(v2)),
                        tf.zeros_like(v2))
        rows[j][j] = alpha
        for k in range(j + 1, p):
            cols[k] = cols[k] - (beta * dot(v, cols[k]))[:, None] * v
            rows[j][k] = cols[k][:, j]
        if rhs is not None:
            rhs = rhs - (beta * dot(v, rhs))[:, None] * v
            qtb.append(rhs[:, j])
        for i in range(j):
            rows[j][i] = tf.zeros_like(alpha)
    r = tf.stack([tf.stack(r_row, axis=-1) for r_row in rows], axis=-2)
    return r, (tf.stack(qtb, axis=-1) if rhs is not None else None)


def triangular_factor(jacobian, jtj, n):
    """``R`` [B, min(N, P), P] with ``R^T R = J^T J`` (``jacobian()`` [B, N, P],
    ``jtj`` its [B, P, P], computed already; the factor's singular values and
    right vectors are J's: `covariance` needs only this): a QR's; under XLA
    for few parameters (and N >= P) the Cholesky factor of ``jtj`` where
    `small.cholesky_factor` shows it as good as a QR's, the unrolled QR's
    for the other problems (`qr_where`): there ``jacobian()`` is called (for
    the whole batch) under a ``tf.cond``, only where some problem needs it."""
    p = jtj.shape[-1]
    if p <= UNROLL_MAX_PARAMS and spd._in_xla():
        if p <= small.COLUMNS_MAX_PARAMS and n is not None and n >= p:
            r, ok = small.cholesky_factor(jtj, n)
            return tf.cond(tf.reduce_all(ok), lambda: r,
                           lambda: qr_where(~ok, r, jacobian()))
        return unrolled_qr(jacobian())[0]
    return tf.linalg.qr(jacobian())[1]


# `qr_where` factors the refused problems QR_FRACTION-th of a batch at a time
# (each of Gpufit's Gaussians passes `small.cholesky_factor`'s test, so the
# QR of the final Jacobians, 8% of a 5x5 solve's CPU time, runs on a few rows
# at most, and is traced and compiled once, for that many rows).
QR_FRACTION = 16


def qr_where(refused, r, jac):
    """``r`` [B, P, P] with the problems ``refused`` [B] given the unrolled
    QR's ``R`` of their ``jac`` [B, N, P] instead: a ``tf.while_loop`` that
    gathers up to 1/`QR_FRACTION` of the batch's refused problems per pass
    (none refused: no pass). It takes ``jac``'s columns, so that a
    Jacobian formed by columns is not written out as a whole."""
    batch = jac.shape[0]
    if batch is None:
        return tf.where(refused[:, None, None], unrolled_qr(jac)[0], r)
    k = -(-batch // QR_FRACTION)   # at most QR_FRACTION passes
    columns = [jac[..., j] for j in range(jac.shape[-1])]

    def factor_some(left, r):
        rows = tf.math.top_k(tf.cast(left, r.dtype), k=k, sorted=False).indices
        some = tf.stack([tf.gather(c, rows) for c in columns], axis=-1)
        patch = tf.where(tf.gather(left, rows)[:, None, None],
                         unrolled_qr(some)[0], tf.gather(r, rows))
        return (tf.tensor_scatter_nd_update(left, rows[:, None],
                                            tf.zeros_like(rows, tf.bool)),
                tf.tensor_scatter_nd_update(r, rows[:, None], patch))

    return tf.while_loop(lambda left, _: tf.reduce_any(left), factor_some,
                         (refused, r))[1]


class BatchedCholesky:
    """`linear_solvers.Cholesky` per problem: ``J^T J + lambda D^2`` factored."""

    needs_jacobian = False

    def solve(self, lin, damping, d2):
        a = lin.jtj + tf.linalg.diag(damping[:, None] * d2)
        p = a.shape[-1]
        if p <= UNROLL_MAX_PARAMS and spd._in_xla():
            return unrolled_cholesky_solve(a, -lin.jtr)
        # (the library's solve: a plain graph's, or XLA's past
        # UNROLL_MAX_PARAMS; spelled with reshape, expand_dims, squeeze and a
        # [P, P] eye broadcast over the batch: the values of slicing and a
        # batch-shaped `tf.eye`, in fewer ops to trace and no [B, P, P]
        # identity built at every solve; 3 solves in each chunk's trace)
        chol = tf.linalg.cholesky(a)
        ok = (tf.reduce_all(tf.math.is_finite(chol), axis=[-2, -1])
              & tf.reduce_all(tf.linalg.diag_part(chol) > 0, axis=-1))
        safe = tf.where(tf.reshape(ok, [-1, 1, 1]), chol, tf.eye(p, dtype=a.dtype))
        step = tf.squeeze(tf.linalg.cholesky_solve(safe, tf.expand_dims(-lin.jtr, -1)), -1)
        ok = ok & _all_finite(step)
        return tf.where(tf.expand_dims(ok, -1), step, tf.zeros_like(step)), ok


SOLVERS = {"qr": BatchedQR, "cholesky": BatchedCholesky}


def gauss_newton_matvec(lin, v):
    return tf.reduce_sum(lin.jtj * v[..., None, :], axis=-1)


def propose(controller, solver, lin, state, d2, x, active):
    """The damped steps at the controllers' current damping: ``(step [B, P],
    ok [B], DampingState)``; `trust_region_propose` for `TrustRegion`."""
    if isinstance(controller, damping_lib.TrustRegion):
        return trust_region_propose(controller, solver, lin, state, d2, x, active)
    step, ok = solver.solve(lin, state.damping, d2)
    return step, ok, state


def trust_region_propose(controller, solver, lin, state, d2, x, active):
    """`damping.TrustRegion.propose` per problem: the Gauss-Newton step where
    it fits 1.1 times the radius, else lambda fitted to the radius by the
    same bracketed secant (Illinois), each problem leaving the loop where
    the one-problem loop would (``active`` [B]: the problems that take a
    step now; the others are carried along unchanged)."""
    dtype = lin.jtr.dtype
    scale = tf.sqrt(d2)
    zero = tf.zeros_like(state.damping)
    one = tf.ones_like(zero)
    inf = tf.fill(tf.shape(zero), tf.constant(float("inf"), dtype))
    first = state.nu <= 0
    x_norm = norm(scale * x)
    radius = tf.where(first, controller.factor * tf.where(x_norm > 0, x_norm, one),
                      state.nu)

    def measure(lam):
        step, ok = solver.solve(lin, lam, d2)
        n = norm(scale * step)
        ok = ok & tf.math.is_finite(n)
        return step, ok, tf.where(ok, n, inf)

    gn_step, gn_ok, gn_norm = measure(zero)
    gn_inside = gn_ok & (gn_norm <= 1.1 * radius)
    g_norm = norm(lin.jtr / scale)
    hi = g_norm / radius
    psi_lo = 1.0 / gn_norm - 1.0 / radius
    guess = g_norm / gn_norm
    lam = tf.where(state.damping > 0, tf.minimum(state.damping, hi),
                   tf.where(gn_ok & (guess > 0), guess, 1e-3 * hi))
    fitting = active & ~gn_inside
    false = tf.zeros_like(fitting)

    def body(i, lam, lo, psi_lo, hi, psi_hi, has_hi, side, step, ok, n, done, used):
        live = fitting & ~done
        new = list(damping_lib.radius_fit_step(radius, measure, lam, lo, psi_lo, hi, psi_hi, has_hi,
                           side))
        old = [lam, lo, psi_lo, hi, psi_hi, has_hi, side, step, ok, n, done, used]
        out = [tf.where(live[:, None] if o.shape.rank == 2 else live, a, o)
               for a, o in zip(new, old)]
        return (i + 1, *out)

    out = tf.while_loop(
        lambda i, *rest: (i < controller.max_solves) & tf.reduce_any(fitting & ~rest[-2]),
        body,
        (tf.constant(0), lam, zero, psi_lo, hi, zero, false, zero,
         tf.zeros_like(lin.jtr), false, zero, false, zero),
        maximum_iterations=controller.max_solves)
    fit_step, fit_ok, fit_norm, fit_used = out[8], out[9], out[10], out[12]
    step = tf.where(gn_inside[:, None], gn_step, fit_step)
    ok = tf.where(gn_inside, gn_ok, fit_ok)
    lam = tf.where(gn_inside, zero, fit_used)
    n = tf.where(gn_inside, gn_norm, fit_norm)
    radius = tf.where(first & ok, tf.minimum(radius, n), radius)
    return step, ok, damping_lib.DampingState(lam, radius)


def stationarity(lin, largest):
    """`least_squares._stationarity` per problem."""
    r_norm = norm(lin.residuals)
    denominator = largest * r_norm[:, None]
    safe = tf.where(denominator > 0, denominator, tf.ones_like(denominator))
    return tf.reduce_max(tf.where(denominator > 0, tf.abs(lin.jtr) / safe,
                                  tf.zeros_like(denominator)), axis=-1), r_norm


def column_norms(lin):
    return tf.sqrt(tf.maximum(tf.linalg.diag_part(lin.jtj), 0.0))


def covariance(r, cost, counts, absolute, proven=None):
    """``curve_fit``'s ``pcov`` per problem (`least_squares.covariance`,
    `fit_report.covariance_from_svd`: all ``inf`` where J is rank-deficient
    or, unless ``absolute``, ``n <= P``), ``n`` each problem's unmasked point
    count. From ``r`` [B, P, P], the triangular factor of a QR of J
    (`triangular_factor`: the same singular values and right vectors), by
    an SVD outside XLA; for few parameters the SVD runs only for the
    problems whose full rank is not proven (`small.full_rank_inverse`;
    ``proven``: `small.proven_covariance`'s result, computed already)."""

    def from_svd(r, cost, counts):
        s, _, v = tf.linalg.svd(r)
        return fit_report.covariance_from_svd(s, v, counts, cost, absolute)

    if (r.shape[-1] <= small.COLUMNS_MAX_PARAMS and r.shape[-2] == r.shape[-1]
            and tf.executing_eagerly()):   # (fewer points than parameters: R is N x P)
        return small.covariance(r, cost, counts, absolute, from_svd, proven)
    return from_svd(r, cost, counts)
