"""Pruning conformance with tfmot 0.8.1 as the oracle (its own tests' scenarios).

tfmot runs in a subprocess (`tfmot_oracle.py`: its import sets
``TF_USE_LEGACY_KERAS=1``, so it needs a tf_keras process), once per session,
answering every case below; this (Keras 3) process runs ours and compares:

- (a) schedules (steps, sparsities, argument checks) and masks (magnitude,
  ties, blocks, M:N) of `tf_gradkit.core` against tfmot's classes;
- (b) training: tfmot's ``prune_low_magnitude`` on tf_keras against our
  `MagnitudePruning` on Keras 3, the same weights, data and schedule: the
  mask each forward pass uses, at every batch;
- (c) Keras 3 only: depthwise kernels left alone; custom schedules (both
  flavours) under ``fit`` and through save/load.

Documented differences are tested as such: a decreasing schedule revives
pruned (zero) weights by index where tfmot picks those its last update moved
most (same counts); blocks that tfmot's "SAME" padding shifts; M:N masks on a
schedule's steps (tfmot: always step 1); ``PolynomialDecay`` with
``begin_step == end_step`` refused (tfmot computes NaN).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR, compile_fn
from helpers import max_abs_diff, weights_of
from tf_gradkit import pruning
from tf_gradkit.core import magnitude, pruning_schedule

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ORACLE_TIMEOUT_S = 180

SHAPES = {  # the models' weights, in Keras's get_weights order (both flavours)
    "mlp": [(8, 16), (16,), (16, 4), (4,)],
    "conv": [(3, 3, 4, 8), (8,), (3, 3, 8, 1), (8,), (32, 4), (4,)],
}
INPUTS = {"mlp": (8,), "conv": (6, 6, 4)}

SCHEDULES = [  # (class, config, steps)
    ("PolynomialDecay", dict(initial_sparsity=0.2, final_sparsity=0.8, begin_step=100,
                             end_step=110, power=3, frequency=2), list(range(95, 116))),
    ("PolynomialDecay", dict(initial_sparsity=0.0, final_sparsity=0.8, begin_step=0,
                             end_step=10, power=3, frequency=2), list(range(16))),
    ("PolynomialDecay", dict(initial_sparsity=0.0, final_sparsity=0.8, begin_step=0,
                             end_step=10, power=1, frequency=3), list(range(16))),
    ("PolynomialDecay", dict(initial_sparsity=0.8, final_sparsity=0.2, begin_step=1,
                             end_step=7, power=1, frequency=2), list(range(12))),
    ("PolynomialDecay", dict(initial_sparsity=0.1, final_sparsity=0.9, begin_step=5,
                             end_step=45, power=0.5, frequency=4), list(range(60))),
    ("ConstantSparsity", dict(target_sparsity=0.5, begin_step=100, end_step=200,
                              frequency=10), [90, 99, 100, 105, 110, 200, 201, 210]),
    ("ConstantSparsity", dict(target_sparsity=0.5, begin_step=0, end_step=-1, frequency=10),
     [0, 5, 10, 10000, 100000000]),
    ("ConstantSparsity", dict(target_sparsity=0.5, begin_step=0, end_step=-1, frequency=100),
     [0, 1, 99, 100, 101, 200]),
    ("ConstantSparsity", dict(target_sparsity=0.7, begin_step=3, end_step=9, frequency=3),
     list(range(14))),
]
NAN_SCHEDULE = ("PolynomialDecay", dict(initial_sparsity=0.2, final_sparsity=0.8,
                                        begin_step=10, end_step=10, power=3, frequency=1),
                [9, 10, 11])


def _validation_cases():
    """tfmot's schedule-argument tests, as (class, positional args)."""
    cases = []
    for begin, end, frequency in [(-1, 1000, 10), (-5, 1000, 10), (0, 1000, 10), (1, 1000, 10),
                                  (100, 1000, 10), (10, -5, 10), (0, 0, 10), (0, 1, 10),
                                  (0, 100, 10), (10, 5, 10), (10, 10, 10), (10, 20, 10),
                                  (10, 1000, 0), (10, 1000, -1), (10, 1000, -5),
                                  (10, 1000, 1)]:
        cases.append(("ConstantSparsity", [0.5, begin, end, frequency]))
        cases.append(("PolynomialDecay", [0.2, 0.8, begin, end, 3, frequency]))
    for s in (-0.001, -1.0, -10.0, 1.0, 10.0, 0.0, 0.001, 0.5, 0.99):
        cases += [("ConstantSparsity", [s, 0]), ("PolynomialDecay", [s, 0.8, 0, 10]),
                  ("PolynomialDecay", [0.2, s, 0, 10])]
    cases.append(("PolynomialDecay", [0.4, 0.8, 10, -1]))
    return cases


