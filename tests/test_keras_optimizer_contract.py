"""Keras's own optimizer contract, over every tf_gradkit optimizer.

The scenarios of Keras 3's ``keras/src/optimizers/optimizer_test.py`` and
tf_keras's ``tf_keras/optimizers/optimizer_test.py``, in our own words, run
over every optimizer of `tf_gradkit._hosts.OPTIMIZERS` in the process's
flavour. A wrapper runs around SGD and around Adam with its own effect made
neutral (GradientAccumulator(steps=1), Projected onto a box no value
reaches, AugmentedLagrangian with an inactive constraint, MagnitudePruning
at sparsity 0, MaskAware masking a variable of its own with ones) and must do exactly what Keras's optimizer does alone (the
reference); ConditionalGradient and LevenbergMarquardt take the checks that
do not depend on an SGD-like step. Each check passes, or is skipped with
the reason there is no counterpart.
"""

import logging
import pickle
import warnings

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR, keras_module

from tf_gradkit._hosts import OPTIMIZERS

KERAS3 = FLAVOUR == "keras3"
WRAPPERS = ("AugmentedLagrangian", "GradientAccumulator", "MagnitudePruning", "MaskAware",
            "Projected")
INNERS = ("sgd", "adam")
KERAS_OPTIMIZERS = {"adam": "Adam", "sgd": "SGD", "adamw": "AdamW", "adagrad": "Adagrad",
                    "rmsprop": "RMSprop", "adadelta": "Adadelta", "adamax": "Adamax",
                    "lion": "Lion", "nadam": "Nadam", "ftrl": "Ftrl",
                    "adafactor": "Adafactor"}


def _inactive():
    """An inequality constraint g <= 0 that never binds (g = -1), registered
    so that saved configs load back (unregistered top-level functions:
    tests/test_fresh_process.py)."""
    return tf.constant([-1.0])


keras_module().saving.register_keras_serializable(package="contract_test")(_inactive)


def _neutral(gk, name, inner):
    """``name`` around ``inner`` with its own effect made neutral."""
    if name == "GradientAccumulator":
        return gk.GradientAccumulator(inner, steps=1, reduction="microbatch")
    if name == "Projected":
        return gk.Projected(inner, {".": gk.constraints.Box(-1e6, 1e6)})
    if name == "AugmentedLagrangian":
        return gk.AugmentedLagrangian(inner, [gk.Inequality(_inactive, name="inactive")])
    if name == "MagnitudePruning":
        from tf_gradkit.pruning import ConstantSparsity  # noqa: PLC0415
        return gk.MagnitudePruning(inner, targets=".", schedule=ConstantSparsity(0.0, 0, 1, 1))
    if name == "MaskAware":  # a mask of ones, of a variable of its own
        return gk.MaskAware(inner, masks=[(tf.Variable([1.0]), [1.0])])
    raise AssertionError(name)


# MaskAware around SGD only: its masked update is the same around any inner
# optimizer (tests/test_mask_aware_explicit.py), and the suite's time is short.
CASES = [f"{w}-{i}" for w in WRAPPERS for i in INNERS if w != "MaskAware" or i == "sgd"] + [
    "ConditionalGradient", "LevenbergMarquardt"]
assert set(WRAPPERS) | {"ConditionalGradient", "LevenbergMarquardt"} == set(OPTIMIZERS)


class Case:
    """One optimizer under test: ``make(**inner_kwargs)`` builds it around a
    fresh inner optimizer, ``reference(**inner_kwargs)`` Keras's alone."""

    def __init__(self, K, gk, case):
        self.K, self.gk, self.case = K, gk, case
        self.name, _, self.inner = case.partition("-")
        self.wrapper = self.name in WRAPPERS

    def inner_optimizer(self, kind=None, **kwargs):
        kind = kind or self.inner
        if kind in ("sgd", "adam"):
            kwargs.setdefault("learning_rate", 1.0 if kind == "sgd" else 0.1)
        return getattr(self.K.optimizers, KERAS_OPTIMIZERS[kind])(**kwargs)

    def make(self, kind=None, **kwargs):
        return _neutral(self.gk, self.name, self.inner_optimizer(kind, **kwargs))

    reference = inner_optimizer

    def own(self):
        """ConditionalGradient or LevenbergMarquardt with defaults."""
        if self.name == "ConditionalGradient":
            return self.gk.ConditionalGradient(0.1)
        return self.gk.LevenbergMarquardt()

    def any(self):
        return self.make() if self.wrapper else self.own()

    def need_wrapper(self, what="this check"):
        if not self.wrapper:
            pytest.skip(f"no counterpart: {self.name} is not a wrapper; {what} compares "
                        "a wrapper with Keras's optimizer alone (its own step has its "
                        f"own tests)")

    def need_gradient_step(self):
        if self.name == "LevenbergMarquardt":
            pytest.skip("no counterpart: LevenbergMarquardt steps from residuals "
                        "(minimize / its fit step), never apply_gradients")


