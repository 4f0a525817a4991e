"""Jacobians of per-example residuals from layer taps (LM's tapped linearisation).

For residuals ``R [B, m]`` of a model whose examples do not interact, one
forward pass taps each layer's input ``a_i`` and pre-activation output
``z_i``, and one backward pass per residual column (``m`` of them, one
vectorised pass) gives ``g_ik = d(sum_j R_jk)/dz_i = dR_ik/dz_i``; each layer
kind's rule turns ``(a_i, g_ik)`` into its rows of the Jacobian
(`core.jacobian_rows`). That costs about one forward and ``m`` backward
passes instead of one forward-mode product per parameter.

`plan` says whether a model can be linearised this way, from what its layers
can do: every layer of a graph model (Sequential or functional, no call of
its own) either has a Jacobian rule for its solved weights (Dense, Conv1D and
Conv2D, Embedding, LayerNormalization, BatchNormalization at inference) or is
a layer kind that keeps the examples apart (`_hosts.protocol.PER_EXAMPLE_LAYERS`,
or any rule's layer in a mode its rule supports). Anything else, such as a
subclassed model's own ``call``, an operation between layers, a
BatchNormalization in training or a layer without a rule, gets the reason
back, and the caller linearises by automatic differentiation instead.
"""

import contextlib
from typing import Callable, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_gradkit import _layer_taps as _taps
from tf_gradkit.core import jacobian_rows
from tf_gradkit.core import precision
from tf_gradkit.gradients import norm_rules
from tf_gradkit.gradients import per_example

__all__ = ["JacobianRule", "RULES", "plan", "residuals_and_jacobian",
           "checked_residuals_and_jacobian"]


class JacobianRule(NamedTuple):
    """A layer kind's rule: `norm_rules.NormRule`'s ``variables``,
    ``supports`` and ``tap``, and ``rows(layer, calls, dtype)``: from each
    call's ``(record, g [m, B, ...])`` the rows ``[B, m, *shape]`` of each of
    ``variables(layer)``; optionally ``products(layer, calls, dtype) ->
    (jvp, vjp)``: ``jvp(tangents) -> [B, m]`` and ``vjp(u [B, m]) -> [one
    tensor per variable]`` without forming the rows (matrix-free solvers)."""

    variables: Callable
    supports: Callable
    tap: str
    rows: Callable
    products: Optional[Callable] = None


def _matmul_rows(layer, a, g, dtype):
    out = [jacobian_rows.matmul_rows(a, g, dtype)]
    if getattr(layer, "use_bias", False):
        out.append(jacobian_rows.bias_rows(g, dtype))
    return out


def _concat_calls(tensors, axis):
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, axis)


def _flat_rows(t, lead):
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([shape[:lead], [-1], shape[-1:]], 0))


def _dense_rows(layer, calls, dtype):
    # A layer called several times: its calls' rows concatenate (rows add).
    a = _concat_calls([_flat_rows(tf.convert_to_tensor(r["input"]), 1)
                       for r, _ in calls], 1)
    g = _concat_calls([_flat_rows(gz, 2) for _, gz in calls], 2)
    return _matmul_rows(layer, a, g, dtype)


def _dense_products(layer, calls, dtype):
    """``J v`` and ``J^T u`` of a Dense layer from its taps: ``a_i^T V g_ik``
    summed, and ``sum_ik u_ik a_i^T g_ik``, never the ``[B, m, d, p]`` rows."""
    a = tf.cast(_concat_calls([_flat_rows(tf.convert_to_tensor(r["input"]), 1)
                               for r, _ in calls], 1), dtype)
    g = tf.cast(_concat_calls([_flat_rows(gz, 2) for _, gz in calls], 2), dtype)
    bias = getattr(layer, "use_bias", False)
    # Rows (example, position) flattened: the big products are plain matmuls.
    shape = tf.shape(a)
    a2 = tf.reshape(a, [-1, shape[-1]])                        # [B*T, d]
    g2 = tf.reshape(g, [tf.shape(g)[0], -1, tf.shape(g)[-1]])  # [m, B*T, p]

    def jvp(tangents):
        z = tf.matmul(a2, tangents[0])                          # [B*T, p]
        if bias:
            z += tangents[1]
        out = tf.reshape(tf.reduce_sum(g2 * z[None], -1), [-1, shape[0], shape[1]])
        return tf.transpose(tf.reduce_sum(out, -1))             # [B, m]

    def vjp(u):
        per_row = tf.repeat(tf.transpose(u), shape[1], axis=1)  # [m, B*T]
        weighted = tf.reduce_sum(g2 * per_row[:, :, None], 0)   # [B*T, p]
        out = [tf.matmul(a2, weighted, transpose_a=True)]
        if bias:
            out.append(tf.reduce_sum(weighted, 0))
        return out

    return jvp, vjp


