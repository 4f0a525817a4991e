"""``least_squares``: a whole Levenberg-Marquardt solve in one compiled loop.

Minimises ``0.5 * sum(residual_fn()**2)`` over ``var_list`` with the LM
iteration of `step.py` inside one ``tf.while_loop`` in one ``tf.function``
(compiled by XLA from `AUTO_XLA_PARAMS` parameters up): no host round-trip
per iteration. The traced solve is kept in `solve_cache.SOLVES`, so a
repeated call only runs; the loop's stages are in `whole_solve.py`.
"""

import types
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_gradkit.core.lm import bounds as bounds_lib
from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import fit_report
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib
from tf_gradkit.core.lm import small
from tf_gradkit.core.lm import solve_cache
from tf_gradkit.core.lm import whole_solve
from tf_gradkit.core.lm.parts import check_parts, resolve_part
from tf_gradkit.core.lm.robust import RobustLoss
from tf_gradkit.core.lm.whole_solve import STATIONARY_COSINE, StopReason, covariance

__all__ = ["AUTO_XLA_CALLS", "AUTO_XLA_PARAMS", "LeastSquaresResult", "REASONS",
           "STATIONARY_COSINE", "StopReason", "covariance", "least_squares"]

# The reasons' texts by code (`StopReason.description`).
REASONS = tuple(reason.description for reason in StopReason)
NON_FINITE_START = StopReason.NON_FINITE_START
# jit_compile="auto" compiles with XLA from this many parameters up: below it
# XLA's compile (seconds) dwarfs a small solve's run (milliseconds), see
# docs/levenberg_marquardt.md.
AUTO_XLA_PARAMS = 64
# Below it, "auto" runs a plain tf.function until the same cached solve (the
# same function and options, `solve_cache`) has been called this many times
# in the process, this call included, then XLA: by then the plain calls have
# cost about what XLA's compile of a small solve costs (about 2 s of CPU at
# 2.3 ms a call), and each later call takes about half as long (ski rental:
# at most twice the best choice made in hindsight). The engines round
# differently: ``jit_compile=False`` keeps the plain one.
AUTO_XLA_CALLS = 1024
_AUTO_CALLS = solve_cache.SolveCache(maxsize=solve_cache.SOLVES.maxsize)


