"""Chunks of a batched fit two at a time on a CPU.

Each chunk of `curve_fit` / `least_squares_batched` is one compiled loop of
small kernels, each split over TensorFlow's thread pool; between kernels the
pool's threads wait, and between chunks the calling thread does its own
work (its inputs' padding, a host sync, the covariance where the chunk could
not prove it). A second chunk in flight, from
a second Python thread (TensorFlow runs a called function in the caller's
thread, without the GIL), fills those waits with its own kernels: on the
2-core development machine fits per second rose 15-25% (10^5 5x5 and 15x15
Gaussians, 2x10^4 float64 bounded decays) and fits per CPU-second 3-5%
(in-process A/B, 2026-11-28; the figures that count are
benchmarks/cpufit_side_by_side.py's). Four in flight were no faster.

Each chunk's result is the one it has alone (the same compiled program on
the same inputs; tested bit for bit). Only where that is all that changes,
so one at a time:
- under `tf.config.run_functions_eagerly` (the user's model would run in
  two threads); its callers run eagerly (`fitting` refuses a graph);
- under a tape or accumulator, op callbacks (`tf.debugging.
  enable_check_numerics`, tfdbg) or a `tf.distribute` strategy: each is
  per thread, so the second thread's chunks would go unrecorded, unchecked
  or traced again outside the strategy;
- on a GPU (its chunks are 16x larger; not measured there), and where
  TensorFlow may use one thread only;
- for chunks of more than `MAX_CHUNK_BYTES` of Jacobian (a `batch_size`
  chosen to fit memory: two at once would need twice that) or under
  `MIN_CHUNK_BYTES` (a second thread costs about a millisecond a call).
The caller's device scope goes with the chunk."""

import concurrent.futures
import contextlib
import os

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.eager import record

# Chunks run at once where `width` allows (1: one at a time everywhere).
CHUNKS_IN_FLIGHT = 2
# Bounds on a chunk's Jacobian bytes (chunk x N x P x itemsize) for two in
# flight: the CPU's default chunk is 4 MB (`fitting.CHUNK_BYTES_CPU`).
MAX_CHUNK_BYTES = 2 ** 22
MIN_CHUNK_BYTES = 2 ** 18


def width(chunks, chunk_bytes=MAX_CHUNK_BYTES):
    """How many of ``chunks`` chunks, each of ``chunk_bytes`` of Jacobian,
    run at once (the module's rule)."""
    if chunks < 2 or CHUNKS_IN_FLIGHT < 2:
        return 1
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        return 1
    if tf.config.functions_run_eagerly():
        return 1
    if (record.could_possibly_record() or context.context().op_callbacks
            or tf.distribute.has_strategy()):   # per thread: see the docstring
        return 1
    threads = (tf.config.threading.get_intra_op_parallelism_threads()
               or os.cpu_count() or 1)
    if threads < 2 or tf.config.list_logical_devices("GPU"):
        return 1
    return min(CHUNKS_IN_FLIGHT, chunks)


def run(fn, items, done=None, chunk_bytes=MAX_CHUNK_BYTES):
    """``[fn(i) for i in items]``, `width` at a time, in order; ``done(i)``
    after each in order (a progress bar). An error is raised as it is, the
    chunks not yet started are dropped."""
    items = list(items)
    n = width(len(items), chunk_bytes)
    out = []
    if n > 1:
        device = context.context().device_name

        def call(i):
            with tf.device(device) if device else contextlib.nullcontext():
                return fn(i)

        pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="tf_gradkit")
        try:
            try:
                futures = [pool.submit(call, i) for i in items]
            except RuntimeError:   # no new threads (the interpreter shutting down)
                futures = None
            for i, future in zip(items, futures or ()):
                out.append(future.result())
                if done is not None:
                    done(i)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if futures is not None:
            return out
    for i in items:
        out.append(fn(i))
        if done is not None:
            done(i)
    return out
