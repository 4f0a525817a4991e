"""Damping controllers and damping scalings for Levenberg-Marquardt.

A *controller* (`Controller`) decides how the damping ``lambda`` moves after
each attempt, from the gain ratio ``rho = actual reduction / predicted
reduction``. A *scaling* (`Scaling`) decides the damping matrix ``D^2`` in
``(J^T J + lambda D^2) d = -J^T r``. Both are small swappable objects
(optimistix-style parts, not string switches). A *restart policy*
(`RestartPolicy`, e.g. `LevenbergThenMarquardt`, known as ``"hybrid"``) is
neither: it lists the (scaling, controller) runs of a whole solve, which
only `least_squares` makes; ``scaling=`` accepts one by name.

References:
  K. Madsen, H.B. Nielsen, O. Tingleff, "Methods for non-linear least squares
  problems", 2004, sec. 3.2 (the gain-ratio update below).
  D. Marquardt, "An algorithm for least-squares estimation of nonlinear
  parameters", 1963 (diag(J^T J) scaling); J. More, "The Levenberg-Marquardt
  algorithm: implementation and theory", 1978 (monotone scaling as in MINPACK).
"""

from typing import NamedTuple

import numpy as np
import tensorflow as tf


class DampingState(NamedTuple):
    """``damping``: current lambda; ``nu``: the controller's second scalar
    (Nielsen's growth factor, `TrustRegion`'s radius Delta)."""

    damping: tf.Tensor
    nu: tf.Tensor


class Trial(NamedTuple):
    """What one attempt measured, handed to ``accept``/``reject``.

    ``rho``: gain ratio; ``scaled_norm``: ``|D d|``; ``actual``: cost before
    minus cost after (``-inf``/NaN when the trial was not finite);
    ``slope``: ``d . J^T r`` (the cost's directional derivative, < 0);
    ``cost``, ``new_cost``: before and at the trial point.
    """

    rho: tf.Tensor
    scaled_norm: tf.Tensor
    actual: tf.Tensor
    slope: tf.Tensor
    cost: tf.Tensor
    new_cost: tf.Tensor


def _check_positive(owner, **values):
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{owner}: `{name}` must be a positive number. "
                             f"Received: {name}={value!r}")


class Controller:
    """The damping rule of LM: a part with these methods (graph code).

    - ``init(dtype) -> DampingState``: the state before the first step.
    - ``propose(solver, lin, state, d2, x) -> (step, ok, state)``: the damped
      step for the linearisation ``lin`` (``solver.solve(lin, lambda, d2)``
      at the lambda it picks), whether it is usable, and the state it was
      taken with (``x``: the flat parameters, for a radius relative to them).
    - ``accept(state, rho, trial) -> DampingState`` after an accepted attempt
      with gain ratio ``rho``; ``reject(state, trial)`` after a rejected one
      (``trial``: a `Trial`).
    - ``restrain(state) -> DampingState``: more damping for the next step
      (the Keras optimizer's mini-batch guard).
    - ``get_config() -> dict``: the constructor's arguments (parts are saved
      as name plus config, `parts.py`).

    Register a new one in `CONTROLLERS` to make it known by name.
    """

    def init(self, dtype):
        raise NotImplementedError

    def propose(self, solver, lin, state, d2, x):
        raise NotImplementedError

    def accept(self, state, rho, trial=None):
        raise NotImplementedError

    def reject(self, state, trial=None):
        raise NotImplementedError

    def restrain(self, state):
        raise NotImplementedError

    def get_config(self):
        return {}


class DampingFactor(Controller):
    """A controller that moves lambda itself by factors (`Nielsen`,
    `MultiplyDivide`), within ``[floor, ceiling]``; the step is the damped
    solve at the current lambda."""

    def __init__(self, initial, floor, ceiling):
        _check_positive(type(self).__name__, initial=initial, floor=floor,
                        ceiling=ceiling)
        if not floor <= initial <= ceiling:
            raise ValueError(
                f"{type(self).__name__}: need floor <= initial <= ceiling. "
                f"Received: floor={floor}, initial={initial}, ceiling={ceiling}")
        self.initial, self.floor, self.ceiling = initial, floor, ceiling

    def init(self, dtype):
        return DampingState(tf.constant(self.initial, dtype),
                            tf.constant(2.0, dtype))

    def propose(self, solver, lin, state, d2, x):
        """The damped step at the current damping: ``(step, ok, state)``."""
        del x
        step, ok = solver.solve(lin, state.damping, d2)
        return step, ok, state

    def _clip(self, damping):
        return tf.clip_by_value(damping, tf.cast(self.floor, damping.dtype),
                                tf.cast(self.ceiling, damping.dtype))

    def restrain(self, state):
        """More damping for the next step (the last one did not carry over
        to fresh data, see ``LevenbergMarquardt``'s mini-batch guard):
        lambda doubles, within the ceiling."""
        return DampingState(self._clip(2.0 * state.damping), state.nu)

    def get_config(self):
        return {"initial": self.initial, "floor": self.floor,
                "ceiling": self.ceiling}


