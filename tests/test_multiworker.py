"""MultiWorkerMirroredStrategy: two worker processes on loopback.

One launch per flavour (`multiworker.launch`, bounded in time) trains every
case of `multiworker_cases` on two workers, under ``fit`` and a custom
``strategy.run`` loop, with `tf_gradkit.distribute.MultiWorkerMirroredStrategy`
(Keras 3's ``fit`` fails under TensorFlow's own: see that module). Here:

- both workers end with the same weights and counters, bit for bit;
- each case equals one process: an accumulation window of 4 global batches
  of 16 equals plain SGD on the batch of 64 (token-averaged losses too);
  Projected, AugmentedLagrangian, MaskAware and plain SGD equal the same
  optimizer on one process with batches of 16; LM's step equals one
  process's within the bound its condition number gives (the all-reduce
  sums J^T J in another order);
- communication, counted by an op beside every all-reduce: one gradient's
  worth per accumulation window (plain data parallelism: one per batch),
  and LM's J^T J and J^T r reduced once per step.
"""

import os

import numpy as np
import pytest

import multiworker
from conftest import FLAVOUR
from helpers import ROUNDOFF, MATMUL_UNIT, max_abs_diff
from multiworker_cases import CASES, DATA, GLOBAL_BATCH, compiled_loss

pytestmark = pytest.mark.multiworker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiworker_worker.py")
NAMES = sorted(n for n in CASES if CASES[n]["reference"] is not None and (
    FLAVOUR == "tf_keras" or not n.startswith("mask")))
BIG = 64  # one accumulation window: 4 global batches of 16


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("multiworker"))
    return multiworker.launch(WORKER, NAMES, out, timeout=400)


def _weights(run, name):
    count = sum(1 for k in run if k.startswith(f"{name}/w"))
    return [run[f"{name}/w{i}"] for i in range(count)]


def _one_process(K, gk, name):
    """The weights one process reaches for case ``name`` (module doc)."""
    case = CASES[name]
    x, y = DATA[case.get("data", "regression")]()
    model = case["model"](K)
    big = case["reference"] == "big"
    if big:
        lr = float(case["optimizer"](K, gk, case["model"](K)).inner_optimizer.learning_rate)
        opt = K.optimizers.SGD(lr)
    else:
        opt = case["optimizer"](K, gk, model)
    model.compile(optimizer=opt, loss=compiled_loss(K, case))
    batch = BIG if big else case.get("batch", GLOBAL_BATCH)
    model.fit(x, y, batch_size=batch, epochs=case["epochs"], shuffle=False, verbose=0)
    return model


def test_both_workers_hold_the_same_weights_and_counters(runs):
    first, second = runs
    assert sorted(first) == sorted(second)
    for key in first:
        if not key.endswith("/seconds"):  # wall time: each worker's own
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("lm")])
def test_two_workers_equal_one_process(K, gk, runs, name):
    start = [w.copy() for w in CASES[name]["model"](K).get_weights()]
    reference = _one_process(K, gk, name).get_weights()
    assert max_abs_diff(start, reference) > 1e-3  # it trained
    assert max_abs_diff(reference, _weights(runs[0], name)) < ROUNDOFF
    if name.startswith(("acc", "tokens")):
        assert int(runs[0][f"{name}/iterations"]) == 2  # windows of 4 global batches
        assert int(runs[0][f"{name}/micro_steps"]) == 8


@pytest.mark.parametrize("name", ["lm-fit", "lm-loop"])
def test_lm_step_on_two_workers_equals_one_process(K, gk, runs, name):
    # J^T J and J^T r are summed per worker, then across workers: the step
    # differs from one process's by round-off in that sum, amplified at
    # most by the condition of the Jacobi-scaled damped matrix
    # (test_levenberg_marquardt.py's MirroredStrategy test derives the bound).
    from test_levenberg_marquardt import _damped_system  # noqa: PLC0415

    x, y = DATA["regression"]()
    case = CASES[name]
    model = case["model"](K)
    model.compile(optimizer=case["optimizer"](K, gk, model), loss="mse")
    model.optimizer.build(model.trainable_variables)
    condition, scale = _damped_system(model, model.optimizer, x, y, "mse")
    before = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=BIG, epochs=1, shuffle=False, verbose=0)

    def step(weights):
        return np.concatenate([(a - b).ravel() for a, b in zip(weights, before)]) / scale

    one, two = step(model.get_weights()), step(_weights(runs[0], name))
    bound = 4 * condition * BIG * MATMUL_UNIT
    assert np.linalg.norm(one) > 0
    assert np.linalg.norm(one - two) <= bound * np.linalg.norm(one)


def _gradient_reductions(run, name):
    """Full gradients' worth of elements the all-reduces carried (scalars
    aside: loss logs, window weights, trial costs)."""
    _, elements, scalars, _, _ = (int(v) for v in run[f"{name}/reduce"])
    return (elements - scalars) / int(run[f"{name}/params"])


@pytest.mark.parametrize("mode", ["fit", "loop"])
def test_one_gradient_all_reduce_per_accumulation_window(runs, mode):
    windows = int(runs[0][f"acc-{mode}/iterations"])  # 2 windows of 4 batches
    ours = _gradient_reductions(runs[0], f"acc-{mode}")
    plain = _gradient_reductions(runs[0], f"plain-{mode}") if mode == "fit" else None
    # Keras's loss logs add a few elements per batch: less than a quarter
    # of a gradient per window.
    assert windows <= ours < windows * 1.25
    if plain is not None:  # data parallelism without accumulation: one per batch
        assert 4 * windows <= plain < 4 * windows * 1.25


@pytest.mark.parametrize("mode", ["fit", "loop"])
def test_lm_reduces_its_normal_equations_once_per_step(runs, mode):
    name = f"lm-{mode}"
    p = int(runs[0][f"{name}/params"])
    steps = int(runs[0][f"{name}/iterations"])
    _, elements, _, big_calls, big_elements = (int(v) for v in runs[0][f"{name}/reduce"])
    # J^T J (p^2 elements), J^T r (p), the cost and the example count (the
    # mini-batch guard's), packed into one all-reduce per step; everything
    # else is small (each attempt's trial cost, the guard's cost at the
    # previous weights, the logs).
    assert big_calls == steps == 1
    assert p * p + p <= big_elements <= p * p + p + 2
    assert elements - big_elements < p
