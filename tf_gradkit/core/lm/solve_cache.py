"""A bounded cache of compiled solves, keyed by what determines their trace.

`least_squares` builds a ``tf.function`` around a whole solve. Tracing it
(and compiling it with XLA) costs seconds, running it milliseconds, so a
repeated call with the same residual function, variables, shapes, dtypes and
trace-time options reuses the traced function: only the values that are
inputs (the variables' values, tolerances, bound values) change.

What is in a key (`function_key`, `part_key`, `value_key`, `variables_key`):

- the residual function by its code (a bound method by its function and
  its object), together with a snapshot of what it reads that a trace would
  freeze (so a new ``lambda`` made by the same line with the same captures,
  as in a loop, finds the entry): the values its closure cells hold and the module globals its code
  names, recursively through the plain Python functions it calls (three
  levels); for a bound method, its object's attributes (one level). A
  number, a string, a tuple, a list or a dict is compared by value, a NumPy
  array by its shape, dtype and bytes, a tensor or anything else by
  identity (a list, tuple or dict of more than `MAX_ITEMS` items, or
  nested deeper than `MAX_DEPTH`, by identity too). A ``tf.Variable`` is read live by the trace, so its value may
  change freely; rebinding a captured name to another tensor or array is a
  new key (a new trace), never a stale result;
- each variable by identity, with its shape and dtype;
- every trace-time option, by value (parts by type and ``get_config()``).

What it does not see: a change inside an object the function reaches only
through an attribute or an item of something compared by identity (a
module's attribute, ``holder.data = new`` on an object that is not the
method's own ``self``). After such a change pass ``cache=False`` to
`least_squares` or call ``SOLVES.clear()``; or keep changing data in a
``tf.Variable`` (assign to it: read live, no retrace).

The cache is an LRU of `DEFAULT_MAXSIZE` entries. An entry holds its
function, variables and captured tensors strongly (identity keys stay valid
while their entry lives), so at most that many user functions are kept
alive; `SolveCache.clear` drops them all.
"""

import collections
import hashlib
import re
import threading
import types
import warnings
from typing import NamedTuple

import numpy as np
import tensorflow as tf

DEFAULT_MAXSIZE = 16
# What XLA raises when it cannot compile a function (an op without an XLA
# kernel, e.g. ``tf.numpy_function``; a value it needs at compile time), told
# from an error of the program's own run by its text.
XLA_REFUSALS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError)
XLA_REFUSAL_TEXT = re.compile(
    r"Detected unsupported operations|tf2xla conversion failed|compile-time "
    r"constant|OpKernel for XLA_|XLA compilation requires|XLA can't")
# How deep `function_key` follows the Python functions a function calls.
MAX_DEPTH = 3
# Lists, tuples and dicts up to this many items are compared item by item
# (to `MAX_DEPTH` levels), longer ones by identity.
MAX_ITEMS = 256
# NumPy arrays up to this many bytes are compared by their bytes, larger
# ones by a BLAKE2b digest of them.
INLINE_BYTES = 4096


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    maxsize: int


