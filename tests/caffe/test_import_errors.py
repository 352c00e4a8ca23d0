"""Bad input to the Caffe importer: each is a CaffeFormatError (a ValueError) that names the file,
the line (text) or the layer, says what is wrong, and leaves nothing half-built."""

from __future__ import annotations

import numpy as np
import pytest

from keras_cct.caffe import import_net, load_net, load_weights, save_weights
from keras_cct.caffe.net.builder import SUPPORTED_TYPES
from keras_cct.errors import CaffeFormatError
from tests.caffe.import_helpers import randomize

TINY = """name: "tiny"
input: "data"
input_shape { dim: 1 dim: 2 dim: 5 dim: 5 }
layer {
  name: "conv"
  type: "Convolution"
  bottom: "data"
  top: "conv"
  convolution_param { num_output: 3 kernel_size: 3 }
}
layer {
  name: "fc"
  type: "InnerProduct"
  bottom: "conv"
  top: "fc"
  inner_product_param { num_output: 4 }
}
"""


def _write(tmp_path, text, name="net.prototxt"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _weights(tmp_path, text=TINY, name="w.caffemodel"):
    net = import_net(_write(tmp_path, text, "for_weights.prototxt"))
    randomize(net.model)
    path = tmp_path / name
    save_weights(net, path)
    return path


def test_syntax_error_names_file_line_and_column(tmp_path):
    bad = TINY.replace("  top: \"conv\"\n", "  top: \"conv\"\n  kernel: 3\n", 1)
    path = _write(tmp_path, bad)
    with pytest.raises(CaffeFormatError) as info:
        load_net(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.path == str(path) and err.line == 9 and err.column == 3
    assert f"{path}:9:3" in str(err) and 'no field named "kernel"' in str(err)


def test_unbalanced_braces_is_a_syntax_error(tmp_path):
    path = _write(tmp_path, TINY.rstrip().rstrip("}"))
    with pytest.raises(CaffeFormatError, match="syntax error") as info:
        load_net(path)
    assert info.value.line is not None


def test_fork_ceil_mode_and_round_mode_together_are_refused(tmp_path):
    """A fork's ``ceil_mode`` is read (tests/caffe/test_schema_forks.py); giving it beside
    BVLC's ``round_mode`` is contradictory and named with its line."""
    text = TINY + ('layer { name: "p" type: "Pooling" bottom: "conv" top: "p"\n'
                   '  pooling_param { pool: MAX kernel_size: 2 ceil_mode: false '
                   'round_mode: CEIL } }\n')
    with pytest.raises(CaffeFormatError, match="round_mode") as info:
        load_net(_write(tmp_path, text))
    assert info.value.layer == "p" and info.value.line == 18


def test_unknown_layer_type_lists_supported(tmp_path):
    text = TINY + 'layer {\n  name: "odd"\n  type: "Frobnicate"\n  bottom: "fc"\n  top: "o"\n}\n'
    with pytest.raises(CaffeFormatError) as info:
        load_net(_write(tmp_path, text))
    msg = str(info.value)
    assert "unsupported layer type 'Frobnicate'" in msg and "layer 'odd'" in msg
    assert info.value.line == 18
    for t in ("Convolution", "Pooling", "InnerProduct", "LRN", "BatchNorm", "Eltwise"):
        assert t in msg
    assert "Convolution" in SUPPORTED_TYPES


def test_python_layer_is_refused_not_executed(tmp_path):
    text = TINY + ('layer { name: "py" type: "Python" bottom: "fc" top: "py"\n'
                   '  python_param { module: "os" layer: "system" param_str: "touch x" } }\n')
    with pytest.raises(CaffeFormatError, match="would import and run Python code: module 'os', "
                       "class 'system'.*python_layers=True") as info:
        load_net(_write(tmp_path, text))
    assert info.value.layer == "py" and info.value.line == 18
    assert not (tmp_path / "x").exists()


def test_bottom_not_produced(tmp_path):
    text = TINY.replace('bottom: "conv"\n  top: "fc"', 'bottom: "cnov"\n  top: "fc"')
    with pytest.raises(CaffeFormatError) as info:
        load_net(_write(tmp_path, text))
    assert "bottom blob 'cnov' is not produced by any earlier layer" in str(info.value)
    assert info.value.layer == "fc" and info.value.line == 11


def test_input_without_shape_asks_for_input_shape(tmp_path):
    text = TINY.replace("input_shape { dim: 1 dim: 2 dim: 5 dim: 5 }\n", "")
    with pytest.raises(CaffeFormatError, match="input 'data' has no shape.*input_shape"):
        load_net(_write(tmp_path, text))
    model = load_net(_write(tmp_path, text, "b.prototxt"), input_shape=(1, 2, 6, 6))
    assert tuple(model.inputs[0].shape) == (None, 6, 6, 2)


def test_weight_shape_mismatch_says_expected_and_found(tmp_path):
    weights = _weights(tmp_path)
    other = TINY.replace("num_output: 3", "num_output: 5")
    with pytest.raises(CaffeFormatError) as info:
        load_net(_write(tmp_path, other), weights)
    msg = str(info.value)
    assert info.value.layer == "conv" and str(weights) in msg
    assert "blob 0 has shape (3, 2, 3, 3), expected (5, 2, 3, 3)" in msg


def test_blob_count_mismatch(tmp_path):
    weights = _weights(tmp_path)
    other = TINY.replace("num_output: 3 kernel_size: 3", "num_output: 3 kernel_size: 3 "
                         "bias_term: false")
    with pytest.raises(CaffeFormatError, match="has 2 blobs in the caffemodel, the net "
                                               "expects 1"):
        load_net(_write(tmp_path, other), weights)


def test_truncated_caffemodel(tmp_path):
    weights = _weights(tmp_path)
    data = weights.read_bytes()
    cut = tmp_path / "cut.caffemodel"
    cut.write_bytes(data[: len(data) - 7])
    with pytest.raises(CaffeFormatError) as info:
        load_net(_write(tmp_path, TINY), cut)
    assert str(cut) in str(info.value) and "truncated" in str(info.value)


def test_non_protobuf_caffemodel(tmp_path):
    junk = tmp_path / "junk.caffemodel"
    junk.write_bytes(b"\xff\xfe not a protobuf at all \x00\x01" * 10)
    with pytest.raises(CaffeFormatError, match="not a valid caffemodel"):
        load_net(_write(tmp_path, TINY), junk)
    text_instead = _write(tmp_path, TINY, "text.caffemodel")
    with pytest.raises(CaffeFormatError, match="not a valid caffemodel"):
        load_net(_write(tmp_path, TINY), text_instead)
    empty = tmp_path / "empty.caffemodel"
    empty.write_bytes(b"")
    with pytest.raises(CaffeFormatError, match="empty caffemodel"):
        load_net(_write(tmp_path, TINY), empty)


def test_missing_file(tmp_path):
    with pytest.raises(CaffeFormatError, match="prototxt file not found"):
        load_net(tmp_path / "nope.prototxt")
    with pytest.raises(CaffeFormatError, match="caffemodel file not found"):
        load_net(_write(tmp_path, TINY), tmp_path / "nope.caffemodel")


def test_missing_weights_error_or_warning(tmp_path):
    weights = _weights(tmp_path)
    more = TINY + ('layer { name: "fc2" type: "InnerProduct" bottom: "fc" top: "fc2"\n'
                   '  inner_product_param { num_output: 2 } }\n')
    path = _write(tmp_path, more)
    with pytest.raises(CaffeFormatError, match="need weights but the caffemodel has none "
                                               "for them: fc2"):
        load_net(path, weights)
    with pytest.warns(UserWarning, match="fc2"):
        model = load_net(path, weights, strict=False)
    assert model.get_layer("fc").get_weights()[0].shape == (4, 27)


def test_failed_load_leaves_model_unchanged(tmp_path):
    """Every blob is checked before any variable is assigned."""
    good = _weights(tmp_path)
    net = import_net(_write(tmp_path, TINY))
    before = [w.copy() for w in net.model.get_weights()]
    # a caffemodel whose conv matches but whose fc does not
    other = TINY.replace("num_output: 4", "num_output: 6")
    bad = _weights(tmp_path, other, "bad.caffemodel")
    with pytest.raises(CaffeFormatError, match="layer 'fc'"):
        load_weights(net, bad)
    for a, b in zip(before, net.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    load_weights(net, good)
    assert any(not np.array_equal(a, b) for a, b in zip(before, net.model.get_weights()))


def test_bad_layer_parameters_are_located(tmp_path):
    text = TINY.replace("num_output: 3 kernel_size: 3", "num_output: 3 kernel_size: 9")
    with pytest.raises(CaffeFormatError) as info:
        load_net(_write(tmp_path, text))
    assert info.value.layer == "conv" and info.value.line == 4
    text = TINY.replace("convolution_param { num_output: 3 kernel_size: 3 }",
                        "convolution_param { num_output: 3 }")
    with pytest.raises(CaffeFormatError, match="layer .conv.: kernel_size is required"):
        load_net(_write(tmp_path, text, "k.prototxt"))


def test_duplicate_layer_names(tmp_path):
    text = TINY.replace('name: "fc"', 'name: "conv"')
    with pytest.raises(CaffeFormatError, match="duplicate layer name 'conv'"):
        load_net(_write(tmp_path, text))


def test_hdf5_caffemodel_round_trip_and_errors(tmp_path):
    """Caffe's HDF5 weights (/data/<layer>/<i>, snapshot_format: HDF5) load like binary ones."""
    h5py = pytest.importorskip("h5py")
    net = import_net(_write(tmp_path, TINY))
    randomize(net.model, seed=5)
    h5 = tmp_path / "w.caffemodel.h5"
    assert save_weights(net, h5) == 2
    with h5py.File(h5, "r") as f:
        assert f["data/conv/0"].shape == (3, 2, 3, 3) and f["data/fc/0"].shape == (4, 27)
    again = load_net(_write(tmp_path, TINY, "again.prototxt"), h5)
    for a, b in zip(again.get_weights(), net.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    other = TINY.replace("num_output: 3", "num_output: 5")
    with pytest.raises(CaffeFormatError, match="blob 0 has shape \\(3, 2, 3, 3\\), expected"):
        load_net(_write(tmp_path, other, "o.prototxt"), h5)
    cut = tmp_path / "cut.caffemodel.h5"
    cut.write_bytes(h5.read_bytes()[:600])
    with pytest.raises(CaffeFormatError, match="cannot read the HDF5 caffemodel"):
        load_net(_write(tmp_path, TINY, "c.prototxt"), cut)
