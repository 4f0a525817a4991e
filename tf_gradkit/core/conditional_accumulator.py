"""A TF2 `ConditionalAccumulator`: stale-gradient dropping without TF1 resources.

TF1's ``tf.compat.v1.ConditionalAccumulator`` averages gradients from several
workers and drops the ones computed against parameters that have since been
updated. It is awkward in TF2: its ops have no XLA kernel, its take is a
blocking queue operation, and two eager instances with the same dtype and shape
silently share one kernel-side resource (``shared_name`` defaults to the op
name). This module rebuilds the same rule from ordinary ``tf.Variable``\\ s owned
by a ``tf.Module``, so it runs eagerly, in ``tf.function`` and under
``jit_compile=True``, checkpoints with ``tf.train.Checkpoint``, and never
shares state between instances.

The rule, per accumulator with global step ``s``, sum ``S`` and count ``n``::

    apply_grad(g, local_step):  if local_step >= s:  S += g;  n += 1
                                else:                dropped += 1
    take_grad(k):               if n >= k:  return S / n (or S);  S = 0; n = 0; s += 1
                                else:       return zeros (state unchanged)

each call atomic (as TF1's kernels, which hold a mutex). ``"MEAN_PER_ROW"``
divides each row of ``S`` by the number of accepted gradients that held it
instead (TF1's ``SparseConditionalAccumulator``).

References: TF1 ``ConditionalAccumulator`` / ``AccumulatorApplyGradient`` /
``AccumulatorTakeGradient`` (same semantics, blocking take).
"""

import tensorflow as tf
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import control_flow_util as _cf_util

from tf_gradkit.core import accumulation
from tf_gradkit.core import distributed_window
from tf_gradkit.core import exclusive

__all__ = ["ConditionalAccumulator", "REDUCTIONS"]

REDUCTIONS = ("MEAN", "SUM", "MEAN_PER_ROW")