class Identity:
    """A key part equal only to the same object (held strongly, so its
    ``id`` cannot be reused while the key lives)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, Identity) and other.obj is self.obj

    def __repr__(self):
        return f"Identity({type(self.obj).__name__} at {id(self.obj):#x})"


class SolveCache:
    """An LRU map from a key to a built (traced or compiled) callable.

    Args:
      maxsize: the most entries kept (an integer >= 0; 0 keeps none, so every
        call builds anew).

    Example:

    >>> cache = SolveCache(maxsize=4)
    >>> f = lambda x: 2.0 * x
    >>> fn, hit = cache.lookup(("my solve", 3), lambda: tf.function(f))
    >>> fn, hit = cache.lookup(("my solve", 3), lambda: tf.function(f))
    >>> hit, cache.info().hits, cache.info().misses
    (True, 1, 1)
    """

    def __init__(self, maxsize=DEFAULT_MAXSIZE):
        self._entries = collections.OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self.maxsize = maxsize

    @property
    def maxsize(self):
        return self._maxsize

    @maxsize.setter
    def maxsize(self, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("SolveCache: `maxsize` must be an integer >= 0. "
                             f"Received: maxsize={value!r}")
        with self._lock:
            self._maxsize = value
            self._evict()

    def lookup(self, key, build):
        """``(callable, hit)``: the entry for ``key``, or ``build()``'s result
        stored under it (evicting the least recently used beyond
        `maxsize`). ``key`` must be hashable (see `function_key` and the
        other ``*_key`` helpers)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return entry, True
            self._misses += 1
        entry = build()
        with self._lock:
            if self._maxsize:
                self._entries[key] = entry
                self._entries.move_to_end(key)
                self._evict()
        return entry, False

    def _evict(self):
        while len(self._entries) > self._maxsize:
            self._entries.popitem(last=False)

    def clear(self):
        """Drops every entry (and the functions and variables it holds)."""
        with self._lock:
            self._entries.clear()
            self._hits = self._misses = 0

    def info(self):
        """`CacheInfo`: hits and misses since the last `clear`, size, maxsize."""
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._entries),
                             self._maxsize)

    def __len__(self):
        return len(self._entries)


# The process's cache of whole solves (`least_squares` and the batched solve).
SOLVES = SolveCache()


def value_key(value, depth=MAX_DEPTH, seen=None):
    """A hashable token of ``value`` as a trace would freeze it (see the
    module docstring): numbers, strings and containers by value, NumPy
    arrays by bytes, functions by identity plus what they read, anything
    else (tensors, variables, modules, objects) by identity."""
    if isinstance(value, float):  # hex: -0.0 and 0.0 differ, NaN equals NaN
        return (float, value.hex())
    if isinstance(value, complex):
        return (complex, value.real.hex(), value.imag.hex())
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return (type(value), value)
    if isinstance(value, np.generic):
        return (type(value), value.tobytes())
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value).tobytes()
        if len(data) > INLINE_BYTES:
            data = hashlib.blake2b(data, digest_size=16).digest()
        return (np.ndarray, value.shape, value.dtype.str, data)
    if isinstance(value, (tuple, list, dict)) and (depth <= 0 or len(value) > MAX_ITEMS):
        return Identity(value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(value_key(v, depth - 1, seen) for v in value))
    if isinstance(value, dict):
        try:
            items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        except Exception:  # noqa: BLE001 - unsortable keys: identity instead
            return Identity(value)
        return (dict, tuple((repr(k), value_key(v, depth - 1, seen)) for k, v in items))
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return function_key(value, depth, seen)
    return Identity(value)


def function_key(fn, depth=MAX_DEPTH, seen=None):
    """A hashable token of a residual function: its code object (a bound
    method's function and object) and the values it reads (closure cells,
    the module globals its code names, a bound method's object's
    attributes), followed through nested Python functions ``depth`` levels.
    Other callables are keyed by identity alone."""
    seen = set() if seen is None else seen
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        attributes = getattr(owner, "__dict__", None)
        state = ()
        if isinstance(attributes, dict) and depth > 0 and id(owner) not in seen:
            seen.add(id(owner))
            state = value_key(dict(attributes), depth - 1, seen)
        return ("method", function_key(fn.__func__, depth, seen), Identity(owner),
                state)
    if not isinstance(fn, types.FunctionType):
        return ("callable", Identity(fn))
    if depth <= 0 or id(fn) in seen:
        return ("function", Identity(fn))
    seen.add(id(fn))
    if fn.__dict__:  # attributes set on the function: keyed by identity
        return ("function", Identity(fn))
    cells = []
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name not bound yet)
            cells.append(("empty",))
            continue
        cells.append(value_key(contents, depth - 1, seen))
    names = sorted(_global_names(fn.__code__))
    module = fn.__globals__
    read = tuple((name, value_key(module[name], depth - 1, seen))
                 for name in names if name in module)
    return ("code", Identity(fn.__code__), Identity(module), tuple(cells), read,
            value_key(fn.__defaults__, depth - 1, seen),
            value_key(fn.__kwdefaults__, depth - 1, seen))


