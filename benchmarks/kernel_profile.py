"""Where a compiled batched fit spends its time, kernel by kernel (XLA on a CPU).

    python benchmarks/kernel_profile.py [--case 5x5|15x15|decay] [--fits 100000]
        [--data DIR] [--top 25]

Not a comparison: a profile of our own compiled `curve_fit` chunk. It runs
`tf_gradkit.curve_fit` with ``jit_compile=True`` twice (to compile and warm),
then once under TensorFlow's profiler with XLA's per-kernel trace
(``--xla_cpu_enable_xprof_traceme``, set in this process's ``XLA_FLAGS``
before TensorFlow loads, with a dump of the optimised HLO; both in temporary
folders, removed at the end). It prints the kernels' time summed over all
threads, split into the kernels inside a loop of the chunk's program (the
passes, the compacted tail, the trust radius fit) and those that run once per
chunk (the linearisation at the start, the final checks, the covariance),
the costliest kernels of each with the TensorFlow op they came from, and the
traced spans of the control flow (``while``, ``conditional``, ``call``),
summed over chunks and threads, which hold other kernels and are left out of
the sums. The profiler adds its own cost: read the shares, not the times.
About a minute (two compiles and three calls).

Cases: Gpufit's 2-D Gaussian on 5x5 or 15x15 points as ../shared/cpufit/'s
driver makes it (amplitude 500, centre at the middle, width 1 on 5x5 and 2
on 15x15, background 10, each times U(0.9, 1.1); Gaussian noise at SNR 10;
starts the truth times U(0.9, 1.1); numpy's generator, so other draws than
the driver's unless ``--data`` names a folder the driver wrote) with
Cpufit's stopping rule (``ftol=1e-4, max_iterations=10``), or
benchmarks/bounded_decay.py's float64 bounded decay with the defaults.
"""

import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="kernel_profile_")
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_cpu_enable_xprof_traceme=true",
    f"--xla_dump_to={DUMP}", "--xla_dump_hlo_as_text"]).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("TF_GRADKIT_XLA_CACHE", None)   # a program read from the cache is not dumped

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import bounded_decay  # noqa: E402
import cpufit_side_by_side  # noqa: E402
import timing  # noqa: E402
import tf_gradkit  # noqa: E402

gaussian = cpufit_side_by_side.gaussian


def gaussian_case(side, fits, data=None, seed=0):
    if data is not None:
        _, y, p0, xy = cpufit_side_by_side.load(data)
        y, p0 = y[:fits], p0[:fits]
    else:
        xy, y, p0 = cpufit_side_by_side.generated(side, fits, seed)
    def call():
        return tf_gradkit.curve_fit(gaussian, xy, y, p0, ftol=1e-4, max_iterations=10,
                                    jit_compile=True)
    return call


def decay_case(fits):
    t, y, p0 = bounded_decay.problems(fits)

    def call():
        return tf_gradkit.curve_fit(bounded_decay.model_tf, t, y, p0, jit_compile=True,
                                    bounds=(bounded_decay.LOWER, bounded_decay.UPPER))
    return call


