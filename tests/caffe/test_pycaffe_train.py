"""pycaffe's backward and solvers: Net.backward's blob and param diffs against central finite
differences of the forward loss (float64 sums of float32 runs), and a pycaffe solver loop
(``step``) against the Solver's own run and against SGD on backward's gradient."""

from __future__ import annotations

import numpy as np
import pytest

import keras_cct.caffe as caffe
from keras_cct.caffe import load_solver
from keras_cct.errors import CaffeFormatError

NET = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 3 dim: 2 dim: 5 dim: 5 } shape { dim: 3 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "act1" type: "TanH" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: AVE kernel_size: 2 stride: 1 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss"
        loss_weight: 2 }
"""


@pytest.fixture
def net(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    n = caffe.Net(str(tmp_path / "net.prototxt"), caffe.TRAIN)
    rng = np.random.default_rng(0)
    n.blobs["data"].data[...] = rng.normal(size=(3, 2, 5, 5))
    n.blobs["label"].data[...] = [0, 3, 1]
    return n


def _loss(net) -> float:
    return float(np.asarray(net.forward()["loss"], np.float64))


def _fd(net, array, idx, h=1e-2) -> float:
    old = float(array[idx])
    array[idx] = old + h
    up = _loss(net)
    array[idx] = old - h
    down = _loss(net)
    array[idx] = old
    return (up - down) / (2 * h)


def test_backward_diffs_match_finite_differences(net):
    out = net.forward()
    assert set(out) == {"loss"} and net.blobs["loss"].diff == 2.0  # loss_weight
    assert net.blob_loss_weights["loss"] == 2.0 and net.blob_loss_weights["ip1"] == 0.0
    assert net._blob_names == ["data", "label", "conv1", "pool1", "ip1", "loss"]
    diffs = net.backward()
    assert set(diffs) == {"data", "label"}
    rng = np.random.default_rng(1)
    checks = [("param", "conv1", 0), ("param", "conv1", 1), ("param", "ip1", 0),
              ("param", "ip1", 1), ("blob", "data", None)]
    for kind, name, i in checks:
        if kind == "param":
            data, diff = net.params[name][i].data, net.params[name][i].diff.copy()
        else:
            data, diff = net.blobs[name].data, net.blobs[name].diff.copy()
        assert np.abs(diff).max() > 0, name
        for _ in range(4):
            idx = tuple(int(rng.integers(0, d)) for d in data.shape)
            # the loss blob holds the unweighted loss; its diff (loss_weight 2) scales the
            # gradient, as Caffe's loss layers do
            fd = 2.0 * _fd(net, data, idx)
            assert abs(fd - diff[idx]) <= 2e-3 + 2e-2 * abs(fd), (name, i, idx, fd, diff[idx])
    # the in-place TanH: blob conv1's diff is the gradient at the convolution's output
    net.forward()
    net.clear_param_diffs()
    net.backward()
    w, b = net.params["conv1"][0].data, net.params["conv1"][1].diff
    np.testing.assert_allclose(b, net.blobs["conv1"].diff.sum(axis=(0, 2, 3)), rtol=1e-4,
                               atol=1e-6)
    # Caffe accumulates param diffs: a second backward doubles them
    first = net.params["ip1"][0].diff.copy()
    net.backward()
    np.testing.assert_allclose(net.params["ip1"][0].diff, 2 * first, rtol=1e-5)
    net.clear_param_diffs()
    assert not np.any(net.params["ip1"][0].diff)
    assert w.shape == (3, 2, 3, 3)


def test_backward_from_given_top_diffs_and_range(net):
    """backward(start=, end=) with a given top diff: the bottoms' diff is the vector-Jacobian
    product of the layers in between (checked by finite differences)."""
    net.forward()
    rng = np.random.default_rng(2)
    seed = rng.normal(size=net.blobs["pool1"].shape).astype(np.float32)
    net.blobs["pool1"].diff[...] = seed
    net.clear_param_diffs()
    got = net.backward(start="pool1", end="conv1")
    assert set(got) == {"data"}
    x = net.blobs["data"].data

    def f():
        net.forward(end="pool1")
        return float(np.sum(net.blobs["pool1"].data.astype(np.float64) * seed))

    for _ in range(4):
        idx = tuple(int(rng.integers(0, d)) for d in x.shape)
        old = float(x[idx])
        x[idx] = old + 1e-2
        up = f()
        x[idx] = old - 1e-2
        down = f()
        x[idx] = old
        fd = (up - down) / 2e-2
        assert abs(fd - got["data"][idx]) <= 2e-3 + 2e-2 * abs(fd)
    assert not np.any(net.params["ip1"][0].diff)  # ip1 is outside the range
    assert np.any(net.params["conv1"][0].diff)


SOLVER_NET = """
name: "tiny_train"
layer { name: "feed" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 4 channels: 2 height: 5 width: 5 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 3 kernel_size: 3
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


def _solver_files(tmp_path, extra=""):
    (tmp_path / "net.prototxt").write_text(SOLVER_NET)
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 10 '
                    f'display: 0 snapshot_prefix: "{tmp_path}/snap" random_seed: 5 {extra}')
    rng = np.random.default_rng(0)
    arrays = {"data": rng.normal(size=(4, 5, 5, 2)).astype(np.float32),
              "label": np.array([0, 1, 2, 1], np.float32)}
    return str(path), arrays


