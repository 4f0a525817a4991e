"""MaskAware: an optimizer wrapper that keeps pruned weights and their
optimizer state exactly zero after every update, written once for both Keras
flavours.

The masked update is `tf_gradkit._algorithms.masked_update`'s (shared with
`MagnitudePruning`). The masks are explicit ``(variable, mask)`` pairs, or
those of a model's pruning layers, found and read by the model's host
(``pruning_layers``, ``pruning_masks``: tfmot's ``PruneLowMagnitude`` in
tf_keras; none in Keras 3, which tfmot does not prune).
"""

import warnings

import tensorflow as tf

from tf_gradkit import _hosts
from tf_gradkit._algorithms.masked_update import MaskedUpdate
from tf_gradkit._algorithms.wrapper import unexpected_arguments
from tf_gradkit._model_hooks import bind_after_load
from tf_gradkit._optimizer_tree import optimizer_chain
from tf_gradkit.core.masks import Masks

_WHO = "MaskAware"
# Where pruned models come from, and what works in either flavour.
_TFMOT = ("tfmot prunes only tf_keras models (its pruned models give MaskAware their "
          "masks): build those with `import tf_keras` (or set TF_USE_LEGACY_KERAS=1 "
          "before importing TensorFlow so that `tf.keras` is tf_keras) and wrap them "
          "with `tfmot.sparsity.keras.prune_low_magnitude`. Explicit `masks=` and "
          "MagnitudePruning (masks as optimizer state) work in either flavour.")


def _kind(obj):
    return f"{type(obj).__module__}.{type(obj).__name__}"


def no_pruning_layers(who, model, alternatives=""):
    """The error for a ``model`` without pruning layers; ``alternatives``:
    what else ``who`` takes, as the end of a sentence."""
    return ValueError(
        f"{who}: `model` has no pruning wrappers (no layer wrapped by "
        "`tfmot.sparsity.keras.prune_low_magnitude`, which prunes tf_keras models "
        f"only), so there are no masks to keep. Received: model={model.name!r} with "
        f"layers {[layer.name for layer in model.layers]}. Prune a tf_keras model "
        f"with tfmot first{alternatives}.")


def check_masks(masks, who, is_variable):
    """Validates explicit masks; returns a list of ``(variable, mask)``.

    ``masks`` is a list of ``(variable, mask)`` pairs, or ``{variable.ref():
    mask}`` (TensorFlow variables are not hashable; ``ref()`` is their dict
    key; Keras 3 variables have none: pass pairs). Each mask stays what it
    was given as if it is a ``tf.Variable`` (so it may change during
    training); anything else becomes a constant tensor in the variable's
    dtype. ``is_variable``: the host's test for a model variable.
    """
    items = list(masks.items()) if isinstance(masks, dict) else masks
    try:
        items = [(variable, mask) for variable, mask in items]
    except (TypeError, ValueError):
        items = None
    if not items:
        raise TypeError(
            f"{who}: `masks` must be a non-empty list of (variable, mask) pairs or "
            "dict {variable.ref(): mask}, each mask a 0/1 (or bool) tensor, array "
            "or tf.Variable shaped like its variable. Received: "
            f"masks={_kind(masks)}.")
    pairs = []
    for variable, mask in items:
        if hasattr(variable, "deref"):
            variable = variable.deref()
        if not is_variable(variable):
            raise TypeError(
                f"{who}: `masks` keys must be model variables (or their "
                f"`.ref()`). Received a key of type {_kind(variable)}.")
        if not isinstance(mask, tf.Variable):
            mask = tf.convert_to_tensor(mask)
            values = mask.numpy()
            if values.dtype != bool and not ((values == 0) | (values == 1)).all():
                raise ValueError(
                    f"{who}: `masks` values must hold only 0 and 1 (or be "
                    f"bool). Received for {variable.name}: values outside "
                    "{0, 1}.")
            mask = tf.cast(mask, variable.dtype)
        if tuple(mask.shape) != tuple(variable.shape):
            raise ValueError(
                f"{who}: each mask must have its variable's shape. Received "
                f"for {variable.name}: mask shape {tuple(mask.shape)}, "
                f"variable shape {tuple(variable.shape)}.")
        pairs.append((variable, mask))
    return pairs


