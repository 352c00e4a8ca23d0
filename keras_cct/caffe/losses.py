"""Caffe's loss and metric layers with Caffe's exact semantics, in ``keras.ops``.

* :func:`softmax_with_loss` -- ``SoftmaxWithLoss``: softmax over the channel axis, then
  ``-log(max(p[label], FLT_MIN))`` summed over every position whose label is not
  ``ignore_label``, divided by the normalizer of ``loss_param.normalization`` (``VALID``, the
  default: the number of counted positions; ``FULL``: all positions; ``BATCH_SIZE``: the outer
  count; ``NONE``: 1); the legacy ``normalize: false`` means ``BATCH_SIZE``.
* :func:`euclidean_loss` -- ``EuclideanLoss``: ``sum((a - b)^2) / (2 * num)``.
* :func:`accuracy` -- ``Accuracy``: a position is correct when fewer than ``top_k`` classes
  score strictly higher than the label's class (ties count as correct, as in Caffe).
* :func:`head_value` -- evaluate one loss/metric layer given its ``LayerParameter``.

Blobs are channels-last: Caffe's axis 1 (channels) of a 4-D blob is the last Keras axis;
:func:`keras_axis` converts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from keras import ops

from keras_cct.errors import CaffeFormatError

FLT_MIN = float(np.finfo(np.float32).tiny)
NORMALIZATIONS = ("FULL", "VALID", "BATCH_SIZE", "NONE")
HEAD_TYPES = ("SoftmaxWithLoss", "EuclideanLoss", "Accuracy")
LOSS_TYPES = ("SoftmaxWithLoss", "EuclideanLoss")

__all__ = ["softmax_with_loss", "euclidean_loss", "accuracy", "head_value", "keras_axis",
           "normalization_of", "HEAD_TYPES", "LOSS_TYPES"]


def keras_axis(caffe_axis: int, ndim: int) -> int:
    """The channels-last axis of Caffe's ``caffe_axis`` in an ``ndim``-D blob (for 3-D and
    higher blobs Caffe's channel axis 1 is last and the spatial axes shift left by one)."""
    a = caffe_axis + ndim if caffe_axis < 0 else caffe_axis
    if not 0 <= a < ndim:
        raise CaffeFormatError(f"axis {caffe_axis} is out of range for a {ndim}-D blob")
    if ndim <= 2 or a == 0:
        return a
    return ndim - 1 if a == 1 else a - 1


def normalization_of(loss_param) -> str:
    """The normalization mode of a ``LossParameter`` (Caffe's legacy ``normalize`` honoured)."""
    if loss_param is None:
        return "VALID"
    if not loss_param.HasField("normalization") and loss_param.HasField("normalize"):
        return "VALID" if loss_param.normalize else "BATCH_SIZE"
    return NORMALIZATIONS[int(loss_param.normalization)]


def softmax_with_loss(scores, label, *, axis: int = -1, ignore_label: Optional[int] = None,
                      normalization: str = "VALID", outer_num: Optional[int] = None):
    """Caffe's ``SoftmaxWithLoss`` forward (a scalar).

    Args:
        scores: logits, channels-last; ``axis`` is the class axis (Keras numbering).
        label: integer class per position (the shape of ``scores`` without ``axis``, or with
            a size-1 ``axis``).
        ignore_label: positions with this label count neither in the sum nor in VALID's count.
        normalization: one of ``FULL``, ``VALID``, ``BATCH_SIZE``, ``NONE``.
        outer_num: Caffe's ``outer_num`` (the product of the dimensions before the class axis
            in Caffe's NCHW layout), BATCH_SIZE's divisor; by default the batch size when the
            class axis is the last of a channels-last blob, else the product of the Keras
            dimensions before ``axis``.
    """
    if normalization not in NORMALIZATIONS:
        raise CaffeFormatError(f"unknown loss normalization {normalization!r}",
                               hint=f"use one of {', '.join(NORMALIZATIONS)}")
    scores = ops.convert_to_tensor(scores)
    ndim = len(scores.shape)
    axis = axis % ndim
    if axis != ndim - 1:
        scores = ops.moveaxis(scores, axis, -1)
    num_classes = scores.shape[-1]
    if outer_num is None:
        if axis == ndim - 1 and ndim > 2:
            outer_num = int(scores.shape[0])
        else:
            outer_num = 1
            for d in scores.shape[:axis]:
                outer_num *= int(d)
    lab = ops.cast(ops.reshape(label, ops.shape(scores)[:-1]), "int32")
    logp = ops.log_softmax(ops.cast(scores, "float32"), axis=-1)
    valid = ops.ones_like(lab, dtype="float32")
    safe = lab
    if ignore_label is not None:
        valid = ops.cast(ops.not_equal(lab, int(ignore_label)), "float32")
        safe = ops.where(ops.equal(lab, int(ignore_label)), ops.zeros_like(lab), lab)
    picked = ops.sum(logp * ops.one_hot(safe, num_classes, dtype="float32"), axis=-1)
    per = -ops.maximum(picked, float(np.log(FLT_MIN)))
    total = ops.sum(per * valid)
    count = 1
    for d in scores.shape[:-1]:
        count *= int(d)
    if normalization == "FULL":
        norm = float(count)
    elif normalization == "VALID":
        norm = ops.sum(valid) if ignore_label is not None else float(count)
    elif normalization == "BATCH_SIZE":
        norm = float(outer_num)
    else:
        norm = 1.0
    return total / ops.maximum(norm, 1.0)


