"""Readers and writers of Caffe's files: .prototxt, .caffemodel, .binaryproto, blobs.

* :func:`read_net` / :func:`parse_net` -- a network definition (text), upgraded to the current
  ``layer {}`` format (V0 ``layers { layer {} }`` and V1 ``layers { type: ENUM }`` nets, the
  ``input:``/``input_dim:``/``input_shape:`` fields become ``Input`` layers, data-layer transform
  fields move to ``transform_param``) exactly as Caffe's ``upgrade_proto.cpp`` does.
* :func:`read_caffemodel` -- trained weights (binary ``NetParameter``), upgraded the same way.
* :func:`read_binaryproto` / :func:`write_binaryproto` -- one ``BlobProto`` (mean files).
* :func:`blob_to_array` / :func:`array_to_blob` -- a ``BlobProto`` <-> numpy, with Caffe's
  legacy 4-D ``num/channels/height/width`` shapes.
* :func:`filter_net` -- Caffe's include/exclude phase, level and stage rules.

Every problem raises :class:`keras_cct.errors.CaffeFormatError` naming the file and the
line:column (text) or the layer (binary). Nothing a file contains is ever executed: text goes
through ``google.protobuf.text_format`` and binary through protobuf's parser only.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
from google.protobuf import message as _pb_message
from google.protobuf import text_format

from keras_cct._files import atomic_write
from keras_cct.caffe import proto
from keras_cct.caffe.validate import check_strings, max_bytes, read_bounded
from keras_cct.errors import CaffeFormatError

PathLike = Union[str, os.PathLike]

__all__ = [
    "NetSource", "read_net", "parse_net", "read_text", "read_caffemodel", "parse_caffemodel",
    "read_binaryproto", "write_binaryproto", "blob_to_array", "array_to_blob", "blob_shape",
    "upgrade_net", "filter_net", "state_meets_rule", "V1_LAYER_TYPES",
]

# V1LayerParameter.LayerType -> current type string (Caffe's UpgradeV1LayerType).
V1_LAYER_TYPES: Dict[str, str] = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData", "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise",
    "EXP": "Exp", "FLATTEN": "Flatten", "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col", "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence",
    "SOFTMAX": "Softmax", "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice",
    "TANH": "TanH", "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}

# V0 (2013) layer type strings -> V1 enum names (Caffe's UpgradeV0LayerType).
_V0_TYPES: Dict[str, str] = {
    "accuracy": "ACCURACY", "bnll": "BNLL", "concat": "CONCAT", "conv": "CONVOLUTION",
    "data": "DATA", "dropout": "DROPOUT", "euclidean_loss": "EUCLIDEAN_LOSS",
    "flatten": "FLATTEN", "hdf5_data": "HDF5_DATA", "hdf5_output": "HDF5_OUTPUT",
    "im2col": "IM2COL", "images": "IMAGE_DATA", "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT", "lrn": "LRN", "multinomial_logistic_loss":
    "MULTINOMIAL_LOGISTIC_LOSS", "pool": "POOLING", "relu": "RELU", "sigmoid": "SIGMOID",
    "softmax": "SOFTMAX", "softmax_loss": "SOFTMAX_LOSS", "split": "SPLIT", "tanh": "TANH",
    "window_data": "WINDOW_DATA",
}


@dataclass
class NetSource:
    """Where a parsed net came from, for error messages.

    Attributes:
        path: the file (or ``"<string>"``).
        layer_lines: for each entry of the upgraded ``net.layer``, the 1-based line of its
            definition in the file (``None`` when unknown).
    """

    path: str = "<string>"
    layer_lines: List[Optional[int]] = field(default_factory=list)

    def line_of(self, index: int) -> Optional[int]:
        return self.layer_lines[index] if 0 <= index < len(self.layer_lines) else None


# --------------------------------------------------------------------------------------------
# Text


def _strip_position(msg: str) -> str:
    return re.sub(r"^\s*\d+:\d+\s*:\s*", "", msg)


def read_text(path: PathLike, message_class=None, *, what: str = "prototxt"):
    """Parse the text-format protobuf file ``path`` into a new ``message_class`` message.

    Raises:
        CaffeFormatError: the file is missing or unreadable, or has a syntax error (with its
            line and column).
    """
    message_class = message_class or proto.NetParameter
    path = str(path)
    return _parse_text(_read_text_file(path, what), message_class, path, what)


def _read_text_file(path: str, what: str) -> str:
    """A text file's contents (a regular file of at most 256 MiB or the memory bound; UTF-8:
    the largest real prototxts are well under 1 MiB)."""
    data = read_bounded(path, what, limit=min(max_bytes(), 256 << 20))
    try:
        return data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise CaffeFormatError(f"not a text {what} (byte {exc.start} is not UTF-8)", path=path,
                               hint="binary .caffemodel files go in `weights=`") from None


def _parse_text(text: str, message_class, path: str, what: str):
    msg = message_class()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as exc:
        line = exc.GetLine() if hasattr(exc, "GetLine") else None
        col = exc.GetColumn() if hasattr(exc, "GetColumn") else None
        detail = _strip_position(str(exc))
        hint = "fix the syntax at that position"
        if "ceil_mode" in detail:
            hint = ("`ceil_mode` comes from a Caffe fork; BVLC Caffe uses "
                    "`round_mode: CEIL` (the default) or `round_mode: FLOOR`")
        elif "has no field named" in detail:
            hint = "the field is not part of BVLC Caffe's caffe.proto (a fork's extension?)"
        raise CaffeFormatError(f"{what} syntax error: {detail}", path=path, line=line,
                               column=col, hint=hint) from None
    check_strings(msg, path, what)  # escapes such as "\\303(" are not UTF-8
    return msg


def _top_level_blocks(text: str) -> List[Tuple[str, int]]:
    """(field name, 1-based line) of every top-level field in a text-format message."""
    out: List[Tuple[str, int]] = []
    depth = 0
    line = 1
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c in "\"'":
            quote = c
            i += 1
            while i < n and text[i] != quote:
                if text[i] == "\\":
                    i += 1
                elif text[i] == "\n":
                    line += 1
                i += 1
            i += 1
        elif c in "{<":
            depth += 1
            i += 1
        elif c in "}>":
            depth -= 1
            i += 1
        elif depth == 0 and (c.isalpha() or c == "_"):
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            out.append((text[i:j], line))
            # skip the value of a scalar field (so that enum names are not taken as fields)
            k = j
            while k < n and text[k] in " \t\r":
                k += 1
            if k < n and text[k] == ":":
                k += 1
                while k < n and text[k] in " \t\r\n":
                    if text[k] == "\n":
                        line += 1
                    k += 1
                if k < n and text[k] not in "{<\"'":
                    while k < n and not text[k].isspace() and text[k] not in "{}<>#":
                        k += 1
            i = k
        else:
            i += 1
    return out


def parse_net(text: str, *, path: str = "<string>", upgrade: bool = True
              ) -> Tuple["proto.NetParameter", NetSource]:
    """Parse a network definition given as text; returns ``(net, source)``."""
    net = _parse_text(text, proto.NetParameter, path, "prototxt")
    blocks = _top_level_blocks(text)
    layer_lines = [ln for name, ln in blocks if name in ("layer", "layers")]
    input_lines = [ln for name, ln in blocks if name == "input"]
    source = NetSource(path, [])
    if upgrade:
        upgrade_net(net, path=path, source=source, layer_lines=layer_lines,
                    input_lines=input_lines)
    else:
        source.layer_lines = list(layer_lines)
    return net, source


def read_net(path: PathLike, *, upgrade: bool = True, with_source: bool = False):
    """Read a .prototxt network definition, upgraded to the current format.

    Args:
        path: the .prototxt file.
        upgrade: convert V0/V1 layers and ``input:`` fields (as Caffe does when it loads a net).
        with_source: also return a :class:`NetSource` (file and line of each layer).

    Returns:
        ``NetParameter`` (or ``(NetParameter, NetSource)``).

    Raises:
        CaffeFormatError: unreadable file or syntax error (file:line:column).
    """
    path = str(path)
    text = _read_text_file(path, "prototxt")
    net, source = parse_net(text, path=path, upgrade=upgrade)
    return (net, source) if with_source else net


# --------------------------------------------------------------------------------------------
# Binary


def parse_caffemodel(data: bytes, *, path: str = "<bytes>", upgrade: bool = True):
    """Parse the bytes of a .caffemodel (binary ``NetParameter``)."""
    net = proto.NetParameter()
    if not data:
        raise CaffeFormatError("empty caffemodel", path=path,
                               hint="the file is empty; download or write it again")
    try:
        net.ParseFromString(data)
    except _pb_message.DecodeError as exc:
        raise CaffeFormatError(
            f"not a valid caffemodel: {exc or 'protobuf decoding failed'}", path=path,
            hint="the file is truncated or is not a binary Caffe NetParameter "
                 "(a .prototxt is text, a .solverstate is a SolverState)") from None
    if not len(net.layer) and not len(net.layers):
        raise CaffeFormatError("the caffemodel contains no layers", path=path,
                               hint="the file is not a Caffe model (or is truncated)")
    check_strings(net, path, "caffemodel")
    if upgrade:
        upgrade_net(net, path=path)
    return net


def read_caffemodel(path: PathLike, *, upgrade: bool = True):
    """Read a .caffemodel (trained weights, binary ``NetParameter``), upgraded to ``layer``.

    Raises:
        CaffeFormatError: missing file, truncated or non-protobuf content, no layers.
    """
    path = str(path)
    data = read_bounded(path, "caffemodel")
    return parse_caffemodel(data, path=path, upgrade=upgrade)


def read_binaryproto(path: PathLike) -> "proto.BlobProto":
    """Read a .binaryproto file (one ``BlobProto``, e.g. Caffe's mean file)."""
    path = str(path)
    data = read_bounded(path, "binaryproto")
    blob = proto.BlobProto()
    try:
        blob.ParseFromString(data)
    except _pb_message.DecodeError as exc:
        raise CaffeFormatError(f"not a valid binaryproto: {exc}", path=path,
                               hint="the file is truncated or not a Caffe BlobProto") from None
    if not (len(blob.data) or len(blob.double_data)):
        raise CaffeFormatError("the binaryproto holds no data", path=path)
    shape, n = blob_shape(blob), len(blob.double_data) or len(blob.data)
    if any(d < 0 for d in shape) or math.prod(shape) != n:
        raise CaffeFormatError(f"the blob declares shape {shape} but holds {n} values",
                               path=path, hint="the file is corrupt; write it again")
    return blob


def write_binaryproto(path: PathLike, array: np.ndarray, *, legacy_shape: bool = False) -> None:
    """Write ``array`` (Caffe's NCHW order) as a .binaryproto file, atomically."""
    _atomic_write(str(path), array_to_blob(array, legacy_shape=legacy_shape)
                  .SerializeToString())


_atomic_write = atomic_write  # kept for callers of the old name


# --------------------------------------------------------------------------------------------
# Blobs


def blob_shape(blob) -> Tuple[int, ...]:
    """The shape of a ``BlobProto``: ``shape.dim``, else the legacy ``(num, channels, height,
    width)`` (Caffe's 4-D blobs, as written by 2014-era Caffe)."""
    if blob.HasField("shape"):
        return tuple(int(d) for d in blob.shape.dim)
    if blob.HasField("num") or blob.HasField("channels") or blob.HasField("height") \
            or blob.HasField("width"):
        return (int(blob.num), int(blob.channels), int(blob.height), int(blob.width))
    n = len(blob.data) or len(blob.double_data)
    return (n,)


def blob_to_array(blob, *, dtype=np.float32) -> np.ndarray:
    """A ``BlobProto`` as a numpy array of its shape (``data``, or ``double_data``)."""
    shape = blob_shape(blob)
    if len(blob.double_data):
        values = np.asarray(blob.double_data, dtype=np.float64)
    else:
        values = np.asarray(blob.data, dtype=np.float32)
    size = math.prod(shape)
    if values.size != size or any(d < 0 for d in shape):
        raise CaffeFormatError(f"blob of shape {shape} holds {values.size} values, "
                               f"expected {size}")
    return values.reshape(shape).astype(dtype, copy=False)


def array_to_blob(array, *, legacy_shape: bool = False, blob=None):
    """A numpy array as a ``BlobProto`` (float32 ``data`` and ``shape.dim``; with
    ``legacy_shape`` the 4-D ``num/channels/height/width`` fields instead)."""
    arr = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
    blob = proto.BlobProto() if blob is None else blob
    if legacy_shape:
        dims = (1,) * (4 - arr.ndim) + arr.shape if arr.ndim <= 4 else None
        if dims is None:
            raise ValueError(f"legacy 4-D blobs cannot hold a {arr.ndim}-D array")
        blob.num, blob.channels, blob.height, blob.width = (int(d) for d in dims)
    else:
        blob.shape.dim.extend(int(d) for d in arr.shape)
    blob.data.extend(arr.ravel().tolist())
    return blob


# --------------------------------------------------------------------------------------------
# Upgrades (Caffe's upgrade_proto.cpp)


def _copy_params(src, dst) -> None:
    """Copy every ``*_param`` sub-message set in ``src`` to the same-named field of ``dst``."""
    dst_fields = dst.DESCRIPTOR.fields_by_name
    for fd, value in src.ListFields():
        if fd.name.endswith("_param") and fd.name in dst_fields and fd.message_type:
            getattr(dst, fd.name).CopyFrom(value)


def _upgrade_v0_layer(conn, v1, path: str) -> None:
    """A V0 ``layers { layer {...} bottom top }`` connection -> V1 layer (in place)."""
    v0 = conn.layer
    v1.name = v0.name
    type_name = v0.type
    if type_name not in _V0_TYPES:
        raise CaffeFormatError(f"unknown V0 layer type {type_name!r}", path=path, layer=v0.name,
                               hint=f"known V0 types: {', '.join(sorted(_V0_TYPES))}")
    v1.type = getattr(proto.V1LayerParameter, _V0_TYPES[type_name])
    for b in v0.blobs:
        v1.blobs.add().CopyFrom(b)
    v1.blobs_lr.extend(v0.blobs_lr)
    v1.weight_decay.extend(v0.weight_decay)
    t = type_name
    if t == "conv":
        p = v1.convolution_param
        if v0.HasField("num_output"):
            p.num_output = v0.num_output
        p.bias_term = v0.biasterm
        if v0.HasField("weight_filler"):
            p.weight_filler.CopyFrom(v0.weight_filler)
        if v0.HasField("bias_filler"):
            p.bias_filler.CopyFrom(v0.bias_filler)
        if v0.pad:
            p.pad.append(v0.pad)
        if v0.HasField("kernelsize"):
            p.kernel_size.append(v0.kernelsize)
        if v0.HasField("group"):
            p.group = v0.group
        if v0.HasField("stride"):
            p.stride.append(v0.stride)
    elif t == "innerproduct":
        p = v1.inner_product_param
        if v0.HasField("num_output"):
            p.num_output = v0.num_output
        p.bias_term = v0.biasterm
        if v0.HasField("weight_filler"):
            p.weight_filler.CopyFrom(v0.weight_filler)
        if v0.HasField("bias_filler"):
            p.bias_filler.CopyFrom(v0.bias_filler)
    elif t == "pool":
        p = v1.pooling_param
        p.pool = v0.pool
        if v0.HasField("kernelsize"):
            p.kernel_size = v0.kernelsize
        if v0.HasField("stride"):
            p.stride = v0.stride
        if v0.pad:
            p.pad = v0.pad
    elif t == "dropout":
        v1.dropout_param.dropout_ratio = v0.dropout_ratio
    elif t == "lrn":
        p = v1.lrn_param
        p.local_size, p.alpha, p.beta, p.k = v0.local_size, v0.alpha, v0.beta, v0.k
    elif t in ("data", "images", "window_data"):
        dp = {"data": v1.data_param, "images": v1.image_data_param,
              "window_data": v1.window_data_param}[t]
        if v0.HasField("source"):
            dp.source = v0.source
        if v0.HasField("batchsize"):
            dp.batch_size = v0.batchsize
        if t != "window_data" and v0.rand_skip:
            dp.rand_skip = v0.rand_skip
        tp = v1.transform_param
        if v0.HasField("scale"):
            tp.scale = v0.scale
        if v0.HasField("meanfile"):
            tp.mean_file = v0.meanfile
        if v0.cropsize:
            tp.crop_size = v0.cropsize
        if v0.mirror:
            tp.mirror = v0.mirror
        if t == "images" and v0.shuffle_images:
            dp.shuffle = True
        if t == "images" and v0.new_height:
            dp.new_height, dp.new_width = v0.new_height, v0.new_width
    elif t == "concat":
        v1.concat_param.concat_dim = v0.concat_dim
    elif t == "hdf5_data":
        if v0.HasField("source"):
            v1.hdf5_data_param.source = v0.source
        if v0.HasField("batchsize"):
            v1.hdf5_data_param.batch_size = v0.batchsize
    elif t == "hdf5_output":
        v1.hdf5_output_param.CopyFrom(v0.hdf5_output_param)


def _v0_to_v1(net, path: str) -> None:
    """Upgrade V0 connections (``layers { layer {} }``) to V1, merging V0 "padding" layers
    into the following convolution like Caffe's UpgradeV0PaddingLayers."""
    conns = list(net.layers)
    pads: Dict[str, Tuple[str, int]] = {}  # padding top -> (its bottom, pad)
    new = []
    for conn in conns:
        if not conn.HasField("layer"):
            new.append(conn)
            continue
        if conn.layer.type == "padding":
            pads[conn.top[0]] = (conn.bottom[0], conn.layer.pad)
            continue
        v1 = proto.V1LayerParameter()
        v1.bottom.extend(conn.bottom)
        v1.top.extend(conn.top)
        _upgrade_v0_layer(conn, v1, path)
        for i, b in enumerate(v1.bottom):
            if b in pads:
                src, pad = pads[b]
                if v1.type not in (proto.V1LayerParameter.CONVOLUTION,
                                   proto.V1LayerParameter.POOLING):
                    raise CaffeFormatError("a V0 padding layer feeds a layer that is neither "
                                           "a convolution nor a pooling", path=path,
                                           layer=v1.name)
                v1.bottom[i] = src
                if v1.type == proto.V1LayerParameter.CONVOLUTION:
                    del v1.convolution_param.pad[:]
                    v1.convolution_param.pad.append(pad)
                else:
                    v1.pooling_param.pad = pad
        new.append(v1)
    del net.layers[:]
    for v1 in new:
        net.layers.add().CopyFrom(v1)


def _v1_to_layer(v1, path: str):
    """One V1LayerParameter -> LayerParameter (Caffe's UpgradeV1LayerParameter)."""
    layer = proto.LayerParameter()
    layer.name = v1.name
    layer.bottom.extend(v1.bottom)
    layer.top.extend(v1.top)
    enum_name = proto.V1LayerParameter.LayerType.Name(v1.type) if v1.HasField("type") else "NONE"
    type_name = V1_LAYER_TYPES.get(enum_name, "")
    if not type_name:
        raise CaffeFormatError(f"V1 layer has no usable type ({enum_name})", path=path,
                               layer=v1.name, hint="give the layer a `type:`")
    layer.type = type_name
    for rule in v1.include:
        layer.include.add().CopyFrom(rule)
    for rule in v1.exclude:
        layer.exclude.add().CopyFrom(rule)
    for b in v1.blobs:
        layer.blobs.add().CopyFrom(b)
    n_param = max(len(v1.param), len(v1.blob_share_mode), len(v1.blobs_lr),
                  len(v1.weight_decay))
    for i in range(n_param):
        spec = layer.param.add()
        if i < len(v1.param):
            spec.name = v1.param[i]
        if i < len(v1.blob_share_mode):
            spec.share_mode = v1.blob_share_mode[i]
        if i < len(v1.blobs_lr):
            spec.lr_mult = v1.blobs_lr[i]
        if i < len(v1.weight_decay):
            spec.decay_mult = v1.weight_decay[i]
    layer.loss_weight.extend(v1.loss_weight)
    _copy_params(v1, layer)
    return layer


_DATA_UPGRADE = {"Data": "data_param", "ImageData": "image_data_param",
                 "WindowData": "window_data_param"}


def _upgrade_data_transform(layer) -> None:
    """Move the old data-layer ``scale/mean_file/crop_size/mirror`` to ``transform_param``."""
    pname = _DATA_UPGRADE.get(layer.type)
    if not pname or not layer.HasField(pname):
        return
    p = getattr(layer, pname)
    tp = layer.transform_param
    for name in ("scale", "mean_file", "crop_size", "mirror"):
        if p.HasField(name):
            setattr(tp, name, getattr(p, name))
            p.ClearField(name)


def upgrade_net(net, *, path: str = "<net>", source: Optional[NetSource] = None,
                layer_lines: Sequence[Optional[int]] = (),
                input_lines: Sequence[int] = ()) -> "proto.NetParameter":
    """Upgrade ``net`` in place to the current format, as Caffe's ``UpgradeNetAsNeeded``.

    V0 connections -> V1 -> ``layer``; ``input``/``input_dim``/``input_shape`` -> leading
    ``Input`` layers (a net whose inputs have no shape keeps ``Input`` layers without
    ``input_param.shape``: the builder then needs ``input_shape``); data-layer transform fields
    -> ``transform_param``.
    """
    lines: List[Optional[int]] = list(layer_lines)
    if len(net.layers):
        if len(net.layer):
            raise CaffeFormatError("the net mixes `layer {}` (current) and `layers {}` (V1) "
                                   "definitions", path=path,
                                   hint="use one format: rename `layers` to `layer`")
        if any(conn.HasField("layer") for conn in net.layers):
            _v0_to_v1(net, path)
            lines = [None] * len(net.layers)
        for v1 in net.layers:
            net.layer.add().CopyFrom(_v1_to_layer(v1, path))
        net.ClearField("layers")
    if len(lines) != len(net.layer):
        lines = [None] * len(net.layer)
    if len(net.input):
        n_in = len(net.input)
        if len(net.input_shape) not in (0, n_in):
            raise CaffeFormatError(f"{n_in} `input` fields but {len(net.input_shape)} "
                                   "`input_shape` fields", path=path,
                                   line=input_lines[0] if input_lines else None,
                                   hint="give one input_shape per input")
        if len(net.input_dim) not in (0, 4 * n_in):
            raise CaffeFormatError(f"{n_in} `input` fields need {4 * n_in} `input_dim` values, "
                                   f"found {len(net.input_dim)}", path=path,
                                   line=input_lines[0] if input_lines else None,
                                   hint="give input_dim as N, C, H, W for each input")
        new_layers = []
        for i, name in enumerate(net.input):
            layer = proto.LayerParameter(name=name, type="Input")
            layer.top.append(name)
            if len(net.input_shape):
                layer.input_param.shape.add().CopyFrom(net.input_shape[i])
            elif len(net.input_dim):
                layer.input_param.shape.add().dim.extend(net.input_dim[4 * i:4 * i + 4])
            new_layers.append(layer)
        rest = list(net.layer)
        del net.layer[:]
        for layer in new_layers + rest:
            net.layer.add().CopyFrom(layer)
        in_line = [input_lines[i] if i < len(input_lines) else None for i in range(n_in)]
        lines = in_line + lines
        net.ClearField("input")
        net.ClearField("input_dim")
        net.ClearField("input_shape")
    for layer in net.layer:
        _upgrade_data_transform(layer)
    if source is not None:
        source.path = path
        source.layer_lines = lines
    return net


# --------------------------------------------------------------------------------------------
# Phase / stage rules (Caffe's Net::FilterNet)


def state_meets_rule(phase: int, level: int, stages: Iterable[str], rule) -> bool:
    """Whether a net state meets one ``NetStateRule`` (Caffe's ``StateMeetsRule``)."""
    stages = set(stages)
    if rule.HasField("phase") and rule.phase != phase:
        return False
    if rule.HasField("min_level") and level < rule.min_level:
        return False
    if rule.HasField("max_level") and level > rule.max_level:
        return False
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def _phase_value(phase) -> int:
    if isinstance(phase, str):
        p = phase.upper()
        if p not in ("TRAIN", "TEST"):
            raise CaffeFormatError(f"phase must be 'TRAIN' or 'TEST', got {phase!r}")
        return proto.TRAIN if p == "TRAIN" else proto.TEST
    return int(phase)


def filter_net(net, *, phase="TEST", stages: Sequence[str] = (), level: int = 0,
               source: Optional[NetSource] = None):
    """The layers of ``net`` that a net in ``phase``/``stages``/``level`` keeps.

    Returns a new ``NetParameter`` and, when ``source`` is given, a matching ``NetSource``
    (``(net, source)``); otherwise just the net.
    """
    ph = _phase_value(phase)
    out = proto.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    kept_lines: List[Optional[int]] = []
    for i, layer in enumerate(net.layer):
        if layer.include and layer.exclude:
            line = source.line_of(i) if source else None
            raise CaffeFormatError("a layer has both include and exclude rules",
                                   path=source.path if source else None, line=line,
                                   layer=layer.name, hint="keep only one of them")
        if layer.include:
            keep = any(state_meets_rule(ph, level, stages, r) for r in layer.include)
        else:
            keep = not any(state_meets_rule(ph, level, stages, r) for r in layer.exclude)
        if keep:
            out.layer.add().CopyFrom(layer)
            kept_lines.append(source.line_of(i) if source else None)
    out.state.phase = ph
    out.state.level = level
    del out.state.stage[:]
    out.state.stage.extend(stages)
    if source is not None:
        return out, NetSource(source.path, kept_lines)
    return out
