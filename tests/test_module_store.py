"""Compiled chunks kept as StableHLO modules beside the XLA cache
(`module_store`, issue 39): a second process finds the module and the
compiled program without tracing the solve, with the same results, and a
changed model, option or shape is never served another's module."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core import spd
from tf_gradkit.core.lm import batched, fitting, module_store, solve_cache

pytestmark = [pytest.mark.keras_free, pytest.mark.skipif(
    bool(tf.config.list_logical_devices("GPU")),
    reason="stored modules are kept on a CPU only (module_store.directory)")]


@pytest.fixture(autouse=True)
def _nothing_cached():
    """Each test starts as a new process would: no solve or module cached."""
    solve_cache.SOLVES.clear()
    module_store._loaded.clear()
    yield
    solve_cache.SOLVES.clear()
    module_store._loaded.clear()

OPTIONS = ("curve", ("cholesky", 1e-8, "float32"), False, None)


def _digest(model, x, options=OPTIONS):
    return module_store.digest(options, lambda v: model(v), (x,))


def test_digest_follows_the_model_options_and_shapes(monkeypatch):
    """Equal for the same model made again (a lambda from one line), and
    different for another constant in the model, other options or another
    shape, a trace choice or an engine constant; equal whatever the process
    traced before a model that calls a tf.function; None (not stored) where the
    model captures a tensor or a variable or has a custom gradient, or an
    option is keyed by identity or is a user's class."""
    x = tf.ones([4, 2])
    made = [lambda p, c=c: c * p[:, :1] * tf.exp(-p[:, 1:2]) for c in (2.0, 2.0, 3.0)]
    a, b, c = (_digest(m, x) for m in made)
    assert a is not None and len(a) == 64 and a == b and a != c
    assert _digest(made[0], tf.ones([5, 2])) != a
    assert _digest(made[0], x, OPTIONS[:-1] + (1,)) != a
    captured = tf.constant([1.0, 2.0])
    assert _digest(lambda p: p * captured, x) is None
    variable = tf.Variable([1.0, 2.0])
    assert _digest(lambda p: p * variable, x) is None

    assert _digest(lambda p: _scaled(p), x) is None   # a custom gradient

    def calling(c):   # a model that calls a tf.function (a library function)
        inner = tf.function(lambda p: c * p)
        return lambda p: inner(p)[:, :1] * tf.exp(-p[:, 1:2])
    first = _digest(calling(2.0), x)
    tf.function(lambda v: v + 1).get_concrete_function(tf.constant(1.0))
    assert first is not None and _digest(calling(2.0), x) == first   # counters aside
    assert _digest(calling(3.0), x) != first
    with spd.use_kernel("loop"):   # what the solve's trace reads
        assert _digest(made[0], x) != a
    monkeypatch.setattr(batched, "COMPACT_MIN_BATCH", 1024)
    assert _digest(made[0], x) != a

    class Mine:
        pass
    assert _digest(made[0], x, OPTIONS + (solve_cache.Identity(object()),)) is None
    assert _digest(made[0], x, OPTIONS + (Mine,)) is None
    assert module_store.arguments((x, object())) is None


def test_usable_only_in_a_plain_context(monkeypatch, tmp_path):
    """Modules are looked for only where the cache is on and the call's
    context adds nothing a stored program would leave out: not under a tape
    or a forward accumulator, op callbacks (check_numerics), functions run
    eagerly or a tf.distribute strategy."""
    monkeypatch.setattr(module_store.xla_cache, "DIRECTORY", str(tmp_path))
    assert module_store.usable()
    with tf.GradientTape():
        assert not module_store.usable()
    with tf.autodiff.ForwardAccumulator(tf.constant(1.0), tf.constant(1.0)):
        assert not module_store.usable()
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert not module_store.usable()
    tf.config.run_functions_eagerly(True)
    try:
        assert not module_store.usable()
    finally:
        tf.config.run_functions_eagerly(False)
    tf.debugging.enable_check_numerics()
    try:
        assert not module_store.usable()
    finally:
        tf.debugging.disable_check_numerics()
    assert module_store.usable()
    monkeypatch.setattr(module_store.xla_cache, "DIRECTORY", None)
    assert not module_store.usable()


