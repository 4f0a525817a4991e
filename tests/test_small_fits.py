"""The small-problem batched engine (issue 39): the by-columns linearisation
and the unrolled Cholesky against TensorFlow's own kernels, solver="auto"
resolved alike by `least_squares` and the batched fits, the float32 default
of `curve_fit`, and the persistent XLA cache's rules."""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core import xla_cache
from tf_gradkit.core.lm import (batched, batched_parts, damping, fit_report, fitting,
                                linear_solvers, solve_cache, small, step, whole_solve)

pytestmark = pytest.mark.keras_free


def gaussian(xy, p):
    dx = xy[0][None, :] - p[:, 1:2]
    dy = xy[1][None, :] - p[:, 2:3]
    return p[:, 0:1] * tf.exp(-(dx * dx + dy * dy) / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5]


def spots(batch, size=5, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    xy = np.stack([xx.ravel(), yy.ravel()]).astype(dtype)
    truth = np.c_[rng.uniform(50, 100, batch), rng.uniform(1.5, size - 2.5, (batch, 2)),
                  rng.uniform(1, 2, batch), rng.uniform(0, 10, batch)].astype(dtype)
    y = gaussian(xy, truth).numpy() + rng.normal(size=(batch, size * size)).astype(dtype)
    p0 = (truth * rng.uniform(0.9, 1.1, truth.shape)).astype(dtype)
    return xy, y, p0


@pytest.mark.parametrize("p", [1, 5, 10])
def test_columns_linearisation_matches_matrix_product(p):
    """Under XLA (where `small.by_columns` holds) the Jacobian by columns and
    J^T J by sums equal a GradientTape Jacobian and its matrix product (float64:
    the sums differ in order only, so 1e-12 relative)."""
    rng = np.random.default_rng(p)
    x = tf.constant(rng.normal(size=(7, p)))
    w = tf.constant(rng.normal(size=(p, 13)))

    def residual_fn(x):
        return tf.sin(x @ w) + tf.square(x[:, :1])

    @tf.function(jit_compile=True, autograph=False)
    def columns(x):
        assert small.by_columns(p)
        r, jac = batched_parts.jacobian(residual_fn, x)
        return r, jac, batched_parts.normal_equations(jac, r)

    r, jac, (jtj, jtr) = columns(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        ref_r = residual_fn(x)
    ref_jac = tape.batch_jacobian(ref_r, x)
    np.testing.assert_allclose(r, ref_r, rtol=1e-12)
    np.testing.assert_allclose(jac, ref_jac, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(jtj, tf.matmul(ref_jac, ref_jac, transpose_a=True),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(jtr, tf.einsum("bnp,bn->bp", ref_jac, ref_r),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(jtj, tf.transpose(jtj, [0, 2, 1]))   # mirrored


def test_unrolled_cholesky_matches_library():
    """The unrolled solve against tf.linalg (float64, condition ~1e2: 1e-10),
    and ``ok`` False with zeros on an indefinite system (control)."""
    rng = np.random.default_rng(1)
    m = rng.normal(size=(6, 8, 8))
    a = np.einsum("bij,bkj->bik", m, m) + 3 * np.eye(8)
    rhs = rng.normal(size=(6, 8))
    a[5] = -a[5]
    x, ok = batched_parts.unrolled_cholesky_solve(tf.constant(a), tf.constant(rhs))
    np.testing.assert_array_equal(ok, [True] * 5 + [False])
    np.testing.assert_allclose(x[:5], np.linalg.solve(a[:5], rhs[:5, :, None])[..., 0], rtol=1e-10)
    np.testing.assert_array_equal(x[5], np.zeros(8))


def test_auto_solver_resolves_alike():
    """"auto" is Cholesky up to 10 parameters and QR above, in the batched
    fits and in `least_squares` (the same steps, to the bit, as naming the
    solver)."""
    assert small.resolve_solver("auto", 10) == "cholesky"
    assert small.resolve_solver("auto", 11) == "qr"
    assert small.resolve_solver("qr", 3) == "qr"
    t = tf.constant(np.linspace(0, 4, 30))
    y = 3.0 * tf.exp(-0.7 * t) + 0.1 * tf.sin(7 * t)
    results = {}
    for solver in ("auto", "cholesky"):
        var = tf.Variable([1.0, 1.0], dtype=tf.float64)
        r = tf_gradkit.least_squares(lambda: var[0] * tf.exp(-var[1] * t) - y, [var],
                                     solver=solver, jit_compile=False)
        results[solver] = (var.numpy(), int(r.iterations))
    np.testing.assert_array_equal(results["auto"][0], results["cholesky"][0])
    assert results["auto"][1] == results["cholesky"][1]


@pytest.mark.slow   # two compiles: 55 s under load on 2 shared cores
def test_defaults_keep_float32_and_match_compiled_general_path():
    """float32 data with a list p0 solve in float32 by default; a float64
    ``p0`` array promotes to float64 (numpy's rule). The default (compiled,
    small-P columns, auto solver) fits end where the uncompiled general
    path (matrix product, library Cholesky) ends: same status, parameters to
    1e-6 relative (float64, tolerances 1e-10, above round-off)."""
    xy, y, p0 = spots(8)
    fit = tf_gradkit.curve_fit(gaussian, xy, y, p0.tolist(), max_iterations=1,
                               jit_compile=False)
    assert fit.x.dtype == tf.float32
    assert fitting._data_dtype(p0.astype(np.float64), y) == tf.float64
    assert fitting._data_dtype([1.0], [2.0]) == tf.float64
    xy, y, p0 = spots(8, dtype=np.float64)
    tol = dict(ftol=1e-10, xtol=1e-10, gtol=1e-10)
    fast = tf_gradkit.curve_fit(gaussian, xy, y, p0, **tol)
    slow = tf_gradkit.curve_fit(gaussian, xy, y, p0, jit_compile=False, **tol)
    assert bool(np.all(fast.converged.numpy()))
    np.testing.assert_array_equal(fast.status, slow.status)
    np.testing.assert_allclose(fast.x, slow.x, rtol=1e-6)


class _Context:
    def __init__(self, started):
        self._context_handle = object() if started else None


@pytest.mark.parametrize("environ, started, expect", [
    ({}, False, None),                                    # off unless asked for
    ({"TF_GRADKIT_XLA_CACHE": "1"}, False, "default"),
    ({"TF_GRADKIT_XLA_CACHE": "1", "TF_XLA_FLAGS": "--tf_xla_auto_jit=2"}, False, "appended"),
    ({"TF_GRADKIT_XLA_CACHE": "0"}, False, None),
    ({"TF_GRADKIT_XLA_CACHE": "/some/dir"}, False, "/some/dir"),
    ({"TF_GRADKIT_XLA_CACHE": "1", "TF_XLA_FLAGS": "--tf_xla_persistent_cache_directory="},
     False, None),
    ({"TF_GRADKIT_XLA_CACHE": "1"}, True, None),
])
def test_xla_cache_rules(monkeypatch, environ, started, expect):
    """The flag is added only where it can apply and the user chose nothing."""
    monkeypatch.setattr(xla_cache._context, "context_safe", lambda: _Context(started))
    env, seen = dict(environ), []
    got = xla_cache.configure(env, read_flags=lambda: seen.append(env.get("TF_XLA_FLAGS")))
    assert env == environ                      # the environment is left as it was
    if expect is None:
        assert got is None and seen == []
    elif expect == "appended":
        assert seen == [f"--tf_xla_auto_jit=2 {xla_cache.FLAG}={xla_cache.default_directory()}"]
    else:
        directory = xla_cache.default_directory() if expect == "default" else expect
        assert got == directory and seen == [f"{xla_cache.FLAG}={directory}"]


def test_xla_cache_fills_in_a_fresh_process_and_leaves_the_environment(tmp_path):
    """In a new process, ``import tf_gradkit`` alone makes a compiled fit
    write its program to the cache directory, and TF_XLA_FLAGS is what it was
    (children of the process inherit nothing of it)."""
    script = (
        "import os, numpy as np, tf_gradkit\n"
        "fit = tf_gradkit.curve_fit(lambda t, p: p[:, :1] * t, np.arange(4.0), "
        "np.ones([2, 4]), np.ones([2, 1]), jit_compile=True)\n"
        "print(repr(os.environ.get('TF_XLA_FLAGS')), bool(np.all(fit.converged.numpy())))\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env["TF_GRADKIT_XLA_CACHE"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["None", "True"], out.stdout
    assert any(name.endswith(".pb") for name in os.listdir(tmp_path)), os.listdir(tmp_path)
    # The control: not asked for, the default directory (under XDG_CACHE_HOME) is not made.
    del env["TF_GRADKIT_XLA_CACHE"]
    env["XDG_CACHE_HOME"] = str(tmp_path / "home")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["None", "True"], out.stderr[-2000:]
    assert not (tmp_path / "home" / "tf_gradkit").exists()   # (CUDA may cache there too)


def gaussian_jac(xy, p):
    """The model's analytic Jacobian [B, N, 5] (as Gpufit's GAUSS_2D)."""
    dx = xy[0][None, :] - p[:, 1:2]
    dy = xy[1][None, :] - p[:, 2:3]
    s2 = p[:, 3:4] ** 2
    g = tf.exp(-(dx * dx + dy * dy) / (2.0 * s2))
    a = p[:, 0:1]
    return tf.stack([g, a * g * dx / s2, a * g * dy / s2,
                     a * g * (dx * dx + dy * dy) / (s2 * p[:, 3:4]), tf.ones_like(g)], -1)


def test_analytic_jac_matches_autodiff():
    """``jac=`` (scipy's callable jac): the same fits as forward mode (float64,
    tolerances 1e-10 above round-off: same status, x to 1e-8), through sigma
    and mask; control: a jac with a zero column leaves that parameter at its
    start, so the user's jac is what the solve used; a wrong shape is refused
    naming `jac`."""
    xy, y, p0 = spots(6, dtype=np.float64)
    sigma = np.full(y.shape, 2.0)
    mask = np.ones(y.shape, bool)
    mask[0, :3] = False
    tol = dict(ftol=1e-10, xtol=1e-10, gtol=1e-10, jit_compile=False, sigma=sigma,
               mask=mask)
    auto = tf_gradkit.curve_fit(gaussian, xy, y, p0, **tol)
    given = tf_gradkit.curve_fit(gaussian, xy, y, p0, jac=gaussian_jac, **tol)
    np.testing.assert_array_equal(given.status, auto.status)
    np.testing.assert_allclose(given.x, auto.x, rtol=1e-8)
    np.testing.assert_allclose(given.covariance, auto.covariance, rtol=1e-6)

    def frozen_offset(xy, p):
        return gaussian_jac(xy, p) * tf.constant([1.0, 1, 1, 1, 0], tf.float64)

    with pytest.warns(UserWarning, match="covariance"):   # a zero column: rank-deficient
        control = tf_gradkit.curve_fit(gaussian, xy, y, p0, jac=frozen_offset, **tol)
    np.testing.assert_array_equal(control.x[:, 4], p0[:, 4])
    assert not np.allclose(auto.x[:, 4], p0[:, 4])
    with pytest.raises(ValueError, match="`jac` must return"):
        tf_gradkit.least_squares_batched(
            lambda x: gaussian(xy, x) - y, p0, jac=lambda x: gaussian_jac(xy, x)[:, :, :4],
            jit_compile=False)


def test_small_covariance_matches_svd_path():
    """The covariance's full-rank inverse (P <= 10, proven full rank) against
    the SVD pseudo-inverse (float64; condition of R below ~1e9 on these rows,
    so 1e-6 of the largest entry is far above round-off); a rank-deficient
    R (a zero pivot) still goes through the SVD and gets the shared rule's
    inf covariance (`fit_report.covariance_from_svd`)."""
    rng = np.random.default_rng(3)
    r = np.triu(rng.normal(size=(50, 5, 5))) + 3 * np.eye(5)
    r[4, 4, 4] = 1e-9
    r[5, 2, 2] = 0.0
    r = tf.constant(r)
    cost, counts = tf.ones([50], tf.float64), tf.fill([50], tf.constant(25.0, tf.float64))
    fast = batched_parts.covariance(r, cost, counts, False).numpy()
    original = small.COLUMNS_MAX_PARAMS
    try:
        small.COLUMNS_MAX_PARAMS = 0     # the SVD path for every row
        svd = batched_parts.covariance(r, cost, counts, False).numpy()
    finally:
        small.COLUMNS_MAX_PARAMS = original
    full = np.delete(np.arange(50), 5)
    scale = np.max(np.abs(svd[full]), axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(fast[full] / scale, svd[full] / scale, atol=1e-6)
    # the rank-deficient one: the shared rule's all-inf covariance, via the SVD
    assert np.all(np.isinf(fast[5])) and np.all(np.isinf(svd[5]))
    _, exact = small.full_rank_inverse(r, 2.2e-16 * counts)
    assert not bool(exact[5]) and bool(np.all(np.delete(exact.numpy(), 5)))


def gpufit_spots(batch, seed):
    """Gpufit's 5x5 benchmark data (Gpufit_Cpufit_Performance_Comparison.cpp,
    as ../shared/cpufit's driver makes them): truth (500, 2, 2, 1, 10) times
    U(0.9, 1.1), Gaussian noise of std = the mean amplitude / 10, starts the
    truth times U(0.9, 1.1); float32. On 10^5 of them 142 fits stopped at
    Cpufit's ftol=1e-4 with column cosines of 1.0e-3 to 1.6e-3."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:5, 0:5]
    xy = np.stack([xx.ravel(), yy.ravel()]).astype(np.float32)
    truth = np.array([500.0, 2.0, 2.0, 1.0, 10.0]) * rng.uniform(0.9, 1.1, (batch, 5))
    std = 2 * np.pi * 500.0 / 4.292 ** 2 / 10
    y = gaussian(xy, truth.astype(np.float32)).numpy() + rng.normal(
        0, std, (batch, 25)).astype(np.float32)
    p0 = (truth * rng.uniform(0.9, 1.1, truth.shape)).astype(np.float32)
    return xy, y.astype(np.float32), p0


def _clear_solves():
    solve_cache.SOLVES.clear()


def _spy_problems(monkeypatch):
    """The list each loop's problem count is appended to as it is built
    (`batched._problems`: the chunk's loop, then any compacted tail's)."""
    built = []
    real = batched._problems

    def spy(residual_fn, counts, box, options):
        built.append(int(counts.shape[0]))
        return real(residual_fn, counts, box, options)

    monkeypatch.setattr(batched, "_problems", spy)
    return built


@pytest.mark.parametrize("solver", [
    "auto", pytest.param("qr", marks=pytest.mark.slow)])   # "qr": a second compile pair
def test_compacted_tail_takes_the_same_steps(monkeypatch, solver):
    """When at most 1/16 of a chunk's fits still run, they go on gathered in
    a batch that size (`batched.COMPACT_FRACTION`): each fit ends exactly as
    in the loop over the whole chunk (float64; the same elementwise ops per
    fit, so status and iterations equal and x to round-off), and the
    compaction did happen (its `_problems` built for the gathered rows).
    With either solver: the gathered state includes the linearisation the
    loop carries, with its Jacobian for "qr". A call compiled by name with
    fewer than `fitting.TAIL_MIN_FITS` fits has no tail (its program is the
    smaller); "auto", once it moved to XLA, has it."""
    xy, y, p0 = spots(640, dtype=np.float64, seed=4)
    p0[::40, 3] *= 2.5     # 16 starts far off in width: the slow tail
    built = _spy_problems(monkeypatch)
    _clear_solves()
    with monkeypatch.context() as patched:
        patched.setattr(fitting, "TAIL_MIN_FITS", 640)
        compact = tf_gradkit.curve_fit(gaussian, xy, y, p0, ftol=1e-10, batch_size=640,
                                       jit_compile=True, solver=solver)
    assert built == [640, 640 // batched.COMPACT_FRACTION], built
    # "auto" past `AUTO_XLA_FITS` compiles with the tail at any call size:
    # here the program above, found again (nothing traced)
    monkeypatch.setattr(fitting, "AUTO_XLA_FITS", 640)
    monkeypatch.setattr(fitting, "_AUTO_FITS", solve_cache.SolveCache(maxsize=16))
    auto = tf_gradkit.curve_fit(gaussian, xy, y, p0, ftol=1e-10, batch_size=640,
                                solver=solver)
    assert len(built) == 2, built
    np.testing.assert_array_equal(auto.x.numpy(), compact.x.numpy())
    built.clear()
    _clear_solves()
    whole = tf_gradkit.curve_fit(gaussian, xy, y, p0, ftol=1e-10, batch_size=640,
                                 jit_compile=True, solver=solver)
    _clear_solves()
    assert built == [640], built   # 640 < TAIL_MIN_FITS: no tail
    it = whole.iterations.numpy()
    assert it.max() > 2 * np.median(it)          # there was a tail to compact
    np.testing.assert_array_equal(compact.status.numpy(), whole.status.numpy())
    np.testing.assert_array_equal(compact.iterations.numpy(), it)
    np.testing.assert_allclose(compact.x.numpy(), whole.x.numpy(), rtol=1e-10)
    np.testing.assert_allclose(compact.covariance.numpy(), whole.covariance.numpy(),
                               rtol=1e-8)
    assert np.all(compact.converged.numpy())


def test_loose_ftol_stop_is_converged_where_no_parameter_can_do_better(monkeypatch):
    """Cpufit's stopping rule (ftol=1e-4): a cost-tolerance stop where the
    Gauss-Newton step would lower the cost by at most ftol of it
    (`whole_solve.within_ftol`) is converged, not "stalled far from a
    minimum". Control: without that rule some of these fits are status 6;
    a single `least_squares` solve of such a fit is converged too, and the
    GN decrease at the batch's point, computed here by numpy, is within
    ftol of the cost."""
    xy, y, p0 = gpufit_spots(8000, seed=5)
    loose = dict(ftol=1e-4, max_iterations=10)
    _clear_solves()
    ruled = tf_gradkit.curve_fit(gaussian, xy, y, p0, **loose)
    monkeypatch.setattr(batched, "within_ftol",
                        lambda code, *rest: tf.zeros_like(code, tf.bool))
    _clear_solves()
    strict = tf_gradkit.curve_fit(gaussian, xy, y, p0, **loose)
    monkeypatch.undo()
    _clear_solves()
    flipped = np.flatnonzero(strict.status.numpy() == 6)
    assert flipped.size > 0
    assert np.all(ruled.status.numpy()[flipped] == 3)
    assert np.all(ruled.status.numpy() != 6)
    b = int(flipped[0])
    q = tf.Variable(p0[b])      # float32, as the batch
    one = tf_gradkit.least_squares(lambda: gaussian(xy, q[None])[0] - y[b], [q],
                                   **loose)
    assert int(one.reason_code) in (2, 3), one.reason
    # the rule's claim, checked independently (float64 numpy at the point)
    xb = ruled.x.numpy()[b].astype(np.float64)
    xy64 = xy.astype(np.float64)
    with tf.GradientTape() as tape:
        t = tf.constant(xb[None])
        tape.watch(t)
        r = gaussian(xy64, t)[0] - y[b].astype(np.float64)
    jac = tape.jacobian(r, t).numpy()[:, 0, :]
    r = r.numpy()
    step = np.linalg.lstsq(jac, -r, rcond=None)[0]
    decrease = 0.5 * (r @ r) - 0.5 * np.sum((r + jac @ step) ** 2)
    assert 0 <= decrease <= 1e-4 * 0.5 * (r @ r) * 1.01   # float32 point: 1% slack
    # and the rule itself: only for a cost-tolerance stop, only within ftol
    one, three = tf.constant(1.0), tf.constant(3, tf.int64)
    assert bool(whole_solve.within_ftol(three, 0.5e-4 * one, True, one, 1e-4))
    assert not bool(whole_solve.within_ftol(three, 2e-4 * one, True, one, 1e-4))
    assert not bool(whole_solve.within_ftol(three, 0.5e-4 * one, False, one, 1e-4))
    assert not bool(whole_solve.within_ftol(tf.constant(2, tf.int64), 0.0 * one, True,
                                            one, 1e-4))


@pytest.mark.parametrize("jtr, expect", [(1e-3, 1), (10.0, 5)])
def test_refused_step_within_ftol_ends_the_iteration(jtr, expect):
    """`step.levenberg_marquardt_step(give_up_below=ftol * cost)`: every trial
    is refused here (the cost always rises); a refused step that promised
    at most ``give_up_below`` (jtr 1e-3: 5e-7 of a cost of 1, against 1e-4)
    ends the iteration after one attempt, one that promised more (jtr 10)
    is retried up to ``max_attempts``; without the bound both retry."""
    v = tf.Variable([0.0], dtype=tf.float64)
    one = tf.constant(1.0, tf.float64)
    lin = linear_solvers.Linearization(cost=one, jtj=tf.constant([[1.0]], tf.float64),
                                       jtr=tf.constant([jtr], tf.float64))
    controller, scaling = damping.TrustRegion(), damping.Marquardt()
    for bound, attempts in ((1e-4 * one, expect), (None, 5)):
        state = step.init_state(controller, scaling, 1, tf.float64)
        _, info = step.levenberg_marquardt_step(
            lin, lambda: one + 1.0 + tf.reduce_sum(v) * 0.0, [v], state,
            controller=controller, scaling=scaling, solver=linear_solvers.Cholesky(),
            max_attempts=5, give_up_below=bound)
        assert int(info.attempts) == attempts and not bool(info.accepted)
        assert float(v[0]) == 0.0          # refused: the variable is restored


@pytest.mark.parametrize("case", ["fun_args_mask_bounds", "curve_sigma_fixed"])
def test_compaction_gathers_each_fits_data(monkeypatch, case):
    """The compacted tail rebuilds the residuals from the gathered rows of
    every per-fit input: `least_squares_batched`'s ``args``, ``mask`` and
    per-fit ``bounds``; `curve_fit`'s per-fit ``sigma`` and, with
    ``parameters_to_fit``, the fixed values (with ``solver="qr"``, whose
    gathered state holds the Jacobian). Each fit ends as in the loop
    over the whole chunk (float64: status and iterations equal, x to
    round-off), and the compacted loop was built (that a tail runs in it is
    shown by test_compacted_tail_takes_the_same_steps)."""
    rng = np.random.default_rng(11)
    b, n = 600, 30
    t = np.linspace(0.0, 3.0, n)
    rate = rng.uniform(0.5, 2.0, b)
    y = 4.0 * np.exp(-rate[:, None] * t) + 0.5 + 0.01 * rng.normal(size=(b, n))
    x0 = np.c_[np.full(b, 1.0), np.full(b, 1.0), np.zeros(b)]
    x0[::30, 1] = 40.0                 # 20 slow starts: the tail
    mask = np.arange(n)[None, :] < n - rng.integers(0, 10, b)[:, None]   # ragged
    upper = np.tile([np.inf, 50.0, np.inf], (b, 1))
    upper[1::7, 2] = 0.3               # a bound that holds for some fits

    def solve():
        _clear_solves()
        if case == "fun_args_mask_bounds":
            return tf_gradkit.least_squares_batched(
                lambda p, y, t: p[:, 0:1] * tf.exp(-p[:, 1:2] * t) + p[:, 2:3] - y,
                x0, args=(y, np.tile(t, (b, 1))), mask=mask,
                bounds=(np.zeros((b, 3)), upper), ftol=1e-12, batch_size=b,
                jit_compile=True)
        sigma = 0.01 * (1.0 + rng.uniform(size=(b, n)))
        return tf_gradkit.curve_fit(
            lambda t, p: p[:, 0:1] * tf.exp(-p[:, 1:2] * t) + p[:, 2:3], t, y,
            x0 + np.c_[np.zeros((b, 2)), np.linspace(0.4, 0.6, b)], sigma=sigma,
            parameters_to_fit=[1, 1, 0], ftol=1e-12, batch_size=b, jit_compile=True,
            solver="qr")   # the gathered state then holds the Jacobian too

    built = _spy_problems(monkeypatch)
    rng_state = rng.bit_generator.state
    with monkeypatch.context() as patched:
        patched.setattr(fitting, "TAIL_MIN_FITS", b)
        compact = solve()
    assert built[:2] == [b, b // batched.COMPACT_FRACTION], built
    rng.bit_generator.state = rng_state
    whole = solve()   # b < TAIL_MIN_FITS: no tail
    _clear_solves()
    it = whole.iterations.numpy()
    np.testing.assert_array_equal(compact.status.numpy(), whole.status.numpy())
    np.testing.assert_array_equal(compact.iterations.numpy(), it)
    # The same steps (asserted exactly above); x to round-off amplified by the
    # fit's conditioning: XLA's CPU code may round the compacted loop's
    # gathered, smaller arrays unlike the whole chunk's (other shapes, other
    # vectorisation: 3e-10 relative on 1 fit of 600 on an AMD EPYC under
    # `make test`'s XLA flags, 0 on the Intel machine before it).
    np.testing.assert_allclose(compact.x.numpy(), whole.x.numpy(), rtol=1e-8, atol=1e-12)
    assert np.mean(compact.converged.numpy()) > 0.95


def test_auto_engine_is_plain_until_the_fits_pay_for_xla(monkeypatch):
    """``jit_compile="auto"`` (the default): a plain tf.function until this
    function with these options has been given `fitting.AUTO_XLA_FITS` fits in
    this process (this call's included), XLA from then on; each call gives
    exactly what the engine it ran on gives when asked for by name (float64,
    bit for bit; below `batched.COMPACT_MIN_BATCH` fits a chunk, with
    no compacted tail either way, by name it is the very program "auto"
    compiled); a call that alone reaches the threshold compiles at once,
    and other options count apart."""
    monkeypatch.setattr(fitting, "AUTO_XLA_FITS", 12)
    monkeypatch.setattr(fitting, "_AUTO_FITS", solve_cache.SolveCache(maxsize=16))
    xy, y, p0 = spots(6, dtype=np.float64, seed=5)
    engines = []
    real = fitting._compiled

    def spy(kind, fn, options, key, jit_compile, *rest, **kw):
        engines.append(jit_compile)
        return real(kind, fn, options, key, jit_compile, *rest, **kw)

    monkeypatch.setattr(fitting, "_compiled", spy)
    _clear_solves()
    first = tf_gradkit.curve_fit(gaussian, xy, y, p0)           # 6 fits: plain
    second = tf_gradkit.curve_fit(gaussian, xy, y, p0)          # 12: XLA
    other = tf_gradkit.curve_fit(gaussian, xy, y, p0, ftol=1e-6)   # other options: 6
    big = tf_gradkit.curve_fit(gaussian, xy, np.tile(y, (2, 1)), np.tile(p0, (2, 1)),
                               ftol=1e-7)                       # 12 at once: XLA
    assert engines == [False, True, False, True], engines
    plain = tf_gradkit.curve_fit(gaussian, xy, y, p0, jit_compile=False)
    built = _spy_problems(monkeypatch)
    xla = tf_gradkit.curve_fit(gaussian, xy, y, p0, jit_compile=True)
    assert built == [], built   # the program "auto" compiled (no tail either way)
    _clear_solves()
    np.testing.assert_array_equal(first.x.numpy(), plain.x.numpy())
    np.testing.assert_array_equal(second.x.numpy(), xla.x.numpy())
    assert np.all(first.converged.numpy()) and np.all(second.converged.numpy())
    assert np.all(other.converged.numpy()) and np.all(big.converged.numpy())
    np.testing.assert_allclose(first.x.numpy(), second.x.numpy(), rtol=1e-6)


def test_least_squares_auto_engine_switches_after_repeated_calls(monkeypatch):
    """`least_squares`' ``jit_compile="auto"`` below `AUTO_XLA_PARAMS`: a plain
    tf.function until the same cached solve has been called
    `AUTO_XLA_CALLS` times (this call included), XLA from then on; each call
    gives bit for bit what the engine it ran on gives when asked for by name;
    other options count apart, and ``cache=False`` calls are not counted."""
    lsq = sys.modules["tf_gradkit.core.lm.least_squares"]
    monkeypatch.setattr(lsq, "AUTO_XLA_CALLS", 3)
    monkeypatch.setattr(lsq, "_AUTO_CALLS", solve_cache.SolveCache(maxsize=16))
    engines = []
    real = lsq._compiled

    def spy(build, residual_fn, inputs, jit_compile, key):
        engines.append(jit_compile)
        return real(build, residual_fn, inputs, jit_compile, key)

    monkeypatch.setattr(lsq, "_compiled", spy)
    t = tf.constant(np.linspace(0.0, 4.0, 40))
    y = 2.5 * np.exp(-1.3 * t.numpy()) + 0.2 + 0.01 * np.sin(7.0 * t.numpy())
    x = tf.Variable([1.0, 1.0, 0.0], dtype=tf.float64)

    def residuals():
        return x[0] * tf.exp(-x[1] * t) + x[2] - y

    def fit(**options):
        x.assign([1.0, 1.0, 0.0])
        result = tf_gradkit.least_squares(residuals, [x], **options)
        assert bool(result.converged)
        return x.numpy()

    _clear_solves()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = [fit(), fit(cache=False), fit(), fit(max_iterations=50), fit(), fit()]
    assert not [w for w in caught if "chose XLA" in str(w.message)]   # no fallback
    assert engines == [False, False, False, False, True, True], engines
    _clear_solves()   # each engine asked for by name traces on its own
    plain, xla = fit(jit_compile=False), fit(jit_compile=True)
    _clear_solves()
    for answer in auto[:3]:
        np.testing.assert_array_equal(answer, plain)
    np.testing.assert_array_equal(auto[4], xla)
    np.testing.assert_array_equal(auto[5], xla)
    np.testing.assert_allclose(auto[3], plain, rtol=1e-8)
    np.testing.assert_allclose(xla, plain, rtol=1e-8)
    engines.clear()   # without the solve cache every call traces: never worth XLA
    monkeypatch.setattr(solve_cache.SOLVES, "maxsize", 0)
    for _ in range(4):
        fit(max_iterations=60)
    assert engines == [False] * 4, engines


def _times_host_one(t):
    """``t`` times a 1 from the host (``tf.numpy_function``): an op XLA has
    no kernel for, on a path that leaves the derivatives to ``t``."""
    one = tf.numpy_function(lambda: np.array(1.0, t.dtype.as_numpy_dtype), [], t.dtype)
    one.set_shape([])
    return t * one


def test_auto_engine_stays_plain_where_xla_cannot_compile(monkeypatch):
    """``jit_compile="auto"`` chose XLA, not the user: a function XLA cannot
    compile runs on the plain engine (bit for bit ``jit_compile=False``),
    with one warning naming what XLA refused, and stays plain without
    another attempt; asked for by name, XLA's error stands. The same rule
    for `least_squares`, whose "auto" picks XLA from `AUTO_XLA_PARAMS`."""
    monkeypatch.setattr(fitting, "AUTO_XLA_FITS", 6)
    monkeypatch.setattr(fitting, "_AUTO_FITS", solve_cache.SolveCache(maxsize=16))
    xy, y, p0 = spots(6, dtype=np.float64, seed=5)

    def model(xy, p):
        return _times_host_one(gaussian(xy, p))

    _clear_solves()
    fallback = r"jit_compile='auto' chose XLA for this function, which XLA cannot "
    with pytest.warns(UserWarning, match=r"curve_fit: " + fallback + r"compile \(.*PyFunc"):
        first = tf_gradkit.curve_fit(model, xy, y, p0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = tf_gradkit.curve_fit(model, xy, y, p0)
    assert not [w for w in caught if "chose XLA" in str(w.message)]
    plain = tf_gradkit.curve_fit(model, xy, y, p0, jit_compile=False)
    np.testing.assert_array_equal(first.x.numpy(), plain.x.numpy())
    np.testing.assert_array_equal(again.x.numpy(), plain.x.numpy())
    assert np.all(first.converged.numpy())
    with pytest.raises(tf.errors.InvalidArgumentError, match="PyFunc"):
        tf_gradkit.curve_fit(model, xy, y, p0, jit_compile=True)

    lsq = sys.modules["tf_gradkit.core.lm.least_squares"]
    monkeypatch.setattr(lsq, "AUTO_XLA_PARAMS", 3)
    monkeypatch.setattr(lsq, "_AUTO_CALLS", solve_cache.SolveCache(maxsize=16))
    t = tf.constant(np.linspace(0.0, 4.0, 40))
    y = 2.5 * np.exp(-1.3 * t.numpy()) + 0.2
    x = tf.Variable([1.0, 1.0, 0.0], dtype=tf.float64)

    def residuals():
        return _times_host_one(x[0] * tf.exp(-x[1] * t) + x[2] - y)

    answers = []
    for expect_warning in (True, False, None):
        x.assign([1.0, 1.0, 0.0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = tf_gradkit.least_squares(
                residuals, [x], **({} if expect_warning is not None
                                   else {"jit_compile": False}))
        warned = [w for w in caught if "least_squares: " + fallback[:40] in str(w.message)]
        assert len(warned) == bool(expect_warning), [str(w.message) for w in caught]
        assert bool(result.converged)
        answers.append(x.numpy())
    np.testing.assert_array_equal(answers[0], answers[2])
    np.testing.assert_array_equal(answers[1], answers[2])
    np.testing.assert_allclose(answers[0], [2.5, 1.3, 0.2], rtol=1e-9)
    x.assign([1.0, 1.0, 0.0])   # asked for by name after the fallback: XLA's error
    with pytest.raises(tf.errors.InvalidArgumentError, match="PyFunc"):
        tf_gradkit.least_squares(residuals, [x], jit_compile=True)
    np.testing.assert_array_equal(x.numpy(), [1.0, 1.0, 0.0])   # nothing ran
    _clear_solves()


def test_parameter_reached_only_through_a_non_differentiable_op_is_flagged():
    """A parameter the model reaches only through an op TensorFlow does not
    differentiate has a zero Jacobian column: the fit leaves it at its
    start, `undetermined` is True, `covariance` inf, and the warning names
    that cause (scipy's finite differences would move it)."""
    xy, y, p0 = spots(3, dtype=np.float64, seed=2)

    def model(xy, p):
        held = tf.concat([p[:, :4], tf.stop_gradient(p[:, 4:5])], axis=1)
        return gaussian(xy, held)

    with pytest.warns(fit_report.CovarianceWarning,
                      match=r"reaches it only through an op TensorFlow does not "
                            r"differentiate \(tf.numpy_function, tf.stop_gradient"):
        fit = tf_gradkit.curve_fit(model, xy, y, p0, jit_compile=False)
    np.testing.assert_array_equal(fit.x.numpy()[:, 4], p0[:, 4])
    assert np.all(fit.undetermined.numpy())
    assert np.all(np.isinf(fit.covariance.numpy()))


@pytest.mark.parametrize("jit_compile", ["yes", None, 1])
def test_jit_compile_refused_by_name(jit_compile):
    xy, y, p0 = spots(2, dtype=np.float64)
    with pytest.raises(ValueError, match=r"curve_fit: `jit_compile` must be True, "
                       r"False or 'auto'. Received: jit_compile="):
        tf_gradkit.curve_fit(gaussian, xy, y, p0, jit_compile=jit_compile)
    ran = []

    def fun(p):
        ran.append(1)
        return p - 1.0

    with pytest.raises(ValueError, match=r"least_squares_batched: `jit_compile`"):
        tf_gradkit.least_squares_batched(fun, np.zeros([2, 2]), jit_compile=jit_compile)
    assert not ran      # refused before the user's function ran


def test_model_closing_over_per_fit_data_is_refused_by_name():
    """`f` closing over a per-fit array does not follow the chunks: refused
    naming `f`, the chunk's shape and where per-fit data go (17 fits run
    as a chunk of 18)."""
    xy, y, p0 = spots(17, dtype=np.float64, seed=7)
    offset = np.zeros([17, 1])

    def model(xy, p):
        return gaussian(xy, p) + offset

    with pytest.raises(ValueError, match=r"curve_fit: `f\(xdata, params\)` failed for "
                       r"`params` of shape \[18, 5\].*`xdata`"):
        tf_gradkit.curve_fit(model, xy, y, p0, jit_compile=False)


def test_small_calls_share_a_power_of_two_chunk(monkeypatch):
    """A call smaller than a chunk runs padded by at most 1/8 (`_padded`): 17
    and 18 fits trace one solve of 18, 1 fit one of 1 (sizes a movie's
    frames of changing spot counts reuse); each fit ends as in a call of its
    own (the padding rows do not touch it: x bit for bit in the same chunk
    shape), and plain mode traces no compacted tail."""
    assert [fitting._padded(b) for b in (1, 7, 9, 10, 17, 1000, 70000)] == [
        1, 7, 9, 10, 18, 1024, 73728]
    xy, y, p0 = spots(18, dtype=np.float64, seed=6)
    built = _spy_problems(monkeypatch)
    _clear_solves()
    part = tf_gradkit.curve_fit(gaussian, xy, y[:17], p0[:17], jit_compile=False)
    whole = tf_gradkit.curve_fit(gaussian, xy, y, p0, jit_compile=False)
    one = tf_gradkit.curve_fit(gaussian, xy, y[1], p0[1], jit_compile=False)
    assert built == [18, 1], built
    np.testing.assert_array_equal(part.x.numpy(), whole.x.numpy()[:17])
    # (one fit runs in a chunk of 1, other kernels: round-off apart)
    np.testing.assert_allclose(one.x.numpy(), whole.x.numpy()[1], rtol=1e-12)
    xy, y, p0 = spots(640, dtype=np.float64, seed=4)
    built.clear()
    tf_gradkit.curve_fit(gaussian, xy, y, p0, batch_size=640, jit_compile=False)
    _clear_solves()
    assert built == [640], built     # no second loop for the tail
    # least_squares_batched is not padded: a `fun` closing over its 3 fits' data works
    built.clear()
    xy, y, p0 = spots(3, dtype=np.float64, seed=6)
    fit = tf_gradkit.least_squares_batched(lambda x: gaussian(xy, x) - y, p0,
                                           jit_compile=False)
    _clear_solves()
    assert built == [3] and np.all(fit.converged.numpy()), (built, fit.status)


def test_a_call_just_over_a_chunk_runs_in_equal_chunks(monkeypatch):
    """With the chunk size left to the package, a call of a few more fits
    than a chunk runs as equal chunks on the padding grid (`_chunk_size`),
    not as a full chunk and a mostly padded one: 70 fits with room for 64 a
    chunk run as two of 36 (72 fits' work, not 128), each fit ending as with
    ``batch_size=36``; 120 fits (equal chunks would save under 1/8) keep the
    chunk of 64; a given `batch_size` is taken as given."""
    assert [fitting._chunk_size(b, 64, True, True) for b in (70, 100, 120, 128, 640)] \
        == [36, 52, 64, 64, 64]
    assert fitting._chunk_size(70, 64, False, True) == 64
    assert fitting._chunk_size(70, 64, True, False) == 36
    assert fitting._chunk_size(50, 64, True, False) == 50   # one chunk: unpadded
    xy, y, p0 = spots(120, dtype=np.float64, seed=8)
    monkeypatch.setattr(fitting, "CHUNK_BYTES_CPU", 64 * 25 * 5 * 8)   # 64 fits
    monkeypatch.setattr(fitting, "CHUNK_ELEMENTS", 64 * 25 * 5)         # (with a GPU)
    built = _spy_problems(monkeypatch)
    _clear_solves()
    fit = tf_gradkit.curve_fit(gaussian, xy, y[:70], p0[:70], jit_compile=False)
    assert built == [36], built   # one trace for both chunks
    built.clear()
    tf_gradkit.curve_fit(gaussian, xy, y, p0, jit_compile=False)
    assert built == [64], built
    built.clear()
    _clear_solves()
    tf_gradkit.curve_fit(gaussian, xy, y[:70], p0[:70], batch_size=64, jit_compile=False)
    assert built == [64], built
    _clear_solves()
    assert np.all(fit.converged.numpy()), fit.status
    # each fit as in the same chunks asked for by name (the padding rows do
    # not touch the others)
    given = tf_gradkit.curve_fit(gaussian, xy, y[:70], p0[:70], batch_size=36,
                                 jit_compile=False)
    np.testing.assert_array_equal(fit.x.numpy(), given.x.numpy())
    np.testing.assert_array_equal(fit.covariance.numpy(), given.covariance.numpy())
    _clear_solves()


def test_compiled_fits_take_half_the_chunk_where_l2_holds_it(monkeypatch):
    """On a CPU whose cores have at least 2 MB of L2 cache, with `batch_size`
    left to the package, a compiled solve takes chunks of
    `CHUNK_BYTES_CPU_COMPILED` of Jacobian (the 15x15 Gaussian and the decay
    ran 1.3-1.4x the fits per CPU-second at 2 MB as at 4 MB there, the 5x5
    1.1x); the plain engine and a CPU of less L2 (or none read) keep
    `CHUNK_BYTES_CPU`. Each fit ends as with that `batch_size` given by
    name."""
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("the CPU's chunk budget")
    f64 = tf.float64
    for l2 in (None, 2 ** 20, 2 ** 21 - 1):
        monkeypatch.setattr(fitting, "_core_l2_bytes", lambda l2=l2: l2)
        assert fitting._chunk_budget(True, f64) == fitting.CHUNK_BYTES_CPU // 8
    monkeypatch.setattr(fitting, "_core_l2_bytes", lambda: 2 ** 21)
    assert fitting._chunk_budget(True, f64) == fitting.CHUNK_BYTES_CPU_COMPILED // 8
    assert fitting._chunk_budget(False, f64) == fitting.CHUNK_BYTES_CPU // 8
    assert fitting._chunk_budget(True, tf.float32) == 2 ** 21 // 4
    monkeypatch.setattr(fitting, "CHUNK_BYTES_CPU", 32 * 40 * 2 * 8)            # 32 fits
    monkeypatch.setattr(fitting, "CHUNK_BYTES_CPU_COMPILED", 16 * 40 * 2 * 8)   # 16 fits
    rng = np.random.default_rng(3)
    t = np.linspace(0.0, 1.0, 40)
    truth = rng.uniform(1.0, 2.0, (64, 2))
    y = truth[:, :1] * t + truth[:, 1:] + rng.normal(0, 0.01, (64, 40))
    p0 = np.ones((64, 2))

    def line(t, p):
        return p[:, 0:1] * t[None, :] + p[:, 1:2]

    built = _spy_problems(monkeypatch)
    _clear_solves()
    plain = tf_gradkit.curve_fit(line, tf.constant(t), y, p0, jit_compile=False)
    assert built == [32], built
    built.clear()
    compiled = tf_gradkit.curve_fit(line, tf.constant(t), y, p0, jit_compile=True)
    assert built == [16], built
    given = tf_gradkit.curve_fit(line, tf.constant(t), y, p0, jit_compile=True,
                                 batch_size=16)
    _clear_solves()
    np.testing.assert_array_equal(compiled.x.numpy(), given.x.numpy())
    assert np.all(compiled.converged.numpy()) and np.all(plain.converged.numpy())
    np.testing.assert_allclose(compiled.x.numpy(), plain.x.numpy(), rtol=1e-9)


def test_core_l2_cache_is_read_from_sysfs(tmp_path):
    """`fitting._core_l2_bytes` reads the level-2 entry of Linux's cache
    folders ("2048K" is 2 MB), skipping the other levels, and gives None
    where there is no such entry or it cannot be read."""
    def entry(name, level, kind, size):
        folder = tmp_path / "cache" / name
        folder.mkdir(parents=True)
        for key, value in (("level", level), ("type", kind), ("size", size)):
            (folder / key).write_text(value + "\n")

    entry("index0", "1", "Data", "48K")
    entry("index1", "1", "Instruction", "64K")
    entry("index2", "2", "Unified", "2048K")
    entry("index3", "3", "Unified", "491520K")
    read = fitting._core_l2_bytes.__wrapped__
    assert read(str(tmp_path / "cache")) == 2 ** 21
    (tmp_path / "cache" / "index2" / "size").write_text("1M\n")
    assert read(str(tmp_path / "cache")) == 2 ** 20
    (tmp_path / "cache" / "index2" / "size").write_text("garbage\n")
    assert read(str(tmp_path / "cache")) is None
    assert read(str(tmp_path / "nothing")) is None


@pytest.mark.parametrize("m, p", [(25, 5), (7, 7), (3, 5), (40, 1)])
def test_unrolled_qr_matches_library(m, p):
    """The unrolled Householder QR (the covariance's factor under XLA) against
    ``tf.linalg.qr``: R and Q^T b equal up to each row's sign, to float64
    round-off (1e-13 on entries of order 1-10), also with fewer rows than
    columns (R is then min(M, P) x P); control: R^T R = A^T A."""
    rng = np.random.default_rng(m * 10 + p)
    a = tf.constant(rng.normal(size=(6, m, p)))
    b = tf.constant(rng.normal(size=(6, m)))
    r, qtb = tf.function(batched_parts.unrolled_qr, jit_compile=True,
                         autograph=False)(a, b)
    q_ref, r_ref = tf.linalg.qr(a)
    sign = np.sign(np.diagonal(r.numpy(), axis1=1, axis2=2)) * np.sign(
        np.diagonal(r_ref.numpy(), axis1=1, axis2=2))
    np.testing.assert_allclose(r.numpy() * sign[..., None], r_ref.numpy(), atol=1e-13)
    np.testing.assert_allclose(qtb.numpy() * sign,
                               tf.linalg.matvec(q_ref, b, transpose_a=True).numpy(),
                               atol=1e-13)
    np.testing.assert_allclose(tf.linalg.matmul(r, r, transpose_a=True).numpy(),
                               tf.linalg.matmul(a, a, transpose_a=True).numpy(), atol=1e-12)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("absolute_sigma", [False, True])
def test_fewer_points_than_parameters(jit_compile, absolute_sigma):
    """N < P (2 points, a quadratic): the fit passes through the points and
    its covariance is all inf (scipy's convention, `undetermined`), under XLA
    too (its unrolled QR of the final 2 x 3 Jacobian failed to trace), and
    with absolute sigmas (no dof test: the 2 singular values of 3 parameters
    had given a finite pseudo-inverse); `least_squares` alike."""
    t = np.array([0.0, 1.0])
    y = np.array([[1.0, 2.0], [2.0, 3.5]])
    with pytest.warns(UserWarning, match="covariance"):
        fit = tf_gradkit.curve_fit(
            lambda t, p: p[:, 0:1] + p[:, 1:2] * t + p[:, 2:3] * t * t, t, y,
            np.ones([2, 3]), jit_compile=jit_compile, absolute_sigma=absolute_sigma)
    x = fit.x.numpy()
    np.testing.assert_allclose(x[:, :1] + x[:, 1:2] * t + x[:, 2:3] * t * t, y, atol=1e-8)
    assert np.all(np.isinf(fit.covariance.numpy())), fit.covariance.numpy()
    assert np.all(fit.undetermined.numpy())



def test_single_solve_fewer_points_than_parameters():
    """`least_squares` with 2 residuals and 3 parameters: covariance all inf."""
    q = tf.Variable([1.0, 1.0, 1.0], dtype=tf.float64)
    t = tf.constant([0.0, 1.0], tf.float64)
    out = tf_gradkit.least_squares(lambda: q[0] + q[1] * t + q[2] * t * t - [1.0, 2.0],
                                   [q])
    assert bool(out.converged) and bool(out.undetermined)
    assert np.all(np.isinf(out.covariance.numpy()))
