"""A whole Levenberg-Marquardt solve, in parts: `least_squares`'s loop.

`solve` runs the phases a scaling asks for (one, or a restart policy's
several, `restart`); each phase (`run_phase`) is a ``tf.while_loop`` of
iterations (`iteration`: linearise, test the gradient, take one
`step.levenberg_marquardt_step`, read its stop code with `step_code`) and
ends with `final_code`, which turns a tolerance stop far from a minimum into
`StopReason.STALLED`. Everything here is graph code over a `Problem` fixed at
trace time and `Tolerances` that may be tensors (inputs of a cached solve).
"""

import enum
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_gradkit.core import spd
from tf_gradkit.core.lm import bounds as bounds_lib
from tf_gradkit.core.lm import fit_report
from tf_gradkit.core.lm import geodesic as geodesic_lib
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib
from tf_gradkit.core.lm import step as step_lib
from tf_gradkit.core.lm.robust import RobustLoss


class StopReason(enum.IntEnum):
    """Why a solve stopped: `LeastSquaresResult.reason_code`.

    The values are the codes `least_squares` has always returned, unchanged.
    1-3 are scipy's ``gtol``/``xtol``/``ftol`` conditions, but the numbers
    are not scipy's ``status`` (there: 1 gtol, 2 ftol, 3 xtol, 4 both, 0 the
    evaluation limit). 1-3 count as converged (`converged`).
    """

    RUNNING = 0
    GRADIENT_TOLERANCE = 1
    STEP_TOLERANCE = 2
    COST_TOLERANCE = 3
    ITERATION_LIMIT = 4
    NO_ACCEPTABLE_STEP = 5
    STALLED = 6
    NON_FINITE_START = 7

    @property
    def description(self):
        """The reason as text (`LeastSquaresResult.reason`)."""
        return DESCRIPTIONS[self]

    @property
    def converged(self):
        return StopReason.GRADIENT_TOLERANCE <= self <= StopReason.COST_TOLERANCE


DESCRIPTIONS = {
    StopReason.RUNNING: "running",
    StopReason.GRADIENT_TOLERANCE: "gradient tolerance",
    StopReason.STEP_TOLERANCE: "step tolerance",
    StopReason.COST_TOLERANCE: "cost tolerance",
    StopReason.ITERATION_LIMIT: "iteration limit",
    StopReason.NO_ACCEPTABLE_STEP: "no acceptable step (damping exhausted)",
    StopReason.STALLED: None,  # set below: `stalled_text`
    StopReason.NON_FINITE_START: (
        "non-finite start (the parameters or the residuals at the start are "
        "inf or NaN)"),
}


def stalled_text(tolerance, tighten):
    """`StopReason.STALLED`'s text naming the ``tolerance`` whose test
    stopped the fit (a user reads which option to ``tighten``; None where no
    option's value would have let it go on)."""
    advice = f"tighten {tighten} to go on; if the cost stays high, " if tighten else ""
    return (f"stalled: {tolerance} stopped the fit at a point not shown to be "
            "a minimum (the gradient is not small next to the residuals, or a "
            f"parameter sits on a bound where the residuals ignore it): {advice}"
            "try another start or rescale the parameters")


# `STALLED`'s text when which test stopped the fit is not given (`REASONS[6]`).
DESCRIPTIONS[StopReason.STALLED] = stalled_text("xtol or ftol", "ftol/xtol")

# A stalled fit's text by ``stopped_by``, the test that stopped it before
# `final_code` found the point not a minimum: 1 gtol (only on a bound the
# residuals ignore), 2 xtol, 3 ftol (a small decrease, or every attempt
# rejected with the model promising at most ftol), 4 `ROUND_OFF_STEP` (every
# attempt rejected, the least damped step below round-off: reason_code 2, but
# no xtol would have gone on); 0 not stalled: the generic text. The single
# and the batched results both read it (`reason_text`).
ROUND_OFF_STEP = 4
STALLED_TEXTS = (DESCRIPTIONS[StopReason.STALLED],
                 stalled_text("gtol", "gtol"),
                 stalled_text("xtol", "xtol"),
                 stalled_text("ftol", "ftol"),
                 stalled_text("a step below round-off (every attempt rejected)",
                              None))


