"""The batched linearisation for few parameters: elementwise ops over the batch.

Why: with P parameters per fit and B fits, `batched_parts` used to form the
Jacobian with one vectorised JVP (`tf.vectorized_map`) and ``J^T J`` with a
batched matrix product of ``[B, N, P + 1]`` matrices. Under XLA on a CPU that
product is a loop of tiny GEMM calls: on Gpufit's 5x5 Gaussian (P = 5, N = 25)
it cost 580 ns per fit of the 700 ns of a linearisation
(benchmarks/batched_fits.py --parts). For small P this module does the same
algebra as P(P+1)/2 + P sums of elementwise products of the Jacobian's columns
(``[B, N]`` each), which XLA fuses and vectorises across the fits, and forms
the columns by one forward-mode JVP per parameter (the residuals come out of
the first one). `batched_parts.jacobian` and `batched_parts.normal_equations`
pick this path from the static parameter count (`COLUMNS_MAX_PARAMS`) under
XLA; the result is the same linearisation up to the order of the sums
(round-off). Outside XLA the matrix product runs, the same graph code as
`least_squares`'s, so an uncompiled batch takes a single solve's steps to the
bit (tests/test_batched_least_squares.py), as for `spd.solve`.
"""

import numpy as np
import tensorflow as tf

from tf_gradkit.core import forward_columns
from tf_gradkit.core import spd
from tf_gradkit.core.lm import fit_report
from tf_gradkit.core.lm import linearize

# Up to this many parameters the Jacobian is formed by columns and J^T J by
# elementwise sums (P(P+1)/2 + P of them: 65 at P = 10). Above, the batched
# matrix product does fewer passes over the Jacobian.
COLUMNS_MAX_PARAMS = 10


def by_columns(p):
    """Whether a linearisation of ``p`` parameters (static) traced here runs
    by columns: few parameters, under XLA."""
    return p is not None and p <= COLUMNS_MAX_PARAMS and spd._in_xla()


