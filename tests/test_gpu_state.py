"""State a compiled GPU step can reach, checked on a CPU.

On a GPU TensorFlow keeps int32 variables (and other dtypes without GPU
kernels for resource variables) in host memory; an XLA-compiled step that
touches one fails with "Trying to access resource ... located in device
CPU:0 from device GPU:0" (measured on an H100, TF 2.21). So every variable
that any tf_gradkit optimizer, wrapper, layer or helper creates must have a
dtype that lives on the GPU: floating point or int64. This test builds each
of them, runs a step, collects every variable it holds (``.variables`` and
any ``tf.Variable`` reachable through tf_gradkit objects' attributes) and
checks the dtypes, so the next int32 counter is caught without a GPU.

It also scans each traced step for ops that only run on the host (Python
callbacks, printing): with XLA they fail to compile, without it they force a
device-to-host round trip every step.
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import FLAVOUR
from helpers import mlp, regression_data
from test_battery import OPTIMIZERS

# Resource-variable dtypes with GPU kernels (TensorFlow registers its GPU
# variable ops for the float types, complex and int64; int32, int8/16,
# uint8/16 and strings stay on the host).
DEVICE_DTYPES = {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int64,
                 tf.complex64, tf.complex128}
HOST_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc", "PrintV2", "Print",
            "StringFormat", "Assert", "AsString", "ReduceJoin"}


def _host_only(ops):
    """Ops that run on the host only: callbacks, printing, strings."""
    return sorted((ops & HOST_OPS) | {op for op in ops if "String" in op})


def _as_tf_variable(obj):
    value = getattr(obj, "value", None)  # a Keras 3 Variable holds one
    if isinstance(value, tf.Variable):
        return value
    return obj if isinstance(obj, tf.Variable) else None


def reachable_variables(root, model=None):
    """Every ``tf.Variable`` held by ``root``: its ``variables`` and whatever
    tf_gradkit objects (and their lists, dicts and tuples) hold, excluding
    the model's own weights."""
    excluded = set()
    if model is not None:
        excluded = {id(_as_tf_variable(w)) for w in model.weights}
    found, seen = {}, set()

    def visit(obj, depth):
        if depth > 8 or id(obj) in seen:
            return
        seen.add(id(obj))
        var = _as_tf_variable(obj)
        if var is not None:
            if id(var) not in excluded:
                found[id(var)] = var
            return
        if isinstance(obj, dict):
            for value in list(obj.values()):
                visit(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value, depth + 1)
        elif type(obj).__module__.startswith("tf_gradkit") or hasattr(obj, "variables"):
            variables = getattr(obj, "variables", None)
            if isinstance(variables, (list, tuple)):
                for v in variables:
                    visit(v, depth + 1)
            if type(obj).__module__.startswith("tf_gradkit"):
                for value in list(vars(obj).values()) if hasattr(obj, "__dict__") else []:
                    visit(value, depth + 1)
            inner = getattr(obj, "inner_optimizer", None)
            if inner is not None:
                visit(inner, depth + 1)

    visit(root, 0)
    return list(found.values())


def _host_dtypes(variables):
    return sorted({(v.name, v.dtype.name) for v in variables
                   if v.dtype.base_dtype not in DEVICE_DTYPES})


def _trained(K, gk, factory):
    x, y = regression_data(n=16)
    model = mlp(K)
    opt = factory(K, gk, model)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model, opt


# Each battery optimizer's trained state in device dtypes: test_battery.py's
# `test_checkpoint_round_trip` (the same training as `_trained`, then saved).


def test_more_parts_keep_device_state(K, gk):
    from tf_gradkit import constraints as C  # noqa: PLC0415

    factories = {
        "lm-qr-chunk": lambda K, gk, m: gk.LevenbergMarquardt(m, solver="cholesky",
                                                              chunk_size=3),
        "cg-nuclear": lambda K, gk, m: gk.ConditionalGradient(0.1, lambda_=3.0,
                                                              ord="nuclear"),
        "accumulate-projected-sgd": lambda K, gk, m: gk.GradientAccumulator(
            gk.Projected(K.optimizers.SGD(0.1), {"kernel": C.NonNeg()}), 2, model=m),
        "lagrangian-outputs": lambda K, gk, m: gk.AugmentedLagrangian(
            K.optimizers.SGD(0.1),
            [gk.Inequality(lambda y_pred, batch: tf.reduce_mean(y_pred) - 1.0)],
            model=m),
    }
    for name, factory in factories.items():
        model, opt = _trained(K, gk, factory)
        assert _host_dtypes(reachable_variables(opt, model)) == [], name


