"""The PHR augmented Lagrangian and its multiplier schedule, in pure TensorFlow.

Problem: minimise ``f(x)`` subject to ``g_i(x) <= 0`` (inequalities) and
``h_j(x) == 0`` (equalities), every constraint value a tensor of any shape
taken elementwise. With multipliers ``lambda`` (one per element) and a penalty
``rho >= 0`` the minimised objective is the Powell-Hestenes-Rockafellar
augmented Lagrangian

    L(x) = f(x) + sum_i [lambda_i s_i + rho/2 s_i^2],  s_i = max(g_i, -lambda_i/rho)
                + sum_j [lambda_j h_j + rho/2 h_j^2]

(for ``rho = 0`` the inequality term is ``lambda_i g_i``; no division by zero
is ever evaluated). Its gradient in ``x`` is ``grad f + sum max(0, lambda_i +
rho g_i) grad g_i + sum (lambda_j + rho h_j) grad h_j``: the multiplier
estimates of the next dual update, which is

    lambda_i <- max(0, lambda_i + rho g_i),    lambda_j <- lambda_j + rho h_j.

The penalty grows (``rho <- min(growth rho, max_penalty)``) when the dual
residual ``max(|s_i|, |h_j|)`` -- zero exactly at a KKT point: feasible and
complementary -- has not fallen below ``decrease`` times its value at the
previous dual update (and exceeds a small ``tolerance``). This is the outer loop of ALGENCAN (Birgin & Martinez,
"Practical Augmented Lagrangian Methods for Constrained Optimization", SIAM
2014, Algorithm 4.1) with the inner minimisation replaced by ``dual_every``
steps of any first-order optimizer, and the constraint values of the dual
update averaged over those steps (so that constraints estimated on
mini-batches are averaged, not sampled).

Everything here is branch-free (``tf.where``), so it runs eagerly, in
``tf.function`` and under ``jit_compile=True``.
"""

import inspect
import numbers
from typing import Any, List, NamedTuple

import numpy as np
import tensorflow as tf

INEQUALITY = "inequality"
EQUALITY = "equality"
KINDS = (INEQUALITY, EQUALITY)
STATE_DTYPE = tf.float32


class ConstraintSpec:
    """One constraint: a callable, its kind and the shape of its value.

    Args:
      fn: returns the constraint value, a tensor of any shape taken
        elementwise. Either ``fn()`` (closing over variables; evaluated by the
        optimizer itself) or ``fn(y_pred, batch)`` (on model outputs; evaluated
        in the train step, see ``AugmentedLagrangian.lagrangian_loss``).
      kind: ``"inequality"`` (``fn(...) <= 0``) or ``"equality"``
        (``fn(...) == 0``).
      name: for metrics and error messages; defaults to ``fn.__name__``.
      shape: shape of the value, hence of its multipliers. Inferred by calling
        ``fn()`` once for closures; ``()`` (a scalar, e.g. a rate) by default
        for output constraints, whose value must not depend on the batch size.

    Raises:
      TypeError: ``fn`` is not callable, or takes neither 0 nor 2 arguments.
      ValueError: ``kind`` is not one of ``KINDS``.
    """

    def __init__(self, fn, kind, name=None, shape=None):
        if not callable(fn):
            raise TypeError(
                "Constraint: `fn` must be callable, fn() or fn(y_pred, batch), "
                f"returning the constraint value. Received: fn={fn!r}")
        if kind not in KINDS:
            raise ValueError(f"Constraint: `kind` must be one of {KINDS}. "
                             f"Received: kind={kind!r}")
        self.fn = fn
        self.kind = kind
        self.name = name or getattr(fn, "__name__", None) or kind
        self.takes_outputs = _takes_outputs(fn)
        self.shape = None if shape is None else tf.TensorShape(shape)
        if self.shape is None and self.takes_outputs:
            self.shape = tf.TensorShape(())

    def __repr__(self):
        return (f"{type(self).__name__}({self.name!r}, kind={self.kind!r}, "
                f"takes_outputs={self.takes_outputs})")


def Inequality(fn, name=None, shape=None):  # pylint: disable=invalid-name  # noqa: N802
    """The constraint ``fn(...) <= 0`` elementwise (see ``ConstraintSpec``)."""
    return ConstraintSpec(fn, INEQUALITY, name=name, shape=shape)


def Equality(fn, name=None, shape=None):  # pylint: disable=invalid-name  # noqa: N802
    """The constraint ``fn(...) == 0`` elementwise (see ``ConstraintSpec``)."""
    return ConstraintSpec(fn, EQUALITY, name=name, shape=shape)


def _takes_outputs(fn):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) not in (0, 2):
        raise TypeError(
            "Constraint: `fn` must take no arguments (closing over variables) "
            "or exactly two, fn(y_pred, batch) (on model outputs). Received a "
            f"function of {len(required)} required arguments: {fn!r}")
    return len(required) == 2


