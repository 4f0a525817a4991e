"""B independent least-squares problems in one compiled loop.

Each problem runs `least_squares`'s iteration (`step.py`'s accept/reject
attempts, the trust-region radius, the bounds' active set, a robust loss,
the stop tests and `least_squares`'s stationarity check) with its own
damping, iteration count and stop reason; the parts are the one-problem
parts with a batch axis (`batched_parts.py`). A problem that has stopped is
frozen (its state is carried unchanged) while the others go on; each loop
ends when every problem has left it. So each problem ends where
`least_squares` ends on it alone with the same options, up to round-off
(tests/test_batched_least_squares.py).

Counters and stop codes are int64 (an int32 tensor would sit in a GPU's
host memory outside XLA).
"""

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_gradkit.core import spd
from tf_gradkit.core.lm import batched_parts as parts
from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import loop_data
from tf_gradkit.core.lm.least_squares import REASONS, STATIONARY_COSINE
from tf_gradkit.core.lm.whole_solve import (ROUND_OFF_STEP, gauss_newton_decrease,
                                            within_ftol)
from tf_gradkit.core.lm.least_squares import NON_FINITE_START as _NON_FINITE

NON_FINITE_START = int(_NON_FINITE)

INFEASIBLE_START = len(REASONS)
BATCHED_REASONS = REASONS + (
    "infeasible start (the start lies outside `bounds`; as scipy's infeasible "
    "`x0`)",
    "no data (every point of this fit is masked; nothing to fit)",)
# A problem whose every residual is masked: refused by its own status.
NO_DATA = INFEASIBLE_START + 1
# Fits that never ran: no covariance (NaN), not moved.
NOT_RUN = (NON_FINITE_START, INFEASIBLE_START, NO_DATA)


class BatchedOptions(NamedTuple):
    """What a batched solve runs with (resolved parts and numbers)."""

    controller: object
    scaling: object
    solver: object
    loss: object            # robust.RobustLoss
    max_iterations: int
    max_attempts: int
    gtol: float
    xtol: float
    ftol: float


class BatchedSolution(NamedTuple):
    x: tf.Tensor             # [B, P]
    cost: tf.Tensor          # [B]
    iterations: tf.Tensor    # [B] int64
    status: tf.Tensor        # [B] int64, index into BATCHED_REASONS
    damping: tf.Tensor       # [B]
    optimality: tf.Tensor    # [B]
    stationarity: tf.Tensor  # [B]
    grad: tf.Tensor          # [B, P]
    active_mask: tf.Tensor   # [B, P] int64
    factor: tf.Tensor        # [B, K, P] R^T R = J^T J, K = min(N, P) (`triangular_factor`)
    fun: tf.Tensor = None    # [B, N] the residuals at x (full_output)
    jac: tf.Tensor = None    # [B, N, P] robust-scaled as scipy's (full_output)
    stopped_by: tf.Tensor = None  # [B] int64 (`whole_solve.reason_text`)


class _Run(NamedTuple):
    x: tf.Tensor
    iterations: tf.Tensor
    status: tf.Tensor
    damping: tf.Tensor
    cost: tf.Tensor
    stationarity: tf.Tensor
    blind: tf.Tensor  # [B, P] on a bound the residuals ignore (`Bounds.blind`)
    stopped_by: tf.Tensor  # [B] int64: a stall's tolerance code, else 0
    final: object = None   # BatchedLinearization at x (its Jacobian: outside XLA, or if the solver needs it)


def _pick(flags, a, b):
    """Per problem (``flags`` [B]) ``a`` else ``b``, over nested tensors of
    any rank (None stays None)."""
    def one(u, v):
        if u is None:
            return None
        return tf.where(tf.reshape(flags, [-1] + [1] * (u.shape.rank - 1)), u, v)
    return tf.nest.map_structure(one, a, b)


