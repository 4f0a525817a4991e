"""GradientAccumulator for Keras 3 (the thin adapter; the rule is in core)."""

import contextlib

import keras
import tensorflow as tf

from tf_gradkit import _accumulator_common as common
from tf_gradkit import _docs
from tf_gradkit.core import accumulation
from tf_gradkit.core import windowed_apply


@keras.saving.register_keras_serializable(package="tf_gradkit")
class GradientAccumulator(keras.optimizers.Optimizer):
    __doc__ = _docs.GRADIENT_ACCUMULATOR.format(flavour="Keras 3", K="keras")

    def __init__(self, optimizer, steps, reduction="example", model=None,
                 epoch_end="apply", nonfinite="skip", name=None, **kwargs):
        if kwargs:
            raise TypeError(
                "GradientAccumulator: unexpected arguments "
                f"{sorted(kwargs)}; set learning rate, clipping, weight decay "
                "and EMA on the inner optimizer.")
        common.validate_arguments(steps, reduction, epoch_end, nonfinite)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(_docs.wrong_optimizer(optimizer, "keras3"))
        if model is not None and not isinstance(model, keras.Model):
            raise TypeError(
                "GradientAccumulator: `model` must be a keras.Model (Keras 3). "
                f"Received: model={type(model).__module__}.{type(model).__name__}")
        super().__init__(learning_rate=0.0, name=name or "gradient_accumulator")
        self.inner_optimizer = optimizer
        self.steps = steps
        self.reduction = reduction
        self.epoch_end = epoch_end
        self.nonfinite = nonfinite
        self._hooks = None
        if model is not None:
            self._hooks = common.ModelHooks.install(
                model, self, keras.callbacks.Callback)

    # ----------------------------------------------------------------- state
    def _make_variable(self, reference, name, per_replica=True, dtype=None):
        var = keras.Variable(
            initializer="zeros", shape=reference.shape,
            dtype=dtype or reference.dtype, trainable=False,
            synchronization="on_read",
            aggregation="sum" if per_replica else "only_first_replica",
            name=name)
        self._track_variable(var)
        return var.value  # the tf.Variable: the core speaks plain TensorFlow

    def _make_scalar(self, dtype, name, per_replica):
        return self._make_variable(
            tf.TensorSpec((), dtype), name, per_replica, dtype=dtype.name)

    def _strategy_scope(self):
        if tf.distribute.has_strategy():
            return contextlib.nullcontext()
        return self._distribution_strategy.scope()

    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        with self._strategy_scope():
            self._state = accumulation.init_accumulation(
                var_list, self._make_variable, self._make_scalar)
            self._micro_steps = self._make_scalar(tf.int64, "micro_steps", False)
            self._dropped = self._make_scalar(tf.int64, "dropped_gradients", False)
            self._skipped = self._make_scalar(tf.int64, "skipped_windows", False)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables[:] + self.inner_optimizer.variables

    # ------------------------------------------------------------ the update
    def apply_gradients(self, grads_and_vars, sample_count=None, local_step=None):
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables, sample_count=sample_count,
                   local_step=local_step)
        return self.iterations

    def apply(self, grads, trainable_variables=None, sample_count=None,
              local_step=None):
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "GradientAccumulator.apply: pass `trainable_variables` on "
                    "the first call, or call `build(variables)` first.")
            trainable_variables = self._trainable_variables
        grads = list(grads)
        trainable_variables = list(trainable_variables)
        common.validate_grads_and_vars(grads, trainable_variables)
        if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
            raise ValueError(
                "GradientAccumulator.apply_gradients must be called in replica "
                "context, i.e. inside `strategy.run`.")
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        grads = self._align(grads, trainable_variables)
        if self.nonfinite == "raise":
            grads = _check_numerics(grads)
        weight = common.micro_batch_weight(self.reduction, sample_count,
                                           self._hooks)
        accept = True
        if local_step is not None:
            accept = tf.cast(local_step, tf.int64) >= tf.cast(
                self.iterations, tf.int64)
        has_grad = [g is not None for g in grads]
        windowed_apply.micro_step(
            self._state, grads, weight=weight, accept=accept, steps=self.steps,
            apply_window=lambda total: self._apply_window(total, has_grad),
            skip_window=lambda: self._skip_window(has_grad),
            count_dropped=lambda: self._dropped.assign_add(1))
        self._micro_steps.assign_add(tf.cast(accept, tf.int64))

    def _align(self, grads, variables):
        """Orders gradients like the variables the optimizer was built with."""
        by_key = {self._var_key(v): g for g, v in zip(grads, variables)}
        return [by_key.get(self._var_key(v)) for v in self._trainable_variables]

    def _window_grads(self, total_weight, has_grad):
        grads = accumulation.window_gradients(
            self._state, self.reduction, total_weight,
            windowed_apply._num_replicas())
        return [g if h else None for g, h in zip(grads, has_grad)]

    def _apply_window(self, total_weight, has_grad):
        grads = self._window_grads(total_weight, has_grad)
        pairs = [(g, v) for g, v in zip(grads, self._trainable_variables)
                 if g is not None]
        self.inner_optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        accumulation.reset(self._state)

    def _skip_window(self, has_grad):
        if isinstance(self.inner_optimizer, keras.optimizers.LossScaleOptimizer):
            # Let the loss-scale optimizer see the overflow: it lowers its
            # scale and skips the update itself, leaving the inner state as is.
            self._apply_window(self._state.weight.read_value(), has_grad)
        else:
            accumulation.reset(self._state)
        self._skipped.assign_add(1)

    # ------------------------------------------------------ window control
    def flush(self):
        """Applies a partially filled window now (no-op when it is empty).

        For custom loops at the end of the data; ``model.fit`` with
        ``model=`` does this at each epoch end when ``epoch_end="apply"``.
        """
        self._run_in_replicas(self._flush_in_replica)

    def discard(self):
        """Drops whatever the open window holds; weights and state unchanged."""
        self._run_in_replicas(lambda: accumulation.reset(self._state))

    def end_epoch(self):
        """Applies the ``epoch_end`` policy: "apply", "carry" or "drop"."""
        if not self.built:
            return
        if self.epoch_end == "apply":
            self.flush()
        elif self.epoch_end == "drop":
            self.discard()

    def _flush_in_replica(self):
        has_grad = [True] * len(self._trainable_variables)
        windowed_apply.micro_step(
            self._state, [None] * len(has_grad), weight=None, accept=True,
            steps=self.steps, force=True,
            apply_window=lambda total: self._apply_window(total, has_grad),
            skip_window=lambda: self._skip_window(has_grad),
            count_dropped=lambda: None)

    def _run_in_replicas(self, fn):
        if not self.built:
            return
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            tf.distribute.get_strategy().run(fn)
        else:
            fn()

    # ------------------------------------------------------------ reporting
    @property
    def iterations(self):
        """Real (inner) updates: schedules and checkpoints see real steps."""
        return self.inner_optimizer.iterations

    @property
    def micro_steps(self):
        """Micro-batches accepted so far (all windows)."""
        return self._micro_steps

    @property
    def window_micro_step(self):
        """Micro-batches in the open window."""
        return self._state.micro_step

    @property
    def dropped_gradients(self):
        """Gradients dropped as stale (``local_step`` < ``iterations``)."""
        return self._dropped

    @property
    def skipped_windows(self):
        """Windows discarded because a micro-batch had a NaN or Inf."""
        return self._skipped

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -------------------------------------------------------------- config
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.optimizers.serialize(self.inner_optimizer),
            "steps": self.steps,
            "reduction": self.reduction,
            "epoch_end": self.epoch_end,
            "nonfinite": self.nonfinite,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.optimizers.deserialize(
            config.pop("optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


def _check_numerics(grads):
    out = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            g = tf.IndexedSlices(tf.debugging.check_numerics(
                g.values, "GradientAccumulator: non-finite gradient"),
                g.indices, g.dense_shape)
        elif g is not None:
            g = tf.debugging.check_numerics(
                g, "GradientAccumulator: non-finite gradient")
        out.append(g)
    return out
