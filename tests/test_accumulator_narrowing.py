"""16-bit variables whose window sums are kept wider (`accumulator_dtype`):
the gradient narrowed back to the variable's dtype, sparse windows, and the
16-bit sums of checkpoints saved before `accumulator_dtype` existed.

Run once per flavour by `make test`.
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn, mode_with_function_slow
from helpers import make_train_step, weights_of

mode = mode_with_function_slow()


def _float16_model(K):
    model = K.Sequential([K.Input((1,)), K.layers.Dense(1, use_bias=False, dtype="float16",
                                                        kernel_initializer="zeros")])
    assert model.trainable_variables[0].dtype == "float16"  # not mixed precision
    return model


def _inner(K):
    return K.optimizers.SGD(1e-3, momentum=0.9)  # has state (momentum) to protect


# Loss (w x - y)^2 at w = 0, y = 100: each example's gradient is -200 x, so
# x = 200 gives -4e4 (fits float16, max 65504) and a window of two sums to
# -8e4, which a float32 sum holds and float16 does not; x = 100 gives a window
# of -4e4 that fits (the control). Every value here is exact in float16.
@pytest.mark.parametrize("fits", [False, True])
@pytest.mark.parametrize("path", ["fit", "loop"])
def test_float16_window_overflowing_when_narrowed_is_skipped(K, gk, path, fits, mode):
    x = np.full((2, 1), 100.0 if fits else 200.0, "float32")
    y = np.full((2, 1), 100.0, "float32")
    model = _float16_model(K)
    if path == "fit":
        opt = gk.GradientAccumulator(_inner(K), steps=2, model=model)
        model.compile(optimizer=opt, loss=K.losses.MeanSquaredError(reduction="sum"),
                      run_eagerly=mode == "eager", jit_compile=mode == "jit")
    else:
        opt = gk.GradientAccumulator(_inner(K), steps=2, reduction="sum")
    opt.build(model.trainable_variables)
    weights = weights_of(model)
    state = [np.array(v.numpy()) for v in opt.inner_optimizer.variables]
    if path == "fit":
        model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0)
    else:
        step = make_train_step(model, opt, mode)
        for i in range(2):
            step(tf.constant(x[i:i + 1], "float16"), tf.constant(y[i:i + 1], "float16"))
    assert opt._state.acc_grads[0].dtype == tf.float32
    if not fits:
        assert int(opt.skipped_windows.numpy()) == 1
        assert int(opt.iterations.numpy()) == 0
        np.testing.assert_array_equal(weights_of(model)[0], weights[0])
        for before, after in zip(state, opt.inner_optimizer.variables):
            np.testing.assert_array_equal(after.numpy(), before)
        return
    # The control proceeds: the inner optimizer applied by hand to the
    # window's gradient, -4e4 in float16.
    reference = _float16_model(K)
    by_hand = _inner(K)
    by_hand.apply_gradients([(tf.constant([[-4e4]], "float16"),
                              reference.trainable_variables[0])])
    assert int(opt.skipped_windows.numpy()) == 0 and int(opt.iterations.numpy()) == 1
    # One float16 rounding apart at most: XLA may keep a fused product in float32.
    np.testing.assert_allclose(weights_of(model)[0].astype("float32"),
                               weights_of(reference)[0].astype("float32"), rtol=2.0 ** -10)
    assert np.all(np.isfinite(weights_of(model)[0].astype("float32")))


@pytest.mark.distributed
@pytest.mark.parametrize("fits", [False, True])
def test_float16_window_overflowing_over_replicas_is_skipped(K, gk, mirrored, fits):
    # Two replicas, one example each per step, windows of 2 steps: the window
    # is the four examples' summed gradient, -200 x each (see above), and each
    # replica holds the share of its two examples in float32. x = 100: each
    # share is -4e4, which fits float16, and only the total over replicas
    # (the widened all-reduce), -8e4, overflows it; x = 50 (the control)
    # gives a window of -4e4.
    x = np.full((4, 1), 50.0 if fits else 100.0, "float32")
    y = np.full((4, 1), 100.0, "float32")
    with mirrored.scope():
        model = _float16_model(K)
        opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=2, model=model)
        model.compile(optimizer=opt, loss=K.losses.MeanSquaredError(reduction="sum"))
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    kernel = model.trainable_variables[0].numpy().astype("float32")
    if fits:
        assert int(opt.skipped_windows.numpy()) == 0 and int(opt.iterations.numpy()) == 1
        # The window's gradient: the four examples' -1e4 each, summed (as
        # one batch of four would give), then SGD(1.0) from 0; exact.
        np.testing.assert_array_equal(kernel, [[4e4]])
    else:
        assert int(opt.skipped_windows.numpy()) == 1 and int(opt.iterations.numpy()) == 0
        np.testing.assert_array_equal(kernel, [[0.0]])


# A sparse window: eight micro-batches of IndexedSlices, each holding the
# gradient -2 y_i for rows 1 and 3 (row 3 twice: repeated indices add); a
# 16-bit running sum rounds where the float32 one is exact (the y of
# test_gradient_accumulator._y16: 16 + spacing * i).
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_sparse_window_is_summed_in_float32(K, gk, dtype, mode):
    spacing = {"bfloat16": 2.0 ** -3, "float16": 2.0 ** -6}[dtype]
    grads = -2.0 * (16.0 + spacing * np.arange(1, 9, dtype="float32"))
    narrow = tf.as_dtype(dtype).as_numpy_dtype
    np.testing.assert_array_equal(grads.astype(narrow).astype("float32"), grads)

    def window(sum_dtype, copies):
        total = np.zeros((), sum_dtype)
        for g in grads:
            for _ in range(copies):
                total = (total + np.asarray(g, sum_dtype)).astype(sum_dtype)
        return -np.float32(narrow(total / sum_dtype(8)))

    expected = [window(np.float32, 1), window(np.float32, 2)]
    # Control: the same windows summed in 16 bits end elsewhere.
    assert window(narrow, 1) != expected[0] and window(narrow, 2) != expected[1]
    model = K.Sequential([K.Input((2,), dtype="int32"),
                          K.layers.Embedding(5, 1, dtype=dtype, embeddings_initializer="zeros")])
    table = model.trainable_variables[0]
    assert table.dtype == dtype
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(model(tf.constant([[1, 3]])))
    real = tape.gradient(out, model.trainable_variables)[0]
    assert isinstance(real, tf.IndexedSlices)  # what an Embedding hands on
    opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=8, reduction="microbatch")
    indices = tf.constant([1, 3, 3])

    def step(g):
        values = tf.fill([3, 1], tf.cast(g, dtype))
        opt.apply_gradients([(tf.IndexedSlices(values, indices, tf.constant([5, 1])), table)])

    step = compile_fn(step, mode)
    for g in grads:
        step(tf.constant(g))
    assert int(opt.iterations.numpy()) == 1
    assert opt._state.acc_grads[0].dtype == tf.float32
    got = table.numpy().astype("float32").ravel()
    np.testing.assert_array_equal(got, [0.0, expected[0], 0.0, expected[1], 0.0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_accumulator_dtype_restores_old_checkpoints(K, gk, dtype, tmp_path):
    # accumulator_dtype=dtype keeps 16-bit sums, as before accumulator_dtype
    # existed: a checkpoint saved mid-window with 16-bit sums restores into
    # it; the default (float32 sums) refuses it by dtype, before anything
    # is restored into the sums.
    def build(accumulator_dtype):
        model = K.Sequential([K.Input((1,)), K.layers.Dense(1, use_bias=False, dtype=dtype,
                                                            kernel_initializer="zeros")])
        opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=4, reduction="microbatch",
                                     accumulator_dtype=accumulator_dtype)
        opt.build(model.trainable_variables)
        return model, opt

    old, old_opt = build(dtype)
    assert old_opt._state.acc_grads[0].dtype == dtype  # the old 16-bit sums
    step = make_train_step(old, old_opt, "eager")
    step(tf.ones((1, 1), dtype), tf.constant([[3.0]], dtype))  # gradient -6
    path = tf.train.Checkpoint(model=old, optimizer=old_opt).save(str(tmp_path / "c"))

    _, refused = build(None)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="expected dtype float does not equal original dtype "
                       f"{ {'float16': 'half'}.get(dtype, dtype)}"):
        tf.train.Checkpoint(optimizer=refused).restore(path).expect_partial()
    np.testing.assert_array_equal(refused._state.acc_grads[0].numpy(), [[0.0]])

    resumed, resumed_opt = build(dtype)
    tf.train.Checkpoint(model=resumed, optimizer=resumed_opt).restore(
        path).assert_existing_objects_matched()
    np.testing.assert_array_equal(
        resumed_opt._state.acc_grads[0].numpy().astype("float32"), [[-6.0]])
    step = make_train_step(resumed, resumed_opt, "eager")
    for _ in range(3):
        step(tf.ones((1, 1), dtype), tf.constant([[1.0]], dtype))  # gradients -2
    assert int(resumed_opt.iterations.numpy()) == 1
    # The window's mean (-6 - 2 - 2 - 2) / 4 = -3, exact; SGD(1.0) from 0.
    np.testing.assert_array_equal(resumed.trainable_variables[0].numpy().astype("float32"),
                                  [[3.0]])


def test_sixteen_bit_accumulator_dtype_widens_to_wider_variables(K, gk):
    from tf_gradkit.core.accumulation import sum_dtype  # noqa: PLC0415
    assert sum_dtype("float32", "bfloat16") == tf.float32
    assert sum_dtype("float16", "float16") == tf.float16
    model = K.Sequential([K.Input((1,)), K.layers.Dense(1)])
    opt = gk.GradientAccumulator(K.optimizers.SGD(1.0), steps=2, accumulator_dtype="float16")
    opt.build(model.trainable_variables)
    assert all(s.dtype == tf.float32 for s in opt._state.acc_grads)
    assert opt.get_config()["accumulator_dtype"] == "float16"
