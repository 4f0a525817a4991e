"""The losses LevenbergMarquardt trains Keras models on, output by output.

Each compiled output loss is read from the flavour's own compiled loss (its
host's ``_output_losses``: the output it belongs to and the ``loss_weights``
entry Keras multiplies it by, matched by output name where Keras matches by
name) and becomes one block of the step:

- a mean squared error: residuals ``sqrt(lw w / d) (y_pred - y)``;
- a Huber (its own ``delta``) or mean absolute error loss: robust residuals
  (`core.lm.robust`), reweighted per block;
- a cross-entropy (its own ``from_logits``): a generalised Gauss-Newton
  block (`core.lm.ggn`).

The cost is Keras's compiled loss ``sum_k lw_k loss_k`` times one constant:
``0.5 B`` when every output is a mean squared error (``0.5 |r|^2``), ``B``
when the residual blocks mix in a robust one (each squared block counts
twice, as ``|r|^2``), and 1 when any output is a cross-entropy (the blocks
are summed as one GGN: ``J^T H J`` and ``J^T g`` over every output). So an
LM step on several outputs is the step on the one problem Keras reports.
"""

from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tf_gradkit._hosts import protocol
from tf_gradkit.core.lm import ggn as ggn_lib
from tf_gradkit.core.lm.robust import RobustLoss

# The flavour's own loss functions LM reads (a name, the function and the
# class alike: "mse", mean_squared_error and MeanSquaredError() are one).
SQUARED = "mean_squared_error"
# Robust losses, as residuals: Keras's Huber(delta) per element is scipy's
# huber with f_scale = delta (0.5 C^2 rho((e/C)^2)); the mean absolute error
# is the "absolute" loss with C = 1 (|e|), stepped by reweighted least squares.
ROBUST = {"huber": "huber", "mean_absolute_error": "absolute"}
# Cross-entropies handled through the generalised Gauss-Newton matrix.
CROSS_ENTROPY = {"categorical_crossentropy": "categorical",
                 "sparse_categorical_crossentropy": "sparse_categorical",
                 "binary_crossentropy": "binary"}
ACCEPTED = ("a mean squared error ('mse', MeanSquaredError), a robust loss ('huber', "
            "Huber(delta); 'mae', MeanAbsoluteError) or a cross-entropy "
            "('categorical_crossentropy', 'sparse_categorical_crossentropy', "
            "'binary_crossentropy' or their classes, from_logits either way), one "
            "per output, in any mix")
_MEAN_REDUCTIONS = ("auto", "sum_over_batch_size", "mean")


class OutputTerm(NamedTuple):
    """One output's loss as LM steps it.

    Attributes:
      name: the output's name (messages).
      family: ``"squared"``, ``"robust"`` or ``"cross_entropy"``.
      weight: its ``loss_weights`` entry (1.0 when none).
      robust: its `RobustLoss` (``"robust"``).
      cross_entropy: its `ggn.LOSSES` kind (``"cross_entropy"``).
      from_logits: read from this output's loss.
      select: the host's ``select(y, y_pred, sample_weight)``.
    """

    name: str
    family: str
    weight: float
    robust: Optional[RobustLoss] = None
    cross_entropy: Optional[str] = None
    from_logits: bool = False
    select: Any = None


def _refuse(name, why, loss):
    raise ValueError(
        f"LevenbergMarquardt: the loss of output {name!r} ({_describe(loss)}) "
        f"{why}. Accepted: {ACCEPTED}. Compile with those, or give "
        "LevenbergMarquardt(model, residuals=fn) a function "
        "fn(model, x, y, sample_weight) -> residuals of your own.")


def _describe(loss):
    if isinstance(loss, str):
        return repr(loss)
    return getattr(loss, "name", None) or getattr(loss, "__name__", None) \
        or type(loss).__name__


