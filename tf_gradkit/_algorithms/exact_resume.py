"""Mid-epoch backups that resume exactly (a callback, each flavour's fit).

Keras's ``BackupAndRestore(save_freq=k)`` backs up every ``k`` batches but
does not resume the run that was interrupted: Keras 3.15 restarts the
interrupted epoch from its first batch (the batches already applied are
applied again), tf_keras 2.21 restarts its step count where it stopped but
its data from the epoch's first batch (the epoch's first batches are seen
twice, its last ones never). The weights and every optimizer's state come
back exactly; the data order does not.

`ExactBackupAndRestore` owns the dataset ``fit`` reads: each epoch is one
pass over a deterministic ``tf.data.Dataset`` of known length, and the
backup holds the position in it (epoch, batches done). On resume the first
epoch's data starts after the batches already done (the pass is rotated:
``skip(k)`` then the first ``k`` batches, which are never read, so the
length ``fit`` sees stays that of a pass), and the flavour's ``fit`` is told
to start at that epoch (its host's ``resume_fit_at``); where it would still
run a whole epoch of steps (Keras 3), the callback ends the epoch after the
batches left. The backup is a ``tf.train.Checkpoint`` of the model, its
optimizer and the position, written every ``save_freq`` batches and at the
start of each epoch after the first (after the last epoch's end hooks, such
as `GradientAccumulator`'s ``epoch_end``, have run). A backup is never
written after an epoch's last batch: the next one, at the next epoch's
start, includes that epoch's end.

Refused, as they cannot resume exactly: a dataset of unknown or infinite
length (one ``fit`` epoch must be one pass), a shuffle without a seed or
that reshuffles each pass (the resumed process would draw another order),
``deterministic=False``, ``steps_per_epoch`` other than the pass's length,
and ``steps_per_execution > 1`` (the position is kept per batch). Not
detectable, so the caller's to avoid: random ops inside ``map`` functions.
"""

import os
import shutil

import tensorflow as tf

from tf_gradkit import _hosts
from tf_gradkit._hosts import protocol

_SHUFFLES = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
             "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2")