def test_solver_step_matches_sgd_on_backward_gradient(tmp_path):
    path, arrays = _solver_files(tmp_path)
    solver = caffe.SGDSolver(path, arrays=arrays, log=lambda line: None)
    net = solver.net
    assert solver.iter == 0 and solver.type == "SGD"
    out = net.forward()  # the one batch the MemoryData layer cycles through
    assert out["loss"] > 0
    net.clear_param_diffs()
    net.backward()
    before = {k: [b.data.copy() for b in v] for k, v in net.params.items()}
    grads = {k: [b.diff.copy() for b in v] for k, v in net.params.items()}
    solver.step(1)
    assert solver.iter == 1
    for k, blobs in net.params.items():
        for i, b in enumerate(blobs):
            assert np.abs(grads[k][i]).max() > 0, (k, i)
            lr = 0.1 * (2 if (k == "conv1" and i == 1) else 1)  # lr_mult
            np.testing.assert_allclose(b.data, before[k][i] - lr * grads[k][i], rtol=1e-4,
                                       atol=1e-6, err_msg=f"{k}[{i}]")


def test_solver_loop_matches_the_solvers_own_run_and_sees_edits(tmp_path):
    path, arrays = _solver_files(tmp_path, "momentum: 0.9 weight_decay: 0.01")
    mine = caffe.get_solver(path, arrays=arrays, log=lambda line: None)
    ref = load_solver(path, arrays=arrays, log=lambda line: None)
    # the same starting weights, one of them set through net.params (Caffe's layout)
    w = np.random.default_rng(9).normal(size=(3, 2, 3, 3)).astype(np.float32)
    mine.net.params["conv1"][0].data[...] = w
    ref.train_net.model.get_layer("conv1").set_weights(
        [w.transpose(2, 3, 1, 0), mine.net.params["conv1"][1].data.copy()])
    ref.train_net.model.get_layer("ip1").set_weights(
        [mine.net.params["ip1"][0].data.copy(), mine.net.params["ip1"][1].data.copy()])
    for _ in range(3):
        mine.step(2)
    ref.step(6)
    assert mine.iter == ref.iter == 6
    got = mine.net.params["conv1"][0].data
    want = ref.train_net.model.get_layer("conv1").get_weights()[0].transpose(3, 2, 0, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(got - w).max() > 1e-3  # it trained
    np.testing.assert_allclose(mine.net.params["ip1"][0].data,
                               ref.train_net.model.get_layer("ip1").get_weights()[0],
                               rtol=1e-5, atol=1e-6)
    mine.snapshot()
    assert (tmp_path / "snap_iter_6.caffemodel").exists()
    assert (tmp_path / "snap_iter_6.solverstate").exists()
    again = caffe.SGDSolver(path, arrays=arrays, log=lambda line: None)
    again.restore(str(tmp_path / "snap_iter_6.solverstate"))
    assert again.iter == 6
    np.testing.assert_allclose(again.net.params["conv1"][0].data, got, rtol=1e-6)


def test_mode_functions():
    caffe.set_mode_cpu()
    caffe.set_device(0)
    with pytest.warns(UserWarning, match="Keras backend's devices"):
        caffe.set_mode_gpu()
    with pytest.raises(ValueError, match="device id"):
        caffe.set_device(-1)


DROP_NET = """
name: "drop"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 6 } shape { dim: 4 } } }
layer { name: "ip0" type: "InnerProduct" bottom: "data" top: "ip0"
        inner_product_param { num_output: 32 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.3 } } }
layer { name: "drop" type: "Dropout" bottom: "ip0" top: "drop"
        dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip1" type: "InnerProduct" bottom: "drop" top: "ip1"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


def test_backward_uses_the_forward_dropout_mask(tmp_path):
    (tmp_path / "d.prototxt").write_text(DROP_NET)
    net = caffe.Net(str(tmp_path / "d.prototxt"), caffe.TRAIN)
    net.blobs["data"].data[...] = np.random.default_rng(0).normal(size=(4, 6))
    net.blobs["label"].data[...] = [0, 1, 2, 0]
    net.forward()
    dropped = net.blobs["drop"].data == 0
    assert 0.2 < dropped.mean() < 0.8  # Caffe's TRAIN phase drops
    kept = ~dropped
    np.testing.assert_allclose(net.blobs["drop"].data[kept], 2.0 * net.blobs["ip0"].data[kept],
                               rtol=1e-6)  # scaled by 1 / (1 - ratio)
    net.backward()
    d = net.blobs["ip0"].diff
    assert np.all(d[dropped] == 0) and np.all(d[kept] != 0)
    np.testing.assert_allclose(d[kept], 2.0 * net.blobs["drop"].diff[kept], rtol=1e-5)
    test_net = caffe.Net(str(tmp_path / "d.prototxt"), caffe.TEST)
    test_net.blobs["data"].data[...] = net.blobs["data"].data
    test_net.share_with(net)
    test_net.forward()
    np.testing.assert_allclose(test_net.blobs["drop"].data, test_net.blobs["ip0"].data)


def test_forward_backward_all_and_reshape(net):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(7, 2, 5, 5)).astype(np.float32)
    labels = np.array([0, 1, 2, 3, 0, 1, 2], np.float32)
    outs = net.forward_all(data=x, label=labels)
    assert set(outs) == {"loss"} and outs["loss"].shape == (3,)  # one loss per batch of 3
    net.forward(data=x[3:6], label=labels[3:6])
    assert np.isclose(outs["loss"][1], float(net.blobs["loss"].data), rtol=1e-6)
    fw, bw = net.forward_backward_all(data=x, label=labels)
    assert bw["data"].shape == (7, 2, 5, 5) and fw["loss"].shape == (3,)
    net.clear_param_diffs()
    net.forward(data=x[3:6], label=labels[3:6])
    net.backward()
    np.testing.assert_allclose(bw["data"][3:6], net.blobs["data"].diff, rtol=1e-5, atol=1e-7)
    # a new batch size: reshape the inputs, then every blob follows
    net.blobs["data"].reshape(5, 2, 5, 5)
    net.blobs["label"].reshape(5)
    net.reshape()
    assert net.blobs["conv1"].shape == (5, 3, 3, 3) and net.blobs["ip1"].shape == (5, 4)
    net.blobs["data"].data[...] = x[:5]
    net.blobs["label"].data[...] = labels[:5]
    assert np.isfinite(net.forward()["loss"])


DATA_NET = """
name: "lmdb_net"
layer { name: "d" type: "Data" top: "data" top: "label"
        transform_param { scale: 0.00390625 }
        data_param { source: "db" batch_size: 3 backend: LMDB } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


def test_data_layer_net_reads_its_lmdb_batches(tmp_path):
    from keras_cct.caffe.io.lmdb_io import write_arrays
    rng = np.random.default_rng(6)
    images = rng.integers(0, 256, (5, 4, 4, 2), dtype=np.uint8)  # HWC records
    labels = [0, 1, 1, 0, 1]
    write_arrays(str(tmp_path / "db"), images, labels)
    (tmp_path / "net.prototxt").write_text(DATA_NET)
    net = caffe.Net(str(tmp_path / "net.prototxt"), caffe.TRAIN)
    assert net.inputs == [] and net.blobs["data"].shape == (3, 2, 4, 4)
    seen = []
    for _ in range(2):  # records 0-2, then 3, 4 and (cycling) 0
        net.forward()
        seen.append((net.blobs["data"].data.copy(), net.blobs["label"].data.copy()))
    want = images.transpose(0, 3, 1, 2) * 0.00390625
    np.testing.assert_allclose(seen[0][0], want[:3], rtol=1e-6)
    np.testing.assert_allclose(seen[1][0], want[[3, 4, 0]], rtol=1e-6)
    np.testing.assert_array_equal(seen[1][1], [0, 1, 0])
    # the loss of the last batch, by numpy from the blobs
    w, b = net.params["ip1"][0].data, net.params["ip1"][1].data
    logits = seen[1][0].reshape(3, -1).astype(np.float64) @ w.T.astype(np.float64) + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_loss = -np.mean(np.log(p[np.arange(3), [0, 1, 0]]))
    assert np.isclose(float(net.blobs["loss"].data), want_loss, rtol=1e-5)


FCN = """
name: "fcn"
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.5 } } }
"""


def test_reshape_to_a_new_image_size_keeps_the_weights(tmp_path):
    (tmp_path / "fcn.prototxt").write_text(FCN)
    net = caffe.Net(str(tmp_path / "fcn.prototxt"), caffe.TEST)
    w = net.params["conv1"][0].data.copy()
    b = net.params["conv1"][1].data.copy()
    net.blobs["data"].reshape(2, 2, 5, 7)
    net.reshape()
    assert net.blobs["conv1"].shape == (2, 3, 5, 7)
    x = np.random.default_rng(8).normal(size=(2, 2, 5, 7)).astype(np.float32)
    out = net.forward(data=x)["conv1"]
    # by numpy: a 3x3 cross-correlation with zero padding 1
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.zeros((2, 3, 5, 7))
    for i in range(5):
        for j in range(7):
            patch = xp[:, :, i:i + 3, j:j + 3]
            want[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w) + b
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(net.params["conv1"][0].data, w)


def test_solver_nets_forward_their_data(tmp_path):
    path, arrays = _solver_files(tmp_path)
    solver = caffe.get_solver(path, arrays=arrays, log=lambda line: None)
    out = solver.net.forward()
    np.testing.assert_allclose(solver.net.blobs["data"].data,
                               arrays["data"].transpose(0, 3, 1, 2))
    assert set(out) == {"loss"} and float(out["loss"]) > 0


PY_MODULE = '''
import numpy as np
import caffe


class Cube(caffe.Layer):
    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data ** 3

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 3 * bottom[0].data ** 2 * top[0].diff
'''

PY_NET = """
name: "py"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "cube" type: "Python" bottom: "data" top: "cube"
        python_param { module: "MODNAME" layer: "Cube" } }
"""


def test_python_layers_run_in_a_pycaffe_net(tmp_path):
    import sys
    name = "pycaffe_cube_layer"
    (tmp_path / f"{name}.py").write_text(PY_MODULE)
    (tmp_path / "py.prototxt").write_text(PY_NET.replace("MODNAME", name))
    try:
        from keras_cct.errors import CaffeFormatError
        with pytest.raises(CaffeFormatError, match=f"module '{name}', class 'Cube'.*"
                                                   "python_layers=True"):
            caffe.Net(str(tmp_path / "py.prototxt"), caffe.TEST)  # opt in only
        assert name not in sys.modules  # refused before anything was imported
        net = caffe.Net(str(tmp_path / "py.prototxt"), caffe.TEST, python_layers=True)
        x = np.random.default_rng(3).normal(size=(2, 3)).astype(np.float32)
        np.testing.assert_allclose(net.forward(data=x)["cube"], x ** 3, rtol=1e-6)
        seed = np.random.default_rng(4).normal(size=(2, 3)).astype(np.float32)
        d = net.backward(cube=seed)["data"]
        np.testing.assert_allclose(d, 3 * x ** 2 * seed, rtol=1e-5)
    finally:
        sys.modules.pop(name, None)


def test_solver_test_nets_see_the_trained_weights(tmp_path):
    path, arrays = _solver_files(tmp_path, "test_iter: 1 test_interval: 1000")
    solver = caffe.AdamSolver(path, arrays=arrays, test_arrays=arrays, log=lambda line: None)
    assert solver.type == "Adam" and len(solver.test_nets) == 1
    test = solver.test_nets[0]
    held = test.params["conv1"][0].data
    start = held.copy()
    solver.step(2)
    assert np.abs(held - start).max() > 0  # refreshed in place after the step
    np.testing.assert_array_equal(held, solver.net.params["conv1"][0].data)
    out = test.forward()
    for name, blobs in solver.net.params.items():
        for a, b in zip(blobs, test.params[name]):
            np.testing.assert_array_equal(a.data, b.data)
    # the same batch through the train net (no dropout): the same loss
    assert np.isclose(float(solver.net.forward()["loss"]), float(out["loss"]), rtol=1e-6)


def test_forward_all_drops_the_padding_of_per_sample_outputs(net):
    # a batch of 3 and 4 inputs: the label blob (N,) and the conv blob come back with 4 rows
    x = np.random.default_rng(5).normal(size=(4, 2, 5, 5)).astype(np.float32)
    labels = np.array([1, 2, 3, 0], np.float32)
    outs = net.forward_all(blobs=["label", "ip1"], data=x, label=labels)
    np.testing.assert_array_equal(outs["label"], labels)
    assert outs["ip1"].shape == (4, 4) and outs["loss"].shape == (2,)
    net.forward(data=x[3:4].repeat(3, 0) * np.array([1, 0, 0])[:, None, None, None],
                label=np.array([0, 0, 0], np.float32))
    np.testing.assert_allclose(outs["ip1"][3], net.blobs["ip1"].data[0], rtol=1e-5)


def test_memory_data_net_and_set_input_arrays(tmp_path):
    (tmp_path / "net.prototxt").write_text(SOLVER_NET)  # MemoryData, batch 4
    net = caffe.Net(str(tmp_path / "net.prototxt"), caffe.TEST)
    assert net.blobs["data"].shape == (4, 2, 5, 5)
    rng = np.random.default_rng(11)
    data = rng.normal(size=(8, 2, 5, 5)).astype(np.float32)
    labels = np.arange(8, dtype=np.float32) % 3
    net.set_input_arrays(data, labels)
    for i in (0, 1, 0):  # batches in order, then again from the start
        net.forward()
        np.testing.assert_array_equal(net.blobs["data"].data, data[4 * i:4 * i + 4])
        np.testing.assert_array_equal(net.blobs["label"].data, labels[4 * i:4 * i + 4])
    with pytest.raises(CaffeFormatError, match="multiple of the batch size 4"):
        net.set_input_arrays(data[:6], labels[:6])


BN_NET = """
name: "bn"
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 4 dim: 3 dim: 2 dim: 2 } shape { dim: 4 dim: 2 } } }
layer { name: "bn" type: "BatchNorm" bottom: "data" top: "data" }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""


def test_backward_leaves_batchnorm_statistics_as_forward_left_them(tmp_path):
    (tmp_path / "bn.prototxt").write_text(BN_NET)
    net = caffe.Net(str(tmp_path / "bn.prototxt"), caffe.TRAIN)
    rng = np.random.default_rng(12)
    x = rng.normal(2.0, 3.0, size=(4, 3, 2, 2)).astype(np.float32)
    net.blobs["target"].data[...] = rng.normal(size=(4, 2))
    bn = net.model.get_layer("bn")
    before = [w.copy() for w in bn.get_weights()]
    net.blobs["data"].data[...] = x  # (pycaffe's forward(**inputs) wants every input)
    net.forward()
    after_forward = [w.copy() for w in bn.get_weights()]
    assert after_forward[2][0] != before[2][0]  # TRAIN: the running statistics moved
    # the batch-normalized blob (in place on "data"): zero mean per channel, as Caffe
    np.testing.assert_allclose(net.blobs["data"].data.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    net.backward()
    for a, b in zip(bn.get_weights(), after_forward):
        np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(net.params["ip"][0].diff)) and np.any(net.params["ip"][0].diff)
