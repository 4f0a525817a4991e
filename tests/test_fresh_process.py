"""A saved model loads in a FRESH process that imports TensorFlow and
tf_gradkit, nothing else (``tf.keras.models.load_model``): every optimizer of
`_hosts.OPTIMIZERS` (MaskAware: a tfmot-pruned model in tf_keras, explicit masks,
attached again after loading, in Keras 3), in every format the flavour keeps an
optimizer in.

The suite's own process registered every class long before it loads
anything, so only a new interpreter shows what a user's ``import tf_gradkit``
followed by ``load_model(path)`` does. Each case is saved here mid-run (an
accumulation window open, between dual updates, mid-schedule), continued
here, and loaded, checked (class, configuration) and continued in one child
process per flavour; the continued weights and optimizer variables must be
the same as here, to the last bit (the same graph on the same data).

Functions registered with no Keras (an AugmentedLagrangian constraint, a
GradientAccumulator ``sample_count``, in ``tests/saved_functions.py``) are
saved by module and qualified name: the child loads them once it has
imported their module (before that, Keras 3 loading says to import it:
tf_gradkit never imports a module a file names; tf_keras's own lookup does),
by ``load_model``, ``keras.optimizers.deserialize`` and ``from_config``."""

import json
import os
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import saved_functions
from conftest import FLAVOUR
from helpers import alternate_mask, regression_data
from tf_gradkit import _hosts

ROOT = pathlib.Path(__file__).resolve().parent.parent
FORMATS = {"keras3": ["keras"], "tf_keras": ["keras", "h5", "savedmodel"]}[FLAVOUR]
FILES = {"keras": "m.keras", "h5": "m.h5", "savedmodel": "saved"}
CHILD_TIMEOUT_S = 300
NEEDS_FUNCTIONS = ("AugmentedLagrangian", "GradientAccumulator-sample_count")


def _fit(model, x, y, callbacks):
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


def _plain_cases(K, gk):
    """name -> (make model, make optimizer for it); one per optimizer."""
    from tf_gradkit import constraints as C  # noqa: PLC0415
    from tf_gradkit.pruning import PolynomialDecay  # noqa: PLC0415

    def mlp(batch_norm=False):
        layers = [K.Input((3,)), K.layers.Dense(4, activation="tanh")]
        if batch_norm:
            layers.append(gk.AccumBatchNormalization(4))
        model = K.Sequential(layers + [K.layers.Dense(1)])
        rng = np.random.RandomState(1)
        for layer in model.layers:
            if isinstance(layer, K.layers.Dense):
                layer.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                                   for w in layer.get_weights()])
        return model

    adam = lambda: K.optimizers.Adam(0.05)  # noqa: E731
    return {
        "AugmentedLagrangian": (mlp, lambda m: gk.AugmentedLagrangian(
            adam(), [gk.Inequality(saved_functions.mean_output_at_most_half)],
            model=m, dual_every=2)),
        "ConditionalGradient": (mlp, lambda m: gk.ConditionalGradient(
            0.2, lambda_=3.0, ord="nuclear")),
        # With the layer that must load too.
        "GradientAccumulator": (lambda: mlp(batch_norm=True), lambda m: gk.GradientAccumulator(
            adam(), 4, model=m, epoch_end="carry")),
        "GradientAccumulator-sample_count": (mlp, lambda m: gk.GradientAccumulator(
            adam(), 4, model=m, epoch_end="carry",
            sample_count=saved_functions.count_examples)),
        "LevenbergMarquardt": (mlp, gk.LevenbergMarquardt),
        "MagnitudePruning": (mlp, lambda m: gk.MagnitudePruning(
            adam(), model=m, schedule=PolynomialDecay(0.0, 0.5, begin_step=0, end_step=4,
                                                     frequency=1))),
        "Projected": (mlp, lambda m: gk.Projected(adam(), {"kernel": C.MaxNorm(1.0)})),
        # tf_keras: the tfmot case below instead.
        "MaskAware": (mlp, lambda m: gk.MaskAware(adam(), masks=alternate_mask(m))),
    }


