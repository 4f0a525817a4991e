"""``solve_least_squares``: a least-squares solution that gradients flow
through, by the implicit function theorem (optimistix's default adjoint).

At a minimum ``x*(theta)`` of ``cost(x, theta)`` the gradient in ``x`` is
zero, ``g(x*(theta), theta) = 0``; differentiating that identity gives
``dx*/dtheta = -H^-1 dg/dtheta`` with ``H`` the cost's Hessian in ``x``. A
cotangent ``u`` on ``x*`` therefore maps to ``-(dg/dtheta)^T H^-1 u``: one
P x P Hessian, one solve, and one second-order reverse pass, whatever the
number of iterations the solve took (nothing is unrolled). Parameters held
on a bound do not move with ``theta``: their rows leave ``H`` and their
derivative is 0.
"""

import threading

import numpy as np
import tensorflow as tf

from tf_gradkit.core.lm.least_squares import least_squares
from tf_gradkit.core.lm.robust import RobustLoss

_SCRATCH = {}
_EAGER_LOCK = threading.RLock()


def solve_least_squares(residual_fn, x0, args=(), **options):
    """Minimises the residuals of ``residual_fn(x, *args)`` from ``x0``;
    differentiable in ``args``.

    Args:
      residual_fn: ``fn(x, *args) -> residuals`` (any shape), written with
        TensorFlow ops.
      x0: the start (a tensor or array of any shape; its dtype is the
        solve's, float64 for reference work; a Python list takes the first
        floating ``args`` entry's dtype).
      args: a tuple of tensors the residuals depend on (data, hyper-
        parameters): gradients of anything computed from the solution flow
        to them. Tensors captured by ``residual_fn`` from outside get none.
      **options: `least_squares`'s keywords (``bounds``, ``loss``,
        ``f_scale``, ``x_scale``, tolerances, ``max_iterations``, ...).

    Returns:
      ``(x, result)``: the solution, shaped like ``x0``, and the
      `LeastSquaresResult`. ``x``'s gradient to ``args`` is the implicit
      one; it is exact at a minimum (check ``result.converged``) whose
      Hessian is non-singular in the free parameters.

    Example:

    >>> t = tf.constant([0., 1., 2., 3.], tf.float64)
    >>> y = tf.constant([2.0, 1.2, 0.7, 0.45], tf.float64)
    >>> with tf.GradientTape() as tape:
    ...     tape.watch(y)
    ...     x, _ = solve_least_squares(lambda p, y: p[0] * tf.exp(-p[1] * t) - y,
    ...                                [1.0, 0.1], args=(y,))
    ...     rate = x[1]  # taken under the tape, so the tape records it
    >>> tape.gradient(rate, y).shape  # how the fitted rate moves with each y_i
    TensorShape([4])
    """
    if not callable(residual_fn):
        raise TypeError("solve_least_squares: `residual_fn` must be callable as "
                        f"fn(x, *args). Received: {type(residual_fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError("solve_least_squares: `args` must be a tuple of tensors. "
                        f"Received: {type(args).__name__}")
    args = tuple(tf.convert_to_tensor(a) for a in args)
    typed = hasattr(x0, "dtype")
    x0 = tf.convert_to_tensor(x0 if typed or not np.iscomplexobj(x0)
                              else np.asarray(x0))
    if x0.dtype.is_complex or not (x0.dtype.is_floating or x0.dtype.is_integer):
        raise ValueError("solve_least_squares: `x0` must be real numbers (a float "
                         "or integer tensor, array or list; scipy refuses a complex "
                         f"`x0` too). Received: x0 of dtype {x0.dtype.name}.")
    if not typed or not x0.dtype.is_floating:  # a list: the data's float dtype
        floats = [a.dtype for a in args if a.dtype.is_floating]
        x0 = tf.cast(x0, floats[0] if floats else tf.float32)
    robust = RobustLoss(options.get("loss", "linear"), options.get("f_scale", 1.0))
    if tf.executing_eagerly():
        # Eagerly the solve runs in scratch variables kept per shape and dtype
        # (x and each of ``args``), so a repeated call with the same
        # ``residual_fn`` and shapes finds its compiled solve in
        # `solve_cache.SOLVES` (only the variables' values change) instead of
        # tracing it anew; the lock keeps threads off each other's scratch.
        with _EAGER_LOCK:
            var = _scratch(x0, "x")
            var.assign(x0)
            held = [_scratch(a, i) for i, a in enumerate(args)]
            for v, a in zip(held, args):
                v.assign(a)
            result = least_squares(lambda: residual_fn(var, *held), [var], **options)
            solution = tf.identity(var.read_value())
    else:
        var = _variable_like(x0)
        var.assign(x0)
        fixed = [tf.stop_gradient(a) for a in args]
        # In a graph the solve captures this trace's tensors: a cached solve
        # could never be found again, so none is stored (unless asked).
        options.setdefault("cache", False)
        result = least_squares(lambda: residual_fn(var, *fixed), [var], **options)
        with tf.control_dependencies([result.cost]):
            solution = tf.identity(var.read_value())

    def cost(x, *theta):
        f = tf.cast(tf.reshape(residual_fn(x, *theta), [-1]), x.dtype)
        return robust.cost(f)

    free = tf.reshape(tf.equal(result.active_mask, 0), [-1])

    @tf.custom_gradient
    def attach(x, *theta):
        def grad(upstream):
            return (None,) + tuple(_implicit_vjp(cost, x, theta, upstream, free))
        return tf.identity(x), grad

    return attach(solution, *args), result


