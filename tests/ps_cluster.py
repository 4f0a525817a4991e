"""An in-process ParameterServerStrategy cluster on loopback, for
`test_parameter_server.py` (tf_keras only: Keras 3 has no
ParameterServerStrategy support).

``python ps_cluster.py OUT SCENARIO`` starts 2 workers and 1 parameter
server as ``tf.distribute.Server``s in this process (this process is the
chief: the strategy starts its server), runs the scenario through a
``ClusterCoordinator``, writes ``OUT/<SCENARIO>.json`` and leaves at once
(in-process servers cannot be stopped).

Scenarios:
  fit      ``model.fit`` with ``GradientAccumulator(SGD, steps=2, model=m)``,
           60 micro-steps scheduled on both workers at once;
  stale    a custom ``coordinator.schedule`` loop: one micro-step is held back
           (a busy loop between reading ``version`` and applying) while the
           other worker runs 8 micro-steps one after the other, closing 4
           windows: the held-back gradient is stale;
  accumulator  ``tf_gradkit.ConditionalAccumulator`` shared by both workers
           (``apply_grad(g, local_step=acc.global_step read first)``) and taken
           by the chief;
  killed   ``fit`` as in "fit" (300 steps), with worker 1 a separate process
           (``python ps_cluster.py serve SPEC INDEX SECONDS``) that is killed
           (SIGKILL) while training and started again on its port: the
           coordinator re-runs the closures it held on the other worker;
  killed_in_close  "killed" with a slow window update, worker 1 killed 3
           times while a window is applied (120 steps).
"""

import json
import os
import socket
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np
import tensorflow as tf


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _worker_config(workers=2):
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = workers + 1  # as TF's own tests
    return config


def make_cluster(workers=2, ps=1, elsewhere=()):
    """The strategy and its coordinator; the workers whose index is in
    ``elsewhere`` are not started here (the caller starts them)."""
    ports = _free_ports(1 + workers + ps)
    spec = tf.train.ClusterSpec({
        "chief": [f"127.0.0.1:{ports[0]}"],
        "worker": [f"127.0.0.1:{p}" for p in ports[1:1 + workers]],
        "ps": [f"127.0.0.1:{p}" for p in ports[1 + workers:]]})
    for i in range(workers):
        if i not in elsewhere:
            tf.distribute.Server(spec, job_name="worker", task_index=i, protocol="grpc",
                                 config=_worker_config(workers), start=True)
    for i in range(ps):
        tf.distribute.Server(spec, job_name="ps", task_index=i, protocol="grpc", start=True)
    for i in elsewhere:
        _start_worker(spec, i)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    return strategy, tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


_WORKERS = {}  # index -> (spec, the worker process serving it)
_SERVE_SECONDS = 120  # a served worker leaves by itself after this


def _start_worker(spec, index):
    """Serves worker ``index`` of ``spec`` in a new process (bounded in time)."""
    import subprocess  # noqa: PLC0415
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve",
                             json.dumps(spec.as_dict()), str(index), str(_SERVE_SECONDS)])
    _WORKERS[index] = (spec, proc)


def _kill_and_restart_worker(index):
    spec, proc = _WORKERS[index]
    proc.kill()
    proc.wait(timeout=30)
    _start_worker(spec, index)


def _stop_workers():
    for _, proc in _WORKERS.values():
        proc.kill()
        proc.wait(timeout=30)


def serve(spec, index, seconds):
    """A worker's process: serves until killed or ``seconds`` have passed."""
    import threading  # noqa: PLC0415
    threading.Timer(float(seconds), lambda: os._exit(3)).start()
    tf.distribute.Server(tf.train.ClusterSpec(json.loads(spec)), job_name="worker",
                         task_index=int(index), protocol="grpc", config=_worker_config(),
                         start=True).join()


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(64, 4).astype("float32")
    return x, (x @ rng.randn(4, 1)).astype("float32")


def _model(tf_keras):
    return tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(4, activation="tanh"),
                                tf_keras.layers.Dense(1)])


def fit(strategy, coordinator, while_training=None, steps=60, learning_rate=0.05):
    del coordinator
    import tf_keras  # noqa: PLC0415

    from tf_gradkit.tf_keras import GradientAccumulator  # noqa: PLC0415

    x, y = _data()

    def dataset_fn(context):
        del context
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)

    with strategy.scope():
        model = _model(tf_keras)
        opt = GradientAccumulator(tf_keras.optimizers.SGD(learning_rate), steps=2, model=model,
                                  epoch_end="carry")
        model.compile(optimizer=opt, loss="mse")
    if while_training is not None:
        while_training(opt)
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=steps, verbose=0)
    state = [v.device for v in opt._state.acc_grads] + [  # pylint: disable=protected-access
        opt._state.micro_step.device, opt._state.weight.device, opt.version.device]
    return {"iterations": int(opt.iterations.numpy()),
            "micro_steps": int(opt.micro_steps.numpy()),
            "dropped": int(opt.dropped_gradients.numpy()),
            "open": int(opt.window_micro_step.numpy()),
            "version": int(opt.version.numpy()), "state_devices": state,
            "lost": int(opt.lost_micro_steps.numpy()),
            "interrupted": int(opt.interrupted_updates.numpy()),
            "phase": int(opt._journal.variable.numpy()[0]),  # pylint: disable=protected-access
            "window_weight": float(opt._state.weight.numpy())}  # pylint: disable=protected-access


KILLED_STEPS = 300  # long enough for the kill to land while training


