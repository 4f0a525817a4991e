"""tf_gradkit for Keras 3 (``keras``). Importing this imports Keras 3 only."""

# Imported eagerly so that every class is registered for deserialisation
# (``load_model``) as soon as this flavour package is imported.
from tf_gradkit.keras3.augmented_lagrangian import AugmentedLagrangian
from tf_gradkit.keras3.augmented_lagrangian import ConstraintSpec
from tf_gradkit.keras3.augmented_lagrangian import Equality
from tf_gradkit.keras3.augmented_lagrangian import Inequality
from tf_gradkit.keras3.conditional_gradient import ConditionalGradient
from tf_gradkit.keras3.gradient_accumulator import GradientAccumulator
from tf_gradkit.keras3.layers import AccumBatchNormalization
from tf_gradkit.keras3.levenberg_marquardt import LevenbergMarquardt
from tf_gradkit.keras3.projected import Projected

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
