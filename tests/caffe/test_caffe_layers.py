"""Keras layers with Caffe's semantics against numpy float64 transcriptions of Caffe's loops."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

from keras_cct.caffe.net import layers as cl
from tests.caffe.caffe_numpy import caffe_lrn_across, caffe_lrn_across_backward
from tests.reference import rel_err

RNG = np.random.default_rng(0)


def _run(layer, x_nchw, *more):
    """Call a layer on Caffe-ordered arrays, return the Caffe-ordered result."""
    xs = [cl.from_caffe_layout(np.asarray(a, np.float32)) for a in (x_nchw,) + more]
    y = layer(xs if more else xs[0])
    if isinstance(y, (list, tuple)):
        return [cl.to_caffe_layout(keras.ops.convert_to_numpy(v)) for v in y]
    return cl.to_caffe_layout(keras.ops.convert_to_numpy(y))


def _run_grad(layer, x_nchw, dy_nchw, *weights):
    """The layer's output and the gradients of ``sum(y * dy)`` with respect to its input and to
    ``weights`` (names of its variables), on Caffe-ordered arrays, with the backend's autodiff."""
    x = cl.from_caffe_layout(np.asarray(x_nchw, np.float32))
    dy = cl.from_caffe_layout(np.asarray(dy_nchw, np.float32))
    if not layer.built:
        layer.build(x.shape)
    backend = keras.backend.backend()
    ws = [getattr(layer, name) for name in weights]
    if backend == "tensorflow":
        import tensorflow as tf
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt)
        grads = tape.gradient(y, [xt] + ws, output_gradients=tf.constant(dy))
    elif backend == "jax":
        import jax
        vals = [w.value for w in ws]

        def f(xx, *vv):
            return layer.stateless_call(vv, [v.value for v in layer.non_trainable_weights],
                                        xx)[0] if ws else layer(xx)
        y, vjp = jax.vjp(f, x, *vals)
        grads = list(vjp(dy))
    else:
        import torch
        xt = torch.tensor(x, requires_grad=True)
        y = layer(xt)
        y.backward(torch.tensor(dy))
        grads = [xt.grad] + [w.value.grad for w in ws]
    out = [keras.ops.convert_to_numpy(y)] + [keras.ops.convert_to_numpy(g) for g in grads]
    return [cl.to_caffe_layout(out[0]), cl.to_caffe_layout(out[1])] + out[2:]


