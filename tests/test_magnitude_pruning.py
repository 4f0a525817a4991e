"""MagnitudePruning: pruning for Keras 3 (and tf_keras) without tfmot.

Masks are optimizer state; after every real update the pruned weights and
their optimizer slots are exactly zero; masks are recomputed on the
schedule counted in real updates, with tfmot's rules (the counts of zeros
match tfmot's at every mask update: `test_tfmot_equivalence` in the tf_keras
process). Both flavours, fit and custom loops, eager / tf.function / XLA.
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR, compile_fn
from helpers import ROUNDOFF, max_abs_diff, weights_of
from tf_gradkit import pruning
from tf_gradkit.core import magnitude, pruning_schedule

SCHEDULE = dict(initial_sparsity=0.0, final_sparsity=0.8, begin_step=0, end_step=10,
                frequency=2)
# tfmot's counts of zeros for an 8x16 and a 16x4 kernel under SCHEDULE, by
# step (docs/pruning_keras3.md; the tfmot test checks them in tf_keras).
ZEROS = {2: (50, 25), 4: (80, 40), 6: (96, 48), 8: (102, 51), 10: (102, 51)}


def _data(n=96, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, 8).astype("float32"), rng.randn(n, 4).astype("float32")


def _model(K, seed=1):
    model = K.Sequential([K.Input((8,)), K.layers.Dense(16, activation="relu", name="d1"),
                          K.layers.Dense(4, name="d2")])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                       for w in model.get_weights()])
    return model


def _expected_zeros(step):
    """Zeros per kernel once update ``step`` is done: the mask of the last
    schedule point <= step (made before update ``step``, tfmot's)."""
    points = [s for s in ZEROS if s <= step]
    return ZEROS[max(points)] if points else (0, 0)


def _pruned_entries(opt):
    """Non-zero weights and slot entries where a mask is 0."""
    weights = slots = 0
    for variable, mask, slot_list in opt._targets:  # pylint: disable=protected-access
        off = mask.numpy() == 0
        weights += int(np.count_nonzero(variable.numpy()[off]))
        slots += sum(int(np.count_nonzero(s.numpy()[off])) for s in slot_list)
    return weights, slots


# ------------------------------------------------------------------ core rules
@pytest.mark.keras_free
def test_schedules_give_tfmots_steps_and_sparsities():
    s = pruning_schedule.PolynomialDecay(**SCHEDULE)
    due = [int(step) for step in range(0, 14) if bool(s.should_prune(step))]
    assert due == [0, 2, 4, 6, 8, 10]
    for step in (1, 2, 5, 10, 13):
        p = np.float32(min(max((step - 0) / 10, 0.0), 1.0))
        want = np.float32(0.8) + np.float32(-0.8) * (np.float32(1) - p) ** 3
        assert float(s.sparsity(step)) == pytest.approx(float(want), abs=1e-7)
    c = pruning_schedule.ConstantSparsity(0.5, begin_step=3, frequency=4)
    assert [st for st in range(20) if bool(c.should_prune(st))] == [3, 7, 11, 15, 19]
    assert pruning_schedule.deserialize(pruning_schedule.serialize(s)).get_config() == \
        s.get_config()


@pytest.mark.keras_free
@pytest.mark.parametrize("size,sparsity,kept", [
    (10, 0.25, 8), (10, 0.75, 2), (10, 0.35, 6), (10, 0.45, 6), (128, 0.8, 26), (5, 0.99, 1)])
def test_kept_count_rounds_as_tfmot(size, sparsity, kept):
    assert int(magnitude.kept_count(size, sparsity)) == kept


@pytest.mark.keras_free
def test_masks_keep_the_largest_magnitudes_ties_included():
    w = tf.constant([[0.1, -3.0, 2.0, 0.5], [2.0, -0.2, 0.0, 1.0]])
    mask = magnitude.magnitude_mask(w, 0.5).numpy()  # keep 4: |w| >= 1.0
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0], [1, 0, 0, 1]])
    tie = magnitude.magnitude_mask(tf.constant([1.0, 1.0, 1.0, 0.5]), 0.5).numpy()
    np.testing.assert_array_equal(tie, [1, 1, 1, 0])  # 3 tie at the threshold: kept


@pytest.mark.keras_free
def test_block_masks_pool_as_tfmot():
    w = tf.constant(np.arange(15.0, dtype="float32").reshape(3, 5))
    # 2x2 blocks over 3x5, partial edges averaged over their real entries:
    # [[3, 5, 6.5], [10.5, 12.5, 14]]; keep 3 of 6 blocks.
    mask = magnitude.magnitude_mask(w, 0.5, block_size=(2, 2)).numpy()
    np.testing.assert_array_equal(mask, [[0] * 5, [0] * 5, [1] * 5])
    mask = magnitude.magnitude_mask(w, 0.5, block_size=(2, 2), pooling="max").numpy()
    np.testing.assert_array_equal(mask, [[0] * 5, [0] * 5, [1] * 5])
    with pytest.raises(ValueError, match="needs 2-D weights"):
        magnitude.magnitude_mask(tf.zeros([2, 2, 2]), 0.5, block_size=(2, 2))


