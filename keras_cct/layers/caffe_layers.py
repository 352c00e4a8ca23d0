"""Keras layers with Caffe's exact semantics, for networks imported from Caffe.

Layout convention: a Caffe blob of shape ``(N, C, d1, ..., dk)`` is held in Keras as the
channels-last tensor ``(N, d1, ..., dk, C)``; blobs of rank <= 2 are unchanged. Every layer here
takes Caffe's own parameters (axes are *Caffe* axes) and maps them onto that layout, so that an
imported net computes exactly what Caffe computes:

* :class:`CaffePooling2D` -- MAX/AVE/global pooling with Caffe's output size (CEIL or FLOOR
  ``round_mode``, the "last window must start inside the image" rule with padding), MAX over the
  valid part of each window, AVE divided by the window size clipped to the *padded* image.
* :class:`CaffeLRN` -- ACROSS_CHANNELS (with ``k``) and WITHIN_CHANNEL local response norm.
* :class:`CaffeBatchNorm` -- mean/variance divided by the scale-factor blob; Caffe's moving
  average update and unbiased variance in training.
* :class:`CaffeScale`, :class:`CaffeBias` -- axis/num_axes broadcasting, learned or 2nd input.
* :class:`CaffePReLU`, :class:`CaffeInnerProduct` (Caffe's C-major flatten order, ``axis``,
  ``transpose``), :class:`CaffeDeconvolution`, :class:`CaffeUnary` (AbsVal, Power, Exp, Log,
  BNLL, Clip, Threshold), :class:`CaffeEltwise`, :class:`CaffeSlice`, :class:`CaffeConcat`,
  :class:`CaffeSoftmax`, :class:`CaffeFlatten`, :class:`CaffeReshape`, :class:`CaffeCrop`.

Weights are stored so that each layer's variables come in Caffe's blob order; the importer
converts blob layouts (see ``keras_cct.caffe.weights``). All layers are registered serializable
(package ``keras_cct``) and round-trip through ``get_config``.
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np
import keras
from keras import ops

from keras_cct.lowering import _backend
from keras_cct.layers._norm import normalize_batch, normalize_with

_PKG = "keras_cct"

__all__ = [
    "caffe_axis", "to_caffe_layout", "from_caffe_layout", "caffe_shape", "keras_shape",
    "pool_output_size", "CaffePooling2D", "CaffeLRN", "CaffeBatchNorm", "CaffeScale",
    "CaffeBias", "CaffePReLU", "CaffeInnerProduct", "CaffeDeconvolution", "CaffeUnary",
    "CaffeEltwise", "CaffeSlice", "CaffeConcat", "CaffeSoftmax", "CaffeFlatten", "CaffeReshape",
    "CaffeCrop",
]


# --------------------------------------------------------------------------------------------
# Layout helpers


def caffe_axis(axis: int, rank: int) -> int:
    """The Keras (channels-last) axis of Caffe axis ``axis`` of a rank-``rank`` blob."""
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise ValueError(f"axis {axis} is out of range for a {rank}-D blob")
    if rank <= 2 or a == 0:
        return a
    return rank - 1 if a == 1 else a - 1


def _to_caffe_perm(rank: int) -> List[int]:
    return [0, rank - 1] + list(range(1, rank - 1)) if rank > 2 else list(range(rank))


def _from_caffe_perm(rank: int) -> List[int]:
    return [0] + list(range(2, rank)) + [1] if rank > 2 else list(range(rank))


def to_caffe_layout(x):
    """A channels-last tensor/array in Caffe's order (N, C, ...). numpy in, numpy out."""
    rank = len(x.shape)
    if rank <= 2:
        return x
    perm = _to_caffe_perm(rank)
    return np.transpose(x, perm) if isinstance(x, np.ndarray) else ops.transpose(x, perm)


def from_caffe_layout(x):
    """A Caffe-ordered (N, C, ...) tensor/array in channels-last order."""
    rank = len(x.shape)
    if rank <= 2:
        return x
    perm = _from_caffe_perm(rank)
    return np.transpose(x, perm) if isinstance(x, np.ndarray) else ops.transpose(x, perm)