def solve(residual_fn, x0, options, counts, box=None, full_output=False,
          rows_fn=None):
    """Solves the B problems ``min 0.5 sum rho(residual_fn(x)[b]^2)``.

    Args:
      residual_fn: ``x [B, P] -> residuals [B, N]`` (each row depending on
        its own row of ``x`` only; masked points already 0).
      x0: ``[B, P]`` starts.
      options: `BatchedOptions`.
      counts: ``[B]`` each problem's number of (unmasked) residuals.
      box: optional `batched_parts.BatchedBounds`.
      full_output: also return the residuals and the Jacobian at the
        solutions.
      rows_fn: optional ``rows [S] -> residual_fn`` of the problems at those
        rows only (their data gathered): lets a loop whose problems are
        mostly done go on with the few left (`COMPACT_FRACTION`).

    Returns:
      `BatchedSolution`.
    """
    dtype = x0.dtype
    eps = float(np.finfo(dtype.as_numpy_dtype).eps)
    prob = _problems(residual_fn, counts, box, options)
    cost_fn = prob.cost_fn

    start_cost = cost_fn(x0)
    finite = tf.reduce_all(tf.math.is_finite(x0), axis=-1) & tf.math.is_finite(
        start_cost)
    start = tf.where(finite, tf.constant(0, tf.int64),
                     tf.constant(NON_FINITE_START, tf.int64))
    if box is not None:
        start = tf.where(finite & box.infeasible(x0),
                         tf.constant(INFEASIBLE_START, tf.int64), start)
    start = tf.where(counts > 0, start, tf.constant(NO_DATA, tf.int64))

    def run(scaling, controller, start_code, x_start=x0):
        return _run(prob, rows_fn, counts, x_start, start_code, start_cost,
                    scaling, controller, options, eps)

    phases = (options.scaling.phases(options.controller)
              if callable(getattr(options.scaling, "phases", None))
              else [(options.scaling, options.controller)])
    out = run(*phases[0], start)
    for phase in phases[1:]:
        # `least_squares`'s restart: the next phase only where this one ended
        # unconverged, from x0 again; the lower cost of the two is kept.
        again = (out.status >= 4) & (out.status != NON_FINITE_START) & (
            out.status != INFEASIBLE_START) & (out.status != NO_DATA)

        def restart(phase=phase, again=again, out=out):
            second = run(*phase, tf.where(again, tf.constant(0, tf.int64), out.status))
            better = again & ((second.cost < out.cost) | ~tf.math.is_finite(out.cost))
            kept = _pick(better, second, out)
            return kept._replace(iterations=tf.where(
                again, out.iterations + second.iterations, out.iterations))

        out = _if_any(again, restart, out)
    if box is not None:
        out = _off_bounds(run, box, x0, out, phases[0])
    x = out.x
    final = out.final   # the linearisation at x, from the run that ended there

    def jacobian():   # under XLA the runs keep it only if their solver needs it
        if final.jacobian is not None:
            return final.jacobian
        return prob.robust.linearize(residual_fn, x).jacobian

    jac = jacobian() if full_output else None   # traced once, for both
    if box is None:
        mask = tf.zeros_like(x, tf.int64)
        scaled = final.jtr
    else:
        mask = box.active_mask(x)
        scaled = final.jtr * box.coleman_li(x, final.jtr)
    return BatchedSolution(
        x=x, cost=final.cost, iterations=out.iterations, status=out.status,
        damping=out.damping, optimality=tf.reduce_max(tf.abs(scaled), axis=-1),
        stationarity=out.stationarity, grad=final.jtr, active_mask=mask,
        factor=parts.triangular_factor(jacobian if jac is None else lambda: jac,
                                       final.jtj, final.residuals.shape[-1]),
        fun=residual_fn(x) if full_output else None,
        jac=jac, stopped_by=out.stopped_by)


