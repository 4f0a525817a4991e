"""`tf_gradkit.callbacks.ExactBackupAndRestore`: an interrupted ``fit``
resumed from a mid-epoch backup ends with the weights and optimizer state of
the run that never stopped (a `GradientAccumulator` window open at the
backup included), in both flavours, eager, ``tf.function`` and XLA, and under
``MirroredStrategy``; Keras's
own ``BackupAndRestore(save_freq=k)`` does not (its interrupted epoch
restarts its data: shown, as the reason for the callback); and what cannot
resume exactly is refused.

The interruption is a callback raising after a given batch, as Keras's own
``BackupAndRestore`` tests do; the resumed ``fit`` uses a new model and
optimizer (other initial weights), as a new process would.
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from helpers import max_abs_diff, mlp, regression_data, variables_of, weights_of

EPOCHS, BATCHES = 3, 5  # 5 batches of 8 per epoch
STOP_AFTER = 8  # batches: epoch 1, its 3rd batch; the last backup was after its 2nd


def _dataset(shuffle=True):
    x, y = regression_data(n=40)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:  # one fixed order: resumable
        data = data.shuffle(40, seed=3, reshuffle_each_iteration=False)
    return data.batch(8)


class _Interrupt:
    """Raises after ``after`` batches of this fit (a crash, as Keras's own
    BackupAndRestore tests simulate one)."""

    def __new__(cls, K, after):
        class Interrupt(K.callbacks.Callback):
            seen = 0

            def on_train_batch_end(self, batch, logs=None):
                Interrupt.seen += 1
                if Interrupt.seen == after:
                    raise RuntimeError("interrupted")

        return Interrupt()


class _Count:
    def __new__(cls, K):
        class Count(K.callbacks.Callback):
            batches = 0

            def on_train_batch_end(self, batch, logs=None):
                Count.batches += 1

        return Count()


def _model(K, gk, mode, seed=1, strategy=None):
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = mlp(K, seed=seed)
        opt = gk.GradientAccumulator(K.optimizers.Adam(0.05), steps=3, model=model)
        model.compile(optimizer=opt, loss="mse", run_eagerly=mode == "eager",
                      jit_compile=mode == "jit")
    return model


def _state(model):
    return weights_of(model) + variables_of(model.optimizer)


@pytest.mark.parametrize("mode", ["eager", "function", pytest.param("jit", marks=pytest.mark.slow)])
def test_an_interrupted_fit_resumes_to_the_uninterrupted_run(K, gk, mode, tmp_path):
    _interrupt_and_resume(K, gk, mode, tmp_path, save_freq=2)


def test_backups_at_each_epochs_start_resume_exactly_too(K, gk, tmp_path):
    _interrupt_and_resume(K, gk, "function", tmp_path, save_freq="epoch")


@pytest.mark.distributed
def test_under_mirrored_strategy_too(K, gk, tmp_path, mirrored):
    _interrupt_and_resume(K, gk, "function", tmp_path, save_freq=2, strategy=mirrored)


def _interrupt_and_resume(K, gk, mode, tmp_path, save_freq, strategy=None):
    callbacks = tf_gradkit.callbacks
    whole = _model(K, gk, mode, strategy=strategy)
    backup = callbacks.ExactBackupAndRestore(_dataset(), str(tmp_path / "a"), save_freq)
    whole.fit(backup.dataset, epochs=EPOCHS, callbacks=[backup], verbose=0)
    assert int(whole.optimizer.micro_steps.numpy()) == EPOCHS * BATCHES

    first = _model(K, gk, mode, strategy=strategy)
    backup = callbacks.ExactBackupAndRestore(_dataset(), str(tmp_path / "b"), save_freq)
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(backup.dataset, epochs=EPOCHS, callbacks=[backup, _Interrupt(K, STOP_AFTER)],
                  verbose=0)
    # A new model and optimizer (other weights), as in a new process.
    resumed = _model(K, gk, mode, seed=7, strategy=strategy)
    resumed(np.zeros((1, 3), "float32"))
    backup = callbacks.ExactBackupAndRestore(_dataset(), str(tmp_path / "b"), save_freq)
    count = _Count(K)
    resumed.fit(backup.dataset, epochs=EPOCHS, callbacks=[backup, count], verbose=0)

    # The batches after the last backup, and no others: after 2 batches of
    # epoch 1 (save_freq=2), or at epoch 1's start ("epoch").
    done = BATCHES + (2 if save_freq == 2 else 0)
    assert type(count).batches == EPOCHS * BATCHES - done
    assert int(resumed.optimizer.micro_steps.numpy()) == EPOCHS * BATCHES
    # Same float32 operations on the same values in the same order: equal to
    # the last bit; 1e-6 leaves room for nothing but that.
    assert max_abs_diff(_state(resumed), _state(whole)) <= 1e-6
    assert not (tmp_path / "b").exists()  # removed once fit finished


def test_a_backup_taken_mid_window_holds_the_open_window(K, gk, tmp_path):
    model = _model(K, gk, "function")
    backup = tf_gradkit.callbacks.ExactBackupAndRestore(
        _dataset(), str(tmp_path / "b"), save_freq=2, delete_checkpoint=False)
    with pytest.raises(RuntimeError):
        model.fit(backup.dataset, epochs=EPOCHS, callbacks=[backup, _Interrupt(K, STOP_AFTER)],
                  verbose=0)
    # The backup after epoch 1's 2nd batch: epoch 0 applied 1 window and
    # flushed 2 batches at its end (epoch_end="apply"); 2 micro-steps open.
    reader = tf.train.load_checkpoint(str(tmp_path / "b"))
    position = [reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
                if k.startswith("position/")]
    assert [p.tolist() for p in position] == [[1, 2]]
    fresh = _model(K, gk, "function", seed=7)
    fresh(np.zeros((1, 3), "float32"))
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(
        tf.train.latest_checkpoint(str(tmp_path / "b"))).expect_partial()
    assert int(fresh.optimizer.window_micro_step) == 2
    assert int(fresh.optimizer.iterations) == 2


def test_keras_backup_and_restore_mid_epoch_is_not_the_uninterrupted_run(K, gk, tmp_path):
    """Why the callback exists: Keras's own mid-epoch resume restores the
    weights and optimizer exactly but restarts the interrupted epoch's data
    (Keras 3 from its first batch and step; tf_keras from its first batch at
    the saved step), so the run differs."""
    whole = _model(K, gk, "function")
    whole.fit(_dataset(), epochs=EPOCHS, verbose=0)
    first = _model(K, gk, "function")
    keras_backup = K.callbacks.BackupAndRestore(str(tmp_path / "k"), save_freq=2)
    with pytest.raises(RuntimeError):
        first.fit(_dataset(), epochs=EPOCHS, callbacks=[keras_backup, _Interrupt(K, STOP_AFTER)],
                  verbose=0)
    resumed = _model(K, gk, "function", seed=7)
    resumed(np.zeros((1, 3), "float32"))
    resumed.fit(_dataset(), epochs=EPOCHS, verbose=0,
                callbacks=[K.callbacks.BackupAndRestore(str(tmp_path / "k"), save_freq=2)])
    assert max_abs_diff(weights_of(resumed), weights_of(whole)) > 1e-4


def test_what_cannot_resume_exactly_is_refused(K, tmp_path):
    make = tf_gradkit.callbacks.ExactBackupAndRestore
    x, y = regression_data(n=40)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    with pytest.raises(ValueError, match="repeats forever"):
        make(data.batch(8).repeat(), str(tmp_path))
    with pytest.raises(ValueError, match="length of `dataset` is unknown"):
        make(data.filter(lambda a, b: True).batch(8), str(tmp_path))
    tf.random.set_seed(None)  # no global seed either (the next test sets its own)
    with pytest.raises(ValueError, match="without a seed"):
        make(data.shuffle(40, reshuffle_each_iteration=False).batch(8), str(tmp_path))
    with pytest.raises(ValueError, match="reshuffles on each pass"):
        make(data.shuffle(40, seed=1).batch(8), str(tmp_path))
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        make((x, y), str(tmp_path))
    with pytest.raises(ValueError, match="save_freq"):
        make(data.batch(8), str(tmp_path), save_freq=0)
    options = tf.data.Options()
    options.deterministic = False
    with pytest.raises(ValueError, match="deterministic=False"):
        make(data.batch(8).with_options(options), str(tmp_path))

    model = mlp(K)
    model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    backup = make(data.batch(8), str(tmp_path / "spe"))
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(backup.dataset, epochs=1, callbacks=[backup], verbose=0)
    model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match="one pass"):
        model.fit(backup.dataset.repeat(), steps_per_epoch=3, epochs=1, callbacks=[backup],
                  verbose=0)
