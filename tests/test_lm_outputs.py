"""LevenbergMarquardt on models with several outputs (issue 38, items 1-4).

Each output's compiled loss is read where Keras keeps it: its weight by the
output's name, its own Huber ``delta`` and ``from_logits``, cross-entropies
on every output, and squared/robust/cross-entropy outputs mixed. Oracles:

- a hand-built residual vector (``residuals=``, the same LM otherwise) must
  give the same weights step for step (float64: the two differ only in the
  order of sums); control: the weights in the dict's order;
- the same parameters as one concatenated output where that is the same
  problem (two sigmoid heads vs one ``Dense(2)`` sigmoid output);
- the first step's linearisation (cost and ``J^T r``) must be Keras's own
  compiled loss and its ``GradientTape`` gradient times one constant, with a
  control that reads a loss wrongly (Huber's first delta, the first
  ``from_logits``, MSE for all);
- where a head is a convex problem of its own (no shared trunk), the point LM
  converges to must be stationary for Keras's compiled loss.

Refusals (an unknown loss, ``label_smoothing``, a cross-entropy with a solver
that cannot take the GGN) name the output, before fit traces a step.
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import mode_with_function_slow

mode = mode_with_function_slow()
F64 = "float64"


def two_outputs(K, widths=(1, 2), activations=(None, None), names=("o1", "o2"),
                as_dict=False, seed=0, trunk=True):
    inputs = K.Input((3,), dtype=F64)
    init = K.initializers.RandomNormal(stddev=0.5, seed=seed)
    # A shared trunk: the outputs' losses compete for its parameters. Without
    # it each head is a convex problem of its own (a stationary point to reach).
    trunk = K.layers.Dense(3, activation="tanh", dtype=F64, kernel_initializer=init)(
        inputs) if trunk else inputs
    outs = [K.layers.Dense(w, activation=a, name=n, dtype=F64,
                           kernel_initializer=init)(trunk)
            for w, a, n in zip(widths, activations, names)]
    return K.Model(inputs, dict(zip(names, outs)) if as_dict else outs)


def data(n=16, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 3)
    return x, rng.randn(n, 1) + x[:, :1] ** 2, rng.randn(n, 2) + x[:, 1:]


def compile_lm(K, gk, model, mode, loss, **kwargs):
    options = {k: kwargs.pop(k) for k in ("loss_weights",) if k in kwargs}
    model.compile(optimizer=gk.LevenbergMarquardt(model, **kwargs), loss=loss,
                  run_eagerly=(mode == "eager"), jit_compile=(mode == "jit"),
                  **options)
    return model


def fit(model, x, y, epochs, sample_weight=None):
    return model.fit(x, y, sample_weight=sample_weight, batch_size=len(x),
                     epochs=epochs, shuffle=False, verbose=0).history["loss"]


def weights_of(model):
    return [v.numpy() for v in model.trainable_variables]


def keras_gradient(model, x, y, sample_weight=None):
    """Keras's own compiled loss and its gradient (no LM code involved)."""
    with tf.GradientTape() as tape:
        pred = model(x, training=True)
        loss = model.compute_loss(x, tf.nest.map_structure(tf.convert_to_tensor, y),
                                  pred, None if sample_weight is None
                                  else tf.convert_to_tensor(sample_weight))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), np.concatenate([g.numpy().ravel() for g in grads])


def hand_squared(weights):
    """A residual vector by hand: ``sqrt(lw_k / d_k) (y_pred_k - y_k)``."""
    def residuals(model, x, y, sample_weight):
        del sample_weight
        preds = model(x, training=True)
        preds = [preds[k] for k in sorted(preds)] if isinstance(preds, dict) else preds
        ys = [y[k] for k in sorted(y)] if isinstance(y, dict) else y
        return tf.concat([tf.reshape(np.sqrt(w / p.shape[-1]) * (p - tf.cast(t, p.dtype)), [-1])
                          for w, p, t in zip(weights, preds, ys)], 0)
    return residuals


# -- 1. loss_weights by output name -----------------------------------------

# Outputs as a list eagerly, as a dict under XLA by default; the other two
# pairs (the same oracle) under `make test-slow`.
@pytest.mark.parametrize("mode,as_dict", [
    ("eager", False), ("jit", True),
    pytest.param("eager", True, marks=pytest.mark.slow),
    pytest.param("jit", False, marks=pytest.mark.slow),
    pytest.param("function", False, marks=pytest.mark.slow),
    pytest.param("function", True, marks=pytest.mark.slow)], ids=[
    "eager-list", "jit-dict", "eager-dict", "jit-list", "function-list",
    "function-dict"])
