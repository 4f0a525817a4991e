"""What a finished fit reports besides its solution, for every engine.

`least_squares`, `least_squares_batched` and `curve_fit` (and any other
engine that solves the same problems) report the parameters' covariance and
the statuses that are not stops of the iteration the same way, from here:

- `covariance_from_svd`: scipy ``curve_fit``'s ``pcov`` from the Jacobian's
  singular values, with scipy's convention for a covariance that cannot be
  estimated: every entry ``inf`` when the Jacobian is rank-deficient at the
  solution (a parameter the model ignores, or two it cannot tell apart:
  scipy's ``leastsq`` then fails to invert ``R`` and ``curve_fit`` returns
  an ``inf`` matrix with an ``OptimizeWarning``) or when there are no more
  points than parameters. A pseudo-inverse would give such a parameter
  variance 0, which reads as "known exactly".
- `undetermined`: that condition as a flag, from the covariance.
- `without_covariance`: ``NaN`` covariance for a fit that never ran (a
  non-finite or infeasible start, no data): there is nothing to estimate.
- `warn_undetermined`: `curve_fit`'s warning (scipy's ``OptimizeWarning``).
"""

import warnings

import numpy as np
import tensorflow as tf


class CovarianceWarning(UserWarning):
    """The covariance of some fit's parameters could not be estimated
    (scipy's ``OptimizeWarning`` from ``curve_fit``)."""


# Up to this many parameters a batch's V diag(1/s^2) V^T is one elementwise
# product summed (P^3 products per fit), above a batched matmul.
SMALL_PRODUCT_PARAMS = 10


def covariance_from_svd(s, v, counts, cost, absolute=False):
    """``pcov`` from the Jacobian's singular values ``s`` ``[..., K]``
    (descending) and right singular vectors ``v`` ``[..., P, K]`` (K = P, or
    fewer with fewer points than parameters: then rank-deficient, ``inf``).

    The pseudo-inverse of ``J^T J`` (singular values above ``eps * max(n, P)
    * s_max`` kept, scipy ``trf``'s cut) times ``2 cost / (n - P)`` unless
    ``absolute``; all ``inf`` where a singular value falls under the cut
    (rank-deficient) or, unless ``absolute``, where ``n <= P``.

    Args:
      s, v: as above (of ``J`` or of the ``R`` of a QR of ``J``).
      counts: ``[...]`` each fit's number of points ``n`` (float).
      cost: ``[...]`` ``0.5 * sum r^2`` at the solution.
      absolute: scipy's ``absolute_sigma``.
    """
    dtype = s.dtype
    p = v.shape[-2] if v.shape[-2] is not None else s.shape[-1]
    eps = float(np.finfo(dtype.as_numpy_dtype).eps)
    counts = tf.cast(counts, dtype)
    cut = eps * tf.maximum(counts, float(p))[..., None] * s[..., :1]
    kept = s > cut
    inverse = tf.where(kept, 1.0 / tf.where(kept, s, tf.ones_like(s)) ** 2,
                       tf.zeros_like(s))
    weighted = v * inverse[..., None, :]
    if v.shape.rank == 3 and p is not None and p <= SMALL_PRODUCT_PARAMS:
        # [B, P, P] batches of few parameters: one broadcast product summed
        # (elementwise over the batch); a batched matmul of 5x5 matrices is
        # a loop of tiny calls (0.55 us per fit on a CPU core, 15% of a
        # 5x5 fit).
        pcov = tf.reduce_sum(weighted[..., :, None, :] * v[..., None, :, :], axis=-1)
    else:
        pcov = tf.matmul(weighted, v, transpose_b=True)
    # reduce_all, not a negated comparison: NaN singular values count as
    # deficient in graphs too (Grappler rewrites ~(a > b) into a <= b).
    determined = tf.reduce_all(kept, axis=-1)
    if s.shape[-1] is not None and p is not None and s.shape[-1] < p:
        # Fewer singular values than parameters (N < P): rank-deficient, also
        # with absolute sigmas (no dof test then to catch it).
        determined = tf.zeros_like(determined)
    if not absolute:
        dof = counts - float(p)
        factor = 2.0 * cost / tf.where(dof > 0, dof, tf.ones_like(dof))
        pcov = pcov * factor[..., None, None]
        determined = determined & (dof > 0)
    inf = tf.constant(float("inf"), dtype)
    return tf.where(determined[..., None, None], pcov, inf)


def undetermined(pcov):
    """``[...]`` bool: the covariance could not be estimated (``inf``)."""
    return tf.reduce_any(tf.math.is_inf(pcov), axis=[-2, -1])


def without_covariance(pcov, unusable):
    """``pcov`` with ``NaN`` where ``unusable`` ``[...]`` (the fit never
    ran: non-finite or infeasible start, no data)."""
    return tf.where(unusable[..., None, None],
                    tf.constant(float("nan"), pcov.dtype), pcov)


def warn_undetermined(flags, name):
    """Warns (eagerly) when some fit's covariance is ``inf``."""
    flags = np.asarray(flags).reshape(-1)
    if flags.any():
        warnings.warn(
            f"{name}: the covariance of the parameters could not be estimated "
            f"for {int(flags.sum())} of {flags.size} fit(s) (the Jacobian is "
            "rank-deficient at the solution, e.g. the model ignores a parameter "
            "or reaches it only through an op TensorFlow does not differentiate "
            "(tf.numpy_function, tf.stop_gradient, tf.round: its Jacobian column "
            "is 0 and the fit leaves it at its start), or there are no more "
            "points than parameters): `covariance` is inf there and "
            "`undetermined` is True (scipy's OptimizeWarning).",
            CovarianceWarning, stacklevel=3)
