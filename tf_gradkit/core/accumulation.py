"""Gradient accumulation as a pure TensorFlow rule (no Keras).

A *window* collects ``steps`` micro-batch gradients and turns them into the one
gradient that a single large batch holding the same examples would have given::

    acc   = sum_t w_t * g_t          (w_t = examples in micro-batch t, or 1)
    total = sum_t w_t
    g     = acc / total              reduction "example" or "microbatch"
    g     = acc                      reduction "sum"

With ``w_t`` = examples, a window whose last micro-batch is short gives the same
update as the big batch of the same examples (mean-reduced losses have
``g_t = mean of per-example gradients``, so ``w_t * g_t`` is their sum).

Lazy reset. Closing a window writes nothing into the sums: it increments the
window counter ``window``, and every first-axis row of a sum remembers the
window it was last written in (``row_windows``). A row written in an older
window holds zeros as far as anything reads it. So a micro-step that does not
close the window costs one fused select-and-add per gradient (or, for
``IndexedSlices``, a gather and two scatters over the touched rows: never the
whole embedding table), and the conditional that closes a window carries no
accumulator at all (under XLA a variable written inside a branch is copied
by every branch, every micro-step).

Non-finite values are found once per window, where it is cheap. A dense sum
keeps any NaN or Inf written into it until the window closes, so the closing
step tests the dense sums (`dense_sums_finite`: one matrix-vector product per
sum, as XLA's CPU reductions run slower than its dot: docs/gradient_accumulation.md), inside a
conditional that only the closing step enters. A ``"rows"`` sum is tested
where it is written instead (only the rows a micro-step touched: testing the
whole table would cost a pass over it per window) and the result rides on
the window's weight: ``0`` or ``NaN`` is added to it, and `weight_is_finite`
reads it. `window_finite` combines both. The row sums behind the tests are
exact for NaN and Inf; a sum that overflowed is caught, and so is a row of
one sum whose values add up past its dtype's range (Adam's squared gradients
would have overflowed long before). 16-bit sums are added up in float32.

Sums are kept in float32 for 16-bit variables by default (`sum_dtype`): the
gradient handed on at the window's close is cast back to the variable's dtype.
A finite float32 sum can narrow to an Inf (a float16 window of two -4e4
gradients summed), so such gradients are tested again after the cast
(`narrowed_finite`), where the window closes.

Dense sums need no marks. A variable's first use fixes its *kind* (decided at
trace time and kept on the state): ``"rows"`` when its first gradient is
``IndexedSlices`` or ``None`` (the marks stay exact whatever comes later,
and a variable that never gets a gradient costs nothing), ``"dense"``
otherwise. Every accepted micro-step writes every dense sum (a ``None``
gradient adds zeros), so a dense sum belongs to
the open window exactly when the window has a micro-step: its add is gated by
that one scalar and reads and writes no marks. (Reading a mark and writing it
back in the same step slowed every micro-step under XLA: `benchmarks/accumulation.py`,
docs/gradient_accumulation.md.) Later gradients of the other kind
stay exact: ``IndexedSlices`` for a dense variable are densified, a dense
gradient for a ``"rows"`` variable takes the per-row select. Not covered: a
checkpoint saved in the middle of a window and restored by a program in
which a variable's gradient changed between ``IndexedSlices`` and a dense
tensor (the kind is not saved; a model's layers fix its gradients' types).

References: TF1 ``ConditionalAccumulator`` (averaging, staleness);
optax ``MultiSteps`` (a named state per rule).
"""

from typing import Callable, List, NamedTuple, Optional

import ml_dtypes
import tensorflow as tf

REDUCTIONS = ("example", "microbatch", "sum")
ACCUMULATOR_DTYPES = (None, "float32", "float64", "float16", "bfloat16")


def check_accumulator_dtype(value, owner):
    """``value`` as one of `ACCUMULATOR_DTYPES` (``tf.float32`` and
    ``tf.float64`` are read by name); raises a ValueError naming ``owner``'s
    argument, what was received and what is accepted otherwise. Strict:
    ``tf.as_dtype`` would also read ``1`` or ``"fp32"`` as float32."""
    if value is None:
        return None
    name = value.name if isinstance(value, tf.DType) else value
    if not isinstance(name, str) or name not in ACCUMULATOR_DTYPES:
        raise ValueError(
            f"{owner}: `accumulator_dtype` must be one of {ACCUMULATOR_DTYPES} (None: "
            "float32 for 16-bit variables, the variable's dtype otherwise; a 16-bit "
            "value keeps 16-bit variables' sums in their own dtype, as before "
            "accumulator_dtype existed, to restore checkpoints saved then). "
            f"Received: accumulator_dtype={value!r}")
    return name


