"""GradientAccumulator: the algorithm, written once for both Keras flavours
(the rule is `tf_gradkit.core.accumulation`, the window's close under
``tf.distribute`` `tf_gradkit.core.distributed_window`)."""

import warnings
import weakref

import tensorflow as tf

from tf_gradkit import _model_hooks
from tf_gradkit._algorithms import loss_denominator
from tf_gradkit._algorithms.wrapper import Wrapper, no_gradients_error
from tf_gradkit.core import accumulation
from tf_gradkit.core import distributed_window
from tf_gradkit.core import exclusive
from tf_gradkit.core.accumulation import REDUCTIONS

EPOCH_END_POLICIES = ("apply", "carry", "drop")
NONFINITE_POLICIES = ("skip", "raise")
# Traced flush/discard functions per optimizer, kept off the optimizer object
# so that no tf.function becomes part of its checkpoint or SavedModel.
_REPLICA_FUNCTIONS = weakref.WeakKeyDictionary()


def validate_arguments(steps, reduction, epoch_end, nonfinite, sample_count=None,
                       accumulator_dtype=None):
    """Raises a clear error for a bad constructor argument; changes nothing.
    Returns ``accumulator_dtype`` by name (or None)."""
    if sample_count is not None and not callable(sample_count):
        raise ValueError(
            "GradientAccumulator: `sample_count` must be None or a function "
            "fn(x, y, sample_weight) -> what the loss of that batch divides by. "
            f"Received: sample_count={sample_count!r}. (In a custom loop pass a "
            "number to apply_gradients(..., sample_count=n) instead.)")
    if sample_count is not None and reduction != "example":
        raise ValueError(
            "GradientAccumulator: `sample_count` weighs micro-batches, which only "
            "reduction='example' does. Received: sample_count=<function>, "
            f"reduction={reduction!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            "GradientAccumulator: `steps` must be an integer >= 1 (the number "
            f"of micro-batches per update). Received: steps={steps!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"GradientAccumulator: `reduction` must be one of {REDUCTIONS}. "
            f"Received: reduction={reduction!r}")
    if epoch_end not in EPOCH_END_POLICIES:
        raise ValueError(
            f"GradientAccumulator: `epoch_end` must be one of "
            f"{EPOCH_END_POLICIES}. Received: epoch_end={epoch_end!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"GradientAccumulator: `nonfinite` must be one of "
            f"{NONFINITE_POLICIES}. Received: nonfinite={nonfinite!r}")
    return accumulation.check_accumulator_dtype(accumulator_dtype, "GradientAccumulator")


class GradientAccumulator(Wrapper):
    """Applies the wrapped optimizer once every ``steps`` micro-batches.

    Each ``apply_gradients`` call adds one micro-batch to a window; when the
    window holds ``steps`` micro-batches the inner optimizer runs once on their
    combined gradient, so k micro-batches update the weights the way one
    batch holding all their examples would (to float32 round-off), for SGD,
    momentum, Adam and AdamW alike, whatever the loss divides by: examples,
    unmasked tokens (Keras masks), elements, summed sample weights, or
    nothing (``reduction="sum"`` losses). Between updates the inner
    optimizer is not touched at all: no zero-gradient steps, no moment decay,
    and clipping, weight decay, EMA and constraints run only at the real
    update.

    ``iterations`` counts real (inner) updates, so learning-rate schedules,
    checkpoints and callbacks see real steps. Keras 3's own
    ``gradient_accumulation_steps`` weights micro-batches equally;
    ``micro_steps`` here counts micro-batches.

    Args:
      optimizer: the optimizer to wrap (Adam, SGD, a tf_gradkit optimizer,
        ...), of the same Keras flavour. Mixed precision: put the
        LossScaleOptimizer outside (compile does that under a
        ``mixed_float16`` policy); Keras 3 refuses one inside, tf_keras
        when another is put outside (compile under that policy).
      steps: micro-batches per update, an integer >= 1.
      reduction: how micro-batches combine. ``"example"`` (default): each
        counts for what its loss divides by, so the window's gradient is the
        big batch's (a micro-batch of 2-token sequences weighs less than one
        of 12-token sequences when the loss averages over tokens). Under
        ``model.fit`` pass ``model=``: the count is read from the compiled
        loss of each batch (its examples, its unmasked tokens under a Keras
        mask, its summed sample weights under
        ``"mean_with_sample_weight"``; a ``reduction="sum"`` loss is summed).
        In custom loops pass ``apply_gradients(..., sample_count=n)``, n
        being what your loss divides by (examples, or tokens). With neither,
        the first step is refused. Where the count cannot be read (a
        ``compute_loss`` override, a loss that returns one value per batch)
        the examples are used and a warning says so once.
        ``"microbatch"``: each micro-batch counts equally (Keras's
        ``gradient_accumulation_steps``; not the big batch when counts
        differ). ``"sum"``: the gradients are summed (custom loops whose loss
        is a sum).
      model: optional, the model trained with ``fit``: its ``train_step`` then
        reports batch sizes and its ``fit`` applies the ``epoch_end`` policy.
        Only that model instance is touched (no subclassing needed); after
        loading a saved model call ``attach(model)``.
      epoch_end: what happens to a window left incomplete when an epoch's
        data ends under ``fit`` (needs ``model=``): ``"apply"`` (default) it
        now, weighted by what it holds; ``"carry"`` it into the next epoch;
        ``"drop"`` it. In custom loops call ``flush()`` or ``discard()``.
      sample_count: optional, for ``model.fit``: a function
        ``fn(x, y, sample_weight)`` giving what the loss of a batch divides by,
        for losses whose count cannot be read (saved by name when defined at a
        module's top level).
      nonfinite: ``"skip"`` (default): a window with a NaN/Inf micro-batch
        gradient is discarded whole, weights and optimizer state untouched,
        and ``skipped_windows`` increments (under ``fit`` with ``model=`` a
        warning after the epoch says how many). ``"raise"``: raise
        ``InvalidArgumentError`` at the offending micro-batch, eagerly and in
        ``tf.function``, before anything changes; XLA cannot raise from a
        compiled step, so under ``jit_compile=True`` that micro-batch is left
        out (nothing changes but ``dropped_gradients``; under ``fit`` a
        warning after the epoch says so).
      accumulator_dtype: the dtype the window's sums are kept in: None
        (default) float32 for 16-bit (float16, bfloat16) variables and the
        variable's own dtype otherwise; ``"float32"`` or ``"float64"`` (never
        narrower than the variable: a float64 variable keeps float64 sums).
        A 16-bit sum would round at every micro-batch, where one big batch
        rounds once. The window's gradient is divided in that dtype (under
        MirroredStrategy summed over replicas in it too), then handed on in
        the variable's; a window whose gradient does not fit that dtype (a
        float16 overflow) is treated as non-finite (``nonfinite``).
        ``"float16"``/``"bfloat16"`` keep 16-bit variables' sums in their own
        dtype, as versions before this argument did: their checkpoints hold
        16-bit sums, which float32 sums refuse to restore. Under
        ``mixed_float16``/``mixed_bfloat16`` policies the variables are
        float32 already.
      name: optional name.

    ``apply_gradients(grads_and_vars, sample_count=None, local_step=None)``:
    ``local_step`` gives ConditionalAccumulator semantics for asynchronous or
    pipelined producers: a gradient computed at ``local_step`` older than
    ``version`` (the number of real updates, read before the weights) is
    stale and dropped (``dropped_gradients`` counts them); it does not count
    toward the window.

    Under ``tf.distribute.MirroredStrategy`` and ``MultiWorkerMirroredStrategy``
    each replica accumulates locally; the one cross-replica gradient
    reduction happens when the window closes. Under ``ParameterServerStrategy``
    (tf_keras) the window lives on the parameter servers, each micro-step
    holds a mutex there (while the workers live, every window takes exactly
    ``steps`` accepted micro-steps; a micro-step a dying worker cuts off is
    rolled back and its window dropped and counted in ``lost_micro_steps``,
    and a re-run step may count twice: docs/distributed.md) and, under ``fit``, a gradient
    computed against weights that another worker's window has since updated
    is dropped as stale.

    Example:

    >>> opt = GradientAccumulator(keras.optimizers.Adam(1e-3), steps=4, model=model)
    >>> model.compile(optimizer=opt, loss="mse")
    >>> model.fit(x, y, batch_size=8)  # one Adam step per 32 examples
    """

    accumulates_gradients = True
    accumulation_argument = "steps"
    ACCEPTED = ("optimizer, steps, reduction, model, epoch_end, nonfinite, "
                "sample_count, accumulator_dtype, name")
    REFUSALS = {
        "same": "Use one GradientAccumulator whose `steps` is the product of both.",
        "residuals": "Give LevenbergMarquardt the whole batch instead (a larger "
                     "batch_size; chunk_size= bounds its memory).",
        "keras_accumulation": "Drop gradient_accumulation_steps from the inner "
                              "optimizer and set `steps` here.",
        "loss_scale": "Put the LossScaleOptimizer outside: compile a plain "
                      "GradientAccumulator(optimizer, steps) (under a "
                      "mixed_float16 policy Keras wraps it), or write "
                      "LossScaleOptimizer(GradientAccumulator(optimizer, steps)).",
    }

    def __init__(self, optimizer, steps, reduction="example", model=None,
                 epoch_end="apply", nonfinite="skip", sample_count=None, name=None,
                 accumulator_dtype=None, **kwargs):
        accumulator_dtype = validate_arguments(steps, reduction, epoch_end, nonfinite,
                                               sample_count, accumulator_dtype)
        self._init_wrapper(optimizer, name, kwargs)
        self.steps = steps
        self.reduction = reduction
        self.epoch_end = epoch_end
        self.nonfinite = nonfinite
        self.sample_count = sample_count
        self.accumulator_dtype = accumulator_dtype
        self._warned = False  # the unknown-denominator warning, said once
        self._binding = None
        self._awaiting_model = False
        self._state = None
        self._with_gradient = None  # which variables the first micro-step gave a gradient
        if model is not None:
            self.attach(model)

    def attach(self, model):
        """Binds this optimizer to ``model`` (what ``model=`` does): under
        ``model.fit`` each micro-batch then counts the examples it holds and
        the ``epoch_end`` policy runs. Needed again after loading a saved
        model (``tf_gradkit.attach(model)`` does it for every optimizer of
        the model); the hooks act only while this optimizer is the model's."""
        self._check_model(model)
        self._binding = _model_hooks.ModelBinding.bind(model, self, self._CALLBACK)
        self._awaiting_model = False
        return self

    def _on_epoch_end(self):
        self.end_epoch()
        self._report_nonfinite()
        self._report_torn()

    _torn_said = (0, 0)

    def _report_torn(self):
        """Under ParameterServerStrategy, after each epoch: says what workers
        that died inside a micro-step cost, since the last time it said so."""
        if self._journal is None:
            return
        said = self._torn_said
        lost, interrupted = int(self.lost_micro_steps), int(self.interrupted_updates)
        self._torn_said = (lost, interrupted)
        if lost > said[0] or interrupted > said[1]:
            warnings.warn(
                f"{type(self).__name__}: a worker died inside a micro-step; its window "
                f"was dropped whole ({lost - said[0]} accepted micro-batch(es) not "
                f"applied, `lost_micro_steps`), and {interrupted - said[1]} window "
                "update(s) were cut off while the inner optimizer wrote them "
                "(`interrupted_updates`: the weights may hold part of that update; "
                "restore the last checkpoint if that matters). docs/distributed.md.",
                UserWarning, stacklevel=2)

    def _report_nonfinite(self):
        """Under ``fit``, after each epoch: says how many windows
        ``nonfinite="skip"`` discarded, and how many micro-batches
        ``nonfinite="raise"`` left out under XLA (which cannot raise), since
        the last time it said so."""
        if self._state is None:
            return
        said = self._nonfinite_said
        skipped, dropped = int(self._skipped.numpy()), int(self._dropped.numpy())
        self._nonfinite_said = (skipped, dropped)
        if skipped > said[0]:
            warnings.warn(
                f"{type(self).__name__} skipped {skipped - said[0]} window(s) holding a "
                "NaN or Inf gradient (nonfinite='skip'): the weights and the optimizer "
                f"were left as they were; `skipped_windows` counts them ({skipped} in "
                "all). Pass nonfinite='raise' to stop at the first one.",
                UserWarning, stacklevel=2)
        if self.nonfinite == "raise" and dropped > said[1] and self._version is None:
            warnings.warn(
                f"{type(self).__name__}(nonfinite='raise') left out {dropped - said[1]} "
                "micro-batch(es) with a NaN or Inf gradient without raising: XLA "
                "(jit_compile=True) cannot raise from a compiled step. Nothing else "
                f"changed; `dropped_gradients` counts them ({dropped} in all). Compile "
                "without jit_compile to stop at the first one.",
                UserWarning, stacklevel=2)

    _nonfinite_said = (0, 0)

    def _wrap_loss(self, loss, arguments):
        """Refuses, as ``fit`` computes the loss and before this optimizer
        is built or anything changes, a loss whose counts no weight per
        micro-batch can make exact (`_read_denominator`)."""
        del arguments  # recorded by the binding, read there
        if self.reduction == "example" and self.sample_count is None:
            self._read_denominator()
        return loss

    # ------------------------------------------------------------------ state
    def _build_own(self, var_list):
        _refuse_overwrite_with_gradient(var_list, self.steps)

        def make_variable(reference, name, per_replica=True, dtype=None):
            ref = reference if getattr(reference, "name", None) else None  # named after it
            return self._new_variable(reference.shape, dtype or reference.dtype, name,
                                      sync="sum" if per_replica else "first",
                                      reference=ref)

        def make_scalar(dtype, name, per_replica):
            return self._new_variable((), dtype, name,
                                      sync="sum" if per_replica else "first")

        self._state = accumulation.init_accumulation(var_list, make_variable, make_scalar,
                                                     self.accumulator_dtype)
        self._micro_steps = make_scalar(tf.int64, "micro_steps", False)
        self._dropped = make_scalar(tf.int64, "dropped_gradients", False)
        self._skipped = make_scalar(tf.int64, "skipped_windows", False)
        if distributed_window.concurrent_workers(self._strategy()):
            # Workers update the window at once (parameter servers): each
            # micro-step holds a mutex on the servers, and `version` counts
            # the updates whose writes are done (`core.exclusive`).
            self._version = make_scalar(tf.int64, "version", False)
            self._mutex = exclusive.new_mutex(self._state.micro_step.device)
            # A worker that dies inside a micro-step leaves it half written:
            # the next one restores the counters from the journal and drops
            # the open window (`_on_torn`). Made after `version`, so that the
            # checkpoint keys of the variables above keep their places (a
            # checkpoint without these restores zeros: nothing torn).
            self._lost = make_scalar(tf.int64, "lost_micro_steps", False)
            self._interrupted = make_scalar(tf.int64, "interrupted_updates", False)
            counters = [self._state.micro_step, self._state.window, self._micro_steps,
                        self._dropped, self._skipped, self._version, self._lost,
                        self._interrupted]
            self._journal = exclusive.Journal(
                self._new_variable((1 + len(counters),), tf.int64, "journal",
                                   sync="first"), counters, self._on_torn)

    _version = None
    _mutex = None
    _journal = None
    _lost = None
    _interrupted = None
    _APPLYING = 2  # the journal's phase while the inner optimizer applies a window

    def _on_torn(self, phase):
        """After a worker died inside a micro-step (the counters are restored
        as they were before it): its window's sums may hold part of a
        micro-batch, so the window is dropped whole and its micro-steps
        counted in `lost_micro_steps`; if the worker died while applying a
        window, `interrupted_updates` counts that update (which may be written
        in part)."""
        self._lost.assign_add(self._state.micro_step.read_value())
        self._interrupted.assign_add(tf.cast(phase >= self._APPLYING, tf.int64))
        accumulation.start_next_window(self._state, tf.constant(True))

    def _wrap_train_step(self, step, model):
        """Under a parameter-server strategy, reads `version` before the
        step reads the weights, as the ``local_step`` of its gradient."""
        if not distributed_window.concurrent_workers(self._strategy()):
            return step
        if self._state is None:
            with tf.init_scope():
                self.build(model.trainable_variables)
        binding = self._binding

        def versioned_step(data):
            version = self._version.read_value()
            binding.record(self._VERSION_KEY, version)
            with tf.control_dependencies([version]):
                return step(data)

        return versioned_step

    _VERSION_KEY = "gradient_accumulator.version"

    # ------------------------------------------------------------------- step
    def _apply_grads(self, grads, variables, aggregated=False, sample_count=None,
                     local_step=None):
        """One micro-step (replica context once built).

        ``aggregated``: the gradients are already summed over replicas (a
        tf_keras LossScaleOptimizer outside does that), so each replica's
        window is scaled by 1 / weight, not replicas / weight, before the
        inner optimizer's one sum over replicas at the window's close.
        """
        if len(grads) != len(variables):
            raise ValueError(
                f"GradientAccumulator.apply_gradients: got {len(grads)} gradients "
                f"for {len(variables)} variables; pass one gradient (or None) per "
                "variable, as (gradient, variable) pairs.")
        if all(g is None for g in grads):
            raise no_gradients_error(variables)
        self._warn_missing_gradients(grads, variables)
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError(
                "GradientAccumulator.apply_gradients must be called in replica "
                "context, i.e. inside `strategy.run`.")
        self._input_aggregated = bool(aggregated)
        grads = self._align(grads, variables)
        self._check_same_variables(grads)
        finite, checked = True, []
        if self.nonfinite == "raise":
            grads, checked = _check_numerics(grads)
            finite = accumulation.all_finite(grads)  # XLA drops the checks: leave it out
        if local_step is None and self._mutex is not None and self._binding is not None:
            local_step = self._binding.step_value(self._VERSION_KEY)
        has_grad = [g is not None for g in grads]

        def micro():
            weight, count = self._micro_batch_weight(sample_count)
            accept = True
            if local_step is not None:
                version = self.iterations if self._version is None else self._version
                accept = tf.cast(local_step, tf.int64) >= tf.cast(version, tf.int64)
            if finite is not True:
                accept = tf.logical_and(accept, finite)
            distributed_window.micro_step(
                self._state, grads, weight=weight, count=count, accept=accept,
                steps=self.steps,
                apply_window=lambda total: self._apply_window(total, has_grad),
                skip_window=lambda total: self._skip_window(total, has_grad),
                count_dropped=self._dropped.assign_add,
                gradients_finite=self._gradients_finite)
            self._micro_steps.assign_add(tf.cast(accept, tf.int64))

        # Under a parameter-server strategy the whole micro-step holds the
        # window's mutex; elsewhere it runs as is. Under nonfinite="raise"
        # nothing is written before every check passed.
        with tf.control_dependencies(checked):
            exclusive.run_exclusive(self._mutex, micro, after=grads, journal=self._journal)

    def _micro_batch_weight(self, sample_count):
        """``(weight, count)``: what this micro-batch's gradient is multiplied
        by, and what it adds to the window's count (the window's gradient is
        the weighted sum over the count; `loss_denominator`)."""
        one = tf.constant(1.0, tf.float32)
        if self.reduction != "example":
            return one, one
        if sample_count is None and self._binding is not None:
            return self._count_under_fit()
        if sample_count is None:
            raise _missing_batch_sizes(self._awaiting_model)
        count = tf.cast(sample_count, tf.float32)
        return count, count

    def _count_under_fit(self):
        binding = self._binding
        if self.sample_count is not None:
            x, y, sample_weight = self._unpack(binding.step_value("data"))
            count = tf.cast(self.sample_count(x, y, sample_weight), tf.float32)
            return count, count
        found = self._read_denominator()
        if isinstance(found, loss_denominator.UnknownDenominator):
            self._warn_unknown(str(found))
            count = tf.cast(binding.batch_size, tf.float32)
            return count, count
        if found.summed:  # weight 1 each, a window count of 1 (its first micro-step)
            first = tf.equal(self._state.micro_step.read_value(), 0)
            return tf.constant(1.0, tf.float32), tf.cast(first, tf.float32)
        return found.count, found.count

    def _read_denominator(self):
        """What this batch's compiled loss divides by (`loss_denominator`),
        from the arguments of the ``compute_loss`` call just made; an
        `UnknownDenominator` when it cannot be read. Raises, before anything
        changes, what no weight per micro-batch can make exact."""
        binding = self._binding
        model, arguments = binding.model, binding.step_value("loss_arguments")
        try:
            if arguments is None:
                raise loss_denominator.UnknownDenominator(
                    "the model's train_step does not call compute_loss")
            if self._overrides_compute_loss(model):
                raise loss_denominator.UnknownDenominator(
                    f"{type(model).__name__} overrides compute_loss")
            terms = self._loss_terms(model, arguments.get("y"), arguments.get("y_pred"),
                                     arguments.get("sample_weight"))
            return loss_denominator.denominator(
                terms, binding.batch_size, self._extra_losses(model), type(self).__name__)
        except loss_denominator.UnknownDenominator as error:
            return error

    def _warn_unknown(self, why):
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"{type(self).__name__} cannot read what the model's loss divides by "
            f"({why}), so it weighs each micro-batch by its examples: a window equals "
            "the big batch only if the loss averages over examples. If it averages "
            "over something else (unmasked tokens, sample weights), pass "
            "sample_count=fn to the GradientAccumulator (fn(x, y, sample_weight) -> "
            "that count for a batch), or apply_gradients(..., sample_count=n) in "
            "your own train_step.", UserWarning, stacklevel=3)

    def _align(self, grads, variables):
        """Orders gradients like the variables the optimizer was built with."""
        known = {self._variable_key(v) for v in self._built_variables()}
        by_key = {}
        for g, v in zip(grads, variables):
            key = self._variable_key(v)
            if key not in known:
                raise ValueError(
                    f"GradientAccumulator: unknown variable {v.name}; the optimizer "
                    "was built for other variables. Create a new "
                    "GradientAccumulator for a new set of variables.")
            by_key[key] = g
        return [by_key.get(self._variable_key(v)) for v in self._built_variables()]

    # Pure Python over the trace: autograph has nothing to convert here (and
    # one tf_keras run saw its converted call pass `self` twice).
    @tf.autograph.experimental.do_not_convert
    def _check_same_variables(self, grads):
        """Refuses a micro-step that gives gradients to other variables than
        the first one did: the window's update covers the variables with a
        gradient, so the sums of the others would be dropped (or variables
        never trained would be updated). Python, before any state changes."""
        with_gradient = tuple(g is not None for g in grads)
        if self._with_gradient is None:
            self._with_gradient = with_gradient
        if with_gradient == self._with_gradient:
            return
        names = [getattr(v, "path", None) or v.name for v, now, first in
                 zip(self._built_variables(), with_gradient, self._with_gradient)
                 if now != first]
        raise ValueError(
            "GradientAccumulator: every micro-step must give gradients to the same "
            f"variables; these had a gradient in one micro-step and None in another: "
            f"{names}. A window's update would drop what the others accumulated. Pass "
            "a gradient for every variable on every micro-step (tf.zeros_like(v) for "
            "a variable a micro-batch does not use), or use one GradientAccumulator "
            "per set of variables that train together (after freezing or unfreezing "
            "layers, compile with a new GradientAccumulator).")

    def _window_gradients(self, total_weight, narrow=True):
        """``(sums, grads)``: this replica's share of the window's sums and the
        gradients it hands on (in the variables' dtypes; with ``narrow=False``
        still in the sums' dtypes)."""
        replicas = (1 if getattr(self, "_input_aggregated", False)
                    else tf.distribute.get_strategy().num_replicas_in_sync)
        dtypes = [v.dtype for v in self._built_variables()]
        sums = distributed_window.widened_sums_on_one_replica(
            accumulation.window_sums(self._state), dtypes)
        return sums, accumulation.window_gradients(sums, self.reduction, total_weight,
                                                   replicas, dtypes=dtypes if narrow else None)

    def _gradients_finite(self, total_weight):
        """Whether the gradients this replica would hand on are finite where
        a wider sum was narrowed to its variable's dtype (a finite float32
        sum may not fit float16): tested where the window closes, before
        anything is written; the window is skipped otherwise. Sums kept in
        their variable's dtype are covered by the window's own test, and cost
        nothing more here."""
        if all(acc.dtype == v.dtype for acc, v in
               zip(self._state.acc_grads, self._built_variables())):
            return tf.constant(True)
        _, wide = self._window_gradients(total_weight, narrow=False)
        return accumulation.narrowed_finite(wide, [v.dtype for v in self._built_variables()])

    def _apply_window(self, total_weight, has_grad):
        _, grads = self._window_gradients(total_weight)
        pairs = [(g, v) for g, v, h in zip(grads, self._built_variables(), has_grad)
                 if h]
        # Each replica hands on its share: the inner optimizer's one sum over
        # replicas (always, even when the micro-steps' input was summed) is
        # the window's only gradient reduction.
        apply = lambda: self._inner_apply([g for g, _ in pairs], [v for _, v in pairs])  # noqa: E731
        if self._version is None:
            apply()
            return
        with tf.control_dependencies([self._journal.mark(self._APPLYING)]):
            # published once the update's writes are done
            exclusive.after_writes(apply, lambda: self._version.assign_add(1))

    def _skip_window(self, total_weight, has_grad):
        if self._is_loss_scale(self.inner_optimizer):
            # Let the loss-scale optimizer see the overflow: it lowers its
            # scale and skips the update itself, leaving the inner state as is.
            self._apply_window(total_weight, has_grad)
        self._skipped.assign_add(1)

    # --------------------------------------------------------- window control
    def flush(self):
        """Applies a partially filled window now (no-op when it is empty).

        For custom loops at the end of the data; ``model.fit`` with
        ``model=`` does this at each epoch end when ``epoch_end="apply"``.
        Call it eagerly, in ``tf.function``, or in ``strategy.run``.
        """
        self._run_in_replicas(self._flush_in_replica)

    def discard(self):
        """Drops whatever the open window holds; weights and state unchanged."""
        self._run_in_replicas(self._discard_in_replica)

    def end_epoch(self):
        """Applies the ``epoch_end`` policy: "apply", "carry" or "drop"."""
        if self.epoch_end == "apply":
            self.flush()
        elif self.epoch_end == "drop":
            self.discard()

    def _discard_in_replica(self):
        exclusive.run_exclusive(self._mutex, lambda: accumulation.start_next_window(
            self._state, tf.constant(True)), journal=self._journal)

    def _flush_in_replica(self):
        has_grad = list(self._with_gradient or [True] * len(self._built_variables()))
        exclusive.run_exclusive(self._mutex, lambda: distributed_window.micro_step(
            self._state, [None] * len(has_grad), weight=None, count=None, accept=True,
            steps=self.steps, force=True,
            apply_window=lambda total: self._apply_window(total, has_grad),
            skip_window=lambda total: self._skip_window(total, has_grad),
            count_dropped=None, gradients_finite=self._gradients_finite),
            journal=self._journal)

    def _run_in_replicas(self, fn):
        """Runs ``fn`` once per replica, from wherever the caller stands.

        Keras 3 runs callbacks outside the strategy scope, so the strategy is
        the one the optimizer was created under, not the ambient one.
        """
        if self._state is None:
            return  # never built: nothing accumulated
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            fn()  # already in replica context (strategy.run, train_step)
            return
        with self._strategy().scope():
            if not tf.distribute.has_strategy():  # the default strategy
                fn()
            elif tf.executing_eagerly():
                # One traced function per (optimizer, action): running a
                # MirroredStrategy eagerly is slow and warns. A weak reference:
                # the cached function must not keep the optimizer alive.
                strategy = self._strategy()
                cache = _REPLICA_FUNCTIONS.setdefault(self, {})
                name = fn.__name__
                if name not in cache:
                    ref = weakref.ref(self)
                    cache[name] = tf.function(lambda: strategy.run(getattr(ref(), name)))
                cache[name]()
            else:
                self._strategy().run(fn)

    # -------------------------------------------------------------- reporting
    def _counter(self, name):
        variable = None if self._state is None else getattr(self, name)
        if variable is None:
            return tf.constant(0, tf.int64)
        # Under ParameterServerStrategy: as the journal holds them while a
        # micro-step is under way or was cut off (all agree), else as written.
        return variable if self._journal is None else self._journal.snapshot(variable)

    micro_steps = property(lambda self: self._counter("_micro_steps"), doc=(
        "Micro-batches accepted so far (all windows; 0 before the first)."))
    window_micro_step = property(lambda self: self._counter("_window_micro_step"), doc=(
        "Micro-batches in the open window (0 before the first)."))
    dropped_gradients = property(lambda self: self._counter("_dropped"), doc=(
        "Gradients dropped as stale (``local_step`` < ``version``), and under "
        "XLA with ``nonfinite='raise'`` those holding a NaN or Inf."))

    @property
    def version(self):
        """Real updates whose writes are all done: what a worker passes as
        ``local_step`` (read before it reads the weights). ``iterations``
        except under ParameterServerStrategy, where another worker's update
        may have counted ``iterations`` before its weights are written."""
        return self.iterations if self._version is None else self._version
    skipped_windows = property(lambda self: self._counter("_skipped"), doc=(
        "Windows discarded because a micro-batch had a NaN or Inf."))
    lost_micro_steps = property(lambda self: self._counter("_lost"), doc=(
        "Under ParameterServerStrategy: accepted micro-batches never applied, "
        "because a worker died inside a later micro-step of their window (the "
        "window is dropped whole; docs/distributed.md). 0 elsewhere."))
    interrupted_updates = property(lambda self: self._counter("_interrupted"), doc=(
        "Under ParameterServerStrategy: window updates a dying worker cut off "
        "while the inner optimizer wrote them (written in part, or whole, or "
        "not at all; restore a checkpoint). 0 elsewhere."))

    @property
    def _window_micro_step(self):
        return self._state.micro_step

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": self._inner_config(),
            "steps": self.steps,
            "reduction": self.reduction,
            "epoch_end": self.epoch_end,
            "nonfinite": self.nonfinite,
            "sample_count": (None if self.sample_count is None
                             else self._saved_function(self.sample_count)),
            # Configs saved before it existed load with the default (None).
            "accumulator_dtype": self.accumulator_dtype,
            # The model cannot be saved with the optimizer: Keras's loader
            # binds it again (`bind_after_load`); made by hand from this
            # config it refuses to train under fit until `attach(model)`.
            "bound_to_model": self._binding is not None or self._awaiting_model,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        bound = config.pop("bound_to_model", False)
        saved = config.pop("sample_count", None)
        if saved is not None:
            if "fn" not in saved:
                raise ValueError(
                    f"{cls.__name__}.from_config: `sample_count` was a lambda or "
                    "closure, which cannot be saved. Define it at a module's top "
                    "level (saved by name), or load with compile=False and compile "
                    "a new GradientAccumulator.")
            config["sample_count"] = cls._load_function(saved["fn"], custom_objects)
        inner = cls._inner_from_config(config, custom_objects)
        optimizer = cls(inner, **config)
        optimizer._awaiting_model = bool(bound)
        _model_hooks.bind_after_load(optimizer, bound)
        return optimizer


