"""Exact projections (tf_gradkit.core.projections and .matrix_projections):
exactness, idempotence, feasibility, dtypes and shapes. Pure TensorFlow."""

import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import isotonic_regression
from scipy.optimize import minimize

from conftest import compile_fn
from tf_gradkit.core import matrix_projections as MP
from tf_gradkit.core import projections as P

# No Keras here: runs in the Keras 3 process only (`make test`).
pytestmark = pytest.mark.keras_free


def _rand(shape, seed=0, scale=2.0):
    return tf.constant(np.random.RandomState(seed).randn(*shape) * scale, tf.float32)


def test_nonneg_and_box_closed_forms(mode):
    x = _rand((4, 5))
    lo, hi = -0.5, np.linspace(0.1, 1.0, 5).astype("float32")
    nonneg, box = compile_fn(lambda: (P.project_nonneg(x), P.project_box(x, lo, hi)),
                             mode)()
    np.testing.assert_array_equal(nonneg.numpy(), np.maximum(x.numpy(), 0))
    np.testing.assert_array_equal(box.numpy(), np.clip(x.numpy(), lo, hi))


def test_l2_ball_and_max_norm(mode):
    x = _rand((6, 3))
    ball, cols = compile_fn(lambda: (P.project_l2_ball(x, 1.5),
                                     P.project_max_norm(x, 0.7, axis=0)), mode)()
    assert np.linalg.norm(ball.numpy()) == pytest.approx(1.5, rel=1e-6)
    np.testing.assert_allclose(ball.numpy(), x.numpy() * 1.5 / np.linalg.norm(x.numpy()),
                               rtol=1e-6)
    norms = np.linalg.norm(cols.numpy(), axis=0)
    assert np.all(norms <= 0.7 * (1 + 1e-6))
    inside = tf.constant([[0.1, 0.2]])
    np.testing.assert_array_equal(P.project_l2_ball(inside, 1.0).numpy(), inside.numpy())


def _brute_force(x, feasible_constraints):
    """Nearest feasible point by SLSQP (float64): the reference for sorts."""
    res = minimize(lambda z: 0.5 * np.sum((z - x) ** 2), np.zeros_like(x),
                   jac=lambda z: z - x, constraints=feasible_constraints,
                   method="SLSQP", options={"ftol": 1e-14, "maxiter": 500})
    return res.x


def test_simplex_matches_brute_force(mode):
    x = _rand((3, 6), seed=1)
    got = compile_fn(lambda: P.project_simplex(x, axis=-1), mode)().numpy()
    for row, proj in zip(x.numpy().astype("float64"), got):
        ref = _brute_force(row, [{"type": "eq", "fun": lambda z: np.sum(z) - 1.0},
                                 {"type": "ineq", "fun": lambda z: z}])
        # SLSQP converges to ~1e-7; float32 sorts and sums add ~1e-7.
        np.testing.assert_allclose(proj, ref, atol=1e-5)
        assert proj.min() >= 0 and proj.sum() == pytest.approx(1.0, abs=1e-6)


def test_l1_ball_matches_brute_force(mode):
    x = _rand((7,), seed=2)
    got = compile_fn(lambda: P.project_l1_ball(x, 1.0), mode)().numpy()
    xd = x.numpy().astype("float64")
    # Reference: the soft-threshold form with theta found by bisection on
    # sum(max(|x| - theta, 0)) = radius (200 halvings: float64-exact).
    lo, hi = 0.0, np.abs(xd).max()
    for _ in range(200):
        theta = 0.5 * (lo + hi)
        if np.sum(np.maximum(np.abs(xd) - theta, 0)) > 1.0:
            lo = theta
        else:
            hi = theta
    ref = np.sign(xd) * np.maximum(np.abs(xd) - hi, 0)
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert np.abs(got).sum() <= 1.0 + 1e-6