def _numeric_grad(f, x, dy, eps=1e-6):
    """d sum(f(x) * dy) / dx by central differences (float64)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = np.sum((f(xp) - f(xm)) * dy) / (2 * eps)
    return g


def caffe_pool_ref(x, pool, k, s, p, ceil=True, global_pool=False):
    """PoolingLayer::Forward_cpu, transcribed (NCHW, float64)."""
    n, c, h, w = x.shape
    if global_pool:
        k, s, p = (h, w), (1, 1), (0, 0)
    (kh, kw), (sh, sw), (ph, pw) = k, s, p
    rnd = math.ceil if ceil else math.floor
    oh = int(rnd((h + 2 * ph - kh) / sh)) + 1
    ow = int(rnd((w + 2 * pw - kw) / sw)) + 1
    if ph or pw:
        if (oh - 1) * sh >= h + ph:
            oh -= 1
        if (ow - 1) * sw >= w + pw:
            ow -= 1
    y = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            hs, ws = i * sh - ph, j * sw - pw
            if pool == "MAX":
                he, we = min(hs + kh, h), min(ws + kw, w)
                hs, ws = max(hs, 0), max(ws, 0)
                y[:, :, i, j] = x[:, :, hs:he, ws:we].max(axis=(2, 3))
            else:
                he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                size = (he - hs) * (we - ws)
                hs, ws = max(hs, 0), max(ws, 0)
                he, we = min(he, h), min(we, w)
                y[:, :, i, j] = x[:, :, hs:he, ws:we].sum(axis=(2, 3)) / size
    return y


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("hw,k,s,p,ceil", [
    ((7, 7), (3, 3), (2, 2), (0, 0), True),    # CEIL overhang: last window partly outside
    ((7, 8), (3, 3), (2, 2), (1, 1), True),    # padding + the "starts inside" rule
    ((6, 6), (2, 2), (2, 2), (1, 1), True),    # pad with a window that would start in the pad
    ((7, 7), (3, 3), (2, 2), (1, 1), False),   # FLOOR
    ((5, 9), (2, 3), (1, 3), (1, 2), True),    # rectangular everything
])
def test_pooling_matches_caffe(pool, hw, k, s, p, ceil):
    x = RNG.standard_normal((2, 3) + hw)
    layer = cl.CaffePooling2D(pool, k, s, p, round_mode="CEIL" if ceil else "FLOOR")
    y = _run(layer, x)
    ref = caffe_pool_ref(x, pool, k, s, p, ceil)
    assert y.shape == ref.shape
    assert rel_err(y, ref) < 1e-6


def caffe_pool_backward_ref(x, dy, pool, k, s, p):
    """PoolingLayer::Backward_cpu (NCHW, float64): MAX to the first maximum of each window
    (Caffe's mask), AVE spread over the window, divided by its size clipped to the padded image."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = k, s, p
    dx = np.zeros_like(x)
    for i in range(dy.shape[2]):
        for j in range(dy.shape[3]):
            hs, ws = i * sh - ph, j * sw - pw
            if pool == "MAX":
                he, we = min(hs + kh, h), min(ws + kw, w)
                hs, ws = max(hs, 0), max(ws, 0)
                win = x[:, :, hs:he, ws:we].reshape(n, c, -1)
                first = np.argmax(win, axis=2)
                for a in range(n):
                    for b in range(c):
                        r, q = divmod(int(first[a, b]), we - ws)
                        dx[a, b, hs + r, ws + q] += dy[a, b, i, j]
            else:
                he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                size = (he - hs) * (we - ws)
                hs, ws = max(hs, 0), max(ws, 0)
                he, we = min(he, h), min(we, w)
                dx[:, :, hs:he, ws:we] += dy[:, :, i:i + 1, j:j + 1] / size
    return dx


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("hw,k,s,p", [
    ((7, 7), (3, 3), (2, 2), (0, 0)),    # CEIL overhang: a padded last row and column
    ((9, 9), (3, 3), (2, 2), (0, 0)),    # exact fit (CaffeNet's pools): no pad, no slice
    ((7, 8), (3, 3), (2, 2), (1, 1)),    # padding + the "starts inside" rule
])
def test_pooling_gradient_matches_caffe(pool, hw, k, s, p):
    x = RNG.standard_normal((2, 3) + hw)
    layer = cl.CaffePooling2D(pool, k, s, p)
    ref = caffe_pool_ref(x, pool, k, s, p)
    dy = RNG.standard_normal(ref.shape)
    y, dx = _run_grad(layer, x, dy)
    assert y.shape == ref.shape and rel_err(y, ref) < 1e-6
    assert rel_err(dx, caffe_pool_backward_ref(x, dy, pool, k, s, p)) < 1e-6


def test_global_pooling():
    x = RNG.standard_normal((2, 3, 5, 4))
    for pool in ("MAX", "AVE"):
        y = _run(cl.CaffePooling2D(pool, global_pooling=True), x)
        assert rel_err(y, caffe_pool_ref(x, pool, None, None, None, global_pool=True)) < 1e-6


def test_lrn_within_channel_matches_caffe():
    """WITHIN_CHANNEL: x * (1 + alpha * mean_{n x n window, zero padded} x^2) ^ -beta; k is
    not used by Caffe there."""
    x = RNG.standard_normal((2, 3, 6, 5))
    n, alpha, beta = 3, 0.7, 0.8
    y = _run(cl.CaffeLRN(n, alpha, beta, k=5.0, norm_region="WITHIN_CHANNEL"), x)
    pad = np.pad(x ** 2, ((0, 0), (0, 0), (1, 1), (1, 1)))
    avg = sum(pad[:, :, i:i + 6, j:j + 5] for i in range(n) for j in range(n)) / (n * n)
    assert rel_err(y, x * (1 + alpha * avg) ** -beta) < 1e-5


@pytest.mark.parametrize("shape,n,alpha,beta,k", [
    ((2, 7, 5, 3), 5, 2.0, 0.75, 1.0),     # Caffe's default exponent (the rsqrt form)
    ((2, 3, 3, 5), 5, 3.0, 0.75, 2.0),     # fewer channels than the window: clipped both sides
    ((1, 1, 2, 3), 3, 1.5, 0.5, 1.0),      # one channel; beta 0.5
    ((2, 6, 1, 1), 7, 1.0, 1.0, 1.5),      # 1x1 image (fc-like); beta 1
    ((3, 9, 3, 2), 3, 0.8, 0.6, 0.5),      # a general exponent: exp(-beta log s)
])
def test_lrn_across_channels_matches_caffe(shape, n, alpha, beta, k):
    """ACROSS_CHANNELS: the output and the input gradient against Caffe's CPU loops
    (CrossChannelForward/Backward_cpu) in float64; that backward is checked against finite
    differences of the forward first."""
    x = RNG.standard_normal(shape)
    dy = RNG.standard_normal(shape)
    ref, _ = caffe_lrn_across(x, n, alpha, beta, k)
    dref = caffe_lrn_across_backward(x, dy, n, alpha, beta, k)
    if x.size <= 100:
        fd = _numeric_grad(lambda v: caffe_lrn_across(v, n, alpha, beta, k)[0], x, dy)
        assert rel_err(dref, fd) < 1e-7
    y, dx = _run_grad(cl.CaffeLRN(n, alpha, beta, k), x, dy)
    assert y.shape == ref.shape and rel_err(y, ref) < 2e-6
    assert rel_err(dx, dref) < 2e-6


def test_lrn_across_channels_alexnet_parameters():
    """CaffeNet's LRN (local_size 5, alpha 1e-4, beta 0.75) on activations of its size."""
    x = np.abs(RNG.standard_normal((2, 96, 3, 4))) * 60.0
    dy = RNG.standard_normal(x.shape)
    y, dx = _run_grad(cl.CaffeLRN(5, 1e-4, 0.75, 1.0), x, dy)
    assert rel_err(y, caffe_lrn_across(x, 5, 1e-4, 0.75, 1.0)[0]) < 2e-6
    assert rel_err(dx, caffe_lrn_across_backward(x, dy, 5, 1e-4, 0.75, 1.0)) < 2e-6


def test_lrn_within_channel_gradient():
    x = RNG.standard_normal((1, 2, 4, 3))
    dy = RNG.standard_normal(x.shape)
    n, alpha, beta = 3, 0.7, 0.8

    def ref(v):
        pad = np.pad(v ** 2, ((0, 0), (0, 0), (1, 1), (1, 1)))
        avg = sum(pad[:, :, i:i + 4, j:j + 3] for i in range(n) for j in range(n)) / (n * n)
        return v * (1 + alpha * avg) ** -beta
    y, dx = _run_grad(cl.CaffeLRN(n, alpha, beta, norm_region="WITHIN_CHANNEL"), x, dy)
    assert rel_err(y, ref(x)) < 2e-6
    assert rel_err(dx, _numeric_grad(ref, x, dy)) < 1e-5


def test_batch_norm_inference_and_caffe_training_update():
    c = 4
    x = RNG.standard_normal((3, c, 5, 2)) * 2 + 1
    mean, var, s = RNG.standard_normal(c), RNG.uniform(0.5, 2, c), 4.0
    layer = cl.CaffeBatchNorm(eps=1e-3, moving_average_fraction=0.9)
    layer.build((None, 5, 2, c))
    layer.set_weights([(mean * s).astype("f"), (var * s).astype("f"), np.array([s], "f")])
    y = _run(layer, x)
    ref = (x - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-3)
    assert rel_err(y, ref) < 1e-5
    # training: batch statistics, and Caffe's moving-average update with m/(m-1)
    xin = cl.from_caffe_layout(x.astype("f"))
    yt = cl.to_caffe_layout(keras.ops.convert_to_numpy(layer(xin, training=True)))
    bm, bv = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    assert rel_err(yt, (x - bm[:, None, None]) / np.sqrt(bv[:, None, None] + 1e-3)) < 1e-5
    m = 3 * 5 * 2
    new_mean, new_var, new_s = layer.get_weights()
    assert rel_err(new_s, [0.9 * s + 1]) < 1e-6
    assert rel_err(new_mean, 0.9 * mean * s + bm) < 1e-5
    assert rel_err(new_var, 0.9 * var * s + bv * m / (m - 1)) < 1e-5


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 5), (1, 3, 1, 1)])
def test_batch_norm_batch_statistics_gradient_against_float64(shape):
    """The backend's fused batch normalization (batch statistics) and its gradient, against
    Caffe's formula in float64; one value per channel normalizes to 0 and adds no variance."""
    x = RNG.standard_normal(shape) * 3 + 2
    dy = RNG.standard_normal(shape)
    axes = tuple(a for a in range(len(shape)) if a != 1)
    mean, var = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    xhat = (x - mean) / np.sqrt(var + 1e-5)
    dx = (dy - dy.mean(axis=axes, keepdims=True)
          - xhat * (dy * xhat).mean(axis=axes, keepdims=True)) / np.sqrt(var + 1e-5)
    y, gx = _run_grad(cl.CaffeBatchNorm(1e-5, use_global_stats=False), x, dy)
    assert rel_err(y, xhat) < 1e-5 or np.abs(y - xhat).max() < 1e-5
    assert np.abs(gx - dx).max() < 1e-4 * max(1.0, np.abs(dx).max())
    layer = cl.CaffeBatchNorm(1e-5, moving_average_fraction=0.5)
    xin = cl.from_caffe_layout(x.astype("f"))
    layer(xin, training=True)
    m = x.size // shape[1]
    bv = var.reshape(-1) * (m / (m - 1) if m > 1 else 0.0)
    assert np.abs(layer.get_weights()[1] - bv).max() < 1e-4 * max(1.0, np.abs(bv).max())
    assert np.isfinite(layer.get_weights()[1]).all()


