"""TensorFlow's persistent XLA compilation cache, on request (``TF_GRADKIT_XLA_CACHE``).

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

- ``TF_GRADKIT_XLA_CACHE`` asks for it: "1" for the default directory, any
  other value but "0" for that directory. It is off by default: on TF 2.21
  each program loaded from the cache logs an ERROR (its text-format parse is
  tried first) and a warning about machine features that could raise SIGILL,
  on every run, which a user who did not ask for the cache should not see,
- ``TF_XLA_FLAGS`` does not already name a persistent cache directory (the
  user's choice wins, and so does their "" to switch it off),
- the eager context has not started yet (then the flag could not apply and
  nothing is set).

The default directory is ``$XDG_CACHE_HOME/tf_gradkit/xla-<TF version>``
(``~/.cache/...`` without it): programs of another TensorFlow are not read.

The environment is left as it was (STYLE.md 2: no environment variable set on
import, since child processes would inherit it, as they inherit tfmot's
``TF_USE_LEGACY_KERAS``). TensorFlow parses all its XLA flags together, once,
at the first read of any of them; `configure` puts the flag into
``TF_XLA_FLAGS``, makes TensorFlow read its flags then (one flag getter), and
puts ``TF_XLA_FLAGS`` back (tests/test_small_fits.py checks both in a fresh
process: the cache directory fills and ``TF_XLA_FLAGS`` is unchanged).
"""

import os

import tensorflow as tf
from tensorflow.python import pywrap_tfe as _pywrap_tfe
from tensorflow.python.eager import context as _context

FLAG = "--tf_xla_persistent_cache_directory"
ENV = "TF_GRADKIT_XLA_CACHE"


def default_directory():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tf_gradkit", f"xla-{tf.__version__}")


def _read_flags_now():
    # Any XLA flag getter parses every flag of TF_XLA_FLAGS (once per process).
    _pywrap_tfe.TF_GetXlaConstantFoldingDisabled()


def configure(environ=None, read_flags=_read_flags_now):
    """Has TensorFlow read the cache flag where the rules above allow, leaving
    ``environ`` (``os.environ`` by default) as it was; returns the directory,
    or None."""
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV, "")
    if choice in ("", "0"):
        return None
    flags = environ.get("TF_XLA_FLAGS", "")
    if FLAG in flags:
        return None
    if _context.context_safe() is not None and _context.context_safe()._context_handle:
        return None
    directory = default_directory() if choice == "1" else choice
    before = environ.get("TF_XLA_FLAGS")
    environ["TF_XLA_FLAGS"] = f"{flags} {FLAG}={directory}".strip()
    try:
        read_flags()
    finally:
        if before is None:
            del environ["TF_XLA_FLAGS"]
        else:
            environ["TF_XLA_FLAGS"] = before
    return directory


# Importing this module (tf_gradkit's __init__ does it first) configures it.
DIRECTORY = configure()
