"""``cct train`` over several devices (CCTStrategy) and several worker processes (MWMS).

A LeNet-like net (two Convolution layers, i.e. HybridConv2D) on 12x12 random "digits" written
by the test as an LMDB, global batch 6. Reference: a single-process ``cct train`` on the same
solver; snapshots are compared blob by blob (``tests.reference.rel_err``). Cluster runs start
``python -m keras_cct.cli train`` worker processes on 127.0.0.1 (free ports, bounded waits),
each in its own session; every process group is killed when the test ends.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest

from tests import reference as ref
from tests.strategy.test_cluster import ROOT, Cluster, _env, _opencl_available, free_ports

RUN_TIMEOUT = 300  # seconds a cluster run may take (TF start-up is slow on 2 busy cores)

NET = """
name: "tiny_lenet"
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        transform_param { scale: 0.00390625 }
        data_param { source: "digits_lmdb" batch_size: 6 backend: LMDB } }
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TEST }
        transform_param { scale: 0.00390625 }
        data_param { source: "digits_lmdb" batch_size: 6 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 6 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv2" top: "ip1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy"
        include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


def _setup(tmp: Path, *, max_iter: int, snapshot: int, test_interval: int = 3,
           more: str = "") -> str:
    """The LMDB (30 random 12x12 digits, so batches wrap around), the net and a solver."""
    from keras_cct.caffe.io.lmdb_io import write_arrays
    if not (tmp / "digits_lmdb").exists():
        rng = np.random.default_rng(0)
        write_arrays(tmp / "digits_lmdb", rng.integers(0, 256, (30, 12, 12, 1), np.uint8),
                     rng.integers(0, 10, 30))
        (tmp / "net.prototxt").write_text(NET)
    solver = tmp / f"solver_{max_iter}_{snapshot}{'_more' if more else ''}.prototxt"
    solver.write_text(f"""
        net: "net.prototxt" test_iter: 1 test_interval: {test_interval}
        test_initialization: false base_lr: 0.05 momentum: 0.9 weight_decay: 0.0005
        lr_policy: "inv" gamma: 0.0001 power: 0.75 display: 1 max_iter: {max_iter}
        snapshot: {snapshot} snapshot_prefix: "unused" random_seed: 5 {more}""")
    return str(solver)


def _blobs(path) -> dict:
    from keras_cct.caffe.io.binary import blob_to_array, read_caffemodel
    model = read_caffemodel(path)
    return {(lp.name, i): blob_to_array(b) for lp in model.layer for i, b in enumerate(lp.blobs)}


def _assert_same_weights(got_path, want_path, tol: float = 1e-5) -> None:
    got, want = _blobs(got_path), _blobs(want_path)
    assert sorted(got) == sorted(want) and len(want) == 6  # conv1, conv2, ip1: weights, bias
    errors = {k: ref.rel_err(got[k], want[k]) for k in want}
    assert max(errors.values()) <= tol, errors


def _last_loss(text: str) -> float:
    """The smoothed loss of the last ``Iteration N (...), loss = X`` line."""
    found = re.findall(r"^(?:\[worker \d+\] )?Iteration \d+.*, loss = (\S+)$", text, re.M)
    assert found, text[-2000:]
    return float(found[-1])


def _single(tmp: Path, solver: str, prefix: str, extra=(), capsys=None) -> str:
    """An in-process ``cct train``; returns its stdout."""
    from keras_cct.cli import main
    if capsys is not None:
        capsys.readouterr()
    assert main(["train", "--solver", solver, "--snapshot-prefix", str(tmp / prefix)]
                + list(extra)) == 0
    return capsys.readouterr().out if capsys is not None else ""


class TrainCluster(Cluster):
    """``cct train`` worker processes (one per entry of ``extra``); see ``Cluster``."""

    def __init__(self, tmp: Path, name: str, workers: List[str], solver: str,
                 extra: List[List[str]], prefix: Optional[str] = None):
        self.procs, self.outs, self.logs = [], [], []
        prefix = prefix or name
        for i, more in enumerate(extra):
            log_path = tmp / f"{name}-{i}.log"
            cmd = [sys.executable, "-m", "keras_cct.cli", "train", "--solver", solver,
                   "--snapshot-prefix", str(tmp / f"{prefix}{i}" / "snap"), "--workers",
                   ",".join(workers), "--worker-index", str(i)] + more
            with open(log_path, "w") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log,
                                                   stderr=subprocess.STDOUT,
                                                   start_new_session=True))
            self.logs.append(log_path)
            self.outs.append(tmp / f"{prefix}{i}" / "snap")

    def snapshot(self, i: int, it: int, ext: str = ".caffemodel") -> Path:
        return Path(f"{self.outs[i]}_iter_{it}{ext}")


