"""Gradient accumulation with asynchronous workers: ParameterServerStrategy.

tf_keras only (Keras 3 does not support ParameterServerStrategy). Workers run
micro-steps at the same time against the accumulation window, which lives on
the parameter server: each micro-step holds the window's mutex there, so
every window takes exactly ``steps`` micro-steps, and a gradient computed
against weights that another worker's window has since updated is dropped
as stale (``dropped_gradients``).

On real hosts every task runs this file with ``TF_CONFIG`` (see
docs/distributed.md): "ps" and "worker" tasks serve, the "chief" trains.
Without ``TF_CONFIG`` it starts a parameter server and two workers in this
process on 127.0.0.1 and trains as the chief.
"""

import json
import os
import socket
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow: tf.keras is tf_keras

import numpy as np
import tensorflow as tf


def local_cluster():
    """A cluster spec for 127.0.0.1 whose workers and server run here."""
    ports = []
    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    spec = tf.train.ClusterSpec({"chief": [f"127.0.0.1:{ports[0]}"],
                                 "worker": [f"127.0.0.1:{p}" for p in ports[1:3]],
                                 "ps": [f"127.0.0.1:{ports[3]}"]})
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = 3
    for job, count in (("worker", 2), ("ps", 1)):
        for i in range(count):
            tf.distribute.Server(spec, job_name=job, task_index=i, protocol="grpc",
                                 config=config, start=True)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")


def train(resolver):
    import tf_keras

    from tf_gradkit.tf_keras import GradientAccumulator

    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    rng = np.random.RandomState(0)
    x = rng.randn(512, 8).astype("float32")
    y = np.sin(x @ rng.randn(8, 1)).astype("float32")

    def dataset_fn(context):
        del context
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512).repeat().batch(16)

    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((8,)),
                                     tf_keras.layers.Dense(32, activation="tanh"),
                                     tf_keras.layers.Dense(1)])
        opt = GradientAccumulator(tf_keras.optimizers.Adam(0.01), steps=4, model=model)
        model.compile(optimizer=opt, loss="mse")
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=3,
              steps_per_epoch=40, verbose=0)
    micro, dropped = int(opt.micro_steps.numpy()), int(opt.dropped_gradients.numpy())
    print(f"120 micro-steps from 2 workers: {micro} accepted, {dropped} dropped as stale; "
          f"{int(opt.iterations.numpy())} Adam updates (windows of 4, a short one "
          "applied at each epoch's end)")
    loss = float(np.mean((model(x).numpy() - y) ** 2))  # the chief reads the weights
    print(f"window state on {opt.version.device}; loss now {loss:.4f}")
    assert micro + dropped == 120


if __name__ == "__main__":
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    role = config.get("task", {}).get("type")
    if role in ("worker", "ps"):  # serve until killed
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        tf.distribute.Server(resolver.cluster_spec(), job_name=role,
                             task_index=resolver.task_id, protocol="grpc", start=True).join()
    train(tf.distribute.cluster_resolver.TFConfigClusterResolver() if role == "chief"
          else local_cluster())
    sys.stdout.flush()
    os._exit(0)  # in-process servers cannot be stopped
