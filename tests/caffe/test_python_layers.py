"""Caffe ``Python`` layers, opt in: a pycaffe-style module written beside the prototxt (it does
``import caffe``, as real ones do) is imported only with ``python_layers=True``; its forward,
backward and learnable blob are checked against numpy written from the layer's formulas, and a
model.fit step against a numpy SGD step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_cct.caffe import import_net
from keras_cct.caffe.net.layers.recurrent import Layer as PyCaffeLayer
from keras_cct.caffe.net.layers.recurrent import allow_python_layers
from keras_cct.caffe.net.layout import from_caffe_layout, to_caffe_layout
from keras_cct.errors import CaffeFormatError
from tests.reference import rel_err

ROOT = Path(__file__).resolve().parents[2]

MODULE = '''
import json
import numpy as np
import caffe


class ScaledReLU(caffe.Layer):
    """top = scale * max(bottom, 0); scale from param_str (JSON)."""

    def setup(self, bottom, top):
        self.scale = float(json.loads(self.param_str)["scale"])
        if len(bottom) != 1:
            raise Exception("one bottom")

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.scale * np.maximum(bottom[0].data, 0)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = self.scale * (bottom[0].data > 0) * top[0].diff


class ChannelScale(caffe.Layer):
    """top[n, c, ...] = w[c] * bottom[n, c, ...], w a learnable blob (initially 1 + c / 10);
    a second top: the per-sample sum of the first (N, 1)."""

    def setup(self, bottom, top):
        c = bottom[0].channels
        self.blobs.add_blob(c)
        self.blobs[0].data[...] = 1 + np.arange(c) / 10.0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)
        top[1].reshape(bottom[0].num, 1)

    def _w(self, nd):
        return self.blobs[0].data.reshape((1, -1) + (1,) * (nd - 2))

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data * self._w(bottom[0].data.ndim)
        top[1].data[...] = top[0].data.reshape(bottom[0].num, -1).sum(1, keepdims=True)

    def backward(self, top, propagate_down, bottom):
        x = bottom[0].data
        dy = top[0].diff + top[1].diff.reshape((-1,) + (1,) * (x.ndim - 1))
        bottom[0].diff[...] = dy * self._w(x.ndim)
        axes = (0,) + tuple(range(2, x.ndim))
        self.blobs[0].diff[...] = (dy * x).sum(axis=axes)
'''

NET = '''
name: "pynet"
layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 4 dim: 3 dim: 2 dim: 2 } } }
layer { name: "cs" type: "Python" bottom: "data" top: "scaled" top: "total"
  python_param { module: "MODNAME" layer: "ChannelScale" } }
layer { name: "act" type: "Python" bottom: "scaled" top: "out"
  python_param { module: "MODNAME" layer: "ScaledReLU" param_str: '{"scale": 2.5}' } }
'''


@pytest.fixture()
def pynet(tmp_path, request):
    """A prototxt and, beside it, a module with a name unique to the test."""
    name = f"pylayers_{request.node.name.replace('[', '_').replace(']', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    path = tmp_path / "net.prototxt"
    path.write_text(NET.replace("MODNAME", name))
    yield path, name
    sys.modules.pop(name, None)


def np_net(x, w, scale=2.5):
    scaled = x * w[None, :, None, None]
    total = scaled.reshape(len(x), -1).sum(1, keepdims=True)
    return scaled, total, scale * np.maximum(scaled, 0)


def test_without_the_flag_nothing_is_imported(pynet):
    path, name = pynet
    with pytest.raises(CaffeFormatError) as info:
        import_net(path)
    msg = str(info.value)
    assert name in msg and "ChannelScale" in msg
    assert "python_layers=True" in msg and "--python-layers" in msg
    assert "net.prototxt" in msg and "cs" in msg
    assert name not in sys.modules


def test_forward_matches_numpy(pynet):
    path, _ = pynet
    net = import_net(path, python_layers=True)
    assert net.outputs == ["out", "total"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3, 2, 2)).astype(np.float32)
    out, total = net.model([from_caffe_layout(x)])
    _, ref_total, ref_out = np_net(x.astype(np.float64), 1 + np.arange(3) / 10.0)
    assert rel_err(to_caffe_layout(keras.ops.convert_to_numpy(out)), ref_out) < 1e-6
    assert rel_err(keras.ops.convert_to_numpy(total), ref_total) < 1e-6
    # the layer's learnable blob is a Keras variable holding the values setup() gave it
    w = net.model.get_layer("cs").weights
    assert len(w) == 1 and np.allclose(keras.ops.convert_to_numpy(w[0]), [1, 1.1, 1.2])
    # another batch size than the prototxt's
    x2 = rng.normal(size=(7, 3, 2, 2)).astype(np.float32)
    out2, _ = net.model([from_caffe_layout(x2)])
    assert rel_err(to_caffe_layout(keras.ops.convert_to_numpy(out2)),
                   np_net(x2.astype(np.float64), 1 + np.arange(3) / 10.0)[2]) < 1e-6


def check_gradients(path):
    """Gradients of sum(out * p) + sum(total * q) through both Python layers vs numpy."""
    net = import_net(path, python_layers=True)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 3, 2, 2))
    p, q = rng.normal(size=(4, 3, 2, 2)), rng.normal(size=(4, 1))
    w = 1 + np.arange(3) / 10.0
    var = net.model.get_layer("cs").weights[0]
    xk = keras.ops.convert_to_tensor(from_caffe_layout(x.astype(np.float32)))
    pk = keras.ops.convert_to_tensor(from_caffe_layout(p.astype(np.float32)))
    qk = keras.ops.convert_to_tensor(q.astype(np.float32))
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf
        with tf.GradientTape() as tape:
            tape.watch(xk)
            out, total = net.model(xk)
            loss = tf.reduce_sum(out * pk) + tf.reduce_sum(total * qk)
        gx, gw = [np.asarray(g) for g in tape.gradient(loss, [xk, var.value])]
    elif backend == "jax":
        import jax

        def f(xx, ww):
            (out, total), _ = net.model.stateless_call([ww], [], xx)
            return (out * pk).sum() + (total * qk).sum()
        gx, gw = [np.asarray(g) for g in jax.grad(f, argnums=(0, 1))(xk, var.value)]
    else:
        xk = xk.detach().clone().requires_grad_(True)
        out, total = net.model(xk)
        loss = (out * pk).sum() + (total * qk).sum()
        gx, gw = [g.detach().cpu().numpy() for g in torch_grad(loss, [xk, var.value])]
    # numpy, by the chain rule written out
    scaled = x * w[None, :, None, None]
    d_scaled = 2.5 * (scaled > 0) * p + q.reshape(4, 1, 1, 1)
    ref_gx = d_scaled * w[None, :, None, None]
    ref_gw = (d_scaled * x).sum(axis=(0, 2, 3))
    assert rel_err(to_caffe_layout(gx), ref_gx) < 1e-5
    assert rel_err(gw, ref_gw) < 1e-5


def torch_grad(loss, xs):
    import torch
    return torch.autograd.grad(loss, xs)


def test_gradients_match_numpy(pynet):
    check_gradients(pynet[0])


def test_fit_step_matches_numpy_sgd(pynet):
    check_fit(pynet[0])


def check_fit(path):
    """Three model.fit steps (SGD on MSE) move the Python layer's blob as numpy's SGD does."""
    net = import_net(path, python_layers=True)
    model = keras.Model(net.model.inputs, net.model.outputs[0])
    lr = 0.05
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 3, 2, 2)).astype(np.float32)
    t = rng.normal(size=(4, 3, 2, 2)).astype(np.float32)
    w = 1 + np.arange(3) / 10.0
    for _ in range(3):
        model.fit(from_caffe_layout(x), from_caffe_layout(t), batch_size=4, epochs=1,
                  shuffle=False, verbose=0)
        scaled, _, out = np_net(x.astype(np.float64), w)
        d_out = 2 * (out - t) / out.size  # mean squared error over all elements
        d_scaled = 2.5 * (scaled > 0) * d_out
        w = w - lr * (d_scaled * x).sum(axis=(0, 2, 3))
        got = keras.ops.convert_to_numpy(net.model.get_layer("cs").weights[0])
        assert rel_err(got, w) < 1e-5


def test_saved_model_needs_permission(pynet, tmp_path):
    path, _ = pynet
    net = import_net(path, python_layers=True)
    file = tmp_path / "m.keras"
    net.model.save(file)
    with pytest.raises(Exception, match="allow_python_layers"):
        keras.saving.load_model(file)
    with allow_python_layers():
        again = keras.saving.load_model(file)
    x = np.random.default_rng(3).normal(size=(2, 2, 2, 3)).astype(np.float32)
    a, b = net.model([x]), again([x])
    assert rel_err(keras.ops.convert_to_numpy(b[0]), keras.ops.convert_to_numpy(a[0])) < 1e-7


def test_setup_errors_are_typed(pynet):
    path, name = pynet
    text = path.read_text()
    path.write_text(text.replace('bottom: "data" top: "scaled" top: "total"',
                                 'bottom: "data" top: "scaled"'))  # ChannelScale has 2 tops
    with pytest.raises(CaffeFormatError, match="ChannelScale failed to set up: IndexError"):
        import_net(path, python_layers=True)
    path.write_text(text.replace("ScaledReLU", "NoSuchClass"))
    with pytest.raises(CaffeFormatError, match="has no 'NoSuchClass'"):
        import_net(path, python_layers=True)


def test_missing_module_is_a_typed_error(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(NET.replace("MODNAME", "no_such_module_xyz"))
    with pytest.raises(CaffeFormatError, match="no_such_module_xyz"):
        import_net(path, python_layers=True)


def test_base_class_is_pycaffe_like():
    import keras_cct.caffe as caffe
    assert caffe.Layer is PyCaffeLayer

    class Plain(caffe.Layer):
        pass
    layer = Plain()
    assert layer.param_str == "" and list(layer.blobs) == []
    layer.blobs.add_blob(2, 3)
    assert layer.blobs[0].shape == (2, 3) and layer.blobs[0].count == 6
    with pytest.raises(NotImplementedError):
        layer.forward([], [])


def test_jax_and_torch_backends(pynet):
    path = pynet[0]
    for backend in ("jax", "torch"):
        code = (f"import keras; assert keras.backend.backend() == {backend!r}; "
                f"from tests.caffe.test_python_layers import check_gradients as c; "
                f"c({str(path)!r}); from tests.caffe.test_python_layers import check_fit; "
                f"check_fit({str(path)!r}); print('ok')")
        env = dict(os.environ, KERAS_BACKEND=backend)
        res = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and "ok" in res.stdout, (backend, res.stderr[-3000:])


SOLVER_NET = '''
name: "pytrain"
layer { name: "feed" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 4 channels: 3 height: 2 width: 2 } }
layer { name: "cs" type: "Python" bottom: "data" top: "scaled" top: "total"
  python_param { module: "MODNAME" layer: "ChannelScale" } }
layer { name: "silence" type: "Silence" bottom: "total" }
layer { name: "ip" type: "InnerProduct" bottom: "scaled" top: "ip"
        inner_product_param { num_output: 2 weight_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


def test_solver_and_cct_opt_in(pynet, tmp_path, capsys):
    """The solver builds a net's Python layers only with ``python_layers=True`` (the module
    found beside the net file) and trains the layer's blob; ``cct info`` refuses the net in
    one line naming the flag, and builds it with ``--python-layers``."""
    from keras_cct.caffe.train.solver import load_solver
    from keras_cct.cli import main
    _, name = pynet
    (tmp_path / "train.prototxt").write_text(SOLVER_NET.replace("MODNAME", name))
    solver_path = tmp_path / "solver.prototxt"
    solver_path.write_text('net: "train.prototxt" base_lr: 0.5 lr_policy: "fixed" '
                           f'max_iter: 3 display: 0 snapshot_prefix: "{tmp_path}/s"')
    rng = np.random.default_rng(0)
    arrays = {"data": rng.normal(size=(4, 2, 2, 3)).astype(np.float32),
              "label": np.array([0, 1, 1, 0], np.float32)}
    with pytest.raises(CaffeFormatError, match="python_layers=True"):
        load_solver(str(solver_path), arrays=arrays, log=lambda line: None)
    assert name not in sys.modules
    solver = load_solver(str(solver_path), arrays=arrays, log=lambda line: None,
                         python_layers=True)
    layer = solver.train_net.model.get_layer("cs")
    before = np.asarray(layer.get_weights()[0]).copy()
    np.testing.assert_allclose(before, 1 + np.arange(3) / 10.0)
    solver.step(3)
    assert np.abs(np.asarray(layer.get_weights()[0]) - before).max() > 1e-4
    sys.modules.pop(name, None)
    net_path = str(tmp_path / "train.prototxt")
    assert main(["info", net_path]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--python-layers" in err and name in err
    assert name not in sys.modules
    assert main(["info", net_path, "--python-layers"]) == 0
    assert "cs" in capsys.readouterr().out
