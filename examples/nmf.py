"""Non-negative matrix factorisation with soft constraints: AugmentedLagrangian.

Run: .venv/bin/python examples/nmf.py   (about 10 s on 2 CPU cores)

Factor V (40 x 30, an exact rank-4 product of non-negative factors plus a
little noise) as V ~ W H with W, H >= 0. Non-negativity is not projected: it is
two elementwise inequality constraints, -W <= 0 and -H <= 0, with one
multiplier per entry of W and of H. Adam takes the primal steps on the
augmented Lagrangian; every `dual_every` steps the multipliers take a dual
step and the penalty grows if the violation stalled. At the end the entries
pinned at zero carry positive multipliers (the KKT conditions of NMF), and the
largest violation max(-W, -H, 0) is printed and checked.

(`tf_gradkit.constraints.NonNeg` as a kernel constraint would project instead;
the augmented Lagrangian is the tool when no cheap projection exists. This
example shows it on a problem whose answer is easy to check.)
"""

import os

import numpy as np
import tensorflow as tf

import tf_gradkit
from tf_gradkit.core.augmented_lagrangian import Inequality

K = tf.keras  # Keras 3 by default; tf_keras with TF_USE_LEGACY_KERAS=1
AugmentedLagrangian = tf_gradkit.optimizers.AugmentedLagrangian


def main():
    rng = np.random.RandomState(0)
    m, n, rank = 40, 30, 4
    w_true = np.maximum(rng.randn(m, rank), 0.0)
    h_true = np.maximum(rng.randn(rank, n), 0.0)
    v = (w_true @ h_true + 0.01 * rng.rand(m, n)).astype("float32")

    # A feasible start; unconstrained Adam steps would leave it at once.
    w = tf.Variable(0.5 * rng.rand(m, rank).astype("float32"), name="W")
    h = tf.Variable(0.5 * rng.rand(rank, n).astype("float32"), name="H")
    steps = 3000
    schedule = K.optimizers.schedules.CosineDecay(0.05, steps, alpha=0.01)
    optimizer = AugmentedLagrangian(
        K.optimizers.Adam(schedule),
        [Inequality(lambda: -w, name="W_nonneg"),
         Inequality(lambda: -h, name="H_nonneg")])

    @tf.function(jit_compile=True)
    def train_step():
        with tf.GradientTape() as tape:
            loss = 0.5 * tf.reduce_mean(tf.square(v - w @ h))
        grads = tape.gradient(loss, [w, h])
        optimizer.apply_gradients(zip(grads, [w, h]))  # adds the constraints' terms
        return loss

    for step in range(1, steps + 1):
        loss = train_step()
        if step % 500 == 0:
            metrics = optimizer.metrics()
            print(f"step {step:5d}  loss {float(loss):.3e}  violation "
                  f"{float(metrics['lagrange_violation']):.2e}  penalty "
                  f"{float(metrics['penalty']):g}")

    relative_error = float(np.linalg.norm(v - w.numpy() @ h.numpy())
                           / np.linalg.norm(v))
    violation = float(max(np.max(-w.numpy()), np.max(-h.numpy()), 0.0))
    lam_w = optimizer.multipliers[0].numpy()
    print(f"flavour: {'tf_keras' if os.environ.get('TF_USE_LEGACY_KERAS') in ('1', 'true', 'True') else 'Keras 3'}")
    print(f"relative reconstruction error |V - WH| / |V|: {relative_error:.4f}")
    print(f"entries of W at zero: {int(np.sum(w.numpy() < 1e-3))} of {w.numpy().size}, "
          f"their mean multiplier {float(lam_w[w.numpy() < 1e-3].mean()):.3e}")
    print(f"max constraint violation max(-W, -H, 0): {violation:.2e}")
    assert violation <= 1e-4, violation
    assert relative_error < 0.01, relative_error   # docs/constraints.md quotes 0.0048


if __name__ == "__main__":
    main()