@pytest.fixture(params=CASES)
def case(request, K, gk):
    return Case(K, gk, request.param)


def var(K, value, name, dtype="float32"):
    if KERAS3:
        return K.Variable(np.asarray(value, dtype), name=name)
    return tf.Variable(np.asarray(value, dtype), name=name)


def close(a, b, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=atol)


def apply(opt, grads, variables, **kwargs):
    return opt.apply_gradients(list(zip(grads, variables)), **kwargs)


def twin(case, make_variables, steps, **inner_kwargs):
    """Runs ``steps`` (a list of gradient lists) through the wrapper and
    through Keras's optimizer alone, on equal variables; returns both
    ``(optimizer, variables)`` pairs."""
    out = []
    for opt in (case.make(**inner_kwargs), case.reference(**inner_kwargs)):
        variables = make_variables()
        for grads in steps:
            apply(opt, grads, variables)
        out.append((opt, variables))
    return out


M = [[1.0, 2.0], [3.0, 4.0]]
ONES = [[1.0, 1.0], [1.0, 1.0]]


# ------------------------------------------------------------ Keras 3's file
def test_iterations_counter(case, K):
    case.need_gradient_step()
    opt = case.any()
    v = var(K, M, "v")
    assert int(opt.iterations) == 0
    apply(opt, [tf.constant(ONES)], [v])
    assert int(opt.iterations) == 1
    apply(opt, [tf.constant(ONES)], [v])
    assert int(opt.iterations) == 2


def _warned_missing(K, fn, caplog):
    """Whether ``fn()`` gave the flavour's "Gradients do not exist" warning
    (Keras 3: a UserWarning; tf_keras: a log record)."""
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        fn()
    texts = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    return any("Gradients do not exist" in t for t in texts)


def test_empty_gradients(case, K, caplog):
    case.need_gradient_step()
    opt = case.any()
    v = var(K, [[3.0, 4.0], [5.0, 6.0]], "v")
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        apply(opt, [None], [v])
    opt = case.any()
    v, v2 = var(K, [[3.0, 4.0], [5.0, 6.0]], "v"), var(K, [[3.0, 4.0], [5.0, 6.0]], "v2")
    assert _warned_missing(K, lambda: apply(opt, [None, tf.constant(ONES)], [v, v2]),
                           caplog)
    close(v, [[3.0, 4.0], [5.0, 6.0]])
    if case.wrapper:
        ref = case.reference()
        w, w2 = var(K, [[3.0, 4.0], [5.0, 6.0]], "w"), var(K, [[3.0, 4.0], [5.0, 6.0]], "w2")
        apply(ref, [None, tf.constant(ONES)], [w, w2])
        close(v2, w2)


def test_clip_args(case):
    case.need_gradient_step()
    for arg in ("clipnorm", "clipvalue", "global_clipnorm"):
        if case.wrapper:
            opt = case.make(**{arg: 0.1})
            assert getattr(opt, arg) == 0.1  # the inner's, which applies it
            with pytest.raises((TypeError, ValueError), match=arg):
                type(opt)(case.inner_optimizer(), **_required(case), **{arg: 0.1})
        else:
            opt = case.gk.ConditionalGradient(0.1, **{arg: 0.1})
            assert getattr(opt, arg) == 0.1
    if case.wrapper and KERAS3:  # nor the wrapper's own loss scale: the inner's
        with pytest.raises(TypeError, match="loss_scale_factor"):
            type(opt)(case.inner_optimizer(), **_required(case), loss_scale_factor=2.0)
    if not case.wrapper and KERAS3:  # tf_keras does not check this
        with pytest.raises(ValueError, match="Only one of"):
            case.gk.ConditionalGradient(0.1, clipnorm=0.1, clipvalue=0.1)


def _required(case):
    """The wrapper's required arguments besides the optimizer."""
    return {"GradientAccumulator": {"steps": 1, "reduction": "microbatch"},
            "Projected": {"constraints": {".": case.gk.constraints.Box(-1e6, 1e6)}},
            "AugmentedLagrangian": {"constraints": [case.gk.Inequality(_inactive)]},
            "MagnitudePruning": {},
            "MaskAware": {"masks": [(tf.Variable([1.0]), [1.0])]}}[case.name]


