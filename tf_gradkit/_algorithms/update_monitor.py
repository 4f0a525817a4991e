"""UpdateMonitor: what the optimizer really changed, per layer (a callback).

Written once; each flavour's class is this algorithm on its
``keras.callbacks.Callback`` (`tf_gradkit.keras3.callbacks`,
`tf_gradkit.tf_keras.callbacks`). The measurement runs inside the train step
(a step wrapper from `_model_hooks.ModelBinding.wrap_step`); the flavour's
host says how to see the gradients an optimizer applies
(`_hosts.<flavour>.watch_applied_gradients`).
"""

import math
import warnings
from typing import NamedTuple

import tensorflow as tf

from tf_gradkit import _hosts
from tf_gradkit._model_hooks import ModelBinding
from tf_gradkit._optimizer_tree import optimizer_chain, sub_optimizers

__all__ = ["UpdateMonitor"]

# The columns of a layer's row, in the order the step writes them.
_COLUMNS = ("update_norm", "weight_norm", "grad_norm", "update_ratio")
_DEFAULT_CAPACITY = 1024


class MonitorState(NamedTuple):
    """What the train step keeps between and for monitored updates.

    snapshot: a copy of each trainable variable, taken before a monitored
      update.
    snapped_at: the real-update count when ``snapshot`` was taken (-1: none).
    armed: 1 while the step's update is monitored (the gradient watch reads it).
    grad_sq: per variable, the squared norm of the gradient last applied
      while armed (NaN: none applied).
    count: monitored updates written so far.
    steps: per row of the ring ``values``, the real-update number.
    values: ring of ``[layers, 4]`` rows (``_COLUMNS``).
    last: the last row written (NaN before the first).
    """
    snapshot: list
    snapped_at: tf.Variable
    armed: tf.Variable
    grad_sq: list
    count: tf.Variable
    steps: tf.Variable
    values: tf.Variable
    last: tf.Variable


def _value(v):
    """A variable's value as a tensor (Keras 3 variables, tf.Variables)."""
    return tf.convert_to_tensor(v)


def _sum_sq(x):
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)  # duplicates summed, as the update sums them
    return tf.reduce_sum(tf.square(tf.cast(x, tf.float32)))


def real_updates(leaves):
    """How many real updates the innermost optimizers ``leaves`` made: the
    largest of their ``iterations`` (the inner optimizer of our accumulators
    counts window closes only, and so does Keras 3's ``iterations`` under its
    own ``gradient_accumulation_steps``; the groups of a MultiOptimizer
    count the same steps)."""
    return tf.reduce_max(tf.stack(
        [tf.cast(_value(leaf.iterations), tf.int64) for leaf in leaves]))


