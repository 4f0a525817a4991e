"""What every tf_gradkit optimizer wrapper shares.

`GradientAccumulator`, `Projected`, `AugmentedLagrangian` and
`pruning.MaskAware` each take an optimizer and return one (STYLE.md, point 3).
They all hold it as ``inner_optimizer``, report its ``iterations`` and learning
rate (so schedules, callbacks and checkpoints see real updates), list their own
variables before the inner one's, and build the inner one first. The two
flavours differ in how: Keras 3 builds once (``self.built``) and keeps its
variables in a tracker; tf_keras keeps them in ``_variables``, assigns
``iterations`` in its constructor and lets the inner optimizer scale losses in
``compute_gradients``. One mixin per flavour holds that; each wrapper provides
``_build_own(var_list)`` for its own state.

Nothing here imports a Keras at import time: each flavour's mixin is only used
by classes of that flavour.
"""

import tensorflow as tf


class WrapperMixin:
    """Flavour-independent delegation to ``self.inner_optimizer``."""

    _KERAS = None  # set by each adapter: `keras` or `tf_keras`

    @property
    def iterations(self):
        """The inner optimizer's updates (schedules and logs see those)."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def _build_own(self, var_list):
        """The wrapper's own state, after the inner optimizer is built."""
        del var_list

    def _inner_config(self):
        return self._KERAS.optimizers.serialize(self.inner_optimizer)

    @classmethod
    def _inner_from_config(cls, config, custom_objects=None):
        """Pops and rebuilds the nested inner optimizer of ``config``."""
        return cls._KERAS.optimizers.deserialize(
            config.pop("optimizer"), custom_objects=custom_objects)


class Keras3WrapperMixin(WrapperMixin):
    """Keras 3: ``built``, tracked variables, ``build`` once."""

    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._build_own(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables[:] + self.inner_optimizer.variables

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    def _built_for(self, trainable_variables):
        """The variables of an ``apply`` call, building on the first one."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    f"{type(self).__name__}.apply: pass `trainable_variables` "
                    "on the first call, or call `build(variables)` first.")
            return list(self._trainable_variables)
        trainable_variables = list(trainable_variables)
        if not self.built:
            import keras  # noqa: PLC0415 - only Keras 3 classes use this mixin
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        return trainable_variables


class TfKerasWrapperMixin(WrapperMixin):
    """tf_keras: ``_built``, ``_variables``, an assignable ``iterations`` and
    the inner optimizer's ``compute_gradients`` (where a LossScaleOptimizer
    scales the loss and unscales the gradients)."""

    @property
    def iterations(self):
        """The inner optimizer's updates (schedules and logs see those)."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, variable):
        self.inner_optimizer.iterations = variable

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        var_list = list(var_list)
        self.inner_optimizer.build(var_list)  # idempotent in tf_keras
        self._trainable_variables = var_list
        self._build_own(var_list)
        self._built = True

    @property
    def variables(self):
        from tf_keras.src.optimizers.optimizer import CallableList  # noqa: PLC0415
        return CallableList(list(self._variables) + list(self.inner_optimizer.variables))

    def compute_gradients(self, loss, var_list, tape=None):
        return self.inner_optimizer.compute_gradients(loss, var_list, tape=tape)

    def _built_pairs(self, grads_and_vars):
        """``(grads, variables)`` of an ``apply_gradients`` call, building on
        the first one; None when there is nothing to apply."""
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return None
        grads, variables = zip(*grads_and_vars)
        with tf.init_scope():
            self.build(variables)
        return list(grads), list(variables)
