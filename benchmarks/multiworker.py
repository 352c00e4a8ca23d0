"""Benchmark: CCTStrategy inside MultiWorkerMirroredStrategy, two local workers against one.

Trains a small CaffeNet-like model of HybridConv2D layers with ``model.fit`` on the same global
batches in these configurations, each in fresh processes (TF fixes its thread pools at
start-up):

* ``single``: one process, no MWMS, CCTStrategy on ``tf:cpu:0`` (TF's default threads).
* ``single-1t``: the same with 1 intra-op thread (one core).
* ``mwms-1``: one MWMS worker (the same, plus the multi-worker runtime and its collectives).
* ``mwms-2``: two MWMS workers on 127.0.0.1, each with 1 intra-op thread (one core each),
  equal shares of each global batch, gradients all-reduced over gRPC every step.
* ``mwms-2-flops`` (unless ``--quick``): the same with shares from each worker's calibrated
  throughput (:func:`keras_cct.strategy.cluster.local_throughput`).

Throughput is images/s of the global batch in the best timed epoch (the first epoch, with
tracing, is not timed) of the best of ``--repeats`` runs; with two workers an epoch lasts until
the slower worker ends it.
On one 2-core machine no speed-up is expected: the benchmark measures the cost of the wiring.
Writes ``multiworker.json`` and ``multiworker.md``.
Run: ``python -m benchmarks.multiworker [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import numpy as np

from benchmarks.common import DEFAULT_OUT, markdown_table, write_results

ROOT = Path(__file__).resolve().parents[1]
INPUT = (32, 32, 3)


# ------------------------------------------------------------------------------ worker side

def _model(strategy):
    import keras
    from keras_cct import HybridConv2D
    with strategy.scope():
        inp = keras.Input(INPUT)
        h = HybridConv2D(32, 5, padding=2, activation="relu")(inp)
        h = keras.layers.MaxPooling2D(3, 2)(h)
        h = HybridConv2D(64, 5, padding=2, groups=2, activation="relu")(h)
        h = keras.layers.MaxPooling2D(3, 2)(h)
        h = HybridConv2D(64, 3, padding=1, activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _epoch_timer():
    """A Keras callback recording each epoch's wall time in ``.seconds``."""
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds: List[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.t0)

    return EpochTimer()


def run_worker(spec: dict) -> dict:
    """One process of a configuration (called in a fresh subprocess)."""
    workers, index = spec.get("workers"), spec.get("index", 0)
    import tensorflow as tf
    if spec.get("threads"):  # before any TF op: thread pools are fixed at start-up
        tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    mwms = None
    if workers:
        from keras_cct.strategy import cluster
        mwms = cluster.configure(workers, index)
    import contextlib
    from keras_cct import CCTStrategy
    from keras_cct.strategy import cluster
    cct = CCTStrategy(["tf:cpu:0"], split=[1.0], rebalance=False)
    rng = np.random.default_rng(0)
    n = spec["batch"] * spec["steps"]
    x = rng.standard_normal((n,) + INPUT).astype("float32")
    y = rng.integers(0, 10, n)
    scope = cluster.scope(mwms, cct) if mwms else contextlib.nullcontext()
    with scope:
        model = _model(cct)
    shares = [1.0]
    if mwms:
        rate = cluster.local_throughput(cct) if spec.get("shares") == "flops" else 1.0
        shares = cluster.worker_shares(mwms, rate).tolist()
        data = cluster.distribute(mwms, tf.data.Dataset.from_tensor_slices((x, y)).batch(
            spec["batch"]), shares)
        fit_args = dict(x=data, shuffle=False)
    else:
        fit_args = dict(x=x, y=y, batch_size=spec["batch"], shuffle=False)
    timer = _epoch_timer()
    model.fit(**fit_args, epochs=1 + spec["epochs"], verbose=0, callbacks=[timer])
    return {"images_per_epoch": n, "shares": shares,
            "epoch_seconds": timer.seconds, "intra_op_threads":
                tf.config.threading.get_intra_op_parallelism_threads()}


# ------------------------------------------------------------------------------ driver side

