"""Caffe's loss and metric layers with Caffe's exact semantics, in ``keras.ops``.

* :func:`softmax_with_loss` -- ``SoftmaxWithLoss``: softmax over the channel axis, then
  ``-log(max(p[label], FLT_MIN))`` summed over every position whose label is not
  ``ignore_label``, divided by the normalizer of ``loss_param.normalization`` (``VALID``, the
  default: the number of counted positions; ``FULL``: all positions; ``BATCH_SIZE``: the outer
  count; ``NONE``: 1); the legacy ``normalize: false`` means ``BATCH_SIZE``.
* :func:`euclidean_loss` -- ``EuclideanLoss``: ``sum((a - b)^2) / (2 * num)``.
* :func:`sigmoid_cross_entropy_loss` -- ``SigmoidCrossEntropyLoss``:
  ``-sum(t * x - max(x, 0) - log(1 + exp(-|x|)))`` over the non-ignored positions, divided by the
  normalizer of ``loss_param.normalization`` (``BATCH_SIZE`` by default for this layer).
* :func:`contrastive_loss`, :func:`hinge_loss`, :func:`infogain_loss`,
  :func:`multinomial_logistic_loss` -- ``ContrastiveLoss``, ``HingeLoss``, ``InfogainLoss``,
  ``MultinomialLogisticLoss``, each with Caffe's own backward where it differs from the exact
  derivative (:func:`with_gradient_of`).
* :func:`accuracy` -- ``Accuracy``: a position is correct when fewer than ``top_k`` classes
  score strictly higher than the label's class (ties count as correct, as in Caffe).
* :func:`head_value` -- evaluate one loss/metric layer given its ``LayerParameter``.
* :class:`Head` / :func:`heads_of` -- the loss and metric layers of a net (not part of its Keras
  model: the builder returns them, the trainer evaluates them); :data:`HEAD_TYPES` lists the
  layer types a head may have, :data:`LOSS_TYPES` those whose default ``loss_weight`` is 1.

Blobs are channels-last: Caffe's axis 1 (channels) of a 4-D blob is the last Keras axis;
:func:`keras_cct.caffe.net.layout.caffe_axis` converts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
from keras import ops

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.binary import blob_to_array, read_binaryproto
from keras_cct.caffe.net.layout import caffe_axis, to_caffe_layout
from keras_cct.errors import CaffeFormatError

FLT_MIN = float(np.finfo(np.float32).tiny)
#: Caffe's ``kLOG_THRESHOLD``: probabilities are clamped to it before their log
LOG_THRESHOLD = 1e-20
NORMALIZATIONS = ("FULL", "VALID", "BATCH_SIZE", "NONE")
#: the layer types evaluated as heads (outside the Keras model)
HEAD_TYPES = ("SoftmaxWithLoss", "EuclideanLoss", "Accuracy", "SigmoidCrossEntropyLoss",
              "ContrastiveLoss", "HingeLoss", "InfogainLoss", "MultinomialLogisticLoss")
#: the heads that are losses (default ``loss_weight`` 1; the others default to 0)
LOSS_TYPES = ("SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss", "ContrastiveLoss",
              "HingeLoss", "InfogainLoss", "MultinomialLogisticLoss")

__all__ = ["softmax_with_loss", "euclidean_loss", "sigmoid_cross_entropy_loss", "accuracy",
           "contrastive_loss", "hinge_loss", "infogain_loss", "multinomial_logistic_loss",
           "with_gradient_of", "LOG_THRESHOLD",
           "head_value", "normalization_of", "Head", "head_of", "heads_of", "HEAD_TYPES",
           "LOSS_TYPES"]


@dataclass
class Head:
    """A loss or metric layer kept for training (not part of the Keras model).

    Attributes:
        name: the Caffe layer name.
        type: one of :data:`HEAD_TYPES`.
        bottoms: the blob names it consumes (model outputs, or model inputs such as "label").
        tops: the blob names it produces (:attr:`top` is the first, or the layer name).
        loss_weight: Caffe's weight of its first top (1 for losses, 0 for Accuracy, unless the
            prototxt says otherwise).
        param: the layer's ``LayerParameter`` (``loss_param``, ``accuracy_param``, ...).
    """

    name: str
    type: str
    bottoms: List[str]
    tops: List[str]
    loss_weight: float
    param: object = None

    @property
    def top(self) -> str:
        """The blob its value is reported under (Caffe's first top)."""
        return self.tops[0] if self.tops else self.name


def head_of(lp) -> Head:
    """The :class:`Head` of a loss/metric ``LayerParameter`` (one of :data:`HEAD_TYPES`)."""
    default = 1.0 if lp.type in LOSS_TYPES else 0.0
    weight = float(lp.loss_weight[0]) if len(lp.loss_weight) else default
    return Head(lp.name, lp.type, list(lp.bottom), list(lp.top), weight, lp)


def heads_of(net_param) -> List[Head]:
    """The loss/metric layers of a phase-filtered ``NetParameter``, in net order."""
    return [head_of(lp) for lp in net_param.layer if lp.type in HEAD_TYPES]


def normalization_of(loss_param, default: str = "VALID") -> str:
    """The normalization mode of a ``LossParameter`` (Caffe's legacy ``normalize`` honoured).

    ``default`` is the mode when neither field is set: ``VALID`` (caffe.proto's default, which
    SoftmaxWithLoss reads) or ``BATCH_SIZE`` (SigmoidCrossEntropyLoss, whose ``LayerSetUp``
    falls back to it when ``normalization`` is not set).
    """
    if loss_param is None:
        return default
    if not loss_param.HasField("normalization"):
        if loss_param.HasField("normalize"):
            return "VALID" if loss_param.normalize else "BATCH_SIZE"
        return default
    return NORMALIZATIONS[int(loss_param.normalization)]


def _normalizer(normalization: str, count: int, valid, outer_num: int):
    """Caffe's ``LossLayer::GetNormalizer``, at least 1: ``count`` positions (``FULL``; also
    ``VALID`` when nothing is ignored), the sum of the ``valid`` mask (``VALID`` with an
    ignore label), ``outer_num`` (``BATCH_SIZE``), 1 (``NONE``)."""
    if normalization == "FULL":
        norm = float(count)
    elif normalization == "VALID":
        norm = ops.sum(valid) if valid is not None else float(count)
    elif normalization == "BATCH_SIZE":
        norm = float(outer_num)
    else:
        norm = 1.0
    return ops.maximum(norm, 1.0)


def _classes_last(scores, axis: int):
    """``(scores with the class axis last, that axis (non-negative), the rank)``."""
    scores = ops.convert_to_tensor(scores)
    ndim = len(scores.shape)
    axis = axis % ndim
    if axis != ndim - 1:
        scores = ops.moveaxis(scores, axis, -1)
    return scores, axis, ndim


def _outer_num(scores, axis: int, ndim: int) -> int:
    """Caffe's ``outer_num`` (BATCH_SIZE's divisor) of a class-last ``scores``: the batch size
    when the class axis was the last of a channels-last blob, else the product of the Keras
    dimensions before ``axis``."""
    dims = scores.shape[:1] if axis == ndim - 1 and ndim > 2 else scores.shape[:axis]
    n = 1
    for d in dims:
        n *= int(d)
    return n


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
    scores, axis, ndim = _classes_last(scores, axis)
    num_classes = scores.shape[-1]
    if outer_num is None:
        outer_num = _outer_num(scores, axis, ndim)
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
    return total / _normalizer(normalization, count, valid if ignore_label is not None else None,
                               outer_num)


def euclidean_loss(a, b):
    """Caffe's ``EuclideanLoss``: ``sum((a - b)^2) / (2 * num)``, ``num`` the batch size."""
    a = ops.convert_to_tensor(a)
    diff = ops.cast(a, "float32") - ops.cast(ops.reshape(b, ops.shape(a)), "float32")
    return ops.sum(ops.square(diff)) / (2.0 * int(a.shape[0]))


def sigmoid_cross_entropy_loss(scores, target, *, ignore_label: Optional[int] = None,
                               normalization: str = "BATCH_SIZE"):
    """Caffe's ``SigmoidCrossEntropyLoss`` forward (a scalar).

    Caffe (``sigmoid_cross_entropy_loss_layer.cpp``) sums, over the positions whose target is not
    ``ignore_label``, ``-(x * (t - [x >= 0]) - log(1 + exp(x - 2 * x * [x >= 0])))``, i.e.
    ``max(x, 0) - x * t + log(1 + exp(-|x|))``, which is ``softplus(x) - x * t``: computed so,
    its gradient is exactly Caffe's backward ``sigmoid(x) - t`` (zero at ignored positions),
    scaled by the same normalizer. The normalizer (at least 1) is that of ``normalization``:
    ``BATCH_SIZE`` (the layer's default) the first dimension, ``VALID`` the non-ignored count,
    ``FULL`` every position, ``NONE`` 1.

    Args:
        scores: the logits ``x`` (any shape; both blobs have the same layout).
        target: the targets ``t`` (probabilities), the same number of values as ``scores``.
    """
    if normalization not in NORMALIZATIONS:
        raise CaffeFormatError(f"unknown loss normalization {normalization!r}",
                               hint=f"use one of {', '.join(NORMALIZATIONS)}")
    x = ops.cast(ops.convert_to_tensor(scores), "float32")
    t = ops.cast(ops.reshape(target, ops.shape(x)), "float32")
    per = ops.softplus(x) - x * t
    count = 1
    for d in x.shape:
        count *= int(d)
    valid = None
    if ignore_label is not None:
        valid = ops.cast(ops.not_equal(ops.cast(t, "int32"), int(ignore_label)), "float32")
        per = ops.where(valid > 0, per, ops.zeros_like(per))  # no gradient through ignored
    outer_num = int(x.shape[0]) if len(x.shape) else 1
    return ops.sum(per) / _normalizer(normalization, count, valid, outer_num)


def with_gradient_of(value, surrogate):
    """``value`` in the forward pass with the gradient of ``surrogate`` (which must have the
    same value): how a Caffe layer whose hand-written backward is not the exact derivative of
    its forward (a clamp it ignores, an epsilon it adds) keeps Caffe's backward."""
    return surrogate + ops.stop_gradient(value - surrogate)


def _per_item(x):
    """A blob as ``(num, count / num)`` in Caffe's C-major order (``x`` channels-last)."""
    x = ops.cast(ops.convert_to_tensor(x), "float32")
    dim = 1
    for d in x.shape[1:]:
        dim *= int(d)
    return ops.reshape(to_caffe_layout(x), (-1, dim))


def _item_labels(label):
    return ops.cast(ops.reshape(label, (-1,)), "int32")


def contrastive_loss(a, b, similar, *, margin: float = 1.0, legacy_version: bool = False):
    """Caffe's ``ContrastiveLoss``: ``sum_i (y_i d_i^2 + (1 - y_i) max(margin - d_i, 0)^2)
    / (2 N)`` with ``d_i = ||a_i - b_i||`` and ``y_i`` = ``int(similar_i) != 0``; with
    ``legacy_version`` the dissimilar term is ``max(margin - d_i^2, 0)``. The backward is
    Caffe's: for a dissimilar pair ``-(margin - d) / (d + 1e-4) (a - b) / N`` (Caffe adds
    ``1e-4`` to ``d``), which is also finite at ``d = 0``."""
    diff = _per_item(a) - _per_item(b)
    y = ops.cast(ops.not_equal(_item_labels(ops.cast(similar, "float32")), 0), "float32")
    dist_sq = ops.sum(ops.square(diff), axis=1)
    n = int(diff.shape[0]) if diff.shape[0] is not None else ops.shape(diff)[0]
    if legacy_version:
        dissimilar = ops.maximum(margin - dist_sq, 0.0)
    else:
        dist = ops.sqrt(ops.stop_gradient(dist_sq))
        mdist = ops.maximum(margin - dist, 0.0)
        # value mdist^2; gradient -2 mdist / (d + 1e-4) * diff, through 0.5 * ||diff||^2
        coeff = ops.stop_gradient(-2.0 * mdist / (dist + 1e-4))
        half_sq = 0.5 * dist_sq
        dissimilar = ops.square(mdist) + coeff * (half_sq - ops.stop_gradient(half_sq))
    per = y * dist_sq + (1.0 - y) * dissimilar
    return ops.sum(per) / (2.0 * ops.cast(n, "float32"))


def hinge_loss(scores, label, *, norm: str = "L1"):
    """Caffe's ``HingeLoss``: with ``t_ij = 1`` for the label and ``-1`` otherwise, ``L1``
    ``sum max(0, 1 - t x) / N``, ``L2`` ``sum max(0, 1 - t x)^2 / N`` (each item's values
    flattened in Caffe's order; the label indexes them)."""
    if norm not in ("L1", "L2"):
        raise CaffeFormatError(f"unknown hinge loss norm {norm!r}", hint="use L1 or L2")
    x = _per_item(scores)
    dim = int(x.shape[1])
    sign = 1.0 - 2.0 * ops.one_hot(_item_labels(label), dim, dtype="float32")
    margin = ops.maximum(1.0 + sign * x, 0.0)
    total = ops.sum(margin) if norm == "L1" else ops.sum(ops.square(margin))
    return total / ops.cast(ops.shape(x)[0], "float32")


def multinomial_logistic_loss(prob, label):
    """Caffe's ``MultinomialLogisticLoss``: ``-sum log(max(p[label], 1e-20)) / N`` on
    probabilities (each item flattened in Caffe's order); the backward is Caffe's
    ``-1 / (N max(p, 1e-20))`` at the label, also below the threshold."""
    p = _per_item(prob)
    picked = ops.sum(p * ops.one_hot(_item_labels(label), int(p.shape[1]), dtype="float32"),
                     axis=1)
    clamped = with_gradient_of(ops.maximum(picked, LOG_THRESHOLD), picked)
    return -ops.sum(ops.log(clamped)) / ops.cast(ops.shape(p)[0], "float32")


def infogain_loss(scores, label, infogain, *, axis: int = -1,
                  ignore_label: Optional[int] = None, normalization: str = "VALID"):
    """Caffe's ``InfogainLoss`` (BVLC master: softmax inside): ``p = softmax(scores)`` over
    ``axis`` (Keras numbering), then ``-sum_l H[label, l] log(max(p_l, 1e-20))`` summed over
    the non-ignored positions and divided by the normalizer of ``normalization``. The backward
    is Caffe's ``p * sum_l H[label, l] - H[label, :]`` (the clamp ignored).

    Args:
        infogain: the ``(K, K)`` matrix ``H`` (any shape with ``K * K`` values); no gradient.
    """
    if normalization not in NORMALIZATIONS:
        raise CaffeFormatError(f"unknown loss normalization {normalization!r}",
                               hint=f"use one of {', '.join(NORMALIZATIONS)}")
    scores, axis, ndim = _classes_last(scores, axis)
    k = int(scores.shape[-1])
    h = ops.reshape(ops.stop_gradient(ops.cast(infogain, "float32")), (k, k))
    lab = ops.cast(ops.reshape(label, ops.shape(scores)[:-1]), "int32")
    valid = None
    safe = lab
    if ignore_label is not None:
        valid = ops.cast(ops.not_equal(lab, int(ignore_label)), "float32")
        safe = ops.where(ops.equal(lab, int(ignore_label)), ops.zeros_like(lab), lab)
    logp = ops.log_softmax(ops.cast(scores, "float32"), axis=-1)
    logp = with_gradient_of(ops.maximum(logp, float(np.log(LOG_THRESHOLD))), logp)
    rows = ops.take(h, safe, axis=0)  # H[label, :] per position
    per = -ops.sum(rows * logp, axis=-1)
    if valid is not None:
        per = per * valid
    count = 1
    for d in scores.shape[:-1]:
        count *= int(d)
    return ops.sum(per) / _normalizer(normalization, count, valid,
                                      _outer_num(scores, axis, ndim))


def accuracy(scores, label, *, top_k: int = 1, axis: int = -1,
             ignore_label: Optional[int] = None):
    """Caffe's ``Accuracy``: the fraction of (non-ignored) positions where fewer than ``top_k``
    classes score strictly higher than the label's class."""
    scores, axis, ndim = _classes_last(scores, axis)
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


def _need_bottoms(what: str, bottoms, counts, name) -> None:
    if len(bottoms) not in counts:
        raise CaffeFormatError(f"{what} needs {' or '.join(map(str, counts))} bottoms, has "
                               f"{len(bottoms)}", layer=name)


def _contrastive_head(lp, bottoms, name):
    _need_bottoms("ContrastiveLoss (a, b, similar)", bottoms, (3,), name)
    p = lp.contrastive_loss_param if lp is not None else None
    return contrastive_loss(*bottoms, margin=float(p.margin) if p is not None else 1.0,
                            legacy_version=bool(p.legacy_version) if p is not None else False)


def _hinge_head(lp, bottoms, name):
    _need_bottoms("HingeLoss (scores, label)", bottoms, (2,), name)
    norm = "L1"
    if lp is not None:
        norm = proto.HingeLossParameter.Norm.Name(lp.hinge_loss_param.norm)
    return hinge_loss(bottoms[0], bottoms[1], norm=norm)


def _multinomial_head(lp, bottoms, name):
    _need_bottoms("MultinomialLogisticLoss (probabilities, label)", bottoms, (2,), name)
    return multinomial_logistic_loss(bottoms[0], bottoms[1])


@functools.lru_cache(maxsize=16)
def _infogain_matrix(path: str) -> np.ndarray:
    return blob_to_array(read_binaryproto(path))


def _infogain_head(lp, bottoms, name):
    _need_bottoms("InfogainLoss (scores, label[, H])", bottoms, (2, 3), name)
    p = lp.infogain_loss_param if lp is not None else None
    loss_param = lp.loss_param if lp is not None else None
    if loss_param is not None and loss_param.HasField("normalize"):
        raise CaffeFormatError("InfogainLoss: loss_param normalize is deprecated (Caffe "
                               "refuses it)", layer=name, hint="use loss_param { normalization: "
                               "VALID } (or FULL, BATCH_SIZE, NONE)")
    if len(bottoms) == 3:
        h = bottoms[2]
    elif p is None or not p.source:
        raise CaffeFormatError("InfogainLoss needs its matrix H: a third bottom or "
                               "infogain_loss_param { source: \"H.binaryproto\" }", layer=name)
    else:
        h = _infogain_matrix(str(p.source))
    k_axis = caffe_axis(int(p.axis) if p is not None else 1, len(bottoms[0].shape))
    k = int(bottoms[0].shape[k_axis])
    n_h = int(np.prod(tuple(h.shape)))
    if n_h != k * k:
        raise CaffeFormatError(f"InfogainLoss: H has {n_h} values, it must be {k}x{k} (the "
                               f"number of classes squared)", layer=name)
    ignore = (int(loss_param.ignore_label)
              if loss_param is not None and loss_param.HasField("ignore_label") else None)
    return infogain_loss(bottoms[0], bottoms[1], h, axis=k_axis, ignore_label=ignore,
                         normalization=normalization_of(loss_param))


_BVLC_LOSSES = {"ContrastiveLoss": _contrastive_head, "HingeLoss": _hinge_head,
                "MultinomialLogisticLoss": _multinomial_head, "InfogainLoss": _infogain_head}


def head_value(layer_type: str, layer_param, bottoms: Sequence):
    """Evaluate one Caffe loss/metric layer.

    Args:
        layer_type: one of :data:`HEAD_TYPES`.
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
                                 axis=caffe_axis(caxis, len(bottoms[0].shape)),
                                 ignore_label=ignore, normalization=normalization_of(loss_param))
    if layer_type == "EuclideanLoss":
        if len(bottoms) != 2:
            raise CaffeFormatError("EuclideanLoss needs 2 bottoms", layer=name)
        return euclidean_loss(bottoms[0], bottoms[1])
    if layer_type == "SigmoidCrossEntropyLoss":
        if len(bottoms) != 2:
            raise CaffeFormatError("SigmoidCrossEntropyLoss needs 2 bottoms (scores, targets)",
                                   layer=name)
        n0, n1 = (None if None in tuple(b.shape) else int(np.prod(tuple(b.shape)))
                  for b in bottoms)
        if n0 is not None and n1 is not None and n0 != n1:
            raise CaffeFormatError(f"SigmoidCrossEntropyLoss's bottoms hold {n0} and {n1} "
                                   f"values: they must have the same count", layer=name)
        loss_param = lp.loss_param if lp is not None else None
        ignore = (int(loss_param.ignore_label)
                  if loss_param is not None and loss_param.HasField("ignore_label") else None)
        return sigmoid_cross_entropy_loss(
            bottoms[0], bottoms[1], ignore_label=ignore,
            normalization=normalization_of(loss_param, default="BATCH_SIZE"))
    if layer_type in _BVLC_LOSSES:
        return _BVLC_LOSSES[layer_type](lp, list(bottoms), name)
    if layer_type == "Accuracy":
        if len(bottoms) < 2:
            raise CaffeFormatError("Accuracy needs 2 bottoms (scores, label)", layer=name)
        ap = lp.accuracy_param if lp is not None else None
        ignore = int(ap.ignore_label) if ap is not None and ap.HasField("ignore_label") else None
        caxis = int(ap.axis) if ap is not None else 1
        return accuracy(bottoms[0], bottoms[1], top_k=int(ap.top_k) if ap is not None else 1,
                        axis=caffe_axis(caxis, len(bottoms[0].shape)), ignore_label=ignore)
    raise CaffeFormatError(f"layer type {layer_type!r} is not a supported loss or metric",
                           layer=name, hint=f"supported: {', '.join(HEAD_TYPES)}")
