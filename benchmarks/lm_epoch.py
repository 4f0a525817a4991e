"""One ``fit`` epoch of Levenberg-Marquardt against one of Adam, same batches.

The peer's sinc problem (20000 points, ``y = sinc(10 x)``, a 1-20(tanh)-1
MLP, 61 parameters, batches of 1000, shuffled): 20 steps per epoch. Both
compiled with ``jit_compile=True``, in this process's Keras flavour. The
contenders' epochs are interleaved (each one's epoch e, then each one's
epoch e + 1: a change in the machine's load falls on all alike). For each
contender it reports the median epoch time over epochs 2.. (the first
includes compilation) and the final MSE, and the ratio of each LM variant's
epoch to Adam's:

  - ``lm``: ``LevenbergMarquardt(model)`` (the mini-batch guard on, default);
  - ``lm-noguard``: ``minibatch_guard=False``;
  - ``lm-autodiff``: ``linearization="autodiff"`` (the Jacobian by forward
    mode, one product per parameter, instead of from layer taps);
  - ``adam``: ``Adam(0.01)``.

``--parts`` also times the pieces of one step (XLA): Adam's forward and
backward pass, the Jacobian from taps and by forward mode, ``J^T J`` and
``J^T r``, one damped Cholesky solve and one trial (a forward pass and its
cost), each run 200 times inside one compiled loop (its cost inside a step)
and as a compiled call of its own (median of 300 calls: that plus one
dispatch, about 0.2 ms on this CPU, which the pieces of a step share).

``--steps-per-execution N`` runs N steps per call for every contender (less
of Keras's per-step work, which is most of a step here).

Run: ``.venv/bin/python benchmarks/lm_epoch.py`` (about a minute);
``TF_USE_LEGACY_KERAS=1`` for tf_keras.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tf_gradkit
import timing

K = tf.keras


EpochTimer = timing.epoch_timer_class(K.callbacks.Callback)


def contender(name, steps_per_execution):
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((1,)), K.layers.Dense(20, activation="tanh"),
                          K.layers.Dense(1)])
    if name == "adam":
        optimizer = K.optimizers.Adam(0.01)
    else:
        optimizer = tf_gradkit.optimizers.LevenbergMarquardt(
            model, minibatch_guard=name != "lm-noguard",
            linearization="autodiff" if name == "lm-autodiff" else "auto")
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True,
                  steps_per_execution=steps_per_execution)
    return model


def run(names, epochs, steps_per_execution, x, y):
    """``{name: (median ms per epoch over epochs 2.., final MSE)}``, the
    contenders' epochs interleaved (epoch e of each, then epoch e + 1), so a
    change in the machine's load falls on all of them alike."""
    models = {n: contender(n, steps_per_execution) for n in names}
    times = {n: [] for n in names}
    for epoch in range(epochs):
        for n, model in models.items():
            timer = EpochTimer()
            model.fit(x, y, batch_size=1000, epochs=epoch + 1, initial_epoch=epoch,
                      verbose=0, shuffle=True, callbacks=[timer])
            times[n] += timer.times
    rows = {}
    for n, model in models.items():
        mse = float(np.mean((model.predict(x, verbose=0, batch_size=20000) - y) ** 2))
        rows[n] = float(np.median(times[n][1:])) * 1e3, mse
    return rows


def in_loop_ms(piece, calls=200):
    """Milliseconds per ``piece(e)`` when run ``calls`` times inside one
    compiled loop (XLA), the median of 7 runs: the piece's own cost inside a
    step, without the per-call dispatch (about 0.2 ms here) that timing it
    as a compiled function of its own adds. ``e`` is a loop-carried scalar
    (zero in value) the piece must add to its inputs, so XLA cannot hoist
    it out of the loop."""
    @tf.function(jit_compile=True)
    def loop():
        def body(i, carry):
            total = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32))
                              for t in tf.nest.flatten(piece(carry * 1e-30))])
            return i + 1, carry + 1e-30 * total
        return tf.while_loop(lambda i, _: i < calls, body,
                             (tf.constant(0), tf.constant(0.0)))[1]

    return timing.median_ms(loop, repeats=7) / calls


def parts(x, y):
    """Milliseconds of each piece of one step on the first batch of 1000:
    inside one compiled loop (what the piece costs in a step) and as a
    compiled call of its own (that plus one dispatch)."""
    from tf_gradkit.core import spd
    from tf_gradkit.core.lm import linearize as lin_lib
    from tf_gradkit.gradients import tapped_jacobian
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((1,)), K.layers.Dense(20, activation="tanh"),
                          K.layers.Dense(1)])
    xb, yb = tf.constant(x[:1000]), tf.constant(y[:1000])
    variables = model.trainable_variables
    tf_vars = [getattr(v, "value", v) if not isinstance(v, tf.Variable) else v
               for v in variables]
    steps, _ = tapped_jacobian.plan(model, variables)

    def residuals(e=0.0):
        return model(xb + e, training=True) - yb

    def backward(e):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(residuals(e)))
        return tape.gradient(loss, tf_vars)

    jac = tapped_jacobian.residuals_and_jacobian(steps, variables, residuals,
                                                 tf.float32)[1]
    jtj = tf.matmul(jac, jac, transpose_a=True)
    eye = tf.eye(jtj.shape[0])
    pieces = {
        "adam: forward + backward": backward,
        "J from taps": lambda e: tapped_jacobian.residuals_and_jacobian(
            steps, variables, lambda: residuals(e), tf.float32),
        "J by forward mode": lambda e: lin_lib.residuals_and_jacobian(
            lambda: residuals(e), tf_vars, tf.float32, mode="forward"),
        "J^T J, J^T r": lambda e: lin_lib.normal_equations(jac + e, jac[:, 0]),
        "damped Cholesky solve": lambda e: spd.solve(jtj + (1e-3 + e) * eye,
                                                     jtj[:, :1]),
        "one trial (forward, cost)": lambda e: tf.reduce_sum(tf.square(residuals(e))),
    }
    print(f"  {'piece':28s} {'in a loop':>10s} {'own call':>10s}")
    for name, fn in pieces.items():
        looped = in_loop_ms(fn)
        alone = timing.median_ms(tf.function(lambda fn=fn: fn(tf.constant(0.0)),
                                             jit_compile=True), repeats=300)
        print(f"  {name:28s} {looped:7.3f} ms {alone:7.3f} ms", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=21)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", action="store_true")
    args = parser.parse_args()
    x = np.linspace(-1, 1, 20000, dtype="float32")[:, None]
    y = np.sinc(10 * x).astype("float32")
    names = ("lm", "lm-noguard", "lm-autodiff", "adam")
    flavour = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "Keras 3"
    print(f"{flavour}, sinc 1-20-1, batch 1000, {args.epochs} epochs, "
          f"steps_per_execution={args.steps_per_execution}")
    if args.parts:
        print("part-by-part, one batch of 1000, XLA:")
        parts(x, y)
    for repeat in range(args.repeats):
        rows = run(names, args.epochs, args.steps_per_execution, x, y)
        for n in names:
            ms, mse = rows[n]
            print(f"repeat {repeat}: {n:10s} {ms:7.1f} ms/epoch  final MSE {mse:.2e}  "
                  f"epoch / adam's {ms / rows['adam'][0]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
