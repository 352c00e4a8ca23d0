"""The rest of BVLC Caffe's layers (ArgMax, Reduction, MVN, Tile, Embed, Parameter, SPP, Im2col,
BatchReindex, Filter, HDF5Output) against float64 numpy transcriptions of Caffe's CPU loops,
forward and backward (Caffe's backward formulas, or central differences), and against OpenCV's
cv2.dnn where it implements the layer (MVN only, of these: OpenCV 4.x has no ArgMax, Reduction,
Tile, Embed, SPP or Im2col Caffe layer)."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from google.protobuf import text_format

from keras_cct.caffe import proto
from keras_cct.caffe.net import layers as cl
from keras_cct.caffe.net.builder import build_net
from keras_cct.caffe.net.layers import bvlc
from keras_cct.errors import CaffeFormatError, KerasCCTError
from tests.caffe.test_caffe_layers import _numeric_grad, _run, _run_grad, caffe_pool_ref

RNG = np.random.default_rng(7)


def _net(text: str, **shapes):
    """Build a net from prototxt text whose input blob shapes (Caffe order) are ``shapes``."""
    layers = "".join(f'layer {{ name: "{k}" type: "Input" top: "{k}" input_param {{ shape {{ '
                     + " ".join(f"dim: {d}" for d in v) + " } } }\n" for k, v in shapes.items())
    net = text_format.Parse(f'name: "t"\n{layers}{text}', proto.NetParameter())
    return build_net(net)


def _forward(built, *xs_nchw):
    feed = [cl.from_caffe_layout(np.asarray(x, np.float32)) for x in xs_nchw]
    y = built.model(feed if len(feed) > 1 else feed[0])
    ys = y if isinstance(y, (list, tuple)) else [y]
    return [cl.to_caffe_layout(np.asarray(keras.ops.convert_to_numpy(v))) for v in ys]


# -- ArgMax -----------------------------------------------------------------------------------

def np_argmax(x, top_k, out_max_val, axis=None):
    """argmax_layer.cpp Forward_cpu: std::partial_sort with std::greater<pair<value, index>>."""
    if axis is None:
        n = x.shape[0]
        flat = x.reshape(n, -1)
        out = np.zeros((n, 2 if out_max_val else 1, top_k) + (1,) * max(0, x.ndim - 3))
        for i in range(n):
            pairs = sorted(((flat[i, j], j) for j in range(flat.shape[1])), reverse=True)[:top_k]
            for j, (v, idx) in enumerate(pairs):
                out[i, 0, j] = idx
                if out_max_val:
                    out[i, 1, j] = v
        return out
    moved = np.moveaxis(x, axis, -1)
    out = np.zeros(moved.shape[:-1] + (top_k,))
    for pos in np.ndindex(moved.shape[:-1]):
        pairs = sorted(((moved[pos][j], j) for j in range(moved.shape[-1])), reverse=True)[:top_k]
        out[pos] = [v if out_max_val else idx for v, idx in pairs]
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("top_k,out_max_val,axis", [(1, False, None), (3, True, None),
                                                    (2, False, 1), (2, True, 2), (1, False, 3),
                                                    (2, True, -1)])
def test_argmax_matches_caffe(top_k, out_max_val, axis):
    x = RNG.integers(0, 5, size=(2, 4, 3, 5)).astype(np.float64)  # many ties
    field = "" if axis is None else f"axis: {axis}"
    built = _net(f'layer {{ name: "am" type: "ArgMax" bottom: "x" top: "y" argmax_param {{ '
                 f'top_k: {top_k} out_max_val: {str(out_max_val).lower()} {field} }} }}',
                 x=(2, 4, 3, 5))
    got = _forward(built, x)[0]
    want = np_argmax(x, top_k, out_max_val, None if axis is None else axis % 4)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_argmax_2d():
    x = RNG.normal(size=(3, 7))
    got = _run(bvlc.CaffeArgMax(2, True), x)
    np.testing.assert_allclose(got, np_argmax(x, 2, True), rtol=1e-6)


# -- Reduction --------------------------------------------------------------------------------

def np_reduction(x, op, axis, coeff):
    """reduction_layer.cpp: per outer position, reduce the trailing count(axis) values."""
    outer = x.shape[:axis]
    flat = x.reshape(int(np.prod(outer)), -1)
    f = {"SUM": lambda v: v.sum(), "ASUM": lambda v: np.abs(v).sum(),
         "SUMSQ": lambda v: (v * v).sum(), "MEAN": lambda v: v.mean()}[op]
    return np.array([f(r) * coeff for r in flat]).reshape(outer)


def np_reduction_backward(x, op, axis, coeff, dy):
    """reduction_layer.cpp Backward_cpu."""
    flat = x.reshape(int(np.prod(x.shape[:axis])), -1)
    dyf = np.asarray(dy).reshape(-1, 1)
    g = {"SUM": np.ones_like(flat), "ASUM": np.sign(flat), "SUMSQ": 2 * flat,
         "MEAN": np.full_like(flat, 1.0 / flat.shape[1])}[op]
    return (g * coeff * dyf).reshape(x.shape)


@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1])
def test_reduction_forward_backward(op, axis):
    x = RNG.normal(size=(2, 3, 4, 5))
    a = axis % 4
    layer = bvlc.CaffeReduction(op, axis, coeff=-0.7)
    dy = RNG.normal(size=x.shape[:a])
    y, dx = _run_grad(layer, x, dy)[:2]
    np.testing.assert_allclose(y, np_reduction(x, op, a, -0.7), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, np_reduction_backward(x, op, a, -0.7, dy), rtol=1e-5,
                               atol=1e-5)


def test_reduction_net_and_scalar_top():
    x = RNG.normal(size=(2, 3, 4, 5))
    built = _net('layer { name: "r" type: "Reduction" bottom: "x" top: "y" '
                 'reduction_param { operation: SUMSQ axis: 2 coeff: 2 } }', x=(2, 3, 4, 5))
    np.testing.assert_allclose(_forward(built, x)[0], np_reduction(x, "SUMSQ", 2, 2.0),
                               rtol=1e-5)
    built = _net('layer { name: "r" type: "Reduction" bottom: "x" top: "y" }', x=(2, 3, 4, 5))
    assert float(_forward(built, x)[0]) == pytest.approx(x.sum(), rel=1e-5)


# -- MVN --------------------------------------------------------------------------------------

def np_mvn(x, normalize_variance=True, across_channels=False, eps=1e-9):
    """mvn_layer.cpp Forward_cpu: eps is added to the standard deviation."""
    n = x.shape[0] if across_channels else x.shape[0] * x.shape[1]
    flat = x.reshape(n, -1)
    out = flat - flat.mean(axis=1, keepdims=True)
    if normalize_variance:
        std = np.sqrt((out ** 2).mean(axis=1, keepdims=True))
        out = out / (std + eps)
    return out.reshape(x.shape)


@pytest.mark.parametrize("nv,ac,eps", [(True, False, 1e-9), (False, False, 1e-9),
                                       (True, True, 0.01), (False, True, 1e-9)])
def test_mvn_forward_backward(nv, ac, eps):
    x = RNG.normal(size=(2, 3, 4, 5)) * 3 + 1
    dy = RNG.normal(size=x.shape)
    y, dx = _run_grad(bvlc.CaffeMVN(nv, ac, eps), x, dy)
    np.testing.assert_allclose(y, np_mvn(x, nv, ac, eps), rtol=1e-4, atol=1e-5)
    want = _numeric_grad(lambda v: np_mvn(v, nv, ac, eps), x, dy)
    np.testing.assert_allclose(dx, want, rtol=1e-3, atol=1e-4)


def test_mvn_constant_input_has_finite_gradient():
    x = np.ones((1, 2, 3, 3))
    y, dx = _run_grad(bvlc.CaffeMVN(), x, RNG.normal(size=x.shape))
    assert np.all(y == 0) and np.all(np.isfinite(dx))


@pytest.mark.parametrize("fields", ["", "normalize_variance: false", "across_channels: true",
                                    "across_channels: true normalize_variance: false"])
def test_mvn_matches_opencv(tmp_path, fields):
    """OpenCV with Caffe's default eps (1e-9). OpenCV divides by ``sqrt(var + eps)`` where
    Caffe divides by ``sqrt(var) + eps``, so a large eps is checked against numpy only."""
    cv2 = pytest.importorskip("cv2")
    text = ('name: "t"\ninput: "x"\ninput_shape { dim: 2 dim: 3 dim: 4 dim: 5 }\n'
            f'layer {{ name: "mvn" type: "MVN" bottom: "x" top: "y" mvn_param {{ {fields} }} }}\n')
    path = tmp_path / "mvn.prototxt"
    path.write_text(text)
    x = (RNG.normal(size=(2, 3, 4, 5)) * 2 + 0.5).astype(np.float32)
    net = cv2.dnn.readNetFromCaffe(str(path))
    net.enableFusion(False)
    net.setInput(x)
    want = net.forward()
    from keras_cct.caffe.net.builder import import_net
    got = _forward(import_net(str(path)), x)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# -- Tile -------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis,tiles", [(1, 3), (2, 2), (3, 1), (-1, 2)])
def test_tile_forward_backward(axis, tiles):
    x = RNG.normal(size=(2, 3, 4, 5))
    a = axis % 4
    reps = [1, 1, 1, 1]
    reps[a] = tiles
    want = np.tile(x, reps)  # tile_layer.cpp copies the whole inner block `tiles` times
    dy = RNG.normal(size=want.shape)
    y, dx = _run_grad(bvlc.CaffeTile(axis, tiles), x, dy)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    split = np.split(dy, tiles, axis=a)  # Backward_cpu: the copies' gradients summed
    np.testing.assert_allclose(dx, np.sum(split, axis=0), rtol=1e-5, atol=1e-6)


def test_tile_net():
    x = RNG.normal(size=(2, 3))
    built = _net('layer { name: "t" type: "Tile" bottom: "x" top: "y" tile_param { tiles: 2 } }',
                 x=(2, 3))
    np.testing.assert_allclose(_forward(built, x)[0], np.tile(x, (1, 2)), rtol=1e-6)


# -- Embed ------------------------------------------------------------------------------------

def test_embed_forward_backward_and_weights(tmp_path):
    idx = RNG.integers(0, 6, size=(3, 4)).astype(np.float64)  # Caffe (N, T) -> (N, T, 5)
    layer = bvlc.CaffeEmbed(5, 6, bias_term=True)
    layer.build(idx.shape)
    w = RNG.normal(size=(6, 5))
    b = RNG.normal(size=(5,))
    layer.set_weights([w.astype(np.float32), b.astype(np.float32)])
    dy = RNG.normal(size=(3, 4, 5))
    y, _, dw, db = _run_grad(layer, idx, dy, "kernel", "bias")
    want = w[idx.astype(int)] + b  # embed_layer.cpp: top = W[index] + bias
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    dw_want = np.zeros_like(w)  # Backward_cpu: each row accumulates its items' gradients
    for pos in np.ndindex(idx.shape):
        dw_want[int(idx[pos])] += dy[pos]
    np.testing.assert_allclose(dw, dw_want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dy.reshape(-1, 5).sum(0), rtol=1e-5, atol=1e-5)


def test_embed_caffemodel_round_trip(tmp_path):
    from keras_cct.caffe.io.binary import blob_to_array, read_caffemodel
    from keras_cct.caffe.net.weights import load_weights, save_weights
    text = ('layer { name: "emb" type: "Embed" bottom: "x" top: "y" '
            'embed_param { num_output: 4 input_dim: 7 } }')
    built = _net(text, x=(2,))
    w = RNG.normal(size=(7, 4)).astype(np.float32)
    b = RNG.normal(size=(4,)).astype(np.float32)
    built.model.get_layer("emb").set_weights([w, b])
    save_weights(built, tmp_path / "e.caffemodel")
    blobs = [lp for lp in read_caffemodel(tmp_path / "e.caffemodel").layer
             if lp.name == "emb"][0].blobs
    np.testing.assert_array_equal(blob_to_array(blobs[0]), w)  # Caffe's (input_dim, num_output)
    np.testing.assert_array_equal(blob_to_array(blobs[1]), b)
    other = _net(text, x=(2,))
    load_weights(other, tmp_path / "e.caffemodel")
    x = np.array([3.0, 6.0])
    np.testing.assert_allclose(_forward(other, x)[0], w[[3, 6]] + b, rtol=1e-6)


# -- Parameter --------------------------------------------------------------------------------

def test_parameter_blob_and_gradient():
    layer = bvlc.CaffeParameter([2, 3, 4])
    layer.build((1,))
    blob = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    layer.set_weights([blob])
    from keras_cct.caffe.net.weights import caffe_type_of, keras_layer_to_blobs
    assert caffe_type_of(layer) == "Parameter"
    np.testing.assert_array_equal(keras_layer_to_blobs(layer)[0], blob)
    y = keras.ops.convert_to_numpy(layer(np.zeros((5, 1), np.float32)))
    np.testing.assert_array_equal(cl.to_caffe_layout(y), blob)  # channels-last top
    dy = RNG.normal(size=(2, 3, 4))
    _, _, dblob = _run_grad(layer, np.zeros((5, 1)), dy, "blob")
    np.testing.assert_allclose(dblob, dy, rtol=1e-6)


def test_parameter_in_a_prototxt_net(tmp_path):
    """A Parameter layer (no bottom) builds from a prototxt, its blob comes and goes through a
    caffemodel, and a net adding it to its input computes data + blob (Caffe's NCHW)."""
    from keras_cct.caffe.net.builder import load_net
    from keras_cct.caffe.net.weights import load_weights, save_weights
    text = """name: "p"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }
layer { name: "bias" type: "Parameter" top: "bias"
        parameter_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }
layer { name: "sum" type: "Eltwise" bottom: "data" bottom: "bias" top: "sum" }
"""
    path = tmp_path / "p.prototxt"
    path.write_text(text)
    model = load_net(str(path))
    blob = RNG.normal(size=(2, 3, 4, 5)).astype(np.float32)
    model.get_layer("bias").set_weights([blob])
    save_weights(model, tmp_path / "p.caffemodel")
    again = load_net(str(path))
    load_weights(again, tmp_path / "p.caffemodel")
    x = RNG.normal(size=(2, 3, 4, 5)).astype(np.float32)
    y = keras.ops.convert_to_numpy(again(cl.from_caffe_layout(x)))
    np.testing.assert_allclose(cl.to_caffe_layout(y), x + blob, rtol=1e-6)


# -- SPP --------------------------------------------------------------------------------------

def np_spp(x, height, pool):
    """spp_layer.cpp: per level a Caffe pooling with GetPoolingParam's kernel/pad (stride =
    kernel), flattened and concatenated."""
    n, _, h, w = x.shape
    outs = []
    for level in range(height):
        bins = 2 ** level
        kh, kw = math.ceil(h / bins), math.ceil(w / bins)
        ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
        outs.append(caffe_pool_ref(x, pool, (kh, kw), (kh, kw), (ph, pw)).reshape(n, -1))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("height,hw", [(1, (5, 7)), (2, (5, 7)), (3, (13, 11)), (4, (16, 16))])
def test_spp_forward_backward(pool, height, hw):
    x = RNG.normal(size=(2, 3) + hw)
    built = _net(f'layer {{ name: "spp" type: "SPP" bottom: "x" top: "y" '
                 f'spp_param {{ pyramid_height: {height} pool: {pool} }} }}', x=(2, 3) + hw)
    got = _forward(built, x)[0]
    want = np_spp(x, height, pool)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    layer = built.model.get_layer("spp")
    dy = RNG.normal(size=want.shape)
    x1 = x[:1]
    _, dx = _run_grad(layer, x1, dy[:1])[:2]
    num = _numeric_grad(lambda v: np_spp(v, height, pool), x1, dy[:1])
    np.testing.assert_allclose(dx, num, rtol=1e-3, atol=1e-4)


# -- Im2col -----------------------------------------------------------------------------------

def _im2col_cells(x_shape, k, s, p, d):
    """util/im2col.cpp's loops: ``(column row, output y, x, input channel, row, col)`` of each
    in-image cell of the column buffer, and the output size."""
    _, c, h, w = x_shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = k, s, p, d
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    cells = []
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                for y in range(oh):
                    for z in range(ow):
                        r, q = y * sh - ph + i * dh, z * sw - pw + j * dw
                        if 0 <= r < h and 0 <= q < w:
                            cells.append(((ch * kh + i) * kw + j, y, z, ch, r, q))
    return cells, (oh, ow)


def np_im2col(x, k, s, p, d):
    """im2col_cpu, per item: channel (c * kh + i) * kw + j; padding reads zeros."""
    cells, (oh, ow) = _im2col_cells(x.shape, k, s, p, d)
    out = np.zeros((x.shape[0], x.shape[1] * k[0] * k[1], oh, ow))
    for row, y, z, ch, r, q in cells:
        out[:, row, y, z] = x[:, ch, r, q]
    return out


def np_col2im(col, x_shape, k, s, p, d):
    """col2im_cpu: each column entry added back into its pixel (the backward)."""
    dx = np.zeros(x_shape)
    for row, y, z, ch, r, q in _im2col_cells(x_shape, k, s, p, d)[0]:
        dx[:, ch, r, q] += col[:, row, y, z]
    return dx


@pytest.mark.parametrize("fields,k,s,p,d", [
    ("kernel_size: 3", (3, 3), (1, 1), (0, 0), (1, 1)),
    ("kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1), (1, 1)),
    ("kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0 dilation: 2",
     (2, 3), (1, 2), (1, 0), (2, 2))])
def test_im2col_forward_backward(fields, k, s, p, d):
    x = RNG.normal(size=(2, 3, 6, 7))
    built = _net(f'layer {{ name: "i2c" type: "Im2col" bottom: "x" top: "y" '
                 f'convolution_param {{ {fields} }} }}', x=(2, 3, 6, 7))
    want = np_im2col(x, k, s, p, d)
    np.testing.assert_allclose(_forward(built, x)[0], want, rtol=1e-6)
    dy = RNG.normal(size=want.shape)
    _, dx = _run_grad(built.model.get_layer("i2c"), x, dy)[:2]
    np.testing.assert_allclose(dx, np_col2im(dy, x.shape, k, s, p, d), rtol=1e-5, atol=1e-5)


# -- BatchReindex and Filter ------------------------------------------------------------------

class _Bound(keras.layers.Layer):
    """A two-input layer with its second input fixed (for the one-input gradient helper)."""

    def __init__(self, inner, second, **kwargs):
        super().__init__(**kwargs)
        self.inner, self.second = inner, np.asarray(second, np.float32)

    def call(self, x):
        y = self.inner([x, keras.ops.convert_to_tensor(self.second)])
        return y[0] if isinstance(y, (list, tuple)) else y


def test_batch_reindex_forward_backward():
    x = RNG.normal(size=(4, 3, 2, 2))
    permut = np.array([2.0, 0.0, 2.0, 3.0, 2.0])
    built = _net('layer { name: "br" type: "BatchReindex" bottom: "x" bottom: "p" top: "y" }',
                 x=(4, 3, 2, 2), p=(5,))
    np.testing.assert_allclose(_forward(built, x, permut)[0], x[permut.astype(int)], rtol=1e-6)
    dy = RNG.normal(size=(5, 3, 2, 2))
    _, dx = _run_grad(_Bound(bvlc.CaffeBatchReindex(), permut), x, dy)[:2]
    want = np.zeros_like(x)  # batch_reindex_layer.cpp Backward: gradients accumulate
    for i, j in enumerate(permut.astype(int)):
        want[j] += dy[i]
    np.testing.assert_allclose(dx, want, rtol=1e-5, atol=1e-6)


def test_filter_forward_backward_eager():
    x = RNG.normal(size=(5, 3, 2, 2))
    lab = RNG.normal(size=(5, 2))
    sel = np.array([1.0, 0.0, 0.0, 2.0, -1.0])
    built = _net('layer { name: "f" type: "Filter" bottom: "x" bottom: "l" bottom: "s" '
                 'top: "fx" top: "fl" }', x=(5, 3, 2, 2), l=(5, 2), s=(5, 1))
    outs = dict(zip(built.outputs, _forward(built, x, lab, sel.reshape(5, 1))))
    fx, fl = outs["fx"], outs["fl"]
    keep = [0, 3, 4]
    np.testing.assert_allclose(fx, x[keep], rtol=1e-6)
    np.testing.assert_allclose(fl, lab[keep], rtol=1e-6)
    dy = RNG.normal(size=(3, 3, 2, 2))
    _, dx = _run_grad(_Bound(bvlc.CaffeFilter(), sel), x, dy)[:2]
    want = np.zeros_like(x)  # filter_layer.cpp Backward: kept items get theirs, others 0
    want[keep] = dy
    np.testing.assert_allclose(dx, want, rtol=1e-6)


def test_filter_where_it_cannot_run():
    with pytest.raises(CaffeFormatError, match="selector"):
        _net('layer { name: "f" type: "Filter" bottom: "x" bottom: "s" top: "fx" }',
             x=(5, 3), s=(5, 2))
    if keras.backend.backend() != "jax":
        pytest.skip("only JAX cannot trace a data-dependent batch size")
    import jax
    layer = bvlc.CaffeFilter()
    with pytest.raises(KerasCCTError, match="eagerly"):
        jax.jit(lambda a, s: layer([a, s]))(np.ones((3, 2), np.float32),
                                            np.ones((3,), np.float32))


# -- HDF5Output -------------------------------------------------------------------------------

def test_hdf5_output_writes_caffe_datasets(tmp_path):
    h5py = pytest.importorskip("h5py")
    x = RNG.normal(size=(3, 2, 4, 5)).astype(np.float32)
    lab = np.arange(3, dtype=np.float32)
    path = tmp_path / "out.h5"
    layer = bvlc.CaffeHDF5Output(str(path))
    out = layer([cl.from_caffe_layout(x), lab])
    np.testing.assert_array_equal(cl.to_caffe_layout(keras.ops.convert_to_numpy(out)), x)
    with h5py.File(path, "r") as f:
        assert sorted(f) == ["data", "label"]
        np.testing.assert_array_equal(f["data"][()], x)  # Caffe's NCHW, float32
        np.testing.assert_array_equal(f["label"][()], lab.reshape(3, 1, 1, 1))
        assert f["data"].dtype == np.float32
    with pytest.raises(CaffeFormatError, match="no top"):
        _net('layer { name: "h" type: "HDF5Output" bottom: "x" bottom: "l" '
             'hdf5_output_param { file_name: "o.h5" } }', x=(3, 2), l=(3,))
    if keras.backend.backend() == "tensorflow":  # compiled, it cannot write: a typed error
        import tensorflow as tf
        with pytest.raises(KerasCCTError, match="eagerly"):
            tf.function(lambda a, b: layer([a, b]))(cl.from_caffe_layout(x), lab)


def test_layers_round_trip_config():
    for layer in [bvlc.CaffeArgMax(2, True, 1), bvlc.CaffeReduction("ASUM", 2, 0.5),
                  bvlc.CaffeMVN(False, True, 0.1), bvlc.CaffeTile(2, 3), bvlc.CaffeEmbed(3, 4),
                  bvlc.CaffeParameter([2, 3]), bvlc.CaffeSPP(3, "AVE"),
                  bvlc.CaffeIm2col((2, 3), 1, (1, 0), 2), bvlc.CaffeHDF5Output("a.h5")]:
        again = type(layer).from_config(layer.get_config())
        assert again.get_config() == layer.get_config()


def test_filter_in_a_compiled_function():
    """TensorFlow (predict's tf.function) and PyTorch run Filter compiled; JAX cannot."""
    if keras.backend.backend() == "jax":
        pytest.skip("JAX cannot trace a data-dependent batch size (see the test above)")
    built = _net('layer { name: "f" type: "Filter" bottom: "x" bottom: "s" top: "fx" }',
                 x=(5, 3), s=(5, 1))
    x = RNG.normal(size=(5, 3)).astype(np.float32)
    s = np.array([[1], [0], [1], [0], [3]], np.float32)
    got = built.model.predict([x, s], verbose=0, batch_size=5)
    np.testing.assert_allclose(got, x[[0, 2, 4]], rtol=1e-6)


@pytest.mark.parametrize("layer,shape,match", [
    ('type: "ArgMax" argmax_param { top_k: 9 axis: 1 }', (2, 4, 3, 5), "top_k"),
    ('type: "ArgMax" argmax_param { axis: 4 }', (2, 4, 3, 5), "axis 4 is out of range"),
    ('type: "Tile"', (2, 3), "tiles"),
    ('type: "Tile" tile_param { axis: 0 tiles: 2 }', (2, 3), "batch"),
    ('type: "Embed" embed_param { num_output: 3 }', (2,), "input_dim"),
    # Caffe's pooling refuses pad >= kernel: 4 bins over 5 rows need kernel 2, pad 2
    ('type: "SPP" spp_param { pyramid_height: 3 }', (1, 2, 5, 8), "pad 2 >= kernel 2"),
    ('type: "SPP" spp_param { pyramid_height: 2 pool: STOCHASTIC }', (1, 2, 4, 4),
     "STOCHASTIC"),
    ('type: "SPP"', (1, 2), "4-D"),
    ('type: "Im2col" convolution_param { kernel_size: 2 axis: 2 }', (1, 2, 4, 4), "axis"),
    ('type: "MVN" mvn_param { eps: -1 }', (1, 2, 4, 4), "eps"),
    ('type: "Parameter" parameter_param { shape { dim: 2 } }', (1, 2), "no bottom"),
])
def test_bad_params_name_the_layer(layer, shape, match):
    with pytest.raises(CaffeFormatError, match=match) as e:
        _net(f'layer {{ name: "bad" {layer} bottom: "x" top: "y" }}', x=shape)
    assert "layer 'bad'" in str(e.value)
