"""`tf_gradkit.core.forward_columns`: Jacobian columns by forward mode over
the traced ops, each column's tangent only where its parameter reaches.

Reference: TensorFlow's own forward mode (`tf.autodiff.ForwardAccumulator`,
one unit tangent per column) on the same function in the same trace. Both
apply the chain rule to the same ops; the rules here may order a product or
a quotient differently, so the columns agree to a few units of round-off of
the largest entry (1e-12 relative in float64, 1e-5 in float32: 2^-52 and
2^-23 times the few operations of each chain), while a missing or wrong rule
(a dropped term, a wrong sign, a transposed product) is an O(1) error.
"""

import numpy as np
import pytest
import tensorflow as tf
from helpers import record_rule_columns

from tf_gradkit.core import forward_columns
from tf_gradkit.core.lm import linearize
from tf_gradkit.core.lm import small

# No Keras here: runs in the Keras 3 process only (`make test`).
pytestmark = pytest.mark.keras_free

B, N, P = 6, 9, 5
_RNG = np.random.default_rng(3)
T = np.linspace(0.1, 3.0, N)
XY = _RNG.normal(size=(2, N))
W = _RNG.normal(size=(P, N))


def _models(dtype):
    t, xy, w = (tf.constant(a, dtype) for a in (T, XY, W))
    return {
        # Gpufit's 2-D Gaussian and the bi-exponential decay, as the
        # benchmarks write them (slices of p, Pow, RealDiv, Exp)
        "gaussian": lambda p: p[:, 0:1] * tf.exp(
            -((xy[0][None] - p[:, 1:2]) ** 2 + (xy[1][None] - p[:, 2:3]) ** 2)
            / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5],
        "decay": lambda p: (p[:, 0:1] * tf.exp(-t / p[:, 1:2])
                            + p[:, 2:3] * tf.exp(-t / p[:, 3:4]) + p[:, 4:5]),
        # the parameters unstacked, shrinking slices, Sin/Sqrt/Tanh
        "unstack": lambda p: (lambda a, b, c, d, e: a[:, None] * tf.sin(b[:, None] * t)
                              + tf.sqrt(c[:, None] ** 2 + 1.0) * tf.tanh(d[:, None] - t)
                              - e[:, None] * p[:, 1][:, None])(*tf.unstack(p, axis=1)),
        # the parameters read whole: a product with a matrix, Maximum
        "matmul": lambda p: tf.matmul(p, w) + tf.maximum(p[:, 0:1], 1.0) * t,
        # tf.split, Abs, Pow with a parameter exponent, Log1p, Cos, a where
        "split": lambda p: (lambda s: s[0] * t ** s[1] + tf.math.log1p(s[2] ** 2) * tf.cos(t)
                            + tf.where(t > 1.0, s[3] * t, s[4]))(
                                tf.split(tf.abs(p) + 0.5, 5, axis=1)),
        # Einsum, a reduction over the parameters, Square
        "einsum": lambda p: tf.einsum("bp,pn->bn", tf.square(p), w) / (
            1.0 + tf.reduce_sum(p, axis=1, keepdims=True)),
        # two-wide and negative slices, an ellipsis, a gather of columns,
        # Sigmoid, Erf, Reciprocal, Log
        "slices": lambda p: (tf.reduce_sum(p[:, 0:2] * p[..., -2:], axis=1, keepdims=True) * t
                             + tf.gather(p, [4, 0, 2], axis=1) @ w[:3]
                             + tf.nn.sigmoid(p[:, 2:3] * t) + tf.math.erf(p[:, 3:4])
                             + tf.math.reciprocal(p[:, 4:5] + 3.0)
                             + tf.math.log(p[:, 1:2] + t)),
        # a reshape and transpose round trip, a cast, Mean, Minimum
        "shapes": lambda p: tf.transpose(tf.reshape(tf.transpose(
            tf.cast(tf.minimum(p, 1.2), dtype)[:, :, None] * w[None]), [N, P, B]),
            [2, 1, 0])[:, 0, :] - tf.reduce_mean(p, axis=-1, keepdims=True),
        # stop_gradient (no tangent through it, as TensorFlow's), a cast to
        # integers (0), check_numerics
        "stops": lambda p: (p[:, 0:1] * tf.stop_gradient(p[:, 1:2]) * t
                            + tf.cast(tf.cast(10.0 * p[:, 2:3], tf.int32), dtype)
                            + _checked(p[:, 3:4]) * t + p[:, 4:5]),
        # the other rules: concat, stack, tile, slice, expand_dims, a batched
        # product, squeeze, broadcast_to, squared_difference, add_n,
        # bias_add, split by sizes, unstack of a derived tensor, an
        # identity and a split of the parameters, Expm1, Rsqrt, Tan, Sinh,
        # Cosh, Cos, Atan, Softplus
        "more": lambda p: _more(p, t, dtype),
    }


