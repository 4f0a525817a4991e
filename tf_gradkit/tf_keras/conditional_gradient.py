"""ConditionalGradient for tf_keras: the thin adapter (the rule, its oracles and
argument checks are in `tf_gradkit.core.frank_wolfe`)."""

import tensorflow as tf
import tf_keras

from tf_gradkit import _docs
from tf_gradkit.core import frank_wolfe as fw


@tf_keras.saving.register_keras_serializable(package="tf_gradkit")
class ConditionalGradient(tf_keras.optimizers.Optimizer):
    __doc__ = _docs.CONDITIONAL_GRADIENT.format(flavour="tf_keras", K="tf_keras",
                                  path_attr="``variable.name`` (e.g. ``dense/kernel:0``)")

    def __init__(self, learning_rate, lambda_=0.01, epsilon=1e-7, ord="fro",
                 k=None, power_iterations=2, name=None, **kwargs):
        # pylint: disable=redefined-builtin
        fw.validate_arguments(learning_rate, lambda_, epsilon, ord, k,
                              power_iterations)
        super().__init__(name=name or "conditional_gradient", **kwargs)
        self._learning_rate = self._build_learning_rate(learning_rate)
        self.lambda_ = dict(lambda_) if isinstance(lambda_, dict) else float(lambda_)
        self.epsilon = epsilon
        self.ord = ord
        self.k = k
        self.power_iterations = power_iterations
        self._oracle = fw.make_oracle(ord, k, epsilon, power_iterations)

    def build(self, var_list):
        var_list = list(var_list)
        if not getattr(self, "_built", False):  # check before building anything
            radii = fw.resolve_radii(self.lambda_, [v.name for v in var_list])
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self._radii = radii
        self._singular_vectors = []
        for var in var_list:
            shape = self._oracle.state_shape(var.shape)
            self._singular_vectors.append(None if shape is None else
                                          self.add_variable_from_reference(
                                              var, "singular_vector", shape=shape,
                                              initial_value=fw.initial_singular_vector(
                                                  shape[0], var.dtype)))
        self._built = True

    def update_step(self, gradient, variable):
        index = self._index_dict[self._var_key(variable)]
        vector = self._singular_vectors[index]
        lr = tf.cast(self.learning_rate, variable.dtype)
        s, new_vector = self._oracle(gradient, self._radii[index], vector)
        variable.assign(fw.frank_wolfe_update(variable, s, lr))
        if vector is not None:
            vector.assign(new_vector)

    def get_config(self):
        config = super().get_config()
        config.update(
            learning_rate=self._serialize_hyperparameter(self._learning_rate),
            lambda_=self.lambda_, epsilon=self.epsilon, ord=self.ord, k=self.k,
            power_iterations=self.power_iterations)
        return config