def sum_dtype(variable_dtype, accumulator_dtype=None):
    """The dtype a variable's window sum is kept in.

    A 16-bit sum rounds every add to 8 (bfloat16) or 11 (float16) bits, so a
    window of ``k`` micro-batches loses up to ``log2(k)`` more bits than one
    big batch: a bfloat16 sum of gradients whose mean is -32.875 reads -32.
    Floating variables narrower than float32 are therefore summed in float32
    by default (``accumulator_dtype=None``; optax ``MultiSteps`` does the
    same); a requested dtype narrower than the variable's is widened to it
    (a sum never holds less than the variable); anything else keeps its own.
    So ``"float16"`` or ``"bfloat16"`` keeps a 16-bit variable's sum in the
    variable's own dtype (what versions before ``accumulator_dtype`` did:
    their mid-window checkpoints hold 16-bit sums, which a float32 sum
    variable refuses to restore) and widens any other to the variable's.
    """
    dtype = tf.as_dtype(variable_dtype)
    if not dtype.is_floating:
        return dtype
    wanted = tf.float32 if accumulator_dtype is None else tf.as_dtype(accumulator_dtype)
    return wanted if wanted.size > dtype.size else dtype


class AccumulationState(NamedTuple):
    """Variables of the accumulation windows.

    Attributes:
      micro_step: int64 scalar, micro-batches accepted into the open window.
      weight: float32 scalar, sum of micro-batch weights (examples) so far;
        NaN once a NaN or Inf was written into a ``"rows"`` sum (module doc).
      window: int64 scalar, the open window's number (0, 1, ...).
      acc_grads: one variable per parameter, the weighted gradient sums.
      row_windows: one int64 vector per parameter, the window each first-axis
        row of its sum was last written in (length 1 for scalars).
      kinds: per parameter, ``None`` until its first gradient is traced, then
        ``"dense"`` or ``"rows"`` (see the module doc); Python, not state.
    """

    micro_step: tf.Variable
    weight: tf.Variable
    window: tf.Variable
    acc_grads: List[tf.Variable]
    row_windows: List[tf.Variable]
    kinds: List[Optional[str]]


def init_accumulation(params, make_variable: Callable, make_scalar: Callable,
                      accumulator_dtype=None):
    """Creates the state for ``params`` (every sum reads as zero).

    Args:
      params: the trainable variables the windows accumulate for.
      make_variable: ``make_variable(reference, name, per_replica=True,
        dtype=None) -> variable`` creating a zero variable shaped like
        ``reference`` (the adapter decides placement and replica
        synchronisation; ``per_replica`` sums replicas on read).
      make_scalar: ``make_scalar(dtype, name, per_replica) -> variable``.
      accumulator_dtype: one of `ACCUMULATOR_DTYPES`: the sums' dtype
        (`sum_dtype`; None: float32 for 16-bit variables, the variable's
        dtype otherwise).

    Returns:
      An `AccumulationState`.
    """
    def rows(p):
        shape = p.shape.as_list()
        return tf.TensorSpec([shape[0] if shape else 1], tf.int64,
                             name=getattr(p, "path", None) or p.name)

    return AccumulationState(
        micro_step=make_scalar(tf.int64, "micro_step", False),
        weight=make_scalar(tf.float32, "window_weight", True),
        window=make_scalar(tf.int64, "window", False),
        acc_grads=[make_variable(p, "acc_grad",
                                 dtype=sum_dtype(p.dtype, accumulator_dtype))
                   for p in params],
        # Sums and row marks start at zero with window 0: every row reads 0.
        row_windows=[make_variable(rows(p), "acc_rows", False, dtype=tf.int64)
                     for p in params],
        kinds=[None] * len(params),
    )


def _current(row_window, window, rank):
    """Bool mask of rows written in ``window``, broadcastable over a sum."""
    current = tf.equal(row_window, window)
    return tf.reshape(current, [-1] + [1] * max(rank - 1, 0)) if rank else current[0]


def _kind(state, index, first="dense"):
    """The variable's kind (module doc), fixed by its first use: ``first``
    when it is still undecided."""
    if state.kinds[index] is None:
        state.kinds[index] = first
    return state.kinds[index]