class ConditionalAccumulator(tf.Module):
    """Averages (or sums) gradients, dropping stale ones; XLA-compatible.

    **What ``local_step`` and staleness mean.** Think of the accumulator's
    ``global_step`` as the *version number of the parameters*. Every successful
    `take_grad` hands an averaged gradient to whoever updates the parameters, so
    the parameters move on and ``global_step`` goes up by one. A worker that
    computes a gradient should pass, as ``local_step``, the ``global_step`` it saw
    when it *read the parameters* it differentiated. If, by the time the gradient
    arrives, ``local_step < global_step``, the gradient describes parameters that
    no longer exist: it is *stale*, and averaging it with current gradients would
    mix two parameter versions. It is dropped silently (counted in
    `num_dropped`) and `apply_grad` returns ``False``. ``local_step >=
    global_step`` is accepted.

    Beware the default ``local_step=0``: it is right only until the first
    successful `take_grad`. After that every gradient applied without a
    ``local_step`` is stale and dropped. If you do not want staleness checks at
    all, pass ``local_step=acc.global_step``.

    Example (two workers read the parameters at step 0; worker B is slow)::

        acc = ConditionalAccumulator(tf.float32, shape=[2])
        step_seen = int(acc.global_step)                    # both workers: 0
        acc.apply_grad([1.0, 2.0], local_step=step_seen)    # A, on time: True
        value, ready = acc.take_grad(num_required=1)        # [1., 2.], True
        int(acc.global_step)                                # 1: parameters moved on
        acc.apply_grad([9.0, 9.0], local_step=step_seen)    # B, stale: False
        int(acc.num_accumulated()), int(acc.num_dropped())  # (0, 1)

    **Differences from ``tf.compat.v1.ConditionalAccumulator``:**

    * `take_grad` never blocks. It returns ``(value, ready)``; when fewer than
      ``num_required`` gradients are in, ``value`` is zeros and nothing changes.
      (A blocking wait has no meaning inside ``tf.function`` or XLA; call again.)
    * Like TF1's, `apply_grad` and `take_grad` are atomic, so several threads
      may share an accumulator: eagerly and in ``tf.function`` they hold a mutex
      of the instance, under XLA the launch holds the variables. Don't mix an
      XLA-compiled caller with others *at the same time*: the two locks don't
      exclude each other.
    * No ``shared_name``: state is this instance's variables. Two instances never
      share state; to share, share the instance.
    * Dense gradients and ``tf.IndexedSlices`` both go into the one accumulator
      (slices are scatter-added; TF1 needs a separate
      ``SparseConditionalAccumulator``). The result is always dense. TF1's
      sparse accumulator averages each row over the gradients that held it:
      that is ``reduction="MEAN_PER_ROW"``; ``"MEAN"`` divides every row by the
      number of gradients (what TF1's dense accumulator does with densified
      slices, and the true average of the gradients).
    * Counters (`num_accumulated`, `num_dropped`, `global_step`) are int64
      (TF1's ``num_accumulated`` is int32).
    * Everything is ordinary TF ops with XLA kernels, and the state saves and
      restores with ``tf.train.Checkpoint(acc=accumulator)``.

    Args:
      dtype: floating dtype of the gradients (``tf.float16``, ``tf.bfloat16``,
        ``tf.float32`` or ``tf.float64``).
      shape: the fully defined shape of every gradient.
      reduction: ``"MEAN"`` (`take_grad` returns the average of the accepted
        gradients), ``"SUM"`` (their sum) or ``"MEAN_PER_ROW"`` (each row of
        the sum divided by the number of accepted gradients that held it: a
        dense gradient holds every row, ``tf.IndexedSlices`` the rows they
        index; rows none held are zero). Needs a ``shape`` of rank >= 1.
      name: optional module name; defaults to ``"conditional_accumulator"``.
      accumulator_dtype: the dtype of the sum: None (default) float32 for
        16-bit ``dtype`` (each add to a bfloat16 sum would round; TF1 sums in
        ``dtype``), ``dtype`` otherwise; ``"float32"`` or ``"float64"`` (never
        narrower than ``dtype``); ``"float16"``/``"bfloat16"`` keep a 16-bit
        ``dtype``'s sum in ``dtype`` (as before this argument: checkpoints
        saved then hold 16-bit sums, which a float32 sum refuses to restore).
        `take_grad` divides in it and returns ``dtype``: a value that does not
        fit ``dtype`` (a float16 ``"SUM"`` past 65504) comes back as Inf, as
        any non-finite value does (and as TF1's 16-bit sum overflows).

    Raises:
      TypeError: ``dtype`` is not a floating dtype.
      ValueError: ``shape`` is not fully defined, ``reduction`` is not one of
        ``REDUCTIONS``, or it is ``"MEAN_PER_ROW"`` for a scalar ``shape``.
    """

    def __init__(self, dtype, shape, reduction="MEAN", name=None, accumulator_dtype=None):
        super().__init__(name=name or "conditional_accumulator")
        self._dtype = _check_dtype(dtype)
        self._sum_dtype = accumulation.sum_dtype(
            self._dtype,
            accumulation.check_accumulator_dtype(accumulator_dtype, "ConditionalAccumulator"))
        self._shape = _check_shape(shape)
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise ValueError(
                f"`reduction` must be one of {REDUCTIONS}. Received: "
                f"reduction={reduction!r}")
        if reduction == "MEAN_PER_ROW" and self._shape.rank == 0:
            raise ValueError(
                "`reduction`='MEAN_PER_ROW' needs rows: a `shape` of rank >= 1. "
                f"Received: shape={self._shape}; use 'MEAN' for a scalar")
        self._reduction = reduction
        with self.name_scope:
            self._sum = tf.Variable(
                tf.zeros(self._shape, self._sum_dtype), trainable=False,
                name="accumulated_grad")
            self._count = _counter("num_accumulated")
            self._dropped = _counter("num_dropped")
            self._global_step = _counter("global_step")
            # MEAN_PER_ROW: how many accepted gradients held each row.
            self._row_count = (
                tf.Variable(tf.zeros(self._shape[:1], tf.int64), trainable=False,
                            name="row_count")
                if reduction == "MEAN_PER_ROW" else None)
        # apply_grad and take_grad are atomic, as TF1's C++ ops are: they hold
        # a mutex (`core.exclusive`) eagerly and in tf.function; under XLA the
        # launch itself holds every variable it uses for its whole run. Made
        # under a ParameterServerStrategy, the state and the mutex live on a
        # parameter server and every worker's calls hold it there.
        self._on_ps = distributed_window.concurrent_workers(tf.distribute.get_strategy())
        self._mutex = exclusive.new_mutex(
            self._sum.device if self._on_ps else "/device:CPU:0")

    @property
    def dtype(self):
        """The gradients' dtype."""
        return self._dtype

    @property
    def shape(self):
        """The gradients' (fully defined) shape."""
        return self._shape

    @property
    def reduction(self):
        """``"MEAN"``, ``"SUM"`` or ``"MEAN_PER_ROW"``."""
        return self._reduction

    @property
    def global_step(self):
        """int64 scalar tensor: the parameter version; `take_grad` bumps it."""
        return self._global_step.read_value()

    def num_accumulated(self):
        """int64 scalar tensor: gradients accepted since the last take."""
        return self._count.read_value()

    def num_dropped(self):
        """int64 scalar tensor: stale gradients dropped over the lifetime."""
        return self._dropped.read_value()

    def set_global_step(self, new_global_step):
        """Sets the global step, e.g. to the trainer's own step counter.

        As in TF1, any value is accepted, including one lower than the current
        step (which makes gradients that were stale acceptable again). The
        accumulated sum and count are left as they are.

        Args:
          new_global_step: integer scalar (Python int or integer tensor).

        Raises:
          TypeError: ``new_global_step`` is not an integer.
        """
        self._global_step.assign(_as_step(new_global_step, "new_global_step"))

    def apply_grad(self, grad, local_step=0):
        """Adds ``grad`` unless it is stale (``local_step < global_step``).

        Atomic: concurrent calls (threads, ``tf.function``\\ s) never interleave
        with each other or with `take_grad`.

        Args:
          grad: a dense tensor (or array-like) of the accumulator's shape and
            dtype, or a ``tf.IndexedSlices`` whose rows index the first axis;
            slices are scatter-added (duplicate indices add up) without ever
            building the dense gradient.
          local_step: integer scalar, the global step at which the parameters
            behind ``grad`` were read. See the class docstring.

        Returns:
          A boolean scalar tensor: ``True`` if ``grad`` was accumulated, ``False``
          if it was dropped as stale. Under XLA, where no error can be raised,
          ``IndexedSlices`` with a row index outside ``[0, shape[0])`` are
          refused whole: ``False``, and nothing changes (not even
          `num_dropped`); elsewhere they raise.

        Raises:
          TypeError: ``grad`` has another dtype, or ``local_step`` is not an
            integer.
          ValueError: ``grad``'s static shape is not the accumulator's shape
            (for slices: indices not a vector, values not ``[n] + shape[1:]``,
            or a ``dense_shape`` that is not ``shape``).
          tf.errors.InvalidArgumentError: when it runs (eagerly or in a
            ``tf.function``, not under XLA), the same checks on shapes known
            only then, and slice indices out of range. A failed call changes
            nothing.
        """
        local_step = _as_step(local_step, "local_step")
        if isinstance(grad, tf.IndexedSlices):
            values, indices, valid = self._check_slices(grad)

            def add():
                self._sum.scatter_add(tf.IndexedSlices(
                    tf.cast(values, self._sum_dtype), indices))
                if self._row_count is not None:
                    held = tf.scatter_nd(indices[:, None],
                                         tf.ones(tf.shape(indices), tf.float32),
                                         self._shape[:1])
                    self._row_count.assign_add(tf.cast(held > 0, tf.int64))
                return self._count_one()

            inputs = [values, indices, local_step]
        else:
            grad = self._check_dense(grad)
            valid = tf.constant(True)

            def add():
                self._sum.assign_add(tf.cast(grad, self._sum_dtype))
                if self._row_count is not None:
                    self._row_count.assign_add(tf.ones(self._shape[:1], tf.int64))
                return self._count_one()

            inputs = [grad, local_step]

        def drop():
            self._dropped.assign_add(tf.constant(1, tf.int64))
            return tf.constant(False)

        def apply():
            # The accepted count moves only once the sum has (`_count_one`),
            # and nothing runs before the checks made in `inputs` have passed:
            # a failed call leaves the state as it was.
            fresh = local_step >= self._global_step
            return tf.cond(
                valid,
                lambda: tf.cond(fresh, add, drop),
                lambda: tf.constant(False))

        return self._exclusive(apply, after=inputs)

    def _count_one(self):
        # Automatic control dependencies do not order ops on different
        # variables; the count must never move without the sum.
        with tf.control_dependencies([self._sum.read_value()]):
            self._count.assign_add(tf.constant(1, tf.int64))
        return tf.constant(True)

    def take_grad(self, num_required):
        """Returns the reduced gradient if at least ``num_required`` are in.

        Unlike TF1 this never blocks. When ready, the sum and count reset to
        zero and the global step increases by one (the caller is expected to
        update the parameters with ``value``, making older gradients stale).
        Atomic, like `apply_grad`: two concurrent takes never return the same
        gradients.

        Args:
          num_required: how many accepted gradients are needed, an integer >= 1.
            A tensor value below 1 raises when it runs; under XLA, where it
            cannot, it is treated as 1.

        Returns:
          ``(value, ready)``: ``value`` is the average (``"MEAN"``), the sum
          (``"SUM"``) or the per-row average (``"MEAN_PER_ROW"``) of the
          accumulated gradients, or zeros when not ready; ``ready`` is a
          boolean scalar tensor.

        Raises:
          ValueError: ``num_required`` is statically known and below 1.
          TypeError: ``num_required`` is not an integer.
          tf.errors.InvalidArgumentError: ``num_required`` is a tensor below 1
            (not under XLA).
        """
        num_required = _check_num_required(num_required)
        return self._exclusive(lambda: self._take(num_required), after=[num_required])

    def _take(self, num_required):
        ready = self._count >= num_required

        def take():
            value = self._sum.read_value()
            if self._reduction == "MEAN":
                value = value / tf.cast(self._count, self._sum_dtype)
            elif self._reduction == "MEAN_PER_ROW":
                rows = tf.maximum(self._row_count, tf.constant(1, tf.int64))
                rows = tf.reshape(tf.cast(rows, self._sum_dtype),
                                  [-1] + [1] * (self._shape.rank - 1))
                value = value / rows
                self._row_count.assign(tf.zeros(self._shape[:1], tf.int64))
            # Automatic control dependencies order these after the reads above.
            self._sum.assign(tf.zeros(self._shape, self._sum_dtype))
            self._count.assign(tf.constant(0, tf.int64))
            self._global_step.assign_add(tf.constant(1, tf.int64))
            return tf.cast(value, self._dtype)

        def wait():
            return tf.zeros(self._shape, self._dtype)

        return tf.cond(ready, take, wait), ready

    def _exclusive(self, fn, after):
        """Runs ``fn()`` atomically with respect to every other apply and take."""
        if _in_xla():
            # The XLA launch locks every variable it touches for its whole run.
            return fn()
        if tf.executing_eagerly() and not self._on_ps:
            lock = tf.raw_ops.MutexLock(mutex=self._mutex)
            try:
                return fn()
            finally:
                del lock  # the mutex is released with the lock's last reference
        return exclusive.run_exclusive(self._mutex, fn, after=after)

    def _check_dense(self, grad):
        if isinstance(grad, (tf.Tensor, tf.Variable)) and grad.dtype != self._dtype:
            raise TypeError(
                f"`grad` must have the accumulator's dtype {self._dtype.name}. "
                f"Received: grad with dtype {grad.dtype.name}")
        grad = tf.convert_to_tensor(grad, dtype=self._dtype)
        if not grad.shape.is_compatible_with(self._shape):
            raise ValueError(
                f"`grad` must have the accumulator's shape {self._shape}. "
                f"Received: grad with shape {grad.shape}")
        # A partly unknown static shape (tf.function without a full signature)
        # is checked when it runs; XLA shapes are always static.
        return tf.ensure_shape(grad, self._shape)

    def _check_slices(self, grad):
        """The checked ``(values, indices, in_range)`` of slices ``grad``."""
        if self._shape.rank == 0:
            raise ValueError(
                "`grad` can be tf.IndexedSlices only for an accumulator of rank "
                ">= 1. Received: IndexedSlices for a scalar accumulator")
        if grad.values.dtype != self._dtype:
            raise TypeError(
                f"`grad` must have the accumulator's dtype {self._dtype.name}. "
                f"Received: IndexedSlices with values dtype "
                f"{grad.values.dtype.name}")
        row_shape = self._shape[1:]
        values_shape = tf.TensorShape([None]).concatenate(row_shape)
        if not grad.values.shape.is_compatible_with(values_shape):
            raise ValueError(
                f"`grad` IndexedSlices values must have shape [n] + {row_shape} "
                f"for an accumulator of shape {self._shape}. Received: values "
                f"with shape {grad.values.shape}")
        if not grad.indices.shape.is_compatible_with([None]):
            raise ValueError(
                "`grad` IndexedSlices indices must be a vector. Received: "
                f"indices with shape {grad.indices.shape}")
        if (grad.indices.shape[0] is not None and grad.values.shape.rank and
                grad.values.shape[0] is not None and
                grad.indices.shape[0] != grad.values.shape[0]):
            raise ValueError(
                "`grad` IndexedSlices must have one values row per index. "
                f"Received: {grad.indices.shape[0]} indices and values with "
                f"shape {grad.values.shape}")
        dense_shape = (None if grad.dense_shape is None
                       else tf.get_static_value(grad.dense_shape))
        if dense_shape is not None and list(dense_shape) != self._shape.as_list():
            raise ValueError(
                f"`grad` IndexedSlices dense_shape must be the accumulator's shape "
                f"{self._shape}. Received: dense_shape={list(dense_shape)}")
        if not grad.indices.dtype.is_integer:
            raise TypeError(
                "`grad` IndexedSlices indices must be integers. Received: "
                f"indices with dtype {grad.indices.dtype.name}")
        values = tf.ensure_shape(grad.values, values_shape)
        indices = tf.cast(tf.ensure_shape(grad.indices, [None]), tf.int64)
        rows = tf.constant(self._shape[0], tf.int64)
        in_range = tf.reduce_all((indices >= 0) & (indices < rows))
        if _in_xla():
            # Nothing raises when an XLA computation runs, but shapes are known
            # when it compiles: a reshape refuses unequal row counts then. An
            # out-of-range row cannot raise: `apply_grad` refuses it instead.
            values = tf.reshape(values, tf.concat(
                [tf.shape(indices, out_type=tf.int32),
                 tf.constant(row_shape.as_list(), tf.int32)], 0))
            return values, indices, in_range
        checks = [
            tf.debugging.assert_equal(
                tf.shape(indices)[0], tf.shape(values)[0],
                message="`grad` IndexedSlices must have one values row per index"),
            tf.debugging.Assert(in_range, [
                f"`grad` IndexedSlices indices must be in [0, {self._shape[0]}). "
                "Received: indices", indices], summarize=16),
        ]
        if grad.dense_shape is not None and dense_shape is None:
            checks.append(tf.debugging.assert_equal(
                tf.cast(grad.dense_shape, tf.int64),
                tf.constant(self._shape.as_list(), tf.int64),
                message="`grad` IndexedSlices dense_shape must be the "
                        f"accumulator's shape {self._shape}"))
        with tf.control_dependencies(checks):
            return tf.identity(values), tf.identity(indices), in_range