# The name before the base was documented (kept for subclasses elsewhere).
_Controller = DampingFactor


class Nielsen(DampingFactor):
    """Nielsen's gain-ratio rule: smooth decrease on success, doubling growth.

    accept: ``lambda *= max(1/3, 1 - (2 rho - 1)^3)``, ``nu = 2``;
    reject: ``lambda *= nu``, ``nu *= 2``.
    """

    def __init__(self, initial=1e-3, floor=1e-15, ceiling=1e15):
        super().__init__(initial, floor, ceiling)

    def accept(self, state, rho, trial=None):
        del trial
        factor = tf.maximum(tf.constant(1.0 / 3.0, rho.dtype),
                            1.0 - tf.pow(2.0 * rho - 1.0, 3))
        return DampingState(self._clip(state.damping * factor),
                            tf.constant(2.0, state.nu.dtype))

    def reject(self, state, trial=None):
        del trial
        return DampingState(self._clip(state.damping * state.nu), state.nu * 2.0)


class MultiplyDivide(DampingFactor):
    """The classic rule (MATLAB ``trainlm``): ``lambda *= increase`` on
    rejection, ``lambda *= decrease`` on success (defaults 10 and 0.1)."""

    def __init__(self, initial=1e-3, increase=10.0, decrease=0.1, floor=1e-15,
                 ceiling=1e15):
        super().__init__(initial, floor, ceiling)
        _check_positive("MultiplyDivide", increase=increase, decrease=decrease)
        if increase <= 1 or decrease >= 1:
            raise ValueError(
                "MultiplyDivide: need increase > 1 and decrease < 1. "
                f"Received: increase={increase}, decrease={decrease}")
        self.increase, self.decrease = increase, decrease

    def accept(self, state, rho, trial=None):
        del rho, trial
        return DampingState(self._clip(state.damping * self.decrease), state.nu)

    def reject(self, state, trial=None):
        del trial
        return DampingState(self._clip(state.damping * self.increase), state.nu)

    def get_config(self):
        return dict(super().get_config(), increase=self.increase,
                    decrease=self.decrease)


