"""Constraint objects for whichever flavour ``tf.keras`` is (see ``_flavour``):
usable as ``kernel_constraint=`` or called on a tensor to project it."""

from tf_gradkit import _constraints_common
from tf_gradkit import _flavour

__all__ = list(_constraints_common.NAMES)

__getattr__, __dir__ = _flavour.lazy_exports(__name__, __all__, "constraints")
