"""How `LevenbergMarquardt.minimize` linearises: checked layer taps, or
automatic differentiation.

``minimize(residual_fn, var_list, model=model)`` may form the Jacobian from
the taps of ``model``'s layers (`tf_gradkit.gradients.tapped_jacobian`, the
rules the fit step uses) when every variable of ``var_list`` belongs to a
layer with a rule. Unlike the fit step's residuals, ``residual_fn`` is
opaque: it may mix examples (a batch mean, a batch statistic) or lay its
residuals out other than example-major, and then the tapped rows would be
wrong. So each call checks (`tapped_jacobian.checked_residuals_and_jacobian`:
one more backward pass) and, where the check fails, forms the Jacobian by
automatic differentiation instead, in the same compiled step; the outcome
of the last call is kept (``linearization_used``).
"""

import tensorflow as tf

from tf_gradkit._algorithms.lm_fit_step import linearize_for, linearize_rows
from tf_gradkit.core.lm import linear_solvers as solvers_lib
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm import parts as parts_lib
from tf_gradkit.gradients import tapped_jacobian

# `linearization_used` after a minimize call that took the checked taps.
CHECKED = "taps (checked per example)"
MIXED = ("autodiff: the residuals of `residual_fn` are not per example (the "
         "check of the tapped rows failed: a residual depends on other examples, "
         "or the first axis is not the examples'), so this call formed the "
         "Jacobian by automatic differentiation")


def _why_not(optimizer, model, variables):
    """``(plan, None)`` or ``(None, why the taps do not apply)``."""
    if optimizer.linearization == "autodiff":
        return None, "linearization='autodiff'"
    if model is None:
        return None, ("minimize was given no `model=` (the model whose layers "
                      "`residual_fn` calls), so there is nothing to tap")
    if optimizer.solver.consumes == solvers_lib.MATRIX_FREE:
        return None, (f"solver={parts_lib.part_name(optimizer.solver)!r} is "
                      "matrix-free; minimize's checked taps form J")
    if tf.distribute.get_strategy().num_replicas_in_sync > 1:
        return None, "minimize's checked taps run on one replica only"
    # training=True: a trainable BatchNormalization (whose mode the function
    # chooses) is refused; a frozen one runs at inference either way.
    return tapped_jacobian.plan(model, variables, training=True)


def linearize(optimizer, residual_fn, variables, tf_vars, dtype, model, support):
    """The `linear_solvers.Linearization` of ``residual_fn`` for one minimize
    call, and ``optimizer.linearization_used`` set to what it used."""
    steps, why = _why_not(optimizer, model, variables)
    if why and optimizer.linearization == "taps":
        raise ValueError(
            "LevenbergMarquardt.minimize: linearization='taps', but the Jacobian "
            f"cannot be formed from layer taps: {why}. Pass `model=` (a Sequential "
            "or functional model of layers with a tap rule, owning every variable "
            "of `var_list`), or use linearization='auto' (it falls back to "
            "automatic differentiation) or 'autodiff'.")
    if steps is not None:
        try:
            r, jac, per_example = tapped_jacobian.checked_residuals_and_jacobian(
                steps, variables, residual_fn, dtype)
        except tapped_jacobian.NotByExample as error:
            steps, why = None, str(error)
    if steps is None:
        optimizer._set_linearization_used(f"autodiff: {why}")
        return linearize_for(optimizer, residual_fn, tf_vars, dtype, support)

    def autodiff():
        return lin_lib.residuals_and_jacobian(residual_fn, tf_vars, dtype,
                                              support=support)

    r, jac = tf.cond(per_example, lambda: (r, lin_lib.on_support(jac, support)),
                     autodiff)
    optimizer._set_linearization_used(CHECKED, per_example)
    return linearize_rows(optimizer, r, jac)
