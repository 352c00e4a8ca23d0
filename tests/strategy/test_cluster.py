"""CCTStrategy inside MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1.

The tests start real TF workers (``python -m tests.strategy.test_cluster worker ...``, the
``main`` below), each with its own CCTStrategy, and compare their final weights with a
single-process ``keras.layers.Conv2D`` model trained on the same global batches. Every process
is started in its own session and killed (with its children) when the test ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 300  # seconds a cluster run may take (TF start-up is slow on 2 busy cores)

# ---------------------------------------------------------------------------- shared problem

SHAPE = (10, 10, 3)
GLOBAL_BATCH = 6


def make_problem(path: Path, n: int = 22, seed: int = 0) -> None:
    """Data and initial weights, written once by the test and read by every process."""
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.standard_normal((n,) + SHAPE).astype("float32"),
             y=rng.integers(0, 3, n).astype("int64"),
             k1=(0.3 * rng.standard_normal((3, 3, 3, 6))).astype("float32"),
             b1=(0.1 * rng.standard_normal(6)).astype("float32"),
             k2=(0.3 * rng.standard_normal((3, 3, 6, 4))).astype("float32"),
             b2=(0.1 * rng.standard_normal(4)).astype("float32"),
             wd=(0.3 * rng.standard_normal((4, 3))).astype("float32"),
             bd=np.zeros(3, "float32"))


def build_model(problem, conv, mean_loss: bool = False):
    """conv1 -> relu -> conv2 (stride 2) -> global pool -> dense, with the problem's weights.
    ``mean_loss``: a model whose ``compute_loss`` override returns the local batch's mean loss
    times ``cluster.mean_loss_factor`` (what Caffe's loss layers need under the cluster)."""
    import keras
    inp = keras.Input(SHAPE)
    h = conv(6, 3, padding="same", activation="relu")(inp)
    h = conv(4, 3, strides=2, padding="valid")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = (_mean_loss_model_class() if mean_loss else keras.Model)(
        inp, keras.layers.Dense(3)(h))
    model.set_weights([problem[k] for k in ("k1", "b1", "k2", "b2", "wd", "bd")])
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _mean_loss_model_class():
    import keras
    from keras_cct.strategy import cluster

    class MeanLossModel(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, y_pred, from_logits=True))
            return loss * cluster.mean_loss_factor(sample_weight)

    return MeanLossModel


def global_batches(problem):
    import tensorflow as tf
    return tf.data.Dataset.from_tensor_slices((problem["x"], problem["y"])).batch(GLOBAL_BATCH)


# ---------------------------------------------------------------------------- worker program

def main(argv: Optional[List[str]] = None) -> int:
    """One worker: ``--index I --workers h:p,h:p --problem P.npz --out O.npz``."""
    p = argparse.ArgumentParser()
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--workers", required=True)
    p.add_argument("--problem", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--devices", default="tf:cpu:0")
    p.add_argument("--fractions", default=None, help="CCTStrategy split inside the worker")
    p.add_argument("--throughput", default="flops", help="'flops' or a number per worker")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mean-loss", action="store_true", help="compute_loss override model")
    p.add_argument("--loop-epochs", type=int, default=0,
                   help="then epochs of train_on_batch on cluster.local_slice (Caffe's loop)")
    p.add_argument("--backup", default=None, help="BackupAndRestore root")
    p.add_argument("--hang-at", default=None, help="EPOCH,BATCH: write OUT.hang then sleep")
    args = p.parse_args(argv)

    from keras_cct.strategy import cluster
    mwms = cluster.configure(args.workers, args.index)
    import keras
    from keras_cct import CCTStrategy, HybridConv2D

    problem = dict(np.load(args.problem))
    fractions = None if args.fractions is None else [float(v) for v in
                                                     args.fractions.split(",")]
    cct = CCTStrategy(args.devices.split(","), split=fractions or "flops", rebalance=False)
    with cluster.scope(mwms, cct):
        model = build_model(problem, lambda *a, **k: HybridConv2D(*a, lowering="type1", **k),
                            mean_loss=args.mean_loss)
    if args.throughput == "flops":
        rate = cluster.local_throughput(cct)
    else:
        rate = float(args.throughput.split(",")[args.index])
    shares = cluster.worker_shares(mwms, rate)
    data = cluster.distribute(mwms, global_batches(problem), shares)

    epochs_run: List[int] = []
    steps_done: List[int] = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)

        def on_train_batch_end(self, batch, logs=None):
            steps_done.append(batch)
            if args.hang_at and [epoch_of(), batch] == [int(v) for v in
                                                        args.hang_at.split(",")]:
                Path(args.out + ".hang").write_text(str(os.getpid()))
                time.sleep(3600)  # until the test kills this process

    def epoch_of():
        return epochs_run[-1]

    callbacks = [Record()]
    if args.backup:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(
            cluster.backup_dir(args.backup), save_freq="epoch", delete_checkpoint=False))
    t0 = time.perf_counter()
    model.fit(data, epochs=args.epochs, verbose=0, shuffle=False, callbacks=callbacks)
    for _ in range(args.loop_epochs):
        for start in range(0, len(problem["x"]), GLOBAL_BATCH):
            batch = (problem["x"][start:start + GLOBAL_BATCH],
                     problem["y"][start:start + GLOBAL_BATCH])
            model.train_on_batch(*cluster.local_slice(batch, shares, args.index))
            steps_done.append(start)
    seconds = time.perf_counter() - t0
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    np.savez(args.out, shares=shares, epochs_run=np.array(epochs_run),
             steps=np.array(len(steps_done)), seconds=np.array(seconds),
             report=np.array(json.dumps(cct.report())), **arrays)
    return 0


