"""Box bounds ``lower <= x <= upper`` for `least_squares`: a projected
Levenberg-Marquardt step with an active set.

Each iteration (1) freezes the parameters that sit on a bound with the
gradient pushing them out of the box (their columns leave the damped system,
their step is exactly 0), (2) solves the damped system for the others, and
(3) projects the step onto the box, ``d <- clip(x + d, lower, upper) - x``.
The gain ratio, the trust radius and every stopping test then measure the
projected step, so the iterates never leave the box and a solution on a
bound is found exactly on it (scipy's ``trf`` keeps iterates strictly
inside and ends within round-off of it). With no bound touched this is the
unbounded iteration, step for step.

Reference: C. Kanzow, N. Yamashita, M. Fukushima, "Levenberg-Marquardt
methods with strong local convergence properties for solving nonlinear
equations with convex constraints", J. Comput. Appl. Math. 172 (2004).
"""

import numpy as np
import tensorflow as tf

from tf_gradkit.core.lm import linear_solvers as solvers_lib


class Bounds:
    """Flat ``lower`` and ``upper`` tensors over the concatenated parameters.

    Built by `from_argument`; ``-inf``/``inf`` entries are unbounded.
    """

    def __init__(self, lower, upper):
        self.lower, self.upper = lower, upper

    @classmethod
    def from_argument(cls, bounds, var_list, dtype):
        """Reads scipy's ``bounds=(lb, ub)``: each side a scalar, a flat
        array over all parameters (the variables' elements in order), or a
        list with one scalar or variable-shaped array per variable; or an
        object with ``lb`` and ``ub`` (``scipy.optimize.Bounds``)."""
        if hasattr(bounds, "lb") and hasattr(bounds, "ub"):
            bounds = (bounds.lb, bounds.ub)
        if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2):
            raise ValueError(
                "least_squares: `bounds` must be a pair (lower, upper), each a "
                "scalar, an array over all parameters or a list with one entry "
                f"per variable. Received: bounds={bounds!r}")
        sizes = [v.shape.num_elements() for v in var_list]
        lower, upper = (cls._side(side, name, var_list, sizes)
                        for side, name in zip(bounds, ("lower", "upper")))
        if np.isnan(lower).any() or np.isnan(upper).any() or not (lower < upper).all():
            bad = int(np.argmax(np.isnan(lower) | np.isnan(upper) | (lower >= upper)))
            raise ValueError(
                "least_squares: every lower bound must be below its upper bound "
                f"(as in scipy). Received: lower[{bad}]={lower[bad]}, "
                f"upper[{bad}]={upper[bad]} (flat parameter index {bad}).")
        return cls(tf.constant(lower, dtype), tf.constant(upper, dtype))

    @staticmethod
    def _side(side, name, var_list, sizes):
        total = sum(sizes)
        if isinstance(side, (list, tuple)) and len(side) == len(var_list) > 1:
            parts = []
            for i, (s, v, n) in enumerate(zip(side, var_list, sizes)):
                a = np.asarray(s, np.float64)
                if a.ndim and a.size != n:
                    raise ValueError(
                        f"least_squares: `bounds` {name} entry {i} has {a.size} values "
                        f"but variable {i} ({v.name}) has {n} elements.")
                parts.append(np.broadcast_to(a.reshape(-1) if a.ndim else a, [n]))
            return np.concatenate(parts).astype(np.float64)
        a = np.asarray(side, np.float64)
        if a.ndim == 0:
            return np.full([total], float(a))
        if a.size != total:
            raise ValueError(
                f"least_squares: `bounds` {name} must be a scalar, {total} values "
                "(one per parameter) or one entry per variable. "
                f"Received {a.size} values.")
        return a.reshape(-1)

    def check_feasible(self, x):
        """Raises (eagerly) when ``x`` lies outside the box, as scipy does."""
        x = np.asarray(x)
        outside = (x < self.lower.numpy()) | (x > self.upper.numpy())
        if outside.any():
            i = int(np.argmax(outside))
            raise ValueError(
                "least_squares: the starting point is outside `bounds` (as scipy: "
                f"`x0` is infeasible): parameter {i} is {x[i]}, bounds "
                f"[{self.lower.numpy()[i]}, {self.upper.numpy()[i]}]. "
                "Start inside the box.")

    def clip(self, x):
        return tf.clip_by_value(x, self.lower, self.upper)

    def project(self, x, step):
        """The step projected onto the box: ``clip(x + d) - x``."""
        return self.clip(x + step) - x

    def frozen(self, x, gradient):
        """Parameters on a bound whose descent direction ``-gradient`` leaves
        the box."""
        return (((x <= self.lower) & (gradient > 0))
                | ((x >= self.upper) & (gradient < 0)))

    def coleman_li(self, x, gradient):
        """Coleman-Li's scaling ``v`` (scipy's first-order optimality under
        bounds is ``max |g v|``): the distance to the upper bound where
        ``g < 0``, to the lower bound where ``g > 0``, 1 where that bound is
        infinite (or ``g = 0``)."""
        one = tf.ones_like(x)
        v = tf.where((gradient < 0) & tf.math.is_finite(self.upper),
                     self.upper - x, one)
        return tf.where((gradient > 0) & tf.math.is_finite(self.lower),
                        x - self.lower, v)

    def blind(self, x, now, largest, eps):
        """``[..., P]`` bool: the parameters that sit on a bound where the residuals
        no longer depend on it (its Jacobian column, ``now``, has vanished
        to ``sqrt(eps)`` of its ``largest`` norm over the run). Its gradient
        is then 0, so the point passes every first-order test, yet the
        Gauss-Newton model is blind there: a step that landed on the bound
        (scipy's gh-7117 hyperbola, ``c = 0`` in ``sqrt(u + c^2 / 4)``) can
        end the fit far above the minimum that the interior reaches; the
        solve then continues from inside the box (`whole_solve.off_bounds`)."""
        on_bound = (x <= self.lower) | (x >= self.upper)
        vanished = (largest > 0) & (now <= tf.sqrt(tf.constant(eps, x.dtype)) * largest)
        return on_bound & vanished

    def inside(self, x, x0, which):
        """``x`` with the parameters in ``which`` moved halfway from their
        bound back to ``x0`` (where a blind bound stopped the fit)."""
        bound = tf.where(x <= self.lower, self.lower, self.upper)
        return tf.where(which, bound + 0.5 * (x0 - bound), x)

    def active_mask(self, x):
        """scipy's ``active_mask``: -1 on the lower bound, 1 on the upper, 0
        inside (int32)."""
        return (tf.cast(x >= self.upper, tf.int32)
                - tf.cast(x <= self.lower, tf.int32))


