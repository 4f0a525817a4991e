"""The composition matrix: every wrapper over every inner optimizer, both
flavours. Each cell either equals doing it by hand (tested here, through
``model.fit``, against a loop that does what the composition promises with
plain optimizers) or is refused at construction with a message naming both
classes and what to write instead. docs/composing.md shows the same table.

Wrappers: GradientAccumulator ("acc"), Projected ("proj"),
AugmentedLagrangian ("lagr"), MagnitudePruning ("prune"), MaskAware ("mask",
explicit masks),
Keras's LossScaleOptimizer ("lso") and Keras 3.15's MultiOptimizer ("multi",
Keras 3 only: the inner optimizer takes the first layer, SGD the rest; given
a function) and the same MultiOptimizer given an ``OptimizerMap`` ("mmap": the
first layer's path pattern mapped to the inner optimizer, SGD the default).
Inner optimizers: SGD, Adam, Adam with ``use_ema``, LevenbergMarquardt,
ConditionalGradient (Frank-Wolfe), Keras 3's ``gradient_accumulation_steps``,
Keras's LossScaleOptimizer, a MultiOptimizer (SGD for the first layer, Adam
for the rest; "multi" given a function, "mmap" an OptimizerMap with Adam the
default), and each of our wrappers around SGD or Adam.

By hand, with the same data (4 batches of 8) and initial weights:
  acc(I, 2)   the inner step on the mean gradient of each 2 batches;
  proj(I)     the inner step, then kernels <- max(kernel, 0) when it moved;
  lagr(I)     the inner step on grad(loss + rho/2 max(g, 0)^2), g the
              constraint |first kernel|^2 - 1 <= 0, rho = 1, multipliers 0
              (no dual update in 4 steps);
  mask(I)     the inner step on masked gradients, then weights * mask;
  prune(I)    the same with the mask of MagnitudePruning at 50% of the first
              kernel, made from its initial values before the first step;
  lso(I)      the inner step (scales are powers of 2: exact);
  multi(I)    I's step on the first layer's variables, SGD's on the others;
  multi       SGD on the first layer's variables, Adam on the others.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR
from helpers import ROUNDOFF, max_abs_diff, mlp, regression_data, weights_of
from tf_gradkit import constraints as C
from tf_gradkit._optimizer_tree import suggested_key

K3 = FLAVOUR == "keras3"
WRAPPERS = ["acc", "proj", "lagr", "lso", "prune", "mask"] + (["multi", "mmap"] if K3 else [])
INNERS = ["sgd", "adam", "ema", "lm", "fw", "lso(adam)", "acc(sgd)", "proj(adam)",
          "lagr(adam)", "prune(sgd)", "mask(sgd)"] + (["kacc(sgd)", "multi", "mmap"] if K3
                                                      else [])

# The refused cells, each with what its message must say (both class names
# and the advice). Everything else must equal the by-hand loop.
REFUSED = {
    ("acc", "lm"): r"GradientAccumulator cannot wrap LevenbergMarquardt.*whole batch",
    ("acc", "acc(sgd)"): r"GradientAccumulator cannot wrap GradientAccumulator.*product",
    ("acc", "kacc(sgd)"): r"GradientAccumulator cannot wrap SGD.*gradient_accumulation_steps",
    ("proj", "lm"): r"Projected cannot wrap LevenbergMarquardt.*reparametrise",
    ("proj", "acc(sgd)"): r"Projected cannot wrap GradientAccumulator.*other\s+way round",
    ("proj", "proj(adam)"): r"Projected cannot wrap Projected.*one Projected",
    ("lagr", "lm"): r"AugmentedLagrangian cannot wrap LevenbergMarquardt",
    ("lagr", "acc(sgd)"): r"AugmentedLagrangian cannot wrap GradientAccumulator.*"
                          r"GradientAccumulator\(AugmentedLagrangian",
    ("lagr", "kacc(sgd)"): r"AugmentedLagrangian cannot wrap SGD.*GradientAccumulator",
    ("lagr", "lagr(adam)"): r"AugmentedLagrangian cannot wrap AugmentedLagrangian",
    ("lagr", "lso(adam)"): r"AugmentedLagrangian cannot wrap LossScaleOptimizer.*"
                           r"other way round",
    ("mask", "mask(sgd)"): r"MaskAware cannot wrap MaskAware",
    ("prune", "prune(sgd)"): r"MagnitudePruning cannot wrap MagnitudePruning",
    ("prune", "mask(sgd)"): r"MagnitudePruning cannot wrap MaskAware.*both keep pruning masks",
    ("mask", "prune(sgd)"): r"MaskAware cannot wrap MagnitudePruning.*both keep pruning masks",
}
if K3:  # Keras 3's compile would wrap the wrapper in a second loss-scale optimizer
    REFUSED[("acc", "lso(adam)")] = (r"GradientAccumulator cannot wrap LossScaleOptimizer"
                                     r".*unscaled twice.*outside")
    REFUSED[("prune", "lso(adam)")] = (r"MagnitudePruning cannot wrap LossScaleOptimizer"
                                       r".*unscaled twice.*outside")
    REFUSED[("proj", "lso(adam)")] = (r"Projected cannot wrap LossScaleOptimizer"
                                      r".*unscaled twice.*outside")
    REFUSED[("mask", "lso(adam)")] = (r"MaskAware cannot wrap LossScaleOptimizer"
                                      r".*unscaled twice.*outside")
# Cells Keras refuses when the MultiOptimizer is built (the first fit), with
# what the error says; nothing changes.
REFUSED_AT_FIT = {
    ("multi", "lm"): r"LevenbergMarquardt needs residuals",
    ("multi", "lso(adam)"): r"LossScaleOptimizer cannot be used inside an MultiOptimizer",
    ("multi", "multi"): r"MultiOptimizer cannot be used inside an MultiOptimizer",
    ("multi", "mmap"): r"MultiOptimizer cannot be used inside an MultiOptimizer",
    ("mmap", "lm"): r"LevenbergMarquardt needs residuals",
}
# Cells Keras's OptimizerMap refuses as the map is made (ValueError).
REFUSED_BY_KERAS = {
    ("mmap", "lso(adam)"): r"optimizer cannot be LossScaleOptimizer",
    ("mmap", "multi"): r"optimizer cannot be MultiOptimizer",
    ("mmap", "mmap"): r"optimizer cannot be MultiOptimizer",
}
# Cells whose by-hand equivalence has its own test elsewhere.
ELSEWHERE = {
    ("mask", "lm"): "test_lm_support.py: MaskAware(LM) equals LM on the restricted problem",
    ("prune", "lm"): "test_magnitude_pruning.py: MagnitudePruning(LevenbergMarquardt(model)) "
                     "solves over the unpruned weights",
    ("lso", "lm"): "test_levenberg_marquardt.py: mixed-precision LM (its own float32 step; "
                   "apply_gradients refused with LM's usage message)",
    ("lso", "lso(adam)"): "Keras's own class in Keras's own class: not ours",
    ("proj", "ema"): "test_projected.py: the average is that of the projected iterates "
                     "(checked against a numpy EMA every step), not Keras's average of "
                     "the raw ones",
}
RHO = 1.0
MASK = np.array([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1]], "float32")  # first kernel


def _parse(name):
    """'proj(adam)' -> ('proj', 'adam'); 'sgd' -> ('sgd', None)."""
    if "(" in name:
        outer, inner = name[:-1].split("(", 1)
        return outer, inner
    return name, None


def _first_layer(model):
    """The MultiOptimizer cells' groups: the first layer's variables, the rest."""
    keys = {id(v) for v in model.trainable_variables[:2]}
    return lambda v: id(v) in keys


def _first_layer_map(K, model, first, default):
    """An OptimizerMap giving ``first`` the first layer's variables (by a path
    pattern, matched whole), ``default`` the others."""
    mapping = K.optimizers.OptimizerMap(default)
    mapping[model.trainable_variables[0].path.rsplit("/", 1)[0] + "/.*"] = first
    return mapping


def _leaf(K, gk, name, model=None):
    if name == "multi":
        first = _first_layer(model)
        sgd, adam = K.optimizers.SGD(0.1), K.optimizers.Adam(0.05)
        return K.optimizers.MultiOptimizer(lambda v: sgd if first(v) else adam)
    if name == "mmap":
        return K.optimizers.MultiOptimizer(_first_layer_map(
            K, model, K.optimizers.SGD(0.1), K.optimizers.Adam(0.05)))
    if name == "sgd":
        return K.optimizers.SGD(0.1)
    if name == "adam":
        return K.optimizers.Adam(0.05)
    if name == "ema":
        return K.optimizers.Adam(0.05, use_ema=True)
    if name == "fw":
        return gk.ConditionalGradient(0.2, lambda_=3.0)
    raise KeyError(name)


def build(K, gk, name, model):
    """Our composition ``name`` for ``model``."""
    outer, inner_name = _parse(name)
    if inner_name is None:
        if name == "lm":
            return gk.LevenbergMarquardt()
        return _leaf(K, gk, name, model)
    if outer == "kacc":
        return K.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    inner = build(K, gk, inner_name, model)
    if outer == "acc":
        return gk.GradientAccumulator(inner, 2, model=model)
    if outer == "proj":
        return gk.Projected(inner, {"kernel": C.NonNeg()})
    if outer == "lagr":
        kernel = model.trainable_variables[0]
        return gk.AugmentedLagrangian(
            inner, [gk.Inequality(lambda: tf.reduce_sum(tf.square(kernel)) - 1.0)],
            dual_every=1000, initial_penalty=RHO)
    if outer == "lso":
        return K.mixed_precision.LossScaleOptimizer(inner)
    if outer == "multi":
        first, rest = _first_layer(model), K.optimizers.SGD(0.1)
        return K.optimizers.MultiOptimizer(lambda v: inner if first(v) else rest)
    if outer == "mmap":
        return K.optimizers.MultiOptimizer(_first_layer_map(K, model, inner,
                                                            K.optimizers.SGD(0.1)))
    if outer == "mask":
        return gk.MaskAware(inner, masks=[(model.trainable_variables[0], MASK)])
    if outer == "prune":  # half the first kernel, from its initial values, at step 1
        from tf_gradkit import pruning  # noqa: PLC0415
        return gk.MagnitudePruning(inner, model=model, targets=[model.trainable_variables[0]],
                                   schedule=pruning.ConstantSparsity(0.5, 1, 1, 1))
    raise KeyError(name)


def _half_mask(kernel):
    """tfmot's rule at 50%: keep the larger half of |kernel|."""
    w = np.abs(kernel.numpy())
    keep = int(np.round(np.float32(w.size) * np.float32(0.5)))
    return (w >= np.sort(w.ravel())[::-1][keep - 1]).astype("float32")


