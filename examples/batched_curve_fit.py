"""Thousands of small fits in one call: tf_gradkit.curve_fit on a batch.

Run: .venv/bin/python examples/batched_curve_fit.py   (well under a minute,
most of it XLA's compilation; a repeated call only runs)

Fits a 2-D Gaussian (amplitude, x0, y0, sigma, offset) to 2,000 simulated
15 x 15 spots at once (Gpufit's benchmark model), each fit with its own
damping, stop reason and covariance, and checks the positions against the
truth and one fit against scipy.optimize.curve_fit.
"""

import time

import numpy as np
import scipy.optimize as so
import tensorflow as tf

import tf_gradkit

SIDE, B = 15, 2000


def gaussian(xy, p):
    """[B, 225] from p [B, 5]; xy [2, 225] is shared by all fits."""
    dx = xy[0][None, :] - p[:, 1:2]
    dy = xy[1][None, :] - p[:, 2:3]
    return p[:, 0:1] * tf.exp(-(dx * dx + dy * dy) / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5]


def main():
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64)
    xy = np.stack([xx.ravel(), yy.ravel()])
    truth = np.stack([np.full(B, 500.0), 7 + rng.uniform(-0.5, 0.5, B),
                      7 + rng.uniform(-0.5, 0.5, B), np.full(B, 2.0),
                      np.full(B, 10.0)], axis=1)
    clean = gaussian(xy, truth).numpy()
    spots = rng.poisson(clean).astype(np.float64)         # photon counts
    sigma = np.sqrt(np.maximum(spots, 1.0))
    p0 = truth * (1 + rng.uniform(-0.1, 0.1, truth.shape))

    start = time.perf_counter()
    fit = tf_gradkit.curve_fit(gaussian, xy, spots, p0, sigma=sigma,
                               absolute_sigma=True, solver="cholesky")
    first = time.perf_counter() - start
    start = time.perf_counter()
    fit = tf_gradkit.curve_fit(gaussian, xy, spots, p0, sigma=sigma,
                               absolute_sigma=True, solver="cholesky")
    again = time.perf_counter() - start
    x = fit.x.numpy()
    print(f"{B} fits: first call {first:.1f} s (compiles), repeated {again:.2f} s "
          f"({B / again:,.0f} fits/s); converged {fit.converged.numpy().mean():.3f}")
    position_error = np.abs(x[:, 1:3] - truth[:, 1:3])
    print(f"median position error {np.median(position_error):.4f} px, median "
          f"standard error {np.median(fit.perr.numpy()[:, 1:3]):.4f} px")
    assert fit.converged.numpy().all()
    # Each fit's standard error describes its scatter about the truth.
    z = (x[:, 1:3] - truth[:, 1:3]) / fit.perr.numpy()[:, 1:3]
    assert 0.8 < np.std(z) < 1.2, np.std(z)

    def one(xy, a, x0, y0, s, c):
        return a * np.exp(-((xy[0] - x0) ** 2 + (xy[1] - y0) ** 2) / (2 * s * s)) + c

    reference, _ = so.curve_fit(one, xy, spots[0], p0[0], sigma=sigma[0],
                                absolute_sigma=True)
    np.testing.assert_allclose(x[0], reference, rtol=1e-6)
    print("fit 0 matches scipy.optimize.curve_fit:", np.round(x[0], 4))


if __name__ == "__main__":
    main()
