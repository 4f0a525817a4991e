"""Gradient accumulation: time per micro-step, peak memory, and distribution.

Compares, through ``model.fit`` on the same in-memory ``tf.data`` pipeline:

  (a) plain     Adam applied to every batch (the baseline);
  (b) gradkit   ``tf_gradkit`` ``GradientAccumulator(Adam, steps=4, model=model)``;
  (c) keras     Keras 3 ``Adam(gradient_accumulation_steps=4)`` (Keras 3 only);
  (d) ga_model  the ``gradient-accumulator`` package's
                ``GradientAccumulateModel(accum_steps=4)`` compiled with Adam.

Why it is built this way:

- Speed is only ever reported as a ratio to (a) measured in the same process,
  with the contenders' repeats interleaved, so machine drift and background
  load hit all of them alike. One repeat = one ``fit`` over a fixed number of
  batches (a multiple of the window, so every repeat closes the same number of
  windows); a callback takes ``perf_counter`` at the first
  ``on_train_batch_begin`` and the last ``on_train_batch_end``. The ratio is
  the median of the per-repeat (paired) ratios.
- Peak memory needs a process of its own per configuration: this script
  re-runs itself (``--worker memory``) and reports the growth of
  ``ru_maxrss`` over the baseline taken after imports and data creation.
- Distribution: ``MirroredStrategy`` over two logical CPUs, with its
  ``ReductionToOneDevice`` instrumented to count, at run time, how many elements every
  executed cross-replica reduction carries, and tags the reduction ops it
  creates so they can be found in the traced graph (cond branches included).

Run: ``.venv/bin/python benchmarks/accumulation.py`` (a few minutes) or with
``--quick`` (about a minute, smoke test). The peer is installed with
``pip install --no-deps gradient-accumulator`` (its metadata pins
``numpy<=1.23.2``, which would otherwise pull in TensorFlow 2.13).
"""

import argparse
import gc
import importlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
from concurrent import futures

from timing import spread, write_result  # benchmarks/timing.py

STEPS = 4  # micro-batches per window, for every accumulating contender
BATCH = 64
VOCAB = 50_000
SEQ_LEN = 20
CONTENDERS = ("plain", "gradkit", "keras", "ga_model")
DESCRIPTIONS = {
    "plain": "(a) Adam every batch",
    "gradkit": "(b) tf_gradkit GradientAccumulator",
    "keras": "(c) Keras 3 gradient_accumulation_steps",
    "ga_model": "(d) gradient-accumulator GradientAccumulateModel",
}
MODELS = ("mlp", "embedding")
RESULT_TAG = "@@RESULT "
HERE = os.path.dirname(os.path.abspath(__file__))


def contenders_for(flavour):
    # Keras 3's own accumulation does not exist in tf_keras.
    return [c for c in CONTENDERS if not (flavour == "tf_keras" and c == "keras")]


# --------------------------------------------------------------------------
# Worker side: everything below up to "Parent side" runs in a subprocess that
# imports TensorFlow; the parent never does.
# --------------------------------------------------------------------------
def _import_stack(flavour, logical_cpus=0):
    """Imports TF (optionally splitting the CPU), one Keras, both accumulators."""
    import tensorflow as tf
    if logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus)
    K = importlib.import_module("tf_keras" if flavour == "tf_keras" else "keras")
    gk = importlib.import_module(f"tf_gradkit.{flavour}")
    import gradient_accumulator  # noqa: F401  (imported by every worker alike)
    return tf, K, gk


def _make_dataset(tf, model_name, batches):
    import numpy as np
    rng = np.random.default_rng(0)
    n = batches * BATCH
    if model_name == "mlp":
        x = rng.standard_normal((n, 256), dtype=np.float32)
    else:
        x = rng.integers(0, VOCAB, (n, SEQ_LEN), dtype=np.int32)
    y = rng.integers(0, 10, (n,), dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        BATCH, drop_remainder=True).repeat()