CLIPS = {"clipnorm": ([100.0, 100.0], 1.0), "clipvalue": ([100.0, -100.0], 1.0),
         "global_clipnorm": ([50.0, 100.0], 1.0)}


@pytest.mark.parametrize("arg", sorted(CLIPS))
@pytest.mark.parametrize("when", ["construction", "set_after"])
def test_clipping(case, K, arg, when):
    """Keras's test_clip_norm / test_clip_value / test_global_clip_norm,
    through the wrapper: the inner optimizer's clipping applies, whether it
    was given at construction or set on the wrapper afterwards."""
    case.need_wrapper()
    grad, value = CLIPS[arg]
    opt = case.make(**({arg: value} if when == "construction" else {}))
    if when == "set_after":
        setattr(opt, arg, value)
    ref = case.reference(**{arg: value})
    v, w = var(K, [0.0, 0.0], "v"), var(K, [0.0, 0.0], "w")
    for _ in range(2):
        apply(opt, [tf.constant(grad)], [v])
        apply(ref, [tf.constant(grad)], [w])
    close(v, w)
    assert np.max(np.abs(v.numpy())) < 10.0  # clipped: an unclipped step moves 50+


def test_ema(case, K):
    case.need_wrapper()
    kw = dict(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)
    (opt, (v,)), (ref, (w,)) = twin(case, lambda: [var(K, [[3.0, 4.0], [5.0, 6.0]], "v")],
                                    [[tf.constant(ONES)]] * 3, **kw)
    close(v, w)
    close(opt.inner_optimizer._model_variables_moving_average[0],
          ref._model_variables_moving_average[0])


def _dense_model(K, kernel="ones", constraint=None):
    model = K.Sequential([K.layers.Input((1,)),
                          K.layers.Dense(2, kernel_initializer=kernel, use_bias=False,
                                         kernel_constraint=constraint)])
    return model


def test_ema_with_model_fit(case, K):
    case.need_wrapper()
    x, y = np.ones((1, 1), "float32"), np.zeros((1, 2), "float32")
    out = []
    for opt in (case.make(learning_rate=0.1, use_ema=True, ema_momentum=0.9),
                case.reference(learning_rate=0.1, use_ema=True, ema_momentum=0.9)):
        model = _dense_model(K)
        model.compile(loss="mse", optimizer=opt, run_eagerly=True)
        model.fit(x, y, batch_size=1, epochs=2, verbose=0)
        out.append(model.trainable_variables[0].numpy())
    close(out[0], out[1])
    if case.inner == "sgd" and KERAS3:
        close(out[0], [[0.891, 0.891]], atol=1e-5)  # Keras 3's own number


def test_constraints_are_applied(case, K):
    """A variable's own constraint runs after the update (Keras 3's
    test_constraints_are_applied, tf_keras's testVariableConstraints)."""
    case.need_gradient_step()
    model = _dense_model(K, kernel="zeros", constraint=K.constraints.NonNeg())
    model.trainable_variables[0].assign(-np.ones((1, 2), "float32"))
    opt = case.any()
    apply(opt, [tf.zeros((1, 2))], model.trainable_variables)
    assert np.min(model.trainable_variables[0].numpy()) == 0.0


def test_get_method(case, K):
    opt = case.any()
    again = K.optimizers.get(K.optimizers.serialize(opt))
    assert type(again) is type(opt)
    assert again.get_config() == opt.get_config()


def test_static_loss_scaling(case, K):
    if not KERAS3:
        pytest.skip("no counterpart: tf_keras optimizers have no loss_scale_factor")
    case.need_wrapper()
    opt = case.make(loss_scale_factor=1024.0)
    v = var(K, M, "v")
    apply(opt, [tf.constant(M) * 1024.0], [v])
    assert float(opt.scale_loss(1.0)) == 1024.0
    close(v, [[0.0, 0.0], [0.0, 0.0]] if case.inner == "sgd"
          else np.asarray(M) - 0.1)  # Adam's first step: lr * sign


