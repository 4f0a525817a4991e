"""The covariance's triangular factor under XLA (issue 39): the Cholesky
factor of the final J^T J where `small.cholesky_factor` shows it as good as a
QR's, the unrolled QR's elsewhere (`batched_parts.qr_where`, gathered 1/16
of a batch at a time), against the QR's factor and its covariance; and the sums
over points in blocks (`small.point_sum`).

`make test` runs this file with XLA's default emitters (the Makefile's
`DEFAULT_EMITTER_TESTS`): at optimisation level 0 with the older emitters,
XLA's compile of the unrolled QR is not backward stable on nearly dependent
columns (docs/batched_fits.md)."""

import numpy as np
import pytest
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.lm import batched_parts, small

pytestmark = pytest.mark.keras_free


def jacobians(batch, dtype, seed=0, n=25, p=5):
    """Well-conditioned Jacobians with column scales from 0.03 to 30 (the
    unscaled condition number ~1e3-1e4, as Gpufit's Gaussians' ~1e3; the
    column-scaled one ~3)."""
    rng = np.random.default_rng(seed)
    j = rng.normal(size=(batch, n, p)) * np.logspace(-1.5, 1.5, p)
    return j.astype(dtype)


def factors(jac):
    """(``triangular_factor`` with J^T J, its `cholesky_factor` ``ok``, the
    unrolled QR's R, the covariance from each) under XLA; checks that
    ``triangular_factor`` gave `cholesky_factor`'s own R wherever it
    accepted it (bit for bit, its diagonal positive where the Householder
    R's is negative for a column whose head is >= 0)."""

    def run(jac):
        jtj = tf.reduce_sum(jac[..., :, None] * jac[..., None, :], axis=-3)
        counts = tf.fill(tf.shape(jac)[:1], tf.constant(float(jac.shape[1]), jac.dtype))
        cost = tf.ones_like(counts)
        r = batched_parts.triangular_factor(lambda: jac, jtj, jac.shape[1])
        cholesky, ok = small.cholesky_factor(jtj, jac.shape[1])
        qr = batched_parts.unrolled_qr(jac)[0]
        return (r, ok, cholesky, qr, small.proven_covariance(r, cost, counts, True),
                small.proven_covariance(qr, cost, counts, True))

    r, ok, cholesky, *rest = tf.function(run, jit_compile=True,
                                         autograph=False)(tf.constant(jac))
    taken = ok.numpy()
    np.testing.assert_array_equal(r.numpy()[taken], cholesky.numpy()[taken])
    assert np.all(np.diagonal(r.numpy()[taken], axis1=1, axis2=2) > 0)
    return (r, ok, *rest)


def normalised(a, b):
    """``|a - b|`` over ``sqrt(b_ii b_jj)``, per problem (the covariances'
    difference on the scale of their correlations)."""
    d = np.sqrt(np.abs(np.einsum("bii->bi", b)))
    return np.max(np.abs(a - b) / (d[:, :, None] * d[:, None, :]), axis=(1, 2))