def reason_text(table, status, stopped_by):
    """The stop texts: ``table[status]``, or for a stall (status 6) the
    `STALLED_TEXTS` entry of ``stopped_by``. Eager values give a str or a
    numpy array of str (as ``status``); graph tensors a string tensor."""
    if isinstance(status, tf.Tensor) and not tf.executing_eagerly():
        status = tf.cast(status, tf.int64)
        stopped_by = tf.cast(stopped_by, tf.int64)
        return tf.where(tf.equal(status, int(StopReason.STALLED)),
                        tf.gather(tf.constant(STALLED_TEXTS), stopped_by),
                        tf.gather(tf.constant(table), status))
    status = np.asarray(status).astype(np.int64)
    stopped_by = np.broadcast_to(np.asarray(
        0 if stopped_by is None else stopped_by).astype(np.int64), status.shape)
    texts = np.where(status == int(StopReason.STALLED),
                     np.asarray(STALLED_TEXTS, dtype=object)[stopped_by],
                     np.asarray(table, dtype=object)[status])
    return texts if texts.ndim else str(texts[()])


# A tolerance stop counts as converged only where r is round-off (see
# `final_code`) or the gradient is small: the cosine between r and the
# Jacobian's columns, max_j |J_j.r| / (|J_j| |r|) (MINPACK's gtol measure), at
# most this; or, where that cosine misreads a minimum at which a column
# vanishes while r does not (r = (x - a)^2 + 5 at x = a: cosine 1), the same
# cosine with each column at its largest norm over the run (`stationarity`:
# scipy's gradient scaled by x_scale='jac', over |r|) at most this and
# Dennis-Schnabel's relative gradient max_j |g_j| max(|x_j|, 1) / cost at
# most eps^(1/3) (the largest norms alone passed Jennrich-Sampson from 10x0,
# stopped at f = 5e28 with a relative gradient of 66). The nonzero-residual
# NIST runs end below 2e-8; tolerance stops far from any minimum of the MGH
# problems end above 1e-2 (docs/levenberg_marquardt.md).
STATIONARY_COSINE = 1e-3


def within_ftol(code, predicted, ok, cost, ftol):
    """A cost-tolerance stop (code 3) verified by the user's own ``ftol``:
    the Gauss-Newton step from the final point (the linear model's best
    step, ``predicted`` its decrease, ``ok`` where it was solved) would
    lower the cost by at most ``ftol`` of it: scipy's ftol test holds for
    the best step there is, so the stop is what was asked for, not
    "stalled far from a minimum". With a loose ``ftol`` (Cpufit's 1e-4)
    the column cosines of such a point can exceed `STATIONARY_COSINE`
    (142 of 10^5 of Gpufit's 5x5 Gaussians: 1.0e-3 to 1.6e-3); scipy's
    bvp test at ftol=1e-2 stops where this step would take most of the
    cost away, and stays stalled."""
    return ((code == int(StopReason.COST_TOLERANCE)) & ok
            & (predicted <= ftol * cost))


def gauss_newton_decrease(lin, solve):
    """``(predicted, ok)``: the decrease ``-g.d - d.(J^T J) d / 2`` of the
    Gauss-Newton step ``d`` that ``solve(jtj, jtr) -> (d, ok)`` gives."""
    step, ok = solve(lin.jtj, lin.jtr)
    jtj_step = tf.reduce_sum(lin.jtj * step[..., None, :], axis=-1)
    predicted = -tf.reduce_sum(step * lin.jtr, axis=-1) - 0.5 * tf.reduce_sum(
        step * jtj_step, axis=-1)
    return predicted, ok & tf.math.is_finite(predicted)


def _code(reason):
    return int(reason)


class Problem(NamedTuple):
    """What a solve minimises, fixed at trace time.

    Attributes:
      residual_fn: zero-argument residual function (as the trace calls it).
      variables: the ``tf.Variable``s fitted in place.
      dtype: the solve's dtype.
      robust: the `RobustLoss`.
      solver: the linear solver part.
      max_iterations, max_attempts: Python ints.
      geodesic: a `geodesic.GeodesicAcceleration` or None.
      history: keep each iteration's (cost, step norm, damping, accepted)
        in the loop (``least_squares(verbose=2)``); False leaves the loop's
        carry as it is.
    """

    residual_fn: Callable
    variables: list
    dtype: tf.DType
    robust: RobustLoss
    solver: Any
    max_iterations: int
    max_attempts: int
    geodesic: Optional[geodesic_lib.GeodesicAcceleration] = None
    history: bool = False

    @property
    def num_params(self):
        return sum(v.shape.num_elements() for v in self.variables)

    @property
    def eps(self):
        return float(np.finfo(self.dtype.as_numpy_dtype).eps)

    @property
    def matrix_free(self):
        return self.solver.consumes == solvers_lib.MATRIX_FREE


