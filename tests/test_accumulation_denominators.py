"""A window equals the big batch whatever the loss divides by.

The 2024 gradient-accumulation bug (Hugging Face's Trainer, Keras's own
``gradient_accumulation_steps``): a loss that averages over unmasked tokens
gives each micro-batch the mean over *its* tokens, and averaging those means
is not the mean over the window's tokens. Here every way a Keras loss can
divide (examples, unmasked tokens under ``mask_zero``/``Masking``/RNN masks
or ``ignore_class``, per-timestep sample weights, ``class_weight``,
``reduction="sum"``, Keras 3's ``"mean_with_sample_weight"``) is run through ``fit`` with a
`GradientAccumulator` over 4 micro-batches of 16 and compared with plain
Keras on batches of 64, in both flavours; custom loops pass ``sample_count=``
(the tokens), and MirroredStrategy is compared with one device. Sequences
are of very different lengths (1-2 tokens in the first half, 10-12 in the
second), so any other weighting is off by about the whole update.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR, compile_fn
from helpers import ROUNDOFF, max_abs_diff, weights_of

K3 = FLAVOUR == "keras3"
N, T, V, MICRO, STEPS = 64, 12, 20, 16, 4


def _sequences(seed=0):
    """64 sequences: 1-2 tokens in the first half, 10-12 in the second."""
    rng = np.random.RandomState(seed)
    lengths = np.concatenate([rng.randint(1, 3, N // 2), rng.randint(10, 13, N // 2)])
    x = np.zeros((N, T), "int32")
    y = np.zeros((N, T), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.randint(1, V, length)
        y[i, :length] = rng.randint(0, V, length)
    return x, y, lengths


def _fixed(model, seed=1):
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.3
                       for w in model.get_weights()])
    return model


def _tokens(K, layers=("dense",), **dense):
    """Embedding(mask_zero) -> [SimpleRNN] -> Dense(V): masks reach the loss."""
    inner = [K.layers.Embedding(V, 8, mask_zero=True)]
    if "rnn" in layers:
        inner.append(K.layers.SimpleRNN(8, return_sequences=True))
    inner.append(K.layers.Dense(V, **dense))
    return _fixed(K.Sequential([K.Input((T,), dtype="int32")] + inner))


def _case(K, name):
    """(make_model, compile kwargs, (x, y), fit kwargs) for a way to divide."""
    x, y, lengths = _sequences()
    sce = lambda **kw: K.losses.SparseCategoricalCrossentropy(from_logits=True, **kw)  # noqa: E731
    if name == "mask_zero":
        return lambda: _tokens(K), {"loss": sce()}, (x, y), {}
    if name == "rnn_mask":
        return lambda: _tokens(K, ("rnn", "dense")), {"loss": sce()}, (x, y), {}
    if name in ("masking_layer", "masking_rnn"):
        xf = np.where(x[..., None] > 0, np.eye(V, dtype="float32")[x], 0.0)

        def make():
            rnn = [K.layers.SimpleRNN(8, return_sequences=True)] if name == "masking_rnn" else []
            return _fixed(K.Sequential([K.Input((T, V)), K.layers.Masking(0.0)] + rnn +
                                       [K.layers.Dense(V)]))
        return make, {"loss": sce()}, (xf.astype("float32"), y), {}
    if name == "timestep_weights":  # no mask: divided by the elements (B*T)
        sw = (x > 0).astype("float32") * np.linspace(0.5, 2.0, T, dtype="float32")
        make = lambda: _fixed(K.Sequential([  # noqa: E731
            K.Input((T,), dtype="int32"), K.layers.Embedding(V, 8), K.layers.Dense(V)]))
        return make, {"loss": sce()}, (x, y), {"sample_weight": sw}
    if name == "sum":
        return lambda: _tokens(K), {"loss": sce(reduction="sum")}, (x, y), {}
    if name == "ignore_class":  # no Keras mask: the loss masks its own values
        make = lambda: _fixed(K.Sequential([  # noqa: E731
            K.Input((T,), dtype="int32"), K.layers.Embedding(V, 8), K.layers.Dense(V)]))
        return (make, {"loss": sce(ignore_class=-1)},
                (x, np.where(x > 0, y, -1).astype("int32")), {})
    if name == "mask_and_example_weights":  # tf_keras: per-example weights under a mask
        sw = np.where(np.arange(N) < N // 2, 0.2, 3.0).astype("float32")
        return lambda: _tokens(K), {"loss": sce()}, (x, y), {"sample_weight": sw}
    if name == "class_weight":
        xc = np.random.RandomState(3).randn(N, 5).astype("float32")
        yc = (lengths % 3).astype("int32")
        make = lambda: _fixed(K.Sequential([K.Input((5,)), K.layers.Dense(3)]))  # noqa: E731
        return make, {"loss": sce()}, (xc, yc), {"class_weight": {0: 0.5, 1: 2.0, 2: 4.0}}
    if name == "mean_with_sample_weight":  # Keras 3: divided by the summed weights
        # Per timestep: Keras 3 cannot merge per-example weights with a mask.
        sw = np.where(np.arange(N)[:, None] < N // 2, 0.2, 3.0) * np.linspace(
            0.5, 1.5, T)[None, :]
        sw = sw.astype("float32")
        return (lambda: _tokens(K), {"loss": sce(reduction="mean_with_sample_weight")},
                (x, y), {"sample_weight": sw})
    if name == "mean_with_sample_weight_no_mask":
        xc = np.random.RandomState(4).randn(N, 5).astype("float32")
        yc = (lengths % 3).astype("int32")
        sw = np.where(np.arange(N) < N // 2, 0.1, 5.0).astype("float32")
        make = lambda: _fixed(K.Sequential([K.Input((5,)), K.layers.Dense(3)]))  # noqa: E731
        return (make, {"loss": sce(reduction="mean_with_sample_weight")}, (xc, yc),
                {"sample_weight": sw})
    raise KeyError(name)


# Keras 3 cannot merge per-example weights with a mask (its own error).
CASES = ["mask_zero", "rnn_mask", "masking_layer", "masking_rnn", "timestep_weights", "sum",
         "class_weight", "ignore_class"] + (
             ["mean_with_sample_weight", "mean_with_sample_weight_no_mask"] if K3
             else ["mask_and_example_weights"])
FIT_MODES = {"eager": {"run_eagerly": True}, "function": {}, "jit": {"jit_compile": True}}
# A summed loss is ~400 tokens large: a step of the same size as the others'.
LEARNING_RATE = {"sum": 0.002}


def _big_batch(K, make, compile_kwargs, data, fit_kwargs, lr=0.5, epochs=2, opt=None):
    model = make()
    model.compile(optimizer=opt or K.optimizers.SGD(lr), **compile_kwargs)
    model.fit(*data, batch_size=N, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return model


def _accumulated(K, gk, make, compile_kwargs, data, fit_kwargs, lr=0.5, epochs=2,
                 inner=None, **options):
    model = make()
    opt = gk.GradientAccumulator(inner or K.optimizers.SGD(lr), steps=STEPS, model=model,
                                 **options)
    model.compile(optimizer=opt, **compile_kwargs)
    model.fit(*data, batch_size=MICRO, epochs=epochs, shuffle=False, verbose=0,
              **fit_kwargs)
    return model, opt


@pytest.mark.parametrize("case", CASES)
def test_fit_window_equals_the_big_batch_whatever_the_loss_divides_by(K, gk, case):
    make, compile_kwargs, data, fit_kwargs = _case(K, case)
    lr = LEARNING_RATE.get(case, 0.5)
    big = _big_batch(K, make, compile_kwargs, data, fit_kwargs, lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the count is known: no warning
        ours, opt = _accumulated(K, gk, make, compile_kwargs, data, fit_kwargs, lr=lr)
    update = max_abs_diff(weights_of(make()), weights_of(big))
    assert update > 1e-2  # the big batch moved the weights
    assert max_abs_diff(weights_of(big), weights_of(ours)) < ROUNDOFF
    assert int(opt.iterations.numpy()) == 2 and int(opt.micro_steps.numpy()) == 8


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m == "function"
                                  else m for m in sorted(FIT_MODES)])
def test_token_average_under_every_fit_mode_and_adam(K, gk, mode):
    # Masking + RNN, not an Embedding: Keras's Adam on the big batch's
    # IndexedSlices squares each repeated row's slices apart (not Adam's
    # math on the summed gradient, which the window hands over), a
    # difference that is Keras's, not the window's (docs).
    make, compile_kwargs, data, fit_kwargs = _case(K, "masking_rnn")
    compile_kwargs = dict(compile_kwargs, **FIT_MODES[mode])
    big = _big_batch(K, make, compile_kwargs, data, fit_kwargs, opt=K.optimizers.Adam(0.05))
    ours, _ = _accumulated(K, gk, make, compile_kwargs, data, fit_kwargs,
                           inner=K.optimizers.Adam(0.05))
    assert max_abs_diff(weights_of(big), weights_of(ours)) < ROUNDOFF


def test_the_old_weightings_are_off_by_about_the_whole_update(K, gk):
    # Why this matters: weighting micro-batches by examples or equally, as
    # Keras's own accumulation does, misses the big batch by ~100% of it.
    make, compile_kwargs, data, fit_kwargs = _case(K, "mask_zero")
    big = _big_batch(K, make, compile_kwargs, data, fit_kwargs, epochs=1)
    update = max_abs_diff(weights_of(make()), weights_of(big))
    by_examples, _ = _accumulated(K, gk, make, compile_kwargs, data, fit_kwargs, epochs=1,
                                  sample_count=lambda x, y, sw: tf.shape(x)[0])
    equal, _ = _accumulated(K, gk, make, compile_kwargs, data, fit_kwargs, epochs=1,
                            reduction="microbatch")
    for model in (by_examples, equal):
        assert max_abs_diff(weights_of(big), weights_of(model)) > 0.5 * update


def _scalar_token_mean(y_true, logits):
    """A loss that averages over the tokens itself, returning one value per
    batch (padding labelled -1): Keras cannot see what it divides by."""
    y_true = tf.cast(tf.reshape(y_true, tf.shape(logits)[:-1]), tf.int32)
    mask = tf.cast(y_true >= 0, logits.dtype)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.maximum(y_true, 0), logits)
    return tf.reduce_sum(losses * mask) / tf.reduce_sum(mask)


def _count_tokens(x, y, sample_weight):
    del x, sample_weight
    return tf.reduce_sum(tf.cast(y >= 0, tf.float32))


def _unmasked_tokens(K):
    return _fixed(K.Sequential([K.Input((T,), dtype="int32"), K.layers.Embedding(V, 8),
                                K.layers.Dense(V)]))


def _padded_labels():
    x, y, _ = _sequences()
    return x, np.where(x > 0, y, -1).astype("int32")


def test_a_loss_that_hides_its_count_warns_once_and_weighs_by_examples(K, gk):
    make = lambda: _unmasked_tokens(K)  # noqa: E731
    data = _padded_labels()
    with pytest.warns(UserWarning, match=r"cannot read what the model's loss divides by "
                      r"\(the loss of output .* returns one value.*sample_count=fn") as seen:
        ours, _ = _accumulated(K, gk, make, {"loss": _scalar_token_mean}, data, {})
    assert sum("divides by" in str(w.message) for w in seen) == 1
    by_examples, _ = _accumulated(K, gk, make, {"loss": _scalar_token_mean}, data, {},
                                  sample_count=lambda x, y, sw: tf.shape(x)[0])
    assert max_abs_diff(weights_of(by_examples), weights_of(ours)) < ROUNDOFF


def test_sample_count_function_makes_a_hidden_count_exact(K, gk):
    make = lambda: _unmasked_tokens(K)  # noqa: E731
    data = _padded_labels()
    big = _big_batch(K, make, {"loss": _scalar_token_mean}, data, {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours, _ = _accumulated(K, gk, make, {"loss": _scalar_token_mean}, data, {},
                               sample_count=_count_tokens)
    assert max_abs_diff(weights_of(big), weights_of(ours)) < ROUNDOFF
    assert max_abs_diff(weights_of(make()), weights_of(big)) > 1e-2


def test_a_compute_loss_override_warns(K, gk):
    class Own(K.Model):
        def compute_loss(self, *args, **kwargs):  # pylint: disable=arguments-differ
            return super().compute_loss(*args, **kwargs)

    def make():
        inputs = K.Input((T,), dtype="int32")
        outputs = K.layers.Dense(V)(K.layers.Embedding(V, 8, mask_zero=True)(inputs))
        return _fixed(Own(inputs, outputs))

    x, y, _ = _sequences()
    with pytest.warns(UserWarning, match=r"Own overrides compute_loss"):
        _accumulated(K, gk, make, {"loss": K.losses.SparseCategoricalCrossentropy(
            from_logits=True)}, (x, y), {}, epochs=1)


def test_a_train_step_that_does_not_call_compute_loss_warns(K, gk):
    class Own(K.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    def make():
        inputs = K.Input((3,))
        return _fixed(Own(inputs, K.layers.Dense(1)(inputs)))

    x = np.random.RandomState(0).randn(N, 3).astype("float32")
    y = x[:, :1] * 2.0
    with pytest.warns(UserWarning, match=r"train_step does not call compute_loss"):
        _accumulated(K, gk, make, {"loss": "mse"}, (x, y), {}, epochs=1)


# ------------------------------------------------------------- refusals
def _two_outputs(K, second_masked):
    inputs = K.Input((T,), dtype="int32")
    hidden = K.layers.Embedding(V, 8, mask_zero=True)(inputs)
    tokens = K.layers.Dense(V, name="tokens")(hidden)
    other = K.layers.Dense(V, name="other")(hidden if second_masked else
                                             K.layers.GlobalAveragePooling1D()(hidden))
    return _fixed(K.Model(inputs, [tokens, other]))


def test_outputs_sharing_a_mask_are_exact(K, gk):
    x, y, _ = _sequences()
    make = lambda: _two_outputs(K, second_masked=True)  # noqa: E731
    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)
    compile_kwargs = {"loss": [loss, loss], "loss_weights": [1.0, 0.5]}
    big = _big_batch(K, make, compile_kwargs, (x, [y, y]), {})
    ours, _ = _accumulated(K, gk, make, compile_kwargs, (x, [y, y]), {})
    assert max_abs_diff(weights_of(big), weights_of(ours)) < ROUNDOFF


def _refused(K, gk, make, compile_kwargs, data, match):
    model = make()
    before = weights_of(model)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.5), steps=STEPS, model=model)
    model.compile(optimizer=opt, **compile_kwargs)
    with pytest.raises(ValueError, match=match):
        model.fit(*data, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(before, weights_of(model)) == 0
    assert int(opt.iterations.numpy()) == 0


def test_outputs_dividing_by_different_counts_are_refused(K, gk):
    x, y, _ = _sequences()
    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)
    _refused(K, gk, lambda: _two_outputs(K, second_masked=False), {"loss": [loss, loss]},
             (x, [y, y[:, 0]]), r"divide by different counts \(its unmasked tokens; "
             r"its examples")


def test_a_summed_loss_beside_regularizers_is_refused(K, gk):
    x, y, _ = _sequences()
    make = lambda: _tokens(K, kernel_regularizer=K.regularizers.l2(0.01))  # noqa: E731
    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    _refused(K, gk, make, {"loss": loss}, (x, y), r"loss is a sum.*counts once")


def test_a_token_average_beside_activity_regularizers_is_refused(K, gk):
    x, y, _ = _sequences()
    make = lambda: _tokens(K, activity_regularizer=K.regularizers.l2(0.01))  # noqa: E731
    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)
    _refused(K, gk, make, {"loss": loss}, (x, y), r"unmasked tokens.*depend on the batch")


def test_weight_regularizers_beside_a_token_average_are_exact(K, gk):
    make, compile_kwargs, data, fit_kwargs = _case(K, "mask_zero")
    make_reg = lambda: _tokens(K, kernel_regularizer=K.regularizers.l2(0.05))  # noqa: E731
    big = _big_batch(K, make_reg, compile_kwargs, data, fit_kwargs)
    ours, _ = _accumulated(K, gk, make_reg, compile_kwargs, data, fit_kwargs)
    assert max_abs_diff(weights_of(big), weights_of(ours)) < ROUNDOFF


# ------------------------------------------------------------ custom loops
# Plain tf.function (no XLA) under `make test-slow` only, here and below: the
# default run keeps eager and XLA, and the window under `compile()`'s default
# (a plain tf.function on a CPU) in every case of
# `test_fit_window_equals_the_big_batch_whatever_the_loss_divides_by`.
@pytest.mark.parametrize("mode", ["eager", pytest.param("function", marks=pytest.mark.slow),
                                  "jit"])
def test_custom_loop_with_token_counts_equals_the_big_batch(K, gk, mode):
    x, y, _ = _sequences()
    loss_fn = K.losses.SparseCategoricalCrossentropy(from_logits=True)

    def grads_of(model, xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))  # masked: over tokens
        return tape.gradient(loss, model.trainable_variables)

    big = _tokens(K)
    big_opt = K.optimizers.SGD(0.5)
    for _ in range(2):
        big_opt.apply_gradients(zip(grads_of(big, x, y), big.trainable_variables))

    model = _tokens(K)
    opt = gk.GradientAccumulator(K.optimizers.SGD(0.5), steps=STEPS)

    def step(xb, yb):
        tokens = tf.math.count_nonzero(xb, dtype=tf.float32)  # what the loss divides by
        opt.apply_gradients(zip(grads_of(model, xb, yb), model.trainable_variables),
                            sample_count=tokens)

    step = compile_fn(step, mode)
    for _ in range(2):
        for i in range(0, N, MICRO):
            step(x[i:i + MICRO], y[i:i + MICRO])
    assert max_abs_diff(weights_of(big), weights_of(model)) < ROUNDOFF


# ---------------------------------------------------------- distribution
@pytest.mark.distributed
def test_mirrored_strategy_fit_with_masks_equals_one_device(K, gk, mirrored):
    # Each replica weighs its half of a micro-batch by its own tokens; the
    # window's count is summed over replicas at the close: the big batch of
    # one device (Keras's own data parallelism averages the replicas' means).
    make, compile_kwargs, data, fit_kwargs = _case(K, "mask_zero")
    big = _big_batch(K, make, compile_kwargs, data, fit_kwargs)
    with mirrored.scope():
        ours, opt = _accumulated(K, gk, make, compile_kwargs, data, fit_kwargs)
    assert max_abs_diff(weights_of(big), weights_of(ours)) < ROUNDOFF
    assert int(opt.iterations.numpy()) == 2


def test_mixed_precision_token_average_equals_the_big_batch(K, gk):
    # compile wraps the accumulator in a LossScaleOptimizer: the count is
    # still read from the loss of each micro-batch.
    make, compile_kwargs, data, fit_kwargs = _case(K, "mask_zero")
    policy = K.mixed_precision.global_policy()
    K.mixed_precision.set_global_policy("mixed_float16")
    try:
        big = _big_batch(K, make, compile_kwargs, data, fit_kwargs, epochs=1)
        ours, opt = _accumulated(K, gk, make, compile_kwargs, data, fit_kwargs, epochs=1)
        equal, _ = _accumulated(K, gk, make, compile_kwargs, data, fit_kwargs, epochs=1,
                                reduction="microbatch")
    finally:
        K.mixed_precision.set_global_policy(policy)
    assert isinstance(ours.optimizer, K.mixed_precision.LossScaleOptimizer)
    # float16 activations round at 2^-11 in both runs; the wrong weighting
    # is ~100% of an update of 0.0175.
    assert max_abs_diff(weights_of(big), weights_of(ours)) < 1e-3
    assert max_abs_diff(weights_of(big), weights_of(equal)) > 1e-2


@pytest.mark.distributed
def test_mirrored_strategy_multioptimizer_with_an_accumulated_group(K, gk, mirrored):
    # Keras 3.15's MultiOptimizer under MirroredStrategy: the embedding
    # accumulates, weighted by each replica's tokens, and equals one device.
    # (The head is held still: Keras's own data parallelism averages the
    # replicas' token means, which is not one device's token mean.)
    if not K3:
        pytest.skip("MultiOptimizer is Keras 3's")
    make, compile_kwargs, data, fit_kwargs = _case(K, "mask_zero")
    x, y = data

    def run(strategy_scope):
        with strategy_scope:
            model = make()
            embedding = {id(model.trainable_variables[0])}
            acc = gk.GradientAccumulator(K.optimizers.SGD(0.5), steps=STEPS, model=model)
            head = K.optimizers.SGD(0.0)
            model.compile(optimizer=K.optimizers.MultiOptimizer(
                lambda v: acc if id(v) in embedding else head), **compile_kwargs)
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
        return model, acc

    one, _ = run(tf.distribute.get_strategy().scope())
    two, acc = run(mirrored.scope())
    assert int(acc.iterations.numpy()) == 1
    assert max_abs_diff(weights_of(make()), weights_of(one)) > 1e-3  # it trained
    assert max_abs_diff(weights_of(one), weights_of(two)) < ROUNDOFF
