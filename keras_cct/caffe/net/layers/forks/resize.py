"""Resizing layers of the segmentation forks: PSPNet/DeepLab's :class:`CaffeInterp`
(align-corners bilinear) and SegNet/YOLO forks' :class:`CaffeUpsample` (max-unpooling with a
mask, or nearest-neighbour by a scale), on channels-last tensors."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import keras
from keras import ops

_PKG = "keras_cct"

__all__ = ["interp_output_size", "interp_matrix", "CaffeInterp", "CaffeUpsample"]


def interp_output_size(size: int, *, zoom: Optional[int] = None, shrink: Optional[int] = None,
                       out: Optional[int] = None, pad_beg: int = 0, pad_end: int = 0) -> int:
    """PSPNet's InterpLayer output size along one axis (``zoom_factor``/``shrink_factor`` on
    the padded size ``size + pad_beg + pad_end``, or an explicit ``out``)."""
    eff = size + pad_beg + pad_end
    if out is not None:
        return int(out)
    n = eff
    if shrink is not None:
        n = (eff - 1) // shrink + 1
    if zoom is not None:
        n = n + (n - 1) * (zoom - 1)
    return n


def interp_matrix(size_in: int, size_eff: int, size_out: int, offset: int) -> np.ndarray:
    """The ``(size_out, size_in)`` matrix of Caffe's ``caffe_cpu_interp2`` along one axis:
    align-corners bilinear from the ``size_eff`` inputs starting at ``offset``."""
    m = np.zeros((size_out, size_in), np.float64)
    if size_eff == size_out:
        m[np.arange(size_out), offset + np.arange(size_out)] = 1.0
        return m
    r = (size_eff - 1) / (size_out - 1) if size_out > 1 else 0.0
    for o in range(size_out):
        src = np.float32(r) * np.float32(o)  # Caffe computes in float
        i = int(src)
        lam = float(src - i)
        step = 1 if i < size_eff - 1 else 0
        m[o, offset + i] += 1.0 - lam
        m[o, offset + i + step] += lam
    return m


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeInterp(keras.layers.Layer):
    """PSPNet/DeepLab's Interp: bilinear resize with aligned corners.

    Args:
        zoom_factor, shrink_factor: the factors (``None`` when not given).
        size: ``(height, width)`` of the output when given, else ``None``.
        pad_beg, pad_end: Caffe's (non-positive) paddings: the input rows/columns dropped at
            each end before resizing.
    With two inputs (and none of the above) the output takes the second input's size.
    """

    def __init__(self, zoom_factor: Optional[int] = None, shrink_factor: Optional[int] = None,
                 size: Optional[Tuple[int, int]] = None, pad_beg: int = 0, pad_end: int = 0,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if pad_beg > 0 or pad_end > 0:
            raise ValueError("Interp pad_beg and pad_end must be <= 0")
        for name, v in (("zoom_factor", zoom_factor), ("shrink_factor", shrink_factor)):
            if v is not None and int(v) < 1:
                raise ValueError(f"Interp {name} must be >= 1, got {v}")
        self.zoom_factor = None if zoom_factor is None else int(zoom_factor)
        self.shrink_factor = None if shrink_factor is None else int(shrink_factor)
        self.size = None if size is None else [int(v) for v in size]
        self.pad_beg = int(pad_beg)
        self.pad_end = int(pad_end)

    def _out_hw(self, shapes):
        two = isinstance(shapes[0], (list, tuple))
        h, w = (shapes[0] if two else shapes)[1:3]
        if self.size is not None:
            return tuple(self.size)
        if self.zoom_factor is None and self.shrink_factor is None:
            if not two or len(shapes) < 2:
                raise ValueError("Interp needs zoom_factor, shrink_factor, height and width, "
                                 "or a second input")
            return tuple(shapes[1][1:3])
        kw = dict(zoom=self.zoom_factor, shrink=self.shrink_factor, pad_beg=self.pad_beg,
                  pad_end=self.pad_end)
        return interp_output_size(h, **kw), interp_output_size(w, **kw)

    def compute_output_shape(self, input_shape):
        first = input_shape[0] if isinstance(input_shape[0], (list, tuple)) else input_shape
        return (first[0],) + tuple(self._out_hw(input_shape)) + (first[-1],)

    def call(self, inputs):
        x = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        shapes = ([tuple(t.shape) for t in inputs] if isinstance(inputs, (list, tuple))
                  else tuple(x.shape))
        oh, ow = self._out_hw(shapes)
        h, w = int(x.shape[1]), int(x.shape[2])
        pad = self.pad_beg + self.pad_end
        mh = interp_matrix(h, h + pad, oh, -self.pad_beg)
        mw = interp_matrix(w, w + pad, ow, -self.pad_beg)
        mh = ops.convert_to_tensor(mh.astype(np.float32), dtype=x.dtype)
        mw = ops.convert_to_tensor(mw.astype(np.float32), dtype=x.dtype)
        y = ops.einsum("oh,nhwc->nowc", mh, x)
        return ops.einsum("pw,nowc->nopc", mw, y)

    def get_config(self):
        return {**super().get_config(), "zoom_factor": self.zoom_factor,
                "shrink_factor": self.shrink_factor, "size": self.size,
                "pad_beg": self.pad_beg, "pad_end": self.pad_end}


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeUpsample(keras.layers.Layer):
    """The forks' Upsample.

    * One input (YOLO forks): nearest-neighbour upsampling by ``scale``.
    * Two inputs ``[x, mask]`` (SegNet): max-unpooling -- each value goes to the output
      position its mask (a MAX Pooling layer's second top: the flat index ``h * W_out + w`` of
      the pooled maximum) names, zeros elsewhere. As SegNet's nets (kernel = stride pooling),
      every index must lie in its own ``scale_h x scale_w`` cell of the output.

    Args:
        scale_hw: ``(scale_h, scale_w)``.
        size: ``(upsample_h, upsample_w)`` (the output size) or ``None`` for input size x scale
            (less ``pad_out_h``/``pad_out_w``: SegNet's odd-size outputs).
    """

    def __init__(self, scale_hw=(2, 2), size: Optional[Tuple[int, int]] = None,
                 pad_out=(False, False), **kwargs) -> None:
        super().__init__(**kwargs)
        self.scale_hw = [int(v) for v in scale_hw]
        if min(self.scale_hw) < 1:
            raise ValueError(f"Upsample scale must be >= 1, got {self.scale_hw}")
        self.size = None if size is None else [int(v) for v in size]
        self.pad_out = [bool(v) for v in pad_out]

    def _out_hw(self, h, w):
        if self.size is not None:
            return tuple(self.size)
        return (h * self.scale_hw[0] - int(self.pad_out[0]),
                w * self.scale_hw[1] - int(self.pad_out[1]))

    def compute_output_shape(self, input_shape):
        first = input_shape[0] if isinstance(input_shape[0], (list, tuple)) else input_shape
        return (first[0],) + self._out_hw(first[1], first[2]) + (first[-1],)

    def _repeat(self, t, oh, ow):
        sh, sw = self.scale_hw
        h, w = int(t.shape[1]), int(t.shape[2])
        # enough repeats to cover the output (an upsample_h larger than h * scale repeats more)
        rh, rw = max(sh, -(-oh // h)), max(sw, -(-ow // w))
        t = ops.repeat(ops.repeat(t, rh, axis=1), rw, axis=2)
        return t[:, :oh, :ow, :]

    def call(self, inputs):
        x = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        oh, ow = self._out_hw(int(x.shape[1]), int(x.shape[2]))
        up = self._repeat(x, oh, ow)
        if not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
            return up
        mask = ops.cast(self._repeat(inputs[1], oh, ow), "int32")
        pos = (np.arange(oh)[:, None] * ow + np.arange(ow)[None, :]).astype("int32")
        here = mask == ops.convert_to_tensor(pos[None, :, :, None])
        return ops.where(here, up, ops.zeros_like(up))

    def get_config(self):
        return {**super().get_config(), "scale_hw": self.scale_hw, "size": self.size,
                "pad_out": self.pad_out}
