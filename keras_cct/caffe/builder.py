"""The network builder: a Caffe ``NetParameter`` -> a functional, channels-last ``keras.Model``.

:func:`build_net` walks the (upgraded, phase-filtered) layers in order, as Caffe's ``Net::Init``
does, keeping a map from blob names to Keras tensors (in-place layers simply rebind a name).
Keras layer names are Caffe layer names (``/`` -> ``__``, Keras forbids ``/``); convolutions
become :class:`keras_cct.HybridConv2D` with Caffe's explicit padding; every other layer is a
Keras layer with Caffe's exact semantics from :mod:`keras_cct.layers.caffe_layers`. Loss and
accuracy layers are not part of the model: they are returned as :class:`Head` records for the
training code, and the blobs they consume are model outputs.

:func:`load_net` is the user-facing importer (prototxt [+ caffemodel] -> ``keras.Model``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import keras

from keras_cct.caffe import proto, validate
from keras_cct.caffe.prototxt import (NetSource, filter_net, parse_net, read_net, upgrade_net,
                                      _phase_value)
from keras_cct.caffe.weights import keras_name, load_weights
from keras_cct.errors import CaffeFormatError, KerasCCTError
from keras_cct.layers import caffe_layers as cl

PathLike = Union[str, os.PathLike]
Shape = Tuple[Optional[int], ...]

__all__ = ["CaffeNet", "Head", "build_net", "load_net", "import_net", "SUPPORTED_TYPES",
           "DATA_TYPES", "HEAD_TYPES"]

DATA_TYPES = ("Data", "ImageData", "HDF5Data", "MemoryData", "WindowData", "DummyData")
HEAD_TYPES = ("SoftmaxWithLoss", "EuclideanLoss", "Accuracy", "SigmoidCrossEntropyLoss")
_LOSS_TYPES = ("SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss")


@dataclass
class Head:
    """A loss or accuracy layer kept for training (not part of the Keras model).

    Attributes:
        name: the Caffe layer name.
        type: ``SoftmaxWithLoss``, ``EuclideanLoss``, ``Accuracy`` or
            ``SigmoidCrossEntropyLoss``.
        bottoms: the blob names it consumes (model outputs, or model inputs such as "label").
        tops: the blob names it produces.
        loss_weight: Caffe's weight of its first top (1 for losses, 0 for Accuracy, unless the
            prototxt says otherwise).
        param: the layer's ``LayerParameter`` (``loss_param``, ``accuracy_param``, ...).
    """

    name: str
    type: str
    bottoms: List[str]
    tops: List[str]
    loss_weight: float
    param: object


@dataclass
class CaffeNet:
    """The result of :func:`build_net`.

    Attributes:
        model: functional ``keras.Model`` (channels-last; inputs in ``inputs`` order, outputs
            in ``outputs`` order).
        inputs: model input blob name -> channels-last shape, batch first (Caffe's batch size
            when the prototxt gives one, else ``None``).
        heads: the loss/accuracy layers (:class:`Head`), in net order.
        outputs: the Caffe blob name of each model output, in order.
        net_param: the upgraded, phase-filtered ``NetParameter`` the model was built from.
        phase: ``"TRAIN"`` or ``"TEST"``.
        caffe_names: Keras layer name -> Caffe layer name.
        output_layer_names: Keras name of each model output (== blob name unless that name
            belongs to another layer, then ``<blob>_blob``).
    """

    model: keras.Model
    inputs: Dict[str, Shape]
    heads: List[Head]
    outputs: List[str]
    net_param: object
    phase: str
    caffe_names: Dict[str, str] = field(default_factory=dict)
    output_layer_names: List[str] = field(default_factory=list)
    blobs: Dict[str, object] = field(default_factory=dict, repr=False)

    def caffe_input_shapes(self) -> Dict[str, Shape]:
        """Model inputs in Caffe's (N, C, H, W) order."""
        return {k: cl.caffe_shape(v) for k, v in self.inputs.items()}

    def submodel(self, blob_names: Sequence[str]) -> keras.Model:
        """A model with the same inputs whose outputs are the named blobs (their final value,
        after any in-place layers), e.g. to extract features at ``"pool5"``."""
        missing = [b for b in blob_names if b not in self.blobs]
        if missing:
            raise KeyError(f"unknown blob(s) {missing}; known: {sorted(self.blobs)}")
        return keras.Model(self.model.inputs, [self.blobs[b] for b in blob_names])


