"""NIST StRD nonlinear regression: tf_gradkit.least_squares next to MINPACK.

Runs the 19 StRD problems of `shared/nist/` (lower and average difficulty)
from both NIST starting points, in float64, with

  ours    ``tf_gradkit.least_squares(residual_fn, variables, max_iterations=500)``
          on the TensorFlow models of `tests/nist_problems.py`;
  scipy   ``scipy.optimize.least_squares(method="lm", xtol=ftol=gtol=1e-15,
          max_nfev=10000)``, i.e. MINPACK's ``lmdif`` with its own
          forward-difference Jacobian, on the same formulas evaluated in numpy.

and prints a markdown table: the minimum log relative error (LRE) over the
certified parameters for each, our iteration count, the wall-clock time of
one call of each and their ratio. Our time is that of one whole call, so it
includes whatever tracing and XLA compilation the call does; scipy's is
pure numpy + MINPACK. Read the times only as a ratio within this run.

Run from the repository root:

    .venv/bin/python benchmarks/nist_table.py               # table to stdout
    .venv/bin/python benchmarks/nist_table.py --write-docs  # also docs/nist.md

A copy of the table goes to `benchmarks/results/nist.md` (git-ignored). If
`tf_gradkit.least_squares` is missing, our columns read "n/a" and the scipy
column is still printed.
"""

import argparse
import datetime
import os
import pathlib
import platform
import sys
import time
import traceback
import warnings

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))

import scipy  # noqa: E402
import tensorflow as tf  # noqa: E402
from scipy import optimize  # noqa: E402

import tf_gradkit  # noqa: E402
from nist_problems import (NIST_DIR, PROBLEMS, lre, residual_fn_for,  # noqa: E402
                           variables_at)

LRE_TARGET = 6.0
# MGH17 from start 1 needs 563 iterations; the tests use the same limit.
MAX_ITERATIONS = 1000
SCIPY_OPTIONS = dict(method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=10000)


def run_ours(problem, start):
    """One `tf_gradkit.least_squares` call; a dict of results, or a reason it could not run."""
    try:
        solve = tf_gradkit.least_squares
    except AttributeError:
        return {"missing": "tf_gradkit.least_squares does not exist"}
    variables = variables_at(problem.starts[start - 1])
    residual_fn = residual_fn_for(problem, variables)
    try:
        began = time.perf_counter()
        result = solve(residual_fn, variables, max_iterations=MAX_ITERATIONS)
        cost = float(result.cost)  # waits for the solve to finish
        seconds = time.perf_counter() - began
    except Exception as error:  # noqa: BLE001 - one failing problem must not hide the rest
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}",
                "traceback": traceback.format_exc()}
    estimate = np.array([float(v.numpy()) for v in variables])
    return {
        "lre": float(np.min(lre(estimate, problem.certified))),
        "iterations": int(result.iterations),
        "reason": str(result.reason),
        "cost": cost,
        "seconds": seconds,
    }


def run_scipy(problem, start):
    """One MINPACK fit of the numpy form of the same model."""
    model, x, y = problem.model, problem.x, problem.y

    def residuals(b):
        return model(b, x, xp=np) - y

    with warnings.catch_warnings():
        # Far starts (MGH17 start 1) overflow exp() on the way; MINPACK copes.
        warnings.simplefilter("ignore", RuntimeWarning)
        began = time.perf_counter()
        fit = optimize.least_squares(residuals, problem.starts[start - 1], **SCIPY_OPTIONS)
        seconds = time.perf_counter() - began
    return {
        "lre": float(np.min(lre(fit.x, problem.certified))),
        "nfev": int(fit.nfev),
        "status": int(fit.status),
        "seconds": seconds,
    }


def _lre_cell(run):
    if "lre" not in run:
        return "n/a" if "missing" in run else "error"
    mark = "" if run["lre"] >= LRE_TARGET else " *"
    return f"{run['lre']:.2f}{mark}"