# ---------------------------------------------------------------------------- test helpers

def free_ports(n: int) -> List[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _env():
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Cluster:
    """Worker processes of one run; ``close()`` kills whatever is still alive."""

    def __init__(self, tmp: Path, name: str, workers: List[str], extra: List[List[str]]):
        self.procs = []
        self.outs = []
        for i, more in enumerate(extra):
            out = tmp / f"{name}-{i}.npz"
            log = open(tmp / f"{name}-{i}.log", "w")
            cmd = [sys.executable, "-m", "tests.strategy.test_cluster", "--index", str(i),
                   "--workers", ",".join(workers), "--out", str(out)] + more
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True))
            self.outs.append(out)
        self.logs = [tmp / f"{name}-{i}.log" for i in range(len(extra))]

    def log_tail(self, i: int, n: int = 3000) -> str:
        return self.logs[i].read_text(errors="replace")[-n:]

    def wait(self, timeout: float) -> List[Optional[int]]:
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the worker and its OpenCL child, by group id
            p.wait(30)

    def close(self) -> None:
        for i in range(len(self.procs)):
            try:
                self.kill(i)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass


@pytest.fixture
def cluster_run(tmp_path):
    import keras
    if keras.backend.backend() != "tensorflow":
        pytest.skip("MultiWorkerMirroredStrategy is TensorFlow's")
    runs = []

    def start(name, extra, ports=None):
        workers = [f"127.0.0.1:{p}" for p in (ports or free_ports(len(extra)))]
        run = Cluster(tmp_path, name, workers, extra)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()


def _finish(run, timeout=START_TIMEOUT):
    codes = run.wait(timeout)
    for i, code in enumerate(codes):
        assert code == 0, f"worker {i} exited with {code}:\n{run.log_tail(i)}"
    return [dict(np.load(o)) for o in run.outs]


def reference_weights(problem, epochs: int):
    """The same global batches in one process, with keras.layers.Conv2D (no keras_cct)."""
    import keras
    model = build_model(problem, keras.layers.Conv2D)
    model.fit(problem["x"], problem["y"], batch_size=GLOBAL_BATCH, epochs=epochs,
              shuffle=False, verbose=0)
    return model.get_weights()


def _assert_weights(result, expected):
    from tests import reference as ref
    got = [result[f"w{i}"] for i in range(len(expected))]
    for a, b in zip(got, expected):
        assert ref.rel_err(a, b) <= 1e-5, ref.rel_err(a, b)


def _opencl_available() -> bool:
    from keras_cct.devices import list_devices
    from tests.conftest import IN_CI
    names = [d.name for d in list_devices(calibrate=False) if d.is_opencl]
    if "opencl:0:0" not in names and IN_CI:
        pytest.fail("no OpenCL device: ci/test installs PoCL (pocl-opencl-icd)")
    return "opencl:0:0" in names


# ---------------------------------------------------------------------------- tests