def _global_names(code):
    """The names ``code`` (and the code objects nested in it) may load as
    globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def variables_key(var_list):
    """Each variable by identity, with its shape and dtype."""
    return tuple((Identity(v), tuple(v.shape.as_list()), v.dtype.name)
                 for v in var_list)


def part_key(part):
    """An LM part (controller, scaling, solver) by type and configuration,
    or by identity where its configuration is not plain data."""
    get_config = getattr(part, "get_config", None)
    if get_config is None:
        return Identity(part)
    try:
        config = value_key(dict(get_config()), depth=1)
        hash(config)
    except Exception:  # noqa: BLE001 - a config that is not plain data
        return Identity(part)
    if _holds_identity(config):
        return Identity(part)
    return (type(part), config)


def _holds_identity(token):
    if isinstance(token, Identity):
        return True
    if isinstance(token, tuple):
        return any(_holds_identity(t) for t in token)
    return False


class OneSignature:
    """A ``tf.function`` that has one trace (a fixed input signature, or
    arguments of one shape and dtype), called through that trace's concrete
    function: a repeated call skips the function's matching of its arguments
    against its signatures, about 0.15 ms of a repeated small solve's 3 ms
    (`benchmarks/lsq_latency.py`). Arguments are tensors, positional."""

    __slots__ = ("function", "_concrete")

    def __init__(self, function):
        self.function = function
        self._concrete = None

    def __call__(self, *args):
        concrete = self._concrete
        if concrete is None:
            concrete = self._concrete = self.function.get_concrete_function(*args)
        return concrete(*args)


def input_spec(tensor):
    """A ``tf.TensorSpec`` of a tensor's shape and dtype (for an input)."""
    tensor = tf.convert_to_tensor(tensor)
    return tf.TensorSpec(tensor.shape, tensor.dtype)


def xla_or_plain(xla, plain, args, name, record=None, stacklevel=3):
    """``(xla(*args), None)``; where that raises one of `XLA_REFUSALS`,
    ``(solve(*args), solve)`` with ``solve = plain()``, a warning naming
    ``name`` (``stacklevel``: the user's call, as for `warnings.warn`) and
    ``record[1]`` set False (the "auto" record ``[count, XLA can compile]``
    of the caller, so that later calls go plain at once).

    For ``jit_compile="auto"``: the rule chose XLA for speed, not the user,
    so a function XLA cannot compile runs as the plain ``tf.function`` it
    ran as before (``plain`` builds it, only when needed), with the result
    ``jit_compile=False`` gives. Only a refusal to compile (`XLA_REFUSAL_TEXT`),
    which comes before anything runs, falls back; an error the compiled
    program raised while running is raised as it is."""
    try:
        return xla(*args), None
    except XLA_REFUSALS as error:
        if not XLA_REFUSAL_TEXT.search(str(error)):
            raise   # the program ran and failed: the user's error, as it is
        refusal = (str(error).strip().splitlines() or [type(error).__name__])[0]
        refusal = re.sub(r" when trying to compile graph \S+ on", " on", refusal)[:200]
    solve = plain()
    out = solve(*args)
    if record is not None:
        record[1] = False
    warnings.warn(
        f"{name}: jit_compile='auto' chose XLA for this function, which XLA cannot "
        f"compile ({refusal}). It ran as a plain tf.function instead (the result "
        "jit_compile=False gives); later calls of this function with these "
        "options run plain without trying again (while its cached solve is "
        "kept). Pass jit_compile=False to skip the attempt.",
        stacklevel=stacklevel)
    return out, solve
