"""tensorflow-privacy's fast-gradient-clipping registry tests, ported to
`per_example_gradient_norms` (conformance).

Source: github.com/tensorflow/privacy, tensorflow_privacy/privacy/
fast_gradient_clipping/registry_functions/{dense,embedding,
layer_normalization,einsum_dense,multi_head_attention,nlp_*}_test.py,
clip_grads_test.py and gradient_clipping_utils_test.py (Apache License 2.0,
Copyright 2023 The TensorFlow Authors). tensorflow-privacy pins
TensorFlow <= 2.15, so its tests cannot run here: their scenarios (models,
layers, inputs, losses, partial trainables, sample weights) are rewritten
for this API, with a Python loop of single-example GradientTapes as the
oracle instead of their own "true norms" helper. Everything is float64, so
the norms must agree to 1e-9 (relative): the two sides sum the same
products in another order, a round-off of ~1e-15 relative each. Each case
runs eagerly and under XLA (tf.function without XLA, the same graph
uncompiled, under `make test-slow`); scenarios without an equivalent here are skipped with a
one-line reason.
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import compile_fn
from tf_gradkit.gradients import per_example_gradient_norms
from tf_gradkit.gradients.per_example import per_example_norm_plan

RTOL = 1e-9  # float64 (see the header)
F64 = "float64"
# tf.function without XLA runs under `make test-slow` only (the same graph as
# "jit", uncompiled).
MODES = ["eager", pytest.param("function", marks=pytest.mark.slow), "jit"]


def _mse(y, p):
    """tensorflow-privacy's default: Keras' MSE per example."""
    return tf.reduce_mean(tf.square(tf.cast(y, p.dtype) - p), -1)


def _test_loss_fn(y, p):
    """Their `common_test_utils.test_loss_fn`'s shape: a scaled sum of
    squares (a loss other than the model's compiled one)."""
    return 0.5 * tf.reduce_sum(tf.square(tf.cast(y, p.dtype) - p), -1)


def _oracle(model, loss_fn, x, y, weights=None):
    """Each example's gradient norm by its own tape."""
    n = int(y.shape[0])
    out = []
    for i in range(n):
        xi = tf.nest.map_structure(lambda t: t[i:i + 1], x)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y[i:i + 1], model(xi, training=False)))
            if weights is not None:
                loss = loss * tf.cast(weights[i], loss.dtype)
        grads = tape.gradient(loss, model.trainable_variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        out.append(np.sqrt(sum(np.sum(np.square(tf.convert_to_tensor(g).numpy()))
                               for g in grads)))
    return np.array(out)


def _check(model, loss_fn, x, y, mode, weights=None):
    fn = compile_fn(lambda x, y, w: per_example_gradient_norms(
        model, loss_fn, x, y, sample_weight=w, training=False), mode)
    got = fn(x, y, weights).numpy()
    want = _oracle(model, loss_fn, x, y, weights)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.max(want))
    return got


# ----------------------------------------------------------------- Dense
def _dense_layer(K, name):
    return {"pure_dense": K.layers.Dense(2, dtype=F64),
            "sigmoid_dense": K.layers.Dense(2, activation="sigmoid", dtype=F64)}[name]


def _dense_model(K, model_name, layer_name):
    """Their `make_one_layer_functional_model`, `make_two_layer_functional_model`
    and `make_two_tower_model`, with the layer under test inside."""
    L = K.layers
    inp = K.Input((4,), dtype=F64)
    if model_name == "func1":
        return K.Model(inp, L.Dense(2, dtype=F64)(_dense_layer(K, layer_name)(inp)))
    if model_name == "func2":
        h = _dense_layer(K, layer_name)(L.Dense(3, dtype=F64)(inp))
        return K.Model(inp, L.Dense(2, dtype=F64)(h))
    other = K.Input((4,), dtype=F64)
    towers = [_dense_layer(K, layer_name)(inp), _dense_layer(K, layer_name)(other)]
    return K.Model([inp, other], L.Dense(2, dtype=F64)(L.Concatenate()(towers)))


