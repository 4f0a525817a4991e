"""Projected: constrained variables feasible after every step, under both
flavours, eager / tf.function / jit_compile, fit and custom loops."""

import re

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR, compile_fn
from helpers import max_abs_diff, mse_grads, regression_data, weights_of

from tf_gradkit import constraints as C

# A projection after an identical float32 update: both sides compute the same
# ops in the same order, so only fused-kernel rounding (a few ulps of O(1)
# weights, ~1e-7 each) can differ over a handful of steps.
ULPS = 1e-6


def named_mlp(K, seed=1, hidden=6, constraint=None, use_bias=True):
    model = K.Sequential([
        K.Input((3,)),
        K.layers.Dense(hidden, activation="tanh", name="hid",
                       kernel_constraint=constraint),
        K.layers.Dense(2, name="out", use_bias=use_bias),
    ])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.8
                       for w in model.get_weights()])
    return model


def data(n=48):
    x, y = regression_data(n=n)
    return x, np.concatenate([y, -y], axis=1)


def is_nonneg(w):
    return float(np.min(w)) >= 0.0


def unit_cols_error(w):
    return float(np.max(np.abs(np.linalg.norm(w, axis=0) - 1.0)))


# ------------------------------------------------- feasibility every step
def test_fit_keeps_every_step_feasible(K, gk, mode):
    x, y = data()
    model = named_mlp(K)
    opt = gk.Projected(K.optimizers.Adam(0.05), {
        "hid/kernel": C.NonNeg(), "out/kernel": C.UnitNorm(axis=0)}, model=model)
    seen = []

    class Check(K.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((model.get_layer("hid").kernel.numpy().min(),
                         unit_cols_error(model.get_layer("out").kernel.numpy())))

    model.compile(optimizer=opt, loss="mse", run_eagerly=(mode == "eager"),
                  jit_compile=(mode == "jit"))
    before = float(model.evaluate(x, y, verbose=0))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[Check()])
    assert len(seen) == 18 and int(opt.iterations.numpy()) == 18
    assert np.min([m for m, _ in seen]) >= 0.0
    # Column normalisation in float32: |w|/|w| is 1 to a few ulps (~2.4e-7).
    assert np.max([e for _, e in seen]) < 1e-6
    assert float(model.evaluate(x, y, verbose=0)) < before


def test_custom_loop_equals_update_then_projection(K, gk, mode):
    x, y = data()
    model, ref = named_mlp(K), named_mlp(K)
    opt = gk.Projected(K.optimizers.Adam(0.05), [("hid/kernel", C.NonNeg()),
                                                 ("out/kernel", C.MaxNorm(0.5))])
    ref_opt = K.optimizers.Adam(0.05)

    def step(xb, yb):
        _, grads = mse_grads(model, xb, yb)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def ref_step(xb, yb):
        _, grads = mse_grads(ref, xb, yb)
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
        k0, k1 = ref.get_layer("hid").kernel, ref.get_layer("out").kernel
        k0.assign(tf.maximum(k0, 0.0))
        norms = tf.sqrt(tf.reduce_sum(tf.square(k1), axis=0, keepdims=True))
        k1.assign(k1 * tf.minimum(1.0, 0.5 / norms))

    step, ref_step = compile_fn(step, mode), compile_fn(ref_step, mode)
    for i in range(0, 48, 8):
        step(x[i:i + 8], y[i:i + 8])
        ref_step(x[i:i + 8], y[i:i + 8])
        assert is_nonneg(model.get_layer("hid").kernel.numpy())
    assert max_abs_diff(weights_of(model), weights_of(ref)) < ULPS
    assert np.linalg.norm(model.get_layer("out").kernel.numpy(), axis=0).max() <= 0.5 + 1e-6


