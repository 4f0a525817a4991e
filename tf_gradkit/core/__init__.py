"""Keras-free update rules: pure TensorFlow over lists of tensors and variables."""

from tf_gradkit.core.accumulation import AccumulationState
from tf_gradkit.core.accumulation import REDUCTIONS
from tf_gradkit.core.accumulation import accumulate
from tf_gradkit.core.accumulation import all_finite
from tf_gradkit.core.accumulation import init_accumulation
from tf_gradkit.core.accumulation import window_gradients
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
    "init_accumulation",
    "window_gradients",
    "ConditionalAccumulator",
    "augmented_lagrangian",
    "frank_wolfe",
    "matrix_projections",
    "projections",
]
