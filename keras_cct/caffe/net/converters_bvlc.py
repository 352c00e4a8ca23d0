"""Converters for the rest of BVLC Caffe's layer types: ``(ctx, layer_param, bottom tensors) -> list of top tensors``,
merged into :data:`keras_cct.caffe.net.converters.CONVERTERS`.

ArgMax, Reduction, MVN, Tile, Embed, Parameter, SPP, Im2col, BatchReindex, Filter and
HDF5Output (the layers are in :mod:`keras_cct.caffe.net.layers.bvlc`); the loss layers
(ContrastiveLoss, HingeLoss, InfogainLoss, MultinomialLogisticLoss) are heads, in
:mod:`keras_cct.caffe.net.losses`.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Set

from keras_cct.caffe.io import proto
from keras_cct.caffe.net.context import Ctx, hw, need_rank
from keras_cct.caffe.net.layers import bvlc
from keras_cct.caffe.net.layout import caffe_shape

__all__ = ["CONVERTERS", "MULTI_TOP", "NO_BOTTOM", "NO_TOP"]


def _canonical_axis(ctx: Ctx, axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise ctx.error(f"{what} axis {axis} is out of range for a {rank}-D blob of Caffe "
                        f"shape", hint=f"use an axis in [{-rank}, {rank - 1}]")
    return axis % rank


def _argmax(ctx, lp, xs):
    p = lp.argmax_param
    x = xs[0]
    cshape = caffe_shape(x.shape)
    if p.top_k < 1:
        raise ctx.error(f"argmax_param top_k is {p.top_k}: it must be >= 1")
    axis = None
    if p.HasField("axis"):
        axis = _canonical_axis(ctx, int(p.axis), len(cshape), "argmax_param")
        size = cshape[axis]
    else:
        size = math.prod(int(d) for d in cshape[1:])
    if size is not None and p.top_k > size:
        raise ctx.error(f"argmax_param top_k ({p.top_k}) is larger than the {size} values it "
                        f"picks from", hint="lower top_k")
    return [bvlc.CaffeArgMax(int(p.top_k), bool(p.out_max_val), axis, name=ctx.kname())(x)]


def _reduction(ctx, lp, xs):
    p = lp.reduction_param
    x = xs[0]
    axis = _canonical_axis(ctx, int(p.axis), len(x.shape), "reduction_param")
    op = proto.ReductionParameter.ReductionOp.Name(p.operation)
    return [bvlc.CaffeReduction(op, axis, float(p.coeff), name=ctx.kname())(x)]


def _mvn(ctx, lp, xs):
    p = lp.mvn_param
    if p.eps < 0:
        raise ctx.error(f"mvn_param eps is {p.eps}: it must be >= 0")
    return [bvlc.CaffeMVN(bool(p.normalize_variance), bool(p.across_channels), float(p.eps),
                          name=ctx.kname())(xs[0])]


def _tile(ctx, lp, xs):
    p = lp.tile_param
    if not p.HasField("tiles") or p.tiles < 1:
        raise ctx.error(f"tile_param tiles is {p.tiles if p.HasField('tiles') else 'missing'}: "
                        f"give tiles >= 1")
    axis = _canonical_axis(ctx, int(p.axis), len(xs[0].shape), "tile_param")
    if axis == 0:
        raise ctx.error("Tile along axis 0 (the batch) is not supported",
                        hint="tile a non-batch axis")
    return [bvlc.CaffeTile(axis, int(p.tiles), name=ctx.kname())(xs[0])]


def _embed(ctx, lp, xs):
    p = lp.embed_param
    if p.num_output < 1 or p.input_dim < 1:
        raise ctx.error(f"embed_param needs num_output and input_dim >= 1, got "
                        f"{p.num_output} and {p.input_dim}")
    return [bvlc.CaffeEmbed(int(p.num_output), int(p.input_dim), bool(p.bias_term),
                            name=ctx.kname())(xs[0])]


def _parameter(ctx, lp, xs):
    shape = [int(d) for d in lp.parameter_param.shape.dim]
    if not shape or min(shape) < 1:
        raise ctx.error(f"parameter_param shape {shape} must have dims >= 1",
                        hint="give parameter_param { shape { dim: ... } }")
    if len(lp.bottom):
        raise ctx.error(f"Parameter takes no bottom, has {len(lp.bottom)}",
                        hint="remove its bottom (Caffe refuses one too)")
    if not xs:
        raise ctx.error("Parameter layer has no anchor tensor to attach to")
    return [bvlc.CaffeParameter(shape, name=ctx.kname())(xs[0])]


def _spp(ctx, lp, xs):
    x = xs[0]
    need_rank(ctx, x, 4, "SPP")
    p = lp.spp_param
    pool = proto.PoolingParameter.PoolMethod.Name(p.pool)
    if pool == "STOCHASTIC":
        raise ctx.error("SPP with STOCHASTIC pooling is not supported", hint="use MAX or AVE")
    if p.pyramid_height < 1:
        raise ctx.error(f"spp_param pyramid_height is {p.pyramid_height}: it must be >= 1")
    if x.shape[1] is None or x.shape[2] is None:
        raise ctx.error("SPP needs a known image height and width",
                        hint="give the input's shape (input_shape=(N, C, H, W))")
    for level in range(int(p.pyramid_height)):
        k, pad = bvlc.spp_geometry(int(x.shape[1]), int(x.shape[2]), level)
        for kk, pp in zip(k, pad):
            if pp >= kk:
                raise ctx.error(f"SPP level {level} ({2 ** level} bins) on a {x.shape[1]}x"
                                f"{x.shape[2]} image needs pad {pp} >= kernel {kk}, which "
                                f"Caffe's pooling refuses", hint="lower pyramid_height")
    return [bvlc.CaffeSPP(int(p.pyramid_height), pool, name=ctx.kname())(x)]


def _im2col(ctx, lp, xs):
    x = xs[0]
    need_rank(ctx, x, 4, "Im2col")
    p = lp.convolution_param
    if p.axis != 1:
        raise ctx.error(f"Im2col axis {p.axis} is not supported (only 1)")
    k = hw(ctx, p, "kernel_size", "kernel_h", "kernel_w", None)
    s = hw(ctx, p, "stride", "stride_h", "stride_w", 1)
    pad = hw(ctx, p, "pad", "pad_h", "pad_w", 0)
    if len(p.dilation) > 2:
        raise ctx.error("dilation has more than 2 values: only 2-D is supported")
    d = (tuple(p.dilation) * 2)[:2] if len(p.dilation) else (1, 1)
    if min(k + s + d) < 1:
        raise ctx.error(f"Im2col kernel {k}, stride {s} and dilation {d} must all be >= 1")
    return [bvlc.CaffeIm2col(k, s, pad, d, name=ctx.kname())(x)]


def _batch_reindex(ctx, lp, xs):
    if len(xs) != 2:
        raise ctx.error(f"BatchReindex needs 2 bottoms (data, permut), has {len(xs)}")
    if len(xs[1].shape) != 1:
        raise ctx.error(f"BatchReindex's permut bottom must be 1-D, got Caffe shape "
                        f"{caffe_shape(xs[1].shape)}")
    return [bvlc.CaffeBatchReindex(name=ctx.kname())(list(xs))]


def _filter(ctx, lp, xs):
    if len(xs) < 2 or len(lp.top) != len(xs) - 1:
        raise ctx.error(f"Filter needs k >= 1 blobs plus a selector as bottoms and k tops; "
                        f"has {len(xs)} bottoms and {len(lp.top)} tops")
    sel = xs[-1]
    if any(d != 1 for d in sel.shape[1:]):
        raise ctx.error(f"Filter's selector (the last bottom) must be (N,) or (N, 1, ...), got "
                        f"Caffe shape {caffe_shape(sel.shape)}")
    outs = bvlc.CaffeFilter(name=ctx.kname())(list(xs))
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _hdf5_output(ctx, lp, xs):
    if len(xs) != 2:
        raise ctx.error(f"HDF5Output needs 2 bottoms (data, label), has {len(xs)}")
    if not lp.hdf5_output_param.file_name:
        raise ctx.error("HDF5Output needs hdf5_output_param { file_name: ... }")
    raise ctx.error("HDF5Output has no top, so it is no part of the Keras model",
                    hint="write the blobs with keras_cct.caffe.net.layers.bvlc."
                         "write_hdf5_output(file_name, data, label) from the model's outputs, "
                         "or call CaffeHDF5Output eagerly")


CONVERTERS: Dict[str, Callable] = {
    "ArgMax": _argmax, "Reduction": _reduction, "MVN": _mvn, "Tile": _tile, "Embed": _embed,
    "Parameter": _parameter, "SPP": _spp, "Im2col": _im2col, "BatchReindex": _batch_reindex,
    "Filter": _filter, "HDF5Output": _hdf5_output,
}
MULTI_TOP: Set[str] = {"Filter", "HDF5Output"}  # types whose layers may have several tops
#: types with no bottom in Caffe (the builder must give them an anchor tensor to attach to)
NO_BOTTOM: Set[str] = {"Parameter"}
#: types with no top in Caffe
NO_TOP: Set[str] = {"HDF5Output"}