def accumulate(state: AccumulationState, grads, weight, accept=True, count=None):
    """Adds one micro-batch: ``acc += weight * g`` (rows of older windows
    count as zero), ``count`` (default ``weight``) into the window's weight,
    one micro-step.

    ``IndexedSlices`` touch only their rows (gather, then scatters), so an
    embedding gradient costs the rows it touches, not the table. ``None``
    gradients add nothing (a dense sum still takes its gate, so that every
    accepted micro-step writes every dense sum: see the module doc).

    Args:
      state: the `AccumulationState`.
      grads: gradients aligned with ``state.acc_grads``.
      weight: float32 scalar, how much this micro-batch's gradient counts.
      accept: bool scalar (tensor or Python): False adds nothing (a stale
        gradient); its values are never multiplied in, so a NaN in it does
        not reach the sums.
      count: float32 scalar added to the window's weight, the divisor of
        `window_gradients` (default ``weight``: the weighted mean). A loss
        that is a sum adds its gradients with weight 1 and counts 1 for the
        whole window (1 at its first micro-step, 0 after), so the window sums.
    """
    window = state.window.read_value()
    started = state.micro_step.read_value() > 0
    gate = (lambda new, old: new) if accept is True else (
        lambda new, old: tf.where(accept, new, old))
    written = []  # per "rows" sum: are the values this micro-step wrote finite
    for index, (acc, rows, g) in enumerate(zip(state.acc_grads, state.row_windows, grads)):
        if isinstance(g, tf.IndexedSlices) and not _scatters(acc):
            g = tf.convert_to_tensor(g)  # per-replica sums take no scatters
        sparse_or_none = g is None or isinstance(g, tf.IndexedSlices)
        kind = _kind(state, index, "rows" if sparse_or_none else "dense")
        if g is None and kind == "rows":
            continue  # the marks keep this sum's rows as they are
        w = tf.cast(weight, acc.dtype)
        if kind == "dense":
            g = tf.zeros_like(acc) if g is None else tf.convert_to_tensor(g)
            base = tf.where(started, acc, tf.zeros_like(acc))
            acc.assign(gate(base + tf.cast(g, acc.dtype) * w, acc))
        elif isinstance(g, tf.IndexedSlices):
            idx = tf.cast(g.indices, tf.int64)
            values = tf.cast(g.values, acc.dtype) * w
            old = tf.gather(acc, idx)
            # Rows last written in an older window are zeroed first (repeated
            # indices write the same value), then every copy is added.
            fresh = tf.where(_current(tf.gather(rows, idx), window, len(acc.shape)),
                             old, tf.zeros_like(old))
            acc.scatter_update(tf.IndexedSlices(gate(fresh, old), idx))
            acc.scatter_add(tf.IndexedSlices(gate(values, tf.zeros_like(values)), idx))
            rows.scatter_update(tf.IndexedSlices(
                gate(tf.fill(tf.shape(idx), window), tf.gather(rows, idx)), idx))
            written.append(_finite_sum(tf.gather(acc, idx)))  # the rows' new sums
        else:
            rank = len(acc.shape)
            base = tf.where(_current(rows, window, rank), acc, tf.zeros_like(acc))
            total = base + tf.cast(g, acc.dtype) * w
            acc.assign(gate(total, acc))
            rows.assign(gate(tf.fill(tf.shape(rows), window), rows))
            written.append(_finite_sum(total))
    weight = tf.cast(weight if count is None else count, state.weight.dtype)
    if written:  # 0, or NaN when a value just written into a "rows" sum is not finite
        weight += tf.where(tf.reduce_all(tf.stack(written)), tf.zeros_like(weight),
                           tf.constant(float("nan"), weight.dtype))
    state.weight.assign_add(gate(weight, tf.zeros_like(weight)))
    state.micro_step.assign_add(tf.cast(accept, state.micro_step.dtype))


def _scatters(variable):
    """Whether ``variable`` takes scatter updates: per-replica sums under
    ``tf.distribute`` (sync-on-read variables) do not, so ``IndexedSlices``
    are added to them dense there."""
    return not (isinstance(variable, tf.distribute.DistributedValues) and
                variable.synchronization == tf.VariableSynchronization.ON_READ)


def _finite_sum(values):
    """True when ``values`` (any shape) hold no NaN or Inf and each row adds
    up within the dtype's range: one matrix-vector product, then a test of
    one value per row."""
    if values.dtype.size < 4:
        values = tf.cast(values, tf.float32)
    rows = tf.reshape(values, [-1, values.shape[-1] if values.shape.rank else 1])
    row_sums = tf.matmul(rows, tf.ones([rows.shape[-1], 1], rows.dtype))
    return tf.reduce_all(tf.math.is_finite(row_sums))


def window_sums(state: AccumulationState):
    """The open window's sums as dense tensors (older rows read as zero)."""
    window = state.window.read_value()
    started = state.micro_step.read_value() > 0
    return [tf.where(started if _kind(state, index) == "dense"
                     else _current(rows, window, len(acc.shape)), acc, tf.zeros_like(acc))
            for index, (acc, rows) in enumerate(zip(state.acc_grads, state.row_windows))]


def weight_is_finite(weight):
    """True when the window's weight (``state.weight``, or its sum over
    replicas) is finite: no NaN or Inf was written into a ``"rows"`` sum of
    the window (module doc)."""
    return tf.math.is_finite(weight)


