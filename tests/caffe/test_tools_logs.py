"""`cct plot-log`: parse_log.py's CSVs (same columns, same row rules) of a real Caffe glog log
and of a `cct train` log, and plot_training_log.py-like curves."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from keras_cct.cli import main
from tests.caffe.caffe_numpy import caffe_rate
from tests.caffe.test_train import _conv_setup

# A Caffe log as glog writes it (caffe train 2>&1 | tee); values chosen by hand.
CAFFE_LOG = """\
I1203 09:59:58.000000 12345 caffe.cpp:218] Using GPUs 0
I1203 09:59:59.000000 12345 solver.cpp:44] Initializing solver from parameters:
test_iter: 100
I1203 10:00:01.000000 12345 net.cpp:255] Network initialization done.
I1203 10:00:02.000000 12345 solver.cpp:337] Solving LeNet
I1203 10:00:02.000100 12345 solver.cpp:338] Learning Rate Policy: inv
I1203 10:00:02.100000 12345 solver.cpp:404] Iteration 0, Testing net (#0)
I1203 10:00:03.000000 12345 solver.cpp:471]     Test net output #0: accuracy = 0.0823
I1203 10:00:03.000000 12345 solver.cpp:471]     Test net output #1: loss = 2.3091 (* 1 = 2.3091 loss)
I1203 10:00:03.100000 12345 solver.cpp:218] Iteration 0 (0 iter/s, 1.1s/100 iters), loss = 2.2961
I1203 10:00:03.100000 12345 solver.cpp:237]     Train net output #0: loss = 2.2961 (* 1 = 2.2961 loss)
I1203 10:00:03.100000 12345 sgd_solver.cpp:105] Iteration 0, lr = 0.01
I1203 10:00:05.100000 12345 solver.cpp:218] Iteration 100 (50 iter/s, 2s/100 iters), loss = 0.2103
I1203 10:00:05.100000 12345 solver.cpp:237]     Train net output #0: loss = 0.2103 (* 1 = 0.2103 loss)
I1203 10:00:05.100000 12345 sgd_solver.cpp:105] Iteration 100, lr = 0.00992565
I1203 10:00:07.000000 12345 solver.cpp:404] Iteration 200, Testing net (#0)
I1203 10:00:08.000000 12345 solver.cpp:471]     Test net output #0: accuracy = 0.9512
I1203 10:00:08.000000 12345 solver.cpp:471]     Test net output #1: loss = 0.1587 (* 1 = 0.1587 loss)
I1203 10:00:08.200000 12345 solver.cpp:218] Iteration 200 (52.6 iter/s, 1.9s/100 iters), loss = 1.5e-1
I1203 10:00:08.200000 12345 solver.cpp:237]     Train net output #0: loss = 1.5e-1 (* 1 = 0.15 loss)
I1203 10:00:08.200000 12345 sgd_solver.cpp:105] Iteration 200, lr = 0.00985258
I1203 10:00:08.300000 12345 solver.cpp:454] Snapshotting to binary proto file lenet_iter_200.caffemodel
I1203 10:00:08.400000 12345 solver.cpp:310] Optimization Done.
"""


def _read(path):
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    return rows[0], [[float(v) for v in r] for r in rows[1:]]


def test_caffe_glog_log_gives_parse_log_rows(tmp_path, capsys):
    log = tmp_path / "lenet.log"
    log.write_text(CAFFE_LOG)
    assert main(["plot-log", str(log), str(tmp_path / "out")]) == 0
    head, train = _read(tmp_path / "out" / "lenet.log.train")
    assert head == ["NumIters", "Seconds", "LearningRate", "loss"]
    # parse_log.py's rules by hand: seconds from the "Solving" line; a row takes the last
    # "lr =" seen before it (Caffe logs it after the outputs); the first row the second's rate
    expected = [[0, 1.1, 0.01, 2.2961], [100, 3.1, 0.01, 0.2103],
                [200, 6.2, 0.00992565, 0.15]]
    np.testing.assert_allclose(train, expected, rtol=1e-9, atol=1e-9)
    head, test = _read(tmp_path / "out" / "lenet.log.test")
    assert head == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    np.testing.assert_allclose(test, [[0, 1.0, 0.00992565, 0.0823, 2.3091],
                                      [200, 6.0, 0.00992565, 0.9512, 0.1587]], atol=1e-9)
    from PIL import Image
    with Image.open(tmp_path / "out" / "lenet.log.png") as im:
        assert im.format == "PNG" and im.size[0] >= 400 and im.size[1] >= 200


def test_cct_train_log_parses_into_the_same_columns(tmp_path, capsys):
    solver = _conv_setup(tmp_path, max_iter=6, snapshot=0)
    # Caffe's single-dash spelling, pasted as a caffe command line
    assert main(["train", "-solver", solver, "-gpu", "0"]) == 0
    captured = capsys.readouterr()
    assert "-gpu 0 ignored" in captured.err
    log = tmp_path / "train.log"
    log.write_text(captured.out)
    assert main(["plot-log", str(log), "--png", str(tmp_path / "curves.png"),
                 "--x", "seconds"]) == 0
    head, train = _read(str(log) + ".train")
    assert head == ["NumIters", "Seconds", "LearningRate", "loss"]
    # the log's own numbers, read here with plain string splitting
    lines = captured.out.splitlines()
    losses = [float(l.split("loss = ")[1].split()[0]) for l in lines
              if "Train net output #0: loss = " in l]
    assert [r[0] for r in train] == [0, 2, 4]  # display: 2, max_iter: 6
    np.testing.assert_allclose([r[3] for r in train], losses, rtol=1e-9)
    # inv policy (base_lr 0.05, gamma 0.1, power 0.75): a row shows the previous display's rate
    rate = [caffe_rate("inv", it, 0.05, gamma=0.1, power=0.75) for it in (0, 2)]
    np.testing.assert_allclose([r[2] for r in train], [rate[0], rate[0], rate[1]], rtol=1e-5)
    lapses = [float(l.split(", ")[1].split("s/")[0]) for l in lines
              if l.startswith("Iteration ") and "iters)" in l]
    np.testing.assert_allclose([r[1] for r in train], [0.0] + list(np.cumsum(lapses)),
                               rtol=1e-9)
    head, test = _read(str(log) + ".test")
    assert head == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    acc = [float(l.split("= ")[1]) for l in lines if "Test net output #0: accuracy" in l]
    assert [r[0] for r in test] == [4] and math.isclose(test[0][3], acc[0])
    from PIL import Image
    with Image.open(tmp_path / "curves.png") as im:
        assert im.size[0] >= 400


def test_plot_log_errors_are_one_line(tmp_path, capsys):
    assert main(["plot-log", str(tmp_path / "missing.log")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.log" in err and "cannot read" in err
    (tmp_path / "x.log").write_text("hello\nno iterations here\n")
    assert main(["plot-log", str(tmp_path / "x.log")]) == 1
    err = capsys.readouterr().err.strip()
    assert "not a training log" in err and not list(tmp_path.glob("x.log.*"))


@pytest.mark.parametrize("effect", ["stop"])
def test_sigint_effect_values_are_checked(effect, capsys):
    from keras_cct.caffe.tools.signals import SignalHandler
    from keras_cct.errors import KerasCCTError
    h = SignalHandler(effect, "snapshot")
    assert h.requested_action() == "none"
    with pytest.raises(KerasCCTError, match="use snapshot, stop or none"):
        SignalHandler("halt")
    with pytest.raises(SystemExit):
        main(["train", "-solver", "s.prototxt", "-sigint_effect", "halt"])
    assert "invalid choice" in capsys.readouterr().err
