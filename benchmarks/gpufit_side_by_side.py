"""`curve_fit` beside Gpufit on the same GPU, the same data, in one run.

    python benchmarks/gpufit_side_by_side.py --driver OUT/gpufit_bench [--sides 5,15]
        [--fits 1000000] [--json FILE]

The driver is built on the GPU machine by `benchmarks/build_gpufit.sh` from Gpufit's own
source (not part of this repository). It generates Gpufit's 2-D Gaussian data as
../shared/cpufit's driver does (5x5 points, width 1, the case behind Gpufit's published
3,038,590 fits/s; 15x15, width 2), fits them on the GPU and writes data and results; this
script fits the same arrays with `curve_fit` on the GPU:

- matched: Gpufit's stopping rule as near as ours goes (``ftol=1e-4``, ``max_iterations=10``);
- defaults: ``curve_fit(f, xy, y, p0)``, nothing else given;
- each again in one chunk (``batch_size`` = all fits);

``--settings`` picks some of them.

Both sides are timed as a user calls them: host arrays in, results back on the host (Gpufit's
call copies the data to the GPU and back too). Each engine: the best of three calls after a
first one (ours: the first call traces and compiles, printed apart). Wall-clock fits per
second are the figure here (a GPU engine's host CPU time says little). Agreement: the median
and 99th percentile of |ours - Gpufit| / |Gpufit| over fits both call converged.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpufit_side_by_side as side_by_side  # (load, gaussian)


def run_gpufit(driver, side, n, directory, repeats=4):
    """Gpufit's rows: its driver times each call; the first (CUDA's start-up) is left out."""
    out = subprocess.run([driver, "--size", str(side), "--n-max", str(n), "--sizes", str(n),
                          "--repeats", str(repeats), "--out", directory],
                         check=True, capture_output=True, text=True).stdout
    print(out, end="", flush=True)
    with open(os.path.join(directory, "meta.json")) as f:
        runs = json.load(f)["runs"]
    walls = [r["wall_s"] for r in runs[1:]]
    states = np.fromfile(os.path.join(directory, f"cpufit_states_{n}.i32"), "<i4")
    params = np.fromfile(os.path.join(directory, f"cpufit_params_{n}.f32"), "<f4").reshape(n, 5)
    return dict(engine="Gpufit (CUDA, its driver)", n=n, first_s=runs[0]["wall_s"],
                wall=min(walls), converged=float(np.mean(states == 0))), params, states == 0


def run_ours(directory, n, label, device, **options):
    import tensorflow as tf
    import tf_gradkit
    _, data, p0, xy = side_by_side.load(directory)
    data, p0 = data[:n], p0[:n]

    def call():
        fit = tf_gradkit.curve_fit(side_by_side.gaussian, xy, data, p0, **options)
        return fit.x.numpy(), fit.converged.numpy(), fit.status.numpy()

    with tf.device(device):
        t0 = time.perf_counter()
        call()
        first = time.perf_counter() - t0
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            x, converged, status = call()
            walls.append(time.perf_counter() - t0)
    statuses = {int(k): int(v) for k, v in zip(*np.unique(status, return_counts=True))}
    return dict(engine=f"tf_gradkit {label}", n=n, first_s=first, wall=min(walls),
                converged=float(np.mean(converged)), status=statuses), x, converged


def agreement(x, ok, ref, ref_ok):
    both = ok & ref_ok
    if not both.any():
        return None
    rel = np.abs(x[both] - ref[both]) / np.maximum(np.abs(ref[both]), 1e-30)
    return [float(np.median(rel)), float(np.percentile(rel, 99))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--driver", required=True)
    parser.add_argument("--sides", default="5,15")
    parser.add_argument("--fits", default="1000000",
                        help="one count for every side, or one per side")
    parser.add_argument("--device", default="/GPU:0", help="ours; /CPU:0 only to try the script")
    parser.add_argument("--json", default=None)
    parser.add_argument("--settings", default="matched,defaults,matched1,defaults1",
                        help="ours: any of matched, defaults, matched1, defaults1 (one "
                             "chunk); each first call compiles for 20-50 s on an H200")
    args = parser.parse_args()
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    print("GPUs:", gpus, flush=True)
    if not gpus and "GPU" in args.device:
        sys.exit("no GPU visible to TensorFlow: this script compares on a GPU")
    sides = [int(s) for s in args.sides.split(",")]
    fits = [int(float(s)) for s in args.fits.split(",")]
    if len(fits) == 1:
        fits *= len(sides)
    if len(fits) != len(sides):
        parser.error(f"--fits: one count, or one per side ({len(sides)}); "
                     f"received {args.fits!r}")
    settings = args.settings.split(",")
    unknown = sorted(set(settings) - {"matched", "defaults", "matched1", "defaults1"})
    if unknown:
        parser.error(f"--settings: unknown {unknown}; accepted: matched, defaults, "
                     "matched1, defaults1")
    rows = []
    for side, n in zip(sides, fits):
        with tempfile.TemporaryDirectory() as directory:
            gpufit_row, ref, ref_ok = run_gpufit(args.driver, side, n, directory)
            gpufit_row["side"] = side
            rows.append(gpufit_row)
            configs = {"matched": ("matched", dict(ftol=1e-4, max_iterations=10)),
                       "defaults": ("defaults", {}),
                       "matched1": ("matched, one chunk", dict(ftol=1e-4, max_iterations=10,
                                                               batch_size=n)),
                       "defaults1": ("defaults, one chunk", dict(batch_size=n))}
            for label, options in [configs[k] for k in settings]:
                row, x, ok = run_ours(directory, n, label, args.device, **options)
                row.update(side=side, agreement=agreement(x, ok, ref, ref_ok))
                rows.append(row)
                print(json.dumps(row), flush=True)
        print(f"\n{side}x{side} Gaussian, {n} fits, float32, on {args.device} {gpus[0].name if gpus else ''}")
        print(f"{'engine':34s} {'first s':>8s} {'best s':>8s} {'fits/s':>12s} "
              f"{'x Gpufit':>9s} {'converged':>9s}  agreement (median, p99)")
        for r in [r for r in rows if r["side"] == side]:
            ratio = gpufit_row["wall"] / r["wall"]
            print(f"{r['engine']:34s} {r['first_s']:8.3f} {r['wall']:8.4f} "
                  f"{r['n'] / r['wall']:12,.0f} {ratio:9.2f} {r['converged']:9.4f}  "
                  f"{r.get('agreement')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