@pytest.fixture
def train_cluster(tmp_path):
    import keras
    if keras.backend.backend() != "tensorflow":
        pytest.skip("MultiWorkerMirroredStrategy is TensorFlow's")
    runs = []

    def start(name, solver, extra, ports=None, prefix=None):
        workers = [f"127.0.0.1:{p}" for p in (ports or free_ports(len(extra)))]
        run = TrainCluster(tmp_path, name, workers, solver, extra, prefix)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()


def _finish(run, timeout: float = RUN_TIMEOUT) -> None:
    codes = run.wait(timeout)
    for i, code in enumerate(codes):
        assert code == 0, f"worker {i} exited with {code}:\n{run.log_tail(i)}"


# ---------------------------------------------------------------------------- tests

def test_two_workers_unequal_shares_equal_single_process(train_cluster, tmp_path, capsys):
    """Shares 2:1 (4 + 2 images of each global batch of 6), each worker splitting its slice
    0.6/0.4 across tf:cpu:0 and opencl:0:0 (when PoCL is there): both workers' final snapshots
    equal the single-process run's, worker 0's displayed losses are the global ones, it alone
    runs the test net, and worker 1's lines are prefixed."""
    solver = _setup(tmp_path, max_iter=6, snapshot=3)
    devices = ["--devices", "tf:cpu:0,opencl:0:0", "--split", "0.6,0.4", "--no-rebalance"] \
        if _opencl_available() else []
    run = train_cluster("two", solver, [["--worker-shares", "2,1"] + devices] * 2)
    single = _single(tmp_path, solver, "single/snap", capsys=capsys)
    _finish(run)
    for i in range(2):
        _assert_same_weights(run.snapshot(i, 6), tmp_path / "single" / "snap_iter_6.caffemodel")
        _assert_same_weights(run.snapshot(i, 3), tmp_path / "single" / "snap_iter_3.caffemodel")
    log0, log1 = (run.log_tail(i, 10 ** 6) for i in range(2))
    assert "Worker 0 of 2: share of each global batch 0.667" in log0
    assert "[worker 1] Worker 1 of 2: share of each global batch 0.333" in log1
    # every displayed iteration's loss is the global batch's (worker 0 logs like caffe)
    pattern = r"^Iteration (\d+) .*loss = (\S+)$|^Iteration (0), loss = (\S+)$"
    want = {m[0] or m[2]: float(m[1] or m[3]) for m in re.findall(pattern, single, re.M)}
    got = {m[0] or m[2]: float(m[1] or m[3]) for m in re.findall(pattern, log0, re.M)}
    assert len(want) == 6 and sorted(got) == sorted(want)
    for k in want:
        assert abs(got[k] - want[k]) <= 1e-4 * abs(want[k]), (k, got[k], want[k])
    assert abs(_last_loss(log0) - _last_loss(single)) <= 1e-4 * abs(_last_loss(single))
    test_lines = re.findall(r"Test net output #0: accuracy = (\S+)", single)
    assert re.findall(r"Test net output #0: accuracy = (\S+)", log0) == test_lines
    assert "Testing net" not in log1 and "Optimization Done." in log1
    if devices:  # each worker's slice of the last batch (4 and 2 images) was split
        for log, images in ((log0, [2, 2]), (log1, [1, 1])):
            rows = re.findall(r"^(?:\[worker 1\] )?\s+conv1\s+(\S+)\s+\S+\s+(\d+)\s", log,
                              re.M)
            assert [r[0] for r in rows] == ["tf:cpu:0", "opencl:0:0"], log[-3000:]
            assert [int(r[1]) for r in rows] == images, log[-3000:]


def test_two_workers_clip_the_global_gradient(train_cluster, tmp_path, capsys):
    """``clip_gradients`` clips the norm of the global batch's gradient (one extra all-reduce),
    not each worker's slice: with clipping active at every step, two workers (shares 2:1)
    still end with the single-process weights."""
    solver = _setup(tmp_path, max_iter=6, snapshot=6, more="clip_gradients: 0.05")
    run = train_cluster("clip", solver, [["--worker-shares", "2,1"]] * 2)
    _single(tmp_path, solver, "single/snap", capsys=capsys)
    _finish(run)
    for i in range(2):
        _assert_same_weights(run.snapshot(i, 6), tmp_path / "single" / "snap_iter_6.caffemodel")