def _conv_rows(layer, calls, dtype):
    a = _concat_calls([norm_rules.conv_patches_of(layer, r["input"])
                       for r, _ in calls], 1)
    g = _concat_calls([_flat_rows(gz, 2) for _, gz in calls], 2)
    rows = _matmul_rows(layer, a, g, dtype)
    shape = tf.shape(rows[0])
    rows[0] = tf.reshape(rows[0], tf.concat([shape[:2], tf.shape(layer.kernel)], 0))
    return rows


def _embedding_rows(layer, calls, dtype):
    ids = _concat_calls([tf.reshape(r["input"], [tf.shape(r["input"])[0], -1])
                         for r, _ in calls], 1)
    g = _concat_calls([_flat_rows(gz, 2) for _, gz in calls], 2)
    return [jacobian_rows.embedding_rows(ids, g, layer.input_dim, dtype)]


def _scale_shift_rows(normalize):
    def rows(layer, calls, dtype):
        gammas, betas = [], []
        for record, gz in calls:
            inputs = tf.cast(tf.convert_to_tensor(record["input"]), dtype)
            gamma, beta = jacobian_rows.scale_shift_rows(
                normalize(layer, inputs), gz, norm_rules._axes(layer), dtype)  # pylint: disable=protected-access
            gammas.append(gamma)
            betas.append(beta)
        return ([tf.add_n(gammas)] if getattr(layer, "scale", True) else []) + \
            ([tf.add_n(betas)] if getattr(layer, "center", True) else [])

    return rows


def _from_norm_rule(kind, rows):
    rule = norm_rules.RULES[kind]
    return JacobianRule(rule.variables, rule.supports, rule.tap, rows)


# pylint: disable=protected-access
RULES = {
    "dense": _from_norm_rule("dense", _dense_rows)._replace(products=_dense_products),
    "conv": _from_norm_rule("conv", _conv_rows),
    "embedding": _from_norm_rule("embedding", _embedding_rows),
    "layer_norm": _from_norm_rule("layer_norm",
                                  _scale_shift_rows(norm_rules._layer_normalized)),
    "batch_norm": _from_norm_rule("batch_norm",
                                  _scale_shift_rows(norm_rules._batch_normalized)),
}
# pylint: enable=protected-access


def plan(model, variables, training=True):
    """``(plan, None)`` with ``plan = [(layer, rule)]`` when taps give the
    Jacobian of ``model``'s per-example residuals in ``variables``, else
    ``(None, why)``."""
    kinds = _taps.layer_kinds(model, "LevenbergMarquardt")
    why = _taps.graph_reason(model, kinds)
    if why:
        return None, why
    solved = {id(v) for v in variables}
    steps, covered = [], set()
    layers = _taps.flat_layers(model)
    tied = _taps.shared_variables(layers)
    for layer in layers:
        if getattr(layer, "layers", None) is not None:  # a nested model
            why = _taps.graph_reason(layer, kinds)
            if why:
                return None, why
            continue
        # A rule only where it is provably right: a subclass overriding
        # `call` (or a weight another layer also uses) falls back.
        kind, why = _taps.provable_kind(layer, kinds)
        if why:
            return None, why
        shared = [v for v in layer.weights if id(v) in tied]
        if shared:
            return None, (f"layer {layer.name!r} shares the variable "
                          f"{getattr(shared[0], 'path', shared[0].name)!r} with another "
                          "layer (tied weights), whose use its rule would not see")
        rule = RULES.get(kind)
        # A layer that is not trainable runs at inference (BatchNormalization
        # uses its moving statistics then, in both flavours).
        mode = bool(training) and bool(layer.trainable)
        if rule is not None:
            why_not = rule.supports(layer, mode)
            if why_not:
                return None, f"layer {layer.name!r}: {why_not}"
            mine = [v for v in layer.trainable_weights if id(v) in solved]
            if mine:
                steps.append((layer, rule))
                covered.update(id(v) for v in rule.variables(layer))
            continue
        if _taps.provably_per_example(layer, kinds) and not layer.weights:
            continue
        return None, (f"layer {layer.name!r} ({type(layer).__name__}) has no rule "
                      "saying that its examples stay apart")
    missing = [v for v in variables if id(v) not in covered]
    if missing:
        return None, (f"no Jacobian rule for the variable "
                      f"{getattr(missing[0], 'path', missing[0].name)!r}")
    return steps, None


