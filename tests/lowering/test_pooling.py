"""Max pooling by its window's slices (keras_cct.lowering.pooling) against a float64 numpy
reference that follows Caffe's PoolingLayer: windows clipped to the image, the gradient to each
window's first maximum in row-major order (ties included)."""

import keras
import numpy as np
import pytest

from keras_cct.lowering import _backend, pooling
from tests.backend_grads import layer_grads, to_numpy

RNG = np.random.default_rng(7)


def pool_ref(x, dy, kernel, strides, pads):
    """``(y, dx)`` in float64 for channels-last ``x``: padding never wins a window."""
    n, h, w, c = x.shape
    (kh, kw), (sh, sw), ((top, bottom), (left, right)) = kernel, strides, pads
    oh, ow = (h + top + bottom - kh) // sh + 1, (w + left + right - kw) // sw + 1
    y = np.zeros((n, oh, ow, c))
    dx = np.zeros(x.shape)
    for i in range(oh):
        for j in range(ow):
            hs, ws = i * sh - top, j * sw - left
            he, we = min(hs + kh, h), min(ws + kw, w)
            hs, ws = max(hs, 0), max(ws, 0)
            win = x[:, hs:he, ws:we, :].reshape(n, -1, c)
            first = np.argmax(win, axis=1)            # numpy: the first maximum
            y[:, i, j, :] = np.max(win, axis=1)
            for a in range(n):
                for b in range(c):
                    r, q = divmod(int(first[a, b]), we - ws)
                    dx[a, hs + r, ws + q, b] += dy[a, i, j, b]
    return y, dx


GEOMETRIES = [
    # (input h, w), kernel, strides, ((top, bottom), (left, right))
    ((9, 9), (3, 3), (2, 2), ((0, 0), (0, 0))),    # CaffeNet's pools: exact fit
    ((7, 7), (3, 3), (2, 2), ((0, 1), (0, 1))),    # Caffe's CEIL overhang
    ((7, 8), (3, 3), (2, 2), ((1, 1), (1, 2))),    # padding on every side
    ((6, 6), (2, 2), (2, 2), ((0, 0), (0, 0))),    # VGG's: windows that do not overlap
    ((5, 9), (2, 3), (1, 3), ((1, 0), (2, 1))),    # rectangular everything
    ((6, 7), (3, 3), (1, 1), ((1, 1), (1, 1))),    # GoogLeNet's 3x3 stride 1
    ((8, 8), (2, 2), (3, 3), ((0, 0), (0, 0))),    # a stride longer than the window
]


def _pool_layer(kernel, strides, pads):
    layer = keras.layers.Lambda(lambda t: pooling.max_pool(t, kernel, strides, pads))
    layer.built = True   # no weights (JAX's stateless_call asks)
    return layer


@pytest.fixture
def windowed(monkeypatch):
    """The slices' form on every backend (TensorFlow without oneDNN takes it by default)."""
    monkeypatch.setattr(_backend, "WINDOWED_MAX_POOL", True)


@pytest.mark.parametrize("hw,kernel,strides,pads", GEOMETRIES)
def test_windowed_max_pool_matches_caffe_with_ties(windowed, hw, kernel, strides, pads):
    """Small integers, as after a ReLU: most windows hold their maximum more than once, and
    the gradient must go to the first only."""
    x = RNG.integers(0, 3, size=(2,) + hw + (5,)).astype(np.float32)
    dy = _dy_for(x, kernel, strides, pads)
    y_ref, dx_ref = pool_ref(x.astype(np.float64), dy, kernel, strides, pads)
    assert pooling.windowed(kernel)
    y, (dx,) = layer_grads(_pool_layer(kernel, strides, pads), x, dy.astype(np.float32))
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hw,kernel,strides,pads", GEOMETRIES[:3])
def test_max_pool_as_shipped_matches_caffe(hw, kernel, strides, pads):
    """The backend's default form (its own op where it keeps the slices' form off), on
    distinct values."""
    x = RNG.standard_normal((2,) + hw + (4,)).astype(np.float32)
    dy = _dy_for(x, kernel, strides, pads)
    y_ref, dx_ref = pool_ref(x.astype(np.float64), dy, kernel, strides, pads)
    y, (dx,) = layer_grads(_pool_layer(kernel, strides, pads), x, dy.astype(np.float32))
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6, atol=1e-6)