def freeze(lin, frozen):
    """``lin`` with the ``frozen`` parameters' columns taken out: their rows
    and columns of ``J^T J`` become a positive diagonal (their own diagonal,
    so the damping scale is unchanged) and their ``J^T r`` entries 0, so any
    damped solve gives them a step of exactly 0."""
    dtype = lin.jtr.dtype
    keep = tf.cast(~frozen, dtype)
    hold = tf.cast(frozen, dtype)
    jtr = lin.jtr * keep
    jtj = lin.jtj
    if jtj is not None:
        diag = tf.linalg.diag_part(jtj)
        own = tf.where(diag > 0, diag, tf.ones_like(diag))
        jtj = jtj * keep[:, None] * keep[None, :] + tf.linalg.diag(hold * own)
    jacobian, residuals = lin.jacobian, lin.residuals
    if jacobian is not None:
        norms = tf.sqrt(tf.reduce_sum(tf.square(jacobian), axis=0))
        norms = tf.where(norms > 0, norms, tf.ones_like(norms))
        jacobian = tf.concat([jacobian * keep[None, :],
                              tf.linalg.diag(hold * norms)], axis=0)
        residuals = tf.concat([residuals, tf.zeros_like(jtr)], axis=0)
    matvec = lin.matvec
    if matvec is not None:
        inner = matvec

        def matvec(v):
            return inner(v * keep) * keep + hold * v
    return solvers_lib.Linearization(cost=lin.cost, jtj=jtj, jtr=jtr,
                                     residuals=residuals, jacobian=jacobian,
                                     matvec=matvec)
