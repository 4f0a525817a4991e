"""What both GradientAccumulator adapters share, none of it Keras-specific.

- argument validation (so both flavours reject bad input with the same words);
- the model hooks: the batch size seen by ``train_step`` (for ``reduction=
  "example"`` under ``model.fit``) and an epoch-end callback added to
  ``model.fit`` (for the ``epoch_end`` policy). They are installed on the model
  instance only, never on its class, and only when the user hands the model in.
"""

import functools
import threading
import weakref

import tensorflow as tf

from tf_gradkit.core.accumulation import REDUCTIONS

EPOCH_END_POLICIES = ("apply", "carry", "drop")
NONFINITE_POLICIES = ("skip", "raise")


def validate_arguments(steps, reduction, epoch_end, nonfinite):
    """Raises a clear error for a bad constructor argument; changes nothing."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            "GradientAccumulator: `steps` must be an integer >= 1 (the number "
            f"of micro-batches per update). Received: steps={steps!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"GradientAccumulator: `reduction` must be one of {REDUCTIONS}. "
            f"Received: reduction={reduction!r}")
    if epoch_end not in EPOCH_END_POLICIES:
        raise ValueError(
            f"GradientAccumulator: `epoch_end` must be one of "
            f"{EPOCH_END_POLICIES}. Received: epoch_end={epoch_end!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"GradientAccumulator: `nonfinite` must be one of "
            f"{NONFINITE_POLICIES}. Received: nonfinite={nonfinite!r}")


def validate_grads_and_vars(grads, variables):
    if len(grads) != len(variables):
        raise ValueError(
            "GradientAccumulator.apply_gradients: got "
            f"{len(grads)} gradients for {len(variables)} variables; pass one "
            "gradient (or None) per variable, as (gradient, variable) pairs.")


def micro_batch_weight(reduction, sample_count, probe):
    """How much one micro-batch counts (float32 scalar)."""
    if reduction != "example":
        return tf.constant(1.0, tf.float32)
    if sample_count is None and probe is not None:
        sample_count = probe.current()
    if sample_count is None:
        return tf.constant(1.0, tf.float32)
    return tf.cast(sample_count, tf.float32)


def batch_size_of(data):
    """The leading dimension of the first tensor in a ``train_step`` batch."""
    first = tf.nest.flatten(data)[0]
    return tf.shape(first)[0]


class ModelHooks:
    """Wraps ``model.train_step`` and ``model.fit`` of one model instance.

    ``train_step`` records its batch size in thread-local storage (replicas of
    ``MirroredStrategy`` run in threads) for the optimizer's next
    ``apply_gradients`` call in the same trace; ``fit`` gets one extra callback
    that tells the optimizer when an epoch's data has ended.
    """

    _ATTR = "_tf_gradkit_model_hooks"

    def __init__(self, model):
        self._local = threading.local()
        self._optimizer_ref = None
        self._model_ref = weakref.ref(model)

    @classmethod
    def install(cls, model, optimizer, callback_base):
        hooks = model.__dict__.get(cls._ATTR)
        if hooks is None:
            hooks = cls(model)
            hooks._wrap(model, callback_base)
            object.__setattr__(model, cls._ATTR, hooks)
        hooks._optimizer_ref = weakref.ref(optimizer)
        return hooks

    def current(self):
        return getattr(self._local, "batch_size", None)

    def _optimizer(self):
        return self._optimizer_ref() if self._optimizer_ref else None

    def _wrap(self, model, callback_base):
        original_train_step = model.train_step
        hooks = self

        @functools.wraps(original_train_step)
        def train_step(data):
            hooks._local.batch_size = batch_size_of(data)
            try:
                return original_train_step(data)
            finally:
                hooks._local.batch_size = None

        class _EpochEnd(callback_base):
            """Applies the ``epoch_end`` policy of the model's accumulator."""

            def on_epoch_end(self, epoch, logs=None):
                del epoch, logs
                optimizer = hooks._optimizer()
                # Only when the model still trains with that accumulator.
                if optimizer is not None and hooks._model_uses(optimizer):
                    optimizer.end_epoch()

        original_fit = model.fit

        @functools.wraps(original_fit)
        def fit(*args, **kwargs):
            args = list(args)
            if len(args) > 5:  # fit(x, y, batch_size, epochs, verbose, callbacks)
                callbacks = list(args[5] or [])
                args[5] = callbacks + [_EpochEnd()]
            else:
                callbacks = list(kwargs.pop("callbacks", None) or [])
                kwargs["callbacks"] = callbacks + [_EpochEnd()]
            return original_fit(*args, **kwargs)

        object.__setattr__(model, "train_step", train_step)
        object.__setattr__(model, "fit", fit)

    def _model_uses(self, optimizer):
        model = self._model_ref()
        return model is not None and getattr(model, "optimizer", None) is optimizer