def by_hand(K, gk, name, variables, leaves):
    """``step(grads)`` doing what composition ``name`` promises, from plain
    optimizers, on ``variables``; what ends a fit goes into ``leaves``."""
    outer, inner_name = _parse(name)
    if name in ("multi", "mmap"):
        sgd, adam = K.optimizers.SGD(0.1), K.optimizers.Adam(0.05)

        def step(grads):
            sgd.apply_gradients(zip(grads[:2], variables[:2]))
            adam.apply_gradients(zip(grads[2:], variables[2:]))
        return step
    if inner_name is None:
        opt = _leaf(K, gk, name)
        leaves.append(lambda: opt.finalize_variable_values(variables))
        return lambda grads: opt.apply_gradients(zip(grads, variables))
    if outer in ("multi", "mmap"):
        first = by_hand(K, gk, inner_name, variables[:2], leaves)
        rest = K.optimizers.SGD(0.1)

        def step(grads):
            first(grads[:2])
            rest.apply_gradients(zip(grads[2:], variables[2:]))
        return step
    if outer == "kacc":
        opt = K.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        return lambda grads: opt.apply_gradients(zip(grads, variables))
    inner = by_hand(K, gk, inner_name, variables, leaves)
    kernels = [v for v in variables if "kernel" in (getattr(v, "path", None) or v.name)]

    def moved(step, grads):
        before = [v.numpy() for v in variables]
        step(grads)
        return any(not np.array_equal(b, v.numpy()) for b, v in zip(before, variables))

    if outer == "acc":
        window = []

        def step(grads):
            window.append(grads)
            if len(window) == 2:
                inner([(a + b) / 2 for a, b in zip(*window)])
                window.clear()
        return step
    if outer == "proj":
        def step(grads):
            if moved(inner, grads):
                for k in kernels:
                    k.assign(tf.maximum(k, 0.0))
        return step
    if outer == "lagr":
        def step(grads):
            with tf.GradientTape() as tape:
                g = tf.reduce_sum(tf.square(variables[0])) - 1.0
                term = 0.5 * RHO * tf.square(tf.maximum(g, 0.0))
            extra = tape.gradient(term, variables)
            inner([a if b is None else a + b for a, b in zip(grads, extra)])
        return step
    if outer == "lso":
        return inner
    if outer in ("mask", "prune"):
        mask = MASK if outer == "mask" else _half_mask(variables[0])
        if outer == "prune":  # made before the first step
            variables[0].assign(variables[0] * mask)

        def step(grads):
            grads = [grads[0] * mask] + list(grads[1:])
            if moved(inner, grads):
                variables[0].assign(variables[0] * mask)
        # After the inner optimizers' end-of-fit write (EMA averages), too.
        leaves.append(lambda: variables[0].assign(variables[0] * mask))
        return step
    raise KeyError(name)


