"""TensorFlow's own accumulator tests, ported: `tf_gradkit.ConditionalAccumulator`
against TF1's ops as the oracle.

The scenarios are those of TensorFlow's ``conditional_accumulator_test.py`` and
``sparse_conditional_accumulator_test.py`` (kernel_tests/data_structures),
rewritten for this API. Each runs TF1's op (``tf.compat.v1.ConditionalAccumulator``
or ``SparseConditionalAccumulator``, in a graph and session of its own, fed
through placeholders of unknown shape so that its run-time checks run) and ours
eagerly, in ``tf.function`` and under XLA (the ``mode`` fixture). A scenario with
no counterpart here is skipped with the reason.

Differences checked rather than hidden:
* TF1's ``take_grad`` blocks until ``num_required`` gradients are in; ours
  returns ``(value, ready)`` at once, so the "blocking" scenarios poll.
* TF1's sparse accumulator returns slices; ours returns the dense tensor (rows
  no gradient touched are zero), and averages over the gradients that held each
  row only with ``reduction="MEAN_PER_ROW"``; ``"MEAN"`` divides every row by
  the number of gradients (what TF1's dense accumulator does with the same
  gradients densified).
* Under XLA nothing can raise at run time: slices with an out-of-range row are
  refused (``apply_grad`` returns False and nothing changes).

Tolerances: the values are sums of n float32 terms and one division, so within
n * eps / 2 (relative) of exact; ``rtol = 2 * n * eps``. Most scenarios use small
integers, whose sums and halves are exact in float16/32/64: asserted exactly.
"""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.core.conditional_accumulator import ConditionalAccumulator

pytestmark = pytest.mark.keras_free

v1 = tf.compat.v1
EPS32 = float(np.finfo(np.float32).eps)
REFUSED = (ValueError, tf.errors.InvalidArgumentError)


# ---------------------------------------------------------------- the oracle

class Tf1:
    """TF1's accumulator in a graph and session of its own (its sparse op has no
    eager kernel); `take` never blocks: it asserts that enough are in first."""

    def __init__(self, dtype, shape, reduction="MEAN", sparse=False):
        self.shape = list(shape)
        self.dtype = tf.as_dtype(dtype)
        self.graph = tf.Graph()
        with self.graph.as_default():
            self._grad = v1.placeholder(self.dtype)
            self._indices = v1.placeholder(tf.int64)
            self._step = v1.placeholder(tf.int64, [])
            self._k = v1.placeholder(tf.int32, [])
            self._new_step = v1.placeholder(tf.int64, [])
            if sparse:
                self.acc = v1.SparseConditionalAccumulator(
                    self.dtype, shape=self.shape, reduction_type=reduction)
                self._apply = self.acc.apply_grad(
                    self._indices, self._grad, local_step=self._step)
                taken = self.acc.take_indexed_slices_grad(self._k)
                self._take = (taken.indices, taken.values)
            else:
                self.acc = v1.ConditionalAccumulator(
                    self.dtype, shape=self.shape, reduction_type=reduction)
                self._apply = self.acc.apply_grad(self._grad, local_step=self._step)
                self._take = self.acc.take_grad(self._k)
            self._num = self.acc.num_accumulated()
            self._set = self.acc.set_global_step(self._new_step)
        self.sparse = sparse
        self.sess = v1.Session(graph=self.graph)

    def apply(self, grad, step=0, indices=None):
        feed = {self._grad: np.asarray(grad, self.dtype.as_numpy_dtype),
                self._step: step}
        if self.sparse:
            feed[self._indices] = np.asarray(indices, np.int64)
        self.sess.run(self._apply, feed)

    def take(self, k):
        assert self.num() >= k, "TF1's take_grad would block"
        return self.take_blocking(k)

    def take_blocking(self, k):
        out = self.sess.run(self._take, {self._k: k})
        if not self.sparse:
            return out
        indices, values = out
        dense = np.zeros(self.shape, self.dtype.as_numpy_dtype)
        dense[indices] = values
        return dense

    def num(self):
        return int(self.sess.run(self._num))

    def set_global_step(self, step):
        self.sess.run(self._set, {self._new_step: step})


