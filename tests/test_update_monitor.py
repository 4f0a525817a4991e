"""UpdateMonitor: per-layer update norms equal the weight deltas computed by
hand; gradient norms equal those of the gradient applied; accumulators log
their real updates only."""

import numpy as np
import pytest
import tensorflow as tf

FIT_MODES = ["eager", "graph", "jit"]


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


class _Deltas:
    """Records every layer's weights before and after each batch (by hand)."""

    def __init__(self, K, model):
        outer = self

        class Recorder(K.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                outer.before = [w.numpy().copy() for w in model.trainable_variables]

            def on_train_batch_end(self, batch, logs=None):
                after = [w.numpy().copy() for w in model.trainable_variables]
                outer.steps.append((outer.before, after))

        self.steps, self.callback = [], Recorder()


def _layer_norm(arrays):
    return float(np.sqrt(sum(np.sum(np.square(a.astype("float64"))) for a in arrays)))


@pytest.mark.parametrize("fit_mode", FIT_MODES)
def test_update_norms_are_the_real_deltas_with_plain_sgd(K, gk, fit_mode):
    model = _model(K)
    x, y = _data()
    _compile(model, K.optimizers.SGD(0.1), fit_mode)
    deltas = _Deltas(K, model)
    monitor = gk.callbacks.UpdateMonitor(every=1)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                        callbacks=[deltas.callback, monitor])
    assert len(monitor.history) == 3
    names = {"hidden": [0, 1], "out": [2, 3]}
    for record, (before, after) in zip(monitor.history, deltas.steps):
        for name, idx in names.items():
            got = record["layers"][name]
            want_update = _layer_norm([after[i] - before[i] for i in idx])
            want_weight = _layer_norm([before[i] for i in idx])
            # float32 weights: the delta of a 0.1-step is exact to ~1e-7 relative.
            assert got["update_norm"] == pytest.approx(want_update, rel=1e-5)
            assert got["weight_norm"] == pytest.approx(want_weight, rel=1e-6)
            assert got["update_ratio"] == pytest.approx(want_update / want_weight, rel=1e-5)
            # SGD: the update is lr * gradient, so the gradient norm is update / lr.
            assert got["grad_norm"] == pytest.approx(want_update / 0.1, rel=1e-4)
    assert "update_ratio" in history.history or fit_mode  # logs reach the history too


def test_accumulator_logs_only_its_real_updates(K, gk):
    model = _model(K)
    x, y = _data(32)
    _compile(model, gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2, model=model),
             "graph")
    deltas = _Deltas(K, model)
    monitor = gk.callbacks.UpdateMonitor(every=1)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[deltas.callback, monitor])
    # 4 micro-batches, windows of 2: two real updates, on batches 2 and 4.
    assert [r["step"] for r in monitor.history] == [1, 2]
    real = [(b, a) for b, a in deltas.steps
            if any(np.any(bi != ai) for bi, ai in zip(b, a))]
    assert len(real) == 2
    for record, (before, after) in zip(monitor.history, real):
        want = _layer_norm([after[i] - before[i] for i in (0, 1)])
        assert record["layers"]["hidden"]["update_norm"] == pytest.approx(want, rel=1e-5)
        assert record["layers"]["hidden"]["update_norm"] > 0
        # The gradient logged is the window's, the one SGD applied.
        assert record["layers"]["hidden"]["grad_norm"] == pytest.approx(want / 0.1, rel=1e-4)


def test_every_counts_batches_and_tensorboard_gets_scalars(K, gk, tmp_path):
    model = _model(K)
    x, y = _data(48)
    _compile(model, K.optimizers.Adam(0.01), "graph")
    monitor = gk.callbacks.UpdateMonitor(every=2, log_dir=str(tmp_path))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    assert len(monitor.history) == 3  # batches 1, 3, 5 of 6
    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert events
    tags = set()
    for event in tf.compat.v1.train.summary_iterator(str(events[0])):
        for value in event.summary.value:
            tags.add(value.tag)
    assert "update_monitor/hidden/update_ratio" in tags
    assert "update_monitor/out/grad_norm" in tags
    # Training again without the monitor works (its watch is gone).
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    leaf = model.optimizer
    assert "apply" not in leaf.__dict__ and "apply_gradients" not in leaf.__dict__


def test_bad_arguments_are_named(gk):
    with pytest.raises(ValueError, match=r"`every` must be an integer >= 1. Received: every=0"):
        gk.callbacks.UpdateMonitor(every=0)
    with pytest.raises(ValueError, match=r"`log_dir` must be a directory path"):
        gk.callbacks.UpdateMonitor(log_dir=3)
