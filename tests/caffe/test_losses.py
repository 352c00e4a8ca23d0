"""SoftmaxWithLoss, EuclideanLoss and Accuracy against numpy transcriptions of Caffe's layers."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from keras import ops

from keras_cct.caffe import proto
from keras_cct.caffe.losses import (accuracy, euclidean_loss, head_value, keras_axis,
                                    softmax_with_loss)
from keras_cct.errors import CaffeFormatError

FLT_MIN = np.finfo(np.float32).tiny


def np_softmax_loss(x_nchw, label, ignore=None, mode="VALID"):
    """softmax_loss_layer.cpp on an NCHW (or NC) blob, axis 1."""
    x = x_nchw.astype(np.float64)
    if x.ndim == 2:
        x = x[:, :, None]
        label = label[:, None]
    n, c = x.shape[:2]
    x = x.reshape(n, c, -1)
    label = label.reshape(n, -1)
    inner = x.shape[2]
    prob = np.exp(x - x.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    loss, count = 0.0, 0
    for i in range(n):
        for j in range(inner):
            lv = int(label[i, j])
            if ignore is not None and lv == ignore:
                continue
            loss -= np.log(max(prob[i, lv, j], FLT_MIN))
            count += 1
    norm = {"FULL": n * inner, "VALID": count if ignore is not None else n * inner,
            "BATCH_SIZE": n, "NONE": 1}[mode]
    return loss / max(1.0, norm)


def np_accuracy(x_nchw, label, top_k=1, ignore=None):
    """accuracy_layer.cpp."""
    x = x_nchw.astype(np.float64)
    if x.ndim == 2:
        x = x[:, :, None]
        label = label[:, None]
    n, c = x.shape[:2]
    x = x.reshape(n, c, -1)
    label = label.reshape(n, -1)
    acc, count = 0, 0
    for i in range(n):
        for j in range(x.shape[2]):
            lv = int(label[i, j])
            if ignore is not None and lv == ignore:
                continue
            count += 1
            better = sum(1 for k in range(c) if x[i, k, j] > x[i, lv, j])
            acc += better < top_k
    return acc / max(count, 1)


def to_np(t):
    return float(ops.convert_to_numpy(t))


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore", [None, 2])
def test_softmax_loss_4d(mode, ignore):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 2, 4)).astype(np.float32) * 3
    label = rng.integers(0, 5, size=(3, 1, 2, 4))
    got = softmax_with_loss(x.transpose(0, 2, 3, 1), label.transpose(0, 2, 3, 1),
                            axis=keras_axis(1, 4), ignore_label=ignore, normalization=mode)
    assert to_np(got) == pytest.approx(np_softmax_loss(x, label, ignore, mode), rel=1e-5)


def test_softmax_loss_2d_clamp_and_head():
    x = np.array([[0., 0., 200.], [1., 2., 3.]], np.float32)
    label = np.array([0, 2])
    want = np_softmax_loss(x, label)  # first row hits the FLT_MIN clamp
    assert want > 40
    assert to_np(softmax_with_loss(x, label)) == pytest.approx(want, rel=1e-5)
    lp = text_format.Parse('name: "loss" type: "SoftmaxWithLoss" loss_param { normalize: false '
                           'ignore_label: 0 }', proto.LayerParameter())
    got = head_value("SoftmaxWithLoss", lp, [ops.convert_to_tensor(x), label])
    assert to_np(got) == pytest.approx(np_softmax_loss(x, label, 0, "BATCH_SIZE"), rel=1e-5)


def test_euclidean_loss():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(4, 3, 2)), rng.normal(size=(4, 3, 2))
    assert to_np(euclidean_loss(a.astype(np.float32), b.astype(np.float32))) == \
        pytest.approx(np.sum((a - b) ** 2) / 8, rel=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_accuracy_topk_ties_ignore(top_k):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 3, size=(6, 4, 2, 2)).astype(np.float32)  # many ties
    label = rng.integers(0, 4, size=(6, 2, 2))
    for ignore in (None, 1):
        got = accuracy(x.transpose(0, 2, 3, 1), label, top_k=top_k, ignore_label=ignore)
        assert to_np(got) == pytest.approx(np_accuracy(x, label, top_k, ignore), abs=1e-6)
    lp = text_format.Parse(f'name: "acc" accuracy_param {{ top_k: {top_k} }}',
                           proto.LayerParameter())
    x2, l2 = x[:, :, 0, 0], label[:, 0, 0]
    assert to_np(head_value("Accuracy", lp, [ops.convert_to_tensor(x2), l2])) == \
        pytest.approx(np_accuracy(x2, l2, top_k), abs=1e-6)


def test_bad_heads():
    with pytest.raises(CaffeFormatError, match="layer 'h'.*HingeLoss.*not a supported"):
        head_value("HingeLoss", proto.LayerParameter(name="h"), [])
    with pytest.raises(CaffeFormatError, match="top_k"):
        accuracy(np.zeros((2, 3), np.float32), np.zeros(2), top_k=5)
