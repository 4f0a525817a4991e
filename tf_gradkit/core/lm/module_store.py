"""A compiled batched chunk kept as a StableHLO module beside the XLA cache.

Why (issue 39): with ``TF_GRADKIT_XLA_CACHE`` a second process still spent
about 4 s of CPU on its first 10^4 5x5 fits, though XLA's program was on
disk: TensorFlow keys that cache by the HLO it lowers from the traced graph,
so the whole solve was traced (about 2 s) and lowered (about 1.5 s) again
before the cache was read. Here the first process also writes the chunk's
StableHLO (an MLIR portable artifact, TensorFlow's `stablehlo` export of the
compiled ``tf.function``) and every process runs it through TensorFlow's
``XlaCallModule`` op, whose lowering is a parse, not a trace: a later process
traces only the user's model, finds the module, and TensorFlow's persistent
cache then finds the compiled program.

What a module's key holds (`digest`), so that a module is used only where
the traced solve would be the same program:

- TensorFlow's version and a digest of tf_gradkit's source files (a changed
  engine is a new key);
- the solve's trace-time options (`fitting._options`'s key), only where they
  are plain data of tf_gradkit's own parts: a user's part class, or one
  keyed by identity, is never stored;
- the graph of the user's functions as the solve calls them (the residuals,
  and ``jac`` where given) traced at the chunk's shapes and at the compacted
  tail's: their ops, constants and attributes. A model that captures a
  tensor or variable is never stored (its values are not in the graph), nor
  one that fails to trace there;
- each argument's shape and dtype, and the Python values among them.

What it does not see: a model that builds other ops inside the solve than
when called alone at the same shapes (one that reads Python state the
solve's calls change, or that looks at its context: inside a loop, under
forward-mode autodiff). Use ``TF_GRADKIT_XLA_CACHE=0`` for such a model,
or delete the ``modules`` folder of the cache directory.

Only on the CPU (no GPU visible) and only where the cache is on
(`xla_cache.DIRECTORY`); anything that cannot be exported runs the usual
compiled path.
"""

import hashlib
import importlib
import json
import os
import threading

import numpy as np
import tensorflow as tf
from tensorflow.compiler.mlir.stablehlo import stablehlo as _stablehlo
from tensorflow.compiler.tf2xla.ops import gen_xla_ops as _xla_ops
from tensorflow.python.eager.polymorphic_function import atomic_function as _atomic

from tf_gradkit.core import xla_cache
from tf_gradkit.core.lm import solve_cache

# XlaCallModule's serialization version (9: StableHLO portable artifacts).
CALL_VERSION = 9
FOLDER = "modules"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_lock = threading.Lock()
_source = []


def directory():
    """Where modules are kept, or None when they are not (no cache, a GPU)."""
    if xla_cache.DIRECTORY is None or tf.config.list_logical_devices("GPU"):
        return None
    return os.path.join(xla_cache.DIRECTORY, FOLDER)


def source_digest():
    """SHA-256 of tf_gradkit's Python files (paths and bytes), once per process."""
    with _lock:
        if not _source:
            h = hashlib.sha256()
            for root, dirs, files in os.walk(_PACKAGE):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith(".py"):
                        path = os.path.join(root, name)
                        h.update(os.path.relpath(path, _PACKAGE).encode())
                        with open(path, "rb") as f:
                            h.update(f.read())
            _source.append(h.hexdigest())
    return _source[0]


def _plain(token):
    """True where ``token`` (an options key) is plain data of tf_gradkit's own
    types: its text is then the same in every process."""
    if isinstance(token, solve_cache.Identity):
        return False
    if isinstance(token, type):
        return (token.__module__.startswith("tf_gradkit.")
                or token.__module__ in ("builtins", "numpy"))
    if isinstance(token, (tuple, list)):
        return all(_plain(t) for t in token)
    return token is None or isinstance(token, (bool, int, float, str, bytes,
                                                np.integer, np.floating))


def _is_tensor(leaf):
    return isinstance(leaf, (tf.Tensor, np.ndarray))


def arguments(args):
    """(the tensors of ``args`` in the order the traced function takes them,
    a text of the arguments' shapes, dtypes and Python values), or None
    where an argument is neither."""
    tensors, text = [], []
    for leaf in tf.nest.flatten(args):
        if _is_tensor(leaf):
            leaf = tf.convert_to_tensor(leaf)
            tensors.append(leaf)
            text.append(f"T{leaf.shape.as_list()}{leaf.dtype.name}")
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            text.append(repr(leaf))
        else:
            return None
    return tensors, repr(tf.nest.map_structure(lambda _: 0, args)) + ";".join(text)


