"""`tf_gradkit.core.spd`: positive definite solves, both kernels.

Bound: Cholesky is backward stable, so the computed x solves a system
perturbed by ``c n u |A|`` and ``|x - x*| / |x*| <= c n u cond(A)`` (u the
dtype's unit round-off; c a small constant, and rounding errors of random
sign make it ``sqrt(n)`` in practice). The matrices here are ``M^T M / m + I``
with cond(A) below 10, so ``20 n u cond(A)`` is a bound with room, and
errors of the wrong algorithm (a missing term, a transposed factor) are O(1).
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import SEED, compile_fn
from tf_gradkit.core import spd

# No Keras here: runs in the Keras 3 process only (`make test`).
pytestmark = pytest.mark.keras_free

MODES = ("eager", "graph", "jit")


def _system(n, k, dtype, seed):
    rng = np.random.RandomState(seed)
    m = rng.randn(3 * n, n)
    a = m.T @ m / (3 * n) + np.eye(n)
    b = rng.randn(n, k)
    return a.astype(dtype), b.astype(dtype)


def _solve(a, b, mode, kernel):
    def fn(a, b):
        with spd.use_kernel(kernel):
            return spd.solve(a, b)
    x, ok = compile_fn(fn, mode)(tf.constant(a), tf.constant(b))
    return x.numpy(), bool(ok)


@pytest.mark.parametrize("kernel", ["loop", "library"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (61, 1), (30, 3)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_solution_matches_float64_reference(kernel, mode, n, k, dtype):
    a, b = _system(n, k, dtype, SEED + n)
    a64, b64 = a.astype("float64"), b.astype("float64")
    exact = np.linalg.solve(a64, b64)
    x, ok = _solve(a, b, mode, kernel)
    assert ok
    assert x.dtype == np.dtype(dtype)
    unit = np.finfo(dtype).eps / 2
    bound = 20 * n * unit * np.linalg.cond(a64)
    assert np.max(np.abs(x - exact)) / np.max(np.abs(exact)) <= bound


@pytest.mark.parametrize("kernel", ["loop", "library"])
@pytest.mark.parametrize("mode", MODES)
def test_not_positive_definite_reports_failure_with_zeros(kernel, mode):
    a, b = _system(6, 2, "float32", SEED)
    indefinite = a.copy()
    indefinite[3, 3] = -1.0                      # a negative pivot on the way
    with_nan = a.copy()
    with_nan[0, 5] = with_nan[5, 0] = np.nan
    for bad in (indefinite, with_nan, np.zeros_like(a)):
        x, ok = _solve(bad, b, mode, kernel)
        assert not ok
        assert np.array_equal(x, np.zeros_like(b))


def test_loop_kernel_runs_under_xla_on_a_cpu_only_up_to_its_size_limit():
    seen = {}

    def probe(mode, size):
        def fn():
            seen[(mode, size)] = spd.uses_loop(size)
            return tf.constant(0.0)
        compile_fn(fn, mode)()

    for mode in MODES:
        for size in (61, spd.LOOP_MAX_SIZE + 1):
            probe(mode, size)
    only_cpus = not tf.config.list_logical_devices("GPU") and \
        not tf.config.list_logical_devices("TPU")
    assert seen == {("eager", 61): False, ("eager", spd.LOOP_MAX_SIZE + 1): False,
                    ("graph", 61): False, ("graph", spd.LOOP_MAX_SIZE + 1): False,
                    ("jit", 61): only_cpus, ("jit", spd.LOOP_MAX_SIZE + 1): False}


@pytest.mark.parametrize("a_shape,b_shape,dtypes,match", [
    ((3, 4), (3, 1), ("float32", "float32"), r"`a` must be a square matrix"),
    ((3,), (3, 1), ("float32", "float32"), r"`a` must be a square matrix"),
    ((3, 3), (4, 1), ("float32", "float32"), r"`rhs` must be a matrix \[n, k\]"),
    ((3, 3), (3,), ("float32", "float32"), r"`rhs` must be a matrix \[n, k\]"),
    ((3, 3), (3, 1), ("float32", "float64"), r"share one floating dtype.*float32 and float64"),
    ((3, 3), (3, 1), ("int32", "int32"), r"share one floating dtype"),
])
def test_bad_shapes_and_dtypes_are_refused_by_name(a_shape, b_shape, dtypes, match):
    a = tf.ones(a_shape, dtypes[0])
    b = tf.ones(b_shape, dtypes[1])
    with pytest.raises(ValueError, match=match):
        spd.solve(a, b)


def test_use_kernel_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match=r"`mode` must be one of .*Received: mode='lapack'"):
        with spd.use_kernel("lapack"):
            pass