@pytest.mark.parametrize("where", ["inner", "wrapper"])
def test_loss_scale_with_active_constraint(case, K, where):
    """AugmentedLagrangian's own gradient terms carry the inner chain's
    loss scale as the loss's gradients do, so a scaled run is the unscaled
    one (it was 1/scale too weak: [0.367, 0.367] instead of [1.3645, 1.3645]
    after 3 steps)."""
    if not KERAS3:
        pytest.skip("no counterpart: tf_keras optimizers have no loss_scale_factor")
    if case.name != "AugmentedLagrangian":
        pytest.skip("no counterpart: only AugmentedLagrangian adds gradient terms "
                    "of its own (the others' scaled runs: test_static_loss_scaling)")
    out = []
    for scale in (None, 8.0):
        v = var(K, [0.0, 0.0], "v")
        inner = case.inner_optimizer(learning_rate=0.1, **(
            {"loss_scale_factor": scale} if scale and where == "inner" else {}))
        opt = case.gk.AugmentedLagrangian(
            inner, [case.gk.Equality(lambda v=v: v - 2.0, shape=(2,))],
            initial_penalty=1.0)
        if scale and where == "wrapper":
            opt.loss_scale_factor = scale
        for _ in range(3):
            apply(opt, [tf.constant([0.5, 0.5]) * float(opt.scale_loss(1.0))], [v])
        out.append(v.numpy())
    close(out[1], out[0], atol=1e-6)
    assert np.min(out[0]) > 0.2  # the constraint pulls


def test_static_loss_scaling_set_on_wrapper(case, K):
    """``wrapper.loss_scale_factor = s`` after construction reaches the
    inner optimizer (scale_loss and the unscaling are the inner's)."""
    if not KERAS3:
        pytest.skip("no counterpart: tf_keras optimizers have no loss_scale_factor")
    case.need_wrapper()
    opt = case.make()
    opt.loss_scale_factor = 64.0
    assert opt.inner_optimizer.loss_scale_factor == 64.0
    assert float(opt.scale_loss(1.0)) == 64.0
    v, w = var(K, M, "v"), var(K, M, "w")
    apply(opt, [tf.constant(ONES) * 64.0], [v])
    apply(case.reference(), [tf.constant(ONES)], [w])
    close(v, w)


def test_set_weights(case, K):
    case.need_gradient_step()
    x = var(K, M, "x")
    grads = tf.constant(M)
    first = case.any()
    apply(first, [grads], [x])
    second = case.any()
    with pytest.raises(ValueError, match="You are calling"):
        second.set_weights(first.variables)
    second.build([x])
    second.set_weights([v.numpy() for v in first.variables])
    assert len(first.variables) == len(second.variables)
    for a, b in zip(first.variables, second.variables):
        close(a, b)
    # The state set is the state used: one more step each, from equal weights.
    start = x.numpy()
    apply(first, [grads], [x])
    after_first = x.numpy()
    x.assign(start)
    apply(second, [grads], [x])
    close(x, after_first)


def test_inner_gradient_accumulation(case, K):
    """Keras 3's gradient_accumulation_steps on the inner optimizer: refused
    at construction, or the same four iterations as Keras alone."""
    if not KERAS3:
        pytest.skip("no counterpart: tf_keras has no gradient_accumulation_steps")
    case.need_wrapper()
    try:
        opt = case.make(gradient_accumulation_steps=3)
    except TypeError as error:
        assert "gradient_accumulation_steps" in str(error)
        return
    ref = case.reference(gradient_accumulation_steps=3)
    v, w = var(K, M, "v"), var(K, M, "w")
    for _ in range(4):
        apply(opt, [tf.constant(ONES)], [v])
        apply(ref, [tf.constant(ONES)], [w])
        close(v, w)
        assert int(opt.iterations) == int(ref.iterations)


def test_tf_checkpointing(case, K, tmp_path):
    case.need_wrapper()
    if case.inner != "adam":
        pytest.skip("no counterpart beyond the adam case (same code path, kept fast)")
    x, y = np.random.random((1, 2)), np.random.random((1, 2))
    model = K.Sequential([K.layers.Input((2,)), K.layers.Dense(2)])
    opt = case.make(learning_rate=0.1)
    model.compile(opt, "mse")
    model.train_on_batch(x, y)
    reference = model.predict(x, verbose=0)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    state = [v.numpy() for v in opt.variables]
    model.train_on_batch(x, y)
    assert not np.allclose(model.predict(x, verbose=0), reference, atol=1e-3)
    checkpoint.restore(path)
    close(model.predict(x, verbose=0), reference, atol=1e-5)
    for a, b in zip(opt.variables, state):
        close(a, b)


def test_callable_learning_rate(case, K):
    case.need_wrapper()
    opt = case.make("sgd", learning_rate=lambda: 0.1)
    v = var(K, M, "v")
    apply(opt, [tf.constant(ONES)], [v])
    close(v, [[0.9, 1.9], [2.9, 3.9]])
    assert int(opt.iterations) == 1


