"""Caffe's schema (keras_cct.caffe.io.proto) and the file readers and upgraders (caffe.io)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from google.protobuf import text_format

from keras_cct.caffe import proto
from keras_cct.caffe.io.binary import (array_to_blob, blob_to_array, read_binaryproto,
                                       read_caffemodel, write_binaryproto)
from keras_cct.caffe.io.filter import filter_net
from keras_cct.caffe.io.text import parse_net, read_net
from keras_cct.caffe.net.weights import blob_array
from keras_cct.errors import CaffeFormatError
from tests.conftest import need_shared

_TYPES = {"float": 2, "double": 1, "int32": 5, "int64": 3, "uint32": 13, "bool": 8,
          "string": 9, "bytes": 12}


@pytest.mark.shared
def test_schema_matches_the_bvlc_listing():
    """Every field of BVLC's caffe.proto listing has the same number, label, type and default
    in our descriptors (the listing in ../shared is the independent reference)."""
    listing = need_shared("reference", "caffe_proto_fields.txt").read_text().splitlines()
    msg = None
    checked = 0
    for line in listing:
        text = line.strip()
        if text.startswith("message "):
            msg = proto.message_class(text.split()[1]).DESCRIPTOR
            continue
        m = re.match(r"(optional|repeated|required) ([\w.]+) (\w+) = (\d+)(?: \[(.*)\])?$",
                     text)
        if not m or msg is None:
            continue
        label, type_name, name, number, opts = m.groups()
        fd = msg.fields_by_name[name]
        assert fd.number == int(number), (msg.name, name)
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else \
            fd.label == fd.LABEL_REPEATED
        assert repeated == (label == "repeated"), (msg.name, name)
        if type_name in _TYPES:
            assert fd.type == _TYPES[type_name], (msg.name, name)
        else:
            assert (fd.message_type or fd.enum_type).name == type_name.split(".")[-1]
        dm = re.search(r"default = ([^,\]]+)", opts or "")
        if dm:
            raw = dm.group(1).strip().strip("'\"")
            if fd.enum_type is not None:
                assert fd.enum_type.values_by_number[fd.default_value].name == raw
            elif type_name in ("float", "double"):
                assert fd.default_value == pytest.approx(float(raw), rel=1e-6)
            elif type_name == "bool":
                assert fd.default_value == (raw == "true")
            elif type_name == "string":
                assert fd.default_value == raw
            else:
                assert fd.default_value == int(raw)
        checked += 1
    assert checked > 400  # every field line of the listing (423)


def test_bvlc_round_mode_default_is_ceil():
    assert proto.PoolingParameter().round_mode == proto.PoolingParameter.CEIL == 0
    assert proto.PoolingParameter.DESCRIPTOR.fields_by_name["round_mode"].number == 13


def test_text_and_binary_round_trip():
    text = ('name: "n" layer { name: "c" type: "Convolution" bottom: "d" top: "c" '
            'convolution_param { num_output: 4 kernel_size: 3 pad: 1 } '
            'blobs { shape { dim: 2 dim: 3 } data: 1 data: 2 data: 3 data: 4 data: 5 data: 6 } }')
    net = text_format.Parse(text, proto.NetParameter())
    again = proto.NetParameter.FromString(net.SerializeToString())
    assert again == net
    assert text_format.Parse(text_format.MessageToString(again), proto.NetParameter()) == net
    np.testing.assert_array_equal(blob_to_array(again.layer[0].blobs[0]),
                                  np.arange(1, 7).reshape(2, 3))


def test_blob_arrays_fast_path_and_legacy_shapes():
    arr = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    blob = array_to_blob(arr)
    np.testing.assert_array_equal(blob_array(blob), arr)
    legacy = array_to_blob(arr, legacy_shape=True)
    assert (legacy.num, legacy.channels, legacy.height, legacy.width) == (1, 3, 4, 5)
    np.testing.assert_array_equal(blob_array(legacy), arr.reshape(1, 3, 4, 5))
    # non-packed floats (as an old writer might emit) take the slow path, same values
    unpacked = b"".join(b"\x2d" + np.float32(v).tobytes() for v in arr.ravel()[:6])
    blob = proto.BlobProto.FromString(unpacked)
    np.testing.assert_array_equal(blob_array(blob), arr.ravel()[:6])


def test_binaryproto_round_trip(tmp_path):
    mean = np.random.default_rng(0).uniform(0, 255, (1, 3, 4, 4)).astype(np.float32)
    path = tmp_path / "mean.binaryproto"
    write_binaryproto(path, mean)
    np.testing.assert_array_equal(blob_to_array(read_binaryproto(path)), mean)
    (tmp_path / "bad.binaryproto").write_bytes(b"\x0a\xff\xff")
    with pytest.raises(CaffeFormatError, match="not a valid binaryproto"):
        read_binaryproto(tmp_path / "bad.binaryproto")


@pytest.mark.shared
def test_v1_net_upgrades_like_the_current_one():
    """The 2014 V1 cifar10_quick equals BVLC's current-format cifar10_quick layer by layer."""
    v1 = read_net(need_shared("caffe-models", "cifar10_quick_v1", "cifar10_quick.prototxt"))
    new = read_net(need_shared("caffe-models", "prototxt-only", "bvlc_cifar10_examples",
                               "cifar10_quick.prototxt"))
    assert [lp.type for lp in v1.layer] == [lp.type for lp in new.layer]
    for a, b in zip(v1.layer, new.layer):
        assert list(a.bottom) == list(b.bottom) and list(a.top) == list(b.top)
        for field in ("convolution_param", "pooling_param"):
            if b.HasField(field):
                pa, pb = getattr(a, field), getattr(b, field)
                for f in ("num_output", "pad", "kernel_size", "stride", "pool"):
                    if f in pb.DESCRIPTOR.fields_by_name:
                        assert getattr(pa, f) == getattr(pb, f), (a.name, f)
    assert [p.lr_mult for p in v1.layer[1].param] == [1.0, 2.0]
    model = read_caffemodel(need_shared("caffe-models", "cifar10_quick_v1",
                                        "cifar10_quick_iter_5000.caffemodel"))
    assert [lp.type for lp in model.layer][:3] == ["Data", "Convolution", "Pooling"]
    assert model.layer[1].blobs[1].num == 1  # legacy 4-D shape kept for the loader


