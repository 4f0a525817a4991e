"""Shared fixtures. The Keras flavour is fixed per process by TF_USE_LEGACY_KERAS
(`make test` runs pytest once per flavour); tests use the fixtures below and
never import a Keras directly, so the same test runs under both."""

import gc
import importlib
import os

import numpy as np
import pytest
import tensorflow as tf

# The suite's processes run side by side and would share one persistent XLA
# cache directory (core/xla_cache.py): each test compiles its own programs.
# tests/test_small_fits.py tests the cache in processes of its own.
os.environ.setdefault("TF_GRADKIT_XLA_CACHE", "0")

from tf_gradkit import _flavour

# Two logical CPUs, so MirroredStrategy tests run on this 2-core machine; and,
# under `make test-gpu` (TF_GRADKIT_TWO_GPUS=1), the first GPU split into two
# logical GPUs, so the same tests run over GPUs with NCCL all-reduce. This
# must happen before TensorFlow initialises its devices, hence at import.
_cpus = tf.config.list_physical_devices("CPU")
_gpus = tf.config.list_physical_devices("GPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    if _gpus and os.environ.get("TF_GRADKIT_TWO_GPUS") == "1":
        tf.config.set_logical_device_configuration(
            _gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=8192)] * 2)
except RuntimeError:  # devices already initialised by an earlier import
    pass

# A test process builds thousands of models and traced functions, and
# Python's full collections rescan all of them: in a 4.5-minute Keras 3 run
# of four test files, 19 full collections took 12 of its 14 s of collector
# time. The imports (TensorFlow, Keras: permanent) are frozen out of the
# scans, and the young generations are collected less often. With a full
# collection every 100 middle ones that run's collector time was 4 s (no
# full collection); kept here at every 10, as by default, so that garbage
# that lived long still goes (the whole suite with this: largest process
# 4.6 GB, against 7.2 GB before, when each side was also one process).
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 10)

FLAVOUR = _flavour.active_flavour()
MODES = ("eager", "function", "jit")


def keras_module():
    """The Keras that `tf.keras` is in this process."""
    return importlib.import_module("tf_keras" if FLAVOUR == "tf_keras" else "keras")


@pytest.fixture(scope="session")
def K():  # noqa: N802
    return keras_module()


@pytest.fixture(scope="session")
def gk():
    """`tf_gradkit.keras3` or `tf_gradkit.tf_keras`, matching the process."""
    return importlib.import_module(f"tf_gradkit.{FLAVOUR}")


@pytest.fixture(scope="session")
def flavour():
    return FLAVOUR


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def mode_with_function_slow():
    """A module's own `mode` fixture (assign it to `mode` in the module) whose
    "function" case (tf.function without XLA) runs only under `make
    test-slow`: for modules where every test taking `mode` also runs "jit",
    the default run's graph-mode case of the same test and assertion."""
    @pytest.fixture(name="mode", params=[
        "eager", pytest.param("function", marks=pytest.mark.slow), "jit"])
    def _mode(request):
        return request.param
    return _mode


def compile_fn(fn, mode):
    """Wraps `fn` for eager, `tf.function` or `tf.function(jit_compile=True)`."""
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=(mode == "jit"))


# The global seed of every test; set TF_GRADKIT_TEST_SEED to run the suite on
# other seeds (a test that passes on one seed only is a defect).
SEED = int(os.environ.get("TF_GRADKIT_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(SEED)
    tf.random.set_seed(SEED)
    yield


@pytest.fixture(scope="session")
def two_cpus():
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs two logical CPU devices")
    return [d.name for d in devices[:2]]


@pytest.fixture(scope="session")
def two_gpus():
    devices = tf.config.list_logical_devices("GPU")
    if len(devices) < 2:
        pytest.skip("needs two logical GPUs (make test-gpu on a GPU machine)")
    return [d.name for d in devices[:2]]


@pytest.fixture(scope="session")
def mirrored(request):
    """One MirroredStrategy for the whole session: separate instances in one
    process restart their collective instance keys, and TensorFlow caches a
    key's shape, so a second strategy reducing other shapes aborts.

    Over two logical GPUs with NCCL all-reduce when there are two (`make
    test-gpu`), else over two logical CPUs."""
    if len(tf.config.list_logical_devices("GPU")) >= 2:
        return tf.distribute.MirroredStrategy(
            request.getfixturevalue("two_gpus"),
            cross_device_ops=tf.distribute.NcclAllReduce())
    return tf.distribute.MirroredStrategy(request.getfixturevalue("two_cpus"))
