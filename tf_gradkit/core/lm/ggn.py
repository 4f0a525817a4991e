"""Generalised Gauss-Newton linearisation for cross-entropy losses.

For a loss ``l(z)`` convex in the network output ``z`` the generalised
Gauss-Newton matrix ``G = J^T H J`` (``J`` = d z / d params, ``H`` = the loss's
Hessian in ``z``) is positive semi-definite and plays the role of ``J^T J`` in
Levenberg-Marquardt; the gradient ``J^T g`` (``g`` = d l / d z) plays ``J^T r``.
The LM step, its gain ratio and its retries need nothing else, so
classification uses the same compiled step as least squares.

Per example, with logits ``z``:

- softmax cross-entropy: ``g = p - y``, ``H = diag(p) - p p^T``;
- sigmoid cross-entropy: ``g = p - y``, ``H = diag(p (1 - p))``;

and with probabilities ``q`` as the output (no logits): ``g = -y / q`` and
``H = diag(y / q^2)`` for the categorical loss, and the per-output Bernoulli
terms for the binary one.

Several outputs, or a cross-entropy beside squared and robust outputs, are one
sum: each output's terms in its own columns of ``z`` (`OutputTerms`), a
residual output's ``H`` its residual weights squared and ``g`` their product
with the residuals (`residual_terms`), so ``J^T H J`` and ``J^T g`` cover
every output at once (`linearize_terms`).

Reference: N. Schraudolph, "Fast curvature matrix-vector products for
second-order gradient descent", Neural Computation 14(7), 2002.
"""

from typing import NamedTuple, Sequence

import tensorflow as tf

from tf_gradkit.core import precision
from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit.core.lm.linear_solvers import Linearization

LOSSES = ("categorical", "sparse_categorical", "binary")


def _per_example_terms(kind, from_logits, outputs, targets, weights, eps):
    """Per-example loss, gradient ``g`` [B, C] and a factor of ``H``.

    Returns (loss [B], g [B, C], h_diag [B, C], h_outer [B, C] or None) with
    ``H = diag(h_diag) - h_outer h_outer^T`` per example.
    """
    c = tf.cast(tf.shape(outputs)[-1], outputs.dtype)
    if kind == "sparse_categorical":
        targets = tf.one_hot(tf.cast(tf.reshape(targets, [-1]), tf.int32),
                             tf.shape(outputs)[-1], dtype=outputs.dtype)
    targets = tf.cast(tf.reshape(targets, tf.shape(outputs)), outputs.dtype)
    w = weights[:, None]
    if kind == "binary":
        if from_logits:
            p = tf.sigmoid(outputs)
            loss = tf.nn.sigmoid_cross_entropy_with_logits(targets, outputs)
            return (tf.reduce_mean(loss, -1) * weights, w * (p - targets) / c,
                    w * p * (1 - p) / c, None)
        q = tf.clip_by_value(outputs, eps, 1 - eps)
        loss = -(targets * tf.math.log(q) + (1 - targets) * tf.math.log(1 - q))
        g = -targets / q + (1 - targets) / (1 - q)
        h = targets / q ** 2 + (1 - targets) / (1 - q) ** 2
        return tf.reduce_mean(loss, -1) * weights, w * g / c, w * h / c, None
    if from_logits:
        p = tf.nn.softmax(outputs)
        loss = tf.nn.softmax_cross_entropy_with_logits(targets, outputs)
        return loss * weights, w * (p - targets), w * p, tf.sqrt(w) * p
    q = tf.clip_by_value(outputs, eps, 1.0)
    loss = -tf.reduce_sum(targets * tf.math.log(q), -1)
    return loss * weights, w * (-targets / q), w * targets / q ** 2, None


class OutputTerms(NamedTuple):
    """The loss's terms in the network outputs ``z`` [B, m] (every output's
    columns side by side): ``cost`` (a scalar), its gradient ``g`` [B, m] in
    ``z``, and its Hessian in ``z`` per example as
    ``diag(h_diag) - sum_k h_k h_k^T`` (``h_outer``: the ``h_k`` [B, m],
    zero outside the columns of the output they belong to)."""

    cost: tf.Tensor
    g: tf.Tensor
    h_diag: tf.Tensor
    h_outer: Sequence[tf.Tensor] = ()


