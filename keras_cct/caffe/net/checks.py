"""A layer's parameters (kernel, stride, pad, dilation, group, num_output, Reshape's shape, ...)
and the bytes its weights and blobs would need, checked against
:func:`keras_cct.caffe.io.validate.max_bytes` before the builder makes a Keras layer: every
problem is a :class:`~keras_cct.errors.CaffeFormatError` naming the file, line and layer."""

from __future__ import annotations

import math
from typing import Optional

from keras_cct.caffe.io.validate import gib, max_bytes
from keras_cct.caffe.net.layout import caffe_shape
from keras_cct.errors import CaffeFormatError

__all__ = ["check_layer", "check_input"]

_DTYPE_BYTES = 4  # float32


def _hw(values, h: int, w: int, has_hw: bool, default: int):
    if has_hw:
        return [("h", int(h)), ("w", int(w))]
    vals = [int(v) for v in values] if not isinstance(values, int) else [int(values)]
    return [("", v) for v in vals] or [("", default)]


def _positive(ctx, p, names, *, minimum: int, default: int) -> None:
    single, h, w = names
    has_hw = p.HasField(h) or p.HasField(w)
    vals = getattr(p, single)
    if isinstance(vals, int) and not p.HasField(single):
        vals = []
    for suffix, v in _hw(vals, getattr(p, h), getattr(p, w), has_hw, default):
        if v < minimum:
            field = f"{single.split('_')[0]}_{suffix}" if suffix else single
            rule = "> 0" if minimum == 1 else ">= 0"
            raise ctx.error(f"{field} is {v}: it must be {rule}", hint=f"fix {field}")


def _numel(dims) -> int:
    return math.prod(int(d) if d is not None else 1 for d in dims)


def _param_bytes(ctx, what: str, count: int) -> None:
    need = count * _DTYPE_BYTES
    limit = max_bytes()
    if need > limit:
        raise ctx.error(f"{what} would need {gib(need)} ({count} values), more than the "
                        f"{gib(limit)} allowed", hint="is the number right? (the bound is "
                        "KERAS_CCT_CAFFE_MAX_BYTES, default a quarter of the memory)")
    total = getattr(ctx, "_validate_param_bytes", 0) + need
    ctx._validate_param_bytes = total
    if total > limit:
        raise ctx.error(f"the weights up to this layer would need {gib(total)}, more than "
                        f"the {gib(limit)} allowed",
                        hint="check num_output and the input size")


def _blob_bytes(ctx, what: str, dims) -> None:
    batch = dims[0] if dims and dims[0] is not None else (getattr(ctx, "batch", None) or 1)
    count = _numel((batch,) + tuple(dims[1:]))
    need = count * _DTYPE_BYTES
    if need > max_bytes():
        shown = tuple(d if d is not None else batch for d in dims)
        raise ctx.error(f"{what} of Caffe shape {shown} would need {gib(need)}, more than "
                        f"the {gib(max_bytes())} allowed",
                        hint="check the dims (or lower the batch size)")


def check_input(ctx, top: str, cshape) -> None:
    """An input blob's Caffe shape: no negative dimension, a sane size."""
    if cshape and cshape[0] is not None and int(cshape[0]) < 0:
        raise ctx.error(f"input '{top}' has a negative batch size {cshape[0]}",
                        hint="use a batch size > 0")
    if any(int(d) < 0 for d in cshape[1:]):
        return  # the builder says which dimension is not positive
    _blob_bytes(ctx, f"input blob '{top}'", tuple(cshape))


def _conv_out(size, k, s, p, d) -> Optional[int]:
    if size is None:
        return None
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def _check_conv(ctx, lp, x, deconv: bool) -> None:
    p = lp.convolution_param
    if p.HasField("num_output") and p.num_output < 1:
        raise ctx.error("num_output is 0: it must be > 0", hint="fix num_output")
    _positive(ctx, p, ("kernel_size", "kernel_h", "kernel_w"), minimum=1, default=1)
    _positive(ctx, p, ("stride", "stride_h", "stride_w"), minimum=1, default=1)
    for i, dil in enumerate(p.dilation):
        if dil < 1:
            raise ctx.error(f"dilation is {dil}: it must be > 0", hint="fix dilation")
    if p.group < 1:
        raise ctx.error("group is 0: it must be > 0", hint="fix group")
    if not p.HasField("num_output"):
        return  # the builder says it is required
    g = int(p.group)
    n_out = int(p.num_output)
    shape = caffe_shape(x.shape)
    c = shape[1] if len(shape) == 4 else None
    if n_out % g:
        raise ctx.error(f"num_output {n_out} is not a multiple of group {g}",
                        hint="fix num_output or group")
    if c is not None and c % g:
        raise ctx.error(f"the input's {c} channels are not a multiple of group {g}",
                        hint="fix group")
    k = [int(v) for v in p.kernel_size] or [1]
    kh, kw = (int(p.kernel_h), int(p.kernel_w)) if p.HasField("kernel_h") else (k[0], k[-1])
    count = n_out * (c or 1) // g * kh * kw + (n_out if p.bias_term else 0)
    _param_bytes(ctx, f"the weights (num_output {n_out} x {(c or 1) // g} input channels x "
                      f"kernel {kh}x{kw})", count)
    if len(shape) == 4:
        s = [int(v) for v in p.stride] or [1]
        sh, sw = (int(p.stride_h), int(p.stride_w)) if p.HasField("stride_h") else (s[0], s[-1])
        pd = [int(v) for v in p.pad] or [0]
        ph, pw = (int(p.pad_h), int(p.pad_w)) if p.HasField("pad_h") else (pd[0], pd[-1])
        d = [int(v) for v in p.dilation] or [1]
        if deconv:
            oh = None if shape[2] is None else sh * (shape[2] - 1) + d[0] * (kh - 1) + 1 - 2 * ph
            ow = None if shape[3] is None else sw * (shape[3] - 1) + d[-1] * (kw - 1) + 1 - 2 * pw
        else:
            oh = _conv_out(shape[2], kh, sh, ph, d[0])
            ow = _conv_out(shape[3], kw, sw, pw, d[-1])
        if (oh is not None and oh < 1) or (ow is not None and ow < 1):
            raise ctx.error(f"the output would be {oh}x{ow} for an input of "
                            f"{shape[2]}x{shape[3]}", hint="check kernel_size, pad and stride")
        _blob_bytes(ctx, f"the output blob (num_output {n_out})", (shape[0], n_out, oh, ow))


