"""GradientAccumulator under fit: the epoch's short window is applied before
anything else sees the epoch's end (checkpoints, backups, validation), and
its non-finite policies leave the traces they promise (issue 27, items 2, 3)."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

from helpers import ROUNDOFF, max_abs_diff, mlp, regression_data, weights_of

# 26 examples in batches of 8, 8, 8, 2 and windows of 3: one full window and
# a short one of a single micro-batch per epoch, two updates per epoch.


def _accumulator(K, gk, model, **kwargs):
    return gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=3, model=model,
                                  **kwargs)


def _fit(K, gk, epochs, callbacks=(), seed=1, **fit_kwargs):
    x, y = regression_data()
    model = mlp(K, seed=seed)
    opt = _accumulator(K, gk, model)
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks), **fit_kwargs)
    return model, opt, history


def test_user_callbacks_and_checkpoints_see_the_short_window_applied(K, gk, tmp_path):
    seen = []

    class Record(K.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((int(self.model.optimizer.iterations.numpy()),
                         weights_of(self.model)))

    path = str(tmp_path / "epoch.weights.h5")
    saver = K.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq="epoch")
    model, opt, _ = _fit(K, gk, epochs=2, callbacks=[Record(), saver])
    assert [n for n, _ in seen] == [2, 4]
    assert int(opt.iterations.numpy()) == 4
    assert max_abs_diff(seen[-1][1], weights_of(model)) == 0
    loaded = mlp(K, seed=5)
    loaded.load_weights(path)
    assert max_abs_diff(weights_of(loaded), weights_of(model)) == 0


def test_validation_logs_describe_the_weights_the_epoch_ends_with(K, gk):
    x, y = regression_data()
    model, _, history = _fit(K, gk, epochs=1, validation_data=(x, y))
    after = model.evaluate(x, y, batch_size=32, verbose=0)
    after = after[0] if isinstance(after, list) else after
    np.testing.assert_allclose(history.history["val_loss"][-1], after, rtol=1e-5)


def test_backup_and_restore_resumes_to_the_uninterrupted_run(K, gk, tmp_path):
    full, full_opt, _ = _fit(K, gk, epochs=3)

    class Interrupt(K.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(K, gk, epochs=3, callbacks=[
            K.callbacks.BackupAndRestore(backup, save_freq="epoch"), Interrupt()])
    resumed, resumed_opt, _ = _fit(K, gk, epochs=3, seed=7, callbacks=[
        K.callbacks.BackupAndRestore(backup, save_freq="epoch")])
    assert int(full_opt.iterations.numpy()) == 6
    assert int(resumed_opt.iterations.numpy()) == 6
    assert max_abs_diff(weights_of(full), weights_of(resumed)) < ROUNDOFF


# ----------------------------------------------------------- non-finite policies
def _bad(y):
    bad = y.copy()
    bad[0] = np.nan
    return bad


def _state(model, opt):
    """Weights and every optimizer variable but the dropped-gradient count."""
    keep = [v for v in opt.variables if "dropped_gradients" not in v.name]
    return weights_of(model) + [np.array(v.numpy()) for v in keep]


def test_nonfinite_raise_leaves_no_trace(K, gk, mode):
    from helpers import make_train_step  # noqa: PLC0415

    x, y = regression_data()
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=4, nonfinite="raise")
    step = make_train_step(model, opt, mode)
    for i in range(5):  # one update, one micro-batch in the open window
        step(x[i * 4:i * 4 + 4], y[i * 4:i * 4 + 4], sample_count=4)
    before = _state(model, opt)
    if mode == "jit":  # XLA cannot raise: the micro-batch is left out, and counted
        step(x[20:24], _bad(y[20:24]), sample_count=4)
        assert int(opt.dropped_gradients.numpy()) == 1
    else:
        with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
            step(x[20:24], _bad(y[20:24]), sample_count=4)
    assert max_abs_diff(before, _state(model, opt)) == 0
    assert int(opt.micro_steps.numpy()) == 5
    assert int(opt.window_micro_step.numpy()) == 1


@pytest.mark.parametrize("jit", [False, True])
def test_nonfinite_raise_under_fit_leaves_no_trace(K, gk, jit):
    x, y = regression_data(n=24)
    y_bad = y.copy()
    y_bad[16] = np.nan  # the third batch of 8
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=4, model=model,
                                 nonfinite="raise", epoch_end="carry")
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    ref = mlp(K)
    ref_opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=4, model=ref,
                                     epoch_end="carry")
    ref.compile(optimizer=ref_opt, loss="mse", jit_compile=jit)
    ref.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    if jit:
        with pytest.warns(UserWarning, match="NaN or Inf gradient without raising"):
            model.fit(x, y_bad, batch_size=8, epochs=1, shuffle=False, verbose=0)
    else:
        with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
            model.fit(x, y_bad, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(opt.micro_steps.numpy()) == 2
    assert int(opt.window_micro_step.numpy()) == 2
    assert max_abs_diff(_state(ref, ref_opt), _state(model, opt)) == 0


def test_skipped_windows_are_reported_under_fit(K, gk):
    x, y = regression_data(n=24)
    y_bad = y.copy()
    y_bad[0] = np.nan
    model = mlp(K)
    opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=3, model=model)
    model.compile(optimizer=opt, loss="mse")
    with pytest.warns(UserWarning, match=r"skipped 1 window.*skipped_windows"):
        model.fit(x, y_bad, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(opt.skipped_windows.numpy()) == 1
    with warnings.catch_warnings():  # nothing new skipped: nothing said
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