def make_problem(residual_fn, variables, dtype, robust, solver, max_iterations,
                 max_attempts, geodesic_acceleration=False, history=False):
    """A `Problem`; ``geodesic_acceleration`` as `least_squares` takes it."""
    geodesic = None
    if geodesic_acceleration:
        alpha = 0.75 if geodesic_acceleration is True else float(geodesic_acceleration)
        geodesic = geodesic_lib.GeodesicAcceleration(residual_fn, alpha=alpha)
    return Problem(residual_fn, list(variables), dtype, robust, solver,
                   max_iterations, max_attempts, geodesic, history)


class Tolerances(NamedTuple):
    """``gtol``, ``xtol``, ``ftol`` as scalars of the solve's dtype."""

    gtol: Any
    xtol: Any
    ftol: Any


class PhaseResult(NamedTuple):
    """One phase's end: iterations, stop code, damping, cost, stationarity,
    and ``blind`` [P]: the parameters held on a bound the residuals ignore
    where that made a tolerance stop `StopReason.STALLED` (`off_bounds`)."""

    iterations: tf.Tensor
    code: tf.Tensor
    damping: tf.Tensor
    cost: tf.Tensor
    stationarity: tf.Tensor
    blind: tf.Tensor
    stopped_by: tf.Tensor  # int64: the code a stall's tolerance test gave, else 0


def cost(problem):
    """The cost at the variables' values: ``0.5 sum r^2``, or the robust
    loss's."""
    r = tf.cast(tf.reshape(problem.residual_fn(), [-1]), problem.dtype)
    if r.shape.num_elements() == 0:  # known at trace time
        raise ValueError(
            "least_squares: `residual_fn` returned no residuals (shape "
            f"{r.shape.as_list()}): there is nothing to fit (scipy refuses this "
            "too). Return at least one residual.")
    if problem.robust.is_linear:
        return 0.5 * tf.reduce_sum(tf.square(r))
    return problem.robust.cost(r)


class Linearizer:
    """Linearises a `Problem` at the variables' values, in a solver's form.

    Each form is traced once, as a function the loop and the final point
    both call (the vectorised Jacobian is the largest part of the trace); a
    matrix-free linearisation holds a closure and is traced where it is used.
    """

    def __init__(self, problem):
        self.problem = problem
        robust = problem.robust
        self.step_fn = (problem.residual_fn if robust.is_linear
                        else robust.scaled(problem.residual_fn, problem.dtype))
        self._traced = {}
        self.history = None   # the last run_phase's verbose=2 record, when kept

    def here(self, form):
        p = self.problem
        lin = lin_lib.linearize_as(form, self.step_fn, p.variables, p.dtype)
        return lin if p.robust.is_linear else lin._replace(cost=cost(p))

    def __call__(self, form=None):
        form = self.problem.solver.consumes if form is None else form
        if form == solvers_lib.MATRIX_FREE:
            return self.here(form)
        if form not in self._traced:
            self._traced[form] = tf.function(lambda: self.here(form), autograph=False)
        return self._traced[form]()

    def final(self):
        """The linearisation at the solution: with the Jacobian, unless the
        solver is matrix-free."""
        return self(self.problem.solver.consumes if self.problem.matrix_free
                    else solvers_lib.JACOBIAN)


def held(problem, box, lin):
    """``lin`` with the parameters held on a bound frozen."""
    if box is None:
        return lin
    x = lin_lib.flatten(problem.variables, problem.dtype)
    return bounds_lib.freeze(lin, box.frozen(x, lin.jtr))


def column_norms(lin):
    """The Jacobian's column norms (zeros for a matrix-free linearisation)."""
    if lin.jtj is None:
        return tf.zeros_like(lin.jtr)
    return tf.sqrt(tf.maximum(tf.linalg.diag_part(lin.jtj), 0.0))