def test_variables_as_keys_and_unconstrained_untouched(K, gk):
    x, y = data()
    model, ref = named_mlp(K), named_mlp(K)
    kernel = model.get_layer("hid").kernel
    opt = gk.Projected(K.optimizers.SGD(0.1), [(kernel, C.Box(-0.1, 0.1))])
    ref_opt = K.optimizers.SGD(0.1)
    _, grads = mse_grads(model, x, y)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    _, grads = mse_grads(ref, x, y)
    ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
    got, want = weights_of(model), weights_of(ref)
    # The box's bound is float32(0.1) (a hair above 0.1): compare in float32,
    # as numpy 2 does; numpy 1 would compare in float64 and fail.
    assert np.abs(got[0]).max() <= np.float32(0.1)
    np.testing.assert_allclose(got[0], np.clip(want[0], -0.1, 0.1), atol=ULPS)
    assert max_abs_diff(got[1:], want[1:]) < ULPS  # bias and out: plain SGD


# --------------------------------------------------------------------- EMA
def test_ema_average_is_the_average_of_projected_iterates(K, gk, mode):
    x, y = data()
    model = named_mlp(K)
    kernel = model.get_layer("hid").kernel
    kernel.assign(tf.abs(kernel))  # start feasible
    inner = K.optimizers.SGD(0.3, use_ema=True, ema_momentum=0.9)
    opt = gk.Projected(inner, {"hid/kernel": C.NonNeg()})

    def step(xb, yb):
        _, grads = mse_grads(model, xb, yb)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step = compile_fn(step, mode)
    # Keras 3 starts the average at the first iterate (momentum 0 on step 1);
    # tf_keras starts it at the initial weights.
    expected = None if K.__name__ == "keras" else kernel.numpy()
    for i in range(0, 48, 8):
        step(x[i:i + 8], y[i:i + 8])
        w = kernel.numpy()
        assert is_nonneg(w)
        expected = w if expected is None else 0.9 * expected + 0.1 * w
        average = opt._ema_average(inner, kernel).numpy()
        # Six float32 EMA updates of O(1) values: a few ulps each.
        np.testing.assert_allclose(average, expected, atol=1e-6)
        assert is_nonneg(average)
    assert int(opt.iterations.numpy()) == 6


def test_fit_with_ema_ends_feasible_where_keras_alone_does_not(K, gk):
    x, y = data()
    # Keras's own kernel_constraint with use_ema: the measured fault.
    plain = named_mlp(K, constraint=K.constraints.NonNeg())
    plain.compile(optimizer=K.optimizers.Adam(0.1, use_ema=True), loss="mse")
    plain.fit(x, y, batch_size=8, epochs=4, verbose=0, shuffle=False)
    # The same model under Projected, the constraint kept on the layer.
    model = named_mlp(K, constraint=K.constraints.NonNeg())
    opt = gk.Projected(K.optimizers.Adam(0.1, use_ema=True),
                       {"out/kernel": C.UnitNorm(axis=0)})
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, shuffle=False)
    assert plain.get_layer("hid").kernel.numpy().min() < 0  # Keras's fault
    assert is_nonneg(model.get_layer("hid").kernel.numpy())
    assert unit_cols_error(model.get_layer("out").kernel.numpy()) < 1e-6


# ------------------------------------------------------------------ sparse
def embedding_net(K, vocab=40, dim=3):
    model = K.Sequential([K.Input((4,), dtype="int32"),
                          K.layers.Embedding(vocab, dim, name="emb"),
                          K.layers.GlobalAveragePooling1D(),
                          K.layers.Dense(1, name="head")])
    rng = np.random.RandomState(3)
    model.set_weights([rng.randn(*w.shape).astype("float32") for w in model.get_weights()])
    return model


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_sparse_gradients_project_touched_rows_only_when_row_local(K, gk, mode, inner):
    model = embedding_net(K)
    table = model.get_layer("emb").embeddings
    # Rows 30.. are never looked up; start them infeasible to see who is projected.
    table.assign(tf.concat([table[:30], 5.0 * tf.ones((10, 3))], axis=0))
    inner_opt = K.optimizers.SGD(0.1) if inner == "sgd" else K.optimizers.Adam(0.01)
    opt = gk.Projected(inner_opt, {"emb/embeddings": C.MaxNorm(1.0, axis=1)})
    ids = np.random.RandomState(0).randint(0, 30, size=(16, 4)).astype("int32")
    target = np.ones((16, 1), "float32")

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids) - target))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads[0]

    step = compile_fn(step, mode)
    step()
    norms = np.linalg.norm(table.numpy(), axis=1)
    touched = np.unique(ids)
    assert norms[touched].max() <= 1.0 + 1e-6
    if inner == "sgd":   # row-local: untouched rows are left as they were
        np.testing.assert_allclose(norms[30:], np.sqrt(75.0), rtol=1e-6)
    else:                # Adam moves every row: every row is projected
        assert norms.max() <= 1.0 + 1e-6


