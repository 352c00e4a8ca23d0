"""SSD's DetectionOutput (weiliu89/caffe): box decoding, per-class greedy NMS and
``keep_top_k``, in ``keras.ops`` with static shapes (any backend, inside a compiled model).

Caffe's output has one row per detection, ``(1, 1, num_det, 7)`` with rows
``[image_id, label, score, xmin, ymin, xmax, ymax]``: grouped by image, then by label
(ascending), then by score (descending). (OpenCV 4.x orders each image's rows by score alone:
``group_by_classes=False`` gives that order.) A Keras model needs a static shape, so here the blob
has a fixed number of rows (the most detections the parameters allow): the detections come
first, in Caffe's order, then padding rows of -1. :func:`detections` strips the padding.
"""

from __future__ import annotations

import numpy as np
import keras
from keras import ops

from keras_cct.caffe.net.layout import to_caffe_layout

_PKG = "keras_cct"

__all__ = ["CaffeDetectionOutput", "detections", "decode_boxes"]

_CODE_TYPES = ("CORNER", "CENTER_SIZE")


def detections(blob) -> np.ndarray:
    """The ``(num_det, 7)`` detection rows of a DetectionOutput blob (Keras ``(1, R, 7, 1)`` or
    Caffe ``(1, 1, R, 7)`` layout): the padding rows (image id -1) dropped."""
    a = np.asarray(keras.ops.convert_to_numpy(blob) if not isinstance(blob, np.ndarray)
                   else blob)
    rows = a.reshape(-1, 7) if a.shape[-1] == 7 else np.moveaxis(a, -1, 1).reshape(-1, 7)
    return rows[rows[:, 0] >= 0]


def decode_boxes(loc, priors, variances, code_type: str, variance_encoded_in_target: bool):
    """SSD's DecodeBBox for ``(..., 4)`` tensors (priors broadcast against ``loc``)."""
    if code_type == "CORNER":
        return priors + (loc if variance_encoded_in_target else loc * variances)
    pw = priors[..., 2] - priors[..., 0]
    ph = priors[..., 3] - priors[..., 1]
    pcx = (priors[..., 0] + priors[..., 2]) / 2.0
    pcy = (priors[..., 1] + priors[..., 3]) / 2.0
    v = ops.ones_like(variances) if variance_encoded_in_target else variances
    cx = v[..., 0] * loc[..., 0] * pw + pcx
    cy = v[..., 1] * loc[..., 1] * ph + pcy
    w = ops.exp(v[..., 2] * loc[..., 2]) * pw
    h = ops.exp(v[..., 3] * loc[..., 3]) * ph
    return ops.stack([cx - w / 2.0, cy - h / 2.0, cx + w / 2.0, cy + h / 2.0], axis=-1)


def _iou(a, b):
    """SSD's JaccardOverlap (normalized boxes) of every pair: ``a`` (..., K, 4), ``b``
    (..., K, 4) -> (..., K, K)."""
    a = a[..., :, None, :]
    b = b[..., None, :, :]
    iw = ops.minimum(a[..., 2], b[..., 2]) - ops.maximum(a[..., 0], b[..., 0])
    ih = ops.minimum(a[..., 3], b[..., 3]) - ops.maximum(a[..., 1], b[..., 1])
    inter = ops.where((iw > 0) & (ih > 0), iw * ih, 0.0)

    def size(x):
        w, h = x[..., 2] - x[..., 0], x[..., 3] - x[..., 1]
        return ops.where((w < 0) | (h < 0), 0.0, w * h)

    union = size(a) + size(b) - inter
    return ops.where(inter > 0, inter / ops.where(union > 0, union, 1.0), 0.0)


