"""Caffe's reducing layers on channels-last blobs: :class:`CaffeArgMax`, :class:`CaffeReduction`
and :class:`CaffeMVN` (mean-variance normalization).

Axes are Caffe's (``(N, C, d1, ...)``); :func:`keras_cct.caffe.net.layout.caffe_axis` maps them
onto the channels-last tensor.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import keras
from keras import ops

from keras_cct.caffe.net.layout import (caffe_axis, caffe_shape, from_caffe_layout,
                                        keras_shape, to_caffe_layout)

_PKG = "keras_cct"

__all__ = ["CaffeArgMax", "CaffeReduction", "CaffeMVN", "reduced_keras_axes"]


def reduced_keras_axes(axis: int, rank: int) -> Tuple[int, ...]:
    """The Keras axes holding Caffe axes ``axis .. rank-1`` of a rank-``rank`` blob (Caffe's
    "from ``axis`` to the end", as Reduction and Softmax-like layers count)."""
    first = caffe_axis(axis, rank)
    a = axis + rank if axis < 0 else axis
    if rank <= 2 or a == 0:
        return tuple(range(a, rank))
    if a == 1:
        return tuple(range(1, rank))
    return tuple(range(first, rank - 1))


def _top_k_last(x, k: int):
    """``(values, indices)`` of the ``k`` largest along the last axis, ties broken as Caffe's
    ``std::partial_sort`` with ``std::greater<pair<value, index>>``: the larger index first
    (the same on every backend: ``k`` rounds of max, then the largest index holding it)."""
    n = int(x.shape[-1])
    iota = ops.cast(ops.arange(n), "int32")
    neg_inf = ops.cast(float("-inf"), x.dtype)
    taken = ops.zeros_like(x, dtype="bool")
    vals, idxs = [], []
    for _ in range(k):
        avail = ops.where(taken, neg_inf, x)
        m = ops.max(avail, axis=-1, keepdims=True)
        hit = ops.logical_and(ops.equal(avail, m), ops.logical_not(taken))
        idx = ops.max(ops.where(hit, iota, -1), axis=-1)
        vals.append(m[..., 0])
        idxs.append(idx)
        taken = ops.logical_or(taken, ops.equal(iota, idx[..., None]))
    return ops.stack(vals, axis=-1), ops.stack(idxs, axis=-1)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeArgMax(keras.layers.Layer):
    """Caffe's ``ArgMax``: the ``top_k`` largest entries (their indices, as floats, or with
    ``out_max_val`` their values).

    Without ``axis`` each item is flattened (in Caffe's C-major order) and the top is Caffe's
    ``(N, 1, top_k, 1...)`` (``(N, 2, top_k, ...)`` with ``out_max_val``: indices then values)
    of rank ``max(rank, 3)``; with ``axis`` the top is the input with that axis cut to
    ``top_k``, holding indices (or, with ``out_max_val``, the values). Caffe has no backward.
    """

    def __init__(self, top_k: int = 1, out_max_val: bool = False, axis: Optional[int] = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if int(top_k) < 1:
            raise ValueError(f"ArgMax top_k must be >= 1, got {top_k}")
        self.top_k = int(top_k)
        self.out_max_val = bool(out_max_val)
        self.axis = None if axis is None else int(axis)

    def _caffe_out(self, cshape):
        rank = len(cshape)
        if self.axis is not None:
            out = list(cshape)
            out[self.axis % rank] = self.top_k
            return tuple(out)
        out = [1] * max(rank, 3)
        out[0] = cshape[0]
        out[1] = 2 if self.out_max_val else 1
        out[2] = self.top_k
        return tuple(out)

    def compute_output_shape(self, input_shape):
        return keras_shape(self._caffe_out(caffe_shape(input_shape)))

    def call(self, x):
        rank = len(x.shape)
        if self.axis is not None:
            k_axis = caffe_axis(self.axis, rank)
            moved = ops.moveaxis(x, k_axis, -1)
            vals, idx = _top_k_last(moved, self.top_k)
            y = vals if self.out_max_val else ops.cast(idx, x.dtype)
            return ops.moveaxis(y, -1, k_axis)
        flat = ops.reshape(to_caffe_layout(x), (-1, math.prod(int(d) for d in x.shape[1:])))
        vals, idx = _top_k_last(flat, self.top_k)
        parts = [ops.cast(idx, x.dtype)] + ([vals] if self.out_max_val else [])
        y = ops.stack(parts, axis=1)  # (N, 1|2, top_k)
        out = self._caffe_out((None,) + tuple(x.shape[1:]))
        y = ops.reshape(y, (-1,) + tuple(out[1:]))
        return from_caffe_layout(y)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(top_k=self.top_k, out_max_val=self.out_max_val, axis=self.axis)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeReduction(keras.layers.Layer):
    """Caffe's ``Reduction``: ``SUM``, ``ASUM`` (sum of absolute values), ``SUMSQ`` (sum of
    squares) or ``MEAN`` over Caffe axes ``axis`` to the last, times ``coeff``. The top has
    Caffe shape ``bottom.shape[:axis]`` (a scalar when ``axis`` is 0)."""

    OPERATIONS = ("SUM", "ASUM", "SUMSQ", "MEAN")

    def __init__(self, operation: str = "SUM", axis: int = 0, coeff: float = 1.0,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        operation = str(operation).upper()
        if operation not in self.OPERATIONS:
            raise ValueError(f"Reduction operation must be one of {self.OPERATIONS}, "
                             f"got {operation!r}")
        self.operation = operation
        self.axis = int(axis)
        self.coeff = float(coeff)

    def compute_output_shape(self, input_shape):
        axes = reduced_keras_axes(self.axis, len(input_shape))
        return tuple(d for i, d in enumerate(input_shape) if i not in axes)

    def call(self, x):
        axes = reduced_keras_axes(self.axis, len(x.shape))
        if self.operation == "ASUM":
            x = ops.abs(x)
        elif self.operation == "SUMSQ":
            x = ops.square(x)
        y = (ops.mean(x, axis=axes) if self.operation == "MEAN"
             else ops.sum(x, axis=axes)) if axes else x
        return y * self.coeff if self.coeff != 1.0 else y

    def get_config(self):
        cfg = super().get_config()
        cfg.update(operation=self.operation, axis=self.axis, coeff=self.coeff)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeMVN(keras.layers.Layer):
    """Caffe's ``MVN``: subtract the mean over each channel's spatial positions (over all of
    an item's values with ``across_channels``), then, with ``normalize_variance``, divide by
    ``sqrt(variance) + eps`` (Caffe adds ``eps`` to the standard deviation, not the variance).

    The backward is the exact derivative; Caffe's hand-written one uses ``sqrt(var) + eps``
    where the exact one has ``sqrt(var)`` in one term (a relative difference of about
    ``eps / std``). A constant region (variance 0) gets a zero, not a NaN, gradient there.
    """

    def __init__(self, normalize_variance: bool = True, across_channels: bool = False,
                 eps: float = 1e-9, **kwargs) -> None:
        super().__init__(**kwargs)
        self.normalize_variance = bool(normalize_variance)
        self.across_channels = bool(across_channels)
        self.eps = float(eps)

    def compute_output_shape(self, input_shape):
        return input_shape

    def _axes(self, rank: int) -> Tuple[int, ...]:
        if self.across_channels:
            return tuple(range(1, rank))
        return tuple(range(1, rank - 1)) if rank > 2 else ()

    def call(self, x):
        axes = self._axes(len(x.shape))
        if not axes:
            return x - x  # each value is its own mean (Caffe: dim == 1)
        centred = x - ops.mean(x, axis=axes, keepdims=True)
        if not self.normalize_variance:
            return centred
        var = ops.mean(ops.square(centred), axis=axes, keepdims=True)
        tiny = 1e-30
        std = ops.sqrt(ops.maximum(var, tiny))  # no inf/NaN gradient where var == 0
        return centred / (std + self.eps)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(normalize_variance=self.normalize_variance,
                   across_channels=self.across_channels, eps=self.eps)
        return cfg