def test_outputs_round_trip():
    """The output nest (named tuples of tf_gradkit, tuples, None) is written
    as JSON and rebuilt around the module's flat outputs; any other type is
    not stored."""
    t = tf.constant(1.0)
    sol = batched.BatchedSolution(*[t] * 10)
    nest = (sol, t, (t, None), ())
    code = json.loads(json.dumps(module_store._encode(nest)))
    flat = [tf.constant(float(i)) for i in range(len(tf.nest.flatten(nest)))]
    flat = [f for f, leaf in zip(flat, tf.nest.flatten(nest)) if leaf is not None]
    back = module_store._decode(code, iter(flat))
    assert isinstance(back[0], batched.BatchedSolution) and back[0].fun is None
    assert [float(v) for v in tf.nest.flatten(back) if v is not None] == \
        [float(v) for v in flat]
    with pytest.raises(TypeError, match="not stored"):
        module_store._encode({"a": t})


EXPORTED = """
module @chunk {
  func.func private @unused(%arg0: tensor<f32> loc("x.1")) -> tensor<f32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<f32> loc("add.1")
    return %0 : tensor<f32>
  }
  func.func private @called(%arg0: tensor<f32>) -> tensor<f32> {
    %0 = stablehlo.multiply %arg0, %arg0 : tensor<f32> loc("mul.1")
    return %0 : tensor<f32>
  }
  func.func @main(%arg0: tensor<f32>) -> tensor<f32> {
    %0 = stablehlo.exponential %arg0 : tensor<f32> loc("Exp")
    %1 = stablehlo.exponential %arg0 : tensor<f32> loc("Exp_1")
    %2 = call @called(%0) : (tensor<f32>) -> tensor<f32>
    %3 = stablehlo.add %2, %1 : tensor<f32>
    return %3 : tensor<f32>
  }
}
"""


def test_the_stored_module_is_the_export_without_uncalled_functions():
    """What is stored of TensorFlow's export (`_simplified`): the functions
    ``main`` does not call are dropped, and the locations; ``main`` and what
    it calls keep every op (the two equal exponentials are not merged, the
    call is not inlined: XLA is to compile the program the usual path
    compiles). Text MLIR cannot parse, or a module whose ``main`` would not
    stay (a private one), is kept as it is."""
    out = module_store._simplified(EXPORTED)
    assert "@unused" not in out and "loc(" not in out
    assert "@called" in out and "call @called" in out
    assert out.count("stablehlo.exponential") == 2
    assert out.count("stablehlo.multiply") == 1 and out.count("stablehlo.add") == 1
    assert module_store._simplified("not MLIR") == "not MLIR"
    private = EXPORTED.replace("func.func @main", "func.func private @main")
    assert module_store._simplified(private) == private   # not an empty module


SCRIPT = """
import json, sys
import numpy as np, tensorflow as tf
import tf_gradkit
from tf_gradkit.core import spd
from tf_gradkit.core.lm import module_store
for i in range(int(sys.argv[1])):   # functions traced first move TF's function counter
    tf.function(lambda v, i=i: v + i).get_concrete_function(tf.constant(1.0))
scale = float(sys.argv[2])

def model(t, p):
    return scale * p[:, :1] * tf.exp(-p[:, 1:2] * t[None, :])

rng = np.random.default_rng(0)
t = np.linspace(0, 3, 12).astype(np.float32)
truth = np.stack([np.linspace(1, 2, 40), np.linspace(0.5, 1.5, 40)], 1).astype(np.float32)
y = (scale * truth[:, :1] * np.exp(-truth[:, 1:2] * t)
     + 0.01 * rng.normal(size=(40, 12))).astype(np.float32)
fit = tf_gradkit.curve_fit(model, t, y, truth * 1.2, jit_compile=True)
out = dict(x=fit.x.numpy().tolist(), converged=bool(np.all(fit.converged.numpy())))
if sys.argv[3] == "usual":   # the compiled path without modules, in this process
    module_store.directory = lambda: None
    out["usual"] = tf_gradkit.curve_fit(model, t, y, truth * 1.2,
                                        jit_compile=True).x.numpy().tolist()
print("RESULT", json.dumps(out))
"""


