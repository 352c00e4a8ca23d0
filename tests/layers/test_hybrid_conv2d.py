"""HybridConv2D against keras.layers.Conv2D (copied weights) and the float64 reference."""


import keras
import numpy as np
import pytest

from keras_cct import HybridConv2D
from keras_cct.lowering import ALL_LOWERINGS
from tests import reference as ref
from tests.backend_grads import layer_grads, to_numpy
from tests.lowering.test_winograd import F32_TOL

LOWERINGS = ("type1", "type2", "type3", "native", "auto")

# name: (input shape, Conv2D kwargs); explicit int/tuple padding is compared with
# ZeroPadding2D + a valid Conv2D.
CASES = {
    # CaffeNet's five convolutions (batch 1): conv1 k11 s4, grouped conv2/4/5. conv1 runs on a
    # 59x59 input (13x13 output): the same layer, without Type 3's 2.4 GB lifted matrix at 227.
    "caffenet_conv1": ((1, 59, 59, 3), dict(filters=96, kernel_size=11, strides=4)),
    "caffenet_conv2": ((1, 27, 27, 96), dict(filters=256, kernel_size=5, padding=2, groups=2)),
    "caffenet_conv3": ((1, 13, 13, 256), dict(filters=384, kernel_size=3, padding=1)),
    "caffenet_conv4": ((1, 13, 13, 384), dict(filters=384, kernel_size=3, padding=1, groups=2)),
    "caffenet_conv5": ((1, 13, 13, 384), dict(filters=256, kernel_size=3, padding=1, groups=2)),
    "1x1": ((3, 6, 6, 16), dict(filters=8, kernel_size=1)),
    "stride2_same_even": ((2, 10, 10, 4), dict(filters=6, kernel_size=3, strides=2,
                                              padding="same")),
    "stride3_valid_odd": ((2, 13, 11, 3), dict(filters=5, kernel_size=(3, 4), strides=3)),
    "dilation2": ((2, 11, 11, 4), dict(filters=4, kernel_size=3, dilation_rate=2,
                                       padding="same")),
    "groups4": ((2, 8, 8, 8), dict(filters=12, kernel_size=3, groups=4, padding=(1, 2))),
    "depthwise": ((2, 9, 9, 6), dict(filters=6, kernel_size=3, groups=6, padding="same")),
    "batch1_explicit": ((1, 7, 9, 5), dict(filters=7, kernel_size=(2, 3), padding=1)),
}


def _reference_layer(shape, kw):
    kw = dict(kw)
    pad = kw.pop("padding", "valid")
    conv = keras.layers.Conv2D(**kw, padding=pad if isinstance(pad, str) else "valid")
    if isinstance(pad, str):
        return conv, conv
    pad_layer = keras.layers.ZeroPadding2D(pad)
    model = keras.Sequential([keras.Input(shape[1:]), pad_layer, conv])
    return model, conv


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_keras_conv2d(case, lowering):
    shape, kw = CASES[case]
    rng = np.random.default_rng(7)
    ref_model, ref_conv = _reference_layer(shape, kw)
    if ref_model is ref_conv:
        ref_model.build(shape)
    layer = HybridConv2D(**kw, lowering=lowering)
    layer.build(shape)
    weights = [w * 0 + rng.standard_normal(w.shape).astype("float32")
               for w in ref_conv.get_weights()]
    ref_conv.set_weights(weights)
    layer.set_weights(weights)
    x = rng.standard_normal(shape).astype("float32")
    dy = rng.standard_normal(layer.compute_output_shape(shape)).astype("float32")
    y_ref, g_ref = layer_grads(ref_model, x, dy)
    y, g = layer_grads(layer, x, dy)
    # "auto" may pick Winograd, whose stated float32 error is larger
    tol = {"winograd": F32_TOL[2], "winograd4": F32_TOL[4]}.get(layer.chosen_lowering, 1e-5)
    assert y.shape == y_ref.shape
    assert ref.rel_err(y, y_ref) <= tol
    for name, a, b in zip(("input", "kernel", "bias"), g, g_ref):
        assert ref.rel_err(a, b) <= tol, name


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_float64_against_numpy(lowering):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 9, 8, 6))
    layer = HybridConv2D(8, (3, 2), strides=(2, 1), padding=((1, 0), (2, 1)), dilation_rate=1,
                         groups=2, lowering=lowering, dtype="float64")
    layer.build(x.shape)
    k, b = (rng.standard_normal(w.shape) for w in layer.get_weights())
    layer.set_weights([k, b])
    kw = dict(strides=(2, 1), padding=((1, 0), (2, 1)), groups=2)
    y_ref = ref.conv2d(x, k, b, **kw)
    dy = rng.standard_normal(y_ref.shape)
    dx_ref, dk_ref, db_ref = ref.conv2d_grads(x, k, dy, **kw)
    y, (dx, dk, db) = layer_grads(layer, x, dy)
    assert y.dtype == np.float64
    for got, want in ((y, y_ref), (dx, dx_ref), (dk, dk_ref), (db, db_ref)):
        assert ref.rel_err(got, want) < 1e-12


