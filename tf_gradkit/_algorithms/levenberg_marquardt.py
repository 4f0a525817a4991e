"""LevenbergMarquardt as a Keras optimizer: the algorithm, written once for
both Keras flavours (the math is `tf_gradkit.core.lm`).

LM needs residuals and their Jacobian, not a gradient, so the optimizer is
handed its model and takes over that model's ``train_step`` (an instance-level
bound method: both Keras flavours honour it in ``fit``, with ``jit_compile``
and ``steps_per_execution``); custom code calls ``minimize(residual_fn,
var_list)``. Plain ``apply_gradients`` raises, saying how to use it.
"""

from typing import NamedTuple

import tensorflow as tf

from tf_gradkit import _model_hooks
from tf_gradkit import _optimizer_tree
from tf_gradkit._algorithms import lm_losses
from tf_gradkit._algorithms import lm_minimize
from tf_gradkit._algorithms.lm_support import Supports, check_subset
from tf_gradkit._algorithms.lm_fit_step import (
    FitStep, check_residuals, linearize_for, require_normal_equations,  # noqa: F401
    variable_constraints)
from tf_gradkit._algorithms.wrapper import unexpected_arguments
from tf_gradkit.core.lm import damping as damping_lib
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm import parts as parts_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib
from tf_gradkit.core.lm import step as step_lib

USAGE = (
    "LevenbergMarquardt needs residuals and their Jacobian, not gradients. "
    "Use it as `model.compile(optimizer=LevenbergMarquardt(model), loss='mse')` "
    "then `model.fit(...)` (the optimizer takes over that model's train step; "
    "after loading a saved model call `tf_gradkit.attach(model)` first), "
    "or call `optimizer.minimize(residual_fn, var_list)` in a custom loop.")

CUSTOM_TRAIN_STEP = (
    "LevenbergMarquardt: the model's class overrides `train_step` (or "
    "something replaced it on the instance), and LevenbergMarquardt would "
    "replace it with its own step, silently skipping yours. Either drop the "
    "override and let LevenbergMarquardt(model) train the model, or keep "
    "your train_step and call `optimizer.minimize(residual_fn, "
    "model.trainable_variables)` inside it (LevenbergMarquardt() without "
    "model=).")


# The mini-batch guard restrains the damping when a step kept less than this
# share of its own batch's decrease (per example) on the next batch: Moré's
# "poor step" ratio (other shares measured: docs/levenberg_marquardt.md,
# "Full batch or mini-batches").
GUARD_CARRIED = 0.25
# ... and only watches batches with fewer residuals than this many per
# solved parameter (under fit, where the count is known): larger batches
# estimate the whole data's cost well, their steps carry over, and near a
# minimum the batch-to-batch noise in the tiny decreases would only slow the
# end of the fit (measured: docs/levenberg_marquardt.md, same section).
GUARD_RESIDUALS_PER_PARAMETER = 4


LINEARIZATIONS = ("auto", "taps", "autodiff")


def _check_linearization(linearization):
    if linearization not in LINEARIZATIONS:
        raise ValueError(
            "LevenbergMarquardt: `linearization` must be one of "
            f"{LINEARIZATIONS}: 'auto' forms the Jacobian from layer taps where "
            "the model's layers allow it (else by automatic differentiation), "
            "'taps' requires the taps, 'autodiff' never uses them. Received: "
            f"linearization={linearization!r}")


class _Restraint(NamedTuple):
    """The mini-batch guard's verdict: the damping state to step from and
    whether it was restrained."""

    control: damping_lib.DampingState
    fired: tf.Tensor


