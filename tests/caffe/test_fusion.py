"""BatchNorm + Scale fused by the net builder (:mod:`keras_cct.caffe.net.fusion`), against
float64 numpy: which pairs fuse, the output, every gradient, Caffe's moving statistics, the
weights by Caffe layer name, and mixed_bfloat16. Runs on every backend (ci/test)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_cct.caffe import build_net
from keras_cct.caffe.io.text import parse_net
from keras_cct.caffe.net.layers import CaffeBatchNorm
from keras_cct.caffe.net.weights import load_weights, save_weights
from tests.backend_grads import layer_grads, to_numpy
from tests.reference import rel_err

RNG = np.random.default_rng(11)
EPS = 1e-5
SHAPE = (4, 5, 6, 3)  # channels-last (Caffe 4x3x5x6)

_BN = ('layer {{ name: "{name}" type: "BatchNorm" bottom: "{bottom}" top: "{top}" '
       'batch_norm_param {{ use_global_stats: {ugs} eps: 1e-5 moving_average_fraction: 0.5 }} }}\n')
_SCALE = ('layer {{ name: "{name}" type: "Scale" bottom: "{bottom}" top: "{top}" '
          'scale_param {{ bias_term: {bias} {more} }} }}\n')
_HEAD = 'name: "fusion" input: "data" input_shape { dim: 4 dim: 3 dim: 5 dim: 6 }\n'


def _net(*layers: str, **build):
    net, source = parse_net(_HEAD + "".join(layers), path="fusion.prototxt")
    return build_net(net, phase="TRAIN", source=source, **build)


def _bn(name="bn", bottom="data", top="a", ugs="false"):
    return _BN.format(name=name, bottom=bottom, top=top, ugs=ugs)


def _scale(name="sc", bottom="a", top="a", bias="true", more=""):
    return _SCALE.format(name=name, bottom=bottom, top=top, bias=bias, more=more)


def _fused(built):
    return sorted((l.name, l.absorbed.name) for l in built.model.layers
                  if isinstance(l, CaffeBatchNorm) and l.absorbed is not None)


def _set_scale(built, g, b=None):
    layer = built.model.get_layer("sc")
    layer.set_weights([g.astype("f")] + ([] if b is None else [b.astype("f")]))


def _reference(x, dy, g, b):
    """float64: y = xhat * g + b with the batch's statistics, and dx, dg, db."""
    axes = (0, 1, 2)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    inv = 1.0 / np.sqrt(var + EPS)
    xhat = (x - mean) * inv
    dg, db = (dy * xhat).sum(axis=axes), dy.sum(axis=axes)
    dx = g * inv * (dy - dy.mean(axis=axes) - xhat * (dy * xhat).mean(axis=axes))
    return xhat * g + b, dx, dg, db


def test_which_pairs_fuse():
    """In place after its BatchNorm: fused (with or without a bias). A BatchNorm output that
    another layer also reads, or a Scale that is not one value per channel: not fused; and
    ``fuse=False`` keeps every pair apart."""
    assert _fused(_net(_bn(), _scale())) == [("bn", "sc")]
    assert _fused(_net(_bn(), _scale(bias="false"))) == [("bn", "sc")]
    assert _fused(_net(_bn(), _scale(), fuse=False)) == []
    shared = ('layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "c" top: "s" '
              'eltwise_param { operation: SUM } }\n')
    assert _fused(_net(_bn(), _scale(top="c"), shared)) == []
    assert _fused(_net(_bn(), _scale(top="c"))) == []  # "a" stays a named blob
    assert _fused(_net(_bn(), _scale(more="num_axes: 2"))) == []  # a (C, H) scale


