"""tf_gradkit for tf_keras (the Keras 2 line tfmot needs). Imports tf_keras only."""

from tf_gradkit.tf_keras.gradient_accumulator import GradientAccumulator
from tf_gradkit.tf_keras.layers import AccumBatchNormalization
from tf_gradkit.tf_keras.levenberg_marquardt import LevenbergMarquardt

__all__ = ["AccumBatchNormalization", "GradientAccumulator", "LevenbergMarquardt"]