def test_a_second_process_runs_the_stored_module(tmp_path):
    """With TF_GRADKIT_XLA_CACHE, the first process writes one module and
    gets what the usual compiled path gives; a second process, which traced
    other functions first, gets the same x bit for bit and compiles nothing
    (no new program in TensorFlow's cache); a process with another model
    writes a module of its own and fits its own data."""
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env["TF_GRADKIT_XLA_CACHE"] = str(tmp_path)

    def run(extra, scale, usual="-"):
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(extra), str(scale), usual],
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        line = [s for s in out.stdout.splitlines() if s.startswith("RESULT ")][-1]
        modules = sorted(os.listdir(tmp_path / module_store.FOLDER))
        programs = [n for n in os.listdir(tmp_path) if n.endswith(".pb")]
        return json.loads(line[len("RESULT "):]), modules, programs

    first, modules, programs = run(0, 1.0, "usual")
    assert first["converged"]
    assert [m.rsplit(".", 1)[1] for m in modules] == ["json", "mlirbc"]
    assert len(programs) == 2   # the module's program and the usual one
    assert first["x"] == first["usual"]   # XLA programs of the same ops
    written = {m: os.stat(tmp_path / module_store.FOLDER / m).st_mtime_ns for m in modules}
    second, modules2, programs2 = run(25, 1.0)
    assert second["x"] == first["x"]   # the same program, loaded
    assert modules2 == modules and sorted(programs2) == sorted(programs)
    assert written == {m: os.stat(tmp_path / module_store.FOLDER / m).st_mtime_ns
                       for m in modules}   # read, not written again
    # Another model (the amplitude doubled): its own module, and its own fit
    # (the first module would put the amplitudes at twice the truth).
    other, modules3, _ = run(0, 2.0)
    assert other["converged"] and len(modules3) == 4
    truth = np.stack([np.linspace(1, 2, 40), np.linspace(0.5, 1.5, 40)], 1)
    for fit in (first, other):   # noise 0.01 on amplitudes 1-4: within 5%
        np.testing.assert_allclose(fit["x"], truth, rtol=0.05)


def _decay(t, p):
    return (p[:, 0:1] * tf.exp(-p[:, 1:2] * t[None, :])
            + p[:, 2:3] * tf.exp(-p[:, 3:4] * t[None, :]))


def _decay_jac(t, p):
    a, b = tf.exp(-p[:, 1:2] * t[None, :]), tf.exp(-p[:, 3:4] * t[None, :])
    return tf.stack([a, -p[:, 0:1] * t * a, b, -p[:, 2:3] * t * b], -1)


@tf.custom_gradient
def _scaled(v):
    return 2.0 * v, lambda g: 2.0 * g


def _data(batch, seed=1):
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 4, 30)
    truth = np.c_[rng.uniform(1, 2, batch), rng.uniform(0.2, 0.5, batch),
                  rng.uniform(0.5, 1, batch), rng.uniform(1.5, 3, batch)]
    y = _decay(tf.constant(t), tf.constant(truth)).numpy() + 0.01 * rng.normal(
        size=(batch, 30))
    return t, y, truth * 1.3, rng


def _same_as_usual(monkeypatch, folder, call, files):
    """``call()`` with modules kept in ``folder`` (``files`` files there
    after it) and with none kept: the same results, to the bit."""
    monkeypatch.setattr(module_store, "directory", lambda: str(folder))
    stored = call()
    assert len(os.listdir(folder)) == files, sorted(os.listdir(folder))
    monkeypatch.setattr(module_store, "directory", lambda: None)
    usual = call()
    for field in ("x", "cost", "status", "covariance", "fun", "jac"):
        a, b = getattr(stored, field), getattr(usual, field)
        assert (a is None) == (b is None), field
        if a is not None:
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=field)
    return stored


def test_stored_modules_give_the_usual_compiled_results(tmp_path, monkeypatch):
    """In one process (the XLA cache itself off): a module run gives what
    the usual compiled solve gives, bit for bit (both are XLA programs of
    the same ops; measured equal), through float64 bounds, full_output,
    sigma and fixed parameters (per-fit `args` of least_squares_batched:
    the slow test below). A corrupted entry is not run but written again; one that fails
    to run falls back on the usual solve and is removed. No module is looked
    for under a GradientTape; nothing is written where the folder cannot be
    made (the usual solve runs)."""
    t, y, p0, _ = _data(40)
    folder = tmp_path / module_store.FOLDER

    def bounded(model=_decay):
        return tf_gradkit.curve_fit(
            model, t, y, p0, sigma=np.full(30, 0.5), bounds=(0, 10),
            parameters_to_fit=[True, True, False, True], full_output=True,
            jit_compile=True)

    _same_as_usual(monkeypatch, folder, bounded, 2)
    # Under a GradientTape no module is looked for (a spy on the key);
    # without one, the same call is.
    keyed, digest = [], module_store.digest
    monkeypatch.setattr(module_store, "directory", lambda: str(folder))
    monkeypatch.setattr(module_store, "digest", lambda *a: keyed.append(a))
    with tf.GradientTape():
        bounded(lambda t, p: _decay(t, p))
    assert keyed == []
    bounded(lambda t, p: _decay(t, p))
    assert len(keyed) == 1 and len(os.listdir(folder)) == 2
    monkeypatch.setattr(module_store, "digest", digest)
    # In a new process (nothing loaded or cached): a corrupted artifact (as by
    # a disk error) is not run but written again; a module that fails to run
    # falls back on the usual solve, and its files are removed.
    stem, = (folder / name[:-len(".json")] for name in os.listdir(folder)
             if name.endswith(".json"))
    path = stem.with_suffix(".mlirbc")
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    solve_cache.SOLVES.clear()
    module_store._loaded.clear()
    _same_as_usual(monkeypatch, folder, bounded, 2)
    assert json.loads(stem.with_suffix(".json").read_text())["sha256"] == \
        hashlib.sha256(path.read_bytes()).hexdigest()   # written again
    decode = module_store._decode

    def failing(*args):   # as a module TensorFlow cannot lower
        raise tf.errors.InvalidArgumentError(None, None, "cannot lower")
    monkeypatch.setattr(module_store, "_decode", failing)
    module_store._loaded.clear()   # as in a new process: the module is read
    _same_as_usual(monkeypatch, folder, bounded, 0)
    assert not stem.with_suffix(".json").exists()
    monkeypatch.setattr(module_store, "_decode", decode)
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setattr(module_store, "directory", lambda: str(blocked / "modules"))
    fit = bounded(lambda t, p: 1.0 * _decay(t, p))
    assert np.all(fit.converged.numpy()) and blocked.is_file()


