"""The cases `test_multiworker.py` runs on two worker processes and, for
the reference, in one process (shared by both sides).

Each case: ``model(K)``, ``optimizer(K, gk, model)``, the compiled ``loss``
(a name, or ``loss(K)``) and the custom loop's ``loss_fn`` (a per-example
mean), ``epochs``, the global ``batch`` (16 unless said), the ``data`` it
trains on, and ``reference``: how one process gets the same
result (``"big"``: plain SGD on one batch of 64, what a window of 4 global
micro-batches of 16 must equal; ``"same"``: the same optimizer, one
process, batches of 16).
"""

import importlib

import numpy as np
import tensorflow as tf

from helpers import mlp, regression_data
from tf_gradkit import _flavour

GLOBAL_BATCH = 16
MASK = (np.arange(3 * 32).reshape(3, 32) % 3 != 0).astype("float32")


def keras_module():
    return importlib.import_module(
        "tf_keras" if _flavour.active_flavour() == "tf_keras" else "keras")


def _tokens_data():
    rng = np.random.RandomState(0)
    lengths = np.concatenate([rng.randint(1, 3, 32), rng.randint(10, 13, 32)])
    x = np.zeros((64, 12), "int32")
    y = np.zeros((64, 12), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.randint(1, 20, length)
        y[i, :length] = rng.randint(0, 20, length)
    return x, y


def _tokens_model(K):
    model = K.Sequential([K.Input((12,), dtype="int32"),
                          K.layers.Embedding(20, 8, mask_zero=True), K.layers.Dense(20)])
    rng = np.random.RandomState(1)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.3
                       for w in model.get_weights()])
    return model


DATA = {"regression": lambda: regression_data(n=64), "tokens": _tokens_data}


def _mse(y, p):
    return tf.reduce_mean(tf.square(p - y))


def _kernel_norm(model):
    """|first kernel|^2 <= 20: active at the start (about 24)."""
    kernel = model.trainable_variables[0]
    return lambda: tf.reduce_sum(tf.square(kernel)) - 20.0


def compiled_loss(K, case):
    loss = case["loss"]
    return loss(K) if callable(loss) else loss


def _case(optimizer, reference, **more):
    case = {"model": lambda K: mlp(K, hidden=32), "optimizer": optimizer,
            "loss": "mse", "loss_fn": _mse, "epochs": 2, "reference": reference}
    case.update(more)
    return case


def _projected(K, gk, model):
    from tf_gradkit import constraints as C  # noqa: PLC0415
    return gk.Projected(K.optimizers.SGD(0.1), {"kernel": C.NonNeg()})


def _mask_aware(K, gk, model):
    from tf_gradkit import pruning  # noqa: PLC0415
    return pruning.MaskAware(K.optimizers.SGD(0.1),
                             masks={model.trainable_variables[0].ref(): MASK})


_BASE = {
    "plain": _case(lambda K, gk, m: K.optimizers.SGD(0.1), "same"),
    "acc": _case(lambda K, gk, m: gk.GradientAccumulator(K.optimizers.SGD(0.1), 4,
                                                          model=m), "big"),
    "proj": _case(_projected, "same"),
    "lagr": _case(lambda K, gk, m: gk.AugmentedLagrangian(
        K.optimizers.SGD(0.1), [gk.Inequality(_kernel_norm(m))], dual_every=3,
        initial_penalty=0.05),
        "same"),
    "lm": _case(lambda K, gk, m: gk.LevenbergMarquardt(m), "same", epochs=1, batch=64),
    "mask": _case(_mask_aware, "same"),
}
CASES = {f"{name}-{mode}": dict(case) for name, case in _BASE.items()
         for mode in ("fit", "loop")}
CASES["tokens-fit"] = {
    "model": _tokens_model, "data": "tokens", "epochs": 2, "reference": "big",
    "optimizer": lambda K, gk, m: gk.GradientAccumulator(K.optimizers.SGD(0.5), 4, model=m),
    "loss": lambda K: K.losses.SparseCategoricalCrossentropy(from_logits=True),
}


def _bench_model(K):
    """benchmarks/distributed.py: 8-256-256-1 (68k parameters)."""
    model = K.Sequential([K.Input((8,)), K.layers.Dense(256, activation="tanh"),
                          K.layers.Dense(256, activation="tanh"), K.layers.Dense(1)])
    rng = np.random.RandomState(1)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.1
                       for w in model.get_weights()])
    return model


def _bench_data():
    rng = np.random.RandomState(0)
    x = rng.randn(2048, 8).astype("float32")
    return x, np.sin(x @ rng.randn(8, 1)).astype("float32")


DATA["bench"] = _bench_data
for _name, _factory in (
        ("plain", lambda K, gk, m: K.optimizers.Adam(1e-3)),
        ("acc", lambda K, gk, m: gk.GradientAccumulator(K.optimizers.Adam(1e-3), 4,
                                                        model=m))):
    CASES[f"bench_{_name}-fit"] = {"model": _bench_model, "optimizer": _factory,
                                   "loss": "mse", "epochs": 2, "data": "bench",
                                   "batch": 64, "timed": True, "reference": None}