def caffe_shape(shape: Sequence) -> Tuple:
    """Caffe's shape of a channels-last Keras shape."""
    shape = tuple(shape)
    return tuple(shape[i] for i in _to_caffe_perm(len(shape)))


def keras_shape(shape: Sequence) -> Tuple:
    """The channels-last shape of a Caffe blob shape."""
    shape = tuple(shape)
    return tuple(shape[i] for i in _from_caffe_perm(len(shape)))


def _pair(v, name: str) -> Tuple[int, int]:
    if isinstance(v, (int, np.integer)):
        return int(v), int(v)
    v = tuple(int(a) for a in v)
    if len(v) != 2:
        raise ValueError(f"`{name}` must be an int or a pair, got {v}")
    return v  # type: ignore[return-value]


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
    """Caffe's 2-D MAX / AVE pooling on channels-last input.

    Args:
        pool: ``"MAX"`` or ``"AVE"``.
        kernel_size, strides, padding: ints or ``(h, w)`` (symmetric padding, as in Caffe).
        global_pooling: pool over the whole image (kernel = input size).
        round_mode: ``"CEIL"`` (Caffe's default) or ``"FLOOR"``.
    """

    def __init__(self, pool: str = "MAX", kernel_size=2, strides=1, padding=0,
                 global_pooling: bool = False, round_mode: str = "CEIL", **kwargs) -> None:
        super().__init__(**kwargs)
        pool = pool.upper()
        if pool not in ("MAX", "AVE"):
            raise ValueError(f"pool must be 'MAX' or 'AVE', got {pool!r}")
        round_mode = round_mode.upper()
        if round_mode not in ("CEIL", "FLOOR"):
            raise ValueError(f"round_mode must be 'CEIL' or 'FLOOR', got {round_mode!r}")
        self.pool = pool
        self.kernel_size = None if kernel_size is None else _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        self.padding = _pair(padding, "padding")
        self.global_pooling = bool(global_pooling)
        self.round_mode = round_mode

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
        return (n, oh, ow, c)

    def _divisor(self, h, w, kh, kw, sh, sw, ph, pw, oh, ow) -> Optional[np.ndarray]:
        def sizes(n_out, size, k, s, p):
            start = np.arange(n_out) * s - p
            end = np.minimum(start + k, size + p)
            return end - start
        div = np.outer(sizes(oh, h, kh, sh, ph), sizes(ow, w, kw, sw, pw)).astype(np.float32)
        if np.all(div == kh * kw):
            return None
        return (kh * kw / div).reshape(oh, ow, 1)

    def call(self, x):
        h, w = x.shape[1], x.shape[2]
        kh, kw, sh, sw, ph, pw, oh, ow = self._geometry(h, w)
        bottom = max(0, (oh - 1) * sh + kh - h - ph)
        right = max(0, (ow - 1) * sw + kw - w - pw)
        pads = [[0, 0], [ph, bottom], [pw, right], [0, 0]]
        if self.pool == "MAX":
            if any(sum(p) for p in pads):
                low = float(np.finfo(np.float32).min)
                x = ops.pad(x, pads, constant_values=low)
            y = ops.max_pool(x, (kh, kw), (sh, sw), padding="valid",
                             data_format="channels_last")
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