class _Problems(NamedTuple):
    """The problems a loop runs on: their residuals, robust loss, bounds."""

    residual_fn: object
    cost_fn: object
    robust: object       # batched_parts.BatchedRobustLoss
    held: object         # (lin, x) -> lin with the bound-held parameters out
    box: object          # batched_parts.BatchedBounds or None

    def with_residuals(self, residual_fn):
        """The same problems with ``residual_fn`` (the same residuals, built
        over other tensors: `loop_data`) and its cost."""
        robust = self.robust

        def cost_fn(x):
            return robust.cost(residual_fn(x))

        return self._replace(residual_fn=residual_fn, cost_fn=cost_fn)


def _problems(residual_fn, counts, box, options):
    def held(lin, x):
        return lin if box is None else box.freeze(lin, x)

    return _Problems(None, None, parts.BatchedRobustLoss(options.loss, counts), held,
                     box).with_residuals(residual_fn)


# When at most 1/COMPACT_FRACTION of a chunk's problems are still running
# (typically a few that keep refusing steps near their minimum), those are
# gathered into a batch that size and the loop goes on with them alone: the
# chunk's last passes cost 1/16 of a full pass (on Gpufit's 5x5 Gaussian,
# 8 of 13 passes ran with under 3% of the fits). Only for chunks of at least
# COMPACT_MIN_BATCH problems, and only under XLA: in a plain tf.function
# (`fitting.AUTO_XLA_FITS`: a first call) tracing and instantiating the
# second loop cost about 0.4 s, more than it saves on 10^4 small fits.
# Each problem's steps are the same.
COMPACT_FRACTION = 16
COMPACT_MIN_BATCH = 512


def _run(prob, rows_fn, counts, x0, start_code, start_cost, scaling, controller,
         options, eps):
    """`least_squares`'s ``run`` for every problem whose ``start_code`` is 0
    (the others are carried through unchanged)."""
    dtype = x0.dtype
    batch, p = x0.shape[0], x0.shape[1]
    control = controller.init(dtype)
    damping0 = tf.broadcast_to(control.damping, [batch])
    nu0 = tf.broadcast_to(control.nu, [batch])
    scale0 = tf.broadcast_to(scaling.init(p, dtype), [batch, p])
    sqrt_eps = tf.constant(np.sqrt(eps), dtype)
    state = (x0, tf.zeros([batch], tf.int64), start_code, damping0, nu0, scale0,
             tf.zeros([batch, p], dtype), tf.zeros([batch], tf.int64),
             tf.zeros([batch], tf.int64), tf.zeros([batch], dtype))
    carry = spd._in_xla()
    if carry:
        # The linearisation at x rides in the state (`_body`): one more
        # linearisation to trace, which a plain function's first call
        # (`fitting.AUTO_XLA_FITS`) would pay for more than it saves.
        state += _carried(prob.robust.linearize(prob.residual_fn, x0,
                                                options.solver.needs_jacobian))
    limit = None
    if (rows_fn is not None and batch is not None and batch >= COMPACT_MIN_BATCH
            and carry):
        limit = batch // COMPACT_FRACTION

    def body_of(problems):
        return _body(problems, scaling, controller, options, sqrt_eps)

    state = _loop(prob, body_of, state, options, limit)
    if limit is not None:
        running = (state[2] == 0) & (state[1] < options.max_iterations)
        rows = tf.math.top_k(tf.cast(running, dtype), k=limit, sorted=False).indices
        box = prob.box
        sub_box = None if box is None else parts.BatchedBounds(
            tf.gather(box.lower, rows), tf.gather(box.upper, rows))
        sub = _problems(rows_fn(rows), tf.gather(counts, rows), sub_box, options)
        sub_state = _loop(sub, body_of, tuple(tf.gather(t, rows) for t in state),
                          options, None)
        state = tuple(tf.tensor_scatter_nd_update(t, rows[:, None], u)
                      for t, u in zip(state, sub_state))
    x, it, code, damping, _, _, largest, test, _, _ = state[:_STATE]
    residual_fn, robust, held, box = prob.residual_fn, prob.robust, prob.held, prob.box
    code = tf.where(code == 0, tf.constant(4, tf.int64), code)
    if not carry:
        final = robust.linearize(residual_fn, x)
    else:
        final = parts.BatchedLinearization(*state[_STATE:])
        if final.residuals is None:   # the Jacobian itself: `solve`'s, if needed
            final = final._replace(residuals=robust.residuals(residual_fn(x)))
    kept = held(final, x)
    now = parts.column_norms(kept)
    cosine_now, r_norm = parts.stationarity(kept, now)
    cosine, _ = parts.stationarity(kept, tf.maximum(largest, now))
    tiny = tf.constant(np.finfo(dtype.as_numpy_dtype).tiny, dtype)
    relative = tf.reduce_max(tf.abs(kept.jtr) * tf.maximum(tf.abs(x), 1.0),
                             axis=-1) / tf.maximum(final.cost, tiny)
    stationary = ((cosine_now <= STATIONARY_COSINE)
                  | ((cosine <= STATIONARY_COSINE) & (relative <= eps ** (1.0 / 3.0)))
                  | within_ftol(code, *gauss_newton_decrease(kept, _gauss_newton),
                                final.cost, options.ftol))
    along = cosine_now * r_norm
    far = ((code >= 2) & (code <= 3) & ~stationary & (along > sqrt_eps)
           & (final.cost > eps * start_cost))
    blind = tf.zeros_like(x, tf.bool)
    if box is not None:  # on a bound the residuals ignore (`Bounds.blind`)
        blind = box.blind(x, parts.column_norms(final), tf.maximum(largest, now),
                          eps) & ((code >= 1) & (code <= 3)
                                  & (final.cost > eps * start_cost))[:, None]
        far = far | tf.reduce_any(blind, axis=-1)
    stopped_by = tf.where(far, test, tf.zeros_like(test))
    code = tf.where(far, tf.constant(6, tf.int64), code)
    return _Run(x=x, iterations=it, status=code, damping=damping, cost=final.cost,
                stationarity=cosine, blind=blind, stopped_by=stopped_by, final=final)