class UpdateMonitor:
    """Per layer: the gradient norm, the update norm and the update/weight ratio.

    Why: the update-to-weight ratio ``||dW|| / ||W||`` says how fast each
    layer moves (around 1e-3 is the usual healthy rate; far above, the step
    is too large; far below, the layer barely learns), and it is what the
    optimizer did, which gradient norms alone do not say (Adam rescales,
    clipping, projections and pruning masks change the step).

    Math, for layer ``l`` with trainable variables ``W_l`` on a monitored
    update::

        update_norm  = sqrt(sum_{v in W_l} ||v_after - v_before||^2)
        weight_norm  = sqrt(sum_{v in W_l} ||v_before||^2)
        update_ratio = update_norm / weight_norm
        grad_norm    = sqrt(sum_{v in W_l} ||g_v||^2)

    **The update is the real one**: the weights after the optimizer's step
    minus a copy taken before it, so it covers any optimizer and every
    tf_gradkit wrapper (learning-rate schedules, momentum, projections,
    pruning masks, Levenberg-Marquardt's solve). **Only real updates are
    logged**: a step counts as one when the innermost optimizers'
    ``iterations`` advance (`real_updates`), so a `GradientAccumulator`
    micro-batch that only accumulates logs nothing; the logs keep showing
    the last real update. ``g_v`` is the gradient the innermost optimizer
    was handed on that update (for an accumulator, the window's averaged
    gradient; under a LossScaleOptimizer, the unscaled one; under Keras 3's
    own ``gradient_accumulation_steps``, which hands the optimizer every
    micro-batch, the last micro-batch's); optimizers that apply no gradient
    (Levenberg-Marquardt solves its own step) log NaN.

    Real updates ``1, 1 + every, 1 + 2 every, ...`` are monitored, counted
    in real updates. Everything is computed in the train step (eager,
    ``tf.function`` or XLA), with no host transfer per batch:

    - ``logs`` (progress bar, ``History``): ``update_ratio`` (the largest
      layer's), ``update_norm`` and ``grad_norm`` (over all layers) of the
      last monitored update (NaN before the first); with
      ``per_layer_logs=True`` also ``<layer>/update_ratio``,
      ``<layer>/update_norm``, ``<layer>/grad_norm``.
    - ``history``: every monitored update, read from the device at each
      epoch's end: ``{"step": real update number, "layers": {layer:
      {"update_norm", "weight_norm", "grad_norm", "update_ratio"}}}``.
    - TensorBoard, with ``log_dir``: the scalars
      ``update_monitor/<layer>/{update_norm,grad_norm,update_ratio}`` and a
      histogram ``update_monitor/update_ratio`` across layers, per monitored
      update (written at epoch ends; the tensorboard package is not needed).

    Cost: without the callback nothing is installed. With it, each step
    reads the optimizers' ``iterations``; a monitored update copies the
    trainable weights once (on the device) and computes the norms above;
    the train function is traced again when training starts and ends.
    ``benchmarks/update_monitor.py`` measures the step-time overhead.

    Args:
      every: monitor one real update in ``every`` (an integer >= 1).
      log_dir: optional TensorBoard directory (a str).
      per_layer_logs: also put every layer's values into ``logs``.

    Raises:
      ValueError: ``every`` is not an integer >= 1, or ``log_dir`` is not
        a str or None.

    Example:

    >>> monitor = tf_gradkit.callbacks.UpdateMonitor(every=10)
    >>> model.fit(x, y, callbacks=[monitor])
    >>> monitor.history[-1]["layers"]["dense"]["update_ratio"]
    """

    _CALLBACK_BASE = None  # the flavour's keras.callbacks.Callback

    def __init__(self, every=1, log_dir=None, per_layer_logs=False):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError("UpdateMonitor: `every` must be an integer >= 1. "
                             f"Received: every={every!r}")
        if log_dir is not None and not isinstance(log_dir, str):
            raise ValueError("UpdateMonitor: `log_dir` must be a directory path "
                             f"(str) or None. Received: log_dir={log_dir!r}")
        super().__init__()
        self.every, self.log_dir = every, log_dir
        self.per_layer_logs = bool(per_layer_logs)
        self.history = []
        self._remove_wrap, self._unwatch = None, []
        self._state, self._flushed, self._writer = None, 0, None

    # ------------------------------------------------------- callback side
    def on_train_begin(self, logs=None):
        del logs
        model = self.model
        steps = (self.params or {}).get("steps")
        self._capacity = steps // self.every + 2 if steps else _DEFAULT_CAPACITY
        self._state, self._flushed = None, 0
        self._remove_wrap = ModelBinding.wrap_step(model, self._wrap_step,
                                                   self._CALLBACK_BASE)
        # fit made its train function before this: make it again, with us.
        model.make_train_function(force=True)
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_end(self, epoch, logs=None):
        del epoch, logs
        self._flush()

    def on_train_end(self, logs=None):
        del logs
        self._flush()
        if self._remove_wrap is not None:
            self._remove_wrap()
            self._remove_wrap = None
        while self._unwatch:
            self._unwatch.pop()[1]()
        if self._writer is not None:
            self._writer.flush()

    # ----------------------------------------------------- train step side
    def _wrap_step(self, step, model):
        def monitored_step(data):
            leaves = [o for o in optimizer_chain(model.optimizer)
                      if not sub_optimizers(o)]
            variables = list(model.trainable_variables)
            state = self._state_for(variables, leaves)
            before = real_updates(leaves)
            monitored = tf.equal(before % self.every, 0)

            def snapshot():
                for copy, v in zip(state.snapshot, variables):
                    copy.assign(_value(v))
                for slot in state.grad_sq:
                    slot.assign(float("nan"))
                state.snapped_at.assign(before)
                return tf.constant(True)

            # Weights change only on real updates, so one copy per monitored
            # update (not per micro-batch of an accumulator's window).
            tf.cond(tf.logical_and(monitored, tf.not_equal(state.snapped_at, before)),
                    snapshot, lambda: tf.constant(False))
            state.armed.assign(tf.cast(monitored, tf.int64))
            logs = step(data)
            after = real_updates(leaves)
            tf.cond(tf.logical_and(monitored, after > before),
                    lambda: self._measure(state, variables, after),
                    lambda: tf.constant(False))
            state.armed.assign(tf.zeros((), tf.int64))
            return {**logs, **self._logs(state.last.read_value())}

        return monitored_step

    def _state_for(self, variables, leaves):
        state = self._state
        if state is None:
            self._groups = _layer_groups(self.model, variables)
            self._index = {}
            for i, v in enumerate(variables):
                self._index[id(v)] = i
                self._index[id(getattr(v, "value", v))] = i
            layers, cap = len(self._groups), self._capacity
            with tf.init_scope():
                state = MonitorState(
                    snapshot=[tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                              for v in variables],
                    snapped_at=tf.Variable(tf.constant(-1, tf.int64), trainable=False),
                    armed=tf.Variable(tf.constant(0, tf.int64), trainable=False),
                    grad_sq=[tf.Variable(float("nan"), trainable=False)
                             for _ in variables],
                    count=tf.Variable(tf.constant(0, tf.int64), trainable=False),
                    steps=tf.Variable(tf.zeros((cap,), tf.int64), trainable=False),
                    values=tf.Variable(tf.zeros((cap, layers, len(_COLUMNS))),
                                       trainable=False),
                    last=tf.Variable(tf.fill((layers, len(_COLUMNS)), float("nan")),
                                     trainable=False))
            self._state = state
        for leaf in leaves:  # watched once each, until training ends, by its host
            if not any(leaf is watched for watched, _ in self._unwatch):
                host = _hosts.host_for(leaf, "optimizer", "UpdateMonitor")
                self._unwatch.append(
                    (leaf, host.watch_applied_gradients(leaf, self._record)))
        return state

    def _record(self, grads, variables):
        """Called (in the graph) with every gradient a leaf optimizer applies."""
        state = self._state
        pairs = [(state.grad_sq[self._index[id(v)]], g)
                 for g, v in zip(grads, variables)
                 if g is not None and id(v) in self._index]
        if not pairs:
            return

        def write():
            for slot, g in pairs:
                slot.assign(_sum_sq(g))
            return tf.constant(True)

        tf.cond(state.armed > 0, write, lambda: tf.constant(False))

    def _measure(self, state, variables, after):
        update_sq, weight_sq = [], []
        for copy, v in zip(state.snapshot, variables):
            before = tf.cast(_value(copy), tf.float32)
            update_sq.append(_sum_sq(tf.cast(_value(v), tf.float32) - before))
            weight_sq.append(_sum_sq(before))
        grad_sq = [_value(g) for g in state.grad_sq]
        rows = []
        for _, idx in self._groups:
            update = tf.sqrt(tf.add_n([update_sq[i] for i in idx]))
            weight = tf.sqrt(tf.add_n([weight_sq[i] for i in idx]))
            grad = tf.sqrt(tf.add_n([grad_sq[i] for i in idx]))
            ratio = tf.where(weight > 0, update / tf.where(weight > 0, weight, 1.0),
                             float("inf"))
            rows.append(tf.stack([update, weight, grad, ratio]))
        row = tf.stack(rows)
        slot = tf.reshape(state.count % self._capacity, (1, 1))
        state.values.assign(tf.tensor_scatter_nd_update(state.values, slot, row[None]))
        state.steps.assign(tf.tensor_scatter_nd_update(state.steps, slot,
                                                       tf.reshape(after, (1,))))
        state.last.assign(row)
        state.count.assign_add(1)
        return tf.constant(True)

    def _logs(self, last):
        column = {name: i for i, name in enumerate(_COLUMNS)}
        logs = {
            "update_ratio": tf.reduce_max(last[:, column["update_ratio"]]),
            "update_norm": tf.norm(last[:, column["update_norm"]]),
            "grad_norm": tf.norm(last[:, column["grad_norm"]]),
        }
        if self.per_layer_logs:
            for j, (name, _) in enumerate(self._groups):
                for key in ("update_ratio", "update_norm", "grad_norm"):
                    logs[f"{name}/{key}"] = last[j, column[key]]
        return logs

    # ------------------------------------------------------------ reading
    def _flush(self):
        """Reads the monitored updates since the last flush off the device
        (one transfer), into ``history`` and TensorBoard."""
        state = self._state
        if state is None:
            return
        count = int(state.count.numpy())
        start = max(self._flushed, count - self._capacity)
        if start > self._flushed:
            warnings.warn(f"UpdateMonitor: {start - self._flushed} monitored updates "
                          "were overwritten before an epoch ended (more than "
                          f"{self._capacity} in one epoch); raise `every`.",
                          stacklevel=2)
        steps, values = state.steps.numpy(), state.values.numpy()
        for k in range(start, count):
            slot = k % self._capacity
            layers = {name: dict(zip(_COLUMNS, map(float, values[slot, j])))
                      for j, (name, _) in enumerate(self._groups)}
            record = {"step": int(steps[slot]), "layers": layers}
            self.history.append(record)
            if self._writer is not None:
                _write_summaries(self._writer, record)
        self._flushed = count


