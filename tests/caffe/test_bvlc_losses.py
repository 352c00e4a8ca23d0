"""ContrastiveLoss, HingeLoss, InfogainLoss and MultinomialLogisticLoss against float64 numpy
transcriptions of Caffe's Forward_cpu and Backward_cpu, and trained through the solver for a few
SGD steps against numpy SGD."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from google.protobuf import text_format

from keras_cct.caffe import proto
from keras_cct.caffe.io.binary import blob_to_array, read_caffemodel, write_binaryproto
from keras_cct.caffe.net.losses import head_value
from keras_cct.caffe.train.solver import load_solver
from keras_cct.errors import CaffeFormatError
from tests.caffe.caffe_numpy import NumpyCaffeSolver

RNG = np.random.default_rng(3)
LOG_THRESHOLD = 1e-20


def _lp(text: str):
    return text_format.Parse(text, proto.LayerParameter())


def _value_and_grad(fn, x):
    """``(fn(x), d fn / d x)`` with the backend's autodiff (``x`` float32 numpy)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            v = fn(xt)
        return float(v), tape.gradient(v, xt).numpy()
    if backend == "jax":
        import jax
        v, g = jax.value_and_grad(lambda a: fn(a))(x)
        return float(v), np.asarray(g)
    import torch
    xt = torch.tensor(x, requires_grad=True)
    v = fn(xt)
    v.backward()
    return float(v.detach()), xt.grad.numpy()


# -- ContrastiveLoss --------------------------------------------------------------------------

def np_contrastive(a, b, y, margin, legacy):
    """contrastive_loss_layer.cpp Forward_cpu and Backward_cpu (top diff 1), float64."""
    n = a.shape[0]
    diff = (a - b).reshape(n, -1)
    loss, ga = 0.0, np.zeros_like(diff)
    for i in range(n):
        d2 = diff[i] @ diff[i]
        if int(y[i]):
            loss += d2
            ga[i] = diff[i] / n
        elif legacy:
            loss += max(margin - d2, 0.0)
            ga[i] = -diff[i] / n if margin - d2 > 0 else 0
        else:
            d = np.sqrt(d2)
            mdist = margin - d
            loss += max(mdist, 0.0) ** 2
            ga[i] = -(mdist / (d + 1e-4)) * diff[i] / n if mdist > 0 else 0
    return loss / n / 2, ga.reshape(a.shape), -ga.reshape(a.shape)


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_loss(legacy):
    a = RNG.normal(size=(6, 4)).astype(np.float32) * 0.6
    b = RNG.normal(size=(6, 4)).astype(np.float32) * 0.6
    b[2] = a[2]  # a dissimilar pair at distance 0 (Caffe's 1e-4 keeps it finite)
    y = np.array([1, 0, 0, 1, 0, 0], np.float32)
    lp = _lp(f'name: "c" type: "ContrastiveLoss" contrastive_loss_param {{ margin: 1.5 '
             f'legacy_version: {str(legacy).lower()} }}')
    want, ga, gb = np_contrastive(a.astype(np.float64), b.astype(np.float64), y, 1.5, legacy)
    got, dga = _value_and_grad(lambda t: head_value("ContrastiveLoss", lp, [t, b, y]), a)
    _, dgb = _value_and_grad(lambda t: head_value("ContrastiveLoss", lp, [a, t, y]), b)
    assert got == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(dga, ga, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dgb, gb, rtol=1e-4, atol=1e-6)
    with pytest.raises(CaffeFormatError, match="3 bottoms"):
        head_value("ContrastiveLoss", lp, [a, b])


# -- HingeLoss --------------------------------------------------------------------------------

def np_hinge(x, label, norm):
    """hinge_loss_layer.cpp: diff = x, diff[label] *= -1, max(0, 1 + diff); backward flips the
    label's sign again, L1 sign(diff) / N, L2 2 diff / N."""
    n = x.shape[0]
    d = x.reshape(n, -1).copy()
    for i in range(n):
        d[i, int(label[i])] *= -1
    d = np.maximum(0, 1 + d)
    loss = np.abs(d).sum() / n if norm == "L1" else (d * d).sum() / n
    g = np.sign(d) if norm == "L1" else 2 * d
    for i in range(n):
        g[i, int(label[i])] *= -1
    return loss, (g / n).reshape(x.shape)


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss(norm):
    x = RNG.normal(size=(5, 4)).astype(np.float32) * 1.5
    label = np.array([0, 3, 1, 1, 2], np.float32)
    lp = _lp(f'name: "h" type: "HingeLoss" hinge_loss_param {{ norm: {norm} }}')
    want, gwant = np_hinge(x.astype(np.float64), label, norm)
    got, g = _value_and_grad(lambda t: head_value("HingeLoss", lp, [t, label]), x)
    assert got == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(g, gwant, rtol=1e-5, atol=1e-6)


# -- MultinomialLogisticLoss ------------------------------------------------------------------

