"""SSD (weiliu89/caffe) end to end: a small MobileNet-SSD-shaped net (ConvolutionDepthwise,
ReLU6, Normalize, Permute/Flatten/Concat heads, PriorBox, Reshape+Softmax, DetectionOutput)
with random weights written by our ``save_weights`` and read by OpenCV's importer, and the
DetectionOutput layer against SSD's algorithm written in float64 numpy."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_cct.caffe import import_net, save_weights
from keras_cct.caffe.net.layers.forks import CaffeDetectionOutput, detections
from keras_cct.caffe.net.layout import from_caffe_layout, to_caffe_layout
from tests.caffe.import_helpers import opencv_forward, randomize
from tests.reference import rel_err

cv2 = pytest.importorskip("cv2")

_HEAD = """
layer {{ name: "{f}_{k}" type: "Convolution" bottom: "{b}" top: "{f}_{k}"
  convolution_param {{ num_output: {n} kernel_size: 3 pad: 1 }} }}
layer {{ name: "{f}_{k}_perm" type: "Permute" bottom: "{f}_{k}" top: "{f}_{k}_perm"
  permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: "{f}_{k}_flat" type: "Flatten" bottom: "{f}_{k}_perm" top: "{f}_{k}_flat"
  flatten_param {{ axis: 1 }} }}
"""

SSD = """name: "tiny_mobilenet_ssd"
input: "data"
input_shape { dim: 1 dim: 3 dim: 64 dim: 64 }
layer { name: "conv0" type: "Convolution" bottom: "data" top: "conv0"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "conv0/relu" type: "ReLU6" bottom: "conv0" top: "conv0" }
layer { name: "conv1/dw" type: "ConvolutionDepthwise" bottom: "conv0" top: "conv1/dw"
  convolution_param { num_output: 8 group: 8 kernel_size: 3 stride: 2 pad: 1 bias_term: false } }
layer { name: "conv1/dw/relu" type: "ReLU" bottom: "conv1/dw" top: "conv1/dw" }
layer { name: "conv1" type: "Convolution" bottom: "conv1/dw" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 1 } }
layer { name: "conv1/relu" type: "ReLU6" bottom: "conv1" top: "conv1" }
layer { name: "conv2/dw" type: "ConvolutionDepthwise" bottom: "conv1" top: "conv2/dw"
  convolution_param { num_output: 16 group: 16 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "conv2" type: "Convolution" bottom: "conv2/dw" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 1 } }
layer { name: "conv2/relu" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv1_norm" type: "Normalize" bottom: "conv1" top: "conv1_norm"
  norm_param { across_spatial: false channel_shared: false
               scale_filler { type: "constant" value: 20 } } }
