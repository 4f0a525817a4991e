"""Jacobian columns by forward mode over the traced ops, zero tangents left out.

Why: `tf.autodiff.ForwardAccumulator` forms each op's JVP from its gradient
(a small traced function per op: a 2-D Gaussian's 52 ops became 381 with its
JVP), and it carries a tangent through every op that the parameters reach,
also where that tangent is all zeros: the column of the amplitude computes
the width's and the centre's terms times zero. XLA cannot fold ``0 * x``
(``0 * inf`` is NaN), so every column paid for the whole JVP (the bounded
decay's profile, docs/batched_fits.md). Here the residual function is traced
once, in the caller's graph, and its ops are walked in the order they were
made: each column's tangent goes only where that parameter reaches (a
parameter read as ``p[:, j:j+1]``, the usual way, starts one column only),
by a rule per op written out below (a few ops per op).

Where an op on the tangents' path has no rule here (a nested function,
control flow, an op not listed), `columns` returns None and the caller takes
TensorFlow's forward mode instead (the same derivative). A zero tangent is
exact: the derivative of an op that a parameter does not reach is 0, where
TensorFlow's ``0 * inf`` gave NaN.

Tangents are tensors that broadcast to their op's output (a slice
``p[:, j:j+1]`` has tangent 1.0, a Python float), widened to the full shape
only where an op needs it (a reduction, a reshape).
"""

import numpy as np
import tensorflow as tf


class _Unsupported(Exception):
    """An op on the tangents' path has no rule here."""


def columns(fn, x):
    """``(fn(x) [B, N], [column_j [B, N] for j < P])`` for ``x`` [B, P] by
    the rules below, in a graph (a ``tf.function``'s trace); None eagerly,
    for ``x`` of another rank or unknown P, or where an op on a tangent's
    path has no rule (then the caller differentiates another way; the ops
    traced here are unused)."""
    if tf.executing_eagerly() or x.shape.rank != 2 or x.shape[-1] is None:
        return None
    graph = tf.compat.v1.get_default_graph()
    if x.graph is not graph:
        return None
    before = len(graph.get_operations())
    out = fn(x)
    ops = graph.get_operations()[before:]
    if not isinstance(out, tf.Tensor) or not out.dtype.is_floating:
        return None
    p = int(x.shape[-1])
    try:
        cols = [_walk(ops, {x.ref(): _Column(x, j)}, out) for j in range(p)]
    except _Unsupported:
        return None
    return out, [_full(c, out) for c in cols]


def variable_columns(fn, variables):
    """``(fn(), [column_j for j < P])``: the Jacobian's columns of ``fn``
    (zero arguments, reading ``variables``) along each of the variables'
    entries, flattened in order (P entries in all), each column of
    ``fn()``'s shape; by the rules below, in a graph.

    Each read of a variable (a ``ReadVariableOp`` of its handle, however
    many nested functions' captures lie between) is a seed. None eagerly,
    under a distribution strategy, for a variable of unknown shape or one
    ``fn`` does not read, and where the variables are used in any other way
    than read (an op taking a handle itself: a nested function, a gather
    straight from the variable, control flow): the caller then takes
    TensorFlow's forward mode, and the ops traced here are unused."""
    if tf.executing_eagerly() or tf.distribute.has_strategy():
        return None
    handles = [getattr(v, "handle", None) for v in variables]
    if any(h is None for h in handles) or not all(
            v.shape.is_fully_defined() for v in variables):
        return None
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    out = fn()
    ops = graph.get_operations()[before:]
    if not isinstance(out, tf.Tensor) or not out.dtype.is_floating:
        return None
    reads = []   # (the value read, the variable's position)
    for op in ops:
        for t in op.inputs:
            k = _variable_of(t, handles) if t.dtype == tf.resource else None
            if k is None:
                continue
            if op.type != "ReadVariableOp":
                return None
            reads.append((op.outputs[0], k))
    if {k for _, k in reads} != set(range(len(variables))):
        return None
    cols = []
    try:
        for k, v in enumerate(variables):
            size = v.shape.num_elements()
            index = np.arange(size).reshape(v.shape.as_list())
            for j in range(size):
                seeds = {t.ref(): _Entries(index, j, t.dtype) for t, kk in reads if kk == k}
                cols.append(_walk(ops, seeds, out))
    except _Unsupported:
        return None
    return out, [_full(c, out) for c in cols]


