"""What the backward pass costs against the forward, by `gradients.backward_cost`.

Two small models (an MLP 64-256-256-10 and a CNN conv(16)-conv(32)-dense(10)
on 28x28x1 inputs), batches 32 to 512, compiled with XLA. For each it prints
the forward and backward FLOPs (TensorFlow's graph cost analysis) and
median times, and the backward/forward ratios, and plots the time ratio
against the FLOPs ratio to docs/backward_cost.png (with matplotlib).

Run: ``.venv/bin/python benchmarks/backward_cost.py`` (about a minute).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

from tf_gradkit.gradients.cost import backward_cost
import plotting

K = tf.keras


def models():
    mlp = K.Sequential([K.Input((64,)), K.layers.Dense(256, activation="relu"),
                        K.layers.Dense(256, activation="relu"), K.layers.Dense(10)])
    cnn = K.Sequential([K.Input((28, 28, 1)), K.layers.Conv2D(16, 3, activation="relu"),
                        K.layers.Conv2D(32, 3, strides=2, activation="relu"),
                        K.layers.Flatten(), K.layers.Dense(10)])
    return {"mlp": mlp, "cnn": cnn}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="32,128,512")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows = []
    print(f"TensorFlow {tf.__version__}, Keras {K.__version__ if hasattr(K, '__version__') else ''}"
          f", {os.cpu_count()} CPUs, XLA")
    print("| model | batch | forward MFLOP | backward MFLOP | FLOPs ratio | forward ms "
          "| backward ms | time ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, model in models().items():
        for batch in (int(b) for b in args.batches.split(",")):
            x = tf.random.normal([batch, *model.input_shape[1:]])
            y = tf.zeros([batch], tf.int32)
            cost = backward_cost(lambda x, y: loss(y, model(x, training=True)),
                                 model.trainable_variables, x, y, jit_compile=True,
                                 repeats=args.repeats)
            rows.append((name, batch, cost))
            print(f"| {name} | {batch} | {cost.forward_flops / 1e6:.1f} | "
                  f"{cost.backward_flops / 1e6:.1f} | {cost.flops_ratio:.2f} | "
                  f"{cost.forward_ms:.3f} | {cost.backward_ms:.3f} | "
                  f"{cost.time_ratio:.2f} |", flush=True)
    if not args.no_plot:
        plt = plotting.pyplot()
        if plt is None:
            return
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, marker in (("mlp", "o"), ("cnn", "s")):
            pts = [(b, c.flops_ratio, c.time_ratio) for n, b, c in rows if n == name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker + "--",
                    label=f"{name}: FLOPs ratio")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker + "-",
                    label=f"{name}: time ratio")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("backward / forward")
        ax.set_title("Backward pass cost (XLA, 2-core CPU)")
        ax.legend(fontsize=8)
        plotting.save(fig, "backward_cost.png")


if __name__ == "__main__":
    main()
