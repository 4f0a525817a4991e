"""One worker of `test_multiworker.py` (run by `multiworker.launch`).

``python multiworker_worker.py OUT CASE [CASE ...]`` trains each case under
`tf_gradkit.distribute.MultiWorkerMirroredStrategy` (one strategy for all
cases: each new strategy restarts the collective keys) and writes, to
``OUT/worker_<index>.npz``, per case: the final weights (``<case>/w<i>``),
the optimizer's counters and what the collective all-reduces carried
(``<case>/reduce`` = [calls, elements, calls of one element], counted by an
op placed beside each all-reduce, so inside a window's conditional it runs
only when the window closes). The flavour is whatever ``tf.keras`` is here.

Data: 64 examples, global batches of 16 (8 per worker); cases built from
`CASES` below, each against the single-process run in the test.
"""

import importlib
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops

import tf_gradkit
from tf_gradkit import _flavour

# Before anything else touches TensorFlow's context (the tests' conftest
# would split the CPU in two): collective ops are configured at start-up.
STRATEGY = tf_gradkit.distribute.MultiWorkerMirroredStrategy()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiworker_cases import (CASES, DATA, GLOBAL_BATCH, compiled_loss,  # noqa: E402
                               keras_module)

BIG = 10000  # elements: more than any case's whole gradient, less than LM's J^T J
COUNTER = tf.Variable(tf.zeros([5], tf.int64), trainable=False, name="reduce_counter")
_all_reduce = collective_ops.all_reduce_v2


def _counted_all_reduce(t, *args, **kwargs):
    size = tf.cast(tf.size(t), tf.int64)
    big = tf.cast(size >= BIG, tf.int64)
    COUNTER.assign_add(tf.stack([tf.constant(1, tf.int64), size,
                                 tf.cast(tf.equal(size, 1), tf.int64), big, big * size]))
    return _all_reduce(t, *args, **kwargs)


collective_ops.all_reduce_v2 = _counted_all_reduce  # this worker process only


def _dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _custom_loop(strategy, model, opt, case, data):
    """A GradientTape loop under strategy.run: each replica's mean loss is
    divided by the replica count (as Keras does) and its batch size passed."""
    replicas = strategy.num_replicas_in_sync
    loss_fn = case.get("loss_fn")

    def step(x, y):
        if getattr(opt, "needs_residuals", False):
            return opt.minimize(lambda: model(x, training=True) - y,
                                model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / replicas
        grads = tape.gradient(loss, model.trainable_variables)
        extra = {}
        if getattr(type(opt), "accumulates_gradients", False):
            extra["sample_count"] = tf.shape(x)[0]
        opt.apply_gradients(zip(grads, model.trainable_variables), **extra)
        return loss

    @tf.function
    def run(x, y):
        strategy.run(step, args=(x, y))

    for _ in range(case["epochs"]):
        dataset = _dataset(*data, case.get("batch", GLOBAL_BATCH))
        for x, y in strategy.experimental_distribute_dataset(dataset):
            run(x, y)


def main(out, names):
    K = keras_module()
    gk = importlib.import_module(f"tf_gradkit.{_flavour.active_flavour()}")
    strategy = STRATEGY
    index = strategy.cluster_resolver.task_id
    results = {"flavour": np.array(_flavour.active_flavour())}
    for name in names:
        case = CASES[name]
        data = DATA[case.get("data", "regression")]()
        mode = name.rsplit("-", 1)[1]
        with strategy.scope():
            model = case["model"](K)
            opt = case["optimizer"](K, gk, model)
            model.compile(optimizer=opt, loss=compiled_loss(K, case))
        dataset = _dataset(*data, case.get("batch", GLOBAL_BATCH))
        if case.get("timed"):  # benchmarks/distributed.py: trace first, then time
            model.fit(dataset, epochs=1, shuffle=False, verbose=0)
        before, updates = COUNTER.numpy().copy(), int(opt.iterations.numpy())
        start = time.perf_counter()
        if mode == "fit":
            model.fit(dataset, epochs=case["epochs"], shuffle=False, verbose=0)
        else:
            _custom_loop(strategy, model, opt, case, data)
        results[f"{name}/seconds"] = np.array(time.perf_counter() - start)
        results[f"{name}/updates"] = np.array(int(opt.iterations.numpy()) - updates)
        results[f"{name}/reduce"] = COUNTER.numpy() - before
        for i, w in enumerate(model.get_weights()):
            results[f"{name}/w{i}"] = w
        results[f"{name}/params"] = np.array(
            sum(int(np.prod(v.shape)) for v in model.trainable_variables))
        results[f"{name}/iterations"] = np.array(int(opt.iterations.numpy()))
        if hasattr(opt, "micro_steps"):
            results[f"{name}/micro_steps"] = np.array(int(opt.micro_steps.numpy()))
    np.savez(os.path.join(out, f"worker_{index}.npz"), **results)
    print(json.dumps({"worker": index, "cases": names}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
