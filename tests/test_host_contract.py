"""The contract between algorithms and Keras hosts, checked (issue 29).

- both hosts implement exactly the hooks `_hosts/protocol.py` declares (and
  override nothing of their Keras beyond its own API), and both host modules
  give every `protocol.HOST_FUNCTIONS`;
- no private Keras member is read outside `_hosts/` and the flavour packages
  (an AST scan; its allow-list is empty);
- both flavour packages publish the same names;
- the battery and the save/load matrix cover every entry of
  `_hosts.OPTIMIZERS`;
- the tools documented for either flavour work on the other flavour's
  objects, in each process (this file is the one place a test imports both
  Keras flavours: the other one is imported here, explicitly);
- the flavour count docs/architecture.md states.
"""

import ast
import glob
import importlib
import inspect
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from conftest import FLAVOUR

from tf_gradkit import _flavour, _hosts
from tf_gradkit._hosts import protocol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The package the tests imported: the checkout's in development, the installed
# wheel's under `make test-compat` (whose tests/ lie outside any source tree).
PACKAGE = os.path.dirname(os.path.abspath(tf_gradkit.__file__))
OTHER = {"keras3": "tf_keras", "tf_keras": "keras3"}[FLAVOUR]
HOST_CLASSES = ("OptimizerHost", "WrapperHost", "StateHost", "SlotHost")


def _hosts_modules():
    return [importlib.import_module(f"tf_gradkit._hosts.{f}") for f in _flavour.KERAS_MODULES]


def _declared():
    """Every member the protocol's classes declare (hooks and shared code)."""
    names = set()
    for name in HOST_CLASSES:
        names |= set(vars(getattr(protocol, name)))
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def _abstract(cls):
    """The hooks ``cls`` declares without a body (NotImplementedError)."""
    out = set()
    for name, member in vars(cls).items():
        fn = getattr(member, "__func__", member)
        if inspect.isfunction(fn):
            source = inspect.getsource(fn)
            if re.search(r"^\s+raise NotImplementedError\s*$", source, re.M):
                out.add(name)
    return out


# --------------------------------------------------------------- the hooks
def test_both_hosts_implement_exactly_the_declared_hooks():
    declared = _declared()
    for host in _hosts_modules():
        keras_api = set(dir(host.Optimizer)) | set(host.KERAS_INSTANCE_ATTRIBUTES)
        for name in HOST_CLASSES:
            cls, base = getattr(host, name), getattr(protocol, name)
            assert issubclass(cls, base), (host.FLAVOUR, name)
            # Every hook without a body is implemented below the protocol.
            for hook in set().union(*(_abstract(c) for c in base.__mro__
                                      if c.__module__ == protocol.__name__)):
                owner = next(c for c in cls.__mro__ if hook in vars(c))
                assert owner.__module__ == host.__name__, (host.FLAVOUR, name, hook)
            # Nothing but declared hooks and the flavour's own Keras API.
            own = {n for n in vars(cls) if not (n.startswith("__") and n.endswith("__"))}
            undeclared = sorted(own - declared - keras_api)
            assert not undeclared, (host.FLAVOUR, name, undeclared)


def test_declared_hooks_shadow_nothing_of_either_keras():
    # A hook with the name of a member of Keras's Optimizer would replace it.
    hooks = {n for n in _declared() if n.startswith("_")}
    for host in _hosts_modules():
        clash = sorted(n for n in hooks if hasattr(host.Optimizer, n)
                       and n not in host.KERAS_INSTANCE_ATTRIBUTES)
        assert not clash, (host.FLAVOUR, clash)


def test_both_host_modules_give_every_host_function():
    for host in _hosts_modules():
        for name in protocol.HOST_FUNCTIONS:
            assert callable(getattr(host, name, None)), (host.FLAVOUR, name)
        for name in protocol.HOST_ATTRIBUTES:
            assert hasattr(host, name), (host.FLAVOUR, name)
        public = {n for n, v in vars(host).items() if not n.startswith("_")
                  and inspect.isfunction(v)}
        extra = sorted(public - set(protocol.HOST_FUNCTIONS) - set(protocol.HOST_ATTRIBUTES))
        assert not extra, (host.FLAVOUR, extra)


