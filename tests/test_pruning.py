"""tf_gradkit.pruning with tfmot: pruned weights and their optimizer state stay
exactly zero after every step; the pruning step counts real updates.

tfmot prunes tf_keras models only, so this module runs in the tf_keras process
(`TF_USE_LEGACY_KERAS=1`) and skips whole otherwise. tfmot is imported here,
inside that process only (its import sets TF_USE_LEGACY_KERAS=1).
"""

import os
import subprocess
import sys

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

from tf_gradkit import pruning  # noqa: E402
from tf_gradkit.tf_keras import GradientAccumulator  # noqa: E402

INNER = {
    "momentum": lambda: tf_keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: tf_keras.optimizers.Adam(0.02),
}
D, HIDDEN, OUT = 8, 16, 4


def _data(n=64, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, D).astype("float32")
    y = np.tanh(x @ rng.randn(D, OUT)).astype("float32")
    return x, y


def _pruned_mlp(schedule=None, seed=1, **prune_kwargs):
    base = tf_keras.Sequential([
        tf_keras.Input((D,)),
        tf_keras.layers.Dense(HIDDEN, activation="tanh"),
        tf_keras.layers.Dense(OUT),
    ])
    rng = np.random.RandomState(seed)
    base.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                      for w in base.get_weights()])
    if schedule is None and "sparsity_m_by_n" not in prune_kwargs:
        schedule = sparsity.PolynomialDecay(0.0, 0.75, begin_step=0, end_step=12,
                                            frequency=3)
    if schedule is not None:
        prune_kwargs["pruning_schedule"] = schedule
    return sparsity.prune_low_magnitude(base, **prune_kwargs)


def _pruning_vars(model):
    return [(w, m) for layer in model.layers
            for w, m, _ in getattr(layer, "pruning_vars", [])]


def _slots(optimizer, variable):
    """Per-entry state of `variable`: tf_keras names it `<prefix>/<name>`."""
    return [s for s in optimizer.variables
            if s.name.endswith("/" + variable.name) and s.shape == variable.shape]


def _nonzero_pruned(model, optimizer=None):
    """Non-zero entries where the mask is 0: in weights, and in their slots."""
    weights = slots = 0
    for w, m in _pruning_vars(model):
        off = m.numpy() == 0
        weights += int(np.count_nonzero(w.numpy()[off]))
        for s in _slots(optimizer, w) if optimizer is not None else ():
            slots += int(np.count_nonzero(s.numpy()[off]))
    return weights, slots


def _pruning_steps(model):
    return [int(layer.pruning_step.numpy()) for layer in model.layers
            if hasattr(layer, "pruning_step")]


def _train_step(model, optimizer, stepper=None):
    def train_step(xb, yb):
        if stepper is not None:
            stepper.before_step()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return train_step


def _assert_zero_after_step(model, optimizer, updated=True, where=None):
    """Pruned weights are zero after every (micro-)step; their slots after
    every real update. With accumulation a mask change at a window's first
    micro-batch reaches the state at that window's update: nothing reads the
    state in between."""
    weights, slots = _nonzero_pruned(model, optimizer)
    assert weights == 0, where
    assert slots == 0 or not updated, where