def table(rows):
    """The markdown table and its summary line."""
    lines = [
        "| problem | start | min LRE (ours) | min LRE (scipy) | our iterations "
        "| our time (ms) | scipy time (ms) | time ratio ours / scipy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, start, ours, theirs in rows:
        has_ours = "lre" in ours
        iterations = str(ours["iterations"]) if has_ours else "n/a"
        our_ms = f"{1e3 * ours['seconds']:.1f}" if has_ours else "n/a"
        ratio = f"{ours['seconds'] / theirs['seconds']:.1f}" if has_ours else "n/a"
        lines.append(f"| {name} | {start} | {_lre_cell(ours)} | {_lre_cell(theirs)} "
                     f"| {iterations} | {our_ms} | {1e3 * theirs['seconds']:.1f} | {ratio} |")
    total = len(rows)
    ours_ok = sum("lre" in o and o["lre"] >= LRE_TARGET for _, _, o, _ in rows)
    scipy_ok = sum(t["lre"] >= LRE_TARGET for _, _, _, t in rows)
    ours_text = (f"{ours_ok}/{total}" if any("lre" in o for _, _, o, _ in rows)
                 else "n/a (tf_gradkit.least_squares missing)")
    summary = (f"LRE >= {LRE_TARGET:g} on every parameter: ours {ours_text}, "
               f"scipy MINPACK {scipy_ok}/{total}. (* = below {LRE_TARGET:g})")
    return "\n".join(lines), summary


def header():
    return (f"tensorflow {tf.__version__}; scipy {scipy.__version__}; numpy {np.__version__}; "
            f"Python {platform.python_version()}; {os.cpu_count()} CPUs; "
            f"{datetime.datetime.now():%Y-%m-%d %H:%M}; data {NIST_DIR}")


DOCS_TEMPLATE = """\
# NIST StRD nonlinear regression

The [Statistical Reference Datasets](https://www.itl.nist.gov/div898/strd/nls/nls_main.shtml)
(StRD) of NIST are the standard accuracy check for nonlinear least-squares
software. Each problem gives a model, data, two starting points (start 1 far
from the solution, start 2 closer) and certified parameter values computed in
128-bit arithmetic, printed to 11 significant digits. We use the 19 problems
of lower and average difficulty.

The figure of merit is the **log relative error** of each parameter,

    LRE = -log10(|estimate - certified| / |certified|)

(the absolute error when the certified value is 0), roughly the number of
correct significant digits, capped here at 15. A solid double-precision
solver reaches LRE >= {target:g} on every parameter from both starts.

## Results

`tf_gradkit.least_squares(residual_fn, variables, max_iterations={max_iterations})` in
float64 with its defaults, next to scipy's MINPACK wrapper
`least_squares(method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=10000)`
(forward-difference Jacobian, as MINPACK's `lmdif`). The LRE columns give the
minimum over the problem's parameters. Times are one call each, ours
including tracing and XLA compilation; they depend on the machine, so only
their ratio within one run means anything.

{header}

{table}

{summary}

## Reproduce

```bash
.venv/bin/python benchmarks/nist_table.py               # prints the table
.venv/bin/python benchmarks/nist_table.py --write-docs  # rewrites this page
.venv/bin/python -m pytest tests/test_nist.py -m slow   # asserts LRE >= {target:g}, all 38 fits
```

The models are written by hand from the headers in `tests/nist_problems.py`;
`tests/test_nist.py` checks each against its certified residual sum of squares.
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/nist.md")
    parser.add_argument("--docs-path", default=str(REPO / "docs" / "nist.md"),
                        help="where --write-docs writes (default: docs/nist.md)")
    parser.add_argument("--problems", default=",".join(sorted(PROBLEMS)),
                        help="comma-separated subset of problems")
    args = parser.parse_args()

    names = [n for n in args.problems.split(",") if n]
    unknown = sorted(set(names) - set(PROBLEMS))
    if unknown:
        parser.error(f"--problems: unknown {unknown}; known: {sorted(PROBLEMS)}")

    rows, failures = [], []
    for name in names:
        for start in (1, 2):
            ours = run_ours(PROBLEMS[name], start)
            theirs = run_scipy(PROBLEMS[name], start)
            rows.append((name, start, ours, theirs))
            if "error" in ours:
                failures.append(f"{name} start {start}: {ours['error']}")
            print(f"{name} start {start}: ours {_lre_cell(ours)}, scipy {_lre_cell(theirs)}",
                  file=sys.stderr, flush=True)

    text, summary = table(rows)
    report = [header(), "", text, "", summary]
    if failures:
        report += ["", "Errors:"] + [f"- {line}" for line in failures]
    if any("missing" in o for _, _, o, _ in rows):
        report += ["", "ours: n/a - tf_gradkit.least_squares does not exist in this checkout."]
    report = "\n".join(report)
    print(report)

    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "nist.md").write_text(f"# NIST StRD benchmark\n\n{report}\n")

    if args.write_docs:
        page = DOCS_TEMPLATE.format(target=LRE_TARGET, max_iterations=MAX_ITERATIONS,
                                    header=header(), table=text, summary=summary)
        pathlib.Path(args.docs_path).write_text(page)
        print(f"wrote {args.docs_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
