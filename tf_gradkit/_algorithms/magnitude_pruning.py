"""MagnitudePruning: magnitude pruning with its masks as optimizer state,
written once for both Keras flavours (the masks' rules are
`tf_gradkit.core.magnitude`, the schedules `tf_gradkit.core.pruning_schedule`,
the masked update `tf_gradkit._algorithms.masked_update`)."""

import re
import threading

import tensorflow as tf

from tf_gradkit import _layer_taps
from tf_gradkit import _model_hooks
from tf_gradkit import _optimizer_tree
from tf_gradkit._algorithms.masked_update import MaskedUpdate, _multiply_in_place
from tf_gradkit.core import magnitude
from tf_gradkit.core import pruning_schedule
from tf_gradkit.core.masks import Masks

# The weights tfmot prunes: Dense/Conv/LocallyConnected kernels, Embedding
# tables, SeparableConv's pointwise kernel, RNN cells' kernels (never biases,
# never depthwise kernels), found by name; the weights of the host's
# "depthwise" layer kinds (Keras 3 names their kernel `kernel`) are left alone
# when the model is known.
KERNEL_NAMES = ("kernel", "embeddings", "pointwise_kernel", "recurrent_kernel")
_OWNER = "MagnitudePruning"
# Masks hold 0 and 1, exact in float16: half the bytes a step reads to mask
# gradients (bool would be smaller but lives in host memory on GPUs).
MASK_DTYPE = tf.float16


def _weight_name(variable, path):
    return path(variable).split("/")[-1].split(":")[0]


def validate_arguments(targets, schedule, block_size, block_pooling, m_by_n):
    """Raises a clear error for a bad constructor argument; changes nothing."""
    if not (targets == "kernels" or isinstance(targets, str) or
            (isinstance(targets, (list, tuple)) and targets)):
        raise ValueError(
            f"{_OWNER}: `targets` must be \"kernels\" (every Dense/Conv/Embedding/RNN "
            "kernel), a path pattern (regex), or a non-empty list of layers, "
            f"variables and patterns. Received: targets={targets!r}")
    if schedule is not None and not isinstance(schedule, pruning_schedule.PruningSchedule):
        raise ValueError(
            f"{_OWNER}: `schedule` must be a tf_gradkit.pruning schedule "
            "(PolynomialDecay, ConstantSparsity or a PruningSchedule subclass). Received: "
            f"schedule={type(schedule).__name__}")
    if not (isinstance(block_size, (list, tuple)) and len(block_size) == 2 and
            all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                for b in block_size)):
        raise ValueError(f"{_OWNER}: `block_size` must be two integers >= 1. "
                         f"Received: block_size={block_size!r}")
    if str(block_pooling).lower() not in magnitude.BLOCK_POOLINGS:
        raise ValueError(f"{_OWNER}: `block_pooling` must be one of "
                         f"{magnitude.BLOCK_POOLINGS}. Received: "
                         f"block_pooling={block_pooling!r}")
    if m_by_n is not None:
        ok = (isinstance(m_by_n, (list, tuple)) and len(m_by_n) == 2 and
              all(isinstance(v, int) and not isinstance(v, bool) for v in m_by_n)
              and 0 < m_by_n[0] < m_by_n[1])
        if not ok:
            raise ValueError(f"{_OWNER}: `m_by_n` must be (m, n) with integers "
                             f"0 < m < n, e.g. (2, 4). Received: m_by_n={m_by_n!r}")
        if tuple(block_size) != (1, 1):
            raise ValueError(f"{_OWNER}: `m_by_n` and `block_size` are two ways to "
                             f"place zeros; pass one. Received: m_by_n={m_by_n!r}, "
                             f"block_size={block_size!r}")


