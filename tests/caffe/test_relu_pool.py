"""A ReLU followed by a MAX Pooling, built by the net builder as the ReLU of the pooled input
(``build_net(fuse=True)``, the default) against the same net built layer by layer
(``fuse=False``) and a float64 numpy reference: the output, the gradients of the input and of
the convolution before it, and which pairs are built so. Runs on every backend (ci/test)."""

from __future__ import annotations

import numpy as np
import pytest

from keras_cct.caffe import build_net
from keras_cct.caffe.io.text import parse_net
from keras_cct.caffe.net.layers import CaffePooling2D
from tests.backend_grads import layer_grads
from tests.lowering.test_pooling import pool_ref

RNG = np.random.default_rng(5)
_HEAD = 'name: "relu_pool" input: "data" input_shape { dim: 2 dim: 3 dim: 9 dim: 9 }\n'
_CONV = ('layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
         'convolution_param { num_output: 4 kernel_size: 1 } }\n')
_POOL = ('layer {{ name: "pool" type: "Pooling" bottom: "{bottom}" top: "pool" '
         'pooling_param {{ pool: {pool} kernel_size: 3 stride: 2 }} }}\n')


def _relu(top="conv", slope=""):
    param = f"relu_param {{ negative_slope: {slope} }}" if slope else ""
    return f'layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "{top}" {param} }}\n'


def _net(*layers: str, fuse: bool = True):
    net, source = parse_net(_HEAD + "".join(layers), path="relu_pool.prototxt")
    return build_net(net, phase="TRAIN", source=source, fuse=fuse)


def _pool_layer(built) -> CaffePooling2D:
    return built.model.get_layer("pool")


def _set_conv(built, w, b):
    built.model.get_layer("conv").set_weights([w, b])


@pytest.mark.parametrize("in_place", [True, False])
def test_relu_then_max_pool_is_pooled_first(in_place):
    """Caffe's in-place ReLU (top = bottom) and a ReLU with a top of its own: the pooling reads
    the convolution's output and applies the ReLU; output and gradients equal the layer-by-layer
    net's and float64 numpy's (a 1x1 convolution of integers: ties and zeros in most windows)."""
    top = "conv" if in_place else "r"
    layers = [_CONV, _relu(top), _POOL.format(bottom=top, pool="MAX")]
    fused, plain = _net(*layers), _net(*layers, fuse=False)
    assert _pool_layer(fused).relu and not _pool_layer(plain).relu
    w = RNG.integers(-1, 2, size=(1, 1, 3, 4)).astype(np.float32)
    b = np.zeros(4, np.float32)
    for built in (fused, plain):
        _set_conv(built, w, b)
    x = RNG.integers(-2, 3, size=(2, 9, 9, 3)).astype(np.float32)
    dy = RNG.standard_normal((2, 4, 4, 4)).astype(np.float32)
    conv = np.einsum("nhwc,co->nhwo", x.astype(np.float64), w[0, 0].astype(np.float64))
    y_ref, dr = pool_ref(np.maximum(conv, 0), dy.astype(np.float64), (3, 3), (2, 2),
                         ((0, 0), (0, 0)))
    dconv = dr * (conv > 0)
    dw_ref = np.einsum("nhwc,nhwo->co", x.astype(np.float64), dconv)
    results = [layer_grads(built.model, x, dy) for built in (fused, plain)]
    for y, (_, dw, db) in results:
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_allclose(dw[0, 0], dw_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(db, dconv.sum(axis=(0, 1, 2)), rtol=1e-5, atol=1e-5)
    assert np.any(dconv != 0) and np.any(conv <= 0)


@pytest.mark.parametrize("layers", [
    [_CONV, _relu(slope="0.1"), _POOL.format(bottom="conv", pool="MAX")],   # a leaky ReLU
    [_CONV, _relu(), _POOL.format(bottom="conv", pool="AVE")],              # average pooling
])
def test_only_a_plain_relu_before_max_pooling_is_moved(layers):
    assert not _pool_layer(_net(*layers)).relu