class Ours:
    """Our accumulator's calls, compiled once for `mode`."""

    def __init__(self, acc, mode, dynamic=False):
        self.acc = acc
        self.mode = mode
        shape = acc.shape.as_list()
        dense_shape = tf.constant(shape, tf.int64)
        signatures = dict(apply=None, slices=None)
        if dynamic:  # shapes known only when the function runs (TF1's placeholders)
            step = tf.TensorSpec([], tf.int64)
            signatures = dict(
                apply=[tf.TensorSpec(None, acc.dtype), step],
                slices=[tf.TensorSpec(None, acc.dtype), tf.TensorSpec(None, tf.int64), step])
        self._apply = _compile(lambda g, s: acc.apply_grad(g, s), mode, signatures["apply"])
        self._slices = _compile(
            lambda v, i, s: acc.apply_grad(tf.IndexedSlices(v, i, dense_shape), s),
            mode, signatures["slices"])
        self._take = _compile(lambda k: acc.take_grad(k), mode, None)
        self._set = _compile(lambda s: acc.set_global_step(s), mode, None)

    def apply(self, grad, step=0, indices=None):
        grad = tf.constant(np.asarray(grad), self.acc.dtype)
        step = tf.constant(step, tf.int64)
        if indices is None:
            return bool(self._apply(grad, step))
        return bool(self._slices(grad, tf.constant(indices, tf.int64), step))

    def take(self, k):
        value, ready = self._take(tf.constant(k, tf.int64))
        return value.numpy(), bool(ready)

    def set_global_step(self, step):
        self._set(tf.constant(step, tf.int64))

    def num(self):
        return int(self.acc.num_accumulated())

    def state(self):
        return (int(self.acc.num_accumulated()), int(self.acc.num_dropped()),
                int(self.acc.global_step))


def _compile(fn, mode, signature):
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=(mode == "jit"), input_signature=signature)


def _pair(mode, dtype=tf.float32, shape=(1,), reduction="MEAN", sparse=False,
          dynamic=False):
    tf1 = Tf1(dtype, shape, reduction="MEAN" if reduction == "MEAN_PER_ROW" else reduction,
              sparse=sparse)
    return tf1, Ours(ConditionalAccumulator(dtype, list(shape), reduction=reduction),
                     mode, dynamic=dynamic)


def _slices(dense):
    """TF's test helper: the rows of `dense` whose sum is non-zero."""
    dense = np.asarray(dense)
    indices = np.where(np.sum(dense, axis=tuple(range(1, dense.ndim))))[0]
    return dense[indices], indices


def _refused(mode, call, under_xla="raises"):
    """`call()` raises, or under XLA (where nothing can) returns False if
    ``under_xla="false"``."""
    if mode == "jit" and under_xla == "false":
        assert call() is False
        return
    with pytest.raises(REFUSED):
        call()


# ------------------------------------- conditional_accumulator_test.py (dense)

def test_constructor_with_invalid_reduction():
    with tf.Graph().as_default(), pytest.raises(ValueError):
        v1.ConditionalAccumulator(tf.float32, name="Q", reduction_type="Invalid")
    with pytest.raises(ValueError, match="`reduction`.*Invalid"):
        ConditionalAccumulator(tf.float32, [1], reduction="Invalid")


def test_size_empty():
    tf1, ours = _pair("eager")
    assert tf1.num() == ours.num() == 0


def test_set_global_step(mode):
    tf1, ours = _pair(mode)
    tf1.set_global_step(1)
    ours.set_global_step(1)
    assert ours.state() == (0, 0, 1)
    tf1.apply([5.0], step=0)  # stale in both now
    assert not ours.apply([5.0], step=0)
    assert tf1.num() == ours.num() == 0


def test_apply_grad_float32(mode):
    tf1, ours = _pair(mode)
    tf1.apply([10.0])
    assert ours.apply([10.0])
    assert tf1.num() == ours.num() == 1


@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64])
def test_dtypes(mode, dtype):
    tf1, ours = _pair(mode, dtype=dtype)
    elems = np.arange(10).astype(dtype.as_numpy_dtype)
    for e in elems:
        tf1.apply([e])
        assert ours.apply([e])
    got, ready = ours.take(1)
    assert ready and got.dtype == dtype.as_numpy_dtype
    want = tf1.take(1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, [4.5])  # 45 / 10, exact in float16 too


def test_multiple_accumulators_keep_their_own_state(mode):
    # TF1's test builds four accumulators all named "Q"; each keeps its state.
    accs = [ConditionalAccumulator(dtype, [1], name="Q")
            for dtype in (tf.float16, tf.float16, tf.float32, tf.float32)]
    ours = [Ours(acc, mode) for acc in accs]
    theirs = [Tf1(acc.dtype, [1]) for acc in accs]
    for i, (tf1, acc) in enumerate(zip(theirs, ours)):
        tf1.apply([i + 10.0])
        assert acc.apply([i + 10.0])
    for i, (tf1, acc) in enumerate(zip(theirs, ours)):
        got, ready = acc.take(1)
        assert ready
        np.testing.assert_array_equal(got, tf1.take(1))
        np.testing.assert_array_equal(got, [i + 10.0])


