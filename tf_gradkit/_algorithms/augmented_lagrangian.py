"""AugmentedLagrangian: the algorithm, written once for both Keras flavours
(the rule and its multiplier schedule are `tf_gradkit.core.augmented_lagrangian`).

Where each constraint's terms enter the gradient:

- ``fn()`` constraints (closing over variables) are the optimizer's own
  business: ``apply`` evaluates them under its own tape and adds the gradient
  of their augmented terms to the gradients it was given. Nothing to do for
  the user, under ``fit`` or in a custom loop.
- ``fn(y_pred, batch)`` constraints need the forward pass, so they enter
  through the loss: ``optimizer.lagrangian_loss(loss, y_pred, batch)`` in a
  custom loop, or automatically under ``fit`` when ``model=`` was passed (the
  model binding of `tf_gradkit._model_hooks` wraps that model instance's
  ``compute_loss``, and adds ``lagrange_violation`` and ``penalty`` to the
  train step's logs).
"""

from collections.abc import Mapping

import tensorflow as tf

from tf_gradkit import _model_hooks
from tf_gradkit._algorithms.wrapper import (Wrapper, no_gradients_error,
                                            unexpected_arguments)
from tf_gradkit.core import augmented_lagrangian as rule

OWNER = "AugmentedLagrangian"


def _replicas():
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        return tf.distribute.get_strategy().num_replicas_in_sync
    return 1


