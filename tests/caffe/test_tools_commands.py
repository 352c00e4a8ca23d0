"""`cct mean`, `cct features`, `cct upgrade`, `cct draw` and `cct device_query` against
independent references: numpy's mean of the records, OpenCV's Caffe importer, the
current-format parse of Caffe's V1 cifar10_quick, the picture's pixels."""

from __future__ import annotations

import os

import numpy as np
import pytest
from google.protobuf import text_format

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.binary import array_to_blob, blob_to_array, read_binaryproto
from keras_cct.caffe.io.lmdb_io import DatumReader, write_arrays
from keras_cct.caffe.io.text import read_net
from keras_cct.cli import main
from tests.caffe.import_helpers import opencv_forward
from tests.conftest import need_shared


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


# -- mean -------------------------------------------------------------------------------------

def test_mean_of_an_lmdb_and_of_an_image_list(tmp_path, capsys):
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(7, 5, 6, 3), dtype=np.uint8)
    write_arrays(tmp_path / "db", images, np.arange(7))
    write_arrays(tmp_path / "db_png", images, np.arange(7), encode="png")
    want = images.astype(np.float64).mean(axis=0).transpose(2, 0, 1)[None]
    for db in ("db", "db_png"):
        out = tmp_path / f"{db}.binaryproto"
        assert main(["mean", str(tmp_path / db), str(out), "--progress"]) == 0
        blob = read_binaryproto(out)
        assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 5, 6)  # as Caffe
        np.testing.assert_allclose(blob_to_array(blob), want, rtol=1e-6)
    assert "Processed 7 files." in capsys.readouterr().out
    assert main(["mean", str(tmp_path / "db")]) == 0  # no output file: the channel means
    out = capsys.readouterr().out
    for c in range(3):
        value = float(out.split(f"mean_value channel [{c}]: ")[1].split()[0])
        assert value == pytest.approx(images[..., c].mean(), rel=1e-5)
    # an image list, read as Caffe's ImageData (OpenCV, BGR); written here with Pillow (RGB)
    from PIL import Image
    lines = []
    for i, img in enumerate(images):
        Image.fromarray(img[:, :, ::-1]).save(tmp_path / f"im{i}.png")  # BGR -> RGB file
        lines.append(f"im{i}.png {i % 2}")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    assert main(["compute_image_mean", str(tmp_path / "list.txt"), str(tmp_path / "l.bp"),
                 "--list", "--root", str(tmp_path)]) == 0
    np.testing.assert_allclose(blob_to_array(read_binaryproto(tmp_path / "l.bp")), want,
                               rtol=1e-6)


def test_mean_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    write_arrays(tmp_path / "a", [np.zeros((4, 4, 1), np.uint8), np.zeros((5, 4, 1), np.uint8)],
                 [0, 1])
    assert main(["mean", str(tmp_path / "a"), str(tmp_path / "m.binaryproto")]) == 1
    _one_line_error(capsys, "record", "the mean needs one size", "--resize-height")
    assert main(["mean", str(tmp_path / "none"), str(tmp_path / "m.binaryproto")]) == 1
    _one_line_error(capsys, "none", "not found")
    assert main(["mean", str(tmp_path / "a"), str(tmp_path / "m.binaryproto"), "-backend",
                 "leveldb"]) == 1
    _one_line_error(capsys, "-backend leveldb")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("m.", ".m."))]


# -- features ---------------------------------------------------------------------------------

NET = """name: "feat"
layer { name: "d" type: "Data" top: "data" top: "label" include { phase: TEST }
        transform_param { scale: 0.00390625 }
        data_param { source: "db" batch_size: 4 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 3 } }
"""
DEPLOY = NET.replace(NET[NET.index("layer"):NET.index('layer { name: "conv1"')],
                     'input: "data" input_shape { dim: 8 dim: 1 dim: 8 dim: 8 }\n')