class _CheckEveryStep(tf_keras.callbacks.Callback):
    """Asserts after every batch that pruned weights and slots are zero."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.checked = 0
        self.updates = 0

    def on_train_batch_end(self, batch, logs=None):
        updates = int(self.optimizer.iterations.numpy())
        _assert_zero_after_step(self.model, self.optimizer,
                                updated=updates != self.updates, where=batch)
        self.updates = updates
        self.checked += 1


def _compile(model, optimizer, mode):
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=(mode == "eager"),
                  jit_compile=(mode == "jit"))


# --------------------------------------------------------- every step, exact
@pytest.mark.parametrize("inner", sorted(INNER))
def test_fit_keeps_pruned_weights_and_slots_zero_every_step(inner, mode):
    x, y = _data()
    model = _pruned_mlp()
    opt = pruning.MaskAware(INNER[inner](), model=model)
    _compile(model, opt, mode)
    check = _CheckEveryStep(opt)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[pruning.UpdatePruningStepFromOptimizer(), check])
    assert check.checked == 16
    assert _pruning_steps(model) == [16, 16] == [int(opt.iterations.numpy())] * 2
    final = [1 - m.numpy().mean() for _, m in _pruning_vars(model)]
    np.testing.assert_allclose(final, 0.75)
    # The state is really there: non-zero on the kept entries.
    kernel = _pruning_vars(model)[0][0]
    assert np.count_nonzero(_slots(opt, kernel)[0].numpy())


@pytest.mark.parametrize("inner", sorted(INNER))
def test_custom_loop_keeps_pruned_weights_and_slots_zero_every_step(inner, mode):
    x, y = _data()
    model = _pruned_mlp()
    opt = pruning.MaskAware(INNER[inner](), model=model)
    step = compile_fn(_train_step(model, opt, pruning.PruningStepper(model, opt)),
                      mode)
    for i in range(16):
        j = (i % 8) * 8
        step(x[j:j + 8], y[j:j + 8])
        assert _nonzero_pruned(model, opt) == (0, 0), i
        assert _pruning_steps(model) == [i + 1] * 2
    final = [1 - m.numpy().mean() for _, m in _pruning_vars(model)]
    np.testing.assert_allclose(final, 0.75)


def test_newly_pruned_entries_lose_their_state():
    x, y = _data()
    model = _pruned_mlp()
    opt = pruning.MaskAware(tf_keras.optimizers.Adam(0.02), model=model)
    step = _train_step(model, opt, pruning.PruningStepper(model, opt))
    opt.build(model.trainable_variables)
    kernel, mask = _pruning_vars(model)[0]
    m_slot, v_slot = _slots(opt, kernel)
    reset = 0
    for i in range(13):
        before_mask = mask.numpy().copy()
        before_m = m_slot.numpy().copy() if i else None
        step(x[:16], y[:16])
        newly = (before_mask == 1) & (mask.numpy() == 0)
        if newly.any() and i > 0:
            assert np.all(before_m[newly] != 0)  # they had state ...
            assert np.all(m_slot.numpy()[newly] == 0)  # ... and lost it
            assert np.all(v_slot.numpy()[newly] == 0)
            assert np.all(kernel.numpy()[newly] == 0)
            reset += int(newly.sum())
    assert reset > 0  # the schedule pruned more after the first update


# ------------------------------------------------- stop anywhere, then strip
def _train_37_steps(model, optimizer, ours):
    x, y = _data(n=80)
    if ours:
        stepper = pruning.PruningStepper(model, optimizer)
    else:  # tfmot's custom-loop recipe
        stepper = None
        callback = sparsity.UpdatePruningStep()
        callback.set_model(model)
        callback.on_train_begin()
    step = tf.function(_train_step(model, optimizer, stepper))
    for i in range(37):  # stopped mid-epoch: no epoch-end re-masking
        j = (i % 10) * 8
        step(x[j:j + 8], y[j:j + 8])


def test_strip_at_an_arbitrary_stop_is_exactly_sparse_and_plain_adam_is_not():
    schedule = sparsity.ConstantSparsity(0.8, begin_step=0, frequency=10)
    plain_model, ours_model = _pruned_mlp(schedule), _pruned_mlp(schedule)
    plain = tf_keras.optimizers.Adam(0.02)
    ours = pruning.MaskAware(tf_keras.optimizers.Adam(0.02), model=ours_model)
    _train_37_steps(plain_model, plain, ours=False)
    _train_37_steps(ours_model, ours, ours=True)

    plain_weights, plain_slots = _nonzero_pruned(plain_model, plain)
    assert plain_weights > 0 and plain_slots > 0  # the problem, measured
    assert _nonzero_pruned(ours_model, ours) == (0, 0)

    for model, exact in ((plain_model, False), (ours_model, True)):
        masks = [m.numpy() for _, m in _pruning_vars(model)]
        stripped = pruning.strip_pruning(model)
        kernels = [layer.kernel.numpy() for layer in stripped.layers]
        leaked = sum(int(np.count_nonzero(k[m == 0])) for k, m in zip(kernels, masks))
        assert (leaked == 0) == exact, leaked
    np.testing.assert_allclose([np.mean(k == 0) for k in kernels], 0.8, atol=0.02)


# ------------------------------------------------------------- 2:4 structure
def test_two_of_four_structure_holds_every_step(mode):
    x, y = _data()
    model = _pruned_mlp(sparsity_m_by_n=(2, 4))
    opt = pruning.MaskAware(tf_keras.optimizers.Adam(0.02), model=model)
    _compile(model, opt, mode)

    class TwoOfFour(_CheckEveryStep):
        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            for w, _ in _pruning_vars(self.model):
                # tfmot groups 4 consecutive input channels per output unit.
                groups = np.abs(w.numpy()).T.reshape(-1, 4)
                assert np.all(np.count_nonzero(groups, axis=1) <= 2), batch

    check = TwoOfFour(opt)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[pruning.UpdatePruningStepFromOptimizer(), check])
    assert check.checked == 8
    for _, m in _pruning_vars(model):
        assert np.all(m.numpy().T.reshape(-1, 4).sum(axis=1) == 2)


# ------------------------------------------------------- with accumulation
def _accumulating(order, model):
    adam = tf_keras.optimizers.Adam(0.02)
    if order == "accumulator_outside":  # GradientAccumulator(MaskAware(Adam))
        return GradientAccumulator(pruning.MaskAware(adam, model=model), steps=4,
                                   reduction="microbatch")
    return pruning.MaskAware(  # MaskAware(GradientAccumulator(Adam))
        GradientAccumulator(adam, steps=4, reduction="microbatch"), model=model)


@pytest.mark.parametrize("order", ["accumulator_outside", "accumulator_inside"])
def test_accumulation_counts_real_updates_and_matches_big_batches(order):
    x, y = _data()
    schedule = sparsity.PolynomialDecay(0.0, 0.75, begin_step=0, end_step=6,
                                        frequency=2)
    ref = _pruned_mlp(schedule)
    ref_opt = pruning.MaskAware(tf_keras.optimizers.Adam(0.02), model=ref)
    _compile(ref, ref_opt, "function")
    ref.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0,
            callbacks=[pruning.UpdatePruningStepFromOptimizer()])

    model = _pruned_mlp(schedule)
    opt = _accumulating(order, model)
    _compile(model, opt, "function")
    check = _CheckEveryStep(opt)
    model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
              callbacks=[pruning.UpdatePruningStepFromOptimizer(), check])

    assert check.checked == 32  # micro-batches
    assert int(opt.iterations.numpy()) == 8 == int(ref_opt.iterations.numpy())
    assert _pruning_steps(model) == [8, 8] == _pruning_steps(ref)
    for (_, m), (_, m_ref) in zip(_pruning_vars(model), _pruning_vars(ref)):
        np.testing.assert_array_equal(m.numpy(), m_ref.numpy())
    np.testing.assert_allclose(
        np.concatenate([w.numpy().ravel() for w in model.trainable_variables]),
        np.concatenate([w.numpy().ravel() for w in ref.trainable_variables]),
        atol=1e-5)


def test_tfmot_callback_counts_micro_batches_ours_counts_updates():
    x, y = _data()
    steps = {}
    for name, callback in (("tfmot", sparsity.UpdatePruningStep()),
                           ("ours", pruning.UpdatePruningStepFromOptimizer())):
        model = _pruned_mlp()
        opt = _accumulating("accumulator_outside", model)
        _compile(model, opt, "function")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
        steps[name] = _pruning_steps(model)[0]
    assert steps == {"tfmot": 8, "ours": 2}


def test_custom_loop_accumulation_counts_real_updates():
    x, y = _data()
    model = _pruned_mlp()
    opt = _accumulating("accumulator_outside", model)
    step = tf.function(_train_step(model, opt, pruning.PruningStepper(model, opt)))
    for i in range(32):
        j = (i % 8) * 8
        step(x[j:j + 8], y[j:j + 8])
        _assert_zero_after_step(model, opt, updated=(i % 4 == 3), where=i)
        assert _pruning_steps(model) == [i // 4 + 1] * 2  # this window's step
    assert int(opt.iterations.numpy()) == 8


# ------------------------------------------------ the same as masks by hand
@pytest.mark.parametrize("inner", sorted(INNER))
def test_matches_masking_by_hand(inner, mode):
    """Explicit masks (no tfmot): g*M, inner step, w*M and slots*M by hand."""
    x, y = _data()

    def fresh():
        model = tf_keras.Sequential([tf_keras.Input((D,)),
                                     tf_keras.layers.Dense(HIDDEN, activation="tanh"),
                                     tf_keras.layers.Dense(OUT)])
        rng = np.random.RandomState(3)
        model.set_weights([rng.randn(*w.shape).astype("float32")
                           for w in model.get_weights()])
        return model

    rng = np.random.RandomState(4)
    ours_model, ref_model = fresh(), fresh()
    kernels = ours_model.trainable_variables[::2]
    mask_values = [(rng.rand(*k.shape) > 0.6).astype("float32") for k in kernels]
    masks = {kernels[0].ref(): mask_values[0] > 0.5,  # a bool mask
             kernels[1].ref(): tf.Variable(mask_values[1])}  # a variable mask
    ours = pruning.MaskAware(INNER[inner](), masks=masks)
    ref = INNER[inner]()
    ref_masks = {0: mask_values[0], 2: mask_values[1]}

    def loss_and_grads(model):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        return loss, tape.gradient(loss, model.trainable_variables)

    def ours_step():
        loss, grads = loss_and_grads(ours_model)
        ours.apply_gradients(zip(grads, ours_model.trainable_variables))
        return loss

    def ref_step():
        loss, grads = loss_and_grads(ref_model)
        variables = ref_model.trainable_variables
        grads = [g * ref_masks[i] if i in ref_masks else g for i, g in enumerate(grads)]
        ref.apply_gradients(zip(grads, variables))
        for i, m in ref_masks.items():
            for v in [variables[i]] + _slots(ref, variables[i]):
                v.assign(v * m)
        return loss

    ours_step, ref_step = compile_fn(ours_step, mode), compile_fn(ref_step, mode)
    for _ in range(5):
        np.testing.assert_allclose(ours_step().numpy(), ref_step().numpy(), rtol=1e-6)
    for a, b in zip(ours_model.trainable_variables, ref_model.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    for a, b in zip(ours.variables, ref.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    assert np.all(kernels[0].numpy()[mask_values[0] == 0] == 0)


def test_variable_mask_change_takes_effect_and_resets_state():
    model = tf_keras.Sequential([tf_keras.Input((D,)), tf_keras.layers.Dense(OUT)])
    kernel = model.trainable_variables[0]
    mask = tf.Variable(tf.ones(kernel.shape))
    opt = pruning.MaskAware(tf_keras.optimizers.Adam(0.1), masks=[(kernel, mask)])
    x, y = _data()
    for i in range(4):
        if i == 2:
            mask.assign(tf.concat([tf.zeros((D // 2, OUT)), tf.ones((D // 2, OUT))], 0))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    slots = _slots(opt, kernel)
    assert len(slots) == 2
    assert np.all(kernel.numpy()[: D // 2] == 0)
    assert all(np.all(s.numpy()[: D // 2] == 0) for s in slots)
    assert all(np.all(s.numpy()[D // 2:] != 0) for s in slots)


def test_loss_scale_optimizer_inner():
    x, y = _data()
    model = _pruned_mlp()
    opt = pruning.MaskAware(
        tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.Adam(0.02)),
        model=model)
    _compile(model, opt, "function")
    check = _CheckEveryStep(opt)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[pruning.UpdatePruningStepFromOptimizer(), check])
    assert check.checked == 8 and int(opt.iterations.numpy()) == 8


# ------------------------------------------------------------------ interop
def test_masks_are_handed_down_to_inner_optimizers_that_use_them():
    from tf_gradkit import tf_keras as gk  # noqa: PLC0415
    model = _pruned_mlp()
    projected = gk.Projected(tf_keras.optimizers.SGD(0.1),
                             {"kernel": tf_keras.constraints.NonNeg()})
    opt = pruning.MaskAware(projected, model=model)
    assert projected.masks is opt.masks  # the value itself, not a callback
    _compile(model, opt, "function")
    model.fit(*_data(), batch_size=8, epochs=1, verbose=0,
              callbacks=[pruning.UpdatePruningStepFromOptimizer()])
    kernel, mask = _pruning_vars(model)[0]
    np.testing.assert_array_equal(opt.masks.mask_for(kernel).numpy(), mask.numpy())
    assert opt.masks.mask_for(model.trainable_variables[1]) is None  # a bias
    # and a Projected outside a MaskAware takes them from the chain it wraps
    outside = gk.Projected(pruning.MaskAware(tf_keras.optimizers.SGD(0.1), model=model),
                           {"kernel": tf_keras.constraints.NonNeg()})
    assert outside.masks is outside.inner_optimizer.masks


# ------------------------------------------------------------------- errors
def test_errors_name_the_argument():
    import keras  # noqa: PLC0415 - Keras 3, for the errors only

    model = _pruned_mlp()
    keras3_model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(TypeError, match="tfmot prunes only tf_keras.*TF_USE_LEGACY_KERAS"):
        pruning.MaskAware(tf_keras.optimizers.Adam(), model=keras3_model)
    with pytest.raises(TypeError, match="tfmot prunes only tf_keras"):
        pruning.PruningStepper(keras3_model)
    plain = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="no pruning wrappers.*Received: model="):
        pruning.MaskAware(tf_keras.optimizers.Adam(), model=plain)
    # Every wrapper's wording; Keras 3 has its own MaskAware now (explicit masks).
    with pytest.raises(TypeError, match=r"wraps a tf_keras .*Received: optimizer=keras.*"
                                        r"use tf_gradkit\.keras3\.MaskAware"):
        pruning.MaskAware(keras.optimizers.Adam(), model=model)
    with pytest.raises(TypeError, match="Received: optimizer=builtins.str"):
        pruning.MaskAware("adam", model=model)
    kernel = plain.trainable_variables[0]
    with pytest.raises(ValueError, match=r"mask shape \(3, 1\), variable shape \(2, 1\)"):
        pruning.MaskAware(tf_keras.optimizers.Adam(), masks={kernel.ref(): np.ones((3, 1))})
    with pytest.raises(ValueError, match="only 0 and 1"):
        pruning.MaskAware(tf_keras.optimizers.Adam(), masks=[(kernel, np.full((2, 1), 0.5))])
    with pytest.raises(ValueError, match="Received neither"):
        pruning.MaskAware(tf_keras.optimizers.Adam())
    with pytest.raises(TypeError, match="unexpected arguments"):
        pruning.MaskAware(tf_keras.optimizers.Adam(), model=model, learning_rate=0.1)


# ----------------------------------------------------------- config, import
def test_get_config_round_trip():
    model = _pruned_mlp()
    opt = pruning.MaskAware(GradientAccumulator(tf_keras.optimizers.Adam(0.03), steps=2,
                                                model=model),
                            model=model, name="masked")
    config = opt.get_config()
    restored = tf_keras.optimizers.deserialize(tf_keras.optimizers.serialize(opt))
    assert isinstance(restored, pruning.MaskAware)
    assert restored.get_config() == config
    assert restored.inner_optimizer.steps == 2
    with pytest.raises(ValueError, match="attach"):
        restored.apply_gradients([(tf.zeros_like(v), v) for v in model.trainable_variables])
    _compile(model, restored, "function")
    import tf_gradkit  # noqa: PLC0415
    tf_gradkit.attach(model)  # masks for MaskAware, batch sizes for the accumulator
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[pruning.UpdatePruningStepFromOptimizer()])
    assert int(restored.iterations.numpy()) == 4
    assert _nonzero_pruned(model, restored) == (0, 0)


# The same child process, with these same assertions, runs by default in
# test_gradient_accumulator.py::test_import_sets_no_environment_and_imports_no_keras.
@pytest.mark.slow
def test_import_neither_imports_tfmot_nor_sets_environment():
    code = (
        "import os, sys\n"
        "os.environ.pop('TF_USE_LEGACY_KERAS', None)\n"
        "import tf_gradkit, tf_gradkit.pruning as p\n"
        "p.MaskAware, p.PruningStepper, p.UpdatePruningStepFromOptimizer\n"
        "assert 'tensorflow_model_optimization' not in sys.modules\n"
        "assert 'TF_USE_LEGACY_KERAS' not in os.environ\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", code], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("fmt", ["keras", "h5", "savedmodel"])
def test_save_mid_schedule_load_alone_and_continue_exactly(tmp_path, fmt):
    # load_model (in tfmot's prune_scope) gives the loaded MaskAware its
    # masks again, and its state (SavedModel: read back by tf_gradkit, as
    # tf_keras does not): the resumed run equals the one that never stopped.
    x, y = _data()

    def make():
        model = _pruned_mlp()
        model.compile(optimizer=pruning.MaskAware(tf_keras.optimizers.Adam(0.02),
                                                  model=model), loss="mse")
        return model

    def fit(model, a, b):
        model.fit(x[a:b], y[a:b], batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[pruning.UpdatePruningStepFromOptimizer()])

    full, stopped = make(), make()
    fit(full, 0, 32)
    fit(stopped, 0, 32)
    path = str(tmp_path / {"keras": "m.keras", "h5": "m.h5", "savedmodel": "saved"}[fmt])
    stopped.save(path)
    with sparsity.prune_scope():
        loaded = tf_keras.models.load_model(path)
    fit(full, 32, 64)
    fit(loaded, 32, 64)
    same = [np.array_equal(a, b) for a, b in zip(full.get_weights(), loaded.get_weights())]
    assert all(same)
    assert _nonzero_pruned(loaded, loaded.optimizer) == (0, 0)
    assert int(loaded.optimizer.iterations.numpy()) == int(full.optimizer.iterations.numpy())


@pytest.mark.parametrize("schedule_frequency", [1, 3])
@pytest.mark.parametrize("compiled", [False, True])
def test_custom_loop_after_savedmodel_load_continues_exactly(tmp_path, schedule_frequency,
                                                              compiled):
    # A SavedModel-loaded optimizer reads its state (`iterations` too) back
    # when built: PruningStepper builds it before reading the step, else the
    # step reads 0, the masks go back to the schedule's start and pruned
    # weights come back to life (frequency 1 shows it at once).
    x, y = _data(96)

    def make():
        schedule = sparsity.PolynomialDecay(0.0, 0.75, begin_step=0, end_step=12,
                                            frequency=schedule_frequency)
        model = _pruned_mlp(schedule)
        model.compile(optimizer=pruning.MaskAware(tf_keras.optimizers.Adam(0.02),
                                                  model=model), loss="mse")
        return model

    def train(model, a, b):
        stepper = pruning.PruningStepper(model)
        loss_fn = tf_keras.losses.MeanSquaredError()

        def step(xb, yb):
            stepper.before_step()
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))

        if compiled:
            step = tf.function(step)
        for i in range(a, b, 8):
            step(x[i:i + 8], y[i:i + 8])

    full, stopped = make(), make()
    train(full, 0, 48)
    train(stopped, 0, 48)
    path = str(tmp_path / "saved")
    stopped.save(path)
    with sparsity.prune_scope():
        loaded = tf_keras.models.load_model(path)
    train(full, 48, 96)
    train(loaded, 48, 96)
    assert int(loaded.optimizer.iterations.numpy()) == int(full.optimizer.iterations.numpy())
    assert _nonzero_pruned(loaded, loaded.optimizer) == (0, 0)
    for a, b in zip(full.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
