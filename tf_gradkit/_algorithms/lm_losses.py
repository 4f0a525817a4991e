"""The losses LevenbergMarquardt trains Keras models on, as residuals or
generalised Gauss-Newton terms: which compiled losses it accepts and how the
residuals of a (multi-output, weighted) mean squared error are formed so that
``0.5 |r|^2`` is exactly ``0.5 * batch * loss``."""

import tensorflow as tf

from tf_gradkit._hosts import protocol
from tf_gradkit.core.lm.robust import RobustLoss

MSE_NAMES = ("mse", "mean_squared_error", "MeanSquaredError")
# Cross-entropies handled through the generalised Gauss-Newton matrix.
CROSS_ENTROPY = {
    "categorical_crossentropy": "categorical",
    "CategoricalCrossentropy": "categorical",
    "sparse_categorical_crossentropy": "sparse_categorical",
    "SparseCategoricalCrossentropy": "sparse_categorical",
    "binary_crossentropy": "binary",
    "BinaryCrossentropy": "binary",
}

# Robust losses, as residuals: Keras's Huber(delta) per element is scipy's
# huber with f_scale = delta (0.5 C^2 rho((e/C)^2)); the mean absolute error
# is the "absolute" loss with C = 1 (|e|), stepped by reweighted least squares.
ROBUST = {"huber": "huber", "Huber": "huber", "huber_loss": "huber",
          "mae": "absolute", "mean_absolute_error": "absolute",
          "MeanAbsoluteError": "absolute"}


def robust_loss(loss):
    """The `RobustLoss` a compiled Huber or MAE loss is, else None."""
    kind = ROBUST.get(loss_name(loss))
    if kind is None:
        return None
    return RobustLoss(kind, _delta(loss) if kind == "huber" else 1.0)


def _delta(loss):
    if isinstance(loss, (list, tuple)):
        loss = loss[0]
    if isinstance(loss, dict):
        loss = next(iter(loss.values()))
    kwargs = protocol.loss_fn_kwargs(loss)
    return float(kwargs.get("delta", getattr(loss, "delta", 1.0)))


def from_logits(loss):
    """Reads ``from_logits`` from a Keras 3 or tf_keras loss object."""
    if isinstance(loss, (list, tuple)):
        loss = loss[0]
    if isinstance(loss, dict):
        loss = next(iter(loss.values()))
    if hasattr(loss, "from_logits"):
        return bool(loss.from_logits)
    return bool(protocol.loss_fn_kwargs(loss).get("from_logits", False))


def loss_name(loss):
    if isinstance(loss, str):
        return loss
    if isinstance(loss, (list, tuple)) and loss:
        names = {loss_name(item) for item in loss}
        return names.pop() if len(names) == 1 else None
    if isinstance(loss, dict) and loss:
        names = {loss_name(item) for item in loss.values()}
        return names.pop() if len(names) == 1 else None
    return getattr(loss, "__name__", type(loss).__name__)


def half_sum_sq(residuals, dtype):
    r = tf.cast(tf.reshape(residuals, [-1]), dtype)
    return 0.5 * tf.reduce_sum(tf.square(r))


def mse_residuals(y_pred, y, sample_weight, dtype, loss_weights=None):
    """Residuals with ``0.5 |r|^2 = 0.5 * batch * (the compiled MSE loss)``.

    Per output k of width d_k: ``sqrt(lw_k / d_k) * sqrt(w) * (y_pred - y)``,
    so sample weights and ``loss_weights`` count exactly as in Keras's loss
    (``sum_k lw_k * mean(w * (y_pred - y)^2)``), as square roots.
    """
    errors, weights = weighted_errors(y_pred, y, sample_weight, dtype, loss_weights)
    return errors * tf.sqrt(weights)


def per_example(flat, y_pred):
    """Flat residuals over every output (each output's elements in turn, as
    `weighted_errors` lays them out) as ``[B, m]``: example ``i``'s row."""
    preds = tf.nest.flatten(y_pred)
    if len(preds) == 1:
        return tf.reshape(flat, [tf.shape(preds[0])[0], -1])
    parts = tf.split(flat, [tf.size(p) for p in preds])
    return tf.concat([tf.reshape(part, [tf.shape(p)[0], -1])
                      for part, p in zip(parts, preds)], axis=1)


def weighted_errors(y_pred, y, sample_weight, dtype, loss_weights=None):
    """Flat errors ``y_pred - y`` over every output and element, and each
    one's weight in Keras's summed loss, ``lw_k * w / d_k``: the compiled
    loss times the batch is ``sum(weight * loss_k(error))``."""
    preds, trues = tf.nest.flatten(y_pred), tf.nest.flatten(y)
    if len(trues) != len(preds):
        raise ValueError(
            f"LevenbergMarquardt: the model has {len(preds)} outputs but the "
            f"data has {len(trues)} targets.")
    lw = _flat_loss_weights(y_pred, loss_weights, len(preds))
    # Keras 3 expands sample weights to the targets' structure (one per output).
    sws = [None] * len(preds) if sample_weight is None else tf.nest.flatten(
        sample_weight)
    if len(sws) == 1 and len(preds) > 1:
        sws = sws * len(preds)
    errors, weights = [], []
    for yp, yt, weight, sample_weight in zip(preds, trues, lw, sws):
        diff = tf.cast(yp, dtype) - tf.cast(tf.reshape(yt, tf.shape(yp)), dtype)
        diff = tf.reshape(diff, [tf.shape(diff)[0], -1])
        width = tf.cast(tf.shape(diff)[1], dtype)
        each = tf.ones_like(diff) * (tf.cast(weight, dtype) / width)
        if sample_weight is not None:
            each = each * tf.reshape(tf.cast(sample_weight, dtype), [-1, 1])
        errors.append(tf.reshape(diff, [-1]))
        weights.append(tf.reshape(each, [-1]))
    if len(errors) == 1:
        return errors[0], weights[0]
    return tf.concat(errors, axis=0), tf.concat(weights, axis=0)


def _flat_loss_weights(y_pred, loss_weights, count):
    """``loss_weights`` (None, list or dict by output name) in flatten order."""
    if loss_weights is None:
        return [1.0] * count
    if isinstance(loss_weights, dict):
        if isinstance(y_pred, dict):
            return [loss_weights.get(k, 1.0) for k in sorted(y_pred)]
        return list(loss_weights.values())
    return list(loss_weights)


def compiled_loss_weights(model):
    """The ``loss_weights`` given to ``compile`` (both flavours keep them in
    ``_compile_config``); None when not given."""
    return protocol.compiled_loss_weights(model)