def test_unit_norm_and_mask():
    x = tf.constant([[3.0, 0.0], [4.0, 0.0]])
    out = P.project_unit_norm(x, axis=0).numpy()
    np.testing.assert_allclose(out[:, 0], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(out[:, 1], [1.0, 0.0])   # zero column -> e_1
    mask = tf.constant([[1, 0], [0, 1]])
    np.testing.assert_array_equal(P.apply_mask(x, mask).numpy(), [[3.0, 0.0], [0.0, 0.0]])


PROJECTIONS = {
    "nonneg": P.project_nonneg,
    "box": lambda x: P.project_box(x, -0.3, 0.4),
    "l2": lambda x: P.project_l2_ball(x, 1.0),
    "l1": lambda x: P.project_l1_ball(x, 1.0),
    "max_norm": lambda x: P.project_max_norm(x, 0.5, axis=0),
    "unit_norm": lambda x: P.project_unit_norm(x, axis=0),
    "simplex": lambda x: P.project_simplex(x, axis=-1),
}


@pytest.mark.parametrize("name", sorted(PROJECTIONS))
@pytest.mark.parametrize("shape", [(5,), (3, 3, 2, 4)])
def test_idempotent_on_vectors_and_conv_kernels(name, shape):
    project = PROJECTIONS[name]
    once = project(_rand(shape, seed=3))
    twice = project(once)
    np.testing.assert_allclose(twice.numpy(), once.numpy(), atol=1e-6)


@pytest.mark.parametrize("name", sorted(PROJECTIONS))
def test_bfloat16_stays_bfloat16_and_feasible(name):
    x = tf.cast(_rand((4, 4), seed=4), tf.bfloat16)
    out = PROJECTIONS[name](x)
    assert out.dtype == tf.bfloat16
    again = PROJECTIONS[name](out)
    # bfloat16 keeps 8 bits: feasibility to ~1e-2 relative.
    np.testing.assert_allclose(tf.cast(again, tf.float32).numpy(),
                               tf.cast(out, tf.float32).numpy(), atol=3e-2)


def test_scalar_inputs():
    assert float(P.project_nonneg(tf.constant(-2.0))) == 0.0
    assert float(P.project_box(tf.constant(5.0), 0.0, 1.0)) == 1.0
    assert float(P.project_l2_ball(tf.constant(-3.0), 2.0)) == pytest.approx(-2.0)


# ---- tf_gradkit.core.matrix_projections: orthogonal, monotone, PSD ----------

EPS32 = np.finfo("float32").eps   # 1.19e-7


def _with_singular_values(m, n, singular_values, seed=0):
    """A float64 m x n matrix U diag(s) V^T with random orthonormal U, V, and
    its exact polar factor U V^T (the reference for project_orthogonal)."""
    rng = np.random.RandomState(seed)
    k = min(m, n)
    u, _ = np.linalg.qr(rng.randn(m, k))
    v, _ = np.linalg.qr(rng.randn(n, k))
    return (u * singular_values) @ v.T, u @ v.T


@pytest.mark.parametrize("m,n", [(7, 4), (4, 7), (5, 5)])
def test_orthogonal_is_the_polar_factor(mode, m, n):
    x, polar = _with_singular_values(m, n, np.linspace(0.5, 3.0, min(m, n)))
    xt = tf.constant(x, tf.float32)
    got = compile_fn(lambda: MP.project_orthogonal(xt), mode)().numpy().astype("float64")
    # Condition number 6: the polar factor is perturbed by ~cond * eps32 by the
    # float32 rounding of x and the iteration (~1e-6); 5e-6 leaves room for sqrt(n).
    np.testing.assert_allclose(got, polar, atol=5e-6)
    gram = got.T @ got if m >= n else got @ got.T
    np.testing.assert_allclose(gram, np.eye(min(m, n)), atol=5e-6)


def test_orthogonal_random_gaussian_matches_numpy_svd():
    x = np.random.RandomState(5).randn(40, 24)
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    got = MP.project_orthogonal(tf.constant(x, tf.float32)).numpy()
    # cond(x) ~ 10 here: errors ~ cond * eps32 ~ 1e-6.
    np.testing.assert_allclose(got, u @ vt, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 3, 2, 4), (1, 1, 3, 16)])
