"""Gpufit's 5x5 2-D Gaussian (float32) with `curve_fit` on one device: the case behind
Gpufit's published 3,038,590 fits/s (its GPU) and Cpufit's 60,957.

    python benchmarks/batched_fits_5x5.py 100000,1000000 [--device /GPU:0]

Data as ../shared/cpufit/cpufit_bench.cpp generates them (truth 500, centre 2, width 1,
background 10; test parameters and starts each truth * U(0.9, 1.1); Gaussian noise).
For each setting (the package defaults; Cpufit's stopping rule, "matched"; each also in one
chunk) it prints the first call (compile + run) and the best of two further calls as JSON
rows. On a CPU, compare with Cpufit per CPU-second through `batched_fits.py --cpufit PATH`
instead; this script is for a GPU, where no peer runs beside it here (docs/batched_fits.md).
"""
import json
import sys
import time

import numpy as np
import tensorflow as tf
import tf_gradkit

print("GPUs:", tf.config.list_physical_devices("GPU"), flush=True)
S = 5
yy, xx = np.mgrid[0:S, 0:S].astype(np.float32)
XY = np.stack([xx.ravel(), yy.ravel()])


def gaussian(xy, p):
    dx = xy[0][None, :] - p[:, 1:2]
    dy = xy[1][None, :] - p[:, 2:3]
    return p[:, 0:1] * tf.exp(-(dx * dx + dy * dy) / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5]


def problems(b, rng):
    truth = np.array([500, 2, 2, 1, 10], np.float32) * rng.uniform(0.9, 1.1, (b, 5)).astype(np.float32)
    dx = XY[0][None] - truth[:, 1:2]
    dy = XY[1][None] - truth[:, 2:3]
    clean = truth[:, :1] * np.exp(-(dx ** 2 + dy ** 2) / (2 * truth[:, 3:4] ** 2)) + truth[:, 4:5]
    std = 2 * np.pi * 500 * 1.0 / (4.292 ** 2) / 10
    y = (clean + rng.normal(0, std, clean.shape)).astype(np.float32)
    p0 = (truth * rng.uniform(0.9, 1.1, truth.shape)).astype(np.float32)
    return y, p0


device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "/GPU:0"
rng = np.random.default_rng(0)
rows = []
for b in [int(s) for s in sys.argv[1].split(",")]:
    y, p0 = problems(b, rng)
    for label, kw in [("defaults", {}), ("matched", dict(ftol=1e-4, max_iterations=10)),
                      ("matched one chunk", dict(ftol=1e-4, max_iterations=10, batch_size=b)),
                      ("defaults one chunk", dict(batch_size=b))]:
        with tf.device(device):
            t0 = time.perf_counter()
            fit = tf_gradkit.curve_fit(gaussian, XY, y, p0, **kw)
            fit.x.numpy()
            first = time.perf_counter() - t0
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                fit = tf_gradkit.curve_fit(gaussian, XY, y, p0, **kw)
                fit.x.numpy()
                times.append(time.perf_counter() - t0)
        t = min(times)
        conv = float(np.mean(fit.converged.numpy()))
        st = np.bincount(fit.status.numpy().astype(int), minlength=10).tolist()
        row = dict(B=b, setting=label, first_s=round(first, 3), seconds=round(t, 4),
                   fits_per_s=round(b / t), converged=conv, status_counts=st)
        rows.append(row)
        print(json.dumps(row), flush=True)
