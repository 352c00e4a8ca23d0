"""The converters' shared context: :class:`Ctx` (the net being built, the layer at hand, its
errors with file and line) and the helpers every converter module uses to read Caffe's
parameters (:func:`hw`, :func:`need_rank`)."""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from keras_cct.caffe.io.upgrade import NetSource
from keras_cct.caffe.net import layers as cl
from keras_cct.caffe.net.weights import keras_name
from keras_cct.errors import CaffeFormatError

__all__ = ["Ctx", "hw", "need_rank", "conv_args"]


class Ctx:
    """What a converter knows while it builds one layer: the net's source (for errors with file
    and line), the phase, how convolutions are built, the Caffe batch and the layer at hand."""

    def __init__(self, source: NetSource, phase: int, conv_impl: str = "hybrid",
                 conv_options: Optional[Mapping] = None, python_layers: bool = False,
                 fuse: bool = True) -> None:
        self.source = source
        self.fuse = bool(fuse)  # build_net's: layers may compute a neighbour's work
        self.python_layers = bool(python_layers)  # Python layers may import their modules
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


def hw(ctx: Ctx, p, single: str, h: str, w: str, default: Optional[int]) -> Tuple[int, int]:
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


def conv_args(ctx: Ctx, p):
    """A ConvolutionParameter's ``(num_output, kernel, stride, pad, dilation, group,
    bias_term)`` (2-D pairs), checked."""
    if p.axis != 1:
        raise ctx.error(f"convolution axis {p.axis} is not supported (only 1)")
    if not p.HasField("num_output"):
        raise ctx.error("num_output is required")
    k = hw(ctx, p, "kernel_size", "kernel_h", "kernel_w", None)
    s = hw(ctx, p, "stride", "stride_h", "stride_w", 1)
    pad = hw(ctx, p, "pad", "pad_h", "pad_w", 0)
    if len(p.dilation) > 2:
        raise ctx.error("dilation has more than 2 values: only 2-D is supported")
    d = ((p.dilation[0],) * 2 if len(p.dilation) == 1 else tuple(p.dilation)
         if len(p.dilation) == 2 else (1, 1))
    return int(p.num_output), k, s, pad, (int(d[0]), int(d[1])), int(p.group), bool(p.bias_term)


def need_rank(ctx: Ctx, x, rank: int, what: str) -> None:
    if len(x.shape) != rank:
        raise ctx.error(f"{what} needs a {rank}-D input (N, C, H, W), got a "
                        f"{len(x.shape)}-D blob of Caffe shape {cl.caffe_shape(x.shape)}")
