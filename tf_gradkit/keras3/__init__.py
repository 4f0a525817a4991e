"""tf_gradkit for Keras 3 (``keras``). Importing this imports Keras 3 only."""

from tf_gradkit.keras3.gradient_accumulator import GradientAccumulator
from tf_gradkit.keras3.layers import AccumBatchNormalization
from tf_gradkit.keras3.levenberg_marquardt import LevenbergMarquardt

__all__ = ["AccumBatchNormalization", "GradientAccumulator", "LevenbergMarquardt"]