# --------------------------------------------------------------------------------------------
# Layer converters: (ctx, layer_param, bottom tensors) -> list of top tensors


class _Ctx:
    def __init__(self, source: NetSource, phase: int, conv_impl: str = "hybrid",
                 conv_options: Optional[Mapping] = None) -> None:
        self.source = source
        self.phase = phase
        self.conv_impl = conv_impl
        self.conv_options = dict(conv_options or {})
        self.batch: Optional[int] = None  # Caffe batch size of the first input
        self.index = 0
        self.lp = None
        self.names: Dict[str, str] = {}  # keras name -> caffe name

    def error(self, message: str, hint: Optional[str] = None) -> CaffeFormatError:
        return CaffeFormatError(message, path=self.source.path,
                                line=self.source.line_of(self.index),
                                layer=self.lp.name if self.lp is not None else None, hint=hint)

    def kname(self) -> str:
        return keras_name(self.lp.name)


def _hw(ctx: _Ctx, p, single: str, h: str, w: str, default: Optional[int]) -> Tuple[int, int]:
    """Caffe's (h, w) from repeated ``single`` (0, 1 or 2 values) or ``h``/``w`` fields."""
    has_hw = p.HasField(h) or p.HasField(w)
    vals = getattr(p, single)
    is_repeated = not isinstance(vals, int)
    if has_hw:
        if not (p.HasField(h) and p.HasField(w)):
            raise ctx.error(f"give both {h} and {w}")
        if (is_repeated and len(vals)) or (not is_repeated and p.HasField(single)):
            raise ctx.error(f"give either {single} or {h}/{w}, not both")
        return int(getattr(p, h)), int(getattr(p, w))
    if is_repeated:
        if len(vals) == 0:
            if default is None:
                raise ctx.error(f"{single} is required")
            return default, default
        if len(vals) == 1:
            return int(vals[0]), int(vals[0])
        if len(vals) == 2:
            return int(vals[0]), int(vals[1])
        raise ctx.error(f"{single} has {len(vals)} values: only 2-D is supported")
    if not p.HasField(single) and default is None:
        raise ctx.error(f"{single} (or {h} and {w}) is required")
    return int(vals), int(vals)


def _need_rank(ctx: _Ctx, x, rank: int, what: str) -> None:
    if len(x.shape) != rank:
        raise ctx.error(f"{what} needs a {rank}-D input (N, C, H, W), got a "
                        f"{len(x.shape)}-D blob of Caffe shape {cl.caffe_shape(x.shape)}")


def _conv_args(ctx: _Ctx, p):
    if p.axis != 1:
        raise ctx.error(f"convolution axis {p.axis} is not supported (only 1)")
    if not p.HasField("num_output"):
        raise ctx.error("num_output is required")
    k = _hw(ctx, p, "kernel_size", "kernel_h", "kernel_w", None)
    s = _hw(ctx, p, "stride", "stride_h", "stride_w", 1)
    pad = _hw(ctx, p, "pad", "pad_h", "pad_w", 0)
    if len(p.dilation) > 2:
        raise ctx.error("dilation has more than 2 values: only 2-D is supported")
    d = ((p.dilation[0],) * 2 if len(p.dilation) == 1 else tuple(p.dilation)
         if len(p.dilation) == 2 else (1, 1))
    return int(p.num_output), k, s, pad, (int(d[0]), int(d[1])), int(p.group), bool(p.bias_term)


def _convolution(ctx, lp, xs):
    x = xs[0]
    _need_rank(ctx, x, 4, "Convolution")
    n_out, k, s, pad, d, g, bias = _conv_args(ctx, lp.convolution_param)
    if ctx.conv_impl == "keras":
        # keras.layers.Conv2D (same kernel layout), explicit padding as a ZeroPadding2D
        if pad != (0, 0):
            x = keras.layers.ZeroPadding2D(pad, name=ctx.kname() + "_pad")(x)
        layer = keras.layers.Conv2D(n_out, k, strides=s, padding="valid", dilation_rate=d,
                                    groups=g, use_bias=bias, name=ctx.kname(),
                                    **ctx.conv_options)
        return [layer(x)]
    from keras_cct import HybridConv2D
    layer = HybridConv2D(n_out, k, strides=s, padding=((pad[0], pad[0]), (pad[1], pad[1])),
                         dilation_rate=d, groups=g, use_bias=bias, name=ctx.kname(),
                         **ctx.conv_options)
    return [layer(x)]


