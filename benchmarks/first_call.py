"""The first call of a new shape in a fresh process, this checkout beside another.

Issue 39's goal: `curve_fit` on 10^4 Gpufit 2-D Gaussians (5x5 points,
float32, the package's defaults: a plain ``tf.function`` for that many fits)
in at most 2 s of CPU, trace and run, in a fresh process (the import not
counted). Each round starts one fresh process per checkout, alternated (a
slow spell of a shared machine hits both), and times its first call and a
second one (the run alone). With ``--against PATH`` (another checkout of the
project, e.g. a ``git worktree`` of an earlier commit) it prints both and
the ratio of their medians; the data are made here as
`cpufit_side_by_side.generated` makes them (Gpufit's generator).

    python benchmarks/first_call.py [--against /tmp/old] [--rounds 5] [--side 5]
        [--fits 10000] [--options '{"jit_compile": true, "batch_size": 1000000}']

``--options`` passes keyword arguments to `curve_fit` (JSON): with
``jit_compile`` and a ``batch_size`` it times an XLA compile of one chunk of
that size (plus its run), the first call a GPU user of large chunks pays.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = """
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
import cpufit_side_by_side as s
import tf_gradkit
assert os.path.dirname(tf_gradkit.__file__).startswith({root!r}), tf_gradkit.__file__
xy, y, p0 = s.generated({side}, {fits})
times = []
for _ in range(2):
    c0 = time.process_time()
    fit = tf_gradkit.curve_fit(s.gaussian, xy, y, p0, **{options})
    fit.x.numpy()
    times.append(time.process_time() - c0)
print(*times, fit.converged.numpy().mean())
"""


def first_call(root, side, fits, options=None):
    """``(first call's CPU s, second call's CPU s, converged share)`` in a
    fresh process importing tf_gradkit from ``root``."""
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("TF_GRADKIT_XLA_CACHE", None)
    code = CHILD.format(root=root, here=HERE, side=side, fits=fits,
                        options=repr(options or {}))
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True, timeout=1200).stdout
    return tuple(float(v) for v in out.split()[-3:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="another checkout of the project")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--side", type=int, default=5)
    parser.add_argument("--fits", type=int, default=10_000)
    parser.add_argument("--options", default="{}",
                        help="curve_fit's keyword arguments as JSON, e.g. '{\"jit_compile\": "
                             "true, \"batch_size\": 1000000}' (default: none, the defaults)")
    args = parser.parse_args()
    try:
        options = json.loads(args.options)
    except ValueError as error:
        parser.error(f"--options: not JSON ({error}). Received: {args.options!r}")
    if not isinstance(options, dict):
        parser.error(f"--options: a JSON object of keyword arguments. Received: "
                     f"{args.options!r}")
    roots = [ROOT] + ([os.path.abspath(args.against)] if args.against else [])
    runs = {root: [] for root in roots}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for root in roots:
            runs[root].append(first_call(root, args.side, args.fits, options))
    print(f"\n### First call of 10^{len(str(args.fits)) - 1} {args.side}x{args.side} "
          f"Gaussian fits, curve_fit's {'options ' + json.dumps(options) if options else 'defaults'}, "
          f"fresh processes ({args.rounds} "
          f"alternated rounds; load average {load:.1f} -> {os.getloadavg()[0]:.1f})\n")
    print("| checkout | first call, CPU s: median [min-max] | second call, CPU s | "
          "converged |")
    print("|---|---|---|---|")
    for root in roots:
        first = [r[0] for r in runs[root]]
        second = [r[1] for r in runs[root]]
        print(f"| {root} | {statistics.median(first):.2f} [{min(first):.2f}-"
              f"{max(first):.2f}] | {statistics.median(second):.2f} | "
              f"{min(r[2] for r in runs[root]):.4f} |")
    if args.against:
        ratio = (statistics.median(r[0] for r in runs[roots[0]])
                 / statistics.median(r[0] for r in runs[roots[1]]))
        print(f"\nfirst call, this checkout / the other: {ratio:.2f}x the CPU")


if __name__ == "__main__":
    main()