def dense_sums_finite(state: AccumulationState):
    """True when no dense sum holds a NaN or Inf (module doc). Reads the sums
    as they are: call it only while the window has a micro-step."""
    checks = [_finite_sum(acc.read_value()) for index, acc in enumerate(state.acc_grads)
              if _kind(state, index) == "dense"]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def window_finite(state: AccumulationState):
    """True when the open window (with at least one micro-step) holds no NaN
    or Inf: its weight and its dense sums (this replica's)."""
    return tf.logical_and(weight_is_finite(state.weight.read_value()),
                          dense_sums_finite(state))


def window_is_finite(sums):
    """True when no window sum holds a NaN or Inf, by a full reduction over
    the sums (`window_finite` answers the same, more cheaply)."""
    if not sums:
        return tf.constant(True)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(s)) for s in sums]))


def window_gradients(sums, reduction, total_weight, num_replicas=1, dtypes=None):
    """The gradient of the whole window, as this replica should hand it on.

    Under ``tf.distribute`` each replica holds its own partial sums and the
    inner optimizer later all-reduces with SUM (Keras divides each replica's
    loss by the replica count, so that SUM gives the global mean). Scaling the
    local sum by ``num_replicas / total_weight`` (global weight) makes that one
    SUM produce exactly the big-batch gradient: one reduction per window.

    Args:
      sums: `window_sums` (local values, read in replica context).
      reduction: one of `REDUCTIONS`.
      total_weight: the window's weight summed over replicas.
      num_replicas: replicas in sync (1 when the gradients were already
        summed over replicas before they were accumulated).
      dtypes: optional, per sum the dtype to hand it on in (the variables'):
        the division runs in the sum's dtype (`sum_dtype`), then one rounding.

    Returns:
      A list of dense gradients aligned with ``sums``.
    """
    out = []
    for index, s in enumerate(sums):
        if reduction != "sum":
            scale = tf.cast(num_replicas, s.dtype) / tf.maximum(
                tf.cast(total_weight, s.dtype), tf.constant(1e-30, s.dtype))
            s = s * scale
        if dtypes is not None and tf.as_dtype(dtypes[index]) != s.dtype:
            s = tf.cast(s, dtypes[index])
        out.append(s)
    return out


def narrowed_finite(wide, dtypes):
    """True when every gradient of ``wide`` (`window_gradients` without
    ``dtypes``: divided in its sum's dtype) that will be narrowed to its
    variable's dtype in ``dtypes`` fits it: no NaN, and below the magnitude
    from which the cast rounds to Inf. A float32 sum that is finite can still
    overflow a 16-bit variable's dtype when cast (or when divided by a window
    weight below 1); the window's own test (`window_finite`) reads the sums.

    Tested on the wide value by one comparison, not by ``is_finite`` of the
    cast value: XLA may drop a float32 -> float16 -> float32 round trip
    (``xla_allow_excess_precision``, on by default), and on an H200 under
    ``jit_compile`` that hid the overflow. Gradients handed on in their own
    dtype are not tested again."""
    checks = []
    for g, dtype in zip(wide, dtypes):
        dtype = tf.as_dtype(dtype)
        if dtype == g.dtype:
            continue
        info = ml_dtypes.finfo(dtype.as_numpy_dtype)
        # Values at or above max + ulp(max) / 2 round to Inf (to nearest, ties to even).
        limit = float(info.max) * (1.0 + 0.5 * float(info.eps) / (2.0 - float(info.eps)))
        checks.append(tf.reduce_all(tf.abs(g) < tf.constant(limit, g.dtype)))
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def start_next_window(state: AccumulationState, closing):
    """Opens the next window where ``closing`` (a bool scalar): the window
    number moves on (so every row reads zero) and the counters restart.
    Writes three scalars, outside any branch."""
    state.window.assign_add(tf.cast(closing, state.window.dtype))
    state.micro_step.assign(tf.where(closing, tf.zeros([], state.micro_step.dtype),
                                     state.micro_step.read_value()))
    state.weight.assign(tf.where(closing, tf.zeros([], state.weight.dtype),
                                 state.weight.read_value()))


def all_finite(grads):
    """True when no gradient (dense or ``IndexedSlices``) holds a NaN or Inf.

    A micro-step's own test, apart from the window's (`window_finite`):
    ``GradientAccumulator(nonfinite="raise")`` refuses a non-finite micro-batch
    with it where XLA drops ``tf.debugging`` checks."""
    checks = []
    for g in grads:
        if g is None:
            continue
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        checks.append(tf.reduce_all(tf.math.is_finite(values)))
    if not checks:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(checks))
