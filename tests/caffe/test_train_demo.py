"""The embedded demo (examples/train_lenet_digits.py), shortened: LeNet from Caffe's files on
the scikit-learn digits through `cct data`, snapshot and accuracy check."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_lenet_digits_demo_short(tmp_path, capsys):
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