def _more(p, t, dtype):
    q = p * 0.5 + 0.25
    c = tf.concat([q[:, 0:1], q[:, 1:2] * 2.0], axis=1)
    st = tf.stack([q[:, 2], q[:, 3]], axis=1)
    cut = tf.slice(tf.tile(c, [1, 2]), [0, 1], [B, 2])
    product = tf.matmul(tf.expand_dims(st * cut, -1), tf.ones([B, 1, N], dtype))
    wide = tf.broadcast_to(q[:, 4:5], [B, N])
    total = tf.add_n([tf.squeeze(product[:, :1, :], axis=1),
                      tf.math.squared_difference(wide, t), tf.nn.bias_add(wide, t)])
    first, second = tf.split(cut, [1, 1], axis=1)
    u, v = tf.unstack(c, axis=1)
    a0, a1, _, _, a4 = tf.split(tf.identity(p), 5, axis=1)
    return (tf.identity(total) + first * t + second + u[:, None] * v[:, None] * t
            + a0 * tf.cos(a1 * t) + tf.atan(a4 * t)
            + tf.math.expm1(q[:, 0:1]) * tf.math.rsqrt(q[:, 1:2] + 1.0)
            + tf.tan(q[:, 2:3]) * tf.sinh(q[:, 3:4]) + tf.cosh(q[:, 4:5]) * tf.atan(t)
            + tf.nn.softplus(q[:, 0:1] - t))


def _checked(v):
    return tf.debugging.check_numerics(v, "v")


def _reference(fn, x):
    columns = []
    for j in range(P):
        tangent = tf.one_hot(tf.fill([B], j), P, dtype=x.dtype)
        with tf.autodiff.ForwardAccumulator(x, tangent) as acc:
            r = fn(x)
        columns.append(acc.jvp(r, unconnected_gradients=tf.UnconnectedGradients.ZERO))
    return r, tf.stack(columns, axis=-1)


@pytest.mark.parametrize("dtype, rtol", [(tf.float64, 1e-12), (tf.float32, 1e-5)])
@pytest.mark.parametrize("jit", [False, True], ids=["function", "jit"])
@pytest.mark.parametrize("name", list(_models(tf.float64)))
def test_columns_equal_tensorflows_forward_mode(name, jit, dtype, rtol):
    fn = _models(dtype)[name]
    x = tf.constant(_RNG.uniform(0.5, 1.5, (B, P)), dtype)

    @tf.function(jit_compile=jit)
    def both(x):
        found = forward_columns.columns(fn, x)
        assert found is not None, f"{name}: an op without a rule"
        residuals, columns = found
        return residuals, tf.stack(columns, axis=-1), _reference(fn, x)

    residuals, jac, (ref_residuals, ref_jac) = (
        tf.nest.map_structure(lambda t: t.numpy(), both(x)))
    np.testing.assert_array_equal(residuals, ref_residuals)
    assert np.all(np.isfinite(jac)) and np.abs(ref_jac).max() > 0
    np.testing.assert_allclose(jac, ref_jac, rtol=0,
                               atol=rtol * np.abs(ref_jac).max())


def test_a_parameter_that_does_not_reach_an_op_gets_an_exact_zero_there():
    """r = a t + b exp(800 t): exp overflows to inf in float64 at t = 3, so
    TensorFlow's forward mode gives a's column 0 * inf = NaN there; a's
    derivative is t, exactly."""
    t = tf.constant(T)

    def fn(p):
        return p[:, 0:1] * t + p[:, 1:2] * tf.exp(800.0 * t)

    x = tf.constant(_RNG.uniform(0.5, 1.5, (B, 2)))
    columns = tf.function(lambda x: forward_columns.columns(fn, x)[1])(x)
    np.testing.assert_array_equal(columns[0].numpy(), np.broadcast_to(T, (B, N)))
    reference = tf.function(lambda x: _reference_two(fn, x))(x).numpy()
    assert np.isnan(reference[:, -1]).all()   # what TensorFlow's gives