def _pad_before(n, b):
    """Rows tfmot's "SAME" pooling pads before its first block."""
    return (-(-n // b) * b - n) // 2


def _mask_cases(rng):
    """(spec entries, weights by id): every mask case of part (a)."""
    cases, weights = [], {}

    def add(kind, w, **spec):
        case_id = f"{kind}/{len(cases)}"
        cases.append(dict(spec, id=case_id, kind=kind))
        weights[case_id] = np.asarray(w, np.float32)

    for shape in [(10,), (7, 5), (3, 4, 5), (16, 16), (2, 3, 3, 4)]:
        for s in (0.0, 0.1, 0.25, 1 / 3, 0.5, 0.8, 0.95, 0.99):
            add("magnitude", rng.randn(*shape), sparsity=s)
    add("magnitude", np.arange(1, 11), sparsity=0.200000018)   # tfmot's testConstructsMask
    add("magnitude", np.linspace(1.0, 100.0, 100), sparsity=0.5)  # testUpdateSingleMask
    for s in (0.3, 0.5, 0.7):  # ties at a positive threshold: all kept
        add("magnitude", rng.permutation(np.repeat(np.arange(1.0, 6.0), 3)), sparsity=s)
    w = rng.randn(20)
    w[rng.permutation(20)[:12]] = 0.0
    add("zeros", w, sparsity=0.2)   # 8 non-zero, 16 kept: the documented difference
    add("tfmot_block", [[0.1, 0.1, 0.2, 0.2], [0.1, 0.1, 0.2, 0.2], [0.3, 0.3, 0.4, 0.4],
                        [0.3, 0.3, 0.4, 0.4]], sparsity=0.5, block=[2, 2], pooling="AVG")
    add("tfmot_block", [[0.1, 0.0, 0.2, 0.0], [0.0, -0.1, 0.0, -0.2], [0.3, 0.0, 0.4, 0.0],
                        [0.0, -0.3, 0.0, -0.4]], sparsity=0.5, block=[2, 2], pooling="MAX")
    for rows in (4, 5, 7, 10):
        for cols in (4, 5, 7, 10):
            for block in ((2, 2), (3, 3), (1, 3), (4, 2), (3, 1), (2, 3)):
                for pooling in ("AVG", "MAX"):
                    add("block", rng.randn(rows, cols), block=list(block), pooling=pooling,
                        sparsity=0.5 if pooling == "AVG" else 0.3)
    for shape in [(4, 3), (8, 5), (6, 2), (5, 4), (3, 3), (3, 3, 4, 8), (1, 1, 8, 2),
                  (2, 2, 6, 3)]:
        for m_by_n in ((2, 4), (1, 4), (3, 4), (1, 2), (2, 3), (4, 8)):
            add("m_by_n", rng.randn(*shape), m_by_n=list(m_by_n))
    return cases, weights


def _schedule_spec(cls, **config):
    return {"class": cls, "config": config}


POLY_UP = _schedule_spec("PolynomialDecay", initial_sparsity=0.0, final_sparsity=0.8,
                         begin_step=0, end_step=10, power=3, frequency=2)
SCENARIOS = [
    dict(name="poly_up", model="mlp", schedule=POLY_UP, batches=14),
    dict(name="const_every10", model="mlp", batches=19,
         schedule=_schedule_spec("ConstantSparsity", target_sparsity=0.5, begin_step=0,
                                 end_step=-1, frequency=10)),
    dict(name="const_default", model="mlp", schedule=None, batches=12),
    dict(name="const_window", model="mlp", batches=12,
         schedule=_schedule_spec("ConstantSparsity", target_sparsity=0.6, begin_step=3,
                                 end_step=9, frequency=3)),
    dict(name="poly_down", model="mlp", batches=10,
         schedule=_schedule_spec("PolynomialDecay", initial_sparsity=0.8, final_sparsity=0.2,
                                 begin_step=1, end_step=7, power=1, frequency=2)),
    dict(name="block22_avg", model="mlp", batches=10, block=[2, 2], pooling="avg",
         schedule=_schedule_spec("PolynomialDecay", initial_sparsity=0.0,
                                 final_sparsity=0.75, begin_step=0, end_step=8, power=3,
                                 frequency=2)),
    dict(name="block42_max", model="mlp", batches=10, block=[4, 2], pooling="max",
         schedule=_schedule_spec("PolynomialDecay", initial_sparsity=0.0,
                                 final_sparsity=0.75, begin_step=0, end_step=8, power=3,
                                 frequency=2)),
    dict(name="mbyn_default", model="conv", schedule=None, batches=6, m_by_n=[2, 4]),
    dict(name="mbyn_schedule", model="mlp", batches=8, m_by_n=[2, 4],
         schedule=_schedule_spec("ConstantSparsity", target_sparsity=0.5, begin_step=3,
                                 end_step=-1, frequency=3)),
    dict(name="conv_poly", model="conv", batches=8,
         schedule=_schedule_spec("PolynomialDecay", initial_sparsity=0.0, final_sparsity=0.7,
                                 begin_step=0, end_step=6, power=3, frequency=2)),
]
for _case in SCENARIOS:
    _case.setdefault("block", [1, 1])
    _case.setdefault("pooling", "avg")
    _case.setdefault("m_by_n", None)
    _case.setdefault("lr", 0.01)
_BY_NAME = {case["name"]: case for case in SCENARIOS}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """tfmot's answers to every case (a subprocess, bounded in time), with
    the inputs both sides use."""
    if FLAVOUR != "keras3":
        pytest.skip("the tfmot oracle is compared in the Keras 3 process")
    try:
        import importlib.util  # noqa: PLC0415
        if importlib.util.find_spec("tensorflow_model_optimization") is None:
            pytest.skip("tensorflow-model-optimization is not installed")
    except ValueError:
        pytest.skip("tensorflow-model-optimization is not installed")
    rng = np.random.RandomState(0)
    masks, inputs = _mask_cases(rng)
    for kind, shapes in SHAPES.items():
        inputs[f"init/{kind}/count"] = np.array(len(shapes))
        for i, shape in enumerate(shapes):
            inputs[f"init/{kind}/{i}"] = (rng.randn(*shape) * 0.5).astype(np.float32)
        n = 8 * max(case["batches"] for case in SCENARIOS if case["model"] == kind)
        inputs[f"x/{kind}"] = rng.randn(n, *INPUTS[kind]).astype(np.float32)
        inputs[f"y/{kind}"] = rng.randn(n, 4).astype(np.float32)
    spec = {"schedules": [dict(zip(("class", "config", "steps"), s))
                          for s in SCHEDULES + [NAN_SCHEDULE]],
            "validation": [dict(zip(("class", "args"), c)) for c in _validation_cases()],
            "masks": masks, "scenarios": SCENARIOS}
    folder = tmp_path_factory.mktemp("tfmot_oracle")
    (folder / "spec.json").write_text(json.dumps(spec))
    np.savez(folder / "inputs.npz", **inputs)
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([_ROOT] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run(
        [sys.executable, os.path.join(_ROOT, "tests", "tfmot_oracle.py"),
         str(folder / "spec.json"), str(folder / "inputs.npz"), str(folder / "out.npz")],
        env=env, capture_output=True, text=True, timeout=_ORACLE_TIMEOUT_S, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    answers = dict(np.load(folder / "out.npz"))
    # The scenarios' expectations are tfmot 0.8.1's behaviour: another tfmot
    # (0.8.0, as TF 2.16 and 2.18 rows install under `make test-compat`) is
    # not that oracle, so its cases skip there, saying so.
    if str(answers["versions"][0]) != "0.8.1":
        pytest.skip(f"the oracle is tfmot 0.8.1; this environment has tfmot "
                    f"{answers['versions'][0]}")
    return {"answers": answers, "inputs": inputs, "masks": masks}


# ---------------------------------------------------------- (a) schedules
@pytest.mark.keras_free
def test_schedules_equal_tfmots_at_every_step(oracle):
    answers = oracle["answers"]
    for i, (cls, config, steps) in enumerate(SCHEDULES):
        ours = getattr(pruning_schedule, cls)(**config)
        due = [bool(ours.should_prune(step)) for step in steps]
        sparsity = np.array([float(ours.sparsity(tf.constant(step, tf.int64)))
                             for step in steps], np.float32)
        assert due == answers[f"schedule/{i}/due"].tolist(), (cls, config)
        # The same float32 operations: at most one float32 rounding apart.
        np.testing.assert_allclose(sparsity, answers[f"schedule/{i}/sparsity"],
                                   rtol=0, atol=1e-7, err_msg=str((cls, config)))


@pytest.mark.keras_free
def test_tfmots_own_polynomial_values():
    # tfmot's testPolynomialDecay_PrunesCorrectly: 0.2, 0.4928, 0.725, 0.8.
    s = pruning.PolynomialDecay(0.2, 0.8, 100, 110, 3, 2)
    got = [float(s.sparsity(tf.constant(step, tf.int64))) for step in (100, 102, 105, 110)]
    np.testing.assert_allclose(got, [0.2, 0.4928, 0.725, 0.8], atol=1e-6)


@pytest.mark.keras_free
def test_argument_checks_refuse_what_tfmot_refuses(oracle):
    raised_theirs = oracle["answers"]["validation/raised"].tolist()
    differences = []
    for (cls, args), theirs in zip(_validation_cases(), raised_theirs):
        try:
            getattr(pruning_schedule, cls)(*args)
            ours = False
        except ValueError:
            ours = True
        if ours != theirs:
            differences.append((cls, tuple(args), ours))
    # The one documented difference: PolynomialDecay with begin == end.
    assert differences == [("PolynomialDecay", (0.2, 0.8, 0, 0, 3, 10), True),
                           ("PolynomialDecay", (0.2, 0.8, 10, 10, 3, 10), True)]


@pytest.mark.keras_free
def test_equal_begin_and_end_is_refused_where_tfmot_computes_nan(oracle):
    index = len(SCHEDULES)
    assert np.isnan(oracle["answers"][f"schedule/{index}/sparsity"][1])  # at step 10
    with pytest.raises(ValueError, match="end_step"):
        pruning.PolynomialDecay(**NAN_SCHEDULE[1])


# --------------------------------------------------------------- (a) masks
def _ours(case, weights):
    if case["kind"] == "m_by_n":
        return magnitude.m_by_n_mask(weights, *case["m_by_n"]).numpy()
    return magnitude.magnitude_mask(weights, case["sparsity"], tuple(case.get("block", (1, 1))),
                                    case.get("pooling", "avg").lower()).numpy()


def _block_reference(w, block, pooling, sparsity, offsets):
    """A block mask by hand: block (i, j) decided by the magnitudes of rows
    ``[i*bh - pr, (i+1)*bh - pr)`` (columns alike) and masking rows
    ``[i*bh, (i+1)*bh)``."""
    a = np.abs(w.astype(np.float64))
    (rows, cols), (bh, bw), (pr, pc) = w.shape, block, offsets
    nr, nc = -(-rows // bh), -(-cols // bw)
    pooled = np.empty((nr, nc))
    for i in range(nr):
        for j in range(nc):
            part = a[max(i * bh - pr, 0):min((i + 1) * bh - pr, rows),
                     max(j * bw - pc, 0):min((j + 1) * bw - pc, cols)]
            pooled[i, j] = part.max() if pooling == "MAX" else part.mean()
    kept = max(int(np.round(np.float32(nr * nc) * (np.float32(1) - np.float32(sparsity)))), 1)
    threshold = np.sort(pooled.ravel())[::-1][kept - 1]
    return np.kron(pooled >= threshold, np.ones(block))[:rows, :cols]


@pytest.mark.keras_free
def test_masks_equal_tfmots(oracle):
    answers, inputs = oracle["answers"], oracle["inputs"]
    compared = 0
    for case in oracle["masks"]:
        if case["kind"] not in ("magnitude", "m_by_n", "tfmot_block"):
            continue
        w = inputs[case["id"]]
        np.testing.assert_array_equal(_ours(case, w), answers[f"mask/{case['id']}"],
                                      err_msg=str({k: v for k, v in case.items()}))
        compared += 1
    assert compared == 40 + 2 + 3 + 2 + 48


@pytest.mark.keras_free
def test_tfmots_own_mask_expectations():
    # testConstructsMaskAndThresholdCorrectly, testUpdateSingleMask, block tests.
    mask = magnitude.magnitude_mask(np.arange(1.0, 11.0, dtype=np.float32), 0.200000018)
    np.testing.assert_array_equal(mask.numpy(), [0, 0] + [1] * 8)
    mask = magnitude.magnitude_mask(np.linspace(1.0, 100.0, 100).astype(np.float32), 0.5)
    assert int(np.count_nonzero(mask.numpy())) == 50
    w = np.array([[0.1, 0.1, 0.2, 0.2], [0.1, 0.1, 0.2, 0.2], [0.3, 0.3, 0.4, 0.4],
                  [0.3, 0.3, 0.4, 0.4]], np.float32)
    for pooling in ("avg", "max"):
        mask = magnitude.magnitude_mask(w, 0.5, (2, 2), pooling).numpy()
        np.testing.assert_array_equal(mask, [[0] * 4] * 2 + [[1] * 4] * 2)


@pytest.mark.keras_free
def test_conditional_mask_updates_follow_a_schedule_table():
    # tfmot's testConditionalMaskUpdate, in our parts: a custom schedule
    # pruning every step at a table's sparsity; zeros at steps 1, 3, 5.
    class Table(pruning.PruningSchedule):
        def __init__(self):
            super().__init__(begin_step=0, end_step=-1, frequency=1)

        def sparsity(self, step):
            table = tf.constant([0.0, 0.1, 0.1, 0.3, 0.3, 0.5, 0.5, 0.5, 0.5, 0.5])
            return tf.gather(table, step)

        def get_config(self):
            return {}

    schedule, w = Table(), np.linspace(1.0, 100.0, 100).astype(np.float32)
    counts = []
    for step in range(10):
        due, sparsity = schedule(tf.constant(step, tf.int64))
        if bool(due):
            w = w * magnitude.magnitude_mask(w, sparsity).numpy()
        counts.append(int(np.count_nonzero(w)))
    assert counts == [100, 90, 90, 70, 70, 50, 50, 50, 50, 50]


@pytest.mark.keras_free
def test_zero_ties_keep_exactly_k_where_tfmot_keeps_every_zero(oracle):
    # Documented difference: fewer non-zeros than k (pruned weights are
    # exactly zero here, moved by an update in tfmot): exactly k kept, every
    # non-zero and the zeros of lowest index; tfmot keeps all the ties.
    case = next(c for c in oracle["masks"] if c["kind"] == "zeros")
    w = oracle["inputs"][case["id"]]
    assert oracle["answers"][f"mask/{case['id']}"].min() == 1.0   # tfmot: everything
    ours = _ours(case, w)
    kept = int(magnitude.kept_count(20, 0.2))
    assert kept == 16 and int(ours.sum()) == kept
    zeros = np.flatnonzero(w == 0)
    np.testing.assert_array_equal(ours[w != 0], 1.0)
    np.testing.assert_array_equal(ours[zeros[:kept - 8]], 1.0)
    np.testing.assert_array_equal(ours[zeros[kept - 8:]], 0.0)


@pytest.mark.keras_free
def test_block_masks_equal_tfmots_unless_its_padding_shifts_the_blocks(oracle):
    answers, inputs = oracle["answers"], oracle["inputs"]
    # tfmot raises where the blocks form one row or column (it squeezes the
    # pooled magnitudes to 1-D); ours is checked against the reference there.
    equal = shifted = refused = 0
    for case in oracle["masks"]:
        if case["kind"] != "block":
            continue
        w, block = inputs[case["id"]], tuple(case["block"])
        offsets = tuple(_pad_before(n, b) for n, b in zip(w.shape, block))
        ours = _ours(case, w)
        message = str((w.shape, block, case["pooling"], offsets))
        # Ours: each block decided by the rows it masks.
        np.testing.assert_array_equal(
            ours, _block_reference(w, block, case["pooling"], case["sparsity"], (0, 0)),
            err_msg=message)
        if f"refused/{case['id']}" in answers:  # one row or column of blocks
            assert min(-(-n // b) for n, b in zip(w.shape, block)) == 1, message
            refused += 1
            continue
        theirs = answers[f"mask/{case['id']}"]
        # tfmot's: decided by rows shifted by its padding, masking from row 0.
        np.testing.assert_array_equal(
            theirs, _block_reference(w, block, case["pooling"], case["sparsity"], offsets),
            err_msg=message)
        if offsets == (0, 0):
            np.testing.assert_array_equal(ours, theirs, err_msg=message)
            equal += 1
        else:
            shifted += 1
    assert equal >= 60 and shifted >= 80 and refused <= 40, (equal, shifted, refused)


# ------------------------------------------------------------ (b) training
def _keras_model(K, kind, weights):
    L = K.layers
    if kind == "mlp":
        model = K.Sequential([K.Input((8,)), L.Dense(16, activation="relu", name="d1"),
                              L.Dense(4, name="d2")])
    else:
        model = K.Sequential([K.Input((6, 6, 4)), L.Conv2D(8, 3, activation="relu", name="c1"),
                              L.DepthwiseConv2D(3, name="dw"), L.Flatten(),
                              L.Dense(4, name="d2")])
    model.set_weights(weights)
    return model


def _our_schedule(spec):
    if spec is None:
        return None
    return getattr(pruning, spec["class"])(**spec["config"])


def _key(opt, variable):
    path = opt._path(variable).split(":")[0]  # pylint: disable=protected-access
    return "/".join(path.split("/")[-2:])


def _our_masks(K, gk, oracle, name, loop=None):
    """Our masks after every batch of scenario ``name`` (Keras 3), by
    ``layer/weight``: ``fit`` (model=), or ``loop`` (a compile mode) for a
    custom GradientTape loop."""
    case, inputs = _BY_NAME[name], oracle["inputs"]
    weights = [inputs[f"init/{case['model']}/{i}"] for i in range(len(SHAPES[case["model"]]))]
    model = _keras_model(K, case["model"], weights)
    opt = gk.MagnitudePruning(
        K.optimizers.SGD(case["lr"]), model=model, schedule=_our_schedule(case["schedule"]),
        block_size=tuple(case["block"]), block_pooling=case["pooling"],
        m_by_n=None if case["m_by_n"] is None else tuple(case["m_by_n"]))
    masks = {}

    def record():
        for variable, mask in opt._table().values():  # pylint: disable=protected-access
            masks.setdefault(_key(opt, variable), []).append(
                np.asarray(mask.numpy(), np.float32))

    x = inputs[f"x/{case['model']}"][:8 * case["batches"]]
    y = inputs[f"y/{case['model']}"][:8 * case["batches"]]
    if loop is None:
        class Record(K.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                record()

        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[Record()])
    else:
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))

        step = compile_fn(step, loop)
        for i in range(0, len(x), 8):
            step(x[i:i + 8], y[i:i + 8])
            record()
    return {key: np.stack(values) for key, values in masks.items()}, model


def _theirs(oracle, name):
    answers = oracle["answers"]
    keys = answers[f"scenario/{name}/keys"].tolist()
    return {key: answers[f"scenario/{name}/{key}"] for key in keys}


@pytest.mark.skipif(FLAVOUR != "keras3", reason="our Keras 3 side (tf_keras: "
                    "test_magnitude_pruning::test_tfmot_equivalence)")
@pytest.mark.parametrize("name", ["poly_up", "const_every10", "const_default",
                                  "const_window", "block22_avg", "block42_max",
                                  "mbyn_default", "conv_poly"])
def test_masks_equal_tfmots_at_every_batch(K, gk, oracle, name):
    ours, _ = _our_masks(K, gk, oracle, name)
    theirs = _theirs(oracle, name)
    assert sorted(ours) == sorted(theirs)   # the same weights pruned (no depthwise)
    for key, masks in theirs.items():
        assert ours[key].shape == masks.shape == (_BY_NAME[name]["batches"],) + \
            masks.shape[1:], key
        for batch, (a, b) in enumerate(zip(ours[key], masks), start=1):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} {key} batch {batch}")


@pytest.mark.skipif(FLAVOUR != "keras3", reason="our Keras 3 side")
def test_sparsity_is_tfmots_at_every_batch_and_at_the_end_of_fit(K, gk, oracle):
    # The off-by-one: ConstantSparsity every 10 steps prunes at batch 10,
    # not after batch 9; after 19 batches both have step 10's masks.
    ours, _ = _our_masks(K, gk, oracle, "const_every10")
    theirs = _theirs(oracle, "const_every10")
    for key in theirs:
        zeros = [int((m == 0).sum()) for m in ours[key]]
        assert zeros == [int((m == 0).sum()) for m in theirs[key]]
        assert zeros[:9] == [0] * 9 and min(zeros[9:]) > 0, zeros


@pytest.mark.skipif(FLAVOUR != "keras3", reason="our Keras 3 side")
@pytest.mark.parametrize("loop", ["eager", "jit"])
def test_custom_loop_sparsity_is_tfmots_at_every_batch(K, gk, oracle, loop):
    # In a custom loop step k's masks are made in apply_gradients (before
    # update k; the forward pass used step k - 1's): the same counts.
    ours, _ = _our_masks(K, gk, oracle, "poly_up", loop=loop)
    theirs = _theirs(oracle, "poly_up")
    for key in theirs:
        assert [int((m == 0).sum()) for m in ours[key]] == \
            [int((m == 0).sum()) for m in theirs[key]], key


@pytest.mark.skipif(FLAVOUR != "keras3", reason="our Keras 3 side")
def test_decreasing_schedule_revives_as_many_weights_as_tfmot(K, gk, oracle):
    # 0.8, 0.6, 0.4, 0.2 in both (not 0.8 then nothing); the 20% kept first
    # stay kept in both (ours keeps every weight it kept); which pruned
    # weights come back differs (documented).
    ours, _ = _our_masks(K, gk, oracle, "poly_down")
    theirs = _theirs(oracle, "poly_down")
    for key in theirs:
        size = theirs[key][0].size
        zeros = [int((m == 0).sum()) for m in ours[key]]
        assert zeros == [int((m == 0).sum()) for m in theirs[key]], key
        fractions = sorted({round(z / size, 1) for z in zeros}, reverse=True)
        assert fractions == [0.8, 0.6, 0.4, 0.2], (key, zeros)
        for masks in (ours[key], theirs[key]):
            first = masks[0] == 1
            assert all(np.all(m[first] == 1) for m in masks), key
        for before, after in zip(ours[key][:-1], ours[key][1:]):
            assert np.all(after[before == 1] == 1), key


@pytest.mark.skipif(FLAVOUR != "keras3", reason="our Keras 3 side")
def test_m_by_n_follows_the_schedules_steps_where_tfmot_prunes_at_step_one(K, gk, oracle):
    # Documented difference: tfmot makes the M:N masks at step 1 whatever the
    # schedule; ours at the schedule's steps (3, 6, ...), and recomputing from
    # the pruned weights gives the same masks.
    ours, _ = _our_masks(K, gk, oracle, "mbyn_schedule")
    theirs = _theirs(oracle, "mbyn_schedule")
    for key in theirs:
        assert all(np.array_equal(m, theirs[key][0]) for m in theirs[key])
        assert (theirs[key][0] == 0).sum() * 2 == theirs[key][0].size   # 2 of 4 from batch 1
        assert ours[key][0].min() == ours[key][1].min() == 1.0          # dense until step 3
        assert all(np.array_equal(m, ours[key][2]) for m in ours[key][2:])
        groups = np.transpose(ours[key][2]).reshape(-1, 4)
        np.testing.assert_array_equal(groups.sum(axis=1), 2.0)


# ------------------------------------------------------ (c) Keras 3 and both
def _conv_family(K):
    L = K.layers
    return K.Sequential([K.Input((8, 8, 4)), L.Conv2D(4, 3, name="c"),
                         L.DepthwiseConv2D(3, name="dw"),
                         L.SeparableConv2D(8, 3, name="sep"), L.Flatten(),
                         L.Dense(4, name="d")])


@pytest.mark.parametrize("m_by_n", [None, (2, 4)])
def test_depthwise_kernels_are_left_alone(K, gk, m_by_n):
    # Keras 3 names DepthwiseConv2D's kernel `kernel`; tfmot prunes none of
    # its weights, nor SeparableConv's depthwise kernel: by layer kind.
    model = _conv_family(K)
    opt = gk.MagnitudePruning(K.optimizers.SGD(0.01), model=model, m_by_n=m_by_n,
                              schedule=pruning.ConstantSparsity(0.5, 0, frequency=1)
                              if m_by_n is None else None)
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.RandomState(0)
    model.fit(rng.randn(16, 8, 8, 4).astype("float32"), rng.randn(16, 4).astype("float32"),
              batch_size=8, verbose=0)
    pruned = sorted(_key(opt, v) for v, _ in opt._table().values())  # pylint: disable=protected-access
    assert pruned == ["c/kernel", "d/kernel", "sep/pointwise_kernel"]
    for layer in model.layers[1:3]:   # dw, sep: no zero in a depthwise kernel
        depthwise = layer.weights[0]
        assert int(np.count_nonzero(depthwise.numpy() == 0)) == 0, layer.name


@pytest.mark.skipif(FLAVOUR != "keras3", reason="DepthwiseConv1D names its kernel "
                    "`kernel` in Keras 3 only")
def test_depthwise_conv1d_kernel_is_left_alone_after_attach(K, gk):
    L = K.layers
    model = K.Sequential([K.Input((10, 3)), L.DepthwiseConv1D(3, name="dw1"),
                          L.Conv1D(4, 3, name="c1"), L.Flatten(), L.Dense(2, name="d")])
    opt = gk.MagnitudePruning(K.optimizers.SGD(0.01)).attach(model)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((8, 10, 3), "float32"), np.ones((8, 2), "float32"), verbose=0)
    pruned = sorted(_key(opt, v) for v, _ in opt._table().values())  # pylint: disable=protected-access
    assert pruned == ["c1/kernel", "d/kernel"]


@pytest.mark.skipif(FLAVOUR != "keras3", reason="only Keras 3 names a depthwise kernel "
                    "`kernel`")
def test_conv_kernels_without_the_model_are_refused_with_what_to_do(K, gk):
    model = _conv_family(K)
    with pytest.raises(ValueError, match=r"without the model.*Pass model=.*/c/kernel'"):
        gk.MagnitudePruning(K.optimizers.SGD(0.01)).build(model.trainable_variables)
    model.compile(optimizer=gk.MagnitudePruning(K.optimizers.SGD(0.01)), loss="mse")
    with pytest.raises(ValueError, match="Pass model="):
        model.fit(np.ones((8, 8, 8, 4), "float32"), np.ones((8, 4), "float32"), verbose=0)
    named = gk.MagnitudePruning(K.optimizers.SGD(0.01), targets=["c/kernel", "d/kernel"])
    named.build(model.trainable_variables)   # named targets need no model
    assert sorted(_key(named, v) for v, _ in named._table().values()) == \
        ["c/kernel", "d/kernel"]  # pylint: disable=protected-access


class StepSparsity(pruning.PruningSchedule):
    """A custom schedule: ``low`` until ``switch``, then ``high``, masks
    every ``frequency`` steps."""

    def __init__(self, low=0.25, high=0.75, switch=4, frequency=2):
        super().__init__(begin_step=0, end_step=-1, frequency=frequency)
        self.low, self.high, self.switch = low, high, switch

    def sparsity(self, step):
        return tf.where(step >= self.switch, self.high, self.low)

    def get_config(self):
        return {"low": self.low, "high": self.high, "switch": self.switch,
                "frequency": self.frequency}


def _mlp(K, seed=1):
    model = K.Sequential([K.Input((8,)), K.layers.Dense(16, activation="relu", name="d1"),
                          K.layers.Dense(4, name="d2")])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                       for w in model.get_weights()])
    return model


def test_custom_schedule_under_fit_and_through_save_and_load(K, gk, tmp_path):
    assert pruning.PruningSchedule is pruning_schedule.PruningSchedule
    assert pruning_schedule.deserialize(pruning_schedule.serialize(StepSparsity(0.1))) \
        .get_config() == StepSparsity(0.1).get_config()
    rng = np.random.RandomState(0)
    x, y = rng.randn(64, 8).astype("float32"), rng.randn(64, 4).astype("float32")

    def make():
        model = _mlp(K)
        model.compile(optimizer=gk.MagnitudePruning(K.optimizers.Adam(0.01), model=model,
                                                    schedule=StepSparsity()), loss="mse")
        return model

    full, stopped = make(), make()
    zeros = []

    class Count(K.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            zeros.append(int((full.layers[0].kernel.numpy() == 0).sum()))

    full.fit(x[:40], y[:40], batch_size=8, shuffle=False, verbose=0, callbacks=[Count()])
    # 128 weights: steps 1, 2, 3 (masks at 2 only: steps 0, 2, 4...) at 25%;
    # step 4 switches to 75%: round(128 * 0.25) kept = 32, 96 zeros.
    assert zeros == [0, 32, 32, 96, 96], zeros
    stopped.fit(x[:40], y[:40], batch_size=8, shuffle=False, verbose=0)
    stopped.save(str(tmp_path / "m.keras"))
    loaded = K.models.load_model(str(tmp_path / "m.keras"))
    assert isinstance(loaded.optimizer.schedule, StepSparsity)
    assert loaded.optimizer.schedule.get_config() == StepSparsity().get_config()
    for model in (full, loaded):
        model.fit(x[40:], y[40:], batch_size=8, shuffle=False, verbose=0)
    assert max_abs_diff(weights_of(full), weights_of(loaded)) == 0


@pytest.mark.keras_free
def test_unknown_schedule_class_is_refused_on_load_with_what_to_do():
    with pytest.raises(ValueError, match="Unknown pruning schedule class 'Nope'.*custom_objects"):
        pruning_schedule.deserialize({"class_name": "Nope", "config": {}})
    got = pruning_schedule.deserialize({"class_name": "Mine", "config": {}}, {"Mine": _Mine})
    assert isinstance(got, _Mine)


class _Mine(pruning_schedule.PruningSchedule):
    def __init__(self):
        super().__init__(0, -1, 1)

    def sparsity(self, step):
        del step
        return tf.constant(0.5)

    def get_config(self):
        return {}