def step_code(problem, tolerances, info):
    """``(code, test)`` after one step (`step.StepInfo`): the stop code, 0 to
    go on, and the test that gave it (int64: the code, or `ROUND_OFF_STEP`
    where a step below round-off gave code 2; `STALLED_TEXTS`).

    An accepted step stops on ``xtol`` (a small step) or ``ftol`` (a small
    decrease). Every attempt rejected: converged at round-off if the model
    promises no real decrease, or if even the least damped step moves x by
    less than sqrt(eps) (the cost cannot resolve it); given up if the most
    damped step is that small too. Otherwise go on: the next iteration
    starts from the damping (or trust radius) the rejections left.
    """
    dtype, eps = problem.dtype, problem.eps
    xtol, ftol = tolerances.xtol, tolerances.ftol
    x_norm = tf.norm(lin_lib.flatten(problem.variables, dtype))
    small_step = info.accepted & (info.step_norm <= xtol * (xtol + x_norm))
    small_drop = info.accepted & (info.cost - info.new_cost <= ftol * info.cost)
    stalled = ~info.accepted
    resolution = tf.sqrt(tf.constant(eps, dtype)) * (1e-8 + x_norm)
    flat = stalled & (info.predicted <= ftol * info.cost)
    tiny = stalled & (info.first_step_norm <= resolution)
    exhausted = stalled & (info.last_step_norm <= resolution)
    code = tf.where(
        flat, _code(StopReason.COST_TOLERANCE), tf.where(
            tiny, _code(StopReason.STEP_TOLERANCE), tf.where(
                exhausted, _code(StopReason.NO_ACCEPTABLE_STEP), tf.where(
                    small_step, _code(StopReason.STEP_TOLERANCE), tf.where(
                        small_drop, _code(StopReason.COST_TOLERANCE),
                        _code(StopReason.RUNNING))))))
    test = tf.where(tiny & ~flat, tf.constant(ROUND_OFF_STEP, tf.int64),
                    tf.cast(code, tf.int64))
    return code, test


def iteration(problem, linearize, box, tolerances, scaling, controller,
              it, reason, state, last_cost, largest, test, *history):
    """One iteration of a phase's loop: linearise, stop on a small gradient
    or take a step. The loop's carry: ``(it, reason, state, cost, largest
    column norms, test)`` (``test``: int64, `step_code`'s), and with
    ``problem.history`` a ``[max_iterations, 4]`` record of each iteration's
    cost, step norm, damping and acceptance (a dense tensor written at row
    ``it``: no host op in the loop)."""
    del reason, last_cost, test
    lin = held(problem, box, linearize())
    largest = tf.maximum(largest, column_norms(lin))
    grad_small = tf.reduce_max(tf.abs(lin.jtr)) <= tolerances.gtol * tf.maximum(
        lin.cost, 1.0)

    def take_step():
        new_state, info = step_lib.levenberg_marquardt_step(
            lin, lambda: cost(problem), problem.variables, state,
            controller=controller, scaling=scaling, solver=problem.solver,
            max_attempts=problem.max_attempts, geodesic=problem.geodesic,
            bounds=box, give_up_below=tolerances.ftol * lin.cost)
        return ((new_state, info.new_cost) + step_code(problem, tolerances, info)
                + (info.step_norm, tf.cast(info.accepted, problem.dtype)))

    zero = tf.zeros([], problem.dtype)
    gtol_code = _code(StopReason.GRADIENT_TOLERANCE)
    new_state, new_cost, code, test, step_norm, accepted = tf.cond(
        grad_small,
        lambda: (state, lin.cost, tf.constant(gtol_code),
                 tf.constant(gtol_code, tf.int64), zero, zero),
        take_step)
    if not history:
        return it + 1, code, new_state, new_cost, largest, test
    row = tf.stack([lin.cost, tf.cast(step_norm, problem.dtype),
                    tf.cast(new_state.damping, problem.dtype), accepted])
    record = tf.tensor_scatter_nd_update(history[0], [[it]], row[None])
    return it + 1, code, new_state, new_cost, largest, test, record


def _history_rows(problem):
    """Rows of a run's verbose=2 record: one per iteration, at least one
    (the loop's body is traced, scatter included, even at
    ``max_iterations=0``)."""
    return max(problem.max_iterations, 1)