def test_overwrite_with_gradient(case, K):
    if not KERAS3:
        pytest.skip("no counterpart: tf_keras variables have no overwrite_with_gradient")
    case.need_wrapper()
    if case.name == "MagnitudePruning":
        pytest.skip("no counterpart here: MagnitudePruning's targets are weights to "
                    "prune; targets='.' would include the float8 state")
    out = []
    for opt in (case.make(), case.reference()):
        v, v2 = var(K, M, "v"), var(K, M, "v2")
        v.overwrite_with_gradient = True
        apply(opt, [tf.constant(ONES), tf.constant(ONES)], [v, v2])
        out.append((v.numpy(), v2.numpy()))
    close(out[0][0], ONES)
    close(out[0][0], out[1][0])
    close(out[0][1], out[1][1])


def test_overwrite_with_gradient_accumulated(case, K):
    """Keras accumulates an overwrite_with_gradient variable by its
    element-wise max; GradientAccumulator(steps > 1) refuses such variables
    (it would take the mean), and the others follow or refuse the inner
    optimizer's gradient_accumulation_steps (`test_inner_gradient_accumulation`)."""
    if not KERAS3:
        pytest.skip("no counterpart: tf_keras variables have no overwrite_with_gradient")
    if case.name != "GradientAccumulator":
        pytest.skip("no counterpart: only GradientAccumulator accumulates itself")
    opt = case.gk.GradientAccumulator(case.inner_optimizer(), steps=2,
                                      reduction="microbatch")
    v, v2 = var(K, M, "v"), var(K, M, "v2")
    v.overwrite_with_gradient = True
    with pytest.raises(ValueError, match="overwrite_with_gradient"):
        apply(opt, [tf.constant(ONES), tf.constant(ONES)], [v, v2])
    close(v, M)
    close(v2, M)




@pytest.mark.parametrize("kind", sorted(KERAS_OPTIMIZERS))
def test_gradient_accumulation_with_weight_decay(case, K, kind):
    """Keras 3's test: three accumulated micro-batches with weight decay
    equal one step on their mean. Here GradientAccumulator(steps=3,
    "microbatch") is that accumulation, in both flavours."""
    if case.name != "GradientAccumulator" or case.inner != "sgd":
        pytest.skip("no counterpart: only GradientAccumulator accumulates "
                    "(inner kind is the parameter)")
    one = case.inner_optimizer(kind, weight_decay=0.05)
    acc = case.gk.GradientAccumulator(case.inner_optimizer(kind, weight_decay=0.05),
                                      steps=3, reduction="microbatch")
    v1, v3 = var(K, [[0.9], [0.5]], "v1"), var(K, [[0.9], [0.5]], "v3")
    rng = np.random.default_rng(0)
    for _ in range(8):
        g3 = rng.random((3, 2, 1)).astype("float32")
        apply(one, [tf.constant(g3.mean(axis=0))], [v1])
        for b in range(3):
            apply(acc, [tf.constant(g3[b])], [v3])
    close(v1, v3, atol=1e-5)


def test_setting_lr_to_callable_untracks_lr_var(case, K):
    if not KERAS3:
        pytest.skip("no counterpart: tf_keras keeps the learning rate out of `variables`")
    case.need_wrapper()
    opt = case.make("adam", learning_rate=0.001)
    own = len(opt.variables) - len(opt.inner_optimizer.variables)
    before = len(opt.inner_optimizer.variables)
    opt.learning_rate = K.optimizers.schedules.PolynomialDecay(0.001, 4)
    assert len(opt.inner_optimizer.variables) == before - 1
    assert len(opt.variables) - len(opt.inner_optimizer.variables) == own


def test_pickleable(case):
    if not KERAS3:
        pytest.skip("no counterpart: tf_keras's test file has no pickling test")
    opt = case.any()
    again = pickle.loads(pickle.dumps(opt))
    assert again.get_config() == opt.get_config()


def test_mixed_with_tf_variables(case, K, caplog):
    if not KERAS3:
        pytest.skip("no counterpart: every tf_keras variable is a tf.Variable")
    case.need_gradient_step()
    opt = case.any()
    v = var(K, M, "v")
    tf_v = tf.Variable(M, name="tf_v")
    apply(opt, [tf.constant(ONES), tf.constant(ONES)], [v, tf_v])
    assert int(opt.iterations) == 1
    if case.name == "GradientAccumulator":
        return  # refuses a micro-step with other variables than the first (its own test)
    assert _warned_missing(K, lambda: apply(opt, [tf.constant(ONES), None], [v, tf_v]),
                           caplog)
    assert int(opt.iterations) == 2