def _deconvolution(ctx, lp, xs):
    x = xs[0]
    _need_rank(ctx, x, 4, "Deconvolution")
    n_out, k, s, pad, d, g, bias = _conv_args(ctx, lp.convolution_param)
    layer = cl.CaffeDeconvolution(n_out, k, s, pad, d, g, bias, name=ctx.kname())
    return [layer(x)]


def _pooling(ctx, lp, xs):
    x = xs[0]
    _need_rank(ctx, x, 4, "Pooling")
    p = lp.pooling_param
    pool = proto.PoolingParameter.PoolMethod.Name(p.pool)
    if pool == "STOCHASTIC":
        raise ctx.error("STOCHASTIC pooling is not supported", hint="use MAX or AVE")
    if p.global_pooling:
        if p.HasField("kernel_size") or p.HasField("kernel_h"):
            raise ctx.error("global_pooling and kernel_size cannot both be given")
        k = (1, 1)
    else:
        k = _hw(ctx, p, "kernel_size", "kernel_h", "kernel_w", None)
    s = _hw(ctx, p, "stride", "stride_h", "stride_w", 1)
    pad = _hw(ctx, p, "pad", "pad_h", "pad_w", 0)
    if p.global_pooling and (pad != (0, 0) or s != (1, 1)):
        raise ctx.error("global pooling needs pad 0 and stride 1")
    layer = cl.CaffePooling2D(pool, k, s, pad, global_pooling=p.global_pooling,
                              round_mode=proto.PoolingParameter.RoundMode.Name(p.round_mode),
                              name=ctx.kname())
    return [layer(x)]


def _inner_product(ctx, lp, xs):
    p = lp.inner_product_param
    if not p.HasField("num_output"):
        raise ctx.error("num_output is required")
    layer = cl.CaffeInnerProduct(p.num_output, axis=p.axis, bias_term=p.bias_term,
                                 name=ctx.kname())
    return [layer(xs[0])]


def _relu(ctx, lp, xs):
    slope = lp.relu_param.negative_slope
    return [keras.layers.ReLU(negative_slope=float(slope), name=ctx.kname())(xs[0])]


def _prelu(ctx, lp, xs):
    if len(xs[0].shape) < 2:
        raise ctx.error("PReLU needs an input with a channel axis")
    return [cl.CaffePReLU(lp.prelu_param.channel_shared, name=ctx.kname())(xs[0])]


def _activation(fn: str):
    def build(ctx, lp, xs):
        return [keras.layers.Activation(fn, name=ctx.kname())(xs[0])]
    return build


def _elu(ctx, lp, xs):
    return [keras.layers.ELU(alpha=float(lp.elu_param.alpha), name=ctx.kname())(xs[0])]


def _unary(op: str):
    def build(ctx, lp, xs):
        kw = {}
        if op == "Power":
            p = lp.power_param
            kw = dict(power=p.power, scale=p.scale, shift=p.shift)
        elif op in ("Exp", "Log"):
            p = lp.exp_param if op == "Exp" else lp.log_param
            if p.base != -1 and p.base <= 0:
                raise ctx.error(f"{op} base must be -1 (e) or > 0, got {p.base}")
            kw = dict(base=p.base, scale=p.scale, shift=p.shift)
        elif op == "Clip":
            if not lp.HasField("clip_param"):
                raise ctx.error("Clip needs clip_param { min max }")
            kw = dict(min=lp.clip_param.min, max=lp.clip_param.max)
        elif op == "Threshold":
            kw = dict(threshold=lp.threshold_param.threshold)
        elif op == "Swish":
            kw = dict(beta=lp.swish_param.beta)
        return [cl.CaffeUnary(op, name=ctx.kname(), **kw)(xs[0])]
    return build


def _lrn(ctx, lp, xs):
    p = lp.lrn_param
    region = proto.LRNParameter.NormRegion.Name(p.norm_region)
    if region == "WITHIN_CHANNEL":
        _need_rank(ctx, xs[0], 4, "WITHIN_CHANNEL LRN")
    if p.local_size % 2 == 0:
        raise ctx.error(f"LRN local_size must be odd, got {p.local_size}")
    layer = cl.CaffeLRN(p.local_size, p.alpha, p.beta, p.k, region, name=ctx.kname())
    return [layer(xs[0])]