def test_stride_with_dilation_which_conv2d_refuses():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 12, 12, 3))
    layer = HybridConv2D(4, 3, strides=2, dilation_rate=2, padding=2, dtype="float64")
    layer.build(x.shape)
    k, b = layer.get_weights()
    assert ref.rel_err(to_numpy(layer(x)), ref.conv2d(x, k, b, strides=2, padding=2,
                                                      dilation=2)) < 1e-12


def test_channels_first():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 9, 9)).astype("float32")
    layer = HybridConv2D(6, 3, padding=1, data_format="channels_first", lowering="type3")
    y = to_numpy(layer(x))
    k, b = layer.get_weights()
    y_ref = ref.conv2d(x.transpose(0, 2, 3, 1), k, b, padding=1).transpose(0, 3, 1, 2)
    assert y.shape == (2, 6, 9, 9)
    assert ref.rel_err(y, y_ref) < 1e-5
    assert layer.compute_output_shape((None, 4, 9, 9)) == (None, 6, 9, 9)


@pytest.mark.parametrize("kwargs, message", [
    (dict(filters=0, kernel_size=3), "`filters` must be a positive int"),
    (dict(filters=6, kernel_size=3, groups=4), "`groups`=4 must divide `filters`=6"),
    (dict(filters=4, kernel_size=3, lowering="im2col"), "`lowering` must be one of"),
    (dict(filters=4, kernel_size=(3, 3, 3)), "`kernel_size` must be an int or a pair"),
    (dict(filters=4, kernel_size=3, padding="causal"), "`padding` must be"),
    (dict(filters=4, kernel_size=3, planner="guess"), "`planner` must be one of"),
])
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridConv2D(**kwargs)


def test_bad_build_arguments_name_the_layer():
    with pytest.raises(ValueError, match="'c': `groups`=2 must divide the input channels"):
        HybridConv2D(4, 3, groups=2, name="c").build((1, 8, 8, 3))
    with pytest.raises(ValueError, match="'d': .*larger than the padded input"):
        HybridConv2D(4, 7, name="d").build((1, 5, 5, 3))


def test_config_round_trip_and_output_shape():
    layer = HybridConv2D(8, (3, 5), strides=2, padding=((1, 2), (0, 3)), groups=2,
                         dilation_rate=(1, 2), lowering="type2", planner="model",
                         activation="relu", use_bias=False, name="conv")
    clone = HybridConv2D.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    shape = (None, 17, 16, 4)
    # height: (17 + 3 - 3) // 2 + 1 = 9; width: (16 + 3 - 9) // 2 + 1 = 6
    assert layer.compute_output_shape(shape) == (None, 9, 6, 8)
    out = keras.Input(shape[1:])
    assert tuple(layer(out).shape) == (None, 9, 6, 8)


def test_model_planner_records_ccts_choice():
    layer = HybridConv2D(256, 3, padding=1, planner="model")
    layer.build((None, 13, 13, 16))
    assert layer.chosen_lowering == "type1"          # few input channels: replicate the input
    layer = HybridConv2D(16, 3, padding=1, planner="model")
    layer.build((None, 13, 13, 1024))
    assert layer.chosen_lowering == "type3"          # many input channels: replicate the output