def _mask_aware_case():
    """A tfmot-pruned tf_keras model under MaskAware (tfmot is imported in
    the tf_keras process only: its import sets TF_USE_LEGACY_KERAS=1)."""
    import tf_keras  # noqa: PLC0415
    tfmot = pytest.importorskip("tensorflow_model_optimization")
    from tf_gradkit import pruning  # noqa: PLC0415
    sparsity = tfmot.sparsity.keras

    def model():
        base = tf_keras.Sequential([tf_keras.Input((3,)),
                                    tf_keras.layers.Dense(4, activation="tanh"),
                                    tf_keras.layers.Dense(1)])
        rng = np.random.RandomState(1)
        base.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                          for w in base.get_weights()])
        return sparsity.prune_low_magnitude(base, pruning_schedule=sparsity.PolynomialDecay(
            0.0, 0.5, begin_step=0, end_step=4, frequency=1))

    return model, lambda m: pruning.MaskAware(tf_keras.optimizers.Adam(0.05), model=m)


def _config(optimizer):
    return json.dumps(optimizer.get_config(), sort_keys=True, default=repr)


def _snapshot(model):
    return {"weights": [w.tolist() for w in model.get_weights()],
            "variables": [np.asarray(v).tolist() for v in model.optimizer.variables]}


# The child: `import tensorflow` and `import tf_gradkit`, nothing else, then
# `tf.keras.models.load_model` of every case that needs no user function; then
# (an error that says to import it first, in Keras 3) the module of the saved
# functions, the cases that use them, and Keras's `deserialize`.
_CHILD = r"""
import json, sys, traceback
import numpy as np
import tensorflow as tf
import tf_gradkit

job = json.load(open(sys.argv[1]))
data = np.load(job["data"])
results = {{}}

def snapshot(model):
    return {{"weights": [w.tolist() for w in model.get_weights()],
             "variables": [np.asarray(v).tolist() for v in model.optimizer.variables]}}

def load(case):
    if not case["pruned"]:
        model = tf.keras.models.load_model(case["path"])
        if case["masks"]:  # explicit masks: data, given again
            model.optimizer.attach(masks=[(model.trainable_variables[i], np.asarray(m))
                                          for i, m in case["masks"]])
        return model
    import tensorflow_model_optimization as tfmot  # tfmot's layer, in its scope
    with tfmot.sparsity.keras.prune_scope():
        return tf.keras.models.load_model(case["path"])

def run(case):
    model = load(case)
    optimizer = model.optimizer
    out = {{"class": type(optimizer).__module__ + "." + type(optimizer).__name__,
            "config": json.dumps(optimizer.get_config(), sort_keys=True, default=repr)}}
    callbacks = []
    if case["pruned"]:
        from tf_gradkit import pruning
        callbacks = [pruning.UpdatePruningStepFromOptimizer()]
    model.fit(data["x"], data["y"], batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks)
    out.update(snapshot(model))
    if case["name"] == "GradientAccumulator-sample_count":
        import saved_functions
        out["sample_count_is_it"] = optimizer.sample_count is saved_functions.count_examples
    if case["name"] == "AugmentedLagrangian":
        import saved_functions
        out["constraint_is_it"] = (optimizer._specs[0].fn
                                   is saved_functions.mean_output_at_most_half)
    return out

def attempt(key, fn):
    try:
        results[key] = fn()
    except BaseException:
        results[key] = {{"error": traceback.format_exc()[-3000:]}}

cases = job["cases"]
for case in cases:
    if not case["needs_functions"]:
        attempt(case["key"], lambda: run(case))
first = next(c for c in cases if c["needs_functions"])
attempt("before-import", lambda: run(first))
import saved_functions
for case in cases:
    if case["needs_functions"]:
        attempt(case["key"], lambda: run(case))
import {keras} as K
for name, serialized in job["serialized"].items():
    def deserialized():
        optimizer = K.optimizers.deserialize(json.loads(serialized))
        rebuilt = type(optimizer).from_config(optimizer.get_config())
        fn = (optimizer.sample_count if name == "GradientAccumulator"
              else optimizer._specs[0].fn)
        again = (rebuilt.sample_count if name == "GradientAccumulator"
                 else rebuilt._specs[0].fn)
        return {{"function": fn.__module__ + "." + fn.__qualname__, "same": fn is again}}
    attempt("deserialize-" + name, deserialized)
print("@@RESULTS@@" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def fresh(K, gk, tmp_path_factory):
    """Saves every case here, runs the child once; ``(expected, results)``."""
    tmp = tmp_path_factory.mktemp("fresh")
    x, y = regression_data(n=20)
    first, second = (x[:12], y[:12]), (x[12:], y[12:])
    np.savez(tmp / "data.npz", x=second[0], y=second[1])
    cases = dict(_plain_cases(K, gk))
    if FLAVOUR == "tf_keras":
        cases["MaskAware"] = _mask_aware_case()
    expected, job = {}, []
    for name, (make_model, make_optimizer) in cases.items():
        callbacks = []
        if name == "MaskAware" and FLAVOUR == "tf_keras":
            from tf_gradkit import pruning  # noqa: PLC0415
            callbacks = [pruning.UpdatePruningStepFromOptimizer()]
        model = make_model()
        model.compile(optimizer=make_optimizer(model), loss="mse", jit_compile=False)
        masks = None
        if name == "MaskAware" and FLAVOUR != "tf_keras":
            masks = [[0, alternate_mask(model)[0][1].tolist()]]
        _fit(model, *first, callbacks)  # 3 micro-batches: windows open
        for fmt in FORMATS:
            path = str(tmp / f"{name}-{fmt}-{FILES[fmt]}")
            model.save(path)
            job.append({"key": f"{name}/{fmt}", "name": name, "path": path,
                        "pruned": name == "MaskAware" and masks is None, "masks": masks,
                        "needs_functions": name in NEEDS_FUNCTIONS})
        optimizer = model.optimizer
        config = _config(optimizer)
        _fit(model, *second, callbacks)
        expected[name] = dict(_snapshot(model), config=config,
                              cls=f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    serialized = {
        "GradientAccumulator": json.dumps(K.optimizers.serialize(gk.GradientAccumulator(
            K.optimizers.SGD(0.1), 2, sample_count=saved_functions.count_examples))),
        "AugmentedLagrangian": json.dumps(K.optimizers.serialize(gk.AugmentedLagrangian(
            K.optimizers.SGD(0.1), [gk.Inequality(saved_functions.mean_output_at_most_half)]))),
    }
    job_path = tmp / "job.json"
    job_path.write_text(json.dumps({"data": str(tmp / "data.npz"), "cases": job,
                                    "serialized": serialized}))
    keras = "tf_keras" if FLAVOUR == "tf_keras" else "keras"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    out = subprocess.run([sys.executable, "-c", _CHILD.format(keras=keras), str(job_path)],
                         env=env, cwd=str(tmp), capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)
    lines = [line for line in out.stdout.splitlines() if line.startswith("@@RESULTS@@")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return expected, json.loads(lines[-1][len("@@RESULTS@@"):])


def _case_keys():
    names = sorted(_hosts.OPTIMIZERS) + ["GradientAccumulator-sample_count"]
    return [f"{name}/{fmt}" for name in names for fmt in FORMATS]


def test_every_optimizer_has_a_case(K, gk):
    names = set(_plain_cases(K, gk)) - {"GradientAccumulator-sample_count"}
    assert names == set(_hosts.OPTIMIZERS)


@pytest.mark.parametrize("key", _case_keys())
def test_loads_in_a_fresh_process_and_continues_exactly(fresh, key):
    expected, results = fresh
    name = key.split("/")[0]
    got, want = results[key], expected[name]
    assert "error" not in got, got.get("error")
    assert got["class"] == want["cls"]
    assert got["config"] == want["config"]
    for part in ("weights", "variables"):
        assert len(got[part]) == len(want[part])
        for a, b in zip(got[part], want[part]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if name == "GradientAccumulator-sample_count":
        assert got["sample_count_is_it"] is True
    if name == "AugmentedLagrangian":
        assert got["constraint_is_it"] is True


def test_a_function_whose_module_is_not_imported(fresh):
    # tf_gradkit never imports a module a file names. Keras 3 neither (a
    # file could name any module): loading says to import it. tf_keras's own
    # lookup, which tf_gradkit falls back to, imports it (as it does classes).
    _, results = fresh
    got = results["before-import"]
    if FLAVOUR == "keras3":
        assert "ValueError" in got.get("error", "")
        assert "`import saved_functions` before loading" in got["error"]
    else:
        assert "error" not in got, got["error"]
        assert got["constraint_is_it"] is True


@pytest.mark.parametrize("name", ["GradientAccumulator", "AugmentedLagrangian"])
def test_deserialize_and_from_config_in_a_fresh_process(fresh, name):
    _, results = fresh
    got = results[f"deserialize-{name}"]
    assert "error" not in got, got.get("error")
    fn = {"GradientAccumulator": saved_functions.count_examples,
          "AugmentedLagrangian": saved_functions.mean_output_at_most_half}[name]
    assert got == {"function": f"saved_functions.{fn.__qualname__}", "same": True}


_LATER = r"""
import os, sys
before = dict(os.environ)
import warnings
import tf_gradkit
assert {later!r} not in sys.modules, "TensorFlow imported it"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {first}
    import {later} as K
