"""AccumBatchNormalization: each micro-batch is normalised as plain BN does, and
the moving statistics move once per window, with the window's pooled moments.

Tolerances. The expected values are float64 numpy statistics of the
concatenated window; the layer works in float32. Inputs here are O(10), so one
float32 rounding is ~1e-6 relative; the window sums add a handful of such
terms and the pooled variance subtracts a square, so a few 1e-6 relative is
round-off. rtol=1e-5 / atol=1e-5 is that bound with margin, and each pooling
test first checks that the naive answer (averaging the micro-batches' own
statistics) misses the expected value by far more than that.
"""

import importlib

import numpy as np
import pytest

from conftest import FLAVOUR, compile_fn

AccumBatchNormalization = importlib.import_module(
    f"tf_gradkit.{FLAVOUR}.layers").AccumBatchNormalization

RTOL = ATOL = 1e-5
SIZES = (8, 8, 3)  # the last micro-batch of the window is short
TAILS = {"dense": (4,), "conv": (3, 3, 2)}  # per-example shapes, channels last


def micro_batches(tail, sizes=SIZES, seed=0):
    """Micro-batches whose means and spreads differ, so that the window's
    variance (mean of variances + variance of means) is far from the mean of
    the micro-batch variances."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, *tail)) * (1 + t) + 3.0 * t + 1.0)
            .astype("float32") for t, n in enumerate(sizes)]


def window_moments(batches):
    """float64 mean and biased variance per channel of the concatenation."""
    x = np.concatenate(batches).astype("float64")
    x = x.reshape(-1, x.shape[-1])
    return x.mean(axis=0), x.var(axis=0)


def moving(layer):
    return layer.moving_mean.numpy().copy(), layer.moving_variance.numpy().copy()


def built(layer, batch):
    layer(batch, training=False)  # builds; inference changes no statistics
    return layer


@pytest.mark.parametrize("tail", sorted(TAILS))
def test_training_outputs_match_plain_batchnorm(K, mode, tail):
    batches = micro_batches(TAILS[tail])
    ours = built(AccumBatchNormalization(3), batches[0])
    plain = built(K.layers.BatchNormalization(), batches[0])
    run_ours = compile_fn(lambda x: ours(x, training=True), mode)
    run_plain = compile_fn(lambda x: plain(x, training=True), mode)
    for x in batches:
        # Bit-identical on the unfused path; tf_keras runs plain BN's fused
        # kernel on 4-D inputs, which rounds differently.
        np.testing.assert_allclose(run_ours(x).numpy(), run_plain(x).numpy(),
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("tail", sorted(TAILS))
def test_moving_stats_pool_each_window_once(mode, tail):
    momentum = 0.9
    windows = [micro_batches(TAILS[tail]),
               micro_batches(TAILS[tail], sizes=(2, 7, 5), seed=1)]
    layer = built(AccumBatchNormalization(3, momentum=momentum), windows[0][0])
    step = compile_fn(lambda x: layer(x, training=True), mode)

    expected_mean, expected_var = moving(layer)
    for batches in windows:
        pooled_mean, pooled_var = window_moments(batches)
        naive_var = np.mean([b.reshape(-1, b.shape[-1]).var(0)
                             for b in batches], axis=0)
        assert np.all(np.abs(naive_var - pooled_var) > 100 * ATOL * pooled_var)

        before = moving(layer)
        for x in batches[:-1]:
            step(x)
            after = moving(layer)  # mid-window: untouched, bit for bit
            np.testing.assert_array_equal(after[0], before[0])
            np.testing.assert_array_equal(after[1], before[1])
        step(batches[-1])

        expected_mean = expected_mean * momentum + pooled_mean * (1 - momentum)
        expected_var = expected_var * momentum + pooled_var * (1 - momentum)
        got_mean, got_var = moving(layer)
        np.testing.assert_allclose(got_mean, expected_mean, rtol=RTOL,
                                   atol=ATOL)
        np.testing.assert_allclose(got_var, expected_var, rtol=RTOL, atol=ATOL)


def test_large_mean_keeps_the_variance(mode):
    # mean/std = 1e4: summing n*(v + m**2) about 0 would lose the variance to
    # float32 round-off (an error of O(1) on a variance of O(1)). The window's
    # shift keeps it; what is left is the float32 error of each micro-batch
    # mean (~1e-3 here), hence rtol=1e-2.
    batches = [x + np.float32(1e4) for x in micro_batches(TAILS["dense"])]
    layer = built(AccumBatchNormalization(3, momentum=0.0), batches[0])
    step = compile_fn(lambda x: layer(x, training=True), mode)
    for x in batches:
        step(x)
    mean, var = window_moments(batches)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(layer.moving_variance.numpy(), var, rtol=1e-2)


def test_one_step_window_is_plain_batchnorm(K):
    # Unfused (2-D) inputs, where both flavours' plain BN feed the biased
    # batch variance to the moving average.
    ours = AccumBatchNormalization(1, momentum=0.8)
    plain = K.layers.BatchNormalization(momentum=0.8)
    for x in micro_batches(TAILS["dense"]):
        ours(x, training=True)
        plain(x, training=True)
    for got, want in zip(moving(ours), moving(plain)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_mask_excludes_padded_positions(K, mode):
    rng = np.random.default_rng(2)
    xs = [(rng.normal(size=(n, 5, 3)) * 2 + 3 * t).astype("float32")
          for t, n in enumerate((4, 3))]
    masks = [rng.random(size=x.shape[:2]) > 0.3 for x in xs]
    layer = built(AccumBatchNormalization(2, momentum=0.0), xs[0])
    plain = built(K.layers.BatchNormalization(), xs[0])
    step = compile_fn(lambda x, m: layer(x, training=True, mask=m), mode)
    plain_step = compile_fn(lambda x, m: plain(x, training=True, mask=m), mode)
    for x, m in zip(xs, masks):
        np.testing.assert_allclose(step(x, m).numpy(), plain_step(x, m).numpy(),
                                   rtol=RTOL, atol=ATOL)
    mean, var = window_moments([x[m] for x, m in zip(xs, masks)])
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(layer.moving_variance.numpy(), var, rtol=RTOL,
                               atol=ATOL)


def test_fit_updates_moving_stats_every_k_steps(K):
    steps, batch, momentum = 2, 8, 0.5
    x = np.concatenate(micro_batches(TAILS["dense"], sizes=(batch,) * 4))
    y = np.zeros((len(x), 1), "float32")
    bn = AccumBatchNormalization(steps, momentum=momentum)
    model = K.Sequential([K.Input(shape=(4,)), bn, K.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")

    seen = []
    record = K.callbacks.LambdaCallback(
        on_train_batch_end=lambda i, logs: seen.append(moving(bn)))
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[record])

    # The statistics are those of the inputs, not of anything trained, so the
    # expected values follow from the data alone.
    mean, var = np.zeros(4), np.ones(4)
    for i, (got_mean, got_var) in enumerate(seen):
        if (i + 1) % steps == 0:
            pooled_mean, pooled_var = window_moments(
                [x[(i + 1 - steps) * batch:(i + 1) * batch]])
            mean = mean * momentum + pooled_mean * (1 - momentum)
            var = var * momentum + pooled_var * (1 - momentum)
        np.testing.assert_allclose(got_mean, mean, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got_var, var, rtol=RTOL, atol=ATOL)

    # Inference normalises with the moving statistics, as plain BN does.
    mean, var = moving(bn)
    gamma, beta = bn.gamma.numpy(), bn.beta.numpy()  # trained by the fit
    np.testing.assert_allclose(
        bn(x[:5], training=False).numpy(),
        gamma * (x[:5] - mean) / np.sqrt(var + bn.epsilon) + beta,
        rtol=RTOL, atol=ATOL)


def test_config_round_trip(K):
    layer = AccumBatchNormalization(4, momentum=0.9, epsilon=1e-4,
                                    center=False, name="abn")
    config = layer.get_config()
    assert config["accumulation_steps"] == 4
    assert AccumBatchNormalization.from_config(config).get_config() == config

    assert (K.saving.get_registered_name(AccumBatchNormalization)
            == "tf_gradkit>AccumBatchNormalization")
    restored = K.saving.deserialize_keras_object(
        K.saving.serialize_keras_object(layer))
    assert type(restored) is AccumBatchNormalization
    assert restored.get_config() == config


def test_saved_model_resumes_an_open_window(K, tmp_path):
    first, second = micro_batches(TAILS["dense"], sizes=(8, 5))
    model = K.Sequential([K.Input(shape=(4,)), AccumBatchNormalization(2)])
    model(first, training=True)  # window half full
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = K.saving.load_model(path)
    assert type(loaded.layers[0]) is AccumBatchNormalization

    model(second, training=True)
    loaded(second, training=True)
    for got, want in zip(moving(loaded.layers[0]), moving(model.layers[0])):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert not np.array_equal(moving(model.layers[0])[0], np.zeros(4))


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3", True, None])
def test_bad_accumulation_steps_raise(bad):
    with pytest.raises(ValueError,
                       match=r"`accumulation_steps` must be an integer >= 1.*"
                             r"Received: accumulation_steps="):
        AccumBatchNormalization(bad)


def test_renorm_is_rejected():
    with pytest.raises(ValueError, match=r"renorm.*Received: renorm=True"):
        AccumBatchNormalization(2, renorm=True)


def test_a_bfloat16_layer_pools_its_window_in_float32(mode):
    # Issue 38, item 12: a 16-bit layer (dtype="bfloat16", variables in
    # bfloat16) keeps its window's counts and sums in float32 (a bfloat16
    # count stops being exact at 256 elements). With momentum 0 the moving
    # mean after a window is the window's mean in float32, rounded once to
    # bfloat16; the control, the same window pooled with bfloat16 counts
    # (300 + 300 + 301 elements per channel: 901 has no bfloat16 value),
    # would differ.
    import tensorflow as tf  # noqa: PLC0415

    batches = [b.astype(tf.bfloat16.as_numpy_dtype).astype("float32")
               for b in micro_batches((1,), sizes=(300, 300, 301))]
    layer = built(AccumBatchNormalization(3, momentum=0.0, dtype="bfloat16"),
                  batches[0])
    assert all(str(getattr(v.dtype, "name", v.dtype)) in ("float32", "int64")
               for v in layer._window)
    step = compile_fn(lambda x: layer(x, training=True), mode)
    for x in batches:
        step(tf.constant(x, "bfloat16"))
    assert float(np.float32(tf.bfloat16.as_numpy_dtype(901.0))) != 901.0  # control
    got, expected = layer.moving_mean.numpy(), window_moments(batches)[0]
    if got.dtype == np.float32:  # tf_keras keeps a 16-bit layer's statistics in float32
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    else:  # one rounding of the float32 pooled mean (float32 round-off is far below it)
        np.testing.assert_array_equal(got, expected.astype("float32").astype(got.dtype))