def test_two_workers_unequal_shares_equal_single_process(cluster_run, tmp_path):
    """Worker 0 reports 3x worker 1's throughput: shares 0.75/0.25 (4+2 of each batch of 6,
    3+1 of the last batch of 4); each worker splits its slice across its own devices. One
    epoch of ``model.fit`` on ``cluster.distribute``, then one of ``train_on_batch`` on
    ``cluster.local_slice`` (the Caffe solver's loop)."""
    problem_path = tmp_path / "problem.npz"
    make_problem(problem_path)
    problem = dict(np.load(problem_path))
    devices, fractions = ("tf:cpu:0,opencl:0:0", "0.6,0.4") if _opencl_available() else \
        ("tf:cpu:0", "1")
    run = cluster_run("equal", [["--problem", str(problem_path), "--devices", devices,
                                 "--fractions", fractions, "--throughput", "3,1",
                                 "--epochs", "1", "--loop-epochs", "1"]] * 2)
    results = _finish(run)
    expected = reference_weights(problem, epochs=2)
    for r in results:
        np.testing.assert_allclose(r["shares"], [0.75, 0.25], rtol=1e-12)
        assert int(r["steps"]) == 8  # 4 steps (22 = 3 * 6 + 4) x 2 epochs on each worker
        _assert_weights(r, expected)
    # each worker's CCTStrategy really split its slices across its devices
    for r, last in zip(results, ([3], [1])):
        rows = json.loads(str(r["report"]))
        assert sum(row["images"] for row in rows if row["layer"] == rows[0]["layer"]) == \
            last[0]
        if "," in devices:
            assert len({row["device"] for row in rows}) == 2


def test_killed_worker_resumes_from_backup(cluster_run, tmp_path):
    """Worker 1 is SIGKILLed in the middle of epoch 2 of 3. The run is restarted on the same
    addresses with BackupAndRestore: it resumes at epoch 2 from the epoch-1 backup and ends
    with the weights of an uninterrupted run. The workers' model overrides ``compute_loss``
    with a local mean loss times ``cluster.mean_loss_factor`` (as Caffe's loss layers need),
    with shares 2:1 (4+2, then 3+1 images)."""
    problem_path = tmp_path / "problem.npz"
    make_problem(problem_path)
    problem = dict(np.load(problem_path))
    backup = tmp_path / "backup"
    common = ["--problem", str(problem_path), "--epochs", "3", "--backup", str(backup),
              "--throughput", "2,1", "--mean-loss"]
    ports = free_ports(2)
    run = cluster_run("crash", [common, common + ["--hang-at", "1,1"]], ports)
    marker = Path(str(run.outs[1]) + ".hang")
    end = time.monotonic() + START_TIMEOUT
    while not marker.exists():
        assert time.monotonic() < end, "worker 1 never reached epoch 2:\n" + run.log_tail(1)
        assert run.procs[1].poll() is None, run.log_tail(1)
        time.sleep(0.5)
    run.kill(1)
    assert run.procs[1].returncode == -signal.SIGKILL
    # the survivor cannot finish the step without its peer: TF's coordination service
    # notices the missing heartbeats and aborts the collective (here within seconds)
    survivor = run.wait(90)[0]
    run.close()
    assert survivor not in (None, 0), run.log_tail(0)
    assert "unhealthy" in run.log_tail(0, 20000), run.log_tail(0)
    assert not run.outs[0].exists()
    for i in range(2):
        meta = json.loads((backup / f"worker-{i}" / "training_metadata.json").read_text())
        assert meta["epoch"] == 1

    resumed = _finish(cluster_run("resume", [common, common], ports))
    expected = reference_weights(problem, epochs=3)
    for r in resumed:
        assert list(r["epochs_run"]) == [1, 2]  # epoch 0 was restored, not recomputed
        _assert_weights(r, expected)


