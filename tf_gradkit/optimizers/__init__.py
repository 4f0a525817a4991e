"""Optimizers for whichever flavour ``tf.keras`` is (see ``tf_gradkit._flavour``).

``tf_gradkit.optimizers.GradientAccumulator`` is
``tf_gradkit.keras3.GradientAccumulator`` by default and
``tf_gradkit.tf_keras.GradientAccumulator`` when ``TF_USE_LEGACY_KERAS=1``.
"""

from tf_gradkit import _flavour

__all__ = ["GradientAccumulator", "LevenbergMarquardt"]


def __getattr__(name):
    if name in __all__:
        return _flavour.resolve(name, __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(__all__)