def _batch_norm(ctx, lp, xs):
    p = lp.batch_norm_param
    ugs = bool(p.use_global_stats) if p.HasField("use_global_stats") else None
    layer = cl.CaffeBatchNorm(p.eps, p.moving_average_fraction, ugs, name=ctx.kname())
    return [layer(xs[0])]


def _scale(ctx, lp, xs):
    p = lp.scale_param
    if len(xs) == 2:
        if p.axis != 0:
            raise ctx.error("Scale with two bottoms is supported with axis: 0 only")
        layer = cl.CaffeScale(0, -1, p.bias_term, name=ctx.kname())
        return [layer([xs[0], xs[1]])]
    layer = cl.CaffeScale(p.axis, p.num_axes, p.bias_term, name=ctx.kname())
    return [layer(xs[0])]


def _bias(ctx, lp, xs):
    if len(xs) != 1:
        raise ctx.error("Bias with two bottoms is not supported", hint="use Eltwise SUM")
    p = lp.bias_param
    return [cl.CaffeBias(p.axis, p.num_axes, name=ctx.kname())(xs[0])]


def _eltwise(ctx, lp, xs):
    p = lp.eltwise_param
    op = proto.EltwiseParameter.EltwiseOp.Name(p.operation)
    if len(xs) < 2:
        raise ctx.error("Eltwise needs at least two bottoms")
    if len(p.coeff) and len(p.coeff) != len(xs):
        raise ctx.error(f"Eltwise has {len(p.coeff)} coeff for {len(xs)} bottoms")
    if len(p.coeff) and op != "SUM":
        raise ctx.error("Eltwise coeff is only allowed with operation SUM")
    shapes = {tuple(x.shape[1:]) for x in xs}
    if len(shapes) != 1:
        raise ctx.error(f"Eltwise bottoms have different shapes: "
                        f"{[cl.caffe_shape(x.shape) for x in xs]}")
    return [cl.CaffeEltwise(op, list(p.coeff) or None, name=ctx.kname())(list(xs))]


def _concat(ctx, lp, xs):
    p = lp.concat_param
    axis = p.concat_dim if p.HasField("concat_dim") and not p.HasField("axis") else p.axis
    if len(xs) == 1:
        return [keras.layers.Identity(name=ctx.kname())(xs[0])]
    return [cl.CaffeConcat(axis, name=ctx.kname())(list(xs))]


def _slice(ctx, lp, xs):
    p = lp.slice_param
    axis = p.slice_dim if p.HasField("slice_dim") and not p.HasField("axis") else p.axis
    layer = cl.CaffeSlice(axis, list(p.slice_point), len(lp.top), name=ctx.kname())
    out = layer(xs[0])
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _flatten(ctx, lp, xs):
    p = lp.flatten_param
    return [cl.CaffeFlatten(p.axis, p.end_axis, name=ctx.kname())(xs[0])]


def _reshape(ctx, lp, xs):
    p = lp.reshape_param
    dims = [int(d) for d in p.shape.dim]
    # a batch size written out (``dim: 1`` for a batch-1 deploy net) keeps the batch axis:
    # the Keras model's batch stays dynamic
    if p.axis == 0 and dims and dims[0] > 0 and dims[0] == ctx.batch:
        dims[0] = 0
    return [cl.CaffeReshape(dims, p.axis, p.num_axes, name=ctx.kname())(xs[0])]


def _crop(ctx, lp, xs):
    if len(xs) != 2:
        raise ctx.error("Crop needs two bottoms (the blob and the reference)")
    p = lp.crop_param
    return [cl.CaffeCrop(p.axis, list(p.offset), name=ctx.kname())([xs[0], xs[1]])]


def _softmax(ctx, lp, xs):
    return [cl.CaffeSoftmax(lp.softmax_param.axis, name=ctx.kname())(xs[0])]


def _dropout(ctx, lp, xs):
    ratio = float(lp.dropout_param.dropout_ratio)
    return [keras.layers.Dropout(ratio, name=ctx.kname())(xs[0])]