def _tapped_pass(steps, residual_rows, dtype, by_batch=False, check=False):
    """One forward pass with the taps on and ``m`` backward passes (one per
    residual column, or one vectorised pass): ``(rows [B, m], records,
    grads, per_example)``, ``records[id(layer)]`` each call's taps,
    ``grads`` an iterator over each call's output gradients ``[m, B, ...]``,
    in ``steps``' order, and ``apart`` None, or with ``check`` the
    check of `checked_residuals_and_jacobian` (a bool tensor).
    ``by_batch``: ``residual_rows()`` has any shape, example ``i``'s
    residuals its ``i``-th slice along the first axis (``B`` read from the
    taps)."""
    records = {id(layer): [] for layer, _ in steps}
    with contextlib.ExitStack() as stack:
        stack.enter_context(per_example._Taps(steps, records))  # pylint: disable=protected-access
        tape = stack.enter_context(tf.GradientTape(persistent=check))
        rows = tf.cast(residual_rows(), dtype)
        if by_batch:
            rows = tf.reshape(rows, [_tapped_batch(steps, records, rows), -1])
        totals = tf.reduce_sum(rows, 0)
        if check:
            scales = _example_scales(tf.shape(rows)[0], dtype)
            weighted = tf.reduce_sum(scales[:, None] * rows, 0)
    outputs = [r["output"] for layer, _ in steps for r in records[id(layer)]]
    grads = _output_gradients(tape, totals, outputs, rows.shape[1])
    apart = None
    if check:
        apart = _scaled_alike(
            grads, _output_gradients(tape, weighted, outputs, rows.shape[1]), scales)
        apart = (apart, tape, weighted, scales)
    return rows, records, iter(grads), apart


def _output_gradients(tape, totals, outputs, columns):
    """``d totals_k / d output`` for each output, ``[m, B, ...]``."""
    zero = tf.UnconnectedGradients.ZERO
    if columns == 1:
        return [g[None] for g in tape.gradient(totals, outputs,
                                               unconnected_gradients=zero)]
    return tape.jacobian(totals, outputs, unconnected_gradients=zero,
                         experimental_use_pfor=True)


class NotByExample(ValueError):
    """The residuals' first axis is not (statically) the tapped batch."""


def _tapped_batch(steps, records, residuals):
    """The batch the tapped layers saw, which must be the (static) length
    of the residuals' first axis; else `NotByExample`."""
    calls = [r for layer, _ in steps for r in records[id(layer)]]
    batches = {tf.convert_to_tensor(r["output"]).shape[0] for r in calls}
    first = residuals.shape[0] if residuals.shape.rank else None
    if len(batches) != 1 or None in batches or first not in batches:
        raise NotByExample(
            f"the residuals' first axis ({first}) is not the batch the tapped "
            f"layers saw ({sorted(batches, key=str)}), known when traced")
    return first


