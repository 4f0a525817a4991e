"""Gradient accumulation across workers: 1 and 2 MultiWorkerMirroredStrategy
workers on loopback, GradientAccumulator(Adam, steps=4) against plain Adam
data parallelism (Keras's own), in the same run.

Per contender: time per global batch and per real (Adam) update, and what the collective
all-reduces carried per window of 4 global batches of 64 (calls, full
gradients' worth of elements, bytes), counted by an op placed beside every
all-reduce in the worker (`tests/multiworker_worker.py`). On 2 cores two
workers share the machine, so absolute scaling means little: the
communication counts are the claim.

    python benchmarks/distributed.py [--repeats 3]

Model 8-256-256-1 (68k parameters), 2048 examples, global batch 64, 2
epochs timed after one untimed (traced) epoch. Runs under the process's
flavour (TF_USE_LEGACY_KERAS=1 for tf_keras).
"""

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)

import multiworker  # noqa: E402  (tests/: the launcher the tests use)

WORKER = os.path.join(TESTS, "multiworker_worker.py")
CASES = {"plain Adam (data parallel)": "bench_plain-fit",
         "GradientAccumulator(Adam, 4)": "bench_acc-fit"}
WINDOW = 4


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    flavour = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras3"
    rows = []
    for workers in (1, 2):
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as out:
                runs.append(multiworker.launch(WORKER, list(CASES.values()), out,
                                               workers=workers, timeout=600)[0])
        for label, case in CASES.items():
            per_update = [float(r[f"{case}/seconds"]) / int(r[f"{case}/updates"])
                          for r in runs]
            r = runs[0]
            calls, elements, scalars, _, _ = (int(v) for v in r[f"{case}/reduce"])
            batches = 2 * 2048 // 64
            windows = batches / WINDOW
            params = int(r[f"{case}/params"])
            rows.append({
                "workers": workers, "contender": label,
                "ms_per_batch": 1e3 * statistics.median(
                    float(r[f"{case}/seconds"]) / (2 * 2048 // 64) for r in runs),
                "ms_per_update": 1e3 * statistics.median(per_update),
                "range": (1e3 * min(per_update), 1e3 * max(per_update)),
                "updates": int(r[f"{case}/updates"]),
                "calls_per_window": calls / windows,
                "gradients_per_window": (elements - scalars) / params / windows,
                "bytes_per_window": 4 * elements / windows})
    print(f"flavour {flavour}; {args.repeats} repeats; window = {WINDOW} global batches")
    print("| workers | contender | ms / global batch | ms / real update (median [min-max]) "
          "| updates | all-reduce calls / window | full gradients / window | "
          "bytes / window |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['workers']} | {row['contender']} | {row['ms_per_batch']:.2f} | "
              f"{row['ms_per_update']:.2f} "
              f"[{row['range'][0]:.2f}-{row['range'][1]:.2f}] | {row['updates']} | "
              f"{row['calls_per_window']:.1f} | {row['gradients_per_window']:.2f} | "
              f"{row['bytes_per_window'] / 1e3:.0f} kB |")
    for workers in (1, 2):
        plain, ours = (r for r in rows if r["workers"] == workers)
        line = (f"{workers} worker(s): accumulation / plain per global batch "
                f"{ours['ms_per_batch'] / plain['ms_per_batch']:.2f}x")
        if plain["bytes_per_window"]:  # one worker all-reduces nothing
            line += (f"; all-reduced bytes per window "
                     f"{ours['bytes_per_window'] / plain['bytes_per_window']:.2f}x")
        print(line)


if __name__ == "__main__":
    main()