def check_dataset(dataset):
    """The number of batches in one pass of ``dataset``; raises what cannot
    be resumed exactly (module doc)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            "ExactBackupAndRestore: `dataset` must be a tf.data.Dataset of batches "
            f"(one pass = one epoch). Received: {type(dataset).__name__}.")
    batches = int(dataset.cardinality())
    if batches == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "ExactBackupAndRestore: `dataset` repeats forever; give one pass (one "
            "epoch) without `.repeat()`, and fit(epochs=...) repeats it.")
    if batches < 0:
        raise ValueError(
            "ExactBackupAndRestore: the length of `dataset` is unknown (a filter, "
            "or a generator); declare it with "
            "`dataset.apply(tf.data.experimental.assert_cardinality(n))`.")
    if batches == 0:
        raise ValueError("ExactBackupAndRestore: `dataset` is empty.")
    if dataset.options().deterministic is False:
        raise ValueError(
            "ExactBackupAndRestore: `dataset` has options deterministic=False, so "
            "its order can change between runs; resuming it cannot be exact.")
    for problem in _shuffle_problems(dataset):
        raise ValueError(
            f"ExactBackupAndRestore: `dataset` has a shuffle {problem}, so a resumed "
            "process would draw another order. Shuffle with a seed and "
            "reshuffle_each_iteration=False (one fixed order), or shuffle the "
            "files or arrays before building the dataset.")
    return batches


def _shuffle_problems(dataset):
    graph = tf.compat.v1.GraphDef()
    serialized = protocol.dataset_graph(dataset)
    graph.ParseFromString(serialized.numpy())
    node_lists = [graph.node] + [f.node_def for f in graph.library.function]
    for nodes in node_lists:
        consts = {n.name: n for n in nodes if n.op == "Const"}
        for node in nodes:
            if node.op not in _SHUFFLES:
                continue
            reshuffle = node.attr.get("reshuffle_each_iteration")
            if "Repeat" in node.op or reshuffle is None or reshuffle.b:
                yield "that reshuffles on each pass (reshuffle_each_iteration=True)"
            seeds = [consts.get(name.split(":")[0].lstrip("^")) for name in node.input[2:4]]
            if all(s is not None and tf.make_ndarray(s.attr["value"].tensor) == 0
                   for s in seeds):
                yield "without a seed"


class ExactBackupAndRestore:
    """Backs up every ``save_freq`` batches; resumes exactly where it was.

    ``fit`` reads ``callback.dataset`` (the dataset given here, able to
    start after the batches a backup says were done). After an interruption,
    a new ``fit`` with a new callback on the same ``backup_dir`` (the same
    program, perhaps a new process) restores the model's weights, its
    optimizer's state (a `GradientAccumulator`'s open window included) and
    the position, and trains the batches that were left: the run ends with
    the weights and optimizer state of the run that never stopped (tested,
    both flavours). See the module doc for what it refuses.

    Args:
      dataset: a ``tf.data.Dataset`` of batches, one pass per epoch, of known
        length, in a fixed order (a shuffle needs a seed and
        ``reshuffle_each_iteration=False``).
      backup_dir: a directory for this run's backup only.
      save_freq: an integer >= 1, back up every this many batches (and at
        each epoch's start); or ``"epoch"``: at each epoch's start only.
      delete_checkpoint: remove ``backup_dir`` once ``fit`` has finished.

    Example:

    >>> import tempfile
    >>> backup = tf_gradkit.callbacks.ExactBackupAndRestore(
    ...     dataset, tempfile.mkdtemp(), save_freq=50)  # a folder of this run's own
    >>> model.fit(backup.dataset, epochs=10, callbacks=[backup])

    Under Keras 3 the callback ends the resumed epoch itself (``fit`` would
    run a whole epoch of steps): it sets ``model.stop_training`` after the
    epoch's last batch and clears it at the epoch's end, so put it before an
    ``EarlyStopping`` in ``callbacks``. Not with Keras's own
    ``BackupAndRestore`` in the same ``fit`` (both would set where it starts).
    """

    @property
    def _HOST(self):  # noqa: N802
        """The host of the model's flavour: ``resume_fit_at(model, epoch,
        step)`` makes fit start at ``epoch`` and says whether it still runs
        that epoch from its first step; ``forget_resume(model)`` clears it;
        ``steps_per_execution(model)``."""
        return _hosts.host_for(self.model, "model", type(self).__name__)

    def __init__(self, dataset, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__()
        self._batches = check_dataset(dataset)
        if not backup_dir:
            raise ValueError("ExactBackupAndRestore: `backup_dir` must name a directory. "
                             f"Received: {backup_dir!r}.")
        if save_freq != "epoch" and not (isinstance(save_freq, int) and
                                         not isinstance(save_freq, bool) and save_freq >= 1):
            raise ValueError(
                "ExactBackupAndRestore: `save_freq` must be an integer >= 1 (batches) or "
                f'"epoch". Received: {save_freq!r}.')
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        with tf.init_scope():
            self._skip = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name="batches_to_skip")
            self._position = tf.Variable([0, 0], dtype=tf.int64, trainable=False,
                                         name="epoch_and_batches_done")
        skip, base = self._skip, dataset
        rotated = tf.data.Dataset.range(1).flat_map(  # reads `skip` per pass
            lambda _: base.skip(skip).concatenate(base.take(skip)))
        self.dataset = rotated.apply(tf.data.experimental.assert_cardinality(self._batches))
        self._manager = None

    # ---------------------------------------------------------------- fit hooks
    def on_train_begin(self, logs=None):
        del logs
        model, host = self.model, self._HOST
        spe = host.steps_per_execution(model)
        if spe != 1:
            raise ValueError(
                "ExactBackupAndRestore keeps its position per batch: compile with "
                f"steps_per_execution=1. Received: steps_per_execution={spe}.")
        steps = self.params.get("steps")
        if steps != self._batches:
            raise ValueError(
                "ExactBackupAndRestore: fit must run one pass of `callback.dataset` per "
                f"epoch ({self._batches} batches); it runs {steps}. Pass the callback's "
                "dataset and no steps_per_epoch.")
        if not model.built:
            raise ValueError("ExactBackupAndRestore: build the model before fit "
                             "(call it on a batch), so that its weights can be restored.")
        optimizer = model.optimizer
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                         position=self._position)
        self._manager = tf.train.CheckpointManager(checkpoint, self.backup_dir, max_to_keep=1)
        self._epoch, self._done, self._since_save = 0, 0, 0
        self._stop_at = self._first_resumed = None
        self._stopped = False
        latest = self._manager.latest_checkpoint
        if latest is None:
            return
        if not host.is_built(optimizer):
            optimizer.build(model.trainable_variables)
        checkpoint.restore(latest).assert_existing_objects_matched()
        epoch, done = (int(v) for v in self._position.numpy())
        self._epoch, self._done = epoch, done
        self._skip.assign(done)
        if host.resume_fit_at(model, epoch, done) and done:
            self._stop_at = self._batches  # fit runs a whole epoch: end it ourselves
        self._first_resumed = True if done else None

    def on_epoch_begin(self, epoch, logs=None):
        del logs
        self._HOST.forget_resume(self.model)  # read by fit already
        if epoch != self._epoch:  # a new epoch (not the resumed one)
            self._epoch, self._done = epoch, 0
            self._save()  # the previous epoch's end included

    def on_train_batch_end(self, batch, logs=None):
        del batch, logs
        if self._first_resumed:
            self._skip.assign(0)  # this pass has read it; the next ones start at 0
            self._first_resumed = None
        self._done += 1
        self._since_save += 1
        if self._stop_at is not None and self._done >= self._stop_at:
            self.model.stop_training = True
            self._stopped, self._stop_at = True, None
        if (self.save_freq != "epoch" and self._since_save >= self.save_freq and
                self._done < self._batches):
            self._save()

    def on_epoch_end(self, epoch, logs=None):
        del epoch, logs
        if self._stopped:
            self.model.stop_training = False
            self._stopped = False

    def on_train_end(self, logs=None):
        del logs
        self._HOST.forget_resume(self.model)
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir)

    def _save(self):
        self._position.assign([self._epoch, self._done])
        self._manager.save()
        self._since_save = 0