def _example_scales(batch, dtype, seed=(29, 32)):
    """A fixed pseudo-random power of two, 2^-6 to 2^6, per example: scaling
    by one is exact in floating point (TF32 included)."""
    powers = tf.random.stateless_uniform([batch], seed=list(seed), minval=-6,
                                         maxval=7, dtype=tf.int32)
    return tf.pow(tf.constant(2.0, dtype), tf.cast(powers, dtype))


def _scaled_alike(grads, weighted, scales):
    """Whether every ``weighted`` output gradient is ``grads``' with example
    ``i``'s part times ``scales[i]``, to 256 ulps of the largest entry."""
    worst, largest, eps = [], [], 0.0
    for g, w in zip(grads, weighted):
        shape = tf.concat([[1, -1], tf.ones([tf.rank(g) - 2], tf.int32)], 0)
        want = g * tf.cast(tf.reshape(scales, shape), g.dtype)
        worst.append(tf.cast(tf.reduce_max(tf.abs(w - want)), tf.float64))
        largest.append(tf.cast(tf.reduce_max(tf.abs(want)), tf.float64))
        eps = max(eps, float(np.finfo(g.dtype.as_numpy_dtype).eps))
    if not worst:
        return tf.constant(True)
    # NaN in either fails the comparison, and falls back.
    return tf.reduce_max(tf.stack(worst)) <= 256 * eps * tf.reduce_max(tf.stack(largest))


def _jacobian_of(steps, variables, rows, records, grads, dtype):
    by_id = {}
    for layer, rule in steps:
        calls = [(r, next(grads)) for r in records[id(layer)]]
        if not calls:  # not called in this pass: zero rows
            continue
        for variable, block in zip(rule.variables(layer), rule.rows(layer, calls, dtype)):
            by_id[id(variable)] = by_id[id(variable)] + block if id(variable) in by_id \
                else block
    n = tf.size(rows)
    blocks = [tf.reshape(by_id[id(v)], [n, -1]) if id(v) in by_id
              else tf.zeros([n, v.shape.num_elements()], dtype) for v in variables]
    return blocks[0] if len(blocks) == 1 else tf.concat(blocks, 1)


def residuals_and_jacobian(steps, variables, residual_rows, dtype):
    """``(r [B*m], J [B*m, P])`` of ``residual_rows() -> [B, m]`` (which runs
    the model) from taps, the columns in ``variables``' order, rows in
    ``r``'s (example-major)."""
    rows, records, grads, _ = _tapped_pass(steps, residual_rows, dtype)
    return tf.reshape(rows, [-1]), _jacobian_of(steps, variables, rows, records,
                                                grads, dtype)