def test_scale_and_bias_axes():
    x = RNG.standard_normal((2, 3, 4, 5))
    # per channel with bias
    layer = cl.CaffeScale(axis=1, num_axes=1, bias_term=True)
    layer.build((None, 4, 5, 3))
    g, b = RNG.standard_normal(3), RNG.standard_normal(3)
    layer.set_weights([g.astype("f"), b.astype("f")])
    assert rel_err(_run(layer, x), x * g[:, None, None] + b[:, None, None]) < 1e-6
    # axis 1, num_axes 2: a (C, H) parameter
    layer = cl.CaffeScale(axis=1, num_axes=2)
    layer.build((None, 4, 5, 3))
    g2 = RNG.standard_normal((3, 4))
    layer.set_weights([g2.astype("f")])
    assert rel_err(_run(layer, x), x * g2[:, :, None]) < 1e-6
    # axis 2, num_axes -1: an (H, W) bias
    layer = cl.CaffeBias(axis=2, num_axes=-1)
    layer.build((None, 4, 5, 3))
    b2 = RNG.standard_normal((4, 5))
    layer.set_weights([b2.astype("f")])
    assert rel_err(_run(layer, x), x + b2) < 1e-6
    # two inputs, axis 0: scale by a (N, C) blob (squeeze-and-excitation style)
    s = RNG.standard_normal((2, 3))
    assert rel_err(_run(cl.CaffeScale(axis=0, num_axes=-1), x, s),
                   x * s[:, :, None, None]) < 1e-6


