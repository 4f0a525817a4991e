"""tf_keras's callbacks: the algorithms of `tf_gradkit._algorithms` on
``tf_keras.callbacks.Callback``."""

import tf_keras

from tf_gradkit._algorithms import exact_resume as _exact_resume
from tf_gradkit._algorithms import precise_bn as _precise_bn
from tf_gradkit._algorithms import update_monitor as _update_monitor

__all__ = ["ExactBackupAndRestore", "PreciseBatchNorm", "UpdateMonitor"]


class UpdateMonitor(_update_monitor.UpdateMonitor, tf_keras.callbacks.Callback):
    __doc__ = _update_monitor.UpdateMonitor.__doc__
    _CALLBACK_BASE = tf_keras.callbacks.Callback


class PreciseBatchNorm(_precise_bn.PreciseBatchNorm, tf_keras.callbacks.Callback):
    __doc__ = _precise_bn.PreciseBatchNorm.__doc__


class ExactBackupAndRestore(_exact_resume.ExactBackupAndRestore, tf_keras.callbacks.Callback):
    __doc__ = _exact_resume.ExactBackupAndRestore.__doc__