def test_orthogonal_conv_kernels_act_as_flattened_matrices(shape):
    x = _rand(shape, seed=6)
    got = MP.project_orthogonal(x).numpy()
    assert got.shape == shape
    flat = x.numpy().reshape(-1, shape[-1]).astype("float64")
    u, _, vt = np.linalg.svd(flat, full_matrices=False)
    # (18, 4): columns orthonormal; (3, 16): rows orthonormal. cond <= ~10.
    np.testing.assert_allclose(got.reshape(flat.shape), u @ vt, atol=1e-5)


def test_orthogonal_is_idempotent_and_handles_ill_conditioning():
    x, polar = _with_singular_values(12, 6, np.logspace(0, -4, 6), seed=7)
    once = MP.project_orthogonal(tf.constant(x, tf.float32))
    # cond 1e4: the float32 input itself pins the polar factor only to
    # ~cond * eps32 ~ 1e-3, but orthonormality is restored to ~sqrt(n) eps32.
    np.testing.assert_allclose(once.numpy(), polar, atol=3e-3)
    q = once.numpy().astype("float64")
    np.testing.assert_allclose(q.T @ q, np.eye(6), atol=2e-6)
    # An orthonormal input has cond 1: one projection moves it by ~eps32 only.
    np.testing.assert_allclose(MP.project_orthogonal(once).numpy(), once.numpy(), atol=1e-6)


