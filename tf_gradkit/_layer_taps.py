"""Taps on a Keras layer instance: see (or replace) its input, its
pre-activation output and its output during a forward pass, then restore it.

Both Keras flavours call a layer through ``layer.call`` and apply a Dense's or
a convolution's ``layer.activation`` after its bias, so overriding the two on
the instance (never on the class, so other models are untouched) sees every
call, eagerly and while a ``tf.function`` traces. The one place that knows
which layers exist is the host of the model's flavour (`_hosts.<flavour>.layer_kinds`).
"""

import contextlib
import inspect

import tensorflow as tf

KINDS = ("dense", "conv", "embedding", "layer_norm", "batch_norm")

# What a subclass may define over a known layer class and still be that
# class for a tap's rule: how it is built from arguments and saved, and the
# class's bookkeeping. Anything else (``call``, ``convolution_op``, a
# ``kernel`` property, ``build``...) may change what the rule assumes.
_SAFE_OVERRIDES = frozenset((
    "__init__", "get_config", "from_config", "__module__", "__doc__",
    "__qualname__", "__dict__", "__weakref__", "__annotations__",
    "__firstlineno__", "__static_attributes__", "__classcell__",
    "__orig_bases__", "__parameters__", "_abc_impl", "__abstractmethods__"))
# Methods Keras itself wraps on every instance (Keras 3's ``Layer.__new__``).
_INSTANCE_WRAPPED = frozenset(("build", "quantize"))


@tf.autograph.experimental.do_not_convert
def layer_kinds(obj, owner="tf_gradkit"):
    """kind -> layer classes of the flavour ``obj`` (a model or layer)
    belongs to (`_hosts.*.layer_kinds`); a TypeError naming ``owner`` when
    no flavour serves it."""
    from tf_gradkit import _hosts  # noqa: PLC0415

    return _hosts.host_for(obj, "model", owner).layer_kinds()


def kind_of(layer, kinds=None):
    """"dense", "conv", "embedding", "layer_norm", "batch_norm" or None, by
    ``isinstance`` (subclasses included); ``kinds``: `layer_kinds` of its
    model (else of the layer's own flavour). A tap's rule needs more: see
    `provable_kind`."""
    kinds = kinds or layer_kinds(layer)
    if isinstance(layer, kinds["excluded"]):
        return None
    for kind in KINDS:
        if isinstance(layer, kinds[kind]):
            return kind
    return None


def why_not_exactly(layer, base):
    """None when ``layer`` computes what ``base`` (a Keras layer class it is
    an instance of) computes: it is a ``base``, or a subclass that changes
    no method or property of ``base`` other than `_SAFE_OVERRIDES`, and no
    method is replaced on the instance. Else why not, naming the layer.

    A tap's rule is derived from ``base.call``: a subclass that overrides
    ``call`` (``super().call(2 * x)``) feeds the matmul something else than
    what the tap records, so its rule would be silently wrong."""
    for cls in type(layer).__mro__:
        if cls is base:
            break
        changed = sorted(name for name in vars(cls) if name not in _SAFE_OVERRIDES
                         and hasattr(base, name))
        if changed:
            return (f"layer {layer.name!r} ({type(layer).__name__}) subclasses "
                    f"{base.__name__} and overrides {changed}, so the "
                    f"{base.__name__} rule is not provably right for it")
    replaced = sorted(name for name in vars(layer) if name not in _INSTANCE_WRAPPED
                      and _is_method(inspect.getattr_static(base, name, None)))
    if replaced:
        return (f"layer {layer.name!r} has {replaced} replaced on the instance, so "
                f"the {base.__name__} rule is not provably right for it")
    return None


def _is_method(obj):
    return inspect.isfunction(obj) or isinstance(obj, (staticmethod, classmethod, property))


def provable_kind(layer, kinds=None):
    """``(kind, None)`` when a kind's rule is provably right for ``layer``;
    ``(None, why)`` when ``layer`` is an instance of a kind's class but not
    provably that class (`why_not_exactly`); ``(None, None)`` otherwise."""
    kinds = kinds or layer_kinds(layer)
    if isinstance(layer, kinds["excluded"]):
        return None, None
    for kind in KINDS:
        for base in kinds[kind]:
            if isinstance(layer, base):
                why = why_not_exactly(layer, base)
                return (None, why) if why else (kind, None)
    return None, None


def provably_per_example(layer, kinds):
    """Whether ``layer`` is, provably, one of the flavour's weightless layers
    whose output for an example depends on that example alone."""
    for base in kinds.get("per_example", ()):
        if isinstance(layer, base):
            return why_not_exactly(layer, base) is None
    return False


def is_graph_model(model, kinds):
    """Whether ``model`` is a Sequential or functional model whose ``call``
    is its graph of layers (not a subclass with a ``call`` of its own)."""
    graph = kinds.get("graph_models", ())
    return isinstance(model, graph) and any(type(model).call is base.call
                                            for base in graph)


def graph_reason(model, kinds):
    """Why ``model``'s call may do more than its layers (None: it is its
    graph of layers): a ``call`` of its own, or (Keras 3) operations applied
    between its layers (``ops.matmul(x, layer.kernel)`` on a KerasTensor),
    which may mix the examples or use a variable no layer's rule sees."""
    if not is_graph_model(model, kinds):
        return (f"{model.name!r} is not a Sequential or functional model (its own "
                "`call` may mix the examples or use any variable)")
    layers = {id(layer) for layer in model.layers}
    others = [op for op in getattr(model, "operations", ()) if id(op) not in layers]
    if others:
        return (f"{model.name!r} applies operations between its layers "
                f"({type(others[0]).__name__}), which may mix the examples or use a "
                "variable")
    return None


def unproven_reason(model, kinds):
    """Why a layer's rule may not see every use of its variables in
    ``model``'s forward pass (None: every model in it is its graph of layers,
    and every innermost layer is provably a rule's kind or provably a
    weightless per-example layer). A Lambda, a tf_keras op layer, a custom
    layer or a kind's subclass overriding ``call`` runs code of its own,
    which may read any variable through a closure (weights tied to an
    Embedding's table) or mix the examples: nothing narrows that soundly."""
    why = graph_reason(model, kinds)
    if why:
        return why
    for layer in flat_layers(model):
        if getattr(layer, "layers", None) is not None:  # a nested model
            why = graph_reason(layer, kinds)
        else:
            kind, why = provable_kind(layer, kinds)
            if why is None and kind is None and not (
                    provably_per_example(layer, kinds) and not layer.weights):
                why = (f"layer {layer.name!r} ({type(layer).__name__}) runs code of its "
                       "own, which may use any variable (e.g. weights tied through a "
                       "closure) or mix the examples")
        if why:
            return why
    return None


def explicit_training(layer, owner):
    """Whether a call of ``layer`` in a functional model was given
    ``training=True`` (which overrides the model's ``training``)."""
    from tf_gradkit import _hosts  # noqa: PLC0415

    calls = _hosts.host_for(layer, "model", owner).layer_call_kwargs(layer)
    return any(bool(kwargs.get("training")) for kwargs in calls)


def shared_variables(layers):
    """ids of the variables that more than one of ``layers`` (innermost
    layers: those without sub-layers) holds: tied weights, used by each."""
    seen, shared = set(), set()
    for layer in layers:
        if getattr(layer, "layers", None) is not None:
            continue
        for v in {id(w): w for w in layer.weights}.values():
            (shared if id(v) in seen else seen).add(id(v))
    return shared


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
