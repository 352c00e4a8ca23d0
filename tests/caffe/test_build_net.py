"""The build_net contract the training code relies on: inputs, heads, outputs, names, order."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_cct.caffe import build_net, import_net, read_net
from keras_cct.caffe.io.text import parse_net
from tests.conftest import need_shared


@pytest.mark.shared
def test_lenet_train_test_in_both_phases():
    path = need_shared("caffe-models", "prototxt-only", "bvlc_mnist_examples",
                       "lenet_train_test.prototxt")
    param = read_net(path)
    train = build_net(param, phase="TRAIN", input_shapes={"data": (64, 1, 28, 28)},
                      source=path)
    assert list(train.inputs) == ["data", "label"]
    assert train.inputs["data"] == (64, 28, 28, 1) and train.inputs["label"] == (64,)
    assert [(h.name, h.type, h.bottoms, h.loss_weight) for h in train.heads] == [
        ("loss", "SoftmaxWithLoss", ["ip2", "label"], 1.0)]
    assert train.outputs == ["ip2", "label"] and train.model.output_names == ["ip2", "label"]
    assert train.phase == "TRAIN"
    test = build_net(param, phase="TEST", input_shapes={"data": (100, 1, 28, 28)}, source=path)
    assert [h.type for h in test.heads] == ["Accuracy", "SoftmaxWithLoss"]
    assert test.heads[0].loss_weight == 0.0 and test.heads[0].param.accuracy_param.top_k == 1
    # the TEST net of load_net: heads dropped, the unused label is not an input
    deploy = import_net(path, input_shape=(1, 1, 28, 28))
    assert list(deploy.inputs) == ["data"] and deploy.outputs == ["ip2"]
    # Keras layer names are Caffe layer names; variables in Caffe blob order
    assert [l.name for l in train.model.layers if l.weights] == ["conv1", "conv2", "ip1", "ip2"]
    conv1 = train.model.get_layer("conv1")
    assert [tuple(w.shape) for w in conv1.weights] == [(5, 5, 1, 20), (20,)]


NET = """name: "names"
input: "data"
input_shape { dim: 1 dim: 3 dim: 6 dim: 6 }
layer { name: "block/conv" type: "Convolution" bottom: "data" top: "block/conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 bias_term: false } }
layer { name: "block/bn" type: "BatchNorm" bottom: "block/conv" top: "block/conv" }
layer { name: "block/scale" type: "Scale" bottom: "block/conv" top: "block/conv"
  scale_param { bias_term: true } }
layer { name: "fc7" type: "InnerProduct" bottom: "block/conv" top: "fc7"
  inner_product_param { num_output: 3 } }
layer { name: "relu7" type: "ReLU" bottom: "fc7" top: "fc7" }
layer { name: "branch" type: "Sigmoid" bottom: "block/conv" top: "zzz" }
"""


def test_names_in_place_outputs_and_variable_order():
    param, source = parse_net(NET, path="names.prototxt")
    net = build_net(param, source=source)
    names = [l.name for l in net.model.layers]
    assert "block__conv" in names and "block__bn" in names
    assert net.caffe_names["block__conv"] == "block/conv"
    # 'fc7' is produced in place by relu7; the output layer cannot reuse the layer name fc7
    assert net.outputs == ["fc7", "zzz"]
    assert net.output_layer_names == ["fc7_blob", "zzz"]  # 'zzz' is free: an Identity
    assert net.model.output_names == net.output_layer_names
    bn = net.model.get_layer("block__bn")
    assert [w.name for w in bn.weights] == ["mean", "variance", "scale_factor"]
    assert [w.trainable for w in bn.weights] == [False, False, False]
    sc = net.model.get_layer("block__scale")
    assert [tuple(w.shape) for w in sc.weights] == [(4,), (4,)]
    x = np.ones((2, 6, 6, 3), np.float32)
    fc7, _ = net.model(x)
    assert float(keras.ops.min(fc7)) >= 0.0  # relu7 applied to the fc7 output


def test_input_shapes_override_and_batch_stays_dynamic():
    param, source = parse_net(NET, path="names.prototxt")
    net = build_net(param, source=source, input_shapes={"data": (5, 3, 8, 8)})
    assert net.inputs["data"] == (5, 8, 8, 3)
    assert tuple(net.model.inputs[0].shape) == (None, 8, 8, 3)
    out = net.model(np.zeros((7, 8, 8, 3), np.float32))
    assert out[0].shape[0] == 7


@pytest.mark.shared
def test_keras_conv2d_variant_has_the_same_weights_and_outputs():
    root = need_shared("caffe-models", "mtcnn")
    hybrid = import_net(root / "det2.prototxt", root / "det2.caffemodel")
    plain = import_net(root / "det2.prototxt", root / "det2.caffemodel", conv_impl="keras")
    assert type(plain.model.get_layer("conv1")).__name__ == "Conv2D"
    assert type(hybrid.model.get_layer("conv1")).__name__ == "HybridConv2D"
    x = np.random.default_rng(0).standard_normal((3, 24, 24, 3)).astype(np.float32)
    for a, b in zip(hybrid.model(x), plain.model(x)):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b),
                                   rtol=1e-4, atol=1e-6)
    opts = import_net(root / "det2.prototxt", conv_options={"lowering": "type1"})
    assert opts.model.get_layer("conv2").get_config()["lowering"] == "type1"


def test_reshape_with_the_batch_size_written_out():
    """Deploy nets often write ``dim: 1`` (their batch) in a Reshape; the model keeps a
    dynamic batch, and the values follow Caffe's C-major order."""
    text = ('name: "r" input: "data" input_shape { dim: 1 dim: 2 dim: 3 dim: 4 }\n'
            'layer { name: "r" type: "Reshape" bottom: "data" top: "r"\n'
            '  reshape_param { shape { dim: 1 dim: -1 dim: 4 } } }\n')
    param, source = parse_net(text)
    net = build_net(param, source=source)
    x = np.random.default_rng(0).standard_normal((3, 2, 3, 4)).astype(np.float32)
    from keras_cct.caffe.net.layout import from_caffe_layout, to_caffe_layout
    y = to_caffe_layout(keras.ops.convert_to_numpy(net.model(from_caffe_layout(x))))
    np.testing.assert_array_equal(y, x.reshape(3, 6, 4))
