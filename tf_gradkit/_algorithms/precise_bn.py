"""PreciseBatchNorm: a callback that recomputes BatchNormalization's
statistics exactly after training (or after every epoch), with
`tf_gradkit.gradients.recompute_batch_norm_statistics`."""

from tf_gradkit.gradients.batch_norm import recompute_batch_norm_statistics


class PreciseBatchNorm:
    """Recomputes BatchNormalization's statistics exactly after training
    (or after every epoch), over ``num_batches`` batches of ``data``
    (`recompute_batch_norm_statistics`).

    Args:
      data: a ``tf.data.Dataset`` or iterable of training batches
        (``x`` or ``(x, y[, w])``).
      num_batches: batches to use (None: all of ``data``).
      every_epoch: also at each epoch's end (callbacks after this one in
        the list, e.g. a ModelCheckpoint, then see precise statistics; Keras
        validates before epoch-end callbacks, so validation does not);
        otherwise only at the end of training.

    Example:

    >>> model.fit(x, y, batch_size=8, callbacks=[PreciseBatchNorm(
    ...     tf.data.Dataset.from_tensor_slices(x).batch(256), num_batches=20)])
    """

    def __init__(self, data, num_batches=None, every_epoch=False):
        if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(
                num_batches, int) or num_batches < 1):
            raise ValueError("PreciseBatchNorm: `num_batches` must be None or an "
                             f"integer >= 1. Received: num_batches={num_batches!r}")
        super().__init__()
        self.data, self.num_batches, self.every_epoch = data, num_batches, every_epoch
        self.counts = None

    def on_epoch_end(self, epoch, logs=None):
        del epoch, logs
        if self.every_epoch:
            self.counts = recompute_batch_norm_statistics(self.model, self.data,
                                                          self.num_batches)

    def on_train_end(self, logs=None):
        del logs
        self.counts = recompute_batch_norm_statistics(self.model, self.data,
                                                      self.num_batches)
