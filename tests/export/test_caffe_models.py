"""ONNX export of the real Caffe models in ../shared/caffe-models.

onnxruntime runs the exported file; its outputs must equal the imported Keras model's
(relative error <= 1e-5) at batch 1 and 7, and OpenCV's own Caffe importer (``cv2.dnn``, an
independent implementation reading the same prototxt/caffemodel) must agree too.
"""

from __future__ import annotations

import numpy as np
import pytest

import keras

pytest.importorskip("tf2onnx")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
if keras.backend.backend() != "tensorflow":
    pytest.skip("ONNX export runs on the TensorFlow backend", allow_module_level=True)

from keras_cct import HybridConv2D  # noqa: E402
from keras_cct.export import export_onnx  # noqa: E402
from tests.conftest import need_shared  # noqa: E402
from tests.reference import rel_err  # noqa: E402

pytestmark = pytest.mark.shared

NETS = {
    "lenet": ("lenet_mnist", "lenet.prototxt", "lenet_iter_10000.caffemodel"),
    "mtcnn_det1": ("mtcnn", "det1.prototxt", "det1.caffemodel"),
    "mtcnn_det2": ("mtcnn", "det2.prototxt", "det2.caffemodel"),
    "cifar10_quick": ("cifar10_quick_v1", "cifar10_quick.prototxt",
                      "cifar10_quick_iter_5000.caffemodel"),
    "resnet50_stem": ("resnet50_stem", "test.prototxt", "test.caffemodel"),
}
PATCH_OPS = {"Im2Col", "Col2Im", "ExtractImagePatches", "Unfold"}
_CACHE: dict = {}


def _exported(name, tmp_path_factory):
    if name not in _CACHE:
        from keras_cct.caffe import load_net

        folder, proto, weights = NETS[name]
        base = need_shared("caffe-models", folder)
        model = load_net(str(base / proto), str(base / weights))
        path = export_onnx(model, tmp_path_factory.mktemp(name) / f"{name}.onnx")
        _CACHE[name] = (model, path, base / proto, base / weights)
    return _CACHE[name]


def _inputs(model, batch):
    rng = np.random.default_rng(batch)
    return {t.name: rng.random((batch,) + tuple(t.shape[1:]), dtype=np.float32)
            for t in model.inputs}


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("name", sorted(NETS))
def test_onnxruntime_equals_keras(name, batch, tmp_path_factory):
    model, path, _, _ = _exported(name, tmp_path_factory)
    feeds = _inputs(model, batch)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == [t.name for t in model.inputs]
    assert [o.name for o in sess.get_outputs()] == list(model.output_names)
    got = sess.run(None, feeds)
    want = model.predict([feeds[t.name] for t in model.inputs], verbose=0)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want)
    for out_name, g, w in zip(model.output_names, got, want):
        assert g.shape == w.shape, out_name
        assert rel_err(g, w) <= 1e-5, out_name


@pytest.mark.parametrize("name", sorted(NETS))
def test_graph_is_checked_standard_conv(name, tmp_path_factory):
    model, path, _, _ = _exported(name, tmp_path_factory)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    n_conv = sum(isinstance(layer, HybridConv2D) for layer in model.layers)
    assert n_conv > 0 and ops.count("Conv") == n_conv
    assert not PATCH_OPS & set(ops)
    dim0 = proto.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param == "batch"  # dynamic batch


@pytest.mark.parametrize("name", sorted(NETS))
def test_onnxruntime_equals_opencv_caffe(name, tmp_path_factory):
    cv2 = pytest.importorskip("cv2")
    if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
        pytest.skip("this OpenCV has no Caffe importer")
    model, path, proto, weights = _exported(name, tmp_path_factory)
    if len(model.inputs) != 1:
        pytest.skip("one-input nets only")
    x = _inputs(model, 3)[model.inputs[0].name]
    net = cv2.dnn.readNetFromCaffe(str(proto), str(weights))
    net.enableFusion(False)
    net.setInput(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    names = list(model.output_names)
    want = net.forward(names)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {model.inputs[0].name: x})
    for out_name, g, w in zip(names, got, want):
        if g.ndim == 4:
            g = g.transpose(0, 3, 1, 2)  # Keras/ONNX export is channels-last, OpenCV NCHW
        assert g.shape == w.shape, out_name
        assert rel_err(g, w) <= 1e-5, out_name


def test_cli_export_prototxt_with_weights(tmp_path, tmp_path_factory):
    from keras_cct.cli import main

    model, _, proto, weights = _exported("lenet", tmp_path_factory)
    out = tmp_path / "lenet.onnx"
    assert main(["export", str(proto), "--weights", str(weights), "-o", str(out)]) == 0
    x = _inputs(model, 2)
    (got,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, x)
    assert rel_err(got, model.predict(x["data"], verbose=0)) <= 1e-5


def test_cli_export_saved_caffe_net(tmp_path, tmp_path_factory):
    """An imported net saved as .keras (Caffe layers included) exports from the file, with the
    ``cct`` command in a fresh process (where nothing has registered the Caffe layers yet)."""
    import os
    import subprocess
    import sys

    model, _, _, _ = _exported("mtcnn_det1", tmp_path_factory)
    saved = tmp_path / "det1.keras"
    model.save(saved)
    out = tmp_path / "det1.onnx"
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    res = subprocess.run([sys.executable, "-m", "keras_cct.cli", "export", str(saved), "-o",
                          str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "wrote" in res.stdout
    x = _inputs(model, 3)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, x)
    for g, w in zip(got, model.predict(x["data"], verbose=0)):
        assert rel_err(g, w) <= 1e-5
