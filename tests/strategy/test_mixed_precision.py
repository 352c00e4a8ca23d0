"""CCTStrategy under ``mixed_bfloat16``, on every backend: the split returns bfloat16, computes
in the arithmetic dtype the layer decided (:mod:`keras_cct.lowering.precision`), and its OpenCL
shards (float32 devices) take and give 16-bit data at their boundary. Before, TensorFlow raised
on the OpenCL shard's float32 output, PyTorch on handing bfloat16 to numpy, and JAX dropped the
device and returned float32."""

import keras
import numpy as np
import pytest

from keras_cct import CCTStrategy, HybridConv2D
from keras_cct.lowering import precision
from tests import reference as ref
from tests.backend_grads import layer_grads, to_numpy
from tests.lowering.test_precision import ROUNDED_OUTPUT, _bf16, fresh  # noqa: F401 (fixture)

CPU = {"jax": "jax:cpu:0", "torch": "torch:cpu", "tensorflow": "tf:cpu:0"}[
    keras.backend.backend()]
pytestmark = pytest.mark.usefixtures("fresh")  # an empty precision cache, nothing decided


def _split_layer(lowering):
    strategy = CCTStrategy([CPU, "opencl:0:0"], split=[0.5, 0.5], rebalance=False)
    with strategy.scope():
        layer = HybridConv2D(16, 3, padding=1, dtype="mixed_bfloat16", lowering=lowering)
    x = np.random.default_rng(0).standard_normal((4, 12, 12, 32)).astype("float32")
    layer.build(x.shape)
    return strategy, layer, x


def _check_split(strategy, layer, x):
    """bfloat16 out, both devices kept, two images each; returns the output as float32."""
    y = layer(x)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    rows = strategy.report()
    assert [r["active"] for r in rows] == [True, True]
    assert [r["images"] for r in rows] == [2, 2]
    return to_numpy(keras.ops.cast(y, "float32"))


@pytest.mark.parametrize("lowering", ["native", "winograd4"])
def test_a_split_bfloat16_layer_computed_in_float32(opencl, monkeypatch, lowering):
    """Only the output is rounded to bfloat16 (F(4x4) included), and the gradients flow
    through the casts and the split."""
    monkeypatch.setenv(precision.ENV, "float32")
    strategy, layer, x = _split_layer(lowering)
    y = _check_split(strategy, layer, x)
    k, b = layer.get_weights()
    assert ref.rel_err(y, ref.conv2d(_bf16(x), _bf16(k), _bf16(b), padding=1)) < ROUNDED_OUTPUT
    dy = np.random.default_rng(1).standard_normal(y.shape).astype("float32")
    _, grads = layer_grads(layer, x, dy)
    want = ref.conv2d_grads(_bf16(x), _bf16(k), _bf16(dy), padding=1)
    for got, expect in zip(grads, want):
        assert ref.rel_err(np.asarray(got, np.float64), expect) < 2e-2


def test_a_split_layer_kept_in_bfloat16(opencl, monkeypatch):
    """``keep`` (a CPU with bfloat16 units): the backend's shard computes in bfloat16 -- F(4x4)
    is then far off the reference, the contrast that shows the test above sees the
    arithmetic -- and the OpenCL shard still runs (in float32)."""
    monkeypatch.setenv(precision.ENV, "keep")
    strategy, layer, x = _split_layer("winograd4")
    y = _check_split(strategy, layer, x)
    k, b = layer.get_weights()
    assert ref.rel_err(y, ref.conv2d(_bf16(x), _bf16(k), _bf16(b), padding=1)) > \
        4 * ROUNDED_OUTPUT