def _features_setup(tmp_path):
    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, size=(10, 8, 8, 1), dtype=np.uint8)
    write_arrays(tmp_path / "db", images, np.zeros(10, int))
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    net = proto.NetParameter(name="feat")
    for name, kind, shapes in (("conv1", "Convolution", [(4, 1, 3, 3), (4,)]),
                               ("ip1", "InnerProduct", [(3, 144), (3,)])):
        lp = net.layer.add(name=name, type=kind)
        for s in shapes:
            array_to_blob(rng.normal(size=s).astype(np.float32), blob=lp.blobs.add())
    (tmp_path / "w.caffemodel").write_bytes(net.SerializeToString())
    x = images[:8].transpose(0, 3, 1, 2).astype(np.float32) * np.float32(0.00390625)
    relu, ip = opencv_forward(tmp_path / "deploy.prototxt", tmp_path / "w.caffemodel",
                              {"data": x}, ["relu1", "ip1"])
    return relu, ip


def test_features_to_lmdb_and_npz_match_opencv(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relu, ip = _features_setup(tmp_path)
    # Caffe's order: weights, net, blobs, datasets, batches, db type
    assert main(["extract_features", "w.caffemodel", "net.prototxt", "conv1,ip1",
                 "conv_db,ip_db", "2", "lmdb", "GPU", "0"]) == 0
    captured = capsys.readouterr()
    assert "Successfully extracted the features!" in captured.out
    assert "GPU 0 ignored" in captured.err
    for db, want in (("conv_db", relu), ("ip_db", ip)):
        with DatumReader(tmp_path / db) as reader:
            items = list(reader.items())
        assert [k for k, _ in items] == [f"{i:010d}" for i in range(8)]
        d = items[0][1]
        dims = want.shape[1:] + (1,) * (4 - want.ndim)
        assert (d.channels, d.height, d.width) == dims
        got = np.stack([np.asarray(d.float_data).reshape(want.shape[1:]) for _, d in items])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert main(["features", "--weights", "w.caffemodel", "--model", "net.prototxt",
                 "--blobs", "ip1", "--output", "f.npz", "--batches", "2"]) == 0
    with np.load(tmp_path / "f.npz") as f:
        np.testing.assert_allclose(f["ip1"], ip, rtol=1e-4, atol=1e-5)


def test_features_errors_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _features_setup(tmp_path)
    before = set(os.listdir(tmp_path))
    assert main(["features", "w.caffemodel", "net.prototxt", "fc7", "fc7_db", "1"]) == 1
    _one_line_error(capsys, "net.prototxt", "no blob 'fc7'", "conv1")
    assert main(["features", "w.caffemodel", "net.prototxt", "ip1", "x", "1", "leveldb"]) == 1
    _one_line_error(capsys, "leveldb", "LMDB")
    assert main(["features", "w.caffemodel", "net.prototxt", "ip1,conv1", "x", "1"]) == 1
    _one_line_error(capsys, "2 blob names", "1 dataset")
    assert main(["features", "w.caffemodel", "deploy.prototxt", "ip1", "x", "1"]) == 1
    _one_line_error(capsys, "deploy.prototxt", "no data layer")
    assert main(["features", "net.prototxt", "w.caffemodel", "ip1", "x", "1"]) == 1
    _one_line_error(capsys, "error")
    assert set(os.listdir(tmp_path)) == before


# -- upgrade ----------------------------------------------------------------------------------

def test_upgrade_v1_cifar10_quick_text_binary_and_solver(tmp_path, capsys):
    root = need_shared("caffe-models", "cifar10_quick_v1")
    old = root / "cifar10_quick.prototxt"
    assert "layers {" in old.read_text()
    assert main(["upgrade_net_proto_text", str(old), str(tmp_path / "new.prototxt")]) == 0
    text = (tmp_path / "new.prototxt").read_text()
    assert "layers {" not in text and "blobs_lr" not in text and "input_dim" not in text
    new = read_net(tmp_path / "new.prototxt", upgrade=False)  # current format as written
    ref = read_net(old)  # the V1 file, upgraded when parsed
    assert [l.name for l in new.layer] == [l.name for l in ref.layer]
    for a, b in zip(new.layer, ref.layer):
        assert text_format.MessageToString(a) == text_format.MessageToString(b)
    assert new.layer[1].type == "Convolution" and new.layer[1].param[1].lr_mult == 2
    # binary: V1 layers {} -> layer {}, the same blobs
    weights = root / "cifar10_quick_iter_5000.caffemodel"
    assert main(["upgrade", str(weights), str(tmp_path / "new.caffemodel")]) == 0
    raw_old, raw_new = proto.NetParameter(), proto.NetParameter()
    raw_old.ParseFromString(weights.read_bytes())
    raw_new.ParseFromString((tmp_path / "new.caffemodel").read_bytes())
    assert len(raw_old.layers) and not len(raw_new.layers) and len(raw_new.layer)
    old_blobs = {l.name: l.blobs for l in raw_old.layers}
    for lp in raw_new.layer:
        for x, y in zip(lp.blobs, old_blobs[lp.name]):
            np.testing.assert_array_equal(blob_to_array(x).ravel(), blob_to_array(y).ravel())
    # OpenCV reads the upgraded pair and gives the V1 pair's output
    x = np.random.default_rng(0).normal(size=(1, 3, 32, 32)).astype(np.float32)
    (a,) = opencv_forward(old, weights, {"data": x}, ["prob"])
    (b,) = opencv_forward(tmp_path / "new.prototxt", tmp_path / "new.caffemodel",
                          {"data": x}, ["prob"])
    np.testing.assert_allclose(b, a, rtol=1e-6)
    # an old solver: solver_type enum -> type string
    (tmp_path / "old_solver.prototxt").write_text(
        'net: "new.prototxt"\nbase_lr: 0.01\nsolver_type: NESTEROV\nmomentum: 0.9\n')
    assert main(["upgrade_solver_proto_text", str(tmp_path / "old_solver.prototxt"),
                 str(tmp_path / "solver.prototxt")]) == 0
    solver = text_format.Parse((tmp_path / "solver.prototxt").read_text(),
                               proto.SolverParameter())
    assert solver.type == "Nesterov" and not solver.HasField("solver_type")
    assert solver.base_lr == pytest.approx(0.01) and solver.net == "new.prototxt"


def test_upgrade_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "both.prototxt").write_text('base_lr: 0.1 solver_type: ADAM type: "SGD"\n')
    assert main(["upgrade", str(tmp_path / "both.prototxt"), str(tmp_path / "o.prototxt")]) == 1
    _one_line_error(capsys, "both.prototxt", "solver_type: ADAM", "type: 'SGD'")
    (tmp_path / "bad.prototxt").write_text("layer { name: 'a' bogus: 1 }\n")
    assert main(["upgrade", str(tmp_path / "bad.prototxt"), str(tmp_path / "o.prototxt")]) == 1
    _one_line_error(capsys, "bad.prototxt", "bogus")
    assert not (tmp_path / "o.prototxt").exists()