def cross_entropy_terms(kind, from_logits, outputs, targets, weights, dtype):
    """`OutputTerms` of one cross-entropy output [B, C] (weights [B])."""
    if kind not in LOSSES:
        raise ValueError(f"`kind` must be one of {LOSSES}. Received: {kind!r}")
    eps = 1e-7 if dtype == tf.float32 else 1e-15
    loss, g, h_diag, h_outer = _per_example_terms(
        kind, from_logits, outputs, targets, tf.cast(weights, dtype), eps)
    return OutputTerms(tf.reduce_sum(loss), g, h_diag,
                       () if h_outer is None else (h_outer,))


def residual_terms(values, factors, cost=None):
    """`OutputTerms` of residuals whose value is ``values`` and whose
    Jacobian is ``factors * dz`` (a squared or reweighted robust loss: its
    Gauss-Newton ``J^T J`` and ``J^T r`` are a GGN with ``h = factors^2``,
    ``g = factors * values``); ``cost`` defaults to ``0.5 |values|^2``."""
    if cost is None:
        cost = 0.5 * tf.reduce_sum(tf.square(values))
    return OutputTerms(cost, factors * values, tf.square(factors))


def linearize_terms(outputs, jac, batch, terms_fn):
    """The GGN `Linearization` of a loss given by its terms in the outputs.

    Args:
      outputs: the flat outputs [B*m] (example-major).
      jac: their Jacobian [B*m, P].
      batch: ``B``.
      terms_fn: ``terms_fn(outputs [B, m]) -> OutputTerms``.

    Returns:
      A `Linearization` with ``jtj = sum_i J_i^T H_i J_i`` and
      ``jtr = sum_i J_i^T g_i``.
    """
    outputs = tf.reshape(outputs, [batch, -1])                  # [B, m]
    jac = tf.reshape(jac, [batch, tf.shape(outputs)[1], -1])    # [B, m, P]
    terms = terms_fn(outputs)
    # sum over examples and outputs of J^T diag(h) J, as one [B*m, P] product
    # (through `precision`: TF32 would round J to 10 bits here).
    rows = tf.reshape(jac, [-1, tf.shape(jac)[-1]])
    ggn = precision.matmul(rows, tf.reshape(terms.h_diag, [-1])[:, None] * rows,
                           transpose_a=True)
    for h_outer in terms.h_outer:
        v = tf.reduce_sum(h_outer[:, :, None] * jac, axis=1)    # h^T J per example
        ggn -= precision.gram(v)
    grad = tf.reduce_sum(terms.g[:, :, None] * jac, axis=[0, 1])
    return Linearization(cost=terms.cost, jtj=ggn, jtr=grad)


def linearize_cross_entropy(output_fn, targets, weights, variables, kind,
                            from_logits, dtype, support=None,
                            outputs_and_jacobian=None):
    """GGN linearisation of a (weighted, summed) cross-entropy.

    Args:
      output_fn: zero-argument callable returning the model output [B, C].
      targets: labels (one-hot, class ids for "sparse_categorical", or 0/1).
      weights: per-example weights [B] (mean reduction: pass 1/B).
      variables: the parameters.
      kind: one of `LOSSES`.
      from_logits: whether the output is logits.
      dtype: the solve's dtype.
      support: optional `linearize.Support` (only those parameters).
      outputs_and_jacobian: optional zero-argument callable returning the
        flat outputs [B*C] and their Jacobian [B*C, k] (over ``support``),
        formed another way (layer taps); ``output_fn`` is then not called.

    Returns:
      A `Linearization` with ``cost`` = the weighted loss sum, ``jtj`` = G and
      ``jtr`` = the gradient.
    """
    if kind not in LOSSES:
        raise ValueError(f"`kind` must be one of {LOSSES}. Received: {kind!r}")
    if outputs_and_jacobian is not None:
        outputs, jac = outputs_and_jacobian()
    else:
        outputs, jac = lin_lib.residuals_and_jacobian(output_fn, variables, dtype,
                                                      support=support)
    return linearize_terms(
        outputs, jac, tf.shape(weights)[0],
        lambda z: cross_entropy_terms(kind, from_logits, z, targets, weights, dtype))


def cross_entropy_cost(outputs, targets, weights, kind, from_logits, dtype):
    """The weighted loss sum that `linearize_cross_entropy` linearises."""
    outputs = tf.cast(outputs, dtype)
    eps = 1e-7 if dtype == tf.float32 else 1e-15
    loss, _, _, _ = _per_example_terms(kind, from_logits, outputs, targets,
                                       tf.cast(weights, dtype), eps)
    return tf.reduce_sum(loss)