def _missing_batch_sizes(awaiting_model):
    """The error for an example-weighted micro-batch of unknown size."""
    if awaiting_model:
        return ValueError(
            "GradientAccumulator: this optimizer was saved bound to its model "
            "(model=...), which a saved file cannot hold: call "
            "`tf_gradkit.attach(model)` (or `optimizer.attach(model)`) after "
            "loading, before training. In a custom loop pass "
            "apply_gradients(..., sample_count=n) instead.")
    return ValueError(
        "GradientAccumulator(reduction='example') weighs each micro-batch by the "
        "examples it holds, and was given no batch size: pass model= (or call "
        "attach(model)) to train with model.fit, or apply_gradients(..., "
        "sample_count=n) in a custom loop. To weigh every micro-batch equally "
        "(what Keras's own gradient_accumulation_steps does), pass "
        "reduction='microbatch'.")


def _refuse_overwrite_with_gradient(var_list, steps):
    """Keras 3 overwrites a variable marked ``overwrite_with_gradient``
    (float8 scales and amax histories) with its gradient, and under its own
    accumulation with the element-wise max over the window; a window's
    weighted mean would be wrong, so such variables are refused (steps > 1)."""
    marked = [getattr(v, "path", None) or v.name for v in var_list
              if getattr(v, "overwrite_with_gradient", False)]
    if marked and steps > 1:
        raise ValueError(
            f"GradientAccumulator(steps={steps}) cannot accumulate {marked}: they are "
            "marked overwrite_with_gradient (float8 training state), which Keras "
            "overwrites with the element-wise max of the window's gradients, not "
            "their mean. Use the inner optimizer's own "
            f"gradient_accumulation_steps={steps} instead of GradientAccumulator.")


def _check_numerics(grads):
    """``(grads, checks)``: the gradients through ``check_numerics`` and the
    checked tensors, for the micro-step's writes to wait on (in a graph,
    writes that do not read a checked gradient would otherwise run first)."""
    message = "GradientAccumulator(nonfinite='raise'): non-finite gradient"
    out, checks = [], []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            g = tf.IndexedSlices(tf.debugging.check_numerics(g.values, message),
                                 g.indices, g.dense_shape)
            checks.append(g.values)
        elif g is not None:
            g = tf.debugging.check_numerics(g, message)
            checks.append(g)
        out.append(g)
    return out, checks