def test_apply_and_take_with_shape(mode):
    tf1, ours = _pair(mode, shape=(3, 2))
    elems = [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
             [[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]]]
    for x in elems:
        tf1.apply(x)
        assert ours.apply(x)
    got, ready = ours.take(1)
    assert ready
    np.testing.assert_array_equal(got, tf1.take(1))
    np.testing.assert_array_equal(got, [[5.5, 11.0], [16.5, 22.0], [27.5, 33.0]])


def test_apply_grad_with_wrong_shape():
    # Static shapes: both refuse when the call is made (TF1: building the op).
    with tf.Graph().as_default():
        q = v1.ConditionalAccumulator(tf.float32, name="Q", shape=(3, 2))
        for bad in ([[1.0, 2.0], [3.0, 4.0]], [[1.0], [2.0], [3.0]]):
            with pytest.raises(ValueError):
                q.apply_grad(bad)
    acc = ConditionalAccumulator(tf.float32, [3, 2])
    for bad in ([[1.0, 2.0], [3.0, 4.0]], [[1.0], [2.0], [3.0]]):
        with pytest.raises(ValueError, match="`grad`.*shape"):
            acc.apply_grad(bad)
    assert int(acc.num_accumulated()) == 0


def test_dynamic_shape(mode):
    # TF1: shape=None and a placeholder; ours: a full shape, fed through a
    # function whose signature leaves the shape unknown until it runs.
    tf1, ours = _pair(mode, shape=(3, 2), dynamic=True)
    elems = [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
             [[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]]]
    for x in elems:
        tf1.apply(x)
        assert ours.apply(x)
    got, ready = ours.take(1)
    assert ready
    np.testing.assert_array_equal(got, tf1.take(1))


def test_wrong_dynamic_shape_raises_and_changes_nothing(mode):
    # A refused gradient must not count: the next mean would be halved.
    tf1, ours = _pair(mode, shape=(3,), dynamic=True)
    tf1.apply([2.0, 4.0, 6.0])
    assert ours.apply([2.0, 4.0, 6.0])
    for bad in ([1.0, 2.0], [[1.0], [2.0], [3.0]]):
        with pytest.raises(tf.errors.InvalidArgumentError):
            tf1.apply(bad)
        with pytest.raises(REFUSED):
            ours.apply(bad)
        assert ours.state() == (1, 0, 0)
        assert tf1.num() == 1
    got, ready = ours.take(1)
    assert ready
    np.testing.assert_array_equal(got, tf1.take(1))
    np.testing.assert_array_equal(got, [2.0, 4.0, 6.0])


def test_size_after_apply_grad(mode):
    tf1, ours = _pair(mode)
    assert tf1.num() == ours.num() == 0
    for n in (1, 2):
        tf1.apply([10.0])
        assert ours.apply([10.0])
        assert tf1.num() == ours.num() == n


def test_size_after_apply_grad_and_take_grad(mode):
    tf1, ours = _pair(mode)
    for n in (1, 2):
        tf1.apply([10.0])
        ours.apply([10.0])
        assert tf1.num() == ours.num() == n
    tf1.take(2)
    assert ours.take(2)[1]
    assert tf1.num() == ours.num() == 0
    for n in range(1, 5):
        tf1.apply([10.0], step=1)
        assert ours.apply([10.0], step=1)
        assert tf1.num() == ours.num() == n
    tf1.take(2)
    assert ours.take(2)[1]
    assert tf1.num() == ours.num() == 0


@pytest.mark.parametrize("reduction, want", [("MEAN", 15.0), ("SUM", 30.0)])
def test_take_grad_mean_and_sum(mode, reduction, want):
    tf1, ours = _pair(mode, reduction=reduction)
    for step in (0, 1):  # the second round at the step the first take made
        for x in (10.0, 20.0):
            tf1.apply([x], step=step)
            assert ours.apply([x], step=step)
        got, ready = ours.take(1)
        assert ready
        np.testing.assert_array_equal(got, tf1.take(1))
        np.testing.assert_array_equal(got, [want])


def test_invalid_take_grad(mode):
    # TF1 raises when take_grad(-1) runs. Ours raises when the call is made if
    # the value is known then, when it runs otherwise; under XLA, where nothing
    # can raise, a run-time value below 1 is taken as 1.
    tf1, _ = _pair(mode)
    for x in (10.0, 20.0):
        tf1.apply([x])
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf1.sess.run(tf1._take, {tf1._k: -1})
    acc = ConditionalAccumulator(tf.float32, [1])
    for x in (10.0, 20.0):
        acc.apply_grad([x])
    with pytest.raises(ValueError, match="`num_required`.*-1"):
        acc.take_grad(-1)
    take = compile_fn(lambda k: acc.take_grad(k), "function" if mode == "eager" else mode)
    if mode == "jit":
        value, ready = take(tf.constant(-1, tf.int64))
        assert bool(ready)
        np.testing.assert_array_equal(value.numpy(), [15.0])
    else:
        with pytest.raises(tf.errors.InvalidArgumentError, match="num_required"):
            take(tf.constant(-1, tf.int64))
        assert int(acc.num_accumulated()) == 2


