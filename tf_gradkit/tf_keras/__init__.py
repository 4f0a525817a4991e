"""tf_gradkit for tf_keras (the Keras 2 line tfmot needs). Imports tf_keras only
(each name loads its module at first use)."""

from tf_gradkit import _flavour

_MEMBERS = {
    "AccumBatchNormalization": "layers",
    "AugmentedLagrangian": "augmented_lagrangian",
    "ConditionalGradient": "conditional_gradient",
    "GradientAccumulator": "gradient_accumulator",
    "LevenbergMarquardt": "levenberg_marquardt",
    "Projected": "projected",
}

__all__ = sorted(_MEMBERS)

__getattr__, __dir__ = _flavour.lazy_members(__name__, _MEMBERS)
