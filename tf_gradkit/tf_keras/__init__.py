"""tf_gradkit for tf_keras (the Keras 2 line tfmot needs). Imports tf_keras only."""

# Imported eagerly so that every class is registered for deserialisation
# (``load_model``) as soon as this flavour package is imported.
from tf_gradkit.tf_keras.augmented_lagrangian import AugmentedLagrangian
from tf_gradkit.tf_keras.augmented_lagrangian import ConstraintSpec
from tf_gradkit.tf_keras.augmented_lagrangian import Equality
from tf_gradkit.tf_keras.augmented_lagrangian import Inequality
from tf_gradkit.tf_keras.conditional_gradient import ConditionalGradient
from tf_gradkit.tf_keras.gradient_accumulator import GradientAccumulator
from tf_gradkit.tf_keras.layers import AccumBatchNormalization
from tf_gradkit.tf_keras.levenberg_marquardt import LevenbergMarquardt
from tf_gradkit.tf_keras.projected import Projected

__all__ = [
    "AccumBatchNormalization",
    "AugmentedLagrangian",
    "ConditionalGradient",
    "ConstraintSpec",
    "Equality",
    "GradientAccumulator",
    "Inequality",
    "LevenbergMarquardt",
    "Projected",
]