def test_windowed_max_pool_in_bfloat16(windowed):
    """A bfloat16 input pools to its own values exactly; the gradient is the bfloat16 of the
    summed shares (computed in float32 inside)."""
    hw, kernel, strides, pads = GEOMETRIES[1]
    x = RNG.standard_normal((2,) + hw + (3,)).astype(np.float32)
    xb = to_numpy(keras.ops.cast(keras.ops.cast(x, "bfloat16"), "float32"))
    dy = to_numpy(keras.ops.cast(keras.ops.cast(_dy_for(x, kernel, strides, pads), "bfloat16"),
                                 "float32"))
    y_ref, dx_ref = pool_ref(xb.astype(np.float64), dy, kernel, strides, pads)
    y = pooling.max_pool(keras.ops.cast(x, "bfloat16"), kernel, strides, pads)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    np.testing.assert_array_equal(to_numpy(keras.ops.cast(y, "float32")), y_ref)
    layer = _pool_layer(kernel, strides, pads)
    _, (dx,) = layer_grads(layer, keras.ops.cast(xb, "bfloat16"), dy)
    np.testing.assert_allclose(to_numpy(keras.ops.cast(dx, "float32")), dx_ref, rtol=1e-2,
                               atol=1e-2)


def test_a_large_window_runs_the_backends_op(windowed):
    """Past MAX_TAPS elements (a whole feature map), the slices would be unrolled into the
    program: the backend's op pools it, still right."""
    kernel = (6, 5)
    assert kernel[0] * kernel[1] > pooling.MAX_TAPS and not pooling.windowed(kernel)
    x = RNG.standard_normal((2, 6, 5, 3)).astype(np.float32)
    pads = ((0, 0), (0, 0))
    y_ref, _ = pool_ref(x.astype(np.float64), _dy_for(x, kernel, (1, 1), pads), kernel, (1, 1),
                        pads)
    y = to_numpy(pooling.max_pool(x, kernel, (1, 1)))
    np.testing.assert_allclose(y, y_ref, rtol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="a TensorFlow graph")
def test_windowed_max_pool_with_an_unknown_batch(windowed):
    """In a graph traced with the batch unknown (as ``fit`` traces a model), the clusters take
    any batch: 3 and 5 images through one trace."""
    import tensorflow as tf

    hw, kernel, strides, pads = GEOMETRIES[2]

    @tf.function(input_signature=[tf.TensorSpec((None,) + hw + (4,)),
                                  tf.TensorSpec((None, 4, 5, 4))])
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = pooling.max_pool(x, kernel, strides, pads)
        return y, tape.gradient(y, x, output_gradients=dy)

    for n in (3, 5):
        x = RNG.integers(0, 3, size=(n,) + hw + (4,)).astype(np.float32)
        dy = _dy_for(x, kernel, strides, pads)
        assert dy.shape == (n, 4, 5, 4)
        y_ref, dx_ref = pool_ref(x.astype(np.float64), dy, kernel, strides, pads)
        y, dx = step(x, dy.astype(np.float32))
        np.testing.assert_array_equal(y.numpy(), y_ref)
        np.testing.assert_allclose(dx.numpy(), dx_ref, rtol=1e-6, atol=1e-6)
    assert len(step._list_all_concrete_functions_for_serialization()) == 1


def _dy_for(x, kernel, strides, pads):
    n, h, w, c = x.shape
    oh = (h + sum(pads[0]) - kernel[0]) // strides[0] + 1
    ow = (w + sum(pads[1]) - kernel[1]) // strides[1] + 1
    return np.random.default_rng(oh * 100 + ow).standard_normal((n, oh, ow, c))


@pytest.mark.parametrize("form", ["windowed", "shipped"])
@pytest.mark.parametrize("hw,kernel,strides,pads", [GEOMETRIES[1], GEOMETRIES[5]])
def test_relu_after_pooling_is_the_pooling_of_the_relu(monkeypatch, form, hw, kernel, strides,
                                                       pads):
    """``max_pool(x, relu=True)`` against a ReLU then the pooling in float64: windows all
    negative, all zero and tied, and mixed; Caffe's ReLU gradient is 0 at 0."""
    if form == "windowed":
        monkeypatch.setattr(_backend, "WINDOWED_MAX_POOL", True)
    x = RNG.integers(-2, 2, size=(2,) + hw + (4,)).astype(np.float32)
    dy = _dy_for(x, kernel, strides, pads)
    y_ref, dr = pool_ref(np.maximum(x, 0).astype(np.float64), dy, kernel, strides, pads)
    dx_ref = dr * (x > 0)
    layer = keras.layers.Lambda(lambda t: pooling.max_pool(t, kernel, strides, pads, relu=True))
    layer.built = True
    y, (dx,) = layer_grads(layer, x, dy.astype(np.float32))
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6, atol=1e-6)
    assert np.any(dx_ref != 0) and np.any((y_ref == 0) & (dy != 0))
