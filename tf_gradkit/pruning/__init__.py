"""Pruning that stays pruned: our own for both flavours, and tfmot's (tf_keras).

- `MagnitudePruning`: magnitude pruning with masks as optimizer state, for
  Keras 3 (which tfmot does not support) and tf_keras alike: the active
  flavour's class (``tf_gradkit.keras3.MagnitudePruning`` or
  ``tf_gradkit.tf_keras.MagnitudePruning``); `PolynomialDecay` and
  `ConstantSparsity` schedules with tfmot's semantics, and `PruningSchedule`,
  their base class, to write your own (pure TensorFlow, both flavours).

tensorflow-model-optimization prunes tf_keras models only. Nothing here imports
tfmot (whose import sets ``TF_USE_LEGACY_KERAS=1`` for the process) or sets an
environment variable; each name loads its module (and tf_keras) at first use.

- `MaskAware`: an optimizer wrapper; pruned weights and their optimizer state
  are exactly zero after every update. Here always tf_keras's
  (``tf_gradkit.tf_keras.MaskAware``, tfmot's flavour);
  ``tf_gradkit.keras3.MaskAware`` takes explicit masks.
- `UpdatePruningStepFromOptimizer`: tfmot's ``UpdatePruningStep`` counting
  real optimizer updates (so gradient accumulation does not speed schedules up).
- `PruningStepper`: the same for custom training loops, plus ``strip()``.
- `strip_pruning`: ``tfmot.sparsity.keras.strip_pruning``.
"""

import importlib

from tf_gradkit import _flavour

_MEMBERS = {
    "PruningStepper": "stepping",
    "UpdatePruningStepFromOptimizer": "stepping",
    "strip_pruning": "stepping",
}

_SCHEDULES = ("ConstantSparsity", "PolynomialDecay", "PruningSchedule")

__all__ = sorted(list(_MEMBERS) + ["MagnitudePruning", "MaskAware"] + list(_SCHEDULES))

_members, _ = _flavour.lazy_members(__name__, _MEMBERS)


def __getattr__(name):
    if name == "MagnitudePruning":  # the active flavour's class
        return _flavour.resolve(name, __name__)
    if name == "MaskAware":  # tf_keras's, whatever the process's flavour (tfmot's)
        return importlib.import_module("tf_gradkit.tf_keras").MaskAware
    if name in _SCHEDULES:
        from tf_gradkit.core import pruning_schedule  # noqa: PLC0415
        return getattr(pruning_schedule, name)
    return _members(name)


def __dir__():
    return list(__all__)