def jacobian_columns(residual_fn, x):
    """``(residual_fn(x) [B, N], [column_j [B, N] for j < P])``.

    In a plain ``tf.function``: forward mode over the traced ops
    (`forward_columns`: each column's tangent only where its parameter
    reaches, a few ops per op). A plain first call of 10^4 5x5 Gaussian
    fits traces 1,607 ops instead of 1,969 and 46 nested functions fewer
    (its CPU: `benchmarks/first_call.py`, docs/batched_fits.md "A plain
    first call traces fewer ops"). Under XLA, and where an op has no rule
    there (the ops `forward_columns` traced are then unused): one JVP per
    parameter, each seeded with that parameter's unit vector for every
    fit, the residuals the first JVP's primal output. That JVP is traced
    once (a nested ``tf.function`` called P times with the P tangents: the
    user's function and forward mode's per-op rules are traced once, not P
    times; XLA inlines the calls). Under XLA the rules' columns made a
    compiled 5x5 chunk slower (the same page; not studied yet)."""
    p = x.shape[-1]
    found = None if spd._in_xla() else forward_columns.columns(residual_fn, x)
    if found is not None:
        return found

    def jvp(x, tangent):
        with tf.autodiff.ForwardAccumulator(x, tangent) as acc:
            r = residual_fn(x)
        return r, acc.jvp(r, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    jvp = tf.function(jvp, autograph=False)

    def forward():
        columns, residuals = [], None
        for j in range(p):
            tangent = tf.one_hot(tf.fill(tf.shape(x)[:1], j), p, dtype=x.dtype)
            r, column = jvp(x, tangent)
            if residuals is None:
                residuals = r
            columns.append(column)
        return residuals, columns

    def reverse():
        residuals, jac = reverse_jacobian(residual_fn, x)
        return residuals, tf.unstack(jac, num=p, axis=-1)

    return linearize.forward_or_reverse(forward, reverse)


def reverse_jacobian(residual_fn, x):
    """``(residual_fn(x) [B, N], J [B, N, P])`` by reverse mode, one
    vectorised backward pass per residual (`batch_jacobian`: each row of
    the residuals depends on its own row of ``x``): where forward mode
    cannot trace the model (`linearize.forward_or_reverse`)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        residuals = residual_fn(x)
    return residuals, tape.batch_jacobian(
        residuals, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)


# Under XLA a sum over more than this many points is taken in blocks
# (`point_sum`). Why: XLA's CPU compiler rewrites a longer reduction into a
# reduce-window over blocks of 32 and a second reduction, and does not fuse
# the reduce-window with the product it sums: each product of two Jacobian
# columns is written out and read back. On Gpufit's 15x15 Gaussian (225
# points) that made the linearisation's 26 sums 1.8x slower than block sums
# of elementwise slices, which fuse into one loop each.
POINT_BLOCK = 32
# Where ceil(N / 32) equal blocks leave points over (225 = 8 x 28 + 1), up
# to 512 points (where N // 16 slices are at most 32, as above) the blocks
# are 16 points wide instead (225 = 14 x 16 + 1). How wide a block XLA's
# CPU code sums fastest is not smooth in its width. Measured in whole
# compiled fits, A/B in one process, float32 Gaussians with Cpufit's
# stopping rule on one thread, 16-wide blocks against equal ones: 15x15
# 1.27x as many fits per CPU-second, 20x20 1.27x, 7x7 1.06x; where equal
# blocks leave nothing over, 8x8 (64 = 2 x 32) 1.09x (1.14x on two
# threads) but 10x10 (100 = 4 x 25) 0.98x, 16x16 (256 = 8 x 32) 0.74x and
# the float64 decay (100 points) 1.02x. No rule that tells 64 from 100 and
# 256 was found, so equal blocks that leave nothing over stay (8x8's gain
# is left).
SHORT_BLOCK = 16
SHORT_BLOCKS_MAX_POINTS = POINT_BLOCK * SHORT_BLOCK


def point_sum(t):
    """``sum(t, axis=-1)`` over the points of ``t`` [..., N]: under XLA, for
    N > `POINT_BLOCK`, as the sum over the last axis of the elementwise sum
    of ``blocks`` = min(ceil(N / 32), 32) slices of equal width, or, where
    those would leave points over and N <= 512, of N // 16 slices 16 wide
    (`SHORT_BLOCK`); the points left over summed apart (at most 32 slices,
    so the traced graph stays small for long fits: beyond 1,024 points the
    blocks are wider than 32 and XLA splits their sum, over 1/32 of the
    data); else one ``reduce_sum``. The same sum, another order."""
    n = t.shape[-1]
    if n is None or n <= POINT_BLOCK or not spd._in_xla():
        return tf.reduce_sum(t, axis=-1)
    blocks = min(-(-n // POINT_BLOCK), POINT_BLOCK)
    width = n // blocks
    if blocks * width < n and n <= SHORT_BLOCKS_MAX_POINTS:
        width = SHORT_BLOCK
        blocks = n // width
    total = tf.reduce_sum(tf.add_n([t[..., i * width:(i + 1) * width]
                                    for i in range(blocks)]), axis=-1)
    if blocks * width < n:
        total = total + tf.reduce_sum(t[..., blocks * width:], axis=-1)
    return total


def normal_equations(columns, residuals):
    """``(J^T J [B, P, P], J^T r [B, P])`` from the columns ``[B, N]`` of J:
    each entry one elementwise product summed over the points, the upper
    triangle computed and mirrored (symmetric to the bit)."""
    p = len(columns)
    dot = {}
    for i in range(p):
        for j in range(i, p):
            dot[i, j] = point_sum(columns[i] * columns[j])
    jtj = tf.stack([tf.stack([dot[min(i, j), max(i, j)] for j in range(p)], axis=-1)
                    for i in range(p)], axis=-2)
    jtr = tf.stack([point_sum(c * residuals) for c in columns], axis=-1)
    return jtj, jtr


# solver="auto" (`curve_fit`'s and `least_squares_batched`'s default, and
# accepted by `least_squares`, where it resolves the same way, so a batch and
# its single solves take the same steps): the Cholesky solve of the normal
# equations up to this many parameters, where its P^3 / 6 elementwise
# operations cost less than forming them and a QR of the N x P Jacobian costs
# several times more (2.28 s against 0.14 s for 1,000 2-D Gaussian fits,
# issue 39); the QR solve above, and for any size where precision matters
# more than speed (the normal equations square J's condition number: pass
# solver="qr").
AUTO_CHOLESKY_MAX_PARAMS = COLUMNS_MAX_PARAMS


def resolve_solver(solver, p):
    """``solver`` with "auto" resolved for ``p`` parameters (static)."""
    if isinstance(solver, str) and solver == "auto":
        return "cholesky" if p <= AUTO_CHOLESKY_MAX_PARAMS else "qr"
    return solver


def cholesky_entries(a):
    """The lower Cholesky factor of ``a`` [B, P, P] (symmetric) unrolled over
    the columns, elementwise ops on [B] vectors (XLA fuses them; its own
    batched Cholesky loops over small matrices): ``(low, ok)``, ``low[i][j]``
    (j <= i) [B] and ``ok`` [B] where every pivot was positive (elsewhere a
    pivot of 1 stands in: finite, not a factor)."""
    p = a.shape[-1]
    entries = [[a[:, i, j] for j in range(p)] for i in range(p)]
    low = [[None] * p for _ in range(p)]
    ok = tf.ones_like(entries[0][0], tf.bool)
    for j in range(p):
        s = entries[j][j]
        for k in range(j):
            s = s - low[j][k] * low[j][k]
        ok = ok & (s > 0)
        d = tf.sqrt(tf.where(s > 0, s, tf.ones_like(s)))
        low[j][j] = d
        for i in range(j + 1, p):
            t = entries[i][j]
            for k in range(j):
                t = t - low[i][k] * low[j][k]
            low[i][j] = t / d
    return low, ok


# `cholesky_factor` takes the Cholesky factor of J^T J for the covariance
# where CHOLESKY_MARGIN * max(N, P) * eps * kappa^2 < 1, kappa = |R_s|_F
# |R_s^-1|_F of the column-scaled factor R_s (J's columns at unit norm: the
# condition that rounding sees; the unscaled one of Gpufit's 5x5 Gaussians is
# ~1,000, the scaled one at most 10). Forming J^T J and factoring it perturb
# the scaled matrix by at most ~2 (N + P) eps of its trace |R_s|_F^2, that is
# at most 2 (N + P) / (16 N) <= 1/4 of its smallest eigenvalue: every
# singular value within a factor 0.87-1.12 of J's, and the covariance as
# accurate as a QR's (both err by ~ kappa^2 eps). The full-rank test of the
# QR's factor (`full_rank_inverse`) is then passed with a margin of 2.
CHOLESKY_MARGIN = 16


def cholesky_factor(jtj, points):
    """``(R [B, P, P], ok [B])``: ``R = L^T`` of the Cholesky factor of
    ``jtj`` = J^T J (``points`` = N, static), ``R^T R = J^T J`` as a QR's
    ``R`` up to rows' signs; ``ok`` where that factor is as good as a QR's
    for the covariance and its full-rank test (`CHOLESKY_MARGIN`): the
    others need a QR (`batched_parts.triangular_factor`)."""
    dtype = jtj.dtype
    eps = float(np.finfo(dtype.as_numpy_dtype).eps)
    p = jtj.shape[-1]
    low, ok = cholesky_entries(jtj)
    zero = tf.zeros_like(low[0][0])
    r = tf.stack([tf.stack([low[j][i] if j >= i else zero for j in range(p)], axis=-1)
                  for i in range(p)], axis=-2)
    m = float(max(points, p))
    # the QR's full-rank test, with a margin of 2
    inv, full_rank = full_rank_inverse(r, tf.constant(2.0 * eps * m, dtype))
    # kappa^2 of the column-scaled factor R_s = R diag(J^T J)^(-1/2):
    # |R_s|_F^2 = trace of the scaled J^T J = P (R's column j has norm^2
    # a_jj), and R_s^-1[i, j] = R^-1[i, j] sqrt(a_ii)
    kappa2 = p * tf.add_n([inv[:, i, j] * inv[:, i, j] * jtj[:, i, i]
                           for i in range(p) for j in range(i, p)])
    ok = (ok & full_rank & tf.math.is_finite(kappa2)
          & (CHOLESKY_MARGIN * m * eps * kappa2 < 1.0))
    return r, ok


def triangular_inverse(r):
    """``R^-1`` of upper-triangular ``r`` [B, P, P] by back substitution
    unrolled over the columns (elementwise ops on [B] vectors), as a list of
    rows of [B] vectors (zeros below the diagonal)."""
    p = r.shape[-1]
    entry = [[r[:, i, j] for j in range(p)] for i in range(p)]
    zero = tf.zeros_like(entry[0][0])
    inv = [[zero] * p for _ in range(p)]
    for j in range(p):
        inv[j][j] = 1.0 / entry[j][j]
        for i in range(j - 1, -1, -1):
            t = zero
            for k in range(i + 1, j + 1):
                t = t + entry[i][k] * inv[k][j]
            inv[i][j] = -t / entry[i][i]
    return inv



def full_rank_inverse(r, threshold):
    """``(R^-1 [B, P, P], exact [B])`` of upper-triangular ``r``; ``exact``
    where ``R`` provably keeps every singular value above ``threshold`` [B]
    times the largest (``1 / |R^-1|_F <= s_min`` and ``s_max <= |R|_F``):
    there the pseudo-inverse of ``R^T R`` that drops the smaller ones is
    ``R^-1 R^-T``."""
    p = r.shape[-1]
    inv = triangular_inverse(r)
    inv_norm2 = tf.add_n([inv[i][j] * inv[i][j] for i in range(p) for j in range(i, p)])
    r_norm2 = tf.reduce_sum(tf.square(r), axis=[-2, -1])
    exact = (tf.math.is_finite(inv_norm2) & tf.math.is_finite(r_norm2)
             & (inv_norm2 > 0) & (threshold * threshold * inv_norm2 * r_norm2 < 1.0))
    return tf.stack([tf.stack(row, axis=-1) for row in inv], axis=-2), exact


def proven_covariance(r, cost, counts, absolute):
    """``(pcov [B, P, P], exact [B])``: where ``exact`` (full rank proven,
    `full_rank_inverse`), `fit_report.covariance_from_svd` with unit
    singular values and ``V = R^-1`` (``V V^T = (R^T R)^-1``: the same
    ``pcov``, its scaling and its ``inf`` rules from the shared function);
    elsewhere to be replaced (`covariance`). Elementwise ops: `fitting`
    runs it inside the compiled chunk (eagerly, its ~60 small ops per chunk
    cost 1.2 us per 5x5 fit, a third of the solve)."""
    dtype = r.dtype
    eps = float(np.finfo(dtype.as_numpy_dtype).eps)
    p = r.shape[-1]
    counts = tf.cast(counts, dtype)
    inv, exact = full_rank_inverse(r, eps * tf.maximum(counts, float(p)))
    fast = fit_report.covariance_from_svd(tf.ones_like(r[..., 0]), inv, counts, cost,
                                          absolute)
    return fast, exact


def covariance(r, cost, counts, absolute, from_svd, proven=None):
    """`batched_parts.covariance` for few parameters, eagerly:
    `proven_covariance` (or ``proven``, its result computed already), and
    ``from_svd(r, cost, counts)`` (an SVD) for the problems whose full rank
    it could not prove only. The batched SVD of 5x5 matrices cost 2.3 us
    per fit on a CPU core, as much as the whole solve."""
    fast, exact = (proven if proven is not None
                   else proven_covariance(r, cost, counts, absolute))
    if bool(tf.reduce_all(exact)):
        return fast
    counts = tf.cast(counts, r.dtype)
    rest = tf.where(~exact)[:, 0]
    slow = from_svd(tf.gather(r, rest), tf.gather(cost, rest), tf.gather(counts, rest))
    return tf.tensor_scatter_nd_update(fast, rest[:, None], slow)