def _cells():
    for wrapper in WRAPPERS:
        for inner in INNERS:
            yield f"{wrapper}({inner})"


@pytest.mark.parametrize("cell", list(_cells()))
def test_composition_is_exact_or_refused(K, gk, cell):
    wrapper, inner = _parse(cell)
    if (wrapper, inner) in ELSEWHERE:
        pytest.skip(ELSEWHERE[(wrapper, inner)])
    x, y = regression_data(n=32)
    model = mlp(K)
    if (wrapper, inner) in REFUSED:
        with pytest.raises(TypeError, match=REFUSED[(wrapper, inner)]):
            build(K, gk, cell, model)
        return
    if (wrapper, inner) in REFUSED_BY_KERAS:
        with pytest.raises(ValueError, match=REFUSED_BY_KERAS[(wrapper, inner)]):
            build(K, gk, cell, model)
        return
    opt = build(K, gk, cell, model)
    model.compile(optimizer=opt, loss="mse")
    if (wrapper, inner) in REFUSED_AT_FIT:
        before = weights_of(model)
        with pytest.raises(ValueError, match=REFUSED_AT_FIT[(wrapper, inner)]):
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert max_abs_diff(before, weights_of(model)) == 0
        return
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    reference = mlp(K)
    variables = reference.trainable_variables
    leaves = []
    step = by_hand(K, gk, cell, variables, leaves)
    for i in range(0, 32, 8):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(x[i:i + 8], training=True)
                                            - y[i:i + 8]))
        step(tape.gradient(loss, variables))
    for finish in leaves:  # what fit does at the end (EMA averages -> weights)
        finish()
    assert max_abs_diff(weights_of(reference), weights_of(model)) < ROUNDOFF
    assert max_abs_diff(weights_of(mlp(K)), weights_of(model)) > 1e-3  # it trained


