"""Gradient accumulation with a loss that averages over tokens, not examples.

The 2024 gradient-accumulation bug: a sequence model whose loss is the mean
over unmasked tokens (a Keras mask from ``Embedding(mask_zero=True)``), 64
sequences of 1-2 tokens (first half) and 10-12 tokens (second half), trained
in 4 micro-batches of 16. Each micro-batch's loss is the mean over its own
tokens, so averaging the four means (Keras's ``gradient_accumulation_steps``)
or weighting them by examples is not the mean over the window's tokens.
GradientAccumulator reads what the compiled loss divides by and weighs each
micro-batch by it: the window equals the batch of 64.

Prints, for one update with SGD(0.5): the big batch's largest weight change,
and each accumulation's largest distance from the big batch. Runs under
either flavour (TF_USE_LEGACY_KERAS=1 for tf_keras; Keras's own
accumulation exists in Keras 3 only).
"""

import numpy as np
import tensorflow as tf

import tf_gradkit
from tf_gradkit import _flavour

K = tf.keras
N, T, V = 64, 12, 20


def sequences(seed=0):
    rng = np.random.RandomState(seed)
    lengths = np.concatenate([rng.randint(1, 3, N // 2), rng.randint(10, 13, N // 2)])
    x = np.zeros((N, T), "int32")
    y = np.zeros((N, T), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.randint(1, V, length)
        y[i, :length] = rng.randint(0, V, length)
    return x, y


def model():
    m = K.Sequential([K.Input((T,), dtype="int32"), K.layers.Embedding(V, 8, mask_zero=True),
                      K.layers.Dense(V)])
    rng = np.random.RandomState(1)
    m.set_weights([rng.randn(*w.shape).astype("float32") * 0.3 for w in m.get_weights()])
    return m


def train(optimizer_for, batch_size):
    m = model()
    m.compile(optimizer=optimizer_for(m),
              loss=K.losses.SparseCategoricalCrossentropy(from_logits=True))
    m.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return m.get_weights()


def distance(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


x, y = sequences()
start = model().get_weights()
big = train(lambda m: K.optimizers.SGD(0.5), batch_size=N)
update = distance(start, big)
GA = tf_gradkit.optimizers.GradientAccumulator
runs = {
    "GradientAccumulator (reads the loss's token count)":
        lambda m: GA(K.optimizers.SGD(0.5), steps=4, model=m),
    "GradientAccumulator weighted by examples (sample_count=batch size)":
        lambda m: GA(K.optimizers.SGD(0.5), steps=4, model=m,
                     sample_count=lambda xb, yb, sw: tf.shape(xb)[0]),
    "GradientAccumulator(reduction='microbatch')":
        lambda m: GA(K.optimizers.SGD(0.5), steps=4, model=m, reduction="microbatch"),
}
if _flavour.active_flavour() == "keras3":
    runs["Keras 3 gradient_accumulation_steps=4"] = \
        lambda m: K.optimizers.SGD(0.5, gradient_accumulation_steps=4)
print(f"flavour: {_flavour.active_flavour()}; big batch of 64: largest weight change "
      f"{update:.4f}")
for name, make in runs.items():
    error = distance(big, train(make, batch_size=16))
    print(f"{name:70s} max |w - w_big| = {error:.2e} ({100 * error / update:.3g}% of the "
          "update)")
ours = distance(big, train(runs["GradientAccumulator (reads the loss's token count)"], 16))
assert ours < 1e-5, ours  # float32 round-off; the others are off by ~100%