@pytest.mark.parametrize("reduction, wants", [("MEAN", (15.0, 25.0)), ("SUM", (30.0, 50.0))])
def test_repeated_take_grad(mode, reduction, wants):
    tf1, ours = _pair(mode, reduction=reduction)
    for step, (elems, want) in enumerate(zip(([10.0, 20.0], [20.0, 30.0]), wants)):
        for x in elems:
            tf1.apply([x], step=step)
            assert ours.apply([x], step=step)
        got, ready = ours.take(1)
        assert ready
        np.testing.assert_array_equal(got, tf1.take(1))
        np.testing.assert_array_equal(got, [want])


def test_increment_global_step(mode):
    # set_global_step from a tensor computed in the same step.
    tf1, ours = _pair(mode)
    step = tf.Variable(0, dtype=tf.int64)

    def bump():
        ours.acc.set_global_step(step + 1)
        step.assign_add(1)

    bump = compile_fn(bump, mode)
    for n in range(1, 4):
        tf1.set_global_step(n)
        bump()
        assert int(ours.acc.global_step) == n == int(step)
    tf1.apply([1.0], step=2)
    assert not ours.apply([1.0], step=2)  # stale at step 3
    assert tf1.num() == ours.num() == 0


def test_set_global_step_prevents_accumulation(mode):
    tf1, ours = _pair(mode)
    local_steps = range(1000, 1005)
    for ls in local_steps:
        tf1.set_global_step(ls)
        ours.set_global_step(ls)
        for x in local_steps:
            tf1.apply([float(x)], step=x)
            assert ours.apply([float(x)], step=x) == (x >= ls)
        got, ready = ours.take(1)
        assert ready
        np.testing.assert_array_equal(got, tf1.take(1))
        fresh = [x for x in local_steps if x >= ls]
        np.testing.assert_allclose(got, [sum(fresh) / len(fresh)], rtol=2 * 5 * EPS32)


def test_parallel_apply_grad(mode):
    tf1, ours = _pair(mode)
    elems = [10.0 * i for i in range(1, 11)]
    for target in (tf1, ours):
        threads = [threading.Thread(target=target.apply, args=([x],)) for x in elems]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert tf1.num() == ours.num() == 10
    got, ready = ours.take(1)
    assert ready
    np.testing.assert_array_equal(got, tf1.take(1))
    np.testing.assert_allclose(got, [55.0], rtol=2 * 10 * EPS32)


def _parallel_takes(apply, take, global_step, elems, takers=10, timeout=30.0):
    """TF's testParallelTakeGrad for a non-blocking take: `takers` threads poll
    take_grad(1) until each has one value while one thread applies `elems` one
    by one (`apply(i)`), each at the step the previous take made. Returns the
    values taken, and whether the applier saw every gradient accepted."""
    results, lock = [], threading.Lock()
    deadline = time.monotonic() + timeout
    accepted = []

    def taker():
        while time.monotonic() < deadline:
            value, ready = take()
            if ready:
                with lock:
                    results.append(value)
                return
            time.sleep(0.0005)

    def applier():
        for i in range(len(elems)):
            accepted.append(apply(i))
            while global_step() <= i and time.monotonic() < deadline:
                time.sleep(0.0005)

    threads = [threading.Thread(target=taker) for _ in range(takers)]
    threads.append(threading.Thread(target=applier))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, accepted


def test_parallel_take_grad(mode):
    # Ten takers at once must hand out each gradient exactly once: no NaN (a
    # take dividing a sum another take just reset), no duplicates, none dropped.
    tf1, ours = _pair(mode)
    elems = [float(e) for e in range(10)]
    results, accepted = _parallel_takes(
        lambda i: ours.apply([elems[i]], step=i), lambda: ours.take(1),
        lambda: int(ours.acc.global_step), elems)
    assert all(accepted)
    got = np.sort(np.concatenate(results)) if results else np.array([])
    np.testing.assert_array_equal(got, elems)
    assert ours.state() == (0, 0, 10)
    # TF1, with its blocking take: the same ten values.
    theirs = []
    takers = [threading.Thread(target=lambda: theirs.append(tf1.take_blocking(1)))
              for _ in range(10)]
    for thread in takers:
        thread.start()
    for e in elems:
        tf1.apply([e], step=int(e))
        time.sleep(0.01)  # the test's own pacing (1 s there)
    for thread in takers:
        thread.join(timeout=30)
    np.testing.assert_array_equal(np.sort(np.concatenate(theirs)), elems)


