"""`curve_fit` beside Cpufit (Gpufit's single-threaded C++ twin) and scipy, one run.

Used by `benchmarks/batched_fits.py --cpufit PATH`. PATH is the driver that
`../shared/cpufit/build.sh` builds from Gpufit's own source (not part of this
repository: fetch and build it there). The driver generates Gpufit's 2-D
Gaussian data (5x5 and 15x15 points, float32), fits them and writes the data;
this module fits the same arrays with:

- ours, matched: Cpufit's stopping rule as near as ours goes (``ftol=1e-4``,
  ``max_iterations=10``; Cpufit stops when chi-square changes by less than
  ``max(1e-4, 1e-4 chi2)`` in at most 10 iterations), float32, defaults else;
- ours, defaults: ``curve_fit(f, xy, y, p0)`` with nothing else given;
- both again in a child process whose TensorFlow has one thread (``one_thread``,
  `timing.on_one_thread`): per CPU-second the like-for-like comparison with
  single-threaded Cpufit (two threads finish sooner but spend more CPU on
  each fit);
- scipy ``least_squares`` ``lm`` and ``trf`` in a Python loop on the first
  ``--scipy-fits`` fits (analytic Jacobian, float64, matched ``ftol``);

and prints one table: fits per second and per CPU-second (this process's
CPU, all threads; Cpufit's is single-threaded), ratios to Cpufit, converged
share. Cpufit and ours run in ``rounds`` (3) interleaved rounds, each engine
best of 2 runs per round (as Cpufit's driver times itself), and the table
gives the median over the rounds and the spread of the per-round ratios: on
a shared machine a slow spell otherwise lands on whichever engine runs
then. Then the first call (trace, compile + 10^4 fits) in a fresh process:
with the defaults, and with XLA without and with the persistent XLA cache
(`core/xla_cache.py`), each in its own process, the cache in an empty
directory of its own; five more processes then read that cache, one after
another (their median and range: one such process's time moves by a fifth
from run to run).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

import timing  # benchmarks/timing.py

HERE = os.path.dirname(os.path.abspath(__file__))


def load(directory):
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    n, m = meta["n_max"], meta["n_points"]
    data = np.fromfile(os.path.join(directory, "data.f32"), "<f4").reshape(n, m)
    p0 = np.fromfile(os.path.join(directory, "p0.f32"), "<f4").reshape(n, 5)
    side = meta["size_x"]
    y, x = np.mgrid[0:side, 0:side]
    return meta, data, p0, np.stack([x.ravel(), y.ravel()]).astype(np.float32)


def generated(side, fits, seed=0):
    """``(xy, y, p0)``, float32: Gpufit's 2-D Gaussian made here as its
    driver makes it (amplitude 500, centred, width 1 on 5x5 and 2 else,
    offset 10, each times U(0.9, 1.1); signal-to-noise 10; starts the truth
    times U(0.9, 1.1)), for scripts that run without the driver."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32)
    xy = np.stack([xx.ravel(), yy.ravel()])
    width = 1.0 if side == 5 else 2.0
    middle = side / 2 - 0.5
    truth = np.array([500, middle, middle, width, 10], np.float32) * rng.uniform(
        0.9, 1.1, (fits, 5)).astype(np.float32)
    spread = 2 * np.pi * 500 * width ** 2 / (4.292 * width) ** 2 / 10   # SNR 10
    y = (gaussian(xy, truth).numpy() + rng.normal(0, spread, (fits, side * side))
         ).astype(np.float32)
    p0 = (truth * rng.uniform(0.9, 1.1, truth.shape)).astype(np.float32)
    return xy, y, p0


def run_cpufit(driver, side, n, directory):
    out = subprocess.run([driver, "--size", str(side), "--n-max", str(n), "--sizes",
                          str(n), "--repeats", "2", "--out", directory],
                         check=True, capture_output=True, text=True).stdout
    best = None
    for line in out.splitlines():
        m = re.search(r"wall ([\d.]+) s .*cpu ([\d.]+) s .*converged ([\d.]+)", line)
        if m:
            wall, cpu, conv = (float(v) for v in m.groups())
            if best is None or cpu < best[1]:
                best = (wall, cpu, conv)
    return dict(engine="Cpufit (C++ -O3, 1 thread)", n=n, wall=best[0], cpu=best[1],
                converged=best[2])