# -- draw -------------------------------------------------------------------------------------

DRAW_NET = NET.replace('layer { name: "ip1"', """layer { name: "pool1" type: "Pooling"
        bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1\"""").replace('bottom: "conv1" top: "ip1"', 'bottom: "pool1" top: "ip1"')


def _colour_pixels(im, hexcolour):
    rgb = np.asarray(im.convert("RGB")).reshape(-1, 3)
    want = np.array([int(hexcolour[i:i + 2], 16) for i in (1, 3, 5)])
    return int(np.all(rgb == want, axis=1).sum())


def test_draw_png_and_svg(tmp_path, capsys):
    from PIL import Image
    (tmp_path / "net.prototxt").write_text(DRAW_NET)
    assert main(["draw", str(tmp_path / "net.prototxt"), str(tmp_path / "lr.png")]) == 0
    assert main(["draw_net", str(tmp_path / "net.prototxt"), str(tmp_path / "tb.png"),
                 "--rankdir", "TB", "--phase", "TEST"]) == 0
    with Image.open(tmp_path / "lr.png") as lr, Image.open(tmp_path / "tb.png") as tb:
        assert lr.format == tb.format == "PNG"
        assert lr.size[0] > lr.size[1] >= 150 and tb.size[1] > tb.size[0] >= 150
        # draw_net.py's colours: convolution, pooling, inner product, in-place neuron, blob
        for colour in ("#FF5050", "#FF9900", "#CC33FF", "#90EE90", "#E0E0E0", "#6495ED"):
            assert _colour_pixels(lr, colour) > 50, colour
    assert main(["draw", str(tmp_path / "net.prototxt"), str(tmp_path / "n.svg")]) == 0
    assert "<svg" in (tmp_path / "n.svg").read_text()[:2000]
    assert main(["draw", str(tmp_path / "net.prototxt"), str(tmp_path / "n.gif")]) == 1
    _one_line_error(capsys, "n.gif", ".png")
    assert main(["draw", str(tmp_path / "nope.prototxt"), str(tmp_path / "n.png")]) == 1
    _one_line_error(capsys, "nope.prototxt")
    assert not (tmp_path / "n.gif").exists() and not (tmp_path / "n.png").exists()