def test_every_refusal_is_a_real_cell():
    cells = {_parse(c) for c in _cells()}
    assert {c for c in REFUSED if c[0] in WRAPPERS and c[1] in INNERS} <= cells
    assert {c for c in REFUSED_AT_FIT if c[0] in WRAPPERS and c[1] in INNERS} <= cells
    assert {c for c in REFUSED_BY_KERAS if c[0] in WRAPPERS and c[1] in INNERS} <= cells
    assert {c for c in ELSEWHERE if c[0] in WRAPPERS and c[1] in INNERS} <= cells


def test_our_wrappers_refuse_keras_options_with_advice(K, gk):
    # gradient_accumulation_steps / use_ema belong on the inner optimizer.
    for make in (lambda **kw: gk.GradientAccumulator(K.optimizers.SGD(0.1), 2, **kw),
                 lambda **kw: gk.Projected(K.optimizers.SGD(0.1),
                                           {"kernel": C.NonNeg()}, **kw)):
        for option in ({"gradient_accumulation_steps": 2}, {"use_ema": True}):
            with pytest.raises(TypeError, match=r"unexpected arguments.*inner optimizer"):
                make(**option)


@pytest.mark.distributed
@pytest.mark.parametrize("wrapper", ["acc", "proj", "lagr"])
def test_loss_scale_outside_under_mirrored_strategy_equals_one_device(K, gk, mirrored,
                                                                       wrapper):
    # What compile builds under a mixed_float16 policy: a LossScaleOptimizer
    # around our wrapper. Under MirroredStrategy the loss-scale optimizer
    # runs the inner update from a merge_call (both flavours) and tf_keras's
    # hands over already-summed gradients: still the big batch's step.
    x, y = regression_data(n=32)
    ref = mlp(K)
    ref.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    with mirrored.scope():
        model = mlp(K)
        kernel = model.trainable_variables[0]
        inner = {
            "acc": lambda: gk.GradientAccumulator(K.optimizers.SGD(0.1), 2, model=model),
            # constraints that hold already: the step is plain SGD's
            "proj": lambda: gk.Projected(K.optimizers.SGD(0.1),
                                         {"kernel": C.L2Ball(100.0)}),
            "lagr": lambda: gk.AugmentedLagrangian(
                K.optimizers.SGD(0.1),
                [gk.Inequality(lambda: tf.reduce_sum(tf.square(kernel)) - 100.0)],
                dual_every=1000),
        }[wrapper]()
        model.compile(optimizer=K.mixed_precision.LossScaleOptimizer(inner), loss="mse")
    model.fit(x, y, batch_size=8 if wrapper == "acc" else 16, epochs=1, shuffle=False,
              verbose=0)
    assert max_abs_diff(weights_of(ref), weights_of(model)) < ROUNDOFF