_CONVERTERS: Dict[str, Callable] = {
    "Convolution": _convolution, "Deconvolution": _deconvolution, "Pooling": _pooling,
    "InnerProduct": _inner_product, "ReLU": _relu, "PReLU": _prelu,
    "Sigmoid": _activation("sigmoid"), "TanH": _activation("tanh"), "ELU": _elu,
    "AbsVal": _unary("AbsVal"), "Power": _unary("Power"), "Exp": _unary("Exp"),
    "Log": _unary("Log"), "BNLL": _unary("BNLL"), "Clip": _unary("Clip"),
    "Threshold": _unary("Threshold"), "Swish": _unary("Swish"), "LRN": _lrn,
    "BatchNorm": _batch_norm, "Scale": _scale, "Bias": _bias, "Eltwise": _eltwise,
    "Concat": _concat, "Slice": _slice, "Flatten": _flatten, "Reshape": _reshape,
    "Crop": _crop, "Softmax": _softmax, "Dropout": _dropout,
}
_ONE_TOP = set(_CONVERTERS) - {"Slice"}

SUPPORTED_TYPES: Tuple[str, ...] = tuple(sorted(set(_CONVERTERS) | {"Input", "Split",
                                                                     "Silence"}
                                                | set(DATA_TYPES) | set(HEAD_TYPES)))


# --------------------------------------------------------------------------------------------
# build_net


def _prepare(net_param, source) -> Tuple[object, NetSource]:
    net = proto.NetParameter()
    net.CopyFrom(net_param)
    src: Optional[NetSource] = source if isinstance(source, NetSource) else None
    path = str(source) if isinstance(source, (str, os.PathLike)) else (
        src.path if src else "<net>")
    needs_upgrade = bool(len(net.layers) or len(net.input))
    if src is None and isinstance(source, (str, os.PathLike)) and Path(path).is_file():
        try:
            _, src_guess = parse_net(Path(path).read_text(encoding="utf-8"), path=path)
        except (KerasCCTError, OSError, UnicodeDecodeError):
            src_guess = None
        if needs_upgrade:
            upgrade_net(net, path=path)
        if src_guess is not None and len(src_guess.layer_lines) == len(net.layer):
            src = src_guess
    elif needs_upgrade:
        upgrade_net(net, path=path)
    if src is None or len(src.layer_lines) != len(net.layer):
        src = NetSource(path, [None] * len(net.layer))
    return net, src


def _shape_of(dims) -> Tuple[int, ...]:
    return tuple(int(d) for d in dims)


def _data_top_shapes(ctx: _Ctx, lp, input_shapes: Mapping[str, Sequence[int]]
                     ) -> List[Tuple[int, ...]]:
    """Caffe shapes of a data layer's tops, from ``input_shapes`` or the layer's own fields."""
    shapes: List[Optional[Tuple[int, ...]]] = []
    batch = None
    t = lp.type
    if t == "MemoryData":
        p = lp.memory_data_param
        batch = int(p.batch_size)
        known = [(batch, int(p.channels), int(p.height), int(p.width)), (batch,)]
    elif t == "DummyData":
        p = lp.dummy_data_param
        known = []
        for i in range(len(lp.top)):
            if len(p.shape):
                known.append(_shape_of(p.shape[min(i, len(p.shape) - 1)].dim))
            elif len(p.num):
                j = min(i, len(p.num) - 1)
                known.append((p.num[j], p.channels[j], p.height[j], p.width[j]))
    else:
        pname = {"Data": "data_param", "ImageData": "image_data_param",
                 "HDF5Data": "hdf5_data_param", "WindowData": "window_data_param"}[t]
        p = getattr(lp, pname)
        batch = int(p.batch_size) if p.HasField("batch_size") else None
        known = []
        if t == "ImageData" and p.new_height and p.new_width:
            c = 3 if p.is_color else 1
            crop = lp.transform_param.crop_size
            h, w = (crop, crop) if crop else (p.new_height, p.new_width)
            known = [(batch or 1, c, h, w)]
    # All tops of a data layer share its batch: a batch given for one top in input_shapes
    # (e.g. data=32,3,227,227 for a layer with batch_size 256) is the batch of the others
    # (the label) too. DummyData's tops have their own shapes and are left alone.
    given = {_shape_of(input_shapes[top])[0] for top in lp.top if top in input_shapes}
    given.discard(0)
    if t != "DummyData" and len(given) > 1:
        named = ", ".join(f"{top}={','.join(map(str, input_shapes[top]))}"
                          for top in lp.top if top in input_shapes)
        raise ctx.error(f"{t} layer tops are given different batch sizes ({named})",
                        hint="the tops of a data layer share one batch size")
    if t != "DummyData" and given:
        batch = given.pop()
        known = [(batch,) + tuple(k[1:]) for k in known]
    for i, top in enumerate(lp.top):
        if top in input_shapes:
            shapes.append(_shape_of(input_shapes[top]))
        elif i < len(known):
            shapes.append(known[i])
        elif i == 1 and t != "DummyData":
            shapes.append((batch or 1,))  # the label blob: (N,)
        else:
            raise ctx.error(f"{t} layer top '{top}' has no known shape",
                            hint=f"pass input_shapes={{'{top}': (N, C, H, W)}} to build_net "
                                 f"(load_net / import_net: input_shape=)")
    return shapes  # type: ignore[return-value]


