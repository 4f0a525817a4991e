"""tf_gradkit for Keras 3 (``keras``). Importing this imports Keras 3 only."""

from tf_gradkit.keras3.gradient_accumulator import GradientAccumulator

__all__ = ["GradientAccumulator"]
