"""Where a compiled batched fit spends its time, kernel by kernel (XLA on a CPU).

    python benchmarks/kernel_profile.py [--case 5x5|15x15|decay] [--fits 100000] [--top 25]

Runs `tf_gradkit.curve_fit` with ``jit_compile=True`` (twice, to compile and
warm), then once under TensorFlow's profiler with XLA's per-kernel trace
(``--xla_cpu_enable_xprof_traceme``, set in this process's ``XLA_FLAGS``
before TensorFlow loads, with a dump of the optimised HLO in a temporary
folder). It prints the kernels' time summed over all threads, split into the
kernels inside a loop of the chunk's program (the passes, the compacted tail,
the trust radius fit) and those that run once per chunk (the linearisation at
the start, the final checks, the covariance), and the costliest kernels of
each with the TensorFlow op they came from; then each loop's own span on
the thread that runs it (it includes its kernels and the waits on them).
The profiler adds its own cost: read the shares, not the times.

Cases: Gpufit's 2-D Gaussian on 5x5 or 15x15 points (float32, truth
amplitude 500, centre at the middle, width side / 5, background 10, each
times U(0.9, 1.1); Gaussian noise of standard deviation sqrt(model); starts
the truth times U(0.9, 1.1); Cpufit's stopping rule,
``ftol=1e-4, max_iterations=10``), or benchmarks/bounded_decay.py's float64
bounded decay with the defaults.
"""

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="kernel_profile_")
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_cpu_enable_xprof_traceme=true",
    f"--xla_dump_to={DUMP}", "--xla_dump_hlo_as_text"]).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tf_gradkit  # noqa: E402


def gaussian(xy, p):
    dx = xy[0][None, :] - p[:, 1:2]
    dy = xy[1][None, :] - p[:, 2:3]
    return p[:, 0:1] * tf.exp(-(dx * dx + dy * dy) / (2.0 * p[:, 3:4] ** 2)) + p[:, 4:5]


def gaussian_case(side, fits, seed=0):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32)
    xy = np.stack([xx.ravel(), yy.ravel()])
    middle = (side - 1) / 2
    truth = np.array([500, middle, middle, side / 5, 10], np.float32) * rng.uniform(
        0.9, 1.1, (fits, 5)).astype(np.float32)
    clean = gaussian(xy, truth).numpy()
    y = (clean + rng.normal(0, np.sqrt(clean))).astype(np.float32)
    p0 = (truth * rng.uniform(0.9, 1.1, truth.shape)).astype(np.float32)

    def call():
        return tf_gradkit.curve_fit(gaussian, xy, y, p0, ftol=1e-4, max_iterations=10,
                                    jit_compile=True)
    return call


def decay_case(fits):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bounded_decay
    t, y, p0 = bounded_decay.problems(fits)

    def call():
        return tf_gradkit.curve_fit(bounded_decay.model_tf, t, y, p0, jit_compile=True,
                                    bounds=(bounded_decay.LOWER, bounded_decay.UPPER))
    return call


def kernel_times(logdir):
    """{kernel name: (ms summed over threads, events)} from the profile."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0],
              "rb") as f:
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


def program():
    """({instruction: its computation}, {computations run in a loop},
    {instruction: TensorFlow op name}, {while instructions}) from the dumped
    HLO of the chunk's program (a loop's body and condition, and what they
    call, run in a loop)."""
    files = [f for f in glob.glob(os.path.join(DUMP, "*cpu_after_optimizations.txt"))
             if "chunk" in os.path.basename(f)]
    where, ops, calls, loops, whiles, computation = ({}, {}, collections.defaultdict(set),
                                                     set(), set(), None)
    with open(max(files, key=os.path.getsize)) as f:
        lines = f.readlines()
    for line in lines:
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and not line.startswith(" "):
            computation = head.group(1)
            continue
        found = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = ", line)
        if not found:
            continue
        where[found.group(1)] = computation
        op = re.search(r'op_name="([^"]*)"', line)
        ops[found.group(1)] = op.group(1) if op else ""
        calls[computation].update(re.findall(r"%([\w.\-]+)", line.split(" = ", 1)[1]))
        loops.update(re.findall(r"(?:body|condition)=%([\w.\-]+)", line))
        if re.search(r" while\(", line):
            whiles.add(found.group(1))
    todo = list(loops)
    while todo:   # what a loop's computations call runs in the loop too
        for called in calls.pop(todo.pop(), ()):
            if called in calls and called not in loops:
                loops.add(called)
                todo.append(called)
    return where, loops, ops, whiles


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="5x5", choices=["5x5", "15x15", "decay"])
    parser.add_argument("--fits", type=int, default=100_000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    call = (decay_case(args.fits) if args.case == "decay"
            else gaussian_case(int(args.case.split("x")[0]), args.fits))
    call()
    call()
    logdir = tempfile.mkdtemp(prefix="kernel_profile_trace_")
    tf.profiler.experimental.start(logdir)
    cpu = time.process_time()
    fit = call()
    fit.x.numpy()
    cpu = time.process_time() - cpu
    tf.profiler.experimental.stop()
    where, loops, ops, whiles = program()
    measured = kernel_times(logdir)
    times = {k: v for k, v in measured.items() if k in where and k not in whiles}
    inside = {k: v for k, v in times.items() if where[k] in loops}
    once = {k: v for k, v in times.items() if where[k] not in loops}
    total = sum(v[0] for v in times.values())
    print(f"{args.case}, {args.fits:,} fits: {cpu:.2f} s of CPU under the profiler; "
          f"kernels {total:.1f} ms over all threads, {len(times)} kernels; "
          f"converged {float(np.mean(fit.converged.numpy())):.4f}")
    for label, part in (("in loops (passes, tail, radius fit)", inside),
                        ("once per chunk", once)):
        ms = sum(v[0] for v in part.values())
        print(f"\n{label}: {ms:.1f} ms ({ms / total:.0%}), {len(part)} kernels")
        for name, (t, n) in sorted(part.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {t:8.2f} ms {n:6d} events  {name:<36} {ops.get(name, '')[:70]}")
    spans = {k: v for k, v in measured.items() if k in whiles}
    print("\nloops' own spans (their kernels' time and waits included): " + ", ".join(
        f"{k} {v[0]:.1f} ms / {v[1]} events" for k, v in sorted(spans.items())))


if __name__ == "__main__":
    main()
