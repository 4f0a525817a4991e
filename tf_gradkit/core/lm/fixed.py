"""Fixed parameters (Gpufit's ``parameters_to_fit``) for batched fits.

A fixed parameter keeps its start in every fit. The solve runs on the free
parameters only (the reduced problem: the model receives the full vector,
its fixed entries taken from ``p0``), so a fixed parameter never moves and
the free ones end where a fit of the reduced model would end. In the
result a fixed parameter has covariance row and column 0, ``perr`` 0,
``grad`` 0 and (``full_output``) a zero Jacobian column: Gpufit's
convention, it was not estimated and has no uncertainty in this fit.
"""

import numpy as np
import tensorflow as tf


def free_indices(parameters_to_fit, p, name):
    """The free parameters' indices (a tuple), or None when all are free.

    Refuses, naming the argument, anything but ``[P]`` of 0/1 (or bool) with
    at least one 1."""
    if parameters_to_fit is None:
        return None
    a = np.asarray(parameters_to_fit)
    ok = a.shape == (p,) and (a.dtype == bool or (
        np.issubdtype(a.dtype, np.number) and np.all(np.isin(a, (0, 1)))))
    if not ok:
        raise ValueError(
            f"{name}: `parameters_to_fit` must be [P] = [{p}] of 1 (fit) and 0 "
            "(keep at its start), or bools (Gpufit's parameters_to_fit). "
            f"Received: {parameters_to_fit!r} (shape {a.shape})")
    free = tuple(int(i) for i in np.flatnonzero(a.astype(bool)))
    if not free:
        raise ValueError(
            f"{name}: `parameters_to_fit` fixes every parameter: there is "
            "nothing to fit. Free at least one (a 1), or evaluate the model "
            f"directly. Received: {parameters_to_fit!r}")
    return None if len(free) == p else free


def expand(x_free, full, free):
    """``full`` ``[B, P]`` with its ``free`` columns replaced by ``x_free``
    ``[B, len(free)]`` (the model's full parameter vector)."""
    position = {j: k for k, j in enumerate(free)}
    cols = [x_free[:, position[j]] if j in position else full[:, j]
            for j in range(int(full.shape[1]))]
    return tf.stack(cols, axis=1)


def reduce_fns(kind, fns, free, full):
    """The user's (model, jac) seen as functions of the free parameters."""
    model, jac = fns
    free_list = list(free)
    if kind == "fun":
        def fun(x, *args):
            return model(expand(x, full, free), *args)

        def dfun(x, *args):
            return tf.gather(jac(expand(x, full, free), *args), free_list, axis=2)
    else:
        def fun(xdata, params):
            return model(xdata, expand(params, full, free))

        def dfun(xdata, params):
            return tf.gather(jac(xdata, expand(params, full, free)), free_list,
                             axis=2)
    return fun, (None if jac is None else dfun)


def scatter_columns(t, free, p, axis):
    """``t`` with its ``axis`` of ``len(free)`` spread to ``p`` entries,
    zeros at the fixed ones."""
    pad = [[0, 0]] * t.shape.rank
    pad[axis] = [0, 1]
    padded = tf.pad(t, pad)   # index len(free) is a zero
    index = np.full([p], len(free), np.int64)
    index[list(free)] = np.arange(len(free))
    return tf.gather(padded, index, axis=axis)


def take_columns(t, free):
    """``t`` ``[B, P]`` restricted to the free columns."""
    return tf.gather(t, list(free), axis=1)