layer { name: "fm1_priorbox" type: "PriorBox" bottom: "conv1_norm" bottom: "data"
  top: "fm1_priorbox"
  prior_box_param { min_size: 10 max_size: 20 aspect_ratio: 2 flip: true clip: false
    variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
layer { name: "fm2_priorbox" type: "PriorBox" bottom: "conv2" bottom: "data" top: "fm2_priorbox"
  prior_box_param { min_size: 25 max_size: 40 aspect_ratio: 2 aspect_ratio: 3 flip: true
    clip: true variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 step: 8 offset: 0.5 } }
""" + "".join(_HEAD.format(f=f, k=k, b=b, n=n) for f, b, k, n in [
    ("fm1", "conv1_norm", "loc", 16), ("fm1", "conv1_norm", "conf", 12),
    ("fm2", "conv2", "loc", 24), ("fm2", "conv2", "conf", 18)]) + """
layer { name: "mbox_loc" type: "Concat" bottom: "fm1_loc_flat" bottom: "fm2_loc_flat"
  top: "mbox_loc" concat_param { axis: 1 } }
layer { name: "mbox_conf" type: "Concat" bottom: "fm1_conf_flat" bottom: "fm2_conf_flat"
  top: "mbox_conf" concat_param { axis: 1 } }
layer { name: "mbox_priorbox" type: "Concat" bottom: "fm1_priorbox" bottom: "fm2_priorbox"
  top: "mbox_priorbox" concat_param { axis: 2 } }
layer { name: "mbox_conf_reshape" type: "Reshape" bottom: "mbox_conf" top: "mbox_conf_reshape"
  reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
layer { name: "mbox_conf_softmax" type: "Softmax" bottom: "mbox_conf_reshape"
  top: "mbox_conf_softmax" softmax_param { axis: 2 } }
layer { name: "mbox_conf_flatten" type: "Flatten" bottom: "mbox_conf_softmax"
  top: "mbox_conf_flatten" flatten_param { axis: 1 } }
layer { name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc"
  bottom: "mbox_conf_flatten" bottom: "mbox_priorbox" top: "detection_out"
  detection_output_param { num_classes: 3 share_location: true background_label_id: 0
    nms_param { nms_threshold: 0.45 top_k: 50 } code_type: CENTER_SIZE keep_top_k: 20
    confidence_threshold: 0.01 } }
"""

BLOBS = ["mbox_loc", "mbox_conf_flatten", "mbox_priorbox", "conv1_norm", "detection_out"]


def _ssd_order(rows: np.ndarray) -> np.ndarray:
    """SSD's row order (image, label, then score descending) of detection rows."""
    return rows[np.lexsort((-rows[:, 2], rows[:, 1], rows[:, 0]))]


@pytest.fixture(scope="module")
def ssd(tmp_path_factory):
    d = tmp_path_factory.mktemp("ssd")
    prototxt = d / "ssd.prototxt"
    prototxt.write_text(SSD)
    net = import_net(prototxt)
    randomize(net.model, seed=1)
    weights = d / "random.caffemodel"
    save_weights(net, weights)
    x = np.random.default_rng(2).uniform(0, 1, (1, 3, 64, 64)).astype(np.float32)
    refs = opencv_forward(prototxt, weights, {"data": x}, BLOBS)
    outs = net.submodel(BLOBS)(from_caffe_layout(x))
    ours = [to_caffe_layout(keras.ops.convert_to_numpy(o)) for o in outs]
    return net, dict(zip(BLOBS, refs)), dict(zip(BLOBS, ours)), (prototxt, weights, x)


def test_ssd_blobs_match_opencv(ssd):
    _, refs, ours, _ = ssd
    for b in BLOBS[:-1]:
        assert ours[b].shape == refs[b].shape, b
        assert rel_err(ours[b], refs[b]) < 1e-5, b
    assert refs["mbox_priorbox"].shape == (1, 2, (16 * 16 * 4 + 8 * 8 * 6) * 4)


def test_ssd_detections_match_opencv(ssd):
    """Same detections (boxes within 1e-4, same labels and scores) in SSD's order; OpenCV 4.x
    orders each image's rows by score alone, so its rows are put in SSD's order first."""
    _, refs, ours, _ = ssd
    ref = refs["detection_out"].reshape(-1, 7)
    ref = ref[ref[:, 2] > 0]
    got = detections(ours["detection_out"])
    assert got.shape == ref.shape and len(got) == 20          # keep_top_k cut in
    assert set(got[:, 1]) == {1.0, 2.0}
    want = _ssd_order(ref)
    np.testing.assert_array_equal(got[:, :2], want[:, :2])
    np.testing.assert_allclose(got[:, 2:], want[:, 2:], atol=1e-4, rtol=0)
    # the layer in OpenCV's order (group_by_classes=False): OpenCV's rows as they come
    layer = CaffeDetectionOutput(3, True, 0, 0.45, 50, "CENTER_SIZE", False, 20, 0.01,
                                 group_by_classes=False)
    out = layer([from_caffe_layout(refs[b]) for b in BLOBS[:3]])
    flat = detections(out)
    np.testing.assert_array_equal(flat[:, :2], ref[:, :2])
    np.testing.assert_allclose(flat[:, 2:], ref[:, 2:], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------
# DetectionOutput against SSD's algorithm in float64 numpy (detection_output_layer.cpp,
# bbox_util.cpp: DecodeBBox, ApplyNMSFast, keep_top_k)


def _decode(loc, prior, var, code, vet):
    if code == "CORNER":
        return prior + (loc if vet else loc * var)
    v = np.ones_like(var) if vet else var
    pw, ph = prior[:, 2] - prior[:, 0], prior[:, 3] - prior[:, 1]
    pcx, pcy = (prior[:, 0] + prior[:, 2]) / 2, (prior[:, 1] + prior[:, 3]) / 2
    cx, cy = v[:, 0] * loc[:, 0] * pw + pcx, v[:, 1] * loc[:, 1] * ph + pcy
    w, h = np.exp(v[:, 2] * loc[:, 2]) * pw, np.exp(v[:, 3] * loc[:, 3]) * ph
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)


def _jaccard(a, b):
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return 0.0
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = iw * ih

    def size(x):
        return (x[2] - x[0]) * (x[3] - x[1]) if x[2] >= x[0] and x[3] >= x[1] else 0.0

    return inter / (size(a) + size(b) - inter)


def detection_output_numpy(loc, conf, prior, num_classes, share, bg, nms, top_k, code, vet,
                           keep_top_k, thr):
    loc, conf, prior = (np.asarray(a, np.float64) for a in (loc, conf, prior))
    n, p = loc.shape[0], prior.shape[2] // 4
    lc = 1 if share else num_classes
    pri, var = prior[0, 0].reshape(p, 4), prior[0, 1].reshape(p, 4)
    rows = []
    for i in range(n):
        l4 = loc[i].reshape(p, lc, 4)
        scores = conf[i].reshape(p, num_classes)
        kept = {}
        for c in range(num_classes):
            if c == bg:
                continue
            boxes = _decode(l4[:, 0 if share else c], pri, var, code, vet)
            s = scores[:, c]
            cand = [j for j in np.argsort(-s, kind="stable") if s[j] > thr]
            if top_k > -1:
                cand = cand[:top_k]
            keep = []
            for j in cand:
                if all(_jaccard(boxes[j], boxes[k]) <= nms for k in keep):
                    keep.append(j)
            kept[c] = [(s[j], j, boxes[j]) for j in keep]
        allk = [(sc, c, j, b) for c, v in kept.items() for sc, j, b in v]
        if keep_top_k > -1 and len(allk) > keep_top_k:
            allk = sorted(allk, key=lambda t: -t[0])[:keep_top_k]
        for sc, c, j, b in sorted(allk, key=lambda t: (t[1], -t[0])):
            rows.append([i, c, sc, *b])
    return np.asarray(rows, np.float64).reshape(-1, 7)


@pytest.mark.parametrize("share,code,vet,keep_top_k,top_k,bg", [
    (True, "CENTER_SIZE", False, 15, 30, 0),
    (False, "CORNER", False, -1, 10, 0),
    (True, "CORNER", True, 7, -1, 2),
    (False, "CENTER_SIZE", True, 40, 25, -1),
])
def test_detection_output_matches_ssd_numpy(share, code, vet, keep_top_k, top_k, bg):
    rng = np.random.default_rng(7)
    n, p, nc = 2, 60, 3
    xy = rng.uniform(0, 0.8, (p, 2))
    wh = rng.uniform(0.05, 0.4, (p, 2))
    prior = np.stack([np.concatenate([xy, xy + wh], 1).reshape(-1),
                      np.tile([0.1, 0.1, 0.2, 0.2], p)])[None].astype(np.float32)
    loc = rng.normal(0, 0.5 if code == "CENTER_SIZE" else 0.05,
                     (n, p * (1 if share else nc) * 4)).astype(np.float32)
    logits = rng.normal(0, 1.5, (n, p, nc))
    conf = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).reshape(n, -1)
    conf = conf.astype(np.float32)
    want = detection_output_numpy(loc, conf, prior, nc, share, bg, 0.4, top_k, code, vet,
                                  keep_top_k, 0.05)
    layer = CaffeDetectionOutput(nc, share, bg, 0.4, top_k, code, vet, keep_top_k, 0.05)
    got = detections(layer([loc, conf, from_caffe_layout(prior)]))
    assert len(want) > 5
    assert got.shape == want.shape
    np.testing.assert_array_equal(got[:, :2], want[:, :2])
    np.testing.assert_allclose(got[:, 2:], want[:, 2:], atol=1e-5, rtol=0)


def test_detection_output_keras_model_roundtrip(tmp_path):
    layer = CaffeDetectionOutput(4, False, 1, 0.3, 5, "CENTER_SIZE", True, 6, 0.2)
    again = CaffeDetectionOutput.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()


def test_ssd_model_saves_reloads_and_predicts(ssd, tmp_path):
    """Every fork layer is a registered serializable Keras layer; ``predict`` (compiled) gives
    the eager detections."""
    net, _, ours, _ = ssd
    path = tmp_path / "ssd.keras"
    net.model.save(path)
    again = keras.saving.load_model(path)
    x = np.random.default_rng(2).uniform(0, 1, (1, 3, 64, 64)).astype(np.float32)
    out = again.predict(from_caffe_layout(x), verbose=0)
    got = detections(out[0] if isinstance(out, (list, tuple)) else out)
    want = detections(ours["detection_out"])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_ssd_with_keras_conv2d_gives_the_same_detections(ssd):
    """conv_impl="keras": Convolution and ConvolutionDepthwise as Keras' Conv2D."""
    _, _, ours, (prototxt, weights, x) = ssd
    net = import_net(prototxt, weights, conv_impl="keras")
    assert type(net.model.get_layer("conv1__dw")).__name__ == "Conv2D"
    out = net.submodel(["detection_out"])(from_caffe_layout(x))
    out = out[0] if isinstance(out, (list, tuple)) else out
    np.testing.assert_allclose(detections(out), detections(ours["detection_out"]), atol=1e-5)
