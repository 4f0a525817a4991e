"""MaskAware with explicit masks, in both flavours (``gk.MaskAware``): pruned
weights and their optimizer slots are exactly zero after every step, through
``model.fit`` and a custom loop, eager, ``tf.function`` and
``jit_compile=True``, and a step equals masking by hand (g*M, the inner step,
w*M, s*M). tfmot's masks (tf_keras only) are tests/test_pruning.py's.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from conftest import compile_fn
from helpers import alternate_mask, mlp, regression_data

INNER = {
    "momentum": lambda K: K.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda K: K.optimizers.Adam(0.02),
}


def _slots(optimizer, variable):
    """The per-entry state of ``variable``: the optimizer's variables of its
    shape (the models here have one variable of each masked shape)."""
    return [s for s in optimizer.variables if tuple(s.shape) == tuple(variable.shape)]


def _nonzero_where_pruned(pairs, optimizer, slots_per_weight):
    """Non-zero entries where a mask is 0, in the weights and their slots."""
    count = 0
    for variable, mask in pairs:
        off = np.asarray(mask) == 0
        slots = _slots(optimizer, variable)
        assert len(slots) == slots_per_weight, [getattr(s, "name", s) for s in slots]
        for v in [variable] + slots:
            count += int(np.count_nonzero(np.asarray(v)[off]))
    return count


# Adam (two slots) in every mode, SGD with momentum (one) eagerly: the
# masked update is the same code around either.
@pytest.mark.parametrize("inner, mode", [("adam", "eager"), ("adam", "function"),
                                         ("adam", "jit"), ("momentum", "eager")])
def test_fit_keeps_pruned_weights_and_slots_zero_every_step(K, gk, inner, mode):
    x, y = regression_data(n=32)
    model = mlp(K, hidden=8)
    pairs = alternate_mask(model)
    opt = gk.MaskAware(INNER[inner](K), masks=pairs)
    slots = {"momentum": 1, "adam": 2}[inner]
    seen = []

    class CheckEveryStep(K.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(_nonzero_where_pruned(pairs, opt.inner_optimizer, slots))

    model.compile(optimizer=opt, loss="mse", run_eagerly=(mode == "eager"),
                  jit_compile=(mode == "jit"))
    before = model.get_weights()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[CheckEveryStep()])
    assert seen == [0, 0, 0, 0]
    assert int(opt.iterations.numpy()) == 4
    # The unpruned entries did move.
    kernel, mask = pairs[0]
    moved = np.asarray(kernel)[mask == 1] - before[0][mask == 1]
    assert np.count_nonzero(moved) == int(mask.sum())


@pytest.mark.parametrize("mode", ["eager", "jit"])  # tf.function: the fit test's
def test_custom_loop_equals_masking_by_hand(K, gk, mode):
    x, y = (tf.constant(a) for a in regression_data(n=32))
    ours_model, ref_model = mlp(K, hidden=8), mlp(K, hidden=8)
    kernel = ours_model.trainable_variables[0]
    bool_mask = alternate_mask(ours_model)[0][1] > 0.5
    # A bool mask for the first kernel, a tf.Variable mask for the second.
    second = ours_model.trainable_variables[2]
    second_mask = tf.Variable(np.tile([[1.0], [0.0]], (4, 1)).astype("float32"))
    ours = gk.MaskAware(K.optimizers.Adam(0.02),
                        masks=[(kernel, bool_mask), (second, second_mask)])
    ref = K.optimizers.Adam(0.02)
    ref_masks = {0: bool_mask.astype("float32"), 2: second_mask.numpy()}

    def grads_of(model, xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        return tape.gradient(loss, model.trainable_variables)

    def ours_step(xb, yb):
        grads = grads_of(ours_model, xb, yb)
        ours.apply_gradients(zip(grads, ours_model.trainable_variables))

    def ref_step(xb, yb):
        variables = ref_model.trainable_variables
        grads = [g * ref_masks[i] if i in ref_masks else g
                 for i, g in enumerate(grads_of(ref_model, xb, yb))]
        ref.apply_gradients(zip(grads, variables))
        for i, m in ref_masks.items():
            for v in [variables[i]] + _slots(ref, variables[i]):
                v.assign(v * m)

    ours_step, ref_step = compile_fn(ours_step, mode), compile_fn(ref_step, mode)
    pairs = [(kernel, ref_masks[0]), (second, ref_masks[2])]
    for i in range(0, 32, 8):
        ours_step(x[i:i + 8], y[i:i + 8])
        ref_step(x[i:i + 8], y[i:i + 8])
        assert _nonzero_where_pruned(pairs, ours.inner_optimizer, 2) == 0, i
    # The same float32 operations in the same order, compiled separately.
    for a, b in zip(ours_model.trainable_variables, ref_model.trainable_variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    for a, b in zip(ours.variables, ref.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_variable_mask_change_takes_effect_and_clears_state(K, gk):
    x, y = regression_data(n=16)
    model = mlp(K, hidden=4)
    kernel = model.trainable_variables[0]
    mask = tf.Variable(tf.ones(tuple(kernel.shape)))
    opt = gk.MaskAware(K.optimizers.Adam(0.1), masks=[(kernel, mask)])
    for i in range(3):
        if i == 2:
            mask.assign([[0.0] * 4, [1.0] * 4, [1.0] * 4])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    slots = _slots(opt.inner_optimizer, kernel)
    assert len(slots) == 2
    for v in [kernel] + slots:
        assert np.all(np.asarray(v)[0] == 0)
        assert np.all(np.asarray(v)[1:] != 0)


def test_a_model_without_pruning_layers_and_no_masks_is_refused(K, gk):
    # Keras 3 has no tfmot: its models never give masks; say what to use.
    model = mlp(K)
    with pytest.raises(ValueError, match=r"no pruning wrappers.*masks=.*MagnitudePruning"):
        gk.MaskAware(K.optimizers.Adam(), model=model)
    # With masks, the model adds nothing, and attaching it changes nothing.
    opt = gk.MaskAware(K.optimizers.Adam(), model=model, masks=alternate_mask(model))
    model.compile(optimizer=opt, loss="mse")
    assert tf_gradkit.attach(model) is model
    with pytest.raises(ValueError, match="has its masks already"):
        opt.attach(masks=alternate_mask(model))


def test_masks_must_be_variables_of_the_shape_with_zeros_and_ones(K, gk):
    model = mlp(K)
    kernel = model.trainable_variables[0]
    with pytest.raises(TypeError, match="keys must be model variables"):
        gk.MaskAware(K.optimizers.Adam(), masks=[(np.ones((3, 4)), np.ones((3, 4)))])
    with pytest.raises(ValueError, match=r"mask shape \(4, 3\), variable shape \(3, 4\)"):
        gk.MaskAware(K.optimizers.Adam(), masks=[(kernel, np.ones((4, 3)))])
    with pytest.raises(ValueError, match="only 0 and 1"):
        gk.MaskAware(K.optimizers.Adam(), masks=[(kernel, np.full((3, 4), 0.5))])
    with pytest.raises(TypeError, match="non-empty list of"):
        gk.MaskAware(K.optimizers.Adam(), masks=[])


@pytest.mark.distributed
def test_under_mirrored_strategy_equals_single_device(K, gk, mirrored):
    x, y = regression_data(n=64)

    def build():
        model = mlp(K, hidden=8)
        model.compile(optimizer=gk.MaskAware(K.optimizers.Adam(0.02),
                                             masks=alternate_mask(model)), loss="mse")
        return model

    ref = build()
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with mirrored.scope():
        model = build()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert _nonzero_where_pruned(alternate_mask(model), model.optimizer.inner_optimizer, 2) == 0
    # Two replicas sum half-batch gradients: float32 summation order only.
    for a, b in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_masks_of_another_models_variables_are_not_silent(K, gk):
    """Masks built on one model's variables and given for training another
    (a clone has new variables) mask nothing: a warning says so at build,
    naming the masked variables; masks on the trained model's own variables
    build without it."""
    import warnings  # noqa: PLC0415
    x, y = regression_data()
    other, model = mlp(K), mlp(K)
    opt = gk.MaskAware(K.optimizers.Adam(), masks=alternate_mask(other))
    model.compile(optimizer=opt, loss="mse")
    with pytest.warns(UserWarning, match=r"none of the \d+ explicit masks is for a "
                      r"variable this optimizer updates.*own variables"):
        model.fit(x, y, epochs=1, verbose=0)
    own = mlp(K)
    own.compile(optimizer=gk.MaskAware(K.optimizers.Adam(), masks=alternate_mask(own)),
                loss="mse")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*explicit masks.*")
        own.fit(x, y, epochs=1, verbose=0)