# ----------------------------------------------------- composition & hosts
def test_accumulator_outside_projects_after_real_updates(K, gk, mode):
    x, y = data(n=32)
    model, ref = named_mlp(K), named_mlp(K)
    opt = gk.GradientAccumulator(
        gk.Projected(K.optimizers.Adam(0.05), {"hid/kernel": C.NonNeg()}), steps=4)
    ref_opt = gk.Projected(K.optimizers.Adam(0.05), {"hid/kernel": C.NonNeg()})
    step = compile_fn(lambda xb, yb: opt.apply_gradients(
        zip(mse_grads(model, xb, yb)[1], model.trainable_variables),
        sample_count=tf.shape(xb)[0]), mode)
    for i in range(0, 32, 8):
        step(x[i:i + 8], y[i:i + 8])
    _, grads = mse_grads(ref, x, y)
    ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
    assert int(opt.iterations.numpy()) == 1
    assert is_nonneg(model.get_layer("hid").kernel.numpy())
    # Accumulated vs one big batch: float32 summation order only (helpers.ROUNDOFF).
    assert max_abs_diff(weights_of(model), weights_of(ref)) < 1e-5


def test_accumulator_inside_is_refused(K, gk):
    with pytest.raises(TypeError, match="Wrap the other way round"):
        gk.Projected(gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2),
                     {"kernel": C.NonNeg()})


def test_loss_scale_optimizer_inner(K, gk):
    x, y = data()
    model = named_mlp(K)
    if FLAVOUR == "keras3":  # Keras 3: the loss-scale optimizer goes outside
        with pytest.raises(TypeError, match="Put the LossScaleOptimizer outside"):
            gk.Projected(K.mixed_precision.LossScaleOptimizer(K.optimizers.Adam(0.05)),
                         {"hid/kernel": C.NonNeg()})
        opt = K.mixed_precision.LossScaleOptimizer(
            gk.Projected(K.optimizers.Adam(0.05), {"hid/kernel": C.NonNeg()}))
    else:
        opt = gk.Projected(K.mixed_precision.LossScaleOptimizer(K.optimizers.Adam(0.05)),
                           {"hid/kernel": C.NonNeg()})
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert is_nonneg(model.get_layer("hid").kernel.numpy())
    assert int(opt.iterations.numpy()) == 12


@pytest.mark.distributed
def test_mirrored_strategy_fit_equals_single_device(K, gk, mirrored):
    x, y = data(n=32)
    spec = lambda: {"hid/kernel": C.NonNeg(), "out/kernel": C.UnitNorm(axis=0)}  # noqa: E731
    ref = named_mlp(K)
    ref.compile(optimizer=gk.Projected(K.optimizers.Adam(0.05), spec()), loss="mse")
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with mirrored.scope():
        model = named_mlp(K)
        model.compile(optimizer=gk.Projected(K.optimizers.Adam(0.05), spec()),
                      loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert is_nonneg(model.get_layer("hid").kernel.numpy())
    assert unit_cols_error(model.get_layer("out").kernel.numpy()) < 1e-6
    # Two replicas sum half-batch gradients: float32 summation order only.
    assert max_abs_diff(weights_of(ref), weights_of(model)) < 1e-5


def test_checkpoint_and_config_round_trip(K, gk, tmp_path):
    x, y = data()
    model = named_mlp(K)
    opt = gk.Projected(K.optimizers.Adam(0.05), [("hid/kernel", C.Simplex(axis=0)),
                                                 (model.get_layer("out").kernel, C.NonNeg())])
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    config = opt.get_config()
    assert set(config["constraints"]) == {"hid/kernel", "(^|/)" + re.escape(
        "out/kernel" + (":0" if K.__name__ == "tf_keras" else "")) + "$"}
    clone = gk.Projected.from_config(config).get_config()
    assert clone["constraints"] == config["constraints"]
    assert clone["optimizer"]["config"] == config["optimizer"]["config"]
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(str(tmp_path / "ckpt"))
    model2 = named_mlp(K, seed=7)
    opt2 = gk.Projected.from_config(config)
    model2.compile(optimizer=opt2, loss="mse")
    opt2.build(model2.trainable_variables)
    tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)
    assert max_abs_diff(weights_of(model), weights_of(model2)) == 0
    assert int(opt2.iterations.numpy()) == int(opt.iterations.numpy())