# `_run`'s loop state: these many tensors, then the linearisation at x
# (`_carried`: its fields that are not None).
_STATE = 10


def _carried(lin):
    return tuple(t for t in lin if t is not None)


def _gauss_newton(jtj, jtr):
    """The undamped step per problem (`BatchedCholesky`, unrolled under XLA)."""
    lin = parts.BatchedLinearization(cost=None, jtj=jtj, jtr=jtr, residuals=None,
                                     jacobian=None)
    return parts.BatchedCholesky().solve(lin, tf.zeros_like(jtr[:, 0]),
                                         tf.ones_like(jtr))


def _loop(prob, body_of, state, options, limit):
    """Passes of ``body_of(prob)`` until no problem runs (or, with ``limit``,
    until at most ``limit`` do). Under XLA, when the residuals carry the
    ``loop_data`` ability, their data ride in the loop's state behind a
    barrier and each pass builds its residuals from them (`loop_data`: so
    the P JVPs' copies of the model merge)."""
    n = len(state)

    def running(code, it):
        return (code == 0) & (it < options.max_iterations)

    def cond(x, it, code, *_):
        if limit is None:
            return tf.reduce_any(running(code, it))
        return tf.reduce_sum(tf.cast(running(code, it), tf.int64)) > limit

    most = options.max_iterations * options.max_attempts
    carry = loop_data.carried(prob.residual_fn) if spd._in_xla() else None
    if carry is None:
        return tf.while_loop(cond, body_of(prob), state, maximum_iterations=most)
    tensors, rebuild = carry

    def body(*args):
        data = loop_data.barrier(args[n:])
        this = prob.with_residuals(rebuild(data))
        return tuple(body_of(this)(*args[:n])) + tuple(data)

    out = tf.while_loop(lambda *args: cond(*args[:n]), body,
                        tuple(state) + tuple(tensors), maximum_iterations=most)
    return tuple(out[:n])


