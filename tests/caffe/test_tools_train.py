"""`cct train` as `caffe train`: SIGINT/SIGHUP effects (a complete snapshot, exit status 0),
`-weights a,b` (Caffe's CopyLayers, in order), `-stage`/`-level`, and Caffe's single-dash
command lines for train, test and time."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.binary import array_to_blob, blob_to_array, read_caffemodel, \
    read_solverstate
from keras_cct.caffe.train.solver import load_solver
from keras_cct.cli import main
from tests.caffe.test_train import CONV_NET, _conv_setup

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")


def _blobs(path):
    return {lp.name: [blob_to_array(b) for b in lp.blobs]
            for lp in read_caffemodel(path).layer if len(lp.blobs)}


def test_sighup_snapshots_and_sigint_stops_with_a_complete_snapshot(tmp_path):
    solver = _conv_setup(tmp_path, max_iter=100000, snapshot=0)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen([sys.executable, "-m", "keras_cct.cli", "train", "-solver", solver],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path, bufsize=1)
    killer = threading.Timer(400, proc.kill)
    killer.start()
    lines, sent = [], []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not sent and line.startswith("Iteration 4 ("):
                proc.send_signal(signal.SIGHUP)  # snapshot, go on
                sent.append("HUP")
            elif sent == ["HUP"] and "Snapshotting solver state" in line:
                proc.send_signal(signal.SIGINT)  # default: stop (then the final snapshot)
                sent.append("INT")
        rc = proc.wait()
        err = proc.stderr.read()
    finally:
        killer.cancel()
        proc.kill()
    assert rc == 0, err[-2000:]
    assert sent == ["HUP", "INT"], lines[-10:]
    assert "Optimization stopped early." in lines and "Optimization Done." not in lines
    iters = sorted(int(l.split("_iter_")[1].split(".")[0]) for l in lines
                   if l.startswith("Snapshotting solver state"))
    assert len(iters) == 2 and 4 <= iters[0] < iters[1] < 100000, iters
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    last = tmp_path / f"run_iter_{iters[1]}"
    state = read_solverstate(str(last) + ".solverstate")
    assert state.iter == iters[1] and len(state.history) == 4
    # the solver restores it: weights, history and iteration
    s = load_solver(_conv_setup(tmp_path, max_iter=100000, snapshot=0, prefix="again"),
                    log=lambda line: None)
    s.restore(str(last) + ".solverstate")
    assert s.iter == iters[1]
    conv = s.train_model.net.get_layer("conv1").get_weights()[0]  # (kh, kw, in, out)
    want = _blobs(str(last) + ".caffemodel")["conv1"][0]  # (out, in, kh, kw)
    np.testing.assert_allclose(conv.transpose(3, 2, 0, 1), want, rtol=1e-6)
    hist = [blob_to_array(h) for h in state.history]
    np.testing.assert_allclose(s.history_blobs()[0], hist[0], rtol=1e-6)


def _caffemodel(path, layers):
    net = proto.NetParameter(name="w")
    for name, arrays in layers.items():
        lp = net.layer.add(name=name, type="Convolution" if name == "conv1" else
                           "InnerProduct")
        for a in arrays:
            array_to_blob(a, blob=lp.blobs.add())
    path.write_bytes(net.SerializeToString())
    return str(path)


def test_weights_a_b_copied_in_order(tmp_path, capsys):
    rng = np.random.default_rng(5)
    a = {"conv1": [rng.normal(size=(4, 1, 3, 3)), rng.normal(size=4)],
         "ip1": [rng.normal(size=(3, 64)), rng.normal(size=3)]}
    b = {"ip1": [rng.normal(size=(3, 64)), rng.normal(size=3)]}
    wa, wb = _caffemodel(tmp_path / "a.caffemodel", a), _caffemodel(tmp_path / "b.caffemodel", b)
    solver = _conv_setup(tmp_path, max_iter=0, snapshot=0)  # Solve(): the final snapshot only
    assert main(["train", "-solver", solver, "-weights", f"{wa},{wb}"]) == 0
    out = capsys.readouterr().out
    assert f"Finetuning from {wa}" in out and f"Finetuning from {wb}" in out
    got = _blobs(tmp_path / "run_iter_0.caffemodel")
    for i in range(2):
        np.testing.assert_allclose(got["conv1"][i], a["conv1"][i], rtol=1e-6)
        np.testing.assert_allclose(got["ip1"][i], b["ip1"][i], rtol=1e-6)  # b over a
    assert main(["train", "-solver", solver, "-weights", f"{wa},{tmp_path}/nope.caffemodel"]
                ) == 1
    err = capsys.readouterr().err
    assert "nope.caffemodel" in err and "weights file not found" in err


ZERO = """layer { name: "zero" type: "Power" bottom: "ip1" top: "ip1" power_param { scale: 0 }
        include { phase: TRAIN stage: "zero" min_level: 1 } }
layer { name: "acc" """


def _train_losses(text):
    return [float(l.split("loss = ")[1].split()[0]) for l in text.splitlines()
            if "Train net output #0: loss = " in l]


def test_stage_and_level_select_the_train_layers(tmp_path, capsys):
    solver = _conv_setup(tmp_path, max_iter=3, snapshot=0)
    (tmp_path / "net.prototxt").write_text(CONV_NET.replace('layer { name: "acc" ', ZERO))
    # -stage alone: the layer needs level 1, so it is left out
    assert main(["train", "-solver", solver, "-stage", "zero"]) == 0
    losses = _train_losses(capsys.readouterr().out)
    assert losses and not any(math.isclose(v, math.log(3), rel_tol=1e-5) for v in losses)
    # with -level 1 the logits are 0: Caffe's softmax loss is log(3) at every iteration
    assert main(["train", "--solver=" + solver, "-stage=zero", "-level", "1"]) == 0
    losses = _train_losses(capsys.readouterr().out)
    assert losses and all(math.isclose(v, math.log(3), rel_tol=1e-5) for v in losses)
    # cct test builds the net at the level given too
    for level, zero in ((1, True), (0, False)):
        assert main(["test", "-model", str(tmp_path / "net.prototxt"), "-phase", "TRAIN",
                     "-weights", str(tmp_path / "run_iter_3.caffemodel"),
                     "-stage", "zero", "-level", str(level), "-iterations", "1"]) == 0
        out = capsys.readouterr().out
        loss = float(out.split("loss = ")[-1].split()[0])
        assert math.isclose(loss, math.log(3), rel_tol=1e-5) == zero, out


def test_caffe_test_and_time_command_lines(tmp_path, capsys):
    solver = _conv_setup(tmp_path, max_iter=2, snapshot=0)
    assert main(["train", "-solver", solver]) == 0
    capsys.readouterr()
    weights = str(tmp_path / "run_iter_2.caffemodel")
    net = str(tmp_path / "net.prototxt")
    assert main(["test", "-model", net, "-weights", weights, "-iterations", "2",
                 "-gpu", "0"]) == 0
    out = capsys.readouterr().out
    assert "Batch 1, accuracy = " in out
    assert main(["time", "-model", net, "-weights", weights, "-iterations", "1",
                 "--no-layers"]) == 0
    assert "Average Forward pass" in capsys.readouterr().out