class MagnitudePruning(MaskedUpdate):
    """Prunes the smallest weights on a schedule; pruned entries stay zero.

    Masks are optimizer state: no wrapper layers, no ``strip_pruning`` step
    (the saved model is the pruned model, its pruned weights exactly zero).
    Step k is the k-th real update of the wrapped optimizer. If the schedule
    prunes at step k, each target's mask is recomputed before update k from
    the weights after update k - 1 (the smallest magnitudes, tfmot's rules:
    `tf_gradkit.core.magnitude`): under ``fit`` with ``model=`` (or
    ``attach``) at the start of the train step, before its forward pass
    (tfmot's moment), else in ``apply_gradients`` before the update (the
    forward pass of step k then used step k - 1's masks). The weights and
    their optimizer slots (Adam's moments, momentum, EMA averages) are
    multiplied by the masks and gradients are masked before the update, so
    after every step they are exactly zero where pruned and the masks are
    tfmot's masks of that step. Steps count real updates: inside a
    `GradientAccumulator` (recommended:
    ``GradientAccumulator(MagnitudePruning(Adam(), ...))``) windows, not
    micro-batches; around one, the same.

    Schedules mean what tfmot's mean (same step, same sparsity, same
    rounding of the number of zeros): tfmot's step k is the k-th training
    batch, ours the k-th real update.

    Args:
      optimizer: the optimizer to wrap, of the same Keras flavour.
      model: optional; resolves ``targets`` now (errors at construction),
        tells depthwise layers by their kind and, under ``fit``, makes each
        pruning step's masks before its forward pass.
      targets: ``"kernels"`` (default: every Dense, Conv, Embedding,
        SeparableConv pointwise and RNN kernel; never biases, never the
        kernels of depthwise convolutions, told by their layer's kind: the
        model must be known through ``model=`` or ``attach`` where the
        flavour names a DepthwiseConv kernel ``kernel`` (Keras 3; without it
        convolution kernels are refused at build)), a path
        pattern (regex searched in each variable's path), or a list of
        layers (their kernels), variables and patterns.
      schedule: ``tf_gradkit.pruning.PolynomialDecay``, ``ConstantSparsity``
        (tfmot's, and its default: ``ConstantSparsity(0.5, 0)``) or a
        ``PruningSchedule`` subclass. With ``m_by_n`` the sparsity is
        ``1 - (n - m) / n`` whatever the schedule says, and the masks are
        made at the schedule's pruning steps (the default: once, at step 1,
        tfmot's behaviour; tfmot ignores a schedule there and always prunes
        at step 1). Recomputing an M:N mask from the pruned weights gives
        the same mask (unless a kept weight is exactly zero), so a schedule
        mostly chooses the step the M:N masks are first made.
      block_size: ``(rows, cols)`` blocks pruned together (2-D weights).
      block_pooling: ``"avg"`` or ``"max"``: a block's magnitude.
      m_by_n: ``(m, n)``: ``m`` zeros in every ``n`` weights along the input
        axis (``(2, 4)`` for sparse tensor cores), Dense and Conv2D kernels.
      name: optional name.

    Example:

    >>> schedule = tf_gradkit.pruning.PolynomialDecay(0.0, 0.8, begin_step=0,
    ...                                              end_step=1000, frequency=100)
    >>> opt = tf_gradkit.pruning.MagnitudePruning(keras.optimizers.Adam(1e-3),
    ...                                           model=model, schedule=schedule)
    >>> model.compile(optimizer=opt, loss="mse")
    >>> model.fit(x, y, epochs=10)   # no callback; model.save() saves it pruned
    """

    ACCEPTED = ("optimizer, model, targets, schedule, block_size, block_pooling, "
                "m_by_n, name")
    REFUSALS = {"same": "One MagnitudePruning prunes every chosen weight.",
                "masks": "Prune with one of them.",
                "loss_scale": "Put the LossScaleOptimizer outside: compile a plain "
                              "MagnitudePruning (under a mixed_float16 policy Keras wraps "
                              "it), or write LossScaleOptimizer(MagnitudePruning(...))."}

    def __init__(self, optimizer, model=None, targets="kernels", schedule=None,
                 block_size=(1, 1), block_pooling="avg", m_by_n=None, name=None,
                 **kwargs):
        validate_arguments(targets, schedule, block_size, block_pooling, m_by_n)
        self._init_wrapper(optimizer, name, kwargs)
        if schedule is None:
            schedule = (pruning_schedule.ConstantSparsity(0.0, 1, 1, 1) if m_by_n
                        else pruning_schedule.ConstantSparsity(0.5, 0))
        self.schedule = schedule
        self.block_size = tuple(block_size)
        self.block_pooling = str(block_pooling).lower()
        self.m_by_n = None if m_by_n is None else tuple(m_by_n)
        self.targets = self._patterns(targets)
        self._left_alone = set()  # paths of depthwise kernels, once the model is known
        self._model_known = False
        self._hooked = threading.local()  # per replica thread, while a step is traced
        self.masks = Masks(self._variable_key)  # filled when built
        for inner in _optimizer_tree.optimizer_chain(optimizer):
            if getattr(type(inner), "accepts_masks", False):
                inner.masks = self.masks
        self._bound = False
        if model is not None:
            self._check_model(model)
            self._leave_alone(model)
            self._resolve(model.trainable_variables)  # errors now, before state
            self.attach(model)

    # --------------------------------------------------------------- targets
    def _patterns(self, targets):
        """``targets`` as path patterns (what the config saves)."""
        if targets == "kernels":
            return "kernels"
        items = [targets] if isinstance(targets, str) else list(targets)
        patterns = []
        for item in items:
            if isinstance(item, str):
                re.compile(item)
                patterns.append(item)
                continue
            weights = getattr(item, "trainable_weights", None)
            if weights is not None:  # a layer: its kernels
                kernels = [w for w in weights
                           if _weight_name(w, self._path) in KERNEL_NAMES]
                if not kernels:
                    raise ValueError(
                        f"{_OWNER}: layer {getattr(item, 'name', item)!r} has no weight "
                        f"named one of {KERNEL_NAMES} to prune (is it built?). Name its "
                        "variables or path patterns in `targets` instead.")
                variables = kernels
            elif hasattr(item, "shape") and hasattr(item, "assign"):
                variables = [item]
            else:
                raise ValueError(f"{_OWNER}: `targets` entries must be layers, "
                                 f"variables or path patterns. Received: {item!r}")
            patterns += [f"(^|/){re.escape(self._target_path(v))}(:0)?$"
                         for v in variables]
        return patterns

    def _target_path(self, variable):
        """The path a variable target is kept (and saved) as: the path below
        the model's name (a rebuilt model may be named ``sequential_1``)
        where that still names the layer, else the whole path. Keras 3
        names a functional model's variables ``layer/kernel``, without the
        model: cut there, ``kernel`` alone would match every layer's kernel."""
        below = self._path_below_model(variable)
        return below if "/" in below else self._path(variable)

    def _resolve(self, variables):
        """The variables of ``variables`` that are pruned; raises on a
        pattern that matches none."""
        variables = list(variables)
        if self.targets == "kernels":
            chosen = [v for v in variables if _weight_name(v, self._path) in KERNEL_NAMES
                      and len(v.shape) >= 2 and self._path(v) not in self._left_alone]
            if not chosen:
                raise ValueError(
                    f"{_OWNER}: none of the {len(variables)} trainable variables is a "
                    f"kernel ({KERNEL_NAMES}); paths: "
                    f"{[self._path(v) for v in variables[:12]]}. Name targets=.")
            convolutions = [self._path(v) for v in chosen if len(v.shape) >= 3]
            if self.DEPTHWISE_NAMED_KERNEL and not self._model_known and convolutions:
                raise ValueError(
                    f"{_OWNER}: without the model, a convolution's kernel cannot be told "
                    "from a depthwise convolution's (which is never pruned, as in tfmot): "
                    "this Keras names both `kernel`. Pass model= (or call attach(model) "
                    "before training), or name targets=. Received kernels: "
                    f"{convolutions[:6]}")
            return chosen
        chosen = []
        for pattern in self.targets:
            hits = [v for v in variables if re.search(pattern, self._path(v))]
            if not hits:
                raise ValueError(
                    f"{_OWNER}: target {pattern!r} matches none of the {len(variables)} "
                    f"trainable variables (paths: {[self._path(v) for v in variables[:12]]})")
            chosen += [v for v in hits if all(v is not c for c in chosen)]
        return chosen

    def _leave_alone(self, model):
        """Remembers the weights of ``model``'s depthwise layers (the host's
        layer kinds), which ``"kernels"`` leaves alone as tfmot does."""
        depthwise = _layer_taps.layer_kinds(model, _OWNER)["depthwise"]
        self._left_alone |= {self._path(w) for layer in _layer_taps.flat_layers(model)
                             if isinstance(layer, depthwise) for w in layer.weights}
        self._model_known = True

    # -------------------------------------------------------------- binding
    def attach(self, model):
        """Binds this optimizer to ``model`` (what ``model=`` does): under
        ``fit`` the masks of each pruning step are made before its forward
        pass, and an inner LevenbergMarquardt's steps are followed by the
        masks'."""
        self._check_model(model)
        self._leave_alone(model)
        _model_hooks.ModelBinding.bind(model, self, self._CALLBACK)
        self._bound = True
        return self

    def _on_fit_start(self, model):
        """Before ``fit``: builds (making step 1's masks, when the schedule
        prunes at step 1, before the first forward pass)."""
        if model.built and self.masks.empty and model.trainable_variables:
            with self._strategy().scope():
                self.build(model.trainable_variables)

    def _wrap_train_step(self, step, model):
        del model

        def pruned_step(data):
            # The masks of the coming step before its forward pass (tfmot's
            # moment); this step's apply_gradients then leaves them.
            ready = bool(self._targets)
            if ready:
                self._prepare_masks()
            self._hooked.ready = ready
            try:
                logs = step(data)
            finally:
                self._hooked.ready = False
            if self.needs_residuals:  # LM replaces the step: mask after it
                self.mask_state(True)
            return logs

        return pruned_step

    # ----------------------------------------------------------------- state
    def _build_own(self, var_list):
        loaded_for = self._model_loaded_for()
        if loaded_for is not None and not self._model_known:
            self._leave_alone(loaded_for)
        pairs = [(v, self._new_variable(v.shape, MASK_DTYPE, "mask", initial=1.0,
                                        sync="none", reference=v))
                 for v in self._resolve(var_list)]
        self.masks.attach(pairs=pairs)
        self._build_targets(var_list)
        # Built eagerly before the first update (Keras 3's fit, `model=`
        # under fit, a custom loop's `build`): step 1's masks now, from the
        # initial weights, so the first forward pass sees them. Not for an
        # optimizer Keras is loading: its state comes next.
        if tf.executing_eagerly() and self._model_loaded_for() is None and \
                int(self.iterations.numpy()) == 0 and bool(self._due(1).numpy()):
            self._recompute(True, tf.constant(1, tf.int64))
            self.mask_state()

    def _table(self):
        return self.masks.table()

    def _due(self, step):
        return self.schedule.should_prune(step)

    def _new_mask(self, variable, step):
        weights = self._tf_variable(variable).read_value()
        if self.m_by_n is not None:
            return magnitude.m_by_n_mask(weights, *self.m_by_n)
        sparsity = tf.cast(self.schedule.sparsity(tf.cast(step, tf.int64)), tf.float32)
        return magnitude.magnitude_mask(weights, sparsity,
                                        self.block_size, self.block_pooling)

    # Weights and slots are masked when the masks change; between changes the
    # masked gradients keep them zero, if every optimizer below preserves
    # zeros (`masked_update._only_at_changes`); else after every update.
    MASK_SLOTS_EVERY_UPDATE = False

    def _recompute(self, due, step, distribution=None):
        """Recomputes every mask at ``step`` where ``due``, and masks the
        slots with them: inside an integer conditional, so that the sort and
        the writes run only then (XLA keeps a ``switch_case`` a conditional)."""
        distribution = distribution or tf.distribute.get_strategy()

        def change():
            for variable, mask, _ in self._targets:
                distribution.extended.update(
                    mask, lambda m, v: m.assign(v, read_value=False),
                    args=(tf.cast(self._new_mask(variable, step), MASK_DTYPE),), group=False)
            for variable, mask, _ in self._targets:
                distribution.extended.update(variable, _multiply_in_place, args=(mask,),
                                             group=False)
            self._mask_slots(distribution)
            return tf.constant(True)

        tf.switch_case(tf.cast(due, tf.int32), [lambda: tf.constant(False), change])

    def _apply_grads(self, grads, variables, aggregated=False):
        if not getattr(self._hooked, "ready", False):
            # Step k's masks before update k (a custom loop, or fit without
            # model=: the forward pass used step k - 1's masks).
            self._prepare_masks()
        super()._apply_grads(grads, variables, aggregated)

    def _prepare_masks(self):
        """Recomputes the masks, if the schedule prunes at the coming step
        (``iterations + 1``), from the current weights; masks weights and slots."""
        step = tf.cast(self.iterations, tf.int64) + 1
        due = self._due(step)

        def recompute(distribution):
            self._recompute(due, step, distribution)

        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            tf.distribute.get_replica_context().merge_call(recompute)
        else:
            recompute(tf.distribute.get_strategy())

    # ------------------------------------------------------------- reporting
    def sparsity(self):
        """``{variable path: fraction of its mask that is zero}``."""
        return {self._path(v): float(1.0 - tf.reduce_mean(tf.cast(m, tf.float32)))
                for v, m in self._table().values()}

    def minimize(self, loss, var_list, tape=None):
        if self.needs_residuals:  # step k's masks before LM's update k
            var_list = list(var_list() if callable(var_list) else var_list)
            with tf.init_scope():
                self.build(var_list)
            self._prepare_masks()
        return super().minimize(loss, var_list, tape=tape)

    def get_config(self):
        return {"name": self.name, "optimizer": self._inner_config(),
                "targets": self.targets,
                "schedule": pruning_schedule.serialize(self.schedule),
                "block_size": list(self.block_size), "block_pooling": self.block_pooling,
                "m_by_n": None if self.m_by_n is None else list(self.m_by_n),
                "bound_to_model": self._bound}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        bound = config.pop("bound_to_model", False)
        config["schedule"] = pruning_schedule.deserialize(config["schedule"], custom_objects)
        inner = cls._inner_from_config(config, custom_objects)
        optimizer = cls(inner, **config)
        optimizer._bound = bool(bound)
        _model_hooks.bind_after_load(optimizer, bound)
        return optimizer
