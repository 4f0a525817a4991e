"""One Levenberg-Marquardt iteration, accept/reject retries included.

The whole iteration is graph code: linearise once, then a ``tf.while_loop``
of attempts, each a damped solve reusing the same J^T J and J^T r, a trial
write of the parameters and one residual evaluation. A rejected attempt
raises the damping; if every attempt fails the parameters are restored
exactly (the saved values are written back, no arithmetic undo).

Gain ratio: ``rho = (cost - cost_trial) / (L(0) - L(d))`` with the model
``L(d) = 0.5 |r + J d|^2``, so ``L(0) - L(d) = -d.J^T r - 0.5 d.J^T J d``.
"""

from typing import NamedTuple

import tensorflow as tf

from tf_gradkit.core import precision
from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib


class LMState(NamedTuple):
    """Carried between iterations: the damping controller's `DampingState`
    and the damping scaling's memory (MINPACK-style running max of
    diag(J^T J))."""

    control: damping_lib.DampingState
    scale: tf.Tensor

    @property
    def damping(self):
        """The current lambda."""
        return self.control.damping


class StepInfo(NamedTuple):
    cost: tf.Tensor          # before the step
    new_cost: tf.Tensor      # after (== cost when nothing was accepted)
    accepted: tf.Tensor
    attempts: tf.Tensor
    step_norm: tf.Tensor
    gradient_norm: tf.Tensor  # max |J^T r| before the step
    rho: tf.Tensor
    predicted: tf.Tensor     # model decrease L(0) - L(d) of the last attempt
    first_step_norm: tf.Tensor  # |d| of the first (least damped) attempt
    last_step_norm: tf.Tensor   # |d| of the last attempt


def init_state(controller, scaling, num_params, dtype):
    return LMState(controller.init(dtype), scaling.init(num_params, dtype))