# --------------------------------------------------------------------------------------------
# BatchNorm, Scale, Bias, PReLU


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeBatchNorm(keras.layers.Layer):
    """Caffe's BatchNorm (no affine part; Caffe follows it with a Scale layer).

    Variables, in Caffe's blob order: ``mean`` (C,), ``variance`` (C,), ``scale_factor`` (1,);
    the statistics used are ``mean / scale_factor`` and ``variance / scale_factor`` (0 when the
    factor is 0). With ``use_global_stats`` false and ``training=True`` the batch statistics are
    used (biased variance) and the blobs are updated as Caffe does:
    ``s = maf * s + 1; mean = maf * mean + batch_mean; var = maf * var + m/(m-1) * batch_var``.
    ``use_global_stats=None`` means Caffe's default: global statistics unless training.
    """

    def __init__(self, eps: float = 1e-5, moving_average_fraction: float = 0.999,
                 use_global_stats: Optional[bool] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eps = float(eps)
        self.moving_average_fraction = float(moving_average_fraction)
        self.use_global_stats = use_global_stats

    def build(self, input_shape):
        c = int(input_shape[-1])
        # Statistics stay float32 under a mixed policy (not autocast): they accumulate.
        self.mean = self.add_weight(name="mean", shape=(c,), initializer="zeros",
                                    trainable=False, autocast=False)
        self.variance = self.add_weight(name="variance", shape=(c,), initializer="zeros",
                                        trainable=False, autocast=False)
        self.scale_factor = self.add_weight(name="scale_factor", shape=(1,),
                                            initializer="zeros", trainable=False, autocast=False)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x, training=None):
        use_global = self.use_global_stats
        if use_global is None:
            use_global = not training
        if use_global:
            s = self.scale_factor[0]
            inv = ops.where(ops.equal(s, 0.0), ops.zeros_like(s), 1.0 / s)
            return normalize_with(x, self.mean * inv, self.variance * inv, self.eps)
        y, mean, unbiased_var = normalize_batch(x, self.eps)
        if training:
            maf = self.moving_average_fraction
            self.scale_factor.assign(self.scale_factor * maf + 1.0)
            self.mean.assign(self.mean * maf + mean)
            self.variance.assign(self.variance * maf + unbiased_var)
        return y

    def get_config(self):
        cfg = super().get_config()
        cfg.update(eps=self.eps, moving_average_fraction=self.moving_average_fraction,
                   use_global_stats=self.use_global_stats)
        return cfg


