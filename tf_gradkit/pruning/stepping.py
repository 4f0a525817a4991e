"""The pruning step from real optimizer updates: a callback and a
custom-loop helper (tf_keras only; no tfmot import).

How tfmot 0.8.1 steps (read from its source): ``PruneLowMagnitude.call`` in
training mode adds 1 to the layer's ``pruning_step``, runs
``pruning_obj.conditional_mask_update()`` (new masks when the schedule says
so at that step) and multiplies the weights by their masks; tfmot's
``UpdatePruningStep`` callback only starts the step at 0 and re-applies the
masks at epoch end. So its step counts training forward passes: with
gradient accumulation, micro-batches, and a schedule written in steps
(``frequency=100``, ``end_step=...``) runs ``steps`` times too fast.

Here the step is taken from ``optimizer.iterations`` (real updates: our
``GradientAccumulator``'s counts windows, not micro-batches): before each
forward pass ``pruning_step <- iterations``, so the forward pass sees
``iterations + 1``, exactly what tfmot's own count gives without
accumulation (the k-th batch runs at step k). Within one accumulation window
every micro-batch sees the same step and the same weights (nothing is
updated until the window closes), so the schedule's mask update happens on
the window's first micro-batch and repeating it on the others returns the
same mask: masks change only after a real update.
"""

import importlib
import sys

import tensorflow as tf
import tf_keras

from tf_gradkit import _hosts
from tf_gradkit._algorithms.mask_aware import no_pruning_layers
from tf_gradkit._hosts import tf_keras as _host
from tf_gradkit._optimizer_tree import optimizer_chain

_LossScaleOptimizer = tf_keras.mixed_precision.LossScaleOptimizer


def _kind(obj):
    return f"{type(obj).__module__}.{type(obj).__name__}"


def _pruning_layers(model, who):
    """The pruning layers of ``model`` (tf_keras's host finds tfmot's);
    raises unless it is a tf_keras model with some."""
    if not isinstance(model, tf_keras.Model):
        keras3 = _hosts.host_of(model) not in (None, _host)
        raise TypeError(
            f"{who}: `model` must be a tf_keras model; tfmot prunes only "
            "tf_keras (Keras 2) models" + (", and this is a Keras 3 model" if keras3 else "")
            + f". Received: model={_kind(model)}. Build the model with `import tf_keras` "
            "(or set TF_USE_LEGACY_KERAS=1 before importing TensorFlow so "
            "that `tf.keras` is tf_keras), then wrap it with "
            "`tfmot.sparsity.keras.prune_low_magnitude`.")
    layers = _host.pruning_layers(model)
    if not layers:
        raise no_pruning_layers(who, model)
    return layers


def _check_optimizer(optimizer, who):
    if isinstance(optimizer, (tf_keras.optimizers.Optimizer, _LossScaleOptimizer)):
        return
    if _hosts.host_of(optimizer) not in (None, _host):
        hint = ("this is a Keras 3 optimizer; tfmot prunes only tf_keras "
                "models, so use tf_keras.optimizers (e.g. "
                "tf_keras.optimizers.Adam) and tf_gradkit.tf_keras wrappers")
    else:
        hint = ("legacy optimizers (tf_keras.optimizers.legacy) and other "
                "objects are not accepted")
    raise TypeError(
        f"{who}: `optimizer` must be a tf_keras optimizer "
        "(tf_keras.optimizers.Optimizer, a tf_gradkit.tf_keras wrapper, or "
        f"tf_keras.mixed_precision.LossScaleOptimizer); {hint}. Received: "
        f"optimizer={_kind(optimizer)}.")


def _accumulation_steps(optimizer):
    """Micro-batches per real update along the wrapped chain (1 if none)."""
    steps = 1
    for opt in optimizer_chain(optimizer):
        if getattr(type(opt), "accumulates_gradients", False):
            steps *= opt.steps
    return steps


def _set_steps(wrappers, step):
    for layer in wrappers:
        layer.pruning_step.assign(tf.cast(step, tf.int64))


def strip_pruning(model):
    """``tfmot.sparsity.keras.strip_pruning(model)``.

    tfmot is imported here, lazily; a model holding tfmot wrappers means it
    is already loaded, so this sets nothing in the environment.
    """
    name = "tensorflow_model_optimization.python.core.sparsity.keras.prune"
    module = sys.modules.get(name) or importlib.import_module(name)
    return module.strip_pruning(model)


