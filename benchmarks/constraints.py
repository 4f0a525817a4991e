"""Train-step cost of constrained updates, both Keras flavours, one run.

Variants on one MLP (non-negative kernels):
  (a) no constraint (the baseline);
  (b) tf_gradkit Projected(Adam, {"kernel": NonNeg()}) -- projection inside the step;
  (c) Keras ``kernel_constraint=NonNeg()`` -- Keras's own post-update constraint;
  (d) the hand-rolled habit: the compiled step, then a separate
      ``v.assign(tf.maximum(v, 0))`` per kernel from Python.
And the sparse case from the issue: MaxNorm on a 200k x 64 Embedding trained with
SGD, Keras ``embeddings_constraint`` (projects the whole table every step) vs
Projected (only the touched rows).

Each flavour runs in its own process (``TF_USE_LEGACY_KERAS`` fixes it), each
mode is eager, tf.function, and tf.function(jit_compile=True). Prints ms/step
(median of 5 repeats, variants interleaved) and ratios to (a).

    python benchmarks/constraints.py            # both flavours
    python benchmarks/constraints.py --quick    # fewer steps
"""

import argparse
import os
import subprocess
import sys
import time


def run_flavour(args):
    import numpy as np
    import tensorflow as tf

    import tf_gradkit
    from tf_gradkit import constraints as C

    K = tf.keras
    flavour = "tf_keras" if K.__name__.startswith("tf_keras") else "keras3"
    rng = np.random.RandomState(0)
    batch, d, hidden = 256, 128, 512
    x = tf.constant(rng.randn(batch, d).astype("float32"))
    y = tf.constant(rng.randn(batch, 10).astype("float32"))

    def mlp(constraint=None):
        model = K.Sequential([K.Input((d,))] + [
            K.layers.Dense(hidden, activation="relu", kernel_constraint=constraint)
            for _ in range(3)] + [K.layers.Dense(10, kernel_constraint=constraint)])
        return model

    def make(variant, mode):
        if variant == "c":
            model = mlp(K.constraints.NonNeg())
        else:
            model = mlp()
        opt = K.optimizers.Adam(1e-3)
        if variant == "b":
            opt = tf_gradkit.optimizers.Projected(opt, {"kernel": C.NonNeg()}, model=model)
        kernels = [v for v in model.trainable_variables if "kernel" in v.name]

        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        if mode != "eager":
            step = tf.function(step, jit_compile=(mode == "jit"))
        if variant == "d":
            inner = step

            def step():
                loss = inner()
                for v in kernels:
                    v.assign(tf.maximum(v, 0.0))
                return loss
        return step

    steps = 10 if args.quick else 30
    rows = []
    for mode in ("eager", "function", "jit"):
        fns = {v: make(v, mode) for v in "abcd"}
        for fn in fns.values():
            for _ in range(3):
                fn()
        times = {v: [] for v in fns}
        for _ in range(5):
            for v, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    loss = fn()
                float(loss)
                times[v].append((time.perf_counter() - t0) / steps * 1e3)
        med = {v: float(np.median(t)) for v, t in times.items()}
        rows.append((mode, med))

    print(f"\n## {flavour}: MLP {d}-{hidden}x3-10, batch {batch}, Adam, NonNeg kernels")
    print("| mode | (a) none ms | (b) Projected ms | (c) kernel_constraint ms "
          "| (d) separate assign ms | b/a | c/a | d/a | b/c |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, m in rows:
        print(f"| {mode} | {m['a']:.2f} | {m['b']:.2f} | {m['c']:.2f} | {m['d']:.2f} "
              f"| {m['b'] / m['a']:.3f} | {m['c'] / m['a']:.3f} | {m['d'] / m['a']:.3f} "
              f"| {m['b'] / m['c']:.3f} |")

    # Sparse: MaxNorm rows of a large embedding table with SGD.
    vocab, dim = (50_000 if args.quick else 200_000), 64
    ids = tf.constant(rng.randint(0, vocab, size=(256, 8)).astype("int32"))
    target = tf.constant(rng.randn(256, 1).astype("float32"))

    def emb_model(constraint=None):
        return K.Sequential([K.Input((8,), dtype="int32"),
                             K.layers.Embedding(vocab, dim, embeddings_constraint=constraint),
                             K.layers.GlobalAveragePooling1D(), K.layers.Dense(1)])

    def make_sparse(variant, mode):
        model = emb_model(C.MaxNorm(1.0, axis=1) if variant == "keras" else None)
        opt = K.optimizers.SGD(0.1)
        if variant == "projected":
            opt = tf_gradkit.optimizers.Projected(
                opt, {"embeddings": C.MaxNorm(1.0, axis=1)}, model=model)

        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(ids, training=True) - target))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return tf.function(step, jit_compile=(mode == "jit"))

    print(f"\n## {flavour}: Embedding {vocab} x {dim}, MaxNorm(axis=1) rows, SGD, 2048 ids/step")
    print("| mode | none ms | Keras constraint ms | Projected ms | Keras/none | Projected/none |")
    print("|---|---|---|---|---|---|")
    for mode in ("function", "jit"):
        fns = {}
        for v in ("none", "keras", "projected"):
            try:
                fns[v] = make_sparse(v, mode)
                for _ in range(3):
                    fns[v]()
            except Exception as e:  # noqa: BLE001 - tf_keras's optimizer refuses constraints on sparse updates
                fns[v] = None
                print(f"<!-- {v} under {mode}: {type(e).__name__}: {str(e)[:120]} -->")
        times = {v: [] for v in fns}
        for _ in range(5):
            for v, fn in fns.items():
                if fn is None:
                    continue
                t0 = time.perf_counter()
                for _ in range(steps):
                    loss = fn()
                float(loss)
                times[v].append((time.perf_counter() - t0) / steps * 1e3)
        med = {v: (float(np.median(t)) if t else float("nan")) for v, t in times.items()}
        fmt = lambda v: "raises" if fns[v] is None else f"{med[v]:.2f}"  # noqa: E731
        ratio = lambda v: "-" if fns[v] is None else f"{med[v] / med['none']:.2f}"  # noqa: E731
        print(f"| {mode} | {fmt('none')} | {fmt('keras')} | {fmt('projected')} "
              f"| {ratio('keras')} | {ratio('projected')} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--flavour", choices=["keras3", "tf_keras"])
    args = parser.parse_args()
    if args.flavour:
        run_flavour(args)
        return
    for flavour in ("keras3", "tf_keras"):
        env = dict(os.environ, TF_USE_LEGACY_KERAS="1" if flavour == "tf_keras" else "0",
                   TF_CPP_MIN_LOG_LEVEL="2")
        cmd = [sys.executable, __file__, "--flavour", flavour] + (
            ["--quick"] if args.quick else [])
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
