"""``import tf_gradkit`` is all ``load_model`` needs: each flavour's classes
are registered with its Keras as soon as both are imported.

Keras finds the classes a saved file names (``tf_gradkit>GradientAccumulator``)
in its registry, which a class joins when it is made (`_hosts.make_class`);
the flavour packages make theirs when they are imported. `register_flavours`
(run at the end of ``import tf_gradkit``) imports them:

- for each Keras already imported: TensorFlow's own import imports the Keras
  that ``tf.keras`` is (``keras`` or ``tf_keras``), and tf_gradkit imports
  TensorFlow, so that one is registered at once (its cost, measured against
  TensorFlow's own import: docs/composing.md);
- for a Keras imported later (tf_keras in a Keras 3 process, by tfmot say,
  or ``keras`` in a tf_keras one): right after that Keras's own module has
  run, through a finder on ``sys.meta_path`` that wraps its loader's
  ``exec_module`` for that one import, then leaves.

Nothing here imports a Keras, sets an environment variable or imports tfmot
(whose import sets ``TF_USE_LEGACY_KERAS=1``): tf_keras's ``MaskAware``
finds tfmot's masks (its host's ``pruning_layers``) without importing it.
"""

import importlib
import sys
import threading
import warnings

from tf_gradkit import _flavour


_DEFERRED = set()  # flavours whose host module was being imported when its Keras came


def _initializing(name):
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None),
                                          "_initializing", False)


def register(flavour):
    """Imports the modules that register ``flavour``'s classes; warns (and
    leaves ``load_model`` to say which class it misses) if one fails.

    When the flavour's own host module is what imported its Keras (``import
    tf_gradkit.tf_keras`` in a Keras 3 process before tf_keras), those modules
    cannot be imported yet (the host is half-run): the host's last line calls
    `host_ready`, which registers them then."""
    if _initializing(f"tf_gradkit._hosts.{flavour}"):
        _DEFERRED.add(flavour)
        return
    _register_now(flavour)


def host_ready(flavour):
    """Called at the end of a host module: a registration deferred while it ran."""
    if flavour in _DEFERRED:
        _DEFERRED.discard(flavour)
        _register_now(flavour)


def _register_now(flavour):
    for name in _flavour.REGISTERING_MODULES[flavour]:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - never break the user's import
            warnings.warn(
                f"tf_gradkit could not register its {flavour} classes for "
                f"load_model: importing {name} raised {error!r}. Import {name} "
                "yourself to see the whole error.", stacklevel=3)
            return


class _RegisterAfterImport:
    """A ``sys.meta_path`` finder that finds nothing itself: for a flavour's
    Keras module it takes the spec the other finders give and makes its
    loader register the flavour once the module has run."""

    def __init__(self, pending):
        self._pending = dict(pending)  # Keras module name -> flavour
        self._finding = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        flavour = self._pending.get(fullname)
        if flavour is None or getattr(self._finding, "active", False):
            return None
        self._finding.active = True
        try:
            spec = _spec_from_other_finders(self, fullname, path, target)
        finally:
            self._finding.active = False
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            self._wrap(loader, fullname, flavour)
        return spec

    def _wrap(self, loader, fullname, flavour):
        run_module = loader.exec_module

        def exec_module(module):
            try:
                run_module(module)
            finally:  # the loader as it was, whether or not the module ran
                if "exec_module" in vars(loader):
                    del loader.exec_module
            self._pending.pop(fullname, None)
            if not self._pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            register(flavour)

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # a loader with slots: left alone
            pass


def _spec_from_other_finders(finder, fullname, path, target):
    for other in list(sys.meta_path):
        find_spec = getattr(other, "find_spec", None)
        if other is finder or find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def register_flavours():
    """Registers the flavours whose Keras is imported; the others when it is."""
    pending = {}
    for flavour, keras_module in _flavour.KERAS_MODULES.items():
        if keras_module in sys.modules:
            register(flavour)
        else:
            pending[keras_module] = flavour
    if pending and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport(pending))