def classify(host, name, loss, reduction="mean", weight=None, select=None):
    """The `OutputTerm` of output ``name``'s compiled ``loss``, or a
    ValueError naming the output and why LM cannot step it.

    Args:
      host: the optimizer's host (``_keras_loss_function``).
      name: the output's name.
      loss: a Keras ``Loss`` (or what ``compile`` resolves a name to).
      reduction: ``"mean"`` (Keras's default), else refused.
      weight: its ``loss_weights`` entry or None.
      select: the host's selector of this output.
    """
    function = host._keras_loss_function(loss)
    kwargs = protocol.loss_fn_kwargs(loss)

    def option(key, default):
        return kwargs.get(key, getattr(loss, key, default))

    if function is None or not (function == SQUARED or function in ROBUST
                                or function in CROSS_ENTROPY):
        _refuse(name, "is not one LevenbergMarquardt forms residuals or a "
                "Gauss-Newton matrix for", loss)
    if reduction != "mean":
        _refuse(name, f"reduces with {getattr(loss, 'reduction', reduction)!r}; LM "
                "steps the mean over the batch (reduction='sum_over_batch_size')",
                loss)
    weight = 1.0 if weight is None else float(weight)
    if function == SQUARED:
        return OutputTerm(name, "squared", weight, select=select)
    if function in ROBUST:
        kind = ROBUST[function]
        scale = float(option("delta", 1.0)) if kind == "huber" else 1.0
        # Stepped by reweighted least squares (`RobustLoss.first_order`).
        return OutputTerm(name, "robust", weight,
                          robust=RobustLoss(kind, scale, first_order=True),
                          select=select)
    if float(option("label_smoothing", 0.0) or 0.0) != 0.0:
        _refuse(name, f"has label_smoothing={option('label_smoothing', 0.0)}, which "
                "the Gauss-Newton terms do not model", loss)
    if option("axis", -1) not in (-1, None):
        _refuse(name, f"has axis={option('axis', -1)}; the Gauss-Newton terms take "
                "the classes along the last axis", loss)
    if option("ignore_class", None) is not None:
        _refuse(name, f"has ignore_class={option('ignore_class', None)}, which the "
                "Gauss-Newton terms do not model", loss)
    return OutputTerm(name, "cross_entropy", weight,
                      cross_entropy=CROSS_ENTROPY[function],
                      from_logits=bool(option("from_logits", False)), select=select)


def check_given_losses(host, model):
    """Refuses, before any batch (outside any graph), a compiled loss LM
    cannot step, naming its output (`classify`)."""
    for name, loss in host._given_losses(model):
        reduction = getattr(loss, "reduction", "auto")
        classify(host, name, loss,
                 "mean" if reduction in _MEAN_REDUCTIONS else reduction)


def read_output_losses(host, model, y, y_pred):
    """Every output's `OutputTerm`, from the host's compiled loss."""
    losses = host._output_losses(model, y, y_pred)
    if not losses:
        raise ValueError(
            "LevenbergMarquardt: the model was compiled without a loss. Compile "
            f"with one per output ({ACCEPTED}), or give "
            "LevenbergMarquardt(model, residuals=fn).")
    return [classify(host, t.name, t.loss, t.reduction, t.weight, t.select)
            for t in losses]


def uses_ggn(terms):
    """Whether any output is a cross-entropy (the step is a summed GGN)."""
    return any(t.family == "cross_entropy" for t in terms)


def squared_factor(terms):
    """How a squared block counts: 1 (``0.5 |r|^2``) when all are squared,
    2 (``|r|^2``, the robust blocks' scale) otherwise."""
    return 1.0 if all(t.family == "squared" for t in terms) else 2.0


def _selected(terms, y, y_pred, sample_weight):
    # Counted before selecting, so that too few targets are named as such.
    if len(terms) > 1 and len(tf.nest.flatten(y)) < len(terms):
        raise ValueError(
            f"LevenbergMarquardt: the model has {len(terms)} outputs with a loss "
            f"but the data has {len(tf.nest.flatten(y))} targets.")
    return [t.select(y, y_pred, sample_weight) for t in terms]


def _block(term, y_t, y_p, weight, dtype, scale):
    """``(errors [B, d], weights [B, d])`` of one residual output: each
    element's weight in the summed loss is ``lw * w * scale / d``."""
    diff = tf.cast(y_p, dtype) - tf.cast(tf.reshape(y_t, tf.shape(y_p)), dtype)
    diff = tf.reshape(diff, [tf.shape(diff)[0], -1])
    width = tf.cast(tf.shape(diff)[1], dtype)
    each = tf.ones_like(diff) * (tf.constant(term.weight, dtype) / width) * scale
    if weight is not None:
        each = each * tf.reshape(tf.cast(weight, dtype), [-1, 1])
    return diff, each


def residual_rows(terms, y, y_pred, sample_weight, dtype, double=None):
    """The step residuals [B, m] (example ``i``'s row; each output's block in
    turn) of outputs that are all squared or robust."""
    double = squared_factor(terms) if double is None else double
    rows = []
    for term, (y_t, y_p, w) in zip(terms, _selected(terms, y, y_pred, sample_weight)):
        diff, weights = _block(term, y_t, y_p, w, dtype, 1.0)
        if term.family == "squared":
            rows.append(diff * tf.sqrt(double * weights))
        else:
            flat = term.robust.scale(tf.reshape(diff, [-1]), tf.reshape(weights, [-1]))
            rows.append(tf.reshape(flat, tf.shape(diff)))
    return rows[0] if len(rows) == 1 else tf.concat(rows, axis=1)