def build_net(net_param, *, phase: str = "TEST", stages: Sequence[str] = (),
              input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
              source: Union[None, PathLike, NetSource] = None, level: int = 0,
              conv_impl: str = "hybrid", conv_options: Optional[Mapping] = None,
              _drop_heads: bool = False) -> CaffeNet:
    """Build the Keras model of a Caffe net for one phase.

    Args:
        net_param: a ``NetParameter`` (any format; V0/V1 and ``input:`` fields are upgraded).
        phase: ``"TRAIN"`` or ``"TEST"``: selects layers by their include/exclude rules.
        stages: the net state's stages (for ``stage``/``not_stage`` rules).
        input_shapes: Caffe shape ``(N, C, H, W)`` (or ``(N, ...)``) per input blob name;
            overrides the prototxt, and is needed for data layers whose shape the prototxt does
            not give.
        source: the prototxt path (or a :class:`NetSource`), used in error messages.
        level: the net state's level.
        conv_impl: ``"hybrid"`` (:class:`keras_cct.HybridConv2D`, the default) or ``"keras"``
            (``keras.layers.Conv2D`` after a ``ZeroPadding2D`` named ``<layer>_pad``: the
            same net with Keras' own convolution, e.g. to compare speed; same weights).
        conv_options: extra keyword arguments for every convolution layer, e.g.
            ``{"lowering": "type1"}`` or ``{"device": "opencl:0:0"}`` for HybridConv2D.

    Returns:
        :class:`CaffeNet`. Its model's outputs are the blobs the heads consume followed by the
        blobs no layer consumes (sorted by name, as Caffe orders its outputs).

    Raises:
        CaffeFormatError: naming the file, line and layer: unknown layer type (the supported
            ones are listed), a bottom no earlier layer produces, bad parameters, shapes.
    """
    input_shapes = dict(input_shapes or {})
    net, src = _prepare(net_param, source)
    ph = _phase_value(phase)
    net, src = filter_net(net, phase=ph, stages=stages, level=level, source=src)
    if conv_impl not in ("hybrid", "keras"):
        raise ValueError(f"conv_impl must be 'hybrid' or 'keras', got {conv_impl!r}")
    ctx = _Ctx(src, ph, conv_impl, conv_options)
    blobs: Dict[str, object] = {}
    available: List[str] = []
    input_tensors: List[object] = []
    inputs: Dict[str, Shape] = {}
    input_names: Dict[str, str] = {}
    heads: List[Head] = []
    head_blobs: Dict[str, object] = {}
    used_names: Dict[str, int] = {}
    consumed: set = set()
    caffe_names: Dict[str, str] = {}
    all_layer_names = {keras_name(lp.name) for lp in net.layer}

    def claim(kname: str, what: str) -> None:
        if kname in used_names:
            raise ctx.error(f"duplicate {what} name '{kname}' (also at layer #"
                            f"{used_names[kname] + 1})", hint="Keras needs unique layer names")
        used_names[kname] = ctx.index

    def add_input(top: str, cshape: Tuple[int, ...]) -> None:
        if top in blobs:
            raise ctx.error(f"input blob '{top}' is produced twice")
        if any(d <= 0 for d in cshape[1:]):
            raise ctx.error(f"input '{top}' has a non-positive dimension {cshape}")
        validate.check_input(ctx, top, cshape)
        kshape = cl.keras_shape(cshape)
        name = keras_name(top)
        if name in used_names or (name in all_layer_names and name != ctx.kname()):
            name = ctx.kname() if ctx.kname() not in used_names else f"{name}_input"
        claim(name, "input")
        t = keras.Input(shape=kshape[1:], name=name)
        blobs[top] = t
        available.append(top)
        input_tensors.append(t)
        inputs[top] = (cshape[0] if cshape[0] > 0 else None,) + tuple(kshape[1:])
        if ctx.batch is None and cshape[0] > 0:
            ctx.batch = int(cshape[0])
        input_names[top] = name

    for i, lp in enumerate(net.layer):
        ctx.index, ctx.lp = i, lp
        t = lp.type
        for b in lp.bottom:
            if b not in blobs:
                raise ctx.error(f"bottom blob '{b}' is not produced by any earlier layer",
                                hint="check the spelling, the layer order and the "
                                     "include/exclude phase rules")
        if t == "Input":
            shapes = lp.input_param.shape
            for j, top in enumerate(lp.top):
                if top in input_shapes:
                    cshape = _shape_of(input_shapes[top])
                elif len(shapes) == len(lp.top):
                    cshape = _shape_of(shapes[j].dim)
                elif len(shapes) == 1:
                    cshape = _shape_of(shapes[0].dim)
                else:
                    raise ctx.error(f"input '{top}' has no shape",
                                    hint=f"give input_param {{ shape {{ dim: ... }} }} or "
                                         f"input_shape=(N, C, H, W) for '{top}'")
                add_input(top, cshape)
            continue
        if t in DATA_TYPES:
            for top, cshape in zip(lp.top, _data_top_shapes(ctx, lp, input_shapes)):
                add_input(top, cshape)
            continue
        if t in HEAD_TYPES and _drop_heads:
            continue
        for b in lp.bottom:
            if b in available:
                available.remove(b)
            consumed.add(b)
        if t in HEAD_TYPES:
            lw = (float(lp.loss_weight[0]) if len(lp.loss_weight)
                  else (1.0 if t in _LOSS_TYPES else 0.0))
            heads.append(Head(lp.name, t, list(lp.bottom), list(lp.top), lw, lp))
            for b in lp.bottom:
                head_blobs.setdefault(b, blobs[b])
            continue
        if t == "Split":
            for top in lp.top:
                blobs[top] = blobs[lp.bottom[0]]
                available.append(top)
            continue
        if t == "Silence":
            continue
        conv = _CONVERTERS.get(t)
        if conv is None:
            raise ctx.error(f"unsupported layer type '{t}'",
                            hint=f"supported types: {', '.join(SUPPORTED_TYPES)}")
        if not len(lp.bottom):
            raise ctx.error(f"{t} layer has no bottom")
        if t in _ONE_TOP and len(lp.top) != 1:
            raise ctx.error(f"{t} layer must have exactly one top, has {len(lp.top)}")
        claim(ctx.kname(), "layer")
        caffe_names[ctx.kname()] = lp.name
        xs = [blobs[b] for b in lp.bottom]
        validate.check_layer(ctx, lp, xs)
        try:
            outs = conv(ctx, lp, xs)
        except CaffeFormatError:
            raise
        except (ValueError, KerasCCTError, TypeError) as exc:
            raise ctx.error(f"cannot build the {t} layer: {exc}") from None
        if len(outs) != len(lp.top):
            raise ctx.error(f"{t} layer produced {len(outs)} outputs for {len(lp.top)} tops")
        for top, out in zip(lp.top, outs):
            blobs[top] = out
            if top in available:
                available.remove(top)
            available.append(top)

    if not input_tensors:
        raise CaffeFormatError("the net has no inputs (no Input/data layer nor `input:`)",
                               path=src.path, hint="add an Input layer or input_shape")
    # outputs: blobs the heads consume, then the blobs no layer consumes (Caffe: sorted)
    out_names: List[str] = []
    out_tensors: List[object] = []
    for b, tensor in head_blobs.items():
        out_names.append(b)
        out_tensors.append(tensor)
    for b in sorted(set(available)):
        if b in head_blobs:
            continue
        if _drop_heads and b in inputs:
            continue  # an input nothing uses (a label in a TEST net): not an output
        out_names.append(b)
        out_tensors.append(blobs[b])
    if not out_tensors:
        raise CaffeFormatError("the net has no outputs", path=src.path)
    keep_inputs = [(top, t) for top, t in zip(inputs, input_tensors)]
    if _drop_heads:
        keep_inputs = [(top, t) for top, t in keep_inputs if top in consumed or
                       top in out_names]
    final_outputs: List[object] = []
    output_layer_names: List[str] = []
    for b, tensor in zip(out_names, out_tensors):
        producer = tensor._keras_history.operation.name
        want = keras_name(b)
        if producer == want:
            final_outputs.append(tensor)
            output_layer_names.append(want)
            continue
        name = want if want not in used_names else f"{want}_blob"
        while name in used_names:
            name += "_"
        used_names[name] = -1
        final_outputs.append(keras.layers.Identity(name=name)(tensor))
        output_layer_names.append(name)
    model_name = keras_name(net.name or "caffe_net")
    try:
        model = keras.Model(inputs=[t for _, t in keep_inputs], outputs=final_outputs,
                            name=model_name)
    except ValueError as exc:
        raise CaffeFormatError(f"cannot assemble the model: {exc}", path=src.path) from None
    return CaffeNet(model=model, inputs={top: inputs[top] for top, _ in keep_inputs},
                    heads=heads, outputs=out_names, net_param=net,
                    phase="TRAIN" if ph == proto.TRAIN else "TEST", caffe_names=caffe_names,
                    output_layer_names=output_layer_names, blobs=dict(blobs))