class LeastSquaresResult(NamedTuple):
    """What `least_squares` returns.

    Attributes:
      cost: final ``0.5 * sum r^2``.
      iterations: LM iterations run.
      converged: True if a tolerance was met at a stationary point (not the
        iteration limit, not a stall with every attempt rejected, not a
        tolerance stop far from a minimum and not a non-finite start: see
        `reason`).
      reason_code: a `StopReason` value (int32; its text in `REASONS`).
      damping: final damping (lambda; 0 for a Gauss-Newton step).
      optimality: scipy's first-order optimality at the final point:
        ``max_i |g_i|`` with ``g`` the cost's gradient (`grad`); with
        ``bounds``, ``max_i |g_i v_i|`` with Coleman-Li's ``v_i``: the
        distance to the bound that ``-g_i`` points to, 1 where that side is
        unbounded (0 for a parameter on a bound it is pushed against). In
        the cost's units: compare it with ``gtol``-like absolute numbers.
      stationarity: ``max_j |J_j . r| / (max_k |J_j(x_k)| |r|)`` at the final
        point: the cosine between the (step) residuals and the Jacobian's
        columns, each column measured at its largest norm over the run
        (scipy's gradient with ``x_scale='jac'``, over ``|r|``), over the
        parameters not held on a bound; 0 at a minimum, 0 for matrix-free
        solvers. A tolerance stop with this above `STATIONARY_COSINE` is
        reported as stalled, not converged.
      x: the solution, flat (the variables' elements in order); the
        variables themselves hold it too.
      fun: the residuals at the solution, flat [N] (scipy's ``fun``).
      jac: the Jacobian at the solution [N, P], for a robust loss scaled as
        scipy's (``jac^T jac`` is the Gauss-Newton Hessian of the cost);
        None with a matrix-free solver.
      grad: the cost's gradient at the solution [P] (scipy's ``grad``).
      active_mask: per parameter, -1 on its lower bound, 1 on its upper
        bound, 0 inside (scipy's ``active_mask``; all 0 without bounds).
      covariance: the parameters' covariance estimate [P, P], as
        ``scipy.optimize.curve_fit``'s ``pcov`` with ``absolute_sigma=False``:
        the pseudo-inverse of ``jac^T jac`` (singular values below
        ``eps * max(N, P) * s_max`` dropped) times ``2 cost / (N - P)``
        (``inf`` when N <= P). Residuals weighted by ``1/sigma`` with
        absolute sigmas: ``covariance * (N - P) / (2 * cost)``. None with
        a matrix-free solver. All ``inf`` when ``jac`` is rank-deficient
        (a parameter the residuals ignore has no variance estimate; scipy's
        ``curve_fit`` convention, `fit_report`); NaN for a non-finite start.
      undetermined: True when ``covariance`` is ``inf`` (rank-deficient
        ``jac`` or N <= P); None with a matrix-free solver.
      stopped_by: int64, for a stall (``reason_code`` 6) the code of the
        test that stopped the fit (1 gtol, 2 xtol, 3 ftol), else 0: `reason`
        names it.
    """

    cost: tf.Tensor
    iterations: tf.Tensor
    converged: tf.Tensor
    reason_code: tf.Tensor
    damping: tf.Tensor
    optimality: tf.Tensor
    stationarity: tf.Tensor = None
    x: tf.Tensor = None
    fun: tf.Tensor = None
    jac: tf.Tensor = None
    grad: tf.Tensor = None
    active_mask: tf.Tensor = None
    covariance: tf.Tensor = None
    undetermined: tf.Tensor = None
    stopped_by: tf.Tensor = None

    @property
    def reason(self):
        """Why the solve stopped, as text (a string tensor inside graphs); a
        stall names the tolerance that stopped it (`stopped_by`)."""
        return whole_solve.reason_text(REASONS, self.reason_code,
                                       0 if self.stopped_by is None
                                       else self.stopped_by)