def test_inner_product_flattens_in_caffe_order_and_axis():
    x = RNG.standard_normal((2, 3, 4, 5))
    w, b = RNG.standard_normal((6, 60)), RNG.standard_normal(6)
    layer = cl.CaffeInnerProduct(6)
    layer.build((None, 4, 5, 3))
    layer.set_weights([w.astype("f"), b.astype("f")])
    assert rel_err(_run(layer, x), x.reshape(2, -1) @ w.T + b) < 1e-5
    # axis 2: (N, C, H*W) -> (N, C, 6)
    w2 = RNG.standard_normal((6, 20))
    layer = cl.CaffeInnerProduct(6, axis=2, bias_term=False)
    layer.build((None, 4, 5, 3))
    layer.set_weights([w2.astype("f")])
    assert rel_err(_run(layer, x), x.reshape(2, 3, 20) @ w2.T) < 1e-5


@pytest.mark.parametrize("axis,bias,o", [(1, True, 6), (2, False, 6), (3, True, 6),
                                         (1, True, 64)])
def test_inner_product_gradients(axis, bias, o):
    """Input, kernel and bias gradients of ``y = flat(x) W^T + b`` (Caffe's flatten order from
    Caffe axis ``axis``), written out in float64. ``o=64``: 16 or more outputs per row of the
    batch, which TensorFlow computes as ``(W @ x^T)^T``."""
    x = RNG.standard_normal((3, 4, 5, 2))
    lead, k = x.shape[:axis], int(np.prod(x.shape[axis:]))
    w, b = RNG.standard_normal((o, k)), RNG.standard_normal(o)
    layer = cl.CaffeInnerProduct(o, axis=axis, bias_term=bias)
    layer.build(cl.keras_shape(x.shape))
    layer.set_weights([w.astype("f"), b.astype("f")] if bias else [w.astype("f")])
    xf = x.reshape(lead + (k,))
    ref = xf @ w.T + (b if bias else 0)
    dy = RNG.standard_normal(ref.shape)
    names = ("kernel", "bias") if bias else ("kernel",)
    got = _run_grad(layer, x, dy, *names)
    assert got[0].shape == ref.shape and rel_err(got[0], ref) < 1e-5
    assert rel_err(got[1], (dy @ w).reshape(x.shape)) < 1e-5
    dyf, xf2 = dy.reshape(-1, o), xf.reshape(-1, k)
    assert rel_err(got[2], dyf.T @ xf2) < 1e-5
    if bias:
        assert rel_err(got[3], dyf.sum(axis=0)) < 1e-5