def test_loss_weights_dict_is_applied_by_output_name(K, gk, mode, as_dict):
    x, y1, y2 = data()
    y = {"o1": y1, "o2": y2} if as_dict else [y1, y2]
    # Dict order (o2 first) differs from the outputs' order (o1, o2).
    lw = {"o2": 3.0, "o1": 0.2}
    model = compile_lm(K, gk, two_outputs(K, as_dict=as_dict), mode,
                       ["mse", "mean_squared_error"] if not as_dict else
                       {"o1": "mse", "o2": K.losses.MeanSquaredError()},
                       loss_weights=lw)
    start = weights_of(model)
    # Keras itself weighs o1 by 0.2: LM's cost is 0.5 * batch * that loss.
    keras_loss, _ = keras_gradient(model, x, y)
    by_hand = float(0.5 * tf.reduce_sum(hand_squared([0.2, 3.0])(model, x, y, None) ** 2))
    # Keras sums its loss in float32 (floatx): 1e-6 relative.
    np.testing.assert_allclose(0.5 * len(x) * keras_loss, by_hand, rtol=1e-6)
    fit(model, x, y, 2)

    def oracle(weights):
        twin = two_outputs(K, as_dict=as_dict)
        for v, w in zip(twin.trainable_variables, start):
            v.assign(w)
        # The oracle runs eagerly whatever the mode: it is the reference.
        compile_lm(K, gk, twin, "eager", "mse", residuals=hand_squared(weights))
        fit(twin, x, y, 2)
        return weights_of(twin)

    # Same sums in another order: float64 round-off only. (0.2 is not exact
    # in float32: a weight rounded to float32 moves these weights by ~2e-7
    # relative, so this also checks that LM keeps loss weights in the
    # model's dtype. Keras's own compiled loss is float32 throughout, its
    # rounding larger than the weight's; LM minimises the same sum exactly.)
    for got, want in zip(weights_of(model), oracle([0.2, 3.0])):
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    # Control: the weights in the dict's order (o1 weighed 3.0) step elsewhere.
    wrong = oracle([3.0, 0.2])
    assert not all(np.allclose(g, w, rtol=1e-3) for g, w in zip(weights_of(model), wrong))


# -- 2. each output's own loss parameters -----------------------------------

def _stationary(K, gk, mode, loss, activations=(None, None), targets=None, epochs=12):
    x, y1, y2 = data(n=24)
    y = targets(y1, y2) if targets else [y1, y2]
    model = compile_lm(K, gk, two_outputs(K, activations=activations, trunk=False),
                       mode, loss)
    history = fit(model, x, y, epochs)
    return model, history, x, y


# Eagerly (slow): test_the_step_linearises_the_compiled_loss[from-logits]
# reads the same per-output from_logits from an eager step.
@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow),
                                  pytest.param("function", marks=pytest.mark.slow), "jit"])
def test_from_logits_is_read_per_output(K, gk, mode):
    # o1 outputs probabilities (sigmoid), o2 logits: each loss says which.
    loss = [K.losses.BinaryCrossentropy(), K.losses.BinaryCrossentropy(from_logits=True)]
    targets = lambda y1, y2: [(y1 > 1).astype(F64), (y2 > 0).astype(F64)]  # noqa: E731
    model, history, x, y = _stationary(K, gk, mode, loss, ("sigmoid", None), targets)
    assert history[-1] < history[0]
    _, grad = keras_gradient(model, x, y)
    # Gauss-Newton on a logistic loss converges fast on non-separable labels.
    assert np.max(np.abs(grad)) < 1e-5, grad


# -- 3. cross-entropies on several outputs ------------------------------------

# Eagerly (slow): the jit case's reference and control fit eagerly.
@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow),
                                  pytest.param("function", marks=pytest.mark.slow), "jit"])