def test_optimizer_auto_naming(case, K):
    """Two unnamed instances are named as the flavour names its own: Keras
    3 ``adam``, ``adam_1``; tf_keras ``Adam`` twice. Explicit names and
    names after deserialisation are kept."""
    first, second = case.any(), case.any()
    a, b = K.optimizers.Adam(), K.optimizers.Adam()
    assert (first.name == second.name) == (a.name == b.name)
    if KERAS3:
        assert second.name == f"{first.name.rsplit('_', 1)[0]}_{int(first.name.rsplit('_', 1)[1]) + 1}" \
            if first.name[-1].isdigit() else second.name == f"{first.name}_1"
    config = K.optimizers.serialize(second)
    assert K.optimizers.deserialize(config).name == second.name
    assert K.optimizers.deserialize(K.optimizers.serialize(first)).name == first.name
    named = (type(first)(case.inner_optimizer(), **_required(case), name="mine")
             if case.wrapper else
             type(first)(**({"learning_rate": 0.1} if case.name == "ConditionalGradient"
                            else {}), name="mine"))
    assert named.name == "mine"


# ----------------------------------------------------------- tf_keras's file
def test_compute_gradients(case, K):
    if KERAS3:
        pytest.skip("no counterpart: Keras 3 optimizers have no compute_gradients")
    case.need_wrapper()
    x = tf.Variable([1.0, 2.0], name="x")
    grads_and_vars = case.make().compute_gradients(lambda: x, [x])
    close(grads_and_vars[0][0], [1.0, 1.0])


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_weight_decay_exclusion(case, K, kind):
    """tf_keras's testWeightDecay: variables excluded by name or by object
    keep their value; the others decay. Excluding on the wrapper reaches
    the inner optimizer, which decays."""
    case.need_wrapper()
    if case.name == "MagnitudePruning":
        pass
    grads = tf.zeros(())

    def run(exclude=None):
        var1, var2, var3 = (var(K, 2.0, "var1"), var(K, 2.0, "exclude"), var(K, 2.0, "var3"))
        opt = case.make(kind, learning_rate=1.0, weight_decay=0.004)
        if exclude == "names":
            opt.exclude_from_weight_decay(var_names=["exclude"])
            apply(opt, [grads, grads], [var1, var2])
        elif exclude == "list":
            opt.exclude_from_weight_decay(var_list=[var3])
            apply(opt, [grads, grads], [var1, var3])
        else:
            apply(opt, [grads], [var1])
        return var1, var2, var3

    close(run()[0], 2.0 - 2.0 * 0.004)  # one step: lr * weight_decay * value
    var1, var2, _ = run("names")
    assert float(var2.numpy()) == 2.0
    assert float(var1.numpy()) < 2.0
    _, _, var3 = run("list")
    assert float(var3.numpy()) == 2.0


def test_legacy_decay_argument(case):
    """tf_keras's testPassingLegacyArgsRaiseError: ``decay=`` is refused by
    the wrapper (it belongs to nothing)."""
    case.need_wrapper()
    with pytest.raises((TypeError, ValueError), match="decay"):
        type(case.make())(case.inner_optimizer(), **_required(case), decay=0.5)


def test_return_all_optimizer_variables(case, K):
    case.need_wrapper()
    opt = case.make("adam")
    apply(opt, [tf.constant(M)], [var(K, M, "x")])
    ids = {id(v) for v in opt.variables}
    assert all(id(v) in ids for v in opt.inner_optimizer.variables)
    assert len(opt.inner_optimizer.variables) >= 3  # iterations, m, v (+ lr in Keras 3)


def test_set_learning_rate(case, K):
    case.need_wrapper()
    opt = case.make("adam", learning_rate=1.0)
    opt.learning_rate = 2.0
    assert float(opt.inner_optimizer.learning_rate) == 2.0
    if not KERAS3:
        opt.lr = 3.0
        assert float(opt.inner_optimizer.learning_rate) == 3.0
    schedule = K.optimizers.schedules.ExponentialDecay(1e-2, 10000, 0.9)
    opt = case.make("adam", learning_rate=schedule)
    close(opt.learning_rate, 0.01)
    x = var(K, [1.0, 2.0], "x")
    for _ in range(2):
        apply(opt, [tf.constant([1.0, 2.0])], [x])
    assert 0.00999 < float(opt.learning_rate) < 0.01
    with pytest.raises(TypeError):
        opt.learning_rate = 2.0


