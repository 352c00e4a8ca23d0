"""Caffe's spatial layers built on windows: :class:`CaffeIm2col` (the column buffer of a
convolution as a blob) and :class:`CaffeSPP` (spatial pyramid pooling, by Caffe's own pooling:
:class:`keras_cct.caffe.net.layers.pooling.CaffePooling2D`). Channels-last (N, H, W, C)."""

from __future__ import annotations

import math
from typing import List, Tuple

import keras
from keras import ops

from keras_cct.caffe.net.layers.pooling import CaffePooling2D, pool_output_size
from keras_cct.caffe.net.layout import pair, to_caffe_layout

_PKG = "keras_cct"

__all__ = ["CaffeIm2col", "CaffeSPP", "spp_geometry"]


def _conv_out(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeIm2col(keras.layers.Layer):
    """Caffe's ``Im2col``: each output position holds its ``C * kh * kw`` window values in
    Caffe's column order (channel ``(c * kh + i) * kw + j`` is input channel ``c`` at kernel
    offset ``(i, j)``); zero padding, stride and dilation as a convolution. The backward
    (col2im) adds each column entry back into its pixel."""

    def __init__(self, kernel_size=1, strides=1, padding=0, dilation_rate=1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.strides = pair(strides, "strides")
        self.padding = pair(padding, "padding")
        self.dilation_rate = pair(dilation_rate, "dilation_rate")
        if min(self.kernel_size + self.strides + self.dilation_rate) < 1 or min(self.padding) < 0:
            raise ValueError("Im2col kernel, stride and dilation must be >= 1 and pad >= 0")

    def _out_hw(self, h, w) -> Tuple[int, int]:
        (kh, kw), (sh, sw) = self.kernel_size, self.strides
        (ph, pw), (dh, dw) = self.padding, self.dilation_rate
        return _conv_out(h, kh, sh, ph, dh), _conv_out(w, kw, sw, pw, dw)

    def compute_output_shape(self, input_shape):
        n, h, w, c = input_shape
        oh, ow = self._out_hw(h, w)
        return (n, oh, ow, c * self.kernel_size[0] * self.kernel_size[1])

    def call(self, x):
        _, h, w, c = (int(d) if d is not None else None for d in x.shape)
        (kh, kw), (sh, sw) = self.kernel_size, self.strides
        (ph, pw), (dh, dw) = self.padding, self.dilation_rate
        oh, ow = self._out_hw(h, w)
        xp = ops.pad(x, [[0, 0], [ph, ph], [pw, pw], [0, 0]]) if ph or pw else x
        cols = []
        for i in range(kh):
            for j in range(kw):
                r0, c0 = i * dh, j * dw
                cols.append(xp[:, r0:r0 + (oh - 1) * sh + 1:sh, c0:c0 + (ow - 1) * sw + 1:sw, :])
        y = ops.stack(cols, axis=-1)  # (N, oh, ow, C, kh*kw): channel-major, as Caffe
        return ops.reshape(y, (-1, oh, ow, c * kh * kw))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(kernel_size=self.kernel_size, strides=self.strides, padding=self.padding,
                   dilation_rate=self.dilation_rate)
        return cfg


def spp_geometry(size_h: int, size_w: int, level: int) -> Tuple[Tuple[int, int],
                                                                  Tuple[int, int]]:
    """Caffe's ``SPPLayer::GetPoolingParam`` for pyramid level ``level``: ``(kernel, pad)``
    (the stride is the kernel) so that ``2**level`` bins cover the image."""
    bins = 2 ** level
    out = []
    for size in (size_h, size_w):
        kernel = int(math.ceil(size / bins))
        remainder = kernel * bins - size
        out.append((kernel, (remainder + 1) // 2))
    (kh, ph), (kw, pw) = out
    return (kh, kw), (ph, pw)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeSPP(keras.layers.Layer):
    """Caffe's ``SPP``: for each level ``l < pyramid_height`` a Caffe ``MAX``/``AVE`` pooling
    into ``2**l x 2**l`` bins (:func:`spp_geometry`), each flattened in Caffe's C-major order,
    concatenated level by level into ``(N, C * sum(4**l))``. Needs a known image size."""

    def __init__(self, pyramid_height: int = 1, pool: str = "MAX", **kwargs) -> None:
        super().__init__(**kwargs)
        if int(pyramid_height) < 1:
            raise ValueError(f"SPP pyramid_height must be >= 1, got {pyramid_height}")
        pool = str(pool).upper()
        if pool not in ("MAX", "AVE"):
            raise ValueError(f"SPP pool must be MAX or AVE, got {pool!r}")
        self.pyramid_height = int(pyramid_height)
        self.pool = pool
        self.pools: List[CaffePooling2D] = []

    def _levels(self, h: int, w: int):
        for level in range(self.pyramid_height):
            k, p = spp_geometry(h, w, level)
            oh = pool_output_size(h, k[0], k[0], p[0], ceil_mode=True, any_pad=bool(p[0] or p[1]))
            ow = pool_output_size(w, k[1], k[1], p[1], ceil_mode=True, any_pad=bool(p[0] or p[1]))
            yield k, p, oh, ow

    def build(self, input_shape):
        _, h, w, _ = input_shape
        if h is None or w is None:
            raise ValueError("SPP needs a known image height and width")
        self.pools = [CaffePooling2D(self.pool, k, k, p, name=f"{self.name}_level{i}")
                      for i, (k, p, _, _) in enumerate(self._levels(int(h), int(w)))]
        for layer in self.pools:
            layer.build(input_shape)
        self.built = True

    def compute_output_shape(self, input_shape):
        n, h, w, c = input_shape
        return (n, sum(c * oh * ow for _, _, oh, ow in self._levels(int(h), int(w))))

    def call(self, x):
        flats = []
        for layer in self.pools:
            y = to_caffe_layout(layer(x))
            flats.append(ops.reshape(y, (-1, math.prod(int(d) for d in y.shape[1:]))))
        return flats[0] if len(flats) == 1 else ops.concatenate(flats, axis=1)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(pyramid_height=self.pyramid_height, pool=self.pool)
        return cfg
