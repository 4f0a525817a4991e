"""``least_squares``: a whole Levenberg-Marquardt solve in one compiled loop.

Minimises ``0.5 * sum(residual_fn()**2)`` over ``var_list`` with the LM
iteration of `step.py` inside one ``tf.while_loop`` (and, by default, one
XLA compilation): no host round-trip per iteration.
"""

import types
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_gradkit.core.lm import bounds as bounds_lib
from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import geodesic as geodesic_lib
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib
from tf_gradkit.core.lm.parts import check_parts, resolve_part
from tf_gradkit.core.lm.robust import RobustLoss
from tf_gradkit.core.lm import solve_cache
from tf_gradkit.core.lm import step as step_lib

REASONS = ("running", "gradient tolerance", "step tolerance", "cost tolerance",
           "iteration limit", "no acceptable step (damping exhausted)",
           "stalled far from a minimum (steps stopped while the gradient is not "
           "small: try another start or rescale the parameters)",
           "non-finite start (the parameters or the residuals at the start are "
           "inf or NaN)")
NON_FINITE_START = 7
# jit_compile="auto" compiles with XLA from this many parameters up: below it
# XLA's compile (seconds) dwarfs a small solve's run (milliseconds), see
# docs/levenberg_marquardt.md.
AUTO_XLA_PARAMS = 64
# A tolerance stop counts as converged only where r is round-off (see
# `least_squares`) or the gradient is small: the cosine between r and the
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