def digest(options_key, probe, args):
    """The module's key (hex), or None where this solve is not stored: see
    the module's docstring. ``probe(*args)`` calls the user's functions as
    the solve does."""
    given = arguments(args)
    if given is None or not _plain(options_key):
        return None
    try:
        traced = tf.function(probe, autograph=False).get_concrete_function(*args)
    except Exception:  # noqa: BLE001 - the usual path traces and raises it
        return None
    if traced.captured_inputs:
        return None
    graph = traced.graph.as_graph_def().SerializeToString(deterministic=True)
    h = hashlib.sha256()
    for part in (tf.__version__, source_digest(), repr(options_key), given[1]):
        h.update(part.encode())
        h.update(b"\0")
    h.update(graph)
    return h.hexdigest()


def _encode(structure):
    """The output nest as JSON: null, "T" (a tensor), or a (named) tuple."""
    if structure is None:
        return None
    if isinstance(structure, tf.Tensor):
        return "T"
    if isinstance(structure, tuple):
        items = [_encode(s) for s in structure]
        kind = type(structure)
        if kind is tuple:
            return {"tuple": items}
        if hasattr(kind, "_fields") and kind.__module__.startswith("tf_gradkit."):
            return {"namedtuple": f"{kind.__module__}:{kind.__qualname__}", "items": items}
    raise TypeError(f"not stored: an output of type {type(structure).__name__}")


def _decode(code, flat):
    if code is None:
        return None
    if code == "T":
        return next(flat)
    items = [_decode(c, flat) for c in (code["tuple"] if "tuple" in code
                                         else code["items"])]
    if "tuple" in code:
        return tuple(items)
    module, name = code["namedtuple"].split(":")
    if not module.startswith("tf_gradkit."):
        raise ValueError(f"a stored module names {module!r}")
    return getattr(importlib.import_module(module), name)(*items)


class StoredSolve:
    """The stored module as a callable of the chunk's arguments (what the
    traced solve takes), returning what it returns.

    It runs as a function named after its key, not a ``tf.function``'s
    ``__inference_<name>_<counter>``: TensorFlow's persistent cache keys a
    program by its function's name too, and the counter depends on how many
    functions the process traced before."""

    def __init__(self, key, artifact, meta, tensors):
        self.meta = meta
        shapes = [tf.TensorShape(s) for s in meta["shapes"]]
        dtypes = [tf.as_dtype(d) for d in meta["dtypes"]]

        def run(*tensors):
            return _xla_ops.xla_call_module(
                args=list(tensors), version=CALL_VERSION, module=artifact,
                Sout=shapes, Tout=dtypes, dim_args_spec=[], platforms=["CPU"],
                function_list=[], has_token_input_output=False, disabled_checks=[])

        traced = tf.function(run, jit_compile=True, autograph=False).get_concrete_function(
            *[tf.TensorSpec(t.shape, t.dtype) for t in tensors])
        self._run = _atomic.from_func_graph(
            f"tf_gradkit_module_{key[:32]}", traced.graph, dict(traced.function_def.attr),
            overwrite=True)

    def __call__(self, *args):
        given = arguments(args)
        if given is None or given[1] != self.meta["arguments"]:
            raise ValueError("a stored module was called with other arguments: "
                             f"{given and given[1]!r}, not {self.meta['arguments']!r}")
        return _decode(self.meta["outputs"], iter(self._run.call_flat(*given[0])))


def _write(path, data):
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)   # readers see the whole file or none


def load(key, tensors):
    """The stored solve of ``key`` (for arguments like ``tensors``), or None."""
    folder = directory()
    base = os.path.join(folder, key)
    try:
        with open(base + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        with open(base + ".mlirbc", "rb") as f:
            artifact = f.read()
    except (OSError, ValueError):
        return None
    return StoredSolve(key, artifact, meta, tensors)


def export(solve, args, key):
    """Writes ``solve`` (a ``tf.function`` with ``jit_compile=True``) at
    ``args`` as the module of ``key``; returns the stored solve, or None
    where it cannot be stored (then nothing is written)."""
    given = arguments(args)
    traced = solve.get_concrete_function(*args)   # a trace error is the user's
    if traced.captured_inputs or given is None:
        return None
    try:
        outputs = _encode(traced.structured_outputs)
        text = solve.experimental_get_compiler_ir(*args)(stage="stablehlo")
        artifact = _stablehlo.serialize_portable_artifact_str(
            text, _stablehlo.get_current_version())
    except Exception:  # noqa: BLE001 - not exportable: the usual compiled path
        return None
    flat = [t for t in tf.nest.flatten(traced.structured_outputs) if t is not None]
    meta = dict(arguments=given[1], outputs=outputs,
                shapes=[t.shape.as_list() for t in flat],
                dtypes=[t.dtype.name for t in flat])
    folder = directory()
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, key)
    _write(base + ".mlirbc", artifact)
    _write(base + ".json", json.dumps(meta).encode())   # last: the entry is whole
    return StoredSolve(key, artifact, meta, given[0])


def stored(solve, args, options_key, probe):
    """``solve``'s stored module (loaded, or exported now), or None where
    modules are not kept or this solve cannot be one."""
    if directory() is None:
        return None
    key = digest(options_key, probe, args)
    if key is None:
        return None
    return load(key, arguments(args)[0]) or export(solve, args, key)
