"""Gradient accumulation in a custom ``GradientTape`` loop under XLA: time per micro-step.

``accumulation.py`` times whole ``model.fit`` batches, which include Keras's
per-batch Python work and swing by 10-30% between repeats on a shared 2-core
machine. This script times the compiled train step alone, the way a custom
loop runs it: ``tf.function(jit_compile=True)`` over ``GradientTape``, called
``--steps`` times on four fixed batches, then one host sync. Contenders, each
with its own model (same seed) and optimizer:

  plain     Adam applied to every micro-batch (the baseline);
  gradkit   ``GradientAccumulator(Adam, steps=4)``, ``sample_count`` passed;
  keras     Keras 3 ``Adam(gradient_accumulation_steps=4)`` (Keras 3 only);
  open      diagnostic: ``GradientAccumulator`` whose window never closes
            (the cost of a micro-step that only accumulates);
  closing   diagnostic: ``GradientAccumulator(steps=1)``, every micro-step
            closes its window (accumulate, test for NaN/Inf, update).

Speed is reported only as a ratio to ``plain`` in the same process: repeats
are interleaved (the order rotates), and the ratio is the median of the
per-repeat ratios [min-max]. Each flavour runs in a process of its own.

Run: ``.venv/bin/python benchmarks/accumulation_loop.py`` (about two minutes).
"""

import argparse
import json
import os
import platform
import statistics
import time

import accumulation as fit_bench  # the same models, data and worker plumbing
from timing import write_result  # benchmarks/timing.py

STEPS = fit_bench.STEPS
CONTENDERS = ("plain", "gradkit", "keras", "open", "closing")
NEVER = 2 ** 62  # a window that never closes
RESULT_TAG = fit_bench.RESULT_TAG


def _optimizer(K, gk, contender):
    adam = K.optimizers.Adam(1e-3)
    if contender == "keras":
        return K.optimizers.Adam(1e-3, gradient_accumulation_steps=STEPS)
    if contender == "plain":
        return adam
    steps = {"gradkit": STEPS, "open": NEVER, "closing": 1}[contender]
    return gk.GradientAccumulator(adam, steps=steps)


def _step_function(tf, K, model, optimizer, contender):
    loss_fn = K.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    optimizer.build(variables)
    counts = contender not in ("plain", "keras")

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        if counts:
            optimizer.apply_gradients(zip(grads, variables), sample_count=tf.shape(x)[0])
        else:
            optimizer.apply_gradients(zip(grads, variables))
        return loss

    return step


def worker(args):
    tf, K, gk = fit_bench._import_stack(args.flavour)
    rows = []
    for model_name in fit_bench.MODELS:
        batches = list(fit_bench._make_dataset(tf, model_name, STEPS).take(STEPS))
        live = {}
        for contender in CONTENDERS:
            if contender == "keras" and args.flavour == "tf_keras":
                continue
            row = dict(flavour=args.flavour, model=model_name, contender=contender)
            rows.append(row)
            try:
                model = fit_bench._build(K, gk, model_name, "plain", "graph")
                step = _step_function(tf, K, model, _optimizer(K, gk, contender),
                                      contender)
                for i in range(2 * STEPS):  # trace, compile, warm up
                    loss = step(*batches[i % STEPS])
                float(loss)
                live[contender] = (step, row, [])
            except Exception as exc:  # noqa: BLE001 - reported, never hidden
                row["error"] = fit_bench._error_text(exc)
        order = list(live)
        for r in range(args.repeats):
            for contender in order[r % len(order):] + order[:r % len(order)]:
                step, row, times = live[contender]
                start = time.perf_counter()
                for i in range(args.steps):
                    loss = step(*batches[i % STEPS])
                float(loss)  # one host sync per repeat
                times.append((time.perf_counter() - start) / args.steps)
        for step, row, times in live.values():
            row["repeats_ms"] = [1e3 * t for t in times]
            row["ms"] = statistics.median(row["repeats_ms"])
    print(RESULT_TAG + json.dumps(rows), flush=True)