def test_apply_and_blocking_take(mode):
    # TF1's take_grad(3) blocks until the third gradient; ours is polled.
    tf1, ours = _pair(mode)
    elems = [10.0, 20.0, 30.0]
    theirs = []
    taker = threading.Thread(target=lambda: theirs.append(tf1.take_blocking(3)))
    taker.start()
    for x in elems:
        tf1.apply([x])
    taker.join(timeout=30)
    mine = []

    def poll():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            value, ready = ours.take(3)
            if ready:
                mine.append(value)
                return
            np.testing.assert_array_equal(value, [0.0])  # not ready: zeros
            time.sleep(0.001)

    poller = threading.Thread(target=poll)
    poller.start()
    for x in elems:
        assert ours.apply([x])
    poller.join()
    assert len(mine) == len(theirs) == 1
    np.testing.assert_array_equal(mine[0], theirs[0])
    np.testing.assert_array_equal(mine[0], [20.0])


@pytest.mark.skip(reason="no counterpart: our take_grad never blocks, so there is "
                         "nothing to cancel (test_take_never_blocks)")
def test_accumulator_cancel():
    pass


def test_take_never_blocks(mode):
    _, ours = _pair(mode)
    started = time.monotonic()
    value, ready = ours.take(1)
    assert not ready and time.monotonic() - started < 10
    np.testing.assert_array_equal(value, [0.0])
    assert ours.state() == (0, 0, 0)


# ---------------------- sparse_conditional_accumulator_test.py (IndexedSlices)

@pytest.mark.skip(reason="no counterpart: TF1's test checks the node_def of its "
                         "graph op; ours is a tf.Module of variables")
def test_sparse_constructor_node_def():
    pass


def test_sparse_size_empty_and_set_global_step(mode):
    tf1, ours = _pair(mode, shape=(1,), sparse=True)
    assert tf1.num() == ours.num() == 0
    tf1.set_global_step(1)
    ours.set_global_step(1)
    assert ours.state() == (0, 0, 1)


def test_sparse_apply_grad_float32(mode):
    tf1, ours = _pair(mode, shape=(3, 3), sparse=True)
    values, indices = [[0.0, 0.0, 1.0], [3.0, 0.0, 4.0]], [0, 2]
    tf1.apply(values, indices=indices)
    assert ours.apply(values, indices=indices)
    assert tf1.num() == ours.num() == 1


@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64])
def test_sparse_dtypes(mode, dtype):
    tf1, ours = _pair(mode, dtype=dtype, shape=(3, 3, 3), reduction="MEAN_PER_ROW",
                      sparse=True)
    total = np.zeros([3, 3, 3], dtype.as_numpy_dtype)
    for e in range(2):
        grad = np.zeros([3, 3, 3], dtype.as_numpy_dtype)
        grad[1, 1, 1] = e + 1
        total += grad
        values, indices = _slices(grad)
        tf1.apply(values, indices=indices)
        assert ours.apply(values, indices=indices)
    got, ready = ours.take(1)
    assert ready
    np.testing.assert_array_equal(got, tf1.take(1))
    np.testing.assert_array_equal(got, total / 2)


def test_sparse_multiple_accumulators(mode):
    elems = [[[1, 0], [0, 0]], [[0, 1], [0, 0]], [[0, 0], [1, 0]], [[0, 0], [0, 1]]]
    dtypes = (tf.float16, tf.float16, tf.float32, tf.float32)
    pairs = [_pair(mode, dtype=d, shape=(2, 2), sparse=True) for d in dtypes]
    for (tf1, ours), elem in zip(pairs, elems):
        values, indices = _slices(np.asarray(elem, ours.acc.dtype.as_numpy_dtype))
        tf1.apply(values, indices=indices)
        assert ours.apply(values, indices=indices)
    for (tf1, ours), elem in zip(pairs, elems):
        got, ready = ours.take(1)
        assert ready
        np.testing.assert_array_equal(got, tf1.take(1))
        np.testing.assert_array_equal(got, elem)


def _two_sparse_grads(tf1, ours, scale, step):
    for values, indices in (([[1.0, 0.0], [0.0, 2.0]], [0, 1]),
                            ([[0.0, 1.0], [3.0, 0.0]], [0, 2])):
        values = scale * np.asarray(values, np.float32)
        tf1.apply(values, step=step, indices=indices)
        assert ours.apply(values, step=step, indices=indices)


