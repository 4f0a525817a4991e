"""Taps on a Keras layer instance: see (or replace) its input, its
pre-activation output and its output during a forward pass, then restore it.

Both Keras flavours call a layer through ``layer.call`` and apply a Dense's or
a convolution's ``layer.activation`` after its bias, so overriding the two on
the instance (never on the class, so other models are untouched) sees every
call, eagerly and while a ``tf.function`` traces. The one place that knows
which layers exist is the host of the model's flavour (`_hosts.<flavour>.layer_kinds`).
"""

import contextlib

import tensorflow as tf


@tf.autograph.experimental.do_not_convert
def layer_kinds(obj, owner="tf_gradkit"):
    """kind -> layer classes of the flavour ``obj`` (a model or layer)
    belongs to (`_hosts.*.layer_kinds`); a TypeError naming ``owner`` when
    no flavour serves it."""
    from tf_gradkit import _hosts  # noqa: PLC0415

    return _hosts.host_for(obj, "model", owner).layer_kinds()


def kind_of(layer, kinds=None):
    """"dense", "conv", "embedding", "layer_norm", "batch_norm" or None;
    ``kinds``: `layer_kinds` of its model (else of the layer's own flavour)."""
    kinds = kinds or layer_kinds(layer)
    if isinstance(layer, kinds["excluded"]):
        return None
    for kind in ("dense", "conv", "embedding", "layer_norm", "batch_norm"):
        if isinstance(layer, kinds[kind]):
            return kind
    return None


def flat_layers(model):
    """Every layer of ``model``, nested models' layers included, once."""
    seen, out, todo = set(), [], list(getattr(model, "layers", []))
    while todo:
        layer = todo.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        out.append(layer)
        todo.extend(getattr(layer, "layers", []))
    return out


def resolve_layer(model, layer, argument):
    """A layer of ``model`` from the layer itself or its name."""
    layers = flat_layers(model)
    if isinstance(layer, str):
        for candidate in layers:
            if candidate.name == layer:
                return candidate
        raise ValueError(f"`{argument}`: the model has no layer named {layer!r}. "
                         f"Its layers: {[candidate.name for candidate in layers]}")
    if not any(candidate is layer for candidate in layers):
        raise ValueError(f"`{argument}` must be a layer of the model (or its "
                         f"name). Received: {layer!r}")
    return layer


@contextlib.contextmanager
def tapped(layer, on_call=None, on_pre_activation=None):
    """While active: ``on_call(inputs, outputs) -> outputs`` sees every call of
    ``layer`` (its first input and its output, which it may replace);
    ``on_pre_activation(z) -> z`` sees a Dense's or convolution's output
    before its activation."""
    saved = {name: layer.__dict__[name] for name in ("call", "activation")
             if name in layer.__dict__}
    if on_call is not None:
        original_call = layer.call

        def call(*args, **kwargs):
            inputs = args[0] if args else kwargs.get("inputs")
            return on_call(inputs, original_call(*args, **kwargs))

        object.__setattr__(layer, "call", call)
    if on_pre_activation is not None:
        activation = layer.activation
        object.__setattr__(layer, "activation",
                           lambda z: activation(on_pre_activation(z)))
    try:
        yield layer
    finally:
        for name in ("call", "activation"):
            if name in saved:
                object.__setattr__(layer, name, saved[name])
            elif name in layer.__dict__ and (
                    (name == "call" and on_call is not None)
                    or (name == "activation" and on_pre_activation is not None)):
                object.__delattr__(layer, name)
