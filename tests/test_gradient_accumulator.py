"""GradientAccumulator behaviour users rely on, under the process's flavour.

Run once per flavour by `make test`; every test here goes through both the
Keras 3 and the tf_keras adapter that way.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR, compile_fn, mode_with_function_slow
from helpers import (ROUNDOFF, embedding_model, make_train_step, max_abs_diff,
                     mlp, mse_grads, regression_data, variables_of, weights_of)


# "function" (tf.function without XLA) runs under `make test-slow` only: each
# test taking `mode` keeps its "jit" case, the graph-mode run of the same
# assertion (conftest.mode_with_function_slow).
mode = mode_with_function_slow()

INNER = {
    "sgd": lambda K: K.optimizers.SGD(0.1),
    "momentum": lambda K: K.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda K: K.optimizers.Adam(0.05),
    "adamw": lambda K: K.optimizers.AdamW(0.05, weight_decay=0.05),
}
# Micro-batches of 12, 12 and a short 2: a window the big batch of 26 matches.
SPLITS = [(0, 12), (12, 24), (24, 26)]


def _big_batch_reference(K, inner, x, y, updates):
    model = mlp(K)
    opt = INNER[inner](K)
    for _ in range(updates):
        _, grads = mse_grads(model, x, y)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model, opt


@pytest.mark.parametrize("inner", sorted(INNER))
def test_window_equals_big_batch_with_short_last_microbatch(K, gk, inner, mode):
    x, y = regression_data()
    ref, ref_opt = _big_batch_reference(K, inner, x, y, updates=2)
    model = mlp(K)
    opt = gk.GradientAccumulator(INNER[inner](K), steps=3)
    step = make_train_step(model, opt, mode)
    for _ in range(2):
        for a, b in SPLITS:
            step(x[a:b], y[a:b], sample_count=b - a)
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF
    assert int(opt.iterations.numpy()) == 2 == int(ref_opt.iterations.numpy())
    assert int(opt.micro_steps.numpy()) == 6


def test_microbatch_reduction_weights_microbatches_equally(K, gk, mode):
    x, y = regression_data()
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=3,
                                 reduction="microbatch")
    step = make_train_step(model, opt, mode)
    expected = [w.numpy() for w in model.trainable_variables]
    grads_each = [mse_grads(model, x[a:b], y[a:b])[1] for a, b in SPLITS]
    for i in range(len(expected)):
        expected[i] = expected[i] - np.mean([g[i].numpy() for g in grads_each], 0)
    for a, b in SPLITS:
        step(x[a:b], y[a:b], sample_count=b - a)  # ignored: "microbatch"
    got = [w.numpy() for w in model.trainable_variables]
    assert max_abs_diff(expected, got) < ROUNDOFF


def test_sum_reduction_sums(K, gk, mode):
    x, y = regression_data()
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=3, reduction="sum")
    step = make_train_step(model, opt, mode)
    grads_each = [mse_grads(model, x[a:b], y[a:b])[1] for a, b in SPLITS]
    expected = [w.numpy() - 0.1 * sum(g[i].numpy() for g in grads_each)
                for i, w in enumerate(model.trainable_variables)]
    for a, b in SPLITS:
        step(x[a:b], y[a:b])
    assert max_abs_diff(expected, [w.numpy() for w in model.trainable_variables]) < ROUNDOFF


def test_inner_optimizer_untouched_between_updates(K, gk, mode):
    x, y = regression_data()
    model = mlp(K)
    inner = K.optimizers.Adam(0.05)
    opt = gk.GradientAccumulator(inner, steps=4, reduction="microbatch")
    step = make_train_step(model, opt, mode)
    step(x[:8], y[:8])
    inner_before = [np.array(v.numpy()) for v in inner.variables]
    weights_before = weights_of(model)
    step(x[8:16], y[8:16])
    step(x[16:24], y[16:24])
    assert max_abs_diff(inner_before, [v.numpy() for v in inner.variables]) == 0
    assert max_abs_diff(weights_before, weights_of(model)) == 0
    assert int(opt.iterations.numpy()) == 0 and int(opt.window_micro_step.numpy()) == 3
    step(x[24:], y[24:])
    assert int(opt.iterations.numpy()) == 1 and int(opt.window_micro_step.numpy()) == 0


def test_learning_rate_schedule_sees_real_steps(K, gk):
    x, y = regression_data()
    model = mlp(K)
    schedule = K.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1,
                                                       decay_rate=0.5)
    opt = gk.GradientAccumulator(K.optimizers.SGD(schedule), steps=4,
                                 reduction="microbatch")
    step = make_train_step(model, opt, "function")
    for i in range(8):
        step(x[i * 3:i * 3 + 3], y[i * 3:i * 3 + 3])
    assert int(opt.iterations.numpy()) == 2
    assert int(opt.micro_steps.numpy()) == 8
    lr_now = float(schedule(opt.iterations))
    assert lr_now == pytest.approx(0.1 * 0.25)


def test_stale_gradients_are_dropped_and_counted(K, gk, mode):
    x, y = regression_data()
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2,
                                 reduction="microbatch")
    step = make_train_step(model, opt, mode)
    step(x[:8], y[:8], local_step=0)
    step(x[8:16], y[8:16], local_step=0)        # window closes: iterations 1
    assert int(opt.iterations.numpy()) == 1
    before = weights_of(model)
    step(x[:8], y[:8], local_step=0)            # stale: computed before update 1
    assert int(opt.dropped_gradients.numpy()) == 1
    assert int(opt.window_micro_step.numpy()) == 0
    assert max_abs_diff(before, weights_of(model)) == 0
    step(x[:8], y[:8], local_step=1)
    step(x[8:16], y[8:16], local_step=1)
    assert int(opt.iterations.numpy()) == 2
    assert int(opt.micro_steps.numpy()) == 4


def test_nonfinite_microbatch_skips_whole_window(K, gk, mode):
    x, y = regression_data()
    model = mlp(K)
    inner = K.optimizers.Adam(0.05)
    opt = gk.GradientAccumulator(inner, steps=2, reduction="microbatch")
    step = make_train_step(model, opt, mode)
    step(x[:8], y[:8])
    step(x[8:16], y[8:16])  # one real update, so Adam has state to protect
    weights = weights_of(model)
    state = [np.array(v.numpy()) for v in inner.variables]
    bad_y = y[:8].copy()
    bad_y[0] = np.nan
    step(x[:8], bad_y)
    step(x[8:16], y[8:16])
    assert int(opt.skipped_windows.numpy()) == 1
    assert max_abs_diff(weights, weights_of(model)) == 0
    assert max_abs_diff(state, [v.numpy() for v in inner.variables]) == 0
    step(x[:8], y[:8])
    step(x[8:16], y[8:16])
    assert int(opt.iterations.numpy()) == 2
    assert all(np.isfinite(w).all() for w in weights_of(model))


@pytest.mark.parametrize("mode_", ["eager", "function"])
def test_nonfinite_raise_policy(K, gk, mode_):
    x, y = regression_data()
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2, nonfinite="raise",
                                 reduction="microbatch")
    step = make_train_step(model, opt, mode_)
    bad_y = y[:8].copy()
    bad_y[0] = np.inf
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
        step(x[:8], bad_y)


def test_nonfinite_raise_policy_under_xla_still_protects_weights(K, gk):
    # XLA has no way to raise from inside a compiled step (it drops
    # CheckNumerics), so under jit_compile "raise" leaves the micro-batch out
    # (counted in dropped_gradients) and changes nothing else.
    x, y = regression_data()
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2, nonfinite="raise",
                                 reduction="microbatch")
    step = make_train_step(model, opt, "jit")
    before = weights_of(model)
    bad_y = y[:8].copy()
    bad_y[0] = np.inf
    step(x[:8], bad_y)
    step(x[8:16], y[8:16])
    assert int(opt.skipped_windows.numpy()) == 0
    assert int(opt.dropped_gradients.numpy()) == 1
    assert int(opt.window_micro_step.numpy()) == 1
    assert max_abs_diff(before, weights_of(model)) == 0


def test_sparse_gradients_accumulate_like_dense(K, gk, mode):
    rng = np.random.RandomState(3)
    x = rng.randint(0, 50, size=(12, 5)).astype("int32")
    y = rng.randn(12, 1).astype("float32")
    ref = embedding_model(K)
    ref_opt = K.optimizers.SGD(0.5)
    _, grads = mse_grads(ref, x, y)
    assert isinstance(grads[0], tf.IndexedSlices)
    ref_opt.apply_gradients(zip(grads, ref.trainable_variables))

    model = embedding_model(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.5), steps=3)
    step = make_train_step(model, opt, mode)
    for a, b in [(0, 4), (4, 8), (8, 12)]:
        step(x[a:b], y[a:b], sample_count=b - a)
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


def test_flush_applies_partial_window_weighted_by_content(K, gk, mode):
    x, y = regression_data()
    ref, _ = _big_batch_reference(K, "adam", x[:20], y[:20], updates=1)
    model = mlp(K)
    opt = gk.GradientAccumulator(INNER["adam"](K), steps=4)
    step = make_train_step(model, opt, mode)
    step(x[:12], y[:12], sample_count=12)
    step(x[12:20], y[12:20], sample_count=8)
    compile_fn(opt.flush, mode)()
    assert int(opt.iterations.numpy()) == 1 and int(opt.window_micro_step.numpy()) == 0
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF
    opt.flush()  # empty window: nothing happens
    assert int(opt.iterations.numpy()) == 1


def test_discard_drops_partial_window(K, gk):
    x, y = regression_data()
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=4,
                                 reduction="microbatch")
    step = make_train_step(model, opt, "function")
    before = weights_of(model)
    step(x[:8], y[:8])
    opt.discard()
    assert int(opt.window_micro_step.numpy()) == 0
    for i in range(4):
        step(x[i * 6:i * 6 + 6], y[i * 6:i * 6 + 6])
    assert int(opt.iterations.numpy()) == 1
    assert max_abs_diff(before, weights_of(model)) > 1e-3


def _two_heads(K):
    """Two models trained by one optimizer: `b` is used by some micro-batches only."""
    a, b = mlp(K), mlp(K, seed=2)
    return a, b, a.trainable_variables + b.trainable_variables


def test_a_micro_step_giving_gradients_to_other_variables_is_refused(K, gk, mode):
    # Before, the window's update covered the closing micro-step's variables
    # only: what the others had accumulated was silently dropped.
    x, y = regression_data()
    a, b, variables = _two_heads(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=3, reduction="sum")

    def step(both):
        def run(xs, ys):
            grads = mse_grads(a, xs, ys)[1]
            grads += mse_grads(b, xs, ys)[1] if both else [None] * len(b.trainable_variables)
            opt.apply_gradients(zip(grads, variables))
        return compile_fn(run, mode)

    both, only_a = step(True), step(False)
    both(x[:8], y[:8])
    weights, state = weights_of(a) + weights_of(b), variables_of(opt)
    first_of_b = b.trainable_variables[0]
    name = re.escape(getattr(first_of_b, "path", None) or first_of_b.name)
    with pytest.raises(ValueError, match="same variables.*" + name):
        only_a(x[8:16], y[8:16])
    assert max_abs_diff(weights, weights_of(a) + weights_of(b)) == 0
    assert max_abs_diff(state, variables_of(opt)) == 0
    assert int(opt.micro_steps.numpy()) == 1


def test_a_variable_never_given_a_gradient_is_never_updated(K, gk, mode):
    # `b` is trainable but no micro-batch uses it: windows and a flush leave
    # it as it is, even under AdamW's weight decay.
    x, y = regression_data()
    a, b, variables = _two_heads(K)
    opt = gk.GradientAccumulator(K.optimizers.AdamW(0.05, weight_decay=0.5), steps=2,
                                 reduction="microbatch")

    def run(xs, ys):
        grads = mse_grads(a, xs, ys)[1] + [None] * len(b.trainable_variables)
        opt.apply_gradients(zip(grads, variables))

    step = compile_fn(run, mode)
    untouched, before = weights_of(b), weights_of(a)
    for i in range(3):
        step(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
    compile_fn(opt.flush, mode)()
    assert int(opt.iterations.numpy()) == 2
    assert max_abs_diff(untouched, weights_of(b)) == 0
    assert max_abs_diff(before, weights_of(a)) > 1e-3


# ----------------------------------------------------------------- model.fit
@pytest.mark.parametrize("jit", [False, True])
def test_fit_with_model_weights_by_batch_size_and_applies_at_epoch_end(K, gk, jit):
    x, y = regression_data()  # 26 examples: batches 8, 8, 8, 2
    ref, _ = _big_batch_reference(K, "adam", x, y, updates=2)
    model = mlp(K)
    opt = gk.GradientAccumulator(INNER["adam"](K), steps=4, model=model)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == 2
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


def test_fit_with_steps_per_execution(K, gk):
    x, y = regression_data(n=32)
    ref, _ = _big_batch_reference(K, "adam", x, y, updates=1)
    model = mlp(K)
    opt = gk.GradientAccumulator(INNER["adam"](K), steps=4, model=model)
    model.compile(optimizer=opt, loss="mse", steps_per_execution=2)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == 1
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


@pytest.mark.distributed
def test_mirrored_strategy_flush_at_epoch_end(K, gk, mirrored):
    x, y = regression_data(n=48)  # 3 global batches of 16: window of 4 is cut
    ref, _ = _big_batch_reference(K, "adam", x, y, updates=1)
    strategy = mirrored
    with strategy.scope():
        model = mlp(K)
        opt = gk.GradientAccumulator(INNER["adam"](K), steps=4, model=model)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == 1
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


@pytest.mark.parametrize("policy,updates,left", [("apply", 2, 0), ("carry", 1, 2), ("drop", 0, 0)])
def test_epoch_end_policies_under_fit(K, gk, policy, updates, left):
    x, y = regression_data(n=24)  # 3 batches of 8 per epoch, windows of 4
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=4, model=model,
                                 epoch_end=policy)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == updates
    assert int(opt.window_micro_step.numpy()) == left


def test_fit_without_batch_sizes_is_refused_with_advice(K, gk):
    # reduction="example" needs each micro-batch's size: under fit that comes
    # from model= (or attach(model)). Without it the first step is refused
    # (before any state changes) rather than silently weighting micro-batches
    # equally.
    x, y = regression_data(n=26)
    model = mlp(K)
    before = weights_of(model)
    model.compile(optimizer=gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=4),
                  loss="mse")
    with pytest.raises(ValueError, match=r"reduction='example'.*pass model=.*"
                       r"sample_count=.*reduction='microbatch'"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(before, weights_of(model)) == 0
    # reduction="microbatch" says what it does: Keras's equal weighting.
    ref = mlp(K)
    ref.compile(optimizer=K.optimizers.SGD(0.1, gradient_accumulation_steps=4)
                if FLAVOUR == "keras3" else K.optimizers.SGD(0.1), loss="mse")
    model = mlp(K)
    model.compile(optimizer=gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=4,
                                                   reduction="microbatch"), loss="mse")
    xs, ys = x[:24], y[:24]
    if FLAVOUR == "keras3":
        ref.fit(xs, ys, batch_size=6, epochs=1, shuffle=False, verbose=0)
    else:
        ref.fit(xs, ys, batch_size=24, epochs=1, shuffle=False, verbose=0)
    model.fit(xs, ys, batch_size=6, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


# ------------------------------------------------------------ checkpointing
def test_checkpoint_resume_mid_window_continues_exactly(K, gk, tmp_path):
    x, y = regression_data()

    def run(model, opt, calls):
        step = make_train_step(model, opt, "function")
        for i in calls:
            step(x[i * 4:i * 4 + 4], y[i * 4:i * 4 + 4], sample_count=4)

    full = mlp(K)
    full_opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=3)
    run(full, full_opt, range(5))

    first = mlp(K)
    first_opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=3)
    run(first, first_opt, range(4))  # one update + one micro-batch pending
    path = tf.train.Checkpoint(model=first, optimizer=first_opt).save(
        str(tmp_path / "ckpt"))

    resumed = mlp(K, seed=9)
    resumed_opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=3)
    resumed_opt.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed_opt).restore(
        path).assert_existing_objects_matched()
    assert int(resumed_opt.window_micro_step.numpy()) == 1
    run(resumed, resumed_opt, [4])
    assert int(resumed_opt.iterations.numpy()) == 1
    run(resumed, resumed_opt, [5])
    run(full, full_opt, [5])
    assert int(resumed_opt.iterations.numpy()) == 2
    assert max_abs_diff(weights_of(full), weights_of(resumed)) < ROUNDOFF


def test_config_round_trip_and_model_save_load(K, gk, tmp_path):
    x, y = regression_data()
    opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=3,
                                 reduction="microbatch", epoch_end="carry",
                                 nonfinite="raise")
    clone = gk.GradientAccumulator.from_config(opt.get_config())
    assert clone.get_config() == opt.get_config()
    assert clone.steps == 3 and clone.reduction == "microbatch"

    model = mlp(K)
    model.compile(optimizer=gk.GradientAccumulator(K.optimizers.Adam(0.05),
                                                   steps=3, model=model,
                                                   epoch_end="carry"), loss="mse")
    model.fit(x[:16], y[:16], batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = K.models.load_model(path)
    assert isinstance(loaded.optimizer, gk.GradientAccumulator)
    assert int(loaded.optimizer.iterations.numpy()) == 1
    assert int(loaded.optimizer.window_micro_step.numpy()) == 1
    assert max_abs_diff(variables_of(model.optimizer), variables_of(loaded.optimizer)) == 0


# ------------------------------------------------------------ distribution
@pytest.mark.distributed
@pytest.mark.parametrize("steps_per_replica_batch", [(4, 8)])
def test_mirrored_strategy_fit_equals_single_device(K, gk, mirrored,
                                                    steps_per_replica_batch):
    steps, batch = steps_per_replica_batch
    x, y = regression_data(n=64)
    ref = mlp(K)
    ref.compile(optimizer=K.optimizers.Adam(0.05), loss="mse")
    ref.fit(x, y, batch_size=steps * batch, epochs=2, shuffle=False, verbose=0)
    strategy = mirrored
    with strategy.scope():
        model = mlp(K)
        opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=steps,
                                     model=model)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == 4
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


@pytest.mark.distributed
def test_mirrored_strategy_custom_loop_with_sample_counts(K, gk, mirrored):
    x, y = regression_data(n=24)
    ref = mlp(K)
    ref_opt = K.optimizers.SGD(0.2, momentum=0.5)
    _, grads = mse_grads(ref, x, y)
    ref_opt.apply_gradients(zip(grads, ref.trainable_variables))

    strategy = mirrored
    with strategy.scope():
        model = mlp(K)
        opt = gk.GradientAccumulator(K.optimizers.SGD(0.2, momentum=0.5), steps=2)
        opt.build(model.trainable_variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            # Keras convention: each replica's loss is divided by the replicas.
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb)) / 2.0
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables),
                            sample_count=tf.shape(xb)[0])

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    # Two global batches of 12 (6 per replica) form the window of 24.
    for a, b in [(0, 12), (12, 24)]:
        dist = strategy.experimental_distribute_values_from_function(
            lambda ctx, a=a, b=b: (
                x[a + 6 * ctx.replica_id_in_sync_group:a + 6 * ctx.replica_id_in_sync_group + 6],
                y[a + 6 * ctx.replica_id_in_sync_group:a + 6 * ctx.replica_id_in_sync_group + 6]))
        step(*dist)
    assert int(opt.iterations.numpy()) == 1
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


# ------------------------------------------------------------ mixed precision
def test_loss_scale_optimizer_composes_and_lowers_scale_on_overflow(K, gk):
    # The arrangement each flavour documents: Keras 3 puts the loss-scale
    # optimizer outside (its compile would wrap a GradientAccumulator holding
    # one again), tf_keras may hold it inside (unscaled in compute_gradients).
    x, y = regression_data()
    ref, _ = _big_batch_reference(K, "sgd", x[:16], y[:16], updates=1)
    model = mlp(K)
    if FLAVOUR == "keras3":
        # (equal micro-batches; the loss-scale optimizer has no sample_count)
        acc = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2,
                                     reduction="microbatch")
        lso = opt = K.mixed_precision.LossScaleOptimizer(acc)
    else:
        lso = K.mixed_precision.LossScaleOptimizer(K.optimizers.SGD(0.1))
        acc = opt = gk.GradientAccumulator(lso, steps=2)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = (lso.scale_loss(loss) if FLAVOUR == "keras3"
                      else lso.get_scaled_loss(loss))
        grads = tape.gradient(scaled, model.trainable_variables)
        if FLAVOUR == "tf_keras":
            grads = lso.get_unscaled_gradients(grads)
            opt.apply_gradients(zip(grads, model.trainable_variables), sample_count=8)
        else:  # the loss-scale optimizer passes no sample_count through
            opt.apply_gradients(zip(grads, model.trainable_variables))

    scale_name = "dynamic_scale" if FLAVOUR == "keras3" else "loss_scale"
    step(x[:8], y[:8])
    step(x[8:16], y[8:16])
    scale0 = float(getattr(lso, scale_name))
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF
    weights = weights_of(model)
    bad = y[:8].copy()
    bad[0] = np.nan
    step(x[:8], bad)
    if FLAVOUR == "keras3":
        # The loss-scale optimizer skips the overflowing micro-batch itself:
        # the window never sees it.
        assert int(acc.window_micro_step.numpy()) == 0
        assert float(getattr(lso, scale_name)) == scale0 / 2
    step(x[8:16], y[8:16])
    if FLAVOUR == "tf_keras":
        assert int(opt.skipped_windows.numpy()) == 1
        assert max_abs_diff(weights, weights_of(model)) == 0
        assert float(getattr(lso, scale_name)) == scale0 / 2


def test_keras3_refuses_a_loss_scale_optimizer_inside(K, gk):
    if FLAVOUR != "keras3":
        pytest.skip("tf_keras unscales in compute_gradients: exact unless wrapped again "
                    "(test_loss_scale_wrappers.py)")
    with pytest.raises(TypeError, match=r"GradientAccumulator cannot wrap "
                       r"LossScaleOptimizer.*unscaled twice.*Put the "
                       r"LossScaleOptimizer outside"):
        gk.GradientAccumulator(K.mixed_precision.LossScaleOptimizer(
            K.optimizers.SGD(0.1)), steps=2)


def test_mixed_precision_fit_with_compile_wrapping_equals_the_big_batch(K, gk):
    # Under a mixed_float16 policy compile wraps the plain accumulator in a
    # loss-scale optimizer (Keras 3; tf_keras too): updates are the big
    # batch's, not 1/scale of them (the double unscale this once gave).
    x, y = regression_data(n=16)
    policy = K.mixed_precision.global_policy()
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        def run(optimizer_fn, batch):
            model = mlp(K)
            opt = optimizer_fn(model)
            model.compile(optimizer=opt, loss="mse")
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            return model, opt
        big, _ = run(lambda m: K.optimizers.SGD(0.1), 16)
        acc, opt = run(lambda m: gk.GradientAccumulator(K.optimizers.SGD(0.1), 4,
                                                        model=m), 4)
    finally:
        K.mixed_precision.set_global_policy(policy)
    assert isinstance(acc.optimizer, K.mixed_precision.LossScaleOptimizer)
    assert int(opt.iterations.numpy()) == 1
    # float16 activations: the forward pass rounds at 2^-11 in both runs.
    assert max_abs_diff(weights_of(big), weights_of(acc)) < 1e-3


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs,match", [
    ({"steps": 0}, "`steps` must be an integer >= 1"),
    ({"steps": 2.5}, "Received: steps=2.5"),
    ({"steps": True}, "Received: steps=True"),
    ({"steps": 2, "reduction": "mean"}, "`reduction` must be one of"),
    ({"steps": 2, "epoch_end": "flush"}, "`epoch_end` must be one of"),
    ({"steps": 2, "nonfinite": "ignore"}, "`nonfinite` must be one of"),
])
def test_bad_constructor_arguments(K, gk, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gk.GradientAccumulator(K.optimizers.SGD(0.1), **kwargs)


def test_not_an_optimizer_or_other_flavour_is_rejected(K, gk):
    with pytest.raises(TypeError, match="Received: optimizer=builtins.str"):
        gk.GradientAccumulator("adam", steps=2)
    other = __import__("tf_keras" if FLAVOUR == "keras3" else "keras")
    with pytest.raises(TypeError, match="other flavour"):
        gk.GradientAccumulator(other.optimizers.SGD(0.1), steps=2)
    with pytest.raises(TypeError, match="`model` must be"):
        gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2, model=object())
    with pytest.raises(TypeError, match="unexpected arguments"):
        gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2, clipnorm=1.0)


def test_mismatched_gradients_raise_and_change_nothing(K, gk):
    x, y = regression_data()
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=1,
                                 reduction="microbatch")
    _, grads = mse_grads(model, x, y)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    weights = weights_of(model)
    state = variables_of(opt)
    with pytest.raises(ValueError, match="gradients for"):
        if FLAVOUR == "keras3":
            opt.apply(grads[:2], model.trainable_variables)
        else:
            opt._apply_grads(grads[:2], model.trainable_variables)
    assert max_abs_diff(weights, weights_of(model)) == 0
    assert max_abs_diff(state, variables_of(opt)) == 0


# ------------------------------------------------------------ packaging
def test_public_names_resolve_to_the_active_flavour(gk):
    import tf_gradkit  # noqa: PLC0415
    assert tf_gradkit.optimizers.GradientAccumulator is gk.GradientAccumulator


# keras_free: the child process is the same from either flavour's process
# (TF_USE_LEGACY_KERAS removed from its environment), so it runs once.
@pytest.mark.keras_free
def test_import_sets_no_environment_and_imports_no_keras():
    # TensorFlow itself imports the Keras tf.keras is; tf_gradkit must add no
    # Keras module (it registers its own classes with that Keras). Then
    # tf_gradkit.pruning and its names: still no tfmot, no environment change
    # (tfmot's import would set TF_USE_LEGACY_KERAS for the process).
    code = (
        "import os, sys; import tensorflow; before = dict(os.environ); "
        "mods = set(sys.modules); import tf_gradkit; "
        "assert dict(os.environ) == before, 'environment changed'; "
        "new = [m for m in set(sys.modules) - mods if 'keras' in m "
        "and not m.startswith('tf_gradkit')]; "
        "assert not new, new; "
        "import tf_gradkit.pruning as p; "
        "p.MaskAware, p.PruningStepper, p.UpdatePruningStepFromOptimizer; "
        "assert 'tensorflow_model_optimization' not in sys.modules, 'tfmot imported'; "
        "assert dict(os.environ) == before, 'tf_gradkit.pruning changed the environment'")
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    out = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


# Issue 38, item 12: 16-bit windows. One Dense(1) kernel, initially 0, without
# bias, x = 1 and micro-batches of one example: each micro-batch's gradient of
# the mean squared error is exactly -2 y, y = 16 + u (1 + i), u the dtype's
# spacing at 16 (so y and -2 y are representable), and SGD(1.0) leaves the
# kernel at minus the mean gradient rounded to the variable's dtype. The eight
# gradients add up to about -257: a 16-bit running sum rounds there (spacing
# 2 in bfloat16, 0.25 in float16) where a float32 sum is exact (every partial
# sum needs fewer than 24 bits).
def _y16(dtype, steps=tuple(range(1, 9))):
    spacing = {"bfloat16": 2.0 ** -3, "float16": 2.0 ** -6}[dtype]
    return (16.0 + spacing * np.array(steps)).astype("float32").reshape(8, 1)


def _sixteen_bit_model(K, dtype):
    model = K.Sequential([K.Input((1,)), K.layers.Dense(1, use_bias=False, dtype=dtype,
                                                        kernel_initializer="zeros")])
    assert model.trainable_variables[0].dtype == dtype  # 16-bit variables, not mixed
    return model


def _sixteen_bit_window(dtype, accumulate_in, y=None):
    """The kernel after one window of the eight gradients -2 y, their mean
    taken in ``accumulate_in`` (running sum, as an accumulator adds them),
    then rounded to ``dtype`` and subtracted (SGD(1.0) from 0)."""
    numpy_dtype = tf.as_dtype(dtype).as_numpy_dtype
    y = (_y16(dtype) if y is None else y)[:, 0]
    grads = (-2.0 * y).astype(numpy_dtype)  # exact: checked below
    np.testing.assert_array_equal(grads.astype("float32"), -2.0 * y)
    total = np.zeros((), tf.as_dtype(accumulate_in).as_numpy_dtype)
    for g in grads:
        total = (total + g.astype(total.dtype)).astype(total.dtype)
    mean = (total / total.dtype.type(8)).astype(numpy_dtype)
    return -(mean.astype("float32"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("path", ["fit", "loop"])
def test_sixteen_bit_windows_are_summed_in_float32(K, gk, dtype, path, mode):
    expected = _sixteen_bit_window(dtype, "float32")
    # Control: the same window summed in 16 bits ends elsewhere.
    assert expected != _sixteen_bit_window(dtype, dtype)
    model, y = _sixteen_bit_model(K, dtype), _y16(dtype)
    x = np.ones((8, 1), "float32")
    if path == "fit":
        opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=8, model=model)
        model.compile(optimizer=opt, loss="mse", run_eagerly=mode == "eager",
                      jit_compile=mode == "jit")
        model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0)
    else:
        opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=8)
        step = make_train_step(model, opt, mode)
        for i in range(8):
            step(tf.constant(x[i:i + 1], dtype), tf.constant(y[i:i + 1], dtype),
                 sample_count=1)
    assert int(opt.iterations.numpy()) == 1
    assert all(s.dtype == tf.float32 for s in opt._state.acc_grads)
    got = model.trainable_variables[0].numpy().astype("float32").ravel()
    np.testing.assert_array_equal(got, [expected])


def test_accumulator_dtype_float64_and_wide_variables(K, gk):
    # "float64" sums a 16-bit window in float64 (same result here: the float32
    # sum is exact); a float32 variable keeps float32 sums by default, and a
    # float64 one is never summed in less than float64.
    model = _sixteen_bit_model(K, "bfloat16")
    opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=8,
                                 accumulator_dtype="float64")
    step = make_train_step(model, opt, "eager")
    for i in range(8):
        step(tf.ones((1, 1), "bfloat16"), tf.constant(_y16("bfloat16")[i:i + 1], "bfloat16"),
             sample_count=1)
    assert opt._state.acc_grads[0].dtype == tf.float64
    np.testing.assert_array_equal(model.trainable_variables[0].numpy().astype("float32"),
                                  [[_sixteen_bit_window("bfloat16", "float64")]])
    from tf_gradkit.core.accumulation import sum_dtype  # noqa: PLC0415
    assert sum_dtype("float32") == tf.float32 and sum_dtype("float64", "float32") == \
        tf.float64 and sum_dtype("float16", "float64") == tf.float64


@pytest.mark.parametrize("bad", ["half", "int32", 1, "fp32", tf.int32])
def test_bad_accumulator_dtype_is_refused_by_name(K, gk, bad):
    # "float16" and "bfloat16" are accepted: 16-bit sums for old checkpoints
    # (test_accumulator_narrowing).
    with pytest.raises(ValueError, match=r"`accumulator_dtype` must be one of \(None, "
                       r"'float32', 'float64', 'float16', 'bfloat16'\).*Received: "
                       rf"accumulator_dtype={re.escape(repr(bad))}"):
        gk.GradientAccumulator(K.optimizers.SGD(0.1), 2, accumulator_dtype=bad)


def test_sixteen_bit_window_checkpointed_mid_window_keeps_its_float32_sums(K, gk, tmp_path):
    # Saved after 3 of 8 micro-batches and restored into a new optimizer, the
    # float32 sums come back unrounded: the resumed window ends where the
    # hand-made float32 window does (a bfloat16 sum of the same gradients ends
    # elsewhere: the control of test_sixteen_bit_windows_are_summed_in_float32).
    y = _y16("bfloat16")

    def run(model, opt, calls):
        step = make_train_step(model, opt, "eager")
        for i in calls:
            step(tf.ones((1, 1), "bfloat16"), tf.constant(y[i:i + 1], "bfloat16"),
                 sample_count=1)

    first = _sixteen_bit_model(K, "bfloat16")
    first_opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=8)
    run(first, first_opt, range(3))
    path = tf.train.Checkpoint(model=first, optimizer=first_opt).save(str(tmp_path / "c"))
    resumed = _sixteen_bit_model(K, "bfloat16")
    resumed_opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=8)
    resumed_opt.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed_opt).restore(
        path).assert_existing_objects_matched()
    restored = resumed_opt._state.acc_grads[0]
    assert restored.dtype == tf.float32
    np.testing.assert_array_equal(restored.numpy().ravel(), [-2.0 * y[:3].sum()])
    run(resumed, resumed_opt, range(3, 8))
    assert int(resumed_opt.iterations.numpy()) == 1
    np.testing.assert_array_equal(
        resumed.trainable_variables[0].numpy().astype("float32"),
        [[_sixteen_bit_window("bfloat16", "float32")]])


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_window_under_mirrored_strategy_equals_one_device(K, gk, mirrored, dtype):
    # Two replicas, one example each per step, windows of 4 steps: eight
    # gradients -2 y, summed in float32 over the replicas too. Control: each
    # replica's float32 share (-sum of its y / 4: Keras halves each replica's
    # loss) rounded to 16 bits before the inner optimizer's sum over replicas
    # would end elsewhere for these y (found by search; replica r gets y[r::2]).
    y = _y16(dtype, steps=(16, 24, 30, 37, 38, 47, 58, 63))
    expected = _sixteen_bit_window(dtype, "float32", y)
    narrow = tf.as_dtype(dtype).as_numpy_dtype
    shares = [narrow(-y[r::2, 0].sum() / 4) for r in range(2)]
    assert -float(narrow(np.float32(shares[0]) + np.float32(shares[1]))) != expected
    with mirrored.scope():
        model = _sixteen_bit_model(K, dtype)
        opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=4, model=model)
        model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((8, 1), "float32"), y, batch_size=2, epochs=1, shuffle=False,
              verbose=0)
    assert int(opt.iterations.numpy()) == 1
    np.testing.assert_array_equal(
        model.trainable_variables[0].numpy().astype("float32").ravel(), [expected])
