"""Keras 3 adapter for `AccumBatchNormalization` (math in `core.batch_stats`)."""

import keras
from keras import ops

from tf_gradkit._hosts import keras3 as _host
from tf_gradkit.core import batch_stats
from tf_gradkit.core.accumulation import sum_dtype

__all__ = ["AccumBatchNormalization"]


@keras.saving.register_keras_serializable(package="tf_gradkit")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose moving statistics are updated once per window.

    Meant to sit in a model trained with gradient accumulation
    (`GradientAccumulator`, or Keras 3's ``gradient_accumulation_steps``),
    where the optimizer updates once every ``accumulation_steps`` micro-batches.
    Plain BatchNormalization would still update its moving mean and variance on
    every micro-batch, from small-batch estimates. This layer instead pools the
    window: for micro-batches ``t`` with ``n_t`` elements per feature, mean
    ``m_t`` and biased variance ``v_t``::

        N        = sum_t n_t
        mean     = sum_t n_t * m_t / N
        variance = sum_t n_t * (v_t + m_t**2) / N - mean**2

    i.e. exactly the mean and biased variance of the concatenated window
    (example-weighted mean of the variances plus variance of the means;
    computed about a shift for float32 accuracy, see `core.batch_stats`). At
    the window's last training call the moving statistics are updated once::

        moving_mean     = moving_mean * momentum + mean * (1 - momentum)
        moving_variance = moving_variance * momentum + variance * (1 - momentum)

    Between window ends they do not change. The window's sums are
    non-trainable weights, so they are saved and restored with the model.

    Trade-off: only the *moving* statistics (used at inference) see the
    window. In a training forward pass each micro-batch is still normalised
    with its own mean and variance, exactly as plain BatchNormalization does,
    so tiny micro-batches still give noisy activations and gradients. If
    micro-batches are only a few examples, prefer a batch-independent
    normalisation (``GroupNormalization``, ``LayerNormalization``). Note
    ``momentum`` now applies per window, not per micro-batch: to keep the same
    averaging horizon in optimizer steps, keep the usual value (e.g. 0.99).

    Example:

    >>> import numpy as np
    >>> bn = AccumBatchNormalization(accumulation_steps=2, momentum=0.5)
    >>> a = np.zeros((4, 1), "float32"); b = np.full((4, 1), 4.0, "float32")
    >>> _ = bn(a, training=True)   # window open: moving stats unchanged
    >>> _ = bn(b, training=True)   # window closed: pooled mean 2, variance 4
    >>> bn.moving_mean.numpy().tolist(), bn.moving_variance.numpy().tolist()
    ([1.0], [2.5])

    (Plain BatchNormalization would have averaged in the two micro-batches'
    own variances, both 0.)

    Args:
      accumulation_steps: int >= 1, training calls per window (match the
        optimizer's accumulation steps). 1 updates every call, like plain
        BatchNormalization.
      axis, momentum, epsilon, center, scale: as in
        `keras.layers.BatchNormalization`.
      **kwargs: the other `keras.layers.BatchNormalization` arguments
        (initializers, regularizers, constraints, ``synchronized``, ``name``,
        ``dtype``...). With ``synchronized=True`` the moments are global but
        each replica weights them by its own element count, which is exact
        when replicas get equal shares of each micro-batch.

    Raises:
      ValueError: ``accumulation_steps`` is not an integer >= 1, or
        ``renorm=True`` (batch renormalisation corrects each micro-batch with
        statistics that this layer only refreshes per window).
    """

    def __init__(self, accumulation_steps, axis=-1, momentum=0.99,
                 epsilon=1e-3, center=True, scale=True, **kwargs):
        _host.check_backend("AccumBatchNormalization")
        steps = batch_stats.check_accumulation_steps(accumulation_steps)
        if kwargs.get("renorm", False):
            raise ValueError(
                "`renorm=True` is not supported by AccumBatchNormalization: "
                "batch renormalisation corrects every micro-batch with moving "
                "statistics that this layer refreshes only once per window. "
                f"Received: renorm={kwargs['renorm']!r}. Accepted: "
                "renorm=False (or use keras.layers.BatchNormalization).")
        super().__init__(axis=axis, momentum=momentum, epsilon=epsilon,
                         center=center, scale=scale, **kwargs)
        self.accumulation_steps = steps
        self._window = None

    def build(self, input_shape):
        super().build(input_shape)
        shape = tuple(self.moving_mean.shape)

        def make_variable(name, per_feature):
            # Same placement and replica handling as the moving statistics.
            if per_feature:
                # Window sums and counts of a 16-bit layer (dtype="bfloat16")
                # in float32, as tf_keras keeps them: a bfloat16 count stops
                # at 256 and each add to a 16-bit sum rounds.
                return self.add_weight(shape=shape, name=name,
                                       initializer="zeros", trainable=False,
                                       autocast=False,
                                       dtype=sum_dtype(self.moving_mean.dtype).name)
            return self.add_weight(shape=(), name=name, initializer="zeros",
                                   dtype="int64", trainable=False)

        self._window = batch_stats.init_window_moments(make_variable)

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less than the "
                f"inputs. Received: mask.shape={mask.shape}, "
                f"inputs.shape={inputs.shape}")

        # As keras.layers.BatchNormalization's training branch, with the
        # per-call moving-average update replaced by the window.
        inputs = ops.cast(inputs, keras.backend.result_type(inputs.dtype,
                                                            "float32"))
        mean, variance = self._moments(inputs, mask)
        batch_stats.update_window_moments(
            self._window, self.moving_mean, self.moving_variance,
            batch_stats.element_count(inputs, self._reduction_axes, mask),
            mean, variance, momentum=self.momentum,
            steps=self.accumulation_steps)

        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        outputs = ops.batch_normalization(
            x=inputs, mean=mean, variance=variance, axis=self.axis,
            offset=beta, scale=gamma, epsilon=self.epsilon)
        return ops.cast(outputs, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(),
                "accumulation_steps": self.accumulation_steps}