def _free_ports(n: int) -> List[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _spawn(specs: List[dict], timeout: float) -> List[dict]:
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3",
               CUDA_VISIBLE_DEVICES="")
    code = ("import json, sys; from benchmarks.multiworker import run_worker; "
            "print('RESULT ' + json.dumps(run_worker(json.loads(sys.argv[1]))))")
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(s)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for s in specs]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not line:
                raise RuntimeError(f"worker failed ({p.returncode}):\n{err[-3000:]}")
            results.append(json.loads(line[-1][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    return results


def run_config(name: str, workers: int, batch: int, steps: int, epochs: int,
               threads: Optional[int], shares: str = "equal") -> dict:
    base = dict(batch=batch, steps=steps, epochs=epochs, shares=shares, threads=threads)
    if name == "single":
        specs = [base]
    else:
        addresses = [f"127.0.0.1:{p}" for p in _free_ports(workers)]
        specs = [dict(base, workers=addresses, index=i) for i in range(workers)]
    t0 = time.perf_counter()
    results = _spawn(specs, timeout=600)
    wall = time.perf_counter() - t0
    # an epoch ends when its slowest worker ends; best timed epoch (the first one traces)
    per_epoch = np.max([r["epoch_seconds"][1:] for r in results], axis=0)
    seconds = float(per_epoch.min())
    images = results[0]["images_per_epoch"]
    return {"config": name, "workers": workers, "threads_per_worker": threads or "default",
            "global_batch": batch, "steps_per_epoch": steps, "timed_epochs": epochs,
            "images_per_s": images / seconds, "ms_per_step": 1e3 * seconds / steps,
            "shares": results[0]["shares"], "process_wall_s": wall,
            "per_worker": results}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no flops config")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of every configuration (best reported; default 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    steps, epochs = (10, 1) if args.quick else (20, 3)
    if args.quick:
        args.repeats = 1
    configs = [("single", 1, None, "equal"), ("single-1t", 1, 1, "equal"),
               ("mwms-1", 1, None, "equal"),
               ("mwms-2", 2, 1, "equal")]
    if not args.quick:
        configs.append(("mwms-2-flops", 2, 1, "flops"))
    from benchmarks.common import machine
    load = [os.getloadavg()[0]]
    rows = []
    runs = {}
    for _ in range(args.repeats):  # configurations interleaved, so load changes hit all
        for name, workers, threads, shares in configs:
            runs.setdefault(name, []).append(
                run_config(name, workers, args.batch, steps, epochs, threads, shares))
    for name, *_ in configs:
        r = max(runs[name], key=lambda run: run["images_per_s"])
        r["images_per_s_all_runs"] = [run["images_per_s"] for run in runs[name]]
        rows.append(r)
    load.append(os.getloadavg()[0])
    base = rows[0]["images_per_s"]
    data = {"machine": machine(), "load_average_1min_before_after": load,
            "command": "python -m benchmarks.multiworker" + (" --quick" if args.quick else "")
                       + (f" --repeats {args.repeats}" if args.repeats != 2 and not args.quick
                          else ""),
            "model": "HybridConv2D 32x5x5 / pool / 64x5x5 g2 / pool / 64x3x3 / GAP / dense, "
                     f"input {INPUT}", "results": rows}
    table = markdown_table(
        ["config", "workers", "intra-op threads / worker", "global batch", "steps/epoch",
         "images/s", "ms/step", "vs single", "shares", "images/s of every run"],
        [[r["config"], r["workers"], r["threads_per_worker"], r["global_batch"],
          r["steps_per_epoch"], r["images_per_s"], r["ms_per_step"],
          f"{r['images_per_s'] / base:.2f}x", ", ".join(f"{s:.3f}" for s in r["shares"]),
          ", ".join(f"{v:.0f}" for v in r["images_per_s_all_runs"])]
         for r in rows])
    m = data["machine"]
    md = (f"# Multi-worker: CCTStrategy inside MultiWorkerMirroredStrategy\n\n"
          f"`{data['command']}` - Keras {m['keras']} ({m['backend']}), TF {m.get('tensorflow')}, "
          f"{m['cores']} CPUs ({m['cpu']}); 1-min load average before/after: "
          f"{[round(v, 2) for v in load]} (other jobs share the machine). Model: "
          f"{data['model']}. Images/s of the global batch in the best of "
          f"{epochs} timed epochs (after one untimed epoch that traces) and of {args.repeats} "
          f"runs of each configuration (interleaved); with two workers an epoch lasts until "
          f"the slower one ends.\n\n" + table +
          "\nTwo workers on one 2-core machine cannot be faster than one process using both "
          "cores: each has one core, and every step adds a gRPC all-reduce of the gradients. "
          "The figures measure the cost of the wiring, not a scale-out. On one machine both "
          "workers read the same calibration, so `mwms-2-flops` gets the same shares as "
          "`mwms-2`: the two rows measure the same configuration twice, and their difference "
          "is the run-to-run noise of this shared machine.\n")
    write_results(args.out, "multiworker", data, md)
    print(md)
    return data


if __name__ == "__main__":
    main()
