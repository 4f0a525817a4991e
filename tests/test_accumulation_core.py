"""`tf_gradkit.core.accumulation` by hand (pure TensorFlow, no Keras): the
window sums with their lazy reset, for dense and sparse gradients."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.core import accumulation as A

# No Keras here: runs in the Keras 3 process only (`make test`).
pytestmark = pytest.mark.keras_free


def _state(params):
    def make_variable(reference, name, per_replica=True, dtype=None):
        del per_replica
        return tf.Variable(tf.zeros(reference.shape, dtype or reference.dtype),
                           trainable=False, name=name)

    def make_scalar(dtype, name, per_replica):
        del per_replica
        return tf.Variable(tf.zeros([], dtype), trainable=False, name=name)

    return A.init_accumulation(params, make_variable, make_scalar)


def _sums(state):
    return [s.numpy() for s in A.window_sums(state)]


def test_dense_windows_by_hand(mode):
    w = tf.Variable(tf.zeros([2, 3]))
    b = tf.Variable(0.0)
    state = _state([w, b])
    g1 = [tf.ones([2, 3]), tf.constant(2.0)]
    g2 = [tf.fill([2, 3], 3.0), tf.constant(-1.0)]
    add = compile_fn(lambda g, weight: A.accumulate(state, g, weight), mode)
    add(g1, 4.0)
    add(g2, 2.0)
    np.testing.assert_array_equal(_sums(state)[0], np.full([2, 3], 4 * 1 + 2 * 3.0))
    assert _sums(state)[1] == 4 * 2.0 + 2 * -1.0
    assert float(state.weight.numpy()) == 6.0 and int(state.micro_step.numpy()) == 2
    grads = A.window_gradients(A.window_sums(state), "example", state.weight)
    np.testing.assert_allclose(grads[0].numpy(), np.full([2, 3], 10.0 / 6.0))
    # Closing writes no sum: the window number moves on, and they read zero.
    raw = state.acc_grads[0].numpy().copy()
    A.start_next_window(state, tf.constant(True))
    np.testing.assert_array_equal(state.acc_grads[0].numpy(), raw)
    assert all(np.all(s == 0) for s in _sums(state))
    assert int(state.micro_step.numpy()) == 0 and float(state.weight.numpy()) == 0.0
    add(g2, 1.0)  # the next window starts from zero
    np.testing.assert_array_equal(_sums(state)[0], np.full([2, 3], 3.0))


def test_sparse_rows_of_older_windows_read_zero(mode):
    table = tf.Variable(tf.zeros([5, 2]))
    state = _state([table])
    add = compile_fn(lambda g, weight: A.accumulate(state, [g], weight), mode)

    def rows(indices, values):
        return tf.IndexedSlices(tf.constant(values, tf.float32),
                                tf.constant(indices, tf.int64), tf.constant([5, 2]))

    add(rows([0, 3, 3], [[1, 1], [2, 2], [3, 3]]), 1.0)   # row 3 twice: summed
    np.testing.assert_array_equal(_sums(state)[0],
                                  [[1, 1], [0, 0], [0, 0], [5, 5], [0, 0]])
    A.start_next_window(state, tf.constant(True))
    add(rows([3, 4], [[1, 0], [0, 1]]), 2.0)             # row 0 is stale now
    np.testing.assert_array_equal(_sums(state)[0],
                                  [[0, 0], [0, 0], [0, 0], [2, 0], [0, 2]])
    # A dense gradient in the same window zeroes the stale rows, keeps the rest.
    add(tf.ones([5, 2]), 1.0)
    np.testing.assert_array_equal(_sums(state)[0],
                                  [[1, 1], [1, 1], [1, 1], [3, 1], [1, 3]])


def test_a_rejected_gradient_adds_nothing_even_a_nan(mode):
    w = tf.Variable(tf.zeros([3]))
    state = _state([w])
    add = compile_fn(lambda g, accept: A.accumulate(state, [g], 1.0, accept), mode)
    add(tf.constant([1.0, 2.0, 3.0]), tf.constant(True))
    add(tf.constant([np.nan, 1.0, 1.0]), tf.constant(False))
    np.testing.assert_array_equal(_sums(state)[0], [1.0, 2.0, 3.0])
    assert int(state.micro_step.numpy()) == 1 and float(state.weight.numpy()) == 1.0


def test_non_finite_values_survive_the_sums_until_the_window_closes():
    w = tf.Variable(tf.zeros([2]))
    state = _state([w])
    A.accumulate(state, [tf.constant([np.inf, 1.0])], 1.0)
    A.accumulate(state, [tf.constant([-np.inf, 1.0])], 1.0)   # inf - inf = nan
    assert not bool(A.window_is_finite(A.window_sums(state)))
    A.start_next_window(state, tf.constant(True))
    assert bool(A.window_is_finite(A.window_sums(state)))
    big = np.finfo(np.float32).max
    A.accumulate(state, [tf.constant([big, 0.0])], 1.0)
    A.accumulate(state, [tf.constant([big, 0.0])], 1.0)      # finite inputs, inf sum
    assert not bool(A.window_is_finite(A.window_sums(state)))


def test_window_gradient_reductions_and_replicas():
    # sums 2*3 = 6 over weight 3: the mean 2, or the sum 6; a replica's share
    # of the global weight is scaled by the replica count (one SUM later).
    sums, total = [tf.constant(6.0)], tf.constant(3.0)
    assert A.window_gradients(sums, "example", total)[0].numpy() == 2.0
    assert A.window_gradients(sums, "sum", total)[0].numpy() == 6.0
    assert A.window_gradients(sums, "example", total, num_replicas=2)[0].numpy() == 4.0
