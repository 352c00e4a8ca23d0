"""pycaffe-style scripts (``import keras_cct.caffe as caffe``) on the real LeNet and CIFAR-10
quick models of ../shared/caffe-models, against the Keras API (load_net) and OpenCV's
independent Caffe importer (cv2.dnn, fusion off)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_cct.caffe as caffe
from keras_cct.caffe import load_net
from keras_cct.errors import CaffeFormatError
from tests.caffe.import_helpers import opencv_forward
from tests.conftest import need_shared
from tests.reference import rel_err

cv2 = pytest.importorskip("cv2")
TOL = 1e-4
LENET = ("lenet_mnist/lenet.prototxt", "lenet_mnist/lenet_iter_10000.caffemodel")
CIFAR = ("cifar10_quick_v1/cifar10_quick.prototxt",
         "cifar10_quick_v1/cifar10_quick_iter_5000.caffemodel")
STEM = ("resnet50_stem/test.prototxt", "resnet50_stem/test.caffemodel")  # BN, Scale in place


def _paths(pair):
    root = need_shared("caffe-models")
    return str(root / pair[0]), str(root / pair[1])


def _digit_png(path, seed=0):
    """A 28x28 gray image of a bright stroke (a '1'-like digit) with a little noise."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    im = rng.integers(0, 30, (28, 28)).astype(np.uint8)
    im[4:24, 12:16] = 230
    Image.fromarray(im).save(path)
    return path


def _color_png(path, seed=1):
    from PIL import Image
    rng = np.random.default_rng(seed)
    im = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
    Image.fromarray(im).save(path)
    return path


def _keras(prototxt, weights, x_nchw):
    model = load_net(prototxt, weights)
    out = model.predict_on_batch(x_nchw.transpose(0, 2, 3, 1))
    return keras.ops.convert_to_numpy(out)


@pytest.mark.shared
def test_lenet_script_classifies_like_keras_and_opencv(tmp_path):
    prototxt, weights = _paths(LENET)
    # --- the pycaffe script, as written for BVLC Caffe ---
    net = caffe.Net(prototxt, weights, caffe.TEST)
    net.blobs["data"].reshape(1, 1, 28, 28)
    transformer = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    transformer.set_transpose("data", (2, 0, 1))
    image = caffe.io.load_image(str(_digit_png(tmp_path / "digit.png")), color=False)
    net.blobs["data"].data[...] = transformer.preprocess("data", image)
    out = net.forward()
    prob = out["prob"][0]
    # --- the references ---
    x = net.blobs["data"].data.copy()
    assert x.shape == (1, 1, 28, 28)
    ref_keras = _keras(prototxt, weights, x)[0]
    (ref_cv,) = opencv_forward(prototxt, weights, {"data": x}, ["prob"])
    assert rel_err(prob, ref_keras) <= 1e-6
    assert rel_err(prob, ref_cv.reshape(prob.shape)) <= TOL
    assert int(prob.argmax()) == int(ref_cv.argmax())
    assert list(out) == ["prob"] and net.outputs == ["prob"] and net.inputs == ["data"]


@pytest.mark.shared
def test_cifar10_quick_script_with_mean_swap_scale_and_resize(tmp_path):
    prototxt, weights = _paths(CIFAR)
    net = caffe.Net(prototxt, caffe.TEST, weights=weights)
    shape = net.blobs["data"].data.shape
    t = caffe.io.Transformer({"data": shape})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([104.0, 117.0, 123.0]))
    img = caffe.io.load_image(str(_color_png(tmp_path / "c.png")))
    assert img.shape == (40, 48, 3)
    data = t.preprocess("data", img)
    assert data.shape == (3, 32, 32)
    batch = np.stack([data] * shape[0])
    out = net.forward(data=batch)
    ref_keras = _keras(prototxt, weights, batch)
    (ref_cv,) = opencv_forward(prototxt, weights, {"data": batch}, [net.outputs[0]])
    got = out[net.outputs[0]]
    assert rel_err(got, ref_keras) <= 1e-6
    assert rel_err(got, ref_cv.reshape(got.shape)) <= TOL


@pytest.mark.shared
@pytest.mark.parametrize("pair", [LENET, CIFAR, STEM], ids=["lenet", "cifar10_quick",
                                                          "resnet50_stem"])