def assert_is_the_qr_factor(jac, r, qr):
    """``r`` [B, P, P] is each problem's own Householder factor, the unrolled
    QR's ``qr`` (computed in another pass of the same program), to the round-off
    that float32 and each problem's conditioning allow, not bit for bit (two
    compilations of one QR may fuse and round differently):

    - upper triangular, NaN where ``qr`` has NaN (a NaN in the Jacobian);
    - ``R^T R = J^T J`` to ``50 eps |J_i| |J_j|`` (Householder QR is backward
      stable column by column: ``J + dJ = QR``, ``|dJ_j| <= gamma |J_j|`` with
      gamma a small multiple of ``sqrt(N) P eps``, 25 eps here, doubled for
      the product): the factor of this problem's J, where another problem's
      factor misses by ~1e6 of that unit;
    - ``|r - qr| <= 4 kappa eps |J_j|``, with kappa the condition number of
      the problem's column-scaled J (its finite, nonzero columns): R's entries
      are known only to its forward error, about kappa times the backward
      error per column (measured up to 0.3 kappa eps |J_j| against float64's
      QR of the same J; two float32 runs, each that close, 2x that; doubled
      again for a margin). With kappa ~3e5 (two nearly equal columns) that is
      0.1-0.2 of a column's norm: a 1e-6 tolerance held only while the two
      passes were compiled alike."""
    eps = np.finfo(np.float32).eps
    np.testing.assert_array_equal(np.isnan(r), np.isnan(qr))
    assert np.all(np.tril(np.nan_to_num(r, nan=0.0), -1) == 0)
    j = jac.astype(np.float64)
    norms = np.linalg.norm(j, axis=1)   # [B, P], NaN for a column with NaN
    r64 = r.astype(np.float64)
    back = np.abs(np.einsum("bki,bkj->bij", r64, r64) - np.einsum("bni,bnj->bij", j, j))
    finite = np.isfinite(back)
    assert np.all(back[finite] <= (50 * eps * norms[:, :, None] * norms[:, None, :])[finite])
    for jb, rb, qb, nb in zip(j, r, qr, norms):
        use = np.isfinite(nb) & (nb > 0)
        kappa = np.linalg.cond(jb[:, use] / nb[use])
        tol = 4 * kappa * eps * np.where(use, nb, 0.0)
        both = np.isfinite(rb) & np.isfinite(qb)
        assert np.all((np.abs(rb - qb) <= tol[None, :])[both]), (kappa, np.abs(rb - qb))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-5), (np.float64, 1e-12)])
def test_cholesky_factor_is_taken_where_it_is_as_good_as_a_qr(dtype, tol):
    """Badly scaled but well-conditioned Jacobians: every problem takes the
    Cholesky factor (the scaled condition number is what the test reads),
    R^T R = J^T J, and the covariance is the QR's to ~kappa^2 eps
    (kappa ~10: 2e-5 in float32, 1e-12 in float64), every entry finite."""
    jac = jacobians(64, dtype)
    r, ok, qr, (cov, exact), (cov_qr, exact_qr) = factors(jac)
    assert np.all(ok.numpy()) and np.all(exact.numpy()) and np.all(exact_qr.numpy())
    r64 = r.numpy().astype(np.float64)
    gram = np.einsum("bni,bnj->bij", jac.astype(np.float64), jac.astype(np.float64))
    np.testing.assert_allclose(np.einsum("bki,bkj->bij", r64, r64), gram,
                               rtol=0, atol=50 * np.finfo(dtype).eps * np.abs(gram).max())
    assert np.all(np.tril(r.numpy(), -1) == 0)
    err = normalised(cov.numpy(), cov_qr.numpy())
    assert np.all(np.isfinite(cov.numpy())) and err.max() < tol, err.max()


@pytest.mark.parametrize("bad_rows", [2, 20])
def test_problems_refused_take_the_qr_factor(bad_rows):
    """float32, 64 problems: ``bad_rows`` of them with two nearly equal
    columns (scaled condition ~1e5: J^T J loses them), one with a zero column
    (rank-deficient) and one with a NaN. Those are refused and take the
    unrolled QR's factor (gathered: one pass of 64/16 rows for 2 + 2 of
    them, six for 22), so their covariance and full-rank verdict are the
    QR's; the others keep the Cholesky factor."""
    jac = jacobians(64, np.float32, seed=bad_rows)
    rng = np.random.default_rng(1)
    bad = rng.choice(64, size=bad_rows + 2, replace=False)
    for b in bad[:bad_rows]:
        jac[b, :, 1] = jac[b, :, 0] * (1.0 + 1e-5 * rng.normal(size=25))
    jac[bad[-2], :, 3] = 0.0
    jac[bad[-1], 4, 2] = np.nan
    r, ok, qr, (cov, exact), (cov_qr, exact_qr) = factors(jac)
    refused = np.zeros(64, bool)
    refused[bad] = True
    np.testing.assert_array_equal(~ok.numpy(), refused)
    assert_is_the_qr_factor(jac[refused], r.numpy()[refused], qr.numpy()[refused])
    np.testing.assert_array_equal(exact.numpy(), exact_qr.numpy())
    assert not exact.numpy()[bad[-2]] and not exact.numpy()[bad[-1]]
    keep = ~refused
    np.testing.assert_array_equal(
        np.abs(np.diagonal(r.numpy()[keep], axis1=1, axis2=2)) > 0, True)
    assert normalised(cov.numpy()[keep], cov_qr.numpy()[keep]).max() < 2e-5