# --------------------------------------------------------------------------------------------
# load_net


def _input_shapes_arg(net, input_shape) -> Dict[str, Tuple[int, ...]]:
    if input_shape is None:
        return {}
    if isinstance(input_shape, Mapping):
        return {k: tuple(int(d) for d in v) for k, v in input_shape.items()}
    names = []
    for lp in net.layer:
        if lp.type == "Input" or lp.type in DATA_TYPES:
            names.extend(lp.top[:1])
    names.extend(net.input)
    if not names:
        raise CaffeFormatError("input_shape given but the net has no input")
    return {names[0]: tuple(int(d) for d in input_shape)}


def import_net(prototxt, weights=None, *, phase: str = "TEST", stages: Sequence[str] = (),
               input_shape=None, strict: bool = True, conv_impl: str = "hybrid",
               conv_options: Optional[Mapping] = None) -> CaffeNet:
    """Like :func:`load_net` but returns the :class:`CaffeNet` (model, inputs, outputs)."""
    if isinstance(prototxt, (str, os.PathLike)):
        net, source = read_net(prototxt, with_source=True)
    else:
        net, source = prototxt, None
    shapes = _input_shapes_arg(net, input_shape)
    built = build_net(net, phase=phase, stages=stages, input_shapes=shapes, source=source,
                      conv_impl=conv_impl, conv_options=conv_options, _drop_heads=True)
    if weights is not None:
        load_weights(built, weights, strict=strict, net_param=built.net_param)
    return built