def test_set_iterations(case, K):
    if KERAS3:
        pytest.skip("no counterpart: Keras 3's iterations cannot be assigned")
    case.need_wrapper()
    opt = case.make("adam")
    opt.iterations = tf.Variable(2, dtype=tf.int64)
    assert int(opt.iterations) == 2
    variables = [var(K, 2.0, "a"), var(K, 2.0, "b")]
    apply(opt, [tf.constant(1.0), tf.constant(1.0)], variables)
    assert int(opt.iterations) == 3
    assert int(opt.inner_optimizer.iterations) == 3


def test_no_gradients(case, K):
    """tf_keras's testNoGradients: an empty list does what Keras's does
    (tf_keras: nothing; Keras 3: its own error)."""
    case.need_wrapper()
    outcomes = []
    for opt in (case.make(), case.reference()):
        try:
            opt.apply_gradients(zip([], []))
            outcomes.append(None)
        except ValueError:
            outcomes.append(ValueError)
    assert outcomes[0] == outcomes[1]


def test_apply_gradients_name_argument(case, K):
    if KERAS3:
        pytest.skip("no counterpart: Keras 3's apply_gradients takes no name")
    case.need_wrapper()
    v = [var(K, 2.0, "a"), var(K, 2.0, "b")]
    opt = case.make("adam")
    apply(opt, [tf.constant(1.0), tf.constant(1.0)], v, name="dummy")
    assert int(opt.iterations) == 1


def test_moving_average_optimizer(case, K):
    """tf_keras's testMovingAverageOptimizer: EMA with overwrite every 3
    steps, one variable without a gradient."""
    case.need_wrapper()
    if case.name == "GradientAccumulator":
        pass
    out = []
    for opt in (case.make("sgd", learning_rate=1.0, use_ema=True, ema_momentum=0.5,
                          ema_overwrite_frequency=3),
                case.reference("sgd", learning_rate=1.0, use_ema=True, ema_momentum=0.5,
                               ema_overwrite_frequency=3)):
        vs = [var(K, 2.0, f"v{i}") for i in range(3)]
        values = []
        for _ in range(3):
            apply(opt, [tf.constant(1.0), None, tf.constant(1.0)], vs)
            values.append([float(v.numpy()) for v in vs])
        out.append(values)
    close(out[0], out[1])
    if not KERAS3:
        close(out[0][-1], [-0.125, 2.0, -0.125])  # tf_keras's own numbers


def test_get_and_from_config(case, K):
    if not case.wrapper:
        opt = case.own()
        clone = type(opt).from_config(opt.get_config())
        assert clone.get_config() == opt.get_config()
        return
    schedule = K.optimizers.schedules.ExponentialDecay(0.05, 100, 0.9)
    kw = dict(learning_rate=schedule, beta_1=0.7, beta_2=0.77, amsgrad=True,
              epsilon=0.001, clipnorm=0.5, use_ema=True, ema_momentum=0.5,
              ema_overwrite_frequency=50, name="custom_adam")
    opt = case.make("adam", **kw)
    clone = type(opt).from_config(opt.get_config())
    assert clone.get_config() == opt.get_config()
    assert clone.inner_optimizer.get_config() == case.reference("adam", **kw).get_config()


def test_checkpoint_optimizer(case, K, tmp_path):
    case.need_wrapper()
    schedule = K.optimizers.schedules.ExponentialDecay(1e-2, 10000, 0.9)
    kw = dict(learning_rate=schedule, beta_1=0.8, beta_2=0.888)
    x = var(K, M, "x")
    grads = tf.constant(M)
    first = case.make("adam", **kw)
    apply(first, [grads], [x])
    path = tf.train.Checkpoint(var=x, optimizer=first).save(str(tmp_path / "c"))
    x2 = var(K, np.zeros((2, 2)), "x")
    second = case.make("adam", **kw)
    status = tf.train.Checkpoint(var=x2, optimizer=second).restore(path)
    for _ in range(2):
        apply(first, [grads], [x])
        apply(second, [grads], [x2])
    status.assert_existing_objects_matched()
    close(x, x2)
    for a, b in zip(first.variables, second.variables):
        close(a, b)


def _save_formats():
    return ["keras"] if KERAS3 else ["keras", "h5"]


