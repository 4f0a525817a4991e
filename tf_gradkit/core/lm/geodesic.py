"""Geodesic acceleration for Levenberg-Marquardt (Transtrum & Sethna).

The LM step ``v`` is a first-order ("velocity") move. Geodesic acceleration
adds the second-order correction along the same path: with the directional
second derivative of the residuals ``r_vv = v^T (d^2 r) v``, solve

    (J^T J + lambda D^2) a = -J^T r_vv

and take ``v + a / 2`` while ``2 |a| / |v| <= alpha`` (the correction stays
small relative to the velocity), else the plain step ``v``. (Transtrum and
Sethna reject such attempts instead; falling back to ``v`` is never worse.)

On the NIST StRD set (`tests/nist_problems.py`) it saved no iterations and
made one problem worse (docs/levenberg_marquardt.md gives the figures), so it
is off by default; try it where plain LM crawls along a curved valley.

``r_vv`` is taken by a central difference along ``v`` (two residual
evaluations, no second derivatives), and ``J^T r_vv`` by one vector-Jacobian
product at the current point.

Reference: M. Transtrum, J. Sethna, "Improvements to the Levenberg-Marquardt
algorithm for nonlinear least-squares minimization", arXiv:1201.5885, 2012.
"""

import tensorflow as tf

from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm.linear_solvers import Linearization


class GeodesicAcceleration:
    """Second-order correction of the LM step.

    Args:
      residual_fn: the zero-argument residual function being minimised.
      step_size: relative finite-difference step ``h`` along ``v``.
      alpha: largest accepted ``2 |a| / |v|``.
    """

    def __init__(self, residual_fn, step_size=0.1, alpha=0.75):
        if not step_size > 0 or not alpha > 0:
            raise ValueError("GeodesicAcceleration: `step_size` and `alpha` must be "
                             f"positive. Received: step_size={step_size!r}, "
                             f"alpha={alpha!r}")
        self.residual_fn, self.step_size, self.alpha = residual_fn, step_size, alpha

    def correct(self, lin, velocity, damping, d2, solver, variables, x0):
        """Returns ``(step, ok)``: ``v + a/2`` and whether ``2|a|/|v| <= alpha``.

        Leaves ``variables`` at ``x0``.
        """
        dtype = velocity.dtype
        h = tf.constant(self.step_size, dtype)

        def residuals_at(shift):
            for v, v0, d in zip(variables, x0, lin_lib.unflatten(shift, variables)):
                v.assign(v0 + d)
            return tf.cast(tf.reshape(self.residual_fn(), [-1]), dtype)

        plus = residuals_at(h * velocity)
        minus = residuals_at(-h * velocity)
        for v, v0 in zip(variables, x0):
            v.assign(v0)
        with tf.GradientTape() as tape:
            center = tf.reshape(self.residual_fn(), [-1])
        r_vv = (plus - 2.0 * tf.cast(center, dtype) + minus) / (h * h)
        jt_rvv = lin_lib.flatten(tape.gradient(
            center, variables, output_gradients=tf.cast(r_vv, center.dtype),
            unconnected_gradients=tf.UnconnectedGradients.ZERO), dtype)
        accel_lin = Linearization(
            cost=lin.cost, jtj=lin.jtj, jtr=jt_rvv, residuals=r_vv,
            jacobian=lin.jacobian, matvec=lin.matvec)
        accel, ok = solver.solve(accel_lin, damping, d2)
        ratio = 2.0 * tf.norm(accel) / tf.maximum(tf.norm(velocity),
                                                  tf.constant(1e-30, dtype))
        use = ok & (ratio <= self.alpha)
        return tf.where(use, velocity + 0.5 * accel, velocity), tf.constant(True)