def least_squares(residual_fn, var_list, max_iterations=100, *,
                  controller="trust_region", scaling=None, solver="qr",
                  max_attempts=10, gtol=None, xtol=None, ftol=None,
                  bounds=None, loss="linear", f_scale=1.0, x_scale=None,
                  geodesic_acceleration=False, jit_compile="auto", cache=True,
                  verbose=0):
    """Solves a nonlinear least-squares problem by Levenberg-Marquardt.

    Args:
      residual_fn: zero-argument callable returning the residuals (any shape)
        computed from the variables in ``var_list``.
      var_list: ``tf.Variable``s to fit (updated in place); the solve runs in
        their dtype (use float64 for reference precision).
      max_iterations: iteration limit (0: no step, the result describes the
        start, as scipy's ``max_nfev=1``).
      controller: "trust_region" (default: Moré's trust radius on the scaled
        step, as MINPACK; lambda may reach 0), "nielsen" (gain-ratio damping,
        the Keras optimizer's default), "multiply_divide" or a controller
        object (`tf_gradkit.core.lm.damping`). On the Moré-Garbow-Hillstrom
        problems from x0, 10x0 and 100x0 the trust region solves 97 of 126
        (103 at a listed minimum) against Nielsen's 97 (101) and MINPACK's 95
        (103), and it solves Meyer's function from 10x0 and 100x0 where
        Nielsen crawls (docs/levenberg_marquardt.md).
      scaling: "marquardt" (the default with ``loss="linear"``,
        scale-invariant: ``D`` from the Jacobian's column norms, running max
        as MINPACK; with a robust loss the default is "hybrid", see below),
        "levenberg"
        (``D = I``) or "hybrid" (a Levenberg run with scipy ``trf``'s first
        radius, then, only if it ends unconverged, a Marquardt run from the
        same start; the lower cost wins: `damping.LevenbergThenMarquardt`). On the
        Moré-Garbow-Hillstrom runs the hybrid solves 108 of 126 against the
        default's 97 and scipy ``trf``'s 105; or use ``x_scale``. A robust
        loss defaults to "hybrid": its Jacobian's rows are scaled by
        ``sqrt(eps)`` where the loss is concave (scipy's rescaling), so
        Marquardt's ``D`` from a start where every residual is an outlier is
        ~1e-8 of the residuals' real sensitivity and a first trust radius in
        those units is a step of ~1e9 in ``x`` (scipy's ``trf`` test with
        ``loss="arctan"``, ``f_scale=0.1`` from 0 then ends in a worse local
        minimum, cost 0.0653 against 0.0317).
      solver: "qr" (default: precision on ill-conditioned problems),
        "cholesky" (fast normal equations), "auto" (`curve_fit`'s default:
        "cholesky" up to `small.AUTO_CHOLESKY_MAX_PARAMS` = 10 parameters,
        else "qr"), "dual" (J J^T form, for fewer
        residuals than parameters), "cg" (matrix-free conjugate gradients,
        memory O(N + P); needs scaling="levenberg"), or a solver object.
      max_attempts: damped solves per iteration before giving up.
      gtol: stop when ``max |J^T r| <= gtol * max(1, cost)``; default: the
        dtype's machine epsilon. ``gtol``, ``xtol`` and ``ftol`` must be
        numbers >= 0 (or None for the default), not all three below the
        dtype's epsilon (as scipy: the solve could never stop on them).
      xtol: stop when an accepted step ``|d| <= xtol * (xtol + |x|)``;
        default ``eps**0.75`` (1.8e-12 in float64, 6.4e-6 in float32).
      ftol: stop when an accepted step lowers the cost by ``<= ftol * cost``,
        or when every attempt is rejected while the model predicts a decrease
        that small (the cost no longer changes at this precision); default
        ``4 * eps``. Large-residual problems converge linearly, so a looser
        ``ftol`` stops them early (NIST ENSO: LRE 6.0 at 1e-14, 7.1 here).
      bounds: ``(lower, upper)`` as scipy's: each a scalar, an array over
        all parameters (the variables' elements in order) or a list with one
        entry per variable; ``-inf``/``inf`` for none. The iterates never
        leave the box (a projected step with an active set, `bounds.py`);
        the start must lie inside it. A `scipy.optimize.Bounds` works too.
      loss: "linear" (default), "soft_l1", "huber", "cauchy" or "arctan":
        scipy's robust losses, or "absolute" (``f_scale * sum |r|``, by
        reweighted least squares); the cost is ``0.5 * f_scale^2 *
        sum(rho((r / f_scale)^2))`` (`robust.py`).
      f_scale: the residual size where a robust loss stops being quadratic.
      x_scale: scipy's ``x_scale``: "jac" (the Jacobian's column norms,
        which is ``scaling="marquardt"``) or positive characteristic scales,
        one per parameter or one for all (the trust region is a sphere in
        ``x / x_scale``). Replaces ``scaling``.
      geodesic_acceleration: add Transtrum-Sethna's second-order correction
        to each step (two extra residual evaluations and one VJP per
        attempt), for curved valleys; off by default because on the NIST set
        it did not reduce iterations (see `geodesic.py`). A float sets the
        largest accepted ``2|a|/|v|`` (default 0.75 when True).
      jit_compile: True compiles the whole solve with XLA, False runs it as a
        plain ``tf.function``; "auto" (default): XLA from `AUTO_XLA_PARAMS`
        parameters up, where the compile (seconds) pays for itself, a plain
        ``tf.function`` below (a small fit's first call in about a second,
        a repeated one in milliseconds) until the same cached solve has
        been called `AUTO_XLA_CALLS` (1,024) times in the process, then XLA
        (about 2 s of compile once, then about half the time per call; the
        two round differently); a function XLA cannot compile (e.g. it
        calls ``tf.numpy_function``) stays plain, with a warning.
      cache: reuse the traced solve of an earlier call with the same
        residual function, variables, shapes, dtypes and options (one call
        traces, later ones only run; `solve_cache`). The function is keyed
        with a snapshot of the values its closure and the module globals it
        names hold, so rebinding one of them traces anew; a change the
        snapshot cannot see (an attribute of another object the function
        reads) needs ``cache=False`` or ``solve_cache.SOLVES.clear()``. Data
        that changes between fits is best held in a ``tf.Variable``: it is
        read at each run, with no new trace.
      verbose: 0 (default) silent; 1 prints scipy's termination report (why
        it stopped, iterations, final cost, first-order optimality) after an
        eager solve, from the host: the compiled solve holds no print op.
        2 also prints each iteration's cost, step norm, damping and
        acceptance (recorded in the compiled loop); with ``bounds`` or a
        restarting ``scaling`` each run the solve makes is headed, and the
        run whose point it kept is named.

    Returns:
      A `LeastSquaresResult`.

    Example:

    >>> a, b = tf.Variable(1.0, dtype=tf.float64), tf.Variable(0.1, dtype=tf.float64)
    >>> x = tf.constant([1., 2., 3., 4.], tf.float64)
    >>> y = 2.5 * tf.exp(-0.3 * x)
    >>> result = least_squares(lambda: a * tf.exp(-b * x) - y, [a, b])
    >>> round(float(a), 6), round(float(b), 6), result.reason
    (2.5, 0.3, 'step tolerance')
    """
    var_list = _variables(var_list)
    _check_verbose(verbose)
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) \
            or max_iterations < 0:
        raise ValueError("least_squares: `max_iterations` must be an integer >= 0. "
                         f"Received: max_iterations={max_iterations!r}")
    solver = small.resolve_solver(solver, sum(
        int(np.prod(v.shape.as_list())) for v in var_list))
    controller, scaling, solver, robust = _parts(controller, scaling, solver,
                                                 x_scale, loss, f_scale)
    if geodesic_acceleration and (bounds is not None or not robust.is_linear):
        raise ValueError("least_squares: `geodesic_acceleration` works on plain "
                         "unbounded least squares only; drop it, or drop `bounds` "
                         "and `loss`.")
    dtype = var_list[0].dtype.base_dtype
    eps = float(tf.experimental.numpy.finfo(dtype.as_numpy_dtype).eps)
    _check_tolerances(dict(gtol=gtol, xtol=xtol, ftol=ftol), eps, dtype)
    gtol = eps if gtol is None else gtol
    xtol = eps ** 0.75 if xtol is None else xtol
    ftol = 4 * eps if ftol is None else ftol
    num_params = sum(v.shape.num_elements() for v in var_list)
    box = None
    if bounds is not None:   # checked before the solve, which clips the start
        if tf.executing_eagerly():
            _check_finite_start(var_list)
        box = bounds_lib.Bounds.from_argument(bounds, var_list, dtype)
        if tf.executing_eagerly():
            box.check_feasible(lin_lib.flatten(var_list, dtype).numpy())

    chosen = jit_compile == "auto"   # XLA chosen for the user, not by them
    if chosen:
        jit_compile = num_params >= AUTO_XLA_PARAMS
    elif not isinstance(jit_compile, bool):
        raise ValueError("least_squares: `jit_compile` must be True, False or "
                         f"'auto'. Received: jit_compile={jit_compile!r}")
    phases = (scaling.phases(controller) if callable(getattr(scaling, "phases", None))
              else [(scaling, controller)])
    history = verbose == 2

    def build(traced_fn, tolerances, box, with_covariance):
        problem = whole_solve.make_problem(
            traced_fn, var_list, dtype, robust, solver, max_iterations,
            max_attempts, geodesic_acceleration, history)
        return _finish(whole_solve.solve(problem, tolerances, box, phases,
                                         with_covariance))

    tolerances = _tolerance_tensors(dtype, gtol, xtol, ftol)
    record = None   # "auto"'s count of this solve's calls (`AUTO_XLA_CALLS`)
    if not tf.executing_eagerly():
        out = build(residual_fn, tolerances, box, with_covariance=True)
    else:
        inputs = list(tolerances) + ([] if box is None else [box.lower, box.upper])
        key = None
        if cache:  # everything the trace depends on; the inputs are not in it
            key = ("least_squares", solve_cache.function_key(residual_fn),
                   solve_cache.variables_key(var_list), max_iterations,
                   solve_cache.part_key(controller), solve_cache.part_key(scaling),
                   solve_cache.part_key(solver), max_attempts, robust.name,
                   robust.f_scale, box is None, geodesic_acceleration,
                   dtype.name, history)
            if chosen:   # XLA for many parameters, or once repeated often enough
                record, _ = _AUTO_CALLS.lookup(key, lambda: [0, True])
                jit_compile = record[1] and (jit_compile or (
                    solve_cache.SOLVES.maxsize > 0
                    and record[0] + 1 >= AUTO_XLA_CALLS))
            key += (jit_compile,)
        solve = _compiled(build, residual_fn, inputs, jit_compile, key)
        if chosen and jit_compile:
            def plain():   # the plain solve's own entry (never under XLA's key)
                return _compiled(build, residual_fn, inputs, False,
                                 None if key is None else key[:-1] + (False,))

            out, _ = solve_cache.xla_or_plain(solve, plain, inputs, "least_squares",
                                              record)
        else:
            out = solve(*inputs)
    (it, code, damping, cost, optimality, cosine, x, fun, jac, grad, mask, cov,
     stopped_by, converged, undetermined) = out[:15]
    if tf.executing_eagerly() and int(code) == StopReason.NON_FINITE_START:
        # Without bounds the solve itself tests the start (it stops before a
        # step, the variables as they were): the parameters named first.
        _check_finite_start(var_list)
        raise ValueError(
            "least_squares: the residuals of `residual_fn` are not finite at the "
            "start (as scipy: 'Residuals are not finite in the initial point'). "
            f"Received: cost {float(cost)} at the values in `var_list`; start "
            "where every residual is finite.")
    if record is not None:   # counted once it ran (eagerly: a record exists)
        record[0] += 1
    if history:
        _print_history(*(part.numpy() for part in out[15:21]),
                       ["from the start"] + [RESTART_TEXT] * (len(phases) - 1)
                       + ([OFF_BOUNDS_TEXT] if box is not None else []))
    if verbose:
        print(f"least_squares: {whole_solve.reason_text(REASONS, code, stopped_by)}. "
              f"Iterations "
              f"{int(it)}, final cost {float(cost):.4e}, first-order optimality "
              f"{float(optimality):.2e}.")
    return LeastSquaresResult(cost=cost, iterations=it, converged=converged,
                              reason_code=code, damping=damping,
                              optimality=optimality, stationarity=cosine,
                              x=x, fun=fun, jac=jac, grad=grad,
                              active_mask=mask, covariance=cov,
                              undetermined=undetermined,
                              stopped_by=stopped_by)