def test_multinomial_logistic_loss():
    p = RNG.random(size=(4, 5)).astype(np.float32)
    p /= p.sum(axis=1, keepdims=True)
    p[1, 2] = 0.0  # below kLOG_THRESHOLD: Caffe clamps, and its backward uses the clamp too
    label = np.array([4, 2, 0, 1], np.float32)
    n = 4
    probs = np.maximum(p[np.arange(n), label.astype(int)].astype(np.float64), LOG_THRESHOLD)
    want = -np.log(probs).sum() / n
    gwant = np.zeros((4, 5))
    gwant[np.arange(n), label.astype(int)] = -1.0 / n / probs
    lp = _lp('name: "m" type: "MultinomialLogisticLoss"')
    got, g = _value_and_grad(lambda t: head_value("MultinomialLogisticLoss", lp, [t, label]), p)
    assert got == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(g, gwant, rtol=1e-5)


# -- InfogainLoss -----------------------------------------------------------------------------

def np_infogain(x, label, h, ignore=None, mode="VALID"):
    """infogain_loss_layer.cpp (BVLC master: softmax inside), axis 1 of an (N, K) blob."""
    x = x.astype(np.float64)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    n, k = x.shape
    loss, count, g = 0.0, 0, np.zeros_like(x)
    for i in range(n):
        lv = int(label[i])
        if ignore is not None and lv == ignore:
            continue
        for l in range(k):
            loss -= h[lv, l] * np.log(max(p[i, l], LOG_THRESHOLD))
            g[i, l] = p[i, l] * h[lv].sum() - h[lv, l]
        count += 1
    norm = {"FULL": n, "VALID": count if ignore is not None else n, "BATCH_SIZE": n,
            "NONE": 1}[mode]
    norm = max(1.0, norm)
    return loss / norm, g / norm


@pytest.mark.parametrize("ignore,mode", [(None, "VALID"), (2, "VALID"), (2, "FULL"),
                                         (None, "NONE")])
def test_infogain_loss_third_bottom(ignore, mode):
    x = RNG.normal(size=(6, 4)).astype(np.float32) * 2
    x[0, 1] = -60.0  # a probability below kLOG_THRESHOLD
    label = np.array([0, 1, 2, 3, 2, 1], np.float32)
    h = RNG.random(size=(4, 4)).astype(np.float32)
    fields = "" if ignore is None else f"ignore_label: {ignore}"
    lp = _lp(f'name: "i" type: "InfogainLoss" loss_param {{ {fields} normalization: {mode} }}')
    want, gwant = np_infogain(x, label, h.astype(np.float64), ignore, mode)
    got, g = _value_and_grad(lambda t: head_value("InfogainLoss", lp, [t, label, h]), x)
    assert got == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(g, gwant, rtol=1e-4, atol=1e-6)


def test_infogain_loss_source_and_errors(tmp_path):
    h = RNG.random(size=(1, 1, 3, 3)).astype(np.float32)
    write_binaryproto(tmp_path / "H.binaryproto", h)
    x = RNG.normal(size=(4, 3)).astype(np.float32)
    label = np.array([0, 2, 1, 2], np.float32)
    lp = _lp(f'name: "i" type: "InfogainLoss" '
             f'infogain_loss_param {{ source: "{tmp_path / "H.binaryproto"}" }}')
    want, _ = np_infogain(x, label, h.reshape(3, 3).astype(np.float64))
    assert float(head_value("InfogainLoss", lp, [x, label])) == pytest.approx(want, rel=1e-5)
    with pytest.raises(CaffeFormatError, match="matrix H"):
        head_value("InfogainLoss", _lp('name: "i" type: "InfogainLoss"'), [x, label])
    with pytest.raises(CaffeFormatError, match="3x3"):
        head_value("InfogainLoss", _lp('name: "i" type: "InfogainLoss"'),
                   [x, label, np.ones((2, 2), np.float32)])
    with pytest.raises(CaffeFormatError, match="deprecated"):
        head_value("InfogainLoss", _lp('name: "i" type: "InfogainLoss" '
                                       'loss_param { normalize: true }'), [x, label, h])


# -- trained through the solver ---------------------------------------------------------------

NET = """
name: "tiny_{name}"
layer {{ name: "feed" type: "MemoryData" top: "data" top: "label"
        memory_data_param {{ batch_size: 4 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        param {{ lr_mult: 1 decay_mult: 1 }} param {{ lr_mult: 2 decay_mult: 0 }}
        inner_product_param {{ num_output: 3 weight_filler {{ type: "gaussian" std: 0.5 }} }} }}
{extra}
"""


def _solve(tmp_path, name, extra, x, label, steps=5, lr=0.2):
    (tmp_path / "net.prototxt").write_text(NET.format(name=name, extra=extra))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "net.prototxt" type: "SGD" momentum: 0.9 base_lr: {lr} lr_policy: "fixed" '
        f'max_iter: {steps} display: 1 snapshot_after_train: true '
        f'snapshot_prefix: "{tmp_path}/snap" random_seed: 5')
    lines = []
    s = load_solver(str(tmp_path / "solver.prototxt"), arrays={"data": x, "label": label},
                    log=lines.append)
    from keras_cct.caffe.net.weights import keras_layer_to_blobs
    w0, b0 = keras_layer_to_blobs(s.train_net.model.get_layer("ip"))
    s.solve()
    losses = [float(line.split("loss = ")[1]) for line in lines
              if line.startswith("Iteration") and "loss = " in line]
    model = read_caffemodel(tmp_path / f"snap_iter_{steps}.caffemodel")
    ip = [lp for lp in model.layer if lp.name == "ip"][0]
    return (w0, b0), losses, [blob_to_array(b) for b in ip.blobs]


