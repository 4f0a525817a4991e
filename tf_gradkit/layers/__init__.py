"""Layers for whichever flavour ``tf.keras`` is (see ``tf_gradkit._flavour``)."""

from tf_gradkit import _flavour

__all__ = ["AccumBatchNormalization"]


def __getattr__(name):
    if name in __all__:
        return _flavour.resolve(name, __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(__all__)
