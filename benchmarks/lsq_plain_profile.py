"""Where one small plain `least_squares` call spends its time (no XLA).

    python benchmarks/lsq_plain_profile.py [--top 15]

Not a comparison: a profile of our own solve on benchmarks/lsq_latency.py's
case (its 80-point float64 decay from ``(1, 1, 0)``, imported), with
``jit_compile=False``, as "auto" runs it for its first `AUTO_XLA_CALLS`
calls. It prints:

- **the first call, in parts** (CPU seconds): the trace (Python builds the
  solve's graph: ``get_concrete_function``), the first run of the traced
  function (TensorFlow's graph optimisation, Grappler, and the executor's
  set-up, then the run), and a repeated run for scale; with the traced
  graph's size, nested functions included, and how many of its ops are
  constants;
- **where the traced ops come from**: the solve's ops (nested functions
  included) counted by the innermost tf_gradkit source line that created
  them, and by file: a trace costs about a millisecond of Python per op, and
  a repeated call runs them (the ops of loop bodies once per iteration or
  attempt) through TensorFlow's executor.

Why no kernel-by-kernel profile of the repeated call: TensorFlow's profiler
traces only the kernels its executor deems expensive, a judgement it
revises from their measured times while the process runs (the same 20 calls
showed 1,925 kernels per call in one process and 196 in another), so its
counts do not tell what ran.

Nothing here is timed against a peer; benchmarks/lsq_latency.py does that.
"""

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # this script only, before TF loads


import tf_gradkit
from lsq_latency import START, p, residuals   # the same case, its variables
from tf_gradkit.core.lm import solve_cache
from timing import write_result


def fit(**options):
    p.assign(START)
    return tf_gradkit.least_squares(residuals, [p], jit_compile=False, **options)


def first_call_parts():
    """CPU seconds of a first call's trace, first run and a repeated run."""
    parts = {}
    original = solve_cache.OneSignature.__call__

    def timed_call(self, *args):
        if self._concrete is None:
            start = time.process_time()
            self._concrete = self.function.get_concrete_function(*args)
            parts["trace"] = time.process_time() - start
            start = time.process_time()
            out = self._concrete(*args)
            parts["first run"] = time.process_time() - start
            return out
        return original(self, *args)

    solve_cache.OneSignature.__call__ = timed_call
    try:
        start = time.process_time()
        result = fit(cache=False)
        parts["whole first call"] = time.process_time() - start
    finally:
        solve_cache.OneSignature.__call__ = original
    fit()   # the cached entry's own first call
    start = time.process_time()
    for _ in range(20):
        fit()
    parts["repeated call"] = (time.process_time() - start) / 20
    return parts, int(result.iterations)


def ops_by_source(concrete):
    """Counters of the traced solve's ops (nested functions included) and of
    its constants, by the innermost tf_gradkit line that created them (the
    user's residual function's own ops under its caller's line)."""
    ops, constants, seen = collections.Counter(), collections.Counter(), set()

    def visit(graph):
        for op in graph.get_operations():
            frames = [f for f in (op.traceback or []) if "tf_gradkit" in f.filename]
            where = (f"{os.path.relpath(frames[-1].filename, PACKAGE)}:{frames[-1].lineno}"
                     if frames else "(no tf_gradkit frame)")
            ops[where] += 1
            constants[where] += op.type == "Const"
            for attr in ("then_branch", "else_branch", "body", "cond", "f"):
                try:
                    name = op.get_attr(attr).name
                except (ValueError, AttributeError):
                    continue
                nested = graph._functions.get(name)
                if name not in seen and nested is not None and hasattr(nested, "graph"):
                    seen.add(name)
                    visit(nested.graph)

    visit(concrete.graph)
    return ops, constants


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(tf_gradkit.__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    fit()   # TensorFlow's runtime started, outside the parts below
    parts, iterations = first_call_parts()
    (entry,) = solve_cache.SOLVES._entries.values()
    by_line, constants_by_line = ops_by_source(entry._concrete)
    ops, constants = sum(by_line.values()), sum(constants_by_line.values())
    by_file = collections.Counter()
    for where, n in by_line.items():
        by_file[where.rsplit(":", 1)[0]] += n
    lines = [
        f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", "",
        "| part of the first call (cache=False) | CPU s |", "|---|---|",
        f"| trace (Python builds the graph: {ops:,} ops, nested functions "
        f"included; {constants:,} of them constants) | {parts['trace']:.3f} |",
        "| first run (graph optimisation, executor set-up, the run) | "
        f"{parts['first run']:.3f} |",
        f"| the whole first call | {parts['whole first call']:.3f} |",
        f"| a repeated call ({iterations} iterations) | {parts['repeated call']:.4f} |",
        "", "| source file | ops traced |", "|---|---|"]
    lines += [f"| {where} | {n} |" for where, n in by_file.most_common(args.top)]
    lines += ["", "| source line | ops traced | of them constants |", "|---|---|---|"]
    lines += [f"| {where} | {n} | {constants_by_line[where]} |"
              for where, n in by_line.most_common(args.top)]
    text = "\n".join(lines)
    print(text)
    write_result("lsq_plain_profile.md", text)


if __name__ == "__main__":
    sys.exit(main())
