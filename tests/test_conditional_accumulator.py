"""Tests for `tf_gradkit.core.conditional_accumulator` (pure TF, no Keras).

Tolerances: a MEAN over ``n`` positive float32 gradients is ``n - 1`` float32
additions and one division, each rounding with relative error <= eps/2, so the
result is within ``n * eps / 2`` (relative) of the exact value computed in
float64 from the same float32 inputs. We assert ``rtol = n * eps``: twice the
bound, never loose enough to hide a wrong formula (those err by O(1)). Where both
sides run the very same float32 ops in the same order (checkpoint resume) we
assert exact equality.
"""

import os
import runpy
import uuid

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.core.conditional_accumulator import ConditionalAccumulator

# No Keras here: runs in the Keras 3 process only (`make test`).
pytestmark = pytest.mark.keras_free

EPS32 = float(np.finfo(np.float32).eps)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ops(acc, mode):
    """apply_grad / take_grad wrapped for ``mode``; steps are passed as tensors."""
    apply = compile_fn(lambda g, step: acc.apply_grad(g, step), mode)
    take = compile_fn(lambda k: acc.take_grad(k), mode)

    def apply_(grad, step=0):
        return bool(apply(grad, tf.constant(step, tf.int64)))

    def take_(k):
        value, ready = take(tf.constant(k, tf.int64))
        return value.numpy(), bool(ready)

    return apply_, take_


def _f32(x):
    return np.asarray(x, np.float32)


def _state(acc):
    return (int(acc.num_accumulated()), int(acc.num_dropped()),
            int(acc.global_step))


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
def test_reduction_hand_computed(mode, reduction):
    acc = ConditionalAccumulator(tf.float32, [2, 2], reduction=reduction)
    apply, take = _ops(acc, mode)
    grads = [_f32([[0.1, 0.2], [0.3, 0.4]]),
             _f32([[1.5, 2.5], [0.7, 0.9]]),
             _f32([[0.3, 0.1], [2.0, 0.05]])]
    for g in grads:
        assert apply(g)
    value, ready = take(3)
    assert ready
    exact = np.sum([g.astype(np.float64) for g in grads], axis=0)
    if reduction == "MEAN":
        exact /= 3.0
    # By hand: sum = [[1.9, 2.8], [3.0, 1.35]], mean = sum / 3.
    np.testing.assert_allclose(
        exact, np.array([[1.9, 2.8], [3.0, 1.35]]) / (3.0 if reduction == "MEAN" else 1.0),
        rtol=1e-7)  # each float32 input is within eps/2 (6e-8) of its decimal
    np.testing.assert_allclose(value, exact, rtol=3 * EPS32)
    assert value.dtype == np.float32


def test_stale_gradients_are_dropped_and_counted(mode):
    acc = ConditionalAccumulator(tf.float32, [3])
    apply, take = _ops(acc, mode)
    acc.set_global_step(3)
    assert not apply(_f32([100.0, 100.0, 100.0]), step=2)  # stale
    assert not apply(_f32([100.0, 100.0, 100.0]), step=0)  # stale
    assert apply(_f32([1.0, 2.0, 3.0]), step=3)            # current
    assert apply(_f32([3.0, 2.0, 1.0]), step=7)            # ahead: accepted (TF1 too)
    assert _state(acc) == (2, 2, 3)
    value, ready = take(2)
    assert ready
    np.testing.assert_array_equal(value, [2.0, 2.0, 2.0])  # exact in float32
    assert _state(acc) == (0, 2, 4)
    # The default local_step=0 is stale once the step has moved on.
    assert not bool(acc.apply_grad(_f32([1.0, 1.0, 1.0])))
    assert _state(acc) == (0, 3, 4)


def test_take_not_ready_leaves_state_unchanged(mode):
    acc = ConditionalAccumulator(tf.float32, [2])
    apply, take = _ops(acc, mode)
    assert apply(_f32([0.25, -4.0]))
    value, ready = take(2)
    assert not ready
    np.testing.assert_array_equal(value, [0.0, 0.0])
    assert _state(acc) == (1, 0, 0)
    value, ready = take(1)  # the sum was kept: the first gradient comes back
    assert ready
    np.testing.assert_array_equal(value, [0.25, -4.0])


def test_take_ready_resets_and_bumps_global_step(mode):
    acc = ConditionalAccumulator(tf.float32, [2], reduction="SUM")
    apply, take = _ops(acc, mode)
    assert apply(_f32([1.0, 2.0]))
    assert apply(_f32([3.0, 4.0]))
    value, ready = take(2)
    assert ready
    np.testing.assert_array_equal(value, [4.0, 6.0])
    assert _state(acc) == (0, 0, 1)
    assert not apply(_f32([9.0, 9.0]), step=0)
    assert apply(_f32([0.5, 0.5]), step=1)
    value, ready = take(1)  # the sum restarted from zero
    assert ready
    np.testing.assert_array_equal(value, [0.5, 0.5])
    assert _state(acc) == (0, 1, 2)


