"""LevenbergMarquardt's default ``solver="auto"``: where a step has fewer
residuals than parameters it solves the N x N system ``J D^-2 J^T`` (the
dual), which gives the same step as the P x P normal equations; elsewhere
(more residuals, chunks, the generalised Gauss-Newton matrix) it is the
Cholesky solver. The choice is visible in ``solver_used``."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn, mode_with_function_slow
from helpers import float32_matmuls, weights_of

mode = mode_with_function_slow()


@pytest.fixture(autouse=True)
def _float32_products():
    with float32_matmuls():
        yield


def _wide(K, rows, width=6, seed=0):
    """A float64 3-width-2 tanh MLP (P = 5 width + 2) and ``rows`` examples."""
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, 3)
    y = np.c_[np.sin(x[:, 0]) * x[:, 1], np.cos(x[:, 2])]
    K.utils.set_random_seed(seed)
    model = K.Sequential([K.Input((3,), dtype="float64"),
                          K.layers.Dense(width, activation="tanh", dtype="float64"),
                          K.layers.Dense(2, dtype="float64")])
    return model, x, y


def _fit_steps(K, gk, mode, solver, rows, steps=3, sample_weight=None, **kwargs):
    model, x, y = _wide(K, rows)
    opt = gk.LevenbergMarquardt(model, solver=solver, **kwargs)
    model.compile(optimizer=opt, loss="mse", run_eagerly=mode == "eager",
                  jit_compile=mode == "jit")
    before = weights_of(model)
    model.fit(x, y, sample_weight=sample_weight, batch_size=rows, epochs=steps,
              shuffle=False, verbose=0)
    return opt, before, weights_of(model)


def _assert_same_steps(after, after_ref, before):
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(after_ref, before))
    assert moved > 1e-3  # it trained
    for a, a_ref in zip(after, after_ref):
        # Float64 round-off of two factorisations of the same step, over 3
        # steps: far below a step's size (an unscaled or wrongly damped dual
        # differs by the size of a step).
        np.testing.assert_allclose(a, a_ref, atol=1e-9 * moved, rtol=0)


def test_auto_takes_the_dual_step_where_residuals_are_fewer(K, gk, mode):
    # 8 examples x 2 outputs = 16 residuals, 37 parameters.
    opt, before, after = _fit_steps(K, gk, mode, "auto", rows=8)
    ref, _, after_ref = _fit_steps(K, gk, mode, "cholesky", rows=8)
    assert opt.solver_used == "dual"
    assert ref.solver_used == "cholesky"
    _assert_same_steps(after, after_ref, before)


@pytest.mark.parametrize("case", ["more_residuals", "chunks"])
def test_auto_is_cholesky_elsewhere(K, gk, case):
    # 40 x 2 = 80 residuals for 37 parameters: the P x P system is the
    # smaller; chunks sum J^T J, which the Cholesky solve reads.
    rows, kwargs = (40, {}) if case == "more_residuals" else (8, {"chunk_size": 3})
    opt, before, after = _fit_steps(K, gk, "eager", "auto", rows=rows, **kwargs)
    assert opt.solver_used == "cholesky"
    _, _, after_ref = _fit_steps(K, gk, "eager", "cholesky", rows=rows, **kwargs)
    _assert_same_steps(after, after_ref, before)


def test_auto_with_sample_weights_and_levenberg_scaling(K, gk):
    # A zero weight makes a zero row of J (its dual unknown is 0).
    kwargs = {"sample_weight": np.r_[0.0, np.linspace(0.5, 2.0, 7)],
              "scaling": "levenberg"}
    opt, before, after = _fit_steps(K, gk, "jit", "auto", rows=8, **kwargs)
    assert opt.solver_used == "dual"
    _, _, after_ref = _fit_steps(K, gk, "jit", "cholesky", rows=8, **kwargs)
    _assert_same_steps(after, after_ref, before)


@pytest.mark.parametrize("mode_", ["eager", "jit"])
def test_minimize_auto_equals_cholesky(K, gk, mode_):
    results = []
    for solver in ("auto", "cholesky"):
        model, x, y = _wide(K, rows=8)
        opt = gk.LevenbergMarquardt(solver=solver)

        def residuals(model=model):
            return model(x) - y

        step = compile_fn(lambda opt=opt, model=model, residuals=residuals: opt.minimize(
            residuals, model.trainable_variables, model=model), mode_)
        before = weights_of(model)
        for _ in range(3):
            step()
        results.append((opt.solver_used, weights_of(model)))
    (used, after), (used_ref, after_ref) = results
    assert (used, used_ref) == ("dual", "cholesky")
    _assert_same_steps(after, after_ref, before)


def test_auto_is_saved_and_explicit_solvers_stay(gk):
    opt = gk.LevenbergMarquardt()
    assert opt.get_config()["solver"]["name"] == "auto"
    assert opt.solver_used is None
    again = gk.LevenbergMarquardt.from_config(opt.get_config())
    assert type(again.solver).__name__ == "Auto"
    with pytest.raises(ValueError, match="solver"):
        gk.LevenbergMarquardt(solver="primal")


def test_dual_solve_equals_the_normal_equations():
    # The push-through identity, directly on the solvers, in float64.
    from tf_gradkit.core.lm import linear_solvers as solvers  # noqa: PLC0415
    from tf_gradkit.core.lm import linearize as lin_lib  # noqa: PLC0415
    rng = np.random.RandomState(1)
    jac = tf.constant(rng.randn(5, 9))
    r = tf.constant(rng.randn(5))
    d2 = tf.constant(rng.uniform(0.5, 3.0, 9))
    light = lin_lib.from_rows(r, jac, True, normal_matrix=False)
    full = lin_lib.from_rows(r, jac, True)
    assert light.jtj is None
    np.testing.assert_allclose(light.jtj_diag, np.diag(full.jtj.numpy()), rtol=1e-12)
    np.testing.assert_allclose(light.jtr, full.jtr, rtol=1e-12)
    v = tf.constant(rng.randn(9))
    np.testing.assert_allclose(light.matvec(v), full.jtj.numpy() @ v.numpy(), rtol=1e-10)
    for damping in (1e-3, 1.0, 1e3):
        step, ok = solvers.NormalEquationsDual().solve(light, damping, d2)
        ref, ok_ref = solvers.Cholesky().solve(full, damping, d2)
        assert bool(ok) and bool(ok_ref)
        np.testing.assert_allclose(step, ref, rtol=1e-8, atol=1e-12)
    assert isinstance(solvers.Auto().for_shape(5, 9), solvers.NormalEquationsDual)
    assert isinstance(solvers.Auto().for_shape(9, 9), solvers.Cholesky)
    assert isinstance(solvers.Auto().for_shape(None, 9), solvers.Cholesky)
