"""A float64 bounded fit with `curve_fit`'s defaults beside a scipy loop.

Issue 39's "defaults" case: a bi-exponential decay
``a1 exp(-t / tau1) + a2 exp(-t / tau2) + c`` on 100 time bins, Gaussian
noise, float64, bounds ``a >= 0``, ``0.05 <= tau <= 50``, ``c >= 0``, starts
off the truth. Ours: ``tf_gradkit.curve_fit(f, t, y, p0, bounds=...)`` with
nothing else given (solver, chunk and tolerances the defaults). scipy: the
same call a user makes, ``scipy.optimize.curve_fit(f, t, y[b], p0[b],
bounds=...)`` (trf, 2-point Jacobian) in a Python loop, and
``least_squares(method="trf")`` with the analytic Jacobian, on the first
``--scipy-fits`` fits. Ours again in a child process whose TensorFlow runs
on one thread (`timing.on_one_thread`; ``--no-one-thread`` skips it): per
CPU-second the like-for-like comparison with a single-threaded scipy loop.
Prints fits per second and per CPU-second (each process's own, all its
threads) and the ratios to both scipy loops, and the median relative
difference of the parameters where both converged.

    python benchmarks/bounded_decay.py [--fits 100000] [--scipy-fits 300]
"""

import argparse
import os
import sys
import time

import numpy as np
import scipy.optimize as so

import timing  # benchmarks/timing.py

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOWER = [0.0, 0.05, 0.0, 0.05, 0.0]
UPPER = [np.inf, 50.0, np.inf, 50.0, np.inf]


def problems(batch, seed=0):
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 20.0, 100)
    truth = np.stack([rng.uniform(200, 800, batch), rng.uniform(0.5, 1.5, batch),
                      rng.uniform(100, 400, batch), rng.uniform(4.0, 8.0, batch),
                      rng.uniform(5, 20, batch)], 1)
    clean = (truth[:, :1] * np.exp(-t / truth[:, 1:2])
             + truth[:, 2:3] * np.exp(-t / truth[:, 3:4]) + truth[:, 4:5])
    y = clean + rng.normal(0, 5.0, clean.shape)
    p0 = truth * rng.uniform(0.7, 1.3, truth.shape)
    return t, y, p0


def model_tf(t, p):
    import tensorflow as tf
    return (p[:, 0:1] * tf.exp(-t / p[:, 1:2]) + p[:, 2:3] * tf.exp(-t / p[:, 3:4])
            + p[:, 4:5])


def model_np(t, a1, t1, a2, t2, c):
    return a1 * np.exp(-t / t1) + a2 * np.exp(-t / t2) + c


def jac_np(p, t, y):
    a1, t1, a2, t2, _ = p
    e1, e2 = np.exp(-t / t1), np.exp(-t / t2)
    return np.stack([e1, a1 * e1 * t / t1 ** 2, e2, a2 * e2 * t / t2 ** 2,
                     np.ones_like(t)], 1)


def clocked(fn):
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def time_ours(fits):
    """``(fit, wall, cpu, first wall, first cpu)`` of ours on the first
    ``fits`` problems: the first call (trace, compile, run), then the best
    of two."""
    import tensorflow as tf
    import tf_gradkit
    t, y, p0 = problems(fits)
    tt = tf.constant(t)

    def ours():
        fit = tf_gradkit.curve_fit(model_tf, tt, y, p0, bounds=(LOWER, UPPER))
        fit.x.numpy()
        return fit

    _, first_wall, first_cpu = clocked(ours)
    best = None
    for _ in range(2):
        fit, wall, cpu = clocked(ours)
        if best is None or cpu < best[2]:
            best = (fit, wall, cpu)
    return best + (first_wall, first_cpu)


def ours_row(fits):
    """`time_ours`'s row, JSON-able (`timing.on_one_thread` calls it)."""
    fit, wall, cpu, _, _ = time_ours(fits)
    return dict(wall=wall, cpu=cpu, converged=float(np.mean(fit.converged.numpy())))


def run(fits=100_000, scipy_fits=300, one_thread=True):
    t, y, p0 = problems(fits)
    fit, wall, cpu, first_wall, first_cpu = time_ours(fits)
    rows = [("tf_gradkit curve_fit defaults (float64, bounds)", fits, wall, cpu,
             float(np.mean(fit.converged.numpy())))]
    if one_thread:
        one = timing.on_one_thread("bounded_decay", "ours_row", fits=fits)
        rows.append(("tf_gradkit curve_fit defaults, 1 thread (own process)", fits,
                     one["wall"], one["cpu"], one["converged"]))
    n = scipy_fits

    def scipy_curve_fit():
        out = []
        for b in range(n):
            try:
                out.append(so.curve_fit(model_np, t, y[b], p0[b], bounds=(LOWER, UPPER))[0])
            except RuntimeError:
                out.append(np.full(5, np.nan))
        return np.array(out)

    def scipy_trf_jac():
        out = []
        for b in range(n):
            r = so.least_squares(lambda p, b=b: model_np(t, *p) - y[b], p0[b],
                                 jac=lambda p, b=b: jac_np(p, t, y[b]),
                                 bounds=(LOWER, UPPER), method="trf")
            out.append(r.x if r.status > 0 else np.full(5, np.nan))
        return np.array(out)

    xs, w, c = clocked(scipy_curve_fit)
    rows.append(("scipy curve_fit loop (trf, 2-point jac)", n, w, c,
                 float(np.mean(np.isfinite(xs).all(1)))))
    xj, w, c = clocked(scipy_trf_jac)
    rows.append(("scipy least_squares trf loop (analytic jac)", n, w, c,
                 float(np.mean(np.isfinite(xj).all(1)))))
    scipy_rates = [count / c for name, count, w, c, conv in rows[-2:]]
    print(f"\n### Bi-exponential decay, 100 points, 5 parameters, float64, bounds "
          f"(load average {os.getloadavg()[0]:.1f})\n")
    print("| engine | N | fits/s | fits/CPU-s | vs scipy curve_fit (CPU-s) | "
          "vs scipy trf, analytic jac (CPU-s) | converged |")
    print("|---|---|---|---|---|---|---|")
    for name, count, w, c, conv in rows:
        print(f"| {name} | {count:,} | {count / w:,.0f} | {count / c:,.0f} | "
              f"{count / c / scipy_rates[0]:.1f}x | {count / c / scipy_rates[1]:.1f}x | "
              f"{conv:.4f} |")
    both = np.isfinite(xs).all(1) & fit.converged.numpy()[:n]
    diff = np.median(np.abs(fit.x.numpy()[:n][both] - xs[both]) / np.abs(xs[both]), axis=0)
    print(f"\nfirst call (compile + run) {first_wall:.2f} s wall / {first_cpu:.2f} s CPU; "
          f"median relative difference from scipy curve_fit where both converged: "
          f"{np.array2string(diff, precision=2)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fits", type=int, default=100_000)
    parser.add_argument("--scipy-fits", type=int, default=300)
    parser.add_argument("--no-one-thread", action="store_true",
                        help="skip the row of ours on one thread (a child process)")
    args = parser.parse_args()
    run(args.fits, args.scipy_fits, one_thread=not args.no_one_thread)