def test_curve_fit_covariance_under_xla_matches_the_plain_engine():
    """End to end (float64 2-D Gaussians, 5x5): the XLA engine's covariance,
    from the Cholesky factor, equals the plain engine's (``tf.linalg.qr``
    and an SVD) to 1e-6 of the correlation scale, as close as the two
    engines' solutions are (they stop within ~1e-8 of each other: the two
    round differently and a fit's flattest direction is known to ~sqrt(eps));
    a fit whose model ignores a parameter is still undetermined (inf) under
    XLA."""
    rng = np.random.default_rng(3)
    g = np.arange(5.0)
    xy = np.stack(np.meshgrid(g, g)).reshape(2, -1)
    truth = np.stack([rng.uniform(50, 100, 40), rng.uniform(1.5, 2.5, 40),
                      rng.uniform(1.5, 2.5, 40), rng.uniform(0.8, 1.2, 40),
                      rng.uniform(5, 15, 40)], axis=1)

    def gaussian(xy, p):
        dx = xy[0][None, :] - p[:, 1:2]
        dy = xy[1][None, :] - p[:, 2:3]
        return p[:, 0:1] * tf.exp(-(dx * dx + dy * dy) / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5]

    y = gaussian(tf.constant(xy), tf.constant(truth)).numpy() + rng.normal(size=(40, 25))
    fits = [tf_gradkit.curve_fit(gaussian, xy, y, truth * 1.05, jit_compile=jit)
            for jit in (True, False)]
    np.testing.assert_allclose(fits[0].x.numpy(), fits[1].x.numpy(), rtol=1e-7)
    assert normalised(fits[0].covariance.numpy(), fits[1].covariance.numpy()).max() < 1e-6

    def ignores_width(xy, p):
        return gaussian(xy, tf.concat([p[:, :3], tf.ones_like(p[:, 3:4]), p[:, 4:]], 1))

    with pytest.warns(UserWarning, match="covariance"):
        fit = tf_gradkit.curve_fit(ignores_width, xy, y[:3], truth[:3], jit_compile=True)
    assert np.all(fit.undetermined.numpy()) and np.all(np.isinf(fit.covariance.numpy()))


@pytest.mark.parametrize("loss", ["linear", "soft_l1"])
def test_compiled_fit_refused_by_the_cholesky_test_takes_the_qr(loss):
    """End to end: a compiled fit whose J^T J `small.cholesky_factor` refuses
    (a quadratic on t in [300, 301]: nearly collinear columns, full rank)
    forms its final Jacobian after the loop (under a ``tf.cond``) for the
    QR, and its covariance equals the plain engine's (``tf.linalg.qr`` of
    the whole final Jacobian) on the correlation scale; with a robust loss
    that Jacobian is the robust-scaled one, as the plain engine's. The
    refusal is checked on the plain engine's ``full_output`` Jacobian."""
    rng = np.random.default_rng(11)
    t = np.linspace(300.0, 301.0, 30)
    truth = np.stack([rng.uniform(-1, 1, 6), rng.uniform(1, 2, 6),
                      rng.uniform(0.5, 1, 6)], axis=1)
    y = truth[:, :1] + truth[:, 1:2] * t + truth[:, 2:3] * t * t
    y = y + 0.01 * rng.normal(size=y.shape)
    y[:, 7] += 0.5   # an outlier, for the robust loss

    def quadratic(t, p):
        return p[:, 0:1] + p[:, 1:2] * t + p[:, 2:3] * t * t

    options = dict(loss=loss, f_scale=0.02, ftol=1e-12, xtol=1e-12, gtol=1e-12)
    plain = tf_gradkit.curve_fit(quadratic, t, y, truth, jit_compile=False,
                                 full_output=True, **options)
    jac = plain.jac.numpy()
    _, ok = small.cholesky_factor(tf.constant(np.einsum("bni,bnj->bij", jac, jac)), 30)
    assert not np.any(ok.numpy())   # every fit needs the QR
    compiled = tf_gradkit.curve_fit(quadratic, t, y, truth, jit_compile=True, **options)
    # The engines round differently; along the flattest direction (the
    # column-scaled condition number is ~5e6) x is found to ~1e-6 relative.
    np.testing.assert_allclose(compiled.x.numpy(), plain.x.numpy(), rtol=1e-5)
    cov = compiled.covariance.numpy()
    assert np.all(np.isfinite(cov)) and np.all(compiled.converged.numpy())
    assert normalised(cov, plain.covariance.numpy()).max() < 1e-6


