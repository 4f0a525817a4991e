"""Exact projections (tf_gradkit.core.projections): exactness, idempotence,
feasibility, dtypes and shapes. Pure TensorFlow."""

import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import minimize

from conftest import compile_fn
from tf_gradkit.core import projections as P


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