def _body(prob, scaling, controller, options, sqrt_eps):
    """One pass: each running problem's linearisation at x and one attempt.
    Under XLA the linearisation at x is carried in the state (after
    ``_STATE`` tensors): the attempt linearises at its trial point (whose
    cost it needs), carried on where the step is taken, so no pass
    evaluates the residuals twice at one point (the bounded decay of
    benchmarks/bounded_decay.py 1.15x as many fits per CPU-second on one
    thread, 1.08x on two; Gpufit's 5x5 Gaussian 1.07x: in-process A/B)."""
    residual_fn, cost_fn, robust, held, box = prob
    solver = options.solver

    def c(v):
        return tf.constant(v, tf.int64)

    def body(x, it, code, damping, nu, scale, largest, test, attempt, first_norm,
             *carried):
        # One attempt per problem per pass: a problem whose step was refused
        # tries again in the next pass from the same point (the same
        # linearisation) with its new damping, up to `max_attempts`; its
        # iteration ends with an accepted step or its last attempt. So each
        # problem takes the steps of `least_squares`'s nested loop, and a
        # chunk loops max over problems of (attempts), not the sum over
        # iterations of the slowest problem's attempts.
        active = (code == 0) & (it < options.max_iterations)
        fresh = attempt == 0
        here = (parts.BatchedLinearization(*carried) if carried else
                robust.linearize(residual_fn, x, solver.needs_jacobian))
        lin = held(here, x)
        new_largest = tf.maximum(largest, parts.column_norms(lin))
        grad_small = tf.reduce_max(tf.abs(lin.jtr), axis=-1) <= options.gtol * (
            tf.maximum(lin.cost, 1.0))
        stepping = active & ~grad_small
        jtj_diag = tf.linalg.diag_part(lin.jtj)
        scale = tf.where((stepping & fresh)[:, None], scaling.update(scale, jtj_diag),
                         scale)
        good, dstate, trial_x, info = _attempt(
            lin, x, damping_lib.DampingState(damping, nu),
            scaling.diagonal(scale, jtj_diag), stepping,
            lambda at: (robust.linearize(residual_fn, at, solver.needs_jacobian)
                        if carried else parts.BatchedLinearization(cost_fn(at), None, None)),
            box, controller, options)
        first_norm = tf.where(stepping & fresh, info["norm"], first_norm)
        stalled = ~good
        flat = stalled & (info["predicted"] <= options.ftol * lin.cost)
        # A refused step that promised at most ftol of the cost (and was
        # solved: a zero step promises 0) ends the iteration
        # (`step.levenberg_marquardt_step`'s ``give_up_below``).
        given_up = flat & (info["predicted"] > 0)
        ended = stepping & (good | given_up | (attempt + 1 >= options.max_attempts))
        new_x = tf.where(good[:, None], trial_x, x)
        x_norm = parts.norm(new_x)
        small_step = good & (info["norm"] <= options.xtol * (options.xtol + x_norm))
        small_drop = good & (lin.cost - info["new_cost"] <= options.ftol * lin.cost)
        resolution = sqrt_eps * (1e-8 + x_norm)
        tiny = stalled & (first_norm <= resolution)
        exhausted = stalled & (info["norm"] <= resolution)
        step_code = tf.where(flat, c(3), tf.where(tiny, c(2), tf.where(
            exhausted, c(5), tf.where(small_step, c(2), tf.where(small_drop, c(3),
                                                                 c(0))))))
        new_code = tf.where(grad_small, c(1), step_code)
        # Which test stopped it (`whole_solve.step_code`'s, for the text).
        new_test = tf.where(tiny & ~flat & ~grad_small, c(ROUND_OFF_STEP), new_code)
        done = active & (grad_small | ended)   # this problem's iteration ended
        moved = (stepping & good)[:, None]
        return (tf.where(moved, new_x, x),
                tf.where(done, it + 1, it),
                tf.where(done, new_code, code),
                tf.where(stepping, dstate.damping, damping),
                tf.where(stepping, dstate.nu, nu),
                scale,
                tf.where(active[:, None], new_largest, largest),
                tf.where(done, new_test, test),
                tf.where(stepping & ~ended, attempt + 1, tf.zeros_like(attempt)),
                first_norm) + (_carried(_pick(stepping & good, info["lin"], here))
                               if carried else ())

    return body