def run_phase(problem, linearize, box, tolerances, scaling, controller, start_cost):
    """One whole run from the variables' values: ``(PhaseResult, final
    linearisation)``; the variables end at its solution."""
    dtype, num_params = problem.dtype, problem.num_params
    state = step_lib.init_state(controller, scaling, num_params, dtype)
    # A start with a non-finite parameter or cost is refused eagerly
    # (`least_squares`); in a graph the solve stops before its first step.
    x_start = lin_lib.flatten(problem.variables, dtype)
    finite = (tf.reduce_all(tf.math.is_finite(x_start))
              & tf.math.is_finite(start_cost))

    def body(*carry):
        return iteration(problem, linearize, box, tolerances, scaling, controller,
                         *carry)

    carry = (tf.constant(0), tf.where(finite, 0, _code(StopReason.NON_FINITE_START)),
             state, tf.constant(0.0, dtype), tf.zeros([num_params], dtype),
             tf.constant(0, tf.int64))
    if problem.history:
        carry += (tf.zeros([_history_rows(problem), 4], dtype),)
    it, code, state, _, largest, test, *record = tf.while_loop(
        lambda it, reason, *_: (reason == 0) & (it < problem.max_iterations), body,
        carry, maximum_iterations=problem.max_iterations)
    code = tf.where(code == 0, _code(StopReason.ITERATION_LIMIT), code)
    final = linearize.final()
    stalled, cosine, blind = final_code(problem, box, code, final, largest,
                                        start_cost, tolerances.ftol)
    stopped_by = tf.where(stalled == code, tf.constant(0, tf.int64), test)
    if record:  # read by `solve`, `restart` and `off_bounds` after each run
        linearize.history = (record[0], it, final.cost, stalled, stopped_by)
    return PhaseResult(it, stalled, state.damping, final.cost, cosine, blind,
                       stopped_by), final


def final_code(problem, box, code, final, largest, start_cost, ftol=0.0):
    """``(code, stationarity, blind)``: a tolerance stop (2, 3) that is
    neither stationary nor at round-off becomes `StopReason.STALLED`; so does
    one (1-3) with a parameter on a bound the residuals ignore there
    (`bounds.Bounds.blind`; ``blind`` [P] marks them).

    Stationary: the cosine small with the columns' current norms, or, where
    a column has shrunk (a minimum where it vanishes while r does not),
    small with their largest norms and the gradient small relative to the
    cost (Dennis-Schnabel's relative gradient max_j |g_j| max(|x_j|, 1) /
    cost <= eps^(1/3)); for an ``ftol`` stop, also `within_ftol`. At
    round-off: the residuals' largest component along
    a column of J, cosine * |r|, at most sqrt(eps) (a zero-residual
    solution has |r| at round-off, where its direction means nothing), or
    the cost down to eps times its start.
    """
    dtype, eps = problem.dtype, problem.eps
    kept = held(problem, box, final)
    now = column_norms(kept)
    cosine_now, r_norm = stationarity(kept, now)
    cosine, _ = stationarity(kept, tf.maximum(largest, now))
    x_abs = tf.abs(lin_lib.flatten(problem.variables, dtype))
    tiny = tf.constant(np.finfo(dtype.as_numpy_dtype).tiny, dtype)
    relative = tf.reduce_max(tf.abs(kept.jtr) * tf.maximum(x_abs, 1.0)) / (
        tf.maximum(final.cost, tiny))
    stationary = ((cosine_now <= STATIONARY_COSINE)
                  | ((cosine <= STATIONARY_COSINE)
                     & (relative <= eps ** (1.0 / 3.0)))
                  | _within_ftol(problem, code, kept, final.cost, ftol))
    along = cosine_now * r_norm
    far = ((code >= _code(StopReason.STEP_TOLERANCE))
           & (code <= _code(StopReason.COST_TOLERANCE)) & ~stationary
           & (along > tf.sqrt(tf.constant(eps, dtype)))
           & (final.cost > eps * start_cost))
    blind = tf.zeros_like(now, tf.bool)
    if box is not None:  # on a bound the model is blind to: not verified
        x = lin_lib.flatten(problem.variables, dtype)
        blind = box.blind(x, column_norms(final), tf.maximum(largest, now), eps) & (
            (code >= _code(StopReason.GRADIENT_TOLERANCE))
            & (code <= _code(StopReason.COST_TOLERANCE))
            & (final.cost > eps * start_cost))
        far = far | tf.reduce_any(blind)
    return tf.where(far, _code(StopReason.STALLED), code), cosine, blind