def _layer_groups(model, variables):
    """``[(layer name, [variable indices])]``: each trainable variable under
    the innermost layer that owns it ("other" when none does)."""
    from tf_gradkit._layer_taps import flat_layers  # noqa: PLC0415

    by_variable = {}
    for layer in flat_layers(model):
        if getattr(layer, "layers", None):
            continue
        for w in layer.trainable_weights:
            by_variable.setdefault(id(w), layer.name)
    groups = {}
    for i, v in enumerate(variables):
        groups.setdefault(by_variable.get(id(v), "other"), []).append(i)
    return list(groups.items())


def _write_summaries(writer, record):
    """TensorBoard scalars and a histogram, written without the tensorboard
    package (the protos its ``tf.summary.scalar`` and ``histogram`` write)."""
    from tensorflow.core.framework import summary_pb2  # noqa: PLC0415

    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    step = record["step"]
    with writer.as_default(step=step):
        ratios = []
        for name, values in record["layers"].items():
            for key in ("update_norm", "grad_norm", "update_ratio"):
                tf.summary.write(f"update_monitor/{name}/{key}",
                                 tf.constant(values[key], tf.float32), step=step,
                                 metadata=metadata)
            if math.isfinite(values["update_ratio"]):
                ratios.append(values["update_ratio"])
        if ratios:
            tf.summary.experimental.write_raw_pb(
                tf.raw_ops.HistogramSummary(tag="update_monitor/update_ratio",
                                            values=tf.constant(ratios, tf.float32)),
                step=step)
