"""Constraint objects for Keras 3 (definitions shared in `_constraints_common`)."""

import keras

from tf_gradkit import _constraints_common as common

_CLASSES = common.build_constraints(keras.constraints.Constraint,
                                    keras.saving.register_keras_serializable)
globals().update(_CLASSES)

__all__ = list(common.NAMES)