def gaussian(xy, p):
    import tensorflow as tf
    dx = xy[0][None, :] - p[:, 1:2]
    dy = xy[1][None, :] - p[:, 2:3]
    return p[:, 0:1] * tf.exp(-(dx * dx + dy * dy) / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5]


def timed(fn, repeats=2, warm=True):
    if warm:
        fn()   # compiles this shape
    best = None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if best is None or cpu < best[1]:
            best = (wall, cpu, out)
    return best


def run_ours(directory, n, label, warm=True, **options):
    import tf_gradkit
    _, data, p0, xy = load(directory)
    wall, cpu, fit = timed(lambda: tf_gradkit.curve_fit(gaussian, xy, data[:n], p0[:n],
                                                        **options), warm=warm)
    return dict(engine=f"tf_gradkit {label}", n=n, wall=wall, cpu=cpu,
                converged=float(np.mean(fit.converged.numpy())),
                status={int(k): int(v) for k, v in
                        zip(*np.unique(fit.status.numpy(), return_counts=True))})


def run_scipy(directory, n, method, ftol):
    import scipy.optimize as so
    _, data, p0, xy = load(directory)
    xy = xy.astype(np.float64)

    def parts(p):
        dx, dy = xy[0] - p[1], xy[1] - p[2]
        g = np.exp(-(dx * dx + dy * dy) / (2.0 * p[3] ** 2))
        return p[0] * g + p[4], g, dx, dy

    def jac(p, y):
        _, g, dx, dy = parts(p)
        a, s = p[0], p[3]
        return np.stack([g, a * g * dx / s ** 2, a * g * dy / s ** 2,
                         a * g * (dx * dx + dy * dy) / s ** 3, np.ones_like(g)], 1)

    ok = []
    c0, t0 = time.process_time(), time.perf_counter()
    for b in range(n):
        r = so.least_squares(lambda p, y: parts(p)[0] - y, p0[b].astype(np.float64),
                             jac=jac, args=(data[b].astype(np.float64),), method=method,
                             ftol=ftol)
        ok.append(r.status > 0)
    return dict(engine=f"scipy {method} loop (float64)", n=n,
                wall=time.perf_counter() - t0, cpu=time.process_time() - c0,
                converged=float(np.mean(ok)))


def ours_rows(directory, n, configs):
    """`run_ours` for each ``[label, options]`` of ``configs``, labelled as
    run on one thread (`timing.on_one_thread` calls it in its child)."""
    return [run_ours(directory, n, f"{label}, 1 thread (own process)", **options)
            for label, options in configs]


FIRST_CALL = """
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
import cpufit_side_by_side as s
import tf_gradkit
meta, data, p0, xy = s.load({directory!r})
c0, t0 = time.process_time(), time.perf_counter()
fit = tf_gradkit.curve_fit(s.gaussian, xy, data[:10000], p0[:10000], **{options})
fit.x.numpy()
print(time.perf_counter() - t0, time.process_time() - c0)
"""


def first_calls(directory, reads=5):
    """(wall, cpu) of the first call in a fresh process: with the defaults
    (``jit_compile="auto"``: a plain ``tf.function`` for 10^4 fits), then
    with ``jit_compile=True`` (XLA) without the cache, and with the
    persistent XLA cache asked for (``TF_GRADKIT_XLA_CACHE=1``,
    `core/xla_cache.py`) in a process that fills an empty cache; then the
    list of ``reads`` further processes, one after another, that read it
    (one such process's CPU time moves by a fifth from run to run here)."""
    out = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache)
        env.pop("TF_XLA_FLAGS", None)
        env.pop("TF_GRADKIT_XLA_CACHE", None)
        for options, cached in ((({}, False), ({"jit_compile": True}, False),
                                 ({"jit_compile": True}, True))
                                + (({"jit_compile": True}, True),) * reads):
            if cached:
                env["TF_GRADKIT_XLA_CACHE"] = "1"
            code = FIRST_CALL.format(root=os.path.dirname(HERE), here=HERE,
                                     directory=directory, options=options)
            line = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                  capture_output=True, text=True).stdout.split()[-2:]
            out.append(tuple(float(v) for v in line))
    return out[:3] + [out[3:]]


