"""Keras flavours as hosts, and the public classes made from them.

An algorithm (`tf_gradkit._algorithms`) is written once, against what a host
class provides; a flavour's public class is the algorithm on that flavour's
host, registered for Keras serialisation as ``tf_gradkit>Name`` (the name
files saved by earlier versions use too)::

    class GradientAccumulator(algorithm, keras3.WrapperHost, keras.optimizers.Optimizer)

`OPTIMIZERS` lists every public optimizer once; the flavour packages
(`tf_gradkit.keras3`, `tf_gradkit.tf_keras`) and `tf_gradkit.optimizers` read
it. A new wrapper is one algorithm module and one line here; a new flavour is
one host module (the same names as `keras3.py`) and its flavour package.
"""

import importlib
import sys
import types

import tensorflow as tf

from tf_gradkit import _flavour

# name -> (algorithm module, the host class it stands on)
OPTIMIZERS = {
    "AugmentedLagrangian": ("tf_gradkit._algorithms.augmented_lagrangian", "WrapperHost"),
    "ConditionalGradient": ("tf_gradkit._algorithms.conditional_gradient", "SlotHost"),
    "GradientAccumulator": ("tf_gradkit._algorithms.gradient_accumulator", "WrapperHost"),
    "LevenbergMarquardt": ("tf_gradkit._algorithms.levenberg_marquardt", "StateHost"),
    "MagnitudePruning": ("tf_gradkit._algorithms.magnitude_pruning", "WrapperHost"),
    "MaskAware": ("tf_gradkit._algorithms.mask_aware", "WrapperHost"),
    "Projected": ("tf_gradkit._algorithms.projected", "WrapperHost"),
}


@tf.autograph.experimental.do_not_convert
def host_of(obj):
    """The host module (`keras3`, `tf_keras`) of the Keras that ``obj`` (a
    model, layer, optimizer, variable, loss or callback) belongs to, or None
    when it belongs to none. Asked of the object (each host's ``serves``),
    never of the environment; a flavour whose Keras is not imported serves
    nothing and is not imported.

    Plain Python about the object, run as it is when a `tf.function` traces
    a step that asks it: left to AutoGraph, its `importlib.import_module`
    call was converted down to `importlib._bootstrap._gcd_import`, which
    AutoGraph cannot read, and every custom `tf.function` loop with a
    tf_gradkit wrapper printed "AutoGraph could not transform
    `_gcd_import`" (issue 40)."""
    for flavour, keras_module in _flavour.KERAS_MODULES.items():
        if keras_module in sys.modules:
            host = importlib.import_module(f"{__name__}.{flavour}")
            if host.serves(obj):
                return host
    return None


def host_for(obj, argument, owner):
    """`host_of`, or a TypeError naming ``argument`` of ``owner`` when no
    flavour serves ``obj``."""
    host = host_of(obj)
    if host is None:
        raise TypeError(
            f"{owner}: `{argument}` must be a Keras 3 or tf_keras object. Received: "
            f"{argument}={type(obj).__module__}.{type(obj).__name__}")
    return host


def make_class(host, algorithm, base, module_name):
    """``algorithm`` on ``host.<base>``, registered as ``tf_gradkit>Name``.

    Made here with ``type()`` from the catalog rather than written out as
    class statements: written out, each public optimizer would need one
    near-identical three-base class per flavour (about 40 in all), which is
    the repetition the catalog exists to avoid; a new flavour or optimizer is
    one entry instead."""
    name = algorithm.__name__
    cls = type(name, (algorithm, getattr(host, base), host.Optimizer),
               {"__doc__": algorithm.__doc__, "__module__": module_name,
                "__qualname__": name})
    return host.register(package="tf_gradkit")(cls)


def optimizer_classes(host, module_name):
    """Every public optimizer of `OPTIMIZERS`, made for ``host``."""
    return {name: make_class(host, getattr(importlib.import_module(module), name),
                             base, module_name)
            for name, (module, base) in OPTIMIZERS.items()}


def constraints_module(host, package):
    """``<package>.constraints``: the flavour's Keras constraints, one per
    `core.sets` set, as a module made here (and put in ``sys.modules``)."""
    from tf_gradkit.core import sets  # noqa: PLC0415
    module = types.ModuleType(f"{package}.constraints", (
        f"Keras constraint classes for {host.FLAVOUR}, one per `tf_gradkit.core.sets` "
        "set: usable as ``kernel_constraint=`` or called on a tensor to project it."))
    for set_class in sets.SETS:
        setattr(module, set_class.__name__, host.constraint_class(set_class))
    module.__all__ = [s.__name__ for s in sets.SETS]
    sys.modules[module.__name__] = module
    return module


def publish(namespace, host, package, layers):
    """Puts a flavour package's public names into ``namespace``: every
    optimizer, the ``constraints`` module, the layers module's
    ``AccumBatchNormalization`` and the constraint specs; returns ``__all__``."""
    from tf_gradkit.core import augmented_lagrangian  # noqa: PLC0415
    names = dict(optimizer_classes(host, package),
                 AccumBatchNormalization=layers.AccumBatchNormalization,
                 ConstraintSpec=augmented_lagrangian.ConstraintSpec,
                 Equality=augmented_lagrangian.Equality,
                 Inequality=augmented_lagrangian.Inequality)
    namespace.update(names, constraints=constraints_module(host, package))
    return sorted(names) + ["constraints", "layers"]