@pytest.mark.keras_free
def test_two_of_four_along_the_input_axis():
    rng = np.random.RandomState(0)
    dense = rng.randn(8, 3).astype("float32")  # [in, out]
    mask = magnitude.m_by_n_mask(dense, 2, 4).numpy()
    groups = mask.T.reshape(3, 2, 4)  # per output, groups of 4 inputs
    assert (groups.sum(-1) == 2).all()
    kept = np.abs(dense.T.reshape(3, 2, 4)) * groups
    dropped = np.abs(dense.T.reshape(3, 2, 4)) * (1 - groups)
    assert (kept.max(-1) >= dropped.max(-1)).all()
    conv = rng.randn(3, 3, 8, 2).astype("float32")  # [h, w, in, out]
    mask = magnitude.m_by_n_mask(conv, 2, 4).numpy()
    assert (mask.transpose(3, 0, 1, 2).reshape(-1, 4).sum(-1) == 2).all()
    with pytest.raises(ValueError, match="input axis"):
        magnitude.m_by_n_mask(tf.zeros([3, 4, 5]), 2, 4)


# --------------------------------------------------------- every step, exact
FIT_MODES = {"eager": {"run_eagerly": True}, "function": {}, "jit": {"jit_compile": True}}


# The plain tf.function cases under `make test-slow` only: eager and XLA stay
# in the default run, and MagnitudePruning fits under `compile()`'s default
# (a plain tf.function on a CPU) in test_save_load.py and test_compile_matrix.py.
@pytest.mark.parametrize("how", [
    "fit-eager", pytest.param("fit-function", marks=pytest.mark.slow), "fit-jit",
    "loop-eager", pytest.param("loop-function", marks=pytest.mark.slow), "loop-jit"])
def test_pruned_weights_and_slots_are_zero_after_every_step(K, gk, how):
    x, y = _data()
    model = _model(K)
    opt = gk.MagnitudePruning(K.optimizers.Adam(0.05), model=model,
                              schedule=pruning.PolynomialDecay(**SCHEDULE))
    seen = []

    def check():
        step = int(opt.iterations.numpy())
        zeros = tuple(int((m.numpy() == 0).sum()) for _, m, _ in opt._targets)
        seen.append((step, zeros, _pruned_entries(opt)))

    kind, mode = how.split("-")
    if kind == "fit":
        class Check(K.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                check()

        model.compile(optimizer=opt, loss="mse", **FIT_MODES[mode])
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[Check()])
    else:
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))

        step = compile_fn(step, mode)
        for i in range(0, 96, 8):
            step(x[i:i + 8], y[i:i + 8])
            check()
    assert [s for s, _, _ in seen] == list(range(1, 13))
    for step, zeros, (weights, slots) in seen:
        assert (weights, slots) == (0, 0), step            # exactly zero, Adam's too
        assert zeros == _expected_zeros(step), (step, zeros)  # each layer, each point
    assert sorted(round(v, 6) for v in opt.sparsity().values()) == [0.796875] * 2


def test_equals_masking_by_hand(K, gk):
    # Plain SGD: w <- (w - lr * g * M) * M, masks from the current weights at
    # each schedule point after an update (tfmot's rule, in numpy).
    x, y = _data()
    model = _model(K)
    opt = gk.MagnitudePruning(K.optimizers.SGD(0.1), model=model,
                              schedule=pruning.PolynomialDecay(**SCHEDULE))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    ref = _model(K)
    kernels = [ref.layers[0].kernel, ref.layers[1].kernel]
    masks = [np.ones(k.shape, "float32") for k in kernels]
    schedule = pruning_schedule.PolynomialDecay(**SCHEDULE)
    for j, i in enumerate(range(0, 96, 8), start=1):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(ref(x[i:i + 8], training=True) - y[i:i + 8]))
        grads = tape.gradient(loss, ref.trainable_variables)
        for g, v in zip(grads, ref.trainable_variables):
            mask = next((m for k, m in zip(kernels, masks) if k is v), 1.0)
            v.assign((v - 0.1 * g * mask) * mask)
        due, sparsity = schedule(j + 1)
        if bool(due):
            for n, k in enumerate(kernels):
                w = np.abs(k.numpy())
                keep = int(max(np.round(np.float32(w.size) * (1 - np.float32(sparsity))), 1))
                masks[n] = (w >= np.sort(w.ravel())[::-1][keep - 1]).astype("float32")
                k.assign(k * masks[n])
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