class TrustRegion(Controller):
    """Moré's trust-region control of the step, as in MINPACK ``lmder``.

    The damping is not a state of its own: each iteration keeps a radius
    Delta on the scaled step ``|D d|`` and picks lambda so the step fits it.
    The Gauss-Newton step (lambda = 0) is taken whenever ``|D d| <= 1.1 Delta``;
    otherwise lambda is found so that ``|D d(lambda)|`` is within 10% of Delta.
    Moré finds it by Newton's method on ``1/|D d(lambda)|``, which is nearly
    linear in lambda; the derivative needs a solve with the factor itself,
    so here the same function is solved by a bracketed secant (Illinois)
    that asks each linear solver only for its damped step, at most
    ``max_solves`` of them (typically 2-4). After each attempt Delta moves by
    Moré's rule from the gain ratio rho: ``rho <= 1/4`` shrinks it (by a
    factor in [0.1, 0.5] from a quadratic fit of the cost along the step),
    ``rho >= 3/4`` (or a Gauss-Newton step) sets ``Delta = 2 |D d|``.

    Since lambda may reach 0, there is no damping floor for steps to crawl
    at, and a far start is limited by Delta, not by a damping that must
    first grow: the two failure modes of the plain gain-ratio rules on the
    Moré-Garbow-Hillstrom problems from 10x and 100x their standard starts.

    Args:
      factor: the first radius is ``factor * |D x0|`` (``factor`` when
        ``x0 = 0``), as MINPACK's ``factor`` (default 100).
      max_solves: damped solves allowed to fit lambda to Delta per attempt.

    Reference: J. J. Moré, "The Levenberg-Marquardt algorithm: implementation
    and theory", Numerical Analysis, LNM 630, 1978.
    """

    def __init__(self, factor=100.0, max_solves=10):
        _check_positive("TrustRegion", factor=factor)
        if isinstance(max_solves, bool) or not isinstance(max_solves, int) \
                or max_solves < 1:
            raise ValueError("TrustRegion: `max_solves` must be an integer >= 1. "
                             f"Received: max_solves={max_solves!r}")
        self.factor, self.max_solves = factor, max_solves

    def get_config(self):
        return {"factor": self.factor, "max_solves": self.max_solves}

    def with_factor(self, factor):
        """This controller with another first radius (`LevenbergThenMarquardt`'s
        phases)."""
        return TrustRegion(factor=factor, max_solves=self.max_solves)

    def init(self, dtype):
        # radius <= 0: not set yet (set from x0 on the first step).
        return DampingState(tf.constant(0.0, dtype), tf.constant(-1.0, dtype))

    def propose(self, solver, lin, state, d2, x):
        dtype = lin.jtr.dtype
        scale = tf.sqrt(d2)
        zero, one = tf.constant(0.0, dtype), tf.constant(1.0, dtype)
        first = state.nu <= 0
        x_norm = tf.norm(scale * x)
        radius = tf.where(first, self.factor * tf.where(x_norm > 0, x_norm, one),
                          state.nu)

        def measure(lam):
            step, ok = solver.solve(lin, lam, d2)
            norm = tf.norm(scale * step)
            ok = ok & tf.math.is_finite(norm)
            return step, ok, tf.where(ok, norm, tf.constant(float("inf"), dtype))

        gn_step, gn_ok, gn_norm = measure(zero)
        gn_inside = gn_ok & (gn_norm <= 1.1 * radius)

        def fit_lambda():
            # psi(lambda) = 1/|D d| - 1/Delta rises through 0 at the wanted
            # lambda; psi(0) < 0 (the Gauss-Newton step is too long) and
            # |D d(hi)| <= |D^-1 J^T r| / hi = Delta, so [0, hi] brackets it.
            hi = tf.norm(lin.jtr / scale) / radius
            psi_lo = 1.0 / gn_norm - 1.0 / radius
            guess = tf.norm(lin.jtr / scale) / gn_norm  # MINPACK's first guess
            lam = tf.where(state.damping > 0, tf.minimum(state.damping, hi),
                           tf.where(gn_ok & (guess > 0), guess, 1e-3 * hi))

            def body(i, lam, lo, psi_lo, hi, psi_hi, has_hi, side, step, ok, norm,
                     done, used):
                del step, ok, norm, done, used
                return (i + 1,) + tuple(radius_fit_step(
                    radius, measure, lam, lo, psi_lo, hi, psi_hi, has_hi, side))

            out = tf.while_loop(
                lambda i, *rest: (i < self.max_solves) & ~rest[-2], body,
                (tf.constant(0), lam, zero, psi_lo, hi, zero, tf.constant(False),
                 zero, tf.zeros_like(lin.jtr), tf.constant(False),
                 zero, tf.constant(False), zero),
                maximum_iterations=self.max_solves)
            step, ok, norm, used = out[8], out[9], out[10], out[12]
            return step, ok, used, norm

        step, ok, lam, norm = tf.cond(
            gn_inside, lambda: (gn_step, gn_ok, zero, gn_norm), fit_lambda)
        # MINPACK: on the first iteration the radius is cut to the first step.
        radius = tf.where(first & ok, tf.minimum(radius, norm), radius)
        return step, ok, DampingState(lam, radius)

    def accept(self, state, rho, trial=None):
        return self._update(state, trial, rho)

    @staticmethod
    def restrain(state):
        """A smaller step next time: the radius halves (if set)."""
        return DampingState(state.damping, tf.where(state.nu > 0, 0.5 * state.nu,
                                                    state.nu))

    def reject(self, state, trial=None):
        return self._update(state, trial, tf.zeros_like(state.nu))

    @staticmethod
    def _update(state, trial, rho):
        lam, radius = state.damping, state.nu
        norm = tf.where(tf.math.is_finite(trial.scaled_norm), trial.scaled_norm,
                        radius)
        # rho <= 1/4: shrink, by the minimiser of the quadratic through the
        # cost and its slope at the start and the cost at the trial point,
        # kept within [0.1, 0.5] (0.1 when the cost blew up 100-fold).
        actual = trial.actual
        quad = 0.5 * trial.slope / (trial.slope + 0.5 * actual)
        temp = tf.where(actual >= 0, tf.constant(0.5, lam.dtype), quad)
        # NaN counts as blown / as too small. Spelled with `is_nan`: Grappler
        # rewrites a negated comparison ``~(a < b)`` into ``a >= b``, which is
        # False for NaN (the radius then became NaN and the fit froze).
        blown = (tf.math.is_nan(trial.new_cost)
                 | (trial.new_cost >= 100.0 * trial.cost))
        temp = tf.where(blown | tf.math.is_nan(temp) | (temp < 0.1),
                        tf.constant(0.1, lam.dtype), temp)
        temp = tf.minimum(temp, tf.constant(0.5, lam.dtype))
        shrink = DampingState(lam / temp, temp * tf.minimum(radius, 10.0 * norm))
        grow = DampingState(0.5 * lam, 2.0 * norm)
        keep = DampingState(lam, radius)
        small = rho <= 0.25
        big = (rho >= 0.75) | tf.equal(lam, 0.0)
        return tf.nest.map_structure(
            lambda s, g, k: tf.where(small, s, tf.where(big, g, k)),
            shrink, grow, keep)