# ------------------------------------------------- private Keras members
ALLOWED = {}  # "path:name" -> why; starts (and stays) empty
_KERAS_SOURCES = ("keras/src", "tf_keras/src")
# TensorFlow internals an algorithm, callback or tool could reach for
# (core/ is pure TensorFlow and knows no host: its ops imports are its own).
_TF_SOURCES = ("tensorflow/python/trackable", "tensorflow/python/distribute",
               "tensorflow/python/data", "tensorflow/python/training")
_DEFINED = re.compile(r"(?:def\s+|\.|^\s+)(_[A-Za-z]\w*)\s*(?:\(|=)", re.M)


def _names_in(relative_dirs):
    names = set()
    site = os.path.dirname(os.path.dirname(tf.__file__))
    for rel in relative_dirs:
        for path in glob.glob(os.path.join(site, rel, "**", "*.py"), recursive=True):
            if "/tests/" in path or path.endswith("_test.py"):
                continue
            with open(path, encoding="utf-8", errors="ignore") as f:
                names.update(_DEFINED.findall(f.read()))
    return names


def _own_names():
    """Private names tf_gradkit defines itself: functions, classes, class
    attributes, and attributes it assigns on ``self``/``cls`` outside the
    hosts (the hosts also assign Keras's own, which stay Keras's)."""
    own = set()
    paths = glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
    assert paths, f"no module found under {PACKAGE}"
    for path in paths:
        in_hosts = os.sep + "_hosts" + os.sep in path
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):  # noqa: SIM115
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            if isinstance(node, ast.ClassDef):
                own |= {t.id for s in node.body if isinstance(s, ast.Assign)
                        for t in s.targets if isinstance(t, ast.Name)}
            if isinstance(node, ast.Assign) and not in_hosts:
                for target in node.targets:
                    for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                and t.value.id in ("self", "cls")):
                            own.add(t.attr)
    return own


