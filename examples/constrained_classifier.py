"""A Keras classifier with a norm budget on its kernel, trained with fit.

Run: .venv/bin/python examples/constrained_classifier.py   (about 15 s on 2 CPU cores)

The kernel W of a softmax regression gets the budget |W|_F^2 <= 0.5 as an inequality
constraint handled by `AugmentedLagrangian` (one multiplier, a penalty that
grows by itself). Unconstrained, the same model ends with |W|_F^2 well above
the budget; constrained, the budget is active at the end: the multiplier is
positive and |W|_F^2 sits on the boundary. `model=` installs the train-step
hook, so `lagrange_violation` and `penalty` appear in the fit logs.
"""

import os

import numpy as np
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.augmented_lagrangian import Inequality

K = tf.keras  # Keras 3 by default; tf_keras with TF_USE_LEGACY_KERAS=1
AugmentedLagrangian = tf_gradkit.optimizers.AugmentedLagrangian

BUDGET = 0.5  # on |W|_F^2


def make_data(n=2000, d=10, classes=3, seed=0):
    centres = 0.7 * np.random.RandomState(0).randn(classes, d)  # shared
    rng = np.random.RandomState(seed)
    y = rng.randint(classes, size=n)
    x = (centres[y] + rng.randn(n, d)).astype("float32")
    return x, y.astype("int32")


def make_model(seed=1):
    model = K.Sequential([K.Input((10,)), K.layers.Dense(3)])  # softmax regression
    rng = np.random.RandomState(seed)
    model.set_weights([rng.randn(*w.shape).astype("float32") * 0.5
                       for w in model.get_weights()])
    return model


def train(constrained, x, y, epochs=30, batch_size=100):
    model = make_model()
    steps = epochs * (len(x) // batch_size)
    inner = K.optimizers.Adam(K.optimizers.schedules.CosineDecay(0.01, steps, alpha=0.01))
    if constrained:
        kernel = model.layers[0].kernel
        optimizer = AugmentedLagrangian(
            inner,
            [Inequality(lambda: tf.reduce_sum(tf.square(kernel)) - BUDGET,
                        name="kernel_norm")],
            model=model)
    else:
        optimizer = inner
    model.compile(optimizer=optimizer,
                  loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0)
    return model, optimizer, history


def main():
    x, y = make_data()
    x_test, y_test = make_data(seed=1)
    free, _, _ = train(False, x, y)
    model, optimizer, history = train(True, x, y)
    logs = history.history
    for epoch in (0, 9, 19, 29):
        print(f"epoch {epoch + 1:2d}  loss {logs['loss'][epoch]:.4f}  accuracy "
              f"{logs['accuracy'][epoch]:.3f}  lagrange_violation "
              f"{logs['lagrange_violation'][epoch]:.2e}  penalty {logs['penalty'][epoch]:g}")
    sq_norm = lambda m: float(np.sum(np.square(m.layers[0].kernel.numpy())))  # noqa: E731
    accuracy = lambda m: float(np.mean(np.argmax(m.predict(x_test, verbose=0), -1) == y_test))  # noqa: E731
    violation = sq_norm(model) - BUDGET
    metrics = optimizer.metrics()
    print(f"flavour: {'tf_keras' if os.environ.get('TF_USE_LEGACY_KERAS') in ('1', 'true', 'True') else 'Keras 3'}")
    print(f"unconstrained: |W|_F^2 = {sq_norm(free):.3f}, test accuracy {accuracy(free):.3f}")
    print(f"constrained:   |W|_F^2 = {sq_norm(model):.5f} (budget {BUDGET}), "
          f"test accuracy {accuracy(model):.3f}, multiplier "
          f"{float(metrics['multipliers/kernel_norm']):.4f}, penalty {float(metrics['penalty']):g}")
    print(f"final constraint violation max(|W|_F^2 - {BUDGET}, 0): {max(violation, 0.0):.2e}")
    assert sq_norm(free) > BUDGET  # the budget matters
    assert violation <= 1e-4, violation
    # What docs/constraints.md quotes (0.897 constrained, 0.908 unconstrained, |W|_F^2 about 11;
    # these vary from run to run by about 0.005 and 0.3): within 0.02 and 1.5 of it.
    assert abs(accuracy(model) - 0.897) <= 0.02 and abs(accuracy(free) - 0.908) <= 0.02, (
        accuracy(model), accuracy(free))
    assert 9.5 <= sq_norm(free) <= 12.5, sq_norm(free)


if __name__ == "__main__":
    main()
