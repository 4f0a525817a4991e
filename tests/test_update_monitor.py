"""UpdateMonitor: per-layer update norms equal the weight deltas computed by
hand, gradient norms equal those of the gradient the optimizer applied (from a
tape by hand), accumulators log their real updates only, under fit eager,
graph and XLA, in both flavours."""

import math

import numpy as np
import pytest
import tensorflow as tf

FIT_MODES = ["eager", "graph", "jit"]
LAYERS = {"hidden": [0, 1], "out": [2, 3]}  # trainable variable indices per layer


def _model(K):
    K.utils.set_random_seed(0)
    return K.Sequential([K.Input((4,)), K.layers.Dense(5, activation="tanh", name="hidden"),
                         K.layers.Dense(1, name="out")])


def _data(n=24):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _compile(model, optimizer, fit_mode):
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=fit_mode == "eager",
                  jit_compile=fit_mode == "jit")


def _sq(arrays):
    return sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in arrays)


class _ByHand:
    """Records, around every batch, the weights before and after, the
    gradient of the mean loss over the batch's examples (a tape, by hand) and
    the logs the batch reported."""

    def __init__(self, K, model, x, y, batch_size):
        outer = self
        self.steps, self.logs = [], []

        class Recorder(K.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                xb = x[batch * batch_size:(batch + 1) * batch_size]
                yb = y[batch * batch_size:(batch + 1) * batch_size]
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
                grads = tape.gradient(loss, model.trainable_variables)
                outer.before = [w.numpy().copy() for w in model.trainable_variables]
                outer.grads = [g.numpy() for g in grads]

            def on_train_batch_end(self, batch, logs=None):
                after = [w.numpy().copy() for w in model.trainable_variables]
                outer.steps.append((outer.before, after, outer.grads))
                outer.logs.append({k: float(np.asarray(v)) for k, v in (logs or {}).items()})

        self.callback = Recorder()


def _check_record(record, before, after, grads=None):
    for name, idx in LAYERS.items():
        got = record["layers"][name]
        update = math.sqrt(_sq([after[i] - before[i] for i in idx]))
        weight = math.sqrt(_sq([before[i] for i in idx]))
        # float32 weights and deltas: the norms agree to ~1e-7 relative; the
        # delta of two float32 weights loses a few bits of a 1e-3-sized step.
        assert got["update_norm"] == pytest.approx(update, rel=1e-4)
        assert got["weight_norm"] == pytest.approx(weight, rel=1e-6)
        assert got["update_ratio"] == pytest.approx(update / weight, rel=1e-4)
        if grads is not None:
            # The tape's float32 reduction order differs from the step's.
            want = math.sqrt(_sq([grads[i] for i in idx]))
            assert got["grad_norm"] == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("fit_mode", FIT_MODES)
def test_adam_update_norms_are_the_real_deltas(K, gk, fit_mode):
    model = _model(K)
    x, y = _data()
    _compile(model, K.optimizers.Adam(0.01), fit_mode)
    by_hand = _ByHand(K, model, x, y, 8)
    monitor = gk.callbacks.UpdateMonitor(every=1, per_layer_logs=True)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                        callbacks=[by_hand.callback, monitor])
    assert [r["step"] for r in monitor.history] == [1, 2, 3]
    for record, (before, after, grads), logs in zip(monitor.history, by_hand.steps,
                                                     by_hand.logs):
        _check_record(record, before, after, grads)
        layers = record["layers"]
        # The batch's logs summarise the same update.
        assert logs["update_ratio"] == pytest.approx(
            np.max([v["update_ratio"] for v in layers.values()]), rel=1e-6)
        assert logs["update_norm"] == pytest.approx(
            math.sqrt(sum(v["update_norm"] ** 2 for v in layers.values())), rel=1e-6)
        assert logs["grad_norm"] == pytest.approx(
            math.sqrt(sum(v["grad_norm"] ** 2 for v in layers.values())), rel=1e-6)
        assert logs["hidden/update_ratio"] == pytest.approx(
            layers["hidden"]["update_ratio"], rel=1e-6)
    assert history.history["update_norm"][-1] == pytest.approx(by_hand.logs[-1]["update_norm"])