def test_forward_end_blobs_equal_opencv_layer_outputs(pair):
    """``forward(end=L)`` stops at L: the tops of L hold L's output (in-place layers after L
    not applied), as OpenCV's ``net.forward(L)``."""
    prototxt, weights = _paths(pair)
    net = caffe.Net(prototxt, weights, caffe.TEST)
    n = 2
    net.blobs["data"].reshape(n, *net.blobs["data"].shape[1:])
    x = np.random.default_rng(7).random(net.blobs["data"].shape).astype(np.float32)
    if pair is not LENET:
        x = x * 255 - 128
    names = [l for l in net._layer_names if net.layer_dict[l].type != "Input"]
    refs = opencv_forward(prototxt, weights, {"data": x}, names)
    net.blobs["data"].data[...] = x
    for name, ref in zip(names, refs):
        out = net.forward(end=name)
        top = net.top_names[name][0]
        assert set(out) == {top}
        got = net.blobs[top].data
        assert got.shape == tuple(ref.shape), (name, got.shape, ref.shape)
        assert rel_err(got, ref) <= TOL, name
    # an in-place layer's blob after forward(end=<its producer>) is the value before it
    inplace = [l for l in net._layer_names if net.bottom_names[l] == net.top_names[l]
               and net.layer_dict[l].type == "ReLU"]
    assert inplace, "the net has in-place ReLU layers"
    for layer in inplace:
        producer = [l for l in net._layer_names if net.top_names[l] == net.top_names[layer]][0]
        net.forward(end=producer)
        before = net.blobs[net.top_names[layer][0]].data.copy()
        net.forward(start=layer, end=layer)
        np.testing.assert_allclose(net.blobs[net.top_names[layer][0]].data,
                                   np.maximum(before, 0), rtol=1e-6)


@pytest.mark.shared
def test_net_surgery_copies_params_and_changes_outputs(tmp_path):
    prototxt, weights = _paths(LENET)
    trained = caffe.Net(prototxt, weights, caffe.TEST)
    fresh = caffe.Net(prototxt, caffe.TEST)  # random initial weights
    x = np.random.default_rng(3).random(trained.blobs["data"].shape).astype(np.float32)
    ref = trained.forward(data=x)["prob"].copy()
    assert rel_err(fresh.forward(data=x)["prob"], ref) > 1e-2
    assert list(trained.params) == ["conv1", "conv2", "ip1", "ip2"]
    assert trained.params["conv1"][0].data.shape == (20, 1, 5, 5)  # Caffe's (O, I, kh, kw)
    assert trained.params["ip1"][0].data.shape == (500, 800)
    for name, blobs in trained.params.items():
        for i, b in enumerate(blobs):
            fresh.params[name][i].data[...] = b.data
    assert rel_err(fresh.forward(data=x)["prob"], ref) <= 1e-6
    # change ip2: zero weights and a bias b -> prob = softmax(b) for every image
    b = np.linspace(-1.0, 2.0, 10).astype(np.float32)
    fresh.params["ip2"][0].data[...] = 0.0
    fresh.params["ip2"][1].data[...] = b
    got = fresh.forward(data=x)["prob"]
    want = np.exp(b - b.max()) / np.exp(b - b.max()).sum()
    np.testing.assert_allclose(got, np.tile(want, (len(x), 1)), rtol=1e-5)
    # saved, the surgery reaches OpenCV; copy_from brings the trained weights back
    fresh.save(str(tmp_path / "surgery.caffemodel"))
    (cv,) = opencv_forward(prototxt, tmp_path / "surgery.caffemodel", {"data": x}, ["prob"])
    np.testing.assert_allclose(cv, np.tile(want, (len(x), 1)), rtol=1e-4)
    held = fresh.params["ip2"][0].data  # a reference keeps seeing the weights
    fresh.copy_from(weights)
    assert np.abs(held).sum() > 0
    assert rel_err(fresh.forward(data=x)["prob"], ref) <= 1e-6
    # layer objects
    assert fresh.layer_dict["conv1"].type == "Convolution"
    assert fresh.layers[1].blobs[0].data.shape == (20, 1, 5, 5)


@pytest.mark.shared
def test_classifier_oversamples_like_pycaffe(tmp_path):
    prototxt, weights = _paths(CIFAR)
    clf = caffe.Classifier(prototxt, weights, image_dims=(36, 36), raw_scale=255,
                           channel_swap=(2, 1, 0), mean=np.array([104.0, 117.0, 123.0]))
    img = caffe.io.load_image(str(_color_png(tmp_path / "c.png")))
    pred = clf.predict([img, img[::-1]])
    assert pred.shape == (2, 10)
    # by hand: resize to 36x36, 10 crops of 32x32, preprocess, OpenCV, mean over the crops
    model_in = []
    for im in (img, img[::-1]):
        big = caffe.io.resize_image(im, (36, 36))
        for (i, j) in [(0, 0), (0, 4), (4, 0), (4, 4), (2, 2)]:
            crop = big[i:i + 32, j:j + 32]
            model_in.append(crop)
        model_in.extend(c[:, ::-1] for c in model_in[-5:])
    x = np.stack([(c[:, :, ::-1] * 255 - [104.0, 117.0, 123.0]).transpose(2, 0, 1)
                  for c in model_in]).astype(np.float32)
    (cv,) = opencv_forward(prototxt, weights, {"data": x}, [clf.outputs[0]])
    want = cv.reshape(2, 10, -1).mean(1)
    assert rel_err(pred, want) <= TOL
    centre = clf.predict([img], oversample=False)
    (cv1,) = opencv_forward(prototxt, weights, {"data": x[2 * 0 + 4:5]}, [clf.outputs[0]])
    assert rel_err(centre, cv1.reshape(centre.shape)) <= TOL