class LeastSquaresResult(NamedTuple):
    """What `least_squares` returns.

    Attributes:
      cost: final ``0.5 * sum r^2``.
      iterations: LM iterations run.
      converged: True if a tolerance was met at a stationary point (not the
        iteration limit, not a stall with every attempt rejected, not a
        tolerance stop far from a minimum and not a non-finite start: see
        `reason`).
      reason_code: index into `REASONS`.
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
        a matrix-free solver.
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

    @property
    def reason(self):
        """Why the solve stopped, as text (a string tensor inside graphs)."""
        if tf.executing_eagerly():
            return REASONS[int(self.reason_code)]
        return tf.gather(tf.constant(REASONS), self.reason_code)


def least_squares(residual_fn, var_list, max_iterations=100, *,
                  controller="trust_region", scaling=None, solver="qr",
                  max_attempts=10, gtol=None, xtol=None, ftol=None,
                  bounds=None, loss="linear", f_scale=1.0, x_scale=None,
                  geodesic_acceleration=False, jit_compile="auto", cache=True):
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
        same start; the lower cost wins: `damping.Hybrid`). On the
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
        "cholesky" (fast normal equations), "dual" (J J^T form, for fewer
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
        a repeated one in milliseconds).
      cache: reuse the traced solve of an earlier call with the same
        residual function, variables, shapes, dtypes and options (one call
        traces, later ones only run; `solve_cache`). The function is keyed
        with a snapshot of the values its closure and the module globals it
        names hold, so rebinding one of them traces anew; a change the
        snapshot cannot see (an attribute of another object the function
        reads) needs ``cache=False`` or ``solve_cache.SOLVES.clear()``. Data
        that changes between fits is best held in a ``tf.Variable``: it is
        read at each run, with no new trace.

    Returns:
      A `LeastSquaresResult`.

    Example:

    >>> a, b = tf.Variable(1.0, dtype=tf.float64), tf.Variable(0.1, dtype=tf.float64)
    >>> x = tf.constant([1., 2., 3., 4.], tf.float64)
    >>> y = 2.5 * tf.exp(-0.3 * x)
    >>> result = least_squares(lambda: a * tf.exp(-b * x) - y, [a, b])
    >>> round(float(a), 6), round(float(b), 6), result.reason
    (2.5, 0.3, 'gradient tolerance')
    """
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
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) \
            or max_iterations < 0:
        raise ValueError("least_squares: `max_iterations` must be an integer >= 0. "
                         f"Received: max_iterations={max_iterations!r}")
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
    if tf.executing_eagerly():
        _check_finite_start(var_list)
    box = None
    if bounds is not None:
        box = bounds_lib.Bounds.from_argument(bounds, var_list, dtype)
        if tf.executing_eagerly():
            box.check_feasible(lin_lib.flatten(var_list, dtype).numpy())

    if jit_compile == "auto":
        jit_compile = num_params >= AUTO_XLA_PARAMS
    elif not isinstance(jit_compile, bool):
        raise ValueError("least_squares: `jit_compile` must be True, False or "
                         f"'auto'. Received: jit_compile={jit_compile!r}")

    def build(residual_fn, gtol, xtol, ftol, box, with_covariance):
        """The whole solve: tolerances and box as tensors (inputs of a cached
        solve), ``residual_fn`` as the trace calls it."""
        geodesic = None
        if geodesic_acceleration:
            alpha = (0.75 if geodesic_acceleration is True
                     else float(geodesic_acceleration))
            geodesic = geodesic_lib.GeodesicAcceleration(residual_fn, alpha=alpha)
        step_fn = residual_fn if robust.is_linear else robust.scaled(residual_fn, dtype)

        def cost_fn():
            r = tf.cast(tf.reshape(residual_fn(), [-1]), dtype)
            if robust.is_linear:
                return 0.5 * tf.reduce_sum(tf.square(r))
            return robust.cost(r)

        def linearize_here(form):
            lin = lin_lib.linearize_as(form, step_fn, var_list, dtype)
            return lin if robust.is_linear else lin._replace(cost=cost_fn())

        # Each form's linearisation traced once (a function the loop and the
        # final point both call): the vectorised Jacobian is the largest part
        # of the trace. A matrix-free one returns a closure: traced inline.
        linearizers = {}

        def linearize(form=solver.consumes):
            if form == solvers_lib.MATRIX_FREE:
                return linearize_here(form)
            if form not in linearizers:
                linearizers[form] = tf.function(
                    lambda: linearize_here(form), autograph=False)
            return linearizers[form]()

        def held(lin):
            """``lin`` with the parameters held on a bound frozen."""
            if box is None:
                return lin
            x = lin_lib.flatten(var_list, dtype)
            return bounds_lib.freeze(lin, box.frozen(x, lin.jtr))

        phases = (scaling.phases(controller) if callable(getattr(scaling, "phases", None))
                  else [(scaling, controller)])

        def assign(flat):
            for v, value in zip(var_list, lin_lib.unflatten(flat, var_list)):
                v.assign(value)

        matrix_free = solver.consumes == solvers_lib.MATRIX_FREE

        def run(scaling, controller, start_cost):
            """One whole solve from the variables' values: ``((iterations, stop
            code, damping, final cost, stationarity), final linearisation)``; the
            variables end at its solution."""

            def column_norms(lin):
                if lin.jtj is None:
                    return tf.zeros_like(lin.jtr)
                return tf.sqrt(tf.maximum(tf.linalg.diag_part(lin.jtj), 0.0))

            def body(it, reason, state, cost, largest):
                del cost
                lin = held(linearize())
                largest = tf.maximum(largest, column_norms(lin))
                grad_small = tf.reduce_max(tf.abs(lin.jtr)) <= gtol * tf.maximum(
                    lin.cost, 1.0)

                def take_step():
                    new_state, info = step_lib.levenberg_marquardt_step(
                        lin, cost_fn, var_list, state, controller=controller,
                        scaling=scaling, solver=solver, max_attempts=max_attempts,
                        geodesic=geodesic, bounds=box)
                    x_norm = tf.norm(lin_lib.flatten(var_list, dtype))
                    small_step = info.accepted & (info.step_norm <= xtol * (xtol + x_norm))
                    small_drop = info.accepted & (
                        info.cost - info.new_cost <= ftol * info.cost)
                    # Every attempt rejected: converged at round-off if the model
                    # promises no real decrease, or if even the least damped step
                    # moves x by less than sqrt(eps) (the cost cannot resolve it);
                    # given up if the most damped step is that small too.
                    # Otherwise go on: the next iteration starts from the damping
                    # (or trust radius) the rejections left.
                    stalled = ~info.accepted
                    resolution = tf.sqrt(tf.constant(eps, dtype)) * (1e-8 + x_norm)
                    flat = stalled & (info.predicted <= ftol * info.cost)
                    tiny = stalled & (info.first_step_norm <= resolution)
                    exhausted = stalled & (info.last_step_norm <= resolution)
                    code = tf.where(
                        flat, 3, tf.where(tiny, 2, tf.where(
                            exhausted, 5,
                            tf.where(small_step, 2, tf.where(small_drop, 3, 0)))))
                    return new_state, info.new_cost, code

                new_state, new_cost, code = tf.cond(
                    grad_small, lambda: (state, lin.cost, tf.constant(1)), take_step)
                return it + 1, code, new_state, new_cost, largest

            state = step_lib.init_state(controller, scaling, num_params, dtype)
            # A start with a non-finite parameter or cost is refused eagerly
            # (`_check_finite_start`, and below for the residuals); in a graph
            # the solve stops before its first step.
            x_start = lin_lib.flatten(var_list, dtype)
            finite = (tf.reduce_all(tf.math.is_finite(x_start))
                      & tf.math.is_finite(start_cost))
            it, code, state, _, largest = tf.while_loop(
                lambda it, reason, *_: (reason == 0) & (it < max_iterations), body,
                (tf.constant(0), tf.where(finite, 0, NON_FINITE_START), state,
                 tf.constant(0.0, dtype), tf.zeros([num_params], dtype)),
                maximum_iterations=max_iterations)
            code = tf.where(code == 0, 4, code)
            final = linearize(solver.consumes if matrix_free else solvers_lib.JACOBIAN)
            kept = held(final)
            now = column_norms(kept)
            cosine_now, r_norm = _stationarity(kept, now)
            cosine, _ = _stationarity(kept, tf.maximum(largest, now))
            # Stationary: the cosine small with the columns' current norms, or,
            # where a column has shrunk (a minimum where it vanishes while r does
            # not), small with their largest norms and the gradient small
            # relative to the cost (Dennis-Schnabel's relative gradient
            # max_j |g_j| max(|x_j|, 1) / cost <= eps^(1/3)).
            x_abs = tf.abs(lin_lib.flatten(var_list, dtype))
            tiny = tf.constant(np.finfo(dtype.as_numpy_dtype).tiny, dtype)
            relative = tf.reduce_max(tf.abs(kept.jtr) * tf.maximum(x_abs, 1.0)) / (
                tf.maximum(final.cost, tiny))
            stationary = ((cosine_now <= STATIONARY_COSINE)
                          | ((cosine <= STATIONARY_COSINE)
                             & (relative <= eps ** (1.0 / 3.0))))
            # Not at round-off: the residuals' largest component along a column
            # of J, cosine * |r|, above sqrt(eps) (a zero-residual solution has
            # |r| at round-off, where its direction means nothing), and the cost
            # not down to eps times its start.
            along = cosine_now * r_norm
            far = ((code >= 2) & (code <= 3) & ~stationary
                   & (along > tf.sqrt(tf.constant(eps, dtype)))
                   & (final.cost > eps * start_cost))
            return (it, tf.where(far, 6, code), state.damping, final.cost, cosine), final

        def solve():
            if box is not None and not tf.executing_eagerly():
                assign(box.clip(lin_lib.flatten(var_list, dtype)))
            start_cost = cost_fn()
            x0 = lin_lib.flatten(var_list, dtype)
            out, final = run(*phases[0], start_cost)
            for phase in phases[1:]:
                # The next phase only where this one ended unconverged (iteration
                # limit, no acceptable step, stalled far from a minimum); it
                # starts from x0 again, and the lower cost of the two is kept.
                def another(first=out, phase=phase):
                    x_first = lin_lib.flatten(var_list, dtype)
                    assign(x0)
                    second, _ = run(*phase, start_cost)
                    cost_first, cost_second = first[3], second[3]
                    better = (cost_second < cost_first) | ~tf.math.is_finite(cost_first)
                    assign(tf.where(better, lin_lib.flatten(var_list, dtype), x_first))
                    kept = tf.nest.map_structure(lambda a, b: tf.where(better, a, b),
                                                 second, first)
                    return (first[0] + second[0],) + tuple(kept[1:])

                out = tf.cond((out[1] >= 4) & (out[1] != NON_FINITE_START), another,
                              lambda out=out: out)
            it, code, damping, _, cosine = out
            if len(phases) > 1:  # the kept phase's point: linearised again there
                final = linearize(solver.consumes if matrix_free else solvers_lib.JACOBIAN)
            x = lin_lib.flatten(var_list, dtype)
            fun = tf.cast(tf.reshape(residual_fn(), [-1]), dtype)
            mask = (tf.zeros([num_params], tf.int32) if box is None
                    else box.active_mask(x))
            scaled = final.jtr if box is None else final.jtr * box.coleman_li(x, final.jtr)
            optimality = tf.reduce_max(tf.abs(scaled))
            cov = (covariance(final.jacobian, final.cost)
                   if with_covariance and final.jacobian is not None else None)
            return (it, code, damping, final.cost, optimality, cosine,
                    x, fun, final.jacobian, final.jtr, mask, cov)

        return solve()

    tolerances = [tf.constant(t, dtype) for t in (gtol, xtol, ftol)]
    if not tf.executing_eagerly():
        out = build(residual_fn, *tolerances, box, with_covariance=True)
    else:
        inputs = tolerances + ([] if box is None else [box.lower, box.upper])

        def compile_solve():
            return _compile(build, residual_fn, inputs, jit_compile)

        if cache:
            key = ("least_squares", solve_cache.function_key(residual_fn),
                   solve_cache.variables_key(var_list), max_iterations,
                   solve_cache.part_key(controller), solve_cache.part_key(scaling),
                   solve_cache.part_key(solver), max_attempts, robust.name,
                   robust.f_scale, box is None, geodesic_acceleration,
                   jit_compile, dtype.name)
            solve, _ = solve_cache.SOLVES.lookup(key, compile_solve)
        else:
            solve = compile_solve()
        out = solve(*inputs)
    it, code, damping, cost, optimality, cosine, x, fun, jac, grad, mask, cov = out
    if tf.executing_eagerly() and int(code) == NON_FINITE_START:
        raise ValueError(
            "least_squares: the residuals of `residual_fn` are not finite at the "
            "start (as scipy: 'Residuals are not finite in the initial point'). "
            f"Received: cost {float(cost)} at the values in `var_list`; start "
            "where every residual is finite.")
    return LeastSquaresResult(cost=cost, iterations=it,
                              converged=(code >= 1) & (code <= 3),
                              reason_code=code, damping=damping,
                              optimality=optimality, stationarity=cosine,
                              x=x, fun=fun, jac=jac, grad=grad,
                              active_mask=mask,
                              covariance=cov)


