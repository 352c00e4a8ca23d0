"""The forks' schema fields: their wire numbers (bytes encoded here by hand, with the numbers
the forks' caffe.proto files give: SSD weiliu89/caffe, caffe-fast-rcnn, ShuffleNet forks),
prototxt parsing by name (ceil_mode beside round_mode, interp_param, upsample_param), and a
user's own .proto additions (proto_ext)."""

from __future__ import annotations

import struct

import pytest

from keras_cct.caffe import parse_net, read_caffemodel
from keras_cct.caffe.io import proto, proto_ext
from keras_cct.errors import CaffeFormatError


def _varint(v: int) -> bytes:
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _msg(field: int, body: bytes) -> bytes:
    return _key(field, 2) + _varint(len(body)) + body


def _f32(field: int, v: float) -> bytes:
    return _key(field, 5) + struct.pack("<f", v)


def _int(field: int, v: int) -> bytes:
    return _key(field, 0) + _varint(v)


def test_fork_fields_have_the_forks_wire_numbers(tmp_path):
    layer = (_msg(1, b"det") + _msg(2, b"DetectionOutput")
             + _msg(202, _int(1, 0) + _int(1, 2) + _int(1, 3) + _int(1, 1))      # permute
             + _msg(203, _f32(1, 30.0) + _f32(2, 60.0) + _f32(3, 2.0) + _int(4, 0)
                    + _int(5, 1) + _f32(6, 0.1) + _int(7, 300) + _f32(10, 8.0)
                    + _f32(13, 0.25))                                            # prior_box
             + _msg(204, _int(1, 21) + _int(2, 0) + _int(3, 5)
                    + _msg(4, _f32(1, 0.45) + _int(2, 400)) + _int(6, 2) + _int(7, 200)
                    + _int(8, 1) + _f32(9, 0.01))                                # detection
             + _msg(206, _int(1, 0) + _int(3, 0) + _f32(4, 1e-6))                # norm_param
             + _msg(164, _int(1, 3))                                             # shuffle
             + _msg(8266711, _int(1, 7) + _int(2, 6) + _f32(3, 0.0625)))         # roi
    path = tmp_path / "fork.caffemodel"
    path.write_bytes(_msg(1, b"ssd") + _msg(100, layer))
    lp = read_caffemodel(path).layer[0]
    assert list(lp.permute_param.order) == [0, 2, 3, 1]
    pb = lp.prior_box_param
    assert (list(pb.min_size), list(pb.max_size), list(pb.aspect_ratio)) == ([30], [60], [2])
    assert (pb.flip, pb.clip, pb.img_size, pb.step, pb.offset) == (False, True, 300, 8.0, 0.25)
    assert pytest.approx(pb.variance[0]) == 0.1
    d = lp.detection_output_param
    assert (d.num_classes, d.share_location, d.background_label_id, d.keep_top_k) == (21, False,
                                                                                       5, 200)
    assert proto.PriorBoxParameter.CodeType.Name(d.code_type) == "CENTER_SIZE"
    assert d.variance_encoded_in_target and d.nms_param.top_k == 400
    assert pytest.approx(d.nms_param.nms_threshold) == 0.45
    assert pytest.approx(d.confidence_threshold) == 0.01
    n = lp.norm_param
    assert (n.across_spatial, n.channel_shared) == (False, False)
    assert pytest.approx(n.eps) == 1e-6
    assert lp.shuffle_channel_param.group == 3
    r = lp.roi_pooling_param
    assert (r.pooled_h, r.pooled_w, r.spatial_scale) == (7, 6, 0.0625)


def test_ssd_defaults_are_ssds():
    pb, d = proto.PriorBoxParameter(), proto.DetectionOutputParameter()
    n = proto.NormalizeParameter()
    assert (pb.flip, pb.clip, pb.offset) == (True, False, 0.5)
    assert (d.share_location, d.background_label_id, d.keep_top_k) == (True, 0, -1)
    assert proto.PriorBoxParameter.CodeType.Name(d.code_type) == "CORNER"
    assert pytest.approx(d.nms_param.nms_threshold) == 0.3 and d.nms_param.eta == 1.0
    assert (n.across_spatial, n.channel_shared) == (True, True)
    assert pytest.approx(n.eps) == 1e-10


