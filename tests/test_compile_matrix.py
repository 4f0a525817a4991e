"""The compile-option matrix (issue 38): every optimizer and wrapper of the
package crossed with Keras's own ``compile``/``fit`` options, several outputs
included, under the process's Keras flavour (`make test` runs it once per
flavour).

Each cell trains a float64 model (Keras's ``floatx`` is float64 in this
module, optimizer variables and learning rates included) through Keras and
compares its final weights with an independent oracle: the same training
done by hand, in an eager GradientTape loop that applies the algorithm's
definition with its own arithmetic (the big-batch gradient for
GradientAccumulator, ``max(kernel, 0)`` after the step for Projected, the
penalty's gradient for AugmentedLagrangian, the linear minimisation oracle
for ConditionalGradient, masks for MaskAware/MagnitudePruning) and the
option's meaning written out (sample and class weights, loss weights by
output name, each output's own loss and parameters, clipping, the learning
rate schedule's value). For LevenbergMarquardt the oracle builds the
residual vector by hand (``sqrt(loss_weight * sample_weight / width) *
(prediction - target)`` for each output, in output order) and takes each
step with ``LevenbergMarquardt.minimize`` on a separate optimizer: what is
checked is what ``fit`` makes of the compile options; the step itself has
its own by-hand tests in test_levenberg_marquardt.py. Robust losses (Huber)
under LM are checked against the same fit on an equivalent problem (see
`_lm_huber_equivalent`).

Every comparison comes with a control that must fail: the oracle with the
option ignored (or, for options that must not change the result such as
``steps_per_execution`` or ``run_eagerly``, with each epoch's batches in
reverse order) must differ from the trained weights by far more than the
tolerance. Cells the package refuses assert that the message names the
cause, and that nothing changed.

Keras 3's MultiOptimizer cells are in test_composition.py.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR
from helpers import max_abs_diff
from tf_gradkit import constraints as C
from tf_gradkit.pruning import ConstantSparsity

K3 = FLAVOUR == "keras3"

# Weights are O(1) and each run is at most 8 updates of size O(0.1), each a
# sum of at most 8 examples x 3 outputs: float64 round-off (1.1e-16 per
# operation) accumulates to ~1e-13; LevenbergMarquardt adds a linear solve
# whose condition number is below 1e4 on these 20-parameter models (1e-12).
# 1e-8 leaves room for different summation orders (on an H200 the GPU's
# reductions, in another order than the oracle's, put one LM cell 1.02e-9 from
# it after its epochs); a wrong weighting or an ignored option moves the
# weights by 1e-3 or more (each control asserts a gap of at least CONTROL_GAP,
# 1e3 times the tolerance).
TOL = 1e-8
CONTROL_GAP = 1e-5
# AugmentedLagrangian keeps its multipliers and penalty in float32 and forms
# the penalty's gradient in float32 (core.augmented_lagrangian.STATE_DTYPE),
# whatever the model's dtype: a gradient of size O(1) carries a relative error
# of 2^-24 (6e-8), and 8 updates at rate 0.1 move the weights by 5e-8 at most.
TOLERANCE = {"lagrangian": 1e-6}

N, BATCH, EPOCHS = 16, 4, 2
LR = 0.1
FW_LR, FW_RADIUS = 0.2, 2.0
RHO = 0.5
CLIP = {"clipnorm": 0.05, "clipvalue": 0.02, "global_clipnorm": 0.05}
# Exact in float32: tf_keras turns class weights into a float32 tensor.
CLASS_WEIGHT = {0: 0.25, 1: 2.0, 2: 1.5}
MASK = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0]], "float64")  # first kernel

OPTIMIZERS = ["accumulate", "projected", "lagrangian", "frank-wolfe", "lm",
              "mask-aware", "pruning"]


@pytest.fixture(scope="module", autouse=True)
def _float64(K):
    """Keras's floatx and global dtype policy float64 for this module only
    (layers, optimizer variables and learning rates), restored after it. The
    policy too: once a test has set one (mixed precision tests restore theirs
    with set_global_policy), layers follow the policy, not floatx."""
    was, policy = K.backend.floatx(), K.mixed_precision.global_policy()
    K.backend.set_floatx("float64")
    K.mixed_precision.set_global_policy("float64")
    yield
    K.mixed_precision.set_global_policy(policy)
    K.backend.set_floatx(was)


# ---------------------------------------------------------------- the data

def _data():
    rng = np.random.RandomState(7)
    x = rng.randn(N, 3)
    return {
        "x": x,
        "y1": np.tanh(x @ rng.randn(3, 1)) + 0.3 * rng.randn(N, 1),
        "y2": x @ rng.randn(3, 2) * 0.7 + 0.2 * rng.randn(N, 2),
        "classes": rng.randint(0, 3, size=(N, 1)).astype("float64"),
        "sw": rng.uniform(0.2, 2.0, size=N),
        "xv": rng.randn(8, 3),
    }


DATA = _data()


def build_model(K, outputs="single"):
    """x -> Dense(3, tanh) -> one Dense(1) output ("single"), or outputs
    ``o1`` (width 1) and ``o2`` (width 2) as a list or a dict; the weights
    are fixed by a seed (not by Keras's RNG), so every copy is the same."""
    inp = K.Input((3,))
    hidden = K.layers.Dense(3, activation="tanh", name="h")(inp)
    o1 = K.layers.Dense(1, name="o1")(hidden)
    if outputs == "single":
        out = o1
    else:
        o2 = K.layers.Dense(2, name="o2")(hidden)
        out = [o1, o2] if outputs == "list" else {"o1": o1, "o2": o2}
    model = K.Model(inp, out)
    rng = np.random.RandomState(3)
    model.set_weights([0.6 * rng.randn(*w.shape) for w in model.get_weights()])
    return model


# ------------------------------------------------------------- the options

class Cell:
    """One compile/fit option: how Keras is told, and what it means by hand.

    outputs: "single", "list" or "dict"; target: "y1" or "classes" (class
    weights need class indices); losses: per output, ("mse",) or ("huber",
    delta); loss_weights: in output order (the oracle's), and ``lw_arg``
    what compile is given; sample_weight / class_weight; clip: a name of
    `CLIP`; schedule: exponential decay of the rate by half per update;
    driver: "fit", "resume", "train_on_batch", "evaluate"; feed: "numpy",
    "pydataset", "tf.data"; compile_kw: steps_per_execution, jit_compile,
    run_eagerly; control: what the control oracle drops ("reverse": each
    epoch's batches in reverse order).
    """

    def __init__(self, outputs="single", target="y1", losses=(("mse",),),
                 loss_arg="mse", loss_weights=None, lw_arg=None, sample_weight=False,
                 class_weight=False, clip=None, schedule=False, driver="fit",
                 feed="numpy", compile_kw=None, control="reverse", validation=False):
        self.outputs, self.target, self.losses = outputs, target, tuple(losses)
        self.loss_arg, self.loss_weights, self.lw_arg = loss_arg, loss_weights, lw_arg
        self.sample_weight, self.class_weight = sample_weight, class_weight
        self.clip, self.schedule, self.driver, self.feed = clip, schedule, driver, feed
        self.compile_kw = dict(compile_kw or {})
        self.control, self.validation = control, validation

    def key(self):
        """What the oracle depends on (options that must not change the
        result share one oracle)."""
        return (self.outputs, self.target, self.losses, self.loss_weights,
                self.sample_weight, self.class_weight, self.clip, self.schedule)

    def without(self, what):
        """The control: this cell with ``what`` ignored."""
        clone = Cell.__new__(Cell)
        clone.__dict__.update(self.__dict__)
        if what == "loss_weights":
            clone.loss_weights = None
        elif what == "loss_weights_in_dict_order":  # the dict applied by position
            clone.loss_weights = tuple(self.lw_arg.values())
        elif what == "losses":  # every output's loss taken as the first one's
            clone.losses = (self.losses[0],) * len(self.losses)
        elif what in ("sample_weight", "class_weight", "schedule"):
            setattr(clone, what, False)
        elif what == "clip":
            clone.clip = None
        return clone


def _huber(delta):
    return ("huber", delta)


# Every number Keras is given is exact in float32 (loss weights, class
# weights, Huber deltas: 0.125, not 0.1): tf_keras makes a float32 tensor of
# a Python float before casting it (``tf.cast(0.1, float64)`` is
# 0.10000000149). (LevenbergMarquardt keeps loss weights in the model's dtype:
# test_lm_outputs checks 0.2 to 1e-8 relative.)
# name -> Cell. The option axis; every optimizer crosses every entry.
OPTIONS = {
    "defaults": Cell(),
    "steps_per_execution": Cell(compile_kw={"steps_per_execution": 2}),
    "jit_compile": Cell(compile_kw={"jit_compile": True}),
    "no_jit": Cell(compile_kw={"jit_compile": False}),
    "run_eagerly": Cell(compile_kw={"run_eagerly": True}),
    "sample_weight": Cell(sample_weight=True, control="sample_weight"),
    "class_weight": Cell(target="classes", class_weight=True, control="class_weight"),
    "validation_data": Cell(validation=True),
    "evaluate_mid_window": Cell(driver="evaluate"),
    "initial_epoch_resume": Cell(driver="resume"),
    "train_on_batch": Cell(driver="train_on_batch"),
    "lr_schedule": Cell(schedule=True, control="schedule"),
    "clipnorm": Cell(clip="clipnorm", control="clip"),
    "clipvalue": Cell(clip="clipvalue", control="clip"),
    "global_clipnorm": Cell(clip="global_clipnorm", control="clip"),
    "pydataset": Cell(feed="pydataset", sample_weight=True, control="sample_weight"),
    "tf_data": Cell(feed="tf.data", sample_weight=True, control="sample_weight"),
    "list_outputs": Cell(outputs="list", losses=(("mse",),) * 2),
    "dict_outputs": Cell(outputs="dict", losses=(("mse",),) * 2),
    "loss_weights_list": Cell(outputs="list", losses=(("mse",),) * 2,
                              loss_arg=["mse", "mse"], loss_weights=(0.25, 3.0), lw_arg=[0.25, 3.0],
                              control="loss_weights"),
    # By name, in the other order than the outputs: o1 weighs 0.25.
    "loss_weights_dict_by_name": Cell(
        outputs="list", losses=(("mse",),) * 2, loss_arg=["mse", "mse"], loss_weights=(0.25, 3.0),
        lw_arg={"o2": 3.0, "o1": 0.25}, control="loss_weights_in_dict_order"),
    "dict_outputs_loss_weights": Cell(
        outputs="dict", losses=(("mse",),) * 2, loss_arg={"o2": "mse", "o1": "mse"},
        loss_weights=(0.25, 3.0),
        lw_arg={"o2": 3.0, "o1": 0.25}, control="loss_weights"),
    "outputs_sample_weight": Cell(outputs="list", losses=(("mse",),) * 2,
                                  sample_weight=True, control="sample_weight"),
    "loss_per_output": Cell(outputs="list", losses=(("mse",), _huber(0.5)),
                            loss_arg=lambda K: ["mse", K.losses.Huber(0.5)],
                            control="losses"),
    "huber_per_output_delta": Cell(
        outputs="list", losses=(_huber(1.0), _huber(0.125)),
        loss_arg=lambda K: [K.losses.Huber(1.0), K.losses.Huber(0.125)], control="losses"),
}

# Cells the package refuses, with what the message must say.
LM_NO_RATE = r"LevenbergMarquardt.*unexpected arguments.*{}"
REFUSED = {
    ("lm", "lr_schedule"): LM_NO_RATE.format("learning_rate"),
    ("lm", "clipnorm"): LM_NO_RATE.format("clipnorm"),
    ("lm", "clipvalue"): LM_NO_RATE.format("clipvalue"),
    ("lm", "global_clipnorm"): LM_NO_RATE.format("global_clipnorm"),
}
# Cells whose correct behaviour is either exact or a refusal naming the
# output and why (issue 38: mixed squared/robust outputs under LM).
EXACT_OR_REFUSED = {
    ("lm", "loss_per_output"): r"output 'o2'",
}
# Cells where an option cannot change the result by the math, so no control
# can fail: Frank-Wolfe's step s = -r g / |g| does not depend on |g|.
NO_CONTROL = {("frank-wolfe", "clipnorm"), ("frank-wolfe", "global_clipnorm")}

# The default run's cells: each option once, and each optimizer on the
# options that reach its own code (several outputs, weights, clipping,
# schedules, drivers that interleave); the rest under `make test-slow`.
FAST_OPTIONS = {"defaults", "loss_weights_dict_by_name"}
FAST_CELLS = {
    ("accumulate", "evaluate_mid_window"), ("accumulate", "train_on_batch"),
    ("accumulate", "steps_per_execution"), ("accumulate", "class_weight"),
    ("accumulate", "sample_weight"),
    ("lm", "loss_per_output"), ("lm", "huber_per_output_delta"),
    ("lm", "clipnorm"), ("lm", "lr_schedule"),
    ("projected", "clipnorm"), ("projected", "pydataset"),
    ("projected", "huber_per_output_delta"),
    ("lagrangian", "clipvalue"), ("lagrangian", "tf_data"),
    ("frank-wolfe", "lr_schedule"), ("frank-wolfe", "clipvalue"),
    ("mask-aware", "jit_compile"), ("mask-aware", "run_eagerly"),
    ("pruning", "global_clipnorm"), ("pruning", "validation_data"),
    ("pruning", "initial_epoch_resume")}


# Under `make test-slow` only although its option is fast: LM's loss_weights
# by output name is checked in the default run by test_lm_outputs.py's
# `test_loss_weights_dict_is_applied_by_output_name` (eager and XLA, the same
# dict in the other order than the outputs, against residuals by hand).
SLOW_CELLS = {("lm", "loss_weights_dict_by_name")}


def _cells():
    for name in OPTIMIZERS:
        for option in OPTIONS:
            fast = ((option in FAST_OPTIONS or (name, option) in FAST_CELLS)
                    and (name, option) not in SLOW_CELLS)
            yield pytest.param(name, option, id=f"{name}-{option}",
                               marks=[] if fast else [pytest.mark.slow])


# ------------------------------------------------------------ by hand

def _targets(cell, idx):
    y1 = DATA[cell.target][idx]
    if cell.outputs == "single":
        return [y1]
    return [y1, DATA["y2"][idx]]


def _weights(cell, idx):
    """Each example's weight: its sample weight, its class's weight, or 1."""
    if cell.sample_weight:
        return DATA["sw"][idx]
    if cell.class_weight:
        return np.array([CLASS_WEIGHT[int(c)] for c in DATA["classes"][idx, 0]])
    return np.ones(len(idx))


def _outputs_in_order(model, x):
    out = model(x, training=True)
    if isinstance(out, dict):
        return [out["o1"], out["o2"]]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _elementwise(kind, e):
    if kind[0] == "mse":
        return tf.square(e)
    delta = kind[1]
    a = tf.abs(e)
    return tf.where(a <= delta, 0.5 * tf.square(e), delta * (a - 0.5 * delta))


def hand_loss(cell, model, idx):
    """Keras's compiled loss written out: sum over outputs k of
    ``lw_k * sum_i w_i * mean_j loss_k(e_ij) / batch``."""
    preds = _outputs_in_order(model, DATA["x"][idx])
    lws = cell.loss_weights or (1.0,) * len(preds)
    w = tf.constant(_weights(cell, idx))
    total = 0.0
    for pred, y, kind, lw in zip(preds, _targets(cell, idx), cell.losses, lws):
        per_example = tf.reduce_mean(_elementwise(kind, pred - y), axis=1)
        total += lw * tf.reduce_sum(w * per_example) / len(idx)
    return total


def hand_residuals(cell, model, idx):
    """LM's residuals by hand: ``sqrt(lw_k * w_i / width_k) * (pred - y)``
    per output, outputs in order (``0.5 |r|^2`` is the batch times the
    compiled mean squared error)."""
    preds = _outputs_in_order(model, DATA["x"][idx])
    lws = cell.loss_weights or (1.0,) * len(preds)
    w = _weights(cell, idx)[:, None]
    parts = []
    for pred, y, lw in zip(preds, _targets(cell, idx), lws):
        scale = np.sqrt(lw * w / pred.shape[1])
        parts.append(tf.reshape(scale * (pred - y), [-1]))
    return tf.concat(parts, axis=0)


def _clip(cell, grads):
    if cell.clip == "clipvalue":
        return [tf.clip_by_value(g, -CLIP["clipvalue"], CLIP["clipvalue"]) for g in grads]
    if cell.clip == "clipnorm":
        return [tf.clip_by_norm(g, CLIP["clipnorm"]) for g in grads]
    if cell.clip == "global_clipnorm":
        return tf.clip_by_global_norm(grads, CLIP["global_clipnorm"])[0]
    return grads


def _rate(cell, base, t):
    """The rate of update t (0-based): halved at each update under the
    schedule (ExponentialDecay(base, 1, 0.5)). Both Keras compute a
    schedule in float32 whatever floatx is (the initial rate, a Python
    float, becomes a float32 tensor): ``float32(base) * 0.5**t`` exactly,
    powers of two being exact."""
    return float(np.float32(base)) * 0.5 ** t if cell.schedule else base


def _half_mask(kernel):
    """tfmot's rule at 50%: keep the larger half of |kernel| (ties: none
    here), round(size * 0.5) entries, rounding half to even."""
    w = np.abs(kernel.numpy())
    keep = int(np.round(w.size * 0.5))
    return (w >= np.sort(w.ravel())[::-1][keep - 1]).astype("float64")


def _batches(reverse=False):
    """Each epoch's batches (index arrays), in fit's order or reversed."""
    order = [np.arange(i, i + BATCH) for i in range(0, N, BATCH)]
    order = order[::-1] if reverse else order
    return [order] * EPOCHS


def train_by_hand(K, gk, name, cell, reverse=False):
    """The oracle: final weights of ``name`` trained on ``cell`` by hand."""
    model = build_model(K, cell.outputs)
    variables = model.trainable_variables
    epochs = _batches(reverse)
    if name == "lm" and any(kind[0] == "huber" for kind in cell.losses):
        return _lm_huber_equivalent(K, gk, cell, reverse)
    if name == "lm":
        opt = gk.LevenbergMarquardt()
        for epoch in epochs:
            for idx in epoch:
                opt.minimize(lambda idx=idx: hand_residuals(cell, model, idx), variables)
        return [w.numpy() for w in model.weights]

    def grads_of(idx, extra=None):
        with tf.GradientTape() as tape:
            loss = hand_loss(cell, model, idx)
            if extra is not None:
                loss += extra()
        return tape.gradient(loss, variables)

    def sgd(grads, t):
        for v, g in zip(variables, _clip(cell, grads)):
            v.assign_sub(_rate(cell, LR, t) * g)

    t = 0
    if name == "pruning":  # half of the first kernel, before the first forward pass
        mask = _half_mask(variables[0])
        variables[0].assign(variables[0] * mask)
    for epoch in epochs:
        for j, idx in enumerate(epoch):
            if name == "accumulate":  # the window's big batch, every 2 batches
                if j % 2 == 1:
                    sgd(grads_of(np.concatenate([epoch[j - 1], idx])), t)
                    t += 1
                continue
            if name == "projected":
                sgd(grads_of(idx), t)
                for v in variables:
                    if len(v.shape) == 2:
                        v.assign(tf.maximum(v, 0.0))
            elif name == "lagrangian":  # multipliers 0 (no dual update in 8 steps)
                def penalty():
                    g = tf.reduce_sum(tf.square(variables[0])) - 1.0
                    return 0.5 * RHO * tf.square(tf.maximum(g, 0.0))
                sgd(grads_of(idx, penalty), t)
            elif name == "frank-wolfe":
                gamma = _rate(cell, FW_LR, t)
                for v, g in zip(variables, _clip(cell, grads_of(idx))):
                    s = -FW_RADIUS * g / (tf.norm(g) + 1e-7)
                    v.assign((1.0 - gamma) * v + gamma * s)
            elif name in ("mask-aware", "pruning"):
                m = MASK if name == "mask-aware" else mask
                grads = grads_of(idx)
                sgd([grads[0] * m] + list(grads[1:]), t)
                variables[0].assign(variables[0] * m)
            else:
                raise KeyError(name)
            t += 1
    return [w.numpy() for w in model.weights]


def _lm_huber_equivalent(K, gk, cell, reverse):
    """LM's oracle for robust losses: the same fit on an equivalent problem
    with one Huber delta ``D`` for every output (no per-output parameter to
    read). Keras's ``Huber_D(a e) = a^2 Huber_{D/a}(e)``, so output k with
    ``Huber(delta_k)`` becomes its head (kernel and bias) and its targets
    scaled by ``a_k = D / delta_k``, weighted ``lw_k / a_k^2``; a squared
    error is ``2 Huber_D`` while ``|e| < D`` (D = 1e3: errors here are
    below 10), ``a_k = 1``. The scaled head is a diagonal change of
    variables, which LM's Marquardt scaling (``diag(J^T J)``) leaves
    invariant, and the cost is the same function: the iterates map onto
    each other exactly, up to round-off."""
    deltas = [kind[1] for kind in cell.losses if kind[0] == "huber"]
    big = 1e3 if len(deltas) < len(cell.losses) else max(deltas)
    scales = [1.0 if kind[0] == "mse" else big / kind[1] for kind in cell.losses]
    lws = cell.loss_weights or (1.0,) * len(cell.losses)
    weights = [2.0 * lw if kind[0] == "mse" else lw / a ** 2
               for kind, lw, a in zip(cell.losses, lws, scales)]
    model = build_model(K, cell.outputs)
    heads = [("o1", scales[0]), ("o2", scales[1])]
    for layer, a in heads:
        model.get_layer(layer).set_weights([a * w for w in model.get_layer(layer).get_weights()])
    model.compile(optimizer=gk.LevenbergMarquardt(model), loss=[K.losses.Huber(big), K.losses.Huber(big)],
                  loss_weights=weights, jit_compile=False)
    sw = DATA["sw"] if cell.sample_weight else None
    for epoch in _batches(reverse):
        for idx in epoch:
            ys = [y * a for y, a in zip(_targets(cell, idx), scales)]
            model.train_on_batch(DATA["x"][idx], ys,
                                 sample_weight=None if sw is None else sw[idx])
    for layer, a in heads:
        model.get_layer(layer).set_weights([w / a for w in model.get_layer(layer).get_weights()])
    return [w.numpy() for w in model.weights]


_ORACLES = {}


def oracle(K, gk, name, cell, reverse=False):
    """`train_by_hand`, shared by every cell with the same meaning."""
    key = (name, cell.key(), reverse)
    if key not in _ORACLES:
        _ORACLES[key] = train_by_hand(K, gk, name, cell, reverse)
    return _ORACLES[key]


# ------------------------------------------------------------ through Keras

def make_optimizer(K, gk, name, cell, model):
    rate = LR if name != "frank-wolfe" else FW_LR
    kw = {}
    if cell.schedule:
        kw["learning_rate"] = K.optimizers.schedules.ExponentialDecay(rate, 1, 0.5)
    elif name != "lm":
        kw["learning_rate"] = rate
    if cell.clip:
        kw[cell.clip] = CLIP[cell.clip]
    if name == "lm":
        return gk.LevenbergMarquardt(model, **kw)
    if name == "frank-wolfe":
        return gk.ConditionalGradient(lambda_=FW_RADIUS, **kw)
    sgd = K.optimizers.SGD(**kw)
    kernel = model.trainable_variables[0]
    if name == "accumulate":
        return gk.GradientAccumulator(sgd, 2, model=model)
    if name == "projected":
        return gk.Projected(sgd, {"kernel": C.NonNeg()}, model=model)
    if name == "lagrangian":
        return gk.AugmentedLagrangian(
            sgd, [gk.Inequality(lambda: tf.reduce_sum(tf.square(kernel)) - 1.0)],
            dual_every=1000, initial_penalty=RHO)
    if name == "mask-aware":
        return gk.MaskAware(sgd, masks=[(kernel, MASK)])
    if name == "pruning":
        # The variable itself: in a Keras 3 functional model its path is
        # "h/kernel", which targets once cut to "kernel" (every kernel).
        return gk.MagnitudePruning(sgd, model=model, targets=[kernel],
                                   schedule=ConstantSparsity(0.5, 1, 1, 1))
    raise KeyError(name)


def _keras_targets(cell, idx):
    ys = _targets(cell, idx)
    if cell.outputs == "single":
        return ys[0]
    return ys if cell.outputs == "list" else {"o1": ys[0], "o2": ys[1]}


def _feed(K, cell):
    """fit's data: arrays, a PyDataset (tf_keras: Sequence) or a tf.data
    pipeline, in BATCH-sized batches, never shuffled."""
    idx = np.arange(N)
    x, y = DATA["x"], _keras_targets(cell, idx)
    sw = DATA["sw"] if cell.sample_weight else None
    if cell.feed == "numpy":
        return {"x": x, "y": y, "sample_weight": sw, "batch_size": BATCH, "shuffle": False}
    batches = []
    for i in range(0, N, BATCH):
        b = np.arange(i, i + BATCH)
        item = (x[b], _keras_targets(cell, b))
        batches.append(item + ((sw[b],) if sw is not None else ()))
    if cell.feed == "tf.data":  # a list of targets travels as a tuple
        parts = (x, tuple(y) if isinstance(y, list) else y) + ((sw,) if sw is not None else ())
        return {"x": tf.data.Dataset.from_tensor_slices(parts).batch(BATCH), "shuffle": False}
    base = K.utils.PyDataset if K3 else K.utils.Sequence

    class Batches(base):
        def __len__(self):
            return len(batches)

        def __getitem__(self, i):
            return batches[i]

    return {"x": Batches(), "shuffle": False}


def _loss_arg(K, cell):
    return cell.loss_arg(K) if callable(cell.loss_arg) else cell.loss_arg


def train_with_keras(K, gk, name, cell):
    model = build_model(K, cell.outputs)
    opt = make_optimizer(K, gk, name, cell, model)
    kw = {"jit_compile": False} if not cell.compile_kw else cell.compile_kw
    model.compile(optimizer=opt, loss=_loss_arg(K, cell), loss_weights=cell.lw_arg, **kw)
    data = _feed(K, cell)
    extra = {"class_weight": CLASS_WEIGHT} if cell.class_weight else {}
    if cell.validation:
        extra["validation_data"] = (DATA["xv"], _keras_targets(cell, np.arange(8)))
    if cell.driver == "fit":
        model.fit(**data, epochs=EPOCHS, verbose=0, **extra)
    elif cell.driver == "resume":
        model.fit(**data, epochs=1, verbose=0, **extra)
        model.fit(**data, epochs=EPOCHS, initial_epoch=1, verbose=0, **extra)
    elif cell.driver == "evaluate":  # evaluate after each odd batch: mid-window
        evaluate = K.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: (
            model.evaluate(DATA["xv"], _keras_targets(cell, np.arange(8)), verbose=0)
            if batch % 2 == 0 else None))
        model.fit(**data, epochs=EPOCHS, verbose=0, callbacks=[evaluate], **extra)
    elif cell.driver == "train_on_batch":
        for epoch in _batches():
            for idx in epoch:
                model.train_on_batch(DATA["x"][idx], _keras_targets(cell, idx))
    return [w.numpy() for w in model.weights]