def killed(strategy, coordinator):
    """"fit" while worker 1's process is killed (once 10 micro-steps are
    counted: batch-level callbacks are not supported under this strategy)
    and started again on its port."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    kills = []

    def kill_when_training(opt):
        def watch():
            deadline = time.time() + 60
            while time.time() < deadline:
                built = opt._journal is not None  # made last  # pylint: disable=protected-access
                if built and int(opt.micro_steps.numpy()) >= 10:
                    _kill_and_restart_worker(1)
                    kills.append(time.time())
                    return
                time.sleep(0.01)
        threading.Thread(target=watch, daemon=True).start()

    try:
        result = fit(strategy, coordinator, kill_when_training, KILLED_STEPS)
    finally:
        _stop_workers()
    return dict(result, kills=len(kills))


def killed_in_close(strategy, coordinator):
    """"killed", but each window's update is slow (a busy loop inside the
    inner optimizer's learning rate, under the mutex), and worker 1 is
    killed (and started again) whenever the journal says a window is being
    applied, 3 times (the holder may be either worker: whether an update is
    cut off in the middle, `interrupted_updates`, varies from run to run)."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    import tf_keras  # noqa: PLC0415

    class SlowRate(tf_keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.05 + 0.0 * _busy(20_000) + 0.0 * tf.cast(step, tf.float32)

        def get_config(self):
            return {}

    kills = []

    def kill_while_applying(opt):
        def watch():
            deadline = time.time() + 90
            while time.time() < deadline and len(kills) < 3:
                journal = opt._journal  # made last  # pylint: disable=protected-access
                if journal is not None and int(journal.variable.numpy()[0]) == 2:
                    _kill_and_restart_worker(1)
                    kills.append(time.time())
                    time.sleep(6)  # until the new worker serves again
                time.sleep(0.005)
        threading.Thread(target=watch, daemon=True).start()

    try:
        result = fit(strategy, coordinator, kill_while_applying, KILLED_IN_CLOSE_STEPS,
                     learning_rate=SlowRate())
    finally:
        _stop_workers()
    return dict(result, kills=len(kills))


KILLED_IN_CLOSE_STEPS = 120


def _busy(seconds_of_work):
    """A loop that keeps a worker busy (a py_function sleep would run on the
    chief's Python, not the worker's)."""
    def body(i, acc):
        return i + 1, acc + tf.sin(acc)
    return tf.while_loop(lambda i, acc: i < seconds_of_work, body,
                         (tf.constant(0), tf.constant(0.1)))[1]


def stale(strategy, coordinator):
    import tf_keras  # noqa: PLC0415

    from tf_gradkit.tf_keras import GradientAccumulator  # noqa: PLC0415

    x, y = _data()
    with strategy.scope():
        model = _model(tf_keras)
        opt = GradientAccumulator(tf_keras.optimizers.SGD(0.05), steps=2)
        opt.build(model.trainable_variables)

    def step(xb, yb, hold):
        version = opt.version.read_value()          # read before the weights
        with tf.control_dependencies([version]):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
        if hold:  # computed against version-0 weights, applied much later
            with tf.control_dependencies([_busy(800_000)]):
                grads = [tf.identity(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables), sample_count=8,
                            local_step=version)
        return version

    slow = tf.function(lambda: strategy.run(step, args=(x[:8], y[:8], True)))
    fast = tf.function(lambda i: strategy.run(
        step, args=(tf.gather(x, tf.range(8) + i), tf.gather(y, tf.range(8) + i), False)))
    held = coordinator.schedule(slow)
    for i in range(8):  # one at a time, on the other worker: never stale
        coordinator.schedule(fast, args=(8 * (i % 7 + 1),)).fetch()
    coordinator.join()
    return {"held_version": int(held.fetch()), "version": int(opt.version.numpy()),
            "dropped": int(opt.dropped_gradients.numpy()),
            "micro_steps": int(opt.micro_steps.numpy()),
            "iterations": int(opt.iterations.numpy())}


def accumulator(strategy, coordinator):
    import tf_gradkit  # noqa: PLC0415

    with strategy.scope():
        acc = tf_gradkit.ConditionalAccumulator(tf.float32, [2], reduction="SUM")

    @tf.function
    def produce():
        step = acc.global_step                      # what to pass as local_step
        with tf.control_dependencies([step]):
            grad = tf.ones([2]) + tf.zeros([2]) * _busy(2000)  # "computed" after it
        return acc.apply_grad(grad, local_step=step)

    # The chief takes while the workers apply: every accepted gradient is in
    # exactly one take, or still in the accumulator.
    accepted = [coordinator.schedule(produce) for _ in range(40)]
    taken = []
    while not coordinator.done() or not taken:
        value, ready = acc.take_grad(4)
        if bool(ready.numpy()):
            taken.append(float(value.numpy()[0]))
    coordinator.join()
    return {"taken": taken, "accepted": sum(bool(a.fetch()) for a in accepted),
            "left": int(acc.num_accumulated().numpy()),
            "dropped": int(acc.num_dropped().numpy()),
            "global_step": int(acc.global_step.numpy()),
            "device": acc.variables[0].device}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(*sys.argv[2:])
    out, scenario = sys.argv[1], sys.argv[2]
    strategy, coordinator = make_cluster(
        elsewhere=(1,) if scenario.startswith("killed") else ())
    result = {"fit": fit, "stale": stale, "accumulator": accumulator, "killed": killed,
              "killed_in_close": killed_in_close}[scenario](strategy, coordinator)
    with open(os.path.join(out, f"{scenario}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)
