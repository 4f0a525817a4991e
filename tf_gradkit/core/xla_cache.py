"""TensorFlow's persistent XLA compilation cache, on by default.

Why: a compiled batched fit (`curve_fit`, `least_squares_batched`) costs
seconds of CPU to compile, in every new process, longer than the fits
themselves for 10^4 small problems (issue 39). TensorFlow can keep each
compiled XLA program on disk (``--tf_xla_persistent_cache_directory`` in
``TF_XLA_FLAGS``) and load it in the next process instead of compiling it
again; the key is the program's fingerprint, so a changed function or shape
compiles anew.

TensorFlow reads ``TF_XLA_FLAGS`` once, when its eager context starts (measured
on TF 2.21: setting it after ``import tensorflow`` but before the first op
works; after the first op it is ignored). So `configure` runs when
tf_gradkit is imported (this module's import), and only adds the flag when:

- ``TF_GRADKIT_XLA_CACHE`` is not "0" (the opt-out; any other value is the
  directory to use),
- ``TF_XLA_FLAGS`` does not already name a persistent cache directory (the
  user's choice wins, and so does their "" to switch it off),
- the eager context has not started yet (then the flag could not apply and
  nothing is set).

The default directory is ``$XDG_CACHE_HOME/tf_gradkit/xla-<TF version>``
(``~/.cache/...`` without it): programs of another TensorFlow are not read.
"""

import os

import tensorflow as tf
from tensorflow.python.eager import context as _context

FLAG = "--tf_xla_persistent_cache_directory"
ENV = "TF_GRADKIT_XLA_CACHE"


def default_directory():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tf_gradkit", f"xla-{tf.__version__}")


def configure(environ=None):
    """Adds the cache flag to ``TF_XLA_FLAGS`` where the rules above allow;
    returns the directory set, or None."""
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV, "")
    if choice == "0":
        return None
    flags = environ.get("TF_XLA_FLAGS", "")
    if FLAG in flags:
        return None
    if _context.context_safe() is not None and _context.context_safe()._context_handle:
        return None
    directory = choice or default_directory()
    environ["TF_XLA_FLAGS"] = f"{flags} {FLAG}={directory}".strip()
    return directory


# Importing this module (tf_gradkit's __init__ does it first) configures it.
DIRECTORY = configure()