def _reference_two(fn, x):
    with tf.autodiff.ForwardAccumulator(x, tf.one_hot(tf.zeros([B], tf.int32), 2,
                                                      dtype=x.dtype)) as acc:
        r = fn(x)
    return acc.jvp(r)


def test_an_op_without_a_rule_falls_back_to_tensorflows_forward_mode():
    """tf.reverse has no rule here: `columns` gives None, and
    `small.jacobian_columns` the Jacobian by TensorFlow's forward mode. So
    do complex arithmetic (no rules: never a dropped tangent) and a nested
    function."""
    w = tf.constant(W)

    def fn(p):
        return tf.reverse(p, [1]) @ w

    def complex_fn(p):
        return tf.math.real(tf.complex(p, tf.zeros_like(p)) ** 2) @ w

    def nested_fn(p):
        return tf.function(lambda q: q * q)(p) @ w

    x = tf.constant(_RNG.uniform(0.5, 1.5, (B, P)))
    for f in (fn, complex_fn, nested_fn):
        assert tf.function(lambda x: forward_columns.columns(f, x) is None)(x)

    @tf.function
    def jacobian(x):
        return tf.stack(small.jacobian_columns(fn, x)[1], axis=-1)

    expected = np.broadcast_to(W[::-1].T[None], (B, N, P))
    np.testing.assert_allclose(jacobian(x).numpy(), expected, rtol=1e-15)


def test_eagerly_none():
    assert forward_columns.columns(lambda p: 2.0 * p, tf.ones([B, P])) is None


# `variable_columns`: the parameters are variables a zero-argument function
# reads (as `least_squares` and the Keras optimizer have them), each entry a
# column. Reference: reverse mode (`GradientTape.jacobian`), the same
# tolerances as above.
XD = _RNG.normal(size=(N, 2))


def _variable_models(dtype):
    t, xd = tf.constant(T, dtype), tf.constant(XD, dtype)
    data = tf.Variable(_RNG.normal(size=N), dtype=dtype)   # read, not a parameter
    p = tf.Variable([1.3, 0.7, -0.2], dtype=dtype)
    a, b, c = (tf.Variable(v, dtype=dtype) for v in (0.9, 1.1, 0.3))
    kernel = tf.Variable(_RNG.normal(size=(2, 2)), dtype=dtype)
    bias = tf.Variable([0.1, -0.4], dtype=dtype)
    q = tf.Variable([0.5, 1.5, -1.0, 2.0], dtype=dtype)
    return {
        # least_squares's usual decay: one vector, read by scalar slices
        "vector": ([p], lambda: p[0] * tf.exp(-p[1] * t) + p[2] - data),
        # scalar variables
        "scalars": ([a, b, c], lambda: a * tf.sin(b * t) + c * t ** 2),
        # a dense layer: a matrix and a bias read whole (MatMul, BiasAdd),
        # the output reshaped, a tanh
        "dense": ([kernel, bias], lambda: tf.reshape(tf.tanh(
            tf.nn.bias_add(xd @ kernel, bias)), [-1])),
        # a vector unstacked, and reshaped into a matrix; read twice
        "unstack": ([q], lambda: (lambda w, x, y, z: w * t + x * t ** 2 + y)(
            *tf.unstack(q)) + tf.reduce_sum(xd @ tf.reshape(q, [2, 2]), axis=1)),
        # two-wide and negative slices of one variable, a scalar beside it
        "slices": ([q, a], lambda: tf.reduce_sum(q[1:3]) * t + q[-1] * tf.exp(-a * t)
                   + tf.reduce_sum(q[:2] * q[2:]) - data),
    }


def _reverse(fn, variables):
    with tf.GradientTape() as tape:
        out = tf.reshape(fn(), [-1])
    jac = tape.jacobian(out, variables, experimental_use_pfor=True)
    return out, tf.concat([tf.reshape(j, [out.shape[0], -1]) for j in jac], axis=1)