@pytest.mark.parametrize("n", [1, 25, 32, 33, 100, 225, 400, 513, 1000, 2047, 5000])
def test_point_sum_is_the_sum_over_points(n):
    """`small.point_sum` under XLA (slices of at most 32 points up to 1,024
    points, at most 32 slices beyond, 16 wide where equal slices would leave
    points over up to 512 points, a remainder apart: 33 = 2 x 16 + 1,
    100 = 4 x 25, 225 = 14 x 16 + 1, 400 = 25 x 16, 513 = 17 x 30 + 3,
    1000 = 32 x 31 + 8, 2047 = 32 x 63 + 31, 5000 = 32 x 156 + 8) equals
    ``reduce_sum`` to float64 round-off (n eps of the sum of |t|); outside
    XLA it is ``reduce_sum`` itself, bit for bit."""
    rng = np.random.default_rng(n)
    t = tf.constant(rng.normal(size=(7, n)) * np.exp(rng.normal(size=(7, n))))
    ref = tf.reduce_sum(t, axis=-1).numpy()
    got = tf.function(small.point_sum, jit_compile=True, autograph=False)(t).numpy()
    bound = n * np.finfo(np.float64).eps * np.sum(np.abs(t.numpy()), axis=-1)
    assert np.all(np.abs(got - ref) <= bound), (got - ref, bound)
    np.testing.assert_array_equal(small.point_sum(t).numpy(), ref)


def test_a_compiled_fit_takes_the_cholesky_factor(monkeypatch):
    """The wiring: a float32 5x5 Gaussian fit under XLA factors its final
    J^T J by `small.cholesky_factor` (traced once, for 25 points), and its
    test accepts every one of these fits' final Jacobians (run eagerly on
    ``full_output``'s ``jac``: no QR needed)."""
    calls = []
    original = small.cholesky_factor

    def spy(jtj, points):
        calls.append(points)
        return original(jtj, points)

    monkeypatch.setattr(small, "cholesky_factor", spy)
    rng = np.random.default_rng(5)
    g = np.arange(5.0, dtype=np.float32)
    xy = np.stack(np.meshgrid(g, g)).reshape(2, -1)
    truth = np.stack([rng.uniform(500, 1000, 64), rng.uniform(1.5, 2.5, 64),
                      rng.uniform(1.5, 2.5, 64), rng.uniform(0.8, 1.2, 64),
                      rng.uniform(5, 15, 64)], axis=1).astype(np.float32)

    def model(xy, p):   # a function of its own: traced here, with the spy
        dx = xy[0][None, :] - p[:, 1:2]
        dy = xy[1][None, :] - p[:, 2:3]
        return p[:, 0:1] * tf.exp(-(dx * dx + dy * dy) / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5]

    y = model(tf.constant(xy), tf.constant(truth)).numpy()
    y = y + rng.normal(size=y.shape).astype(np.float32) * np.sqrt(y)
    fit = tf_gradkit.curve_fit(model, xy, y, truth * 1.02, jit_compile=True,
                               full_output=True)
    assert calls == [25], calls
    assert np.all(fit.converged.numpy()) and np.all(np.isfinite(fit.covariance.numpy()))
    jac = fit.jac
    _, ok = original(tf.einsum("bni,bnj->bij", jac, jac), 25)
    assert np.all(ok.numpy())
