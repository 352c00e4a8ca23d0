"""``cct convert`` and ``cct info`` (run in-process through keras_cct.cli.main)."""

from __future__ import annotations

import re

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


# a train_val-style net: a Data layer whose two tops (data, label) share batch_size 256
_TRAIN_VAL = """name: "tiny_train_val"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  transform_param { crop_size: 16 mirror: true }
  data_param { source: "does_not_exist_lmdb" batch_size: 256 backend: LMDB } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { crop_size: 16 }
  data_param { source: "does_not_exist_lmdb" batch_size: 50 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc"
  inner_product_param { num_output: 5 } }
layer { name: "accuracy" type: "Accuracy" bottom: "fc" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


def test_time_input_shape_sets_the_batch_of_every_data_top(tmp_path, capsys):
    """--input-shape data=4,... with --random-data: the label top of the same Data layer gets
    batch 4 too (not the file's batch_size 256)."""
    net = tmp_path / "train_val.prototxt"
    net.write_text(_TRAIN_VAL)
    rc = main(["time", "--model", str(net), "--random-data", "--input-shape", "data=4,3,16,16",
               "--iterations", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Average Forward-Backward (training step)" in out and "*** Benchmark ends ***" in out
    assert re.search(r"training step\): [0-9.]+ ms \([0-9.]+ images/s\)", out)
    from keras_cct.caffe.train.model import build_phase_net
    _, sources, built = build_phase_net(str(net), phase="TRAIN", random_data=True,
                                        input_shapes={"data": (4, 3, 16, 16)})
    assert built.inputs["label"][0] == 4 and built.inputs["data"][0] == 4
    assert all(s.batch_size == 4 for s in sources)


def test_time_input_shape_batch_without_random_data_is_explained(tmp_path, capsys):
    net = tmp_path / "train_val.prototxt"
    net.write_text(_TRAIN_VAL)
    rc = main(["time", "--model", str(net), "--input-shape", "data=4,3,16,16",
               "--iterations", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and "reads batches of 256" in err and "--random-data" in err


def test_data_layer_tops_given_different_batches_are_refused(tmp_path):
    from keras_cct.caffe import build_net
    from keras_cct.caffe.io.text import parse_net
    from keras_cct.errors import CaffeFormatError
    with pytest.raises(CaffeFormatError, match="different batch sizes"):
        build_net(parse_net(_TRAIN_VAL)[0], phase="TRAIN",
                  input_shapes={"data": (4, 3, 16, 16), "label": (8,)})


@pytest.mark.shared
def test_time_caffenet_train_val_at_a_small_batch(capsys):
    root = need_shared("caffe-models", "prototxt-only", "bvlc_reference_caffenet")
    rc = main(["time", "--model", str(root / "train_val.prototxt"), "--random-data",
               "--input-shape", "data=2,3,227,227", "--iterations", "1", "--no-layers"])
    out = capsys.readouterr().out
    assert rc == 0 and "Average Forward-Backward (training step)" in out