@pytest.mark.parametrize("reduction", ["MEAN_PER_ROW", "MEAN"])
def test_sparse_take_grad_mean(mode, reduction):
    # TF1's sparse accumulator averages each row over the gradients that held
    # it: MEAN_PER_ROW. Our MEAN divides every row by the number of gradients,
    # as TF1's dense accumulator does with the same gradients densified.
    tf1, ours = _pair(mode, shape=(3, 2), reduction=reduction, sparse=True)
    dense_tf1 = Tf1(tf.float32, [3, 2])
    _two_sparse_grads(tf1, ours, 1.0, 0)
    for values, indices in (([[1.0, 0.0], [0.0, 2.0]], [0, 1]),
                            ([[0.0, 1.0], [3.0, 0.0]], [0, 2])):
        dense = np.zeros([3, 2], np.float32)
        dense[indices] = values
        dense_tf1.apply(dense)
    got, ready = ours.take(1)
    assert ready
    if reduction == "MEAN_PER_ROW":
        np.testing.assert_array_equal(got, tf1.take(1))
        np.testing.assert_array_equal(got, [[0.5, 0.5], [0.0, 2.0], [3.0, 0.0]])
    else:
        np.testing.assert_array_equal(got, dense_tf1.take(1))
        np.testing.assert_array_equal(got, [[0.5, 0.5], [0.0, 1.0], [1.5, 0.0]])


def test_sparse_repeated_take_grad(mode):
    tf1, ours = _pair(mode, shape=(3, 2), reduction="MEAN_PER_ROW", sparse=True)
    for step, (scale, want) in enumerate(((1.0, [[0.5, 0.5], [0.0, 2.0], [3.0, 0.0]]),
                                          (10.0, [[5.0, 5.0], [0.0, 20.0], [30.0, 0.0]]))):
        _two_sparse_grads(tf1, ours, scale, step)
        got, ready = ours.take(1)
        assert ready
        np.testing.assert_array_equal(got, tf1.take(1))
        np.testing.assert_array_equal(got, want)


def test_sparse_mean_per_row_counts_dense_gradients_in_every_row(mode):
    # No TF1 counterpart mixes the two; by hand: row 0 held by both, row 1 by
    # the dense one only.
    _, ours = _pair(mode, shape=(2, 2), reduction="MEAN_PER_ROW")
    assert ours.apply([[1.0, 2.0], [3.0, 4.0]])
    assert ours.apply([[5.0, 6.0]], indices=[0])
    got, ready = ours.take(2)
    assert ready
    np.testing.assert_array_equal(got, [[3.0, 4.0], [3.0, 4.0]])
    assert ours.apply([[2.0, 2.0]], step=1, indices=[1])  # the row counts restarted
    got, _ = ours.take(1)
    np.testing.assert_array_equal(got, [[0.0, 0.0], [2.0, 2.0]])


def test_sparse_duplicate_indices_add_up_and_count_once(mode):
    # TF1 returns the row twice, with made-up values, for a gradient naming it
    # twice (no counterpart to compare with); ours adds the two and counts the
    # row once for MEAN_PER_ROW.
    _, ours = _pair(mode, shape=(3, 2), reduction="MEAN_PER_ROW")
    assert ours.apply([[1.0, 1.0], [1.0, 1.0]], indices=[0, 0])
    assert ours.apply([[4.0, 4.0]], indices=[0])
    got, _ = ours.take(1)
    np.testing.assert_array_equal(got, [[3.0, 3.0], [0.0, 0.0], [0.0, 0.0]])


def test_sparse_parallel_apply_grad(mode):
    tf1, ours = _pair(mode, shape=(2, 2), reduction="MEAN_PER_ROW", sparse=True)
    elems = [10.0 * i for i in range(1, 11)]
    for target in (tf1, ours):
        threads = [threading.Thread(target=target.apply, args=([[x, 0.0], [0.0, x]],),
                                    kwargs=dict(indices=[0, 1])) for x in elems]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    got, ready = ours.take(1)
    assert ready
    np.testing.assert_array_equal(got, tf1.take(1))
    np.testing.assert_allclose(got, [[55.0, 0.0], [0.0, 55.0]], rtol=2 * 10 * EPS32)


def test_sparse_parallel_take_grad(mode):
    _, ours = _pair(mode, shape=(2, 2), reduction="MEAN_PER_ROW")
    elems = [float(e + 1) for e in range(10)]
    results, accepted = _parallel_takes(
        lambda i: ours.apply([[elems[i], 0.0]], step=i, indices=[1]),
        lambda: ours.take(1), lambda: int(ours.acc.global_step), elems)
    assert all(accepted) and len(results) == 10
    got = sorted(results, key=lambda r: float(r[1, 0]))
    for value, e in zip(got, elems):
        np.testing.assert_array_equal(value, [[0.0, 0.0], [e, 0.0]])
    assert ours.state() == (0, 0, 10)


def test_sparse_apply_and_blocking_take(mode):
    tf1, ours = _pair(mode, shape=(2, 2), reduction="MEAN_PER_ROW", sparse=True)
    theirs = []
    taker = threading.Thread(target=lambda: theirs.append(tf1.take_blocking(3)))
    taker.start()
    for x in (10.0, 20.0, 30.0):
        tf1.apply([[0.0, x]], indices=[0])
        assert ours.apply([[0.0, x]], indices=[0])
        if x < 30.0:
            assert not ours.take(3)[1]
    taker.join(timeout=30)
    got, ready = ours.take(3)
    assert ready and len(theirs) == 1
    np.testing.assert_array_equal(got, theirs[0])
    np.testing.assert_array_equal(got, [[0.0, 20.0], [0.0, 0.0]])


