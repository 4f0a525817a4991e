"""Which Keras flavour the public names resolve to.

``tf_gradkit.optimizers.X`` (and ``.layers``, ``.callbacks``,
``.constraints``, ``tf_gradkit.pruning``'s flavoured names) is the class for
whatever ``tf.keras`` is in this process: Keras 3, or tf_keras when
``TF_USE_LEGACY_KERAS`` was set to a true value before ``tf.keras`` was first
used. TensorFlow reads that variable once, when ``tf.keras`` is first used,
and keeps its answer; we ask ``tf.keras`` itself at each lookup (which fixes
it, as using ``tf.keras`` would), so importing tfmot (which sets the
variable) after a Keras 3 name was used changes neither ``tf.keras`` nor what
that name resolves to. We never write the variable.

Nothing else in tf_gradkit asks which flavour is active: an optimizer, layer,
model or callback is served by the host of the Keras it belongs to
(`tf_gradkit._hosts.host_of`), and ``tf_gradkit.keras3.X`` /
``tf_gradkit.tf_keras.X`` are that flavour whatever the process's is.
"""

import importlib
import os
import sys

KERAS3 = "keras3"
TF_KERAS = "tf_keras"

# Each flavour's Keras module, and the modules whose import registers every
# class of that flavour a saved file can name (optimizers, MaskAware too,
# constraints, layers; none imports tfmot) with that Keras, for
# ``load_model`` (see `tf_gradkit._registration`).
KERAS_MODULES = {KERAS3: "keras", TF_KERAS: "tf_keras"}
REGISTERING_MODULES = {
    KERAS3: ("tf_gradkit.keras3",),
    TF_KERAS: ("tf_gradkit.tf_keras",),
}


def active_flavour():
    """Returns ``"tf_keras"`` if ``tf.keras`` is tf_keras here, else ``"keras3"``.

    Read from ``tf.keras`` (its ``Model`` is one flavour's ``Model``); only
    when neither matches, from ``TF_USE_LEGACY_KERAS`` as TensorFlow reads it."""
    import tensorflow as tf  # noqa: PLC0415

    model = tf.keras.Model  # TensorFlow decides (once) what tf.keras is
    for flavour, module_name in KERAS_MODULES.items():
        keras = sys.modules.get(module_name)
        if keras is not None and getattr(keras, "Model", None) is model:
            return flavour
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", None)
    return TF_KERAS if legacy in ("true", "True", "1") else KERAS3


def resolve(name, module_name, submodule=None):
    """Looks up ``name`` in ``tf_gradkit.<flavour>[.<submodule>]`` for the
    active flavour.

    Args:
      name: the public name, e.g. ``"GradientAccumulator"``.
      module_name: the asking module, for the error message.
      submodule: optional module inside the flavour package.
    """
    path = f"tf_gradkit.{active_flavour()}" + (f".{submodule}" if submodule else "")
    flavour_module = importlib.import_module(path)
    try:
        return getattr(flavour_module, name)
    except AttributeError:
        raise AttributeError(
            f"module {module_name!r} has no attribute {name!r}") from None


def lazy_exports(module_name, names, submodule=None):
    """``(__getattr__, __dir__)`` for a module whose public ``names`` resolve
    to the active flavour at first use (PEP 562)."""

    def __getattr__(name):
        if name in names:
            return resolve(name, module_name, submodule)
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    def __dir__():
        return list(names)

    return __getattr__, __dir__


def lazy_members(module_name, members):
    """``(__getattr__, __dir__)`` for a flavour package: each public name in
    ``members`` (name -> submodule) is imported from its submodule at first
    use, so one optimizer's module never has to load for another's."""

    def __getattr__(name):
        if name in members:
            module = importlib.import_module(f"{module_name}.{members[name]}")
            return getattr(module, name)
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    def __dir__():
        return sorted(members)

    return __getattr__, __dir__