@pytest.mark.parametrize("fit_mode", FIT_MODES)
def test_accumulator_logs_only_its_real_updates(K, gk, fit_mode):
    model = _model(K)
    x, y = _data(32)
    _compile(model, gk.GradientAccumulator(K.optimizers.Adam(0.01), steps=2, model=model),
             fit_mode)
    by_hand = _ByHand(K, model, x, y, 8)
    monitor = gk.callbacks.UpdateMonitor(every=1)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[by_hand.callback, monitor])
    # 4 micro-batches, windows of 2: real updates on micro-batches 2 and 4 only.
    assert [r["step"] for r in monitor.history] == [1, 2]
    changed = [any(np.any(b != a) for b, a in zip(before, after))
               for before, after, _ in by_hand.steps]
    assert changed == [False, True, False, True]
    for record, window in zip(monitor.history, ((0, 1), (2, 3))):
        before, after, _ = by_hand.steps[window[1]]
        # The window's gradient: the mean of its two equal micro-batches'.
        grads = [(g0 + g1) / 2 for g0, g1 in zip(by_hand.steps[window[0]][2],
                                                   by_hand.steps[window[1]][2])]
        _check_record(record, before, after, grads)
    norms = [logs["update_norm"] for logs in by_hand.logs]
    # No spurious zeros: before the first real update NaN, then the last one's.
    assert math.isnan(norms[0])
    assert norms[2] == norms[1] > 0 and norms[3] > 0


@pytest.mark.parametrize("name", ["LevenbergMarquardt", "MagnitudePruning"])
def test_other_optimizers_log_their_real_updates(K, gk, name):
    model = _model(K)
    x, y = _data()
    optimizer = (gk.LevenbergMarquardt(model) if name == "LevenbergMarquardt"
                 else gk.MagnitudePruning(K.optimizers.Adam(0.01)))
    _compile(model, optimizer, "jit")
    by_hand = _ByHand(K, model, x, y, 8)
    monitor = gk.callbacks.UpdateMonitor(every=1)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[by_hand.callback, monitor])
    assert len(monitor.history) == 3
    for record, (before, after, _) in zip(monitor.history, by_hand.steps):
        _check_record(record, before, after)
        # LM solves its own step: no gradient is applied, so none is logged.
        grad = record["layers"]["hidden"]["grad_norm"]
        assert math.isnan(grad) if name == "LevenbergMarquardt" else grad > 0


def test_keras3_gradient_accumulation_steps_counts_real_updates(K, gk):
    if not hasattr(K.optimizers.Adam(), "gradient_accumulation_steps"):
        pytest.skip("tf_keras optimizers have no gradient_accumulation_steps")
    model = _model(K)
    x, y = _data(32)
    _compile(model, K.optimizers.Adam(0.01, gradient_accumulation_steps=2), "graph")
    by_hand = _ByHand(K, model, x, y, 8)
    monitor = gk.callbacks.UpdateMonitor(every=1)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[by_hand.callback, monitor])
    assert [r["step"] for r in monitor.history] == [1, 2]
    for record, i in zip(monitor.history, (1, 3)):
        before, after, _ = by_hand.steps[i]
        _check_record(record, before, after)


def test_every_counts_updates_and_tensorboard_gets_summaries(K, gk, tmp_path):
    model = _model(K)
    x, y = _data(48)
    _compile(model, K.optimizers.Adam(0.01), "graph")
    monitor = gk.callbacks.UpdateMonitor(every=2, log_dir=str(tmp_path))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    # Updates 1, 3, 5 of each 6-batch epoch; read at each epoch's end.
    assert [r["step"] for r in monitor.history] == [1, 3, 5, 7, 9, 11]
    tags = set()
    for event in tf.compat.v1.train.summary_iterator(
            str(next(tmp_path.glob("events.out.tfevents.*")))):
        for value in event.summary.value:
            tags.add(value.tag)
    assert {"update_monitor/hidden/update_ratio", "update_monitor/out/grad_norm",
            "update_monitor/update_ratio"} <= tags
    # Off again: the model's train step and the optimizer are its own.
    assert "train_step" not in model.__dict__
    assert "apply" not in model.optimizer.__dict__
    assert "apply_gradients" not in model.optimizer.__dict__
    assert "update_norm" not in model.fit(x, y, batch_size=8, epochs=1, verbose=0).history


def test_steps_per_execution_monitors_inside_the_compiled_loop(K, gk):
    model = _model(K)
    x, y = _data(48)
    model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse", steps_per_execution=3)
    monitor = gk.callbacks.UpdateMonitor(every=2)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    # Six steps in two calls of the train function: updates 1, 3, 5 all seen.
    assert [r["step"] for r in monitor.history] == [1, 3, 5]
    assert all(r["layers"]["out"]["update_norm"] > 0 for r in monitor.history)


def test_bad_arguments_are_named(gk):
    with pytest.raises(ValueError, match=r"`every` must be an integer >= 1. Received: every=0"):
        gk.callbacks.UpdateMonitor(every=0)
    with pytest.raises(ValueError, match=r"`log_dir` must be a directory path"):
        gk.callbacks.UpdateMonitor(log_dir=3)
