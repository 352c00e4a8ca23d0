"""Malformed Caffe files (issue 15, part A): each is a CaffeFormatError naming the file, line or
layer and the field, raised before anything large is allocated or looped over."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from keras_cct.caffe import import_net, load_net, load_weights, proto, save_weights
from keras_cct.caffe.io.binary import (read_binaryproto, read_caffemodel, read_solverstate,
                                       write_binaryproto, write_solverstate)
from keras_cct.caffe.io.validate import MAX_ITER_SIZE, remove_stale_temps
from keras_cct.caffe.train.config import read_solver
from keras_cct.caffe.train.data import skip_batches
from keras_cct.caffe.train.solver import load_solver
from keras_cct.errors import CaffeFormatError

NET = """name: "tiny"
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer {
  name: "conv"
  type: "Convolution"
  bottom: "data"
  top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 }
}
layer {
  name: "pool"
  type: "Pooling"
  bottom: "conv"
  top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 }
}
layer {
  name: "fc"
  type: "InnerProduct"
  bottom: "pool"
  top: "fc"
  inner_product_param { num_output: 5 }
}
"""

IP_NET = """
name: "tiny_ip"
layer { name: "feed" type: "MemoryData" top: "data" top: "target"
        memory_data_param { batch_size: 4 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""


def _write(path, text):
    path.write_text(text)
    return str(path)


def _raises(fn, *needles):
    """fn() raises a CaffeFormatError whose message holds every needle, within 5 s."""
    t0 = time.perf_counter()
    with pytest.raises(CaffeFormatError) as info:
        fn()
    assert time.perf_counter() - t0 < 5, "the error came late (allocated or looped first?)"
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    return info.value


# -- 1. giant sizes: refused before allocating ------------------------------------------------

def test_giant_num_output_is_refused_before_allocating(tmp_path):
    path = _write(tmp_path / "net.prototxt", NET.replace("num_output: 4", "num_output: 999999999"))
    err = _raises(lambda: load_net(path), str(path), "layer 'conv'", "num_output 999999999",
                  "GiB")
    assert err.line == 4 and err.layer == "conv"


def test_giant_input_dim_into_inner_product_is_refused(tmp_path):
    net = """layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 1 dim: 999999999 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
        inner_product_param { num_output: 10 } }
"""
    path = _write(tmp_path / "net.prototxt", net)
    err = _raises(lambda: load_net(path), "layer 'fc'", "num_output 10 x 999999999 inputs",
                  "GiB")
    assert err.line == 3
    # the input itself is refused when it alone is too large
    path = _write(tmp_path / "n2.prototxt", NET.replace("dim: 8 dim: 8", "dim: 8 dim: 999999999"))
    _raises(lambda: load_net(path), "layer 'data'", "input blob 'data'", "GiB")


def test_giant_input_blob_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_CCT_CAFFE_MAX_BYTES", str(64 << 20))
    path = _write(tmp_path / "net.prototxt", NET.replace("dim: 2 dim: 3", "dim: 100000 dim: 3"))
    _raises(lambda: load_net(path), "layer 'data'", "input blob 'data'", "MiB")


# -- 2. zero and negative kernels, strides, groups ---------------------------------------------

@pytest.mark.parametrize("old,new,layer,field", [
    ("pool: MAX kernel_size: 2 stride: 2", "pool: MAX kernel_size: 2 stride: 0", "pool",
     "stride"),
    ("pool: MAX kernel_size: 2 stride: 2", "pool: MAX kernel_size: 0", "pool", "kernel_size"),
    ("pool: MAX kernel_size: 2 stride: 2", "pool: MAX kernel_h: 2 kernel_w: 2 stride_h: 0 "
     "stride_w: 1", "pool", "stride_h"),
    ("pool: MAX kernel_size: 2 stride: 2", "pool: MAX kernel_size: 2 pad: 2", "pool", "pad"),
    ("num_output: 4 kernel_size: 3", "num_output: 4 kernel_size: 0", "conv", "kernel_size"),
    ("num_output: 4 kernel_size: 3", "num_output: 4 kernel_size: 3 stride: 0", "conv",
     "stride"),
    ("num_output: 4 kernel_size: 3", "num_output: 4 kernel_size: 3 dilation: 0", "conv",
     "dilation"),
    ("num_output: 4 kernel_size: 3", "num_output: 4 kernel_size: 3 group: 0", "conv", "group"),
    ("num_output: 4 kernel_size: 3", "num_output: 4 kernel_size: 3 group: 3", "conv", "group"),
    ("num_output: 4 kernel_size: 3", "num_output: 0 kernel_size: 3", "conv", "num_output"),
    ("num_output: 4 kernel_size: 3", "num_output: 4 kernel_size: 30", "conv", "kernel_size"),
    ("inner_product_param { num_output: 5 }", "inner_product_param { num_output: 0 }", "fc",
     "num_output"),
])
def test_zero_and_bad_layer_parameters(tmp_path, old, new, layer, field):
    assert old in NET
    path = _write(tmp_path / "net.prototxt", NET.replace(old, new))
    err = _raises(lambda: load_net(path), str(path), f"layer '{layer}'", field)
    assert err.layer == layer and err.line is not None


def test_cct_info_with_stride_zero_is_one_line_error(tmp_path, capsys):
    from keras_cct.cli import main
    path = _write(tmp_path / "net.prototxt", NET.replace("stride: 2", "stride: 0"))
    rc = main(["info", path])
    err = capsys.readouterr().err
    assert rc != 0
    assert "stride is 0" in err and "Traceback" not in err


# -- 3. Reshape without reshape_param ----------------------------------------------------------

def test_reshape_without_reshape_param(tmp_path):
    net = NET + 'layer { name: "r" type: "Reshape" bottom: "fc" top: "r" }\n'
    path = _write(tmp_path / "net.prototxt", net)
    _raises(lambda: load_net(path), "layer 'r'", "reshape_param")
    net = NET + ('layer { name: "r" type: "Reshape" bottom: "fc" top: "r" '
                 'reshape_param { shape { dim: -1 dim: -1 } } }\n')
    _raises(lambda: load_net(_write(tmp_path / "n2.prototxt", net)), "layer 'r'", "-1")


# -- 4. strings that are not UTF-8 -------------------------------------------------------------

def _tiny_caffemodel(tmp_path):
    net = import_net(_write(tmp_path / "w.prototxt", NET))
    path = tmp_path / "w.caffemodel"
    save_weights(net, path)
    return net, path


def test_current_format_layer_name_not_utf8(tmp_path):
    net, path = _tiny_caffemodel(tmp_path)
    data = path.read_bytes()
    assert data.count(b"\x0a\x02fc") == 1  # the name "fc" (field 1, length 2)
    bad = tmp_path / "bad.caffemodel"
    bad.write_bytes(data.replace(b"\x0a\x02fc", b"\x0a\x02\xc3\x28"))
    _raises(lambda: load_weights(net, bad), str(bad), "layer[", ".name", "not UTF-8")
    _raises(lambda: read_caffemodel(bad), "not UTF-8")


def test_v1_caffemodel_strings_not_utf8(tmp_path):
    v1 = proto.NetParameter(name="v1")
    layer = v1.layers.add(name="ab", type=proto.V1LayerParameter.CONVOLUTION)
    layer.bottom.append("data")
    layer.top.append("ab")
    path = tmp_path / "v1.caffemodel"
    path.write_bytes(v1.SerializeToString().replace(b"ab", b"\xc3\x28"))
    _raises(lambda: read_caffemodel(path), str(path), "layers[0]", "not UTF-8")


def test_prototxt_escape_not_utf8(tmp_path):
    path = _write(tmp_path / "net.prototxt", NET.replace('name: "fc"', 'name: "\\303("'))
    _raises(lambda: load_net(path), f"{path}:20:", "utf-8")


# -- 5. solverstates: learned_net not UTF-8, /dev/zero ----------------------------------------

def _ip_solver(tmp_path, extra=""):
    _write(tmp_path / "net.prototxt", IP_NET)
    return _write(tmp_path / "solver.prototxt", f"""net: "net.prototxt"
snapshot_prefix: "{tmp_path}/ip"
{extra or "base_lr: 0.1 max_iter: 2 momentum: 0.9"}""")


def _ip_arrays():
    rng = np.random.default_rng(0)
    return {"data": rng.normal(size=(8, 4)).astype(np.float32),
            "target": rng.normal(size=(8, 3)).astype(np.float32)}


def test_solverstate_learned_net_not_utf8(tmp_path):
    path = tmp_path / "s.solverstate"
    write_solverstate(str(path), it=3, learned_net="ab.caffemodel", history=[])
    path.write_bytes(path.read_bytes().replace(b"ab.caffemodel", b"\xc3\x28.caffemodel"))
    _raises(lambda: read_solverstate(path), str(path), "learned_net", "not UTF-8")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_solverstate_learned_net_dev_zero(tmp_path):
    s = load_solver(_ip_solver(tmp_path), arrays=_ip_arrays(), log=lambda line: None)
    path = tmp_path / "z.solverstate"
    write_solverstate(str(path), it=1, learned_net="/dev/zero", history=s.history_blobs())
    _raises(lambda: s.restore(str(path)), "/dev/zero", "not a regular file")
    _raises(lambda: load_net("/dev/zero"), "/dev/zero", "not a regular file")
    _raises(lambda: read_binaryproto(tmp_path), "folder")


# -- 6. solver numbers out of range ------------------------------------------------------------

@pytest.mark.parametrize("line,field", [
    ("random_seed: 4294967296", "random_seed"), ("base_lr: -0.1", "base_lr"),
    ("max_iter: -1", "max_iter"), ("iter_size: 0", "iter_size"),
    ("iter_size: 999999999", "iter_size"), ("snapshot: -5", "snapshot"),
    ("test_iter: 0\ntest_interval: 10", "test_iter"), ("momentum: 1.5", "momentum"),
    ("weight_decay: -1", "weight_decay"), ("base_lr: nan", "base_lr"),
    ("display: -1", "display"), ("average_loss: 0", "average_loss"),
])
def test_solver_numbers_out_of_range(tmp_path, line, field):
    path = _ip_solver(tmp_path, line)
    err = _raises(lambda: read_solver(path), f"{path}:", f"{field}: ", "out of range")
    assert err.line == 3  # the first extra line
    assert str(MAX_ITER_SIZE) in str(err) or field != "iter_size"


def test_negative_random_seed_means_none(tmp_path):
    assert read_solver(_ip_solver(tmp_path, "random_seed: -1")).param.random_seed == -1


# -- 7. resuming at a huge iteration does not replay every batch -------------------------------

def test_restore_at_huge_iteration_returns_and_trains(tmp_path):
    s = load_solver(_ip_solver(tmp_path), arrays=_ip_arrays(), log=lambda line: None)
    path = tmp_path / "big.solverstate"
    write_solverstate(str(path), it=2147483000, learned_net="", history=s.history_blobs())
    t0 = time.perf_counter()
    s.restore(str(path))
    assert time.perf_counter() - t0 < 10
    assert s.iter == 2147483000
    s.step(1)
    assert s.iter == 2147483001


class _Counting:
    """A deterministic source of ``size`` records (record i is i) in batches of ``bs``."""

    def __init__(self, size, bs):
        self.name, self.size, self.batch_size, self.read = "c", size, bs, 0

    def batches(self):
        def gen():
            i = 0
            while True:
                self.read += 1
                yield {"x": np.array([(i + k) % self.size for k in range(self.batch_size)])}
                i = (i + self.batch_size) % self.size
        return gen()


@pytest.mark.parametrize("skip", [0, 1, 5, 12, 13, 1000, 2 ** 31 - 1])
def test_skip_batches_equals_replay(skip):
    a, b = _Counting(13, 4), _Counting(6, 4)
    got = next(skip_batches([a, b], skip))
    assert list(got["x"]) == [(skip * 4 + k) % 6 for k in range(4)]  # b's batch wins the key
    got = next(skip_batches([a], skip))
    assert list(got["x"]) == [(skip * 4 + k) % 13 for k in range(4)]
    assert a.read <= 2 * 13 + 2  # at most one period (13 batches) read per call


@pytest.mark.parametrize("skip", [7, 2 ** 31 - 1, 123456789])
def test_skip_batches_over_the_replay_budget(skip, monkeypatch):
    """A period too long to replay: less than one epoch is read, and the next batch starts at
    most batch_size - 1 records before the exact position."""
    from keras_cct.caffe.train import data
    monkeypatch.setattr(data, "EXACT_REPLAY_RECORDS", 0)
    src = _Counting(101, 8)  # period 101 batches (8 epochs)
    lines = []
    first = int(next(skip_batches([src], skip, log=lines.append))["x"][0])
    exact = (skip * 8) % 101
    assert 0 <= exact - first < 8
    assert src.read <= 101 // 8 + 2
    assert (exact != first) == bool(lines)


# -- 8. temporary files of an interrupted snapshot ---------------------------------------------

def test_stale_snapshot_temps_are_removed(tmp_path):
    stale = [tmp_path / ".ip_iter_3.solverstate.k2j4x.tmp",
             tmp_path / ".ip_iter_3.caffemodel.abcd.tmp.h5"]
    keep = [tmp_path / ".other_iter_3.solverstate.k2j4x.tmp", tmp_path / "ip_iter_3.solverstate"]
    for p in stale + keep:
        p.write_bytes(b"x")
    lines = []
    load_solver(_ip_solver(tmp_path), arrays=_ip_arrays(), log=lines.append)
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in keep)
    assert any("interrupted snapshot" in line for line in lines)
    assert remove_stale_temps(str(tmp_path / "ip")) == []


# -- 9. blobs whose shape disagrees with their data, truncated files ---------------------------

def test_binaryproto_giant_declared_shape(tmp_path):
    path = tmp_path / "mean.binaryproto"
    write_binaryproto(str(path), np.zeros((1, 3, 2, 2), np.float32))
    blob = proto.BlobProto.FromString(path.read_bytes())
    blob.shape.dim[:] = [100000, 100000, 100000]
    path.write_bytes(blob.SerializeToString())
    _raises(lambda: read_binaryproto(path), str(path), "(100000, 100000, 100000)", "12 values")


def test_caffemodel_blob_shape_disagrees_with_data(tmp_path):
    net, path = _tiny_caffemodel(tmp_path)
    model = read_caffemodel(path)
    fc = [lp for lp in model.layer if lp.name == "fc"][0]
    del fc.blobs[1].data[1:]  # bias declared (5,), holds 1 value
    bad = tmp_path / "bad.caffemodel"
    bad.write_bytes(model.SerializeToString())
    _raises(lambda: load_weights(net, bad), str(bad), "layer 'fc'", "holds 1 values")


@pytest.mark.parametrize("kind", ["caffemodel", "solverstate", "binaryproto"])
def test_truncated_protobufs(tmp_path, kind):
    if kind == "caffemodel":
        net, path = _tiny_caffemodel(tmp_path)
        read = lambda p: load_weights(net, p)  # noqa: E731
    elif kind == "solverstate":
        path = tmp_path / "s.solverstate"
        write_solverstate(str(path), it=3, learned_net="x.caffemodel",
                          history=[np.ones((4, 3), np.float32)])
        read = read_solverstate
    else:
        path = tmp_path / "m.binaryproto"
        write_binaryproto(str(path), np.ones((1, 3, 2, 2), np.float32))
        read = read_binaryproto
    data = path.read_bytes()
    bad = tmp_path / f"trunc.{kind}"
    bad.write_bytes(data[:len(data) - 3])
    _raises(lambda: read(bad), str(bad))


def test_learning_rate_that_overflows_is_refused(tmp_path):
    path = _ip_solver(tmp_path, 'base_lr: 0.1\nlr_policy: "inv"\ngamma: 0.0001\n'
                                'power: -2147483648\nmax_iter: 10000')
    err = _raises(lambda: read_solver(path), f"{path}:4:", "lr_policy 'inv'", "iteration 10000")
    assert err.line == 4


@pytest.mark.parametrize("old,new", [(b"HEAP", b"HEAQ"), (b"TREE", b"TREF"), (b"SNOD", b"SNOE")])
def test_corrupt_hdf5_caffemodel(tmp_path, old, new):
    """h5py raises RuntimeError/KeyError on damaged metadata: a CaffeFormatError instead."""
    net = import_net(_write(tmp_path / "w.prototxt", NET))
    path = tmp_path / "w.caffemodel.h5"
    save_weights(net, path)
    data = path.read_bytes()
    assert old in data
    bad = tmp_path / "bad.caffemodel.h5"
    bad.write_bytes(data.replace(old, new))
    _raises(lambda: load_weights(net, bad), str(bad), "HDF5")


def test_files_over_the_bound_are_not_read(tmp_path, monkeypatch):
    _, model = _tiny_caffemodel(tmp_path)
    monkeypatch.setenv("KERAS_CCT_CAFFE_MAX_BYTES", "300")
    path = _write(tmp_path / "net.prototxt", NET)  # ~600 bytes
    _raises(lambda: load_net(path), str(path), "more than the", "KERAS_CCT_CAFFE_MAX_BYTES")
    _raises(lambda: read_caffemodel(model), str(model), "more than the")