def test_v0_net_upgrade_with_padding_layer():
    text = """name: "v0"
input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 3 stride: 2
                 biasterm: false } bottom: "pad1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 2 stride: 2 }
         bottom: "conv1" top: "pool1" }
layers { layer { name: "fc" type: "innerproduct" num_output: 5 } bottom: "pool1" top: "fc" }
layers { layer { name: "norm" type: "lrn" local_size: 3 alpha: 0.1 beta: 0.5 k: 2 }
         bottom: "fc" top: "norm" }
"""
    net, _ = parse_net(text)
    assert [lp.type for lp in net.layer] == ["Input", "Convolution", "Pooling",
                                             "InnerProduct", "LRN"]
    conv = net.layer[1]
    assert list(conv.bottom) == ["data"]
    assert list(conv.convolution_param.pad) == [2] and not conv.convolution_param.bias_term
    assert list(conv.convolution_param.kernel_size) == [3]
    assert net.layer[2].pooling_param.pool == proto.PoolingParameter.AVE
    assert net.layer[4].lrn_param.k == 2.0
    assert list(net.layer[0].input_param.shape[0].dim) == [1, 3, 8, 8]


def test_phase_stage_level_rules():
    text = """name: "rules"
layer { name: "a" type: "Input" top: "a" include { phase: TRAIN } }
layer { name: "b" type: "Input" top: "b" include { phase: TEST stage: "x" } }
layer { name: "c" type: "Input" top: "c" exclude { stage: "x" } }
layer { name: "d" type: "Input" top: "d" include { min_level: 2 } }
layer { name: "e" type: "Input" top: "e" include { not_stage: "y" } }
"""
    net, src = parse_net(text)

    def names(**kw):
        return [lp.name for lp in filter_net(net, **kw).layer]

    assert names(phase="TRAIN") == ["a", "c", "e"]
    assert names(phase="TEST") == ["c", "e"]
    assert names(phase="TEST", stages=["x"]) == ["b", "e"]
    assert names(phase="TEST", stages=["y"], level=3) == ["c", "d"]
    _, kept = filter_net(net, phase="TRAIN", source=src)
    assert kept.layer_lines == [2, 4, 6]


def test_mixed_layer_and_layers_is_an_error():
    with pytest.raises(CaffeFormatError, match="mixes"):
        parse_net('layer { name: "a" type: "Input" top: "a" }\n'
                  'layers { name: "b" type: RELU bottom: "a" top: "a" }\n', path="m.prototxt")


def test_input_dim_count_is_checked():
    with pytest.raises(CaffeFormatError, match="need 4 `input_dim` values, found 3") as info:
        parse_net('input: "data"\ninput_dim: 1 input_dim: 3 input_dim: 8\n', path="i.prototxt")
    assert info.value.line == 1


@pytest.mark.shared
@pytest.mark.parametrize("path", ["lenet_mnist/lenet_iter_10000.caffemodel",
                                  "cifar10_quick_v1/cifar10_quick_iter_5000.caffemodel"])
def test_zero_copy_blob_payloads_equal_protobufs_values(path):
    """load_weights reads packed blob payloads straight from the file bytes (current and V1
    layouts); they must equal what protobuf decodes."""
    from keras_cct.caffe.net.weights import _raw_blob_payloads
    file = need_shared("caffe-models", *path.split("/"))
    raw = _raw_blob_payloads(file.read_bytes())
    net = read_caffemodel(file)
    n = 0
    for lp in net.layer:
        for blob, fast in zip(lp.blobs, raw.get(lp.name, [])):
            np.testing.assert_array_equal(fast, blob_array(blob).ravel())
            n += 1
    assert n == sum(len(lp.blobs) for lp in net.layer) > 0