@pytest.mark.parametrize("mode", ["float32", "keep"])
def test_inner_product_under_mixed_bfloat16(monkeypatch, mode):
    """Under ``mixed_bfloat16`` the product is bfloat16 out, computed in float32 where this
    machine computes 16-bit products slower (``$KERAS_CCT_16BIT`` forces either): both within
    the output's rounding of the float64 product of the bfloat16-rounded inputs."""
    monkeypatch.setenv("KERAS_CCT_16BIT", mode)
    x = RNG.standard_normal((4, 16, 2, 3))
    w, b = RNG.standard_normal((32, 96)), RNG.standard_normal(32)
    layer = cl.CaffeInnerProduct(32, dtype="mixed_bfloat16")
    layer.build(cl.keras_shape(x.shape))
    layer.set_weights([w.astype("f"), b.astype("f")])
    y = layer(cl.from_caffe_layout(x.astype("f")))
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"

    def bf16(a):
        t = keras.ops.cast(keras.ops.cast(np.asarray(a, np.float32), "bfloat16"), "float32")
        return keras.ops.convert_to_numpy(t).astype(np.float64)

    want = bf16(x).reshape(4, -1) @ bf16(w).T + bf16(b)
    got = keras.ops.convert_to_numpy(keras.ops.cast(y, "float32"))
    assert rel_err(got, want) < 2.0 ** -7


@pytest.mark.parametrize("o,g,k,s,p,d", [(6, 2, 3, 2, 1, 2), (3, 1, 2, 3, 0, 1),
                                         (4, 4, 4, 2, 1, 1)])