def levenberg_marquardt_step(lin, cost_fn, variables, state, *, controller,
                             scaling, solver, max_attempts, geodesic=None,
                             support=None, bounds=None, constrain=None,
                             give_up_below=None):
    """Runs one LM iteration from the linearisation ``lin``.

    Args:
      lin: `Linearization` at the current ``variables``.
      cost_fn: zero-argument function, ``0.5 * sum r^2`` at the current values
        of ``variables`` (evaluated once per attempt).
      variables: the parameters (``tf.Variable``s), updated in place.
      state: `LMState`.
      controller, scaling, solver: the damping rule, the damping matrix and
        the linear solver.
      max_attempts: Python int, attempts before giving up on this iteration.
      give_up_below: optional scalar: a refused attempt whose model decrease
        was at most this ends the iteration (``ftol * cost``: the smaller
        steps of further attempts promise less still, so the iteration ends
        on the cost tolerance either way; in float32 near a minimum, where
        the decrease is under the cost's round-off, they were refused up to
        ``max_attempts`` times). A failed solve (a zero step) never gives up.
      geodesic: optional `geodesic.GeodesicAcceleration`, adding the
        second-order correction to each attempted step.
      support: optional `linearize.Support` the linearisation was taken over;
        the step moves only those parameters (pruned weights stay put) and
        the damping scale of the others is kept as it was.
      bounds: optional `bounds.Bounds`: every attempted step is projected
        onto the box before it is tried and measured (``lin`` should have
        the parameters held on a bound frozen, `bounds.freeze`).
      constrain: optional zero-argument function that may change
        ``variables`` in place (Keras's variable constraints), applied after
        each trial write and after a restore. Each trial is then measured
        where the constraints put it: its cost at the constrained point, and
        the predicted decrease ``L(0) - L(d)`` along the displacement really
        made (the constrained point minus the start), so an accepted step
        lowered the cost of the weights the caller keeps.

    Returns:
      ``(new_state, StepInfo)``.
    """
    dtype = lin.jtr.dtype
    if support is not None and geodesic is not None:
        raise ValueError("levenberg_marquardt_step: geodesic acceleration "
                         "over a support is not supported.")
    if bounds is not None and support is not None:
        raise ValueError("levenberg_marquardt_step: bounds over a support are "
                         "not supported.")
    num_params = state.scale.shape[0]
    x0 = [tf.identity(v) for v in variables]
    # Matrix-free linearisations have no diag(J^T J): only Levenberg scaling,
    # which ignores it, applies (the adapters check this at construction).
    if lin.jtj is not None:
        jtj_diag = tf.linalg.diag_part(lin.jtj)
    elif lin.jtj_diag is not None:  # J held without J^T J (`from_rows`)
        jtj_diag = lin.jtj_diag
    else:
        jtj_diag = tf.zeros_like(lin.jtr)
    old_scale = (state.scale if support is None
                 else tf.gather(state.scale, support.indices))
    scale = scaling.update(old_scale, jtj_diag)
    d2 = scaling.diagonal(scale, jtj_diag)
    if support is not None:  # padding: a positive diagonal, a zero step
        d2 = tf.where(support.valid, d2, tf.ones_like(d2))

    def on_support(flat):
        if support is None:
            return flat
        return tf.where(support.valid, tf.gather(flat, support.indices),
                        tf.zeros_like(d2))

    x_flat = on_support(lin_lib.flatten(x0, dtype))
    root_d2 = tf.sqrt(d2)

    def attempt(i, accepted, damping, nu, new_cost, step_norm, rho, predicted,
                first_norm):
        del accepted, new_cost, step_norm, rho, predicted
        step, ok, dstate = controller.propose(
            solver, lin, damping_lib.DampingState(damping, nu), d2, x_flat)
        step = tf.where(ok, step, tf.zeros_like(step))
        if geodesic is not None:
            step, accel_ok = geodesic.correct(lin, step, dstate.damping, d2,
                                              solver, variables, x0)
            ok = ok & accel_ok
            step = tf.where(ok, step, tf.zeros_like(step))
        if bounds is not None:
            step = bounds.project(x_flat, step)
        full = lin_lib.to_full(step, support, num_params)
        for v, v0, d in zip(variables, x0, lin_lib.unflatten(full, variables)):
            v.assign(v0 + d)
        if constrain is not None:
            constrain()
            step = on_support(lin_lib.flatten(variables, dtype)) - x_flat
        trial = tf.cast(cost_fn(), dtype)
        slope = precision.dot(step, lin.jtr)
        predicted = -slope - 0.5 * precision.dot(
            step, solvers_lib.gauss_newton_matvec(lin, step))
        rho = (lin.cost - trial) / tf.where(predicted > 0, predicted,
                                            tf.ones_like(predicted))
        good = ok & tf.math.is_finite(trial) & (predicted > 0) & (rho > 0)
        measured = damping_lib.Trial(
            rho=tf.where(good, rho, tf.zeros_like(rho)),
            scaled_norm=tf.where(ok, tf.norm(root_d2 * step),
                                 tf.constant(float("inf"), dtype)),
            actual=tf.where(ok, lin.cost - trial, tf.constant(float("-inf"), dtype)),
            slope=slope, cost=lin.cost,
            new_cost=tf.where(ok, trial, tf.constant(float("inf"), dtype)))
        dstate = tf.cond(good, lambda: controller.accept(dstate, rho, measured),
                         lambda: controller.reject(dstate, measured))
        norm = tf.norm(step)
        return (i + 1, good, dstate.damping, dstate.nu,
                tf.where(good, trial, lin.cost), norm, rho, predicted,
                tf.where(tf.equal(i, 0), norm, first_norm))

    zero = tf.constant(0.0, dtype)

    def given_up(i, predicted):
        if give_up_below is None:
            return tf.constant(False)
        return (i > 0) & (predicted > 0) & (predicted <= give_up_below)

    (attempts, accepted, damping, nu, new_cost, step_norm, rho, predicted,
     first_norm) = tf.while_loop(
        lambda i, accepted, damping, nu, new_cost, step_norm, rho, predicted, _: (
            (i < max_attempts) & tf.logical_not(accepted)
            & tf.logical_not(given_up(i, predicted))),
        attempt,
        (tf.constant(0), tf.constant(False), state.control.damping, state.control.nu,
         lin.cost, zero, zero, zero, zero),
        maximum_iterations=max_attempts)

    def restore():
        for v, v0 in zip(variables, x0):
            v.assign(v0)
        if constrain is not None:
            constrain()
        return tf.constant(True)

    tf.cond(accepted, lambda: tf.constant(False), restore)
    if support is not None:
        scale = tf.tensor_scatter_nd_update(
            state.scale, support.indices[:, None],
            tf.where(support.valid, scale, old_scale))
    info = StepInfo(cost=lin.cost, new_cost=new_cost, accepted=accepted,
                    attempts=attempts, step_norm=tf.where(accepted, step_norm, zero),
                    gradient_norm=tf.reduce_max(tf.abs(lin.jtr)), rho=rho,
                    predicted=predicted, first_step_norm=first_norm,
                    last_step_norm=step_norm)
    return LMState(damping_lib.DampingState(damping, nu), scale), info
