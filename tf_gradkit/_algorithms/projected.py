"""Projected: the algorithm, written once for both Keras flavours (the sets
and their projections are `tf_gradkit.core.sets`)."""

import re

import tensorflow as tf

from tf_gradkit import _model_hooks
from tf_gradkit._algorithms.wrapper import Wrapper, no_gradients_error
from tf_gradkit._optimizer_tree import optimizer_chain
from tf_gradkit.core import sets

SPARSE_ROWS = ("auto", True, False)


def normalise_constraints(constraints):
    """``constraints`` as a list of ``(key, constraint)``; keys are compiled
    patterns or variables. Raises a clear error for anything else."""
    if isinstance(constraints, dict):
        items = list(constraints.items())
    elif isinstance(constraints, (list, tuple)):
        items = list(constraints)
    else:
        raise TypeError(
            "Projected: `constraints` must be a dict or a list of (key, "
            "constraint) pairs, a key being a variable or a regular-expression "
            "pattern searched in the variable's path. Received: "
            f"constraints={type(constraints).__name__}")
    if not items:
        raise ValueError("Projected: `constraints` is empty; give at least one "
                         "(variable or pattern, constraint) entry.")
    out = []
    for item in items:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise TypeError("Projected: each entry of `constraints` must be a (key, "
                            f"constraint) pair. Received: {item!r}")
        key, constraint = item
        if not callable(constraint):
            raise TypeError(
                f"Projected: the constraint for {key!r} must be callable (a "
                "tf_gradkit/Keras constraint object or a function tensor -> "
                f"tensor). Received: {constraint!r}")
        if isinstance(key, str):
            try:
                key = re.compile(key)
            except re.error as e:
                raise ValueError(f"Projected: pattern {key!r} is not a valid "
                                 f"regular expression ({e}).") from None
        elif hasattr(key, "deref"):  # a variable's .ref()
            key = key.deref()
        elif not (hasattr(key, "shape") and hasattr(key, "assign")):
            raise TypeError("Projected: keys of `constraints` must be variables or "
                            f"pattern strings. Received: {type(key).__name__} {key!r}")
        out.append((key, constraint))
    return out


def _project_within(constraint, value, mask):
    """The projection onto the set intersected with ``{z = 0 off the mask}``:
    a set knows its own (`ConstraintSet.project_within`); any other
    callable gets the generic one (exact for separable sets containing 0)."""
    keep = tf.broadcast_to(tf.not_equal(mask, tf.zeros_like(mask)), tf.shape(value))
    if isinstance(constraint, sets.ConstraintSet):
        return constraint.project_within(value, keep)
    zeros = tf.zeros_like(value)
    return tf.where(keep, constraint(tf.where(keep, value, zeros)), zeros)