def test_killed_worker_resume_from_snapshot(train_cluster, tmp_path, capsys):
    """Worker 1 is SIGKILLed after its first snapshot (iteration 4 of 80); the survivor exits
    non-zero with a ClusterError naming the restart. Both restarted with their
    ``--snapshot PREFIX_iter_4.solverstate`` end with the weights of an uninterrupted
    single-process run. Shares here come from each worker's calibrated throughput."""
    solver = _setup(tmp_path, max_iter=80, snapshot=4, test_interval=40)
    ports = free_ports(2)
    run = train_cluster("crash", solver, [[], []], ports)
    state = run.snapshot(1, 4, ".solverstate")
    end = time.monotonic() + RUN_TIMEOUT
    while not state.exists():
        assert time.monotonic() < end, "worker 1 never wrote its first snapshot:\n" + \
            run.log_tail(1)
        assert run.procs[1].poll() is None, run.log_tail(1)
        time.sleep(0.02)
    run.kill(1)
    assert run.procs[1].returncode == -signal.SIGKILL
    survivor = run.wait(120)[0]  # TF's heartbeats notice the dead peer (10 s measured)
    assert survivor not in (None, 0), run.log_tail(0)
    assert "cct train: error: worker 0 stopped at iteration" in run.log_tail(0), run.log_tail(0)
    assert not run.snapshot(0, 80).exists() and not run.snapshot(1, 80).exists()
    run.close()

    resume = [["--snapshot", str(run.snapshot(i, 4, ".solverstate"))] for i in range(2)]
    again = train_cluster("resume", solver, resume, ports, prefix="crash")
    _single(tmp_path, solver, "single/snap", capsys=capsys)
    _finish(again)
    for i in range(2):
        assert "Restoring previous solver status from" in again.log_tail(i, 10 ** 6)
        _assert_same_weights(again.snapshot(i, 80),
                             tmp_path / "single" / "snap_iter_80.caffemodel")


def test_devices_split_equals_plain_run(tmp_path, capsys):
    """``--devices <backend cpu>,opencl:0:0 --split 0.6,0.4`` in one process (``tf:cpu:0``,
    ``jax:cpu:0`` or ``torch:cpu``: the Keras backend's own CPU): the same weights as the plain
    run, and the final table names both devices with their fractions."""
    import keras
    cpu, shown = {"tensorflow": ("tf:cpu:0",) * 2, "jax": ("jax:cpu:0",) * 2,
                  "torch": ("torch:cpu", "torch:cpu:0")}[keras.backend.backend()]
    if not _opencl_available():
        pytest.skip("no OpenCL device (PoCL)")
    solver = _setup(tmp_path, max_iter=4, snapshot=0, test_interval=4)
    _single(tmp_path, solver, "plain/snap", capsys=capsys)
    out = _single(tmp_path, solver, "split/snap", ["--devices", f"{cpu},opencl:0:0",
                                                    "--split", "0.6,0.4", "--no-rebalance"],
                  capsys=capsys)
    _assert_same_weights(tmp_path / "split" / "snap_iter_4.caffemodel",
                         tmp_path / "plain" / "snap_iter_4.caffemodel")
    table = out[out.index("CCTStrategy split"):]
    for layer in ("conv1", "conv2"):
        rows = re.findall(rf"^\s*{layer}\s+(\S+)\s+(\S+)\s+(\d+)\s", table, re.M)
        assert [r[0] for r in rows] == [shown, "opencl:0:0"], table
        assert [float(r[1]) for r in rows] == [0.6, 0.4], table
        assert sum(int(r[2]) for r in rows) == 6 and int(rows[1][2]) > 0, table


@pytest.mark.parametrize("extra, message", [
    (["--workers", "127.0.0.1:1,127.0.0.1:2"], "needs --worker-index"),
    (["--worker-index", "0"], "needs --workers"),
    (["--workers", "127.0.0.1", "--worker-index", "0"], "not host:port"),
    (["--workers", "127.0.0.1:1,127.0.0.1:2", "--worker-index", "2"], "not in 0..1"),
    (["--workers", "127.0.0.1:1,127.0.0.1:1", "--worker-index", "0"], "listed twice"),
    (["--workers", "a:1,b:2", "--worker-index", "0", "--worker-shares", "1"],
     "one positive number per worker"),
    (["--worker-shares", "1,1"], "needs --workers"),
    (["--split", "0.5,0.5"], "several --devices"),
    (["--devices", "tf:cpu:0,opencl:0:0", "--split", "0.5"], "one non-negative fraction"),
])
def test_bad_cluster_and_device_arguments(tmp_path, capsys, monkeypatch, extra, message):
    """Refused before anything runs: a typed error printed by the CLI, exit 1, no TF_CONFIG
    set, nothing written."""
    from keras_cct.cli import main
    solver = _setup(tmp_path, max_iter=2, snapshot=1)
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert main(["train", "--solver", solver, "--snapshot-prefix", str(tmp_path / "s")]
                + extra) == 1
    err = capsys.readouterr().err
    assert err.startswith("cct train: error: ") and re.search(message, err), err
    assert "TF_CONFIG" not in os.environ
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_cluster_error_is_typed():
    from keras_cct import errors
    from keras_cct.strategy.cluster import ClusterError
    assert ClusterError is errors.ClusterError  # lives in keras_cct.errors with the others
    assert issubclass(ClusterError, errors.KerasCCTError) and issubclass(ClusterError, ValueError)