@pytest.mark.parametrize("dtype, rtol", [(tf.float64, 1e-12), (tf.float32, 1e-5)])
@pytest.mark.parametrize("jit", [False, True], ids=["function", "jit"])
@pytest.mark.parametrize("name", list(_variable_models(tf.float64)))
def test_variable_columns_equal_reverse_mode(name, jit, dtype, rtol):
    variables, fn = _variable_models(dtype)[name]

    @tf.function(jit_compile=jit)
    def both():
        found = forward_columns.variable_columns(fn, variables)
        assert found is not None, f"{name}: not covered"
        out, columns = found
        return (tf.reshape(out, [-1]), tf.stack([tf.reshape(c, [-1]) for c in columns],
                                                axis=1), _reverse(fn, variables))

    out, jac, (ref_out, ref_jac) = tf.nest.map_structure(lambda t: t.numpy(), both())
    np.testing.assert_array_equal(out, ref_out)
    assert jac.shape == (ref_out.size, sum(v.shape.num_elements() for v in variables))
    assert np.all(np.isfinite(jac)) and np.all(np.abs(ref_jac).max(axis=0) > 0)
    np.testing.assert_allclose(jac, ref_jac, rtol=0, atol=rtol * np.abs(ref_jac).max())


def test_a_variable_that_does_not_reach_an_op_gets_an_exact_zero_there():
    """As for `columns`: a t + b exp(800 t), a's column exactly t where
    TensorFlow's forward mode gives 0 * inf = NaN."""
    t = tf.constant(T)
    a, b = tf.Variable(0.5, dtype=tf.float64), tf.Variable(1.0, dtype=tf.float64)
    columns = tf.function(lambda: forward_columns.variable_columns(
        lambda: a * t + b * tf.exp(800.0 * t), [a, b])[1])()
    np.testing.assert_array_equal(columns[0].numpy(), T)


def test_variables_used_other_than_read_fall_back():
    """None (the caller takes TensorFlow's forward mode) where a variable
    is read inside a nested function, gathered straight from its handle, or
    not read at all, and under a distribution strategy: a read the walk
    cannot see would otherwise give a zero column."""
    t = tf.constant(T)
    p = tf.Variable([1.0, 2.0], dtype=tf.float64)
    other = tf.Variable(3.0, dtype=tf.float64)
    nested = tf.function(lambda: p[0] * t)
    cases = {
        "nested function": ([p], lambda: nested() + p[1]),
        "gather": ([p], lambda: tf.gather(p, [1, 0])[0] * t),
        "not read": ([p, other], lambda: p[0] * t + p[1]),
    }
    for name, (variables, fn) in cases.items():
        got = tf.function(lambda: forward_columns.variable_columns(fn, variables))()
        assert got is None, name
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert tf.function(lambda: forward_columns.variable_columns(
            lambda: p[0] * t, [p]))() is None
    assert forward_columns.variable_columns(lambda: p[0] * t, [p]) is None   # eagerly


def test_linearize_takes_the_rules_for_few_parameters(monkeypatch):
    """`linearize.residuals_and_jacobian` (least_squares, the Keras
    optimizer) takes these columns up to `RULE_COLUMNS_MAX_PARAMS`
    parameters, and TensorFlow's forward mode above: the same Jacobian."""
    taken = record_rule_columns(monkeypatch)
    t = tf.constant(T)
    for size in (3, linearize.RULE_COLUMNS_MAX_PARAMS + 1):
        p = tf.Variable(np.linspace(0.5, 1.5, size))
        powers = tf.constant(np.arange(size, dtype=np.float64))

        def fn():
            return tf.reduce_sum(p[:, None] * t[None] ** powers[:, None], axis=0) + tf.exp(
                -p[0] * t)

        taken.clear()
        residuals, jac = tf.function(
            lambda: linearize.residuals_and_jacobian(fn, [p], tf.float64))()
        assert taken == ([True] if size <= linearize.RULE_COLUMNS_MAX_PARAMS else [])
        _, ref = tf.function(lambda: _reverse(fn, [p]))()
        np.testing.assert_allclose(jac.numpy(), ref.numpy(), rtol=0,
                                   atol=1e-12 * np.abs(ref.numpy()).max())