def _build(K, gk, model_name, contender, mode):
    """A fresh compiled model for one contender (identical layers and seed)."""
    K.utils.set_random_seed(0)
    if model_name == "mlp":
        inp = K.Input((256,))
        h = K.layers.Dense(512, activation="relu")(inp)
        h = K.layers.Dense(512, activation="relu")(h)
    else:  # the embedding gradient is a tf.IndexedSlices
        inp = K.Input((SEQ_LEN,), dtype="int32")
        h = K.layers.Embedding(VOCAB, 64)(inp)
        h = K.layers.GlobalAveragePooling1D()(h)
    out = K.layers.Dense(10)(h)
    if contender == "ga_model":
        from gradient_accumulator import GradientAccumulateModel
        model = GradientAccumulateModel(accum_steps=STEPS, inputs=inp,
                                        outputs=out)
    else:
        model = K.Model(inputs=inp, outputs=out)
    if contender == "gradkit":
        optimizer = gk.GradientAccumulator(
            K.optimizers.Adam(1e-3), steps=STEPS, model=model)
    elif contender == "keras":
        optimizer = K.optimizers.Adam(1e-3, gradient_accumulation_steps=STEPS)
    else:
        optimizer = K.optimizers.Adam(1e-3)
    model.compile(
        optimizer=optimizer,
        loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=(mode == "eager"), jit_compile=(mode == "jit"))
    return model


def _timer_class(K):
    class BatchTimer(K.callbacks.Callback):
        """perf_counter at each train batch's begin and end."""

        def __init__(self):
            super().__init__()
            self.begins, self.ends = [], []

        def on_train_batch_begin(self, batch, logs=None):
            del batch, logs
            self.begins.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            del batch, logs
            self.ends.append(time.perf_counter())

    return BatchTimer


def _timed_fit(model, ds, steps, timer_cls):
    gc.collect()
    timer = timer_cls()
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[timer])
    per_batch = [e - b for b, e in zip(timer.begins, timer.ends)]
    return (timer.ends[-1] - timer.begins[0]) / steps, per_batch


_GENERIC = ("Exception encountered when calling", "Graph execution error",
            "Detected at node", "File ", "Arguments received", "[[",
            "in user code")