def _check_verbose(verbose):
    """Refuses, naming it, a ``verbose`` this solve cannot honour."""
    if isinstance(verbose, bool) or verbose not in (0, 1, 2):
        raise ValueError("least_squares: `verbose` must be 0 (silent), 1 (a "
                         "termination report) or 2 (and each iteration), scipy's "
                         f"levels. Received: verbose={verbose!r}")
    if verbose and not tf.executing_eagerly():
        raise ValueError(
            f"least_squares: verbose={verbose} prints on the host after the solve, "
            "so it needs an eager call (inside a tf.function read the result's "
            "`reason`, `iterations` and `cost` instead). Received: verbose="
            f"{verbose} while tracing.")


# verbose=2's heading of each run after the first (`whole_solve.solve`: the
# restart policy's phases, then the run off bounds the residuals ignore)
RESTART_TEXT = "restarted from the start: the restart policy's next phase"
OFF_BOUNDS_TEXT = ("restarted from the kept point, the parameters held on bounds "
                   "the residuals ignore moved halfway back to the start")


def _print_history(rows, counts, costs, codes, stopped_by, kept, labels):
    """verbose=2: one line per iteration, recorded in the compiled loop;
    per run (`whole_solve.solve`) ``rows`` [R, max_iterations, 4], its
    ``counts``, final ``costs``, ``codes`` and ``stopped_by`` [R] and
    ``kept`` [R], ``labels`` [R] what each run is. Where more than one run
    ran, each is headed by its label and ends with its stop and cost, and the
    run whose point the solve kept is named; the iterations are numbered
    across the runs (the result's ``iterations`` counts them all)."""
    ran = [r for r in range(len(counts)) if counts[r] > 0 or r == 0]
    print(f"{'Iteration':>9} {'Cost':>12} {'Step norm':>12} {'Damping':>12}  Step")
    i = 0
    for r in ran:
        if len(ran) > 1:
            print(f"Run {r + 1}: {labels[r]}")
        for cost, step, damping, accepted in rows[r][:counts[r]]:
            taken = "accepted" if accepted else "rejected"
            print(f"{i:>9d} {cost:12.4e} {step:12.4e} {damping:12.4e}  {taken}")
            i += 1
        if len(ran) > 1:
            reason = whole_solve.reason_text(REASONS, codes[r], stopped_by[r])
            print(f"Run {r + 1} ended: {reason}, cost {costs[r]:.4e}")
    if len(ran) > 1:
        last = max(r for r in ran if kept[r])
        print(f"Kept: run {last + 1}'s point (the lowest cost)")


