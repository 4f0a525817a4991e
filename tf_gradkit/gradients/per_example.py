"""Per-example gradients, and per-example gradient norms without them.

`per_example_gradients` vectorises one-example gradient tapes with
``tf.vectorized_map`` (no Python loop): memory ``B x P``.

`per_example_gradient_norms` never forms them. One forward pass taps every
supported layer's input and pre-activation output, one backward pass of the
*summed* per-example losses gives each example's output gradient ``g_i``,
and each layer kind's rule (`norm_rules`, math in `core.ghost_norms`)
turns ``(a_i, g_i)`` into ``||dL_i/dW||^2`` for Dense, Conv1D/Conv2D,
Embedding, LayerNormalization and BatchNormalization at inference. Its
memory is the activations plus ``B`` numbers per variable; its cost is
about one backward pass. This is what DP-SGD needs to clip
(docs/gradients.md, examples/dp_sgd.py).

Trainable variables that no rule covers are refused (naming their layers),
not silently computed another way: the caller chooses between
`per_example_gradients` for such a model (memory ``B x P``) and freezing
or replacing the layer.
"""

import contextlib

import tensorflow as tf

from tf_gradkit import _layer_taps as _taps
from tf_gradkit.gradients.norm_rules import RULES

__all__ = ["per_example_gradients", "per_example_gradient_norms"]


def per_example_gradients(loss_fn, variables, batch):
    """The gradient of ``loss_fn`` for each example of ``batch``, vectorised.

    Args:
      loss_fn: ``loss_fn(example) -> scalar``, where ``example`` is
        ``batch``'s structure (a tensor, tuple or dict) sliced to ONE example
        with its batch axis kept (size 1), so a Keras model can be called
        on it as is: ``lambda e: loss(e[1], model(e[0]))``.
      variables: the variables to differentiate (e.g.
        ``model.trainable_variables``).
      batch: tensors with a leading batch axis ``B``.

    Returns:
      A list with one ``[B, *variable.shape]`` tensor per variable (zeros
      where an example's loss does not depend on a variable).

    The examples run through ``tf.vectorized_map`` as one batched
    computation, eagerly, in ``tf.function`` and under XLA. Layers whose
    ops have no vectorised form fall back to a ``tf.while_loop`` inside it
    (TensorFlow warns then). Layers that mix examples (BatchNormalization in
    training) see one example at a time here, as in a loop of tapes.

    Example:

    >>> import tensorflow as tf
    >>> w = tf.Variable([[1.0], [2.0]])
    >>> x = tf.constant([[1.0, 0.0], [0.0, 3.0]])
    >>> grads = per_example_gradients(lambda xi: tf.reduce_sum(xi @ w), [w], x)
    >>> grads[0][:, :, 0].numpy().tolist()
    [[1.0, 0.0], [0.0, 3.0]]
    """
    variables = list(variables)
    if not variables:
        raise ValueError("per_example_gradients: `variables` is empty; pass what "
                         "to differentiate, e.g. model.trainable_variables.")

    def one(example):
        example = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), example)
        with tf.GradientTape() as tape:
            loss = loss_fn(example)
        grads = tape.gradient(loss, variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]

    return tf.vectorized_map(one, batch)