# One group's optimizer that would be silently wrong there, and what its
# refusal (at the first fit, before anything changes) says.
GROUP_REFUSALS = {
    # LM's fit step solves for every variable: it would train the others too.
    "lm": (lambda K, gk, model: gk.LevenbergMarquardt(model),
           r"LevenbergMarquardt cannot be one of MultiOptimizer's optimizers.*"
           r"trainable = False"),
    # "kernel" also names the second layer's kernel, which SGD updates.
    "proj": (lambda K, gk, model: gk.Projected(K.optimizers.SGD(0.1),
                                               {"kernel": C.NonNeg()}, model=model),
             r"constraints name \[.*kernel.*which this optimizer is not given.*"
             r"never be projected"),
    # The constraint reads the second layer's kernel: its gradient share lost.
    "lagr": (lambda K, gk, model: gk.AugmentedLagrangian(
        K.optimizers.SGD(0.1), [gk.Inequality(
            lambda: tf.reduce_sum(tf.square(model.trainable_variables[2])) - 1.0,
            name="norm")]),
             r"constraints \['norm'\] depend on .*not given"),
}


@pytest.mark.parametrize("name", sorted(GROUP_REFUSALS))
def test_one_groups_optimizer_that_would_be_wrong_is_refused(K, gk, name):
    if not K3:
        pytest.skip("MultiOptimizer is Keras 3's")
    make, match = GROUP_REFUSALS[name]
    x, y = regression_data(n=16)
    model = mlp(K)
    ours, first, sgd = make(K, gk, model), _first_layer(model), K.optimizers.SGD(0.1)
    model.compile(optimizer=K.optimizers.MultiOptimizer(lambda v: ours if first(v) else sgd),
                  loss="mse")
    before = weights_of(model)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(before, weights_of(model)) == 0


def test_an_accumulator_in_a_multioptimizer_counts_and_flushes_its_windows(K, gk):
    # The case: the accumulator's window must open (its model
    # binding sees through the MultiOptimizer) and its layer must move only
    # at real updates, including the epoch-end flush of a short window.
    if not K3:
        pytest.skip("MultiOptimizer is Keras 3's")
    x, y = regression_data(n=40)
    model = mlp(K)
    acc = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=4, model=model)
    first, sgd = _first_layer(model), K.optimizers.SGD(0.1)
    model.compile(optimizer=K.optimizers.MultiOptimizer(lambda v: acc if first(v) else sgd),
                  loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    # 5 micro-batches an epoch: one full window and a flushed one of 1.
    assert int(acc.iterations.numpy()) == 4 and int(acc.micro_steps.numpy()) == 10


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_an_optimizer_map_key_that_matches_nothing_is_refused(K, gk, where):
    # OptimizerMap matches keys against the whole path (re.fullmatch), so a
    # prefix like "dense/" matches no variable: the accumulator (inside) or
    # the mapped Adam (outside, under the accumulator) would never run and
    # the default optimizer would take its variables every micro-batch.
    if not K3:
        pytest.skip("MultiOptimizer is Keras 3's")
    x, y = regression_data(n=16)
    model = mlp(K)
    mapping = K.optimizers.OptimizerMap(K.optimizers.SGD(0.1))
    if where == "inside":
        acc = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2, model=model)
        mapping["dense/"] = acc
        opt = K.optimizers.MultiOptimizer(mapping)
    else:
        mapping["dense/"] = K.optimizers.Adam(0.05)
        opt = gk.GradientAccumulator(K.optimizers.MultiOptimizer(mapping), 2, model=model)
    model.compile(optimizer=opt, loss="mse")
    before = weights_of(model)
    for _ in range(2):  # and again: a refusal is not a one-off
        with pytest.raises(ValueError, match=r"key 'dense/' of its OptimizerMap matched "
                           r"no variable.*re.fullmatch"):
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(before, weights_of(model)) == 0