ours = [str(w.message) for w in caught if "tf_gradkit" in str(w.message)]
assert not ours, ours
from tf_gradkit._hosts import OPTIMIZERS
from tf_gradkit.core.sets import SETS
names = list(OPTIMIZERS) + [s.__name__ for s in SETS] + ["AccumBatchNormalization"]
found = {{n: K.saving.get_registered_object("tf_gradkit>" + n) for n in names}}
wrong = {{n: c for n, c in found.items() if c is None
         or not c.__module__.startswith("tf_gradkit.{package}")}}
assert not wrong, wrong
assert "tensorflow_model_optimization" not in sys.modules
assert dict(os.environ) == before, "environment changed"
assert not [f for f in sys.meta_path if type(f).__module__ == "tf_gradkit._registration"]
"""


@pytest.mark.parametrize("first", ["", "import tf_gradkit.{package}",
                                   "import tf_gradkit._hosts.{package}"])
def test_a_keras_imported_after_tf_gradkit_has_its_classes_registered(first):
    # TensorFlow imports the Keras tf.keras is; the other one, imported
    # later (by tfmot, say), gets every class a saved file can name as soon
    # as its import finishes; tfmot is not imported for MaskAware. Also when
    # it is tf_gradkit's own flavour package (or host) that imports it: the
    # host, half-run then, registers the rest when it ends (without that,
    # MaskAware was missing, with a warning).
    later = "keras" if FLAVOUR == "tf_keras" else "tf_keras"
    package = "keras3" if later == "keras" else "tf_keras"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    code = _LATER.format(later=later, package=package, first=first.format(package=package))
    out = subprocess.run([sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]


# --------------------------------------------------------- in this process
def _fn_of(optimizer):
    if hasattr(optimizer, "sample_count"):
        return optimizer.sample_count
    if hasattr(optimizer, "residuals"):
        return optimizer.residuals
    return optimizer._specs[0].fn


def _with(gk, K, name, fn):
    if name == "GradientAccumulator":
        return gk.GradientAccumulator(K.optimizers.SGD(0.1), 2, sample_count=fn)
    if name == "LevenbergMarquardt":
        return gk.LevenbergMarquardt(residuals=fn)
    return gk.AugmentedLagrangian(K.optimizers.SGD(0.1), [gk.Inequality(fn, name="c")])


@pytest.mark.parametrize("name", ["GradientAccumulator", "AugmentedLagrangian",
                                  "LevenbergMarquardt"])
def test_top_level_and_class_body_functions_round_trip(K, gk, name):
    fns = {"GradientAccumulator": (saved_functions.count_examples,
                                   saved_functions.Counts.examples),
           "AugmentedLagrangian": (saved_functions.mean_output_at_most_half,),
           "LevenbergMarquardt": (saved_functions.output_minus_target,)}[name]
    for fn in fns:
        optimizer = _with(gk, K, name, fn)
        saved = json.loads(json.dumps(optimizer.get_config()))
        assert _fn_of(type(optimizer).from_config(saved)) is fn
        assert _fn_of(K.optimizers.deserialize(K.optimizers.serialize(optimizer))) is fn
        if FLAVOUR == "keras3":  # tf_keras's optimizers do not pickle at all (weakrefs)
            assert _fn_of(pickle.loads(pickle.dumps(optimizer))) is fn


def test_registered_function_saved_by_bare_name_loads(K, gk):
    # tf_keras <= 2.18 (and Keras <= 3.6) saved a registered function under
    # its bare name; 2.19+ and Keras 3.7+ as "package>name". Both load.
    def bare_named_constraint(y_pred, batch):
        del batch
        return tf.reduce_mean(y_pred) - 1.0
    fn = K.saving.register_keras_serializable(package="tests_fresh")(bare_named_constraint)
    config = _with(gk, K, "AugmentedLagrangian", fn).get_config()
    saved = config["constraints"][0]["fn"]
    assert saved["config"] == "tests_fresh>bare_named_constraint"
    cls = type(_with(gk, K, "AugmentedLagrangian", fn))
    assert _fn_of(cls.from_config(config)) is fn
    old = dict(config, constraints=[dict(config["constraints"][0], fn=dict(
        saved, module="builtins", config="bare_named_constraint",
        registered_name="bare_named_constraint"))])
    assert _fn_of(cls.from_config(old)) is fn


def test_a_bare_name_registered_twice_is_refused(K, gk):
    def make(bound):
        def twice_named(y_pred, batch):
            del batch
            return tf.reduce_mean(y_pred) - bound
        return twice_named
    first = K.saving.register_keras_serializable(package="tests_fresh_a")(make(0.0))
    K.saving.register_keras_serializable(package="tests_fresh_b")(make(1.0))
    config = _with(gk, K, "AugmentedLagrangian", first).get_config()
    saved = config["constraints"][0]["fn"]
    old = dict(config, constraints=[dict(config["constraints"][0], fn=dict(
        saved, module="builtins", config="twice_named", registered_name="twice_named"))])
    with pytest.raises(ValueError, match=r"bare name 'twice_named'.*tests_fresh_a>twice_named"
                       r".*tests_fresh_b>twice_named.*custom_objects"):
        type(_with(gk, K, "AugmentedLagrangian", first)).from_config(old)


def test_registered_name_beside_a_bare_name_picks_the_function(K, gk):
    # tf_keras <= 2.18 wrote a registered function as {"config": bare name,
    # "registered_name": "package>name", "module": its module}: the
    # registered name decides, even where two packages share the bare name
    # and the module is not imported. We write "package>name" in "config" on
    # every version.
    def make(bound):
        def paired_name(y_pred, batch):
            del batch
            return tf.reduce_mean(y_pred) - bound
        return paired_name
    K.saving.register_keras_serializable(package="tests_pair_a")(make(0.0))
    second = K.saving.register_keras_serializable(package="tests_pair_b")(make(1.0))
    config = _with(gk, K, "AugmentedLagrangian", second).get_config()
    saved = config["constraints"][0]["fn"]
    assert saved["config"] == saved["registered_name"] == "tests_pair_b>paired_name"
    old = dict(config, constraints=[dict(config["constraints"][0], fn=dict(
        saved, module="a_module_not_imported", config="paired_name"))])
    cls = type(_with(gk, K, "AugmentedLagrangian", second))
    assert _fn_of(cls.from_config(old)) is second


@pytest.mark.parametrize("name", ["GradientAccumulator", "AugmentedLagrangian"])
def test_lambdas_and_local_functions_are_saved_as_unsaved_and_refused_at_load(K, gk, name):
    def local(a, b, c=None):
        del b, c
        return tf.shape(a)[0]
    for fn in (lambda a, b, c=None: tf.shape(a)[0], local):
        optimizer = _with(gk, K, name, fn)
        config = optimizer.get_config()
        saved = (config["sample_count"] if name == "GradientAccumulator"
                 else config["constraints"][0])
        assert "fn" not in saved
        with pytest.raises(ValueError, match=r"lambdas? or closures?.*module's top level"):
            type(optimizer).from_config(config)