@pytest.mark.filterwarnings("ignore::tf_gradkit.core.lm.fit_report.CovarianceWarning")
def test_a_chunk_without_a_proven_covariance_is_stored_and_runs(tmp_path, monkeypatch):
    """Fewer points than parameters (3 and 4): the chunk proves no
    covariance (its factor is not square) and the host computes it after
    the module ran, which is kept, read and run as for any other chunk (its
    two files are there after each call), with the usual results to the
    bit."""
    rng = np.random.default_rng(3)
    t = np.array([0.0, 1.0, 2.0])
    p0 = np.c_[rng.uniform(1, 2, 8), rng.uniform(0.2, 0.5, 8), rng.uniform(0, 1, (8, 2))]
    y = _decay(tf.constant(t), tf.constant(p0 * 1.1)).numpy()

    def call():
        return tf_gradkit.curve_fit(_decay, t, y, p0, jit_compile=True)

    folder = tmp_path / module_store.FOLDER
    _same_as_usual(monkeypatch, folder, call, 2)   # written
    solve_cache.SOLVES.clear()   # as in a new process: the module read and run
    module_store._loaded.clear()
    stored = _same_as_usual(monkeypatch, folder, call, 2)
    assert np.all(np.isinf(stored.covariance.numpy()))   # n <= P


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::tf_gradkit.core.lm.fit_report.CovarianceWarning")
def test_stored_modules_across_options(tmp_path, monkeypatch):
    """Per-fit `args` of `least_squares_batched` in float32 give the usual
    results through a module. Two calls that differ only in an option (the loss) get modules of
    their own, each with the usual results; so do a mask, 1,200 fits in two
    chunks of 600 (the compacted tail, two chunks in flight), an analytic
    `jac` with Poisson maximum likelihood (whose Jacobian calls library
    functions)."""
    t, y, p0, rng = _data(40)
    t32, y32, p32 = t.astype(np.float32), y.astype(np.float32), p0.astype(np.float32)
    mask = np.arange(30)[None, :] < rng.integers(20, 31, (40, 1))
    folder = tmp_path / module_store.FOLDER
    _same_as_usual(monkeypatch, folder, lambda: tf_gradkit.least_squares_batched(
        lambda x, obs: _decay(tf.constant(t32), x) - obs, p32, args=(y32,),
        jit_compile=True), 2)   # per-fit args, float32
    for loss, files in (("cauchy", 4), ("soft_l1", 6)):
        _same_as_usual(monkeypatch, folder, lambda loss=loss: tf_gradkit.curve_fit(
            _decay, t32, y32, p32, loss=loss, mask=mask, jit_compile=True), files)
    tb, yb, pb, _ = _data(1200, seed=2)   # two chunks with the compacted tail
    monkeypatch.setattr(fitting, "TAIL_MIN_FITS", 1200)
    big = _same_as_usual(monkeypatch, folder, lambda: tf_gradkit.curve_fit(
        _decay, tb, yb, pb, batch_size=600, jit_compile=True), 8)
    assert np.all(big.converged.numpy())
    counts = np.random.default_rng(3).poisson(20 * y).astype(np.float64)
    _same_as_usual(monkeypatch, folder, lambda: tf_gradkit.curve_fit(
        lambda t, p: 20 * _decay(t, p), t, counts, p0, estimator="mle",
        jac=lambda t, p: 20 * _decay_jac(t, p), jit_compile=True), 10)
