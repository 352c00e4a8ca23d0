"""Caffe's windowed layers: :class:`CaffePooling2D` (MAX/AVE/STOCHASTIC/global pooling with
Caffe's output size and divisors) and :class:`CaffeLRN` (ACROSS_CHANNELS and WITHIN_CHANNEL)."""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import keras
from keras import ops

from keras_cct.caffe.net.layout import pair as _pair
from keras_cct.lowering.pooling import max_pool

_PKG = "keras_cct"

__all__ = ["pool_output_size", "CaffePooling2D", "CaffeLRN"]


# --------------------------------------------------------------------------------------------
# Pooling


def pool_output_size(size: int, kernel: int, stride: int, pad: int, *, ceil_mode: bool,
                     any_pad: bool) -> int:
    """Caffe's pooled size along one axis (PoolingLayer::Reshape)."""
    span = size + 2 * pad - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if any_pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@keras.saving.register_keras_serializable(package=_PKG)
class CaffePooling2D(keras.layers.Layer):
    """Caffe's 2-D MAX / AVE / STOCHASTIC pooling on channels-last input.

    STOCHASTIC (Zeiler & Fergus, as Caffe's GPU kernels; inputs are expected >= 0, e.g. after
    a ReLU): in training each window outputs one of its values, drawn with probability
    ``x / sum(window)`` (the gradient goes to it); at inference the probability-weighted
    average ``sum(x^2) / sum(x)`` (0 for an all-zero window). Windows ignore ``padding`` and are
    clipped at the bottom/right edges, as Caffe's.

    Args:
        pool: ``"MAX"``, ``"AVE"`` or ``"STOCHASTIC"``.
        kernel_size, strides, padding: ints or ``(h, w)`` (symmetric padding, as in Caffe).
        global_pooling: pool over the whole image (kernel = input size).
        round_mode: ``"CEIL"`` (Caffe's default) or ``"FLOOR"`` (the forks' ``ceil_mode:
            false``).
        seed: the STOCHASTIC sampling seed (``None``: unseeded).
        return_mask: MAX only: also return Caffe's second top, the flat index ``h * W + w``
            of each window's (first) maximum in the input, as floats (SegNet's Upsample
            reads it).
        relu: MAX only, without the mask: the pooling of ``ReLU(x)``, computed as the ReLU
            of the pooled ``x`` (the same values and gradients, on a quarter of the
            elements at stride 2): a net's ``ReLU -> MAX Pooling`` pair, built so
            (:mod:`keras_cct.caffe.net.converters`), reads the ReLU's input.
    """

    def __init__(self, pool: str = "MAX", kernel_size=2, strides=1, padding=0,
                 global_pooling: bool = False, round_mode: str = "CEIL",
                 seed: Optional[int] = None, return_mask: bool = False, relu: bool = False,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        pool = pool.upper()
        if pool not in ("MAX", "AVE", "STOCHASTIC"):
            raise ValueError(f"pool must be 'MAX', 'AVE' or 'STOCHASTIC', got {pool!r}")
        round_mode = round_mode.upper()
        if round_mode not in ("CEIL", "FLOOR"):
            raise ValueError(f"round_mode must be 'CEIL' or 'FLOOR', got {round_mode!r}")
        self.pool = pool
        self.kernel_size = None if kernel_size is None else _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        self.padding = _pair(padding, "padding")
        self.global_pooling = bool(global_pooling)
        self.round_mode = round_mode
        self.seed = seed
        self.return_mask = bool(return_mask)
        if self.return_mask and pool != "MAX":
            raise ValueError("only MAX pooling has a mask top")
        self.relu = bool(relu)
        if self.relu and (pool != "MAX" or self.return_mask):
            raise ValueError("relu=True is for MAX pooling without a mask top")
        self.seed_generator = (keras.random.SeedGenerator(seed) if pool == "STOCHASTIC"
                               else None)

    def _geometry(self, h: int, w: int):
        if h is None or w is None:
            raise ValueError(f"CaffePooling2D '{self.name}' needs a known input height and width")
        if self.global_pooling:
            kh, kw, (sh, sw), (ph, pw) = h, w, (1, 1), (0, 0)
        else:
            (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.strides, self.padding
        if ph >= kh or pw >= kw:
            raise ValueError(f"pooling '{self.name}': pad ({ph}, {pw}) must be smaller than the "
                             f"kernel ({kh}, {kw})")
        ceil_mode = self.round_mode == "CEIL"
        any_pad = bool(ph or pw)
        oh = pool_output_size(h, kh, sh, ph, ceil_mode=ceil_mode, any_pad=any_pad)
        ow = pool_output_size(w, kw, sw, pw, ceil_mode=ceil_mode, any_pad=any_pad)
        if oh < 1 or ow < 1:
            raise ValueError(f"pooling '{self.name}': kernel ({kh}, {kw}) larger than the padded "
                             f"input ({h + 2 * ph}, {w + 2 * pw})")
        return kh, kw, sh, sw, ph, pw, oh, ow

    def compute_output_shape(self, input_shape):
        n, h, w, c = input_shape
        *_, oh, ow = self._geometry(h, w)
        return [(n, oh, ow, c)] * 2 if self.return_mask else (n, oh, ow, c)

    def _divisor(self, h, w, kh, kw, sh, sw, ph, pw, oh, ow) -> Optional[np.ndarray]:
        def sizes(n_out, size, k, s, p):
            start = np.arange(n_out) * s - p
            end = np.minimum(start + k, size + p)
            return end - start
        div = np.outer(sizes(oh, h, kh, sh, ph), sizes(ow, w, kw, sw, pw)).astype(np.float32)
        if np.all(div == kh * kw):
            return None
        return (kh * kw / div).reshape(oh, ow, 1)

    def _windows(self, x, geometry, pad=(0, 0), value=0.0):
        """The (N, oh, ow, C, kh*kw) windows (row-major within a window) of the input padded
        by ``pad`` at the top/left and filled with ``value`` past the image. STOCHASTIC pooling
        uses no padding and zeros (which change neither sum)."""
        kh, kw, sh, sw, _, _, oh, ow = geometry
        h, w = x.shape[1], x.shape[2]
        x = ops.pad(x, [[0, 0], [pad[0], max(0, (oh - 1) * sh + kh - h - pad[0])],
                        [pad[1], max(0, (ow - 1) * sw + kw - w - pad[1])], [0, 0]],
                    constant_values=value)
        parts = [x[:, i:i + (oh - 1) * sh + 1:sh, j:j + (ow - 1) * sw + 1:sw, :]
                 for i in range(kh) for j in range(kw)]
        return ops.stack(parts, axis=-1)

    def _stochastic(self, x, geometry, training):
        win = self._windows(x, geometry)
        total = ops.sum(win, axis=-1)
        if not training:
            safe = ops.where(total > 0, total, ops.ones_like(total))
            return ops.where(total > 0, ops.sum(win * win, axis=-1) / safe,
                             ops.zeros_like(total))
        u = keras.random.uniform(ops.shape(total), dtype=x.dtype, seed=self.seed_generator)
        hit = ops.cumsum(win, axis=-1) >= (u * total)[..., None]
        pick = ops.argmax(ops.cast(hit, "int32"), axis=-1)
        return ops.squeeze(ops.take_along_axis(win, pick[..., None], axis=-1), axis=-1)

    def _mask(self, x, geometry):
        """Caffe's MAX mask: the input's flat index of each window's first maximum."""
        kh, kw, sh, sw, ph, pw, oh, ow = geometry
        low = float(np.finfo(np.float32).min)
        pick = ops.argmax(self._windows(x, geometry, (ph, pw), low), axis=-1)   # (N,oh,ow,C)
        # window element k = i * kw + j sits at input (a*sh - ph + i, b*sw - pw + j)
        i, j = pick // kw, pick % kw
        a = ops.convert_to_tensor((np.arange(oh) * sh - ph).astype("int32"))[None, :, None, None]
        b = ops.convert_to_tensor((np.arange(ow) * sw - pw).astype("int32"))[None, None, :, None]
        index = (a + ops.cast(i, "int32")) * int(x.shape[2]) + b + ops.cast(j, "int32")
        return ops.stop_gradient(ops.cast(index, x.dtype))

    def call(self, x, training=None):
        h, w = x.shape[1], x.shape[2]
        kh, kw, sh, sw, ph, pw, oh, ow = self._geometry(h, w)
        if self.pool == "STOCHASTIC":
            return self._stochastic(x, (kh, kw, sh, sw, ph, pw, oh, ow), bool(training))
        if self.return_mask:
            return [self._pool(x, (kh, kw, sh, sw, ph, pw, oh, ow)),
                    self._mask(x, (kh, kw, sh, sw, ph, pw, oh, ow))]
        return self._pool(x, (kh, kw, sh, sw, ph, pw, oh, ow))

    def _pool(self, x, geometry):
        h, w = x.shape[1], x.shape[2]
        kh, kw, sh, sw, ph, pw, oh, ow = geometry
        bottom = max(0, (oh - 1) * sh + kh - h - ph)
        right = max(0, (ow - 1) * sw + kw - w - pw)
        pads = [[0, 0], [ph, bottom], [pw, right], [0, 0]]
        if self.pool == "MAX":
            y = max_pool(x, (kh, kw), (sh, sw), (tuple(pads[1]), tuple(pads[2])),
                         relu=self.relu)
        else:
            if any(sum(p) for p in pads):
                x = ops.pad(x, pads)
            y = ops.average_pool(x, (kh, kw), (sh, sw), padding="valid",
                                 data_format="channels_last")
        if y.shape[1] != oh or y.shape[2] != ow:
            y = y[:, :oh, :ow, :]   # (an identity slice still costs TF a gradient pass)
        if self.pool == "AVE":
            div = self._divisor(h, w, kh, kw, sh, sw, ph, pw, oh, ow)
            if div is not None:
                y = y * ops.convert_to_tensor(div, dtype=y.dtype)
        return y

    def get_config(self):
        cfg = super().get_config()
        cfg.update(pool=self.pool, kernel_size=self.kernel_size, strides=self.strides,
                   padding=self.padding, global_pooling=self.global_pooling,
                   round_mode=self.round_mode)
        if self.pool == "STOCHASTIC":
            cfg["seed"] = self.seed
        if self.return_mask:
            cfg["return_mask"] = True
        if self.relu:
            cfg["relu"] = True
        return cfg


# --------------------------------------------------------------------------------------------
# LRN


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeLRN(keras.layers.Layer):
    """Caffe's local response normalization on channels-last input.

    ACROSS_CHANNELS: ``y = x * (k + alpha / n * sum_{window of n channels} x^2) ^ -beta``.
    WITHIN_CHANNEL: ``y = x * (1 + alpha * avg_{n x n window, zero padded} x^2) ^ -beta``
    (Caffe ignores ``k`` there).
    """

    def __init__(self, local_size: int = 5, alpha: float = 1.0, beta: float = 0.75,
                 k: float = 1.0, norm_region: str = "ACROSS_CHANNELS", **kwargs) -> None:
        super().__init__(**kwargs)
        if int(local_size) % 2 == 0:
            raise ValueError(f"LRN local_size must be odd, got {local_size}")
        norm_region = norm_region.upper()
        if norm_region not in ("ACROSS_CHANNELS", "WITHIN_CHANNEL"):
            raise ValueError(f"unknown LRN norm_region {norm_region!r}")
        self.local_size = int(local_size)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.k = float(k)
        self.norm_region = norm_region

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        n = self.local_size
        if self.norm_region == "ACROSS_CHANNELS":
            return _lrn_across_channels(x, n, self.alpha, self.beta, self.k)
        pooled = _ave_pool_same(ops.square(x), n, (n - 1) // 2)
        return x * _neg_power(1.0 + self.alpha * pooled, self.beta)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(local_size=self.local_size, alpha=self.alpha, beta=self.beta, k=self.k,
                   norm_region=self.norm_region)
        return cfg


def _neg_power(s, beta: float):
    """``s ** -beta``. Common exponents by square roots, others as ``exp(-beta log s)``:
    TensorFlow's CPU ``Pow`` costs about 5 times ``exp(log)`` and 9 times ``rsqrt`` and
    ``sqrt`` (the form of Caffe's default 0.75), measured on CaffeNet's norm1. Same values at
    ``s = 0`` (inf) and ``s < 0`` (nan)."""
    if beta == 0.75:
        r = ops.rsqrt(s)
        return r * ops.sqrt(r)
    if beta == 0.5:
        return ops.rsqrt(s)
    if beta == 1.0:
        return 1.0 / s
    return ops.exp(ops.log(s) * (-beta))


def _channel_band(c: int, n: int, scale: float, dtype):
    """The (c, c) matrix ``B`` with ``(t @ B)[j] = scale * sum(t[j - pre .. j + n - 1 - pre])``,
    clipped at the edges: the window sum over channels of ACROSS_CHANNELS LRN as one matmul
    (symmetric for odd ``n``)."""
    return ops.convert_to_tensor(_channel_band_array(c, n, scale), dtype=dtype)


@functools.lru_cache(maxsize=64)
def _channel_band_array(c: int, n: int, scale: float) -> np.ndarray:
    """:func:`_channel_band`'s values, made once per layer shape (cached: not to be modified)."""
    pre = (n - 1) // 2
    d = np.arange(c)[None, :] - np.arange(c)[:, None]
    band = ((d >= -(n - 1 - pre)) & (d <= pre)).astype(np.float32) * np.float32(scale)
    return band


def _lrn_across_channels(x, n: int, alpha: float, beta: float, k: float):
    """Caffe's ACROSS_CHANNELS LRN, ``y = x s^-beta``, ``s = k + alpha/n sum_window x^2``, on
    the last axis, with its gradient written out:
    ``dx = g s^-beta - 2 beta x (alpha/n) sum_window(g y / s)`` (the window is symmetric).

    Each window sum is one (rows, C) x (C, C) band matmul: on TensorFlow's CPU about two
    element-wise passes for CaffeNet's 96 channels, where n shifted slices and adds cost about
    five (and their autodiff gradient n pads more); its cost grows with C, but the whole layer
    still beats the slices at 2048 channels. The written-out gradient needs 6 passes where
    autodiff of the forward needs about 15.
    """
    c = int(x.shape[-1])
    band = _channel_band(c, n, alpha / n, x.dtype)
    band2 = _channel_band(c, n, 2.0 * beta * alpha / n, x.dtype)
    shape = [-1] + [int(d) if d is not None else ops.shape(x)[i]
                    for i, d in enumerate(x.shape)][1:]

    @ops.custom_gradient
    def lrn(x):
        x2 = ops.reshape(x, (-1, c))
        s = ops.matmul(ops.square(x2), band) + k
        p = _neg_power(s, beta)
        y = x2 * p

        def grad(*args, upstream=None):
            g = upstream if upstream is not None else args[0]
            g2 = ops.reshape(g, (-1, c))
            dx = g2 * p - x2 * ops.matmul(g2 * y / s, band2)
            return ops.reshape(dx, shape)

        return ops.reshape(y, shape), grad

    return lrn(x)


def _ave_pool_same(x, n: int, pad: int):
    """Caffe AVE pooling, kernel n, stride 1, pad (n-1)/2 (divisor n*n): WITHIN_CHANNEL LRN."""
    xp = ops.pad(x, [[0, 0], [pad, n - 1 - pad], [pad, n - 1 - pad], [0, 0]])
    return ops.average_pool(xp, (n, n), (1, 1), padding="valid", data_format="channels_last")


