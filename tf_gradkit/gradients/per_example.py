"""Per-example gradients, and per-example gradient norms without them.

`per_example_gradients` vectorises one-example gradient tapes with
``tf.vectorized_map`` (no Python loop): memory ``B x P``.

`per_example_gradient_norms` never forms them. One forward pass taps every
supported layer's input and pre-activation output, one backward pass of the
*summed* per-example losses gives each example's output gradient ``g_i``,
and `core.ghost_norms` turns ``(a_i, g_i)`` into ``||dL_i/dW||^2`` for
Dense, Conv1D/Conv2D, Embedding and LayerNormalization. Its memory is the
activations plus ``B`` numbers per layer; its cost is about one backward
pass. This is what DP-SGD needs to clip (docs/gradients.md, examples/dp_sgd.py).
"""

import contextlib

import tensorflow as tf

from tf_gradkit.core import ghost_norms
from tf_gradkit import _layer_taps as _taps

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
                               training=True, per_layer=False):
    """``||dL_i/dtheta||`` for each example, without per-example gradients.

    Args:
      model: a Keras model (either flavour) whose trainable layers are
        Dense, Conv1D, Conv2D (channels last, ``groups=1``), Embedding or
        LayerNormalization, possibly nested. Other trainable layers are
        refused (use `per_example_gradients`).
      loss_fn: ``loss_fn(y, y_pred) -> [B]`` (or ``[B, ...]``, summed per
        example): per-example losses, e.g. a Keras loss built with
        ``reduction="none"``.
      x, y: the batch.
      sample_weight: optional ``[B]`` weights multiplying each example's loss.
      training: passed to the model (dropout stays per example; a
        BatchNormalization in training mode mixes examples and is refused).
      per_layer: also return ``{layer name: [B] norms}``.

    Returns:
      ``[B]`` norms over all trainable variables of the model (and the
      per-layer dict when ``per_layer``).

    Raises:
      ValueError: a trainable variable that no rule covers, naming its layer.
    """
    kinds = _taps.layer_kinds()
    rules, covered = [], set()
    for layer in _taps.flat_layers(model):
        if not layer.trainable or not layer.trainable_weights:
            continue
        kind = _taps.kind_of(layer, kinds)
        if kind in RULES and not (kind == "batch_norm"):
            if kind == "conv" and not _conv_supported(layer):
                continue
            rules.append((layer, kind))
            covered.update(id(_ref(v)) for v in layer.trainable_weights)
    missing = [v for v in model.trainable_variables if id(_ref(v)) not in covered]
    if missing:
        owners = sorted({_owner(model, v) for v in missing})
        hint = (" BatchNormalization mixes the examples of a batch in training, so "
                "no example has a gradient of its own: pass training=False or use "
                "LayerNormalization/GroupNormalization." if any(
                    _taps.kind_of(layer, kinds) == "batch_norm"
                    for layer in _taps.flat_layers(model) if layer.name in owners)
                else "")
        raise ValueError(
            "per_example_gradient_norms: no per-example norm rule for the "
            f"trainable variables of layer(s) {owners}. Rules exist for Dense, "
            "Conv1D/Conv2D (channels_last, groups=1), Embedding and "
            "LayerNormalization; for other layers use per_example_gradients "
            f"(vectorised, memory B x parameters).{hint}")
    records = {id(layer): [] for layer, _ in rules}
    with _Taps(rules, records):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=training)
            losses = tf.convert_to_tensor(loss_fn(y, y_pred))
            if losses.shape.rank and losses.shape.rank > 1:
                losses = tf.reduce_sum(losses, list(range(1, losses.shape.rank)))
            if sample_weight is not None:
                losses = losses * tf.cast(tf.reshape(sample_weight, [-1]), losses.dtype)
            total = tf.reduce_sum(losses)
        outputs = [r["output"] for layer, _ in rules for r in records[id(layer)]]
        grads = tape.gradient(total, outputs,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    grads = iter(grads)
    squared, by_layer = [], {}
    for layer, kind in rules:
        calls = [(r, next(grads)) for r in records[id(layer)]]
        if not calls:
            continue
        sq = RULES[kind](layer, calls)
        squared.append(sq)
        by_layer[layer.name] = tf.sqrt(sq)
    norms = tf.sqrt(tf.add_n(squared)) if squared else tf.zeros(
        [tf.shape(tf.nest.flatten(x)[0])[0]])
    return (norms, by_layer) if per_layer else norms


def _ref(v):
    return getattr(v, "value", v) if not isinstance(v, tf.Variable) else v


def _owner(model, variable):
    for layer in _taps.flat_layers(model):
        if any(_ref(w) is _ref(variable) for w in layer.trainable_weights) and not \
                getattr(layer, "layers", None):
            return layer.name
    return getattr(variable, "path", getattr(variable, "name", "?"))


def _conv_supported(layer):
    return (getattr(layer, "groups", 1) == 1
            and getattr(layer, "data_format", "channels_last") == "channels_last")


class _Taps:
    """Installs the taps of every rule's layer (and removes them)."""

    def __init__(self, rules, records):
        self.rules, self.records, self._stack = rules, records, None

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        for layer, kind in self.rules:
            log = self.records[id(layer)]
            if kind in ("dense", "conv"):
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


def _dense(layer, calls):
    a = tf.concat([_rows(tf.convert_to_tensor(r["input"])) for r, _ in calls], 1)
    g = tf.concat([_rows(tf.cast(gz, a.dtype)) for _, gz in calls], 1)
    sq = ghost_norms.matmul_sq_norms(a, g)
    if getattr(layer, "use_bias", False):
        sq = sq + ghost_norms.bias_sq_norms(g)
    return sq


def _conv(layer, calls):
    patches, outs = [], []
    for record, gz in calls:
        inputs = tf.convert_to_tensor(record["input"])
        kernel, strides = tuple(layer.kernel_size), tuple(layer.strides)
        dilation, padding = tuple(layer.dilation_rate), layer.padding
        if len(kernel) == 1:  # Conv1D as a 1 x k Conv2D
            if padding == "causal":
                inputs = tf.pad(inputs, [[0, 0], [dilation[0] * (kernel[0] - 1), 0],
                                         [0, 0]])
                padding = "valid"
            inputs = inputs[:, None]
            kernel, strides, dilation = (1,) + kernel, (1,) + strides, (1,) + dilation
        patches.append(ghost_norms.conv_patches(inputs, kernel, strides, padding,
                                                dilation))
        outs.append(_rows(gz))
    a = tf.concat(patches, 1)
    g = tf.cast(tf.concat(outs, 1), a.dtype)
    sq = ghost_norms.matmul_sq_norms(a, g)
    if getattr(layer, "use_bias", False):
        sq = sq + ghost_norms.bias_sq_norms(g)
    return sq


def _embedding(layer, calls):
    ids = tf.concat([tf.reshape(r["input"], [tf.shape(r["input"])[0], -1])
                     for r, _ in calls], 1)
    g = tf.concat([_rows(gz) for _, gz in calls], 1)
    return ghost_norms.embedding_sq_norms(ids, tf.cast(g, tf.float32))


def _layer_norm(layer, calls):
    """y = gamma * xhat + beta: example i's gamma gradient is sum g_i xhat_i
    over the positions gamma is shared by, beta's sum g_i (summed over calls
    before squaring: a shared layer's gradients add)."""
    gammas, betas = [], []
    for record, gz in calls:
        inputs = tf.cast(tf.convert_to_tensor(record["input"]), tf.float32)
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        mean, var = tf.nn.moments(inputs, axes, keepdims=True)
        normalized = (inputs - mean) * tf.math.rsqrt(var + layer.epsilon)
        g = tf.cast(gz, tf.float32)
        rank = len(normalized.shape)
        axes = sorted(a % rank for a in axes)
        summed = [a for a in range(1, rank) if a not in axes]
        gammas.append(tf.reduce_sum(g * normalized, summed) if summed else g * normalized)
        betas.append(tf.reduce_sum(g, summed) if summed else g)
    flat = lambda t: tf.reshape(t, [tf.shape(t)[0], -1])  # noqa: E731
    sq = tf.zeros([tf.shape(gammas[0])[0]])
    if getattr(layer, "scale", True):
        sq = sq + tf.reduce_sum(tf.square(flat(tf.add_n(gammas))), 1)
    if getattr(layer, "center", True):
        sq = sq + tf.reduce_sum(tf.square(flat(tf.add_n(betas))), 1)
    return sq


def _rows(t):
    t = tf.convert_to_tensor(t)
    shape = tf.shape(t)
    return tf.reshape(t, [shape[0], -1, shape[-1]])


RULES = {"dense": _dense, "conv": _conv, "embedding": _embedding,
         "layer_norm": _layer_norm}
