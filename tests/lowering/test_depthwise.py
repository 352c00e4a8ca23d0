"""keras_cct.lowering.depthwise: the shifted multiply-add lowering of depthwise convolutions,
against a direct float64 numpy convolution and Keras' own depthwise convolution (outputs and
both gradients) on the current backend, and the planner's pick for depthwise layers.

(The float64 check over every geometry of ``test_conv2d.CASES`` runs there too.)"""

import functools

import keras
import numpy as np
import pytest

from keras_cct.lowering import _backend as B
from keras_cct.lowering import choose, conv_geometry
from keras_cct.lowering.depthwise import depthwise_applies, depthwise_conv2d
from keras_cct.lowering.dispatch import available
from tests import reference as ref
from tests.backend_grads import layer_grads
from tests.lowering.test_winograd import _run

# (input shape, kernel shape, strides, padding, dilation): MobileNet's two kinds (stride 1 and
# 2, "same"-like padding 1), a multiplier with asymmetric padding, dilation, a 5x5 at stride 3.
CASES = {
    "mobilenet_s1": ((2, 9, 9, 8), (3, 3, 1, 8), 1, 1, 1),
    "mobilenet_s2": ((3, 10, 10, 6), (3, 3, 1, 6), 2, 1, 1),
    "multiplier3_asym": ((2, 7, 8, 4), (3, 3, 1, 12), 1, ((0, 2), (1, 0)), 1),
    "dilation2": ((1, 11, 9, 5), (3, 3, 1, 5), 1, 2, 2),
    "k5_s3": ((2, 13, 12, 3), (5, 5, 1, 3), 3, 2, 1),
}


def _case(name, dtype=np.float64):
    xs, ks, s, p, d = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    x, k = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ks).astype(dtype)
    geo = conv_geometry(xs, ks, strides=s, padding=p, dilation_rate=d, groups=xs[-1])
    dy = rng.standard_normal((xs[0], geo.out_h, geo.out_w, ks[3])).astype(dtype)
    return x, k, dy, geo


def _ref(name):
    x, k, dy, geo = _case(name)
    _, _, s, p, d = CASES[name]
    kw = dict(strides=s, padding=p, dilation=d, groups=x.shape[-1])
    return ref.conv2d(x, k, **kw), *ref.conv2d_grads(x, k, dy, **kw)[:2]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(case):
    x, k, dy, geo = _case(case)
    assert depthwise_applies(geo) and "depthwise" in available(geo)
    y_ref, dx_ref, dk_ref = _ref(case)
    y, dx, dk = _run(lambda a, b: depthwise_conv2d(a, b, geo), x, k, dy)
    assert y.dtype == dx.dtype == dk.dtype == np.float64
    assert y.shape == y_ref.shape and dx.shape == x.shape and dk.shape == k.shape
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got, want) < 1e-12


@functools.lru_cache(maxsize=None)
def _keras_reference(case):
    """(y, dx, dk) of keras.layers.DepthwiseConv2D in float32, its kernel laid out as
    HybridConv2D's (kh, kw, 1, channels * multiplier), on the zero-padded input."""
    x, k, dy, geo = _case(case, np.float32)
    (t, b), (l, r) = geo.pad
    x_in = np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)))
    c, m = x.shape[-1], k.shape[-1] // x.shape[-1]
    layer = keras.layers.DepthwiseConv2D(k.shape[:2], strides=(geo.sh, geo.sw),
                                         dilation_rate=(geo.dh, geo.dw), depth_multiplier=m,
                                         use_bias=False, dtype="float32")
    layer.build(x_in.shape)
    layer.kernel.assign(k.reshape(k.shape[0], k.shape[1], c, m))
    y, (dx, dk) = layer_grads(layer, x_in, dy)
    return y, dx[:, t:t + x.shape[1], l:l + x.shape[2]], dk.reshape(k.shape)