def _nd_batches():
    """Their `get_nd_test_batches(4)`: batches of 1 and 3 (integer-valued
    entries; weights of varied size)."""
    rng = np.random.default_rng(0)
    return [(tf.constant(rng.integers(-3, 4, size=(n, 4)), F64),
             tf.constant(rng.uniform(0.5, 2.0, size=n), F64)) for n in (1, 3)]


# Every case eagerly; compiled, the variant with every option (the plain
# one compiles the same ops), to keep the file cheap.
DENSE_PARAMS = [
    pytest.param(m, layer, v, mode, id=f"{m}-{layer}-{v}-{mode}",
                 marks=[pytest.mark.slow] if mode == "function" else [])
    for m in ("func1", "func2", "tower2") for layer in ("pure_dense", "sigmoid_dense")
    for v in ("plain", "custom_loss_partial_weighted")
    for mode in ("eager", "function", "jit")
    if mode == "eager" or v != "plain"]


@pytest.mark.parametrize("model_name,layer_name,variant,mode", DENSE_PARAMS)
def test_dense(K, model_name, layer_name, variant, mode):
    model = _dense_model(K, model_name, layer_name)
    loss_fn, weighted = _mse, False
    if variant != "plain":
        # "partial": norms over a subset of the variables (their
        # `trainable_vars`): here the first Dense is frozen.
        loss_fn, weighted = _test_loss_fn, True
        model.layers[1].trainable = False
    rng = np.random.default_rng(1)
    for x, w in _nd_batches():
        y = tf.constant(rng.normal(size=(x.shape[0], 2)), F64)
        xs = [x, 2.0 * x] if model_name == "tower2" else x
        _check(model, loss_fn, xs, y, mode, w if weighted else None)


# ------------------------------------------------------------- Embedding
def _ids(kind):
    """Their `x_batch` cases: 2-D and 3-D ids, dense and ragged (with an
    empty example), with repeated ids."""
    dense2 = [[0, 1], [1, 1], [0, 0]]
    ragged2 = [[0], [1], [], [0, 0], [0, 1], [1, 0], [1, 1], [0, 1]]
    return {"dense_2d": tf.constant(dense2, tf.int32),
            "ragged_2d": tf.ragged.constant(ragged2, tf.int32),
            "dense_3d": tf.constant([[r] for r in dense2], tf.int32),
            "ragged_3d": tf.ragged.constant(
                [[[0]], [[1]], [], [[0, 0]], [[0, 1]], [[1, 0]], [[1, 1]], [[0]]],
                tf.int32)}[kind]


def _sum_tokens(K):
    """Sums a (ragged or dense) [B, ..., d] over its middle axes."""
    def total(t):
        while t.shape.rank > 2:
            t = tf.reduce_sum(t, 1)
        return t
    return K.layers.Lambda(total, dtype=F64)


def _bow_model(K, model_name, ids):
    """Their `make_bow_model` (Embedding, summed), `make_dense_bow_model`
    (Embedding, a Dense per token, summed) and `make_weighted_bow_model`
    (a second Embedding weighting each token)."""
    L = K.layers
    ragged = isinstance(ids, tf.RaggedTensor)
    inp = K.Input(tuple([None] * (ids.shape.rank - 1)), dtype="int32", ragged=ragged)
    emb = L.Embedding(3, 2, dtype=F64)(inp)
    if model_name == "bow1":
        return K.Model(inp, _sum_tokens(K)(emb))
    if model_name == "bow2":
        return K.Model(inp, _sum_tokens(K)(L.Dense(2, dtype=F64)(emb)))
    weight = L.Embedding(3, 1, dtype=F64)(inp)
    return K.Model(inp, _sum_tokens(K)(L.Multiply()([emb, weight])))


# Every case eagerly; compiled, the 3-D dense and 2-D ragged ids (the 2-D
# dense and 3-D ragged ones compile the same ops).
EMBEDDING_PARAMS = [
    pytest.param(k, m, mode, id=f"{k}-{m}-{mode}",
                 marks=[pytest.mark.slow] if mode == "function" else [])
    for k in ("dense_2d", "ragged_2d", "dense_3d", "ragged_3d")
    for m in ("bow1", "bow2", "weighted_bow1") for mode in ("eager", "function", "jit")
    if mode == "eager" or k in ("dense_3d", "ragged_2d")]


