"""Pruning: the cost of MaskAware per train step, and what it buys.

Compares, in one process, a tfmot-pruned model trained by

  (a) plain     ``tf_keras.optimizers.Adam(1e-3)`` (the baseline), and
  (b) masked    ``tf_gradkit.pruning.MaskAware(Adam(1e-3), model=model)``,

for two models (an MLP 784-300-100-10 and a small CNN on 28x28x1 inputs,
batch 64) under ``tf.function`` ("graph") and ``tf.function(jit_compile=True)``
("jit").

Why it is built this way:

- Speed is only reported as a ratio to (a) measured in the same run: the two
  contenders' repeats are interleaved (alternating which goes first), so drift and background load hit both.
  One repeat = 30 calls of a custom ``GradientTape`` train step, timed
  with ``perf_counter`` around them, the last loss read back to synchronise.
  The ratio is the median of the per-repeat (paired) ratios, [min-max].
- Both contenders step pruning the same way (tfmot's recipe: the wrapper's
  training-mode forward pass advances ``pruning_step`` and updates masks), so
  the ratio is MaskAware's own cost: masking gradients, weights and slots.
- At the end, the entries that should be pruned (mask 0) and are not, in the
  weights and in Adam's moments, are counted for both after the same number of
  steps (not a multiple of any epoch: no epoch-end re-masking happens).

Run: ``.venv/bin/python benchmarks/pruning.py`` (1-2 minutes on 2 cores);
``--quick`` for a smoke run. tfmot prunes tf_keras models only: the script
sets ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported.
"""

import argparse
import os
import platform
import statistics
import sys
import time

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot
import tf_keras

from tf_gradkit import pruning

BATCH = 64
MODELS = ("mlp", "cnn")
MODES = ("graph", "jit")
CONTENDERS = ("plain", "masked")


def build(model_name):
    tf_keras.utils.set_random_seed(0)
    layers = tf_keras.layers
    if model_name == "mlp":
        model = tf_keras.Sequential([
            tf_keras.Input((784,)), layers.Dense(300, activation="relu"),
            layers.Dense(100, activation="relu"), layers.Dense(10)])
    else:
        model = tf_keras.Sequential([
            tf_keras.Input((28, 28, 1)),
            layers.Conv2D(16, 3, activation="relu"),
            layers.Conv2D(32, 3, activation="relu"),
            layers.MaxPooling2D(2), layers.Flatten(), layers.Dense(10)])
    schedule = tfmot.sparsity.keras.PolynomialDecay(
        0.0, 0.8, begin_step=0, end_step=150, frequency=50)
    return tfmot.sparsity.keras.prune_low_magnitude(model, pruning_schedule=schedule)


def data(model_name, seed=0):
    rng = np.random.RandomState(seed)
    shape = (BATCH, 784) if model_name == "mlp" else (BATCH, 28, 28, 1)
    x = tf.constant(rng.rand(*shape).astype("float32"))
    y = tf.constant(rng.randint(0, 10, BATCH).astype("int32"))
    return x, y


def make_step(model, optimizer, mode):
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    callback = tfmot.sparsity.keras.UpdatePruningStep()  # tfmot's recipe
    callback.set_model(model)
    callback.on_train_begin()

    @tf.function(jit_compile=(mode == "jit"))
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def nonzero_pruned(model, optimizer):
    weights = slots = 0
    for layer in model.layers:
        for w, m, _ in getattr(layer, "pruning_vars", []):
            off = m.numpy() == 0
            weights += int(np.count_nonzero(w.numpy()[off]))
            slots += sum(int(np.count_nonzero(s.numpy()[off]))
                         for s in optimizer.variables
                         if s.name.endswith("/" + w.name) and s.shape == w.shape)
    return weights, slots


def run(model_name, mode, steps, repeats):
    x, y = data(model_name)
    runs = {}
    for name in CONTENDERS:
        model = build(model_name)
        adam = tf_keras.optimizers.Adam(1e-3)
        optimizer = adam if name == "plain" else pruning.MaskAware(adam, model=model)
        step = make_step(model, optimizer, mode)
        for _ in range(3):  # trace / compile, then settle
            step(x, y).numpy()
        runs[name] = (model, optimizer, step, [])
    for repeat in range(repeats):  # interleaved, alternating who goes first
        for name in CONTENDERS[::1 if repeat % 2 == 0 else -1]:
            _, _, step, times = runs[name]
            start = time.perf_counter()
            for _ in range(steps):
                loss = step(x, y)
            loss.numpy()
            times.append((time.perf_counter() - start) / steps)
    plain_times = runs["plain"][3]
    ratios = [m / p for m, p in zip(runs["masked"][3], plain_times)]
    row = {
        "plain_ms": 1e3 * statistics.median(plain_times),
        "masked_ms": 1e3 * statistics.median(runs["masked"][3]),
        "ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "steps": int(runs["plain"][1].iterations.numpy()),
    }
    for name in CONTENDERS:
        model, optimizer, _, _ = runs[name]
        row[f"{name}_nonzero"] = nonzero_pruned(model, optimizer)
        row["pruned"] = sum(int((m.numpy() == 0).sum()) for layer in model.layers
                            for _, m, _ in getattr(layer, "pruning_vars", []))
    return row