@pytest.mark.filterwarnings("ignore:.*from_logits=True:UserWarning")
def test_two_sigmoid_heads_step_as_one_dense2_output(K, gk, mode):
    x, y1, y2 = data()
    labels = np.concatenate([y1 > 1, y2[:, :1] > 0], 1).astype(F64)
    inputs = K.Input((3,), dtype=F64)
    joined = K.Model(inputs, K.layers.Dense(2, activation="sigmoid", dtype=F64)(inputs))
    # The reference eagerly (one XLA compilation fewer; float64 either way).
    compile_lm(K, gk, joined, "eager", "binary_crossentropy")
    split = two_outputs(K, widths=(1, 1), activations=("sigmoid", "sigmoid"), trunk=False)
    kernel, bias = (v.numpy() for v in joined.trainable_variables)
    for v, w in zip(split.trainable_variables,
                    [kernel[:, :1], bias[:1], kernel[:, 1:], bias[1:]]):
        v.assign(w)
    # One Dense(2) output's mean over 2 columns is the two heads' mean,
    # halved: weights 0.5 make them the same problem.
    compile_lm(K, gk, split, mode, ["binary_crossentropy"] * 2, loss_weights=[0.5, 0.5])
    start = [v.numpy() for v in split.trainable_variables]
    h_joined = fit(joined, x, labels, 1)
    after_one = [v.numpy() for v in joined.trainable_variables]
    h_joined += fit(joined, x, labels, 2)
    h_split = fit(split, x, [labels[:, :1], labels[:, 1:]], 3)
    # Keras reports its loss in float32: 1e-6 relative.
    np.testing.assert_allclose(h_split, h_joined, rtol=1e-6)
    assert h_split[-1] < h_split[0]  # steps were taken (issue: never)
    kernel, bias = (v.numpy() for v in joined.trainable_variables)
    got = split.trainable_variables
    np.testing.assert_allclose(np.concatenate([got[0].numpy(), got[2].numpy()], 1),
                               kernel, rtol=1e-8, atol=1e-10)
    # Control: the heads' probabilities read as logits (another loss) step
    # elsewhere. (Weights alone would not do: with heads of their own, a
    # weight scales a block of J^T H J and its Marquardt scaling alike.)
    control = two_outputs(K, widths=(1, 1), activations=("sigmoid", "sigmoid"), trunk=False)
    for v, w in zip(control.trainable_variables, start):
        v.assign(w)
    compile_lm(K, gk, control, "eager", [K.losses.BinaryCrossentropy(from_logits=True)] * 2,
               loss_weights=[0.5, 0.5])
    fit(control, x, [labels[:, :1], labels[:, 1:]], 1)
    got = control.trainable_variables
    assert not np.allclose(np.concatenate([got[0].numpy(), got[2].numpy()], 1),
                           after_one[0], rtol=1e-6)


# -- 4. mixed losses ------------------------------------------------------------

# Huber eagerly and the cross-entropy under XLA by default; the other pairs
# (the same stationary-point oracle) under `make test-slow`.
@pytest.mark.parametrize("mode,case", [
    ("eager", "mse+huber"), ("jit", "mse+bce"),
    pytest.param("jit", "mse+huber", marks=pytest.mark.slow),
    pytest.param("eager", "mse+bce", marks=pytest.mark.slow),
    pytest.param("function", "mse+huber", marks=pytest.mark.slow),
    pytest.param("function", "mse+bce", marks=pytest.mark.slow)])
def test_mixed_outputs_reach_the_compiled_losss_stationary_point(K, gk, mode, case):
    if case == "mse+huber":
        loss, acts, targets = ["mse", K.losses.Huber(0.3)], (None, None), None
    else:
        loss = ["mean_squared_error", K.losses.BinaryCrossentropy(from_logits=True)]
        acts, targets = (None, None), lambda y1, y2: [y1, (y2 > 0).astype(F64)]
    model, history, x, y = _stationary(K, gk, mode, loss, acts, targets)
    assert history[-1] < history[0]
    _, grad = keras_gradient(model, x, y)
    assert np.max(np.abs(grad)) < 1e-4, grad


# -- the step's linearisation is Keras's compiled loss, scaled ---------------

def _cases(K):
    bce = lambda y1, y2: [(y1 > 1).astype(F64), (y2 > 0).astype(F64)]  # noqa: E731
    mixed = lambda y1, y2: [y1, (y2 > 0).astype(F64)]  # noqa: E731
    soft = lambda y1, y2: [np.eye(2)[(y1[:, 0] > 1).astype(int)],  # noqa: E731
                           (y2[:, 0] > 0).astype(F64)]
    # name: (loss, a control that reads it wrongly, activations, targets,
    #        widths, loss_weights)
    return {
        "huber-deltas": ([K.losses.Huber(1.0), K.losses.Huber(0.1)],
                         [K.losses.Huber(1.0), K.losses.Huber(1.0)],
                         (None, None), None, (1, 2), None),
        "from-logits": ([K.losses.BinaryCrossentropy(),
                         K.losses.BinaryCrossentropy(from_logits=True)],
                        [K.losses.BinaryCrossentropy()] * 2,
                        ("sigmoid", None), bce, (1, 2), None),
        "softmax-by-name": (["categorical_crossentropy",
                             K.losses.SparseCategoricalCrossentropy(from_logits=True)],
                            None, ("softmax", None), soft, (2, 2),
                            {"o2": 2.0, "o1": 0.5}),
        "mse+huber": (["mse", K.losses.Huber(0.3)], ["mse", "mse"],
                      (None, None), None, (1, 2), None),
        "mse+mae": (["mse", "mae"], ["mse", "mse"], (None, None), None, (1, 2), None),
        "mse+bce": (["mean_squared_error", K.losses.BinaryCrossentropy(from_logits=True)],
                    ["mse", "mse"], (None, None), mixed, (1, 2), None),
    }


