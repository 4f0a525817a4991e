"""Callbacks for whichever flavour ``tf.keras`` is (see ``tf_gradkit._flavour``)."""

from tf_gradkit import _flavour

__all__ = ["ExactBackupAndRestore", "PreciseBatchNorm", "UpdateMonitor"]

__getattr__, __dir__ = _flavour.lazy_exports(__name__, __all__, submodule="callbacks")
