"""tf_gradkit: optimizers plain Keras lacks, for Keras 3 and tf_keras.

Public names resolve to the Keras flavour that ``tf.keras`` is in this process
(Keras 3 by default, tf_keras when ``TF_USE_LEGACY_KERAS=1``); both flavours are
reachable explicitly as ``tf_gradkit.keras3`` and ``tf_gradkit.tf_keras``.
Importing tf_gradkit sets no environment variable and imports no Keras: each
flavour is imported the first time one of its names is used.
"""

import importlib

from tf_gradkit.core.augmented_lagrangian import ConstraintSpec
from tf_gradkit.core.augmented_lagrangian import Equality
from tf_gradkit.core.augmented_lagrangian import Inequality
from tf_gradkit.core.conditional_accumulator import ConditionalAccumulator
from tf_gradkit.core.lm.solve import LeastSquaresResult, least_squares

__version__ = "0.1.0"

__all__ = [
    "ConditionalAccumulator",
    "ConstraintSpec",
    "Equality",
    "Inequality",
    "LeastSquaresResult",
    "least_squares",
    "constraints",
    "core",
    "keras3",
    "layers",
    "optimizers",
    "pruning",
    "tf_keras",
]

_LAZY_SUBMODULES = ("constraints", "core", "keras3", "layers", "optimizers",
                    "pruning", "tf_keras")


def __getattr__(name):
    # Sub-packages load lazily so that `import tf_gradkit` never imports a Keras.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"tf_gradkit.{name}")
    raise AttributeError(f"module 'tf_gradkit' has no attribute {name!r}")
