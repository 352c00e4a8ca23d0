"""The Caffe training loop: solver files, updates through whole nets, snapshots and resume,
the real cifar10_quick solverstate, the CLI, and bad inputs."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from keras_cct.caffe.io.binary import blob_to_array, read_caffemodel, read_solverstate
from keras_cct.caffe.io.lmdb_io import write_arrays
from keras_cct.caffe.train.config import read_solver
from keras_cct.caffe.train.solver import load_solver
from keras_cct.errors import CaffeFormatError, DataError
from tests.caffe.caffe_numpy import NumpyCaffeSolver, caffe_rate
from tests.conftest import need_shared

IP_NET = """
name: "tiny_ip"
layer { name: "feed" type: "MemoryData" top: "data" top: "target"
        memory_data_param { batch_size: 4 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""

CONV_NET = """
name: "tiny_conv"
layer { name: "d" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        transform_param { scale: 0.0039 crop_size: 6 mirror: true }
        data_param { source: "train_lmdb" batch_size: 5 backend: LMDB } }
layer { name: "d" type: "Data" top: "data" top: "label" include { phase: TEST }
        transform_param { scale: 0.0039 crop_size: 6 }
        data_param { source: "train_lmdb" batch_size: 6 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "acc" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy"
        include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


def _write(path, text):
    path.write_text(text)
    return str(path)


def _ip_arrays():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32)


@pytest.mark.parametrize("solver_type,extra", [("SGD", "momentum: 0.9"),
                                               ("AdaDelta", "momentum: 0.95 delta: 1e-6")])
def test_solver_file_matches_numpy_caffe(tmp_path, solver_type, extra):
    """InnerProduct + EuclideanLoss through load_solver: lr_mult/decay_mult from the
    prototxt, weight decay, step policy, cycling MemoryData batches; weights after 5 steps
    equal numpy's Caffe, and the solverstate's history equals numpy's history."""
    _write(tmp_path / "net.prototxt", IP_NET)
    solver = _write(tmp_path / "solver.prototxt", f"""
        net: "net.prototxt" type: "{solver_type}" {extra}
        base_lr: 0.1 lr_policy: "step" gamma: 0.5 stepsize: 2 weight_decay: 0.01
        max_iter: 5 display: 0 snapshot_after_train: true
        snapshot_prefix: "{tmp_path}/snap" random_seed: 3""")
    x, t = _ip_arrays()
    s = load_solver(solver, arrays={"data": x, "target": t}, log=lambda line: None)
    from keras_cct.caffe.net.weights import keras_layer_to_blobs  # the importer's Caffe layout
    w0, b0 = keras_layer_to_blobs(s.train_net.model.get_layer("ip"))  # (3, 4), (3,)
    assert w0.shape == (3, 4)
    ref = NumpyCaffeSolver([w0, b0], solver_type, weight_decay=0.01, lr_mults=[1.0, 2.0],
                           decay_mults=[1.0, 0.0], **({"momentum": 0.9} if solver_type == "SGD"
                                                      else {"momentum": 0.95, "delta": 1e-6}))
    s.solve()
    for it in range(5):
        rows = [(4 * it + k) % 8 for k in range(4)]
        xb, tb = x[rows].astype(np.float64), t[rows].astype(np.float64)
        W, b = ref.w
        dy = (xb @ W.T + b - tb) / 4  # EuclideanLoss: sum(d^2) / (2N)
        ref.apply_update([dy.T @ xb, dy.sum(0)], caffe_rate("step", it, 0.1, gamma=0.5,
                                                             stepsize=2))
    model = read_caffemodel(tmp_path / "snap_iter_5.caffemodel")
    ip = [lp for lp in model.layer if lp.name == "ip"][0]
    np.testing.assert_allclose(blob_to_array(ip.blobs[0]), ref.w[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(blob_to_array(ip.blobs[1]), ref.w[1], atol=1e-5, rtol=1e-5)
    state = read_solverstate(tmp_path / "snap_iter_5.solverstate")
    assert state.iter == 5 and state.learned_net.endswith("snap_iter_5.caffemodel")
    hist = [blob_to_array(h) for h in state.history]
    want = ref.history + (ref.update_history if solver_type == "AdaDelta" else [])
    assert len(hist) == len(want)
    for h, w in zip(hist, want):
        np.testing.assert_allclose(h, w, atol=1e-5, rtol=1e-5)


def _conv_setup(tmp_path, max_iter=6, snapshot=3, prefix="run"):
    if not (tmp_path / "train_lmdb").exists():
        rng = np.random.default_rng(1)
        write_arrays(tmp_path / "train_lmdb",
                     rng.integers(0, 256, size=(13, 8, 8, 1), dtype=np.uint8),
                     rng.integers(0, 3, size=13))
    if not (tmp_path / "net.prototxt").exists():
        _write(tmp_path / "net.prototxt", CONV_NET)
    return _write(tmp_path / f"{prefix}_solver.prototxt", f"""
        net: "net.prototxt" test_iter: 2 test_interval: 4 test_initialization: false
        base_lr: 0.05 momentum: 0.9 weight_decay: 0.001 lr_policy: "inv" gamma: 0.1
        power: 0.75 display: 2 max_iter: {max_iter} snapshot: {snapshot}
        snapshot_prefix: "{tmp_path}/{prefix}" random_seed: 7""")


def test_snapshot_resume_equals_uninterrupted_run(tmp_path):
    lines = []
    s1 = load_solver(_conv_setup(tmp_path), log=lines.append)
    s1.solve()
    assert any(line.startswith("Iteration 2 (") and "loss = " in line for line in lines)
    assert any("Test net output #0: accuracy = " in line for line in lines)
    assert "Optimization Done." in lines
    state3 = read_solverstate(tmp_path / "run_iter_3.solverstate")
    assert state3.iter == 3
    # history in Caffe's layout: conv (O, I, kh, kw), bias, ip (O, K), bias
    assert [tuple(h.shape.dim) for h in state3.history] == [(4, 1, 3, 3), (4,), (3, 64), (3,)]
    s2 = load_solver(_conv_setup(tmp_path, prefix="resumed"), log=lines.append)
    s2.snapshot_prefix = str(tmp_path / "resumed")
    s2.solve(resume_file=str(tmp_path / "run_iter_3.solverstate"))
    a = read_caffemodel(tmp_path / "run_iter_6.caffemodel")
    b = read_caffemodel(tmp_path / "resumed_iter_6.caffemodel")
    for la, lb in zip(a.layer, b.layer):
        for x, y in zip(la.blobs, lb.blobs):
            np.testing.assert_allclose(blob_to_array(y), blob_to_array(x), atol=1e-6)
    ha = read_solverstate(tmp_path / "run_iter_6.solverstate").history
    hb = read_solverstate(tmp_path / "resumed_iter_6.solverstate").history
    for x, y in zip(ha, hb):
        np.testing.assert_allclose(blob_to_array(y), blob_to_array(x), atol=1e-6)
    # the weights moved: the test is not comparing two untrained nets
    first = read_caffemodel(tmp_path / "run_iter_3.caffemodel")
    assert np.abs(blob_to_array(first.layer[0].blobs[0]) -
                  blob_to_array(a.layer[0].blobs[0])).max() > 1e-4


def test_interrupted_snapshot_leaves_previous_intact(tmp_path, monkeypatch):
    s = load_solver(_conv_setup(tmp_path, max_iter=6, snapshot=3), log=lambda line: None)
    s.step(3)  # writes run_iter_3.*
    before = {n: (tmp_path / n).read_bytes() for n in ("run_iter_3.caffemodel",
                                                        "run_iter_3.solverstate")}

    def killed(fd):
        raise OSError("killed during the snapshot")
    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(OSError, match="killed"):
        s.step(3)
    monkeypatch.undo()
    names = sorted(os.listdir(tmp_path))
    assert not any("iter_6" in n or ".tmp" in n for n in names), names
    for n, data in before.items():
        assert (tmp_path / n).read_bytes() == data
    assert read_solverstate(tmp_path / "run_iter_3.solverstate").iter == 3


def test_cifar10_quick_solverstate_resumes():
    """Caffe's own cifar10_quick snapshot (V1 net, legacy 4-D blobs): the solverstate's
    iteration, weights and momentum history load, and the next SGD step uses that history:
    with equal weights and batch, w(resumed) - w(zero history) = -momentum * history."""
    folder = need_shared("caffe-models", "cifar10_quick_v1")
    state_path = str(folder / "cifar10_quick_iter_5000.solverstate")
    rng = np.random.default_rng(0)
    x = rng.uniform(-30, 30, size=(100, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=100).astype(np.float32)
    arrays = {"data": x, "label": y}
    solver = str(folder / "cifar10_quick_solver.prototxt")
    s = load_solver(solver, arrays=arrays, test_arrays=arrays, log=lambda line: None)
    s.restore(state_path)
    assert s.iter == 5000
    state = read_solverstate(state_path)
    raw = [blob_to_array(h) for h in state.history]
    assert len(raw) == 10
    got = s.history_blobs()
    for r, g in zip(raw, got):
        np.testing.assert_array_equal(g.reshape(r.shape), r)
    weights = read_caffemodel(folder / "cifar10_quick_iter_5000.caffemodel")
    conv1 = [lp for lp in weights.layer if lp.name == "conv1"][0]
    k = s.train_net.model.get_layer("conv1").get_weights()[0]
    np.testing.assert_array_equal(k.transpose(3, 2, 0, 1),
                                  blob_to_array(conv1.blobs[0]).reshape(32, 3, 5, 5))
    from keras_cct.caffe.net.weights import keras_layer_to_blobs  # the importer's Caffe layout

    def ip2_blobs(solver):
        return keras_layer_to_blobs(solver.train_net.model.get_layer("ip2"))
    w_before = ip2_blobs(s)
    s.param.test_interval = 0
    s.param.snapshot = 0
    s.step(1)
    w_resumed = ip2_blobs(s)
    s2 = load_solver(solver, arrays=arrays, test_arrays=arrays, log=lambda line: None)
    s2.param.test_interval = 0
    s2.param.snapshot = 0
    s2.load_weights(str(folder / "cifar10_quick_iter_5000.caffemodel"))
    s2.iter = 5000
    s2.step(1)
    w_fresh = ip2_blobs(s2)
    h_ip2 = [raw[8].reshape(10, 64), raw[9].reshape(10)]
    for a, b, h, w0 in zip(w_resumed, w_fresh, h_ip2, w_before):
        assert np.abs(h).max() > 0
        np.testing.assert_allclose(a - b, -0.9 * h, atol=1e-6 + 1e-4 * np.abs(h).max())
        assert not np.allclose(a, w0)


def test_bad_solver_inputs(tmp_path):
    _write(tmp_path / "net.prototxt", IP_NET)
    with pytest.raises(CaffeFormatError, match=r"s1.prototxt: the solver names no net"):
        read_solver(_write(tmp_path / "s1.prototxt", "base_lr: 0.1"))
    with pytest.raises(CaffeFormatError, match=r"s2.prototxt: unknown lr_policy 'cosine'"):
        read_solver(_write(tmp_path / "s2.prototxt", 'net: "net.prototxt" lr_policy: "cosine"'))
    with pytest.raises(CaffeFormatError, match=r"s3.prototxt: unknown solver type 'Lion'"):
        read_solver(_write(tmp_path / "s3.prototxt", 'net: "net.prototxt" type: "Lion"'))
    with pytest.raises(CaffeFormatError, match=r"s4.prototxt.*'missing.prototxt' was not found"):
        read_solver(_write(tmp_path / "s4.prototxt", 'net: "missing.prototxt"'))
    with pytest.raises(CaffeFormatError, match=r"s5.prototxt:1:.*syntax error"):
        read_solver(_write(tmp_path / "s5.prototxt", 'net: "net.prototxt" base_lr: {'))
    cfg = read_solver(_write(tmp_path / "s6.prototxt", 'net: "net.prototxt" solver_type: ADAM'))
    assert cfg.solver_type == "Adam"
    with pytest.raises(DataError, match=r"MemoryData layer needs arrays"):
        load_solver(str(tmp_path / "s6.prototxt"), log=lambda line: None)


def test_snapshot_from_another_net_is_refused(tmp_path):
    _write(tmp_path / "net.prototxt", IP_NET)
    x, t = _ip_arrays()
    solver = _write(tmp_path / "s.prototxt", f"""net: "net.prototxt" base_lr: 0.1
        max_iter: 1 momentum: 0.9 snapshot_prefix: "{tmp_path}/ip" """)
    s = load_solver(solver, arrays={"data": x, "target": t}, log=lambda line: None)
    s.solve()
    (tmp_path / "conv").mkdir()
    conv = load_solver(_conv_setup(tmp_path / "conv"), log=lambda line: None)
    w = conv.train_net.model.get_layer("conv1").get_weights()[0].copy()
    with pytest.raises(CaffeFormatError, match=r"ip_iter_1.solverstate.*2 history blobs.*4 "):
        conv.restore(str(tmp_path / "ip_iter_1.solverstate"))
    np.testing.assert_array_equal(conv.train_net.model.get_layer("conv1").get_weights()[0], w)
    (tmp_path / "trunc.solverstate").write_bytes(
        (tmp_path / "ip_iter_1.solverstate").read_bytes()[:-7])
    with pytest.raises(CaffeFormatError, match=r"trunc.solverstate.*not a valid solverstate"):
        s.restore(str(tmp_path / "trunc.solverstate"))


def test_cct_data_train_test_time_cli(tmp_path, capsys):
    """`cct data` from arrays, `cct train` end to end in a subprocess, `cct test`/`cct time`."""
    from keras_cct.cli import main
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "arr.npz", images=rng.integers(0, 256, size=(13, 8, 8, 1),
                                                         dtype=np.uint8),
             labels=rng.integers(0, 3, size=13))
    assert main(["data", str(tmp_path / "arr.npz"), str(tmp_path / "train_lmdb"),
                 "--mean", str(tmp_path / "mean.binaryproto")]) == 0
    assert "Processed 13 files." in capsys.readouterr().out
    from keras_cct.caffe.io.binary import read_binaryproto
    mean = blob_to_array(read_binaryproto(tmp_path / "mean.binaryproto"))
    np.testing.assert_allclose(mean[0, 0], np.load(tmp_path / "arr.npz")["images"]
                               .mean(axis=0)[:, :, 0], rtol=1e-6)
    solver = _conv_setup(tmp_path, max_iter=4, snapshot=0)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run([sys.executable, "-m", "keras_cct.cli", "train", "--solver", solver],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Iteration 0, loss = " in out and "Iteration 2, lr = " in out
    assert "Iteration 4, Testing net (#0)" in out and "Optimization Done." in out
    assert "images/s" in out and (tmp_path / "run_iter_4.solverstate").exists()
    assert main(["test", "--model", str(tmp_path / "net.prototxt"), "--weights",
                 str(tmp_path / "run_iter_4.caffemodel"), "--iterations", "2"]) == 0
    assert main(["time", "--model", str(tmp_path / "net.prototxt"), "--iterations",
                 "2"]) == 0
    text = capsys.readouterr().out
    assert "Batch 1, accuracy = " in text and "\naccuracy = " in text
    assert "conv1\tforward:" in text and "[lowering: " in text and "conv1\tforward-backward:" in text
    assert "images/s" in text
    assert main(["train", "--solver", str(tmp_path / "nope.prototxt")]) == 1
    err = capsys.readouterr().err
    assert "nope.prototxt" in err and "not found" in err


def test_train_net_and_separate_test_net(tmp_path):
    """Caffe's older solver style: train_net + test_net files."""
    _write(tmp_path / "net.prototxt", IP_NET)
    x, t = _ip_arrays()
    solver = _write(tmp_path / "s.prototxt", f"""train_net: "net.prototxt"
        test_net: "net.prototxt" test_iter: 2 test_interval: 2 base_lr: 0.01 max_iter: 2
        snapshot_after_train: false snapshot_prefix: "{tmp_path}/x" """)
    lines = []
    s = load_solver(solver, arrays={"data": x, "target": t},
                    test_arrays={"data": x, "target": t}, log=lines.append)
    s.solve()
    assert "Iteration 2, Testing net (#0)" in lines
    out = [line for line in lines if "Test net output #0: loss = " in line]
    assert len(out) == 2  # at iteration 0 and 2
    # the test loss is the EuclideanLoss of the current weights on the first two batches
    from keras_cct.caffe.net.weights import keras_layer_to_blobs
    W, b = keras_layer_to_blobs(s.train_net.model.get_layer("ip"))
    want = np.mean([np.sum((x[r] @ W.T + b - t[r]) ** 2) / 8 for r in (slice(0, 4),
                                                                       slice(4, 8))])
    got = float(out[-1].split("loss = ")[1].split()[0])
    assert got == pytest.approx(want, rel=1e-4)
    assert not list(tmp_path.glob("x_iter_*"))


SIGMOID_NET = IP_NET.replace('name: "tiny_ip"', 'name: "tiny_sigmoid"').replace(
    'type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss"',
    'type: "SigmoidCrossEntropyLoss" bottom: "ip" bottom: "target" top: "cross_entropy_loss"')


def test_sigmoid_cross_entropy_net_trains(tmp_path):
    """A net whose loss is SigmoidCrossEntropyLoss (mnist_autoencoder's) trains: each
    iteration's loss and the weights after 5 SGD steps equal numpy float64 Caffe (loss
    ``-sum(t x - max(x, 0) - log(1 + exp(-|x|))) / N`` with Caffe's default BATCH_SIZE
    normalization for this layer, gradient ``(sigmoid(x) - t) / N``), and the loss falls."""
    _write(tmp_path / "net.prototxt", SIGMOID_NET)
    solver = _write(tmp_path / "solver.prototxt", f"""
        net: "net.prototxt" type: "SGD" momentum: 0.9 base_lr: 0.5 lr_policy: "fixed"
        max_iter: 5 display: 1 snapshot_after_train: true
        snapshot_prefix: "{tmp_path}/snap" random_seed: 5""")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    t = (rng.random(size=(8, 3)) < 0.5).astype(np.float32)
    lines = []
    s = load_solver(solver, arrays={"data": x, "target": t}, log=lines.append)
    from keras_cct.caffe.net.weights import keras_layer_to_blobs  # the importer's Caffe layout
    w0, b0 = keras_layer_to_blobs(s.train_net.model.get_layer("ip"))
    ref = NumpyCaffeSolver([w0, b0], "SGD", momentum=0.9, lr_mults=[1.0, 2.0])
    s.solve()
    want_losses = []
    for it in range(5):
        rows = [(4 * it + k) % 8 for k in range(4)]
        xb, tb = x[rows].astype(np.float64), t[rows].astype(np.float64)
        W, b = ref.w
        logits = xb @ W.T + b
        want_losses.append(-np.sum(tb * logits - np.maximum(logits, 0)
                                   - np.log1p(np.exp(-np.abs(logits)))) / 4)
        dy = (1.0 / (1.0 + np.exp(-logits)) - tb) / 4
        ref.apply_update([dy.T @ xb, dy.sum(0)], 0.5)
    got_losses = [float(line.split("loss = ")[1]) for line in lines
                  if line.startswith("Iteration") and "loss = " in line]
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4)
    model = read_caffemodel(tmp_path / "snap_iter_5.caffemodel")
    ip = [lp for lp in model.layer if lp.name == "ip"][0]
    np.testing.assert_allclose(blob_to_array(ip.blobs[0]), ref.w[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(blob_to_array(ip.blobs[1]), ref.w[1], atol=1e-5, rtol=1e-5)
    s.step(30)
    assert s.smoothed_loss < want_losses[0]
