"""SoftmaxWithLoss, EuclideanLoss, SigmoidCrossEntropyLoss and Accuracy against numpy
transcriptions of Caffe's layers."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from keras import ops

from keras_cct.caffe import proto
from keras_cct.caffe.net.layout import caffe_axis
from keras_cct.caffe.net.losses import (accuracy, euclidean_loss, head_value,
                                        sigmoid_cross_entropy_loss, softmax_with_loss)
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
                            axis=caffe_axis(1, 4), ignore_label=ignore, normalization=mode)
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
    with pytest.raises(CaffeFormatError, match="layer 'h'.*NoSuchLoss.*not a supported"):
        head_value("NoSuchLoss", proto.LayerParameter(name="h"), [])
    with pytest.raises(CaffeFormatError, match="top_k"):
        accuracy(np.zeros((2, 3), np.float32), np.zeros(2), top_k=5)


# -- SigmoidCrossEntropyLoss ----------------------------------------------------------------


def np_sigmoid_cross_entropy(x, t, ignore=None, mode="BATCH_SIZE"):
    """sigmoid_cross_entropy_loss_layer.cpp (BVLC Caffe master), in float64: Forward_cpu's
    ``loss -= x * (t - (x >= 0)) - log(1 + exp(x - 2 * x * (x >= 0)))`` over the positions
    whose ``static_cast<int>(t)`` is not ``ignore_label``, divided by ``get_normalizer`` (at
    least 1; LayerSetUp's default mode, with neither ``normalization`` nor ``normalize`` set,
    is BATCH_SIZE: the first dimension); Backward_cpu's ``sigmoid(x) - t`` (0 where ignored)
    scaled by the same normalizer. Returns ``(loss, d loss / d x)``."""
    n = x.shape[0]
    xf, tf_ = x.astype(np.float64).ravel(), t.astype(np.float64).ravel()
    loss, valid = 0.0, 0
    diff = np.zeros_like(xf)
    for i in range(xf.size):
        if ignore is not None and int(tf_[i]) == ignore:
            continue
        pos = 1.0 if xf[i] >= 0 else 0.0
        loss -= xf[i] * (tf_[i] - pos) - np.log(1.0 + np.exp(xf[i] - 2.0 * xf[i] * pos))
        diff[i] = 1.0 / (1.0 + np.exp(-xf[i])) - tf_[i]
        valid += 1
    norm = max(1.0, {"FULL": xf.size, "VALID": valid, "BATCH_SIZE": n, "NONE": 1}[mode])
    return loss / norm, (diff / norm).reshape(x.shape)


def _sigmoid_loss_and_grad(x, t, **kwargs):
    """keras_cct's loss and its gradient with respect to the logits, on the Keras backend."""
    import keras

    from tests.backend_grads import layer_grads

    class _Loss(keras.layers.Layer):
        def call(self, logits):
            return sigmoid_cross_entropy_loss(logits, t, **kwargs)

    layer = _Loss()
    layer.build(x.shape)  # (no variables: JAX's stateless_call wants it built)
    y, grads = layer_grads(layer, x, np.ones((), np.float32))
    return float(y), grads[0]


@pytest.mark.parametrize("mode", [None, "FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore", [None, 2])
def test_sigmoid_cross_entropy_loss_and_gradient(mode, ignore):
    """Loss and gradient (the backend's autodiff) equal Caffe's forward and backward; large
    logits of both signs (the stable form) and, with ignore_label, ignored positions."""
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(4, 3, 2, 2)) * 6).astype(np.float32)
    x[0, 0, 0, 0], x[1, 2, 1, 1] = 40.0, -40.0
    t = rng.random(size=x.shape).astype(np.float32)
    if ignore is not None:
        t[rng.random(size=x.shape) < 0.3] = ignore
    kwargs = {"ignore_label": ignore} if ignore is not None else {}
    if mode is not None:
        kwargs["normalization"] = mode
    loss, dx = _sigmoid_loss_and_grad(x.transpose(0, 2, 3, 1), t.transpose(0, 2, 3, 1), **kwargs)
    want, want_dx = np_sigmoid_cross_entropy(x, t, ignore, mode or "BATCH_SIZE")
    assert loss == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(dx.transpose(0, 3, 1, 2), want_dx, rtol=1e-4, atol=1e-6)


def test_sigmoid_cross_entropy_head_normalization():
    """head_value reads loss_param as Caffe's LayerSetUp does: no field -> BATCH_SIZE, the
    legacy ``normalize: true`` -> VALID, ``normalization`` itself; and checks the bottoms."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, 7)).astype(np.float32)
    t = rng.random(size=(5, 7)).astype(np.float32)
    t[0, :3] = -1
    for fields, ignore, mode in [("", None, "BATCH_SIZE"),
                                 ("loss_param { normalize: true }", None, "VALID"),
                                 ("loss_param { ignore_label: -1 normalize: true }", -1,
                                  "VALID"),
                                 ("loss_param { normalization: FULL }", None, "FULL")]:
        lp = text_format.Parse(f'name: "loss" type: "SigmoidCrossEntropyLoss" {fields}',
                               proto.LayerParameter())
        got = to_np(head_value("SigmoidCrossEntropyLoss", lp, [x, t]))
        assert got == pytest.approx(np_sigmoid_cross_entropy(x, t, ignore, mode)[0], rel=1e-5)
    lp = text_format.Parse('name: "loss" type: "SigmoidCrossEntropyLoss"', proto.LayerParameter())
    with pytest.raises(CaffeFormatError, match="same count"):
        head_value("SigmoidCrossEntropyLoss", lp, [x, t[:, :6]])
    with pytest.raises(CaffeFormatError, match="needs 2 bottoms"):
        head_value("SigmoidCrossEntropyLoss", lp, [x])
