"""Constraint objects for tf_keras (definitions shared in `_constraints_common`)."""

import tf_keras

from tf_gradkit import _constraints_common as common

_CLASSES = common.build_constraints(tf_keras.constraints.Constraint,
                                    tf_keras.saving.register_keras_serializable)
globals().update(_CLASSES)

__all__ = list(common.NAMES)