def _error_text(exc):
    """The first informative line of an error (Keras wraps the real one)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # Keras bolds its messages
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    # tf_keras quotes the user-code traceback, then "SomeError: message".
    typed = [l for l in lines if re.match(r"^[\w.]*(Error|Exception): ", l)]
    useful = typed or [l for l in lines if not l.startswith(_GENERIC)
                       and not l.startswith(("•", "Cf."))]
    line = (useful or lines or [""])[0]
    name = type(exc).__name__
    if line.startswith(name + ": "):
        line = line[len(name) + 2:]
    return f"{name}: {line[:100]}"


def worker_timing(args):
    """All contenders of one flavour, interleaved repeat by repeat."""
    tf, K, gk = _import_stack(args.flavour)
    timer_cls = _timer_class(K)
    rows = []
    for model_name in args.models:
        ds = _make_dataset(tf, model_name, 64)
        for mode in args.modes:
            live, repeats, batches = {}, {}, {}
            for contender in contenders_for(args.flavour):
                row = dict(flavour=args.flavour, model=model_name, mode=mode,
                           contender=contender)
                rows.append(row)
                try:
                    model = _build(K, gk, model_name, contender, mode)
                    t0 = time.perf_counter()
                    _timed_fit(model, ds, 2 * STEPS, timer_cls)  # trace/compile
                    row["warmup_s"] = time.perf_counter() - t0
                    _timed_fit(model, ds, 2 * STEPS, timer_cls)
                    live[contender] = (model, row)
                    repeats[contender], batches[contender] = [], []
                except Exception as exc:  # noqa: BLE001 - reported, never hidden
                    row["error"] = _error_text(exc)
                    row["traceback"] = traceback.format_exc()
            order = list(live)
            for r in range(args.repeats):
                # Rotate the order so no contender always runs first.
                for contender in order[r % len(order):] + order[:r % len(order)]:
                    model, row = live[contender]
                    try:
                        per_step, per_batch = _timed_fit(
                            model, ds, args.steps, timer_cls)
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = _error_text(exc)
                        row["traceback"] = traceback.format_exc()
                        continue
                    repeats[contender].append(per_step)
                    batches[contender].extend(per_batch)
            for contender, (model, row) in live.items():
                if "error" in row or not repeats[contender]:
                    continue
                row["ms"] = 1e3 * statistics.median(repeats[contender])
                row["repeats_ms"] = [1e3 * t for t in repeats[contender]]
                # Window phase: batch i of a fit closes a window iff i % 4 == 3
                # (every fit is a whole number of windows long).
                per_batch = batches[contender]
                closing = [t for i, t in enumerate(per_batch) if i % STEPS == STEPS - 1]
                opening = [t for i, t in enumerate(per_batch) if i % STEPS != STEPS - 1]
                row["open_ms"] = 1e3 * statistics.median(opening)
                row["close_ms"] = 1e3 * statistics.median(closing)
            del live
            gc.collect()
    print(RESULT_TAG + json.dumps(rows), flush=True)


def _state_bytes(model):
    """Bytes of optimizer state plus any accumulators kept on the model."""
    variables = list(model.optimizer.variables)
    variables += list(getattr(model, "gradient_accumulation", None) or [])
    total = 0
    for v in variables:
        n = 1
        for d in v.shape:
            n *= int(d)
        total += n * (8 if "64" in str(v.dtype) else 4)
    return total


def worker_memory(args):
    """Peak RSS growth of one configuration, alone in its process."""
    tf, K, gk = _import_stack(args.flavour)
    ds = _make_dataset(tf, args.model, 64)
    timer_cls = _timer_class(K)
    gc.collect()
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = dict(flavour=args.flavour, model=args.model, mode=args.mode,
               contender=args.contender)
    try:
        model = _build(K, gk, args.model, args.contender, args.mode)
        _timed_fit(model, ds, 2 * STEPS, timer_cls)
        _timed_fit(model, ds, args.steps, timer_cls)
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        row["rss_mb"] = (peak_kb - base_kb) / 1024
        row["state_mb"] = _state_bytes(model) / 2**20
    except Exception as exc:  # noqa: BLE001
        row["error"] = _error_text(exc)
        row["traceback"] = traceback.format_exc()
    print(RESULT_TAG + json.dumps(row), flush=True)


# ------------------------------------------------------------ distributed
REDUCE_SCOPE = "bench_cross_replica_reduce"


def _instrument_reductions(tf):
    """Makes every ReductionToOneDevice count what it reduces and tag its ops.

    Patched on the class (in this worker process only), because
    MirroredStrategy also builds its own ReductionToOneDevice for reductions
    to a CPU destination, e.g. reading a sync-on-read variable in
    cross-replica context; a subclass passed as ``cross_device_ops`` would miss
    those. The returned holder's ``counter`` (int64 [calls, elements,
    scalar calls]) is bumped by an op created next to each reduction, so it
    runs exactly when the reduction runs: inside a ``tf.cond`` or
    ``switch_case`` branch only when that branch is taken.
    """

    class Holder:
        counter = None

    cls = tf.distribute.ReductionToOneDevice
    original = cls.reduce_implementation

    def reduce_implementation(self, reduce_op, per_replica_value, destinations,
                              options):
        # batch_reduce_implementation calls this once per value, so counting
        # here counts every reduction exactly once.
        local = getattr(per_replica_value, "values", (per_replica_value,))[0]
        if isinstance(local, tf.IndexedSlices):
            local = local.values
        if Holder.counter is not None:
            size = tf.cast(tf.size(local), tf.int64)
            with tf.device("/cpu:0"):
                Holder.counter.assign_add(tf.stack(
                    [tf.constant(1, tf.int64), size,
                     tf.cast(tf.equal(size, 1), tf.int64)]))
        with tf.name_scope(REDUCE_SCOPE):
            return original(self, reduce_op, per_replica_value, destinations,
                            options)

    cls.reduce_implementation = reduce_implementation
    return Holder


def _find_tf_function(fn, depth=3):
    """The tf.function behind a Keras train_function (it may be a closure)."""
    if hasattr(fn, "get_concrete_function"):
        return fn
    if depth == 0:
        return None
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            found = _find_tf_function(cell.cell_contents, depth - 1)
        except ValueError:  # empty cell
            continue
        if found is not None:
            return found
    return None


def _reduce_ops_in_graph(graph_def):
    """Counts tagged AddN ops outside vs inside cond branches.

    Walks from the top-level graph through call ops (``f`` attribute) and
    ``If``/``StatelessIf``/``Case`` branches; a function first reached through a
    branch is "in a cond".
    """
    library = {f.signature.name: f for f in graph_def.library.function}

    def children(nodes):
        for node in nodes:
            is_branch = node.op in ("If", "StatelessIf", "Case", "StatelessCase")
            for key, attr in node.attr.items():
                names = []
                if attr.HasField("func"):
                    names.append(attr.func.name)
                if attr.HasField("list"):
                    names.extend(f.name for f in attr.list.func)
                for name in names:
                    if name in library:
                        yield name, is_branch and key != "f"

    def count(nodes):
        return sum(1 for n in nodes if n.op == "AddN" and REDUCE_SCOPE in n.name)

    totals = {"outside_cond": count(graph_def.node), "inside_cond": 0}
    seen = set()
    stack = [(name, branch) for name, branch in children(graph_def.node)]
    while stack:
        name, in_cond = stack.pop()
        if (name, in_cond) in seen:
            continue
        seen.add((name, in_cond))
        nodes = library[name].node_def
        totals["inside_cond" if in_cond else "outside_cond"] += count(nodes)
        stack.extend((child, in_cond or branch) for child, branch in children(nodes))
    return totals


def worker_distributed(args):
    """Each contender under MirroredStrategy on two logical CPUs (MLP)."""
    tf, K, gk = _import_stack(args.flavour, logical_cpus=2)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    timer_cls = _timer_class(K)
    holder = _instrument_reductions(tf)
    rows = []
    for mode in args.modes:
        for contender in contenders_for(args.flavour):
            row = dict(flavour=args.flavour, model="mlp", mode=mode,
                       contender=contender)
            rows.append(row)
            counter = tf.Variable([0, 0, 0], dtype=tf.int64, trainable=False)
            holder.counter = counter
            strategy = tf.distribute.MirroredStrategy(
                devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
            try:
                with strategy.scope():
                    model = _build(K, gk, "mlp", contender, mode)
                params = sum(int(tf.size(v)) for v in model.trainable_variables)
                ds = _make_dataset(tf, "mlp", 64)
                _timed_fit(model, ds, 2 * STEPS, timer_cls)
                counter.assign([0, 0, 0])
                per_batch = []
                for _ in range(args.repeats):
                    per_batch += _timed_fit(model, ds, args.steps, timer_cls)[1]
                calls, elements, scalars = (int(x) for x in counter.numpy())
                micro_steps = args.repeats * args.steps
                row["reductions_per_step"] = calls / micro_steps
                row["scalar_reductions_per_step"] = scalars / micro_steps
                row["grad_reductions_per_step"] = (
                    (elements - scalars) / params / micro_steps)
                closing = [t for i, t in enumerate(per_batch) if i % STEPS == STEPS - 1]
                opening = [t for i, t in enumerate(per_batch) if i % STEPS != STEPS - 1]
                row["open_ms"] = 1e3 * statistics.median(opening)
                row["close_ms"] = 1e3 * statistics.median(closing)
                row["ms"] = 1e3 * statistics.mean(per_batch)
                if mode != "eager":
                    fn = _find_tf_function(model.train_function)
                    iterator = iter(strategy.experimental_distribute_dataset(ds))
                    graph_def = fn.get_concrete_function(iterator).graph.as_graph_def()
                    row.update(_reduce_ops_in_graph(graph_def))
            except Exception as exc:  # noqa: BLE001
                row["error"] = _error_text(exc)
                row["traceback"] = traceback.format_exc()
    print(RESULT_TAG + json.dumps(rows), flush=True)


# --------------------------------------------------------------------------
# Parent side: runs workers, never imports TensorFlow.
# --------------------------------------------------------------------------
def _run_worker(worker_args, flavour, script=__file__):
    """Runs ``script --worker ...`` in the flavour's own process; its result."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               TF_USE_LEGACY_KERAS="1" if flavour == "tf_keras" else "0")
    cmd = [sys.executable, os.path.abspath(script), "--worker"] + worker_args
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise RuntimeError(f"worker {' '.join(worker_args)} failed "
                       f"(exit {proc.returncode}):\n{tail}")


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _ratio_stats(row, plain):
    """Median (and range) of per-repeat ratios, paired by repeat index."""
    if not plain or "repeats_ms" not in row or "repeats_ms" not in plain:
        return None, None, None
    return spread(a / b for a, b in zip(row["repeats_ms"], plain["repeats_ms"]))