# -------------------------------------------------------------- the wrapper
class AugmentedLagrangian(Wrapper):
    """Soft constraints with multipliers: the PHR augmented Lagrangian..

    Wraps any optimizer (``inner``). The minimised objective is

        loss + sum_ineq [lambda s + rho/2 s^2],  s = max(g, -lambda/rho)   (g <= 0)
             + sum_eq   [lambda h + rho/2 h^2]                            (h == 0)

    elementwise over each constraint's value. Every ``dual_every`` optimizer steps
    the multipliers take a dual-ascent step with the constraint values averaged
    over those steps (``lambda <- max(0, lambda + rho g)``, ``lambda <- lambda +
    rho h``), and the penalty ``rho`` is multiplied by ``growth`` (capped at
    ``max_penalty``) when the dual residual ``max(|s|, |h|)`` has not fallen below
    ``decrease`` times its value at the previous dual update (ALGENCAN's rule;
    Birgin & Martinez 2014). Multipliers and penalty are non-trainable optimizer
    variables: checkpointed with the optimizer, updated inside the compiled step
    (eager, ``tf.function``, ``jit_compile=True``), readable with ``metrics()``.

    Unlike ``kernel_constraint=`` (a projection Keras applies after each update,
    exact but only for sets with a cheap projection), this handles any
    differentiable constraint, on weights or on model outputs, and is exact only
    at convergence.

    Args:
      optimizer: the inner optimizer (same Keras flavour) taking the primal steps.
      constraints: a list of ``Inequality(fn)`` / ``Equality(fn)`` specs (or
        ``(fn, kind)`` pairs). ``fn()`` closes over variables and is handled by the
        optimizer itself; ``fn(y_pred, batch)`` constrains model outputs (rates,
        fairness) and enters through the loss: pass ``model=`` for ``fit`` or
        call ``lagrangian_loss`` in a custom loop.
      model: optional Keras Model; its instance (not class) gets a ``train_step``
        and ``compute_loss`` wrapper that adds output-constraint terms to the loss
        in the train step's tape and ``lagrange_violation``, ``penalty`` to the
        ``fit`` logs. ``batch`` is then ``(x, y, sample_weight)``.
      dual_every: optimizer steps per dual update (the inner minimisation).
      initial_penalty: ``rho`` at the start, >= 0. ``0`` freezes the multipliers
        (dual steps are ``rho`` times the violation) and the penalty.
      growth: factor > 1 by which ``rho`` grows when the residual stalls.
      max_penalty: cap on ``rho`` (keeps the inner problem's conditioning sane
        for first-order inner optimizers).
      decrease: in (0, 1), the residual must fall below ``decrease`` times its
        previous value at each dual update, else ``rho`` grows.
      tolerance: no growth while the residual is below it (round-off and
        sampling noise never push ``rho`` to its cap).
      name: optimizer name.

    ``get_config`` records the constraints' names and kinds but not their
    callables: ``from_config(config, constraints=[...])`` takes them again.
    Wrap this optimizer in a LossScaleOptimizer for mixed precision (not the
    reverse: the inner optimizer must see unscaled gradients).

    Example:

        >>> x = tf.Variable([0.5, 0.5])
        >>> opt = AugmentedLagrangian(
        ...     keras.optimizers.SGD(0.05),
        ...     [Equality(lambda: tf.reduce_sum(x) - 1.0), Inequality(lambda: x[0] - 0.1)],
        ...     max_penalty=10.0)  # plain SGD: keep lr * max_penalty * |grad g|^2 < 2
        >>> @tf.function
        ... def step():
        ...     with tf.GradientTape() as tape:
        ...         loss = tf.reduce_sum(tf.square(x - [1.0, 0.0]))
        ...     opt.apply_gradients(zip(tape.gradient(loss, [x]), [x]))
        >>> for _ in range(500):
        ...     step()
        >>> [round(float(v), 4) for v in x.numpy()]
        [0.1, 0.9]
        >>> float(opt.metrics()["lagrange_violation"]) < 1e-6
        True
    """

    PRESERVES_ZEROS = False  # adds the penalty's gradient to every variable
    ACCEPTED = ("optimizer, constraints, model, dual_every, initial_penalty, growth, "
                "max_penalty, decrease, tolerance, name")
    REFUSALS = {
        "same": "Give one AugmentedLagrangian all the constraints (a list).",
        "residuals": "Use a gradient optimizer (Adam, SGD, ...) inside it.",
        "accumulator": "Wrap the other way round: GradientAccumulator("
                       "AugmentedLagrangian(optimizer, constraints), steps) adds "
                       "the terms once per real update and counts dual_every in "
                       "real updates.",
        "keras_accumulation": "Accumulate outside instead: GradientAccumulator("
                              "AugmentedLagrangian(optimizer, constraints), steps).",
        "loss_scale": "Wrap it the other way round: LossScaleOptimizer("
                      "AugmentedLagrangian(inner, constraints)).",
    }

    def _wraps_loss_scale(self):
        return False

    def _loss_scale_reason(self, them):
        del them
        return "it must see unscaled gradients to add the constraint terms"

    def __init__(self, optimizer, constraints, model=None, dual_every=20,
                 initial_penalty=1.0, growth=10.0, max_penalty=1e3,
                 decrease=0.25, tolerance=1e-6, name=None, **kwargs):
        self._check_backend()
        if kwargs:
            raise unexpected_arguments(OWNER, kwargs, self.ACCEPTED)
        specs = rule.validate_arguments(constraints, dual_every, initial_penalty,
                                   growth, max_penalty, decrease, tolerance)
        self._init_wrapper(optimizer, name, {})
        if model is not None:
            self._check_model(model)
        self._specs = list(specs)
        self.dual_every = dual_every
        self.initial_penalty = float(initial_penalty)
        self.growth = float(growth)
        self.max_penalty = float(max_penalty)
        self.decrease = float(decrease)
        self.tolerance = float(tolerance)
        self._outputs_recorded = False
        self._lagrangian_built = False
        if model is not None:
            self.attach(model)

    def attach(self, model):
        """Binds this optimizer to ``model`` (what ``model=`` does): under
        ``model.fit`` output constraints then enter the loss and the logs
        show ``lagrange_violation`` and ``penalty``. Needed again after
        loading a saved model (``tf_gradkit.attach(model)``)."""
        self._check_model(model)
        _model_hooks.ModelBinding.bind(model, self, self._CALLBACK)
        self._bound = True
        return self

    def _wrap_train_step(self, step, model):
        del model

        def train_step(data):
            logs = step(data)
            if isinstance(logs, Mapping):
                logs = dict(logs)
                logs.update(self.train_logs())
            return logs

        return train_step

    def _wrap_loss(self, loss, arguments):
        batch = (arguments.get("x"), arguments.get("y"), arguments.get("sample_weight"))
        return self.lagrangian_loss(loss, arguments.get("y_pred"), batch)

    @property
    def constraint_specs(self):
        return list(self._specs)

    @property
    def _kinds(self):
        return [c.kind for c in self._specs]

    @tf.autograph.experimental.do_not_convert
    def _build_lagrangian(self):
        """Creates the state variables (eagerly, once)."""
        if self._lagrangian_built:
            return
        with tf.init_scope():
            shapes = []
            for i, c in enumerate(self._specs):
                if c.shape is None:
                    c.shape = tf.convert_to_tensor(c.fn()).shape
                if not c.shape.is_fully_defined():
                    raise ValueError(
                        f"{OWNER}: constraint {c.name!r} (constraints[{i}]) "
                        f"has no fixed shape ({c.shape}); pass shape=.")
                shapes.append(c.shape)
            init = rule.init_augmented_lagrangian(shapes, self.initial_penalty)
            tag = lambda i: f"{i}_{_safe(self._specs[i].name)}"  # noqa: E731
            def make(shape, dtype, name, initial):
                return self._new_variable(shape, dtype, name, initial, sync="first")

            self._state_vars = rule.AugmentedLagrangianState(
                multipliers=[make(s, tf.float32, f"multiplier_{tag(i)}", v)
                             for i, (s, v) in enumerate(zip(shapes, init.multipliers))],
                penalty=make((), tf.float32, "penalty", init.penalty),
                reference_residual=make((), tf.float32, "reference_residual",
                                        init.reference_residual),
                window_sums=[make(s, tf.float32, f"window_sum_{tag(i)}", v)
                             for i, (s, v) in enumerate(zip(shapes, init.window_sums))],
                window_steps=make((), tf.float32, "window_steps", init.window_steps),
                dual_updates=make((), tf.int64, "dual_updates", init.dual_updates))
            self._values = [make(s, tf.float32, f"constraint_value_{tag(i)}",
                                 tf.zeros(s)) for i, s in enumerate(shapes)]
        self._lagrangian_built = True

    # ------------------------------------------------------------ the loss
    @tf.autograph.experimental.do_not_convert
    def lagrangian_loss(self, loss, y_pred=None, batch=None):
        """``loss`` plus the augmented terms of the output constraints.

        Call inside the ``GradientTape`` of a custom loop, once per step
        (``fit`` does this itself when ``model=`` was passed). Constraints of
        the form ``fn()`` are not added here: ``apply`` adds their gradient.

        Args:
          loss: the model loss (scalar tensor).
          y_pred: the model output, passed to each ``fn(y_pred, batch)``.
          batch: anything the constraints need from the batch.

        Returns:
          ``loss`` plus the terms, in ``loss``'s dtype (divided by the number
          of replicas in a replica context, as Keras scales losses).
        """
        outputs = [i for i, c in enumerate(self._specs) if c.takes_outputs]
        if not outputs:
            return loss
        if y_pred is None:
            names = [self._specs[i].name for i in outputs]
            raise ValueError(
                f"{OWNER}.lagrangian_loss: constraints {names} take "
                "(y_pred, batch); pass y_pred= (and batch=).")
        self._build_lagrangian()
        values = [self._specs[i].fn(y_pred, batch) for i in outputs]
        replicas = _replicas()
        for i, v in zip(outputs, values):
            recorded = tf.stop_gradient(tf.cast(v, tf.float32))
            if replicas > 1:
                recorded = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.MEAN, recorded)
            self._values[i].assign(tf.reshape(recorded, self._values[i].shape))
        self._outputs_recorded = True
        terms = rule.augmented_terms(
            values, [self._specs[i].kind for i in outputs],
            [self._state_vars.multipliers[i] for i in outputs],
            self._state_vars.penalty)
        loss = tf.convert_to_tensor(loss)
        return loss + tf.cast(terms / replicas, loss.dtype)

    # -------------------------------------------------------------- a step
    def _build_own(self, var_list):
        del var_list
        self._build_lagrangian()

    @tf.autograph.experimental.do_not_convert
    def _apply_grads(self, grads, variables, aggregated=False):
        """Adds the ``fn()`` terms' gradient, steps the inner optimizer, then
        records the constraint values and runs the dual schedule."""
        grads, variables = list(grads), list(variables)
        if len(grads) != len(variables):
            raise ValueError(f"{OWNER}.apply: got {len(grads)} gradients for "
                             f"{len(variables)} variables.")
        if all(g is None for g in grads):
            raise no_gradients_error(variables)
        self._build_lagrangian()
        if any(c.takes_outputs for c in self._specs) and not self._outputs_recorded:
            names = [c.name for c in self._specs if c.takes_outputs]
            raise ValueError(
                f"{OWNER}: constraints {names} depend on model outputs but no "
                "train step evaluated them: pass model= to the optimizer for "
                "model.fit (after loading a saved model, call "
                "tf_gradkit.attach(model)), or call optimizer.lagrangian_loss("
                "loss, y_pred, batch) inside your GradientTape.")
        closure = [i for i, c in enumerate(self._specs) if not c.takes_outputs]
        if closure:
            with tf.GradientTape() as tape:
                values = [self._specs[i].fn() for i in closure]
                terms = rule.augmented_terms(
                    values, [self._specs[i].kind for i in closure],
                    [self._state_vars.multipliers[i] for i in closure],
                    self._state_vars.penalty)
            extra = tape.gradient(terms, variables)
            self._check_constraint_variables(tape.watched_variables(), variables, closure)
            # Already all-reduced gradients (a LossScaleOptimizer outside does
            # that) get the whole term; otherwise each replica adds 1/R of it
            # and the inner optimizer's sum over replicas restores it.
            replicas = 1 if aggregated else _replicas()
            # The loss, and so its gradients, carry the inner chain's static
            # loss scale (Keras 3's `loss_scale_factor`), which the inner
            # optimizer divides out: the terms get it too.
            scale = self._inner_loss_scale()
            grads = [_add(g, e, v, replicas, scale)
                     for g, e, v in zip(grads, extra, variables)]
            for i, v in zip(closure, values):
                self._values[i].assign(tf.reshape(
                    tf.stop_gradient(tf.cast(v, tf.float32)), self._values[i].shape))
        self._warn_missing_gradients(grads, variables)
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if pairs:
            self._inner_apply([g for g, _ in pairs], [v for _, v in pairs],
                              aggregated)
        state = rule.observe(
            [v.read_value() for v in self._values], self._kinds, self._state_vars,
            self.dual_every, self.growth, self.max_penalty, self.decrease,
            self.tolerance)
        tf.nest.map_structure(lambda var, new: var.assign(new),
                              tuple(self._state_vars), tuple(state))

    # ------------------------------------------------------------ reporting
    @property
    def multipliers(self):
        """One variable per constraint, shaped like its value."""
        self._build_lagrangian()
        return list(self._state_vars.multipliers)

    @property
    def penalty(self):
        self._build_lagrangian()
        return self._state_vars.penalty

    @property
    def constraint_values(self):
        """The values of the last step (closures: before its update)."""
        self._build_lagrangian()
        return list(self._values)

    def metrics(self):
        """A dict of tensors: ``lagrange_violation`` (``max(g+, |h|)`` of the
        last step), ``dual_residual``, ``penalty``, ``dual_updates`` and
        ``multipliers/<name>`` per constraint."""
        self._build_lagrangian()
        values = [v.read_value() for v in self._values]
        out = {
            "lagrange_violation": rule.feasibility_violation(values, self._kinds),
            "dual_residual": rule.dual_residual(
                values, self._kinds, self._state_vars.multipliers,
                self._state_vars.penalty),
            "penalty": self._state_vars.penalty.read_value(),
            "dual_updates": self._state_vars.dual_updates.read_value(),
        }
        for i, (c, m) in enumerate(zip(self._specs, self._state_vars.multipliers)):
            key = f"multipliers/{c.name}"
            out[key if key not in out else f"{key}_{i}"] = m.read_value()
        return out

    def train_logs(self):
        """What the ``fit`` hook adds to the logs (scalars)."""
        metrics = self.metrics()
        return {"lagrange_violation": metrics["lagrange_violation"],
                "penalty": metrics["penalty"]}

    def _check_constraint_variables(self, watched, variables, closure):
        """Refuses constraints on trainable variables this optimizer does not
        update (a MultiOptimizer gives them to another): their share of the
        penalty's gradient would be dropped."""
        keys = {self._variable_key(v) for v in variables}
        outside = sorted({self._path(v) for v in watched
                          if v.trainable and self._variable_key(v) not in keys})
        if outside:
            names = [self._specs[i].name for i in closure]
            raise ValueError(
                f"{OWNER}: constraints {names} depend on {outside}, which this "
                "optimizer is not given (a MultiOptimizer gives them to another "
                "optimizer), so their share of the penalty's gradient would be "
                "dropped. Wrap the optimizer of every variable a constraint reads "
                "(e.g. AugmentedLagrangian(MultiOptimizer(...))).")

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": self._inner_config(),
            "constraints": [dict({"name": c.name, "kind": c.kind,
                                  "takes_outputs": c.takes_outputs,
                                  "shape": None if c.shape is None else c.shape.as_list()},
                                 **self._saved_function(c.fn))
                            for c in self._specs],
            "dual_every": self.dual_every,
            "initial_penalty": self.initial_penalty,
            "growth": self.growth,
            "max_penalty": self.max_penalty,
            "decrease": self.decrease,
            "tolerance": self.tolerance,
            # Keras's loader binds it to the loaded model again (`attach`).
            "bound_to_model": getattr(self, "_bound", False),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None, constraints=None):
        """Rebuilds the optimizer. Constraint functions defined at a module's
        top level are saved by name and come back by themselves; lambdas and
        closures (over variables, say) cannot be saved: pass the constraints
        again as ``constraints``."""
        config = dict(config)
        bound = config.pop("bound_to_model", False)
        recorded = config.pop("constraints", [])
        if constraints is None:
            unsaved = [c["name"] for c in recorded if "fn" not in c]
            if unsaved:
                raise ValueError(
                    f"{OWNER}.from_config: constraints {unsaved} are lambdas or "
                    "closures, which cannot be saved. Pass them again: "
                    "from_config(config, constraints=[...]); to load a saved "
                    "model, define each constraint function at a module's top "
                    "level (saved by name), or load with compile=False and "
                    "compile a new AugmentedLagrangian.")
            constraints = [rule.ConstraintSpec(
                cls._load_function(c["fn"], custom_objects),
                c["kind"], name=c["name"], shape=c["shape"]) for c in recorded]
        inner = cls._inner_from_config(config, custom_objects)
        optimizer = cls(inner, constraints, **config)
        optimizer._bound = bool(bound)  # until attached: saved the same again
        _model_hooks.bind_after_load(optimizer, bound)
        return optimizer


def _add(grad, extra, variable, replicas, scale=1.0):
    if extra is None:
        return grad
    extra = tf.cast(extra, variable.dtype)
    if scale != 1.0:
        extra = tf.convert_to_tensor(extra) * tf.cast(scale, variable.dtype)
    if replicas > 1:
        extra = extra / replicas
    if grad is None:
        return extra
    if isinstance(extra, tf.IndexedSlices):
        extra = tf.convert_to_tensor(extra)
    return tf.convert_to_tensor(grad) + extra


def _safe(name):
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in str(name))