def _compile(build, residual_fn, inputs, jit_compile):
    """A ``tf.function`` of the solve over ``inputs`` (tolerances, bounds):
    the solve's own code is not converted by AutoGraph (its loops are
    ``tf.while_loop``s already, and conversion doubles the trace's time);
    ``residual_fn`` is, as a ``tf.function`` would convert it. Under XLA the
    covariance (an SVD) comes from a second, plain ``tf.function``."""
    traced_fn = _autograph(residual_fn)

    def solve(gtol, xtol, ftol, *limits):
        box = bounds_lib.Bounds(*limits) if limits else None
        return build(traced_fn, gtol, xtol, ftol, box,
                     with_covariance=not jit_compile)

    compiled = tf.function(solve, jit_compile=jit_compile, autograph=False,
                           input_signature=[solve_cache.input_spec(t) for t in inputs])
    if not jit_compile:
        return compiled
    pcov = tf.function(covariance, autograph=False)

    def with_covariance(*args):
        out = compiled(*args)
        jac, cost = out[8], out[3]
        return out[:-1] + (None if jac is None else pcov(jac, cost),)

    return with_covariance


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


def covariance(jac, cost):
    """``curve_fit``'s ``pcov`` from the Jacobian and the cost at the
    solution (outside XLA: one thin SVD of ``jac``, P x P)."""
    dtype = jac.dtype
    n = tf.cast(tf.shape(jac)[0], dtype)
    p = tf.shape(jac)[1]
    s, _, v = tf.linalg.svd(jac, full_matrices=False)
    eps = tf.experimental.numpy.finfo(dtype.as_numpy_dtype).eps
    kept = s > eps * tf.maximum(n, tf.cast(p, dtype)) * s[0]
    inverse = tf.where(kept, 1.0 / tf.where(kept, s, tf.ones_like(s)) ** 2,
                       tf.zeros_like(s))
    pcov = tf.matmul(v * inverse[None, :], v, transpose_b=True)
    dof = n - tf.cast(p, dtype)
    return tf.where(dof > 0, pcov * (2.0 * cost / tf.where(dof > 0, dof, 1.0)),
                    tf.fill([p, p], tf.constant(float("inf"), dtype)))


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


def _stationarity(lin, largest):
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