@pytest.mark.parametrize("bias", [True, False])
def test_fused_output_and_gradients_against_float64(bias):
    built = _net(_bn(), _scale(bias="true" if bias else "false"))
    assert _fused(built) == [("bn", "sc")]
    g = RNG.uniform(0.5, 2.0, SHAPE[-1])
    b = RNG.standard_normal(SHAPE[-1]) if bias else np.zeros(SHAPE[-1])
    _set_scale(built, g, b if bias else None)
    x = (RNG.standard_normal(SHAPE) * 3 + 2).astype("float32")
    dy = RNG.standard_normal(SHAPE).astype("float32")
    y, grads = layer_grads(built.model, x, dy)
    ry, rdx, rdg, rdb = _reference(x.astype(np.float64), dy.astype(np.float64), g, b)
    assert rel_err(y, ry) < 1e-5
    assert rel_err(grads[0], rdx) < 1e-4
    assert rel_err(grads[1], rdg) < 1e-5
    if bias:
        assert rel_err(grads[2], rdb) < 1e-5
    assert len(grads) == 2 + bias  # the Scale's variables, nothing else trainable


def test_fused_pair_updates_caffes_moving_statistics():
    """The moving blobs of the fused BatchNorm follow Caffe's update (the scale does not
    enter the statistics)."""
    built = _net(_bn(), _scale())
    _set_scale(built, RNG.uniform(0.5, 2.0, 3), RNG.standard_normal(3))
    x = (RNG.standard_normal(SHAPE) * 2 - 1).astype("float32")
    built.model(x, training=True)
    mean, var, s = built.model.get_layer("bn").get_weights()
    m = x.size // x.shape[-1]
    xd = x.astype(np.float64)
    assert rel_err(s, [1.0]) < 1e-6
    assert rel_err(mean, xd.mean(axis=(0, 1, 2))) < 1e-5
    assert rel_err(var, xd.var(axis=(0, 1, 2)) * m / (m - 1)) < 1e-5


def test_global_statistics_fused_against_float64():
    built = _net(_bn(ugs="true"), _scale())
    c = SHAPE[-1]
    mean, var = RNG.standard_normal(c), RNG.uniform(0.5, 2.0, c)
    built.model.get_layer("bn").set_weights([(mean * 2).astype("f"), (var * 2).astype("f"),
                                             np.array([2.0], "f")])
    g, b = RNG.uniform(0.5, 2.0, c), RNG.standard_normal(c)
    _set_scale(built, g, b)
    x = RNG.standard_normal(SHAPE).astype("float32")
    want = (x.astype(np.float64) - mean) / np.sqrt(var + EPS) * g + b
    assert rel_err(to_numpy(built.model(x)), want) < 1e-5


def test_weights_by_caffe_name_match_an_unfused_net(tmp_path):
    """A .caffemodel saved from the fused net loads into the unfused one (same blobs per Caffe
    layer), and both compute the same."""
    fused = _net(_bn(ugs="true"), _scale())
    c = SHAPE[-1]
    fused.model.get_layer("bn").set_weights([RNG.standard_normal(c).astype("f"),
                                             RNG.uniform(0.5, 2, c).astype("f"),
                                             np.array([1.0], "f")])
    _set_scale(fused, RNG.uniform(0.5, 2.0, c), RNG.standard_normal(c))
    path = tmp_path / "w.caffemodel"
    save_weights(fused, path)
    plain = _net(_bn(ugs="true"), _scale(), fuse=False)
    load_weights(plain, str(path))
    x = RNG.standard_normal(SHAPE).astype("float32")
    assert rel_err(to_numpy(plain.model(x)), to_numpy(fused.model(x))) < 1e-6
    assert rel_err(plain.model.get_layer("sc").get_weights()[1],
                   fused.model.get_layer("sc").get_weights()[1]) == 0


def test_fused_pair_under_mixed_bfloat16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        built = _net(_bn(), _scale())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert _fused(built) == [("bn", "sc")]
    g, b = RNG.uniform(0.5, 2.0, 3), RNG.standard_normal(3)
    _set_scale(built, g, b)
    x = (RNG.standard_normal(SHAPE) * 3 + 2).astype("float32")
    y = to_numpy(built.model(x, training=True)).astype(np.float64)
    want = _reference(x.astype(np.float64), np.zeros(SHAPE), g, b)[0]
    assert rel_err(y, want) < 2e-2  # bfloat16 input and output (8 bits of mantissa)