def table(rounds, rows, side, load_before, load_after):
    """One line per engine: Cpufit and ours from ``rounds`` (a list per
    round, Cpufit first), their median fits per second and per CPU-second
    and the median [min-max] over the rounds of the ratio to that round's
    Cpufit; then ``rows`` (scipy, run once) against the median Cpufit."""
    print(f"\n### 2-D Gaussian {side}x{side}, float32 data (load average {load_before} "
          f"-> {load_after}; {len(rounds)} rounds, each Cpufit then ours, best of 2 "
          "runs each)\n")
    print("| engine | N | fits/s | fits/CPU-s | vs Cpufit (CPU-s), median [min-max] "
          "| converged | status |")
    print("|---|---|---|---|---|---|---|")
    base = np.median([r[0]["n"] / r[0]["cpu"] for r in rounds])
    for i in range(len(rounds[0])):
        runs = [r[i] for r in rounds]
        wall = np.median([r["n"] / r["wall"] for r in runs])
        cpu = np.median([r["n"] / r["cpu"] for r in runs])
        ratios = [(r[i]["n"] / r[i]["cpu"]) / (r[0]["n"] / r[0]["cpu"]) for r in rounds]
        print(f"| {runs[0]['engine']} | {runs[0]['n']:,} | {wall:,.0f} | {cpu:,.0f} | "
              f"{np.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
              f"{min(r['converged'] for r in runs):.4f} | {runs[-1].get('status', '')} |")
    for r in rows:
        per_cpu = r["n"] / r["cpu"]
        print(f"| {r['engine']} | {r['n']:,} | {r['n'] / r['wall']:,.0f} | {per_cpu:,.0f} | "
              f"{per_cpu / base:.2f}x | {r['converged']:.4f} | {r.get('status', '')} |")


def main(driver, sides=(5, 15), n=100_000, scipy_fits=500, rounds=3,
         one_thread=True):
    import tensorflow as tf  # noqa: F401  (after tf_gradkit's cache setup in main)
    for side in sides:
        with tempfile.TemporaryDirectory() as directory, \
                tempfile.TemporaryDirectory() as scratch:
            load_before = os.getloadavg()[0]
            runs = []
            for i in range(rounds):   # interleaved: a slow spell hits all engines
                # the driver seeds its data (mt19937(0)): every run's are the first's
                row = [run_cpufit(driver, side, n, scratch if i else directory)]
                meta, *_ = load(directory)
                matched = dict(ftol=float(meta["tolerance"]),
                               max_iterations=int(meta["max_n_iterations"]))
                row.append(run_ours(directory, n, "matched (ftol 1e-4, 10 it)",
                                    warm=not i, **matched))
                row.append(run_ours(directory, n, "defaults", warm=not i))
                if one_thread:
                    for one in timing.on_one_thread(
                            "cpufit_side_by_side", "ours_rows", directory=directory,
                            n=n, configs=[["matched (ftol 1e-4, 10 it)", matched],
                                          ["defaults", {}]]):
                        # (JSON's keys are strings)
                        one["status"] = {int(k): v for k, v in one["status"].items()}
                        row.append(one)
                runs.append(row)
            rows = [run_scipy(directory, scipy_fits, method, matched["ftol"])
                    for method in ("lm", "trf")]
            table(runs, rows, side, f"{load_before:.1f}", f"{os.getloadavg()[0]:.1f}")
            if side == sides[0]:
                (w0, c0), (w1, c1), (w2, c2), reads = first_calls(directory)
                cpu = [c for _, c in reads]
                print(f"\nfirst call, 10^4 {side}x{side} fits, fresh process (import "
                      f"not counted): curve_fit defaults {w0:.2f} s wall / {c0:.2f} s "
                      f"CPU; jit_compile=True {w1:.2f} s wall / {c1:.2f} s CPU; "
                      f"jit_compile=True with TF_GRADKIT_XLA_CACHE=1: filling an empty "
                      f"cache {w2:.2f} s wall / {c2:.2f} s CPU, {len(reads)} later "
                      f"processes reading it {np.median([w for w, _ in reads]):.2f} s "
                      f"wall / {np.median(cpu):.2f} s CPU (median; CPU "
                      f"{min(cpu):.2f}-{max(cpu):.2f} s)")
    import bounded_decay
    bounded_decay.run(fits=n, scipy_fits=scipy_fits, one_thread=one_thread)
