"""Poisson maximum likelihood as least squares (Gpufit's MLE estimator).

Gpufit's ``MLE`` minimises the Poisson deviance
``chi2 = 2 * sum(f - y - y * log(f / y))`` (the log term 0 where
``y == 0``) of counts ``y >= 0`` under a positive model ``f``. Written as
signed deviance residuals ``r = sign(f - y) * sqrt(2 (f - y - y log(f / y)))``,
``0.5 * sum r^2`` is exactly half the deviance and ``J_r^T r`` exactly its
half-gradient ``sum (1 - y / f) df/dp``, so the least-squares machinery
(damping, stop rules, batching) minimises the deviance unchanged. Its
Gauss-Newton matrix ``J_r^T J_r`` equals Gpufit's ``sum y / f^2 df df^T``
where the model meets the data (``r -> (f - y) / sqrt(y)``) and differs
away from it: the minimum is the same, the path (iteration count) may not
be.

The root is taken in a form that stays smooth through ``f == y``:
``r = (f - y) * sqrt(2 h(u) / y)`` with ``u = (f - y) / y`` and
``h(u) = (u - log1p(u)) / u^2`` (a series below ``|u| = 0.1``, where the
direct form cancels); ``r = sqrt(2 f)`` where ``y == 0``. A non-positive
model value has no Poisson likelihood: its residual is NaN, so a start
there gets the non-finite-start status and a step there is rejected.
"""

import tensorflow as tf

# h(u) = sum_k (-1)^k u^k / (k + 2); 15 terms: below |u| = 0.1 the
# truncation is under 0.1^15 / 17, far below float64 round-off.
_TERMS = 15
_SERIES_BELOW = 0.1


def _h(u):
    small = tf.abs(u) < _SERIES_BELOW
    us = tf.where(small, u, tf.zeros_like(u))
    series = tf.zeros_like(u)
    for k in reversed(range(_TERMS)):
        series = series * us + (-1.0) ** k / (k + 2)
    ud = tf.where(small, tf.ones_like(u), u)
    direct = (ud - tf.math.log1p(ud)) / (ud * ud)
    return tf.where(small, series, direct)


def residuals(model, y):
    """Signed deviance residuals of counts ``y`` under the model ``model``."""
    positive_y = y > 0
    ok = model > 0
    ys = tf.where(positive_y, y, tf.ones_like(y))
    fs = tf.where(ok, model, tf.ones_like(model))
    u = tf.where(positive_y, (fs - ys) / ys, tf.zeros_like(y))
    with_counts = (fs - ys) * tf.sqrt(2.0 * _h(u) / ys)
    no_counts = tf.sqrt(2.0 * fs)
    r = tf.where(positive_y, with_counts, no_counts)
    return tf.where(ok, r, tf.fill(tf.shape(r), tf.constant(float("nan"), r.dtype)))


def residual_derivative(model, y):
    """``dr/df`` elementwise (forward mode), for a user's model Jacobian."""
    with tf.autodiff.ForwardAccumulator(model, tf.ones_like(model)) as acc:
        r = residuals(model, y)
    return acc.jvp(r)