def test_shares_and_slices_give_exact_global_weights():
    """In-process: the slices cover the batch in order and the weights make the replicas'
    Keras-scaled mean losses sum to the global mean."""
    from keras_cct.strategy import cluster
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((7, 2)), np.arange(7)
    losses = rng.random(7)
    shares = [0.5, 0.3, 0.2]
    parts = [cluster.local_slice((x, y), shares, i) for i in range(3)]
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    assert [len(p[1]) for p in parts] == list(cluster.split_sizes(7, shares)) == [4, 2, 1]
    total, lo = 0.0, 0
    for xi, yi, wi in parts:  # Keras: sum(w * l) / n_local, then / replicas
        li = losses[lo:lo + len(yi)]
        lo += len(yi)
        total += (wi * li).sum() / len(yi) / 3
    assert abs(total - losses.mean()) <= 1e-6 * losses.mean()  # float32 weights
    # a local-mean loss (Caffe's) times mean_loss_factor is n_local / n_global of it under 3
    # replicas (here, outside any strategy, the factor is not divided by 3: we do it)
    factors = [float(np.asarray(cluster.mean_loss_factor(wi))) / 3 for _, _, wi in parts]
    np.testing.assert_allclose(factors, np.array([4, 2, 1]) / 7, rtol=1e-6)
    assert cluster.mean_loss_factor(None) == 1.0
    # a Caffe net's batch: a dict of input blobs, labels included, no y
    blobs, none, w = cluster.local_slice({"data": x, "label": y}, shares, 1)
    assert none is None and list(blobs["label"]) == [4, 5]
    np.testing.assert_array_equal(blobs["data"], x[4:6])
    np.testing.assert_allclose(w, [3 * 2 / 7] * 2, rtol=1e-6)
    _, _, w = cluster.local_slice((x, y, np.full(7, 2.0)), shares, 1, loss_reduction="sum")
    np.testing.assert_array_equal(w, [2.0, 2.0])


def test_local_throughput_is_the_sum_of_calibrated_devices():
    import keras
    if keras.backend.backend() != "tensorflow":
        pytest.skip("tf:cpu:0 devices and TensorFlow's multi-worker composition")
    from keras_cct import CCTStrategy
    from keras_cct.devices import calibrate
    from keras_cct.strategy import cluster
    s = CCTStrategy(["tf:cpu:0"])
    assert cluster.local_throughput(s) == pytest.approx(calibrate("tf:cpu:0"))


@pytest.mark.parametrize("call, message", [
    (lambda c: c.tf_config("127.0.0.1:1,127.0.0.1:2", 2), "not in 0..1"),
    (lambda c: c.tf_config("127.0.0.1", 0), "not host:port"),
    (lambda c: c.tf_config(["a:70000"], 0), "port in 1..65535"),
    (lambda c: c.tf_config("a:1,a:1", 0), "listed twice"),
    (lambda c: c.tf_config("", 0), "empty"),
    (lambda c: c.split_sizes(4, [0, 0]), "not all zero"),
    (lambda c: c.local_slice((np.zeros(3),), [1], 0), "tuple \\(x, y\\)"),
    (lambda c: c.local_slice((np.zeros(3), np.zeros(3)), [1, 1], 2), "not in 0..1"),
    (lambda c: c.local_slice((np.zeros(3), np.zeros(3)), [1], 0, loss_reduction="mean"),
     "loss_reduction"),
])
def test_bad_cluster_descriptions(call, message):
    from keras_cct.strategy import cluster
    with pytest.raises(cluster.ClusterError, match=message):
        call(cluster)


def test_configure_refuses_a_missing_or_bad_cluster(monkeypatch):
    import keras
    if keras.backend.backend() != "tensorflow":
        pytest.skip("MultiWorkerMirroredStrategy is TensorFlow's")
    from keras_cct.strategy import cluster
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(cluster.ClusterError, match="no cluster given"):
        cluster.configure()
    with pytest.raises(cluster.ClusterError, match="`replica_device` must be"):
        cluster.configure(["127.0.0.1:1"], 0, replica_device="tpu")
    with pytest.raises(cluster.ClusterError, match="`worker_index` is required"):
        cluster.configure(["127.0.0.1:1", "127.0.0.1:2"])
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"chief": ["a:1"]}}')
    with pytest.raises(cluster.ClusterError, match="TF_CONFIG is not a worker cluster"):
        cluster.configure()


def test_tf_config_is_the_cluster_description():
    from keras_cct.strategy import cluster
    assert cluster.tf_config(["10.0.0.1:2222", "[::1]:2223"], 1) == {
        "cluster": {"worker": ["10.0.0.1:2222", "[::1]:2223"]},
        "task": {"type": "worker", "index": 1}}


if __name__ == "__main__":
    sys.exit(main())