# --------------------------------------------------------------- bad input
@pytest.mark.parametrize("constraints, error, match", [
    ({"nothing/here": C.NonNeg()}, ValueError, "matches none of the"),
    ({"kernel": C.NonNeg(), "hid": C.NonNeg()}, ValueError, "matched by both"),
    ({"kernel": "nonneg"}, TypeError, "must be callable"),
    ({"(": C.NonNeg()}, ValueError, "not a valid regular expression"),
    ({}, ValueError, "is empty"),
    ([3], TypeError, "pair"),
    ("kernel", TypeError, "must be a dict"),
])
def test_bad_constraints_fail_at_construction(K, gk, constraints, error, match):
    model = named_mlp(K)
    with pytest.raises(error, match=match):
        gk.Projected(K.optimizers.SGD(0.1), constraints, model=model)


def test_unmatched_pattern_without_model_fails_before_any_change(K, gk):
    x, y = data()
    model = named_mlp(K)
    opt = gk.Projected(K.optimizers.SGD(0.1), {"nothing/here": C.NonNeg()})
    before = weights_of(model)
    _, grads = mse_grads(model, x, y)
    with pytest.raises(ValueError, match="matches none"):
        opt.apply_gradients(zip(grads, model.trainable_variables))
    assert max_abs_diff(before, weights_of(model)) == 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sparse_rows": "yes"}, ValueError, "`sparse_rows` must be one of"),
    ({"radius": 1.0}, TypeError, "unexpected arguments"),
    ({"model": "net"}, TypeError, "`model` must be a"),
])
def test_bad_arguments(K, gk, kwargs, error, match):
    with pytest.raises(error, match=match):
        gk.Projected(K.optimizers.SGD(0.1), {"kernel": C.NonNeg()}, **kwargs)


def test_other_flavour_optimizer_is_refused(gk):
    with pytest.raises(TypeError, match="Projected .* wraps a"):
        gk.Projected(tf.Module(), {"kernel": C.NonNeg()})


def test_keras3_gradient_accumulation_steps_inner(K, gk, mode):
    if K.__name__ != "keras":
        pytest.skip("`gradient_accumulation_steps` is a Keras 3 option")
    x, y = data(n=32)
    model, ref = named_mlp(K), named_mlp(K)
    opt = gk.Projected(K.optimizers.Adam(0.05, gradient_accumulation_steps=2),
                       {"hid/kernel": C.NonNeg()})
    ref_opt = K.optimizers.Adam(0.05, gradient_accumulation_steps=2)

    def step(xb, yb):
        _, grads = mse_grads(model, xb, yb)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def ref_step(xb, yb):
        _, grads = mse_grads(ref, xb, yb)
        before = weights_of(ref)
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
        kernel = ref.get_layer("hid").kernel
        # Keras updates the weights on every second call only; project then
        # (the start is infeasible, so projecting after a call that did not
        # update would change the weights too early).
        if max_abs_diff(before, weights_of(ref)) > 0:
            kernel.assign(tf.maximum(kernel, 0.0))

    step = compile_fn(step, mode)
    for i in range(0, 32, 8):
        step(x[i:i + 8], y[i:i + 8])
        ref_step(x[i:i + 8], y[i:i + 8])
        assert max_abs_diff(weights_of(model), weights_of(ref)) < ULPS
    assert is_nonneg(model.get_layer("hid").kernel.numpy())