def test_num_required_below_one_raises_when_run_or_is_one_under_xla(mode):
    # Statically known values < 1 raise (tested below); a run-time tensor raises
    # as TF1's op does, except under XLA, where nothing can raise: there it is
    # treated as 1 rather than dividing by zero.
    acc = ConditionalAccumulator(tf.float32, [1])
    take = compile_fn(lambda k: acc.take_grad(k),
                      "function" if mode == "eager" else mode)
    if mode != "jit":
        with pytest.raises(tf.errors.InvalidArgumentError, match="num_required"):
            take(tf.constant(0, tf.int64))
        return
    value, ready = take(tf.constant(0, tf.int64))
    assert not bool(ready)
    np.testing.assert_array_equal(value.numpy(), [0.0])
    acc.apply_grad(_f32([2.0]))
    value, ready = take(tf.constant(0, tf.int64))
    assert bool(ready)
    np.testing.assert_array_equal(value.numpy(), [2.0])


def test_indexed_slices_match_dense(mode):
    shape = [5, 3]
    rng = np.random.default_rng(0)
    slices = [
        (_f32(rng.uniform(0.1, 1.0, (3, 3))), np.array([0, 3, 3])),  # duplicate row
        (_f32(rng.uniform(0.1, 1.0, (2, 3))), np.array([4, 0])),
        (_f32(rng.uniform(0.1, 1.0, (1, 3))), np.array([3])),
    ]
    sparse = ConditionalAccumulator(tf.float32, shape)
    dense = ConditionalAccumulator(tf.float32, shape)
    apply_sparse, take_sparse = _ops(sparse, mode)
    apply_dense, take_dense = _ops(dense, mode)
    for values, indices in slices:
        grad = tf.IndexedSlices(tf.constant(values), tf.constant(indices, tf.int64),
                                tf.constant(shape, tf.int64))
        assert apply_sparse(grad)
        assert apply_dense(tf.convert_to_tensor(grad))
    got, ready_sparse = take_sparse(3)
    want, ready_dense = take_dense(3)
    assert ready_sparse and ready_dense
    # Row 3 receives four positive terms; summation order may differ between
    # scatter-add and densify-then-add, so allow 4 roundings on each side.
    np.testing.assert_allclose(got, want, rtol=4 * EPS32)
    assert np.all(got[[1, 2]] == 0.0)  # untouched rows stay exactly zero


def test_two_instances_do_not_share_state(mode):
    first = ConditionalAccumulator(tf.float32, [2])
    second = ConditionalAccumulator(tf.float32, [2])
    apply_first, take_first = _ops(first, mode)
    assert apply_first(_f32([1.0, 1.0]))
    take_first(1)
    assert _state(first) == (0, 0, 1)
    assert _state(second) == (0, 0, 0)
    value, ready = second.take_grad(1)
    assert not bool(ready)


