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
cache then finds the compiled program. The module is stored without the
functions its ``main`` does not call and without locations (`_simplified`):
the same program, about half the ops to parse and lower.

What a module's key holds (`digest`), so that a module is used only where
the traced solve would be the same program:

- TensorFlow's version and a digest of tf_gradkit's source files (a changed
  engine is a new key), and what the solve's trace reads from the engine's
  modules besides (`trace_state`: their constants, the trace choices);
- the solve's trace-time options (`fitting._options`'s key), only where they
  are plain data of tf_gradkit's own parts: a user's part class, or one
  keyed by identity, is never stored;
- the graph of the user's functions as the solve calls them (the residuals,
  and ``jac`` where given) traced at the chunk's shapes and at the compacted
  tail's: their ops, constants and attributes, the functions they call
  renamed in calling order (`_graph_bytes`). A model that captures a
  tensor or variable is never stored (its values are not in the graph), nor
  one with a custom gradient (its Python code is not), nor one that fails
  to trace there;
- each argument's shape and dtype, and the Python values among them.

What it does not see: a model that builds other ops inside the solve than
when called alone at the same shapes (one that reads Python state the
solve's calls change, or that looks at its context: inside a loop, under
forward-mode autodiff). Use ``TF_GRADKIT_XLA_CACHE=0`` for such a model,
or delete the ``modules`` folder of the cache directory.

Only on the CPU (no GPU visible), only where the cache is on
(`xla_cache.DIRECTORY`) and only in a plain context (`usable`); anything that
cannot be exported or written runs the usual compiled path, and an entry
whose artifact does not match its recorded digest is written again.
"""

import functools
import hashlib
import importlib
import json
import os
import sys
import threading
import types

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.eager import record

from tf_gradkit.core import trace_choice
from tf_gradkit.core import xla_cache
from tf_gradkit.core.lm import solve_cache

# XlaCallModule's serialization version (9: StableHLO portable artifacts).
CALL_VERSION = 9
FOLDER = "modules"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_lock = threading.Lock()   # guards `_loaded`
_loaded = {}   # key -> StoredSolve: one named function per module and process


def _tensorflow_parts():
    """TensorFlow's modules this needs (private ones: imported when used, so
    that a TensorFlow without them only goes without stored modules)."""
    from tensorflow.compiler.mlir.stablehlo import stablehlo  # noqa: PLC0415
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops  # noqa: PLC0415
    from tensorflow.python.eager.polymorphic_function import (  # noqa: PLC0415
        atomic_function)
    return stablehlo, gen_xla_ops, atomic_function


def directory():
    """Where modules are kept, or None when they are not (no cache, a GPU,
    a TensorFlow without the parts)."""
    if xla_cache.DIRECTORY is None or tf.config.list_logical_devices("GPU"):
        return None
    try:
        _tensorflow_parts()
    except ImportError:
        return None
    return os.path.join(xla_cache.DIRECTORY, FOLDER)


def usable():
    """True where a call may use a stored module: modules are kept and the
    call's context adds nothing a stored program would leave out (a tape or
    forward accumulator recording it, op callbacks such as check_numerics,
    functions run eagerly, a `tf.distribute` strategy)."""
    return (directory() is not None and not tf.config.functions_run_eagerly()
            and not record.could_possibly_record()
            and not context.context().op_callbacks and not tf.distribute.has_strategy())


def _engine_modules(root="tf_gradkit.core.lm.fitting"):
    """The tf_gradkit modules the solve's code reaches from ``root`` (through
    the modules, functions and classes each one names), sorted: a set that
    depends on the code only, not on what else the process imported."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in sys.modules:
            continue
        seen.add(name)
        for value in vars(sys.modules[name]).values():
            other = (value.__name__ if isinstance(value, types.ModuleType)
                     else getattr(value, "__module__", None)
                     if isinstance(value, (type, types.FunctionType)) else None)
            if isinstance(other, str) and other.startswith("tf_gradkit."):
                todo.append(other)
    return sorted(seen - {__name__})   # (this one's path is not the program's)


def _simple(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, tuple) and all(_simple(v) for v in value)


def trace_state():
    """What the solve's trace reads besides its arguments and source: each
    engine module's plain values (`COMPACT_MIN_BATCH`, ...), trace choices
    (`spd.use_kernel`, `precision.use_split`: this thread's mode) and which
    function or class each of its names is (a replaced one is another
    program)."""
    lines = []
    for name in _engine_modules():
        for attribute, value in sorted(vars(sys.modules[name]).items()):
            if attribute.startswith("__"):
                continue
            text = _describe(value)
            if isinstance(value, dict) and all(_simple(k) for k in value):
                text = repr(sorted((repr(k), _describe(v)) for k, v in value.items()))
            if text is not None:
                lines.append(f"{name}.{attribute}={text}")
    return "\n".join(lines)