def main_table(rows, memory):
    lines = [
        "| flavour | model | mode | contender | ms / micro-step | ratio vs plain "
        "[min-max] | open / closing step ms | peak RSS MB | state MB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    index = {(r["flavour"], r["model"], r["mode"], r["contender"]): r for r in rows}
    for r in rows:
        key = (r["flavour"], r["model"], r["mode"], r["contender"])
        mem = memory.get(key, {})
        plain = index.get(key[:3] + ("plain",))
        rss = _fmt(mem.get("rss_mb"), ".0f") if "error" not in mem else "err"
        state = _fmt(mem.get("state_mb"), ".1f") if "error" not in mem else "err"
        if "error" in r:
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {r['contender']} | "
                         f"crash: {r['error']} | - | - | {rss} | {state} |")
            continue
        ratio, lo, hi = _ratio_stats(r, plain)
        ratio_txt = "-" if ratio is None else f"{ratio:.2f} [{lo:.2f}-{hi:.2f}]"
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {r['contender']} | "
            f"{r['ms']:.2f} | {ratio_txt} | "
            f"{r['open_ms']:.2f} / {r['close_ms']:.2f} | {rss} | {state} |")
    return "\n".join(lines)


def distributed_table(rows):
    lines = [
        "| flavour | mode | contender | reductions / micro-step (of them "
        "scalars) | gradient reductions / micro-step | reduce ops in graph "
        "(outside / inside cond) | open / closing step ms |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['flavour']} | {r['mode']} | {r['contender']} | "
        if "error" in r:
            lines.append(head + f"crash: {r['error']} | - | - | - |")
            continue
        graph = ("-" if "outside_cond" not in r else
                 f"{r['outside_cond']} / {r['inside_cond']}")
        lines.append(head + f"{r['reductions_per_step']:.2f} "
                     f"({r['scalar_reductions_per_step']:.2f}) | "
                     f"{r['grad_reductions_per_step']:.2f} | {graph} | "
                     f"{r['open_ms']:.2f} / {r['close_ms']:.2f} |")
    return "\n".join(lines)


def verdicts(rows):
    """The issue's targets, checked per (flavour, model, mode)."""
    out = []
    groups = {}
    for r in rows:
        groups.setdefault((r["flavour"], r["model"], r["mode"]), {})[r["contender"]] = r
    for (flavour, model, mode), group in groups.items():
        ours, plain = group.get("gradkit"), group.get("plain")
        if not ours or "ms" not in ours or not plain or "ms" not in plain:
            continue
        ratio = _ratio_stats(ours, plain)[0]
        peers = {c: _ratio_stats(group[c], plain)[0] for c in ("keras", "ga_model")
                 if c in group and "ms" in group[c]}
        checks = []
        if mode == "jit":
            checks.append(f"within 5% of plain: {'yes' if ratio <= 1.05 else 'NO'} "
                          f"({ratio:.2f})")
        for peer, peer_ratio in peers.items():
            rel = ratio / peer_ratio
            word = ("SLOWER" if rel > 1.05 else "faster" if rel < 0.95
                    else "same within 5%")
            checks.append(f"vs {peer}: {rel:.2f}x ({word})")
        out.append(f"- {flavour} {model} {mode}: gradkit {ratio:.2f}x plain; "
                   + "; ".join(checks))
    return "\n".join(out)


def _versions():
    code = ("import importlib.metadata as m; print(' '.join(p + ' ' + m.version(p) "
            "for p in ('tensorflow', 'keras', 'tf_keras', 'gradient-accumulator')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.strip()


def _revision():
    """The commit measured (the library is imported from the working tree)."""
    def git(*cmd):
        out = subprocess.run(["git", *cmd], cwd=HERE, capture_output=True,
                             text=True)
        return out.stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "../tf_gradkit")
    return head + (" + uncommitted changes in tf_gradkit/" if dirty else "")


def parent(args):
    t_start = time.time()
    revision = _revision()
    load_start = os.getloadavg()
    quick = args.quick
    # --quick touches every code path once (jit only, MLP-only memory).
    modes = ["jit"] if quick or args.jit_only else ["eager", "graph", "jit"]
    mem_modes = ["jit"] if quick else ["eager", "jit"]
    # jit under MirroredStrategy fails on CPUs for every contender, plain Adam
    # included (XLA reads a variable placed on the other device): shown once.
    dist_modes = {"keras3": ["graph"] if quick else ["graph", "jit", "eager"],
                  "tf_keras": ["graph", "eager"]}
    steps = args.timing_steps or (8 if quick else 40)
    if steps % STEPS:
        raise SystemExit(f"--timing-steps must be a multiple of the window ({STEPS}). "
                         f"Received: {steps}")
    repeats = args.timing_repeats or (2 if quick else 5)
    flavours = ["keras3"] if quick or args.no_tf_keras else ["keras3", "tf_keras"]
    common = ["--modes", ",".join(modes), "--steps", str(steps),
              "--repeats", str(repeats)]
    log = lambda msg: print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)  # noqa: E731

    rows = []
    for flavour in flavours:
        log(f"timing {flavour}: models {MODELS}, modes {modes}, "
            f"{repeats} repeats x {steps} micro-steps")
        rows += _run_worker(["timing", "--flavour", flavour,
                             "--models", ",".join(MODELS)] + common, flavour)

    dist_rows, jobs = [], []
    if args.timing_only:
        flavours_for_rest = []
    else:
        flavours_for_rest = flavours
        log("distributed (MirroredStrategy, 2 logical CPUs, MLP)")
    for flavour in flavours_for_rest:
        dist_rows += _run_worker(
            ["distributed", "--flavour", flavour,
             "--modes", ",".join(dist_modes[flavour]),
             "--steps", str(4 * STEPS), "--repeats", "1" if quick else "3"], flavour)

    mem_models = ["mlp"] if quick else list(MODELS)
    for flavour in flavours_for_rest:
        for model in mem_models:
            for mode in mem_modes:
                for contender in contenders_for(flavour):
                    jobs.append((flavour, model, mode, contender))
    if jobs:
        log(f"peak memory: {len(jobs)} configurations, one process each")
    memory = {}
    # Several at a time: RSS is per process, and nothing is being timed now.
    with futures.ThreadPoolExecutor(max_workers=3) as pool:
        pending = {
            pool.submit(_run_worker, ["memory", "--flavour", f, "--model", m,
                                      "--mode", d, "--contender", c,
                                      "--steps", str(steps)], f): (f, m, d, c)
            for f, m, d, c in jobs}
        for done in futures.as_completed(pending):
            try:
                memory[pending[done]] = done.result()
            except RuntimeError as exc:
                memory[pending[done]] = {"error": str(exc)}

    runtime = time.time() - t_start
    log("done")
    report = "\n".join([
        "# Gradient accumulation benchmark",
        "",
        f"tf_gradkit {revision}; {_versions()}; "
        f"Python {platform.python_version()}; "
        f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}; "
        f"runtime {runtime:.0f} s{' (--quick)' if quick else ''}; load average "
        f"{load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end (other "
        "processes on the machine add noise to every ratio).",
        f"Window {STEPS} micro-batches of {BATCH}; {repeats} interleaved repeats "
        f"x {steps} micro-steps per contender after warm-up; ms = median over "
        "repeats; ratio = median of per-repeat ratios to plain Adam "
        "[min-max]; open / closing = median batch time of micro-steps that do "
        "not / do close a window; peak RSS = ru_maxrss growth over the "
        "post-import baseline, one process per configuration; state = bytes "
        "of optimizer variables (+ the model's accumulators for ga_model). "
        f"Peak RSS is measured for modes {mem_modes} only.",
        "",
        "Contenders: " + "; ".join(f"{k} = {v}" for k, v in DESCRIPTIONS.items())
        + ".",
        "",
        main_table(rows, memory),
        "",
        "## Targets (jit: within 5% of plain; never slower than a peer)",
        "",
        verdicts(rows),
        "",
        "## MirroredStrategy, 2 logical CPUs, MLP, global batch 64",
        "",
        "reductions = cross-replica reduce calls executed (counted at run time); "
        "gradient reductions = reduced elements / trainable parameters, i.e. how "
        "many full gradient all-reduces each micro-step costs; reduce ops in "
        "graph = tagged AddN ops in the traced train function, outside / inside "
        "cond / switch_case branch functions; scalars = reductions of one "
        "element (e.g. reading a sync-on-read counter in cross-replica "
        "context).",
        "",
        distributed_table(dist_rows),
    ])
    print()
    print(report)
    failures = [r for r in rows + dist_rows + list(memory.values())
                if "traceback" in r and r.get("contender") == "gradkit"]
    for r in failures:
        print(f"\n--- traceback: gradkit {r.get('flavour')} {r.get('model')} "
              f"{r.get('mode')} ---\n{r['traceback']}")
    path = write_result("accumulation.md", report)
    print(f"\nwritten to {os.path.relpath(path)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (about a minute): fewer repeats and configs")
    parser.add_argument("--no-tf-keras", action="store_true",
                        help="skip the tf_keras flavour")
    parser.add_argument("--timing-only", action="store_true",
                        help="time the micro-steps only (no MirroredStrategy, no memory)")
    parser.add_argument("--jit-only", action="store_true",
                        help="time jit_compile=True only")
    parser.add_argument("--timing-repeats", type=int, default=None,
                        help="interleaved repeats per contender (default 5; --quick 2)")
    parser.add_argument("--timing-steps", type=int, default=None,
                        help="micro-steps per repeat, a multiple of 4 (default 40; --quick 8)")
    parser.add_argument("--worker", choices=("timing", "memory", "distributed"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--flavour", default="keras3", help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--modes", default="eager,jit", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="jit", help=argparse.SUPPRESS)
    parser.add_argument("--contender", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.models = args.models.split(",")
    args.modes = args.modes.split(",")
    if args.worker is None:
        parent(args)
    else:
        {"timing": worker_timing, "memory": worker_memory,
         "distributed": worker_distributed}[args.worker](args)


if __name__ == "__main__":
    main()