def test_default_planner_times_native_against_the_lowerings(tmp_path, monkeypatch):
    from keras_cct.lowering import planner
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path))
    timed = []

    def fake_time(geo, lowering, **kw):
        timed.append((lowering, kw["batch"]))
        return {"native": 2.0, "winograd": 1.0, "winograd4": 1.5}.get(lowering, 3.0)

    monkeypatch.setattr(planner, "time_lowerings", lambda geo, lows, **kw: {
        low: fake_time(geo, low, **kw) for low in lows})
    # the race alone (PyTorch's winner is timed again at a larger batch: tests/lowering)
    monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", False)
    layer = HybridConv2D(256, 3, padding=1)
    assert layer.planner == "auto"
    layer.build((None, 13, 13, 64))
    assert timed == []                                    # planned at first use, not at build
    assert layer.chosen_lowering == "winograd"
    # native, Winograd (3x3, stride 1) and the cost model's one lowered type, at a small batch
    assert sorted(t for t, _ in timed) == ["native", "type1", "winograd", "winograd4"]
    # 13x13x64 -> 256: 0.1 GFLOP/image; the layer's own batch (32 when unknown) where the
    # backend compiles Winograd per shape
    assert {b for _, b in timed} == ({32} if "winograd" in planner.B.COMPILED
                                     else {planner.AUTO_BATCH})
    timed.clear()
    layer = HybridConv2D(256, 5, strides=2, padding=2)  # no Winograd for 5x5 at stride 2
    layer.build((None, 13, 13, 64))
    assert layer.chosen_lowering == "native"
    assert sorted(t for t, _ in timed) == ["native", "type1"]
    timed.clear()
    monkeypatch.setenv("KERAS_CCT_16BIT", "keep")  # computed in bfloat16
    layer = HybridConv2D(256, 3, padding=1, dtype="mixed_bfloat16")
    layer.build((None, 13, 13, 64))  # F(4x4, 3x3) is not accurate enough in bfloat16
    assert layer.chosen_lowering == "winograd"
    assert sorted(t for t, _ in timed) == ["native", "type1", "winograd"]
    timed.clear()
    monkeypatch.setenv("KERAS_CCT_16BIT", "float32")  # a machine slower in bfloat16: the
    layer = HybridConv2D(256, 3, padding=1, dtype="mixed_bfloat16")  # float32 race's plan,
    layer.build((None, 13, 13, 64))                                  # from the cache
    assert layer.chosen_lowering == "winograd" and timed == []
    timed.clear()
    layer = HybridConv2D(512, 3, padding=1, groups=512)  # depthwise: the backend's pick,
    layer.build((None, 28, 28, 512))                     # untimed
    want = "depthwise" if keras.backend.backend() == "jax" else "native"
    assert layer.chosen_lowering == want and timed == []
    layer = HybridConv2D(4, 3, padding=1)  # too small to be worth timing: the backend's op
    layer.build((None, 8, 8, 2))
    assert layer.chosen_lowering == "native" and timed == []


def test_auto_plans_for_the_batch_the_layer_runs_at(tmp_path, monkeypatch):
    from keras_cct.lowering import planner
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path))
    timed = []

    def fake_times(geo, lows, *, batch, **kw):
        timed.extend((low, batch) for low in lows)
        return {low: 1.0 if low == "native" else 2.0 for low in lows}

    monkeypatch.setattr(planner, "time_lowerings", fake_times)
    layer = HybridConv2D(256, 3, padding=1)
    inp = keras.Input((13, 13, 64))
    layer(inp)                                            # Keras tracing shapes: nothing timed
    assert timed == []
    x = np.zeros((4, 13, 13, 64), "float32")
    layer(x)
    assert {b for _, b in timed} == {4}                   # timed at the 4 images it runs at
    n = len(timed)
    layer(x)
    assert len(timed) == n                                # planned once per batch
    layer(np.zeros((8, 13, 13, 64), "float32"))
    assert {b for _, b in timed[n:]} == {8}
    # a layer built with a static batch plans for it when a call has none (TF under fit)
    timed.clear()
    static = HybridConv2D(256, 3, padding=1)
    static.build((12, 13, 13, 64))  # more images than any race cached: raced
    assert static.chosen_lowering == "native" and {b for _, b in timed} == {12}


def _small_model(lowering="auto"):
    inp = keras.Input((12, 12, 3))
    h = HybridConv2D(8, 3, padding=1, activation="relu", lowering=lowering)(inp)
    h = HybridConv2D(8, 3, strides=2, padding=((0, 1), (1, 0)), groups=2, lowering="type3")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


