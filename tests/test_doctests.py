"""Every docstring example in tf_gradkit runs as a doctest (issue 40), in
each flavour's process (`make test` runs this file under Keras 3 and under
tf_keras); those of the Keras-free `tf_gradkit.core` once, under Keras 3.

Collected from every module of the package (the public classes and functions
are defined in them; private helpers' examples run too). Each docstring's
namespace is its module's globals, then the public API over them (so
`GradientAccumulator` in an algorithm's docstring is the public class of the
process's flavour, as a user's `tf_gradkit.optimizers.GradientAccumulator`),
then what the examples take as given, as a reader of a docstring does:
`tf`, `np`, `keras` (the process's `tf.keras`), `tf_gradkit`, and a small
`model` (8 -> Dense(16, name="dense") -> Dense(1, name="out"), compiled with SGD and MSE)
with data `x` (64 x 8) and `y` (64 x 1), `dataset` (them in batches of 8) and
`loss_fn` (mean squared error).

An example that shows output is compared with it (numbers as printed). An
example that shows none is checked to run without raising; what it prints
(`fit`'s progress bar) is not compared. An example that needs what this
namespace cannot give (a tfmot-pruned model, a saved run) is marked
`# doctest: +SKIP` in its docstring; `test_skipped_examples_are_few_and_listed`
lists them so that a new one is a visible decision.
"""

import doctest
import importlib
import inspect
import pkgutil

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from tf_gradkit import _flavour

PUBLIC_PACKAGES = ("tf_gradkit", "tf_gradkit.optimizers", "tf_gradkit.layers",
                   "tf_gradkit.callbacks", "tf_gradkit.constraints", "tf_gradkit.gradients",
                   "tf_gradkit.pruning")

# Examples marked `+SKIP` (docstring name: why). A new skip must be added here.
SKIPPED = {
    "MaskAware": "needs a tfmot-pruned tf_keras model and a pruning schedule",
    "PruningStepper": "needs a tfmot-pruned tf_keras model and its training loop",
    "attach": "needs an optimizer config saved by an earlier run",
    "load_optimizer_state": "needs a run directory saved by an earlier run",
}


def _modules():
    names = ["tf_gradkit"]
    for info in pkgutil.walk_packages(tf_gradkit.__path__, "tf_gradkit."):
        names.append(info.name)
    return sorted(names)


def _public_names():
    names = {}
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            try:
                names[name] = getattr(module, name)
            except (AttributeError, ImportError):
                continue
    return names


def _given():
    keras = tf.keras
    rng = np.random.RandomState(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense"),
                              keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = rng.randn(64, 8).astype("float32"), rng.randn(64, 1).astype("float32")
    return {"tf": tf, "np": np, "keras": keras, "tf_gradkit": tf_gradkit, "model": model,
            "x": x, "y": y, "dataset": tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
            "loss_fn": keras.losses.MeanSquaredError()}


def _examples():
    """Each docstring with examples once (a public class made per flavour
    carries its algorithm's docstring: run where the algorithm is defined)."""
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            if test.examples and (test.docstring not in found or (
                    test.lineno is not None and found[test.docstring].lineno is None)):
                found[test.docstring] = test
    return sorted(found.values(), key=lambda t: t.name)


TESTS = _examples()


class _Checker(doctest.OutputChecker):
    """Compares shown output; an example that shows none only has to run."""

    def check_output(self, want, got, optionflags):
        return True if not want.strip() else super().check_output(want, got, optionflags)


def _clear_session():
    """Keras's global state reset, without Keras 3's full `gc.collect()`
    (``free_memory``): in a test process of this size each took about 1.4 s,
    about 45 s over the examples; Python's own collections free the same
    garbage."""
    clear = tf.keras.backend.clear_session
    if "free_memory" in inspect.signature(clear).parameters:
        clear(free_memory=False)
    else:
        clear()


@pytest.mark.parametrize("test", TESTS, ids=[t.name for t in TESTS])
def test_docstring_example_runs(test):
    if test.name.startswith("tf_gradkit.core.") and _flavour.active_flavour() == "tf_keras":
        pytest.skip("tf_gradkit.core imports no Keras: its examples run once, under Keras 3")
    globs = dict(test.globs)
    globs.update(_public_names())
    globs.update(_given())
    test = doctest.DocTest(test.examples, globs, test.name, test.filename, test.lineno,
                           test.docstring)
    runner = doctest.DocTestRunner(checker=_Checker(), verbose=False,
                                   optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    runner.run(test, out=report.append)
    _clear_session()
    assert runner.failures == 0, "".join(report)


def test_skipped_examples_are_few_and_listed():
    skipped = {t.name.rsplit(".", 1)[-1] for t in TESTS
               for e in t.examples if e.options.get(doctest.SKIP)}
    assert skipped == set(SKIPPED), (
        f"examples marked +SKIP: {sorted(skipped)}; listed in SKIPPED: {sorted(SKIPPED)}")