def residual_cost(terms, y, y_pred, sample_weight, dtype, double=None):
    """The summed loss `residual_rows` linearises (robust blocks at their
    own cost, not ``0.5 |r|^2``)."""
    double = squared_factor(terms) if double is None else double
    costs = []
    for term, (y_t, y_p, w) in zip(terms, _selected(terms, y, y_pred, sample_weight)):
        diff, weights = _block(term, y_t, y_p, w, dtype, 1.0)
        if term.family == "squared":
            costs.append(half_sum_sq(diff * tf.sqrt(double * weights), dtype))
        else:
            costs.append(term.robust.cost(tf.reshape(diff, [-1]),
                                          tf.reshape(weights, [-1])))
    return tf.add_n(costs)


def output_rows(terms, y_pred, dtype):
    """Every output with a loss as ``[B, d_k]`` side by side: ``[B, m]``."""
    rows = [tf.cast(tf.reshape(y_p, [tf.shape(y_p)[0], -1]), dtype)
            for y_p in y_pred]
    return rows[0] if len(rows) == 1 else tf.concat(rows, axis=1)


def selected_outputs(terms, y, y_pred, sample_weight):
    """``(predictions, targets, sample weights)`` per output, as lists."""
    picked = _selected(terms, y, y_pred, sample_weight)
    return ([p[1] for p in picked], [p[0] for p in picked], [p[2] for p in picked])


def ggn_terms(terms, outputs, widths, targets, weights, example_scale, dtype):
    """`ggn.OutputTerms` of every output (``outputs`` [B, m], the blocks'
    ``widths``): cross-entropies as GGN blocks, squared and robust outputs as
    residual blocks (``h = s^2``, ``g = s r``), each example weighted by
    ``w_i * example_scale`` (1 / the global batch: Keras's mean)."""
    blocks = tf.split(outputs, widths, axis=1) if len(widths) > 1 else [outputs]
    double = squared_factor(terms)
    cost, g, h_diag, outer = [], [], [], []
    for term, z, y_t, w in zip(terms, blocks, targets, weights):
        scale = tf.cast(example_scale, dtype)
        if term.family == "cross_entropy":
            ew = tf.ones([tf.shape(z)[0]], dtype) if w is None else tf.cast(
                tf.reshape(w, [-1]), dtype)
            t = ggn_lib.cross_entropy_terms(
                term.cross_entropy, term.from_logits, z, y_t,
                ew * scale * term.weight, dtype)
        else:
            diff, each = _block(term, y_t, z, w, dtype, scale)
            if term.family == "squared":
                root = tf.sqrt(double * each)
                t = ggn_lib.residual_terms(root * diff, root)
            else:
                flat = tf.reshape(diff, [-1])
                f_factor, j_factor = term.robust.weights(flat)
                root = tf.sqrt(tf.reshape(each, [-1]))
                t = ggn_lib.residual_terms(
                    tf.reshape(root * f_factor * flat, tf.shape(diff)),
                    tf.reshape(root * j_factor, tf.shape(diff)),
                    cost=term.robust.cost(flat, tf.reshape(each, [-1])))
        cost.append(t.cost)
        g.append(t.g)
        h_diag.append(t.h_diag)
        outer.append(t.h_outer)
    padded = []
    for k, block_outer in enumerate(outer):
        for h in block_outer:
            padded.append(tf.concat(
                [tf.zeros_like(b) if j != k else h for j, b in enumerate(g)], axis=1)
                if len(g) > 1 else h)
    join = (lambda parts: parts[0]) if len(g) == 1 else (
        lambda parts: tf.concat(parts, axis=1))
    return ggn_lib.OutputTerms(tf.add_n(cost), join(g), join(h_diag), tuple(padded))


def widths_of(y_pred):
    """Each output's width ``d_k`` (static where known)."""
    out = []
    for y_p in y_pred:
        static = y_p.shape[1:].num_elements()
        out.append(static if static is not None
                   else tf.reduce_prod(tf.shape(y_p)[1:]))
    return out


def half_sum_sq(residuals, dtype):
    r = tf.cast(tf.reshape(residuals, [-1]), dtype)
    return 0.5 * tf.reduce_sum(tf.square(r))