# ---------------------------------------------------------------- the cells

@pytest.mark.parametrize("name,option", list(_cells()))
def test_cell_is_exact_or_refused(K, gk, name, option):
    cell = OPTIONS[option]
    if (name, option) in REFUSED:
        model = build_model(K, cell.outputs)
        before = [w.numpy() for w in model.weights]
        with pytest.raises((TypeError, ValueError), match=REFUSED[(name, option)]):
            make_optimizer(K, gk, name, cell, model)
        assert max_abs_diff(before, [w.numpy() for w in model.weights]) == 0
        return
    if (name, option) in EXACT_OR_REFUSED:
        try:
            trained = train_with_keras(K, gk, name, cell)
        except (TypeError, ValueError) as err:
            assert re.search(EXACT_OR_REFUSED[(name, option)], str(err)), str(err)
            return
    else:
        trained = train_with_keras(K, gk, name, cell)
    expected = oracle(K, gk, name, cell)
    assert np.all(np.isfinite(np.concatenate([w.ravel() for w in trained])))
    tol = TOLERANCE.get(name, TOL)
    assert max_abs_diff(expected, trained) < tol, (name, option)
    # The control: the oracle with the option ignored (or the batches in
    # another order) must be far from what Keras trained.
    assert max_abs_diff(build_model(K, cell.outputs).get_weights(), trained) > 1e-3
    if (name, option) in NO_CONTROL:
        return
    if cell.control == "reverse":
        control = oracle(K, gk, name, cell, reverse=True)
    else:
        control = oracle(K, gk, name, cell.without(cell.control))
    assert max_abs_diff(control, trained) > max(CONTROL_GAP, 100 * tol), (
        name, option, cell.control)