@pytest.mark.shared
def test_errors_are_typed_and_one_line(tmp_path):
    prototxt, weights = _paths(LENET)
    net = caffe.Net(prototxt, weights, caffe.TEST)
    cases = [
        (lambda: net.forward(end="conv9"), "end='conv9' is not a layer"),
        (lambda: net.forward(start="nope"), "start='nope' is not a layer"),
        (lambda: net.forward(blobs=["nope"]), "'nope' is not a blob"),
        (lambda: net.forward(image=np.zeros((64, 1, 28, 28))), "do not match"),
        (lambda: net.forward(data=np.zeros((3, 1, 28, 28))), "has shape"),
        (lambda: caffe.Net(str(tmp_path / "missing.prototxt"), caffe.TEST), "not found"),
        (lambda: net.copy_from(str(tmp_path / "missing.caffemodel")), "missing.caffemodel"),
        (lambda: caffe.get_solver(str(tmp_path / "none.prototxt")), "not found"),
    ]
    for fn, match in cases:
        with pytest.raises(CaffeFormatError) as info:
            fn()
        text = str(info.value)
        assert match in text and "\n" not in text, text
    with pytest.raises(ValueError, match="phase must be caffe.TRAIN or caffe.TEST"):
        caffe.Net(prototxt, 5)


@pytest.mark.shared
def test_detector_windows_with_and_without_context(tmp_path):
    prototxt, weights = _paths(CIFAR)
    mean = np.array([104.0, 117.0, 123.0])
    png = str(_color_png(tmp_path / "c.png"))
    img = caffe.io.load_image(png)  # 40 x 48
    windows = np.array([[8, 8, 24, 24], [0, 0, 12, 12], [10, 20, 30, 46]])

    def model_input(crop):  # resize to 32x32, RGB [0,1] -> BGR [0,255] - mean, CHW
        c = caffe.io.resize_image(crop, (32, 32)) if crop.shape[:2] != (32, 32) else crop
        return (c[:, :, ::-1] * 255.0 - mean).transpose(2, 0, 1)

    plain = caffe.Detector(prototxt, weights, mean=mean, raw_scale=255, channel_swap=(2, 1, 0))
    dets = plain.detect_windows([(png, windows)])
    assert [d["filename"] for d in dets] == [png] * 3
    x = np.stack([model_input(img[a:c, b:d]) for a, b, c, d in windows]).astype(np.float32)
    (cv,) = opencv_forward(prototxt, weights, {"data": x}, [plain.outputs[0]])
    got = np.stack([d["prediction"] for d in dets])
    assert rel_err(got, cv.reshape(got.shape)) <= TOL

    ctx = caffe.Detector(prototxt, weights, mean=mean, raw_scale=255, channel_swap=(2, 1, 0),
                         context_pad=4)
    dets = ctx.detect_windows([(png, windows[:2])])
    # by hand, from pycaffe's formulas: window (8, 8, 24, 24) with 4 px of context at 32 px
    # is the box (5, 5, 28, 28) warped to 32x32; window (0, 0, 12, 12) is the box
    # (-2, -2, 15, 15): clipped to (0, 0, 15, 15), warped to 28x28 at offset 4, the rest the
    # mean (in [0, 1] RGB)
    first = caffe.io.resize_image(img[5:28, 5:28], (32, 32))
    second = np.ones((32, 32, 3), np.float32) * (mean[::-1] / 255.0)
    second[4:, 4:] = caffe.io.resize_image(img[0:15, 0:15], (28, 28))
    x = np.stack([model_input(first), model_input(second)]).astype(np.float32)
    (cv,) = opencv_forward(prototxt, weights, {"data": x}, [ctx.outputs[0]])
    got = np.stack([d["prediction"] for d in dets])
    assert rel_err(got, cv.reshape(got.shape)) <= TOL