def validate_lm_arguments(max_attempts, chunk_size):
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) \
            or max_attempts < 1:
        raise ValueError("LevenbergMarquardt: `max_attempts` must be an integer "
                         f">= 1. Received: max_attempts={max_attempts!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, int) or chunk_size < 1):
        raise ValueError("LevenbergMarquardt: `chunk_size` must be None or an "
                         f"integer >= 1. Received: chunk_size={chunk_size!r}")


def with_initial_damping(controller, initial_damping):
    """``controller`` rebuilt with its first lambda set (a new object: a
    controller the user passed is not changed)."""
    if initial_damping is None:
        return controller
    if isinstance(initial_damping, bool) or not isinstance(
            initial_damping, (int, float)) or not initial_damping > 0:
        raise ValueError("LevenbergMarquardt: `initial_damping` must be a positive "
                         f"number. Received: initial_damping={initial_damping!r}")
    config = controller.get_config() if hasattr(controller, "get_config") else {}
    if "initial" not in config:
        raise ValueError(
            "LevenbergMarquardt: `initial_damping` sets the first lambda of a "
            "gain-ratio controller ('nielsen', 'multiply_divide'); controller="
            f"{parts_lib.part_name(controller)!r} has none (the trust region "
            "sets lambda from its radius: set its `factor` instead).")
    config["initial"] = float(initial_damping)
    if config["initial"] < config.get("floor", 0.0) or \
            config["initial"] > config.get("ceiling", float("inf")):
        raise ValueError(
            "LevenbergMarquardt: `initial_damping` must lie between the "
            f"controller's floor {config.get('floor')} and ceiling "
            f"{config.get('ceiling')}. Received: initial_damping={initial_damping!r}")
    return type(controller)(**config)


def check_parts(scaling, solver):
    """A matrix-free solver has no diag(J^T J) for a scaling that needs it."""
    parts_lib.check_parts(scaling, solver, "LevenbergMarquardt")


class LevenbergMarquardt(FitStep, Supports):
    """Levenberg-Marquardt as a Keras optimizer.

    LM minimises ``0.5 * |r|^2`` by solving the damped Gauss-Newton system
    ``(J^T J + lambda D^2) d = -J^T r`` each iteration, accepting the step when
    the cost drops as the linear model predicts (gain ratio) and otherwise
    raising ``lambda`` and retrying from the same J^T J and J^T r. The whole
    iteration, retries included, is one compiled graph (XLA-ready).

    Use it with its model: ``model.compile(optimizer=LevenbergMarquardt(model),
    loss="mse")``; the optimizer then takes over that model's train step
    (residuals ``sqrt(w) * (y_pred - y)``, so sample weights count as in the
    loss; ``"huber"`` and ``"mae"`` train as robust residuals, cross-entropies
    by a generalised Gauss-Newton step) and the progress bar shows ``damping``, ``attempts``
    and ``skipped_batches``. A batch that is not finite at the current
    weights takes no step and changes no state (``skipped_batches`` counts
    it); variable constraints are applied to each trial point, as Keras's
    optimizers apply them after an update. In custom
    code, ``loss = optimizer.minimize(residual_fn, var_list)`` runs one
    iteration; for a whole solve see ``tf_gradkit.least_squares``.

    Args:
      model: the model to train with ``fit`` (same Keras flavour); a model whose
        class overrides ``train_step`` is refused. After loading a saved
        model, ``attach(model)`` (or ``tf_gradkit.attach(model)``).
      controller: damping rule, "nielsen" (default, gain-ratio),
        "trust_region" (Moré's trust radius, `least_squares`'s default) or
        "multiply_divide" (MATLAB trainlm: x10 / x0.1), or an object from
        ``tf_gradkit.core.lm``. Nielsen stays the default here for speed: the
        trust region fits lambda with several solves per attempt (its time
        per step: docs/levenberg_marquardt.md, "The parts").
      scaling: "marquardt" (default, ``D^2`` = running max of diag(J^T J)) or
        "levenberg" (``D = I``).
      solver: "auto" (default: "dual" where a step's residuals are
        statically fewer than its parameters and it holds the whole
        Jacobian, else "cholesky"; the same step either way), "cholesky"
        (normal equations, P x P), "qr" (augmented system, for
        ill-conditioned problems), "dual" (J D^-2 J^T, N x N) or "cg"
        (matrix-free conjugate gradients: neither J nor J^T J is formed,
        memory O(N + P); needs scaling="levenberg").
      max_attempts: damped solves per iteration before giving up (the weights
        are then restored exactly, and the next batch starts from this one's
        first damping restrained once: lambda x2, the trust radius /2).
      chunk_size: rows of the Jacobian formed at a time under ``fit`` (memory
        ``chunk_size * P + P^2`` whatever the batch); None forms it whole.
      name: optional name.
      minibatch_guard: before each step, measure how much of the last
        step's decrease carried over to this batch (one forward pass at the
        previous weights); when under a quarter of it did, the last step fit
        its batch rather than the data, and the damping grows (doubles; the
        trust region halves its radius) before stepping. Keeps mini-batch LM
        from driving lambda to its floor and jumping between batches
        (docs/levenberg_marquardt.md, "Full batch or mini-batches"). Under
        ``fit`` it watches only batches with fewer than 4 residuals per
        solved parameter (larger ones estimate the data's cost well); on a
        full batch the same data come back and it never fires. False: the
        plain iteration.
      residuals: optional ``fn(model, x, y, sample_weight) -> residuals``
        (any shape) for ``fit``: LM then minimises ``0.5 * sum(fn(...)**2)``
        whatever the compiled loss (which is only reported): a loss of your
        own written as residuals, or a residual model such as a physics-
        informed network's (derivatives of ``model`` in ``x`` included).
        Saved by name when registered with Keras
        (``keras.saving.register_keras_serializable``, or passed to
        ``load_model`` in ``custom_objects``); a lambda or closure is not
        saved, and the loaded optimizer refuses to train until
        ``optimizer.residuals = fn`` is set again.
      subset: which parameters each step solves for (torch-levenberg-
        marquardt's ``param_selection_strategy``): None (default) all;
        a float in (0, 1], that fraction of them drawn at random each step
        (the same draw on every replica; the system is that fraction's size
        squared); "layers", one layer's weights per step, cycling through
        the layers in order (a layer: the variables sharing a path up to
        their last "/"). The others keep their values for that step. Not
        with pruning masks (those already choose the columns).
      linearization: how ``fit`` forms the Jacobian. "auto" (default): from
        layer taps (one forward pass and one backward pass per residual of
        an example, `tf_gradkit.gradients.tapped_jacobian`) when every layer
        of the model can say what its examples' rows are (a Sequential or
        functional model of Dense, Conv1D/2D, Embedding, LayerNormalization,
        BatchNormalization at inference and layers that keep examples apart,
        under the compiled loss, a solver that forms J^T J or J), else by
        automatic differentiation (one forward-mode product per parameter);
        "taps": the taps or an error saying why not; "autodiff": never the
        taps. ``minimize`` too, when given ``model=`` (each call checks that
        its residuals are per example, else uses autodiff). What the last
        traced step used is ``linearization_used``.
      initial_damping: the first lambda (default: the controller's, 1e-3),
        for a controller that has one ("nielsen", "multiply_divide"); the
        trust region sets lambda from its radius and refuses it. Saved as
        part of ``controller``.

    Example:

    >>> model.compile(optimizer=LevenbergMarquardt(model), loss="mse")
    >>> model.fit(x, y, batch_size=1000, epochs=20)
    
    """

    # Custom loops call `minimize(residual_fn, var_list)`, not apply_gradients.
    needs_residuals = True
    # Solves over the unpruned weights when handed pruning masks (MaskAware).
    accepts_masks = True

    def __init__(self, model=None, controller="nielsen", scaling="marquardt",
                 solver="auto", max_attempts=10, chunk_size=None, name=None,
                 initial_damping=None, minibatch_guard=True, residuals=None,
                 subset=None, linearization="auto", **kwargs):
        self._check_backend()
        if kwargs:
            raise unexpected_arguments(
                "LevenbergMarquardt", kwargs, "model, controller, scaling, solver, "
                "max_attempts, chunk_size, name, initial_damping, minibatch_guard, "
                "residuals, subset, linearization", advice="")
        check_residuals(residuals, chunk_size)
        _check_linearization(linearization)
        check_subset(subset)
        if not isinstance(minibatch_guard, bool):
            raise ValueError("LevenbergMarquardt: `minibatch_guard` must be True or "
                             f"False. Received: minibatch_guard={minibatch_guard!r}")
        if model is not None:
            _model_hooks.check_model(self, model)
        validate_lm_arguments(max_attempts, chunk_size)
        self._init_base(name)
        self.controller = with_initial_damping(parts_lib.resolve_part(
            controller, damping_lib.CONTROLLERS, "controller"), initial_damping)
        self.scaling = parts_lib.resolve_part(scaling, damping_lib.SCALINGS,
                                              "scaling")
        if callable(getattr(self.scaling, "phases", None)):
            raise ValueError(
                "LevenbergMarquardt: scaling="
                f"{parts_lib.part_name(self.scaling)!r} restarts a whole solve, "
                "which only `tf_gradkit.least_squares` runs; the optimizer takes "
                "one step per batch. Use scaling='marquardt' or 'levenberg'.")
        self.solver = parts_lib.resolve_part(solver, solvers_lib.SOLVERS, "solver")
        check_parts(self.scaling, self.solver)
        self.max_attempts = max_attempts
        self.chunk_size = chunk_size
        self.minibatch_guard = minibatch_guard
        self.residuals = residuals
        self.subset = subset
        self.linearization = linearization
        # What the last traced step linearised with (`linearization_used`);
        # minimize's check of its taps, a variable made at its first use.
        object.__setattr__(self, "_linearization_used", None)
        object.__setattr__(self, "_taps_apart", None)
        self._residuals_unsaved = None  # the name of one lost in saving
        self._lm_vars = None
        self.masks = None
        if model is not None:
            self.attach(model)

    def attach(self, model):
        """Binds this optimizer to ``model`` (what ``model=`` does): while it
        is the model's optimizer, ``model.fit`` runs LM steps. Needed again
        after loading a saved model (``tf_gradkit.attach(model)``)."""
        _model_hooks.check_model(self, model)
        if _model_hooks.overrides_train_step(model, self._DEFAULT_MODEL):
            raise ValueError(CUSTOM_TRAIN_STEP)
        _model_hooks.ModelBinding.bind(model, self, self._CALLBACK)
        self._bound = True
        return self

    def _wrap_train_step(self, step, model):
        del step  # LM's step replaces the model's (checked at `attach`)
        path = _optimizer_tree.path_to(getattr(model, "optimizer", None), self) or []
        groups = [o for o in path[:-1] if _optimizer_tree.dispatches(o)]
        if groups:
            raise ValueError(
                f"LevenbergMarquardt cannot be one of {type(groups[0]).__name__}'s "
                "optimizers: its fit step solves for every trainable variable of the "
                "model at once, so it would update the other optimizers' variables too. "
                "Compile LevenbergMarquardt(model) as the model's optimizer and freeze "
                "the layers it should not train (layer.trainable = False), or call "
                "optimizer.minimize(residual_fn, var_list) on a group in a custom loop.")
        return lambda data: self._fit_step(model, data)

    # ----------------------------------------------------------------- state
    def _build_own(self, var_list):
        var_list = list(var_list)
        dtype = self._solve_dtype(var_list)
        num_params = sum(v.shape.num_elements() for v in var_list)
        init = step_lib.init_state(self.controller, self.scaling, num_params, dtype)
        # Created in this order (damping, nu, scale): saved optimizers list
        # their variables by position.
        control = damping_lib.DampingState(
            damping=self._new_variable((), dtype, "damping", init.control.damping),
            nu=self._new_variable((), dtype, "nu", init.control.nu))
        self._lm_vars = step_lib.LMState(
            control=control,
            scale=self._new_variable((num_params,), dtype, "scale", init.scale))
        # int64: TensorFlow keeps int32 variables in host memory on a GPU,
        # where a compiled step cannot reach them.
        self._last_attempts = self._new_variable((), tf.int64, "attempts", 0)
        # The mini-batch guard's memory: the weights before the last accepted
        # step and that step's decrease per example on its batch (0: none).
        self._previous_x = self._new_variable((num_params,), dtype, "previous_x", 0.0)
        self._previous_gain = self._new_variable((), dtype, "previous_gain", 0.0)
        # Batches not finite at the current weights (no step taken).
        self._skipped = self._new_variable((), tf.int64, "skipped_batches", 0)
        self._lm_var_list = var_list

    @staticmethod
    def _solve_dtype(var_list):
        # Mixed precision keeps float32 variables; the solve runs in their dtype.
        dtypes = {tf.as_dtype(v.dtype).base_dtype for v in var_list}
        return tf.float64 if tf.float64 in dtypes else tf.float32

    def _read_state(self):
        return tf.nest.map_structure(tf.convert_to_tensor, self._lm_vars)

    def _write_state(self, state, info):
        for var, value in zip(tf.nest.flatten(self._lm_vars), tf.nest.flatten(state)):
            var.assign(value)
        self._last_attempts.assign(tf.cast(info.attempts, tf.int64))
        self.iterations.assign_add(1)

    @property
    def damping(self):
        """The current damping ``lambda``."""
        return self._lm_vars.control.damping

    @property
    def skipped_batches(self):
        """Batches skipped because their residuals, Jacobian or cost were
        not finite at the current weights (NaN/Inf inputs, targets or
        outputs): no step was taken and the LM state was left as it was.
        Also in ``fit``'s logs as ``skipped_batches`` (the count so far)."""
        return self._skipped

    @property
    def last_attempts(self):
        """Damped solves the last iteration needed (1 = first one accepted)."""
        return self._last_attempts

    @property
    def linearization_used(self):
        """How the last traced step formed the Jacobian: "taps" (fit), "taps
        (checked per example)" (minimize), or "autodiff: <why not taps>";
        None before the first step. Read eagerly after a minimize call whose
        check of the taps failed: "autodiff: <why>" too."""
        used = self._linearization_used
        if (used == lm_minimize.CHECKED and self._taps_apart is not None
                and tf.executing_eagerly() and not int(self._taps_apart.numpy())):
            return lm_minimize.MIXED
        return used

    @property
    def solver_used(self):
        """The linear solver the last traced step solved with, by name:
        under ``solver="auto"``, "dual" (the N x N system) where that step's
        residuals were statically fewer than its parameters, else
        "cholesky"; None before the first step."""
        solver = getattr(self, "_step_solver", None)
        return None if solver is None else parts_lib.part_name(solver)

    def _set_linearization_used(self, used, per_example=None):
        """Records ``used`` (logged when it changes) and, for minimize's
        checked taps, the check's outcome ``per_example`` (a bool tensor)."""
        if used != self._linearization_used:
            tf.get_logger().info("LevenbergMarquardt linearises with %s", used)
            object.__setattr__(self, "_linearization_used", used)
        if per_example is None:
            return
        if self._taps_apart is None:
            with tf.init_scope():  # int64: a compiled step on a GPU reaches it
                object.__setattr__(self, "_taps_apart", tf.Variable(
                    1, dtype=tf.int64, trainable=False, name="taps_apart"))
        self._taps_apart.assign(tf.cast(per_example, tf.int64))

    # ------------------------------------------------------------- the step
    def minimize(self, residual_fn, var_list, tape=None, model=None):
        """One LM iteration on ``0.5 * sum(residual_fn()**2)``.

        Args:
          residual_fn: zero-argument callable returning residuals (any shape).
          var_list: the variables to update.
          tape: not used (LM computes its own Jacobian); must be None.
          model: optional, the Keras model whose layers ``residual_fn`` calls:
            with ``linearization`` "auto" or "taps" the Jacobian then comes
            from its layers' taps where they cover ``var_list``, for
            residuals whose first axis is the model's examples, each
            residual depending on its own example only. That is checked
            each call (one more backward pass); a call whose check fails
            forms the Jacobian by automatic differentiation, as without
            ``model`` (`lm_minimize`; ``linearization_used`` says which).

        Returns:
          The cost ``0.5 * sum r^2`` after the iteration.
        """
        if tape is not None or not callable(residual_fn):
            raise ValueError(
                "LevenbergMarquardt.minimize(residual_fn, var_list): "
                "`residual_fn` must be a zero-argument callable returning "
                f"residuals. Received: {type(residual_fn).__name__}. " + USAGE)
        var_list = list(var_list)
        if self._lm_vars is None:
            with tf.init_scope():
                self.build(var_list)
        tf_vars = [self._tf_variable(v) for v in var_list]
        dtype = self._lm_vars.control.damping.dtype
        # Plain attribute (no Keras tracking): trace-time Python state.
        object.__setattr__(self, "_step_support", self._support(var_list, tf_vars))
        object.__setattr__(self, "_step_constrain", variable_constraints(var_list))
        object.__setattr__(self, "_step_solver", self.solver.for_shape(None, None))
        lin = lm_minimize.linearize(self, residual_fn, var_list, tf_vars, dtype,
                                    model, self._step_support)
        local_cost = lambda: lm_losses.half_sum_sq(residual_fn(), dtype)  # noqa: E731
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            # Each replica's residuals are its share of the problem: J^T J
            # and J^T r are summed over replicas and all take one step.
            return self._distributed_iterate(ctx, lin, local_cost, (), tf_vars,
                                             tf.constant(1.0, dtype))[1]
        return self._iterate(lin, local_cost, tf_vars).new_cost

    def _iterate(self, lin, cost_fn, tf_vars, size=None, per_example=None):
        """One LM iteration; ``size``: the examples behind ``lin`` (the
        guard compares decreases per example), None for 1; ``per_example``:
        residuals per example (None: unknown, the guard always watches).
        Returns the `step.StepInfo`.

        A batch whose residuals, Jacobian or cost are not finite at the
        current weights takes no step: the weights and every piece of LM
        state (damping, controller, scaling, the guard's memory,
        ``iterations``) stay as they were and ``skipped_batches`` counts it,
        so the next clean batch steps as if this one had not come."""
        finite = _linearization_is_finite(lin)

        def skip():
            self._skipped.assign_add(1)
            return _no_step(lin)

        return tf.cond(finite, lambda: self._step(lin, cost_fn, tf_vars, size,
                                                  per_example), skip)

    def _step(self, lin, cost_fn, tf_vars, size, per_example):
        """`_iterate` on a finite batch."""
        state = self._read_state()
        dtype = state.damping.dtype
        watch = tf.constant(True)
        if per_example is not None and size is not None:
            support = getattr(self, "_step_support", None)
            solved = support.size if support is not None else state.scale.shape[0]
            residuals = tf.cast(size, tf.float64) * tf.cast(per_example, tf.float64)
            watch = residuals < GUARD_RESIDUALS_PER_PARAMETER * solved
        size = tf.constant(1.0, dtype) if size is None else tf.cast(size, dtype)
        x_now = lin_lib.flatten(tf_vars, dtype)
        if self.minibatch_guard:
            restrained = self._guard(state.control, lin.cost, cost_fn, tf_vars,
                                     x_now, size, watch)
            state = state._replace(control=restrained.control)
        start = state.control
        state, info = step_lib.levenberg_marquardt_step(
            lin, cost_fn, tf_vars, state, controller=self.controller,
            scaling=self.scaling,
            solver=getattr(self, "_step_solver", None) or self.solver,
            max_attempts=self.max_attempts,
            support=getattr(self, "_step_support", None),
            constrain=getattr(self, "_step_constrain", None))
        # No attempt accepted: the next batch starts from this one's damping
        # restrained once (lambda x2, the trust radius /2), not from the
        # escalation of its attempts (Nielsen's ten rejections raise lambda
        # 2^55-fold, to the ceiling, where no step is resolvable in float32
        # and every later batch would be rejected too).
        state = state._replace(control=tf.nest.map_structure(
            lambda after, failed: tf.where(info.accepted, after, failed),
            state.control, self.controller.restrain(start)))
        self._write_state(state, info)
        if self.minibatch_guard:
            self._previous_x.assign(x_now)
            self._previous_gain.assign(tf.where(
                info.accepted, (info.cost - info.new_cost) / size,
                tf.zeros_like(info.cost)))
        return info

    def _guard(self, control, cost_now, cost_fn, tf_vars, x_now, size, watch):
        """The damping restrained when under `GUARD_CARRIED` of the last
        step's decrease per example carried over to this batch
        (`minibatch_guard`): one evaluation of this batch's cost at the
        weights before that step, when ``watch`` (a batch small enough to
        overfit). Returns `_Restraint`."""
        gain = tf.where(watch, self._previous_gain.read_value(),
                        tf.zeros_like(cost_now))

        def cost_before_last_step():
            for v, value in zip(tf_vars, lin_lib.unflatten(
                    self._previous_x.read_value(), tf_vars)):
                v.assign(value)
            cost = tf.cast(cost_fn(), gain.dtype)
            with tf.control_dependencies([cost]):
                for v, value in zip(tf_vars, lin_lib.unflatten(x_now, tf_vars)):
                    v.assign(value)
            return tf.identity(cost)

        before = tf.cond(gain > 0, cost_before_last_step, lambda: cost_now)
        carried = (before - cost_now) / size
        # NaN fires (is_nan, not ~(a >= b): Grappler rewrites that to a < b).
        fired = (gain > 0) & (tf.math.is_nan(carried)
                              | (carried < GUARD_CARRIED * gain))
        control = tf.nest.map_structure(
            lambda r, c: tf.where(fired, r, c), self.controller.restrain(control),
            control)
        return _Restraint(control, fired)

    def _distributed_iterate(self, ctx, lin, local_cost, args, tf_vars, size,
                             per_example=None):
        """The iteration of the whole problem from each replica's share:
        ``local_cost(*args)`` is this replica's cost at the current weights,
        ``size`` its examples. Returns ``(attempts, cost after the step)``,
        the same on every replica."""
        require_normal_equations(
            self.solver, "under tf.distribute it sums J^T J across replicas")
        jtj, jtr, cost, size = ctx.all_reduce(
            tf.distribute.ReduceOp.SUM,
            [lin.jtj, lin.jtr, lin.cost, tf.cast(size, lin.cost.dtype)])

        per_example_known = per_example is not None
        per_example = tf.constant(-1) if per_example is None else per_example

        def cross_replica(distribution, jtj, jtr, cost, size, per_example, *args):
            def first(value):
                return distribution.experimental_local_results(value)[0]

            total = solvers_lib.Linearization(cost=first(cost), jtj=first(jtj),
                                              jtr=first(jtr))

            def cost_fn():
                per_replica = distribution.extended.call_for_each_replica(
                    local_cost, args=args)
                return distribution.reduce(tf.distribute.ReduceOp.SUM,
                                           per_replica, axis=None)

            known = first(per_example)
            info = self._iterate(total, cost_fn, tf_vars, first(size),
                                    tf.where(known >= 0, known, 0) if
                                    per_example_known else None)
            return info.attempts, info.new_cost

        return ctx.merge_call(cross_replica,
                              args=(jtj, jtr, cost, size, per_example) + tuple(args))

    def apply_gradients(self, *args, **kwargs):
        del args, kwargs
        raise ValueError(USAGE)

    def apply(self, *args, **kwargs):
        del args, kwargs
        raise ValueError(USAGE)

    def get_config(self):
        return {
            "name": self.name,
            "controller": parts_lib.serialize_part(self.controller),
            "scaling": parts_lib.serialize_part(self.scaling),
            "solver": parts_lib.serialize_part(self.solver),
            "max_attempts": self.max_attempts,
            "chunk_size": self.chunk_size,
            "minibatch_guard": self.minibatch_guard,
            "residuals": self._saved_residuals(),
            "subset": self.subset,
            "linearization": self.linearization,
            # Keras's loader binds it to the loaded model again (`attach`).
            "bound_to_model": getattr(self, "_bound", False),
        }

    def _saved_residuals(self):
        """``None``, ``{"fn": ...}`` (saved by name) or ``{"unsaved": name}``."""
        if self.residuals is None:
            return ({"unsaved": self._residuals_unsaved}
                    if self._residuals_unsaved else None)
        saved = self._saved_function(self.residuals)
        return saved or {"unsaved": getattr(self.residuals, "__qualname__",
                                            type(self.residuals).__name__)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        bound = config.pop("bound_to_model", False)
        saved = config.pop("residuals", None)
        optimizer = cls(**config)
        if saved is not None and "fn" in saved:
            optimizer.residuals = cls._load_function(saved["fn"], custom_objects)
        elif saved is not None:
            optimizer._residuals_unsaved = saved.get("unsaved", "?")
        optimizer._bound = bool(bound)  # until attached: saved the same again
        _model_hooks.bind_after_load(optimizer, bound)
        return optimizer


def _linearization_is_finite(lin):
    """Whether every part of the linearisation at the current weights is
    finite (its cost, ``J^T r`` and whichever of ``J^T J``, ``J``, ``r`` it
    holds)."""
    parts = [lin.cost, lin.jtr] + [t for t in (lin.jtj, lin.jacobian, lin.residuals)
                                   if t is not None]
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in parts])


def _no_step(lin):
    """The `step.StepInfo` of a batch skipped before any attempt."""
    zero = tf.zeros_like(lin.cost)
    return step_lib.StepInfo(
        cost=lin.cost, new_cost=lin.cost, accepted=tf.constant(False),
        attempts=tf.constant(0), step_norm=zero, gradient_norm=zero, rho=zero,
        predicted=zero, first_step_norm=zero, last_step_norm=zero)
