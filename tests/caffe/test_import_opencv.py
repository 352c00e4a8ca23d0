"""Imported Caffe nets against OpenCV's independent Caffe importer (cv2.dnn, fusion off).

Real trained models from ../shared/caffe-models, every prototxt-only net with random weights
written by our ``save_weights`` (so the caffemodel round trip is tested too), and a small "zoo"
net with most layer types. Relative error bound: 1e-4 (float32).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from keras_cct.caffe import build_net, import_net, load_net, read_net, save_weights
from keras_cct.caffe.net.layout import from_caffe_layout, to_caffe_layout
from tests.caffe.import_helpers import NETS, opencv_forward, producer_of, randomize
from tests.conftest import need_shared
from tests.reference import rel_err

cv2 = pytest.importorskip("cv2")
TOL = 1e-4


def _compare(net, prototxt, caffemodel, x_nchw, blobs=None, tol=TOL):
    """Max relative error of each blob (default: every model output) vs OpenCV."""
    blobs = list(blobs or net.outputs)
    layers = [producer_of(net.net_param, b) for b in blobs]
    inp = list(net.inputs)[0]
    refs = opencv_forward(prototxt, caffemodel, {inp: x_nchw}, layers)
    vals = net.submodel(blobs)(from_caffe_layout(x_nchw))
    vals = vals if isinstance(vals, (list, tuple)) else [vals]
    errs = {}
    for b, ref, val in zip(blobs, refs, vals):
        ours = to_caffe_layout(keras.ops.convert_to_numpy(val))
        assert ours.size == ref.size, (b, ours.shape, ref.shape)
        errs[b] = rel_err(ours.reshape(ref.shape), ref)
    bad = {b: e for b, e in errs.items() if not e <= tol}
    assert not bad, f"relative error above {tol}: {bad}"
    return errs


REAL = [
    ("lenet_mnist/lenet.prototxt", "lenet_mnist/lenet_iter_10000.caffemodel", (1, 1, 28, 28)),
    ("mtcnn/det1.prototxt", "mtcnn/det1.caffemodel", None),
    ("mtcnn/det2.prototxt", "mtcnn/det2.caffemodel", None),
    ("cifar10_quick_v1/cifar10_quick.prototxt",
     "cifar10_quick_v1/cifar10_quick_iter_5000.caffemodel", None),
    ("resnet50_stem/test.prototxt", "resnet50_stem/test.caffemodel", None),
]


@pytest.mark.shared
@pytest.mark.parametrize("prototxt,weights,shape", REAL, ids=[r[0].split("/")[0] + "-" +
                                                             r[0].split("/")[1] for r in REAL])
def test_real_model_matches_opencv(prototxt, weights, shape):
    root = need_shared("caffe-models")
    net = import_net(root / prototxt, root / weights, input_shape=shape)
    cshape = net.caffe_input_shapes()[list(net.inputs)[0]]
    x = np.random.default_rng(0).standard_normal((2,) + tuple(cshape[1:])).astype(np.float32)
    x *= 50.0 if "lenet" in prototxt else 1.0  # LeNet's first conv expects 0..255 inputs
    errs = _compare(net, root / prototxt, root / weights, x)
    assert errs


@pytest.mark.shared
def test_real_lenet_weights_are_the_trained_ones():
    """The loaded kernel equals the caffemodel blob transposed (not just "close outputs")."""
    from keras_cct.caffe import read_caffemodel
    from keras_cct.caffe.net.weights import blob_array
    root = need_shared("caffe-models", "lenet_mnist")
    model = load_net(root / "lenet.prototxt", root / "lenet_iter_10000.caffemodel")
    cm = {lp.name: lp for lp in read_caffemodel(root / "lenet_iter_10000.caffemodel").layer}
    w = blob_array(cm["conv2"].blobs[0])                       # (50, 20, 5, 5)
    np.testing.assert_array_equal(model.get_layer("conv2").get_weights()[0],
                                  np.transpose(w, (2, 3, 1, 0)))
    ip = blob_array(cm["ip1"].blobs[0])                        # (500, 800)
    np.testing.assert_array_equal(model.get_layer("ip1").get_weights()[0], ip)
    assert model.output_names == ["prob"] and model.layers[0].name == "data"
    assert type(model.get_layer("conv1")).__name__ == "HybridConv2D"


# prototxt-only nets: (path, input shape or None, blobs to compare besides the outputs)
PROTOTXT_ONLY = [
    ("bvlc_alexnet/deploy.prototxt", (1, 3, 67, 67), ["fc8"]),
    ("bvlc_reference_caffenet/deploy.prototxt", (1, 3, 67, 67), ["fc8"]),
    ("squeezenet_v1.1/deploy.prototxt", (1, 3, 64, 64), ["conv10"]),
    ("vgg16/deploy.prototxt", (1, 3, 32, 32), ["fc8"]),
    ("bvlc_googlenet/deploy.prototxt", (1, 3, 224, 224), ["loss3/classifier"]),
    ("resnet50/ResNet-50-deploy.prototxt", (1, 3, 224, 224), ["fc1000"]),
    # OpenCV gets depthwise convs on 1x1 inputs wrong; 64x64 keeps the last maps 2x2
    ("mobilenet_caffe/mobilenet_deploy.prototxt", (1, 3, 64, 64), ["fc7"]),
    ("mobilenet_caffe/mobilenet_v2_deploy.prototxt", (1, 3, 64, 64), ["fc7"]),
    ("bvlc_cifar10_examples/cifar10_full.prototxt", None, ["ip1"]),
    ("bvlc_cifar10_examples/cifar10_quick.prototxt", None, ["ip2"]),
    ("bvlc_mnist_examples/lenet.prototxt", (1, 1, 28, 28), ["ip2"]),
]


# The big nets compile slowly op by op on JAX (minutes on 2 cores); the importer is backend
# independent and every layer type is checked on every backend by the zoo, real-model and
# layer tests, so by default the big nets run on the TensorFlow backend only
# (CCT_CAFFE_BIG_NETS=all runs them everywhere).
BIG = ("bvlc_alexnet", "bvlc_reference_caffenet", "vgg16", "bvlc_googlenet", "resnet50",
       "mobilenet_caffe", "squeezenet_v1.1")


@pytest.mark.shared
@pytest.mark.slow
@pytest.mark.parametrize("path,shape,extra", PROTOTXT_ONLY,
                         ids=[p[0].split("/")[0] for p in PROTOTXT_ONLY])
def test_prototxt_only_random_weights_match_opencv(path, shape, extra, tmp_path):
    if (path.split("/")[0] in BIG and keras.backend.backend() != "tensorflow"
            and os.environ.get("CCT_CAFFE_BIG_NETS", "") != "all"):
        pytest.skip("big nets run on the TensorFlow backend (CCT_CAFFE_BIG_NETS=all: all)")
    prototxt = need_shared("caffe-models", "prototxt-only", *path.split("/"))
    net = import_net(prototxt, input_shape=shape)
    randomize(net.model, seed=1)
    weights = tmp_path / "random.caffemodel"
    save_weights(net, weights)
    cshape = net.caffe_input_shapes()[list(net.inputs)[0]]
    x = np.random.default_rng(2).standard_normal((1,) + tuple(cshape[1:])).astype(np.float32)
    _compare(net, prototxt, weights, x, blobs=net.outputs + extra)


@pytest.mark.shared
@pytest.mark.parametrize("path", ["bvlc_alexnet/train_val.prototxt",
                                  "squeezenet_v1.1/train_val.prototxt",
                                  "bvlc_googlenet/train_val.prototxt",
                                  "bvlc_cifar10_examples/cifar10_full_sigmoid_train_test_bn.prototxt",
                                  "bvlc_mnist_examples/mnist_autoencoder.prototxt"])
def test_train_val_nets_build_in_both_phases(path):
    """Data layers become inputs, losses/accuracies become heads whose bottoms are outputs."""
    prototxt = need_shared("caffe-models", "prototxt-only", *path.split("/"))
    param = read_net(prototxt)
    small = (2, 3, 227, 227) if "alexnet" in path or "googlenet" in path else None
    for phase in ("TRAIN", "TEST"):
        shapes = {}
        if small:
            shapes = {"data": small}
        elif "cifar" in path:
            shapes = {"data": (2, 3, 32, 32)}
        elif "mnist" in path:
            shapes = {"data": (2, 1, 28, 28)}
        elif "squeezenet" in path:
            shapes = {"data": (2, 3, 227, 227)}
        stages = ("test-on-test",) if "autoencoder" in path and phase == "TEST" else ()
        net = build_net(param, phase=phase, stages=stages, input_shapes=shapes,
                        source=prototxt)
        assert "data" in net.inputs
        assert net.heads, "train/test nets have loss heads"
        for head in net.heads:
            for b in head.bottoms:
                assert b in net.outputs or b in net.inputs
        assert net.model.output_names == net.output_layer_names
        assert len(net.model.outputs) == len(net.outputs)
        if phase == "TEST":
            assert any(h.type == "Accuracy" and h.loss_weight == 0 for h in net.heads) or \
                "autoencoder" in path


def test_zoo_of_layer_types_matches_opencv(tmp_path):
    prototxt = NETS / "zoo.prototxt"
    net = import_net(prototxt)
    assert net.outputs == ["flat", "gpool", "ip", "sm"]  # unconsumed blobs, sorted (Caffe)
    randomize(net.model, seed=3)
    weights = tmp_path / "zoo.caffemodel"
    save_weights(net, weights)
    x = np.random.default_rng(0).standard_normal((2, 4, 9, 11)).astype(np.float32)
    blobs = ["conv", "dil", "deconv", "crop", "sum", "prod", "max", "lrn1", "lrn2", "cat", "s1",
             "apool", "mpool", "gpool", "tanh", "pow", "bnll", "elu", "flat", "ip", "resh", "sm"]
    _compare(net, prototxt, weights, x, blobs=blobs)


def test_lrn_with_k_against_caffe_formula():
    """OpenCV ignores lrn_param.k; check ACROSS_CHANNELS LRN with k=2 against Caffe's formula
    in numpy: y = x * (k + alpha/n * sum_{window} x^2)^-beta."""
    from keras_cct.caffe.io.text import parse_net
    text = ('name: "lrn" input: "data" input_shape { dim: 2 dim: 7 dim: 3 dim: 4 }\n'
            'layer { name: "norm" type: "LRN" bottom: "data" top: "norm"\n'
            '  lrn_param { local_size: 5 alpha: 0.3 beta: 0.6 k: 2 } }\n')
    param, _ = parse_net(text)
    model = build_net(param).model
    x = np.random.default_rng(0).standard_normal((2, 7, 3, 4))
    y = to_caffe_layout(keras.ops.convert_to_numpy(model(from_caffe_layout(x.astype(np.float32)))))
    n, alpha, beta, k = 5, 0.3, 0.6, 2.0
    ref = np.empty_like(x)
    for c in range(7):
        lo, hi = max(0, c - 2), min(7, c - 2 + n)
        scale = k + alpha / n * np.sum(x[:, lo:hi] ** 2, axis=1)
        ref[:, c] = x[:, c] * scale ** -beta
    assert rel_err(y, ref) < 1e-5


def test_inner_product_transpose_blob_round_trips_through_opencv(tmp_path):
    """``transpose: true`` stores the InnerProduct weight as (K, O) and computes ``x @ W``
    (Caffe's gemm with CblasNoTrans); save_weights writes it so. OpenCV 4 ignores the flag, so
    the reference is Caffe's formula in numpy."""
    prototxt = tmp_path / "t.prototxt"
    prototxt.write_text('name: "t" input: "data" input_shape { dim: 2 dim: 3 dim: 2 dim: 2 }\n'
                        'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"\n'
                        '  inner_product_param { num_output: 5 transpose: true } }\n')
    net = import_net(prototxt)
    randomize(net.model)
    weights = tmp_path / "t.caffemodel"
    save_weights(net, weights)
    from keras_cct.caffe import read_caffemodel
    assert tuple(read_caffemodel(weights).layer[0].blobs[0].shape.dim) == (12, 5)
    again = import_net(prototxt, weights)
    np.testing.assert_array_equal(again.model.get_layer("fc").get_weights()[0],
                                  net.model.get_layer("fc").get_weights()[0])
    from keras_cct.caffe.net.weights import blob_array
    blob = blob_array(read_caffemodel(weights).layer[0].blobs[0]).astype(np.float64)
    bias = blob_array(read_caffemodel(weights).layer[0].blobs[1]).astype(np.float64)
    x = np.random.default_rng(0).standard_normal((2, 3, 2, 2)).astype(np.float32)
    y = keras.ops.convert_to_numpy(again.model(from_caffe_layout(x)))
    assert rel_err(y, x.reshape(2, 12).astype(np.float64) @ blob + bias) < 1e-5