class AugmentedLagrangianState(NamedTuple):
    """Multipliers, penalty and the window the next dual update averages.

    Attributes:
      multipliers: one tensor per constraint, the shape of its value.
      penalty: ``rho``, float32 scalar.
      reference_residual: dual residual at the previous dual update (``inf``
        before the first), the yardstick of the penalty growth test.
      window_sums: per constraint, the sum of its values since the last dual
        update.
      window_steps: float32 scalar, how many values the sums hold.
      dual_updates: int64 scalar, dual updates done.
    """
    multipliers: List[Any]
    penalty: Any
    reference_residual: Any
    window_sums: List[Any]
    window_steps: Any
    dual_updates: Any


def init_augmented_lagrangian(shapes, initial_penalty):
    """The state before any step: zero multipliers, ``rho = initial_penalty``."""
    zeros = [tf.zeros(s, STATE_DTYPE) for s in shapes]
    return AugmentedLagrangianState(
        multipliers=zeros, penalty=tf.constant(initial_penalty, STATE_DTYPE),
        reference_residual=tf.constant(float("inf"), STATE_DTYPE),
        window_sums=[tf.zeros(s, STATE_DTYPE) for s in shapes],
        window_steps=tf.constant(0.0, STATE_DTYPE),
        dual_updates=tf.constant(0, tf.int64))


def _f32(x):
    return tf.cast(tf.convert_to_tensor(x), STATE_DTYPE)


def _max_or_zero(x):
    """``max(0, max(x))``; 0 for an empty ``x``."""
    return tf.reduce_max(tf.concat([tf.zeros([1], x.dtype), tf.reshape(x, [-1])], 0))


def _clipped_inequality(g, multiplier, penalty):
    """``s = max(g, -lambda/rho)``, and ``g`` itself where ``rho == 0``."""
    positive = penalty > 0
    safe = tf.where(positive, penalty, tf.ones_like(penalty))
    return tf.where(positive, tf.maximum(g, -multiplier / safe), g)


def augmented_terms(values, kinds, multipliers, penalty):
    """The augmented-Lagrangian terms added to the loss (float32 scalar).

    Args:
      values: constraint values, one tensor per constraint (any float dtype;
        differentiable: the terms' gradient flows into them).
      kinds: ``"inequality"`` or ``"equality"`` per constraint.
      multipliers: one tensor per constraint, shaped like its value.
      penalty: ``rho >= 0``.

    Returns:
      ``sum lambda s + rho/2 s^2`` over inequality elements with
      ``s = max(g, -lambda/rho)``, plus ``sum lambda h + rho/2 h^2`` over
      equality elements. Finite for ``rho = 0``.
    """
    penalty = tf.stop_gradient(_f32(penalty))
    total = tf.constant(0.0, STATE_DTYPE)
    for value, kind, multiplier in zip(values, kinds, multipliers):
        value = _f32(value)
        multiplier = tf.stop_gradient(_f32(multiplier))
        if kind == INEQUALITY:
            value = _clipped_inequality(value, multiplier, penalty)
        total += tf.reduce_sum(multiplier * value + 0.5 * penalty * tf.square(value))
    return total


def dual_update(values, kinds, multipliers, penalty):
    """Dual ascent: ``max(0, lambda + rho g)`` and ``lambda + rho h``."""
    penalty = _f32(penalty)
    out = []
    for value, kind, multiplier in zip(values, kinds, multipliers):
        new = _f32(multiplier) + penalty * _f32(value)
        out.append(tf.maximum(new, 0.0) if kind == INEQUALITY else new)
    return out


def dual_residual(values, kinds, multipliers, penalty):
    """``max(|max(g, -lambda/rho)|, |h|)`` over all elements (0 if none).

    Zero exactly when the point is feasible and complementary for these
    multipliers; equal to the size of the next dual step divided by ``rho``.
    With ``rho = 0`` it measures infeasibility only, ``max(g, 0)``.
    """
    penalty = _f32(penalty)
    worst = tf.constant(0.0, STATE_DTYPE)
    for value, kind, multiplier in zip(values, kinds, multipliers):
        value = _f32(value)
        if kind == INEQUALITY:
            clipped = _clipped_inequality(value, _f32(multiplier), penalty)
            value = tf.where(penalty > 0, clipped, tf.maximum(value, 0.0))
        worst = tf.maximum(worst, _max_or_zero(tf.abs(value)))
    return worst


def feasibility_violation(values, kinds):
    """``max(max(g, 0), |h|)`` over all elements: 0 when feasible."""
    worst = tf.constant(0.0, STATE_DTYPE)
    for value, kind in zip(values, kinds):
        value = _f32(value)
        value = tf.maximum(value, 0.0) if kind == INEQUALITY else tf.abs(value)
        worst = tf.maximum(worst, _max_or_zero(value))
    return worst