@pytest.mark.parametrize("case", ["mobilenet_s2", "multiplier3_asym", "dilation2"])
def test_matches_keras_depthwise_conv2d_float32(case):
    x, k, dy, geo = _case(case, np.float32)
    y_k, dx_k, dk_k = _keras_reference(case)
    y, dx, dk = _run(lambda a, b: depthwise_conv2d(a, b, geo), x, k, dy)
    assert y.dtype == dx.dtype == dk.dtype == np.float32
    for got, want in ((y, y_k), (dx, dx_k), (dk, dk_k)):
        assert ref.rel_err(got, want) < 1e-6


def test_bfloat16_error_is_stated():
    """In bfloat16 the taps are summed in float32: the error is bfloat16's rounding of the
    inputs and of the result (measured 3e-3 to 5e-3 relative on every backend; the backend's
    own op: 3e-3 to 4e-3), and the output stays bfloat16."""
    x, k, dy, geo = _case("mobilenet_s1", np.float32)
    y_ref, dx_ref, dk_ref = _ref("mobilenet_s1")

    def conv(a, b):
        a, b = keras.ops.cast(a, "bfloat16"), keras.ops.cast(b, "bfloat16")
        y = depthwise_conv2d(a, b, geo)
        assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
        return keras.ops.cast(y, "float32")

    y, dx, dk = _run(conv, x, k, dy)
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got, want) < 2e-2


def test_many_chunks_and_a_batch_the_chunk_does_not_divide(monkeypatch):
    """JAX works through the batch in chunks of images: a 7-image batch in chunks of one
    image gives the same result as the reference."""
    if keras.backend.backend() != "jax":
        pytest.skip("chunks are the JAX form's")
    from keras_cct.lowering._backend import jax as jax_backend
    monkeypatch.setattr(jax_backend, "DEPTHWISE_CHUNK_BYTES", 9 * 9 * 8 * 8 * 2)
    rng = np.random.default_rng(5)
    x, k = rng.standard_normal((7, 9, 9, 8)), rng.standard_normal((3, 3, 1, 8))
    geo = conv_geometry(x.shape, k.shape, padding=1, groups=8)
    dy = rng.standard_normal((7, 9, 9, 8))
    y, dx, dk = _run(lambda a, b: depthwise_conv2d(a, b, geo), x, k, dy)
    kw = dict(padding=1, groups=8)
    dx_ref, dk_ref, _ = ref.conv2d_grads(x, k, dy, **kw)
    for got, want in ((y, ref.conv2d(x, k, **kw)), (dx, dx_ref), (dk, dk_ref)):
        assert ref.rel_err(got, want) < 1e-12


def test_planner_picks_the_backends_depthwise_form():
    """Depthwise layers are not timed: the planner runs what the backend module names, a
    lowering that computes them on this backend ("depthwise" on JAX, "native" elsewhere)."""
    pick = choose((16, 56, 56, 128), (3, 3, 1, 128), padding=1, groups=128, mode="auto")
    assert pick == B.DEPTHWISE
    assert pick == ("depthwise" if keras.backend.backend() == "jax" else "native")
    geo = conv_geometry((16, 56, 56, 128), (3, 3, 1, 128), padding=1, groups=128)
    assert pick in available(geo)


def test_not_for_ordinary_convolutions():
    """A layer with more than one input channel per group has no depthwise form; the planner
    never returns it there, and asking for it by name says why."""
    from keras_cct.errors import LoweringError
    from keras_cct.lowering import conv2d
    geo = conv_geometry((2, 9, 9, 8), (3, 3, 2, 8), groups=4)
    assert not depthwise_applies(geo) and "depthwise" not in available(geo)
    assert choose((2, 9, 9, 8), (3, 3, 2, 8), groups=4, mode="auto") != "depthwise"
    with pytest.raises(LoweringError, match="one input channel per group"):
        conv2d(np.zeros((2, 9, 9, 8), "float32"), np.zeros((3, 3, 2, 8), "float32"),
               groups=4, lowering="depthwise")