def euclidean_loss(a, b):
    """Caffe's ``EuclideanLoss``: ``sum((a - b)^2) / (2 * num)``, ``num`` the batch size."""
    a = ops.convert_to_tensor(a)
    diff = ops.cast(a, "float32") - ops.cast(ops.reshape(b, ops.shape(a)), "float32")
    return ops.sum(ops.square(diff)) / (2.0 * int(a.shape[0]))


def accuracy(scores, label, *, top_k: int = 1, axis: int = -1,
             ignore_label: Optional[int] = None):
    """Caffe's ``Accuracy``: the fraction of (non-ignored) positions where fewer than ``top_k``
    classes score strictly higher than the label's class."""
    scores = ops.convert_to_tensor(scores)
    ndim = len(scores.shape)
    axis = axis % ndim
    if axis != ndim - 1:
        scores = ops.moveaxis(scores, axis, -1)
    num_classes = scores.shape[-1]
    if top_k > num_classes:
        raise CaffeFormatError(f"top_k ({top_k}) is larger than the number of classes "
                               f"({num_classes})")
    lab = ops.cast(ops.reshape(label, ops.shape(scores)[:-1]), "int32")
    safe = lab
    valid = ops.ones_like(lab, dtype="float32")
    if ignore_label is not None:
        valid = ops.cast(ops.not_equal(lab, int(ignore_label)), "float32")
        safe = ops.where(ops.equal(lab, int(ignore_label)), ops.zeros_like(lab), lab)
    s = ops.cast(scores, "float32")
    label_score = ops.sum(s * ops.one_hot(safe, num_classes, dtype="float32"), axis=-1,
                          keepdims=True)
    better = ops.sum(ops.cast(ops.greater(s, label_score), "float32"), axis=-1)
    correct = ops.cast(ops.less(better, float(top_k)), "float32") * valid
    return ops.sum(correct) / ops.maximum(ops.sum(valid), 1.0)


def head_value(layer_type: str, layer_param, bottoms: Sequence):
    """Evaluate one Caffe loss/metric layer.

    Args:
        layer_type: ``SoftmaxWithLoss``, ``EuclideanLoss`` or ``Accuracy``.
        layer_param: its ``LayerParameter`` (for loss_param / accuracy_param / softmax_param),
            or ``None`` for the defaults.
        bottoms: the bottom tensors, channels-last.
    """
    lp = layer_param
    name = lp.name if lp is not None else None
    if layer_type == "SoftmaxWithLoss":
        if len(bottoms) < 2:
            raise CaffeFormatError("SoftmaxWithLoss needs 2 bottoms (scores, label)", layer=name)
        loss_param = lp.loss_param if lp is not None else None
        ignore = (int(loss_param.ignore_label)
                  if loss_param is not None and loss_param.HasField("ignore_label") else None)
        caxis = int(lp.softmax_param.axis) if lp is not None else 1
        return softmax_with_loss(bottoms[0], bottoms[1],
                                 axis=keras_axis(caxis, len(bottoms[0].shape)),
                                 ignore_label=ignore, normalization=normalization_of(loss_param))
    if layer_type == "EuclideanLoss":
        if len(bottoms) != 2:
            raise CaffeFormatError("EuclideanLoss needs 2 bottoms", layer=name)
        return euclidean_loss(bottoms[0], bottoms[1])
    if layer_type == "Accuracy":
        if len(bottoms) < 2:
            raise CaffeFormatError("Accuracy needs 2 bottoms (scores, label)", layer=name)
        ap = lp.accuracy_param if lp is not None else None
        ignore = int(ap.ignore_label) if ap is not None and ap.HasField("ignore_label") else None
        caxis = int(ap.axis) if ap is not None else 1
        return accuracy(bottoms[0], bottoms[1], top_k=int(ap.top_k) if ap is not None else 1,
                        axis=keras_axis(caxis, len(bottoms[0].shape)), ignore_label=ignore)
    raise CaffeFormatError(f"layer type {layer_type!r} is not a supported loss or metric",
                           layer=name, hint=f"supported: {', '.join(HEAD_TYPES)}")
