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

A layer gets its kind's rule only where the rule is provably right for it
(the kind's class or a subclass changing only its construction, inside
Sequential/functional models only, with variables no other layer holds, in
a model running no code of its own: no Lambda, op layer, custom layer or
Keras 3 raw op, any of which may read a variable through a closure);
other layers of those kinds get their per-example gradients exactly (a
vectorised Jacobian of the per-example losses, ``B x`` their parameters),
with a warning naming them, or are refused (``fallback="refuse"``).
`per_example_norm_plan` says which, per layer. Trainable variables that no
rule covers are refused (naming their layers): the caller chooses between
`per_example_gradients` for such a model (memory ``B x P``) and freezing
or replacing the layer.
"""

import contextlib
import warnings
from typing import NamedTuple

import tensorflow as tf

from tf_gradkit import _layer_taps as _taps
from tf_gradkit.core import ghost_norms
from tf_gradkit.gradients.norm_rules import RULES

__all__ = ["per_example_gradients", "per_example_gradient_norms",
           "per_example_norm_plan"]


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
                               per_variable=False, fallback="exact"):
    """``||dL_i/dtheta||`` for each example, without per-example gradients.

    Valid only when the examples of the batch do not interact in the
    forward pass: then example ``i``'s rows of each layer's output gradient,
    taken from the *sum* of the per-example losses, are ``dL_i/dz_i``.

    A layer gets its kind's ghost rule only where the rule is provably
    right for it (`per_example_norm_plan` says which rule each layer gets):
    it is the kind's Keras class, or a subclass changing nothing but
    ``__init__``/``get_config`` (a subclass overriding ``call`` feeds the
    matmul something else than the tap records); every model it sits in is a
    Sequential or functional model (a ``call`` of a model's own could reorder
    or merge the examples' rows); no other layer holds its variables
    (tied weights: the rule would miss the other use); and the model runs no
    code of its own (a Lambda, a tf_keras op layer, a custom layer, a kind's
    subclass overriding ``call`` or a Keras 3 raw op between layers may read
    any variable through a closure: then every layer falls back). Other layers of
    those kinds get their per-example gradients exactly (``fallback="exact"``,
    a vectorised Jacobian of the per-example losses, memory ``B x`` their
    parameters, with a warning naming them) or are refused
    (``fallback="refuse"``).

    Args:
      model: a Keras model (either flavour) whose trainable layers are
        Dense, Conv1D, Conv2D (channels last, ``groups=1``), Embedding
        (dense or ragged ids), LayerNormalization or BatchNormalization
        (only with ``training=False``), possibly nested or shared. Other
        trainable layers are refused (use `per_example_gradients`).
      loss_fn: ``loss_fn(y, y_pred) -> [B]`` (or ``[B, ...]``, summed per
        example): per-example losses, e.g. a Keras loss built with
        ``reduction="none"``.
      x, y: the batch.
      sample_weight: optional ``[B]`` weights multiplying each example's loss.
      training: passed to the model (dropout stays per example).
      per_layer: also return ``{layer name: [B] norms}``.
      per_variable: also return a list of ``[B]`` norms, one per variable of
        ``model.trainable_variables``, in that order.
      fallback: ``"exact"`` (default) or ``"refuse"``: what happens to a
        layer of a covered kind whose ghost rule is not provably right.

    Returns:
      ``[B]`` norms over all trainable variables of the model; with
      ``per_layer`` and/or ``per_variable``, a tuple ``(norms, by_layer)``,
      ``(norms, by_variable)`` or ``(norms, by_layer, by_variable)``.

    Raises:
      ValueError: trainable variables that no rule covers (naming their
        layers and why), e.g. a BatchNormalization with ``training=True``
        (given here or to its call in a functional model);
        a ragged or sparse input to a layer other than an Embedding.

    Warns:
      UserWarning: naming the layers computed by the exact fallback.

    Example:

    >>> import tensorflow as tf
    >>> K = tf.keras
    >>> model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
    >>> loss = K.losses.MeanSquaredError(reduction="none")
    >>> per_example_gradient_norms(model, loss, tf.ones([4, 3]), tf.zeros([4, 2])).shape
    TensorShape([4])
    """
    plan = _plan(model, training, fallback)
    if plan.exact:
        by_why = {}
        for name, why in plan.exact.items():
            by_why.setdefault(why, []).append(name)
        warnings.warn(
            "per_example_gradient_norms: exact per-example gradients (memory B x "
            "their parameters) instead of a ghost rule for " + "; ".join(
                f"{names}: {why}" for why, names in by_why.items()),
            stacklevel=2)
    records = {id(layer): [] for layer, _ in plan.ghost}
    with _Taps(plan.ghost, records):
        with tf.GradientTape(persistent=bool(plan.exact_variables)) as tape:
            y_pred = model(x, training=training)
            losses = tf.convert_to_tensor(loss_fn(y, y_pred))
            if losses.shape.rank and losses.shape.rank > 1:
                losses = tf.reduce_sum(losses, list(range(1, losses.shape.rank)))
            if sample_weight is not None:
                losses = losses * tf.cast(tf.reshape(sample_weight, [-1]), losses.dtype)
            total = tf.reduce_sum(losses)
        outputs = [r["output"] for layer, _ in plan.ghost for r in records[id(layer)]]
        zero = tf.UnconnectedGradients.ZERO
        grads = tape.gradient(total, outputs, unconnected_gradients=zero)
        exact = []
        if plan.exact_variables:
            exact = tape.jacobian(losses, plan.exact_variables,
                                  unconnected_gradients=zero, experimental_use_pfor=True)
    grads = iter(grads)
    trainable = {id(v) for v in model.trainable_variables}
    by_id, by_layer = {}, {}
    for layer, rule in plan.ghost:
        calls = [(r, tf.convert_to_tensor(next(grads))) for r in records[id(layer)]]
        if not calls:  # not called in this forward pass: zero gradients
            continue
        layer_sq = []
        for variable, sq in zip(rule.variables(layer), rule.sq_norms(layer, calls)):
            if id(variable) in trainable:
                by_id[id(variable)] = by_id.get(id(variable), 0.0) + sq
                layer_sq.append(sq)
        if layer_sq:
            by_layer[layer.name] = tf.sqrt(tf.add_n(layer_sq))
    for variable, jac in zip(plan.exact_variables, exact):
        by_id[id(variable)] = ghost_norms.sq_norms(tf.convert_to_tensor(jac))
    for name, variables in plan.exact_layers.items():
        if variables:
            by_layer[name] = tf.sqrt(tf.add_n([by_id[id(v)] for v in variables]))
    squared = list(by_id.values())
    norms = tf.sqrt(tf.add_n(squared)) if squared else tf.zeros_like(losses)
    extra = []
    if per_layer:
        extra.append(by_layer)
    if per_variable:
        extra.append([tf.sqrt(by_id[id(v)]) if id(v) in by_id else
                      tf.zeros_like(norms) for v in model.trainable_variables])
    return (norms, *extra) if extra else norms


def per_example_norm_plan(model, training=True, fallback="exact"):
    """How `per_example_gradient_norms` treats each trainable layer of
    ``model``: ``{layer name: "ghost rule"}`` or ``{layer name: "exact
    fallback: <why>"}``; raises the same ValueError as the norms for a
    model they refuse.

    Example:

    >>> import tensorflow as tf
    >>> K = tf.keras
    >>> class Scaled(K.layers.Dense):
    ...     def call(self, x):
    ...         return super().call(2.0 * x)
    >>> model = K.Sequential([K.Input((3,)), K.layers.Dense(2, name="d"),
    ...                       Scaled(1, name="s")])
    >>> plan = per_example_norm_plan(model)  # s's own code may read d's kernel too
    >>> plan["d"].split(":")[0], plan["s"].split(":")[0]
    ('exact fallback', 'exact fallback')
    >>> per_example_norm_plan(K.Sequential([K.Input((3,)), K.layers.Dense(2, name="d")]))
    {'d': 'ghost rule'}
    """
    plan = _plan(model, training, fallback)
    out = {layer.name: "ghost rule" for layer, _ in plan.ghost}
    out.update({name: f"exact fallback: {why}" for name, why in plan.exact.items()})
    return out


class _Plan(NamedTuple):
    ghost: list            # [(layer, rule)]: layers computed by their ghost rule
    exact: dict            # layer name -> why it is computed exactly
    exact_layers: dict     # layer name -> its trainable variables
    exact_variables: list  # those variables, once each


def _plan(model, training, fallback):
    """The `_Plan` whose ghost rules and exact fallbacks give every
    trainable variable's norms; refuses (naming the layers) if some are left."""
    if fallback not in ("exact", "refuse"):
        raise ValueError("per_example_gradient_norms: `fallback` must be 'exact' "
                         f"or 'refuse'. Received: fallback={fallback!r}")
    owner = "per_example_gradient_norms"
    kinds = _taps.layer_kinds(model, owner)
    layers = _taps.flat_layers(model)
    # Code of the model's own (a Lambda, a raw op, a custom layer, a call
    # override) may read any variable, e.g. a table tied through a closure:
    # no rule is then provably right, for any layer (one shared check with
    # LevenbergMarquardt's taps: `_layer_taps.unproven_reason`).
    whole = _taps.unproven_reason(model, kinds)
    tied = _taps.shared_variables(layers)
    trainable = {id(v) for v in model.trainable_variables}
    plan = _Plan([], {}, {}, [])
    covered, refused = set(), {}
    for layer in layers:
        if (not layer.trainable or not layer.trainable_weights
                or getattr(layer, "layers", None) is not None):
            continue
        rule = RULES.get(_taps.kind_of(layer, kinds))
        if rule is None:
            continue
        # A functional `bn(x, training=True)` runs in training whatever the
        # model is given: the rule must see the mode the layer runs in.
        explicit = not training and _taps.explicit_training(layer, owner)
        why_not = rule.supports(layer, bool(training) or explicit)
        if why_not:
            refused[layer.name] = (
                "its call in the model is given training=True, which overrides the "
                f"training=False given here; {why_not}" if explicit else why_not)
            continue
        why = _taps.provable_kind(layer, kinds)[1] or whole
        shared = [v for v in layer.trainable_weights if id(v) in tied]
        if why is None and shared:
            why = (f"its variable(s) {[_path(v) for v in shared]} are held by another "
                   "layer too (tied weights), whose use its rule would not see")
        if why is None:
            plan.ghost.append((layer, rule))
            covered.update(id(v) for v in rule.variables(layer))
        elif fallback == "refuse":
            refused[layer.name] = (f"{why}; fallback='exact' computes its per-example "
                                   "gradients exactly (memory B x its parameters)")
        else:
            mine = [v for v in layer.trainable_weights if id(v) in trainable]
            plan.exact[layer.name] = why
            plan.exact_layers[layer.name] = mine
            for v in mine:
                if id(v) not in covered:
                    plan.exact_variables.append(v)
            covered.update(id(v) for v in mine)
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
    # A variable a ghost rule covers must not also be computed exactly.
    assert not {id(v) for v in plan.exact_variables} & {
        id(v) for layer, rule in plan.ghost for v in rule.variables(layer)}
    return plan


def _path(variable):
    return getattr(variable, "path", None) or getattr(variable, "name", "?")


def _owner(model, variable):
    """The name of the innermost layer holding ``variable``."""
    for layer in _taps.flat_layers(model):
        if not getattr(layer, "layers", None) and any(
                w is variable for w in layer.trainable_weights):
            return layer.name
    return _path(variable)


class _Taps:
    """Installs the taps each rule asks for (and removes them). A ragged
    input is taken only by a rule that says ``ragged`` (Embedding's), which
    gets the output's flat values to differentiate; any other composite
    input (ragged, sparse) is refused, naming the layer."""

    def __init__(self, plan, records):
        self.plan, self.records, self._stack = plan, records, None

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        for layer, rule in self.plan:
            log = self.records[id(layer)]
            ragged = getattr(rule, "ragged", False)
            if rule.tap == "pre_activation":
                def on_call(inputs, outputs, log=log, layer=layer):
                    _check_dense_input(layer, inputs, False)
                    log[-1]["input"] = inputs
                    return outputs

                def on_pre(z, log=log):
                    log.append({"output": z})
                    return z

                # The pre-activation tap runs inside call, before on_call.
                self._stack.enter_context(_taps.tapped(layer, on_call, on_pre))
            else:
                def on_call(inputs, outputs, log=log, layer=layer, ragged=ragged):
                    _check_dense_input(layer, inputs, ragged)
                    tapped = outputs
                    if isinstance(inputs, tf.RaggedTensor):
                        if not isinstance(outputs, tf.RaggedTensor):
                            _check_dense_input(layer, inputs, False)
                        tapped = outputs.flat_values
                    log.append({"input": inputs, "output": tapped})
                    return outputs

                self._stack.enter_context(_taps.tapped(layer, on_call))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


def _check_dense_input(layer, inputs, ragged_ok):
    if isinstance(inputs, tf.RaggedTensor) and ragged_ok:
        return
    if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
        raise ValueError(
            f"per_example_gradient_norms: layer {layer.name!r} received a "
            f"{type(inputs).__name__} input; its norm rule takes dense tensors "
            "(ragged ones only for an Embedding's ids). Densify the input (e.g. "
            "`.to_tensor()`, with a mask) or use per_example_gradients.")