def _numpy_sgd(w0, b0, x, label, loss_and_dlogits, steps=5, lr=0.2):
    ref = NumpyCaffeSolver([w0, b0], "SGD", momentum=0.9, lr_mults=[1.0, 2.0])
    losses = []
    for it in range(steps):
        rows = [(4 * it + k) % len(x) for k in range(4)]
        xb = x[rows].astype(np.float64)
        W, b = ref.w
        loss, dy = loss_and_dlogits(xb @ W.T + b, label[rows])
        losses.append(loss)
        ref.apply_update([dy.T @ xb, dy.sum(0)], lr)
    return losses, ref.w


def _softmax(z):
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("kind", ["HingeLoss", "InfogainLoss", "MultinomialLogisticLoss"])
def test_losses_train_like_numpy_sgd(tmp_path, kind):
    x = RNG.normal(size=(8, 4)).astype(np.float32)
    label = RNG.integers(0, 3, size=(8,)).astype(np.float32)
    h = (np.eye(3) * 2 + 0.25).astype(np.float32)
    if kind == "HingeLoss":
        extra = ('layer { name: "loss" type: "HingeLoss" bottom: "ip" bottom: "label" '
                 'top: "loss" hinge_loss_param { norm: L2 } }')
        fn = lambda z, lab: np_hinge(z, lab, "L2")  # noqa: E731
    elif kind == "InfogainLoss":
        write_binaryproto(tmp_path / "H.binaryproto", h.reshape(1, 1, 3, 3))
        extra = (f'layer {{ name: "loss" type: "InfogainLoss" bottom: "ip" bottom: "label" '
                 f'top: "loss" infogain_loss_param {{ source: "{tmp_path}/H.binaryproto" }} }}')
        fn = lambda z, lab: np_infogain(z, lab, h.astype(np.float64))  # noqa: E731
    else:
        extra = ('layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }\n'
                 'layer { name: "loss" type: "MultinomialLogisticLoss" bottom: "prob" '
                 'bottom: "label" top: "loss" }')

        def fn(z, lab):
            p = _softmax(z)
            n, idx = len(lab), lab.astype(int)
            pl = np.maximum(p[np.arange(n), idx], LOG_THRESHOLD)
            dp = np.zeros_like(p)
            dp[np.arange(n), idx] = -1.0 / n / pl
            dz = p * (dp - (dp * p).sum(axis=1, keepdims=True))  # softmax backward
            return -np.log(pl).sum() / n, dz
    (w0, b0), got_losses, got_w = _solve(tmp_path, kind, extra, x, label)
    want_losses, want_w = _numpy_sgd(w0, b0, x, label, fn)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4)
    np.testing.assert_allclose(got_w[0], want_w[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_w[1], want_w[1], rtol=1e-4, atol=1e-5)


def test_contrastive_loss_trains_like_numpy_sgd(tmp_path):
    """Two towers (ip, ip_b) from one input; the label says which pairs are similar."""
    x = RNG.normal(size=(8, 4)).astype(np.float32)
    sim = (RNG.random(size=(8,)) < 0.5).astype(np.float32)
    extra = ('layer { name: "ip_b" type: "InnerProduct" bottom: "data" top: "ip_b" '
             'param { lr_mult: 0 } param { lr_mult: 0 } '
             'inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }\n'
             'layer { name: "loss" type: "ContrastiveLoss" bottom: "ip" bottom: "ip_b" '
             'bottom: "label" top: "loss" contrastive_loss_param { margin: 2.0 } }')
    (w0, b0), got_losses, got_w = _solve(tmp_path, "ContrastiveLoss", extra, x, sim)
    snap = read_caffemodel(tmp_path / "snap_iter_5.caffemodel")
    wb, bb = [blob_to_array(b).astype(np.float64)
              for b in [lp for lp in snap.layer if lp.name == "ip_b"][0].blobs]  # lr_mult 0

    ref = NumpyCaffeSolver([w0, b0], "SGD", momentum=0.9, lr_mults=[1.0, 2.0])
    want_losses = []
    for it in range(5):
        rows = [(4 * it + k) % 8 for k in range(4)]
        xb = x[rows].astype(np.float64)
        a = xb @ ref.w[0].T + ref.w[1]
        loss, ga, _ = np_contrastive(a, xb @ wb.T + bb, sim[rows], 2.0, False)
        want_losses.append(loss)
        ref.apply_update([ga.T @ xb, ga.sum(0)], 0.2)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4)
    np.testing.assert_allclose(got_w[0], ref.w[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_w[1], ref.w[1], rtol=1e-4, atol=1e-5)