def _describe(value):
    """A text of an engine module's value that is the same in every process
    where the value is, or None (not described: a mutable cache, say)."""
    if isinstance(value, trace_choice.TraceChoice):
        return f"choice {value.mode}"
    if isinstance(value, (type, types.FunctionType)):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, functools.partial):
        return f"partial {_describe(value.func)} {value.args!r} {value.keywords!r}"
    return repr(value) if _simple(value) else None


def _source_digest():
    """SHA-256 of tf_gradkit's Python files (paths and bytes)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(_PACKAGE):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, _PACKAGE).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


# The source read when the engine was imported, not when first used: a file
# edited since (an editable install) is not the program this process runs.
SOURCE_DIGEST = _source_digest()


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
    graph = _graph_bytes(traced.graph.as_graph_def())
    if graph is None:
        return None
    h = hashlib.sha256()
    for part in (tf.__version__, SOURCE_DIGEST, trace_state(), repr(options_key),
                 given[1]):
        h.update(part.encode())
        h.update(b"\0")
    h.update(graph)
    return h.hexdigest()


def _graph_bytes(graph_def):
    """``graph_def`` serialised with its library's functions renamed ``f0``,
    ``f1``, ... in the order the graph first calls them (TensorFlow names
    them with a counter of the process's traces), unreferenced ones left
    out; None where the graph has a custom gradient (its Python code is not
    in the graph)."""
    functions = {f.signature.name: f for f in graph_def.library.function}
    names = {}

    def called(node):
        found = [node.op] if node.op in functions else []
        for value in node.attr.values():
            found += [value.func.name] + [f.name for f in value.list.func]
        return [f for f in found if f in functions]

    def visit(nodes):
        for node in nodes:
            for name in called(node):
                if name not in names:
                    names[name] = f"f{len(names)}"
                    visit(functions[name].node_def)

    visit(graph_def.node)
    if graph_def.library.gradient or any(
            "_gradient_op_type" in node.attr for node in graph_def.node) or any(
            "_gradient_op_type" in node.attr
            for name in names for node in functions[name].node_def):
        return None

    def rename(node):
        if node.op in names:
            node.op = names[node.op]
        for value in node.attr.values():
            if value.func.name in names:
                value.func.name = names[value.func.name]
            for f in value.list.func:
                if f.name in names:
                    f.name = names[f.name]

    out = type(graph_def)()
    out.CopyFrom(graph_def)
    del out.library.function[:]
    for node in out.node:
        rename(node)
    for name in names:   # in the order first called
        function = out.library.function.add()
        function.CopyFrom(functions[name])
        function.signature.name = names[name]
        for node in function.node_def:
            rename(node)
    return out.SerializeToString(deterministic=True)


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
    traced solve takes), returning what it returns (`call`).

    It runs as a function named after its key, not a ``tf.function``'s
    ``__inference_<name>_<counter>``: TensorFlow's persistent cache keys a
    program by its function's name too, and the counter depends on how many
    functions the process traced before."""

    def __init__(self, key, artifact, meta, tensors):
        _, xla_ops, atomic = _tensorflow_parts()
        self.key, self.meta, self.broken = key, meta, False
        shapes = [tf.TensorShape(s) for s in meta["shapes"]]
        dtypes = [tf.as_dtype(d) for d in meta["dtypes"]]

        def run(*tensors):
            return xla_ops.xla_call_module(
                args=list(tensors), version=CALL_VERSION, module=artifact,
                Sout=shapes, Tout=dtypes, dim_args_spec=[], platforms=["CPU"],
                function_list=[], has_token_input_output=False, disabled_checks=[])

        traced = tf.function(run, jit_compile=True, autograph=False).get_concrete_function(
            *[tf.TensorSpec(t.shape, t.dtype) for t in tensors])
        self._run = atomic.from_func_graph(
            f"tf_gradkit_module_{key[:32]}", traced.graph, dict(traced.function_def.attr),
            overwrite=True)

    def call(self, args, fallback):
        """The module's outputs for ``args``; where it fails, ``fallback(*args)``
        (the usual solve: its result or its own error), and the module is not
        run again in this process (its files are removed where the failure
        points at them: a module TensorFlow cannot lower or run)."""
        given = arguments(args)
        if self.broken or given is None or given[1] != self.meta["arguments"]:
            return fallback(*args)
        try:
            return _decode(self.meta["outputs"], iter(self._run.call_flat(*given[0])))
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError,
                tf.errors.FailedPreconditionError, tf.errors.InternalError,
                ValueError, StopIteration):
            self.broken = True
            _remove(self.key)
        except tf.errors.OpError:
            self.broken = True   # (out of memory, cancelled: the files may be good)
        return fallback(*args)


class _Bound:
    """A `StoredSolve` with the usual solve of the caller's function."""

    def __init__(self, stored, fallback):
        self.stored, self.fallback = stored, fallback

    def __call__(self, *args):
        return self.stored.call(args, self.fallback)