def _scratch(value, role):
    """The eager scratch variable of ``role`` ("x" or the index in ``args``)
    for ``value``'s shape and dtype (made on first use, then kept: its
    identity is part of the cached solve's key)."""
    key = ("eager", role, tuple(value.shape.as_list()), value.dtype)
    if key not in _SCRATCH:
        _SCRATCH[key] = tf.Variable(tf.zeros(key[2], key[3]), trainable=False,
                                    name="solve_least_squares_scratch")
    return _SCRATCH[key]


def _variable_like(x0):
    """A variable to solve in: a new one eagerly; in a graph, one per shape
    and dtype made outside it (variables cannot be made per call there)."""
    if tf.executing_eagerly():
        return tf.Variable(x0, trainable=False)
    key = (tuple(x0.shape.as_list()), x0.dtype)
    if None in key[0]:
        raise ValueError("solve_least_squares: inside a tf.function `x0` needs a "
                         f"static shape. Received shape {x0.shape}.")
    if key not in _SCRATCH:
        with tf.init_scope():
            _SCRATCH[key] = tf.Variable(tf.zeros(key[0], key[1]), trainable=False,
                                        name="solve_least_squares_x")
    return _SCRATCH[key]


def _implicit_vjp(cost, x, theta, upstream, free):
    """``-(d g / d theta)^T H^-1 u`` with ``g = d cost / d x`` at ``x``."""
    p = tf.size(x)
    with tf.GradientTape() as outer:
        outer.watch(x)
        g = _gradient_in_x(cost, x, [tf.stop_gradient(t) for t in theta])
    hessian = tf.reshape(outer.jacobian(g, x), [p, p])
    both = free[:, None] & free[None, :]
    hessian = tf.where(both, hessian, tf.eye(p, dtype=x.dtype))
    u = tf.where(free, tf.reshape(tf.cast(upstream, x.dtype), [-1]),
                 tf.zeros([p], x.dtype))
    w = tf.stop_gradient(tf.linalg.solve(hessian, u[:, None])[:, 0])
    with tf.GradientTape() as outer:
        outer.watch(theta)
        pairing = tf.reduce_sum(_gradient_in_x(cost, x, theta) * w)
    grads = outer.gradient(pairing, list(theta),
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [-gr for gr in grads]


def _gradient_in_x(cost, x, theta):
    """The cost's gradient in ``x``, flat, differentiable again."""
    with tf.GradientTape() as inner:
        inner.watch(x)
        c = cost(x, *theta)
    return tf.reshape(inner.gradient(c, x), [-1])
