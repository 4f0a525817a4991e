"""Chunks of a batched fit two at a time on a CPU.

Each chunk of `curve_fit` / `least_squares_batched` is one compiled loop of
small kernels, each split over TensorFlow's thread pool; between kernels the
pool's threads wait, and between chunks the calling thread does its own
work (padding, the covariance, a host sync). A second chunk in flight, from
a second Python thread (TensorFlow runs a called function in the caller's
thread, without the GIL), fills those waits with its own kernels: on the
2-core development machine, 10^5 5x5 Gaussians ran +25% per CPU-second and
+40% per second, 15x15 +5-30% and +30-60%, the float64 bounded decay +5%
and +28% (in-process A/B, 2026-11-28; the figures that count are
benchmarks/cpufit_side_by_side.py's). Four in flight were no faster.

Each chunk's result is the one it has alone (the same compiled program on
the same inputs; tested bit for bit). Only where that is all that changes:
eagerly, with no tape or accumulator recording (they are per thread), not
under `tf.config.run_functions_eagerly` (the user's model would run in two
threads), on CPUs only (a GPU's chunks are 16x larger and untested here),
and where TensorFlow may use more than one thread (a process set to one
intra-op thread keeps to one). The caller's device scope goes with the
chunk."""

import concurrent.futures
import contextlib
import os

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.eager import record

# Chunks run at once where `width` allows (1: one at a time everywhere).
CHUNKS_IN_FLIGHT = 2


def width(chunks):
    """How many of ``chunks`` chunks run at once (the module's rule)."""
    if chunks < 2 or CHUNKS_IN_FLIGHT < 2:
        return 1
    if not tf.executing_eagerly() or tf.config.functions_run_eagerly():
        return 1
    if record.could_possibly_record():   # a tape or accumulator is watching
        return 1
    threads = (tf.config.threading.get_intra_op_parallelism_threads()
               or os.cpu_count() or 1)
    if threads < 2 or tf.config.list_logical_devices("GPU"):
        return 1
    return min(CHUNKS_IN_FLIGHT, chunks)


def run(fn, items, done=None):
    """``[fn(i) for i in items]``, `width` at a time, in order; ``done(i)``
    after each in order (a progress bar). An error is raised as it is, the
    chunks not yet started are dropped."""
    n = width(len(items))
    if n < 2:
        out = []
        for i in items:
            out.append(fn(i))
            if done is not None:
                done(i)
        return out
    device = context.context().device_name

    def call(i):
        with tf.device(device) if device else contextlib.nullcontext():
            return fn(i)

    pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="tf_gradkit")
    try:
        futures = [pool.submit(call, i) for i in items]
        out = []
        for i, future in zip(items, futures):
            out.append(future.result())
            if done is not None:
                done(i)
        return out
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
