"""Levenberg-Marquardt over a support: pruned weights are left out of the
Jacobian and the damped system, and the result equals LM on the dense model
restricted to that support (a reduced parameter vector)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn, mode_with_function_slow


# "function" (tf.function without XLA) runs under `make test-slow` only: each
# test taking `mode` keeps its "jit" case, the graph-mode run of the same
# assertion (conftest.mode_with_function_slow).
mode = mode_with_function_slow()


def problem(K, seed=0, keep=0.3):
    rng = np.random.RandomState(seed)
    x = rng.randn(120, 4).astype("float32")
    y = np.sin(x @ rng.randn(4, 1)).astype("float32")
    mask = (rng.rand(4, 12) < keep).astype("float32")
    model = K.Sequential([K.Input((4,)), K.layers.Dense(12, activation="tanh"),
                          K.layers.Dense(1)])
    w = [rng.randn(*v.shape).astype("float32") * 0.5 for v in model.get_weights()]
    w[0] = w[0] * mask
    model.set_weights(w)
    return x, y, mask, model, w


def give_masks(lm, model, mask_var):
    """What `MaskAware` does: hand LM a `Masks`
    value holding the first kernel's mask."""
    from tf_gradkit.core.masks import Masks  # noqa: PLC0415
    lm.masks = Masks(lm._var_key)
    lm.masks.attach(pairs=[(model.layers[0].kernel, mask_var)])


def reduced_reference(gk, x, y, mask, w, iterations, mode):
    idx = np.flatnonzero(mask.ravel())
    theta = tf.Variable(w[0].ravel()[idx])
    b0, k1, b1 = (tf.Variable(v) for v in w[1:])

    def residuals():
        kernel = tf.reshape(tf.scatter_nd(idx[:, None], theta, [mask.size]), mask.shape)
        return tf.tanh(x @ kernel + b0) @ k1 + b1 - y

    lm = gk.LevenbergMarquardt()
    step = compile_fn(lambda: lm.minimize(residuals, [theta, b0, k1, b1]), mode)
    for _ in range(iterations):
        cost = step()
    kernel = np.zeros(mask.size, "float32")
    kernel[idx] = theta.numpy()
    return float(cost), [kernel.reshape(mask.shape), b0.numpy(), k1.numpy(), b1.numpy()]


@pytest.mark.parametrize("solver", ["cholesky", "qr"])
def test_support_step_equals_lm_on_the_restricted_problem(K, gk, mode, solver):
    if solver == "qr" and mode != "eager":
        pytest.skip("QR's support path is the same gather as Cholesky's; "
                    "compiled modes are covered by cholesky")
    x, y, mask, model, w = problem(K)
    lm = gk.LevenbergMarquardt(solver=solver)
    give_masks(lm, model, tf.Variable(mask))
    step = compile_fn(lambda: lm.minimize(lambda: model(x) - y,
                                          model.trainable_variables), mode)
    iterations = 4
    for _ in range(iterations):
        cost = step()
        # Pruned weights are never moved: exactly zero after every iteration.
        assert np.all(model.layers[0].kernel.numpy()[mask == 0] == 0.0)
    ref_cost, ref = reduced_reference(gk, x, y, mask, w, iterations, mode)
    # The same k x k system from the same float32 Jacobian columns: only the
    # order of summation in J^T J differs (one-hot tangents vs a scatter in
    # the residual), ~1e-6 relative per iteration; XLA reassociates more.
    tol = 1e-3 if mode == "jit" else 1e-4
    np.testing.assert_allclose(float(cost), ref_cost, rtol=tol)
    for got, want in zip(model.get_weights(), ref):
        np.testing.assert_allclose(got, want, atol=tol)


def test_system_size_is_the_number_of_unpruned_weights(K, gk):
    x, y, mask, model, _ = problem(K, keep=0.2)
    lm = gk.LevenbergMarquardt()
    give_masks(lm, model, tf.Variable(mask))
    lm.minimize(lambda: model(x) - y, model.trainable_variables)
    dense = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert lm._step_support.size == dense - int((mask == 0).sum())


def test_traced_step_pads_when_more_weights_are_pruned(K, gk):
    x, y, mask, model, _ = problem(K, keep=0.5)
    mask_var = tf.Variable(mask)
    lm = gk.LevenbergMarquardt()
    give_masks(lm, model, mask_var)
    step = tf.function(lambda: lm.minimize(lambda: model(x) - y,
                                           model.trainable_variables))
    step()
    # Prune more after tracing: the traced system keeps its size, the newly
    # pruned weights are frozen like the padding.
    fewer = mask * (np.arange(mask.size).reshape(mask.shape) % 2)
    mask_var.assign(fewer)
    kernel = model.layers[0].kernel
    kernel.assign(kernel * fewer)
    for _ in range(3):
        step()
    assert np.all(kernel.numpy()[fewer == 0] == 0.0)
    assert np.any(kernel.numpy()[fewer == 1] != 0.0)


def test_matrix_free_solver_with_masks_is_a_clear_error(K, gk):
    x, y, mask, model, _ = problem(K)
    lm = gk.LevenbergMarquardt(solver="cg", scaling="levenberg")
    give_masks(lm, model, tf.Variable(mask))
    with pytest.raises(ValueError, match="solves over the unpruned weights"):
        lm.minimize(lambda: model(x) - y, model.trainable_variables)