def test_deconvolution_is_the_scatter_of_caffe(o, g, k, s, p, d):
    """Caffe's deconvolution, written as a scatter: y[o, i*s - p + a*d, ...] += x[c] w[c, o]
    (cases: grouped + dilated, kernel smaller than the stride, depthwise upsampling)."""
    n, c, h, w = 2, 4, 3, 4
    x = RNG.standard_normal((n, c, h, w))
    wt = RNG.standard_normal((c, o // g, k, k))
    oh, ow = s * (h - 1) + d * (k - 1) + 1 - 2 * p, s * (w - 1) + d * (k - 1) + 1 - 2 * p
    full = np.zeros((n, o, oh + 2 * p, ow + 2 * p))
    cg, og = c // g, o // g
    for ci in range(c):
        grp = ci // cg
        for oi in range(og):
            for a in range(k):
                for bb in range(k):
                    full[:, grp * og + oi, a * d:a * d + s * (h - 1) + 1:s,
                         bb * d:bb * d + s * (w - 1) + 1:s] += x[:, ci] * wt[ci, oi, a, bb]
    ref = full[:, :, p:p + oh, p:p + ow]
    layer = cl.CaffeDeconvolution(o, k, s, p, d, g, use_bias=False)
    layer.build((None, h, w, c))
    layer.set_weights([np.transpose(wt, (2, 3, 1, 0)).astype("f")])
    y = _run(layer, x)
    assert y.shape == ref.shape and rel_err(y, ref) < 1e-5


def test_unary_formulas():
    x = RNG.uniform(0.2, 3.0, (2, 3, 2, 2))
    cases = [
        (cl.CaffeUnary("Exp", base=2.0, scale=0.5, shift=0.1), 2.0 ** (0.1 + 0.5 * x)),
        (cl.CaffeUnary("Exp"), np.exp(x)),
        (cl.CaffeUnary("Log", base=10.0, scale=2.0, shift=1.0), np.log10(1 + 2 * x)),
        (cl.CaffeUnary("Log"), np.log(x)),
        (cl.CaffeUnary("Power", power=-0.5, scale=3.0, shift=0.5), (0.5 + 3 * x) ** -0.5),
        (cl.CaffeUnary("Clip", min=0.5, max=1.5), np.clip(x, 0.5, 1.5)),
        (cl.CaffeUnary("Threshold", threshold=1.0), (x > 1.0).astype(float)),
        (cl.CaffeUnary("BNLL"), np.log1p(np.exp(x))),
        (cl.CaffeUnary("AbsVal"), np.abs(x)),
    ]
    for layer, ref in cases:
        assert rel_err(_run(layer, x), ref) < 1e-5, layer.op


def test_shape_layers_follow_caffe_axes():
    x = RNG.standard_normal((2, 6, 3, 4))
    assert rel_err(_run(cl.CaffeFlatten(axis=2), x), x.reshape(2, 6, 12)) < 1e-6
    assert rel_err(_run(cl.CaffeReshape([0, 3, -1]), x), x.reshape(2, 3, 24)) < 1e-6
    assert rel_err(_run(cl.CaffeSoftmax(axis=2), x),
                   np.exp(x) / np.exp(x).sum(axis=2, keepdims=True)) < 1e-6
    parts = _run(cl.CaffeSlice(axis=3, slice_points=[1, 3], num_outputs=3), x)
    for got, ref in zip(parts, np.split(x, [1, 3], axis=3)):
        assert rel_err(got, ref) < 1e-6
    both = _run(cl.CaffeConcat(axis=2), x, x[:, :, :1])
    assert rel_err(both, np.concatenate([x, x[:, :, :1]], axis=2)) < 1e-6
    ref_blob = np.zeros((2, 6, 2, 2))
    assert rel_err(_run(cl.CaffeCrop(axis=2, offset=[1, 2]), x, ref_blob),
                   x[:, :, 1:3, 2:4]) < 1e-6
    out = _run(cl.CaffeEltwise("SUM", [2.0, -1.0]), x, x ** 2)
    assert rel_err(out, 2 * x - x ** 2) < 1e-6


def test_layers_round_trip_through_keras_files(tmp_path):
    inp = keras.Input((7, 8, 4))
    y = cl.CaffePooling2D("AVE", 3, 2, 1, round_mode="FLOOR")(inp)
    y = cl.CaffeLRN(3, 0.5, 0.75, 2.0)(y)
    y = cl.CaffeBatchNorm(1e-3)(y)
    y = cl.CaffeScale(bias_term=True)(y)
    y = cl.CaffePReLU()(y)
    y = cl.CaffeDeconvolution(3, 3, 2, 1)(y)
    y = cl.CaffeUnary("Power", power=2.0, shift=1.0)(y)
    y = cl.CaffeInnerProduct(5)(y)
    model = keras.Model(inp, y)
    for layer in model.layers:
        if layer.weights:
            layer.set_weights([RNG.uniform(0.5, 1.5, w.shape).astype("f")
                               for w in layer.get_weights()])
    path = tmp_path / "m.keras"
    model.save(path)
    again = keras.saving.load_model(path)
    x = RNG.standard_normal((2, 7, 8, 4)).astype("f")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(again(x)), keras.ops.convert_to_numpy(model(x)), rtol=1e-6)
    for a, b in zip(model.layers, again.layers):
        assert a.get_config() == b.get_config()
