"""The embedded demo (examples/train_lenet_digits.py), shortened: LeNet from Caffe's files on
the scikit-learn digits through `cct data`, snapshot and accuracy check."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_lenet_digits_demo_short(tmp_path, capsys):
    import keras
    if keras.backend.backend() != "tensorflow":
        pytest.skip("ci/demo runs the demo on the TensorFlow backend; the training code on "
                    "the other backends is covered by tests/caffe/test_train.py")
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" /
                                                  "train_lenet_digits.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    rc = demo.main(["--workdir", str(tmp_path), "--max-iter", "200", "--min-accuracy", "0.9"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Processed 1397 files." in out and "Processed 400 files." in out
    acc = float(out.split("Test accuracy: ")[1].split()[0])
    assert acc >= 0.9
    assert "images/s" in out
    assert (tmp_path / "lenet_digits_iter_200.caffemodel").exists()
    assert (tmp_path / "lenet_digits_iter_200.solverstate").exists()
    # The snapshot is a real Caffe model: OpenCV's Caffe importer scores it the same.
    import cv2
    import numpy as np
    data = np.load(tmp_path / "digits_test.npz")
    x, y = data["images"], data["labels"]
    net = cv2.dnn.readNetFromCaffe(str(tmp_path / "lenet.prototxt"),
                                   str(tmp_path / "lenet_digits_iter_200.caffemodel"))
    net.enableFusion(False)
    net.setInput(x[:, None].astype(np.float32) * np.float32(0.00390625))
    cv_acc = float(np.mean(net.forward().argmax(axis=1) == y))
    assert abs(cv_acc - acc) <= 1.0 / len(y) + 1e-9
