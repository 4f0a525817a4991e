"""Jacobians of any tensor, and hooks on the gradient through a layer.

`jacobian` differentiates a function's output with respect to variables or
tensors, in forward or reverse mode picked by shape: the one choice LM's
linearisation already makes (`core.lm.linearize.residuals_and_jacobian`:
forward, one JVP per input element, when there are at least as many
outputs as inputs; reverse, one VJP per output element, otherwise).

`layer_jacobian` does it for a model's intermediate activations: of one
layer's output with respect to the variables, or to another layer's output
(the forward pass is re-run with that output held as the input).

`gradient_of` taps a layer's output so that a function sees (and may
replace) the gradient flowing back through it.
"""

import contextlib

import tensorflow as tf

from tf_gradkit.core.lm import linearize as lin_lib
from tf_gradkit import _layer_taps as _taps

__all__ = ["jacobian", "layer_jacobian", "gradient_of"]


def jacobian(fn, wrt, mode="auto"):
    """The Jacobian of ``fn()`` with respect to each of ``wrt``.

    Args:
      fn: zero-argument function returning a tensor (any shape), computed
        from ``wrt``.
      wrt: a variable or tensor, or a list of them.
      mode: "auto" (forward when ``fn()`` has at least as many elements as
        ``wrt`` in all, as LM's linearisation), "forward" or "reverse".

    Returns:
      For each of ``wrt``, a tensor of shape ``fn().shape + w.shape`` (as
      ``tf.GradientTape.jacobian``); a single tensor when ``wrt`` is one.
      Zeros where ``fn()`` does not depend on an input.

    Example:

    >>> import tensorflow as tf
    >>> x = tf.Variable([1.0, 2.0])
    >>> jacobian(lambda: tf.stack([x[0] * x[1], x[0] ** 2]), x).numpy().tolist()
    [[2.0, 1.0], [2.0, 0.0]]
    """
    if mode not in lin_lib.JACOBIAN_MODES:
        raise ValueError(f"jacobian: `mode` must be one of {lin_lib.JACOBIAN_MODES}. "
                         f"Received: mode={mode!r}")
    single = not isinstance(wrt, (list, tuple))
    wrt = [wrt] if single else list(wrt)
    if not wrt:
        raise ValueError("jacobian: `wrt` is empty; pass the variables or tensors "
                         "to differentiate with respect to.")
    for i, w in enumerate(wrt):
        if not (isinstance(w, (tf.Variable, tf.Tensor)) or hasattr(w, "value")):
            raise TypeError(f"jacobian: `wrt` must hold tf.Variables or tensors. "
                            f"Received: wrt[{i}] of type {type(w).__name__}.")
        if not w.shape.is_fully_defined():
            raise ValueError(f"jacobian: `wrt[{i}]` needs a static shape. "
                             f"Received: shape {w.shape}.")
    wrt = [w if isinstance(w, (tf.Variable, tf.Tensor)) else w.value for w in wrt]
    out_shapes = []

    def output():
        # The first call (outside any vectorised map) gives the output's shape,
        # so fn runs no extra time for it.
        out = tf.convert_to_tensor(fn())
        if not out_shapes:
            out_shapes.append(out.shape.as_list() if out.shape.is_fully_defined()
                              else tf.shape(out))
        return out

    # The forward/reverse choice is LM's linearisation's, made in one place.
    _, flat = lin_lib.residuals_and_jacobian(output, wrt, wrt[0].dtype, mode=mode)
    parts = tf.split(flat, [w.shape.num_elements() for w in wrt], axis=1) \
        if len(wrt) > 1 else [flat]
    jacs = [tf.cast(tf.reshape(p, _joined(out_shapes[0], w.shape.as_list())), w.dtype)
            for p, w in zip(parts, wrt)]
    return jacs[0] if single else jacs


def _joined(out_shape, in_shape):
    if isinstance(out_shape, list):
        return out_shape + in_shape
    return tf.concat([out_shape, tf.constant(in_shape, out_shape.dtype)], 0)