class MaskAware(MaskedUpdate):
    """Applies the wrapped optimizer through pruning masks.

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

    Flavours: ``tf_gradkit.tf_keras.MaskAware`` (also
    ``tf_gradkit.pruning.MaskAware``) takes a tfmot-pruned tf_keras model or
    explicit masks; ``tf_gradkit.keras3.MaskAware`` takes explicit masks
    (tfmot prunes tf_keras models only; for masks made on a schedule in
    Keras 3 use ``MagnitudePruning``).

    Slots: an inner-optimizer variable is a slot of weight ``v`` when it has
    ``v``'s shape and the name the flavour gives variables made by
    ``add_variable_from_reference(v, ...)`` (Adam, SGD momentum, RMSprop,
    Adagrad, Lion, EMA averages). Variables made otherwise, such as
    Adafactor's factored statistics or ``GradientAccumulator``'s gradient
    sums, are left alone.

    Cost per update: one multiply of each pruned weight's gradient, and one
    fused multiply-assign per pruned weight and per slot, done only when the
    inner optimizer really updated (its ``iterations`` moved).

    With ``GradientAccumulator`` both orders are exact:
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
      optimizer: the optimizer to wrap, of the same Keras flavour (its
        optimizers, a tf_gradkit wrapper, or a ``LossScaleOptimizer``).
      model: a tf_keras model pruned with
        ``tfmot.sparsity.keras.prune_low_magnitude``; the masks of its
        ``PruneLowMagnitude`` layers (``pruning_vars``) are read at every
        step, so schedule changes are followed.
      masks: alternatively (or in addition), a list of ``(variable, mask)``
        pairs or ``{variable.ref(): mask}`` (tf_keras); each mask a 0/1 or
        bool tensor or array, or a ``tf.Variable`` mask that you update
        yourself (read at every step).
      name: optional name.

    Raises:
      TypeError: a model or optimizer of another flavour, or a wrong
        argument type.
      ValueError: neither masks nor a pruned model (a Keras 3 model has no
        pruning layers), or a mask whose shape differs from its variable's.

    Example:

    >>> pruned = tfmot.sparsity.keras.prune_low_magnitude(model, schedule)  # doctest: +SKIP
    >>> opt = MaskAware(tf_keras.optimizers.Adam(1e-3), model=pruned)  # doctest: +SKIP
    >>> pruned.compile(optimizer=opt, loss="mse")  # doctest: +SKIP
    >>> pruned.fit(x, y, callbacks=[UpdatePruningStepFromOptimizer()])  # doctest: +SKIP
    """

    ACCEPTED = "optimizer, model, masks, name"
    REFUSALS = {"same": "One MaskAware keeps every mask of the model.",
                "loss_scale": "Put the LossScaleOptimizer outside: compile a plain "
                              "MaskAware (under a mixed_float16 policy Keras wraps it), "
                              "or write LossScaleOptimizer(MaskAware(...))."}

    def __init__(self, optimizer, model=None, masks=None, name=None, **kwargs):
        if kwargs:
            raise unexpected_arguments(_WHO, kwargs, self.ACCEPTED)
        self._init_mask_aware(optimizer, name)
        if model is None and masks is None:
            raise ValueError(
                f"{_WHO}: pass `model=` (a tf_keras model pruned with "
                "tfmot.sparsity.keras.prune_low_magnitude) or `masks=` "
                "([(variable, 0/1 mask), ...]). Received neither.")
        layers = [] if model is None else self._pruning_layers(
            model, masks_given=masks is not None)
        explicit = [] if masks is None else self._check_masks(masks)
        self.masks.attach(layers, explicit)
        self._from_model = bool(layers)

    def _init_mask_aware(self, optimizer, name):
        self._init_wrapper(optimizer, name, {})
        self._forget_own_variables()  # `variables` is the inner's
        self.masks = Masks(self._variable_key, read=_hosts.host_of(self).pruning_masks)
        self._targets = self._untracked([])
        # The masks go down the chain, to the optimizers that can use them.
        for inner in optimizer_chain(optimizer):
            if getattr(type(inner), "accepts_masks", False):
                inner.masks = self.masks

    def _pruning_layers(self, model, masks_given):
        """``model``'s pruning layers (its host's ``pruning_layers``); raises
        unless ``model`` is of this flavour and has some or ``masks_given``."""
        if not self._is_model(model):
            other = _hosts.host_of(model)
            advice = ("" if other is None or other.FLAVOUR == self.FLAVOUR else
                      f" For a model of the other flavour use "
                      f"tf_gradkit.{other.FLAVOUR}.{_WHO}.")
            raise TypeError(
                f"{_WHO} (tf_gradkit.{self.FLAVOUR}): `model` must be a "
                f"{self.MODEL_KIND}. Received: model={_kind(model)}.{advice} {_TFMOT}")
        layers = _hosts.host_of(self).pruning_layers(model)
        if not layers and not masks_given:
            raise no_pruning_layers(
                _WHO, model, ", or pass `masks=[(variable, 0/1 mask), ...]` (or "
                "`{variable.ref(): mask}` for tf.Variables), or use "
                f"tf_gradkit.{self.FLAVOUR}.MagnitudePruning (its own masks, on a schedule)")
        return layers

    def _check_masks(self, masks):
        return check_masks(masks, _WHO, _hosts.host_of(self).is_variable)

    def attach(self, model=None, masks=None):
        """Gives a MaskAware made by ``from_config`` (e.g. by ``load_model``)
        its masks, same arguments as the constructor's; before it trains.
        ``tf_gradkit.attach(model)`` calls it with the model (and changes
        nothing when this optimizer has its masks from that model, or
        explicit ones)."""
        if model is None and masks is None:
            raise ValueError(f"{_WHO}.attach: pass `model=` or `masks=`.")
        layers = [] if model is None else self._pruning_layers(
            model, masks_given=masks is not None or not self.masks.empty)
        if not self.masks.empty:
            if masks is None and self.masks.same_sources(layers):
                return self  # the same model again (or explicit masks): nothing to do
            raise ValueError(f"{_WHO}.attach: this optimizer has its masks "
                             "already; make a new MaskAware for other masks.")
        explicit = [] if masks is None else self._check_masks(masks)
        self.masks.attach(layers, explicit)
        self._from_model = bool(layers)
        if self._is_built():  # loaded: state restored, no masks yet
            self._build_own(self._built_variables())
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
        self._build_targets(var_list)
        self._warn_if_no_explicit_mask_matches(var_list)

    def _warn_if_no_explicit_mask_matches(self, var_list):
        """Explicit masks none of which names a variable this optimizer
        updates (masks built on another model's variables, a clone's) would
        mask nothing: said, not silent."""
        count = self.masks.explicit_count
        unmatched = self.masks.explicit_unmatched(self._variable_key(v) for v in var_list)
        if count and len(unmatched) == count:
            names = [getattr(v, "path", None) or getattr(v, "name", "?") for v, _ in unmatched]
            warnings.warn(
                f"{_WHO}: none of the {count} explicit masks is for a variable this "
                f"optimizer updates, so nothing is masked. Received masks for: "
                f"{names[:5]}; the optimizer was built for {len(var_list)} variables. "
                "Build the masks on the trained model's own variables (a cloned or "
                "reloaded model has new ones), or call `attach(masks=...)` with them.",
                stacklevel=2)

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
