"""Forward against reverse mode for `tf_gradkit.gradients.jacobian`, by shape.

A function from P = 512 inputs to N outputs (a tanh layer, N from 8 to 4096),
its Jacobian [N, P] in forward mode (P JVPs), reverse mode (N VJPs) and
"auto" (forward when N >= P, the choice LM's linearisation makes), each
compiled with XLA; median of 20 calls. Prints the table and plots the times
against N to docs/jacobian_modes.png (with matplotlib).

Run: ``.venv/bin/python benchmarks/jacobian_modes.py`` (about a minute).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

from tf_gradkit.gradients import jacobian
import plotting
from timing import median_ms

P = 512


def main():
    x = tf.Variable(tf.random.normal([P]))
    rows = []
    print(f"Jacobian of tanh(W x), x with P = {P} elements, XLA, median of 20 calls")
    print("| N outputs | forward ms | reverse ms | auto ms | auto picks |")
    print("|---:|---:|---:|---:|---|")
    for n in (8, 64, 512, 4096):
        w = tf.random.normal([n, P]) / P ** 0.5
        fn = lambda: tf.tanh(tf.linalg.matvec(w, x))  # noqa: E731
        times = {mode: median_ms(tf.function(lambda mode=mode: jacobian(fn, x, mode=mode),
                                             jit_compile=True))
                 for mode in ("forward", "reverse", "auto")}
        picked = "forward" if n >= P else "reverse"
        rows.append((n, times))
        print(f"| {n} | {times['forward']:.3f} | {times['reverse']:.3f} | "
              f"{times['auto']:.3f} | {picked} |", flush=True)
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ns = [n for n, _ in rows]
    for mode, style in (("forward", "o--"), ("reverse", "s--"), ("auto", "k-")):
        ax.plot(ns, [t[mode] for _, t in rows], style, label=mode)
    ax.axvline(P, color="grey", lw=0.8)
    ax.text(P * 1.05, ax.get_ylim()[1] * 0.9, "N = P", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"outputs N (inputs P = {P})")
    ax.set_ylabel("ms per Jacobian")
    ax.set_title("jacobian(): forward vs reverse mode (XLA, 2-core CPU)")
    ax.legend()
    plotting.save(fig, "jacobian_modes.png")


if __name__ == "__main__":
    main()