def layer_jacobian(model, x, of, wrt=None, mode="auto", training=False):
    """The Jacobian of a layer's output (or the model's) for input ``x``.

    Args:
      model: a Keras model (either flavour).
      x: the model's input.
      of: the layer (or its name) whose output is differentiated; None for
        the model's output.
      wrt: None for the model's trainable variables; a list of variables;
        or a layer (or its name) whose output is the input of the Jacobian
        (it must come before ``of``).
      mode: as `jacobian`.
      training: passed to the model.

    Returns:
      As `jacobian`: ``of``'s output shape + each input's shape (the batch
      axes included on both sides: examples that do not interact give
      zeros across examples).
    """
    of_layer = None if of is None else _taps.resolve_layer(model, of, "of")
    wrt_layer = None
    if wrt is None:
        wrt = list(model.trainable_variables)
    elif isinstance(wrt, str) or hasattr(wrt, "call"):
        wrt_layer = _taps.resolve_layer(model, wrt, "wrt")
    held = {}

    def forward():
        with contextlib.ExitStack() as stack:
            seen = {}
            if of_layer is not None:
                stack.enter_context(_taps.tapped(
                    of_layer, lambda inputs, outputs: seen.setdefault("of", outputs)))
            if wrt_layer is not None:
                def hold(inputs, outputs):
                    del inputs
                    if "value" not in held:
                        held["value"] = tf.convert_to_tensor(outputs)
                    return held["value"]
                stack.enter_context(_taps.tapped(wrt_layer, hold))
            out = model(x, training=training)
            if of_layer is not None and "of" not in seen:
                raise ValueError(f"layer_jacobian: layer {of_layer.name!r} was not "
                                 "called in the model's forward pass.")
            return seen["of"] if of_layer is not None else out

    if wrt_layer is None:
        return jacobian(forward, wrt, mode)
    forward()  # holds wrt's output: the Jacobian's input
    if "value" not in held:
        raise ValueError(f"layer_jacobian: layer {wrt_layer.name!r} was not called "
                         "in the model's forward pass.")
    return jacobian(forward, held["value"], mode)


@contextlib.contextmanager
def gradient_of(layer, fn):
    """While active, ``fn(grad)`` sees the gradient flowing back through
    ``layer``'s output and may replace it.

    Args:
      layer: a Keras layer (either flavour).
      fn: ``fn(grad) -> grad or None``: called in the backward pass with the
        gradient of the loss with respect to the layer's output; return a
        tensor of the same shape to replace it (clip, scale, add noise), or
        None to leave it (read it: store it, log it). In a ``tf.function``
        the gradient is a tensor of that function's graph: use it there.

    Example:

    >>> with gradient_of(model.layers[0], lambda g: tf.clip_by_norm(g, 1.0)):
    ...     with tf.GradientTape() as tape:
    ...         loss = loss_fn(y, model(x))
    ...     grads = tape.gradient(loss, model.trainable_variables)
    """
    if not callable(fn):
        raise TypeError(f"gradient_of: `fn` must be callable. Received: fn={fn!r}")

    @tf.custom_gradient
    def hook(outputs):
        def backward(upstream):
            replaced = fn(upstream)
            if replaced is None:
                return upstream
            replaced = tf.convert_to_tensor(replaced, dtype=upstream.dtype)
            if not replaced.shape.is_compatible_with(upstream.shape):
                raise ValueError(
                    f"gradient_of: `fn` must return None or a gradient shaped like "
                    f"{getattr(layer, 'name', 'the layer')}'s output "
                    f"{upstream.shape}. Received: shape {replaced.shape}.")
            return replaced
        return tf.identity(outputs), backward

    def on_call(inputs, outputs):
        del inputs
        return tf.nest.map_structure(hook, outputs)

    with _taps.tapped(layer, on_call):
        yield layer