class UpdatePruningStepFromOptimizer(tf_keras.callbacks.Callback):
    """tfmot's ``UpdatePruningStep``, counting real optimizer updates.

    A drop-in replacement: ``model.fit(..., callbacks=[
    UpdatePruningStepFromOptimizer()])``. Before every batch each
    ``PruneLowMagnitude`` layer's ``pruning_step`` is set to
    ``model.optimizer.iterations``; the layer's forward pass then runs the
    schedule at ``iterations + 1``. Without accumulation this is the step
    tfmot counts; with ``GradientAccumulator(steps=k)`` it stays the same for
    the k micro-batches of a window, so the schedule means the same number of
    real updates with and without accumulation, and masks change only after a
    real update. At epoch end the masks are re-applied to the weights, as
    tfmot's callback does.

    ``steps_per_execution > 1`` runs several batches per callback call; with
    gradient accumulation that would count micro-batches again, so that
    combination raises at ``on_train_begin``.
    """

    def __init__(self):
        super().__init__()
        self.prunable_layers = []

    def on_train_begin(self, logs=None):
        del logs
        self.prunable_layers = _host.pruning_layers(self.model)
        host = _hosts.host_for(self.model, "model", "UpdatePruningStepFromOptimizer")
        per_execution = host.steps_per_execution(self.model)
        if per_execution > 1 and _accumulation_steps(self.model.optimizer) > 1:
            raise ValueError(
                "UpdatePruningStepFromOptimizer: steps_per_execution="
                f"{per_execution} with gradient accumulation is not supported "
                "(the step is set once per execution, so the layers would "
                "count micro-batches). Compile with steps_per_execution=1.")
        _build_if_loaded(self.model.optimizer, self.model)
        self._sync()

    def on_train_batch_begin(self, batch, logs=None):
        del batch, logs
        self._sync()

    def on_epoch_end(self, epoch, logs=None):
        del epoch, logs
        for layer in self.prunable_layers:
            layer.pruning_obj.weight_mask_op()

    def _sync(self):
        if self.prunable_layers:
            _set_steps(self.prunable_layers, self.model.optimizer.iterations)


def _build_if_loaded(optimizer, model):
    """Builds an optimizer loaded from a tf_keras SavedModel: its state,
    ``iterations`` too, is read back when it is built, which must precede
    the first read of its step (else the step reads 0 and pruned weights
    come back to life)."""
    if getattr(optimizer, "_saved_model_dir", None):
        optimizer.build(model.trainable_variables)


class PruningStepper:
    """What ``UpdatePruningStepFromOptimizer`` does, for custom loops.

    Call ``before_step()`` at the start of each training step (before the
    forward pass), eagerly or inside the ``tf.function``/``jit_compile``
    step. It sets ``pruning_step <- iterations + 1``, runs the schedule's
    mask update (``conditional_mask_update``, once per real update: further
    micro-batches of an accumulation window skip it) and masks the weights,
    then leaves ``pruning_step`` at ``iterations`` so a training-mode forward
    pass (``model(x, training=True)``, which adds 1 and repeats tfmot's
    update on unchanged weights, a no-op) sees the same step. The masks are
    therefore current even if the forward pass does not run in training mode.

    ``after_step()`` (optional) re-applies the masks to the weights, what
    tfmot's callback does at epoch end; ``MaskAware`` makes it unnecessary.

    Args:
      model: the pruned tf_keras model.
      optimizer: the optimizer whose ``iterations`` count real updates;
        defaults to ``model.optimizer`` (read at each call).

    Example:

    >>> stepper = PruningStepper(pruned, opt)  # doctest: +SKIP
    >>> @tf.function  # doctest: +SKIP
    ... def train_step(x, y):
    ...     stepper.before_step()
    ...     with tf.GradientTape() as tape:
    ...         loss = loss_fn(y, pruned(x, training=True))
    ...     grads = tape.gradient(loss, pruned.trainable_variables)
    ...     opt.apply_gradients(zip(grads, pruned.trainable_variables))
    >>> final = stepper.strip()  # doctest: +SKIP
    """

    def __init__(self, model, optimizer=None):
        self._wrappers = _pruning_layers(model, "PruningStepper")
        if optimizer is not None:
            _check_optimizer(optimizer, "PruningStepper")
        self.model = model
        self._optimizer = optimizer
        self._loaded_checked = False
        with tf.init_scope():
            # The last step the masks were brought up to date for.
            self._masked_step = tf.Variable(
                tf.constant(-1, tf.int64), trainable=False,
                name="pruning_stepper_masked_step")

    @property
    def optimizer(self):
        optimizer = self._optimizer or getattr(self.model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "PruningStepper: no optimizer; pass `optimizer=` or compile "
                "the model first.")
        return optimizer

    @property
    def pruning_step(self):
        """The first wrapper's ``pruning_step`` variable."""
        return self._wrappers[0].pruning_step

    def before_step(self):
        """Brings step and masks up to date; call before each forward pass."""
        if tf.executing_eagerly() or not self._loaded_checked:
            with tf.init_scope():
                _build_if_loaded(self.optimizer, self.model)
            self._loaded_checked = True
        done = tf.cast(self.optimizer.iterations, tf.int64)
        step = done + 1
        _set_steps(self._wrappers, step)

        def update():
            for layer in self._wrappers:
                layer.pruning_obj.conditional_mask_update()
                layer.pruning_obj.weight_mask_op()
            self._masked_step.assign(step)
            return tf.constant(True)

        if tf.executing_eagerly():
            if int(self._masked_step.numpy()) != int(step):
                update()
        else:
            tf.cond(tf.not_equal(self._masked_step, step), update,
                    lambda: tf.constant(False))
        _set_steps(self._wrappers, done)

    def after_step(self):
        """Re-applies the masks to the weights (``w <- w * M``)."""
        for layer in self._wrappers:
            layer.pruning_obj.weight_mask_op()

    def strip(self):
        """``tfmot.sparsity.keras.strip_pruning(model)``: the plain model."""
        return strip_pruning(self.model)
