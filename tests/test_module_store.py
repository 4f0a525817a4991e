"""Compiled chunks kept as StableHLO modules beside the XLA cache
(`module_store`, issue 39): a second process finds the module and the
compiled program without tracing the solve, with the same results, and a
changed model, option or shape is never served another's module."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.lm import batched, module_store, solve_cache

pytestmark = pytest.mark.keras_free

OPTIONS = ("curve", ("cholesky", 1e-8, "float32"), False, None)


def _digest(model, x, options=OPTIONS):
    return module_store.digest(options, lambda v: model(v), (x,))


def test_digest_follows_the_model_options_and_shapes():
    """Equal for the same model made again (a lambda from one line), and
    different for another constant in the model, other options or another
    shape; None (not stored) where the model captures a tensor or a variable,
    or an option is keyed by identity or is a user's class."""
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

    class Mine:
        pass
    assert _digest(made[0], x, OPTIONS + (solve_cache.Identity(object()),)) is None
    assert _digest(made[0], x, OPTIONS + (Mine,)) is None
    assert module_store.arguments((x, object())) is None


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


SCRIPT = """
import json, sys
import numpy as np, tensorflow as tf
import tf_gradkit
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
    # Same algorithm and HLO ops; the two lowering routes may round float32
    # differently (a few ulp per step, amplified by the fits' conditioning of
    # about 1e2): 1e-5 relative. Measured equal.
    np.testing.assert_allclose(first["x"], first["usual"], rtol=1e-5)
    second, modules2, programs2 = run(25, 1.0)
    assert second["x"] == first["x"]   # the same program, loaded
    assert modules2 == modules and sorted(programs2) == sorted(programs)
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


def test_stored_modules_give_the_usual_compiled_results(tmp_path, monkeypatch):
    """In one process (the XLA cache itself off): a module run gives what
    the usual compiled solve gives, bit for bit (measured; both are XLA's
    program of the same HLO ops), through float64 bounds, full_output,
    sigma, fixed parameters, a robust loss, a mask and least_squares_batched;
    a residual function that captures a tensor is not stored and runs the
    usual way."""
    rng = np.random.default_rng(1)
    t = np.linspace(0, 4, 30)
    truth = np.c_[rng.uniform(1, 2, 40), rng.uniform(0.2, 0.5, 40),
                  rng.uniform(0.5, 1, 40), rng.uniform(1.5, 3, 40)]
    y = _decay(tf.constant(t), tf.constant(truth)).numpy() + 0.01 * rng.normal(size=(40, 30))
    y32, t32, p32 = y.astype(np.float32), t.astype(np.float32), (truth * 1.3).astype(np.float32)
    observed = tf.constant(y32)
    mask = np.arange(30)[None, :] < rng.integers(20, 31, (40, 1))
    cases = [
        (lambda: tf_gradkit.curve_fit(
            _decay, t, y, truth * 1.3, sigma=np.full(30, 0.5), bounds=(0, 10),
            parameters_to_fit=[True, True, False, True], full_output=True,
            jit_compile=True), 2),
        (lambda: tf_gradkit.curve_fit(
            _decay, t32, y32, p32, loss="cauchy", mask=mask,
            jit_compile=True), 4),
        (lambda: tf_gradkit.least_squares_batched(
            lambda x: _decay(tf.constant(t32), x) - observed, p32, jit_compile=True), 4),
    ]
    folder = tmp_path / module_store.FOLDER
    for call, files in cases:
        monkeypatch.setattr(module_store, "directory", lambda: str(folder))
        stored = call()
        assert len(os.listdir(folder)) == files
        monkeypatch.setattr(module_store, "directory", lambda: None)
        usual = call()
        for field in ("x", "cost", "status", "covariance", "fun", "jac"):
            a, b = getattr(stored, field), getattr(usual, field)
            assert (a is None) == (b is None), field
            if a is not None:
                np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=field)
