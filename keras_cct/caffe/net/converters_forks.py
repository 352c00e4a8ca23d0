"""Converters for layer types of the most-used Caffe forks (SSD, PSPNet/DeepLab, SegNet,
Faster R-CNN, SENet, MobileNet, ShuffleNet): ``(ctx, layer_param, bottom tensors) -> list of
top tensors``, merged into :data:`keras_cct.caffe.net.converters.CONVERTERS`.

Their parameters are the forks' proto fields (:mod:`keras_cct.caffe.io._schema_forks`). Also
here: :func:`pooling_round_mode`, which reads the forks' ``ceil_mode`` beside BVLC's
``round_mode`` for the Pooling converter."""

from __future__ import annotations

from typing import Callable, Dict, Set

import keras

from keras_cct.caffe.io import proto
from keras_cct.caffe.net.context import Ctx, conv_args, need_rank
from keras_cct.caffe.net.layers import forks as fl
from keras_cct.layers.convert import keras_conv_layers
from keras_cct.layers.hybrid_conv2d import HybridConv2D

__all__ = ["CONVERTERS", "MULTI_TOP", "pooling_round_mode"]


def pooling_round_mode(ctx: Ctx, p) -> str:
    """``"CEIL"`` or ``"FLOOR"`` from BVLC's ``round_mode`` or the forks' ``ceil_mode`` (a bool
    with the opposite sense of BVLC's enum on the same wire number 13; in a prototxt the names
    tell them apart, in a binary file field 13 is read as BVLC's ``round_mode``)."""
    if p.HasField("ceil_mode"):
        if p.HasField("round_mode"):
            raise ctx.error("give either round_mode (BVLC) or ceil_mode (forks), not both")
        return "CEIL" if p.ceil_mode else "FLOOR"
    return proto.PoolingParameter.RoundMode.Name(p.round_mode)


def _n_bottoms(ctx: Ctx, xs, counts, what: str) -> None:
    if len(xs) not in counts:
        raise ctx.error(f"{ctx.lp.type} needs {what}, got {len(xs)} bottom(s)")


def _permute(ctx, lp, xs):
    order = list(lp.permute_param.order)
    rank = len(xs[0].shape)
    if any(not -rank <= a < rank for a in order) or len(set(order)) != len(order):
        raise ctx.error(f"permute_param.order {order} is not a permutation of the "
                        f"{rank} axes", hint="give each axis of the bottom blob once")
    return [fl.CaffePermute(order, name=ctx.kname())(xs[0])]


def _normalize(ctx, lp, xs):
    p = lp.norm_param
    init = "ones"
    if p.HasField("scale_filler"):
        f = p.scale_filler
        if f.type != "constant":
            raise ctx.error(f"Normalize scale_filler type {f.type!r} is not supported",
                            hint="use a constant filler (the caffemodel gives the scale)")
        init = keras.initializers.Constant(float(f.value))
    layer = fl.CaffeNormalize(p.across_spatial, p.channel_shared, p.eps,
                              scale_initializer=init, name=ctx.kname())
    return [layer(xs[0])]


def _pair_field(ctx, p, one: str, h: str, w: str, cast):
    if p.HasField(h) or p.HasField(w):
        if not (p.HasField(h) and p.HasField(w)) or p.HasField(one):
            raise ctx.error(f"give either {one} or both {h} and {w}")
        return cast(getattr(p, h)), cast(getattr(p, w))
    if p.HasField(one):
        return cast(getattr(p, one)), cast(getattr(p, one))
    return None


def _prior_box(ctx, lp, xs):
    _n_bottoms(ctx, xs, (1, 2), "the feature map and the image")
    need_rank(ctx, xs[0], 4, "PriorBox")
    p = lp.prior_box_param
    if not len(p.min_size):
        raise ctx.error("prior_box_param.min_size is required")
    image_hw = _pair_field(ctx, p, "img_size", "img_h", "img_w", int)
    if image_hw is None and len(xs) < 2:
        raise ctx.error("PriorBox needs the image as its second bottom, or img_size")
    step_hw = _pair_field(ctx, p, "step", "step_h", "step_w", float) or (0.0, 0.0)
    try:
        layer = fl.CaffePriorBox(list(p.min_size), list(p.max_size), list(p.aspect_ratio),
                                 p.flip, p.clip, list(p.variance), image_hw, step_hw, p.offset,
                                 name=ctx.kname())
    except ValueError as exc:
        raise ctx.error(str(exc)) from None
    return [layer(list(xs) if len(xs) > 1 else xs[0])]


def _detection_output(ctx, lp, xs):
    _n_bottoms(ctx, xs, (3,), "three bottoms (loc, conf, priors)")
    p = lp.detection_output_param
    if not p.HasField("num_classes"):
        raise ctx.error("detection_output_param.num_classes is required")
    nms = p.nms_param
    if nms.eta != 1.0:
        raise ctx.error(f"adaptive NMS (eta {nms.eta}) is not supported", hint="use eta: 1")
    code = proto.PriorBoxParameter.CodeType.Name(p.code_type)
    if code not in ("CORNER", "CENTER_SIZE"):
        raise ctx.error(f"code_type {code} is not supported", hint="use CORNER or CENTER_SIZE")
    layer = fl.CaffeDetectionOutput(
        p.num_classes, p.share_location, p.background_label_id, nms.nms_threshold,
        nms.top_k if nms.HasField("top_k") else -1, code, p.variance_encoded_in_target,
        p.keep_top_k, p.confidence_threshold if p.HasField("confidence_threshold") else None,
        name=ctx.kname())
    return [layer(list(xs))]