def test_layers_and_accumulators_keep_device_state(gk):
    import tf_gradkit  # noqa: PLC0415

    layer = gk.AccumBatchNormalization(3)
    layer(tf.ones([4, 2]), training=True)
    acc = tf_gradkit.ConditionalAccumulator(tf.float32, [3])
    acc.apply_grad(tf.ones([3]), local_step=0)
    own = [w for w in layer.weights] + list(acc.variables)
    assert len(own) >= 5
    assert _host_dtypes([_as_tf_variable(v) for v in own]) == []


@pytest.mark.skipif(FLAVOUR != "tf_keras", reason="tfmot prunes tf_keras models only")
def test_pruning_helpers_keep_device_state():
    import tf_keras  # noqa: PLC0415
    tfmot = pytest.importorskip("tensorflow_model_optimization")
    from tf_gradkit import pruning  # noqa: PLC0415

    base = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(4),
                                tf_keras.layers.Dense(1)])
    pruned = tfmot.sparsity.keras.prune_low_magnitude(
        base, pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(0.5, 0))
    opt = pruning.MaskAware(tf_keras.optimizers.Adam(0.01), model=pruned)
    stepper = pruning.PruningStepper(pruned, opt)
    x, y = regression_data(n=8)
    stepper.before_step()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(pruned(x, training=True) - y))
    opt.apply_gradients(zip(tape.gradient(loss, pruned.trainable_variables),
                            pruned.trainable_variables))
    variables = reachable_variables(opt, pruned) + reachable_variables(stepper, pruned)
    assert variables
    assert _host_dtypes(variables) == []


def test_the_check_catches_an_int32_counter(K, gk):
    # The guard itself can fail: an optimizer holding an int32 variable.
    model, opt = _trained(K, gk, OPTIMIZERS["projected-adam-maxnorm"])
    opt._stray_counter = tf.Variable(0, dtype=tf.int32, name="stray")
    assert ("stray:0", "int32") in [(n.split("/")[-1], d) for n, d in
                                    _host_dtypes(reachable_variables(opt, model))]


def _graph_ops(concrete):
    """Op types of a concrete function, including nested loop/branch bodies."""
    graph_def = concrete.graph.as_graph_def()
    ops = {node.op for node in graph_def.node}
    for fn in graph_def.library.function:
        ops |= {node.op for node in fn.node_def}
    return ops


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_steps_use_no_host_only_ops(K, gk, name):
    x, y = regression_data(n=8)
    model = mlp(K)
    opt = OPTIMIZERS[name](K, gk, model)
    extra = {"sample_count": 8} if getattr(type(opt), "accumulates_gradients", False) else {}

    @tf.function
    def step(xb, yb):
        if getattr(opt, "needs_residuals", False):
            return opt.minimize(lambda: model(xb, training=True) - yb,
                                model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables), **extra)
        return loss

    ops = _graph_ops(step.get_concrete_function(tf.constant(x), tf.constant(y)))
    assert "ReadVariableOp" in ops or "AssignVariableOp" in ops  # the scan sees the step
    assert _host_only(ops) == []
    step(tf.constant(x), tf.constant(y))
    assert np.isfinite(model(x).numpy()).all()


# Every composition the matrix allows (test_composition.py), as fit runs it:
# the model's train_step (with tf_gradkit's hooks) in one function.
def _allowed_compositions():
    from test_composition import (ELSEWHERE, REFUSED, REFUSED_AT_FIT,  # noqa: PLC0415
                                  REFUSED_BY_KERAS, _cells, _parse)
    return [c for c in _cells() if _parse(c) not in {**REFUSED, **REFUSED_AT_FIT,
                                                     **REFUSED_BY_KERAS, **ELSEWHERE}]


def _composition_step(K, gk, cell, jit):
    from test_composition import build  # noqa: PLC0415
    x, y = regression_data(n=8)
    model = mlp(K)
    model.compile(optimizer=build(K, gk, cell, model), loss="mse")
    step = tf.function(lambda xb, yb: model.train_step((xb, yb)), jit_compile=jit)
    return model, step, (tf.constant(x), tf.constant(y))


@pytest.mark.parametrize("cell", _allowed_compositions())
def test_every_allowed_composition_traces_with_no_host_only_ops(K, gk, cell):
    # TPU-safe by construction: no host callbacks, printing or strings in
    # the step of any composition a user can build (traced, not run).
    _, step, args = _composition_step(K, gk, cell, jit=True)
    ops = _graph_ops(step.get_concrete_function(*args))
    assert "ReadVariableOp" in ops or "AssignVariableOp" in ops
    assert _host_only(ops) == []


@pytest.mark.slow
@pytest.mark.parametrize("cell", _allowed_compositions())
def test_every_allowed_composition_compiles_under_xla(K, gk, cell):
    model, step, args = _composition_step(K, gk, cell, jit=True)
    for _ in range(3):  # an accumulation window of 2 closes
        step(*args)
    assert all(np.isfinite(w).all() for w in model.get_weights())