def _compiled(build, residual_fn, inputs, jit_compile, key):
    """The solve's ``tf.function``: from `solve_cache.SOLVES` under ``key``
    (traced there on a miss), or traced anew when ``key`` is None."""
    if key is None:
        return _compile(build, residual_fn, inputs, jit_compile)
    solve, _ = solve_cache.SOLVES.lookup(
        key, lambda: _compile(build, residual_fn, inputs, jit_compile))
    return solve


def _compile(build, residual_fn, inputs, jit_compile):
    """A ``tf.function`` of the solve over ``inputs`` (tolerances, bounds):
    the solve's own code is not converted by AutoGraph (its loops are
    ``tf.while_loop``s already, and conversion doubles the trace's time);
    ``residual_fn`` is, as a ``tf.function`` would convert it. Under XLA the
    covariance (an SVD) comes from a second, plain ``tf.function``."""
    traced_fn = _autograph(residual_fn)

    def solve(gtol, xtol, ftol, *limits):
        box = bounds_lib.Bounds(*limits) if limits else None
        return build(traced_fn, whole_solve.Tolerances(gtol, xtol, ftol), box,
                     with_covariance=not jit_compile)

    compiled = solve_cache.OneSignature(tf.function(
        solve, jit_compile=jit_compile, autograph=False,
        input_signature=[solve_cache.input_spec(t) for t in inputs]))
    if not jit_compile:
        return compiled
    def finished_covariance(jac, cost, code):
        cov = _unusable_nan(covariance(jac, cost), code)
        return cov, fit_report.undetermined(cov)

    pcov = tf.function(finished_covariance, autograph=False)

    def with_covariance(*args):
        out = compiled(*args)
        jac, cost, code = out[8], out[3], out[1]
        # out[11] is the covariance slot (None here); out[12] stopped_by;
        # out[13] converged; out[14] undetermined (None here); out[15:] the
        # verbose=2 record when kept.
        if jac is None:
            return out
        cov, undetermined = pcov(jac, cost, code)
        return out[:11] + (cov,) + out[12:14] + (undetermined,) + out[15:]

    return with_covariance


