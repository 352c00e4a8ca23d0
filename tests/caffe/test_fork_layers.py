"""The forks' layers (SSD, PSPNet/DeepLab, SegNet, Fast R-CNN, SENet, MobileNet, ShuffleNet)
and Pooling's ``ceil_mode``/STOCHASTIC: one-layer nets against OpenCV's importer (fusion off;
weights written by our ``save_weights``), against the forks' formulas in float64 numpy, and
gradients against finite differences."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_cct.caffe import import_net, save_weights
from keras_cct.caffe.net import layers as cl
from keras_cct.caffe.net.layers import forks as fl
from tests.caffe.import_helpers import opencv_forward, randomize
from tests.caffe.test_bvlc_losses import _value_and_grad
from tests.caffe.test_caffe_layers import _numeric_grad, _run_grad
from tests.reference import rel_err

cv2 = pytest.importorskip("cv2")


def _net(tmp_path, inputs, body, seed=0):
    """A net of ``inputs`` ({name: Caffe shape}) and ``body`` (layer text), imported, with
    random weights saved for OpenCV; returns (net, prototxt, caffemodel)."""
    head = "".join(f'input: "{n}"\ninput_shape {{ {" ".join(f"dim: {d}" for d in s)} }}\n'
                   for n, s in inputs.items())
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(head + body)
    net = import_net(prototxt)
    randomize(net.model, seed=seed)
    weights = tmp_path / "net.caffemodel"
    save_weights(net, weights)
    return net, prototxt, weights


def _ours(net, xs, blob):
    vals = net.submodel([blob])([cl.from_caffe_layout(x) for x in xs])
    vals = vals[0] if isinstance(vals, (list, tuple)) else vals
    return cl.to_caffe_layout(keras.ops.convert_to_numpy(vals))


def _vs_opencv(tmp_path, inputs, body, blob, xs, tol=1e-5):
    net, prototxt, weights = _net(tmp_path, inputs, body)
    ref = opencv_forward(prototxt, weights, dict(zip(inputs, xs)), [blob])[0]
    ours = _ours(net, xs, blob)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert rel_err(ours, ref) <= tol
    return net, ours


def _rand(*shape, seed=0, lo=None, hi=None):
    rng = np.random.default_rng(seed)
    if lo is not None:
        return rng.uniform(lo, hi, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Permute, Normalize, PriorBox (SSD)


@pytest.mark.parametrize("order", [(0, 2, 3, 1), (0, 3, 1, 2), (0, 1, 3, 2), (0, 3, 2, 1)])
def test_permute_matches_opencv_and_numpy(tmp_path, order):
    x = _rand(2, 3, 4, 5)
    body = ('layer { name: "p" type: "Permute" bottom: "x" top: "p" permute_param { '
            + " ".join(f"order: {a}" for a in order) + " } }")
    _, ours = _vs_opencv(tmp_path, {"x": x.shape}, body, "p", [x], tol=0)
    full = list(order) + [a for a in range(4) if a not in order]
    np.testing.assert_array_equal(ours, np.transpose(x, full))


def _normalize_ref(x, scale, across, shared, eps):
    x = x.astype(np.float64)
    axes = (1, 2, 3) if across else (1,)
    norm = np.sqrt((x * x).sum(axis=axes, keepdims=True) + eps)
    s = scale.reshape(1, -1, 1, 1) if not shared else scale.reshape(1, 1, 1, 1)
    return x / norm * s


@pytest.mark.parametrize("across,shared", [(True, True), (True, False), (False, True),
                                           (False, False)])
def test_normalize_matches_opencv_numpy_and_gradients(tmp_path, across, shared):
    x = _rand(2, 4, 3, 5)
    body = (f'layer {{ name: "n" type: "Normalize" bottom: "x" top: "n" norm_param {{ '
            f'across_spatial: {str(across).lower()} channel_shared: {str(shared).lower()} '
            f'eps: 1e-6 }} }}')
    if across and not shared:  # OpenCV 4.x asserts one scale per image plane here
        net, _, _ = _net(tmp_path, {"x": x.shape}, body)
        ours = _ours(net, [x], "n")
    else:
        net, ours = _vs_opencv(tmp_path, {"x": x.shape}, body, "n", [x])
    layer = net.model.get_layer("n")
    scale = np.array(layer.get_weights()[0], np.float64)
    assert scale.shape == (() if shared else (4,))   # SSD's blobs: a 0-D scalar or (C,)
    np.testing.assert_allclose(ours, _normalize_ref(x, scale, across, shared, 1e-6),
                               rtol=1e-5, atol=1e-6)
    dy = _rand(*x.shape, seed=3)
    y, dx, dscale = _run_grad(layer, x, dy, "scale")
    x64 = x.astype(np.float64)
    num_dx = _numeric_grad(lambda a: _normalize_ref(a, scale.astype(np.float64), across,
                                                    shared, 1e-6), x64, dy)
    num_ds = _numeric_grad(lambda s: _normalize_ref(x64, s, across, shared, 1e-6),
                           scale.copy(), dy)
    assert rel_err(dx, num_dx) < 1e-4 and rel_err(dscale, num_ds) < 1e-4


# OpenCV's defaults differ from SSD's (clip true) and it ignores img_size/img_h/img_w: clip is
# given, and the image size comes from the image bottom (img_size: test_prior_box_img_size)
PRIORS = [
    ("min_size: 10 max_size: 20 aspect_ratio: 2 flip: true clip: false variance: 0.1", 8, 8),
    ("min_size: 30 min_size: 15 max_size: 45 max_size: 30 aspect_ratio: 2 aspect_ratio: 3 "
     "flip: false clip: true variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2", 5, 7),
    ("min_size: 20 aspect_ratio: 2 aspect_ratio: 0.5 aspect_ratio: 2 flip: true clip: true "
     "variance: 0.2 step: 12 offset: 0.3", 6, 6),
    ("min_size: 16 max_size: 32 aspect_ratio: 3 flip: true clip: false variance: 0.1 "
     "variance: 0.1 variance: 0.2 variance: 0.2 step_h: 10 step_w: 6", 6, 8),
]


@pytest.mark.parametrize("params,h,w", PRIORS)
def test_prior_box_matches_opencv(tmp_path, params, h, w):
    x = _rand(1, 2, h, w)
    img = _rand(1, 3, 64, 48)
    body = ('layer { name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "pb" '
            f"prior_box_param {{ {params} }} }}")
    _vs_opencv(tmp_path, {"f": x.shape, "img": img.shape}, body, "pb", [x, img], tol=1e-6)


def test_prior_box_values_by_hand():
    """One 1x1 map cell of a 100x100 image: min 20, max 80 (sqrt 40), ratio 4 (40x10)."""
    out = fl.prior_boxes((1, 1), (100, 100), [20], [80], [4], flip=False)
    boxes = out[0, 0].reshape(-1, 4)
    np.testing.assert_allclose(boxes, [[0.4, 0.4, 0.6, 0.6], [0.3, 0.3, 0.7, 0.7],
                                       [0.3, 0.45, 0.7, 0.55]], atol=1e-7)
    np.testing.assert_allclose(out[0, 1], 0.1)


def test_prior_box_img_size_replaces_the_image_bottom(tmp_path):
    """SSD: img_h/img_w (or img_size) given, the image bottom's size is not used."""
    body = ('layer { name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "pb" '
            'prior_box_param { min_size: 20 clip: false img_h: 100 img_w: 50 step: 25 } }')
    net, _, _ = _net(tmp_path, {"f": (1, 1, 2, 2), "img": (1, 3, 64, 48)}, body)
    out = _ours(net, [_rand(1, 1, 2, 2), _rand(1, 3, 64, 48)], "pb")
    # cell (h=1, w=0): center (12.5, 37.5); box 20x20 over a 50 (w) x 100 (h) image
    np.testing.assert_allclose(out[0, 0].reshape(-1, 4)[2],
                               [2.5 / 50, 27.5 / 100, 22.5 / 50, 47.5 / 100], rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Interp (PSPNet/DeepLab), Upsample (SegNet/YOLO)


def _interp_ref(x, oh, ow, pad_beg=0, pad_end=0):
    """caffe_cpu_interp2 (align corners) on the input cropped by -pad_beg/-pad_end."""
    n, c, h, w = x.shape
    he, we = h + pad_beg + pad_end, w + pad_beg + pad_end
    y0, x0 = -pad_beg, -pad_beg
    x = x.astype(np.float64)
    rh = np.float32((he - 1) / (oh - 1)) if oh > 1 else np.float32(0)
    rw = np.float32((we - 1) / (ow - 1)) if ow > 1 else np.float32(0)
    out = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            if he == oh and we == ow:
                out[:, :, i, j] = x[:, :, y0 + i, x0 + j]
                continue
            hr, wr = rh * np.float32(i), rw * np.float32(j)
            h1, w1 = int(hr), int(wr)
            hp, wp = (1 if h1 < he - 1 else 0), (1 if w1 < we - 1 else 0)
            lh, lw = float(hr - h1), float(wr - w1)
            p = x[:, :, y0 + h1:, x0 + w1:]
            out[:, :, i, j] = ((1 - lh) * ((1 - lw) * p[:, :, 0, 0] + lw * p[:, :, 0, wp])
                               + lh * ((1 - lw) * p[:, :, hp, 0] + lw * p[:, :, hp, wp]))
    return out


# OpenCV 4.x's Interp reads zoom_factor and height/width only (not shrink_factor)
@pytest.mark.parametrize("params,oh,ow,opencv", [
    ("zoom_factor: 2", 9, 11, True), ("height: 7 width: 13", 7, 13, True),
    ("shrink_factor: 2", 3, 3, False), ("zoom_factor: 3 shrink_factor: 2", 7, 7, False)])
def test_interp_matches_opencv_and_numpy(tmp_path, params, oh, ow, opencv):
    x = _rand(1, 3, 5, 6)
    body = f'layer {{ name: "i" type: "Interp" bottom: "x" top: "i" interp_param {{ {params} }} }}'
    if opencv:
        _, ours = _vs_opencv(tmp_path, {"x": x.shape}, body, "i", [x])
    else:
        ours = _ours(_net(tmp_path, {"x": x.shape}, body)[0], [x], "i")
    assert ours.shape[2:] == (oh, ow)
    np.testing.assert_allclose(ours, _interp_ref(x, oh, ow), rtol=1e-5, atol=1e-6)


def test_interp_pads_and_gradient():
    x = _rand(2, 3, 7, 8)
    layer = fl.CaffeInterp(zoom_factor=2, pad_beg=-1, pad_end=-2)
    y = cl.to_caffe_layout(keras.ops.convert_to_numpy(layer(cl.from_caffe_layout(x))))
    assert y.shape == (2, 3, 7, 9)   # (7 - 3) * 2 + 1, (8 - 3) * 2 + 1
    np.testing.assert_allclose(y, _interp_ref(x, 7, 9, -1, -2), rtol=1e-5, atol=1e-6)
    dy = _rand(*y.shape, seed=1)
    _, dx = _run_grad(fl.CaffeInterp(zoom_factor=2, pad_beg=-1, pad_end=-2), x, dy)
    num = _numeric_grad(lambda a: _interp_ref(a, 7, 9, -1, -2), x.astype(np.float64), dy)
    assert rel_err(dx, num) < 1e-4


def test_upsample_nearest_and_unpool():
    x = _rand(1, 2, 3, 4)
    up = cl.to_caffe_layout(keras.ops.convert_to_numpy(
        fl.CaffeUpsample((2, 2))(cl.from_caffe_layout(x))))
    np.testing.assert_array_equal(up, x.repeat(2, 2).repeat(2, 3))
    # SegNet: a 2x2/2 MAX pooling's argmax indices on a 5x7 input (upsample 5x7)
    src = _rand(1, 2, 5, 7, seed=4)
    pooled = np.zeros((1, 2, 3, 4), np.float32)
    mask = np.zeros((1, 2, 3, 4), np.float32)
    for c in range(2):
        for i in range(3):
            for j in range(4):
                win = src[0, c, 2 * i:2 * i + 2, 2 * j:2 * j + 2]
                a, b = np.unravel_index(np.argmax(win), win.shape)
                pooled[0, c, i, j] = win[a, b]
                mask[0, c, i, j] = (2 * i + a) * 7 + (2 * j + b)
    want = np.zeros((1, 2, 5, 7), np.float32)
    for c in range(2):
        want[0, c].reshape(-1)[mask[0, c].astype(int).reshape(-1)] = pooled[0, c].reshape(-1)
    layer = fl.CaffeUpsample((2, 2), size=(5, 7))
    got = layer([cl.from_caffe_layout(pooled), cl.from_caffe_layout(mask)])
    np.testing.assert_array_equal(cl.to_caffe_layout(keras.ops.convert_to_numpy(got)), want)


# ------------------------------------------------------------------------------------------
# ROIPooling (Fast R-CNN), ShuffleChannel, ReLU6, Axpy


def _roi_ref(x, rois, ph, pw, scale):
    """ROIPoolingLayer::Forward_cpu (caffe-fast-rcnn), transcribed."""
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw))
    rnd = lambda v: int(np.sign(v) * np.floor(abs(v) + 0.5))  # noqa: E731
    for r, (b, x1, y1, x2, y2) in enumerate(rois):
        sw, sh, ew, eh = rnd(x1 * scale), rnd(y1 * scale), rnd(x2 * scale), rnd(y2 * scale)
        rh, rw = max(eh - sh + 1, 1), max(ew - sw + 1, 1)
        bh, bw = rh / ph, rw / pw
        for i in range(ph):
            for j in range(pw):
                hs = min(max(int(np.floor(i * bh)) + sh, 0), h)
                he = min(max(int(np.ceil((i + 1) * bh)) + sh, 0), h)
                ws = min(max(int(np.floor(j * bw)) + sw, 0), w)
                we = min(max(int(np.ceil((j + 1) * bw)) + sw, 0), w)
                if he > hs and we > ws:
                    out[r, :, i, j] = x[int(b), :, hs:he, ws:we].max(axis=(1, 2))
    return out