def grow_penalty(penalty, residual, reference, growth, max_penalty, decrease,
                 tolerance=0.0):
    """``min(growth rho, max_penalty)`` if the residual stalled, else ``rho``.

    Stalled: ``residual > decrease * reference`` and ``residual > tolerance``
    (below the tolerance the residual is round-off or sampling noise, and a
    larger penalty would only worsen the inner problem's conditioning).
    """
    penalty = _f32(penalty)
    residual = _f32(residual)
    stalled = tf.logical_and(residual > decrease * _f32(reference),
                             residual > tolerance)
    return tf.where(stalled, tf.minimum(penalty * growth, max_penalty), penalty)


def observe(values, kinds, state, dual_every, growth, max_penalty, decrease,
            tolerance=0.0):
    """Adds one step's constraint values to the window; closes it every
    ``dual_every`` steps with a dual update and the penalty test.

    Args:
      values: this step's constraint values (gradients are not needed).
      kinds: kind per constraint.
      state: an ``AugmentedLagrangianState`` (tensors or variables).
      dual_every: steps per dual update (Python int >= 1).
      growth, max_penalty, decrease, tolerance: the penalty rule, see
        ``grow_penalty``.

    Returns:
      The new ``AugmentedLagrangianState`` (tensors), branch-free.
    """
    values = [tf.stop_gradient(_f32(v)) for v in values]
    sums = [_f32(s) + v for s, v in zip(state.window_sums, values)]
    steps = _f32(state.window_steps) + 1.0
    close = steps >= float(dual_every)
    means = [s / steps for s in sums]
    multipliers = [_f32(m) for m in state.multipliers]
    penalty = _f32(state.penalty)
    residual = dual_residual(means, kinds, multipliers, penalty)
    new_multipliers = dual_update(means, kinds, multipliers, penalty)
    new_penalty = grow_penalty(penalty, residual, state.reference_residual,
                               growth, max_penalty, decrease, tolerance)
    keep = lambda new, old: tf.where(close, new, old)  # noqa: E731
    return AugmentedLagrangianState(
        multipliers=[keep(n, o) for n, o in zip(new_multipliers, multipliers)],
        penalty=keep(new_penalty, penalty),
        reference_residual=keep(residual, _f32(state.reference_residual)),
        window_sums=[keep(tf.zeros_like(s), s) for s in sums],
        window_steps=keep(tf.zeros_like(steps), steps),
        dual_updates=tf.convert_to_tensor(state.dual_updates)
        + tf.cast(close, tf.int64))


# ------------------------------------------------------------- validation
OWNER = "AugmentedLagrangian"


def _number(name, value, ok, accepted):
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not np.isfinite(value) or not ok(value)):
        raise ValueError(f"{OWNER}: `{name}` must be {accepted}. "
                         f"Received: {name}={value!r}")
    return float(value)


def validate_arguments(constraints, dual_every, initial_penalty, growth,
                       max_penalty, decrease, tolerance):
    """Returns the constraint specs; raises a clear error for bad input."""
    if callable(constraints) or isinstance(constraints, ConstraintSpec):
        constraints = [constraints]
    if not isinstance(constraints, (list, tuple)) or not constraints:
        raise ValueError(
            f"{OWNER}: `constraints` must be a non-empty list of "
            "Inequality(fn) / Equality(fn) specs. Received: "
            f"constraints={constraints!r}")
    specs = []
    for i, c in enumerate(constraints):
        if isinstance(c, ConstraintSpec):
            specs.append(c)
        elif isinstance(c, tuple) and len(c) == 2:
            fn, kind = c
            if kind not in KINDS:
                raise ValueError(
                    f"{OWNER}: the kind of `constraints[{i}]` must be one of "
                    f"{KINDS}. Received: {kind!r}")
            if not callable(fn):
                raise TypeError(
                    f"{OWNER}: `constraints[{i}]` must hold a callable. "
                    f"Received: {fn!r}")
            specs.append(ConstraintSpec(fn, kind))
        elif callable(c):
            raise TypeError(
                f"{OWNER}: `constraints[{i}]` is a bare callable; say its "
                "kind: Inequality(fn) for fn(...) <= 0 or Equality(fn) for "
                f"fn(...) == 0. Received: {c!r}")
        else:
            raise TypeError(
                f"{OWNER}: `constraints[{i}]` must be Inequality(fn), "
                f"Equality(fn) or a (fn, kind) pair. Received: {c!r}")
    if isinstance(dual_every, bool) or not isinstance(dual_every, int) or dual_every < 1:
        raise ValueError(f"{OWNER}: `dual_every` must be an integer >= 1 "
                         f"(optimizer steps per dual update). Received: "
                         f"dual_every={dual_every!r}")
    _number("initial_penalty", initial_penalty, lambda v: v >= 0,
            "a finite number >= 0")
    _number("growth", growth, lambda v: v > 1, "a finite number > 1")
    _number("max_penalty", max_penalty, lambda v: v >= initial_penalty,
            f"a finite number >= initial_penalty ({initial_penalty})")
    _number("decrease", decrease, lambda v: 0 < v < 1, "a number in (0, 1)")
    _number("tolerance", tolerance, lambda v: v >= 0, "a finite number >= 0")
    return specs
