"""LevenbergMarquardt's ``fit`` step: one LM iteration on a batch, written
once for both Keras flavours (the algorithm class inherits `FitStep`).

From the compiled loss, output by output (`lm_losses`: each output's loss,
weight and parameters as the host's compiled loss matches them), or from
``residuals=``, it makes the batch's residuals (squared and robust outputs'
blocks side by side), or one generalised Gauss-Newton system over every output
when any is a cross-entropy,
linearises them (layer taps where the model allows, else automatic
differentiation; whole, chunked or matrix-free, as the solver consumes),
runs the iteration (`LevenbergMarquardt._iterate`, or across replicas
`_distributed_iterate`) and returns the step's logs.

`FitStep` uses what the algorithm class has: ``solver``, ``chunk_size``,
``subset``, ``masks``, ``linearization``, ``_set_linearization_used``,
``residuals``, ``_residuals_unsaved``, ``_lm_vars``, ``_skipped``,
``build``, ``_support``, ``_iterate``, ``_distributed_iterate`` and the host
hooks ``_unpack``, ``_report`` and ``_tf_variable``.
"""

import tensorflow as tf

from tf_gradkit._algorithms import lm_losses
from tf_gradkit.core.lm import ggn as ggn_lib
from tf_gradkit.core.lm import linear_solvers as solvers_lib
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm import parts as parts_lib
from tf_gradkit.gradients import tapped_jacobian


def check_residuals(residuals, chunk_size):
    if residuals is not None and not callable(residuals):
        raise ValueError(
            "LevenbergMarquardt: `residuals` must be None or a function "
            "fn(model, x, y, sample_weight) -> residuals. Received: "
            f"{type(residuals).__name__}")
    if residuals is not None and chunk_size is not None:
        raise ValueError(
            "LevenbergMarquardt: `chunk_size` pads the last chunk with "
            "zero-weight rows, which a residual function of your own may not "
            "honour; use chunk_size=None with `residuals` (or smaller batches).")


def linearize_for(optimizer, residual_fn, variables, dtype, support=None):
    """The linearisation the optimizer's solver consumes
    (`linear_solvers.FORMS`), by automatic differentiation."""
    if optimizer.solver.consumes == solvers_lib.MATRIX_FREE:
        return lin_lib.linearize_as(solvers_lib.MATRIX_FREE, residual_fn, variables,
                                    dtype, support=support)
    return linearize_rows(optimizer, *lin_lib.residuals_and_jacobian(
        residual_fn, variables, dtype, support=support))


def linearize_rows(optimizer, residuals, jacobian):
    """The `Linearization` of residuals [N] and their Jacobian [N, k] for the
    solver this step uses (`FitStep._choose_solver`: the N x N dual system
    when N < k under ``solver="auto"``); ``J^T J`` is formed only when that
    solver reads it."""
    solver = optimizer._choose_solver(residuals.shape[0], jacobian.shape[1])
    jacobian_form = solver.consumes == solvers_lib.JACOBIAN
    return lin_lib.from_rows(residuals, jacobian, jacobian_form,
                             normal_matrix=not jacobian_form or solver.reads_normal_matrix)


def require_normal_equations(solver, why):
    """Paths that sum ``J^T J`` (chunks, replicas, GGN) need a solver that
    consumes only the normal equations."""
    if solver.consumes != solvers_lib.NORMAL_EQUATIONS:
        raise ValueError(
            f"LevenbergMarquardt: {why}, so it needs a solver that works from "
            "J^T J alone (solver='cholesky'). Received: "
            f"solver={parts_lib.part_name(solver)!r}")


def variable_constraints(variables):
    """The variables' Keras constraints as one function for the step
    (`step.levenberg_marquardt_step`'s ``constrain``), or None when none has
    one. Applied as Keras's optimizers apply them after an update:
    ``variable.assign(variable.constraint(variable))`` (``constraint`` is an
    attribute of a Keras 3 variable and of a ``tf.Variable`` alike)."""
    constrained = [(v, v.constraint) for v in variables
                   if getattr(v, "constraint", None) is not None]
    if not constrained:
        return None

    def constrain():
        for variable, constraint in constrained:
            variable.assign(constraint(variable))

    return constrain



