"""A micro-step cut off half-written (a ParameterServerStrategy worker that
dies holding the window's mutex) is rolled back by the next one: the counters
as they were, the open window dropped whole and counted.

The parameter-server code path (mutex and journal) runs here in one process:
`distributed_window.concurrent_workers` is made to answer yes. The real
cluster, with a worker process killed, is `test_parameter_server.py`.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_gradkit.core import distributed_window


@pytest.fixture
def ps_path(monkeypatch):
    monkeypatch.setattr(distributed_window, "concurrent_workers", lambda strategy: True)


def _setup(K, gk, learning_rate):
    model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
    opt = gk.GradientAccumulator(K.optimizers.SGD(learning_rate), steps=2)
    opt.build(model.trainable_variables)
    return model, opt


def _grads(model, scale):
    x = tf.ones([4, 3]) * scale
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - 1.0))
    return tape.gradient(loss, model.trainable_variables)


def _counters(opt):
    return {name: int(getattr(opt, name).numpy()) for name in (
        "micro_steps", "window_micro_step", "version", "lost_micro_steps",
        "interrupted_updates", "dropped_gradients", "skipped_windows")}


def test_a_micro_step_cut_off_while_applying_is_rolled_back(K, gk, ps_path):
    del ps_path
    fail = tf.Variable(0.0)

    class FailWhenAsked(K.optimizers.schedules.LearningRateSchedule):
        """0.1, or an error inside the inner update while ``fail`` is set:
        the update is cut off after the window's other writes were made."""

        def __call__(self, step):
            check = tf.debugging.assert_equal(fail, 0.0, message="injected failure")
            with tf.control_dependencies([check]):
                return tf.constant(0.1) + 0.0 * tf.cast(step, tf.float32)

        def get_config(self):
            return {}

    model, opt = _setup(K, gk, FailWhenAsked())
    variables = model.trainable_variables
    opt.apply_gradients(zip(_grads(model, 1.0), variables), sample_count=4)
    fail.assign(1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="injected failure"):
        opt.apply_gradients(zip(_grads(model, 2.0), variables), sample_count=4)
    # Read while torn: as before the cut-off micro-step (from the journal).
    assert _counters(opt) == dict(micro_steps=1, window_micro_step=1, version=0,
                                  lost_micro_steps=0, interrupted_updates=0,
                                  dropped_gradients=0, skipped_windows=0)
    fail.assign(0.0)
    before = [v.numpy() for v in variables]
    g3, g4 = _grads(model, 3.0), _grads(model, 0.5)
    opt.apply_gradients(zip(g3, variables), sample_count=4)
    # Rolled back: the torn window is dropped whole (its 1 accepted
    # micro-step counted as lost, its update as interrupted) and this
    # micro-step opens a clean window.
    assert _counters(opt) == dict(micro_steps=2, window_micro_step=1, version=0,
                                  lost_micro_steps=1, interrupted_updates=1,
                                  dropped_gradients=0, skipped_windows=0)
    assert float(opt._state.weight.numpy()) == 4.0  # pylint: disable=protected-access
    opt.apply_gradients(zip(g4, variables), sample_count=4)
    assert _counters(opt)["version"] == 1 == int(opt.iterations.numpy())
    assert _counters(opt)["micro_steps"] == 2 * 1 + 0 + 1  # version * steps + open + lost
    # The window's update is exactly its two micro-steps' mean gradient.
    for b, v, a, c in zip(before, variables, g3, g4):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * (a.numpy() + c.numpy()) / 2,
                                   rtol=1e-6, atol=1e-7)


def test_a_micro_step_cut_off_while_adding_is_rolled_back(K, gk, ps_path):
    del ps_path
    model, opt = _setup(K, gk, 0.1)
    variables = model.trainable_variables
    opt.apply_gradients(zip(_grads(model, 1.0), variables), sample_count=4)
    # What a worker dying inside its micro-step leaves: the journal says a
    # micro-step began (with the counters as they were), and part of its
    # writes were made (here the window's weight and one counter).
    journal = opt._journal  # pylint: disable=protected-access
    entry = journal.variable.numpy().copy()
    entry[0] = journal.WRITING
    entry[1:] = [int(c.numpy()) for c in journal.counters]
    journal.variable.assign(entry)
    opt._state.weight.assign_add(4.0)  # pylint: disable=protected-access
    opt._micro_steps.assign_add(1)  # pylint: disable=protected-access
    assert _counters(opt)["micro_steps"] == 1  # read from the journal while torn
    before = [v.numpy() for v in variables]
    g2, g3 = _grads(model, 2.0), _grads(model, 3.0)
    opt.apply_gradients(zip(g2, variables), sample_count=4)
    assert _counters(opt) == dict(micro_steps=2, window_micro_step=1, version=0,
                                  lost_micro_steps=1, interrupted_updates=0,
                                  dropped_gradients=0, skipped_windows=0)
    assert float(opt._state.weight.numpy()) == 4.0  # pylint: disable=protected-access
    opt.apply_gradients(zip(g3, variables), sample_count=4)
    assert int(opt.version.numpy()) == 1 == int(opt.iterations.numpy())
    assert int(journal.variable.numpy()[0]) == 0
    for b, v, a, c in zip(before, variables, g2, g3):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * (a.numpy() + c.numpy()) / 2,
                                   rtol=1e-6, atol=1e-7)


def test_a_checkpoint_without_the_journal_restores(K, gk, monkeypatch, tmp_path):
    # A checkpoint made where the optimizer had no journal (before it existed,
    # or outside ParameterServerStrategy) restores into one that has it: every
    # other variable as saved, the journal and its counters zero (nothing cut
    # off), and the next micro-step closes the window it held.
    model, saved = _setup(K, gk, 0.1)
    variables = model.trainable_variables
    g1, g2 = _grads(model, 1.0), _grads(model, 2.0)
    saved.apply_gradients(zip(g1, variables), sample_count=4)
    path = tf.train.Checkpoint(optimizer=saved).save(str(tmp_path / "ckpt"))
    assert saved._journal is None  # pylint: disable=protected-access
    monkeypatch.setattr(distributed_window, "concurrent_workers", lambda strategy: True)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2)
    opt.build(variables)
    tf.train.Checkpoint(optimizer=opt).restore(path)
    assert _counters(opt) == dict(micro_steps=1, window_micro_step=1, version=0,
                                  lost_micro_steps=0, interrupted_updates=0,
                                  dropped_gradients=0, skipped_windows=0)
    journal = opt._journal  # pylint: disable=protected-access
    np.testing.assert_array_equal(journal.variable.numpy(), np.zeros(9, np.int64))
    assert float(opt._state.weight.numpy()) == 4.0  # pylint: disable=protected-access
    before = [v.numpy() for v in variables]
    opt.apply_gradients(zip(g2, variables), sample_count=4)
    assert int(opt.version.numpy()) == 1 == int(opt.iterations.numpy())
    for b, v, a, c in zip(before, variables, g1, g2):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * (a.numpy() + c.numpy()) / 2,
                                   rtol=1e-6, atol=1e-7)