@pytest.mark.parametrize("case", ["huber-deltas", "from-logits", "softmax-by-name",
                                  "mse+huber", "mse+mae", "mse+bce"])
def test_the_step_linearises_the_compiled_loss(K, gk, case):
    # Eager, so that the first step's linearisation can be read: its cost
    # and J^T r must be Keras's compiled loss and its gradient (by
    # GradientTape, no LM code), times one constant: 1 with a cross-entropy
    # (a GGN of the mean), the batch B for squared/robust residuals. Sample
    # weights count in every block.
    loss, control, acts, targets, widths, lw = _cases(K)[case]
    x, y1, y2 = data()
    y = targets(y1, y2) if targets else [y1, y2]
    sw = np.random.RandomState(1).uniform(0.2, 2.0, len(x))
    model = compile_lm(K, gk, two_outputs(K, widths=widths, activations=acts), "eager",
                       loss, **({"loss_weights": lw} if lw else {}))
    keras_loss, keras_grad = keras_gradient(model, x, y, sw)
    seen = {}
    iterate = model.optimizer._iterate

    def record(lin, *args, **kwargs):
        seen.setdefault("lin", lin)
        return iterate(lin, *args, **kwargs)

    model.optimizer._iterate = record
    fit(model, x, y, 1, sample_weight=sw)
    lin = seen["lin"]
    scale = 1.0 if "bce" in case or "logits" in case or "softmax" in case else len(x)
    # Keras computes its loss in float32: 1e-5 relative.
    np.testing.assert_allclose(float(lin.cost), scale * keras_loss, rtol=1e-5)
    np.testing.assert_allclose(lin.jtr.numpy(), scale * keras_grad, rtol=1e-4,
                               atol=1e-5 * np.max(np.abs(scale * keras_grad)))
    if control is not None:
        twin = two_outputs(K, widths=widths, activations=acts)
        twin.compile(loss=control)
        for v, w in zip(twin.trainable_variables, model.trainable_variables):
            v.assign(w)
        # The control's gradient at the same start, at whatever scale.
        model.optimizer._iterate = iterate
        _, wrong = keras_gradient(twin, x, y, sw)
        for other in (wrong, 2 * wrong, 0.5 * wrong):
            assert not np.allclose(lin.jtr.numpy(), scale * other, rtol=1e-3)


def test_mixed_losses_with_one_mse_output_and_an_mae_one_train(K, gk):
    x, y1, y2 = data()
    model = compile_lm(K, gk, two_outputs(K), "jit", ["mse", "mae"])
    history = fit(model, x, [y1, y2], 4)
    # MAE is not smooth: no stationary-point oracle; its IRLS blocks must
    # still take steps on the compiled loss.
    assert np.all(np.isfinite(history)) and history[-1] < 0.9 * history[0]


def test_an_unknown_loss_is_refused_naming_its_output(K, gk):
    x, y1, y2 = data()
    model = compile_lm(K, gk, two_outputs(K), "function",
                       ["mse", K.losses.LogCosh()])
    start = weights_of(model)
    with pytest.raises(ValueError, match=r"output 'o2'.*Accepted") as info:
        fit(model, x, [y1, y2], 1)
    # Refused before fit traces a step: no graph traceback in the message.
    assert "in user code" not in str(info.value)
    for got, want in zip(weights_of(model), start):
        np.testing.assert_array_equal(got, want)


def test_cross_entropy_refuses_a_solver_without_normal_equations(K, gk):
    x, y1, y2 = data()
    model = compile_lm(K, gk, two_outputs(K), "function",
                       ["mse", K.losses.BinaryCrossentropy(from_logits=True)],
                       solver="qr")
    with pytest.raises(ValueError, match=r"output 'o2'.*solver='cholesky'") as info:
        fit(model, x, [y1, (y2 > 0).astype(F64)], 1)
    assert "in user code" not in str(info.value)


