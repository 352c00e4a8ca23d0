"""16-bit convolutions computed in float32 where this machine computes them slower
(keras_cct.lowering.precision), on every backend: the choice (``$KERAS_CCT_16BIT``, the cached
measurement) and the layer's results against the float64 reference."""

import json

import keras
import numpy as np
import pytest

from keras_cct import HybridConv2D
from keras_cct.errors import LoweringError
from keras_cct.lowering import _backend as B
from keras_cct.lowering import precision
from tests import reference as ref
from tests.backend_grads import layer_grads, to_numpy

#: The output's rounding to bfloat16 (8 bits of mantissa: 2**-9 relative, up to 2**-8 of the
#: largest value), where the sum is float32's: far below F(4x4, 3x3)'s error in bfloat16 (about
#: 0.1 of the largest value, planner.IMPRECISE).
ROUNDED_OUTPUT = 2.0 ** -8


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache folder and no decision remembered in this process."""
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(precision.ENV, raising=False)
    monkeypatch.setattr(precision, "_decided", {})
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "fma"})  # no 16-bit units
    return tmp_path


def test_the_environment_decides_without_measuring(fresh, monkeypatch):
    monkeypatch.setattr(precision, "measure", lambda dtype: pytest.fail("measured"))
    monkeypatch.setenv(precision.ENV, "float32")
    assert precision.arithmetic_dtype("bfloat16") == "float32"
    assert precision.arithmetic_dtype("float16") == "float32"
    assert precision.arithmetic_dtype("float32") == "float32"
    monkeypatch.setenv(precision.ENV, "keep")
    assert precision.arithmetic_dtype("bfloat16") == "bfloat16"
    monkeypatch.setenv(precision.ENV, "fp32")
    with pytest.raises(LoweringError, match="KERAS_CCT_16BIT='fp32'.*'auto', 'float32', 'keep'"):
        precision.arithmetic_dtype("bfloat16")
    assert not (fresh / "precision.json").exists()


def test_a_cpu_with_16bit_units_keeps_the_dtype_unmeasured(fresh, monkeypatch):
    monkeypatch.setattr(precision, "measure", lambda dtype: pytest.fail("measured"))
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "avx512f", "amx_bf16"})
    assert precision.arithmetic_dtype("bfloat16") == "bfloat16"
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "avx512_fp16"})
    assert precision.arithmetic_dtype("float16") == "float16"


def test_a_cached_decision_is_read_not_measured(fresh, monkeypatch):
    key = precision._key("bfloat16")
    (fresh / "precision.json").write_text(json.dumps(
        {"version": precision.CACHE_VERSION, "entries": {key: {"compute": "float32"}}}))
    monkeypatch.setattr(precision, "measure", lambda dtype: pytest.fail("measured"))
    assert precision.arithmetic_dtype("bfloat16") == "float32"


def test_a_corrupt_cache_is_ignored_with_a_warning_and_rewritten(fresh, monkeypatch):
    from keras_cct.errors import PlannerCacheWarning
    (fresh / "precision.json").write_text("{not json")
    monkeypatch.setattr(precision, "measure", lambda dtype: {"compute": "float32"})
    with pytest.warns(PlannerCacheWarning, match="precision.json: ignoring the 16-bit"):
        assert precision.arithmetic_dtype("bfloat16") == "float32"
    data = json.loads((fresh / "precision.json").read_text())
    assert data["version"] == precision.CACHE_VERSION
    assert data["entries"][precision._key("bfloat16")] == {"compute": "float32"}


def test_the_measurement_is_made_once_and_cached(fresh, monkeypatch):
    """A real measurement: both dtypes timed, the decision the rule gives for those times, and
    neither this process nor a later one (the cache file) measures again."""
    if B.device_name():
        pytest.skip("on an accelerator the 16-bit dtype is kept unmeasured")
    got = precision.arithmetic_dtype("bfloat16")
    entry = json.loads((fresh / "precision.json").read_text())["entries"][
        precision._key("bfloat16")]
    t16, t32 = entry["seconds"]["bfloat16"], entry["seconds"]["float32"]
    assert 0 < t16 < 10 and 0 < t32 < 10
    assert sorted(entry["per_step"]) == ["native bfloat16", "native float32",
                                         "type2 bfloat16", "type2 float32"]
    assert got == entry["compute"] == ("float32" if t16 > precision.SLOWER_BY * t32
                                       else "bfloat16")
    monkeypatch.setattr(precision, "measure", lambda dtype: pytest.fail("measured again"))
    assert precision.arithmetic_dtype("bfloat16") == got
    monkeypatch.setattr(precision, "_decided", {})  # a later process: the file decides
    assert precision.arithmetic_dtype("bfloat16") == got


def _bf16(a):
    """``a`` rounded to bfloat16 values (held as float64), as the layer's autocast rounds it."""
    return to_numpy(keras.ops.cast(keras.ops.cast(a, "bfloat16"), "float32")).astype(np.float64)


def _layer_and_input(lowering):
    layer = HybridConv2D(16, 3, padding=1, dtype="mixed_bfloat16", lowering=lowering)
    x = np.random.default_rng(0).standard_normal((2, 12, 12, 32)).astype("float32")
    layer.build(x.shape)
    return layer, x


@pytest.mark.parametrize("lowering", ["native", "type2", "winograd4"])
def test_a_bfloat16_layer_computed_in_float32(fresh, monkeypatch, lowering):
    """``$KERAS_CCT_16BIT=float32``: the layer still returns bfloat16, but only the output is
    rounded (F(4x4) included, whose bfloat16 products are 0.1 off), and its gradients flow
    through the casts."""
    monkeypatch.setenv(precision.ENV, "float32")
    layer, x = _layer_and_input(lowering)
    y = layer(x)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    k, b = layer.get_weights()
    xb, kb, bb = _bf16(x), _bf16(k), _bf16(b)
    assert ref.rel_err(to_numpy(keras.ops.cast(y, "float32")),
                       ref.conv2d(xb, kb, bb, padding=1)) < ROUNDED_OUTPUT
    dy = np.random.default_rng(1).standard_normal(y.shape).astype("float32")
    _, (dx, dk, db) = layer_grads(layer, x, dy)
    want = ref.conv2d_grads(xb, kb, _bf16(dy), padding=1)
    for got, expect in zip((dx, dk, db), want):
        assert ref.rel_err(np.asarray(got, np.float64), expect) < 2e-2


def test_keep_computes_in_bfloat16(fresh, monkeypatch):
    """The contrast that shows the test above measures the arithmetic: F(4x4) computed in
    bfloat16 is far off the same reference."""
    monkeypatch.setenv(precision.ENV, "keep")
    layer, x = _layer_and_input("winograd4")
    y = to_numpy(keras.ops.cast(layer(x), "float32"))
    k, b = layer.get_weights()
    assert ref.rel_err(y, ref.conv2d(_bf16(x), _bf16(k), _bf16(b), padding=1)) > \
        4 * ROUNDED_OUTPUT