def _within_ftol(problem, code, kept, cost, ftol):
    """`within_ftol` for one problem (not for a matrix-free solver: its
    inexact step could understate the decrease). The P x P solve runs only
    for a cost-tolerance stop."""
    if problem.matrix_free or kept.jtj is None:
        return tf.constant(False)

    def solve(jtj, jtr):
        step, ok = spd.solve(jtj, -jtr[:, None])
        return step[:, 0], ok

    def check():
        predicted, ok = gauss_newton_decrease(kept, solve)
        return within_ftol(code, predicted, ok, cost, ftol)

    return tf.cond(code == _code(StopReason.COST_TOLERANCE), check,
                   lambda: tf.constant(False))


def off_bounds(problem, linearize, box, tolerances, phase, first, x0, start_cost):
    """Where ``first`` stalled on bounds the residuals ignore (``first.blind``),
    one more run of ``phase`` from its point with those parameters moved
    halfway back to ``x0`` (`bounds.Bounds.inside`); the lower cost of the
    two is kept, iterations added. scipy's ``trf`` never lands on a bound
    (its iterates stay strictly inside), so it does not meet this stop.
    Returns ``(kept PhaseResult, run)``, ``run`` as `_maybe_run`'s."""
    variables, dtype = problem.variables, problem.dtype

    def another():
        x_first = lin_lib.flatten(variables, dtype)
        assign(variables, box.inside(x_first, x0, first.blind))
        second, _ = run_phase(problem, linearize, box, tolerances, *phase, start_cost)
        better = second.cost < first.cost
        assign(variables, tf.where(better, lin_lib.flatten(variables, dtype), x_first))
        kept = tf.nest.map_structure(lambda a, b: tf.where(better, a, b),
                                     second, first)
        return kept._replace(iterations=first.iterations + second.iterations), better

    x = lin_lib.flatten(variables, dtype)
    movable = tf.reduce_any(first.blind & tf.not_equal(box.inside(x, x0, first.blind), x))
    return _maybe_run(problem, linearize,
                      (first.code == _code(StopReason.STALLED)) & movable, another, first)


def restart(problem, linearize, box, tolerances, phase, first, x0, start_cost):
    """The next phase of a restart policy, only where ``first`` ended
    unconverged (iteration limit, no acceptable step, stalled far from a
    minimum): it starts from ``x0`` again and the lower cost of the two is
    kept (the variables end at its point). Returns ``(kept PhaseResult,
    run)`` (iterations of both added; ``run`` as `_maybe_run`'s)."""
    variables, dtype = problem.variables, problem.dtype

    def another():
        x_first = lin_lib.flatten(variables, dtype)
        assign(variables, x0)
        second, _ = run_phase(problem, linearize, box, tolerances, *phase, start_cost)
        better = (second.cost < first.cost) | ~tf.math.is_finite(first.cost)
        assign(variables, tf.where(better, lin_lib.flatten(variables, dtype), x_first))
        kept = tf.nest.map_structure(lambda a, b: tf.where(better, a, b),
                                     second, first)
        return kept._replace(iterations=first.iterations + second.iterations), better

    unconverged = ((first.code >= _code(StopReason.ITERATION_LIMIT))
                   & (first.code != _code(StopReason.NON_FINITE_START)))
    return _maybe_run(problem, linearize, unconverged, another, first)


def _maybe_run(problem, linearize, condition, another, first):
    """``(kept, run)``: ``another()`` (``-> (kept PhaseResult, better)``, one
    more run) where ``condition``, else ``first``. With ``problem.history``,
    ``run`` is that run's verbose=2 record ``(rows [max_iterations, 4],
    iterations, final cost, code, stopped_by, kept)`` (`run_phase`'s; no
    rows and not kept where it did not run), else None."""
    if not problem.history:
        return tf.cond(condition, lambda: another()[0], lambda: first), None

    def ran():
        kept, better = another()
        return kept, linearize.history + (better,)   # this branch's run

    def skipped():
        return first, (tf.zeros([_history_rows(problem), 4], problem.dtype),
                       tf.constant(0), tf.zeros([], problem.dtype), first.code,
                       tf.constant(0, tf.int64), tf.constant(False))

    return tf.cond(condition, ran, skipped)