def _private_reads(tree):
    """``(line, name)`` of each private attribute read (``x._name``,
    ``getattr(x, "_name")``) and each import from a private module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            yield node.lineno, node.args[1].value
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, "import " + node.module


@pytest.mark.keras_free
def test_no_private_keras_member_is_read_outside_the_hosts():
    keras_names = _names_in(_KERAS_SOURCES) - _own_names()
    tf_names = _names_in(_TF_SOURCES) - _own_names()
    assert "_var_key" in keras_names and "_no_dependency" in tf_names  # the scan sees
    found = []
    for path in sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, os.path.dirname(PACKAGE))
        parts = rel.split(os.sep)
        if parts[1] in ("_hosts", "keras3", "tf_keras"):  # the flavours' own code
            continue
        in_core = parts[1] == "core"
        tree = ast.parse(open(path, encoding="utf-8").read())  # noqa: SIM115
        for line, name in _private_reads(tree):
            if name.startswith("import "):
                bad = re.match(r"import (keras|tf_keras)\.src\b", name) or (
                    not in_core and name.startswith("import tensorflow.python"))
            elif name.startswith("_") and not name.startswith("__") and name != "_replace":
                bad = (name in keras_names or (not in_core and name in tf_names)
                       or name == "_getframe")
            else:
                bad = False
            if bad and f"{rel}:{name}" not in ALLOWED:
                found.append(f"{rel}:{line}: {name}")
    assert not found, "\n".join(found)


# ----------------------------------------------------------- publishing
def test_both_flavour_packages_publish_the_same_names():
    k3 = importlib.import_module("tf_gradkit.keras3")
    tk = importlib.import_module("tf_gradkit.tf_keras")
    assert sorted(k3.__all__) == sorted(tk.__all__)
    for sub in ("callbacks", "constraints"):
        assert sorted(getattr(k3, sub).__all__) == sorted(getattr(tk, sub).__all__), sub
    assert set(_hosts.OPTIMIZERS) <= set(k3.__all__)


def test_the_flavour_count_is_the_one_the_architecture_states():
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    stated = re.search(r"\*\*(\w+) Keras flavours\*\*", text)
    assert stated, "docs/architecture.md states how many flavours there are"
    words = {"one": 1, "two": 2, "three": 3, "four": 4}
    assert words[stated.group(1)] == len(_flavour.KERAS_MODULES)
    hosts = [p for p in glob.glob(os.path.join(PACKAGE, "_hosts", "*.py"))
             if os.path.basename(p) not in ("__init__.py", "protocol.py")]
    assert sorted(os.path.basename(p)[:-3] for p in hosts) == sorted(_flavour.KERAS_MODULES)
    packages = [os.path.basename(os.path.dirname(p))
                for p in glob.glob(os.path.join(PACKAGE, "*", "__init__.py"))]
    flavour_packages = sorted(p for p in packages if os.path.exists(
        os.path.join(PACKAGE, "_hosts", p + ".py")))
    assert flavour_packages == sorted(_flavour.KERAS_MODULES)


def _flavour_package_files(flavour):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(PACKAGE, flavour, "*.py")))


def test_a_new_flavours_cost_is_the_one_the_architecture_states():
    """docs/architecture.md's "a Keras flavour: N package files": a host
    module, the flavour package's files (the same in every flavour), and the
    two files that list the flavours (`_flavour.py`, `tf_gradkit/__init__.py`)."""
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    stated = re.search(r"\*\*a Keras flavour\*\*: (\d+) package files", text)
    assert stated, "docs/architecture.md states what a new flavour costs"
    files = {f: _flavour_package_files(f) for f in _flavour.KERAS_MODULES}
    first = next(iter(files.values()))
    assert all(v == first for v in files.values()), files
    listing = []
    for name in ("_flavour.py", "__init__.py"):
        with open(os.path.join(PACKAGE, name), encoding="utf-8") as f:
            source = f.read()
        if all(f'"{flavour}"' in source for flavour in _flavour.KERAS_MODULES):
            listing.append(name)
    assert listing == ["_flavour.py", "__init__.py"], listing
    assert int(stated.group(1)) == 1 + len(first) + len(listing), (stated.group(0), first)


def _tf_gradkit_classes(optimizer):
    from tf_gradkit._optimizer_tree import optimizer_chain  # noqa: PLC0415
    return {type(o).__name__ for o in optimizer_chain(optimizer)
            if type(o).__module__.startswith("tf_gradkit.")}


def test_battery_and_save_load_matrix_cover_every_optimizer(K, gk):
    from helpers import mlp  # noqa: PLC0415
    import test_battery  # noqa: PLC0415
    import test_save_load  # noqa: PLC0415

    battery = set()
    for factory in test_battery.OPTIMIZERS.values():
        battery |= _tf_gradkit_classes(factory(K, gk, mlp(K)))
    assert set(_hosts.OPTIMIZERS) <= battery, set(_hosts.OPTIMIZERS) - battery
    matrix = set()
    makers = test_save_load._optimizers(K, gk)  # pylint: disable=protected-access
    for name in test_save_load.NAMES:
        matrix |= _tf_gradkit_classes(makers[name](mlp(K)))
    assert set(_hosts.OPTIMIZERS) <= matrix, set(_hosts.OPTIMIZERS) - matrix


# ------------------------------------------- the other flavour's objects
@pytest.fixture(scope="module")
def other():
    """``(Keras, tf_gradkit flavour package)`` of the flavour this process
    is not."""
    keras = importlib.import_module(_flavour.KERAS_MODULES[OTHER])
    return keras, importlib.import_module(f"tf_gradkit.{OTHER}")


def test_host_of_reads_the_flavour_from_the_object(K, other):
    keras, _ = other
    for k, flavour in ((K, FLAVOUR), (keras, OTHER)):
        layer = k.layers.Dense(2)
        for obj in (layer, k.Sequential([layer]), k.optimizers.Adam()):
            assert _hosts.host_of(obj).FLAVOUR == flavour
    assert _hosts.host_of(object()) is None
    with pytest.raises(TypeError, match="`model` must be a Keras 3 or tf_keras object"):
        tf_gradkit.gradients.recompute_batch_norm_statistics(object(), [np.ones((2, 3))])


def test_wrapper_given_the_other_flavour_names_the_right_class(gk, other):
    keras, _ = other
    with pytest.raises(TypeError, match=f"use tf_gradkit.{OTHER}.GradientAccumulator"):
        gk.GradientAccumulator(keras.optimizers.Adam(), steps=2)


def test_recompute_batch_norm_statistics_on_the_other_flavour(other):
    keras, _ = other
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(32, 3)).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
    counts = tf_gradkit.gradients.recompute_batch_norm_statistics(
        model, tf.data.Dataset.from_tensor_slices(x).batch(8))
    assert counts == {model.layers[0].name: 32}
    bn = model.layers[0]
    # float64 pooling of float32 inputs, stored as float32.
    np.testing.assert_allclose(bn.moving_mean.numpy(), x.astype("float64").mean(0),
                               rtol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), x.astype("float64").var(0),
                               rtol=1e-5)


def test_per_example_gradient_norms_on_the_other_flavour(other):
    keras, _ = other
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 4)).astype("float32"), rng.normal(size=(5, 2)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(2)])
    mse = lambda t, p: tf.reduce_sum(tf.square(t - p), -1)  # noqa: E731
    norms = tf_gradkit.gradients.per_example_gradient_norms(model, mse, x, y)
    want = []
    for i in range(5):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(mse(y[i:i + 1], model(x[i:i + 1], training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        want.append(np.sqrt(sum(np.sum(np.square(g.numpy().astype("float64")))
                                for g in grads)))
    # float32 products in a different order: ~1e-6 relative.
    np.testing.assert_allclose(np.asarray(norms), want, rtol=1e-4)


def test_the_other_flavours_update_monitor_on_its_model(other):
    keras, flavour_package = other
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = [w.numpy().copy() for w in model.trainable_variables]
    monitor = flavour_package.callbacks.UpdateMonitor()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    after = [w.numpy() for w in model.trainable_variables]
    update = np.sqrt(sum(np.sum(np.square(a.astype("float64") - b))
                         for a, b in zip(after, before)))
    assert [r["step"] for r in monitor.history] == [1]
    # The delta of two float32 weights: a few bits of a 0.1-sized step.
    assert monitor.history[0]["layers"]["out"]["update_norm"] == pytest.approx(
        update, rel=1e-4)


@pytest.mark.keras_free  # its own Keras 3 process, once
def test_the_readme_example_after_importing_tfmot_in_a_keras3_process():
    # The README's five lines, with tfmot imported after tf.keras was used
    # (tfmot sets TF_USE_LEGACY_KERAS=1): tf.keras stays Keras 3, and so do
    # the names tf_gradkit.optimizers resolves. A new process: the import
    # changes the environment.
    code = (
        "import numpy as np\n"
        "import tensorflow as tf, tf_gradkit\n"
        "model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(1)])\n"
        "import tensorflow_model_optimization, os\n"
        "assert os.environ['TF_USE_LEGACY_KERAS'] == '1'\n"
        "opt = tf_gradkit.optimizers.GradientAccumulator(tf.keras.optimizers.Adam(1e-3),"
        " steps=4, model=model)\n"
        "model.compile(optimizer=opt, loss='mse')\n"
        "x, y = np.ones((64, 8), 'float32'), np.ones((64, 1), 'float32')\n"
        "model.fit(x, y, batch_size=16, verbose=0)\n"
        "assert int(opt.iterations.numpy()) == 1, opt.iterations\n"
        "assert tf_gradkit.optimizers.GradientAccumulator is "
        "tf_gradkit.keras3.GradientAccumulator\n")
    env = dict(os.environ, TF_USE_LEGACY_KERAS="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