def _unusable_nan(cov, code):
    return fit_report.without_covariance(cov, tf.equal(code, NON_FINITE_START))


def _finish(out):
    """The solve's outputs with ``converged``, the covariance NaN where the
    fit never ran and ``undetermined`` added after ``stopped_by`` (out[13],
    out[14]), computed in the traced solve: as eager ops they cost a repeated
    small fit about 0.1 ms."""
    code, cov = out[1], out[11]
    converged = (code >= 1) & (code <= 3)
    undetermined = None
    if cov is not None:
        cov = _unusable_nan(cov, code)
        undetermined = fit_report.undetermined(cov)
    return out[:11] + (cov, out[12], converged, undetermined) + out[13:]


def _autograph(fn):
    """``fn`` converted by AutoGraph (Python control flow on tensors), as a
    ``tf.function`` with ``autograph=True`` would run it; ``fn`` itself
    where it cannot be converted (a ``tf.function``, no source)."""
    if isinstance(fn, (types.FunctionType, types.MethodType)):
        try:
            return tf.autograph.to_graph(fn)
        except Exception:  # noqa: BLE001 - as tf.function: run it as it is
            return fn
    return fn


def _variables(var_list):
    """The variables to fit, checked: a list of real floating ``tf.Variable``s
    (Keras variables by their ``value``)."""
    var_list = [getattr(v, "value", v) if not isinstance(v, tf.Variable) else v
                for v in (var_list if isinstance(var_list, (list, tuple)) else [var_list])]
    if not var_list:
        raise ValueError("least_squares: `var_list` is empty; pass the variables "
                         "to fit.")
    for i, v in enumerate(var_list):
        if not isinstance(v, tf.Variable):
            raise TypeError(
                "least_squares: `var_list` must hold the tf.Variables to fit "
                "(updated in place), e.g. [tf.Variable(x0, dtype=tf.float64)]. "
                f"Received: var_list[{i}] of type {type(v).__name__}.")
    for i, v in enumerate(var_list):
        if not v.dtype.is_floating:
            raise ValueError(
                "least_squares: the variables in `var_list` must be real floating "
                "point (float64 for reference work; scipy refuses a complex `x0` "
                f"too). Received: var_list[{i}] ({v.name}) of dtype "
                f"{v.dtype.name}.")
    return var_list


