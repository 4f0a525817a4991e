"""Robust losses for `least_squares`, by scipy's definitions.

The cost is ``0.5 * C^2 * sum(rho(z))`` with ``z = (f / C)^2``, ``f`` the
residuals and ``C`` the ``f_scale`` (scipy.optimize.least_squares):

- ``linear``:  ``rho(z) = z`` (ordinary least squares);
- ``soft_l1``: ``rho(z) = 2 ((1 + z)^0.5 - 1)``;
- ``huber``:   ``rho(z) = z`` if ``z <= 1`` else ``2 z^0.5 - 1``;
- ``cauchy``:  ``rho(z) = ln(1 + z)``;
- ``arctan``:  ``rho(z) = arctan(z)``;
- ``absolute`` (not scipy's): ``rho(z) = 2 z^0.5``, so the cost is
  ``C * sum |f|`` (a mean absolute error), stepped by iteratively
  reweighted least squares (`FIRST_ORDER`).

Each Gauss-Newton step uses scipy's (and Triggs et al.'s) rescaling: with
``s = sqrt(max(rho'(z) + 2 z rho''(z), eps))`` the step is taken for the
residuals ``rho'(z) f / s`` with the Jacobian ``s J``, so that their ``J^T r``
is the robust cost's gradient ``rho'(z) J^T f`` and ``J^T J`` its
Gauss-Newton Hessian. The step function never changes: `scaled` returns one
residual function whose value is the first and whose Jacobian is the second.
"""

import tensorflow as tf


def _linear(z):
    return z, tf.ones_like(z), tf.zeros_like(z)


def _soft_l1(z):
    t = 1.0 + z
    return 2.0 * (tf.sqrt(t) - 1.0), tf.math.rsqrt(t), -0.5 * t ** -1.5


def _huber(z):
    inside = z <= 1.0
    safe = tf.where(inside, tf.ones_like(z), z)
    return (tf.where(inside, z, 2.0 * tf.sqrt(safe) - 1.0),
            tf.where(inside, tf.ones_like(z), tf.math.rsqrt(safe)),
            tf.where(inside, tf.zeros_like(z), -0.5 * safe ** -1.5))


def _cauchy(z):
    t = 1.0 + z
    return tf.math.log1p(z), 1.0 / t, -1.0 / tf.square(t)


def _arctan(z):
    t = 1.0 + tf.square(z)
    return tf.atan(z), 1.0 / t, -2.0 * z / tf.square(t)


def _absolute(z):
    root = tf.sqrt(z)
    return 2.0 * root, 1.0 / root, -0.5 / (z * root)


LOSSES = {"linear": _linear, "soft_l1": _soft_l1, "huber": _huber,
          "cauchy": _cauchy, "arctan": _arctan, "absolute": _absolute}
# Losses whose rho' + 2 z rho'' vanishes: their Gauss-Newton weight is rho'
# alone (iteratively reweighted least squares), with z kept at or above
# (1e-3 times the batch's mean |f| / C)^2 so that a residual near 0 does not
# get an unbounded weight.
FIRST_ORDER = ("absolute",)
FIRST_ORDER_FLOOR = 1e-3


class RobustLoss:
    """One of `LOSSES` with its ``f_scale`` ``C`` (the residual size where
    the loss stops being quadratic).

    Args:
      loss: a name in `LOSSES`.
      f_scale: positive float, ``C``.
      first_order: step with the weight ``rho'`` alone (iteratively
        reweighted least squares, a majoriser of the loss for ``huber``)
        instead of scipy's ``rho' + 2 z rho''``; default: for `FIRST_ORDER`
        losses only. Keras's Huber is stepped so (`lm_losses`): where every
        residual is past ``C`` scipy's weight vanishes, ``J^T J`` with it, and
        the damped step (scaled by ``diag(J^T J)``) stays too long to accept.
    """

    def __init__(self, loss="linear", f_scale=1.0, first_order=None):
        if not isinstance(loss, str) or loss not in LOSSES:
            raise ValueError(f"least_squares: `loss` must be one of {sorted(LOSSES)}. "
                             f"Received: loss={loss!r}")
        if isinstance(f_scale, bool) or not isinstance(f_scale, (int, float)) \
                or not f_scale > 0:
            raise ValueError("least_squares: `f_scale` must be a positive number. "
                             f"Received: f_scale={f_scale!r}")
        self.name, self.f_scale = loss, float(f_scale)
        self.first_order = loss in FIRST_ORDER if first_order is None else bool(
            first_order)
        self._rho = LOSSES[loss]

    @property
    def is_linear(self):
        return self.name == "linear"

    def cost(self, f, weights=None):
        """``0.5 * C^2 * sum(weights * rho((f / C)^2))`` of flat residuals."""
        c = tf.constant(self.f_scale, f.dtype)
        rho, _, _ = self._rho(tf.square(f / c))
        if weights is not None:
            rho = weights * rho
        return 0.5 * c * c * tf.reduce_sum(rho)

    def weights(self, f):
        """``(residual factor, Jacobian factor)`` per residual, as constants."""
        c = tf.constant(self.f_scale, f.dtype)
        z = tf.square(f / c)
        eps = tf.constant(tf.experimental.numpy.finfo(f.dtype.as_numpy_dtype).eps,
                          f.dtype)
        if self.first_order:
            floor = FIRST_ORDER_FLOOR * tf.reduce_mean(tf.abs(f)) / c
            z = tf.maximum(z, tf.maximum(tf.square(floor), eps))
            _, d1, _ = self._rho(z)
            jacobian_factor = tf.sqrt(d1)
        else:
            _, d1, d2 = self._rho(z)
            jacobian_factor = tf.sqrt(tf.maximum(d1 + 2.0 * z * d2, eps))
        return tf.stop_gradient(d1 / jacobian_factor), tf.stop_gradient(jacobian_factor)

    def scale(self, f, weights=None):
        """Step residuals from residuals ``f`` (flat, differentiable): the
        value ``sqrt(weights) rho'(z) f / s``, the Jacobian ``sqrt(weights) s J``
        (``s`` held constant)."""
        f_factor, j_factor = self.weights(tf.stop_gradient(f))
        if weights is not None:
            root = tf.sqrt(tf.stop_gradient(weights))
            f_factor, j_factor = root * f_factor, root * j_factor
        return j_factor * f + tf.stop_gradient((f_factor - j_factor) * f)

    def scaled(self, residual_fn, dtype):
        """A residual function with value ``rho'(z) f / s`` and Jacobian
        ``s J`` (``s`` held constant), flat, in ``dtype``."""

        def fn():
            return self.scale(tf.cast(tf.reshape(residual_fn(), [-1]), dtype))

        return fn