def test_roi_pooling_matches_opencv_numpy_and_gradient(tmp_path):
    x = _rand(2, 3, 12, 14)
    rois = np.array([[0, 0, 0, 40, 40], [1, 8.2, 4.5, 50, 30], [0, 30, 30, 31, 31],
                     [1, -8, -8, 70, 70], [0, 52, 44, 54, 46]], np.float32)
    body = ('layer { name: "roi" type: "ROIPooling" bottom: "x" bottom: "rois" top: "roi" '
            'roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.25 } }')
    _, ours = _vs_opencv(tmp_path, {"x": x.shape, "rois": rois.shape}, body, "roi", [x, rois])
    np.testing.assert_allclose(ours, _roi_ref(x, rois, 3, 2, 0.25), rtol=1e-6)
    layer = fl.CaffeROIPooling(3, 2, 0.25)
    xr = cl.from_caffe_layout(x)
    dy = _rand(5, 3, 2, 3, seed=2)  # Keras layout (R, PH, PW, C)
    # (t * 1: TensorFlow's gradient of a gather is IndexedSlices; the product makes it dense)
    dyt = keras.ops.convert_to_tensor(dy)
    _, g = _value_and_grad(lambda t: keras.ops.sum(layer([t * 1.0, rois]) * dyt), xr)
    num = _numeric_grad(lambda a: cl.from_caffe_layout(_roi_ref(cl.to_caffe_layout(a), rois,
                                                                 3, 2, 0.25)),
                        np.asarray(xr, np.float64), dy, eps=1e-3)
    assert rel_err(g, num) < 1e-4