def test_an_accumulator_as_the_optimizer_maps_default_counts_its_windows(K, gk):
    if not K3:
        pytest.skip("MultiOptimizer is Keras 3's")
    x, y = regression_data(n=40)
    model = mlp(K)
    acc = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=4, model=model)
    mapping = K.optimizers.OptimizerMap(acc)  # the accumulator takes the first layer
    mapping[model.trainable_variables[2].path.rsplit("/", 1)[0] + "/.*"] = \
        K.optimizers.SGD(0.1)
    model.compile(optimizer=K.optimizers.MultiOptimizer(mapping), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(acc.iterations.numpy()) == 4 and int(acc.micro_steps.numpy()) == 10


def _map_under_key(K, gk, model, where, key, mapped=None):
    """``model``'s optimizer with ``key`` in an OptimizerMap (SGD the
    default): the key holds a bound GradientAccumulator ("inside"), a bound
    Projected of the first kernel ("projected"), or an Adam under a GradientAccumulator around the
    MultiOptimizer ("outside"). Returns (optimizer, the key's optimizer)."""
    mapping = K.optimizers.OptimizerMap(K.optimizers.SGD(0.1))
    if where == "inside":
        mapped = gk.GradientAccumulator(K.optimizers.SGD(0.1), steps=2, model=model)
    elif where == "projected":
        mapped = gk.Projected(K.optimizers.SGD(0.1),
                              {model.layers[0].name + "/kernel": C.NonNeg()}, model=model)
    else:
        mapped = K.optimizers.Adam(0.05)
    mapping[key] = mapped
    opt = K.optimizers.MultiOptimizer(mapping)
    if where == "outside":
        opt = gk.GradientAccumulator(opt, 2, model=model)
    return opt, mapped


@pytest.mark.parametrize("where", ["inside", "projected", "outside"])
def test_the_key_a_refusal_suggests_dispatches_that_layer(K, gk, where, mode):
    # Issue 38, item 11: a bound Projected under a key matching none of its
    # variables used to train silently (Keras never builds it), and the
    # advice ('dense/.*') matched nothing either (keys match whole paths,
    # which start with the model's name). The key suggested must give the
    # mapped optimizer exactly the layer the key named, fed back as is.
    if not K3:
        pytest.skip("MultiOptimizer is Keras 3's")
    x, y = regression_data(n=16)
    model = mlp(K)
    key = model.layers[0].name + "/"  # found in the first layer's paths, matching none
    opt, _ = _map_under_key(K, gk, model, where, key)
    model.compile(optimizer=opt, loss="mse", run_eagerly=mode == "eager",
                  jit_compile=mode == "jit")
    before = weights_of(model)
    with pytest.raises(ValueError, match=rf"key {key!r} of its OptimizerMap matched no "
                       r"variable.*re.fullmatch.*Write '") as refused:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(before, weights_of(model)) == 0
    suggested = re.search(r"Write '([^']*)'", str(refused.value)).group(1)
    first = [v.path for v in model.trainable_variables[:2]]
    # Control: the key as written takes no variable; the suggestion, the first layer's.
    paths = [v.path for v in model.trainable_variables]
    assert [p for p in paths if re.fullmatch(key, p)] == []
    assert [p for p in paths if re.fullmatch(suggested, p)] == first

    opt, mapped = _map_under_key(K, gk, model, where, suggested)
    model.compile(optimizer=opt, loss="mse", run_eagerly=mode == "eager",
                  jit_compile=mode == "jit")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert mapped.built and [v.path for v in mapped._trainable_variables] == first
    assert int(mapped.iterations.numpy()) == (1 if where != "projected" else 2)


@pytest.mark.keras_free
def test_suggested_keys_select_exactly_the_layer_the_key_names():
    # The advice is computed from the paths and checked before it is given:
    # a nested block ('enc/.*/.*' found in three paths), a key found in one
    # variable only, paths another key already takes (left out: Keras refuses
    # a path two keys match), and a key found nowhere (no advice).
    paths = ["model/enc/a/kernel", "model/enc/a/bias", "model/enc/b/kernel",
             "model/dec/kernel", "model/dec_1/kernel"]
    cases = [("enc/.*/.*", (), paths[:3]), ("enc/a/kernel", (), paths[:1]),
             ("dec", (), paths[3:]), ("dec", ("model/dec_1/kernel",), paths[3:4]),
             ("encoder/", (), None)]
    for key, taken, wanted in cases:
        got = suggested_key(key, paths, taken)
        if wanted is None:
            assert got is None
            continue
        assert not any(re.fullmatch(key, p) for p in wanted)  # control: the key fails
        assert [p for p in paths if re.fullmatch(got, p)] == wanted, (key, got)