def checked_residuals_and_jacobian(steps, variables, residual_fn, dtype):
    """``(r [N], J [N, P], per_example)`` of ``residual_fn()`` (any shape,
    example ``i``'s residuals its ``i``-th slice along the first axis, ``i``
    the example the tapped layers see at position ``i``) from taps, checked.

    The taps' rows are right only when each residual depends on the
    variables through the tapped layers' outputs for its own example alone,
    which an opaque function need not honour (a batch mean, a batch
    statistic, a layout that is not example-major, a penalty on the weights
    themselves). ``per_example`` (a bool tensor) checks both halves, with
    one more backward pass of the residuals weighted per example by fixed
    pseudo-random powers of two ``c_i``:

    - each tapped layer's output gradient for example ``i`` must be the
      unweighted pass's times ``c_i``: exact (a power of two scales
      exactly, TF32 included) when the examples stay apart, off by the
      mixed part otherwise;
    - the variables' gradient of that sum with column ``k`` also weighted
      by a power of two ``d_k`` (reverse mode, whatever the paths) must
      equal ``J^T w`` from the tapped rows (``w_ik = c_i d_k``) to the
      round-off of the sums, per parameter: a path that bypasses the taps
      is missing from ``J^T w``.

    Where it is False the returned J is wrong and the caller must form
    another. Costs one more backward pass (``m`` for ``m`` residuals per
    example).

    Raises:
      NotByExample: the residuals' first axis is not statically the batch
        every tapped layer call saw.
    """
    rows, records, grads, (apart, tape, weighted, scales) = _tapped_pass(
        steps, residual_fn, dtype, by_batch=True, check=True)
    jacobian = _jacobian_of(steps, variables, rows, records, grads, dtype)
    # Columns weighted too (powers of two d_k): w_ik = c_i d_k.
    columns = _example_scales(tf.shape(rows)[1], dtype, seed=[32, 29])
    true = tape.gradient(weighted, list(variables), output_gradients=columns,
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)
    del tape
    true = tf.concat([tf.reshape(tf.cast(g, dtype), [-1]) for g in true], 0)
    w = tf.reshape(scales[:, None] * columns[None, :], [-1])
    tapped = tf.linalg.matvec(jacobian, w, transpose_a=True)
    terms = tf.linalg.matvec(tf.abs(jacobian), tf.abs(w), transpose_a=True)
    # Each side sums the same N products of the model's values in its own
    # order: their inputs rounded to the products' unit (TF32's 2^-11 where
    # a GPU may use it), the sums accumulated in the model's precision.
    model_dtype = tf.as_dtype(variables[0].dtype)
    accumulate = float(np.finfo(model_dtype.as_numpy_dtype).eps) / 2
    inputs = (2.0 ** -11 if model_dtype == tf.float32 and precision.tf32_may_apply()
              else accumulate)
    per_term = tf.cast(16 * inputs, dtype) + tf.cast(4 * accumulate, dtype) * tf.sqrt(
        tf.cast(tf.size(rows), dtype))
    bound = per_term * (terms + tf.reduce_max(terms) * 2.0 ** -20)
    complete = tf.reduce_all(tf.abs(tapped - true) <= bound)
    return tf.reshape(rows, [-1]), jacobian, tf.logical_and(apart, complete)


def matrix_free(steps, variables, residual_rows, dtype):
    """``(r [B*m], J^T r [P], matvec)`` with ``matvec(v) = J^T (J v)`` from
    the taps of one forward and ``m`` backward passes: each product is a
    few contractions of the stored layer inputs and output gradients (rows
    are formed only for layers whose rule has no ``products``)."""
    rows, records, grads, _ = _tapped_pass(steps, residual_rows, dtype)
    index = {id(v): i for i, v in enumerate(variables)}
    sizes = [v.shape.num_elements() for v in variables]
    parts = []  # (variable positions, jvp, vjp)
    for layer, rule in steps:
        calls = [(r, next(grads)) for r in records[id(layer)]]
        if not calls:
            continue
        where = [(index.get(id(v)), v.shape) for v in rule.variables(layer)]
        if rule.products is not None:
            parts.append((where,) + tuple(rule.products(layer, calls, dtype)))
            continue
        blocks = rule.rows(layer, calls, dtype)
        n = tf.size(rows)
        flat = [tf.reshape(b, [n, -1]) for b in blocks]

        def jvp(tangents, flat=flat):
            out = tf.add_n([tf.linalg.matvec(f, tf.reshape(t, [-1]))
                            for f, t in zip(flat, tangents)])
            return tf.reshape(out, tf.shape(rows))

        def vjp(u, flat=flat):
            return [tf.linalg.matvec(f, tf.reshape(u, [-1]), transpose_a=True)
                    for f in flat]

        parts.append((where, jvp, vjp))

    def split(vector):
        pieces = tf.split(vector, sizes) if len(sizes) > 1 else [vector]
        return [tf.reshape(p, v.shape) for p, v in zip(pieces, variables)]

    def transpose_product(u):
        out = [tf.zeros([n], dtype) for n in sizes]
        for where, _, vjp in parts:
            for (i, _), grad in zip(where, vjp(u)):
                if i is not None:
                    out[i] += tf.reshape(grad, [-1])
        return tf.concat(out, 0) if len(out) > 1 else out[0]

    def matvec(v):
        tangents = split(tf.cast(v, dtype))
        jv = tf.add_n([jvp([tangents[i] if i is not None else
                            tf.zeros(shape, dtype) for i, shape in where])
                       for where, jvp, _ in parts])
        return transpose_product(jv)

    return tf.reshape(rows, [-1]), transpose_product(rows), matvec