def load_net(prototxt, weights=None, *, phase: str = "TEST", stages: Sequence[str] = (),
             input_shape=None, strict: bool = True, conv_impl: str = "hybrid",
             conv_options: Optional[Mapping] = None) -> keras.Model:
    """Import a Caffe network (and its trained weights) as a functional ``keras.Model``.

    Args:
        prototxt: the .prototxt path (or a ``NetParameter``).
        weights: an optional .caffemodel path (or ``NetParameter``); layers are matched by
            name and the caffemodel's extra layers (data, losses of the TRAIN net) ignored.
        phase, stages: the net state selecting layers by their include/exclude rules.
        input_shape: Caffe shape ``(N, C, H, W)`` of the (first) input, or a dict per input
            blob name; needed when the prototxt gives none (or to change the image size).
        strict: a weighted layer missing from ``weights`` is an error (else a warning).
        conv_impl, conv_options: how convolutions are built (see :func:`build_net`).

    Returns:
        A ``keras.Model`` with channels-last inputs (one per Caffe input, named by the blob)
        and outputs (the blobs no layer consumes, sorted by name as Caffe does, named by the
        blob); Keras layer names are Caffe layer names (``/`` -> ``__``). Loss and accuracy
        layers are dropped.

    Raises:
        CaffeFormatError: for any problem in either file, naming the file, the line (text) or
            the layer, and how to fix it. Nothing is returned half-built.
    """
    return import_net(prototxt, weights, phase=phase, stages=stages, input_shape=input_shape,
                      strict=strict, conv_impl=conv_impl, conv_options=conv_options).model