def _in_xla():
    return _cf_util.GraphOrParentsInXlaContext(_ops.get_default_graph())


def _counter(name):
    return tf.Variable(tf.constant(0, tf.int64), trainable=False, name=name)


def _check_dtype(dtype):
    try:
        as_dtype = tf.as_dtype(dtype)
    except TypeError:
        as_dtype = None
    if as_dtype is None or not as_dtype.is_floating:
        raise TypeError(
            "`dtype` must be a floating dtype (float16, bfloat16, float32, "
            f"float64). Received: dtype={dtype!r}")
    return as_dtype


def _check_shape(shape):
    try:
        static = tf.TensorShape(shape)
    except (TypeError, ValueError):
        static = None
    if static is None or not static.is_fully_defined():
        raise ValueError(
            "`shape` must be fully defined (a list of non-negative ints, [] "
            f"for a scalar). Received: shape={shape!r}")
    return static


def _as_step(step, arg_name):
    step = tf.convert_to_tensor(step)
    if not step.dtype.is_integer or step.shape.rank not in (None, 0):
        raise TypeError(
            f"`{arg_name}` must be an integer scalar. Received: {arg_name} with "
            f"dtype {step.dtype.name} and shape {step.shape}")
    return tf.cast(step, tf.int64)


def _check_num_required(num_required):
    if isinstance(num_required, bool):
        raise TypeError(
            "`num_required` must be an integer >= 1. Received: "
            f"num_required={num_required!r}")
    num_required = _as_step(num_required, "num_required")
    static = tf.get_static_value(num_required)
    if static is not None and static < 1:
        raise ValueError(
            "`num_required` must be an integer >= 1. Received: "
            f"num_required={static}")
    if static is None and not _in_xla():  # known when it runs: checked then
        check = tf.debugging.assert_greater_equal(
            num_required, tf.constant(1, tf.int64),
            message="`num_required` must be an integer >= 1")
        with tf.control_dependencies([check]):
            num_required = tf.identity(num_required)
    return tf.maximum(num_required, tf.constant(1, tf.int64))
