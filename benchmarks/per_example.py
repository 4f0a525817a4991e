"""Per-example gradients and norms: ours against the Python loop of tapes.

A CNN (28x28x1 -> conv 16 -> conv 32 stride 2 -> dense 10, 51k parameters)
on random data, batches 32 to 512. Three ways to get what DP-SGD needs (each
example's gradient norm):

  loop        a Python loop of single-example GradientTapes (eager), the
              hand-rolled baseline;
  vectorised  `per_example_gradients` (tf.vectorized_map, compiled), which
              materialises B x 51k gradients, then their norms;
  ghost       `per_example_gradient_norms` (compiled): one forward and one
              backward pass, no per-example gradient.

Each measurement runs in a fresh process: the time is the median of 3 calls
after a first one (which compiles); the memory is the growth of the
process's peak resident set (ru_maxrss, measured: tf.config's memory info
does not work on CPUs and tracemalloc does not see TensorFlow's allocator)
over that first call, so it counts what each method allocates, compilation
included. Beside it, the analytic size of the largest tensor each method
materialises: the B x P per-example gradients (vectorised), the conv
patches or Gram matrices of the largest layer (ghost), one example's
gradients (loop). Ratios are against the loop. With matplotlib installed it
also writes docs/per_example.png. Run: ``.venv/bin/python
benchmarks/per_example.py`` (about 3 minutes on 2 CPU cores).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import plotting

METHODS = ("loop", "vectorised", "ghost")
# The model's layers: (name, rows T per example, input width d, output width p).
# conv1: 26x26 positions of 3x3x1 patches -> 16; conv2: 12x12 of 3x3x16 -> 32;
# dense: 1 row of 4608 -> 10.
LAYERS = (("conv1", 26 * 26, 9, 16), ("conv2", 12 * 12, 144, 32), ("dense", 1, 4608, 10))
PARAMS = sum(d * p + p for _, _, d, p in LAYERS)


def analytic_mb(method, batch):
    """The largest tensor a method materialises, in MB (float32)."""
    if method == "loop":
        return 4 * PARAMS / 2 ** 20
    if method == "vectorised":
        return 4 * batch * PARAMS / 2 ** 20
    # Ghost: per layer the patches [B, T, d] and either the two T x T Grams or
    # the [B, d, p] product, whichever `core.ghost_norms` picks (the smaller).
    return max(4 * batch * max(t * d, min(2 * t * t, d * p)) for _, t, d, p in LAYERS) / 2 ** 20


def measure(method, batch):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    from tf_gradkit.gradients import per_example_gradient_norms, per_example_gradients
    K = tf.keras
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((28, 28, 1)), K.layers.Conv2D(16, 3, activation="relu"),
                          K.layers.Conv2D(32, 3, strides=2, activation="relu"),
                          K.layers.Flatten(), K.layers.Dense(10)])
    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x = tf.random.normal([batch, 28, 28, 1])
    y = tf.random.uniform([batch], 0, 10, tf.int32)
    variables = model.trainable_variables

    if method == "loop":
        def run():
            norms = []
            for i in range(batch):
                with tf.GradientTape() as tape:
                    value = tf.reduce_sum(loss(y[i:i + 1], model(x[i:i + 1])))
                grads = tape.gradient(value, variables)
                norms.append(tf.sqrt(tf.add_n([tf.reduce_sum(g * g) for g in grads])))
            return tf.stack(norms)
    elif method == "vectorised":
        @tf.function
        def run():
            grads = per_example_gradients(
                lambda e: tf.reduce_sum(loss(e[1], model(e[0]))), variables, (x, y))
            return tf.sqrt(tf.add_n([tf.reduce_sum(tf.reshape(g * g, [batch, -1]), 1)
                                     for g in grads]))
    else:
        @tf.function
        def run():
            return per_example_gradient_norms(model, loss, x, y, training=False)

    model(x[:1])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    norms = run().numpy()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run().numpy()
        times.append(time.perf_counter() - start)
    return {"ms": 1e3 * float(np.median(times)), "peak_mb": (peak - base) / 1024.0,
            "norm_sum": float(np.sum(norms))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="32,64,128,256,512")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    print(f"CNN 28x28x1, {PARAMS} parameters; time: median of 3 calls; memory: peak RSS "
          "growth over the first call (fresh process each); largest tensor: analytic\n")
    print("| batch | method | ms | x loop's time | peak MB | x loop's memory | "
          "largest tensor MB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    table = {}
    for batch in (int(b) for b in args.batches.split(",")):
        results = {}
        for method in METHODS:
            out = subprocess.run([sys.executable, __file__, "--one", method, str(batch)],
                                 capture_output=True, text=True, check=True)
            results[method] = json.loads(out.stdout.strip().splitlines()[-1])
        ref = results["loop"]
        for method in METHODS:
            r = results[method]
            # The three agree on the norms (a check that they compute the same).
            assert abs(r["norm_sum"] - ref["norm_sum"]) <= 1e-3 * ref["norm_sum"], (method, r)
            print(f"| {batch} | {method} | {r['ms']:.1f} | {r['ms'] / ref['ms']:.3f} | "
                  f"{r['peak_mb']:.0f} | {r['peak_mb'] / max(ref['peak_mb'], 1.0):.2f} | "
                  f"{analytic_mb(method, batch):.1f} |", flush=True)
        table[batch] = results
    plot(table)


def plot(table):
    plt = plotting.pyplot()
    if plt is None:
        return
    batches = sorted(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method in METHODS:
        left.plot(batches, [table[b][method]["ms"] for b in batches], "o-", label=method)
        right.plot(batches, [table[b][method]["peak_mb"] for b in batches], "o-",
                   label=method)
    for ax, label in ((left, "time per call (ms)"), (right, "peak RSS growth (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel(label)
        ax.legend()
    left.set_yscale("log")
    fig.suptitle(f"Per-example gradient norms, CNN with {PARAMS} parameters, CPU")
    plotting.save(fig, "per_example.png", dpi=90)


if __name__ == "__main__":
    main()