@pytest.mark.parametrize("ids_kind,model_name,mode", EMBEDDING_PARAMS)
def test_embedding(K, ids_kind, model_name, mode):
    ids = _ids(ids_kind)
    if model_name == "weighted_bow1" and isinstance(ids, tf.RaggedTensor):
        pytest.skip("tensorflow-privacy skips ragged ids in its weighted bag of words too")
    model = _bow_model(K, model_name, ids)
    if isinstance(ids, tf.RaggedTensor) and model_name == "bow2":
        try:
            model(ids)
        except (TypeError, ValueError):
            pytest.skip("this Keras's Dense takes no ragged input (the model "
                        "itself fails)")
        # A Dense on ragged rows under its ghost rule (no Lambda around it):
        # refused by design, naming the layer. (In their model the Lambda
        # sends every layer to the exact fallback, checked below.)
        L = K.layers
        inp = K.Input((None,), dtype="int32", ragged=True)
        dense = L.Dense(2, dtype=F64)
        tapped = K.Model(inp, dense(L.Embedding(3, 2, dtype=F64)(inp)))
        y = tf.zeros([int(ids.shape[0]), 2], F64)
        with pytest.raises(ValueError, match=rf"layer '{dense.name}' "
                                             "received a RaggedTensor input"):
            compile_fn(lambda t: per_example_gradient_norms(
                tapped, lambda y, p: tf.reduce_sum(p, [1, 2]), t, y), mode)(ids)
    if isinstance(ids, tf.RaggedTensor) and mode == "jit":  # the model alone
        try:
            tf.function(lambda t: model(t), jit_compile=True)(ids)
        except tf.errors.InvalidArgumentError:
            pytest.skip("this Keras's model on ragged ids does not compile under XLA "
                        "(the model itself, e.g. RaggedRange)")
    # Their bag of words sums the tokens in a Lambda: code of the model's own,
    # which may read any variable (a table tied through a closure), so every
    # layer takes the exact fallback (tests/test_per_example.py has the ghost
    # rule for Embedding with provable layers around it).
    plan = per_example_norm_plan(model, training=False)
    assert all(how.startswith("exact fallback: layer 'lambda")
               for how in plan.values()), plan
    y = tf.constant(np.random.default_rng(2).normal(size=(int(ids.shape[0]), 2)), F64)
    for partial in (False, True):
        if partial:  # norms over the Embedding's table only
            for layer in model.layers[2:]:
                layer.trainable = False
        _check(model, _test_loss_fn, ids, y, mode)


# ---------------------------------------------------- LayerNormalization
LAYER_NORM_CASES = [
    ([3], -1), ([3], [1]),
    ([3, 4], -1), ([3, 4], [1]), ([3, 4], [2]), ([3, 4], [1, 2]),
    ([3, 4, 5], -1), ([3, 4, 5], [1]), ([3, 4, 5], [2]), ([3, 4, 5], [3]),
    ([3, 4, 5], [1, 2]), ([3, 4, 5], [1, 3]), ([3, 4, 5], [2, 3]),
    ([3, 4, 5], [1, 2, 3]),
]


# Every case eagerly; under XLA the ranks' last and all-axes cases (the
# rule's code paths: one kept axis, several, every axis), to keep it cheap.
LAYER_NORM_PARAMS = [pytest.param(d, a, "eager", id=f"{d}-{a}-eager")
                     for d, a in LAYER_NORM_CASES] + [
    pytest.param(d, a, "jit", id=f"{d}-{a}-jit") for d, a in LAYER_NORM_CASES
    if a in (-1, [1, 2, 3]) or (len(d) == 2 and a == [1, 2])] + [
    pytest.param(d, a, "function", id=f"{d}-{a}-function", marks=pytest.mark.slow)
    for d, a in LAYER_NORM_CASES]