def _parts(controller, scaling, solver, x_scale, loss, f_scale):
    """``(controller, scaling, solver, robust loss)`` objects from
    `least_squares`'s arguments (``x_scale`` sets the scaling; a robust loss
    defaults to the hybrid restart)."""
    controller = resolve_part(controller, damping_lib.CONTROLLERS, "controller")
    robust = RobustLoss(loss, f_scale)
    if x_scale is not None:
        if scaling is not None:
            raise ValueError("least_squares: pass `scaling` or `x_scale`, not both "
                             f"(x_scale sets the scaling). Received: scaling="
                             f"{scaling!r}, x_scale={x_scale!r}")
        scaling = (damping_lib.Marquardt() if isinstance(x_scale, str)
                   and x_scale == "jac" else _x_scale(x_scale))
    solver = resolve_part(solver, solvers_lib.SOLVERS, "solver")
    if scaling is None:  # a robust loss: see `scaling` above
        scaling = ("hybrid" if not robust.is_linear
                   and solver.consumes != solvers_lib.MATRIX_FREE else "marquardt")
    scaling = resolve_part(scaling, damping_lib.SCALINGS, "scaling")
    check_parts(scaling, solver, "least_squares")
    return controller, scaling, solver, robust


def _x_scale(x_scale):
    if isinstance(x_scale, str) or np.iscomplexobj(x_scale):
        raise ValueError("least_squares: `x_scale` must be 'jac' or positive "
                         f"real numbers. Received: x_scale={x_scale!r}")
    return damping_lib.XScale(x_scale)


def _check_tolerances(tolerances, eps, dtype):
    for name, value in tolerances.items():
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, (int, float)) or not value >= 0):
            raise ValueError(f"least_squares: `{name}` must be a number >= 0 or None "
                             f"(the default). Received: {name}={value!r}")
    if all(value is not None and value < eps for value in tolerances.values()):
        raise ValueError(
            "least_squares: at least one of `gtol`, `xtol`, `ftol` must be above "
            f"the machine epsilon of {dtype.name} ({eps:.3g}), or the solve could "
            "only stop at the iteration limit (as scipy); pass None for a "
            "default. Received: " + ", ".join(f"{k}={v!r}" for k, v in
                                               tolerances.items()))


def _tolerance_tensors(dtype, gtol, xtol, ftol):
    """`whole_solve.Tolerances` of scalar tensors; eagerly, for Python
    numbers, the same tensors again on a repeated call (`_TOLERANCES`:
    three ``tf.constant`` calls are about 0.04 ms of a repeated small fit)."""
    values = (gtol, xtol, ftol)

    def make():
        return whole_solve.Tolerances(*(tf.constant(t, dtype) for t in values))

    if tf.executing_eagerly() and all(type(t) in (float, int) for t in values):
        return _TOLERANCES.lookup((dtype.name,) + values, make)[0]
    return make()


_TOLERANCES = solve_cache.SolveCache(maxsize=64)   # eager tensors by value


def _check_finite_start(var_list):
    """Raises when a variable holds inf or NaN (eagerly: values are known)."""
    for i, v in enumerate(var_list):
        values = v.numpy().reshape(-1)
        bad = ~np.isfinite(values)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                "least_squares: the starting values in `var_list` must be finite "
                f"(as scipy's `x0`). Received: var_list[{i}] ({v.name}) holds "
                f"{values[j]} at flat index {j}.")