class FitStep:
    """LevenbergMarquardt's ``fit`` step (a part of the algorithm class)."""

    def _fit_step(self, model, data):
        custom = self.residuals
        if custom is None and self._residuals_unsaved:
            raise ValueError(
                "LevenbergMarquardt: this optimizer was saved while training on "
                f"residuals={self._residuals_unsaved!r}, a lambda or closure that "
                "cannot be saved, and would otherwise train on the compiled loss "
                "instead. Set `optimizer.residuals = <your function>` before "
                "fit, or define it at a module's top level and register it with "
                "keras.saving.register_keras_serializable so that it is saved by "
                "name.")
        check_residuals(custom, self.chunk_size)
        x, y, sample_weight = self._unpack(data)
        # The forward pass first: it builds a model that was not built yet.
        y_pred = model(x, training=False)
        # Each output's loss, matched to it as the flavour's Keras matches it.
        terms = None if custom is not None else lm_losses.read_output_losses(
            self, model, y, y_pred)
        if terms is not None and lm_losses.uses_ggn(terms):
            self._check_ggn(terms)
        variables = model.trainable_variables
        if not variables:
            raise ValueError("LevenbergMarquardt: the model has no trainable "
                             "variables to fit.")
        if self._lm_vars is None:
            with tf.init_scope():
                self.build(variables)
        tf_vars = [self._tf_variable(v) for v in variables]
        dtype = self._lm_vars.control.damping.dtype
        support = self._support(variables, tf_vars)
        object.__setattr__(self, "_step_support", support)
        object.__setattr__(self, "_step_constrain", variable_constraints(variables))
        object.__setattr__(self, "_step_solver", self.solver.for_shape(None, None))

        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        steps = self._tap_plan(model, variables, custom)

        def tapped(rows_fn):
            """``(r, J)`` over the support from ``rows_fn() -> [B, m]``."""
            r, jac = tapped_jacobian.residuals_and_jacobian(steps, variables,
                                                            rows_fn, dtype)
            return r, lin_lib.on_support(jac, support)

        if terms is not None and lm_losses.uses_ggn(terms):
            return self._fit_step_ggn(model, terms, x, y, sample_weight, y_pred,
                                      batch, tf_vars, dtype,
                                      None if steps is None else tapped)

        def rows_of(xb, yb, wb):
            """The step residuals [B, m]: every output's block side by side."""
            if custom is not None:
                return custom(model, xb, yb, wb)
            return lm_losses.residual_rows(terms, yb, model(xb, training=True), wb,
                                           dtype)

        def residuals(xb, yb, wb):
            return tf.cast(tf.reshape(rows_of(xb, yb, wb), [-1]), dtype)

        def cost(xb, yb, wb):
            """The batch's summed loss (robust blocks at their own cost)."""
            if custom is not None:
                return lm_losses.half_sum_sq(residuals(xb, yb, wb), dtype)
            return lm_losses.residual_cost(terms, yb, model(xb, training=True), wb,
                                           dtype)

        def residual_rows(xb, yb, wb):
            return lambda: rows_of(xb, yb, wb)

        if (self.chunk_size is None and steps is not None
                and self.solver.consumes == solvers_lib.MATRIX_FREE):
            r, jtr, matvec = tapped_jacobian.matrix_free(
                steps, variables, residual_rows(x, y, sample_weight), dtype)
            lin = solvers_lib.Linearization(cost=0.5 * tf.reduce_sum(tf.square(r)),
                                            jtj=None, jtr=jtr, matvec=matvec)
        elif self.chunk_size is None and steps is not None:
            lin = linearize_rows(self, *tapped(residual_rows(x, y, sample_weight)))
        elif self.chunk_size is None:
            lin = linearize_for(self, lambda: residuals(x, y, sample_weight),
                                tf_vars, dtype, support)
        else:
            lin = self._chunked(residuals, x, y, sample_weight, batch, tf_vars, dtype,
                                None if steps is None else
                                lambda xb, yb, wb: tapped(residual_rows(xb, yb, wb)))
        if terms is not None and any(t.family == "robust" for t in terms):
            # 0.5 |r|^2 of the step residuals is not a robust loss's cost.
            lin = lin._replace(cost=cost(x, y, sample_weight))
        return self._step_and_report(model, x, y, sample_weight, y_pred, lin, cost,
                                     tf_vars)

    def _check_ggn(self, terms):
        """A cross-entropy output makes the step a summed GGN: ``J^T H J``
        is formed whole, for a solver that reads only it."""
        if (self.solver.consumes != solvers_lib.NORMAL_EQUATIONS
                or self.chunk_size is not None):
            names = [t.name for t in terms if t.family == "cross_entropy"]
            raise ValueError(
                f"LevenbergMarquardt: output {names[0]!r} has a cross-entropy loss, "
                "which is stepped through the generalised Gauss-Newton matrix: it "
                "needs solver='cholesky' and chunk_size=None. Received: "
                f"solver={parts_lib.part_name(self.solver)!r}, "
                f"chunk_size={self.chunk_size}")

    def _on_fit_start(self, model):
        """Refuses, before ``fit`` traces a step, a compiled loss LM cannot
        step (naming the output) or a cross-entropy with a solver that
        cannot take its GGN."""
        if self.residuals is not None or self._residuals_unsaved:
            return
        given = self._given_losses(model)
        lm_losses.check_given_losses(self, model)
        if any(self._keras_loss_function(loss) in lm_losses.CROSS_ENTROPY
               for _, loss in given):
            self._check_ggn([lm_losses.OutputTerm(name, "cross_entropy", 1.0)
                             for name, loss in given
                             if self._keras_loss_function(loss) in lm_losses.CROSS_ENTROPY])

    def _fit_step_ggn(self, model, terms, x, y, sample_weight, y_pred, batch,
                      tf_vars, dtype, tapped=None):
        """One step when any output is a cross-entropy: every output's terms
        (`lm_losses.ggn_terms`) summed into one GGN over the outputs'
        Jacobian, the cost Keras's compiled loss."""
        del batch

        def example_scale(xb):
            # Keras reduces with the mean over the (global) batch: w_i / B.
            b = tf.shape(tf.nest.flatten(xb)[0])[0]
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            return 1.0 / tf.cast(b * replicas, dtype)

        preds, targets, weights = lm_losses.selected_outputs(terms, y, y_pred,
                                                             sample_weight)
        widths = lm_losses.widths_of(preds)

        def rows():
            outputs = lm_losses.selected_outputs(
                terms, y, model(x, training=True), sample_weight)[0]
            return lm_losses.output_rows(terms, outputs, dtype)

        if tapped is not None:
            outputs, jac = tapped(rows)
        else:
            outputs, jac = lin_lib.residuals_and_jacobian(
                rows, tf_vars, dtype, support=self._step_support)
        lin = ggn_lib.linearize_terms(
            outputs, jac, tf.shape(tf.nest.flatten(x)[0])[0],
            lambda z: lm_losses.ggn_terms(terms, z, widths, targets, weights,
                                          example_scale(x), dtype))

        def cost(xb, yb, wb):
            p, t, w = lm_losses.selected_outputs(terms, yb, model(xb, training=True),
                                                 wb)
            return lm_losses.ggn_terms(
                terms, lm_losses.output_rows(terms, p, dtype), widths, t, w,
                example_scale(xb), dtype).cost

        return self._step_and_report(model, x, y, sample_weight, y_pred, lin, cost,
                                     tf_vars)

    def _step_and_report(self, model, x, y, sample_weight, y_pred, lin,
                         local_cost, tf_vars):
        """One LM iteration from this replica's linearisation, then the logs.

        Under a multi-replica strategy J^T J, J^T r and the cost are summed
        across replicas once; the attempts then run in cross-replica context
        (one ``merge_call``), where each trial cost is evaluated per replica
        and summed, so every replica takes the identical step.
        """
        ctx = tf.distribute.get_replica_context()
        size = tf.shape(tf.nest.flatten(x)[0])[0]
        outputs = tf.add_n([tf.size(o) for o in tf.nest.flatten(y_pred)])
        per_example = outputs // tf.maximum(tf.shape(tf.nest.flatten(y_pred)[0])[0], 1)
        if ctx is not None and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            attempts = self._distributed_iterate(ctx, lin, local_cost,
                                                 (x, y, sample_weight), tf_vars,
                                                 size, per_example)[0]
        else:
            info = self._iterate(lin, lambda: local_cost(x, y, sample_weight),
                                 tf_vars, size, per_example)
            attempts = info.attempts
        logs = dict(self._report(model, x, y, y_pred, sample_weight))
        logs["damping"] = self._lm_vars.control.damping.read_value()
        logs["attempts"] = attempts
        logs["skipped_batches"] = self._skipped.read_value()
        return logs

    def _chunked(self, residuals, x, y, sample_weight, batch, tf_vars, dtype,
                 tapped=None):
        require_normal_equations(
            self.solver, "`chunk_size` bounds memory by never holding the whole "
            "Jacobian, only the sum of the chunks' J^T J")
        size = self.chunk_size
        num_chunks = (batch + size - 1) // size

        def rows(i):
            idx = i * size + tf.range(size)
            valid = tf.cast(idx < batch, dtype)
            idx = tf.minimum(idx, batch - 1)
            take = lambda t: tf.gather(t, idx)  # noqa: E731
            xb = tf.nest.map_structure(take, x)
            yb = tf.nest.map_structure(take, y)
            # Per-output sample weights (a list or dict) are taken output
            # by output: each is [B], never stacked into one tensor.
            wb = valid if sample_weight is None else tf.nest.map_structure(
                lambda w: valid if w is None else valid * tf.cast(take(w), dtype),
                sample_weight)
            return xb, yb, wb

        return lin_lib.linearize_chunked(
            lambda i: residuals(*rows(i)), num_chunks, tf_vars, dtype,
            support=self._step_support,
            chunk_rows_fn=None if tapped is None else lambda i: tapped(*rows(i)))

    def _choose_solver(self, rows, columns):
        """The solver of this step: ``solver.for_shape(rows, columns)`` on
        one replica (across replicas ``J^T J`` is summed, so the solver as
        given), kept for `_step` as ``_step_solver``."""
        if tf.distribute.get_strategy().num_replicas_in_sync > 1:
            rows = None
        solver = self.solver.for_shape(rows, columns)
        object.__setattr__(self, "_step_solver", solver)
        return solver

    def _tap_plan(self, model, variables, custom):
        """The tapped Jacobian's plan for this fit step, or None (autodiff);
        records the choice in ``linearization_used`` (and logs a change)."""
        steps, why = None, None
        if self.linearization == "autodiff":
            why = "linearization='autodiff'"
        elif custom is not None:
            why = ("a residual function of your own (`residuals=`) may mix the "
                   "examples")
        elif self.solver.consumes == solvers_lib.MATRIX_FREE and (
                self.chunk_size is not None or self.subset is not None
                or self.masks is not None):
            why = (f"solver={parts_lib.part_name(self.solver)!r} is matrix-free, "
                   "which neither chunks nor supports (subset=, masks) combine with")
        else:
            steps, why = tapped_jacobian.plan(model, variables, training=True)
        if why and self.linearization == "taps":
            raise ValueError(
                "LevenbergMarquardt: linearization='taps', but the Jacobian cannot "
                f"be formed from layer taps: {why}. Use linearization='auto' (it "
                "falls back to automatic differentiation) or 'autodiff'.")
        self._set_linearization_used("taps" if steps is not None else f"autodiff: {why}")
        return steps