def _interp(ctx, lp, xs):
    need_rank(ctx, xs[0], 4, "Interp")
    p = lp.interp_param
    has_size = p.HasField("height") and p.HasField("width")
    zoom = p.zoom_factor if p.HasField("zoom_factor") else None
    shrink = p.shrink_factor if p.HasField("shrink_factor") else None
    specs = (zoom is not None or shrink is not None) + has_size + (len(xs) == 2)
    if specs != 1:
        raise ctx.error("Interp needs exactly one of zoom_factor/shrink_factor, height and "
                        "width, or a second bottom")
    if p.pad_beg > 0 or p.pad_end > 0:
        raise ctx.error("Interp pad_beg and pad_end must be <= 0")
    layer = fl.CaffeInterp(zoom, shrink, (p.height, p.width) if has_size else None,
                           p.pad_beg, p.pad_end, name=ctx.kname())
    return [layer(list(xs) if len(xs) == 2 else xs[0])]


def _upsample(ctx, lp, xs):
    _n_bottoms(ctx, xs, (1, 2), "the blob (and the pooling mask)")
    need_rank(ctx, xs[0], 4, "Upsample")
    p = lp.upsample_param
    scale = _pair_field(ctx, p, "scale", "scale_h", "scale_w", int) or (p.scale, p.scale)
    size = None
    if p.HasField("upsample_h") or p.HasField("upsample_w"):
        if not (p.HasField("upsample_h") and p.HasField("upsample_w")):
            raise ctx.error("give both upsample_h and upsample_w")
        size = (p.upsample_h, p.upsample_w)
    if len(xs) == 2 and tuple(xs[0].shape[1:]) != tuple(xs[1].shape[1:]):
        raise ctx.error("Upsample's mask must have the shape of its first bottom")
    layer = fl.CaffeUpsample(scale, size, (p.pad_out_h, p.pad_out_w), name=ctx.kname())
    return [layer(list(xs) if len(xs) == 2 else xs[0])]


def _roi_pooling(ctx, lp, xs):
    _n_bottoms(ctx, xs, (2,), "two bottoms (features, rois)")
    need_rank(ctx, xs[0], 4, "ROIPooling")
    p = lp.roi_pooling_param
    if p.pooled_h < 1 or p.pooled_w < 1:
        raise ctx.error("roi_pooling_param needs pooled_h and pooled_w")
    layer = fl.CaffeROIPooling(p.pooled_h, p.pooled_w, p.spatial_scale, name=ctx.kname())
    return [layer([xs[0], xs[1]])]


def _axpy(ctx, lp, xs):
    _n_bottoms(ctx, xs, (3,), "three bottoms (a, x, y)")
    if tuple(xs[1].shape[1:]) != tuple(xs[2].shape[1:]):
        raise ctx.error("Axpy's x and y must have one shape")
    return [fl.CaffeAxpy(name=ctx.kname())(list(xs))]


def _shuffle_channel(ctx, lp, xs):
    g = int(lp.shuffle_channel_param.group)
    c = xs[0].shape[-1]
    if g < 1 or (c is not None and c % g):
        raise ctx.error(f"ShuffleChannel group {g} does not divide the {c} channels")
    return [fl.CaffeShuffleChannel(g, name=ctx.kname())(xs[0])]


def _relu6(ctx, lp, xs):
    return [keras.layers.ReLU(max_value=6.0, name=ctx.kname())(xs[0])]


def _convolution_depthwise(ctx, lp, xs):
    x = xs[0]
    need_rank(ctx, x, 4, "ConvolutionDepthwise")
    n_out, k, s, pad, d, _, bias = conv_args(ctx, lp.convolution_param)
    c = int(x.shape[-1])
    if n_out % c:
        raise ctx.error(f"ConvolutionDepthwise num_output {n_out} is not a multiple of the "
                        f"{c} input channels")
    if ctx.conv_impl == "keras":  # as Convolution: Keras' Conv2D after a ZeroPadding2D
        for layer in keras_conv_layers(n_out, k, strides=s, padding=pad, dilation_rate=d,
                                       groups=c, use_bias=bias, name=ctx.kname(),
                                       pad_name=ctx.kname() + "_pad", **ctx.conv_options):
            x = layer(x)
        return [x]
    layer = HybridConv2D(n_out, k, strides=s, padding=((pad[0], pad[0]), (pad[1], pad[1])),
                         dilation_rate=d, groups=c, use_bias=bias, name=ctx.kname(),
                         **ctx.conv_options)
    return [layer(x)]


CONVERTERS: Dict[str, Callable] = {
    "Permute": _permute, "Normalize": _normalize, "PriorBox": _prior_box,
    "DetectionOutput": _detection_output, "Interp": _interp, "Upsample": _upsample,
    "ROIPooling": _roi_pooling, "Axpy": _axpy, "ShuffleChannel": _shuffle_channel,
    "ReLU6": _relu6, "ConvolutionDepthwise": _convolution_depthwise,
}
MULTI_TOP: Set[str] = {"Pooling"}  # types whose layers may have several tops (MAX's mask)
