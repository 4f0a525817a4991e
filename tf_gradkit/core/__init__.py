"""Keras-free update rules: pure TensorFlow over lists of tensors and variables."""

from tf_gradkit.core.accumulation import AccumulationState
from tf_gradkit.core.accumulation import REDUCTIONS
from tf_gradkit.core.accumulation import accumulate
from tf_gradkit.core.accumulation import all_finite
from tf_gradkit.core.accumulation import dense_sums_finite
from tf_gradkit.core.accumulation import init_accumulation
from tf_gradkit.core.accumulation import start_next_window
from tf_gradkit.core.accumulation import weight_is_finite
from tf_gradkit.core.accumulation import window_gradients
from tf_gradkit.core.accumulation import window_finite
from tf_gradkit.core.accumulation import window_is_finite
from tf_gradkit.core.accumulation import window_sums
from tf_gradkit.core.conditional_accumulator import ConditionalAccumulator
from tf_gradkit.core import augmented_lagrangian
from tf_gradkit.core import frank_wolfe
from tf_gradkit.core import matrix_projections
from tf_gradkit.core import projections

__all__ = [
    "AccumulationState",
    "REDUCTIONS",
    "accumulate",
    "all_finite",
    "dense_sums_finite",
    "init_accumulation",
    "start_next_window",
    "weight_is_finite",
    "window_gradients",
    "window_finite",
    "window_is_finite",
    "window_sums",
    "ConditionalAccumulator",
    "augmented_lagrangian",
    "frank_wolfe",
    "matrix_projections",
    "projections",
]