class Projected(Wrapper):
    """Wraps an optimizer so constrained variables are feasible after every step.

    The inner optimizer updates as usual; then, in the same step (eager,
    ``tf.function`` or ``jit_compile=True``), every variable named in
    ``constraints`` is replaced by its exact Euclidean projection, written once.

    Why not Keras's ``constraint=``: that needs access to the layer at build
    time (pretrained models and layers wrapped by other libraries do not give
    it); with ``use_ema=True`` Keras averages the unprojected weights, so the
    averaged weights ``fit`` leaves behind are infeasible; and Keras 3
    projects a whole embedding table when a sparse gradient touched a few
    rows. Here:

    - ``use_ema=True`` on the inner optimizer: its moving average becomes the
      average of the projected iterates and is kept feasible (for variables
      with a Keras ``constraint=`` too), so ``finalize_variable_values``
      writes feasible weights;
    - sparse (``IndexedSlices``) gradients with a set whose rows project
      independently (``NonNeg``, scalar ``Box``, ``MaxNorm``/``UnitNorm``/
      ``Simplex`` over a non-first axis, ``FixedMask``) project only the
      touched rows when the inner update is row-local (``sparse_rows="auto"``:
      plain SGD; Adam and momentum move every row, so every row is projected);
    - variables with a Keras ``constraint=`` keep it (the inner optimizer
      applies it); variables matched here are projected after that;
    - inside ``pruning.MaskAware`` (or around one) the projection keeps pruned
      weights at zero (each set's ``project_within``);
    - for gradient accumulation wrap this one:
      ``GradientAccumulator(Projected(opt, ...), steps)`` projects after real
      updates only (``Projected(GradientAccumulator(...))`` is refused); with
      Keras 3's own ``gradient_accumulation_steps`` on the inner optimizer it
      projects after the update steps only.

    Args:
      optimizer: the optimizer doing the update (same Keras flavour).
      constraints: a dict, or a list of ``(key, constraint)`` pairs. A key is a
        variable or a regular-expression pattern searched in the variable's
        path (Keras 3 ``variable.path``, tf_keras ``variable.name``;
        ``"dense/kernel"`` matches ``sequential/dense/kernel``). A constraint
        is a ``tf_gradkit.constraints`` object, a Keras constraint or any
        callable ``tensor -> tensor`` that returns the projection. A pattern
        matching nothing, or a variable matched twice, is an error.
      model: optional; when given, ``constraints`` is checked against
        ``model.trainable_variables`` at construction, and the first ``fit``
        refuses this optimizer under a ``MultiOptimizer`` key that matches
        none of its variables or when another group holds a constrained one.
      sparse_rows: ``"auto"``, ``True`` (the inner update is known to touch
        only rows with a gradient) or ``False`` (always project whole
        variables).
      name: optional name.

    Example:

    >>> model.compile(optimizer=tf_gradkit.optimizers.Projected(
    ...     keras.optimizers.Adam(1e-3),
    ...     {"dense/kernel": tf_gradkit.constraints.NonNeg()}), loss="mse")
    """

    WRAPS_KERAS_ACCUMULATION = True  # projects on update steps only
    accepts_masks = True
    ACCEPTED = "optimizer, constraints, model, sparse_rows, name"
    REFUSALS = {
        "same": "Give one Projected every constraint (a dict of variables or "
                "patterns).",
        "residuals": "A projected LM step is not the LM step of the constrained "
                     "problem. Use a gradient optimizer (Adam, SGD) inside "
                     "Projected, or reparametrise the variable (e.g. softplus "
                     "for positivity) and keep LevenbergMarquardt.",
        "accumulator": "Projecting after every micro-batch would cost a projection "
                       "per micro-step for nothing. Wrap the other way round: "
                       "GradientAccumulator(Projected(optimizer, constraints), "
                       "steps) projects after real updates only.",
        "loss_scale": "Put the LossScaleOptimizer outside: compile a plain "
                      "Projected(optimizer, constraints) (under a mixed_float16 "
                      "policy Keras wraps it), or write "
                      "LossScaleOptimizer(Projected(optimizer, constraints)).",
    }

    def __init__(self, optimizer, constraints, model=None, sparse_rows="auto",
                 name=None, **kwargs):
        if not (isinstance(sparse_rows, bool) or sparse_rows == "auto"):
            raise ValueError("Projected: `sparse_rows` must be one of "
                             f"{SPARSE_ROWS}. Received: sparse_rows={sparse_rows!r}")
        entries = normalise_constraints(constraints)
        self._init_wrapper(optimizer, name, kwargs)
        self._entries = entries
        self.sparse_rows = sparse_rows
        self._by_key = None
        # Masks of a pruning.MaskAware inside (or handed down from outside).
        self.masks = next((getattr(o, "masks", None) for o in optimizer_chain(optimizer)
                           if getattr(type(o), "provides_masks", False)), None)
        self._model_paths = None
        if model is not None:
            self._check_model(model)
            # A pattern matching nothing is an error now, before any state.
            self._model_paths = {k: self._path(v) for v in model.trainable_variables
                                 for k in [self._variable_key(v)]
                                 if k in self._resolve(model.trainable_variables)}
            # Bound, so the first fit checks where this optimizer sits: under
            # a MultiOptimizer key that matches none of its variables Keras
            # would never build or call it (`_optimizer_tree.check_groups`).
            _model_hooks.ModelBinding.bind(model, self, self._CALLBACK)

    def _build_own(self, var_list):
        by_key = self._resolve(var_list)
        # Given the model, a constrained variable this optimizer is not given
        # (a MultiOptimizer hands it to another) would never be projected.
        outside = sorted(path for k, path in (self._model_paths or {}).items()
                         if k not in by_key)
        if outside:
            raise ValueError(
                f"Projected: the constraints name {outside}, which this optimizer is "
                "not given (a MultiOptimizer gives them to another optimizer), so they "
                "would never be projected. Give this Projected every variable its "
                "constraints name, or narrow the patterns to its own variables.")

    # ----------------------------------------------------------------- map
    def _resolve(self, variables):
        """``{var_key: constraint}`` for ``variables``; raises on a pattern or
        variable that matches nothing, or a variable matched twice."""
        variables = list(variables)
        by_key, seen_by = {}, {}
        for key, constraint in self._entries:
            hits = [v for v in variables if self._matches(key, v)]
            if not hits:
                what = (f"pattern {key.pattern!r}" if isinstance(key, re.Pattern)
                        else f"variable {getattr(key, 'name', key)!r}")
                paths = ", ".join(self._path(v) for v in variables[:12])
                raise ValueError(
                    f"Projected: {what} matches none of the {len(variables)} "
                    f"trainable variables (paths: {paths}"
                    f"{', ...' if len(variables) > 12 else ''}).")
            for v in hits:
                k = self._variable_key(v)
                if k in by_key:
                    raise ValueError(
                        f"Projected: variable {self._path(v)!r} is matched by both "
                        f"{seen_by[k]!r} and {self._describe_key(key)!r}; give one "
                        "constraint per variable (compose them in one callable if "
                        "you mean both).")
                by_key[k] = constraint
                seen_by[k] = self._describe_key(key)
        self._by_key = by_key
        return by_key

    def _describe_key(self, key):
        return key.pattern if isinstance(key, re.Pattern) else self._path(key)

    def _matches(self, key, variable):
        if isinstance(key, re.Pattern):
            return key.search(self._path(variable)) is not None
        return self._variable_key(key) == self._variable_key(variable)

    def constraint_for(self, variable):
        """The constraint this wrapper projects ``variable`` onto, or None."""
        return None if self._by_key is None else self._by_key.get(self._variable_key(variable))

    def _mask_of(self, variable):
        return None if self.masks is None else self.masks.mask_for(variable)

    # ----------------------------------------------------------- the step
    def _apply_grads(self, grads, variables, aggregated=False):
        if all(g is None for g in grads):
            raise no_gradients_error(variables)
        self._inner_apply(grads, variables, aggregated)
        self._project_after_update(grads, variables)

    def _row_local_inner(self):
        """Whether the inner update leaves rows without gradient untouched:
        plain SGD (no momentum, no weight decay, no EMA) does; Adam, momentum
        and weight decay move every row."""
        if self.sparse_rows != "auto":
            return bool(self.sparse_rows)
        opt = self.inner_optimizer
        if type(opt) is not self._SGD:
            return False
        return (not getattr(opt, "momentum", 0.0) and not getattr(opt, "weight_decay", None)
                and not getattr(opt, "use_ema", False))

    def _ema_owner(self):
        for opt in optimizer_chain(self.inner_optimizer):
            if getattr(opt, "use_ema", False):
                return opt
        return None

    def _project_after_update(self, grads, variables):
        """Projects what the inner update just wrote; one write per variable."""
        owner = self._ema_owner()
        momentum = self._ema_momentum(owner) if owner is not None else None
        multi_replica = (tf.distribute.has_strategy() and
                         tf.distribute.get_strategy().num_replicas_in_sync > 1)
        row_local = self._row_local_inner() and not multi_replica
        jobs = []
        for g, v in zip(grads, variables):
            if g is None:
                continue
            constraint = self.constraint_for(v)
            average = self._ema_average(owner, v) if owner is not None else None
            if constraint is None:
                keras_constraint = getattr(v, "constraint", None)
                if keras_constraint is not None and average is not None:
                    # Keras projected the weight after averaging the raw one.
                    jobs.append((v, keras_constraint, None, average, "average"))
                continue
            rows = None
            if (isinstance(g, tf.IndexedSlices) and row_local and average is None
                    and self._mask_of(v) is None
                    and isinstance(constraint, sets.ConstraintSet)
                    and constraint.rows_independent(len(v.shape))):
                rows = g.indices
            jobs.append((v, constraint, rows, average, "weight"))
        if not jobs:
            return
        updated = self._update_happened(self.inner_optimizer)
        if updated is not None:  # Keras 3 `gradient_accumulation_steps`
            _when(updated, lambda: self._dispatch(jobs, momentum))
        else:
            self._dispatch(jobs, momentum)

    def _dispatch(self, jobs, momentum):
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            tf.distribute.get_replica_context().merge_call(
                lambda strategy: self._run_jobs(strategy, jobs, momentum))
        else:
            self._run_jobs(tf.distribute.get_strategy(), jobs, momentum)

    def _projection(self, constraint, variable):
        mask = self._mask_of(variable)
        if mask is None:
            return constraint
        return lambda x: _project_within(constraint, x, tf.convert_to_tensor(mask))

    def _run_jobs(self, strategy, jobs, momentum):
        for v, constraint, rows, average, what in jobs:
            project = self._projection(constraint, v)
            target = self._tf_variable(v)
            if what == "average":
                strategy.extended.update(
                    self._tf_variable(average),
                    lambda a, p=project: a.assign(tf.cast(p(a), a.dtype)), group=False)
            elif rows is not None:
                strategy.extended.update(
                    target, lambda t, c=constraint, i=rows: _project_rows(t, c, i),
                    group=False)
            elif average is None:
                strategy.extended.update(
                    target, lambda t, p=project: t.assign(tf.cast(p(t), t.dtype)),
                    group=False)
            else:
                strategy.extended.update(
                    target, lambda t, a, p=project: _project_with_average(t, a, p, momentum),
                    args=(self._tf_variable(average),), group=False)

    def _finalize(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)
        if self._ema_owner() is None:
            return
        # The inner optimizer just wrote its averages into the weights.
        for v in var_list:
            constraint = self.constraint_for(v)
            if constraint is not None:
                v.assign(tf.cast(self._projection(constraint, v)(
                    tf.convert_to_tensor(v)), v.dtype))

    # ----------------------------------------------------------- saving
    def _pattern_for(self, variable):
        """A variable key saved as a pattern of its path below the model's
        name (a reloaded or rebuilt model may be named ``sequential_1``)."""
        return "(^|/)" + re.escape(self._path_below_model(variable)) + "$"

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": self._inner_config(),
            "constraints": {
                (key.pattern if isinstance(key, re.Pattern) else self._pattern_for(key)):
                self._serialize(constraint) for key, constraint in self._entries},
            "sparse_rows": self.sparse_rows,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = cls._inner_from_config(config, custom_objects)
        constraints = {k: cls._load_constraint(v, custom_objects)
                       for k, v in config.pop("constraints").items()}
        return cls(inner, constraints, **config)

    @classmethod
    def _load_constraint(cls, config, custom_objects):
        # Ours by their registered name: HDF5 loading deserialises by class
        # name, and Keras's own MaxNorm/UnitNorm/NonNeg would win.
        registered = isinstance(config, dict) and config.get("registered_name")
        if registered and registered.startswith("tf_gradkit>"):
            ours = cls._registered(registered)
            if ours:
                return ours.from_config(config["config"])
        return cls._deserialize_constraint(config, custom_objects=custom_objects)