# -- device_query -----------------------------------------------------------------------------

def test_device_query(capsys):
    assert main(["device_query", "-gpu", "0"]) == 0
    out = capsys.readouterr().out
    assert "Querying device ID = 0" in out and "Device id:" in out and "Name:" in out
    assert main(["device_query", "-gpu", "99"]) == 1
    _one_line_error(capsys, "-gpu 99", "no device 99")


def test_draw_through_pydot_when_installed(tmp_path, monkeypatch):
    """draw_net.py's route (pydot + Graphviz; neither is installed here): a stand-in pydot
    records the graph it is given."""
    import shutil
    import sys
    import types

    made = {"nodes": {}, "edges": [], "graph": None}

    class Dot:
        def __init__(self, name, **kw):
            made["graph"] = (name, kw)

        def add_node(self, node):
            made["nodes"][node.name] = node.kw

        def add_edge(self, edge):
            made["edges"].append((edge.src, edge.dst, edge.kw["label"]))

        def create(self, format):
            return b"picture:" + format.encode()

    class Node:
        def __init__(self, name, **kw):
            self.name, self.kw = name, kw

    class Edge:
        def __init__(self, src, dst, **kw):
            self.src, self.dst, self.kw = src, dst, kw

    monkeypatch.setitem(sys.modules, "pydot", types.SimpleNamespace(Dot=Dot, Node=Node,
                                                                     Edge=Edge))
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/dot")
    (tmp_path / "net.prototxt").write_text(DRAW_NET)
    assert main(["draw", str(tmp_path / "net.prototxt"), str(tmp_path / "n.svg"),
                 "--engine", "pydot", "-rankdir", "TB"]) == 0
    assert (tmp_path / "n.svg").read_bytes() == b"picture:svg"
    assert made["graph"] == ("feat", {"graph_type": "digraph", "rankdir": "TB"})
    nodes = made["nodes"]
    assert nodes["conv1_Convolution"]["fillcolor"] == "#FF5050"
    assert nodes["conv1_Convolution"]["label"] == \
        '"conv1 (Convolution) kernel size: 3 stride: 1 pad: 0"'  # TB: one line, as draw_net.py
    assert nodes["pool1_Pooling"]["label"].startswith('"pool1 (Pooling MAX) kernel size: 2')
    assert nodes["relu1_ReLU"]["fillcolor"] == "#90EE90"
    assert nodes["conv1_blob"]["shape"] == "octagon"
    assert ("d_Data", "data_blob", '"Batch 4"') in made["edges"]
    assert ("conv1_Convolution", "conv1_blob", '"4"') in made["edges"]
