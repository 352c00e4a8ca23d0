"""Small fork layers: ShuffleNet's :class:`CaffeShuffleChannel`, SENet's :class:`CaffeAxpy`
and Fast R-CNN's :class:`CaffeROIPooling` (channels-last tensors)."""

from __future__ import annotations

import numpy as np
import keras
from keras import ops

_PKG = "keras_cct"

__all__ = ["CaffeShuffleChannel", "CaffeAxpy", "CaffeROIPooling"]


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeShuffleChannel(keras.layers.Layer):
    """ShuffleNet's channel shuffle: channels seen as ``(group, C / group)``, transposed to
    ``(C / group, group)`` (output channel ``j * group + g`` is input channel
    ``g * C / group + j``)."""

    def __init__(self, group: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        if int(group) < 1:
            raise ValueError(f"ShuffleChannel group must be >= 1, got {group}")
        self.group = int(group)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        c = int(x.shape[-1])
        if c % self.group:
            raise ValueError(f"ShuffleChannel: {c} channels do not split in {self.group} groups")
        perm = np.arange(c).reshape(self.group, c // self.group).T.reshape(-1)
        return ops.take(x, ops.convert_to_tensor(perm.astype("int32")), axis=-1)

    def get_config(self):
        return {**super().get_config(), "group": self.group}


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeAxpy(keras.layers.Layer):
    """SENet's Axpy on ``[a, x, y]``: ``a * x + y`` with ``a`` one value per image and channel
    (Caffe ``(N, C, 1, 1)`` or ``(N, C)``), ``x`` and ``y`` of one shape ``(N, C, H, W)``."""

    def compute_output_shape(self, input_shape):
        return input_shape[1]

    def call(self, inputs):
        a, x, y = inputs
        if len(a.shape) == 2 and len(x.shape) > 2:
            a = ops.reshape(a, (-1,) + (1,) * (len(x.shape) - 2) + (int(a.shape[-1]),))
        return a * x + y


def _round_half_away(v):
    """C's ``round``: halves away from zero."""
    return ops.sign(v) * ops.floor(ops.abs(v) + 0.5)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeROIPooling(keras.layers.Layer):
    """Fast R-CNN's ROIPooling on ``[features, rois]``: rois ``(R, 5)`` rows
    ``[batch_index, x1, y1, x2, y2]`` in image pixels; each is scaled by ``spatial_scale`` and
    rounded (C ``round``), given a size of at least 1, split into ``pooled_h x pooled_w`` bins
    (``floor``/``ceil`` of the fractional bin edges, clipped to the map) and max-pooled; an
    empty bin gives 0. Output: Caffe ``(R, C, pooled_h, pooled_w)`` (Keras channels-last)."""

    def __init__(self, pooled_h: int = 1, pooled_w: int = 1, spatial_scale: float = 1.0,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if int(pooled_h) < 1 or int(pooled_w) < 1:
            raise ValueError("ROIPooling needs pooled_h and pooled_w >= 1")
        self.pooled_h = int(pooled_h)
        self.pooled_w = int(pooled_w)
        self.spatial_scale = float(spatial_scale)

    def compute_output_shape(self, input_shape):
        feat, rois = input_shape
        return (rois[0], self.pooled_h, self.pooled_w, feat[-1])

    def _masks(self, start, end, pooled: int, size: int):
        """(R, pooled, size) booleans: which rows/columns each bin covers."""
        length = ops.maximum(end - start + 1.0, 1.0)
        binsize = length / pooled
        p = ops.cast(ops.arange(pooled), length.dtype)[None, :]
        lo = ops.floor(p * binsize[:, None]) + start[:, None]
        hi = ops.ceil((p + 1.0) * binsize[:, None]) + start[:, None]
        lo = ops.clip(lo, 0.0, float(size))
        hi = ops.clip(hi, 0.0, float(size))
        pos = ops.cast(ops.arange(size), length.dtype)[None, None, :]
        return (pos >= lo[..., None]) & (pos < hi[..., None])

    def call(self, inputs):
        x, rois = inputs
        h, w = int(x.shape[1]), int(x.shape[2])
        rois = ops.reshape(rois, (-1, 5))
        box = _round_half_away(rois[:, 1:] * self.spatial_scale)
        mh = self._masks(box[:, 1], box[:, 3], self.pooled_h, h)      # (R, PH, H)
        mw = self._masks(box[:, 0], box[:, 2], self.pooled_w, w)      # (R, PW, W)
        feats = ops.take(x, ops.cast(rois[:, 0], "int32"), axis=0)    # (R, H, W, C)
        low = ops.cast(np.finfo(np.float32).min, x.dtype)
        mask = mh[:, :, None, :, None] & mw[:, None, :, None, :]     # (R, PH, PW, H, W)
        vals = ops.where(mask[..., None], feats[:, None, None], low)
        out = ops.max(vals, axis=(3, 4))
        empty = ops.logical_not(ops.any(mask, axis=(3, 4)))[..., None]
        return ops.where(empty, ops.zeros_like(out), out)

    def get_config(self):
        return {**super().get_config(), "pooled_h": self.pooled_h, "pooled_w": self.pooled_w,
                "spatial_scale": self.spatial_scale}
