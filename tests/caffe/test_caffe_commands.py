"""``cct convert`` and ``cct info`` (run in-process through keras_cct.cli.main)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_cct.caffe import import_net
from keras_cct.cli import main
from tests.caffe.import_helpers import NETS
from tests.conftest import need_shared


@pytest.mark.shared
def test_convert_writes_a_keras_file_with_the_caffe_outputs(tmp_path, capsys):
    root = need_shared("caffe-models", "mtcnn")
    out = tmp_path / "det1.keras"
    rc = main(["convert", str(root / "det1.prototxt"), "--weights", str(root / "det1.caffemodel"),
               "-o", str(out)])
    assert rc == 0 and out.exists()
    assert "outputs conv4-2, prob1" in capsys.readouterr().out
    model = keras.saving.load_model(out)
    ref = import_net(root / "det1.prototxt", root / "det1.caffemodel").model
    x = np.random.default_rng(0).standard_normal((2, 12, 12, 3)).astype(np.float32)
    for a, b in zip(model(x), ref(x)):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b),
                                   rtol=1e-6, atol=1e-7)
    assert model.output_names == ["conv4-2", "prob1"]


def test_convert_error_is_reported_not_raised(tmp_path, capsys):
    bad = tmp_path / "bad.prototxt"
    bad.write_text('name: "x"\nlayer { name: "a" type: "Nope" }\n')
    rc = main(["convert", str(bad), "-o", str(tmp_path / "m.keras")])
    err = capsys.readouterr().err
    assert rc == 1 and f"{bad}:2" in err and "unsupported layer type 'Nope'" in err
    assert not (tmp_path / "m.keras").exists()


def test_info_prints_shapes_and_parameter_counts(capsys):
    rc = main(["info", str(NETS / "zoo.prototxt"), "--input-shape", "2,4,9,11"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line and line[0] != " "}
    # conv: 6 filters of 2 input channels (group 2) x 3 x 2 + 6 biases = 78
    assert "(None, 6, 5, 14)" in rows["conv"] and rows["conv"].rstrip().endswith(" 78")
    assert "(None, 4, 9, 27)" in rows["deconv"]                    # stride 2 deconvolution
    assert "(None, 5, 5, 6)" in rows["apool"]                      # ceil-mode pooling
    assert "s1, s2, s3" in rows["slice"]
    assert "total parameters:" in out
