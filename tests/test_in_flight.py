"""Two chunks of a batched fit in flight at once on a CPU (`in_flight`,
issue 39): each chunk's result is the one it has alone, the chunks really
overlap, the caller's device scope goes with them, and where a second
thread would change what runs (a tape, a graph being built, functions run
eagerly) they run one at a time."""

import io
import threading
from contextlib import redirect_stdout

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tf_gradkit
from tf_gradkit.core.lm import in_flight

pytestmark = pytest.mark.keras_free


@pytest.fixture
def one_at_a_time(monkeypatch):
    def set_width(n):
        monkeypatch.setattr(in_flight, "CHUNKS_IN_FLIGHT", n)
    return set_width


def gaussians(batch, seed=0):
    """1-D Gaussians on 30 points, float32, starts off the truth; a few
    start with NaN data (their own status) to show locality survives."""
    rng = np.random.default_rng(seed)
    x = np.linspace(-3, 3, 30).astype(np.float32)
    truth = np.stack([rng.uniform(1, 3, batch), rng.uniform(-1, 1, batch),
                      rng.uniform(0.5, 1.5, batch)], 1).astype(np.float32)
    y = truth[:, :1] * np.exp(-(x - truth[:, 1:2]) ** 2 / (2 * truth[:, 2:] ** 2))
    y = (y + rng.normal(0, 0.05, y.shape)).astype(np.float32)
    y[::17, 3] = np.nan
    return x, y, (truth * rng.uniform(0.85, 1.15, truth.shape)).astype(np.float32)


def model(x, p):
    return p[:, :1] * tf.exp(-(x - p[:, 1:2]) ** 2 / (2 * p[:, 2:] ** 2))


@pytest.mark.parametrize("jit_compile", [True, False])
def test_chunks_in_flight_give_each_chunk_its_own_result(one_at_a_time, jit_compile):
    """Seven chunks (the last padded), two in flight, against one at a
    time: every output equal to the bit, NaN fits where they were, and the
    progress bar counting up in order."""
    x, y, p0 = gaussians(200)
    assert in_flight.width(7) == 2   # this machine and process allow two
    outs, bars = {}, {}
    for n in (1, 2):
        one_at_a_time(n)
        text = io.StringIO()
        with redirect_stdout(text):
            outs[n] = tf_gradkit.curve_fit(model, x, y, p0, batch_size=32,
                                           jit_compile=jit_compile, progress=True)
        bars[n] = [int(part.split("/")[0]) for part in
                   text.getvalue().replace("\r", "\n").split("curve_fit: ")[1:]]
    for field in outs[1]._fields:
        a, b = getattr(outs[1], field), getattr(outs[2], field)
        assert (a is None) == (b is None), field
        if a is not None:
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=field)
    assert bars[1] == bars[2] == [32, 64, 96, 128, 160, 192, 200]
    status = outs[2].status.numpy()
    assert np.all(status[::17] != status[1]) and np.all(outs[2].converged.numpy()[1::17])


def test_chunks_overlap_in_the_callers_device_scope():
    """Two items block on a two-party barrier: only two threads at once get
    through it (one at a time would time out). Each sees the caller's
    device scope; results come back in order, `done` called in order."""
    barrier = threading.Barrier(2, timeout=30)
    seen, done = [], []

    def fn(i):
        seen.append((threading.current_thread() is threading.main_thread(),
                     context.context().device_name))
        if i < 2:
            barrier.wait()
        return i * i

    with tf.device("/CPU:0"):
        scope = context.context().device_name
        assert in_flight.run(fn, list(range(5)), done.append) == [0, 1, 4, 9, 16]
    assert done == [0, 1, 2, 3, 4]
    assert not any(main for main, _ in seen)
    assert scope.endswith("CPU:0") and all(device == scope for _, device in seen)


def test_an_error_in_a_chunk_is_raised_as_it_is():
    def fn(i):
        if i == 2:
            raise ValueError("chunk 2 failed")
        return i

    with pytest.raises(ValueError, match="chunk 2 failed"):
        in_flight.run(fn, list(range(6)))


def test_one_at_a_time_where_a_second_thread_would_change_what_runs():
    """A tape (per thread: it would miss the second chunk's ops), a graph
    being built, and `run_functions_eagerly` (the user's model in two
    threads) keep one chunk at a time; so does a single chunk."""
    assert in_flight.width(3) == 2 and in_flight.width(1) == 1
    with tf.GradientTape():
        assert in_flight.width(3) == 1
    with tf.autodiff.ForwardAccumulator(tf.constant(1.0), tf.constant(1.0)):
        assert in_flight.width(3) == 1

    @tf.function(autograph=False)
    def graph():
        return tf.constant(in_flight.width(3))
    assert int(graph()) == 1
    tf.config.run_functions_eagerly(True)
    try:
        assert in_flight.width(3) == 1
    finally:
        tf.config.run_functions_eagerly(False)


def test_a_fit_under_a_tape_runs_its_chunks_in_the_callers_thread(monkeypatch):
    """Under a tape no second thread is started (the tape would miss its
    ops), and the fit is the one outside a tape."""
    x, y, p0 = gaussians(100)
    free = tf_gradkit.curve_fit(model, x, y, p0, batch_size=32, jit_compile=False)

    def no_threads(*args, **kwargs):
        raise AssertionError("a second thread under a tape")
    monkeypatch.setattr(in_flight.concurrent.futures, "ThreadPoolExecutor", no_threads)
    with tf.GradientTape():
        taped = tf_gradkit.curve_fit(model, x, y, p0, batch_size=32, jit_compile=False)
    np.testing.assert_array_equal(free.x.numpy(), taped.x.numpy())
    with pytest.raises(AssertionError, match="second thread"):
        tf_gradkit.curve_fit(model, x, y, p0, batch_size=32, jit_compile=False)