def test_two_of_four_stays_valid_after_every_step(K, gk):
    rng = np.random.RandomState(0)
    x = rng.randn(64, 6, 6, 8).astype("float32")
    y = rng.randn(64, 3).astype("float32")
    model = K.Sequential([K.Input((6, 6, 8)), K.layers.Conv2D(8, 3, name="conv"),
                          K.layers.Flatten(), K.layers.Dense(3, name="head")])
    opt = gk.MagnitudePruning(K.optimizers.Adam(0.01), model=model, m_by_n=(2, 4))
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    conv, head = model.layers[0].kernel, model.layers[2].kernel
    for _ in range(3):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        c = (conv.numpy() != 0).transpose(3, 0, 1, 2).reshape(-1, 4).sum(-1)
        h = (head.numpy() != 0).T.reshape(-1, 4).sum(-1)
        assert (c <= 2).all() and (h <= 2).all()
        assert _pruned_entries(opt) == (0, 0)
    assert opt.sparsity() == pytest.approx({k: 0.5 for k in opt.sparsity()})


def test_save_and_checkpoint_mid_schedule_resume_exactly(K, gk, tmp_path):
    x, y = _data()

    def make():
        model = _model(K)
        model.compile(optimizer=gk.MagnitudePruning(
            K.optimizers.Adam(0.05), model=model,
            schedule=pruning.PolynomialDecay(**SCHEDULE)), loss="mse")
        return model

    def fit(model, a, b):
        model.fit(x[a:b], y[a:b], batch_size=8, epochs=1, shuffle=False, verbose=0)

    full, stopped = make(), make()
    fit(full, 0, 40)
    fit(stopped, 0, 40)  # 5 updates: step 4's masks (62.5%), the next point at step 6
    stopped.save(str(tmp_path / "m.keras"))
    path = tf.train.Checkpoint(model=stopped, optimizer=stopped.optimizer).save(
        str(tmp_path / "ckpt"))
    loaded = K.models.load_model(str(tmp_path / "m.keras"))   # the pruned model itself
    restored = make()
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(path)
    assert int((loaded.layers[0].kernel.numpy() == 0).sum()) == ZEROS[4][0]
    for model in (full, loaded, restored):
        fit(model, 40, 96)
    assert max_abs_diff(weights_of(full), weights_of(loaded)) == 0
    assert max_abs_diff(weights_of(full), weights_of(restored)) == 0


def test_schedule_counts_accumulation_windows(K, gk):
    # Inside a GradientAccumulator the masks follow real updates: 12
    # micro-batches in windows of 2 are 6 updates, the mask of step 6.
    x, y = _data()
    model = _model(K)
    opt = gk.GradientAccumulator(gk.MagnitudePruning(
        K.optimizers.Adam(0.05), model=model, schedule=pruning.PolynomialDecay(**SCHEDULE)),
        steps=2, model=model)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == 6
    zeros = tuple(int((layer.kernel.numpy() == 0).sum()) for layer in model.layers)
    assert zeros == ZEROS[6]


@pytest.mark.distributed
def test_mirrored_strategy_equals_one_device(K, gk, mirrored):
    x, y = _data()

    def run(scope):
        with scope:
            model = _model(K)
            model.compile(optimizer=gk.MagnitudePruning(
                K.optimizers.SGD(0.1), model=model,
                schedule=pruning.PolynomialDecay(**SCHEDULE)), loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model

    one, two = run(tf.distribute.get_strategy().scope()), run(mirrored.scope())
    assert max_abs_diff(weights_of(one), weights_of(two)) < ROUNDOFF
    assert _pruned_entries(two.optimizer) == (0, 0)


def test_levenberg_marquardt_solves_over_the_unpruned_weights(K, gk):
    x, y = _data(n=64)
    y = y[:, :1]
    model = K.Sequential([K.Input((8,)), K.layers.Dense(6, activation="tanh"),
                          K.layers.Dense(1)])
    lm = gk.LevenbergMarquardt(model)
    opt = gk.MagnitudePruning(lm, model=model, schedule=pruning.ConstantSparsity(
        0.5, begin_step=1, end_step=1, frequency=1))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    assert _pruned_entries(opt) == (0, 0)
    dense = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    pruned = sum(int((m.numpy() == 0).sum()) for _, m, _ in opt._targets)
    assert lm._step_support.size == dense - pruned  # pruned columns never solved


@pytest.mark.parametrize("kwargs,match", [
    ({"targets": []}, "`targets` must be"),
    ({"targets": "nothing_matches"}, "matches none"),
    ({"schedule": 0.5}, "`schedule` must be"),
    ({"block_size": (0, 2)}, "`block_size` must be"),
    ({"block_pooling": "median"}, "`block_pooling` must be"),
    ({"m_by_n": (4, 2)}, "`m_by_n` must be"),
    ({"m_by_n": (2, 4), "block_size": (2, 2)}, "pass one"),
])
def test_bad_arguments_are_refused_at_construction(K, gk, kwargs, match):
    model = _model(K)
    with pytest.raises(ValueError, match=match):
        gk.MagnitudePruning(K.optimizers.Adam(), model=model, **kwargs)


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="end_step` must be > `begin_step"):
        pruning.PolynomialDecay(0.0, 0.5, begin_step=5, end_step=5)
    with pytest.raises(ValueError, match="-1 \\(no end\\) is for ConstantSparsity"):
        pruning.PolynomialDecay(0.0, 0.5, begin_step=0, end_step=-1)
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        pruning.ConstantSparsity(1.0)


