"""keras3's callbacks: the algorithms of `tf_gradkit._algorithms` on
``keras.callbacks.Callback``."""

import keras

from tf_gradkit._algorithms import exact_resume as _exact_resume
from tf_gradkit._algorithms import precise_bn as _precise_bn
from tf_gradkit._algorithms import update_monitor as _update_monitor

__all__ = ["ExactBackupAndRestore", "PreciseBatchNorm", "UpdateMonitor"]


class UpdateMonitor(_update_monitor.UpdateMonitor, keras.callbacks.Callback):
    __doc__ = _update_monitor.UpdateMonitor.__doc__
    _CALLBACK_BASE = keras.callbacks.Callback


class PreciseBatchNorm(_precise_bn.PreciseBatchNorm, keras.callbacks.Callback):
    __doc__ = _precise_bn.PreciseBatchNorm.__doc__


class ExactBackupAndRestore(_exact_resume.ExactBackupAndRestore, keras.callbacks.Callback):
    __doc__ = _exact_resume.ExactBackupAndRestore.__doc__
