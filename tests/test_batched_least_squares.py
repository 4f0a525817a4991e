"""`least_squares_batched` and `curve_fit`: each problem of a batch ends where
`least_squares` ends on it alone with the same options.

The references are one-problem `least_squares` solves, each traced once per
(model, point count, options) and reused (no XLA: the same graph code); the
batched solves run compiled with XLA where the test says so. Every compared
problem must agree in its stop reason, its iteration count and, to round-off,
its solution, cost and covariance.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.lm import fitting, solve_cache

pytestmark = pytest.mark.keras_free

F64 = tf.float64
LOWER, UPPER = np.array([0.0, 0.0, -1.0]), np.array([10.0, 2.0, 1.0])


def decay(t, p):
    return p[:, 0:1] * tf.exp(-p[:, 1:2] * t) + p[:, 2:3]


_GRAPHS = {}


def single(model, t, y, sigma, p0, dtype=F64, **options):
    """`least_squares` of ``(model(t, p) - y) / sigma`` for one problem, with
    the batched default ``solver="auto"`` unless told (`least_squares`
    resolves it as the batch does)."""
    options.setdefault("solver", "auto")
    key = (model, len(t), np.dtype(dtype.as_numpy_dtype).name,
           repr(sorted(options.items())))
    if key not in _GRAPHS:
        var = tf.Variable(tf.zeros([len(p0)], dtype))

        @tf.function(autograph=False)
        def run(start, t, y, sigma):
            var.assign(start)
            result = tf_gradkit.least_squares(
                lambda: (model(t[None], var[None])[0] - y) / sigma, [var],
                **options)
            return result, var.value()

        _GRAPHS[key] = run
    return _GRAPHS[key](*[tf.constant(np.asarray(a), dtype)
                          for a in (p0, t, y, sigma)])[0]


def problems(batch, n_max, seed, dtype=np.float64, ragged=True):
    """Ragged decay problems padded to ``n_max`` (NaN at the padding)."""
    rng = np.random.default_rng(seed)
    truth = np.stack([rng.uniform(1, 5, batch), rng.uniform(0.3, 2.6, batch),
                      rng.uniform(-0.5, 0.5, batch)], axis=1)
    lengths = rng.choice([n_max, n_max - 10], batch) if ragged else np.full(
        batch, n_max)
    t = np.full([batch, n_max], np.nan)
    y = np.full([batch, n_max], np.nan)
    sigma = np.full([batch, n_max], np.nan)
    mask = np.zeros([batch, n_max], bool)
    for b, n in enumerate(lengths):
        t[b, :n] = np.linspace(0.0, 4.0, n)
        sigma[b, :n] = rng.uniform(0.5, 2.0, n)
        noise = 0.0 if b < 4 else 0.03
        y[b, :n] = (truth[b, 0] * np.exp(-truth[b, 1] * t[b, :n]) + truth[b, 2]
                    + noise * sigma[b, :n] * rng.normal(size=n))
        mask[b, :n] = True
    p0 = np.clip(truth * (1 + 0.3 * rng.normal(size=truth.shape)),
                 LOWER + 0.05, UPPER - 0.05)
    cast = (lambda a: a.astype(dtype))  # noqa: E731
    return cast(t), cast(y), cast(sigma), mask, cast(p0), lengths


def assert_same(fit, b, ref, rtol=1e-8, atol=1e-10, cov_rtol=1e-6):
    assert int(fit.status[b]) == int(ref.reason_code), (b, fit.reason[b], ref.reason)
    assert int(fit.stopped_by[b]) == int(ref.stopped_by), b
    assert fit.reason[b] == ref.reason, b
    assert int(fit.iterations[b]) == int(ref.iterations), b
    assert bool(fit.converged[b]) == bool(ref.converged), b
    np.testing.assert_allclose(fit.x[b].numpy(), ref.x.numpy(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(fit.cost[b].numpy(), ref.cost.numpy(), rtol=rtol,
                               atol=atol)
    np.testing.assert_allclose(fit.covariance[b].numpy(), ref.covariance.numpy(),
                               rtol=cov_rtol, atol=atol)
    np.testing.assert_array_equal(fit.active_mask[b].numpy(), ref.active_mask.numpy())


def _mixed_batch():
    """26 ragged (masked, NaN-padded) problems with sigma weights and shared
    bounds, some ending on a bound; problem 24 has a NaN datum, problem 25
    an infeasible start."""
    t, y, sigma, mask, p0, lengths = problems(26, 30, seed=0)
    y[24, 3] = np.nan
    p0[25, 1] = 3.0                         # outside [0, 2]
    return t, y, sigma, mask, p0, lengths


def _check_mixed(fit, t, y, sigma, p0, lengths, rtol, **options):
    assert fit.x.shape == (26, 3) and fit.covariance.shape == (26, 3, 3)
    assert int(fit.status[24]) == 7 and "non-finite" in fit.reason[24]
    assert int(fit.status[25]) == 8 and "infeasible" in fit.reason[25]
    assert not bool(fit.converged[24]) and not bool(fit.converged[25])
    np.testing.assert_array_equal(fit.x[25].numpy(), p0[25])
    on_bound = 0
    for b in range(24):
        n = lengths[b]
        ref = single(decay, t[b, :n], y[b, :n], sigma[b, :n], p0[b],
                     bounds=(LOWER, UPPER), **options)
        assert_same(fit, b, ref, rtol=rtol)
        on_bound += int(np.any(ref.active_mask.numpy() != 0))
    assert on_bound >= 2  # the bound-hitting case is covered
    return set(fit.status.numpy()[:24].tolist())


def test_batch_matches_single_solves():
    """The same graph code without XLA: every problem takes the single
    solve's steps (same stop reason and iteration count, the solution to
    1e-8); the bad problems change nobody else. QR on both sides (the
    default solver="auto", Cholesky here, is compared under XLA in
    test_compiled_batch_matches_single_solves). The batched and the single
    QR kernels agree to the bit on some machines, not on all: at the default
    tolerances (round-off) an H200 stopped one problem for the cost tolerance
    where its single solve stopped for the step tolerance, and an AMD EPYC
    CPU problem 6 the other way round. So the tolerances sit above
    round-off, where each stop is decided alike."""
    t, y, sigma, mask, p0, lengths = _mixed_batch()
    tolerances = dict(ftol=1e-10, xtol=1e-10, gtol=1e-10, solver="qr")
    fit = tf_gradkit.curve_fit(decay, t, y, p0, sigma=sigma, bounds=(LOWER, UPPER),
                               mask=mask, jit_compile=False, **tolerances)
    statuses = _check_mixed(fit, t, y, sigma, p0, lengths, rtol=1e-8, **tolerances)
    if not tf.config.list_physical_devices("GPU"):   # not checked on a GPU
        assert 1 in statuses and 2 in statuses and 3 in statuses, statuses


@pytest.mark.parametrize("solver", ["auto", "qr"])
def test_compiled_batch_matches_single_solves(solver):
    """The same under XLA (``jit_compile=True``: "auto" would not compile 26
    fits; the data carried through the loop, `loop_data`; its CPU code
    rounds differently, so the default
    tolerances, at round-off, may stop an iteration apart or for the other
    tolerance): with tolerances above round-off each problem stops where the
    single solve does, for the same reason. With either solver: the loop
    carries the linearisation at x, with the Jacobian for "qr" ("auto" is
    the Cholesky solve here, whose final Jacobian is formed after the loop
    only where a covariance needs the QR: the non-finite start here)."""
    t, y, sigma, mask, p0, lengths = _mixed_batch()
    tolerances = dict(ftol=1e-10, xtol=1e-10, gtol=1e-10, solver=solver)
    fit = tf_gradkit.curve_fit(decay, t, y, p0, sigma=sigma, bounds=(LOWER, UPPER),
                               mask=mask, jit_compile=True, **tolerances)
    _check_mixed(fit, t, y, sigma, p0, lengths, rtol=1e-8, **tolerances)


def test_no_sigma_no_mask_the_same_fits_as_ones_and_all_true():
    """Without ``sigma`` and ``mask`` the residuals are ``f - ydata`` (no
    array of ones to divide by, none of True to select with): the same fits
    to the bit as ``sigma=1`` and ``mask`` all True (plain tf.function:
    dividing by 1 and selecting everywhere are exact), with and without a
    ``jac``; a ``sigma`` of inf drops its point as ``mask`` False does."""
    t, y, sigma, mask, p0, _ = problems(12, 20, seed=4, ragged=False)
    t = t[0]

    def jac(t, p):
        e = tf.exp(-p[:, 1:2] * t)
        return tf.stack([e, -p[:, :1] * t * e, tf.ones_like(e)], axis=2)

    def same(a, b):
        for name in ("x", "cost", "covariance", "status", "iterations"):
            np.testing.assert_array_equal(getattr(a, name).numpy(),
                                          getattr(b, name).numpy(), err_msg=name)

    for jacobian in (None, jac):
        options = dict(bounds=(LOWER, UPPER), jit_compile=False, jac=jacobian)
        lean = tf_gradkit.curve_fit(decay, t, y, p0, **options)
        full = tf_gradkit.curve_fit(decay, t, y, p0, sigma=np.ones_like(y),
                                    mask=np.ones(y.shape, bool), **options)
        assert np.all(lean.converged.numpy())
        same(lean, full)
    y_bad = y.copy()
    y_bad[:, 3] = 1e6   # an outlier at point 3 of every fit
    by_inf = tf_gradkit.curve_fit(decay, t, y_bad, p0,
                                  sigma=np.where(np.arange(20) == 3, np.inf, 1.0),
                                  bounds=(LOWER, UPPER), jit_compile=False)
    keep = np.broadcast_to(np.arange(20) != 3, y.shape)
    by_mask = tf_gradkit.curve_fit(decay, t, y_bad, p0, mask=keep,
                                   bounds=(LOWER, UPPER), jit_compile=False)
    same(by_inf, by_mask)
    assert np.all(by_inf.converged.numpy())


def test_refused_inside_a_tf_function():
    """`curve_fit` and `least_squares_batched` compile and run their chunks
    themselves and read results between them: traced into a user's
    tf.function they are refused, naming what to do (it used to fail with
    TensorFlow's "symbolic tf.Tensor as a Python bool")."""
    t, y, sigma, mask, p0, _ = problems(2, 20, seed=5, ragged=False)

    @tf.function(autograph=False)
    def fit():
        return tf_gradkit.curve_fit(decay, t[0], y, p0).x

    @tf.function(autograph=False)
    def batched():
        return tf_gradkit.least_squares_batched(
            lambda p, yb: decay(t[0], p) - yb, p0, args=(y,)).x

    for call, name in ((fit, "curve_fit"), (batched, "least_squares_batched")):
        with pytest.raises(RuntimeError, match=name + r" runs eagerly.*outside the tf\.function"):
            call()


def test_ensure_shape_in_the_model_fits_by_reverse_mode():
    """TensorFlow's forward mode cannot trace `tf.ensure_shape` in a
    tf.function (its shape attribute): the Jacobian is then taken by reverse
    mode (`linearize.forward_or_reverse`), with a warning that says why and
    how to keep forward mode. The fits are those of the same model with
    `set_shape` (forward mode): in `curve_fit` plain and compiled (the
    columns of `small.jacobian_columns`), with more than 10 parameters (the
    vectorised path) and in `least_squares`. A matrix-free solver, which
    needs forward mode, is refused with what to do, nothing moved."""
    t, y, sigma, mask, p0, _ = problems(4, 20, seed=5, ragged=False)
    t = t[0]

    def with_ensure(t, p):
        return tf.ensure_shape(decay(t, p), [None, 20])

    def with_set_shape(t, p):
        r = decay(t, p)
        r.set_shape([None, 20])
        return r

    def close(a, b):   # forward and reverse mode round differently
        np.testing.assert_allclose(a.x.numpy(), b.x.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(a.status.numpy(), b.status.numpy())

    for jit_compile in (False, True):
        with pytest.warns(UserWarning, match=r"reverse-mode.*tf\.ensure_shape.*set_shape"):
            fit = tf_gradkit.curve_fit(with_ensure, t, y, p0, jit_compile=jit_compile)
        close(fit, tf_gradkit.curve_fit(with_set_shape, t, y, p0, jit_compile=jit_compile))
        assert np.all(fit.converged.numpy())

    basis = tf.constant(0.1 * np.sin(np.arange(1, 10)[:, None] * t[None]))

    def wide(model):   # 12 parameters: the vectorised path
        return lambda t, p: model(t, p[:, :3]) + tf.reduce_sum(
            p[:, 3:, None] * basis, axis=1)
    p12 = np.concatenate([p0, np.full((4, 9), 0.1)], axis=1)
    tight = dict(ftol=1e-15, xtol=1e-15, gtol=1e-15, jit_compile=False)
    with pytest.warns(UserWarning, match="reverse-mode"):   # both at the minimum
        fit = tf_gradkit.curve_fit(wide(with_ensure), t, y, p12, **tight)
    ref = tf_gradkit.curve_fit(wide(with_set_shape), t, y, p12, **tight)
    np.testing.assert_allclose(fit.x.numpy(), ref.x.numpy(), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(fit.cost.numpy(), ref.cost.numpy(), rtol=1e-10, atol=1e-20)

    def least_squares(model, **options):
        var = tf.Variable(p0[0])
        out = tf_gradkit.least_squares(lambda: model(t, var[None])[0] - y[0], [var],
                                       **options)
        return out, var
    with pytest.warns(UserWarning, match="reverse-mode"):
        (out, var), (ref, ref_var) = least_squares(with_ensure), least_squares(
            with_set_shape)
    np.testing.assert_allclose(var.numpy(), ref_var.numpy(), rtol=1e-9)
    assert bool(out.converged) and int(out.iterations) == int(ref.iterations)
    with pytest.raises(ValueError, match=r"tf\.ensure_shape.*set_shape"):
        least_squares(with_ensure, solver="cg", scaling="levenberg")

def test_absolute_sigma_covariance():
    """``absolute_sigma=True``: the pseudo-inverse of J^T J, unscaled."""
    jac = tf.constant(np.diag([1.0, 2.0, 4.0])[None].repeat(2, 0))
    cov = fitting.batched_parts.covariance(jac, tf.constant([1.0, 2.0], F64),
                                           tf.constant([3.0, 5.0], F64), absolute=True)
    np.testing.assert_allclose(cov.numpy()[0], np.diag([1.0, 0.25, 1 / 16]))
    scaled = fitting.batched_parts.covariance(jac, tf.constant([1.0, 2.0], F64),
                                              tf.constant([3.0, 5.0], F64),
                                              absolute=False)
    assert np.isinf(scaled.numpy()[0]).all()  # n = P: no degrees of freedom
    np.testing.assert_allclose(scaled.numpy()[1], np.diag([1.0, 0.25, 1 / 16]) * 2.0)


@pytest.mark.parametrize("loss, jit_compile, solver", [
    pytest.param("soft_l1", False, "auto", marks=pytest.mark.slow),
    pytest.param("cauchy", False, "auto", marks=pytest.mark.slow),
    ("soft_l1", True, "auto"),
    pytest.param("soft_l1", True, "qr", marks=pytest.mark.slow)])
def test_robust_losses_and_restarts_match_single_solves(loss, jit_compile, solver):
    """Robust losses (the 'hybrid' scaling's two phases: a short iteration
    limit makes some problems restart) with outliers, unbounded, plain and
    under XLA (where the loop carries the robust linearisation). The robust
    cost is summed in another order than the single solve's, so the
    tolerances are set above round-off (at the defaults a last iteration may
    stop on the step rather than the cost tolerance)."""
    t, y, sigma, mask, p0, lengths = problems(10, 24, seed=1, ragged=False)
    y[:, 5] += 2.0                       # an outlier in every problem
    p0[:5] = p0[:5] * 3.0 + 1.0          # far starts
    options = dict(loss=loss, f_scale=0.1, max_iterations=12, ftol=1e-10,
                   xtol=1e-10, gtol=1e-10, solver=solver)
    fit = tf_gradkit.curve_fit(decay, t, y, p0, sigma=sigma, mask=mask,
                               bounds=None, jit_compile=jit_compile, **options)
    limits = 0
    for b in range(10):
        n = lengths[b]
        ref = single(decay, t[b, :n], y[b, :n], sigma[b, :n], p0[b], **options)
        assert_same(fit, b, ref, rtol=1e-7, atol=1e-9, cov_rtol=1e-5)
        limits += int(ref.iterations) > 12
    assert limits >= 1  # a second phase ran somewhere


@pytest.mark.slow
def test_float32_matches_single_solves():
    """float32: the same verdicts; the solutions agree to what float32
    resolves at a nonzero-residual minimum (the cost is flat to eps there,
    so x only to about sqrt(eps32) = 3e-4 relative). The stop reasons are
    not compared: in float32 the gradient and step tests sit at round-off
    (one problem stops on the gradient alone and on the step batched)."""
    t, y, sigma, mask, p0, lengths = problems(6, 20, seed=2, dtype=np.float32,
                                              ragged=False)
    tolerances = dict(ftol=1e-5, xtol=1e-5, gtol=1e-5)
    fit = tf_gradkit.curve_fit(decay, t, y, p0, mask=mask, jit_compile=False,
                               solver="cholesky", **tolerances)
    assert fit.x.dtype == tf.float32
    for b in range(6):
        n = lengths[b]
        ref = single(decay, t[b, :n], y[b, :n], np.ones(n, np.float32), p0[b],
                     dtype=tf.float32, solver="cholesky", **tolerances)
        assert bool(fit.converged[b]) == bool(ref.converged)
        np.testing.assert_allclose(fit.x[b].numpy(), ref.x.numpy(), rtol=1e-3,
                                   atol=3e-4)


def test_chunks_and_cache():
    """Chunking (a padded last chunk) changes nothing; a repeated call with
    the same function and options traces nothing new."""
    t, y, sigma, mask, p0, _ = problems(7, 20, seed=3)

    def model(t, p):
        return decay(t, p)

    whole = tf_gradkit.curve_fit(model, t, y, p0, mask=mask, jit_compile=False)
    chunked = tf_gradkit.curve_fit(model, t, y, p0, mask=mask, jit_compile=False,
                                   batch_size=3)
    np.testing.assert_allclose(chunked.x.numpy(), whole.x.numpy(), rtol=1e-12)
    np.testing.assert_array_equal(chunked.status.numpy(), whole.status.numpy())
    hits = solve_cache.SOLVES.info().hits
    traces = [fn.experimental_get_tracing_count()
              for fn in solve_cache.SOLVES._entries.values()
              if hasattr(fn, "experimental_get_tracing_count")]
    again = tf_gradkit.curve_fit(model, t, y + 0.01, p0, mask=mask,
                                 jit_compile=False, batch_size=3)
    assert solve_cache.SOLVES.info().hits == hits + 1
    assert [fn.experimental_get_tracing_count()
            for fn in solve_cache.SOLVES._entries.values()
              if hasattr(fn, "experimental_get_tracing_count")] == traces
    assert again.x.shape == (7, 3)


def test_one_fit_and_least_squares_batched():
    t = np.linspace(0, 4, 20)
    y = 2.0 * np.exp(-0.7 * t) + 0.1
    one = tf_gradkit.curve_fit(decay, t, y, [1.0, 1.0, 0.0], jit_compile=False)
    assert one.x.shape == (3,) and one.covariance.shape == (3, 3)
    np.testing.assert_allclose(one.x.numpy(), [2.0, 0.7, 0.1], rtol=1e-8)
    ys = np.stack([y, 2 * y])

    def fun(x, data):
        return decay(t, x) - data

    res = tf_gradkit.least_squares_batched(fun, np.ones([2, 3]), (ys,),
                                           jit_compile=False, full_output=True)
    assert res.fun.shape == (2, 20) and res.jac.shape == (2, 20, 3)
    np.testing.assert_allclose(res.x.numpy(), [[2.0, 0.7, 0.1], [4.0, 0.7, 0.2]],
                               rtol=1e-8)


@pytest.mark.parametrize("kwargs, name", [
    (dict(ydata=np.zeros([3, 5])), "ydata"),
    (dict(p0=np.zeros([2, 3, 1])), "p0"),
    (dict(sigma=np.ones([2, 4])), "sigma"),
    (dict(mask=np.ones([2, 6], bool)), "mask"),
    (dict(bounds=(np.zeros(2), 1.0)), "bounds"),
    (dict(bounds=(1.0, 0.5)), "lower bound"),
    (dict(xdata=np.zeros([2, 7]), xdata_per_fit=True), "f"),
    (dict(batch_size=0), "batch_size"),
    (dict(solver="cg"), "solver"),
    (dict(max_iterations=-1), "max_iterations"),
])
def test_bad_shapes_refused_naming_the_argument(kwargs, name):
    args = dict(f=decay, xdata=np.linspace(0, 1, 5), ydata=np.zeros([2, 5]),
                p0=np.ones([2, 3]), jit_compile=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        tf_gradkit.curve_fit(**args)


@pytest.mark.parametrize("p", [3, 70])   # under and over the unrolled solve's size
@pytest.mark.parametrize("traced", [False, True])
def test_plain_batched_cholesky_solves_each_problem_and_refuses_the_failed(p, traced):
    """`BatchedCholesky` outside XLA (a plain chunk's solve): the step of each
    SPD problem is ``-(J^T J + lambda D^2)^-1 J^T r``; a problem whose
    factor fails (NaN in its J^T J) gets a zero step and ``ok`` False, and
    its neighbours are untouched (the [P, P] identity it falls back on is
    broadcast over the batch)."""
    from tf_gradkit.core.lm import batched_parts   # noqa: PLC0415
    rng = np.random.default_rng(p)
    jac = rng.normal(size=(3, p + 5, p))
    jtj = np.einsum("bni,bnj->bij", jac, jac)
    jtj[1, 0, 0] = np.nan
    jtr = rng.normal(size=(3, p))
    damping, d2 = np.array([0.0, 0.5, 2.0]), rng.uniform(0.5, 2.0, size=(3, p))
    lin = batched_parts.BatchedLinearization(
        cost=tf.zeros([3], tf.float64), jtj=tf.constant(jtj), jtr=tf.constant(jtr))

    def solve(damping, d2):
        return batched_parts.BatchedCholesky().solve(lin, damping, d2)

    run = tf.function(solve, autograph=False) if traced else solve
    step, ok = run(tf.constant(damping), tf.constant(d2))
    np.testing.assert_array_equal(ok.numpy(), [True, False, True])
    np.testing.assert_array_equal(step.numpy()[1], np.zeros(p))
    for b in (0, 2):
        want = np.linalg.solve(jtj[b] + np.diag(damping[b] * d2[b]), -jtr[b])
        np.testing.assert_allclose(step.numpy()[b], want, rtol=1e-8, atol=1e-10)
