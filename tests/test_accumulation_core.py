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
    assert not bool(A.window_finite(state))
    A.start_next_window(state, tf.constant(True))
    assert bool(A.window_is_finite(A.window_sums(state)))
    big = np.finfo(np.float32).max
    A.accumulate(state, [tf.constant([big, 0.0])], 1.0)
    assert bool(A.window_finite(state))
    A.accumulate(state, [tf.constant([big, 0.0])], 1.0)      # finite inputs, inf sum
    assert not bool(A.window_is_finite(A.window_sums(state)))
    assert not bool(A.window_finite(state))


def test_window_gradient_reductions_and_replicas():
    # sums 2*3 = 6 over weight 3: the mean 2, or the sum 6; a replica's share
    # of the global weight is scaled by the replica count (one SUM later).
    sums, total = [tf.constant(6.0)], tf.constant(3.0)
    assert A.window_gradients(sums, "example", total)[0].numpy() == 2.0
    assert A.window_gradients(sums, "sum", total)[0].numpy() == 6.0
    assert A.window_gradients(sums, "example", total, num_replicas=2)[0].numpy() == 4.0


def _slices(indices, values, shape):
    return tf.IndexedSlices(tf.constant(values, tf.float32),
                            tf.constant(indices, tf.int64), tf.constant(shape))


def test_a_dense_sum_missing_gradients_never_keeps_an_older_window(mode):
    # `b` gets no gradient on some micro-steps: its sum must hold exactly
    # what this window gave it, never what a closed window left behind.
    a, b = tf.Variable(tf.zeros([2])), tf.Variable(tf.zeros([2, 2]))
    state = _state([a, b])
    both = compile_fn(lambda ga, gb: A.accumulate(state, [ga, gb], 1.0), mode)
    only_a = compile_fn(lambda ga: A.accumulate(state, [ga, None], 1.0), mode)
    ga, gb = tf.constant([1.0, 2.0]), tf.fill([2, 2], 5.0)
    both(ga, gb)
    only_a(ga)
    np.testing.assert_array_equal(_sums(state)[1], np.full([2, 2], 5.0))
    A.start_next_window(state, tf.constant(True))
    only_a(ga)                         # b: nothing yet in this window
    np.testing.assert_array_equal(_sums(state)[1], np.zeros([2, 2]))
    both(ga, tf.fill([2, 2], 2.0))
    np.testing.assert_array_equal(_sums(state)[0], [2.0, 4.0])
    np.testing.assert_array_equal(_sums(state)[1], np.full([2, 2], 2.0))
    A.start_next_window(state, tf.constant(True))
    only_a(ga)                         # a window that never touches b
    np.testing.assert_array_equal(_sums(state)[1], np.zeros([2, 2]))


def test_each_variable_keeps_the_kind_of_its_first_gradient(mode):
    # A dense variable given IndexedSlices later densifies them; a sparse one
    # given a dense gradient later takes the per-row path: both stay exact.
    dense, table = tf.Variable(tf.zeros([4, 2])), tf.Variable(tf.zeros([4, 2]))
    state = _state([dense, table])
    add = compile_fn(lambda g0, g1: A.accumulate(state, [g0, g1], 1.0), mode)
    add(tf.ones([4, 2]), _slices([1], [[1.0, 1.0]], [4, 2]))
    assert state.kinds == ["dense", "rows"]
    add2 = compile_fn(lambda g0, g1: A.accumulate(state, [g0, g1], 2.0), mode)
    add2(_slices([0, 0], [[1.0, 0.0], [1.0, 0.0]], [4, 2]), tf.ones([4, 2]))
    assert state.kinds == ["dense", "rows"]
    np.testing.assert_array_equal(_sums(state)[0], [[5, 1], [1, 1], [1, 1], [1, 1]])
    np.testing.assert_array_equal(_sums(state)[1], [[2, 2], [3, 3], [2, 2], [2, 2]])
    A.start_next_window(state, tf.constant(True))
    add2(_slices([3], [[1.0, 1.0]], [4, 2]), tf.ones([4, 2]))
    np.testing.assert_array_equal(_sums(state)[0], [[0, 0], [0, 0], [0, 0], [2, 2]])
    np.testing.assert_array_equal(_sums(state)[1], np.full([4, 2], 2.0))


def test_a_variable_first_without_gradient_keeps_exact_marks(mode):
    # Its first micro-step gives it None: it takes the "rows" kind, costs
    # nothing while it gets none, and a dense gradient later is still exact.
    a, b = tf.Variable(tf.zeros([2])), tf.Variable(tf.zeros([2, 2]))
    state = _state([a, b])
    both = compile_fn(lambda ga, gb: A.accumulate(state, [ga, gb], 1.0), mode)
    only_a = compile_fn(lambda ga: A.accumulate(state, [ga, None], 1.0), mode)
    ga = tf.constant([1.0, 2.0])
    only_a(ga)
    assert state.kinds == ["dense", "rows"]
    both(ga, tf.fill([2, 2], 3.0))
    A.start_next_window(state, tf.constant(True))
    only_a(ga)
    np.testing.assert_array_equal(_sums(state)[1], np.zeros([2, 2]))
    both(ga, tf.fill([2, 2], 2.0))      # the closed window's 3s never leak in
    np.testing.assert_array_equal(_sums(state)[1], np.full([2, 2], 2.0))


