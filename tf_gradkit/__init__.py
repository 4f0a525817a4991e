"""tf_gradkit: optimizers plain Keras lacks, for Keras 3 and tf_keras.

Public names resolve to the Keras flavour that ``tf.keras`` is in this process
(Keras 3 by default, tf_keras when ``TF_USE_LEGACY_KERAS=1``); both flavours are
reachable explicitly as ``tf_gradkit.keras3`` and ``tf_gradkit.tf_keras``.
Importing tf_gradkit has TensorFlow read a persistent XLA cache directory
where ``TF_GRADKIT_XLA_CACHE`` asks for one (`core/xla_cache.py`), leaves the
environment as it was, and imports no Keras of its
own; it registers its classes with each Keras that is imported (TensorFlow
imports the one ``tf.keras`` is; another one when its import finishes), so
that ``import tf_gradkit`` is all ``load_model`` needs.
"""

import importlib

# First: TensorFlow must read the cache flag before its first op.
from tf_gradkit.core import xla_cache as _xla_cache  # noqa: F401
from tf_gradkit import _registration
from tf_gradkit.core.augmented_lagrangian import ConstraintSpec
from tf_gradkit.core.augmented_lagrangian import Equality
from tf_gradkit.core.augmented_lagrangian import Inequality
from tf_gradkit.core.conditional_accumulator import ConditionalAccumulator
from tf_gradkit.core.lm.fitting import BatchedFitResult
from tf_gradkit.core.lm.fitting import curve_fit
from tf_gradkit.core.lm.fitting import least_squares_batched
from tf_gradkit.core.lm.implicit import solve_least_squares
from tf_gradkit.core.lm.least_squares import LeastSquaresResult, least_squares

__version__ = "0.1.0"

__all__ = [
    "attach",
    "load_optimizer_state",
    "BatchedFitResult",
    "ConditionalAccumulator",
    "ConstraintSpec",
    "Equality",
    "Inequality",
    "LeastSquaresResult",
    "curve_fit",
    "least_squares",
    "least_squares_batched",
    "solve_least_squares",
    "callbacks",
    "constraints",
    "core",
    "distribute",
    "gradients",
    "keras3",
    "layers",
    "optimizers",
    "pruning",
    "tf_keras",
]

def attach(model):
    """Binds ``model``'s tf_gradkit optimizers to it (what ``model=`` does).

    A saved model (``.keras``, SavedModel, HDF5) keeps its optimizer's
    configuration and state but not the optimizer's link to the model, which
    `LevenbergMarquardt` (its train step), `GradientAccumulator` (batch
    sizes, loss counts, epoch ends), `AugmentedLagrangian` (output
    constraints) and `MaskAware` (masks) need under ``fit``.
    ``load_model`` binds them again by itself (Keras's loader says which
    model it loads). This is for optimizers made by ``from_config`` by hand
    and given to another model: every optimizer in the model's optimizer
    chain that needs its model gets it. Until then they refuse to train,
    with a message saying so. Calling it on a bound model changes nothing.

    Returns:
      ``model``.

    Example:

    >>> model.compile(optimizer=GradientAccumulator.from_config(config), loss="mse")  # doctest: +SKIP
    >>> tf_gradkit.attach(model)  # doctest: +SKIP
    >>> model.fit(x, y)  # doctest: +SKIP
    """
    from tf_gradkit._optimizer_tree import optimizer_chain  # noqa: PLC0415

    for optimizer in optimizer_chain(getattr(model, "optimizer", None)):
        if type(optimizer).__module__.startswith("tf_gradkit.") and callable(
                getattr(optimizer, "attach", None)):
            optimizer.attach(model)
    return model


def load_optimizer_state(model, saved_model_dir):
    """Restores ``model.optimizer``'s state from a tf_keras SavedModel.

    tf_keras's ``load_model`` gives a SavedModel directory's weights and the
    optimizer's configuration back, but not the optimizer's state, for every
    optimizer (Adam's moments and ``iterations`` too, measured with tf_keras
    2.21), although the directory holds it. tf_gradkit's optimizers read
    theirs back by themselves (when they are built); this restores Keras's
    own too: the optimizer is built for the model's variables and its
    variables (only those) are read from ``<saved_model_dir>/variables``.

    Returns:
      ``model``.

    Example:

    >>> model = tf_keras.models.load_model("run_dir")  # doctest: +SKIP
    >>> tf_gradkit.load_optimizer_state(model, "run_dir")  # doctest: +SKIP
    >>> tf_gradkit.attach(model)  # doctest: +SKIP
    """
    import os  # noqa: PLC0415

    import tensorflow as tf  # noqa: PLC0415

    model.optimizer.build(model.trainable_variables)
    path = os.path.join(saved_model_dir, "variables", "variables")
    tf.train.Checkpoint(optimizer=model.optimizer).restore(path).expect_partial()
    return model


_LAZY_SUBMODULES = ("callbacks", "constraints", "core", "distribute", "gradients",
                    "keras3", "layers", "optimizers", "pruning", "tf_keras")


def __getattr__(name):
    # Sub-packages load lazily so that `import tf_gradkit` never imports a Keras.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"tf_gradkit.{name}")
    raise AttributeError(f"module 'tf_gradkit' has no attribute {name!r}")


# `load_model` needs no more than `import tf_gradkit`: the classes of each
# Keras imported (TensorFlow imports the one `tf.keras` is) are registered
# now, those of a Keras imported later as soon as it is (`_registration`).
_registration.register_flavours()
