"""Finding tfmot's masks; argument checks. No tfmot import.

tfmot's ``PruneLowMagnitude`` wrapper is recognised by what it holds, not by
its class, so that nothing here imports tensorflow-model-optimization (its
import sets ``TF_USE_LEGACY_KERAS=1`` for the whole process): a layer with a
``pruning_obj`` and a ``pruning_vars`` list of ``(weight, mask, threshold)``.

"""

import tensorflow as tf
import tf_keras

from tf_gradkit._hosts import protocol

_LossScaleOptimizer = tf_keras.mixed_precision.LossScaleOptimizer


def is_pruning_wrapper(layer):
    """True for a tfmot ``PruneLowMagnitude`` (or a layer that quacks like it)."""
    return (hasattr(layer, "pruning_obj") and hasattr(layer, "pruning_step")
            and isinstance(getattr(layer, "pruning_vars", None), list))


def pruning_wrappers(model):
    """The pruning wrappers in ``model`` (nested models included), in order."""
    return [layer for layer in model.submodules if is_pruning_wrapper(layer)]


def _is_keras3(obj):
    return any(cls.__module__.split(".")[0] == "keras"
               for cls in type(obj).__mro__)


def _kind(obj):
    return f"{type(obj).__module__}.{type(obj).__name__}"


def check_model(model, who, masks_given=False):
    """Raises unless ``model`` is a tf_keras model with pruning wrappers.

    Returns:
      The model's pruning wrappers (empty only if ``masks_given``).
    """
    if _is_keras3(model):
        raise TypeError(
            f"{who}: `model` must be a tf_keras model; tfmot prunes only "
            "tf_keras (Keras 2) models, and this is a Keras 3 model. Received: "
            f"model={_kind(model)}. Build the model with `import tf_keras` "
            "(or set TF_USE_LEGACY_KERAS=1 before importing TensorFlow so "
            "that `tf.keras` is tf_keras), then wrap it with "
            "`tfmot.sparsity.keras.prune_low_magnitude`.")
    if not isinstance(model, tf_keras.Model):
        raise TypeError(
            f"{who}: `model` must be a tf_keras.Model. Received: "
            f"model={_kind(model)}.")
    wrappers = pruning_wrappers(model)
    if not wrappers and not masks_given:
        raise ValueError(
            f"{who}: `model` has no pruning wrappers (no layer wrapped by "
            "`tfmot.sparsity.keras.prune_low_magnitude`), so there are no "
            f"masks to keep. Received: model={model.name!r} with layers "
            f"{[layer.name for layer in model.layers]}. Prune the model first, "
            "or pass `masks={variable.ref(): 0/1 tensor}`.")
    return wrappers


def check_optimizer(optimizer, who):
    if isinstance(optimizer, (tf_keras.optimizers.Optimizer, _LossScaleOptimizer)):
        return
    if _is_keras3(optimizer):
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


def check_masks(masks, who):
    """Validates explicit masks; returns a list of ``(variable, mask)``.

    ``masks`` is ``{variable.ref(): mask}`` (TensorFlow variables are not
    hashable; ``ref()`` is their dict key) or a list of ``(variable, mask)``
    pairs. Each mask stays what it was given as if it is a ``tf.Variable``
    (so it may change during training); anything else becomes a constant
    tensor in the variable's dtype.
    """
    items = list(masks.items()) if isinstance(masks, dict) else masks
    try:
        items = [(variable, mask) for variable, mask in items]
    except (TypeError, ValueError):
        items = None
    if not items:
        raise TypeError(
            f"{who}: `masks` must be a non-empty dict {{variable.ref(): mask}} "
            "or list of (variable, mask) pairs, each mask a 0/1 (or bool) "
            "tensor, array or tf.Variable shaped like its variable. Received: "
            f"masks={_kind(masks)}.")
    pairs = []
    for variable, mask in items:
        if hasattr(variable, "deref"):
            variable = variable.deref()
        if not protocol.is_variable(variable):
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
