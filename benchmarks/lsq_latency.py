"""Latency of one small fit: `tf_gradkit.least_squares` against scipy's trf.

What it measures: an 80-point, 3-parameter exponential decay
``p0 exp(-p1 t) + p2`` (float64, noise 0.01) fitted from ``(1, 1, 0)``, the
case of issue 31 item 5. In one process:

  scipy        ``scipy.optimize.least_squares(method="trf")``: the baseline;
  repeat       ours, a repeated call (the traced solve comes from
               `core/lm/solve_cache.py`; ``jit_compile="auto"``, which is a
               plain ``tf.function`` for 3 parameters until the same function
               has been called `AUTO_XLA_CALLS` times: keep ``--repeats`` x
               ``--calls`` well under that);
  new data     ours, a repeated call after assigning new data to the
               ``tf.Variable`` the residual function reads;
  new lambda   ours, a new ``lambda`` (same line, same captures) each call;
  repeat, after 1,024 calls
               ours, a repeated call of a function already called
               `AUTO_XLA_CALLS` times (the defaults: "auto" runs it with XLA
               from then on; the call that compiles is shown apart);
  repeat XLA   ours with ``jit_compile=True``, a repeated call;
  first        ours, a first call: ``cache=False`` traces anew, as the first
               call of a new residual function does (the process's very first
               call, which also starts TensorFlow's runtime, is shown apart);
  first XLA    the same with ``jit_compile=True`` (an XLA compile).

Repeats are interleaved contender by contender; each timed sample of a
repeated call is the mean of ``--calls`` calls. Ratios are per repeat
(median [min-max]) against scipy's sample of the same repeat. Wall and CPU
(``time.process_time``, all of the process's threads) are both shown: on a
shared, loaded machine the wall time of a first call is several times its
CPU time. Each answer is checked against scipy's (relative 1e-6).

Run: ``.venv/bin/python benchmarks/lsq_latency.py`` (about a minute of CPU;
``--quick`` for a smoke run).
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # this script only, before TF loads

import numpy as np
import scipy.optimize as so
import tensorflow as tf

import tf_gradkit
from timing import spread, write_result

START = (1.0, 1.0, 0.0)


def data(seed):
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 4.0, 80)
    truth = rng.uniform([1.0, 0.5, -0.5], [4.0, 2.0, 0.5])
    y = truth[0] * np.exp(-truth[1] * t) + truth[2] + 0.01 * rng.standard_normal(80)
    return t, y


T, Y = data(0)
t_tf = tf.constant(T)
y_var = tf.Variable(Y)
p = tf.Variable(START, dtype=tf.float64)


def residuals():
    return p[0] * tf.exp(-p[1] * t_tf) + p[2] - y_var


def ours(**options):
    p.assign(START)
    return tf_gradkit.least_squares(residuals, [p], **options).x.numpy()


def residuals_repeated():
    """The same residuals as `residuals`: a cache entry of its own, called
    `AUTO_XLA_CALLS` times before timing, after which "auto" runs it with
    XLA."""
    return p[0] * tf.exp(-p[1] * t_tf) + p[2] - y_var


def ours_after_switch():
    p.assign(START)
    return tf_gradkit.least_squares(residuals_repeated, [p]).x.numpy()


def ours_new_lambda():
    p.assign(START)
    return tf_gradkit.least_squares(
        lambda: p[0] * tf.exp(-p[1] * t_tf) + p[2] - y_var, [p]).x.numpy()


def scipy_fit(y=None):
    y = Y if y is None else y
    return so.least_squares(lambda q: q[0] * np.exp(-q[1] * T) + q[2] - y,
                            START, method="trf").x


def timed(fn, calls=1):
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        out = fn()
    return ((time.perf_counter() - wall) / calls,
            (time.process_time() - cpu) / calls, out)


def check(name, x, reference):
    if not np.allclose(x, reference, rtol=1e-6, atol=1e-9):
        raise AssertionError(f"{name}: {x} differs from scipy's {reference}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--first", type=int, default=3,
                        help="first calls timed (each traces; XLA ones compile)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.calls, args.first = 2, 3, 1
    reference = scipy_fit()
    process_first = timed(ours)
    check("process first", process_first[2], reference)
    ours(jit_compile=True)  # the XLA entry, compiled once before timing
    ours_new_lambda()  # its line's first call traces; later ones find the entry
    calls = sys.modules["tf_gradkit.core.lm.least_squares"].AUTO_XLA_CALLS
    switch = []
    for _ in range(calls):   # "auto" turns to XLA at the last of these calls
        switch.append(timed(ours_after_switch))
    check("after switch", switch[-1][2], reference)
    new = data(1)[1]

    def new_data():
        y_var.assign(new)
        try:
            return ours()
        finally:
            y_var.assign(Y)

    repeated = {"repeat": ours, "new data": new_data, "new lambda": ours_new_lambda,
                f"repeat, after {calls:,} calls (auto: XLA)": ours_after_switch,
                "repeat XLA": lambda: ours(jit_compile=True)}
    rows = {name: [] for name in ["scipy", *repeated, "first", "first XLA"]}
    for _ in range(args.repeats):
        rows["scipy"].append(timed(scipy_fit, args.calls)[:2])
        for name, fn in repeated.items():
            wall, cpu, x = timed(fn, args.calls)
            check(name, x, scipy_fit(new) if name == "new data" else reference)
            rows[name].append((wall, cpu))
    for i in range(args.first):
        for name, options in (("first", {}), ("first XLA", {"jit_compile": True})):
            if name == "first XLA" and i:  # one XLA compile is enough to show
                continue
            wall, cpu, x = timed(lambda options=options: ours(cache=False, **options))
            check(name, x, reference)
            rows[name].append((wall, cpu))
            rows[name + " scipy"] = rows.get(name + " scipy", []) + [
                timed(scipy_fit, args.calls)[:2]]
    lines = [f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
             "cores (figures measured under that load)", "",
             "| call | wall ms (median [min-max]) | CPU ms | ratio to scipy (wall) "
             "| ratio to scipy (CPU) |",
             "|---|---|---|---|---|"]
    scipy_walls = [w for w, _ in rows["scipy"]]
    scipy_cpu = statistics.median(c for _, c in rows["scipy"])
    lines.append("| process's first call (TF runtime start included) | "
                 f"{1e3 * process_first[0]:.0f} | {1e3 * process_first[1]:.0f} | "
                 f"{process_first[0] / statistics.median(scipy_walls):.0f}x | "
                 f"{process_first[1] / scipy_cpu:.0f}x |")
    plain_cpu = [c for _, c, _ in switch[:-1]]
    lines.append(f"| the {calls:,}th call of one function (auto's switch to XLA: "
                 f"compile) | {1e3 * switch[-1][0]:.0f} | {1e3 * switch[-1][1]:.0f} | "
                 f"| (calls 2-{calls - 1:,}: {1e3 * statistics.median(plain_cpu[1:]):.2f} "
                 "ms CPU each) |")
    for name, samples in rows.items():
        if name.endswith(" scipy"):
            continue
        walls, cpus = [w for w, _ in samples], [c for _, c in samples]
        baseline = (scipy_walls if name not in ("first", "first XLA")
                    else [w for w, _ in rows[name + " scipy"]])
        ratios = [w / b for w, b in zip(walls, baseline)]
        med, lo, hi = spread(walls)
        r_med, r_lo, r_hi = spread(ratios)
        scipy_cpus = ([c for _, c in rows["scipy"]] if name not in ("first", "first XLA")
                      else [c for _, c in rows[name + " scipy"]])
        lines.append(f"| {name} | {1e3 * med:.2f} [{1e3 * lo:.2f}-{1e3 * hi:.2f}] | "
                     f"{1e3 * statistics.median(cpus):.2f} | "
                     f"{r_med:.2f}x [{r_lo:.2f}-{r_hi:.2f}] | "
                     f"{statistics.median(cpus) / statistics.median(scipy_cpus):.2f}x |")
    text = "\n".join(lines)
    print(text)
    write_result("lsq_latency.md", text)


if __name__ == "__main__":
    main()
