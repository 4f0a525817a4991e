"""Many small fits in one call: `tf_gradkit.curve_fit` against scipy in a loop.

Gpufit's benchmark case (Przybylski et al., Sci. Rep. 7, 15722 (2017)): a
2-D Gaussian (amplitude, x0, y0, sigma, offset) on 15 x 15 points, float32,
random starts near the truth, Gaussian or Poisson noise; B = 10^3, 10^4,
10^5 fits (10^6 with --huge), reported as fits/s, the share converged and
the parameters' error against the truth, beside `scipy.optimize.least_squares`
in a Python loop ("trf" and "lm", analytic Jacobian, timed on 1,000 fits in
the same run) and Gpufit's published figures. Then an exponential decay with
bounds (lifetime imaging, Poisson counts), a robust-loss case, and the
latency of one fit (first and repeated call) against scipy.

Timings are wall clock on whatever machine runs this; on a shared machine
say so (the figures in docs/batched_fits.md say where they were measured).

    python benchmarks/batched_fits.py                   # CPU, 1e3..1e5
    python benchmarks/batched_fits.py --device /GPU:0 --sizes 1000,100000,1000000
    python benchmarks/batched_fits.py --cpufit /tmp/cpufit/cpufit_bench   # beside Cpufit
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import scipy.optimize as so
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tf_gradkit

GPUFIT_GPU = 3_038_590   # fits/s, Gpufit on its GPU at 10^7 fits (published)
CPUFIT = 60_957          # fits/s, Cpufit (its CPU twin) at 10^7 fits (published)
SIDE = 15


def grid():
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64)
    return np.stack([x.ravel(), y.ravel()])          # [2, 225], shared


def gaussian(xy, p):
    """[B, 225] from p [B, 5] = (amplitude, x0, y0, sigma, offset)."""
    dx = xy[0][None, :] - p[:, 1:2]
    dy = xy[1][None, :] - p[:, 2:3]
    return p[:, 0:1] * tf.exp(-(dx * dx + dy * dy) / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5]


def gaussian_np(xy, p):
    dx, dy = xy[0] - p[1], xy[1] - p[2]
    g = np.exp(-(dx * dx + dy * dy) / (2.0 * p[3] ** 2))
    return p[0] * g + p[4], g, dx, dy


def gaussian_problems(batch, noise, rng):
    xy = grid()
    truth = np.stack([np.full(batch, 500.0), 7 + rng.uniform(-0.5, 0.5, batch),
                      7 + rng.uniform(-0.5, 0.5, batch), np.full(batch, 2.0),
                      np.full(batch, 10.0)], axis=1)
    dx = xy[0][None] - truth[:, 1:2]
    dy = xy[1][None] - truth[:, 2:3]
    clean = truth[:, :1] * np.exp(-(dx ** 2 + dy ** 2) / (2 * truth[:, 3:4] ** 2)) \
        + truth[:, 4:5]
    if noise == "poisson":
        y = rng.poisson(clean).astype(np.float64)
    else:
        y = clean + rng.normal(0, 10.0, clean.shape)
    # Gpufit's starts: the truth with random relative deviations.
    p0 = truth * (1 + rng.uniform(-0.1, 0.1, truth.shape))
    return xy, y, p0, truth


def scipy_loop(xy, y, p0, method):
    def residuals(p, yb):
        return gaussian_np(xy, p)[0] - yb

    def jacobian(p, yb):
        del yb
        _, g, dx, dy = gaussian_np(xy, p)
        a, s = p[0], p[3]
        return np.stack([g, a * g * dx / s ** 2, a * g * dy / s ** 2,
                         a * g * (dx * dx + dy * dy) / s ** 3, np.ones_like(g)], 1)

    xs, ok = [], []
    start = time.perf_counter()
    for b in range(len(y)):
        r = so.least_squares(residuals, p0[b], jac=jacobian, args=(y[b],),
                             method=method)
        xs.append(r.x)
        ok.append(r.status > 0)
    seconds = time.perf_counter() - start
    return np.array(xs), np.array(ok), seconds


def timed(fn):
    start = time.perf_counter()
    out = fn()
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
    return out, time.perf_counter() - start


def relative_error(x, truth):
    return np.median(np.abs(x - truth) / np.abs(truth), axis=0)


def gaussian_case(args, rng, rows):
    dtype = np.float32 if args.dtype == "float32" else np.float64
    n_scipy = args.scipy_fits
    xy, y, p0, truth = gaussian_problems(n_scipy, args.noise, rng)
    scipy = {}
    for method in ("trf", "lm"):
        xs, ok, seconds = scipy_loop(xy, y, p0, method)
        scipy[method] = dict(fits_per_s=n_scipy / seconds, converged=float(ok.mean()),
                             x=xs, ok=ok)
        print(f"scipy {method} loop: {n_scipy} fits in {seconds:.2f} s, "
              f"{n_scipy / seconds:,.0f} fits/s, converged {ok.mean():.3f}, "
              f"median relative error {relative_error(xs, truth).round(5)}")

    def fit(xy, y, p0):
        return tf_gradkit.curve_fit(gaussian, xy.astype(dtype), y.astype(dtype),
                                    p0.astype(dtype), solver=args.solver,
                                    batch_size=args.batch_size)

    # Agreement with scipy on scipy's problems (float64 for this check).
    ours64 = tf_gradkit.curve_fit(gaussian, xy, y, p0, solver=args.solver)
    both = ours64.converged.numpy() & scipy["trf"]["ok"]
    agree = np.max(np.abs(ours64.x.numpy()[both] - scipy["trf"]["x"][both])
                   / np.abs(scipy["trf"]["x"][both]))
    print(f"float64, {n_scipy} fits: converged {ours64.converged.numpy().mean():.3f} "
          f"(scipy trf {scipy['trf']['converged']:.3f}); largest relative "
          f"difference from scipy trf where both converged: {agree:.2e}")
    for batch in args.sizes:
        xy, y, p0, truth = gaussian_problems(batch, args.noise, rng)
        first, first_s = timed(lambda: fit(xy, y, p0))
        result, seconds = timed(lambda: fit(xy, y, p0))
        rate = batch / seconds
        conv = float(result.converged.numpy().mean())
        err = relative_error(result.x.numpy(), truth)
        row = dict(case="gaussian2d", noise=args.noise, dtype=args.dtype, batch=batch,
                   seconds=seconds, first_call_s=first_s, fits_per_s=rate,
                   converged=conv, median_relative_error=err.tolist(),
                   scipy_trf_fits_per_s=scipy["trf"]["fits_per_s"],
                   scipy_lm_fits_per_s=scipy["lm"]["fits_per_s"],
                   ratio_vs_trf=rate / scipy["trf"]["fits_per_s"],
                   ratio_vs_lm=rate / scipy["lm"]["fits_per_s"],
                   ratio_vs_cpufit=rate / CPUFIT, ratio_vs_gpufit=rate / GPUFIT_GPU)
        rows.append(row)
        print(f"B={batch:>8,}: {rate:>12,.0f} fits/s ({seconds:.2f} s; first call "
              f"{first_s:.2f} s with compile), converged {conv:.4f}, median rel. "
              f"error {err.round(5)}; x{row['ratio_vs_trf']:.0f} scipy trf, "
              f"x{row['ratio_vs_lm']:.0f} scipy lm, {row['ratio_vs_cpufit']:.2f} of "
              f"Cpufit's 60,957/s, {row['ratio_vs_gpufit']:.3f} of Gpufit's "
              "3,038,590/s (published, 10^7 fits)")
    return scipy


def decay_case(args, rng, rows):
    """Fluorescence-lifetime style: a exp(-t / tau) + c on 64 bins, Poisson
    counts, bounds a >= 0, 0.05 <= tau <= 20, c >= 0."""
    t = np.linspace(0.0, 10.0, 64)
    batch = args.decay_size
    truth = np.stack([rng.uniform(50, 500, batch), rng.uniform(0.5, 4.0, batch),
                      rng.uniform(0, 5, batch)], 1)
    y = rng.poisson(truth[:, :1] * np.exp(-t / truth[:, 1:2]) + truth[:, 2:3]).astype(
        np.float64)
    sigma = np.sqrt(np.maximum(y, 1.0))
    p0 = np.stack([y[:, 0], np.full(batch, 2.0), np.full(batch, 1.0)], 1)
    lower, upper = [0.0, 0.05, 0.0], [np.inf, 20.0, np.inf]

    def model(t, p):
        return p[:, 0:1] * tf.exp(-t / p[:, 1:2]) + p[:, 2:3]

    def fit():
        return tf_gradkit.curve_fit(model, t, y, p0, sigma=sigma, bounds=(lower, upper),
                                    solver=args.solver)

    fit()
    result, seconds = timed(fit)
    n = min(args.scipy_fits, batch)
    start = time.perf_counter()
    xs = []
    for b in range(n):
        xs.append(so.least_squares(
            lambda p, b=b: (p[0] * np.exp(-t / p[1]) + p[2] - y[b]) / sigma[b],
            p0[b], bounds=(lower, upper)).x)
    scipy_s = time.perf_counter() - start
    xs = np.array(xs)
    diff = np.median(np.abs(result.x.numpy()[:n] - xs) / np.abs(xs), axis=0)
    rate = batch / seconds
    rows.append(dict(case="decay_bounds", batch=batch, fits_per_s=rate,
                     converged=float(result.converged.numpy().mean()),
                     scipy_trf_fits_per_s=n / scipy_s, ratio_vs_trf=rate * scipy_s / n,
                     median_relative_difference_from_scipy=diff.tolist(),
                     on_a_bound=float((result.active_mask.numpy() != 0).any(1).mean())))
    print(f"decay with bounds, B={batch:,}: {rate:,.0f} fits/s, converged "
          f"{result.converged.numpy().mean():.4f}; scipy trf (2-point Jacobian) "
          f"{n / scipy_s:,.0f} fits/s; x{rate * scipy_s / n:.0f}; median relative "
          f"difference from scipy {diff}")


def robust_case(args, rng, rows):
    """A decay with 10% outliers, loss='soft_l1', f_scale=0.1."""
    t = np.linspace(0.0, 4.0, 50)
    batch = args.decay_size
    truth = np.stack([rng.uniform(1, 3, batch), rng.uniform(0.5, 2, batch)], 1)
    y = truth[:, :1] * np.exp(-truth[:, 1:2] * t) + rng.normal(0, 0.02, (batch, 50))
    out = rng.random((batch, 50)) < 0.1
    y[out] += rng.normal(0, 1.0, out.sum())
    p0 = np.ones([batch, 2])

    def model(t, p):
        return p[:, 0:1] * tf.exp(-p[:, 1:2] * t)

    def fit():
        return tf_gradkit.curve_fit(model, t, y, p0, loss="soft_l1", f_scale=0.1,
                                    solver=args.solver)

    fit()
    result, seconds = timed(fit)
    n = min(args.scipy_fits, batch)
    start = time.perf_counter()
    xs = np.array([so.least_squares(
        lambda p, b=b: p[0] * np.exp(-p[1] * t) - y[b], p0[b], loss="soft_l1",
        f_scale=0.1).x for b in range(n)])
    scipy_s = time.perf_counter() - start
    rate = batch / seconds
    err = np.median(np.abs(result.x.numpy() - truth) / truth, axis=0)
    err_scipy = np.median(np.abs(xs - truth[:n]) / truth[:n], axis=0)
    rows.append(dict(case="robust_soft_l1", batch=batch, fits_per_s=rate,
                     converged=float(result.converged.numpy().mean()),
                     scipy_trf_fits_per_s=n / scipy_s, ratio_vs_trf=rate * scipy_s / n,
                     median_relative_error=err.tolist(),
                     scipy_median_relative_error=err_scipy.tolist()))
    print(f"robust soft_l1, B={batch:,}: {rate:,.0f} fits/s, converged "
          f"{result.converged.numpy().mean():.4f}, median rel. error {err.round(4)} "
          f"(scipy {err_scipy.round(4)}); scipy trf {n / scipy_s:,.0f} fits/s; "
          f"x{rate * scipy_s / n:.0f}")


def latency(args, rng, rows):
    """One 80-point, 3-parameter exponential fit: first and repeated call."""
    t = np.linspace(0, 4, 80)
    y = 2.5 * np.exp(-1.3 * t) + 0.5 + rng.normal(0, 0.01, 80)

    def model(t, p):
        return p[:, 0:1] * tf.exp(-p[:, 1:2] * t) + p[:, 2:3]

    times = []
    for _ in range(3):
        start = time.perf_counter()
        tf_gradkit.curve_fit(model, t, y, [1.0, 1.0, 0.0], solver=args.solver).x.numpy()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(20):
        so.curve_fit(lambda t, a, k, c: a * np.exp(-k * t) + c, t, y, p0=[1, 1, 0])
    scipy_s = (time.perf_counter() - start) / 20
    rows.append(dict(case="latency_one_fit", first_call_s=times[0],
                     repeated_call_s=min(times[1:]), scipy_curve_fit_s=scipy_s))
    print(f"one fit: first call {times[0]:.2f} s, repeated {min(times[1:]) * 1e3:.1f} "
          f"ms; scipy curve_fit {scipy_s * 1e3:.2f} ms")


def plot(rows, path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plotting
    plt = plotting.pyplot()
    if plt is None:
        return
    gauss = [r for r in rows if r["case"] == "gaussian2d"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog([r["batch"] for r in gauss], [r["fits_per_s"] for r in gauss], "o-",
              label="tf_gradkit.curve_fit")
    for key, label in (("scipy_trf_fits_per_s", "scipy least_squares trf, loop"),
                       ("scipy_lm_fits_per_s", "scipy least_squares lm, loop")):
        ax.axhline(gauss[0][key], ls="--", color="gray" if "trf" in key else "silver",
                   label=label)
    ax.axhline(CPUFIT, ls=":", color="tab:orange", label="Cpufit, published (1e7)")
    ax.axhline(GPUFIT_GPU, ls=":", color="tab:red", label="Gpufit GPU, published (1e7)")
    ax.set_xlabel("fits per call (B)")
    ax.set_ylabel("fits / s")
    ax.set_title(f"2-D Gaussian, 15x15, {gauss[0]['dtype']}, measured on "
                 f"{args_device(rows)}", fontsize=8)
    ax.legend(fontsize=7)
    plotting.save(fig, path)


def args_device(rows):
    return rows[0].get("device", "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="e.g. /CPU:0 or /GPU:0")
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--huge", action="store_true", help="add B = 10^6")
    parser.add_argument("--noise", default="gaussian", choices=["gaussian", "poisson"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--solver", default="cholesky", choices=["cholesky", "qr"])
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--scipy-fits", type=int, default=1000)
    parser.add_argument("--decay-size", type=int, default=10000)
    parser.add_argument("--label", default="", help="where it ran, for the plot")
    parser.add_argument("--plot", default=None, help="docs/ file name of the plot")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--plot-from", default=None,
                        help="only draw --plot from rows written by --json")
    parser.add_argument("--cpufit", default=None, metavar="PATH",
                        help="Cpufit's driver (../shared/cpufit/build.sh): only the "
                             "table beside Cpufit (benchmarks/cpufit_side_by_side.py)")
    parser.add_argument("--cpufit-sides", default="5,15")
    parser.add_argument("--cpufit-rounds", type=int, default=3,
                        help="interleaved rounds of Cpufit and ours (median, spread)")
    parser.add_argument("--no-one-thread", action="store_true",
                        help="skip the rows of ours on one thread (a child process each "
                             "round)")
    parser.add_argument("--threads", type=int, default=None,
                        help="TensorFlow intra- and inter-op threads (e.g. 1, the "
                             "per-core figure beside single-threaded Cpufit)")
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.cpufit:
        import cpufit_side_by_side
        cpufit_side_by_side.main(args.cpufit, sides=tuple(
            int(s) for s in args.cpufit_sides.split(",")), scipy_fits=args.scipy_fits,
            rounds=args.cpufit_rounds, one_thread=not args.no_one_thread)
        return
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f), args.plot or "batched_fits.png")
        return
    args.sizes = [int(float(s)) for s in args.sizes.split(",")]
    if args.huge:
        args.sizes.append(1_000_000)
    rng = np.random.default_rng(0)
    rows = []
    device = args.device or ("/GPU:0" if tf.config.list_physical_devices("GPU")
                             else "/CPU:0")
    print(f"device {device}, {args.dtype}, solver {args.solver}, noise {args.noise}"
          f"{', ' + args.label if args.label else ''}")
    with tf.device(device):
        gaussian_case(args, rng, rows)
        decay_case(args, rng, rows)
        robust_case(args, rng, rows)
        latency(args, rng, rows)
    for r in rows:
        r["device"] = f"{device} {args.label}".strip()
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