class Scaling:
    """The damping matrix ``D^2`` of LM: a part with these methods.

    - ``needs_diagonal``: True if it reads ``diag(J^T J)`` (a matrix-free
      solver, which never forms it, then refuses it: `parts.check_parts`).
    - ``init(num_params, dtype) -> scale``: its memory before the first step.
    - ``update(scale, jtj_diag) -> scale``: the memory after seeing this
      iteration's ``diag(J^T J)``.
    - ``diagonal(scale, jtj_diag) -> d2``: ``D^2``'s diagonal for this step.
    - ``get_config() -> dict``: the constructor's arguments.

    Register a new one in `SCALINGS` to make it known by name.
    """

    needs_diagonal = True

    def init(self, num_params, dtype):
        return tf.zeros([num_params], dtype)

    def update(self, scale, jtj_diag):
        raise NotImplementedError

    def diagonal(self, scale, jtj_diag):
        raise NotImplementedError

    def get_config(self):
        return {}


class Levenberg(Scaling):
    """``D^2 = I``: plain ridge damping (invariant to nothing, simple)."""

    needs_diagonal = False  # works with matrix-free solvers

    def get_config(self):
        return {}

    def init(self, num_params, dtype):
        return tf.zeros([num_params], dtype)

    def update(self, scale, jtj_diag):
        del jtj_diag
        return scale

    def diagonal(self, scale, jtj_diag):
        del scale
        return tf.ones_like(jtj_diag)


class Marquardt(Scaling):
    """``D^2 = diag(J^T J)``: invariant to parameter scaling.

    Args:
      monotone: keep the running max over iterations, as MINPACK does (a
        parameter whose column vanishes temporarily keeps a positive
        damping); False: the current diagonal only, so huge column norms from
        a far start do not keep shrinking later steps.
    """

    needs_diagonal = True  # reads diag(J^T J)

    def __init__(self, monotone=True):
        if not isinstance(monotone, bool):
            raise ValueError("Marquardt: `monotone` must be True or False. "
                             f"Received: monotone={monotone!r}")
        self.monotone = monotone

    def get_config(self):
        return {"monotone": self.monotone}

    def init(self, num_params, dtype):
        return tf.zeros([num_params], dtype)

    def update(self, scale, jtj_diag):
        return tf.maximum(scale, jtj_diag) if self.monotone else jtj_diag

    def diagonal(self, scale, jtj_diag):
        del jtj_diag
        tiny = tf.constant(1e-30 if scale.dtype == tf.float64 else 1e-20,
                           scale.dtype)
        return tf.maximum(scale, tiny)


class XScale(Levenberg):
    """``D^2 = 1 / x_scale^2``: fixed characteristic scales of the parameters
    (scipy's array ``x_scale``): the trust region is a sphere in the
    variables ``x / x_scale``.

    Args:
      x_scale: positive floats, one per parameter (flat), or one float.
    """

    def __init__(self, x_scale):
        scale = np.asarray(x_scale, np.float64).reshape(-1)
        if scale.size == 0 or not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            raise ValueError("XScale: `x_scale` must be positive finite numbers "
                             f"(or 'jac'). Received: x_scale={x_scale!r}")
        self.x_scale = scale

    def get_config(self):
        return {"x_scale": self.x_scale.tolist()}

    def init(self, num_params, dtype):
        if self.x_scale.size not in (1, num_params):
            raise ValueError(
                f"XScale: `x_scale` has {self.x_scale.size} values but there are "
                f"{num_params} parameters; pass one value or one per parameter.")
        return super().init(num_params, dtype)

    def diagonal(self, scale, jtj_diag):
        return super().diagonal(scale, jtj_diag) / tf.constant(self.x_scale ** 2,
                                                               jtj_diag.dtype)


