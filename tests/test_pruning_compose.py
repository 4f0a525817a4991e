"""Pruning composed with the other optimizers: Projected projects within the
mask's support, Levenberg-Marquardt solves for unpruned weights only (tfmot,
so tf_keras only)."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR, compile_fn

if FLAVOUR != "tf_keras":
    pytest.skip("tfmot prunes tf_keras models only (run with TF_USE_LEGACY_KERAS=1)",
                allow_module_level=True)

import tf_keras

tfmot = pytest.importorskip("tensorflow_model_optimization")
sparsity = tfmot.sparsity.keras

from tf_gradkit import constraints as C  # noqa: E402
from tf_gradkit import pruning  # noqa: E402
from tf_gradkit.tf_keras import LevenbergMarquardt, Projected  # noqa: E402


def pruned_mlp(final=0.6, seed=1):
    base = tf_keras.Sequential([tf_keras.Input((6,)),
                                tf_keras.layers.Dense(10, activation="tanh", name="hid"),
                                tf_keras.layers.Dense(3, name="out")])
    rng = np.random.RandomState(seed)
    base.set_weights([rng.randn(*w.shape).astype("float32") * 0.6
                      for w in base.get_weights()])
    return sparsity.prune_low_magnitude(
        base, pruning_schedule=sparsity.ConstantSparsity(final, 0, frequency=1))


def data(n=96, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 6).astype("float32")
    return x, np.tanh(x @ rng.randn(6, 3)).astype("float32")


def masks_of(model):
    return {w.name: (w, m) for layer in model.layers
            for w, m, _ in getattr(layer, "pruning_vars", [])}


@pytest.mark.parametrize("constraint, check", [
    (C.UnitNorm(axis=0), lambda w: np.abs(np.linalg.norm(w, axis=0) - 1).max()),
    (C.NonNeg(), lambda w: np.maximum(0.0, -float(w.min()))),
])
def test_projected_inside_mask_aware_is_pruned_and_feasible(mode, constraint, check):
    x, y = data()
    model = pruned_mlp()
    opt = pruning.MaskAware(
        Projected(tf_keras.optimizers.Adam(0.05), {"hid/kernel": constraint}),
        model=model)
    stepper = pruning.PruningStepper(model, opt)

    def step(xb, yb):
        stepper.before_step()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = compile_fn(step, mode)
    for i in range(0, 96, 16):
        step(x[i:i + 16], y[i:i + 16])
        kernel, mask = masks_of(model)["hid/kernel:0"]
        w, m = kernel.numpy(), mask.numpy()
        assert np.all(w[m == 0] == 0.0)           # pruned, exactly
        # Feasible in the weights the model uses (projected within the
        # support): float32 normalisation is exact to a few ulps.
        assert check(w) < 1e-6
    assert float(np.mean(m == 0)) > 0.5


def test_levenberg_marquardt_on_a_pruned_model(mode):
    x, y = data()
    model = pruned_mlp(final=0.8)
    lm = LevenbergMarquardt()
    opt = pruning.MaskAware(lm, model=model)
    # Let tfmot compute its masks once (a forward pass in training mode).
    pruning.PruningStepper(model, opt).before_step()
    model(x[:1], training=True)
    step = compile_fn(lambda: opt.minimize(lambda: model(x, training=True) - y,
                                           model.trainable_variables), mode)
    costs = [float(step()) for _ in range(5)]
    masked = sum(int(np.sum(m.numpy() == 0)) for _, m in masks_of(model).values())
    dense = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert lm._step_support.size == dense - masked   # a (1 - 0.8) smaller system
    for w, m in masks_of(model).values():
        assert np.all(w.numpy()[m.numpy() == 0] == 0.0)
    assert costs[-1] < costs[0]


@pytest.mark.distributed
def test_mask_aware_under_mirrored_strategy_equals_single_device(mirrored):
    x, y = data(n=128)

    def build():
        model = pruned_mlp()
        opt = pruning.MaskAware(tf_keras.optimizers.Adam(0.02), model=model)
        model.compile(optimizer=opt, loss="mse")
        return model

    ref = build()
    ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
            callbacks=[pruning.UpdatePruningStepFromOptimizer()])
    with mirrored.scope():
        model = build()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
              callbacks=[pruning.UpdatePruningStepFromOptimizer()])
    for w, m in masks_of(model).values():
        assert np.all(w.numpy()[m.numpy() == 0] == 0.0)
    # Two replicas sum half-batch gradients: float32 summation order only.
    for a, b in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
