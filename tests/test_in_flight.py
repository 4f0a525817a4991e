"""Two chunks of a batched fit in flight at once on a CPU (`in_flight`,
issue 39): each chunk's result is the one it has alone, the chunks really
overlap, the caller's device scope goes with them, and where a second
thread would change what runs (a tape, op callbacks, a strategy,
functions run eagerly), where chunks are too large (a
`batch_size` chosen for memory) or too small, or where no thread can
start, they run one at a time."""

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
    """Three chunks (the last padded), two in flight, against one at a
    time: every output equal to the bit, NaN fits where they were, and the
    progress bar counting up in order."""
    x, y, p0 = gaussians(2500)
    assert in_flight.width(3, 1024 * 30 * 3 * 4) == 2   # this machine allows two
    outs, bars = {}, {}
    for n in (1, 2):
        one_at_a_time(n)
        text = io.StringIO()
        with redirect_stdout(text):
            outs[n] = tf_gradkit.curve_fit(model, x, y, p0, batch_size=1024,
                                           jit_compile=jit_compile, progress=True)
        bars[n] = [int(part.split("/")[0]) for part in
                   text.getvalue().replace("\r", "\n").split("curve_fit: ")[1:]]
    for field in outs[1]._fields:
        a, b = getattr(outs[1], field), getattr(outs[2], field)
        assert (a is None) == (b is None), field
        if a is not None:
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=field)
    assert bars[1] == bars[2] == [1024, 2048, 2500]
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
    """A tape or accumulator (per thread: it would miss the second chunk's
    ops), op callbacks (check_numerics: per thread), a strategy's scope
    (per thread: the second thread would trace again outside it),
    `run_functions_eagerly` (the user's model in two threads),
    a single chunk, chunks above `MAX_CHUNK_BYTES` (two would need twice
    the memory a `batch_size` was chosen for) or under `MIN_CHUNK_BYTES`
    keep one chunk at a time."""
    assert in_flight.width(3) == 2 and in_flight.width(1) == 1
    assert in_flight.width(3, in_flight.MAX_CHUNK_BYTES + 1) == 1
    assert in_flight.width(3, in_flight.MIN_CHUNK_BYTES - 1) == 1
    with tf.GradientTape():
        assert in_flight.width(3) == 1
    with tf.autodiff.ForwardAccumulator(tf.constant(1.0), tf.constant(1.0)):
        assert in_flight.width(3) == 1
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert in_flight.width(3) == 1
    tf.debugging.enable_check_numerics()
    try:
        assert in_flight.width(3) == 1
    finally:
        tf.debugging.disable_check_numerics()
    assert in_flight.width(3) == 2

    tf.config.run_functions_eagerly(True)
    try:
        assert in_flight.width(3) == 1
    finally:
        tf.config.run_functions_eagerly(False)


def test_where_no_thread_can_start_the_chunks_run_in_the_callers_thread(monkeypatch):
    """At interpreter shutdown (an atexit handler) a pool refuses new work
    with a RuntimeError: the chunks then run one at a time, same results."""
    def refuse(self, *args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")
    monkeypatch.setattr(in_flight.concurrent.futures.ThreadPoolExecutor, "submit", refuse)
    done = []
    assert in_flight.run(lambda i: i + 1, range(4), done.append) == [1, 2, 3, 4]
    assert done == [0, 1, 2, 3]


def test_a_fit_under_a_tape_runs_its_chunks_in_the_callers_thread(monkeypatch):
    """Under a tape no second thread is started (the tape would miss its
    ops), and the fit is the one outside a tape."""
    x, y, p0 = gaussians(2500)
    free = tf_gradkit.curve_fit(model, x, y, p0, batch_size=1024, jit_compile=False)

    def no_threads(*args, **kwargs):
        raise AssertionError("a second thread under a tape")
    monkeypatch.setattr(in_flight.concurrent.futures, "ThreadPoolExecutor", no_threads)
    with tf.GradientTape():
        taped = tf_gradkit.curve_fit(model, x, y, p0, batch_size=1024, jit_compile=False)
    np.testing.assert_array_equal(free.x.numpy(), taped.x.numpy())
    with pytest.raises(AssertionError, match="second thread"):
        tf_gradkit.curve_fit(model, x, y, p0, batch_size=1024, jit_compile=False)


def test_least_squares_batched_with_a_batch_size_and_no_mask_runs_two(monkeypatch):
    """`least_squares_batched` given a `batch_size` and no mask: its chunks'
    size in bytes comes from the first chunk (N unknown before), and they
    run two at a time with the results they have one at a time."""
    x, y, p0 = gaussians(2500)
    y = np.nan_to_num(y)

    def fun(p, yb):
        return model(x, p) - yb

    started = []
    pool = in_flight.concurrent.futures.ThreadPoolExecutor

    def counting(*args, **kwargs):
        started.append(1)
        return pool(*args, **kwargs)
    monkeypatch.setattr(in_flight.concurrent.futures, "ThreadPoolExecutor", counting)
    two = tf_gradkit.least_squares_batched(fun, p0, args=(y,), batch_size=1024,
                                           jit_compile=False)
    assert started == [1]
    monkeypatch.setattr(in_flight, "CHUNKS_IN_FLIGHT", 1)
    one = tf_gradkit.least_squares_batched(fun, p0, args=(y,), batch_size=1024,
                                           jit_compile=False)
    np.testing.assert_array_equal(one.x.numpy(), two.x.numpy())
    np.testing.assert_array_equal(one.status.numpy(), two.status.numpy())
    # One chunk (batch_size above the batch, N never needed): no thread.
    whole = tf_gradkit.least_squares_batched(fun, p0[:100], args=(y[:100],),
                                             batch_size=4096, jit_compile=False)
    assert started == [1] and np.all(whole.converged.numpy())
