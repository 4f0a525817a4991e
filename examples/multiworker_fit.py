"""Gradient accumulation on several machines: MultiWorkerMirroredStrategy.

On real hosts, run this file on every worker with ``TF_CONFIG`` naming the
cluster and the worker's index (see docs/distributed.md); each worker trains
its share of every global batch, and one gradient all-reduce per window of 4
batches keeps them in step. Without ``TF_CONFIG`` it starts two workers on
this machine (127.0.0.1) as subprocesses and checks that they end with the
same weights, equal to one process training on the big batches.

Works with Keras 3 (through ``tf_gradkit.distribute.MultiWorkerMirroredStrategy``,
which Keras 3's ``fit`` needs under multi-worker) and tf_keras
(``TF_USE_LEGACY_KERAS=1``).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np


def data():
    rng = np.random.RandomState(0)
    x = rng.randn(256, 8).astype("float32")
    return x, np.sin(x @ rng.randn(8, 1)).astype("float32")


def model_and_optimizer(tf, tf_gradkit, accumulate):
    K = tf.keras
    model = K.Sequential([K.Input((8,)), K.layers.Dense(32, activation="tanh"),
                          K.layers.Dense(1)])
    rng = np.random.RandomState(1)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.3
                       for w in model.get_weights()])
    opt = K.optimizers.Adam(0.01)
    if accumulate:
        opt = tf_gradkit.optimizers.GradientAccumulator(opt, steps=4, model=model)
    model.compile(optimizer=opt, loss="mse")
    return model


def worker():
    """One worker (TF_CONFIG set): trains, prints its weights' checksum."""
    import tensorflow as tf

    import tf_gradkit

    strategy = tf_gradkit.distribute.MultiWorkerMirroredStrategy()  # first, at start-up
    with strategy.scope():
        model = model_and_optimizer(tf, tf_gradkit, accumulate=True)
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # 32 per global batch
    history = model.fit(dataset, epochs=3, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    print(json.dumps({"worker": strategy.cluster_resolver.task_id,
                      "updates": int(model.optimizer.iterations.numpy()),
                      "loss": history.history["loss"][-1],
                      "weights": weights.tolist()}), flush=True)


def launch_two_local_workers():
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = [subprocess.Popen(
        [sys.executable, __file__], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                            TF_CONFIG=json.dumps({"cluster": cluster,
                                                  "task": {"type": "worker", "index": i}})))
        for i in range(2)]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]

    import tensorflow as tf  # the reference: one process, batches of 4 x 32

    import tf_gradkit
    model = model_and_optimizer(tf, tf_gradkit, accumulate=False)
    model.fit(*data(), batch_size=128, epochs=3, shuffle=False, verbose=0)
    reference = np.concatenate([w.ravel() for w in model.get_weights()])
    a, b = (np.array(r["weights"]) for r in results)
    print(f"2 workers, {results[0]['updates']} Adam updates (windows of 4 global batches "
          f"of 32), final loss {results[0]['loss']:.4f}")
    print(f"max |worker 0 - worker 1| = {np.max(np.abs(a - b)):.1e}; "
          f"max |workers - one process on batches of 128| = {np.max(np.abs(a - reference)):.1e}")
    assert np.array_equal(a, b) and np.max(np.abs(a - reference)) < 1e-5


if __name__ == "__main__":
    worker() if "TF_CONFIG" in os.environ else launch_two_local_workers()