def _off_bounds(run, box, x0, out, phase):
    """`whole_solve.off_bounds` per problem: where a problem stalled on
    bounds its residuals ignore, one more run of ``phase`` from its point
    with those parameters moved halfway back to ``x0``; the lower cost is
    kept, iterations added."""
    inside = box.inside(out.x, x0, out.blind)
    again = (out.status == 6) & tf.reduce_any(
        out.blind & tf.not_equal(inside, out.x), axis=-1)

    def rerun():
        second = run(*phase, tf.where(again, tf.constant(0, tf.int64), out.status),
                     tf.where(again[:, None], inside, out.x))
        better = again & (second.cost < out.cost)
        kept = _pick(better, second, out)
        return kept._replace(iterations=tf.where(
            again, out.iterations + second.iterations, out.iterations))

    return _if_any(again, rerun, out)


def _if_any(flags, rerun, out):
    """``rerun()`` (a `_Run` built from ``out``) where some problem of
    ``flags`` [B] runs again, else ``out`` as it is, by a ``tf.cond``: a chunk
    none of whose problems restarts skips the second run's loop and its
    linearisations, at every problem's width (the same results to the
    bit: a problem not in ``flags`` keeps ``out``'s values either way). On
    the bounded decay (benchmarks/bounded_decay.py), where no chunk needs
    the off-bounds run, 1.08-1.09x as many fits per CPU-second (in-process
    A/B, one thread)."""
    flat = tf.nest.flatten(out)
    present = [t for t in flat if t is not None]

    def again():
        got = [t for t in tf.nest.flatten(rerun()) if t is not None]
        for g, t in zip(got, present):
            g.set_shape(t.shape)
        return got

    chosen = iter(tf.cond(tf.reduce_any(flags), again, lambda: present))
    return tf.nest.pack_sequence_as(out, [None if t is None else next(chosen)
                                          for t in flat])


def _attempt(lin, x, state, d2, live, linearize_at, box, controller, options):
    """One attempt of `step.levenberg_marquardt_step` for the problems in
    ``live``: ``(accepted [B], DampingState after it, trial x [B, P], info)``
    with ``info``'s ``new_cost`` (the trial's cost where accepted, else the
    current one), ``norm`` (the step's), ``predicted`` (the model's
    decrease) and ``lin`` (``linearize_at(trial x)``, whose ``cost`` is the
    trial's)."""
    dtype = x.dtype
    root_d2 = tf.sqrt(d2)
    inf = tf.constant(float("inf"), dtype)
    step, ok, dstate = parts.propose(controller, options.solver, lin, state, d2, x, live)
    step = tf.where(ok[:, None], step, tf.zeros_like(step))
    if box is not None:
        step = box.project(x, step)
    trial_x = x + step
    trial_lin = linearize_at(trial_x)
    trial = trial_lin.cost
    slope = parts.dot(step, lin.jtr)
    pred = -slope - 0.5 * parts.dot(step, parts.gauss_newton_matvec(lin, step))
    gain = (lin.cost - trial) / tf.where(pred > 0, pred, tf.ones_like(pred))
    good = live & ok & tf.math.is_finite(trial) & (pred > 0) & (gain > 0)
    measured = damping_lib.Trial(
        rho=tf.where(good, gain, tf.zeros_like(gain)),
        scaled_norm=tf.where(ok, parts.norm(root_d2 * step), inf),
        actual=tf.where(ok, lin.cost - trial, -inf),
        slope=slope, cost=lin.cost, new_cost=tf.where(ok, trial, inf))
    taken = controller.accept(dstate, gain, measured)
    refused = controller.reject(dstate, measured)
    dstate = tf.nest.map_structure(lambda a, b: tf.where(good, a, b), taken, refused)
    info = dict(new_cost=tf.where(good, trial, lin.cost), norm=parts.norm(step),
                predicted=pred, lin=trial_lin)
    return good, dstate, trial_x, info
