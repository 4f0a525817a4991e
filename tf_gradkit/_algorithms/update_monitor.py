"""UpdateMonitor: what the optimizer really changed, per layer (a callback).

Written once; each flavour's class is this algorithm on its
``keras.callbacks.Callback`` (`tf_gradkit.keras3.callbacks`,
`tf_gradkit.tf_keras.callbacks`). The flavour's host says how to see the
gradients an optimizer applies (`_hosts.<flavour>.watch_applied_gradients`).
"""

import importlib
import math

import tensorflow as tf

from tf_gradkit import _flavour
from tf_gradkit._model_hooks import optimizer_chain, sub_optimizers


def _ref(v):
    return v if isinstance(v, tf.Variable) else getattr(v, "value", v)


class UpdateMonitor:
    """Per layer: the gradient norm, the update norm and the update/weight ratio.

    The update is the real one: the weights after the optimizer's step minus
    before it (``||W_after - W_before||``), so it is what any optimizer or
    wrapper did (learning rate, momentum, projections, pruning masks,
    Levenberg-Marquardt's solve included). Under a `GradientAccumulator`
    only real updates are logged: a micro-batch that only accumulated
    changes no weight and logs nothing. The gradient norm is that of the
    gradient the innermost optimizer applied on that step (for an
    accumulator, the window's gradient); optimizers that apply no gradient
    (Levenberg-Marquardt solves its own step) log none.

    Logged every ``every`` batches that make a real update (counted in real
    updates), to the progress bar (``logs``: ``update_ratio`` (the largest
    layer's), ``update_norm``, ``grad_norm``, over all layers) and, with
    ``log_dir``, to TensorBoard (``update_monitor/<layer>/update_norm``,
    ``.../grad_norm``, ``.../update_ratio``, per real update). Every logged
    step is also kept in ``history``: ``{"step", "layers": {name: {...}}}``.

    Cost: off (no callback), nothing. On, a monitored batch copies the
    weights once on the device before the step (one assign each), reads one
    float per variable after it, and the train step records the squared
    norm of each gradient into a float32 variable (under XLA too). See
    benchmarks/update_monitor.py for the measured overhead.

    Args:
      every: monitor one batch in ``every`` (an integer >= 1).
      log_dir: optional TensorBoard directory.
      per_layer_logs: also put ``<layer>/update_ratio`` into ``logs``.

    Example:

    >>> monitor = UpdateMonitor(every=10)
    >>> model.fit(x, y, callbacks=[monitor])
    >>> monitor.history[-1]["layers"]["dense"]["update_ratio"]
    """

    def __init__(self, every=1, log_dir=None, per_layer_logs=False):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError("UpdateMonitor: `every` must be an integer >= 1. "
                             f"Received: every={every!r}")
        if log_dir is not None and not isinstance(log_dir, str):
            raise ValueError("UpdateMonitor: `log_dir` must be a directory path or "
                             f"None. Received: log_dir={log_dir!r}")
        super().__init__()
        self.every, self.log_dir, self.per_layer_logs = every, log_dir, per_layer_logs
        self.history = []
        self._undo, self._batch, self._updates = [], 0, 0
        self._writer = None

    # Keras calls set_model before it builds the train function: the watch
    # on the optimizer goes in here, and a train function traced without it
    # is dropped so that the next fit traces it with the watch.
    def set_model(self, model):
        super().set_model(model)
        self._remove_watch()
        self._model = model

    def on_train_begin(self, logs=None):
        del logs
        model = self._model
        self._variables = list(model.trainable_variables)
        self._layers = self._layer_groups(model)
        self._grad_sq = {}
        with tf.init_scope():
            self._snapshot = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                              for v in map(_ref, self._variables)]
            for v in map(_ref, self._variables):
                self._grad_sq[id(v)] = tf.Variable(float("nan"), trainable=False,
                                                   dtype=tf.float32)
        host = importlib.import_module(f"tf_gradkit._hosts.{_flavour.active_flavour()}")
        self._leaves = [o for o in optimizer_chain(model.optimizer)
                        if not sub_optimizers(o)]
        for leaf in self._leaves:
            self._undo.append(host.watch_applied_gradients(leaf, self._record))
        # A train function traced before the watch would not record.
        model.train_function = None
        model.make_train_function(force=True) if _accepts_force(model) else None
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_train_end(self, logs=None):
        del logs
        self._remove_watch()
        self._model.train_function = None  # the next fit traces without it
        if self._writer is not None:
            self._writer.flush()

    def _remove_watch(self):
        while self._undo:
            self._undo.pop()()

    def _record(self, grads, variables):
        for g, v in zip(grads, variables):
            slot = self._grad_sq.get(id(_ref(v)))
            if slot is not None and g is not None:
                g = tf.convert_to_tensor(g)
                slot.assign(tf.reduce_sum(tf.square(tf.cast(g, tf.float32))))

    def _layer_groups(self, model):
        by_variable = {}
        for layer in _flat_layers(model):
            if getattr(layer, "layers", None):
                continue
            for w in layer.trainable_weights:
                by_variable.setdefault(id(_ref(w)), layer.name)
        groups = {}
        for i, v in enumerate(self._variables):
            groups.setdefault(by_variable.get(id(_ref(v)), "other"), []).append(i)
        return groups

    def _real_updates(self):
        return sum(int(_ref(leaf.iterations).numpy()) for leaf in self._leaves)

    def on_train_batch_begin(self, batch, logs=None):
        del batch, logs
        self._watching = self._batch % self.every == 0
        self._batch += 1
        if self._watching:
            for snap, v in zip(self._snapshot, self._variables):
                snap.assign(_ref(v))
            for slot in self._grad_sq.values():
                slot.assign(float("nan"))
            self._before = self._real_updates()

    def on_train_batch_end(self, batch, logs=None):
        del batch
        if not self._watching:
            return
        if self._real_updates() == self._before:
            # Nothing applied (an accumulator's micro-batch): look again at
            # the next batch instead of logging a zero update.
            self._batch -= 1
            return
        self._updates += 1
        delta_sq = [float(tf.reduce_sum(tf.square(tf.cast(_ref(v) - s, tf.float32))))
                    for v, s in zip(self._variables, self._snapshot)]
        weight_sq = [float(tf.reduce_sum(tf.square(tf.cast(s, tf.float32))))
                     for s in self._snapshot]
        grad_sq = [float(self._grad_sq[id(_ref(v))].numpy()) for v in self._variables]
        layers = {}
        for name, idx in self._layers.items():
            update = math.sqrt(sum(delta_sq[i] for i in idx))
            weight = math.sqrt(sum(weight_sq[i] for i in idx))
            grads = [grad_sq[i] for i in idx]
            layers[name] = {
                "update_norm": update,
                "weight_norm": weight,
                "update_ratio": update / weight if weight > 0 else float("inf"),
                "grad_norm": (math.sqrt(sum(grads)) if all(math.isfinite(g) for g in grads)
                              else float("nan")),
            }
        step = self._updates
        self.history.append({"step": step, "layers": layers})
        if logs is not None:
            logs["update_ratio"] = max(l["update_ratio"] for l in layers.values())
            logs["update_norm"] = math.sqrt(sum(delta_sq))
            logs["grad_norm"] = (math.sqrt(sum(grad_sq)) if all(
                math.isfinite(g) for g in grad_sq) else float("nan"))
            if self.per_layer_logs:
                for name, values in layers.items():
                    logs[f"{name}/update_ratio"] = values["update_ratio"]
        if self._writer is not None:
            with self._writer.as_default(step=step):
                for name, values in layers.items():
                    for key in ("update_norm", "grad_norm", "update_ratio"):
                        _scalar(f"update_monitor/{name}/{key}", values[key], step)


def _scalar(tag, value, step):
    """A TensorBoard scalar, written without the tensorboard package (what
    its ``tf.summary.scalar`` writes: a float32 tensor tagged for the
    scalars plugin)."""
    from tensorflow.core.framework import summary_pb2  # noqa: PLC0415
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step,
                     metadata=metadata)


def _flat_layers(model):
    from tf_gradkit._layer_taps import flat_layers  # noqa: PLC0415
    return flat_layers(model)


def _accepts_force(model):
    import inspect  # noqa: PLC0415
    try:
        return "force" in inspect.signature(model.make_train_function).parameters
    except (TypeError, ValueError):
        return False