def test_keras_file_round_trip(tmp_path):
    model = _small_model("type2")
    x = np.random.default_rng(0).standard_normal((3, 12, 12, 3)).astype("float32")
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.layers[1], HybridConv2D)
    assert loaded.layers[1].lowering == "type2"
    np.testing.assert_array_equal(to_numpy(loaded(x)), to_numpy(model(x)))


@pytest.mark.parametrize("jit", [False, True])
def test_fit_decreases_the_loss(jit):
    if jit and keras.backend.backend() == "torch":
        pytest.skip("jit_compile on the torch backend is torch.compile, not exercised here")
    keras.utils.set_random_seed(1)
    x = np.random.default_rng(1).standard_normal((32, 12, 12, 3)).astype("float32")
    y = (x[:, :6].mean(axis=(1, 2, 3)) > x[:, 6:].mean(axis=(1, 2, 3))).astype("int32")
    model = _small_model()
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
    history = model.fit(x, y, epochs=8, batch_size=8, verbose=0).history["loss"]
    assert history[-1] < 0.8 * history[0]


def test_mixed_precision_policy():
    layer = HybridConv2D(4, 3, padding=1, dtype="mixed_bfloat16", lowering="type1")
    x = np.random.default_rng(2).standard_normal((2, 6, 6, 3)).astype("float32")
    y = layer(x)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    assert layer.kernel.dtype == "float32"
    k, b = layer.get_weights()
    assert ref.rel_err(to_numpy(keras.ops.cast(y, "float32")),
                       ref.conv2d(x, k, b, padding=1)) < 2e-2


@pytest.mark.parametrize("arithmetic", ["keep", "float32"])
@pytest.mark.parametrize("lowering", ["native", "type1", "winograd"])
def test_stateless_call_of_a_mixed_precision_layer(lowering, arithmetic, monkeypatch):
    """``layer.stateless_call`` calls ``call`` outside the layer's autocast scope: a bfloat16
    input meets the float32 kernel. Where keras Conv2D computes that (on JAX: in float32, the
    common dtype), HybridConv2D returns the same; ``native`` raised a dtype error on JAX. So
    it does whether this machine computes bfloat16 layers in bfloat16 (``keep``: a CPU with
    bfloat16 units, where the float32 pair was cast down to bfloat16) or in float32."""
    from keras_cct.lowering import precision
    monkeypatch.setenv(precision.ENV, arithmetic)
    rng = np.random.default_rng(4)
    x = keras.ops.cast(rng.standard_normal((2, 8, 8, 16)), "bfloat16")
    conv = keras.layers.Conv2D(8, 3, padding="same", dtype="mixed_bfloat16")
    conv.build((None, 8, 8, 16))
    try:
        want, _ = conv.stateless_call([v.value for v in conv.trainable_variables], [], x)
    except (ValueError, TypeError, RuntimeError) as exc:
        pytest.skip(f"keras Conv2D's stateless_call fails here too: {type(exc).__name__}")
    layer = HybridConv2D(8, 3, padding="same", dtype="mixed_bfloat16", lowering=lowering)
    layer.build((None, 8, 8, 16))
    layer.set_weights(conv.get_weights())
    got, _ = layer.stateless_call([v.value for v in layer.trainable_variables], [], x)
    assert keras.backend.standardize_dtype(got.dtype) == \
        keras.backend.standardize_dtype(want.dtype) == "float32"
    tol = F32_TOL[2] if lowering == "winograd" else 1e-5
    assert ref.rel_err(to_numpy(got), to_numpy(want)) < tol


def test_measure_planner_inside_a_subclassed_model(tmp_path, monkeypatch):
    """planner='measure' times lowerings even when the layer is built during tracing."""
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path))

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.conv = HybridConv2D(4, 3, padding=1, planner="measure")
            self.head = keras.layers.Dense(2)

        def call(self, x):
            return self.head(keras.ops.mean(self.conv(x), axis=(1, 2)))

    model = Net()
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).standard_normal((4, 6, 6, 2)).astype("float32")
    model.fit(x, np.zeros((4, 2), "float32"), epochs=1, verbose=0)
    assert model.conv.chosen_lowering in ALL_LOWERINGS
    assert (tmp_path / "planner.json").exists()
