"""MaskAware: an optimizer wrapper that keeps pruned weights and their
optimizer state exactly zero after every update (tf_keras, as tfmot).

The masked update is `tf_gradkit._algorithms.masked_update`'s (shared with
`MagnitudePruning`); this module reads tfmot's masks. Its public class is made
for the tf_keras host by `tf_gradkit.pruning`.
"""

from tf_gradkit import _hosts
from tf_gradkit._algorithms.masked_update import MaskedUpdate
from tf_gradkit._algorithms.wrapper import unexpected_arguments
from tf_gradkit._model_hooks import bind_after_load
from tf_gradkit._optimizer_tree import optimizer_chain
from tf_gradkit.core.masks import Masks
from tf_gradkit._hosts import tf_keras as _tf_keras_host
from tf_gradkit.pruning import _masks

_WHO = "MaskAware"


class MaskAware(MaskedUpdate):
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
        self._init_wrapper(optimizer, name, {})
        self._forget_own_variables()  # `variables` is the inner's
        self.masks = Masks(self._variable_key)
        self._targets = self._untracked([])
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