class RestartPolicy:
    """The runs of a whole solve: a part with ``phases(controller) ->
    [(scaling, controller), ...]``, run in order by `least_squares`, each
    later one only where the runs before it ended unconverged, from the same
    start (the lower cost is kept). Not a `Scaling`: the Keras optimizer,
    which takes one step per batch, refuses it. ``needs_diagonal``: True if
    any phase's scaling reads ``diag(J^T J)``."""

    needs_diagonal = True

    def phases(self, controller):
        raise NotImplementedError

    def get_config(self):
        return {}


class LevenbergThenMarquardt(RestartPolicy):
    """Levenberg's scaling first, Marquardt's if that run does not converge
    (``scaling="hybrid"``; the class was called ``Hybrid``, still a name of it).

    The two scalings win on different problems. ``D = I`` with a first trust
    radius of ``|x0|`` (scipy ``trf``'s default) crosses the huge column
    norms of far starts (Chebyquad from 10x0 and 100x0, Gulf from x0,
    Box 3-D, Gaussian) where Marquardt's running max of ``diag(J^T J)``,
    taken at the far start, keeps later steps tiny. Marquardt's
    scale-invariant ``D`` wins where the parameters' scales differ by orders
    of magnitude (Meyer, from 0.02 to 4000). A solve with this scaling runs
    the Levenberg phase first; only if that run ends unconverged (iteration
    limit, no acceptable step, or stalled far from a minimum) does a second,
    Marquardt-scaled run start from the same ``x0``, and the lower cost of
    the two is the result. A start that converges costs one run.

    Only whole solves (`least_squares`) can restart; the Keras optimizer,
    which takes one step per batch, refuses it.

    Args:
      factor: the Levenberg phase's first trust radius is ``factor * |x0|``
        (with the trust-region controller; 1.0 as scipy's ``trf``).
    """

    needs_diagonal = True  # the Marquardt phase reads diag(J^T J)

    def __init__(self, factor=1.0):
        _check_positive("Hybrid", factor=factor)  # its name in messages
        self.factor = factor

    def get_config(self):
        return {"factor": self.factor}

    def phases(self, controller):
        """``[(scaling, controller), ...]``: the runs, in order."""
        first = getattr(controller, "with_factor", None)
        return [(Levenberg(), first(self.factor) if first else controller),
                (Marquardt(), controller)]


# The name before it was placed as a restart policy (configs, scripts).
Hybrid = LevenbergThenMarquardt

CONTROLLERS = {"nielsen": Nielsen, "multiply_divide": MultiplyDivide,
               "trust_region": TrustRegion}
# What ``scaling=`` accepts by name: the scalings, and the restart policy
# "hybrid" (`least_squares` only).
SCALINGS = {"levenberg": Levenberg, "marquardt": Marquardt, "hybrid": LevenbergThenMarquardt}


def radius_fit_step(radius, measure, lam, lo, psi_lo, hi, psi_hi, has_hi, side):
    """One step of `TrustRegion`'s fit of lambda to the trust radius
    (Illinois secant on psi = 1/|D step| - 1/radius, MINPACK's bracket),
    elementwise: one problem's scalars or a batch's vectors alike.
    ``measure(lam) -> (step, ok, norm)``. Returns the next candidate and
    bracket, and this solve's ``step, ok, norm, done, used``."""
    used = lam
    step, ok, n = measure(lam)
    done = ok & (tf.abs(n - radius) <= 0.1 * radius)
    psi = 1.0 / n - 1.0 / radius
    left = psi < 0
    psi_hi = tf.where(left & (side < 0), 0.5 * psi_hi, psi_hi)
    psi_lo = tf.where(~left & (side > 0), 0.5 * psi_lo, psi_lo)
    lo, psi_lo = tf.where(left, lam, lo), tf.where(left, psi, psi_lo)
    hi, psi_hi = tf.where(left, hi, lam), tf.where(left, psi_hi, psi)
    has_hi = has_hi | ~left
    side = tf.where(left, -tf.ones_like(side), tf.ones_like(side))
    secant = lo - psi_lo * (hi - lo) / (psi_hi - psi_lo)
    ratio = tf.where(ok, lam * n / radius, 10.0 * lam)
    cand = tf.where(has_hi, secant, ratio)
    inside = (cand > lo) & (cand < hi) & tf.math.is_finite(cand)
    cand = tf.where(inside, cand, tf.maximum(tf.sqrt(lo * hi), 1e-3 * hi))
    return cand, lo, psi_lo, hi, psi_hi, has_hi, side, step, ok, n, done, used