def _greedy_nms(valid, iou, threshold: float):
    """SSD's ApplyNMSFast on candidates sorted by score: candidate i is kept if it is valid
    and overlaps no kept candidate by more than ``threshold``. valid (..., K), iou (..., K, K)."""
    k = valid.shape[-1]
    over = iou > threshold
    idx = ops.arange(k)

    def body(i, keep):
        row = ops.take(over, i, axis=-2)                       # (..., K)
        ok = ops.logical_and(ops.take(valid, i, axis=-1),
                             ops.logical_not(ops.any(ops.logical_and(keep, row), axis=-1)))
        return ops.where(idx == i, ok[..., None], keep)

    return ops.fori_loop(0, k, body, ops.zeros_like(valid))


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeDetectionOutput(keras.layers.Layer):
    """SSD's DetectionOutput on ``[loc, conf, priors]`` (Caffe blobs ``(N, P*L*4)``,
    ``(N, P*C)`` with softmaxed scores, ``(1, 2, P*4)``).

    Output: Caffe's ``(1, 1, R, 7)`` blob (Keras ``(1, R, 7, 1)``) with ``R`` the most
    detections possible: ``N * min(keep_top_k, C' * K)`` (``C'`` the non-background classes,
    ``K`` the NMS ``top_k`` or P); rows after the detections are -1 (see :func:`detections`).
    Memory: the NMS compares ``K x K`` candidates per class and image, so give
    ``nms_param.top_k`` (SSD's nets do: 400) where the priors are many.
    ``group_by_classes`` (default, SSD's order): each image's rows by label, then score;
    ``False``: by score alone (OpenCV's order).
    """

    def __init__(self, num_classes: int = 2, share_location: bool = True,
                 background_label_id: int = 0, nms_threshold: float = 0.3, top_k: int = -1,
                 code_type: str = "CORNER", variance_encoded_in_target: bool = False,
                 keep_top_k: int = -1, confidence_threshold=None, group_by_classes: bool = True,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if code_type not in _CODE_TYPES:
            raise ValueError(f"code_type must be one of {_CODE_TYPES}, got {code_type!r}")
        if int(num_classes) < 1:
            raise ValueError("num_classes must be at least 1")
        self.num_classes = int(num_classes)
        self.share_location = bool(share_location)
        self.background_label_id = int(background_label_id)
        self.nms_threshold = float(nms_threshold)
        self.top_k = int(top_k)
        self.code_type = code_type
        self.variance_encoded_in_target = bool(variance_encoded_in_target)
        self.keep_top_k = int(keep_top_k)
        self.group_by_classes = bool(group_by_classes)
        self.confidence_threshold = (None if confidence_threshold is None
                                     else float(confidence_threshold))

    def _sizes(self, prior_shape):
        p = int(prior_shape[1]) // 4
        k = p if self.top_k < 0 else min(self.top_k, p)
        classes = [c for c in range(self.num_classes) if c != self.background_label_id]
        m = len(classes) * k
        if self.keep_top_k > -1:
            m = min(m, self.keep_top_k)
        return p, k, classes, max(m, 1)

    def compute_output_shape(self, input_shape):
        loc_shape, _, prior_shape = input_shape
        _, _, _, m = self._sizes(prior_shape)
        n = loc_shape[0]
        return (1, None if n is None else n * m, 7, 1)

    @staticmethod
    def _flat(x):
        x = to_caffe_layout(x) if len(x.shape) > 2 else x
        return ops.reshape(x, (ops.shape(x)[0], -1))

    def call(self, inputs):
        loc, conf, prior = inputs
        p, k, classes, m = self._sizes(prior.shape)
        nc, lc = self.num_classes, (1 if self.share_location else self.num_classes)
        pri = ops.reshape(to_caffe_layout(prior), (2, p, 4))
        loc = ops.reshape(self._flat(loc), (-1, p, lc, 4))
        conf = ops.reshape(self._flat(conf), (-1, p, nc))
        boxes = decode_boxes(loc, pri[0][:, None, :], pri[1][:, None, :], self.code_type,
                             self.variance_encoded_in_target)              # (N, P, Lc, 4)
        cls = ops.convert_to_tensor(np.asarray(classes, "int32"))
        scores = ops.transpose(ops.take(conf, cls, axis=2), (0, 2, 1))     # (N, C', P)
        if self.share_location:
            cboxes = ops.broadcast_to(boxes[:, None, :, 0, :],
                                      (ops.shape(boxes)[0], len(classes), p, 4))
        else:
            cboxes = ops.transpose(ops.take(boxes, cls, axis=2), (0, 2, 1, 3))
        neg = ops.cast(-np.inf, scores.dtype)
        if self.confidence_threshold is not None:
            scores = ops.where(scores > self.confidence_threshold, scores, neg)
        top, idx = ops.top_k(scores, k, sorted=True)                       # (N, C', K)
        tboxes = ops.take_along_axis(cboxes, ops.repeat(idx[..., None], 4, axis=-1), axis=2)
        keep = _greedy_nms(top > neg, _iou(tboxes, tboxes), self.nms_threshold)
        flat = ops.reshape(ops.where(keep, top, neg), (-1, len(classes) * k))
        best, pick = ops.top_k(flat, m, sorted=True)                       # (N, M)
        ok = best > neg
        label = ops.take(cls, pick // k)
        if self.group_by_classes:
            rank = ops.arange(m)[None, :]
            order = ops.argsort(ops.where(ok, label * m + rank, (nc + 1) * m + rank), axis=-1)
            best, pick, ok, label = (ops.take_along_axis(t, order, axis=1)
                                     for t in (best, pick, ok, label))
        bx = ops.take_along_axis(ops.reshape(tboxes, (-1, len(classes) * k, 4)),
                                 ops.repeat(pick[..., None], 4, axis=-1), axis=1)
        n = ops.shape(best)[0]
        image = ops.broadcast_to(ops.arange(n)[:, None], ops.shape(best))
        rows = ops.concatenate([ops.cast(image, best.dtype)[..., None],
                                ops.cast(label, best.dtype)[..., None], best[..., None], bx],
                               axis=-1)
        rows = ops.where(ok[..., None], rows, ops.cast(-1.0, rows.dtype))
        rows = ops.reshape(rows, (-1, 7))
        ok = ops.reshape(ok, (-1,))
        pos = ops.arange(ops.shape(ok)[0])
        rows = ops.take(rows, ops.argsort(ops.where(ok, pos, pos + ops.shape(ok)[0])), axis=0)
        return rows[None, :, :, None]

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes,
                "share_location": self.share_location,
                "background_label_id": self.background_label_id,
                "nms_threshold": self.nms_threshold, "top_k": self.top_k,
                "code_type": self.code_type,
                "variance_encoded_in_target": self.variance_encoded_in_target,
                "keep_top_k": self.keep_top_k,
                "confidence_threshold": self.confidence_threshold,
                "group_by_classes": self.group_by_classes}