class _AxisParamLayer(keras.layers.Layer):
    """Shared by Scale and Bias: a parameter of Caffe shape ``blob.shape[axis:axis+num_axes]``,
    learned or given as the second input."""

    def __init__(self, axis: int = 1, num_axes: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.num_axes = int(num_axes)

    def _param_shape(self, caffe_in: Tuple) -> Tuple[int, ...]:
        rank = len(caffe_in)
        a = self.axis + rank if self.axis < 0 else self.axis
        end = rank if self.num_axes == -1 else a + self.num_axes
        if not (0 <= a <= rank and a <= end <= rank):
            raise ValueError(f"'{self.name}': axis {self.axis} / num_axes {self.num_axes} do "
                             f"not fit a {rank}-D blob")
        return tuple(int(d) for d in caffe_in[a:end])

    def _channel_fast_path(self, rank: int, pshape: Tuple) -> bool:
        a = self.axis + rank if self.axis < 0 else self.axis
        return a == 1 and len(pshape) == 1

    def _apply(self, x, p, op):
        rank = len(x.shape)
        a = self.axis + rank if self.axis < 0 else self.axis
        if a == 1 and len(p.shape) == 1:          # per channel: last axis in Keras' layout
            return op(x, p)
        if len(p.shape) == 0:
            return op(x, p)
        xc = to_caffe_layout(x)
        shape = [1] * a + list(p.shape) + [1] * (rank - a - len(p.shape))
        if a == 0:
            shape[0] = -1
        y = op(xc, ops.reshape(p, shape))
        return from_caffe_layout(y)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, num_axes=self.num_axes)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeScale(_AxisParamLayer):
    """Caffe's Scale: ``y = x * scale (+ bias)``; ``scale`` learned (one input) or the second
    input (Caffe order, channels-last held). Variables: ``scale`` then ``bias``."""

    def __init__(self, axis: int = 1, num_axes: int = 1, bias_term: bool = False,
                 **kwargs) -> None:
        super().__init__(axis, num_axes, **kwargs)
        self.bias_term = bool(bias_term)

    def build(self, input_shape):
        two = isinstance(input_shape, (list, tuple)) and len(input_shape) == 2 and \
            isinstance(input_shape[0], (list, tuple))
        first = input_shape[0] if two else input_shape
        if two:
            if self.axis != 0:
                raise ValueError(f"Scale '{self.name}' with two inputs: only axis 0 is "
                                 "supported (the second input includes the batch axis)")
            if self.bias_term:
                raise ValueError(f"Scale '{self.name}' with two inputs: bias_term is not "
                                 "supported (its bias would have a batch axis)")
        else:
            pshape = self._param_shape(caffe_shape(first))
            self.scale = self.add_weight(name="scale", shape=pshape, initializer="ones")
            if self.bias_term:
                self.bias = self.add_weight(name="bias", shape=pshape, initializer="zeros")

    def compute_output_shape(self, input_shape):
        two = isinstance(input_shape, (list, tuple)) and len(input_shape) == 2 and \
            isinstance(input_shape[0], (list, tuple))
        return input_shape[0] if two else input_shape

    def call(self, inputs):
        if isinstance(inputs, (list, tuple)):
            x, s = inputs
            y = self._apply_two(x, s)
        else:
            x = inputs
            y = self._apply(x, self.scale, ops.multiply)
        if self.bias_term:
            y = self._apply(y, self.bias, ops.add)
        return y

    def _apply_two(self, x, s):
        # axis 0: s (Caffe shape (N, d1, ..)) scales Caffe dims [0, s.rank) of x.
        rank, k = len(x.shape), len(s.shape)
        if k > rank:
            raise ValueError(f"Scale '{self.name}': the scale input has more axes than x")
        sc = to_caffe_layout(s)
        sb = ops.reshape(sc, [-1] + [int(d) for d in sc.shape[1:]] + [1] * (rank - k))
        return from_caffe_layout(to_caffe_layout(x) * sb)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(bias_term=self.bias_term)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeBias(_AxisParamLayer):
    """Caffe's Bias: ``y = x + bias`` (learned, Caffe shape ``shape[axis:axis+num_axes]``)."""

    def build(self, input_shape):
        pshape = self._param_shape(caffe_shape(input_shape))
        self.bias = self.add_weight(name="bias", shape=pshape, initializer="zeros")

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return self._apply(x, self.bias, ops.add)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffePReLU(keras.layers.Layer):
    """Caffe's PReLU: ``y = max(0, x) + a * min(0, x)``, ``a`` per channel (C,) or shared (1,)."""

    def __init__(self, channel_shared: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.channel_shared = bool(channel_shared)

    def build(self, input_shape):
        c = 1 if self.channel_shared else int(input_shape[-1])
        self.alpha = self.add_weight(name="alpha", shape=(c,),
                                     initializer=keras.initializers.Constant(0.25))

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return ops.maximum(x, 0.0) + self.alpha * ops.minimum(x, 0.0)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(channel_shared=self.channel_shared)
        return cfg


# --------------------------------------------------------------------------------------------
# InnerProduct, Deconvolution


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeInnerProduct(keras.layers.Layer):
    """Caffe's InnerProduct: flattens Caffe axes ``[axis, end)`` in Caffe's (C-major) order,
    then ``y = x W^T + b``.

    Variables: ``kernel`` of shape ``(num_output, K)``, exactly Caffe's weight blob (so that
    importing a 240 MB caffemodel needs no transposition; a ``transpose: true`` blob is
    transposed once at import) and ``bias``.
    """

    def __init__(self, num_output: int, axis: int = 1, bias_term: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_output = int(num_output)
        self.axis = int(axis)
        self.bias_term = bool(bias_term)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def _split(self, shape):
        cshape = caffe_shape(shape)
        rank = len(cshape)
        a = self.axis + rank if self.axis < 0 else self.axis
        if not 0 < a < rank:
            raise ValueError(f"InnerProduct '{self.name}': axis {self.axis} invalid for a "
                             f"{rank}-D input")
        k = 1
        for d in cshape[a:]:
            if d is None:
                raise ValueError(f"InnerProduct '{self.name}' needs known input dims, got "
                                 f"{tuple(shape)}")
            k *= int(d)
        return cshape, a, k

    def build(self, input_shape):
        _, _, k = self._split(input_shape)
        self.kernel = self.add_weight(name="kernel", shape=(self.num_output, k),
                                      initializer=self.kernel_initializer)
        if self.bias_term:
            self.bias = self.add_weight(name="bias", shape=(self.num_output,),
                                        initializer=self.bias_initializer)

    def compute_output_shape(self, input_shape):
        cshape, a, _ = self._split(input_shape)
        return keras_shape(tuple(cshape[:a]) + (self.num_output,))

    def call(self, x):
        cshape, a, k = self._split(x.shape)
        lead = [int(d) for d in cshape[1:a]]
        # Caffe's flatten order: a transpose of the (N, H, W, C) input to (N, C, H, W) (for
        # CaffeNet's fc6 at batch 32, 0.3 M values: well under 1% of the layer), then rows of K.
        x2 = ops.reshape(to_caffe_layout(x), (-1, k))
        # x @ kernel^T with the transpose as a matmul flag: on TensorFlow, ops.transpose of the
        # (O, K) kernel copies it in the forward and again for its gradient (fc6 at batch 32:
        # 1.6x the time of the flag form), and TF's einsum gradient builds an (N, O, K) tensor.
        y = _backend.matmul_nt(x2, _backend.as_tensor(self.kernel))
        if self.bias_term:
            y = y + self.bias
        if lead:
            y = ops.reshape(y, [-1] + lead + [self.num_output])
        return from_caffe_layout(y)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(num_output=self.num_output, axis=self.axis, bias_term=self.bias_term,
                   kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                   bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeDeconvolution(keras.layers.Layer):
    """Caffe's Deconvolution (the adjoint of a convolution), channels-last.

    Output size ``stride * (in - 1) + dilation * (kernel - 1) + 1 - 2 * pad``.
    Variables: ``kernel`` ``(kh, kw, filters // groups, in_channels)`` (Keras'
    ``conv_transpose`` layout; Caffe's blob is ``(in_channels, filters // groups, kh, kw)``)
    and ``bias``.
    """

    def __init__(self, filters: int, kernel_size, strides=1, padding=0, dilation_rate=1,
                 groups: int = 1, use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", **kwargs) -> None:
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        self.padding = _pair(padding, "padding")
        self.dilation_rate = _pair(dilation_rate, "dilation_rate")
        self.groups = int(groups)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        c = int(input_shape[-1])
        if c % self.groups or self.filters % self.groups:
            raise ValueError(f"Deconvolution '{self.name}': group {self.groups} must divide "
                             f"the input channels ({c}) and num_output ({self.filters})")
        kh, kw = self.kernel_size
        self.kernel = self.add_weight(name="kernel",
                                      shape=(kh, kw, self.filters // self.groups, c),
                                      initializer=self.kernel_initializer)
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(self.filters,),
                                        initializer=self.bias_initializer)

    def _out(self, size, k, s, p, d):
        return s * (size - 1) + d * (k - 1) + 1 - 2 * p

    def compute_output_shape(self, input_shape):
        n, h, w, _ = input_shape
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (self.kernel_size, self.strides,
                                                  self.padding, self.dilation_rate)
        return (n, self._out(h, kh, sh, ph, dh), self._out(w, kw, sw, pw, dw), self.filters)

    def call(self, x):
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (self.kernel_size, self.strides,
                                                  self.padding, self.dilation_rate)
        h, w, c = x.shape[1], x.shape[2], x.shape[3]
        oh, ow = self._out(h, kh, sh, ph, dh), self._out(w, kw, sw, pw, dw)
        full_h, full_w = oh + 2 * ph, ow + 2 * pw
        g = self.groups
        cg = c // g
        outs = []
        for i in range(g):
            xi = x[..., i * cg:(i + 1) * cg] if g > 1 else x
            ki = self.kernel[..., i * cg:(i + 1) * cg] if g > 1 else self.kernel
            yi = ops.conv_transpose(xi, ki, (sh, sw), padding="valid",
                                    output_padding=None, data_format="channels_last",
                                    dilation_rate=(dh, dw))
            outs.append(yi)
        y = ops.concatenate(outs, axis=-1) if g > 1 else outs[0]
        # 'valid' conv_transpose gives (in-1)*s + ek (or more when ek < s); crop Caffe's pad
        yh, yw = y.shape[1], y.shape[2]
        if yh is not None and yh < full_h or yw is not None and yw < full_w:
            y = ops.pad(y, [[0, 0], [0, max(0, full_h - yh)], [0, max(0, full_w - yw)],
                            [0, 0]])
        y = y[:, ph:ph + oh, pw:pw + ow, :]
        if self.use_bias:
            y = y + self.bias
        return y

    def get_config(self):
        cfg = super().get_config()
        cfg.update(filters=self.filters, kernel_size=self.kernel_size, strides=self.strides,
                   padding=self.padding, dilation_rate=self.dilation_rate, groups=self.groups,
                   use_bias=self.use_bias,
                   kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                   bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return cfg


# --------------------------------------------------------------------------------------------
# Element-wise


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeUnary(keras.layers.Layer):
    """One of Caffe's element-wise layers.

    ``op``: ``"AbsVal"``; ``"Power"`` ``(shift + scale x)^power``; ``"Exp"``
    ``base^(shift + scale x)`` (``base=-1`` means e); ``"Log"`` ``log_base(shift + scale x)``;
    ``"BNLL"`` ``log(1 + e^x)``; ``"Clip"`` to ``[min, max]``; ``"Threshold"``
    ``x > threshold``; ``"Swish"`` ``x * sigmoid(beta x)``.
    """

    OPS = ("AbsVal", "Power", "Exp", "Log", "BNLL", "Clip", "Threshold", "Swish")

    def __init__(self, op: str, power: float = 1.0, scale: float = 1.0, shift: float = 0.0,
                 base: float = -1.0, min: float = 0.0, max: float = 0.0,  # noqa: A002
                 threshold: float = 0.0, beta: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if op not in self.OPS:
            raise ValueError(f"CaffeUnary op must be one of {self.OPS}, got {op!r}")
        self.op = op
        self.power = float(power)
        self.scale = float(scale)
        self.shift = float(shift)
        self.base = float(base)
        self.min = float(min)
        self.max = float(max)
        self.threshold = float(threshold)
        self.beta = float(beta)

    def compute_output_shape(self, input_shape):
        return input_shape

    def _lin(self, x):
        y = x
        if self.scale != 1.0:
            y = y * self.scale
        if self.shift != 0.0:
            y = y + self.shift
        return y

    def call(self, x):
        op = self.op
        if op == "AbsVal":
            return ops.abs(x)
        if op == "Power":
            y = self._lin(x)
            return y if self.power == 1.0 else ops.power(y, self.power)
        if op == "Exp":
            y = self._lin(x)
            return ops.exp(y if self.base == -1.0 else y * math.log(self.base))
        if op == "Log":
            y = ops.log(self._lin(x))
            return y if self.base == -1.0 else y / math.log(self.base)
        if op == "BNLL":
            return ops.softplus(x)
        if op == "Clip":
            return ops.clip(x, self.min, self.max)
        if op == "Threshold":
            return ops.cast(ops.greater(x, self.threshold), x.dtype)
        return x * ops.sigmoid(self.beta * x)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(op=self.op, power=self.power, scale=self.scale, shift=self.shift,
                   base=self.base, min=self.min, max=self.max, threshold=self.threshold,
                   beta=self.beta)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeEltwise(keras.layers.Layer):
    """Caffe's Eltwise over its inputs: ``SUM`` (with optional per-input ``coeff``), ``PROD``,
    ``MAX``."""

    def __init__(self, operation: str = "SUM", coeff: Optional[Sequence[float]] = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        operation = operation.upper()
        if operation not in ("SUM", "PROD", "MAX"):
            raise ValueError(f"Eltwise operation must be SUM, PROD or MAX, got {operation!r}")
        if coeff and operation != "SUM":
            raise ValueError("Eltwise `coeff` is only allowed with operation SUM")
        self.operation = operation
        self.coeff = [float(c) for c in coeff] if coeff else None

    def compute_output_shape(self, input_shape):
        return input_shape[0]

    def call(self, inputs):
        xs = list(inputs)
        if self.coeff and len(self.coeff) != len(xs):
            raise ValueError(f"Eltwise '{self.name}': {len(self.coeff)} coeffs for "
                             f"{len(xs)} inputs")
        if self.operation == "SUM":
            coeff = self.coeff or [1.0] * len(xs)
            y = xs[0] * coeff[0] if coeff[0] != 1.0 else xs[0]
            for c, x in zip(coeff[1:], xs[1:]):
                y = y + (x * c if c != 1.0 else x)
            return y
        y = xs[0]
        for x in xs[1:]:
            y = y * x if self.operation == "PROD" else ops.maximum(y, x)
        return y

    def get_config(self):
        cfg = super().get_config()
        cfg.update(operation=self.operation, coeff=self.coeff)
        return cfg


# --------------------------------------------------------------------------------------------
# Shape layers (axes are Caffe axes)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeConcat(keras.layers.Layer):
    """Caffe's Concat along Caffe axis ``axis``."""

    def __init__(self, axis: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)

    def compute_output_shape(self, input_shape):
        rank = len(input_shape[0])
        ax = caffe_axis(self.axis, rank)
        out = list(input_shape[0])
        dims = [s[ax] for s in input_shape]
        out[ax] = None if any(d is None for d in dims) else sum(dims)
        return tuple(out)

    def call(self, inputs):
        return ops.concatenate(list(inputs), axis=caffe_axis(self.axis, len(inputs[0].shape)))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeSlice(keras.layers.Layer):
    """Caffe's Slice along Caffe axis ``axis`` at ``slice_points`` (or ``num_outputs`` equal
    parts); returns a list of tensors."""

    def __init__(self, axis: int = 1, slice_points: Sequence[int] = (), num_outputs: int = 2,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.slice_points = [int(p) for p in slice_points]
        self.num_outputs = int(num_outputs)

    def _bounds(self, size: int) -> List[Tuple[int, int]]:
        if self.slice_points:
            pts = [0] + self.slice_points + [size]
            if len(pts) - 1 != self.num_outputs:
                raise ValueError(f"Slice '{self.name}': {len(self.slice_points)} slice points "
                                 f"for {self.num_outputs} outputs")
        else:
            if size % self.num_outputs:
                raise ValueError(f"Slice '{self.name}': axis size {size} does not divide into "
                                 f"{self.num_outputs} equal parts")
            step = size // self.num_outputs
            pts = [i * step for i in range(self.num_outputs + 1)]
        if any(b <= a for a, b in zip(pts, pts[1:])) or pts[-1] > size:
            raise ValueError(f"Slice '{self.name}': slice points {self.slice_points} invalid for "
                             f"an axis of size {size}")
        return list(zip(pts, pts[1:]))

    def compute_output_shape(self, input_shape):
        ax = caffe_axis(self.axis, len(input_shape))
        out = []
        for a, b in self._bounds(int(input_shape[ax])):
            s = list(input_shape)
            s[ax] = b - a
            out.append(tuple(s))
        return out

    def call(self, x):
        rank = len(x.shape)
        ax = caffe_axis(self.axis, rank)
        outs = []
        for a, b in self._bounds(int(x.shape[ax])):
            idx = [slice(None)] * rank
            idx[ax] = slice(a, b)
            outs.append(x[tuple(idx)])
        return outs

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, slice_points=self.slice_points, num_outputs=self.num_outputs)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeSoftmax(keras.layers.Layer):
    """Caffe's Softmax along Caffe axis ``axis`` (default 1, the channels)."""

    def __init__(self, axis: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return ops.softmax(x, axis=caffe_axis(self.axis, len(x.shape)))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis)
        return cfg


def _static_caffe_shape(layer, shape) -> List[Optional[int]]:
    cs = list(caffe_shape(shape))
    if any(d is None for d in cs[1:]):
        raise ValueError(f"'{layer.name}' needs known non-batch dims, got {tuple(shape)}")
    return cs


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeFlatten(keras.layers.Layer):
    """Caffe's Flatten of Caffe axes ``[axis, end_axis]`` in Caffe's element order."""

    def __init__(self, axis: int = 1, end_axis: int = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.end_axis = int(end_axis)

    def _out_caffe(self, shape):
        cs = _static_caffe_shape(self, shape)
        r = len(cs)
        a = self.axis + r if self.axis < 0 else self.axis
        e = self.end_axis + r if self.end_axis < 0 else self.end_axis
        if not 0 <= a <= e < r:
            raise ValueError(f"Flatten '{self.name}': axes [{self.axis}, {self.end_axis}] "
                             f"invalid for a {r}-D blob")
        mid = 1
        for d in cs[a:e + 1]:
            mid = None if (d is None or mid is None) else mid * d
        return cs[:a] + [mid] + cs[e + 1:]

    def compute_output_shape(self, input_shape):
        return keras_shape(self._out_caffe(input_shape))

    def call(self, x):
        out = self._out_caffe(x.shape)
        y = ops.reshape(to_caffe_layout(x), [-1] + [int(d) for d in out[1:]])
        return from_caffe_layout(y)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, end_axis=self.end_axis)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeReshape(keras.layers.Layer):
    """Caffe's Reshape: ``shape`` replaces Caffe axes ``[axis, axis + num_axes)``; 0 copies the
    input dim, -1 is inferred. The batch axis must be kept (0 or -1 there)."""

    def __init__(self, shape: Sequence[int], axis: int = 0, num_axes: int = -1,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.shape = [int(d) for d in shape]
        self.axis = int(axis)
        self.num_axes = int(num_axes)

    def _out_caffe(self, in_shape):
        cs = list(caffe_shape(in_shape))
        r = len(cs)
        a = self.axis + r + 1 if self.axis < 0 else self.axis
        end = r if self.num_axes == -1 else a + self.num_axes
        if not 0 <= a <= end <= r:
            raise ValueError(f"Reshape '{self.name}': axis {self.axis} / num_axes "
                             f"{self.num_axes} invalid for a {r}-D blob")
        new = []
        for i, d in enumerate(self.shape):
            new.append(cs[a + i] if d == 0 else d)
        out = cs[:a] + new + cs[end:]
        if self.shape.count(-1) > 1:
            raise ValueError(f"Reshape '{self.name}': at most one -1 in shape")
        if -1 in out:
            known = 1
            for d in out:
                if d not in (-1, None):
                    known *= d
            total = 1
            for d in cs[1:]:
                total *= d
            j = out.index(-1)
            if j == 0:
                out[0] = None  # batch inferred
            else:
                rest = 1
                for k, d in enumerate(out):
                    if k != j and k != 0:
                        rest *= d
                if out[0] is None or cs[0] is None or out[0] == cs[0]:
                    if total % rest:
                        raise ValueError(f"Reshape '{self.name}': cannot reshape {cs} to "
                                         f"{self.shape}")
                    out[j] = total // rest
        if out[0] is not None and out[0] != cs[0]:
            raise ValueError(f"Reshape '{self.name}': changing the batch axis is not supported")
        tot_in = int(np.prod([d for d in cs[1:]]))
        tot_out = int(np.prod([d for d in out[1:]]))
        if tot_in != tot_out:
            raise ValueError(f"Reshape '{self.name}': {cs} has {tot_in} values per item, "
                             f"{out} needs {tot_out}")
        return out

    def compute_output_shape(self, input_shape):
        return keras_shape(self._out_caffe(input_shape))

    def call(self, x):
        out = self._out_caffe(x.shape)
        return from_caffe_layout(ops.reshape(to_caffe_layout(x), [-1] + out[1:]))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(shape=self.shape, axis=self.axis, num_axes=self.num_axes)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeCrop(keras.layers.Layer):
    """Caffe's Crop: crops input 0 to the shape of input 1 on Caffe axes ``>= axis``, starting
    at ``offset`` (one value for all axes, one per axis, or none = 0)."""

    def __init__(self, axis: int = 2, offset: Sequence[int] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.offset = [int(o) for o in offset]

    def _slices(self, s0, s1):
        c0, c1 = list(caffe_shape(s0)), list(caffe_shape(s1))
        r = len(c0)
        a = self.axis + r if self.axis < 0 else self.axis
        if len(self.offset) not in (0, 1, r - a):
            raise ValueError(f"Crop '{self.name}': {len(self.offset)} offsets for {r - a} axes")
        sl = [slice(None)] * r
        shape = list(c0)
        for i in range(a, r):
            off = 0 if not self.offset else (self.offset[0] if len(self.offset) == 1
                                             else self.offset[i - a])
            if c1[i] is None or c0[i] is None:
                raise ValueError(f"Crop '{self.name}' needs known dims")
            if off + c1[i] > c0[i]:
                raise ValueError(f"Crop '{self.name}': offset {off} + size {c1[i]} exceeds "
                                 f"{c0[i]} on axis {i}")
            sl[i] = slice(off, off + c1[i])
            shape[i] = c1[i]
        kperm = _from_caffe_perm(r)
        return [sl[i] for i in kperm], keras_shape(shape)

    def compute_output_shape(self, input_shape):
        return self._slices(input_shape[0], input_shape[1])[1]

    def call(self, inputs):
        x, ref = inputs
        sl, _ = self._slices(x.shape, ref.shape)
        return x[tuple(sl)]

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, offset=self.offset)
        return cfg