@pytest.mark.skip(reason="no counterpart: our take_grad never blocks, so there is "
                         "nothing to cancel (test_take_never_blocks)")
def test_sparse_accumulator_cancel():
    pass


# The malformed slices of TF's tests: (values, indices, what TF1 says). Each is
# refused by both, TF1 when it runs, ours when the call is made if the shapes
# are known then (eager, XLA) and when it runs otherwise; and a refused gradient
# changes nothing: the mean after it is the mean without it.
MALFORMED = {
    "non_vector_indices": ([1.0, 2.0], [[0, 1], [1, 0]],
                           "Input indices should be vector"),
    "zero_dimension_values": (1.0, [0], "Values cannot be 0-dimensional"),
    "fewer_values_than_indices": ([[0.0, 1.0, 1.0]], [0, 1], "non-empty input values"),
    "values_rank": ([[[1.0], [2.0], [3.0]]], [0], "values rank"),
    "values_dim": ([[1.0, 2.0]], [0], "values dim"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_sparse_malformed_is_refused_and_changes_nothing(mode, case):
    values, indices, message = MALFORMED[case]
    tf1, ours = _pair(mode, shape=(3, 3), reduction="MEAN_PER_ROW", sparse=True,
                      dynamic=True)
    good = [[2.0, 4.0, 6.0]]
    tf1.apply(good, indices=[1])
    assert ours.apply(good, indices=[1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        tf1.apply(values, indices=indices)
    with pytest.raises(REFUSED):
        ours.apply(values, indices=indices)
    assert tf1.num() == 1
    assert ours.state() == (1, 0, 0)
    got, ready = ours.take(1)
    assert ready
    np.testing.assert_array_equal(got, tf1.take(1))
    np.testing.assert_array_equal(got, [[0.0, 0.0, 0.0], [2.0, 4.0, 6.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("rows", [[3], [0, 7]])
def test_sparse_index_out_of_range_is_refused_and_changes_nothing(mode, rows):
    # TF1: "index of slice ... exceeded limits of shape". Ours raises, except
    # under XLA, where it cannot and the gradient is refused (False) instead of
    # being counted as a zero gradient.
    tf1, ours = _pair(mode, shape=(3, 2), reduction="MEAN_PER_ROW", sparse=True,
                      dynamic=True)
    tf1.apply([[2.0, 4.0]], indices=[0])
    assert ours.apply([[2.0, 4.0]], indices=[0])
    values = np.ones([len(rows), 2], np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="exceeded limits"):
        tf1.apply(values, indices=rows)
    _refused(mode, lambda: ours.apply(values, indices=rows), under_xla="false")
    assert tf1.num() == 1 and ours.state() == (1, 0, 0)
    got, _ = ours.take(1)
    np.testing.assert_array_equal(got, tf1.take(1))
    np.testing.assert_array_equal(got, [[2.0, 4.0], [0.0, 0.0], [0.0, 0.0]])


def test_sparse_out_of_range_under_plain_mean_does_not_halve_the_mean(mode):
    # The same for "MEAN", where a counted bad gradient would halve the mean.
    _, ours = _pair(mode, shape=(3,), dynamic=True)
    assert ours.apply([2.0, 4.0, 6.0])
    _refused(mode, lambda: ours.apply([1.0], indices=[5]), under_xla="false")
    _refused(mode, lambda: ours.apply([1.0], indices=[-1]), under_xla="false")
    assert ours.state() == (1, 0, 0)
    got, _ = ours.take(1)
    np.testing.assert_array_equal(got, [2.0, 4.0, 6.0])


def test_sparse_dense_shape_must_match(mode):
    # TF1: "Shape mismatch: expected shape rank/dim ..." for grad_shape.
    acc = ConditionalAccumulator(tf.float32, [2, 2])
    for shape in ([2, 3], [2, 2, 1]):
        grad = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant(shape))
        with pytest.raises(ValueError, match="dense_shape"):
            acc.apply_grad(grad)
    if mode == "eager":
        return
    apply = tf.function(
        lambda d: acc.apply_grad(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), d)),
        input_signature=[tf.TensorSpec([None], tf.int32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="dense_shape"):
        apply(tf.constant([2, 3]))
    assert bool(apply(tf.constant([2, 2])))
    assert int(acc.num_accumulated()) == 1


def test_sparse_scalar_accumulator():
    # TF1 takes grad_indices=[0], grad_values=[1.0] for shape [] (and refuses
    # the malformed forms); ours has no rows to index in a scalar and refuses
    # slices for it, naming the argument.
    tf1 = Tf1(tf.float32, [], sparse=True)
    tf1.apply([1.0], indices=[0])
    for values, indices in (([1.0], 0), (1.0, [0])):
        with pytest.raises(tf.errors.InvalidArgumentError):
            tf1.apply(values, indices=indices)
    acc = ConditionalAccumulator(tf.float32, [])
    with pytest.raises(ValueError, match="`grad`.*scalar"):
        acc.apply_grad(tf.IndexedSlices(tf.constant([1.0]), tf.constant([0])))
    with pytest.raises(ValueError, match="MEAN_PER_ROW.*rank"):
        ConditionalAccumulator(tf.float32, [], reduction="MEAN_PER_ROW")


@pytest.mark.skip(reason="no counterpart: TF1's shapes may stay partly unknown until "
                         "the first gradient fixes them; ours are fully defined and "
                         "the result is dense of that shape")
def test_sparse_return_shape_and_shape_fixed_by_first_gradient():
    pass


def test_sparse_int32_indices_and_shape(mode):
    tf1, ours = _pair(mode, shape=(3, 3), reduction="MEAN_PER_ROW", sparse=True)
    values = np.array([[0.0, 0.0, 1.0], [3.0, 0.0, 4.0]], np.float32)
    for _ in range(2):
        tf1.apply(values, indices=[0, 2])
    grad = lambda: tf.IndexedSlices(tf.constant(values), tf.constant([0, 2], tf.int32),  # noqa: E731
                                    tf.constant([3, 3], tf.int32))
    apply = compile_fn(lambda: ours.acc.apply_grad(grad()), mode)
    for _ in range(2):
        assert bool(apply())
    assert tf1.num() == ours.num() == 2
    got, _ = ours.take(1)
    np.testing.assert_array_equal(got, tf1.take(1))
    np.testing.assert_array_equal(got, [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [3.0, 0.0, 4.0]])


# ------------------------------------------------------ a randomized sequence

@pytest.mark.parametrize("kind, reduction", [
    ("dense", "MEAN"), ("dense", "SUM"),
    ("sparse", "MEAN_PER_ROW"), ("sparse", "SUM"), ("sparse_as_dense", "MEAN")])
def test_random_sequence_matches_tf1_at_every_call(mode, kind, reduction):
    """Random apply (fresh, stale, ahead), take (ready or not) and
    set_global_step (up and down) calls; after each, ours and TF1 agree on what
    was accepted, the count, and any value taken. ``sparse_as_dense``: our MEAN
    of slices against TF1's dense accumulator fed the densified gradients."""
    rng = np.random.default_rng(7)
    shape = [5, 2]
    sparse_tf1 = kind == "sparse"
    tf1 = Tf1(tf.float32, shape, reduction="MEAN" if reduction == "MEAN_PER_ROW"
              else reduction, sparse=sparse_tf1)
    ours = Ours(ConditionalAccumulator(tf.float32, shape, reduction=reduction), mode)
    step, taken = 0, 0
    for _ in range(60):
        action = rng.choice(["apply", "apply", "apply", "take", "set"])
        if action == "apply":
            local = int(step + rng.integers(-2, 3))
            if kind == "dense":
                grad = rng.uniform(0.1, 2.0, shape).astype(np.float32)
                before = tf1.num()
                tf1.apply(grad, step=local)
                accepted = ours.apply(grad, step=local)
            else:
                indices = np.sort(rng.choice(5, size=int(rng.integers(1, 4)), replace=False))
                values = rng.uniform(0.1, 2.0, [len(indices), 2]).astype(np.float32)
                before = tf1.num()
                if sparse_tf1:
                    tf1.apply(values, step=local, indices=indices)
                else:
                    dense = np.zeros(shape, np.float32)
                    dense[indices] = values
                    tf1.apply(dense, step=local)
                accepted = ours.apply(values, step=local, indices=indices)
            assert accepted == (tf1.num() == before + 1) == (local >= step)
        elif action == "take":
            k = int(rng.integers(1, 4))
            count = ours.num()
            got, ready = ours.take(k)
            assert ready == (tf1.num() >= k)
            if ready:
                taken += 1
                np.testing.assert_allclose(got, tf1.take(k), rtol=2 * count * EPS32)
                step += 1
            else:
                np.testing.assert_array_equal(got, np.zeros(shape))
        else:
            step = int(max(0, step + rng.integers(-2, 3)))
            tf1.set_global_step(step)
            ours.set_global_step(step)
        assert ours.num() == tf1.num()
        assert int(ours.acc.global_step) == step
    assert taken >= 3  # the sequence exercised takes (seeded: not by luck)