def assign(variables, flat):
    """Writes a flat vector into the variables."""
    for v, value in zip(variables, lin_lib.unflatten(flat, variables)):
        v.assign(value)


def solve(problem, tolerances, box, phases, with_covariance):
    """The whole solve: ``(iterations, code, damping, cost, optimality,
    stationarity, x, fun, jac, grad, active_mask, covariance, stopped_by)``
    (``stopped_by``: `PhaseResult.stopped_by`, for `reason_text`), and with
    ``problem.history`` the verbose=2 record after them: each run's rows,
    iterations, final cost, code, stopped_by and whether it was kept (run 0
    from the start, then each restart's and the off-bounds run's, where they
    may run; `least_squares` labels them in this order).

    Args:
      problem: the `Problem`.
      tolerances: `Tolerances`.
      box: a `bounds.Bounds` or None.
      phases: ``[(scaling, controller), ...]``: one, or a restart policy's.
      with_covariance: compute the covariance here (else None: under XLA it
        is computed outside, see `least_squares`).
    """
    variables, dtype = problem.variables, problem.dtype
    linearize = Linearizer(problem)
    if box is not None and not tf.executing_eagerly():
        assign(variables, box.clip(lin_lib.flatten(variables, dtype)))
    start_cost = cost(problem)
    x0 = lin_lib.flatten(variables, dtype)
    out, final = run_phase(problem, linearize, box, tolerances, *phases[0], start_cost)
    runs = [linearize.history + (tf.constant(True),)] if problem.history else []
    for phase in phases[1:]:
        out, run = restart(problem, linearize, box, tolerances, phase, out, x0,
                           start_cost)
        runs += [run] if run is not None else []
    if box is not None:
        out, run = off_bounds(problem, linearize, box, tolerances, phases[0], out, x0,
                              start_cost)
        runs += [run] if run is not None else []
    if len(phases) > 1 or box is not None:  # the kept point: linearised again
        final = linearize.final()
    x = lin_lib.flatten(variables, dtype)
    fun = tf.cast(tf.reshape(problem.residual_fn(), [-1]), dtype)
    mask = (tf.zeros([problem.num_params], tf.int32) if box is None
            else box.active_mask(x))
    scaled = final.jtr if box is None else final.jtr * box.coleman_li(x, final.jtr)
    optimality = tf.reduce_max(tf.abs(scaled))
    pcov = (covariance(final.jacobian, final.cost)
            if with_covariance and final.jacobian is not None else None)
    result = (out.iterations, out.code, out.damping, final.cost, optimality,
              out.stationarity, x, fun, final.jacobian, final.jtr, mask, pcov,
              out.stopped_by)
    if not problem.history:
        return result
    # verbose=2: each run's rows [R, max_iterations, 4], iterations, final
    # cost, code and stopped_by [R], and whether its point replaced the one
    # kept before it [R] (run 0: True)
    return result + tuple(tf.stack(part) for part in zip(*runs))


def covariance(jac, cost_value):
    """``curve_fit``'s ``pcov`` from the Jacobian and the cost at the
    solution (one thin SVD of ``jac``, P x P); all ``inf`` when ``jac`` is
    rank-deficient or N <= P (`fit_report.covariance_from_svd`)."""
    s, _, v = tf.linalg.svd(jac, full_matrices=False)
    return fit_report.covariance_from_svd(
        s, v, tf.cast(tf.shape(jac)[0], jac.dtype), cost_value)


def stationarity(lin, largest):
    """``(max_j |J_j . r| / (largest_j |r|), |r|)``, ``r`` the step residuals
    (0 where a column or r is zero)."""
    if lin.jtj is None:
        zero = tf.zeros([], lin.jtr.dtype)
        return zero, zero
    r_norm = (tf.norm(lin.residuals) if lin.residuals is not None
              else tf.sqrt(2.0 * lin.cost))
    denominator = largest * r_norm
    return tf.reduce_max(tf.where(denominator > 0, tf.abs(lin.jtr) / tf.where(
        denominator > 0, denominator, tf.ones_like(denominator)),
        tf.zeros_like(denominator))), r_norm