def test_shuffle_channel_and_relu6_match_opencv(tmp_path):
    x = _rand(2, 6, 3, 4) * 5
    body = ('layer { name: "s" type: "ShuffleChannel" bottom: "x" top: "s" '
            'shuffle_channel_param { group: 3 } }\n'
            'layer { name: "r" type: "ReLU6" bottom: "s" top: "r" }')
    net, ours = _vs_opencv(tmp_path, {"x": x.shape}, body, "s", [x], tol=0)
    want = x.reshape(2, 3, 2, 3, 4).transpose(0, 2, 1, 3, 4).reshape(x.shape)
    np.testing.assert_array_equal(ours, want)
    _vs_opencv(tmp_path, {"x": x.shape}, body, "r", [x], tol=0)
    np.testing.assert_array_equal(_ours(net, [x], "r"), np.clip(want, 0, 6))


def test_axpy_and_gradient(tmp_path):
    a, x, y = _rand(2, 3, 1, 1), _rand(2, 3, 4, 5, seed=1), _rand(2, 3, 4, 5, seed=2)
    prototxt_body = ('layer { name: "ax" type: "Axpy" bottom: "a" bottom: "x" bottom: "y" '
                     'top: "ax" }')
    net, _, _ = _net(tmp_path, {"a": a.shape, "x": x.shape, "y": y.shape}, prototxt_body)
    np.testing.assert_allclose(_ours(net, [a, x, y], "ax"), a * x + y, rtol=1e-6)
    layer = fl.CaffeAxpy()
    ak, xk, yk = (cl.from_caffe_layout(t) for t in (a, x, y))
    dy = _rand(*xk.shape, seed=5)
    dyt = keras.ops.convert_to_tensor(dy)
    _, g = _value_and_grad(lambda t: keras.ops.sum(layer([t, xk, yk]) * dyt), ak)
    np.testing.assert_allclose(g, (xk * dy).sum(axis=(1, 2), keepdims=True), rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Pooling: ceil_mode (forks) and STOCHASTIC (BVLC)


@pytest.mark.parametrize("ceil", ["true", "false"])
@pytest.mark.parametrize("hw,k,s,p", [((7, 9), 3, 2, 0), ((8, 8), 3, 2, 1), ((6, 11), 2, 2, 0)])
def test_ceil_mode_shapes_and_values_match_opencv(tmp_path, ceil, hw, k, s, p):
    x = _rand(1, 2, *hw)
    body = (f'layer {{ name: "pool" type: "Pooling" bottom: "x" top: "pool" pooling_param {{ '
            f'pool: MAX kernel_size: {k} stride: {s} pad: {p} ceil_mode: {ceil} }} }}')
    _vs_opencv(tmp_path, {"x": x.shape}, body, "pool", [x], tol=0)


def test_ceil_mode_and_round_mode_together_is_an_error(tmp_path):
    from keras_cct.errors import CaffeFormatError
    body = ('layer { name: "pool" type: "Pooling" bottom: "x" top: "pool" pooling_param { '
            'pool: MAX kernel_size: 2 stride: 2 ceil_mode: false round_mode: FLOOR } }')
    with pytest.raises(CaffeFormatError, match="ceil_mode"):
        _net(tmp_path, {"x": (1, 1, 4, 4)}, body)


def _stochastic_windows(x, k, s):
    n, c, h, w = x.shape
    oh, ow = -(-(h - k) // s) + 1, -(-(w - k) // s) + 1
    for i in range(oh):
        for j in range(ow):
            yield i, j, x[:, :, i * s:min(i * s + k, h), j * s:min(j * s + k, w)]


def test_stochastic_pooling_test_phase_is_probability_weighted():
    x = _rand(2, 3, 7, 8, lo=0, hi=1)
    x[0, 0, :3, :3] = 0   # an all-zero window gives 0
    layer = cl.CaffePooling2D("STOCHASTIC", 3, 2)
    y = cl.to_caffe_layout(keras.ops.convert_to_numpy(layer(cl.from_caffe_layout(x))))
    want = np.zeros_like(y, np.float64)
    for i, j, win in _stochastic_windows(x.astype(np.float64), 3, 2):
        tot = win.sum(axis=(2, 3))
        want[:, :, i, j] = np.where(tot > 0, (win * win).sum(axis=(2, 3)) / np.where(
            tot > 0, tot, 1), 0)
    assert y.shape == (2, 3, 3, 4)
    np.testing.assert_allclose(y, want, rtol=1e-5)
    assert y[0, 0, 0, 0] == 0


def test_stochastic_pooling_train_phase_samples_window_values():
    x = _rand(1, 2, 6, 6, lo=0, hi=1)
    layer = cl.CaffePooling2D("STOCHASTIC", 2, 2, seed=3)
    xk = cl.from_caffe_layout(x)
    counts = np.zeros((1, 2, 3, 3, 4))
    trials = 400
    for _ in range(trials):
        y = cl.to_caffe_layout(keras.ops.convert_to_numpy(layer(xk, training=True)))
        for i, j, win in _stochastic_windows(x, 2, 2):
            flat = win.reshape(1, 2, 4)
            hit = flat == y[:, :, i, j][..., None]
            assert np.all(hit.any(-1))           # every output is one of its window's values
            counts[:, :, i, j] += hit
    freq = counts / trials
    prob = np.stack([w.reshape(1, 2, 4) / w.reshape(1, 2, 4).sum(-1, keepdims=True)
                     for _, _, w in _stochastic_windows(x, 2, 2)], 2).reshape(freq.shape)
    assert np.abs(freq - prob).max() < 0.12      # drawn with probability x / sum (4 sigma)


def _max_mask_ref(x, k, s, p):
    """PoolingLayer::Forward_cpu MAX with its mask top (first maximum, clipped windows)."""
    n, c, h, w = x.shape
    oh = -(-(h + 2 * p - k) // s) + 1
    ow = -(-(w + 2 * p - k) // s) + 1
    if p and (oh - 1) * s >= h + p:
        oh -= 1
    if p and (ow - 1) * s >= w + p:
        ow -= 1
    y, m = np.zeros((n, c, oh, ow)), np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            hs, ws = i * s - p, j * s - p
            he, we = min(hs + k, h), min(ws + k, w)
            hs, ws = max(hs, 0), max(ws, 0)
            win = x[:, :, hs:he, ws:we].reshape(n, c, -1)
            a = win.argmax(-1)
            y[:, :, i, j] = win.max(-1)
            m[:, :, i, j] = (hs + a // (we - ws)) * w + ws + a % (we - ws)
    return y, m


@pytest.mark.parametrize("hw,k,s,p", [((6, 8), 2, 2, 0), ((7, 9), 3, 2, 1), ((5, 7), 2, 2, 0)])
def test_segnet_max_pool_mask_and_unpool(tmp_path, hw, k, s, p):
    x = _rand(2, 3, *hw)
    x[0, 0, 0, :2] = 5.0   # a tie: the first maximum wins, as Caffe's strict '>'
    body = (f'layer {{ name: "pool" type: "Pooling" bottom: "x" top: "pool" top: "mask" '
            f'pooling_param {{ pool: MAX kernel_size: {k} stride: {s} pad: {p} }} }}\n'
            f'layer {{ name: "up" type: "Upsample" bottom: "pool" bottom: "mask" top: "up" '
            f'upsample_param {{ scale: {s} upsample_h: {hw[0]} upsample_w: {hw[1]} }} }}')
    net, _, _ = _net(tmp_path, {"x": x.shape}, body)
    y_ref, m_ref = _max_mask_ref(x, k, s, p)
    np.testing.assert_array_equal(_ours(net, [x], "pool"), y_ref.astype(np.float32))
    np.testing.assert_array_equal(_ours(net, [x], "mask"), m_ref)
    if k == s:  # SegNet's pooling: every index lies in its own cell of the output
        want = np.zeros(x.shape, np.float32)
        flat = want.reshape(2, 3, -1)
        for a in range(2):
            for c in range(3):
                flat[a, c, m_ref[a, c].astype(int).reshape(-1)] = y_ref[a, c].reshape(-1)
        np.testing.assert_array_equal(_ours(net, [x], "up"), want)


def test_interp_to_the_second_bottoms_size(tmp_path):
    x, ref = _rand(1, 2, 4, 5), _rand(1, 3, 9, 7)
    body = 'layer { name: "i" type: "Interp" bottom: "x" bottom: "r" top: "i" }'
    net, _, _ = _net(tmp_path, {"x": x.shape, "r": ref.shape}, body)
    np.testing.assert_allclose(_ours(net, [x, ref], "i"), _interp_ref(x, 9, 7), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("inputs,body,match", [
    ({"x": (1, 2, 4, 4)}, 'layer { name: "bad" type: "Permute" bottom: "x" top: "p" '
     'permute_param { order: 0 order: 1 order: 1 order: 2 } }', "permutation"),
    ({"x": (1, 2, 4, 4), "img": (1, 3, 8, 8)}, 'layer { name: "bad" type: "PriorBox" '
     'bottom: "x" bottom: "img" top: "p" prior_box_param { max_size: 3 } }', "min_size"),
    ({"x": (1, 2, 4, 4)}, 'layer { name: "bad" type: "PriorBox" bottom: "x" top: "p" '
     'prior_box_param { min_size: 3 } }', "img_size"),
    ({"l": (1, 8), "c": (1, 4), "p": (1, 2, 8)}, 'layer { name: "bad" type: "DetectionOutput" '
     'bottom: "l" bottom: "c" bottom: "p" top: "d" }', "num_classes"),
    ({"x": (1, 2, 4, 4)}, 'layer { name: "bad" type: "Interp" bottom: "x" top: "i" }',
     "exactly one"),
    ({"x": (1, 2, 4, 4)}, 'layer { name: "bad" type: "Interp" bottom: "x" top: "i" '
     'interp_param { zoom_factor: 2 pad_beg: 1 } }', "pad_beg"),
    ({"x": (1, 6, 4, 4)}, 'layer { name: "bad" type: "ShuffleChannel" bottom: "x" top: "s" '
     'shuffle_channel_param { group: 4 } }', "group 4"),
    ({"x": (1, 6, 4, 4)}, 'layer { name: "bad" type: "ConvolutionDepthwise" bottom: "x" '
     'top: "s" convolution_param { num_output: 8 kernel_size: 3 } }', "multiple"),
    ({"x": (1, 2, 4, 4)}, 'layer { name: "bad" type: "Pooling" bottom: "x" top: "p" top: "m" '
     'pooling_param { pool: AVE kernel_size: 2 stride: 2 } }', "mask"),
])
def test_fork_layer_errors_name_the_layer_and_line(tmp_path, inputs, body, match):
    from keras_cct.errors import CaffeFormatError
    with pytest.raises(CaffeFormatError, match=match) as info:
        _net(tmp_path, inputs, body)
    assert info.value.layer == "bad" and info.value.line is not None


def test_stochastic_pooling_train_gradient_goes_to_one_drawn_value():
    """Caffe's backward: each window's gradient goes to the one element it drew."""
    x = _rand(1, 2, 6, 6, lo=0.1, hi=1, seed=8)
    layer = cl.CaffePooling2D("STOCHASTIC", 2, 2, seed=5)
    dy = _rand(1, 3, 3, 2, lo=1, hi=2, seed=9)   # Keras layout (N, oh, ow, C)
    dyt = keras.ops.convert_to_tensor(dy)
    _, g = _value_and_grad(lambda t: keras.ops.sum(layer(t, training=True) * dyt),
                           cl.from_caffe_layout(x))
    g = cl.to_caffe_layout(np.asarray(g))
    d = cl.to_caffe_layout(dy)
    for i, j, _ in _stochastic_windows(x, 2, 2):
        gw = g[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(1, 2, 4)
        assert np.all((gw != 0).sum(-1) == 1)
        np.testing.assert_allclose(gw.sum(-1), d[:, :, i, j], rtol=1e-6)