def _variable_of(t, handles):
    """The position in ``handles`` of the variable handle that ``t`` (a
    resource tensor in a graph) stands for, following the captures of
    nested graphs out to the handle itself; None for any other."""
    while True:
        for k, handle in enumerate(handles):
            if t is handle:
                return k
        try:
            graph = t.graph
        except AttributeError:   # an eager tensor: no graph above it
            return None
        outer = next((e for e, i in getattr(graph, "captures", ()) if i is t), None)
        if outer is None:
            return None
        t = outer


def _walk(ops, seeds, out):
    """The tangent of ``out`` along one column, ``seeds`` the tangents of
    the tensors the parameters are read from (`_Seed`s, by ``ref()``)."""
    tangents = dict(seeds)
    for op in ops:
        ins = [tangents.get(t.ref()) for t in op.inputs]
        if all(t is None for t in ins):
            continue
        if op.type in _NO_TANGENT:
            continue
        seeded = [t for t in ins if isinstance(t, _Seed)]
        got = seeded[0].through(op, ins) if len(seeded) == 1 else None
        if got is None:
            rule = _RULES.get(op.type)
            if rule is None:
                raise _Unsupported(op.type)
            got = rule(op, [t.dense() if isinstance(t, _Seed) else t for t in ins])
        for t, d in zip(op.outputs, got):
            if d is None:
                continue
            if not t.dtype.is_floating:   # complex: no rules here
                raise _Unsupported(op.type)
            tangents[t.ref()] = d
    found = tangents.get(out.ref())
    return found.dense() if isinstance(found, _Seed) else found


class _Seed:
    """The tangent of a tensor the parameters are read from, kept symbolic
    so that an op that only selects from it (`through`) can tell which of
    its outputs the column reaches; `dense` is it as a tensor."""

    def through(self, op, ins):
        """The output tangents of ``op``, whose only seeded input is this
        one, where selection decides them; else None (then the op's rule
        runs on `dense`)."""
        return [self] if op.type == "Identity" else None

    def dense(self):
        raise NotImplementedError


class _Column(_Seed):
    """``x`` [B, P] itself along column ``j``: e_j in every row."""

    def __init__(self, x, j):
        self.x, self.j, self.p = x, j, int(x.shape[-1])

    def dense(self):
        return tf.constant(np.eye(self.p)[self.j], self.x.dtype)

    def through(self, op, ins):
        """A slice or an unstack of ``x``'s columns keeps only column j's
        part (1.0 or a constant 0/1 pattern, None where it takes no part)."""
        j, p = self.j, self.p
        if op.type == "StridedSlice" and ins[0] is self:
            pattern = _slice_columns(op, p)
            if pattern is not None:
                return [_indicator(pattern == j, self.x.dtype)]
        if op.type == "Unpack" and ins[0] is self and op.get_attr("axis") in (1, -1):
            return [1.0 if k == j else None for k in range(p)]
        if (op.type == "Split" and ins[1] is self and op.get_attr("num_split") == p
                and tf.get_static_value(op.inputs[0]) in (1, -1)):
            return [1.0 if k == j else None for k in range(p)]
        return super().through(op, ins)


class _Entries(_Seed):
    """A variable's value, or a part of it selected by slices, along its
    entry ``j``: ``index`` holds, at each element, the flat index of the
    variable's entry it is (a numpy array of the tensor's static shape)."""

    def __init__(self, index, j, dtype):
        self.index, self.j, self.dtype = index, j, dtype

    @classmethod
    def of(cls, index, j, dtype):
        """The tangent of the part ``index``: None where entry j is not in
        it, 1.0 where it is all of it, else an `_Entries`."""
        hit = index == j
        if not hit.any():
            return None
        if hit.all():
            return 1.0
        return cls(index, j, dtype)

    def dense(self):
        return tf.constant((self.index == self.j).astype(self.dtype.as_numpy_dtype))

    def through(self, op, ins):
        if ins[0] is self:
            if op.type == "StridedSlice":
                spec = _slice_spec(op)
                if spec is not None:
                    try:
                        return [self.of(self.index[spec], self.j, self.dtype)]
                    except IndexError:
                        return None
            elif op.type == "Unpack":
                axis = op.get_attr("axis")
                return [self.of(part, self.j, self.dtype) for part in np.moveaxis(
                    self.index, axis, 0)]
            elif op.type == "Reshape":
                shape = tf.get_static_value(op.inputs[1])
                if shape is not None:
                    return [self.of(self.index.reshape(shape), self.j, self.dtype)]
        return super().through(op, ins)


