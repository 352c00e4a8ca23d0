"""Caffe's format upgrades (``upgrade_proto.cpp``): V0 ``layers { layer {} }`` and V1
``layers { type: ENUM }`` nets to the current ``layer {}`` format, the ``input:`` /
``input_dim:`` / ``input_shape:`` fields to ``Input`` layers, data-layer transform fields to
``transform_param``; and :class:`NetSource`, where a parsed net's layers came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from keras_cct.caffe.io import proto
from keras_cct.errors import CaffeFormatError

__all__ = ["NetSource", "upgrade_net", "V1_LAYER_TYPES"]

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




def _copy_params(src, dst) -> None:
    """Copy every ``*_param`` sub-message set in ``src`` to the same-named field of ``dst``."""
    dst_fields = dst.DESCRIPTOR.fields_by_name
    for fd, value in src.ListFields():
        if fd.name.endswith("_param") and fd.name in dst_fields and fd.message_type:
            getattr(dst, fd.name).CopyFrom(value)


def _copy_weighted(v0, p) -> None:
    """A V0 layer's num_output, biasterm and fillers -> a convolution or inner product param."""
    if v0.HasField("num_output"):
        p.num_output = v0.num_output
    p.bias_term = v0.biasterm
    if v0.HasField("weight_filler"):
        p.weight_filler.CopyFrom(v0.weight_filler)
    if v0.HasField("bias_filler"):
        p.bias_filler.CopyFrom(v0.bias_filler)


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
        _copy_weighted(v0, p)
        if v0.pad:
            p.pad.append(v0.pad)
        if v0.HasField("kernelsize"):
            p.kernel_size.append(v0.kernelsize)
        if v0.HasField("group"):
            p.group = v0.group
        if v0.HasField("stride"):
            p.stride.append(v0.stride)
    elif t == "innerproduct":
        _copy_weighted(v0, v1.inner_product_param)
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


