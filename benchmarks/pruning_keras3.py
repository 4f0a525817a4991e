"""Pruning on Keras 3: MagnitudePruning's cost per step, and its accuracy.

1. Speed (Keras 3, this process): an MLP 784-300-100-10 and a small CNN on
   28x28x1 inputs, batch 64, a compiled ``GradientTape`` step
   (``jit_compile=True``; ``--graph`` adds ``tf.function`` without XLA):
   plain ``Adam(1e-3)`` against ``MagnitudePruning(Adam(1e-3))`` with a
   ``PolynomialDecay`` to 80% recomputing masks every 50 steps (their cost
   included). Repeats of 30 steps, interleaved (alternating which goes
   first); ratio = median of per-repeat ratios [min-max].
2. Accuracy at 80% sparsity on scikit-learn's digits (1,437 train / 360
   test, bundled with scikit-learn): an MLP 64-256-128-10, Adam(1e-3), 40
   epochs of batch 32, the same schedule to 80% over the first 60% of the
   steps, every 10 steps; dense vs ours on Keras 3, and dense vs tfmot's
   ``prune_low_magnitude`` on tf_keras (in a subprocess: tfmot sets
   ``TF_USE_LEGACY_KERAS=1`` for its process). Test accuracy, mean [min-max]
   over seeds.

Run: ``.venv/bin/python benchmarks/pruning_keras3.py`` (about 3 minutes on 2
cores; ``--quick`` for a smoke run). Needs scikit-learn (``.[bench]``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if "--tfmot-worker" in sys.argv:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np

BATCH = 64
SPARSITY = 0.8


# ----------------------------------------------------------------- speed
def _speed_model(K, name):
    K.utils.set_random_seed(0)
    layers = K.layers
    if name == "mlp":
        return K.Sequential([K.Input((784,)), layers.Dense(300, activation="relu"),
                             layers.Dense(100, activation="relu"), layers.Dense(10)])
    return K.Sequential([K.Input((28, 28, 1)), layers.Conv2D(16, 3, activation="relu"),
                         layers.MaxPooling2D(), layers.Conv2D(32, 3, activation="relu"),
                         layers.Flatten(), layers.Dense(10)])


def speed(mode, repeats, steps):
    import keras
    import tensorflow as tf

    from tf_gradkit import pruning
    rows = []
    for name in ("mlp", "cnn"):
        rng = np.random.RandomState(0)
        shape = (784,) if name == "mlp" else (28, 28, 1)
        x = tf.constant(rng.rand(BATCH, *shape).astype("float32"))
        y = tf.constant(rng.randint(0, 10, BATCH))
        steps_fns = {}
        for contender in ("plain", "pruned"):
            model = _speed_model(keras, name)
            opt = keras.optimizers.Adam(1e-3)
            if contender == "pruned":
                opt = pruning.MagnitudePruning(opt, model=model, schedule=pruning.PolynomialDecay(
                    0.0, SPARSITY, begin_step=0, end_step=5 * steps, frequency=50))
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

            def step(xb, yb, model=model, opt=opt):
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, model(xb, training=True))
                opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                        model.trainable_variables))
                return loss

            fn = tf.function(step, jit_compile=(mode == "jit"))
            opt.build(model.trainable_variables)
            for _ in range(3):
                fn(x, y)
            steps_fns[contender] = (fn, model, opt)
        times = {"plain": [], "pruned": []}
        for r in range(repeats):
            order = ("plain", "pruned") if r % 2 == 0 else ("pruned", "plain")
            for contender in order:
                fn = steps_fns[contender][0]
                start = time.perf_counter()
                for _ in range(steps):
                    loss = fn(x, y)
                float(loss)
                times[contender].append((time.perf_counter() - start) / steps)
        ratios = [p / q for p, q in zip(times["pruned"], times["plain"])]
        opt = steps_fns["pruned"][2]
        rows.append({"model": name, "mode": mode,
                     "plain_ms": 1e3 * statistics.median(times["plain"]),
                     "pruned_ms": 1e3 * statistics.median(times["pruned"]),
                     "ratio": statistics.median(ratios), "min": min(ratios),
                     "max": max(ratios),
                     "sparsity": max(opt.sparsity().values())})
    return rows


# -------------------------------------------------------------- accuracy
def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    return train_test_split(x, data.target.astype("int32"), test_size=360, random_state=0)


def _digits_model(K, seed):
    K.utils.set_random_seed(seed)
    return K.Sequential([K.Input((64,)), K.layers.Dense(256, activation="relu"),
                         K.layers.Dense(128, activation="relu"), K.layers.Dense(10)])


def _schedule(module, steps):
    return module.PolynomialDecay(0.0, SPARSITY, begin_step=0, end_step=int(0.6 * steps),
                                  frequency=10)


def accuracy(seeds, epochs, tfmot):
    """Test accuracies (dense, pruned) and the pruned kernels' sparsity."""
    import tensorflow as tf
    K = tf.keras
    x_train, x_test, y_train, y_test = _digits()
    steps = epochs * ((len(x_train) + 31) // 32)
    results = []
    for seed in seeds:
        row = {}
        for contender in ("dense", "pruned"):
            model = _digits_model(K, seed)
            callbacks, opt = [], K.optimizers.Adam(1e-3)
            if contender == "pruned" and tfmot:
                import tensorflow_model_optimization as tfmot_module
                sk = tfmot_module.sparsity.keras
                model = sk.prune_low_magnitude(model, pruning_schedule=_schedule(sk, steps))
                callbacks = [sk.UpdatePruningStep()]
            elif contender == "pruned":
                from tf_gradkit import pruning
                opt = pruning.MagnitudePruning(opt, model=model,
                                               schedule=_schedule(pruning, steps))
            model.compile(optimizer=opt, metrics=["accuracy"],
                          loss=K.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x_train, y_train, batch_size=32, epochs=epochs, verbose=0,
                      callbacks=callbacks)
            if contender == "pruned" and tfmot:
                model = sk.strip_pruning(model)
                model.compile(metrics=["accuracy"], loss=K.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
            row[contender] = float(model.evaluate(x_test, y_test, verbose=0)[1])
            if contender == "pruned":
                kernels = [w for w in model.weights if "kernel" in w.name]
                row["sparsity"] = float(np.mean([np.mean(k.numpy() == 0) for k in kernels]))
        results.append(row)
    return results


def _summary(values):
    return f"{100 * statistics.mean(values):.1f}% [{100 * min(values):.1f}-{100 * max(values):.1f}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--tfmot-worker", action="store_true")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    seeds = list(range(1 if args.quick else args.seeds))
    epochs = 3 if args.quick else 40
    if args.tfmot_worker:
        print("@@" + json.dumps(accuracy(seeds, epochs, tfmot=True)), flush=True)
        return
    repeats, steps = (2, 10) if args.quick else (9, 30)
    rows = []
    for mode in (("graph", "jit") if args.graph else ("jit",)):
        rows += speed(mode, repeats, steps)
    print(f"Keras 3 speed: {repeats} interleaved repeats of {steps} steps, batch {BATCH}")
    print("| model | mode | Adam ms/step | MagnitudePruning(Adam) ms/step | ratio [min-max] |"
          " mask sparsity |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['plain_ms']:.2f} | {r['pruned_ms']:.2f} | "
              f"{r['ratio']:.2f}x [{r['min']:.2f}-{r['max']:.2f}] | {r['sparsity']:.2f} |")
    ours = accuracy(seeds, epochs, tfmot=False)
    worker = subprocess.run([sys.executable, __file__, "--tfmot-worker", "--seeds",
                             str(len(seeds))] + (["--quick"] if args.quick else []),
                            capture_output=True, text=True, timeout=1800)
    line = [x for x in worker.stdout.splitlines() if x.startswith("@@")]
    theirs = json.loads(line[-1][2:]) if line else None
    print(f"\nDigits, MLP 64-256-128-10, {epochs} epochs, {len(seeds)} seed(s): test accuracy, "
          "mean [min-max]")
    print("| flavour | dense | pruned to 80% | kernels' sparsity |")
    print("|---|---:|---:|---:|")
    print(f"| Keras 3, MagnitudePruning | {_summary([r['dense'] for r in ours])} | "
          f"{_summary([r['pruned'] for r in ours])} | "
          f"{statistics.mean(r['sparsity'] for r in ours):.3f} |")
    if theirs:
        print(f"| tf_keras, tfmot prune_low_magnitude | "
              f"{_summary([r['dense'] for r in theirs])} | "
              f"{_summary([r['pruned'] for r in theirs])} | "
              f"{statistics.mean(r['sparsity'] for r in theirs):.3f} |")
    else:
        print("| tf_keras, tfmot | (worker failed) | | |\n" + worker.stderr[-2000:])


if __name__ == "__main__":
    main()