def test_orthogonal_rank_deficient_and_zero_inputs():
    # Exact zero singular values stay zero: the partial isometry U_r V_r^T.
    x = tf.constant([[2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(MP.project_orthogonal(x).numpy(),
                               [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], atol=1e-6)
    zero = MP.project_orthogonal(tf.zeros([4, 3]))
    np.testing.assert_array_equal(zero.numpy(), np.zeros([4, 3]))


def test_orthogonal_rejects_vectors():
    with pytest.raises(ValueError, match=r"rank >= 2.*Received shape \(5,\)"):
        MP.project_orthogonal(tf.zeros([5]))


def _pava(y):
    """Pool-adjacent-violators in float64: the textbook O(n) reference."""
    blocks = []                                   # [sum, count] per block
    for v in y:
        blocks.append([v, 1])
        while len(blocks) > 1 and (blocks[-2][0] / blocks[-2][1]
                                   > blocks[-1][0] / blocks[-1][1]):
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return np.concatenate([np.full(c, s / c) for s, c in blocks])


def test_monotone_small_cases_by_hand():
    np.testing.assert_allclose(MP.project_monotone(tf.constant([1.0, 3.0, 2.0, 4.0])),
                               [1.0, 2.5, 2.5, 4.0])
    np.testing.assert_allclose(MP.project_monotone(tf.constant([3.0, 2.0, 1.0])),
                               [2.0, 2.0, 2.0])
    np.testing.assert_allclose(
        MP.project_monotone(tf.constant([1.0, 3.0, 2.0]), increasing=False),
        [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(MP.project_monotone(tf.constant([[5.0]])), [[5.0]])


@pytest.mark.parametrize("n", [2, 7, 64])
def test_monotone_matches_pava_and_scipy(mode, n):
    x = _rand((3, n), seed=n)
    got = compile_fn(lambda: MP.project_monotone(x, axis=-1), mode)().numpy()
    for row, proj in zip(x.numpy().astype("float64"), got):
        ref = _pava(row)
        np.testing.assert_allclose(ref, isotonic_regression(row).x, atol=1e-12)
        # Each output is one block mean of <= n float32 entries (|x| <~ 6):
        # rounding bound ~ log2(n) * eps32 * 6 for tree sums, plus the
        # division; 1e-5 covers n = 64 with room.
        np.testing.assert_allclose(proj, ref, atol=1e-5)
        assert np.all(np.diff(proj) >= 0)


def test_monotone_axis_decreasing_and_conv_kernels(mode):
    x = _rand((3, 3, 2, 5), seed=8)
    got = compile_fn(lambda: MP.project_monotone(x, axis=0, increasing=False),
                     mode)().numpy()
    moved = np.moveaxis(x.numpy().astype("float64"), 0, -1).reshape(-1, 3)
    ref = np.stack([-_pava(-row) for row in moved])
    ref = np.moveaxis(ref.reshape(3, 2, 5, 3), -1, 0)
    np.testing.assert_allclose(got, ref, atol=1e-6)   # blocks of <= 3: ~eps32 * |x|
    assert np.all(np.diff(got, axis=0) <= 0)


def test_monotone_is_idempotent_on_sorted_input():
    x = tf.sort(_rand((50,), seed=9))
    # A sorted input is its own projection; the selected block mean may be
    # a few-term mean of equal-ish numbers, off by an ulp or two at most.
    np.testing.assert_allclose(MP.project_monotone(x).numpy(), x.numpy(), rtol=4 * EPS32)


def test_monotone_rejects_scalars_and_bad_axes():
    with pytest.raises(ValueError, match=r"rank >= 1.*Received shape \(\)"):
        MP.project_monotone(tf.constant(1.0))
    with pytest.raises(ValueError, match=r"`axis` must be in \[-2, 2\)"):
        MP.project_monotone(tf.zeros([2, 3]), axis=2)


def _psd_reference(x):
    sym = 0.5 * (x + np.swapaxes(x, -1, -2))
    vals, vecs = np.linalg.eigh(sym)
    return (vecs * np.maximum(vals, 0)[..., None, :]) @ np.swapaxes(vecs, -1, -2)


@pytest.mark.parametrize("shape", [(5, 5), (2, 3, 4, 4)])
def test_psd_matches_numpy_eigh(mode, shape):
    x = _rand(shape, seed=10)
    got = compile_fn(lambda: MP.project_psd(x), mode)().numpy()
    ref = _psd_reference(x.numpy().astype("float64"))
    # eigh is backward stable: error ~ n * eps32 * |x|_2 ~ 5 * 1.2e-7 * 8 ~ 5e-6.
    np.testing.assert_allclose(got, ref, atol=2e-5)
    np.testing.assert_array_equal(got, np.swapaxes(got, -1, -2))
    assert np.linalg.eigvalsh(got.astype("float64")).min() >= -2e-5


def test_psd_is_idempotent_and_keeps_psd_inputs():
    a = _rand((6, 3), seed=11).numpy()
    psd = tf.constant(a @ a.T)                    # rank 3, PSD
    once = MP.project_psd(psd)
    # eigh's backward error is ~ n * eps32 * |x|_2 (|x|_2 ~ 40 here, ~3e-5);
    # zero eigenvalues come back as +- that and are clipped. 4x for room.
    tol = 4 * 6 * EPS32 * np.linalg.norm(psd.numpy(), 2)
    np.testing.assert_allclose(once.numpy(), psd.numpy(), atol=tol)
    np.testing.assert_allclose(MP.project_psd(once).numpy(), once.numpy(), atol=tol)
    np.testing.assert_allclose(MP.project_psd(tf.constant([[1.0, 0.0], [0.0, -2.0]])),
                               [[1.0, 0.0], [0.0, 0.0]], atol=1e-7)


def test_psd_rejects_non_square():
    with pytest.raises(ValueError, match=r"square matrices.*Received shape \(3, 4\)"):
        MP.project_psd(tf.zeros([3, 4]))


MATRIX_PROJECTIONS = {
    "orthogonal": (MP.project_orthogonal,
                   lambda z: np.abs(z.T @ z - np.eye(z.shape[1])).max()),
    "monotone": (MP.project_monotone, lambda z: np.maximum(0.0, -np.diff(z, axis=-1).min())),
    "psd": (MP.project_psd, lambda z: np.maximum(0.0, -np.linalg.eigvalsh(z).min())),
}


@pytest.mark.parametrize("name", sorted(MATRIX_PROJECTIONS))
def test_matrix_projections_bfloat16(name):
    project, violation = MATRIX_PROJECTIONS[name]
    x = tf.cast(_rand((6, 6), seed=12, scale=0.5), tf.bfloat16)
    out = project(x)
    assert out.dtype == tf.bfloat16
    # Computed in float32, then rounded to bfloat16 (8 bits, eps 2^-8 ~ 4e-3
    # relative): feasibility holds up to that rounding of O(1) entries.
    assert violation(tf.cast(out, tf.float64).numpy()) < 3e-2
    ref = project(tf.cast(x, tf.float32))
    np.testing.assert_allclose(tf.cast(out, tf.float32).numpy(), ref.numpy(), atol=2e-2)