def test_label_smoothing_is_refused_naming_its_output(K, gk):
    x, y1, y2 = data()
    model = compile_lm(K, gk, two_outputs(K), "function",
                       ["mse", K.losses.BinaryCrossentropy(label_smoothing=0.1)])
    with pytest.raises(ValueError, match=r"output 'o2'.*label_smoothing"):
        fit(model, x, [y1, (y2 > 0).astype(F64)], 1)


# -- per-output sample weights, targets by name, replicas ---------------------

def _started(K, gk, mode, start=None, widths=(1, 2), **kwargs):
    model = compile_lm(K, gk, two_outputs(K, widths=widths), mode, ["mse", "mse"],
                       loss_weights={"o2": 3.0, "o1": 0.2}, **kwargs)
    for v, w in zip(model.trainable_variables, start or []):
        v.assign(w)
    return model


# Eagerly (slow): the jit case's unchunked reference and control run eagerly.
@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow),
                                  pytest.param("function", marks=pytest.mark.slow), "jit"])
def test_chunks_take_per_output_sample_weights_output_by_output(K, gk, mode):
    # chunk_size sums J^T J chunk by chunk: with one sample weight array per
    # output each chunk takes its rows of each array (they were stacked
    # into one [2, B] tensor and gathered by example: an error on CPU,
    # zeros from out-of-range indices on a GPU).
    x, y1, y2 = data()
    rng = np.random.RandomState(2)
    sw = [rng.uniform(0.2, 2.0, len(x)), rng.uniform(0.2, 2.0, len(x))]
    # The unchunked reference eagerly (float64: the same sums to round-off).
    whole = _started(K, gk, "eager")
    start = weights_of(whole)
    fit(whole, x, [y1, y2], 2, sample_weight=sw)

    def chunked(weights, mode=mode):
        model = _started(K, gk, mode, start, chunk_size=5)  # 5, 5, 5, 1 rows
        fit(model, x, [y1, y2], 2, sample_weight=weights)
        return weights_of(model)

    # The same sums in chunks: float64 round-off only.
    for got, want in zip(chunked(sw), weights_of(whole)):
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    # Control (eager, as a reference): each output weighed by the other's
    # sample weights.
    wrong = chunked(sw[::-1], "eager")
    assert not all(np.allclose(g, w, rtol=1e-3) for g, w in zip(wrong, weights_of(whole)))


# Eagerly (slow): the jit case's control reads a dict of targets eagerly.
@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow),
                                  pytest.param("function", marks=pytest.mark.slow), "jit"])
def test_targets_as_a_dict_by_output_name_for_list_outputs(K, gk, mode):
    # Plain fit reads a dict of targets by output name for a model whose
    # outputs are a list; LM must read it so too (Keras 3 refused it).
    x, y1, y2 = data()
    y2b = y2[:, ::-1] * 2.0
    as_list = _started(K, gk, mode, widths=(2, 2))
    start = weights_of(as_list)
    fit(as_list, x, [y2, y2b], 2)

    def by_name(targets, mode=mode):
        model = _started(K, gk, mode, start, widths=(2, 2))
        fit(model, x, targets, 2)
        return weights_of(model)

    # The dict in the other order than the outputs: read by name, it is the
    # same computation as the list, to the bit.
    for got, want in zip(by_name({"o2": y2b, "o1": y2}), weights_of(as_list)):
        np.testing.assert_array_equal(got, want)
    # Control (eager, as a reference): the targets swapped between the
    # outputs step elsewhere.
    wrong = by_name({"o2": y2, "o1": y2b}, "eager")
    assert not all(np.allclose(g, w, rtol=1e-3) for g, w in zip(wrong, weights_of(as_list)))


@pytest.mark.distributed
def test_mirrored_two_outputs_with_loss_weights_by_name_equal_one_device(K, gk, mirrored):
    # J^T J and J^T r of both outputs are summed over two replicas (8
    # examples each): the steps are one device's, up to the order of the
    # float64 sums (a well-conditioned 17-parameter system: 1e-8 relative
    # leaves orders of magnitude above the round-off).
    x, y1, y2 = data()
    ref = _started(K, gk, "eager")  # the reference: float64 either way
    start = weights_of(ref)
    with mirrored.scope():
        model = _started(K, gk, "function", start)
    ref_hist = fit(ref, x, [y1, y2], 2)
    hist = fit(model, x, [y1, y2], 2)
    for got, want in zip(weights_of(model), weights_of(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    # Keras reports its loss in float32: 1e-6 relative.
    np.testing.assert_allclose(hist, ref_hist, rtol=1e-6)
    assert not np.allclose(weights_of(ref)[0], start[0], rtol=1e-3)  # steps were taken