def test_fork_prototxt_fields_parse_by_name():
    net, _ = parse_net("""
layer { name: "pool" type: "Pooling" bottom: "x" top: "pool"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 ceil_mode: false } }
layer { name: "interp" type: "Interp" bottom: "pool" top: "interp"
  interp_param { zoom_factor: 8 pad_beg: 0 pad_end: 0 } }
layer { name: "up" type: "Upsample" bottom: "interp" bottom: "mask" top: "up"
  upsample_param { scale: 2 upsample_h: 45 upsample_w: 60 } }
""")
    pool, interp, up = net.layer
    assert pool.pooling_param.HasField("ceil_mode") and not pool.pooling_param.ceil_mode
    assert not pool.pooling_param.HasField("round_mode")
    assert interp.interp_param.zoom_factor == 8
    assert (up.upsample_param.upsample_h, up.upsample_param.upsample_w) == (45, 60)


def test_binary_field_13_is_bvlc_round_mode(tmp_path):
    """The fork trap: a binary PoolingParameter field 13 = 1 is BVLC's round_mode FLOOR (a
    fork's ceil_mode: true would be the same bytes; binary files are read as BVLC's)."""
    layer = _msg(1, b"pool") + _msg(2, b"Pooling") + _msg(121, _int(2, 3) + _int(13, 1))
    path = tmp_path / "pool.caffemodel"
    path.write_bytes(_msg(100, layer))
    p = read_caffemodel(path).layer[0].pooling_param
    assert proto.PoolingParameter.RoundMode.Name(p.round_mode) == "FLOOR"
    assert not p.HasField("ceil_mode")


def test_pspnet_binary_interp_param_does_not_break_parsing(tmp_path):
    """PSPNet writes interp_param as field 143 (BVLC's input_param): the file still parses,
    and its blobs are read."""
    blob = _msg(7, _msg(7, _int(1, 2)) + _key(5, 2) + _varint(8) + struct.pack("<2f", 1, 2))
    layer = _msg(1, b"interp") + _msg(2, b"Interp") + _msg(143, _int(3, 8)) + blob
    path = tmp_path / "psp.caffemodel"
    path.write_bytes(_msg(100, layer))
    lp = read_caffemodel(path).layer[0]
    assert lp.type == "Interp" and list(lp.blobs[0].data) == [1.0, 2.0]


EXTRA = """
syntax = "proto2";
package caffe;
// a fork's additions
message LayerParameter {
  optional string name = 1;                    // already known: skipped
  optional MyScaleParameter my_scale_param = 7001;
}
message MyScaleParameter {
  enum Mode { /* two modes */ LINEAR = 0; SQUARE = 1; }
  optional float factor = 1 [default = 2.5];
  optional Mode mode = 2 [default = SQUARE];
  repeated int32 dims = 3 [packed = true];
}
"""


def test_user_proto_extension(tmp_path):
    path = tmp_path / "extra.proto"
    path.write_text(EXTRA)
    try:
        added = proto_ext.extend_schema(path)
        assert added == ["LayerParameter", "MyScaleParameter"]
        net, _ = parse_net('layer { name: "s" type: "MyScale" my_scale_param { factor: 3 '
                        'dims: 1 dims: 2 } }')
        p = net.layer[0].my_scale_param
        assert (p.factor, list(p.dims)) == (3.0, [1, 2])
        assert proto.MyScaleParameter.Mode.Name(p.mode) == "SQUARE"
        wire = net.SerializeToString()
        assert proto.NetParameter.FromString(wire).layer[0].my_scale_param.factor == 3.0
        assert proto.PriorBoxParameter().offset == 0.5          # the forks' fields stay
    finally:
        proto_ext.reset_schema()
    assert not hasattr(proto, "MyScaleParameter")
    assert "my_scale_param" not in proto.LayerParameter.DESCRIPTOR.fields_by_name


@pytest.mark.parametrize("text,match", [
    ("message A { message B { optional int32 x = 1; } }", "nested message"),
    ("message A { oneof u { int32 x = 1; } }", "oneof"),
    ("message LayerParameter { optional float type = 2; }", "clashes"),
])
def test_user_proto_extension_errors(text, match):
    try:
        with pytest.raises(CaffeFormatError, match=match):
            proto_ext.extend_schema(text)
    finally:
        proto_ext.reset_schema()