@pytest.mark.parametrize("fmt", _save_formats())
def test_save_and_load_optimizer_with_model(case, K, tmp_path, fmt):
    """tf_keras's testSaveAndLoadOptimizerWithModel (clipnorm set after
    construction; SavedModel format: tests/test_save_load.py)."""
    case.need_wrapper()
    if case.inner != "adam":
        pytest.skip("no counterpart beyond the adam case (same code path, kept fast)")
    model = K.Sequential([K.layers.Input((1,)), K.layers.Dense(1)])
    opt = case.make("adam", learning_rate=0.002)
    opt.clipnorm = 0.1
    x = np.array([[1], [1], [1], [0], [0], [0]], "float32")
    model.compile(loss="mse", optimizer=opt)
    model.fit(x, x, verbose=0)
    path = str(tmp_path / f"model.{fmt}")
    model.save(path)
    loaded = K.models.load_model(path).optimizer
    assert type(loaded) is type(opt)
    close(loaded.learning_rate, 0.002)
    assert loaded.clipnorm == 0.1
    assert loaded.inner_optimizer.clipnorm == 0.1
    for a, b in zip(opt.variables, loaded.variables):
        close(a, b)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_sparse_gradients(case, K, kind):
    """tf_keras's testSparseGradientsWorkAsExpected (float64): IndexedSlices
    give what the dense gradient gives, and what Keras alone gives."""
    case.need_wrapper()
    if case.inner != "sgd":
        pytest.skip("no counterpart beyond one case per wrapper (inner kind is the "
                    "parameter)")
    grads = tf.constant([0, 1.0, 1.5, 0, 0], tf.float64)
    sparse = tf.IndexedSlices(tf.constant([1.0, 1.5], tf.float64), tf.constant([1, 2]),
                              dense_shape=tf.constant([5]))
    extra = {"weight_decay": 0.004, "use_ema": True, "ema_overwrite_frequency": 1} \
        if kind == "sgd" else {}
    runs = []
    for opt, g in ((case.make(kind, learning_rate=0.002, **extra), grads),
                   (case.make(kind, learning_rate=0.002, **extra), sparse),
                   (case.reference(kind, learning_rate=0.002, **extra), sparse)):
        x = var(K, np.ones(5), "x", "float64")
        values = []
        for _ in range(5):
            apply(opt, [g], [x])
            values.append(x.numpy().copy())
        runs.append(values)
    close(runs[0], runs[1], atol=1e-12)
    close(runs[1], runs[2], atol=1e-12)


def test_legacy_optimizers_refused(case, K):
    """tf_keras's OptimizerRegressionTest compares legacy optimizers with
    the new ones: the wrappers refuse legacy ones, saying so."""
    if KERAS3:
        pytest.skip("no counterpart: Keras 3 has no legacy optimizers")
    case.need_wrapper()
    with pytest.raises(TypeError, match="wraps a"):
        type(case.make())(K.optimizers.legacy.Adam(), **_required(case))


@pytest.mark.slow  # ~10 s a case; wrappers under MirroredStrategy: test_composition.py etc.
@pytest.mark.distributed
def test_get_gradients_in_model_mirrored(case, K, mirrored):
    """tf_keras's DistributedTrainingTest (fit under a strategy), on two
    logical CPUs: the wrapper trains as Keras's optimizer alone does."""
    case.need_wrapper()
    if case.inner != "adam":
        pytest.skip("no counterpart beyond the adam case (kept fast)")
    x = np.array([[1], [1], [1], [0], [0], [0]], "float32")
    data = tf.data.Dataset.from_tensor_slices((x, x)).repeat().batch(6)
    out = []
    for make in (case.make, case.reference):
        with mirrored.scope():
            model = K.Sequential([K.layers.Input((1,)), K.layers.Dense(
                1, kernel_initializer="ones")])
            opt = make("adam", learning_rate=0.002)
            model.compile(loss="mse", optimizer=opt)
        model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)
        out.append(([w.numpy() for w in model.weights],
                    int(tf.convert_to_tensor(opt.iterations).numpy())))
    assert out[0][1] == out[1][1] == 5
    for a, b in zip(out[0][0], out[1][0]):
        close(a, b)


def test_jit_compile_same_numbers(case, K):
    """tf_keras's testJitCompile: the same numbers with jit_compile on and off."""
    case.need_wrapper()
    if case.inner != "sgd":
        pytest.skip("no counterpart beyond the sgd case (compiles are slow; every "
                    "optimizer x jit: tests/test_battery.py)")
    out = []
    for jit in (False, True):
        opt = case.make(use_ema=True, ema_overwrite_frequency=1)
        v = var(K, M, "v")
        step = tf.function(lambda: apply(opt, [tf.constant(ONES) * 0.3], [v]),
                           jit_compile=jit)
        for _ in range(3):
            step()
        out.append(v.numpy())
    close(out[0], out[1])
