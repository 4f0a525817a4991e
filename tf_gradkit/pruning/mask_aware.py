"""MaskAware: an optimizer wrapper that keeps pruned weights and their
optimizer state exactly zero after every update (tf_keras, as tfmot).

Written against the wrapper base (`tf_gradkit._algorithms.wrapper`); its
public class is made for the tf_keras host by `tf_gradkit.pruning`.
"""

import tensorflow as tf

from tf_gradkit import _hosts
from tf_gradkit._algorithms.wrapper import (Wrapper, no_gradients_error,
                                            unexpected_arguments)
from tf_gradkit._model_hooks import bind_after_load, optimizer_chain
from tf_gradkit.core.masks import Masks
from tf_gradkit._hosts import tf_keras as _tf_keras_host
from tf_gradkit.pruning import _masks

_WHO = "MaskAware"


def mask_gradient(grad, mask):
    """``grad * mask`` for a dense gradient or ``tf.IndexedSlices``."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        rows = tf.gather(tf.cast(mask, grad.values.dtype), grad.indices)
        return tf.IndexedSlices(grad.values * rows, grad.indices, grad.dense_shape)
    return grad * tf.cast(mask, grad.dtype)


def _multiply_in_place(variable, mask):
    value = variable.read_value()
    return variable.assign(value * tf.cast(mask, value.dtype), read_value=False)


class MaskAware(Wrapper):
    """Applies the wrapped optimizer through pruning masks (tf_keras).

    tfmot's ``PruneLowMagnitude`` re-applies its masks to the weights before
    each forward pass and at epoch end, so between those moments the weights
    an optimizer step just moved are non-zero, and the optimizer's moments
    (Adam's ``m`` and ``v``, SGD's momentum) fill up on every pruned entry. A
    checkpoint taken mid-epoch, a run stopped after ``steps_per_epoch`` or a
    custom loop keep those values; ``strip_pruning`` then exports a model
    that is not as sparse as its masks say.

    ``MaskAware`` makes every update go through the current mask ``M``::

        g <- g * M;  inner.apply_gradients(g);  w <- w * M;  s <- s * M

    for each pruned weight ``w`` and each of its per-entry slots ``s`` in the
    inner optimizer, so after every single step the pruned entries of the
    weights and of their optimizer state are exactly zero. Because the
    current mask multiplies everything on every step, entries that a pruning
    schedule newly prunes lose their state at the next update; entries it
    revives (masks never revive in tfmot's schedules) restart from zero.

    Slots: an inner-optimizer variable is a slot of weight ``v`` when it has
    ``v``'s shape and the name tf_keras gives variables made by
    ``add_variable_from_reference(v, prefix)``: ``<prefix>/<v's name>``
    (Adam, SGD momentum, RMSprop, Adagrad, Lion, EMA averages). Variables made
    otherwise, such as Adafactor's factored statistics or
    ``GradientAccumulator``'s gradient sums, are left alone.

    Cost per update: one multiply of each pruned weight's gradient, and one
    fused multiply-assign per pruned weight and per slot, done only when the
    inner optimizer really updated (its ``iterations`` moved).

    With ``tf_gradkit.tf_keras.GradientAccumulator`` both orders are exact:
    ``GradientAccumulator(MaskAware(Adam))`` (recommended: masks are applied
    once per real update) and ``MaskAware(GradientAccumulator(Adam))``
    (gradients are masked per micro-batch, weights and slots per real
    update). ``iterations`` counts real updates either way.

    Inner optimizers that can restrict themselves to the mask's support (a
    projection, Levenberg-Marquardt dropping pruned Jacobian columns) say so
    (``accepts_masks``); every such optimizer in the wrapped chain is handed
    the masks (a `tf_gradkit.core.masks.Masks` value, ``self.masks``) at
    construction.

    Args:
      optimizer: the tf_keras optimizer to wrap (``tf_keras.optimizers.*``,
        a ``tf_gradkit.tf_keras`` wrapper, or a ``LossScaleOptimizer``).
      model: a tf_keras model pruned with
        ``tfmot.sparsity.keras.prune_low_magnitude``; the masks of its
        ``PruneLowMagnitude`` layers (``pruning_vars``) are read at every
        step, so schedule changes are followed.
      masks: alternatively (or in addition), ``{variable.ref(): mask}`` or a
        list of ``(variable, mask)`` pairs; each mask a 0/1 or bool tensor or
        array, or a ``tf.Variable`` mask that you update yourself (read at
        every step).
      name: optional name.

    Raises:
      TypeError: a Keras 3 model or optimizer, or a wrong argument type.
      ValueError: neither masks nor a pruned model, or a mask whose shape
        differs from its variable's.

    Example:

    >>> pruned = tfmot.sparsity.keras.prune_low_magnitude(model, schedule)
    >>> opt = MaskAware(tf_keras.optimizers.Adam(1e-3), model=pruned)
    >>> pruned.compile(optimizer=opt, loss="mse")
    >>> pruned.fit(x, y, callbacks=[UpdatePruningStepFromOptimizer()])
    """

    # Masks go around any update, LM's (over the support) and windows' too.
    WRAPS_RESIDUAL_OPTIMIZERS = True
    WRAPS_ACCUMULATORS = True
    provides_masks = True
    ACCEPTED = "optimizer, model, masks, name"
    REFUSALS = {"same": "One MaskAware keeps every mask of the model."}

    def __init__(self, optimizer, model=None, masks=None, name=None, **kwargs):
        if kwargs:
            raise unexpected_arguments(_WHO, kwargs, self.ACCEPTED)
        _masks.check_optimizer(optimizer, _WHO)
        if model is None and masks is None:
            raise ValueError(
                f"{_WHO}: pass `model=` (a tf_keras model pruned with "
                "tfmot.sparsity.keras.prune_low_magnitude) or `masks=` "
                "({variable.ref(): 0/1 tensor}). Received neither.")
        wrappers = [] if model is None else _masks.check_model(
            model, _WHO, masks_given=masks is not None)
        explicit = [] if masks is None else _masks.check_masks(masks, _WHO)
        self._init_mask_aware(optimizer, name)
        self.masks.attach(wrappers, explicit)
        self._from_model = bool(wrappers)

    def _init_mask_aware(self, optimizer, name):
        self._init_wrapper(optimizer, name or "mask_aware", {})
        self._variables = []  # no state of its own: `variables` is the inner's
        self.masks = Masks(self._var_key)
        self._targets = self._no_dependency([])
        # The masks go down the chain, to the optimizers that can use them.
        for inner in optimizer_chain(optimizer):
            if getattr(type(inner), "accepts_masks", False):
                inner.masks = self.masks

    def attach(self, model=None, masks=None):
        """Gives a MaskAware made by ``from_config`` (e.g. by ``load_model``)
        its masks, same arguments as the constructor's; before it trains.
        ``tf_gradkit.attach(model)`` calls it with the model."""
        if model is None and masks is None:
            raise ValueError(f"{_WHO}.attach: pass `model=` or `masks=`.")
        wrappers = [] if model is None else _masks.check_model(
            model, _WHO, masks_given=masks is not None)
        if not self.masks.empty:
            if masks is None and self.masks.same_sources(wrappers):
                return self  # the same model again: nothing to do
            raise ValueError(f"{_WHO}.attach: this optimizer has its masks "
                             "already; make a new MaskAware for other masks.")
        explicit = [] if masks is None else _masks.check_masks(masks, _WHO)
        self.masks.attach(wrappers, explicit)
        self._from_model = bool(wrappers)
        if getattr(self, "_built", False):  # loaded: state restored, no masks yet
            self._build_own(self._trainable_variables)
        return self

    def _table(self):
        if self.masks.empty:
            raise ValueError(
                f"{_WHO} has no masks: it was made by `from_config`; call "
                "`attach(model=...)` or `attach(masks=...)` (or "
                "`tf_gradkit.attach(model)`) before training.")
        return self.masks.table()

    # ------------------------------------------------------------------ build
    def _build_own(self, var_list):
        if self.masks.empty:
            return  # made by from_config: `attach` builds the targets
        table = self.masks.table()
        slots = _masks.slots_by_variable(
            self.inner_optimizer.variables, var_list, self._var_key)
        self._targets = self._no_dependency([
            (table[key][0], table[key][1], slots[key])
            for key in (self._var_key(v) for v in var_list) if key in table])

    # ----------------------------------------------------------------- update
    def _apply_grads(self, grads, variables, aggregated=False):
        if all(grad is None for grad in grads):
            raise no_gradients_error(variables)
        table = self._table()
        masked = []
        for grad, variable in zip(grads, variables):
            entry = table.get(self._var_key(variable))
            masked.append(grad if entry is None else mask_gradient(grad, entry[1]))
        before = tf.identity(self.iterations)
        self._inner_apply(masked, variables, aggregated)
        self._mask_state_if(tf.not_equal(self.iterations, before))

    def _mask_state_if(self, updated):
        """Masks weights and slots, if the inner optimizer really updated."""
        if tf.distribute.has_strategy():
            self.mask_state()  # merge calls cannot sit in a tf.cond branch
        elif tf.executing_eagerly():
            if bool(updated):
                self.mask_state()
        else:
            def apply():
                self.mask_state()
                return tf.constant(True)
            tf.cond(updated, apply, lambda: tf.constant(False))

    def mask_state(self):
        """``w <- w * M`` and ``s <- s * M`` for every masked weight and slot.

        Done by ``apply_gradients`` after each real update; call it yourself
        after changing masks outside training, or after ``minimize`` of an
        optimizer that bypasses ``apply_gradients``.
        """
        if not self._targets:
            return

        def mask_all(distribution):
            for variable, mask, slots in self._targets:
                for target in [variable] + list(slots):
                    distribution.extended.update(
                        target, _multiply_in_place, args=(mask,), group=False)

        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            tf.distribute.get_replica_context().merge_call(mask_all)
        elif tf.distribute.has_strategy():
            mask_all(tf.distribute.get_strategy())
        else:
            # e.g. `finalize_variable_values` at the end of `fit`, outside the
            # scope of the strategy the optimizer was created under.
            with self._distribution_strategy.scope():
                mask_all(self._distribution_strategy)

    def minimize(self, loss, var_list, tape=None):
        """As the inner optimizer's; for optimizers that need residuals (like
        LevenbergMarquardt), calls the inner ``minimize`` then masks."""
        if not getattr(self.inner_optimizer, "needs_residuals", False):
            return super().minimize(loss, var_list, tape=tape)
        var_list = list(var_list() if callable(var_list) else var_list)
        with tf.init_scope():
            self.build(var_list)
        result = self.inner_optimizer.minimize(loss, var_list)
        self.mask_state()
        return result

    @property
    def needs_residuals(self):
        return getattr(self.inner_optimizer, "needs_residuals", False)

    def _finalize(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)
        self.mask_state()

    def get_config(self):
        # Masks are data of the model, not configuration: `attach` them after
        # `from_config` (as GradientAccumulator's `model=` is not serialised).
        # Masks read from a pruned model come back by themselves when Keras
        # loads that model (`bind_after_load`).
        return {"name": self.name,
                "optimizer": self._inner_config(),
                "bound_to_model": getattr(self, "_from_model", False)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        bound = config.pop("bound_to_model", False)
        inner = cls._inner_from_config(config, custom_objects)
        optimizer = cls.__new__(cls)
        optimizer._init_mask_aware(inner, config.pop("name", None))
        optimizer._from_model = bool(bound)  # until attached: saved the same again
        bind_after_load(optimizer, bound)
        return optimizer


# The public class: the algorithm on the tf_keras host (tfmot prunes tf_keras
# models only).
MaskAware = _hosts.make_class(_tf_keras_host, MaskAware, "WrapperHost",
                              "tf_gradkit.pruning")