def _check_pooling(ctx, lp, x) -> None:
    p = lp.pooling_param
    if not p.global_pooling:
        _positive(ctx, p, ("kernel_size", "kernel_h", "kernel_w"), minimum=1, default=1)
    _positive(ctx, p, ("stride", "stride_h", "stride_w"), minimum=1, default=1)
    if not p.global_pooling:
        kh = int(p.kernel_h) if p.HasField("kernel_h") else int(p.kernel_size)
        kw = int(p.kernel_w) if p.HasField("kernel_w") else int(p.kernel_size)
        ph = int(p.pad_h) if p.HasField("pad_h") else int(p.pad)
        pw = int(p.pad_w) if p.HasField("pad_w") else int(p.pad)
        if (ph or pw) and (ph >= kh or pw >= kw) and (kh and kw):
            raise ctx.error(f"pad ({ph}, {pw}) must be smaller than the kernel ({kh}, {kw})",
                            hint="Caffe refuses it too; lower pad")


def _check_inner_product(ctx, lp, x) -> None:
    p = lp.inner_product_param
    if p.HasField("num_output") and p.num_output < 1:
        raise ctx.error("num_output is 0: it must be > 0", hint="fix num_output")
    shape = caffe_shape(x.shape)
    axis = int(p.axis) + (len(shape) if p.axis < 0 else 0)
    if not 0 <= axis < len(shape):
        raise ctx.error(f"axis {p.axis} is out of range for a {len(shape)}-D input",
                        hint="fix inner_product_param.axis")
    k = _numel(shape[axis:])
    n_out = int(p.num_output)
    _param_bytes(ctx, f"the weights (num_output {n_out} x {k} inputs of Caffe shape "
                      f"{tuple(shape[axis:])})", n_out * k + (n_out if p.bias_term else 0))
    _blob_bytes(ctx, f"the output blob (num_output {n_out})", tuple(shape[:axis]) + (n_out,))


def _check_reshape(ctx, lp, x) -> None:
    if not lp.HasField("reshape_param") or not lp.reshape_param.HasField("shape"):
        raise ctx.error("Reshape needs reshape_param { shape { dim: ... } }",
                        hint="give the new shape (0 copies a dimension, -1 infers one)")
    dims = [int(d) for d in lp.reshape_param.shape.dim]
    if any(d < -1 for d in dims):
        raise ctx.error(f"reshape_param.shape has a dimension < -1: {dims}",
                        hint="use 0 (copy), -1 (infer) or a positive size")
    if dims.count(-1) > 1:
        raise ctx.error(f"reshape_param.shape infers more than one dimension (-1): {dims}",
                        hint="use -1 at most once")
    if lp.reshape_param.num_axes < -1:
        raise ctx.error(f"reshape_param.num_axes is {lp.reshape_param.num_axes}: it must "
                        f"be >= -1", hint="fix num_axes")


def check_layer(ctx, lp, xs) -> None:
    """A layer's parameters, and the bytes its weights and output need, before it is built."""
    if not xs:
        return
    try:
        _check_layer(ctx, lp, xs[0])
    except CaffeFormatError:
        raise
    except (ValueError, TypeError, IndexError, ArithmeticError) as exc:
        raise ctx.error(f"cannot check the {lp.type} layer: {exc}") from None


def _check_layer(ctx, lp, x) -> None:
    t = lp.type
    if t in ("Convolution", "Deconvolution"):
        _check_conv(ctx, lp, x, t == "Deconvolution")
    elif t == "Pooling":
        _check_pooling(ctx, lp, x)
    elif t == "InnerProduct":
        _check_inner_product(ctx, lp, x)
    elif t == "Reshape":
        _check_reshape(ctx, lp, x)
    elif t == "LRN" and lp.lrn_param.local_size < 1:
        raise ctx.error("lrn_param.local_size is 0: it must be > 0 (and odd)",
                        hint="fix local_size")
    elif t == "Dropout":
        r = float(lp.dropout_param.dropout_ratio)
        if not 0.0 <= r < 1.0:
            raise ctx.error(f"dropout_ratio is {r}: it must be in [0, 1)",
                            hint="fix dropout_ratio")