def table(rows):
    lines = ["| flavour | model | contender | ms / micro-step | ratio vs plain [min-max] |",
             "|---|---|---|---:|---:|"]
    plain = {(r["flavour"], r["model"]): r for r in rows if r["contender"] == "plain"}
    for r in rows:
        head = f"| {r['flavour']} | {r['model']} | {r['contender']} | "
        if "error" in r:
            lines.append(head + f"crash: {r['error']} | - |")
            continue
        ratio, lo, hi = fit_bench._ratio_stats(r, plain.get((r["flavour"], r["model"])))
        text = "-" if ratio is None else f"{ratio:.2f} [{lo:.2f}-{hi:.2f}]"
        lines.append(head + f"{r['ms']:.3f} | {text} |")
    return "\n".join(lines)


def verdicts(rows):
    """The issue's targets: within 5% of plain Adam, never slower than Keras's own."""
    groups = {}
    for r in rows:
        groups.setdefault((r["flavour"], r["model"]), {})[r["contender"]] = r
    out = []
    for (flavour, model), group in groups.items():
        plain, ours = group.get("plain"), group.get("gradkit")
        if not plain or not ours or "ms" not in plain or "ms" not in ours:
            continue
        ratio = fit_bench._ratio_stats(ours, plain)[0]
        text = (f"- {flavour} {model}: gradkit {ratio:.2f}x plain; within 5% of plain: "
                f"{'yes' if ratio <= 1.05 else 'NO'}")
        keras = group.get("keras")
        if keras and "ms" in keras:
            rel = ratio / fit_bench._ratio_stats(keras, plain)[0]
            word = "SLOWER" if rel > 1.05 else "faster" if rel < 0.95 else "same within 5%"
            text += f"; vs Keras's own: {rel:.2f}x ({word})"
        out.append(text)
    return "\n".join(out)


def parent(args):
    started, load = time.time(), os.getloadavg()[0]
    rows = []
    for flavour in args.flavours:
        print(f"[{time.time() - started:6.1f}s] {flavour}", flush=True)
        rows += fit_bench._run_worker(
            ["--flavour", flavour, "--steps", str(args.steps), "--repeats", str(args.repeats)],
            flavour, script=__file__)
    report = "\n".join([
        "# Gradient accumulation in a custom GradientTape loop, jit_compile=True",
        "",
        f"tf_gradkit {fit_bench._revision()}; {fit_bench._versions()}; Python "
        f"{platform.python_version()}; {os.cpu_count()} CPUs; "
        f"{time.strftime('%Y-%m-%d %H:%M')}; runtime {time.time() - started:.0f} s; load "
        f"average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end.",
        f"Window {STEPS} micro-batches of {fit_bench.BATCH}; {args.repeats} interleaved "
        f"repeats x {args.steps} micro-steps per contender after warm-up; ms = median "
        "over repeats; ratio = median of per-repeat ratios to plain Adam [min-max]. "
        "open / closing are diagnostics: a micro-step that only accumulates, and one "
        "that closes its window every time.",
        "",
        table(rows),
        "",
        "## Targets (within 5% of plain Adam; never slower than Keras's own)",
        "",
        verdicts(rows),
    ])
    print()
    print(report)
    path = write_result("accumulation_loop.md", report)
    print(f"\nwritten to {os.path.relpath(path)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80,
                        help="micro-steps per repeat, a multiple of 4 (default 80)")
    parser.add_argument("--repeats", type=int, default=15,
                        help="interleaved repeats per contender (default 15)")
    parser.add_argument("--no-tf-keras", action="store_true", help="skip tf_keras")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--flavour", default="keras3", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps % STEPS:
        raise SystemExit(f"--steps must be a multiple of the window ({STEPS}). "
                         f"Received: {args.steps}")
    args.flavours = ["keras3"] if args.no_tf_keras else ["keras3", "tf_keras"]
    worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    main()
