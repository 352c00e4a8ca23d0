"""ONNX export: onnxruntime's outputs against Keras', the graph's ops and names, the errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import keras

pytest.importorskip("tf2onnx")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
if keras.backend.backend() != "tensorflow":  # the non-TF message is tested in a subprocess
    pytest.skip("ONNX export runs on the TensorFlow backend", allow_module_level=True)

import keras_cct  # noqa: E402
from keras_cct.errors import ExportError  # noqa: E402
from keras_cct.export import export_onnx  # noqa: E402
from tests.reference import rel_err  # noqa: E402

H = keras_cct.HybridConv2D
# Ops that would betray an exported lowering (patch extraction, GEMM over patches, shifts).
LOWERING_OPS = {"Im2Col", "Col2Im", "ExtractImagePatches", "Unfold", "MatMul", "Gemm", "Einsum",
                "Gather", "GatherND", "Slice", "Concat", "Pad", "Split", "ScatterND"}


def _randomize(model, seed=0):
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        weights = layer.get_weights()
        if weights:
            layer.set_weights([rng.standard_normal(w.shape).astype(w.dtype) * 0.5
                               for w in weights])


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _hybrid_model():
    """Every lowering, grouped, dilated, strided+dilated, asymmetric and 'same' padding."""
    inp = keras.Input((15, 17, 4), name="data")
    x = H(8, 3, padding=((1, 2), (0, 1)), lowering="type1", activation="relu", name="c1")(inp)
    x = H(8, 3, strides=2, dilation_rate=2, groups=2, padding=2, lowering="type2",
          name="c2")(x)
    x = H(6, (1, 3), groups=2, padding="same", lowering="type3", name="c3")(x)
    x = H(6, 3, dilation_rate=(1, 2), lowering="native", name="c4")(x)
    out = H(5, 2, lowering="auto", use_bias=False, name="prob")(x)
    model = keras.Model(inp, out, name="hybrid_net")
    _randomize(model)
    return model


@pytest.fixture(scope="module")
def hybrid_export(tmp_path_factory):
    model = _hybrid_model()
    path = export_onnx(model, tmp_path_factory.mktemp("onnx") / "hybrid.onnx")
    return model, path


@pytest.mark.parametrize("batch", [1, 7])
def test_hybrid_model_matches_keras(hybrid_export, batch):
    model, path = hybrid_export
    x = np.random.default_rng(batch).random((batch, 15, 17, 4), dtype=np.float32)
    (got,) = _session(path).run(None, {"data": x})
    want = model.predict(x, verbose=0)
    assert got.shape == want.shape == (batch, 5, 3, 5)
    assert rel_err(got, want) <= 1e-5


def test_hybrid_graph_is_standard_conv(hybrid_export):
    _, path = hybrid_export
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("Conv") == 5
    assert not LOWERING_OPS & set(ops), ops
    convs = [n for n in proto.graph.node if n.op_type == "Conv"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in convs]
    assert [a.get("group", 1) for a in attrs] == [1, 2, 2, 1, 1]
    assert attrs[1]["dilations"] == [2, 2] and attrs[1]["strides"] == [2, 2]
    assert attrs[3]["dilations"] == [1, 2]
    assert attrs[0]["pads"] == [1, 0, 2, 1]  # ONNX order: top, left, bottom, right


def test_names_and_dynamic_batch(hybrid_export):
    _, path = hybrid_export
    proto = onnx.load(str(path))
    assert [i.name for i in proto.graph.input] == ["data"]
    assert [o.name for o in proto.graph.output] == ["prob"]
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [15, 17, 4]


def test_plain_keras_sequential(tmp_path):
    """The Keras 3 Sequential case that tf2onnx.convert.from_keras fails on (tf2onnx#2448)."""
    model = keras.Sequential([
        keras.Input((12, 12, 1), name="pixels"),
        keras.layers.Conv2D(4, 5, activation="relu", name="conv1"),
        keras.layers.MaxPooling2D(2, name="pool1"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(10, name="ip"),
        keras.layers.Softmax(name="prob"),
    ])
    _randomize(model)
    path = export_onnx(model, tmp_path / "seq.onnx")
    proto = onnx.load(str(path))
    assert [i.name for i in proto.graph.input] == ["pixels"]
    assert [o.name for o in proto.graph.output] == ["prob"]
    x = np.random.default_rng(1).random((7, 12, 12, 1), dtype=np.float32)
    (got,) = _session(path).run(None, {"pixels": x})
    assert rel_err(got, model.predict(x, verbose=0)) <= 1e-5


def test_grouped_keras_conv2d_and_channels_first(tmp_path):
    """A grouped keras Conv2D (run through XLA by Keras, which tf2onnx cannot convert) is
    rewritten too; a channels_first HybridConv2D exports as NCHW Conv."""
    inp = keras.Input((6, 9, 9), name="nchw")
    x = H(4, 3, data_format="channels_first", padding=1, groups=2, name="cf")(inp)
    x = keras.layers.Permute((2, 3, 1), name="to_nhwc")(x)
    out = keras.layers.Conv2D(6, 3, groups=2, padding="same", name="grouped")(x)
    model = keras.Model(inp, out)
    _randomize(model)
    path = export_onnx(model, tmp_path / "g.onnx", batch_size=3, opset=17)
    proto = onnx.load(str(path))
    assert {o.domain: o.version for o in proto.opset_import}[""] == 17
    assert [n.op_type for n in proto.graph.node].count("Conv") == 2
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 3
    x = np.random.default_rng(2).random((3, 6, 9, 9), dtype=np.float32)
    (got,) = _session(path).run(None, {"nchw": x})
    assert rel_err(got, model.predict(x, verbose=0)) <= 1e-5


@pytest.mark.parametrize("make, channels", [("_model", 3), ("_separable_model", 4)])
def test_hybridized_depthwise_and_separable_layers_export(tmp_path, make, channels):
    """keras_cct.hybridize turns DepthwiseConv2D layers into grouped HybridConv2D layers (one
    group per channel, a depth multiplier) and SeparableConv2D layers into a Sequential of a
    grouped and a 1x1 HybridConv2D: onnxruntime on the export gives the Keras model's output,
    from a graph of standard Conv nodes."""
    from tests.strategy import test_hybridize
    model = getattr(test_hybridize, make)()  # random kernels (BatchNormalization's statistics
    hybrid = keras_cct.hybridize(model)     # stay valid)
    path = export_onnx(hybrid, tmp_path / f"{make}.onnx")
    proto = onnx.load(str(path))
    assert [n.op_type for n in proto.graph.node].count("Conv") == 4
    x = np.random.default_rng(3).standard_normal((2, 12, 12, channels)).astype(np.float32)
    (got,) = _session(path).run(None, {proto.graph.input[0].name: x})
    assert rel_err(got, model.predict(x, verbose=0)) <= 1e-5


def test_two_inputs_two_outputs(tmp_path):
    a = keras.Input((5, 5, 2), name="left")
    b = keras.Input((5, 5, 2), name="right")
    x = keras.layers.Concatenate(name="cat")([a, b])
    y1 = H(3, 3, padding=1, name="head1")(x)
    y2 = keras.layers.GlobalAveragePooling2D(name="head2")(y1)
    model = keras.Model([a, b], [y1, y2])
    _randomize(model)
    path = export_onnx(model, tmp_path / "io.onnx")
    sess = _session(path)
    assert [i.name for i in sess.get_inputs()] == ["left", "right"]
    assert [o.name for o in sess.get_outputs()] == ["head1", "head2"]
    rng = np.random.default_rng(3)
    xa, xb = (rng.random((2, 5, 5, 2), dtype=np.float32) for _ in range(2))
    got = sess.run(None, {"left": xa, "right": xb})
    want = model.predict([xa, xb], verbose=0)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-5


class NumpyDouble(keras.layers.Layer):
    """Calls back into Python: no ONNX equivalent."""

    def call(self, x):
        import tensorflow as tf

        y = tf.numpy_function(lambda a: a * 2, [x], tf.float32)
        return tf.ensure_shape(y, x.shape)

    def compute_output_shape(self, shape):
        return shape


class Patches(keras.layers.Layer):
    """tf.image.extract_patches: tf2onnx emits a graph onnxruntime rejects (tf2onnx#2403)."""

    def call(self, x):
        import tensorflow as tf

        return tf.image.extract_patches(x, [1, 3, 3, 1], [1, 1, 1, 1], [1, 1, 1, 1], "VALID")


@pytest.mark.parametrize("bad_cls", [NumpyDouble, Patches])
def test_bad_layer_is_named_and_no_file_is_left(tmp_path, bad_cls):
    inp = keras.Input((8, 8, 3), name="data")
    x = H(3, 3, padding=1, name="conv")(inp)
    x = bad_cls(name="the_bad_layer")(x)
    out = keras.layers.ReLU(name="relu")(x)
    model = keras.Model(inp, out)
    target = tmp_path / "bad.onnx"
    with pytest.raises(ExportError, match="the_bad_layer") as info:
        export_onnx(model, target)
    assert info.value.layer == "the_bad_layer"
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temporary one
    target.write_bytes(b"previous")  # an existing file is kept as it was
    with pytest.raises(ExportError):
        export_onnx(model, target)
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["bad.onnx"]


def test_subclassed_model_with_hybrid_conv_is_refused(tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="subnet")
            self.conv = H(2, 3, name="inner_conv")

        def call(self, x):
            return self.conv(x)

    model = Net()
    model(keras.Input((6, 6, 1)))  # symbolic: builds the inner layer
    with pytest.raises(ExportError, match="inner_conv|subnet"):
        export_onnx(model, tmp_path / "s.onnx")
    assert list(tmp_path.iterdir()) == []


def test_subclassed_model_without_hybrid_conv_exports(tmp_path):
    class Plain(keras.Model):
        def __init__(self):
            super().__init__(name="plain")
            self.conv = keras.layers.Conv2D(2, 3, name="conv")

        def call(self, x):
            return self.conv(x)

    model = Plain()
    model(keras.Input((6, 6, 1), name="img"))
    path = export_onnx(model, tmp_path / "p.onnx")
    sess = _session(path)
    assert [i.name for i in sess.get_inputs()] == ["img"]
    assert [o.name for o in sess.get_outputs()] == ["plain"]
    x = np.random.default_rng(7).random((3, 6, 6, 1), dtype=np.float32)
    assert rel_err(sess.run(None, {"img": x})[0], model.predict(x, verbose=0)) <= 1e-5
    eager = Plain()
    eager(np.zeros((1, 6, 6, 1), np.float32))  # no symbolic inputs: refused
    with pytest.raises(ExportError, match="no known inputs"):
        export_onnx(eager, tmp_path / "e.onnx")


def test_cli_export_keras_file(tmp_path, capsys):
    from keras_cct.cli import main

    model = _hybrid_model()
    saved = tmp_path / "net.keras"
    model.save(saved)
    out = tmp_path / "net.onnx"
    assert main(["export", str(saved), "-o", str(out)]) == 0
    x = np.random.default_rng(4).random((2, 15, 17, 4), dtype=np.float32)
    (got,) = _session(out).run(None, {"data": x})
    assert rel_err(got, model.predict(x, verbose=0)) <= 1e-5
    assert main(["export", str(tmp_path / "missing.keras"), "-o", str(out)]) == 1
    assert "missing.keras" in capsys.readouterr().err


def test_non_tensorflow_backend_says_export_needs_tf(tmp_path):
    code = textwrap.dedent(f"""
        import keras, keras_cct
        from keras_cct.errors import ExportError
        from keras_cct.export import export_onnx
        m = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Flatten()])
        try:
            export_onnx(m, {str(tmp_path / 'x.onnx')!r})
        except ExportError as e:
            print("ERR", e)
    """)
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "ERR ONNX export needs the TensorFlow backend" in res.stdout, res.stderr[-2000:]
    assert "KERAS_BACKEND=tensorflow" in res.stdout
    assert not (tmp_path / "x.onnx").exists()


def test_conversion_retries_with_tf2onnx_rollback(tmp_path, monkeypatch):
    """The fast path (tf2onnx's rollback copies off) falls back to tf2onnx's default."""
    import tf2onnx

    real = tf2onnx.convert.from_function
    seen = []

    def flaky(*args, **kwargs):
        seen.append(os.environ.get("TF2ONNX_CATCH_ERRORS"))
        if seen[-1] == "FALSE":
            raise RuntimeError("an optimizer pass failed")
        return real(*args, **kwargs)

    monkeypatch.delenv("TF2ONNX_CATCH_ERRORS", raising=False)
    monkeypatch.setattr(tf2onnx.convert, "from_function", flaky)
    model = keras.Sequential([keras.Input((6, 6, 2), name="data"), H(3, 3, name="conv")])
    _randomize(model)
    path = export_onnx(model, tmp_path / "retry.onnx")
    assert seen == ["FALSE", None] and "TF2ONNX_CATCH_ERRORS" not in os.environ
    x = np.random.default_rng(5).random((2, 6, 6, 2), dtype=np.float32)
    (got,) = _session(path).run(None, {"data": x})
    assert rel_err(got, model.predict(x, verbose=0)) <= 1e-5


def test_bad_arguments(tmp_path):
    model = keras.Sequential([keras.Input((6, 6, 2)), H(3, 3)])
    with pytest.raises(ExportError, match="batch_size"):
        export_onnx(model, tmp_path / "x.onnx", batch_size=0)
    with pytest.raises(ExportError, match="keras.Model"):
        export_onnx(H(3, 3), tmp_path / "x.onnx")
    assert list(tmp_path.iterdir()) == []


def test_nested_model_convs_are_rewritten(tmp_path):
    block = keras.Sequential([keras.Input((7, 7, 3)), H(4, 3, padding=((0, 1), (1, 0)),
                                                         groups=1, name="inner"),
                              keras.layers.ReLU(name="inner_relu")], name="block")
    inp = keras.Input((7, 7, 3), name="data")
    out = H(2, 1, name="head")(block(inp))
    model = keras.Model(inp, out)
    _randomize(model)
    _randomize(block)
    path = export_onnx(model, tmp_path / "nested.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("Conv") == 2 and not LOWERING_OPS & set(ops), ops
    x = np.random.default_rng(6).random((7, 7, 7, 3), dtype=np.float32)
    (got,) = _session(path).run(None, {"data": x})
    assert rel_err(got, model.predict(x, verbose=0)) <= 1e-5


def test_written_file_has_the_usual_mode(tmp_path):
    model = keras.Sequential([keras.Input((4, 4, 1), name="data"), H(1, 3, name="conv")])
    path = export_onnx(model, tmp_path / "sub" / "m.onnx")  # the folder is created
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~umask)
    assert [p.name for p in path.parent.iterdir()] == ["m.onnx"]


def test_export_leaves_the_model_intact(hybrid_export, tmp_path):
    """The rewrite shares layers with the model: it must still save, reload and predict."""
    model, _ = hybrid_export
    assert [type(layer).__name__ for layer in model.layers[1:]] == ["HybridConv2D"] * 5
    model.save(tmp_path / "after.keras")
    again = keras.saving.load_model(tmp_path / "after.keras")
    x = np.random.default_rng(8).random((2, 15, 17, 4), dtype=np.float32)
    assert [layer.name for layer in again.layers] == [layer.name for layer in model.layers]
    assert rel_err(again.predict(x, verbose=0), model.predict(x, verbose=0)) <= 1e-6