def per_example_gradient_norms(model, loss_fn, x, y, sample_weight=None,
                               training=True, per_layer=False,
                               per_variable=False):
    """``||dL_i/dtheta||`` for each example, without per-example gradients.

    Valid only when the examples of the batch do not interact in the
    forward pass: then example ``i``'s rows of each layer's output gradient,
    taken from the *sum* of the per-example losses, are ``dL_i/dz_i``.

    Args:
      model: a Keras model (either flavour) whose trainable layers are
        Dense, Conv1D, Conv2D (channels last, ``groups=1``), Embedding,
        LayerNormalization or BatchNormalization (only with
        ``training=False``), possibly nested or shared. Other trainable
        layers are refused (use `per_example_gradients`).
      loss_fn: ``loss_fn(y, y_pred) -> [B]`` (or ``[B, ...]``, summed per
        example): per-example losses, e.g. a Keras loss built with
        ``reduction="none"``.
      x, y: the batch.
      sample_weight: optional ``[B]`` weights multiplying each example's loss.
      training: passed to the model (dropout stays per example).
      per_layer: also return ``{layer name: [B] norms}``.
      per_variable: also return a list of ``[B]`` norms, one per variable of
        ``model.trainable_variables``, in that order.

    Returns:
      ``[B]`` norms over all trainable variables of the model; with
      ``per_layer`` and/or ``per_variable``, a tuple ``(norms, by_layer)``,
      ``(norms, by_variable)`` or ``(norms, by_layer, by_variable)``.

    Raises:
      ValueError: trainable variables that no rule covers (naming their
        layers and why), e.g. a BatchNormalization with ``training=True``.

    Example:

    >>> import tensorflow as tf
    >>> K = tf.keras
    >>> model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
    >>> loss = K.losses.MeanSquaredError(reduction="none")
    >>> per_example_gradient_norms(model, loss, tf.ones([4, 3]), tf.zeros([4, 2])).shape
    TensorShape([4])
    """
    plan = _plan(model, training)
    records = {id(layer): [] for layer, _ in plan}
    with _Taps(plan, records):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=training)
            losses = tf.convert_to_tensor(loss_fn(y, y_pred))
            if losses.shape.rank and losses.shape.rank > 1:
                losses = tf.reduce_sum(losses, list(range(1, losses.shape.rank)))
            if sample_weight is not None:
                losses = losses * tf.cast(tf.reshape(sample_weight, [-1]), losses.dtype)
            total = tf.reduce_sum(losses)
        outputs = [r["output"] for layer, _ in plan for r in records[id(layer)]]
        grads = tape.gradient(total, outputs,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    grads = iter(grads)
    trainable = {id(v) for v in model.trainable_variables}
    by_id, by_layer = {}, {}
    for layer, rule in plan:
        calls = [(r, next(grads)) for r in records[id(layer)]]
        if not calls:  # not called in this forward pass: zero gradients
            continue
        layer_sq = []
        for variable, sq in zip(rule.variables(layer), rule.sq_norms(layer, calls)):
            if id(variable) in trainable:
                by_id[id(variable)] = by_id.get(id(variable), 0.0) + sq
                layer_sq.append(sq)
        if layer_sq:
            by_layer[layer.name] = tf.sqrt(tf.add_n(layer_sq))
    batch = tf.shape(tf.nest.flatten(x)[0])[0]
    squared = list(by_id.values())
    norms = tf.sqrt(tf.add_n(squared)) if squared else tf.zeros([batch])
    extra = []
    if per_layer:
        extra.append(by_layer)
    if per_variable:
        extra.append([tf.sqrt(by_id[id(v)]) if id(v) in by_id else
                      tf.zeros_like(norms) for v in model.trainable_variables])
    return (norms, *extra) if extra else norms


def _plan(model, training):
    """``[(layer, rule)]`` for the layers whose taps and rules give every
    trainable variable's norms; refuses (naming the layers) if some are left."""
    kinds = _taps.layer_kinds(model, "per_example_gradient_norms")
    plan, covered, refused = [], set(), {}
    for layer in _taps.flat_layers(model):
        if not layer.trainable or not layer.trainable_weights:
            continue
        rule = RULES.get(_taps.kind_of(layer, kinds))
        if rule is None:
            continue
        why_not = rule.supports(layer, training)
        if why_not:
            refused[layer.name] = why_not
            continue
        plan.append((layer, rule))
        covered.update(id(v) for v in rule.variables(layer))
    missing = [v for v in model.trainable_variables if id(v) not in covered]
    if missing:
        owners = sorted({_owner(model, v) for v in missing})
        reasons = "".join(f" {name}: {refused[name]}." for name in owners
                          if name in refused)
        raise ValueError(
            "per_example_gradient_norms: no per-example norm rule for the "
            f"trainable variables of layer(s) {owners}.{reasons} Rules exist for "
            "Dense, Conv1D/Conv2D (channels_last, groups=1), Embedding, "
            "LayerNormalization and BatchNormalization with training=False; for "
            "other layers use per_example_gradients (vectorised, memory B x "
            "parameters), or freeze them (layer.trainable = False).")
    return plan


def _owner(model, variable):
    """The name of the innermost layer holding ``variable``."""
    for layer in _taps.flat_layers(model):
        if not getattr(layer, "layers", None) and any(
                w is variable for w in layer.trainable_weights):
            return layer.name
    return getattr(variable, "path", getattr(variable, "name", "?"))


class _Taps:
    """Installs the taps each rule asks for (and removes them)."""

    def __init__(self, plan, records):
        self.plan, self.records, self._stack = plan, records, None

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        for layer, rule in self.plan:
            log = self.records[id(layer)]
            if rule.tap == "pre_activation":
                def on_call(inputs, outputs, log=log):
                    log[-1]["input"] = inputs
                    return outputs

                def on_pre(z, log=log):
                    log.append({"output": z})
                    return z

                # The pre-activation tap runs inside call, before on_call.
                self._stack.enter_context(_taps.tapped(layer, on_call, on_pre))
            else:
                def on_call(inputs, outputs, log=log):
                    log.append({"input": inputs, "output": outputs})
                    return outputs

                self._stack.enter_context(_taps.tapped(layer, on_call))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)