def test_sums_read_before_any_gradient_fix_the_dense_kind(mode):
    # A flush traced before the first micro-step reads every sum as dense; a
    # later IndexedSlices gradient is densified, and nothing stale leaks in.
    table = tf.Variable(tf.zeros([3, 1]))
    state = _state([table])
    read = compile_fn(lambda: A.window_sums(state), mode)
    np.testing.assert_array_equal(read()[0].numpy(), np.zeros([3, 1]))
    add = compile_fn(lambda g: A.accumulate(state, [g], 1.0), mode)
    add(_slices([2], [[4.0]], [3, 1]))
    assert state.kinds == ["dense"]
    np.testing.assert_array_equal(read()[0].numpy(), [[0.0], [0.0], [4.0]])
    A.start_next_window(state, tf.constant(True))
    add(_slices([0], [[1.0]], [3, 1]))
    np.testing.assert_array_equal(read()[0].numpy(), [[1.0], [0.0], [0.0]])


@pytest.mark.parametrize("kind", ["dense", "rows"])
def test_the_closing_test_sees_every_non_finite_value(mode, kind):
    # Dense sums are tested when the window closes; "rows" sums where they
    # are written, the result riding on the window's weight.
    table = tf.Variable(tf.zeros([3, 2]))
    state = _state([table])

    def gradient(values):
        values = tf.constant(values, tf.float32)
        if kind == "dense":
            return values
        return tf.IndexedSlices(values, tf.constant([0, 1, 2], tf.int64),
                                tf.constant([3, 2]))

    add = compile_fn(lambda g, accept: A.accumulate(state, [g], 2.0, accept), mode)
    finite = compile_fn(lambda: A.window_finite(state), mode)
    ones = np.ones([3, 2], np.float32)
    add(gradient(ones), tf.constant(True))
    bad = ones.copy()
    bad[1, 0] = np.nan
    add(gradient(bad), tf.constant(False))     # stale: dropped, nothing changes
    assert float(state.weight.numpy()) == 2.0 and bool(finite())
    for value in (np.nan, np.inf, -np.inf):
        bad[1, 0] = value
        add(gradient(bad), tf.constant(True))
        assert not bool(finite())
        assert bool(A.weight_is_finite(state.weight)) == (kind == "dense")
        add(gradient(ones), tf.constant(True))     # a later finite micro-batch
        assert not bool(finite())
        A.start_next_window(state, tf.constant(True))
        add(gradient(ones), tf.constant(True))
        assert bool(finite()) and float(state.weight.numpy()) == 2.0
        A.start_next_window(state, tf.constant(True))
    big = np.full([3, 2], np.finfo(np.float32).max / 2, np.float32)
    big[:, 1] = 0.0
    add(gradient(big), tf.constant(True))       # rows of max/2 * 2: finite
    assert bool(finite())
    add(gradient(big * 1.5), tf.constant(True))   # finite inputs, sums overflow
    assert not bool(finite())


def test_half_precision_variables_are_summed_in_float32(mode):
    # A float16 variable's sums are float32 (`sum_dtype`, issue 38 item 12):
    # 2000 + 65000 (64992 in float16) adds up past float16's 65504 (control:
    # inf there) to a finite, exact 66992, and the window reads finite.
    w = tf.Variable(tf.zeros([2, 64], tf.float16))
    state = _state([w])
    assert state.acc_grads[0].dtype == tf.float32
    add = compile_fn(lambda g: A.accumulate(state, [g], 1.0), mode)
    finite = compile_fn(lambda: A.window_finite(state), mode)
    add(tf.fill([2, 64], tf.constant(2000.0, tf.float16)))
    assert bool(finite())
    add(tf.fill([2, 64], tf.constant(65000.0, tf.float16)))
    total = np.float32(np.float16(2000.0)) + np.float32(np.float16(65000.0))
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.float16(2000.0) + np.float16(65000.0))
    assert bool(finite())
    np.testing.assert_array_equal(_sums(state)[0], np.full([2, 64], total, "float32"))
    # Handed on in the variable's dtype: the gradient itself is what overflows.
    (handed,) = A.window_gradients(A.window_sums(state), "sum", 1.0, dtypes=[w.dtype])
    assert handed.dtype == tf.float16 and not np.isfinite(handed.numpy()).any()


@pytest.mark.parametrize("jit", [False, True])
def test_narrowed_finite_is_the_cast_rounding_to_inf(jit):
    """A float32 value fits float16 below 65520 (from there the cast rounds to
    Inf); NaN never fits; bfloat16's limit is near float32's max; gradients
    kept in their own dtype are not tested. The test reads the float32 value
    (no cast round trip that XLA may drop on a GPU)."""
    check = tf.function(A.narrowed_finite, jit_compile=jit)

    def fits(value, dtype):
        return bool(check([tf.constant([1.0, value], tf.float32)], [dtype]))

    assert fits(65519.0, tf.float16) and fits(-65519.0, tf.float16)
    assert not fits(65520.0, tf.float16) and not fits(-1e5, tf.float16)
    assert np.isinf(np.float16(np.float32(65520.0))) and np.isfinite(np.float16(np.float32(65519.0)))
    assert not fits(float("nan"), tf.float16) and not fits(float("nan"), tf.bfloat16)
    assert fits(3.0e38, tf.bfloat16) and fits(1e5, tf.bfloat16)
    assert fits(float("inf"), tf.float32)          # its own dtype: the window's test covers it