@pytest.mark.parametrize("dims,axis,mode", LAYER_NORM_PARAMS)
def test_layer_normalization(K, dims, axis, mode):
    L = K.layers
    inp = K.Input(tuple(dims), dtype=F64)
    norm = L.LayerNormalization(axis=axis, dtype=F64)
    model = K.Model(inp, L.Dense(1, dtype=F64)(L.Flatten()(norm(inp))))
    rng = np.random.default_rng(3)
    norm.gamma.assign(rng.uniform(0.5, 1.5, size=norm.gamma.shape))
    norm.beta.assign(rng.normal(size=norm.beta.shape))
    # Their input: a reshaped range (here scaled, with noise, so that no
    # example is constant along the normalised axes).
    size = int(np.prod(dims))
    x = tf.constant(np.arange(6 * size).reshape([6] + dims) / size
                    + rng.normal(size=[6] + dims), F64)
    _check(model, _mse, x, tf.constant(rng.normal(size=(6, 1)), F64), mode)


# ------------------------------------------------ layers refused by design
@pytest.mark.parametrize("layer_name", ["einsum_dense", "multi_head_attention"])
def test_layers_without_a_rule_are_refused_by_name(K, layer_name):
    """tensorflow-privacy has rules for EinsumDense and MultiHeadAttention;
    here they are refused, naming the layer (per_example_gradients covers
    them, memory B x parameters)."""
    L = K.layers
    inp = K.Input((3, 4), dtype=F64)
    if layer_name == "einsum_dense":
        out = L.EinsumDense("abc,cd->abd", (3, 2), name="under_test", dtype=F64)(inp)
    else:
        out = L.MultiHeadAttention(2, 2, name="under_test", dtype=F64)(inp, inp)
    model = K.Model(inp, out)
    x = tf.ones([2, 3, 4], F64)
    with pytest.raises(ValueError, match=r"\['under_test'\].*per_example_gradients"):
        per_example_gradient_norms(model, _mse, x, tf.zeros([2, 3, out.shape[-1]], F64))


@pytest.mark.parametrize("test_file", ["nlp_on_device_embedding_test.py",
                                       "nlp_position_embedding_test.py"])
def test_tf_models_layers(test_file):
    del test_file
    pytest.skip("tf-models-official layers (OnDeviceEmbedding, PositionEmbedding) are "
                "not installed here; their Keras bases are covered above")


# ------------------------------------------------------------ clip_grads
@pytest.mark.parametrize("mode", MODES)
def test_clipped_sum_by_reweighted_backward_pass(K, mode):
    """clip_grads_test's `compute_clipped_gradients_and_outputs`: with the
    norms, one backward pass of the loss re-weighted by min(1, C / norm_i)
    gives the sum of the per-example gradients clipped one by one."""
    model = _dense_model(K, "func2", "sigmoid_dense")
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(size=(5, 4)) * 3.0, F64)
    y = tf.constant(rng.normal(size=(5, 2)), F64)
    norms = _check(model, _test_loss_fn, x, y, mode)
    ordered = np.sort(norms)
    clip = 0.5 * float(ordered[1] + ordered[2])  # some examples clipped, some not
    factors = tf.constant(np.minimum(1.0, clip / norms), F64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(factors * _test_loss_fn(y, model(x)))
    got = tape.gradient(loss, model.trainable_variables)
    want = [np.zeros(v.shape) for v in model.trainable_variables]
    for i in range(5):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_test_loss_fn(y[i:i + 1], model(x[i:i + 1])))
        grads = tape.gradient(loss, model.trainable_variables)
        scale = min(1.0, clip / np.sqrt(sum(np.sum(np.square(g.numpy())) for g in grads)))
        want = [w + scale * g.numpy() for w, g in zip(want, grads)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=RTOL, atol=RTOL * np.abs(w).max())
    assert np.any(norms > clip) and np.any(norms < clip)  # the control: both kinds


def test_clip_grads_microbatches():
    pytest.skip("num_microbatches has no equivalent here: the norms are per example")


def test_gradient_clipping_utils():
    pytest.skip("gradient_clipping_utils_test checks tensorflow-privacy's internal "
                "registry generator and noise helpers, which have no equivalent here")