def kernel_times(logdir):
    """{kernel name: (ms summed over threads, events)} from the profile."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    found = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not found:
        raise SystemExit(f"kernel_profile: the profiler wrote no trace under {logdir}")
    with open(found[0], "rb") as f:
        space.ParseFromString(f.read())
    out = collections.defaultdict(lambda: [0.0, 0])
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                entry = out[names.get(event.metadata_id, "?")]
                entry[0] += event.duration_ps / 1e9
                entry[1] += 1
    return out


# An HLO instruction's called computations, and the opcodes whose traced
# span holds other kernels (control flow: left out of the kernel sums).
CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%([\w.\-]+)|branch_computations=\{([^}]*)\}")
CONTROL = re.compile(r" (?:while|conditional|call)\(")


def program():
    """({instruction: its computation}, {computations run in a loop},
    {instruction: TensorFlow op name}, {control-flow instructions}) from the
    dumped HLO of the chunk's program (a loop's body and condition, and what
    they call, run in a loop)."""
    files = [f for f in glob.glob(os.path.join(DUMP, "*cpu_after_optimizations.txt"))
             if "chunk" in os.path.basename(f)]
    if not files:
        raise SystemExit(f"kernel_profile: XLA dumped no chunk program under {DUMP}")
    with open(max(files, key=os.path.getsize)) as f:
        lines = f.readlines()
    where, ops, calls, loops, control, computation = ({}, {}, collections.defaultdict(set),
                                                      set(), set(), None)
    for line in lines:
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and not line.startswith(" "):
            computation = head.group(1)
            continue
        found = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = ", line)
        if not found:
            continue
        name = found.group(1)
        where[name] = computation
        op = re.search(r'op_name="([^"]*)"', line)
        ops[name] = op.group(1) if op else ""
        for single, several in CALLED.findall(line):
            calls[computation].update([single] if single else re.findall(
                r"%([\w.\-]+)", several))
        loops.update(re.findall(r"(?:body|condition)=%([\w.\-]+)", line))
        if CONTROL.search(line):
            control.add(name)
    todo = list(loops)
    while todo:   # what a loop's computations call runs in the loop too
        for called in calls.pop(todo.pop(), ()):
            if called not in loops:
                loops.add(called)
                todo.append(called)
    return where, loops, ops, control


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="5x5", choices=["5x5", "15x15", "decay"])
    parser.add_argument("--fits", type=int, default=100_000)
    parser.add_argument("--data", default=None,
                        help="a folder ../shared/cpufit/'s driver wrote (Gaussian cases)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    call = (decay_case(args.fits) if args.case == "decay"
            else gaussian_case(int(args.case.split("x")[0]), args.fits, args.data))
    call()
    call()
    logdir = tempfile.mkdtemp(prefix="kernel_profile_trace_")
    try:
        tf.profiler.experimental.start(logdir)
        cpu = time.process_time()
        fit = call()
        fit.x.numpy()
        cpu = time.process_time() - cpu
        tf.profiler.experimental.stop()
        where, loops, ops, control = program()
        measured = kernel_times(logdir)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
        shutil.rmtree(DUMP, ignore_errors=True)
    times = {k: v for k, v in measured.items() if k in where and k not in control}
    total = sum(v[0] for v in times.values())
    if not total:
        raise SystemExit("kernel_profile: no traced kernel matched the dumped program")
    lines = [f"### `curve_fit` chunk kernels, {args.case}, {args.fits:,} fits\n",
             f"{cpu:.2f} s of CPU under the profiler; kernels {total:.1f} ms summed over "
             f"all threads, {len(times)} kernels; converged "
             f"{float(np.mean(fit.converged.numpy())):.4f}"]
    for label, inside in (("in loops (passes, compacted tail, trust radius fit)", True),
                          ("once per chunk", False)):
        part = {k: v for k, v in times.items() if (where[k] in loops) == inside}
        ms = sum(v[0] for v in part.values())
        lines += [f"\n{label}: {ms:.1f} ms ({ms / total:.0%}), {len(part)} kernels\n",
                  "| ms | events | kernel | TensorFlow op |", "|---|---|---|---|"]
        lines += [f"| {t:.2f} | {n} | {name} | {ops.get(name, '')[:70]} |"
                  for name, (t, n) in sorted(part.items(), key=lambda kv: -kv[1][0])[:args.top]]
    lines.append("\ncontrol flow's traced spans (other kernels inside, summed over chunks and "
                 "threads): " + ", ".join(f"{k} {v[0]:.1f} ms / {v[1]} events"
                                          for k, v in sorted(measured.items()) if k in control))
    text = "\n".join(lines)
    print(text)
    print("written to", timing.write_result(f"kernel_profile_{args.case}.md", text))


if __name__ == "__main__":
    main()
