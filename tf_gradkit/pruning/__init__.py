"""Pruning that stays pruned: tfmot interoperation (tf_keras only).

tensorflow-model-optimization prunes tf_keras models only. Nothing here imports
tfmot (whose import sets ``TF_USE_LEGACY_KERAS=1`` for the process) or sets an
environment variable; each name loads its module (and tf_keras) at first use.

- `MaskAware`: an optimizer wrapper; pruned weights and their optimizer state
  are exactly zero after every update.
- `UpdatePruningStepFromOptimizer`: tfmot's ``UpdatePruningStep`` counting
  real optimizer updates (so gradient accumulation does not speed schedules up).
- `PruningStepper`: the same for custom training loops, plus ``strip()``.
- `strip_pruning`: ``tfmot.sparsity.keras.strip_pruning``.
"""

from tf_gradkit import _flavour

_MEMBERS = {
    "MaskAware": "mask_aware",
    "PruningStepper": "stepping",
    "UpdatePruningStepFromOptimizer": "stepping",
    "strip_pruning": "stepping",
}

__all__ = sorted(_MEMBERS)

__getattr__, __dir__ = _flavour.lazy_members(__name__, _MEMBERS)