def _write(path, data):
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)   # readers see the whole file or none
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _remove(key):
    folder = directory()
    for suffix in (".json", ".mlirbc"):
        try:
            os.remove(os.path.join(folder, key + suffix))
        except (OSError, TypeError):
            pass


def load(key, tensors):
    """The stored solve of ``key`` (for arguments like ``tensors``), or None
    (no entry, or one that is not whole: its artifact's digest is checked)."""
    base = os.path.join(directory(), key)
    try:
        with open(base + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        with open(base + ".mlirbc", "rb") as f:
            artifact = f.read()
        if (meta["key"] != key
                or meta["sha256"] != hashlib.sha256(artifact).hexdigest()):
            return None
        return StoredSolve(key, artifact, meta, tensors)
    except (OSError, ValueError, KeyError, TypeError, tf.errors.OpError):
        return None


def _main_arguments(text):
    """The count of the exported module's ``main`` arguments, or None."""
    start = text.find("func.func @main(")
    if start < 0:
        start = text.find("func.func public @main(")
    end = text.find(") ->", start)
    return None if start < 0 or end < 0 else text.count("%arg", start, end)


# What the stored module keeps of TensorFlow's export (`_simplified`).
PASSES = "symbol-dce"


def _simplified(text):
    """``text`` (the solve's StableHLO as TensorFlow exports it) without the
    functions nothing calls and without locations, or ``text`` where MLIR
    cannot run the pass.

    TensorFlow's export keeps a private function for every function the
    trace made, most of them inlined into ``main`` already, and each op's
    location (an op name, which XLA keeps as metadata in the compiled
    program). ``symbol-dce`` drops the functions ``main`` does not call and
    changes nothing in it, so XLA compiles the same program, to the bit
    (tested: tests/test_module_store.py). Measured on the chunk of a call
    of 10^4 5x5 Gaussians: 8,142 ops instead of 15,167, 138 KB of artifact
    instead of 344 KB and 2.8 MB of compiled program instead of 4.0 MB; a
    later process parses, lowers and loads it in about 0.35 s of the
    0.48 s it took. Not run:
    MLIR's ``cse`` and ``canonicalize``, which shrink the module further but
    change what XLA compiles (fits 3e-7 apart in float64, measured)."""
    try:
        out = tf.mlir.experimental.run_pass_pipeline(text, PASSES,
                                                     show_debug_info=False)
    except Exception:  # noqa: BLE001 - the module as exported still runs
        return text
    # A public ``main`` of the same arguments, or the export as it was (a
    # private ``main`` would have gone with the functions nothing calls).
    kept = _main_arguments(out)
    return out if kept is not None and kept == _main_arguments(text) else text


def export(solve, build, args, key):
    """Writes ``solve`` (a ``tf.function`` with ``jit_compile=True``) at
    ``args`` as the module of ``key``, traced here, so that the module is the
    program of this state (the key's): where ``solve`` has a trace already,
    perhaps from another state, a new one from ``build()``. Returns the
    stored solve, or None where it cannot be stored (then nothing is left
    written)."""
    stablehlo = _tensorflow_parts()[0]
    given = arguments(args)
    if solve.experimental_get_tracing_count():
        solve = build()
    traced = solve.get_concrete_function(*args)   # a trace error is the user's
    if traced.captured_inputs or given is None:
        return None
    try:
        outputs = _encode(traced.structured_outputs)
        text = solve.experimental_get_compiler_ir(*args)(stage="stablehlo")
        if _main_arguments(text) != len(given[0]):
            return None   # an argument XLA took as a constant: not this call's
        artifact = stablehlo.serialize_portable_artifact_str(
            _simplified(text), stablehlo.get_current_version())
        flat = [t for t in tf.nest.flatten(traced.structured_outputs) if t is not None]
        meta = dict(key=key, sha256=hashlib.sha256(artifact).hexdigest(),
                    arguments=given[1], outputs=outputs,
                    shapes=[t.shape.as_list() for t in flat],
                    dtypes=[t.dtype.name for t in flat])
        found = StoredSolve(key, artifact, meta, given[0])
    except Exception:  # noqa: BLE001 - not exportable: the usual compiled path
        return None
    base = os.path.join(directory(), key)
    try:
        os.makedirs(directory(), exist_ok=True)
        _write(base + ".mlirbc", artifact)
        _write(base + ".json", json.dumps(meta).encode())   # last: the entry is whole
    except OSError:
        _remove(key)
        return None
    return found


def stored(solve, build, args, options_key, probe):
    """``solve``'s stored module (loaded, or exported now: `export`) as a
    callable that falls back on ``solve``, or None where modules are not
    kept or this solve cannot be one. One module per key in a
    process (a lock: its named function is registered once)."""
    if not usable():
        return None
    key = digest(options_key, probe, args)
    if key is None:
        return None
    with _lock:
        found = _loaded.get(key)
        if found is None:
            found = load(key, arguments(args)[0]) or export(solve, build, args, key)
            if found is None:
                return None
            _loaded[key] = found
    return _Bound(found, solve)