def _when(pred, fn):
    """Runs ``fn`` if ``pred``: a Python branch eagerly, a ``tf.cond`` in a
    graph (XLA compiles it to a conditional, not a select)."""
    if tf.executing_eagerly():
        if bool(pred):
            fn()
        return

    def run():
        fn()
        return tf.constant(True)

    tf.cond(pred, run, lambda: tf.constant(False))


def _project_rows(target, constraint, indices):
    # Repeated indices are fine without a (slow under XLA) tf.unique: each
    # copy of a row projects to the same value, so the scatter writes agree.
    idx = tf.cast(indices, tf.int64)
    rows = tf.gather(target, idx)
    new_rows = tf.cast(constraint.project_rows(rows, idx), target.dtype)
    return target.scatter_update(tf.IndexedSlices(new_rows, idx))


def _project_with_average(target, average, project, momentum):
    """Projects the weight and turns the inner optimizer's average of the raw
    weight into the average of the projected one, then keeps it feasible
    (a no-op for convex sets; needed for spheres and masks)."""
    raw = tf.convert_to_tensor(target)
    new = tf.cast(project(raw), target.dtype)
    weight = tf.cast(1.0, average.dtype) - tf.cast(momentum, average.dtype)
    corrected = average + weight * tf.cast(new - raw, average.dtype)
    with tf.control_dependencies([target.assign(new)]):
        return average.assign(tf.cast(project(corrected), average.dtype))