def lm_dense_vs_pruned(repeats=5, steps=5):
    """Levenberg-Marquardt step time, dense vs 80% pruned (the same network).

    The pruned run is ``MaskAware(LevenbergMarquardt())`` on a tfmot model whose
    masks are already at 80% when the step is traced, so LM solves for the 20%
    unpruned weights only (a 5x smaller Jacobian and damped system). Both runs
    are ``tf.function(jit_compile=True)`` ``minimize`` steps on 1000 residuals,
    interleaved.
    """
    from tf_gradkit import pruning
    from tf_gradkit.tf_keras import LevenbergMarquardt

    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(1000, 8).astype("float32"))
    y = tf.constant(np.tanh(x.numpy() @ rng.randn(8, 1)).astype("float32"))

    def base():
        model = tf_keras.Sequential([tf_keras.Input((8,)),
                                     tf_keras.layers.Dense(48, activation="tanh"),
                                     tf_keras.layers.Dense(48, activation="tanh"),
                                     tf_keras.layers.Dense(1)])
        model.set_weights([rng.randn(*w.shape).astype("float32") * 0.3
                           for w in model.get_weights()])
        return model

    dense = base()
    dense_lm = LevenbergMarquardt()
    dense_step = tf.function(lambda: dense_lm.minimize(
        lambda: dense(x, training=True) - y, dense.trainable_variables), jit_compile=True)

    pruned = tfmot.sparsity.keras.prune_low_magnitude(
        base(), pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(0.8, 0, frequency=1))
    lm = LevenbergMarquardt()
    opt = pruning.MaskAware(lm, model=pruned)
    pruning.PruningStepper(pruned, opt).before_step()
    pruned(x[:1], training=True)  # tfmot computes its 80% masks
    pruned_step = tf.function(lambda: opt.minimize(
        lambda: pruned(x, training=True) - y, pruned.trainable_variables), jit_compile=True)

    dense_step(), pruned_step()  # compile
    times = {"dense": [], "pruned": []}
    for _ in range(repeats):
        for name, fn in (("dense", dense_step), ("pruned", pruned_step)):
            t0 = time.perf_counter()
            for _ in range(steps):
                cost = fn()
            float(cost)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    d, p = float(np.median(times["dense"])), float(np.median(times["pruned"]))
    n_dense = sum(int(np.prod(v.shape)) for v in dense.trainable_variables)
    return [
        "| LM step (jit, 1000 residuals, 8-48-48-1) | parameters solved for | ms/step |",
        "|---|---|---|",
        f"| dense | {n_dense} | {d:.1f} |",
        f"| 80% pruned, MaskAware(LevenbergMarquardt) | {lm._step_support.size} | {p:.1f} |",
        f"| speed-up dense / pruned | | {d / p:.2f}x |",
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    steps, repeats = (10, 2) if args.quick else (30, 8)
    load_start = os.getloadavg()
    began = time.perf_counter()
    lines = [
        "| model | mode | plain Adam ms/step | MaskAware(Adam) ms/step | ratio [min-max] "
        "| non-zero pruned weights / Adam moments: plain | MaskAware | pruned entries |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model_name in MODELS:
        for mode in MODES:
            r = run(model_name, mode, steps, repeats)
            lo, hi = r["ratio_range"]
            pw, ps = r["plain_nonzero"]
            mw, ms = r["masked_nonzero"]
            lines.append(
                f"| {model_name} | {mode} | {r['plain_ms']:.2f} | {r['masked_ms']:.2f} "
                f"| {r['ratio']:.2f}x [{lo:.2f}-{hi:.2f}] | {pw} / {ps} | {mw} / {ms} "
                f"| {r['pruned']} (after {r['steps']} steps) |")
            print(lines[-1], flush=True)
    # ---- RESERVED for LevenbergMarquardt dense vs pruned (added later) ----
    lm_lines = lm_dense_vs_pruned()
    print()
    print(f"# Pruning: MaskAware(Adam) vs plain Adam per train step (batch {BATCH}, "
          f"{repeats} interleaved repeats of {steps} steps)")
    print()
    print(f"TensorFlow {tf.__version__}, tf_keras {tf_keras.__version__}, tfmot "
          f"{tfmot.__version__ if hasattr(tfmot, '__version__') else '?'}, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs. Load average (1 min) "
          f"{load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end. "
          f"Total {time.perf_counter() - began:.0f} s.")
    print()
    print("\n".join(lines))
    if lm_lines:
        print()
        print("\n".join(lm_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