def _indicator(mask, dtype):
    """A tangent that is 1 where ``mask`` and 0 elsewhere: None, 1.0 or a
    constant (with a leading axis of 1, broadcast over the batch)."""
    if not mask.any():
        return None
    if mask.all():
        return 1.0
    return tf.constant(mask[None].astype(dtype.as_numpy_dtype))


def _slice_spec(op):
    """A ``StridedSlice``'s selection as a numpy index (a tuple of slices,
    integers, Ellipsis and np.newaxis), or None where it is not static."""
    values = [tf.get_static_value(t) for t in op.inputs[1:4]]
    if any(v is None for v in values):
        return None
    begin, end, strides = (np.asarray(v).tolist() for v in values)
    masks = {name: op.get_attr(name) for name in (
        "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    spec = []
    for i, (b, e, s) in enumerate(zip(begin, end, strides)):
        bit = 1 << i
        if masks["ellipsis_mask"] & bit:
            spec.append(Ellipsis)
        elif masks["new_axis_mask"] & bit:
            spec.append(np.newaxis)
        elif masks["shrink_axis_mask"] & bit:
            spec.append(int(b))
        else:
            spec.append(slice(None if masks["begin_mask"] & bit else int(b),
                              None if masks["end_mask"] & bit else int(e), int(s)))
    return tuple(spec)


def _slice_columns(op, p):
    """For a ``StridedSlice`` of ``x`` [B, P] that keeps the batch axis as it
    is: the column of ``x`` each element of a row of its output comes from
    (a numpy array of the output's shape without the batch axis); None for
    any other slice."""
    spec = _slice_spec(op)
    if spec is None:
        return None
    index = np.arange(2 * p).reshape(2, p)
    try:
        taken = index[spec]
    except IndexError:
        return None
    if taken.ndim < 1 or taken.shape[0] != 2 or np.any(taken[0] >= p) or np.any(
            taken[1] < p):
        return None
    return taken[0] % p


def _full(t, like):
    """Tangent ``t`` (None, a Python float or a broadcastable tensor) at
    ``like``'s shape and dtype."""
    if t is None:
        return tf.zeros_like(like)
    t = tf.cast(t, like.dtype) if isinstance(t, tf.Tensor) else tf.constant(t, like.dtype)
    if t.shape == like.shape and like.shape.is_fully_defined():
        return t
    return tf.broadcast_to(t, tf.shape(like))


# Python-level arithmetic on tangents that may be None (zero) or a float.
def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _neg(a):
    return None if a is None else -a


def _sub(a, b):
    return _add(a, _neg(b))


def _mul(a, b):
    """``a * b``, ``a`` a tangent (None, a float or a tensor), ``b`` a tensor."""
    if a is None:
        return None
    if isinstance(a, float):
        if a == 1.0:
            return b
        if a == -1.0:
            return -b
    return a * b


def _elementwise(derivative):
    """A rule for a one-input elementwise op: ``dx * derivative(x, z)``."""
    def rule(op, ins):
        return [_mul(ins[0], derivative(op.inputs[0], op.outputs[0]))]
    return rule


def _add_rule(op, ins):
    return [_add(ins[0], ins[1])]


def _sub_rule(op, ins):
    return [_sub(ins[0], ins[1])]


def _mul_rule(op, ins):
    a, b = op.inputs
    return [_add(_mul(ins[0], b), _mul(ins[1], a))]


def _div_rule(op, ins):
    a, b = op.inputs
    z = op.outputs[0]
    first = None if ins[0] is None else ins[0] / b
    second = None if ins[1] is None else _mul(ins[1], z / b)
    return [_sub(first, second)]


def _pow_rule(op, ins):
    a, b = op.inputs
    z = op.outputs[0]
    first = None
    if ins[0] is not None:
        first = _mul(ins[0], b * tf.pow(a, b - 1))
    second = None
    if ins[1] is not None:
        log_a = tf.where(a > 0, tf.math.log(tf.where(a > 0, a, tf.ones_like(a))),
                         tf.zeros_like(a))
        second = _mul(ins[1], z * log_a)
    return [_add(first, second)]


def _squared_difference_rule(op, ins):
    a, b = op.inputs
    return [_mul(_sub(ins[0], ins[1]), 2.0 * (a - b))]


def _select_rule(op, ins):
    cond, a, b = op.inputs
    da, db = ins[1], ins[2]
    z = op.outputs[0]
    return [tf.where(cond, _full(da, z), _full(db, z))]


def _extremum_rule(pick_first):
    def rule(op, ins):
        a, b = op.inputs
        z = op.outputs[0]
        return [tf.where(pick_first(a, b), _full(ins[0], z), _full(ins[1], z))]
    return rule


def _add_n_rule(op, ins):
    total = None
    for t in ins:
        total = _add(total, t)
    return [total]


def _cast_rule(op, ins):
    target = op.outputs[0].dtype
    if target.is_complex:
        raise _Unsupported(op.type)
    if not target.is_floating:   # to integers: 0, as TensorFlow's gradient
        return [None]
    t = ins[0]
    return [t if isinstance(t, float) else tf.cast(t, target)]


def _shaped(build):
    """A rule for an op on one tensor input (the first) that changes its
    shape: ``build(op, full tangent)``, the tangent widened first."""
    def rule(op, ins):
        for t in ins[1:]:
            if t is not None:
                raise _Unsupported(op.type)
        return build(op, _full(ins[0], op.inputs[0]))
    return rule


def _strided_slice(op, t):
    return [tf.raw_ops.StridedSlice(
        input=t, begin=op.inputs[1], end=op.inputs[2], strides=op.inputs[3],
        **{name: op.get_attr(name) for name in (
            "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
            "shrink_axis_mask")})]


def _concat_rule(op, ins):
    values, axis = op.inputs[:-1], op.inputs[-1]
    if ins[-1] is not None:
        raise _Unsupported(op.type)
    return [tf.concat([_full(t, v) for t, v in zip(ins[:-1], values)], axis)]


def _pack_rule(op, ins):
    return [tf.stack([_full(t, v) for t, v in zip(ins, op.inputs)],
                     axis=op.get_attr("axis"))]


def _matmul_rule(op, ins):
    a, b = op.inputs
    attrs = dict(transpose_a=op.get_attr("transpose_a"),
                 transpose_b=op.get_attr("transpose_b"))
    first = None if ins[0] is None else tf.matmul(_full(ins[0], a), b, **attrs)
    second = None if ins[1] is None else tf.matmul(a, _full(ins[1], b), **attrs)
    return [_add(first, second)]


def _batch_matmul_rule(op, ins):
    a, b = op.inputs
    attrs = dict(adjoint_a=op.get_attr("adj_x"), adjoint_b=op.get_attr("adj_y"))
    first = None if ins[0] is None else tf.matmul(_full(ins[0], a), b, **attrs)
    second = None if ins[1] is None else tf.matmul(a, _full(ins[1], b), **attrs)
    return [_add(first, second)]


def _einsum_rule(op, ins):
    equation = op.get_attr("equation").decode()
    inputs = list(op.inputs)
    total = None
    for i, t in enumerate(ins):
        if t is not None:
            args = inputs[:i] + [_full(t, inputs[i])] + inputs[i + 1:]
            total = _add(total, tf.einsum(equation, *args))
    return [total]


def _gather_rule(op, ins):
    if ins[1] is not None or (len(ins) > 2 and ins[2] is not None):
        raise _Unsupported(op.type)
    return [tf.gather(_full(ins[0], op.inputs[0]), op.inputs[1], axis=op.inputs[2],
                      batch_dims=op.get_attr("batch_dims"))]


def _split_rule(op, ins):
    if ins[0] is not None:
        raise _Unsupported(op.type)
    return tf.split(_full(ins[1], op.inputs[1]), op.get_attr("num_split"),
                    axis=op.inputs[0])


def _split_v_rule(op, ins):
    if ins[1] is not None or ins[2] is not None:
        raise _Unsupported(op.type)
    return tf.split(_full(ins[0], op.inputs[0]), op.inputs[1], axis=op.inputs[2])


def _bias_add_rule(op, ins):
    if op.get_attr("data_format") not in (b"NHWC", "NHWC"):
        raise _Unsupported(op.type)
    return [_add(ins[0], ins[1])]


def _sqrt(x, z):
    return 0.5 / z


def _rsqrt(x, z):
    return -0.5 * z / x


def _log(x, z):
    return 1.0 / x


def _log1p(x, z):
    return 1.0 / (1.0 + x)


def _sigmoid(x, z):
    return z * (1.0 - z)


def _erf(x, z):
    return (2.0 / np.sqrt(np.pi)) * tf.exp(-tf.square(x))


_RULES = {
    "Identity": lambda op, ins: [ins[0]],
    "CheckNumerics": lambda op, ins: [ins[0]],
    "Neg": lambda op, ins: [_neg(ins[0])],
    "AddV2": _add_rule,
    "Sub": _sub_rule,
    "Mul": _mul_rule,
    "RealDiv": _div_rule,
    "Pow": _pow_rule,
    "SquaredDifference": _squared_difference_rule,
    "AddN": _add_n_rule,
    "BiasAdd": _bias_add_rule,
    "SelectV2": _select_rule,
    "Maximum": _extremum_rule(lambda a, b: a >= b),
    "Minimum": _extremum_rule(lambda a, b: a <= b),
    "Cast": _cast_rule,
    "Exp": _elementwise(lambda x, z: z),
    "Expm1": _elementwise(lambda x, z: z + 1.0),
    "Log": _elementwise(_log),
    "Log1p": _elementwise(_log1p),
    "Sqrt": _elementwise(_sqrt),
    "Rsqrt": _elementwise(_rsqrt),
    "Square": _elementwise(lambda x, z: 2.0 * x),
    "Reciprocal": _elementwise(lambda x, z: -z * z),
    "Sin": _elementwise(lambda x, z: tf.cos(x)),
    "Cos": _elementwise(lambda x, z: -tf.sin(x)),
    "Tan": _elementwise(lambda x, z: 1.0 + z * z),
    "Tanh": _elementwise(lambda x, z: 1.0 - z * z),
    "Sigmoid": _elementwise(_sigmoid),
    "Sinh": _elementwise(lambda x, z: tf.cosh(x)),
    "Cosh": _elementwise(lambda x, z: tf.sinh(x)),
    "Atan": _elementwise(lambda x, z: 1.0 / (1.0 + x * x)),
    "Abs": _elementwise(lambda x, z: tf.sign(x)),
    "Softplus": _elementwise(lambda x, z: tf.sigmoid(x)),
    "Erf": _elementwise(_erf),
    "Reshape": _shaped(lambda op, t: [tf.reshape(t, op.inputs[1])]),
    "ExpandDims": _shaped(lambda op, t: [tf.expand_dims(t, op.inputs[1])]),
    "Squeeze": _shaped(lambda op, t: [tf.squeeze(t, op.get_attr("squeeze_dims"))]),
    "Transpose": _shaped(lambda op, t: [tf.transpose(t, op.inputs[1])]),
    "StridedSlice": _shaped(_strided_slice),
    "Slice": _shaped(lambda op, t: [tf.slice(t, op.inputs[1], op.inputs[2])]),
    "Sum": _shaped(lambda op, t: [tf.reduce_sum(t, op.inputs[1],
                                                keepdims=op.get_attr("keep_dims"))]),
    "Mean": _shaped(lambda op, t: [tf.reduce_mean(t, op.inputs[1],
                                                  keepdims=op.get_attr("keep_dims"))]),
    "Tile": _shaped(lambda op, t: [tf.tile(t, op.inputs[1])]),
    "BroadcastTo": _shaped(lambda op, t: [tf.broadcast_to(t, op.inputs[1])]),
    "Unpack": _shaped(lambda op, t: tf.unstack(t, num=op.get_attr("num"),
                                               axis=op.get_attr("axis"))),
    "ConcatV2": _concat_rule,
    "Pack": _pack_rule,
    "MatMul": _matmul_rule,
    "BatchMatMulV2": _batch_matmul_rule,
    "Einsum": _einsum_rule,
    "GatherV2": _gather_rule,
    "Split": _split_rule,
    "SplitV": _split_v_rule,
}

# Ops whose outputs carry no tangent (not differentiable, or 0 almost
# everywhere, as TensorFlow's own gradients have them).
_NO_TANGENT = frozenset({
    "Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike", "Sign", "Floor",
    "Ceil", "Round", "Rint", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal",
    "NotEqual", "IsFinite", "IsNan", "IsInf", "ArgMax", "ArgMin", "StopGradient",
    "FloorDiv"})
