"""Starts TensorFlow worker processes on loopback and collects what they wrote.

`launch(script, args, workers=2, timeout=...)` runs ``python script args...``
once per worker with ``TF_CONFIG`` naming 127.0.0.1 ports (one cluster), the
same Keras flavour as this process (``TF_USE_LEGACY_KERAS`` is inherited) and
no GPU. It waits at most ``timeout`` seconds, kills whatever is left (a worker
whose peer died waits in a collective forever) and raises with each worker's
log tail unless every worker exited 0. Each worker writes its results to
``<out>/worker_<index>.npz``; `launch` returns them as dicts, by index.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(script, args, out, workers=2, timeout=240, extra_env=None):
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(workers)]}
    os.makedirs(out, exist_ok=True)
    procs = []
    for index in range(workers):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=json.dumps({"cluster": cluster,
                                         "task": {"type": "worker", "index": index}}))
        env.update(extra_env or {})
        log = open(os.path.join(out, f"worker_{index}.log"), "w")  # noqa: SIM115
        procs.append((subprocess.Popen([sys.executable, script, out] + list(args),
                                       env=env, stdout=log, stderr=subprocess.STDOUT),
                      log))
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                time.sleep(3)  # let the other write its error, then stop it
                break
            time.sleep(0.25)
    finally:
        codes = []
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            codes.append(p.wait())
            log.close()
    if any(codes):
        tails = []
        for index in range(workers):
            with open(os.path.join(out, f"worker_{index}.log")) as f:
                tails.append(f"--- worker {index} (exit {codes[index]}):\n" +
                             "".join(f.readlines()[-40:]))
        what = "timed out" if time.time() >= deadline else "failed"
        raise RuntimeError(f"multi-worker run {what} after {timeout}s:\n" + "\n".join(tails))
    results = []
    for index in range(workers):
        with np.load(os.path.join(out, f"worker_{index}.npz"), allow_pickle=False) as data:
            results.append({k: data[k] for k in data.files})
    return results