def test_targets_by_layer_and_pattern(K, gk):
    model = _model(K)
    by_layer = gk.MagnitudePruning(K.optimizers.SGD(0.1), model=model,
                                   targets=[model.layers[1]])
    by_layer.build(model.trainable_variables)
    assert [v.name.split(":")[0].split("/")[-2:] for v, _, _ in by_layer._targets] == \
        [["d2", "kernel"]]
    by_pattern = gk.MagnitudePruning(K.optimizers.SGD(0.1), targets="d1/kernel")
    by_pattern.build(model.trainable_variables)
    assert len(by_pattern._targets) == 1


@pytest.mark.skipif(FLAVOUR != "tf_keras", reason="tfmot prunes tf_keras models only")
@pytest.mark.parametrize("schedule", [
    dict(SCHEDULE), dict(SCHEDULE, frequency=3), dict(SCHEDULE, begin_step=2, end_step=10,
                                                      frequency=3)])
def test_tfmot_equivalence(K, gk, schedule):
    # The same model, data and schedule: tfmot's sparsity after every batch
    # equals ours, layer by layer (tfmot's batch k uses step k; ours makes
    # step k's mask at the start of train step k, before its forward pass).
    tfmot = pytest.importorskip("tensorflow_model_optimization")
    sk = tfmot.sparsity.keras
    x, y = _data()
    theirs = sk.prune_low_magnitude(_model(K), pruning_schedule=sk.PolynomialDecay(**schedule))
    theirs.compile(optimizer=K.optimizers.Adam(0.05), loss="mse")
    ours = _model(K)
    opt = gk.MagnitudePruning(K.optimizers.Adam(0.05), model=ours,
                              schedule=pruning.PolynomialDecay(**schedule))
    ours.compile(optimizer=opt, loss="mse")
    sparsities = {"theirs": [], "ours": []}

    class Trace(K.callbacks.Callback):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def on_train_batch_end(self, batch, logs=None):
            if self.key == "ours":  # the mask this batch's forward pass used
                sparsities["ours"].append(tuple(round(v, 6) for v in opt.sparsity().values()))
            else:
                sparsities["theirs"].append(tuple(
                    round(float(1 - layer.pruning_vars[0][1].numpy().mean()), 6)
                    for layer in self.model.layers if hasattr(layer, "pruning_vars")))

    theirs.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
               callbacks=[sk.UpdatePruningStep(), Trace("theirs")])
    ours.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[Trace("ours")])
    assert sparsities["ours"] == sparsities["theirs"]
    assert np.max(sparsities["ours"][-1]) > 0.5


@pytest.mark.parametrize("inner", ["lagrangian", "subclass"])
def test_inner_updates_that_move_zeros_are_masked_every_step(K, gk, inner):
    # Between mask changes the masked gradients keep Keras's optimizers at
    # zero; an AugmentedLagrangian (its penalty's gradient reaches pruned
    # entries) or an unknown optimizer class may not: masked every update.
    x, y = _data()
    model = _model(K)

    class Drifting(K.optimizers.SGD):  # moves every entry, gradient or not
        def update_step(self, gradient, variable, *args):
            super().update_step(gradient, variable, *args)
            variable.assign_add(tf.fill(tf.shape(variable), 0.01))

    if inner == "lagrangian":
        kernel = model.trainable_variables[0]
        base = gk.AugmentedLagrangian(
            K.optimizers.Adam(0.05),
            [gk.Inequality(lambda: tf.reduce_sum(kernel) - 1.0)], initial_penalty=1.0)
    else:
        base = Drifting(0.1)
    opt = gk.MagnitudePruning(base, model=model, schedule=pruning.PolynomialDecay(**SCHEDULE))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert _pruned_entries(opt) == (0, 0)
    assert tuple(int((m.numpy() == 0).sum()) for _, m, _ in opt._targets) == ZEROS[10]
