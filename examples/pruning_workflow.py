"""Pruning that stays pruned: tfmot + tf_gradkit.pruning.MaskAware.

Run: .venv/bin/python examples/pruning_workflow.py   (about 20 seconds)

An MLP is pruned to 80% sparsity with tfmot (a PolynomialDecay schedule that
updates the masks every 100 steps) and trained for 1037 steps, i.e. stopped in
the middle of an epoch, the way a time budget, a preemption or a mid-epoch
checkpoint stops training. Then `strip_pruning` exports the plain model.

- plain Adam with tfmot's own recipe: tfmot re-applies the masks before each
  forward pass, so the last optimizer step leaves pruned weights non-zero, and
  Adam's moments are non-zero on every pruned entry;
- MaskAware(Adam) with PruningStepper: every update goes through the masks;
  pruned weights and their Adam moments are exactly zero after every step.

tfmot prunes tf_keras models only, so this script uses tf_keras explicitly and
sets TF_USE_LEGACY_KERAS=1 before TensorFlow is imported (tfmot's import would
set it anyway).
"""

import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot
import tf_keras

from tf_gradkit import pruning

STEPS = 1037  # 10 epochs of 100 batches and 37 batches into the 11th
BATCH = 40


def make_data(seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(4000, 32).astype("float32")
    teacher = rng.randn(32, 10)
    y = np.argmax(np.tanh(x @ teacher) + 0.3 * rng.randn(4000, 10), axis=1)
    return x, y.astype("int32")


def make_model():
    tf_keras.utils.set_random_seed(1)
    model = tf_keras.Sequential([
        tf_keras.Input((32,)),
        tf_keras.layers.Dense(256, activation="relu"),
        tf_keras.layers.Dense(256, activation="relu"),
        tf_keras.layers.Dense(10),
    ])
    schedule = tfmot.sparsity.keras.PolynomialDecay(
        initial_sparsity=0.0, final_sparsity=0.8, begin_step=0, end_step=600,
        frequency=100)
    return tfmot.sparsity.keras.prune_low_magnitude(model, pruning_schedule=schedule)


def train(mask_aware):
    x, y = make_data()
    model = make_model()
    adam = tf_keras.optimizers.Adam(1e-3)
    if mask_aware:
        optimizer = pruning.MaskAware(adam, model=model)
        stepper = pruning.PruningStepper(model, optimizer)
    else:  # tfmot's custom-loop recipe
        optimizer, stepper = adam, None
        callback = tfmot.sparsity.keras.UpdatePruningStep()
        callback.set_model(model)
        callback.on_train_begin()
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def train_step(xb, yb):
        if stepper is not None:
            stepper.before_step()
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    batches = len(x) // BATCH
    for step in range(STEPS):
        i = step % batches
        train_step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])

    # What should be zero: entries whose mask is 0, in weights and Adam state.
    masks = [(w, m.numpy()) for layer in model.layers
             for w, m, _ in getattr(layer, "pruning_vars", [])]
    state = sum(int(np.count_nonzero(s.numpy()[m == 0]))
                for w, m in masks for s in optimizer.variables
                if s.name.endswith("/" + w.name) and s.shape == w.shape)
    stripped = pruning.strip_pruning(model)
    kernels = [layer.kernel.numpy() for layer in stripped.layers]
    leaked = sum(int(np.count_nonzero(k[m == 0])) for k, (_, m) in zip(kernels, masks))
    pruned = sum(int((m == 0).sum()) for _, m in masks)
    accuracy = float(np.mean(np.argmax(stripped.predict(x, verbose=0), 1) == y))
    return leaked, state, pruned, accuracy, int(optimizer.iterations.numpy())


def main():
    results = {}
    for name, mask_aware in (("plain Adam", False), ("MaskAware(Adam)", True)):
        leaked, state, pruned, accuracy, updates = train(mask_aware)
        results[name] = leaked
        print(f"{name:16s} after {updates} steps: {leaked:6d} of {pruned} pruned "
              f"weights non-zero after strip_pruning, {state:6d} non-zero Adam "
              f"moment entries on pruned weights; train accuracy {accuracy:.3f}")
    assert results["plain Adam"] > 0, "expected plain Adam to leak"
    assert results["MaskAware(Adam)"] == 0, "MaskAware left pruned weights non-zero"
    print("MaskAware: the stripped model is exactly as sparse as its masks.")


if __name__ == "__main__":
    main()