def test_checkpoint_resume_mid_accumulation_is_exact(tmp_path):
    def continue_run(acc):
        acc.apply_grad(_f32([0.3, 0.7]), local_step=2)
        acc.apply_grad(_f32([5.0, 5.0]), local_step=1)  # stale
        return acc.take_grad(3)

    original = ConditionalAccumulator(tf.float32, [2])
    original.set_global_step(2)
    original.apply_grad(_f32([0.1, 0.2]), local_step=2)
    original.apply_grad(_f32([9.0, 9.0]), local_step=0)  # stale
    original.apply_grad(_f32([0.4, 1.1]), local_step=2)
    path = tf.train.Checkpoint(acc=original).save(str(tmp_path / "ckpt"))

    restored = ConditionalAccumulator(tf.float32, [2])
    tf.train.Checkpoint(acc=restored).restore(path).assert_consumed()
    assert _state(restored) == (2, 1, 2)

    want_value, want_ready = continue_run(original)
    got_value, got_ready = continue_run(restored)
    assert bool(want_ready) and bool(got_ready)
    np.testing.assert_array_equal(got_value.numpy(), want_value.numpy())
    assert _state(restored) == _state(original) == (0, 2, 3)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dtype=tf.int32, shape=[2]), TypeError, ["`dtype`", "int32", "floating"]),
    (dict(dtype="not a dtype", shape=[2]), TypeError, ["`dtype`", "not a dtype"]),
    (dict(dtype=tf.float32, shape=[None, 2]), ValueError, ["`shape`", "None", "fully defined"]),
    (dict(dtype=tf.float32, shape=None), ValueError, ["`shape`", "None"]),
    (dict(dtype=tf.float32, shape=[2], reduction="mean"), ValueError,
     ["`reduction`", "'mean'", "MEAN", "SUM"]),
    (dict(dtype=tf.float32, shape=[2], reduction="AVG"), ValueError, ["`reduction`", "AVG"]),
])
def test_bad_construction_arguments_name_the_argument(kwargs, error, words):
    with pytest.raises(error) as info:
        ConditionalAccumulator(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_bad_call_arguments_name_the_argument():
    acc = ConditionalAccumulator(tf.float32, [2, 3])
    with pytest.raises(ValueError, match=r"`grad`.*\(2, 3\).*\(3, 2\)"):
        acc.apply_grad(tf.zeros([3, 2]))
    with pytest.raises(TypeError, match=r"`grad`.*float32.*float64"):
        acc.apply_grad(tf.zeros([2, 3], tf.float64))
    with pytest.raises(ValueError, match=r"`grad` IndexedSlices values"):
        acc.apply_grad(tf.IndexedSlices(tf.zeros([1, 4]), tf.constant([0])))
    with pytest.raises(ValueError, match=r"`grad` IndexedSlices dense_shape"):
        acc.apply_grad(tf.IndexedSlices(tf.zeros([1, 3]), tf.constant([0]),
                                        tf.constant([4, 3])))
    with pytest.raises(TypeError, match=r"`local_step`.*float32"):
        acc.apply_grad(tf.zeros([2, 3]), local_step=1.0)
    with pytest.raises(ValueError, match=r"`num_required`.*0"):
        acc.take_grad(0)
    with pytest.raises(TypeError, match=r"`new_global_step`"):
        acc.set_global_step(2.5)
    assert _state(acc) == (0, 0, 0)  # nothing was half-applied


def test_partially_known_shape_is_checked_when_run():
    acc = ConditionalAccumulator(tf.float32, [2])
    apply = tf.function(lambda g: acc.apply_grad(g),
                        input_signature=[tf.TensorSpec([None], tf.float32)])
    assert bool(apply(tf.ones([2])))
    with pytest.raises(tf.errors.InvalidArgumentError):
        apply(tf.ones([3]))


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
def test_agrees_with_tf1_conditional_accumulator(reduction):
    ours = ConditionalAccumulator(tf.float32, [3], reduction=reduction)
    theirs = tf.compat.v1.ConditionalAccumulator(
        tf.float32, shape=[3], reduction_type=reduction,
        shared_name=f"tf_gradkit_test_{uuid.uuid4().hex}")
    rng = np.random.default_rng(1)
    # (action, argument, local_step). TF1's take blocks until ready, so it is
    # only called when enough gradients are in; `ours` is checked for that too.
    script = [
        ("apply", 0), ("apply", 0), ("take", 2),
        ("apply", 0), ("apply", 1), ("apply", 3), ("apply", 1), ("take", 3),
        ("set", 5), ("apply", 4), ("apply", 5), ("take", 1),
        ("set", 1), ("apply", 1), ("apply", 2), ("take", 2),
    ]
    for action, arg in script:
        if action == "apply":
            grad = _f32(rng.uniform(0.1, 2.0, 3))
            theirs.apply_grad(grad, local_step=arg)
            ours.apply_grad(grad, local_step=arg)
        elif action == "set":
            theirs.set_global_step(arg)
            ours.set_global_step(arg)
        else:
            count = int(ours.num_accumulated())
            want = theirs.take_grad(arg).numpy()
            got, ready = ours.take_grad(arg)
            assert bool(ready)
            np.testing.assert_allclose(got.numpy(), want, rtol=count * EPS32)
        assert int(ours.num_accumulated()) == int(theirs.num_accumulated())
    assert int(ours.num_dropped()) == 2  # the step-0 and step-4 gradients
    assert int(ours.global_step) == 2


def test_example_script_runs(capsys):
    runpy.run_path(os.path.join(REPO_ROOT, "examples", "conditional_accumulator.py"),
                   run_name="__main__")
    out = capsys.readouterr().out
    assert "dropped" in out


def test_several_calls_in_one_function_take_the_lock_in_turn(mode):
    # Each call holds the instance's mutex (not under XLA); calls in one
    # function must take it one after the other, never deadlock, and see each
    # other's effects in program order.
    acc = ConditionalAccumulator(tf.float32, [2])

    def step(g):
        first = acc.apply_grad(g, acc.global_step)
        second = acc.apply_grad(2.0 * g, acc.global_step)
        value, ready = acc.take_grad(2)
        third = acc.apply_grad(g, acc.global_step)
        return first, second, value, ready, third

    first, second, value, ready, third = compile_fn(step, mode)(tf.constant([1.0, 2.0]))
    assert bool(first) and bool(second) and bool(ready) and bool(third)
    np.testing.assert_array_equal(value.numpy(), [1.5, 3.0])
    assert _state(acc) == (1, 0, 1)


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_sixteen_bit_gradients_are_summed_in_float32(mode, dtype):
    # Issue 38, item 12: eight 16-bit gradients 32 + 2u(1 + i) (u the dtype's
    # spacing at 16: representable) add up past 256, where a 16-bit running
    # sum rounds (control) and a float32 one is exact; the MEAN comes back in
    # the gradients' dtype, rounded once.
    narrow = dtype.as_numpy_dtype
    spacing = {tf.bfloat16: 2.0 ** -3, tf.float16: 2.0 ** -6}[dtype]
    grads = (32.0 + 2 * spacing * np.arange(1, 9)).astype("float32")
    assert np.array_equal(grads.astype(narrow).astype("float32"), grads)
    expected = narrow(grads.sum() / 8)
    running = narrow(0)
    for g in grads:
        running = narrow(np.float32(running) + g)
    assert narrow(np.float32(running) / 8) != expected  # control
    acc = ConditionalAccumulator(dtype, [1])
    apply, take = _ops(acc, mode)
    for g in grads:
        assert apply(tf.constant([g], dtype))
    value, ready = take(8)
    assert ready and value.dtype == narrow
    np.testing.assert_array_equal(value, [expected])


def test_accumulator_dtype_is_checked_and_never_narrower():
    assert ConditionalAccumulator(tf.float64, [1], accumulator_dtype="float32")._sum.dtype \
        == tf.float64
    assert ConditionalAccumulator(tf.float16, [1], accumulator_dtype="float64")._sum.dtype \
        == tf.float64
    with pytest.raises(ValueError, match=r"ConditionalAccumulator: `accumulator_dtype` must "
                       r"be one of \(None, 'float32', 'float64', 'float16', 'bfloat16'\)"
                       r".*Received: accumulator_dtype='int32'"):
        ConditionalAccumulator(tf.float32, [1], accumulator_dtype="int32")
    # A 16-bit value keeps a 16-bit accumulator's sum in its own dtype (as
    # before accumulator_dtype existed: old checkpoints), and widens others.
    assert ConditionalAccumulator(tf.bfloat16, [1], accumulator_dtype="bfloat16")._sum.dtype \
        == tf.bfloat16
    assert ConditionalAccumulator(tf.float32, [1], accumulator_dtype="float16")._sum.dtype \
        == tf.float32


@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
def test_sixteen_bit_take_that_does_not_fit_returns_inf_as_a_nonfinite_mean(mode, reduction):
    # The float32 sum of two float16 gradients of 4e4 holds 8e4, which
    # float16 does not: "SUM" hands on Inf, as it hands on any non-finite
    # value (and as TF1's float16 sum overflows), never a finite wrong
    # value; the "MEAN", 4e4, fits (control).
    acc = ConditionalAccumulator(tf.float16, [2], reduction=reduction)
    apply, take = _ops(acc, mode)
    for _ in range(2):
        assert apply(tf.constant([4e4, 1.0], tf.float16))
    value, ready = take(2)
    assert ready and value.dtype == np.float16
    expected = [np.inf, 2.0] if reduction == "SUM" else [4e4, 1.0]
    np.testing.assert_array_equal(value.astype("float32"), expected)


def test_sixteen_bit_accumulator_dtype_restores_old_checkpoints(tmp_path):
    # A checkpoint of a bfloat16 accumulator saved before accumulator_dtype
    # holds a bfloat16 sum: the default float32 sum refuses it by dtype, and
    # accumulator_dtype="bfloat16" restores it.
    old = ConditionalAccumulator(tf.bfloat16, [1], accumulator_dtype="bfloat16")
    assert old.apply_grad(tf.constant([3.0], tf.bfloat16), 0)
    path = tf.train.Checkpoint(acc=old).save(str(tmp_path / "c"))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="expected dtype float does not equal original dtype bfloat16"):
        tf.train.Checkpoint(acc=ConditionalAccumulator(tf.bfloat16, [1])).restore(path)
    resumed = ConditionalAccumulator(tf.bfloat16, [1], accumulator_dtype="bfloat16")
    tf.train.Checkpoint(acc=resumed).restore(path).assert_existing_objects_matched()
    assert resumed.apply_grad(tf.constant([1.0], tf.bfloat16), 0)
    value, ready = resumed.take_grad(2)
    assert bool(ready)
    np.testing.assert_array_equal(value.numpy().astype("float32"), [2.0])  # (3 + 1) / 2
