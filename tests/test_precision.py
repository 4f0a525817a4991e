"""`tf_gradkit.core.precision`: float32-accurate products where TF32 is on.

A GPU is not needed to test this: TF32's effect on a product is rounding
each float32 input to a 10-bit mantissa (`precision.emulate_tf32`), so the
tests run the split on a CPU with that rounding applied inside every
matrix-multiply kernel the module launches, and check that the result keeps
float32's accuracy while the unsplit product does not.

Bounds: float32 dot products of length N have error at most
``N * 2**-24 * (|A|^T |B|)`` elementwise; with rounding errors of random
sign (these fixed, seeded matrices) the error grows like ``sqrt(N)``, and
we allow ``4 sqrt(N) 2**-24``. The split adds at most ``2**-30`` relative
per product. TF32 inputs add up to ``2 * 2**-11`` relative per product,
i.e. about ``sqrt(N) * 2**-11`` after summation: far outside that bound.
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.core import precision

# No Keras here: runs in the Keras 3 process only (`make test`).
pytestmark = pytest.mark.keras_free

U32 = 2.0 ** -24


def _tf32_kernel(a, b, transpose_a=False, transpose_b=False):
    return tf.matmul(precision.emulate_tf32(a), precision.emulate_tf32(b),
                     transpose_a=transpose_a, transpose_b=transpose_b)


@pytest.fixture
def tf32_kernels(monkeypatch):
    """Every matrix-multiply kernel of the module behaves like TF32."""
    monkeypatch.setattr(precision, "_raw_matmul", _tf32_kernel)


def _badly_scaled(n, p, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, p) * np.exp(3 * rng.randn(1, p))).astype("float32")


def _relative_error(got, a, b):
    a64, b64 = a.astype("float64"), b.astype("float64")
    exact = a64.T @ b64
    scale = np.abs(a64).T @ np.abs(b64)
    return float(np.max(np.abs(np.asarray(got, "float64") - exact) / scale))


def test_split_parts_are_exact_and_tf32_representable():
    rng = np.random.RandomState(1)
    # |x| > 2**-100 (TensorFlow flushes float32 denormals to zero on CPUs and
    # GPUs, so parts below 2**-126 vanish; that never matters for a product).
    x = np.concatenate([rng.randn(1000) * 10.0 ** rng.randint(-30, 30, 1000),
                        [0.0, -0.0, 1.0, -3.0, 1e-30, 3.4e38, np.pi]]).astype("float32")
    hi, mid, lo = [p.numpy() for p in precision.split_tf32(tf.constant(x))]
    assert np.array_equal(hi + mid + lo, x)            # exact, in any order
    assert np.array_equal((hi + mid) + lo, x)
    for part in (hi, mid, lo):                         # TF32 changes nothing
        assert np.array_equal(precision.emulate_tf32(part).numpy(), part)
    assert not np.array_equal(precision.emulate_tf32(x).numpy(), x)


def test_emulated_tf32_rounds_to_nearest_ten_bit_mantissa():
    x = tf.constant([1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -12,
                     -(1.0 + 2.0 ** -10 + 2.0 ** -12)], tf.float32)
    # ties to even: 1 + 2^-11 -> 1; 1 + 3 * 2^-11 -> 1 + 2^-9; below half -> 1
    np.testing.assert_array_equal(precision.emulate_tf32(x).numpy(),
                                  [1.0, 1.0 + 2.0 ** -9, 1.0, -(1.0 + 2.0 ** -10)])


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_split_products_keep_float32_accuracy_under_tf32(tf32_kernels, mode):
    a, b = _badly_scaled(1000, 61, 0), _badly_scaled(1000, 37, 1)

    def products():
        with precision.use_split("split"):
            return (precision.gram(tf.constant(a)),
                    precision.matmul(tf.constant(a), tf.constant(b), transpose_a=True))

    gram, cross = compile_fn(products, mode)()
    bound = 4 * np.sqrt(1000) * U32
    assert _relative_error(gram, a, a) < bound
    assert _relative_error(cross, a, b) < bound
    # The same kernels without the split miss the bound: the test can fail.
    with precision.use_split("plain"):
        plain = precision.gram(tf.constant(a))
    assert _relative_error(plain, a, a) > 5 * bound


def test_split_matmul_handles_transposes_and_batches(tf32_kernels):
    rng = np.random.RandomState(2)
    a = rng.randn(3, 20, 9).astype("float32")
    b = rng.randn(3, 7, 20).astype("float32")
    with precision.use_split("split"):
        got = precision.matmul(tf.constant(a), tf.constant(b), transpose_a=True,
                               transpose_b=True).numpy()
    exact = np.einsum("bnp,bqn->bpq", a.astype("float64"), b.astype("float64"))
    scale = np.einsum("bnp,bqn->bpq", np.abs(a).astype("float64"),
                      np.abs(b).astype("float64"))
    assert np.max(np.abs(got - exact) / scale) < 20 * U32


def test_matvec_and_dot_never_launch_a_matmul(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a matrix-multiply kernel was used")

    monkeypatch.setattr(precision, "_raw_matmul", refuse)
    monkeypatch.setattr(tf, "matmul", refuse)
    a = _badly_scaled(50, 7)
    x = np.random.RandomState(3).randn(7).astype("float32")
    y = np.random.RandomState(4).randn(50).astype("float32")
    got = precision.matvec(tf.constant(a), tf.constant(x)).numpy()
    got_t = precision.matvec(tf.constant(a), tf.constant(y), transpose_a=True).numpy()
    np.testing.assert_allclose(got, a.astype("float64") @ x, rtol=0,
                               atol=7 * U32 * float(np.max(np.abs(a) @ np.abs(x))))
    np.testing.assert_allclose(got_t, a.T.astype("float64") @ y, rtol=0,
                               atol=50 * U32 * float(np.max(np.abs(a.T) @ np.abs(y))))
    assert float(precision.dot(tf.constant(y), tf.constant(y))) == pytest.approx(
        float(y.astype("float64") @ y), rel=50 * U32)


def test_auto_splits_only_where_tf32_may_apply(monkeypatch):
    calls = []
    monkeypatch.setattr(precision, "_raw_matmul",
                        lambda a, b, **kw: calls.append(a.shape) or tf.matmul(a, b, **kw))
    a = tf.ones([4, 3])
    monkeypatch.setattr(precision, "tf32_may_apply", lambda: False)
    precision.gram(a)                                   # a CPU: plain
    assert calls == [tf.TensorShape([4, 3])]
    monkeypatch.setattr(precision, "tf32_may_apply", lambda: True)
    calls.clear()
    precision.gram(a)                                   # a GPU with TF32: split
    assert len(calls) == 2 and calls[0][0] == 8
    calls.clear()
    precision.gram(tf.ones([4, 3], tf.float64))         # float64: never TF32
    assert len(calls) == 1


def test_tf32_may_apply_reads_the_device_and_the_switches(monkeypatch):
    has_gpu = bool(tf.config.list_logical_devices("GPU"))
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    assert precision.tf32_may_apply() == (
        has_gpu and tf.config.experimental.tensor_float_32_execution_enabled())
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    assert not precision.tf32_may_apply()


def test_use_split_rejects_unknown_modes():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        with precision.use_split("fast"):
            pass


def _one_lm_iteration(split_mode, kernels=None, monkeypatch=None):
    import tf_gradkit  # noqa: PLC0415

    if kernels is not None:
        monkeypatch.setattr(precision, "_raw_matmul", kernels)
    x = tf.constant(np.linspace(0.0, 4.0, 200), tf.float32)
    y = 3.0 * tf.exp(-0.7 * x) + 0.5 * tf.sin(5.0 * x)
    params = [tf.Variable([1.0, -0.2, 0.1, 4.0], dtype=tf.float32)]

    def residuals():
        a, b, c, w = tf.unstack(params[0])
        return a * tf.exp(b * x) + c * tf.sin(w * x) - y

    with precision.use_split(split_mode):
        tf_gradkit.least_squares(residuals, params, max_iterations=1,
                                 solver="cholesky", jit_compile=False)
    if kernels is not None:
        monkeypatch.undo()
    return params[0].numpy()


def test_lm_step_under_tf32_equals_the_float32_step(monkeypatch):
    # One Levenberg-Marquardt iteration (Cholesky on J^T J) from the same
    # point: with TF32 kernels and the split it matches float32 to a few
    # float32 ulps of the step; the unsplit TF32 step is visibly off.
    from helpers import float32_matmuls  # noqa: PLC0415

    with float32_matmuls():  # on a GPU, "plain" would run TF32 kernels itself
        reference = _one_lm_iteration("plain")
    split = _one_lm_iteration("split", _tf32_kernel, monkeypatch)
    unsplit = _one_lm_iteration("plain", _tf32_kernel, monkeypatch)
    start = np.array([1.0, -0.2, 0.1, 4.0], "float32")
    step = np.abs(reference - start)
    split_error = np.max(np.abs(split - reference) / step)
    assert split_error < 3e-5
    assert np.max(np.abs(unsplit - reference) / step) > 10 * 3e-5
