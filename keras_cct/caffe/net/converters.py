"""The layer converters of the network builder: ``(ctx, layer_param, bottom tensors) -> list of
top tensors``, one per Caffe layer type (:data:`CONVERTERS`). Convolutions become
:class:`~keras_cct.layers.HybridConv2D` with Caffe's explicit padding (or, with
``conv_impl="keras"``, ``keras.layers.Conv2D`` after a ``ZeroPadding2D``: see
:mod:`keras_cct.layers.convert`); every other layer is a Keras layer with Caffe's exact semantics
from :mod:`keras_cct.caffe.net.layers`."""

from __future__ import annotations

from typing import Callable, Dict

import keras

from keras_cct.caffe.io import proto
from keras_cct.caffe.net import layers as cl
from keras_cct.caffe.net.context import Ctx, conv_args
from keras_cct.caffe.net.context import hw as _hw
from keras_cct.caffe.net.context import need_rank as _need_rank
from keras_cct.layers.convert import keras_conv_layers
from keras_cct.layers.hybrid_conv2d import HybridConv2D

__all__ = ["Ctx", "CONVERTERS", "ONE_TOP", "NO_BOTTOM"]



def _convolution(ctx, lp, xs):
    x = xs[0]
    _need_rank(ctx, x, 4, "Convolution")
    n_out, k, s, pad, d, g, bias = conv_args(ctx, lp.convolution_param)
    if ctx.conv_impl == "keras":
        # keras.layers.Conv2D (same kernel layout), explicit padding as a ZeroPadding2D
        for layer in keras_conv_layers(n_out, k, strides=s, padding=pad, dilation_rate=d,
                                       groups=g, use_bias=bias, name=ctx.kname(),
                                       pad_name=ctx.kname() + "_pad", **ctx.conv_options):
            x = layer(x)
        return [x]
    layer = HybridConv2D(n_out, k, strides=s, padding=((pad[0], pad[0]), (pad[1], pad[1])),
                         dilation_rate=d, groups=g, use_bias=bias, name=ctx.kname(),
                         **ctx.conv_options)
    return [layer(x)]


def _deconvolution(ctx, lp, xs):
    x = xs[0]
    _need_rank(ctx, x, 4, "Deconvolution")
    n_out, k, s, pad, d, g, bias = conv_args(ctx, lp.convolution_param)
    layer = cl.CaffeDeconvolution(n_out, k, s, pad, d, g, bias, name=ctx.kname())
    return [layer(x)]


def _pooling(ctx, lp, xs):
    x = xs[0]
    _need_rank(ctx, x, 4, "Pooling")
    p = lp.pooling_param
    pool = proto.PoolingParameter.PoolMethod.Name(p.pool)
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
    if len(lp.top) > 2 or (len(lp.top) == 2 and pool != "MAX"):
        raise ctx.error("Pooling has one top, or two (the output and the mask) for MAX")
    mask = len(lp.top) == 2
    before = _relu_input(x) if ctx.fuse and pool == "MAX" and not mask else None
    layer = cl.CaffePooling2D(pool, k, s, pad, global_pooling=p.global_pooling,
                              round_mode=converters_forks.pooling_round_mode(ctx, p),
                              return_mask=mask, relu=before is not None, name=ctx.kname())
    out = layer(x if before is None else before)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _relu_input(x):
    """The input of the plain ReLU (negative slope 0, no cap) whose output ``x`` is, or None:
    a MAX pooling of it is the ReLU of the input's pooling, on fewer elements."""
    relu = getattr(getattr(x, "_keras_history", None), "operation", None)
    if (type(relu) is not keras.layers.ReLU or relu.negative_slope != 0
            or relu.max_value is not None or relu.threshold != 0
            or len(relu._inbound_nodes) != 1):
        return None
    inputs = relu._inbound_nodes[0].input_tensors
    return inputs[0] if len(inputs) == 1 else None


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


CONVERTERS: Dict[str, Callable] = {
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
_MULTI_TOP = {"Slice"}
#: types that take no bottom (Parameter): the builder hands their converter the net's first input
NO_BOTTOM: set = set()


def _register(more: Dict[str, Callable], multi_top=(), no_bottom=()) -> None:
    """Adds another module's converters (one definition per type: a clash is a bug)."""
    clash = set(more) & set(CONVERTERS)
    if clash:
        raise RuntimeError(f"Caffe layer types converted twice: {sorted(clash)}")
    CONVERTERS.update(more)
    _MULTI_TOP.update(multi_top)
    NO_BOTTOM.update(no_bottom)


from keras_cct.caffe.net import converters_bvlc, converters_forks, converters_recurrent  # noqa: E402

for _mod in (converters_bvlc, converters_forks, converters_recurrent):
    _register(_mod.CONVERTERS, getattr(_mod, "MULTI_TOP", ()), getattr(_mod, "NO_BOTTOM", ()))

ONE_TOP = set(CONVERTERS) - _MULTI_TOP
