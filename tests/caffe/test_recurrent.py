"""Caffe's LSTM, RNN and LSTMUnit layers against float64 numpy written from Caffe's formulas
(lstm_layer.cpp / rnn_layer.cpp unroll, lstm_unit_layer.cpp), gradients against central finite
differences of that numpy, caffemodels written by protobuf directly (Caffe's blob order and
shapes) and by save_weights.

OpenCV (4.x) is no reference here: its Caffe importer reads an LSTM's blobs in its own order
(Wh, Wx, b), so a caffemodel in Caffe's order (W_xc, b_c, W_hc) is rejected, and it has no
``cont`` input; it does not implement Caffe's RNN or LSTMUnit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_cct.caffe import import_net, save_weights
from keras_cct.caffe.io import proto
from keras_cct.caffe.net.layers.recurrent import CaffeLSTM, CaffeLSTMUnit, CaffeRNN
from keras_cct.caffe.net.layout import from_caffe_layout, to_caffe_layout
from keras_cct.errors import CaffeFormatError
from tests.reference import rel_err

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# float64 numpy, from Caffe's unrolled nets


def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


def np_unit(c_prev, gates, cont):
    """LSTMUnit: c_prev (N, H), gates (N, 4H) rows i, f, o, g; cont (N,)."""
    h = c_prev.shape[1]
    i, o = _sig(gates[:, :h]), _sig(gates[:, 2 * h:3 * h])
    f = cont[:, None] * _sig(gates[:, h:2 * h])
    g = np.tanh(gates[:, 3 * h:])
    c = f * c_prev + i * g
    return c, o * np.tanh(c)


def np_lstm(x, cont, w_xc, b_c, w_hc, x_static=None, w_s=None, h0=None, c0=None):
    """Caffe's LSTM: x (T, N, ...), cont (T, N): (h (T, N, H), h_T, c_T)."""
    t_, n = x.shape[:2]
    x = x.reshape(t_, n, -1)
    hid = w_hc.shape[1]
    h = np.zeros((n, hid)) if h0 is None else h0[0]
    c = np.zeros((n, hid)) if c0 is None else c0[0]
    static = 0.0 if x_static is None else x_static.reshape(n, -1) @ w_s.T
    hs = []
    for t in range(t_):
        gates = x[t] @ w_xc.T + b_c + static + (cont[t][:, None] * h) @ w_hc.T
        c, h = np_unit(c, gates, cont[t])
        hs.append(h)
    return np.stack(hs), h[None], c[None]


def np_rnn(x, cont, w_xh, b_h, w_hh, w_ho, b_o, x_static=None, w_s=None, h0=None):
    """Caffe's RNN: (o (T, N, H), h_T)."""
    t_, n = x.shape[:2]
    x = x.reshape(t_, n, -1)
    h = np.zeros((n, w_hh.shape[0])) if h0 is None else h0[0]
    static = 0.0 if x_static is None else x_static.reshape(n, -1) @ w_s.T
    os_ = []
    for t in range(t_):
        h = np.tanh(x[t] @ w_xh.T + b_h + static + (cont[t][:, None] * h) @ w_hh.T)
        os_.append(np.tanh(h @ w_ho.T + b_o))
    return np.stack(os_), h[None]


def _cont(t_, n):
    cont = np.ones((t_, n))
    cont[0] = 0
    cont[3, 1] = 0  # stream 1 starts a new sequence at step 3
    return cont


# --------------------------------------------------------------------------------------------
# prototxt nets


LSTM_NET = """
name: "rnn_net"
layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ {x} }} }} }}
layer {{ name: "cont" type: "Input" top: "cont" input_param {{ shape {{ dim: {T} dim: {N} }} }} }}
{extra}
layer {{ name: "rec" type: "{type}" {bottoms} {tops}
  recurrent_param {{ num_output: {H} {expose} weight_filler {{ type: "gaussian" std: 0.3 }} }} }}
"""


def _dims(shape):
    return " ".join(f"dim: {d}" for d in shape)


def _net(tmp_path, kind, t_, n, xs, hid, static=None, expose=False):
    extra, bottoms = "", ['bottom: "x"', 'bottom: "cont"']
    if static is not None:
        extra += (f'layer {{ name: "xs" type: "Input" top: "xs" input_param {{ shape {{ '
                  f'{_dims(static)} }} }} }}\n')
        bottoms.append('bottom: "xs"')
    states = ["h0", "c0"] if kind == "LSTM" else ["h0"]
    tops = ['top: "y"']
    if expose:
        for s in states:
            extra += (f'layer {{ name: "{s}" type: "Input" top: "{s}" input_param {{ shape {{ '
                      f'dim: 1 dim: {n} dim: {hid} }} }} }}\n')
            bottoms.append(f'bottom: "{s}"')
        tops += ['top: "hT"'] + (['top: "cT"'] if kind == "LSTM" else [])
    text = LSTM_NET.format(x=_dims((t_, n) + tuple(xs)), T=t_, N=n, extra=extra, type=kind,
                           bottoms=" ".join(bottoms), tops=" ".join(tops), H=hid,
                           expose="expose_hidden: true" if expose else "")
    path = tmp_path / f"{kind.lower()}.prototxt"
    path.write_text(text)
    return path


def _run(net, feeds):
    """Feed Caffe-layout arrays by blob name; Caffe-layout float64 outputs by name."""
    args = [from_caffe_layout(np.asarray(feeds[b], np.float32)) for b in net.inputs]
    out = net.model(args)
    out = out if isinstance(out, (list, tuple)) else [out]
    return {b: to_caffe_layout(keras.ops.convert_to_numpy(o)).astype(np.float64)
            for b, o in zip(net.outputs, out)}


def _caffemodel(path, layer_name, ltype, blobs):
    """A caffemodel written with protobuf (as Caffe writes it), blobs in the given order."""
    net = proto.NetParameter(name="rnn_net")
    lp = net.layer.add(name=layer_name, type=ltype)
    for a in blobs:
        b = lp.blobs.add()
        b.shape.dim.extend(a.shape)
        b.data.extend(np.asarray(a, np.float32).ravel().tolist())
    path.write_bytes(net.SerializeToString())
    return path


def _randn(rng, *shape, scale=1.0):
    return rng.normal(0, scale, shape).astype(np.float32).astype(np.float64)


def test_lstm_caffemodel_forward_cont_resets(tmp_path):
    rng = np.random.default_rng(0)
    t_, n, i_, hid = 6, 3, 5, 4
    proto_path = _net(tmp_path, "LSTM", t_, n, (i_,), hid)
    w = [_randn(rng, 4 * hid, i_, scale=0.5), _randn(rng, 4 * hid, scale=0.5),
         _randn(rng, 4 * hid, hid, scale=0.5)]
    model_path = _caffemodel(tmp_path / "lstm.caffemodel", "rec", "LSTM", w)
    net = import_net(proto_path, model_path)
    assert [tuple(v.shape) for v in net.model.get_layer("rec").weights] == [
        (4 * hid, i_), (4 * hid,), (4 * hid, hid)]
    x, cont = _randn(rng, t_, n, i_), _cont(t_, n)
    y = _run(net, {"x": x, "cont": cont})["y"]
    ref = np_lstm(x, cont, *w)[0]
    assert rel_err(y, ref) < 1e-5
    # the reset matters: without it stream 1 differs from step 3 on
    no_reset = cont.copy()
    no_reset[3, 1] = 1
    assert rel_err(np_lstm(x, no_reset, *w)[0][3:, 1], ref[3:, 1]) > 1e-3
    # save_weights writes Caffe's blobs back: reloaded, same outputs; same blob shapes
    save_weights(net, tmp_path / "again.caffemodel")
    saved = proto.NetParameter.FromString((tmp_path / "again.caffemodel").read_bytes())
    assert [tuple(b.shape.dim) for b in saved.layer[0].blobs] == [a.shape for a in w]
    assert saved.layer[0].type == "LSTM"
    net2 = import_net(proto_path, tmp_path / "again.caffemodel")
    assert rel_err(_run(net2, {"x": x, "cont": cont})["y"], ref) < 1e-5


def check_carried_state(tmp_path):
    """Without expose_hidden Caffe carries h_T, c_T to the next forward pass: two calls on the
    halves of a sequence (cont 1 at the second half's start) give the whole sequence's h, and so
    does predict in batches that cut the time axis; reset_states starts from zeros again."""
    tmp_path = Path(tmp_path)
    rng = np.random.default_rng(8)
    t_, n, i_, hid = 8, 2, 3, 4
    net = import_net(_net(tmp_path, "LSTM", t_, n, (i_,), hid))
    w = [_randn(rng, 4 * hid, i_, scale=0.5), _randn(rng, 4 * hid, scale=0.5),
         _randn(rng, 4 * hid, hid, scale=0.5)]
    net.model.get_layer("rec").set_weights([a.astype(np.float32) for a in w])
    x, cont = _randn(rng, t_, n, i_), np.ones((t_, n))
    cont[0] = 0
    ref = np_lstm(x, cont, *w)[0]
    half = t_ // 2
    y1 = _run(net, {"x": x[:half], "cont": cont[:half]})["y"]
    y2 = _run(net, {"x": x[half:], "cont": cont[half:]})["y"]
    assert rel_err(np.concatenate([y1, y2]), ref) < 1e-5
    state = net.model.get_layer("rec_state")
    state.reset_states()
    assert rel_err(_run(net, {"x": x[:half], "cont": cont[:half]})["y"], ref[:half]) < 1e-5
    state.reset_states()
    got = net.model.predict([from_caffe_layout(x.astype(np.float32)), cont.astype(np.float32)],
                            batch_size=3, verbose=0)
    assert rel_err(to_caffe_layout(np.asarray(got)), ref) < 1e-5
    # the state is not a Caffe blob
    save_weights(net, tmp_path / "s.caffemodel")
    saved = proto.NetParameter.FromString((tmp_path / "s.caffemodel").read_bytes())
    assert [lp.name for lp in saved.layer] == ["rec"] and len(saved.layer[0].blobs) == 3


def test_hidden_state_carried_to_the_next_call(tmp_path):
    check_carried_state(tmp_path)


def check_fit_step(tmp_path):
    """One model.fit SGD step on an imported LSTM net (MSE on h) moves the blobs by the
    learning rate times numpy's finite-difference gradient; the carried state is then h_T."""
    tmp_path = Path(tmp_path)
    rng = np.random.default_rng(10)
    t_, n, i_, hid = 4, 2, 3, 2
    net = import_net(_net(tmp_path, "LSTM", t_, n, (i_,), hid))
    layer = net.model.get_layer("rec")
    w = [rng.normal(0, 0.5, tuple(v.shape)).astype(np.float32).astype(np.float64)
         for v in layer.weights]
    layer.set_weights([a.astype(np.float32) for a in w])
    x, cont = _randn(rng, t_, n, i_), _cont(t_, n)
    target = _randn(rng, t_, n, hid, scale=0.5)
    lr = 0.5
    net.model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    net.model.fit([from_caffe_layout(x.astype(np.float32)), cont.astype(np.float32)],
                  from_caffe_layout(target.astype(np.float32)), batch_size=t_, epochs=1,
                  shuffle=False, verbose=0)
    grads = _fd(lambda a: float(((np_lstm(x, cont, *a)[0] - target) ** 2).mean()), w)
    for v, a, g in zip(layer.weights, w, grads):
        assert rel_err(keras.ops.convert_to_numpy(v), a - lr * g) < 1e-5
    h_t = np_lstm(x, cont, *w)[1]
    state = net.model.get_layer("rec_state").states[0]
    assert rel_err(to_caffe_layout(keras.ops.convert_to_numpy(state)), h_t) < 1e-5


def test_fit_step_matches_numpy(tmp_path):
    check_fit_step(tmp_path)


def test_recurrent_net_saves_as_keras(tmp_path):
    """A .keras file of an LSTM net (its state layer is called twice) loads and computes the
    same, its carried state starting from the saved values."""
    rng = np.random.default_rng(9)
    net = import_net(_net(tmp_path, "LSTM", 4, 2, (3,), 5, static=(2, 3)))
    net.model.get_layer("rec").set_weights(
        [rng.normal(0, 0.5, tuple(v.shape)).astype(np.float32)
         for v in net.model.get_layer("rec").weights])
    feeds = [from_caffe_layout(rng.normal(size=(4, 2, 3)).astype(np.float32)),
             np.ones((4, 2), np.float32), rng.normal(size=(2, 3)).astype(np.float32)]
    net.model(feeds)  # a state to carry
    net.model.save(tmp_path / "lstm.keras")
    again = keras.saving.load_model(tmp_path / "lstm.keras")
    assert rel_err(keras.ops.convert_to_numpy(again(feeds)),
                   keras.ops.convert_to_numpy(net.model(feeds))) < 1e-6


def test_lstm_static_input_and_exposed_hidden(tmp_path):
    rng = np.random.default_rng(1)
    t_, n, hid = 4, 2, 3
    xs, static = (2, 3), (n, 3, 2, 2)  # x (T, N, 2, 3) flattened to 6; x_static (N, 3, 2, 2)
    proto_path = _net(tmp_path, "LSTM", t_, n, xs, hid, static=static, expose=True)
    net = import_net(proto_path)
    w = [_randn(rng, 4 * hid, 6, scale=0.5), _randn(rng, 4 * hid, scale=0.5),
         _randn(rng, 4 * hid, 12, scale=0.5), _randn(rng, 4 * hid, hid, scale=0.5)]
    layer = net.model.get_layer("rec")
    assert [tuple(v.shape) for v in layer.weights] == [a.shape for a in w]
    layer.set_weights([a.astype(np.float32) for a in w])
    feeds = {"x": _randn(rng, t_, n, *xs), "cont": _cont(t_, n), "xs": _randn(rng, *static),
             "h0": _randn(rng, 1, n, hid), "c0": _randn(rng, 1, n, hid)}
    out = _run(net, feeds)
    h, h_t, c_t = np_lstm(feeds["x"], feeds["cont"], w[0], w[1], w[3], feeds["xs"], w[2],
                          feeds["h0"], feeds["c0"])
    assert rel_err(out["y"], h) < 1e-5
    assert rel_err(out["hT"], h_t) < 1e-5
    assert rel_err(out["cT"], c_t) < 1e-5


def test_rnn_caffemodel_static_and_exposed(tmp_path):
    rng = np.random.default_rng(2)
    t_, n, i_, hid = 5, 3, 4, 3
    proto_path = _net(tmp_path, "RNN", t_, n, (i_,), hid, static=(n, 2), expose=True)
    w = [_randn(rng, hid, i_), _randn(rng, hid), _randn(rng, hid, 2), _randn(rng, hid, hid),
         _randn(rng, hid, hid), _randn(rng, hid)]  # W_xh, b_h, W_xh_static, W_hh, W_ho, b_o
    net = import_net(proto_path, _caffemodel(tmp_path / "rnn.caffemodel", "rec", "RNN", w))
    feeds = {"x": _randn(rng, t_, n, i_), "cont": _cont(t_, n), "xs": _randn(rng, n, 2),
             "h0": _randn(rng, 1, n, hid)}
    out = _run(net, feeds)
    o, h_t = np_rnn(feeds["x"], feeds["cont"], w[0], w[1], w[3], w[4], w[5], feeds["xs"],
                    w[2], feeds["h0"])
    assert rel_err(out["y"], o) < 1e-5
    assert rel_err(out["hT"], h_t) < 1e-5


def test_lstm_unit_net(tmp_path):
    n, hid = 3, 4
    text = f"""
layer {{ name: "c" type: "Input" top: "c"
  input_param {{ shape {{ dim: 1 dim: {n} dim: {hid} }} }} }}
layer {{ name: "g" type: "Input" top: "g"
  input_param {{ shape {{ dim: 1 dim: {n} dim: {4 * hid} }} }} }}
layer {{ name: "k" type: "Input" top: "k" input_param {{ shape {{ dim: 1 dim: {n} }} }} }}
layer {{ name: "unit" type: "LSTMUnit" bottom: "c" bottom: "g" bottom: "k" top: "c1" top: "h1" }}
"""
    path = tmp_path / "unit.prototxt"
    path.write_text(text)
    net = import_net(path)
    rng = np.random.default_rng(3)
    feeds = {"c": _randn(rng, 1, n, hid), "g": _randn(rng, 1, n, 4 * hid),
             "k": np.array([[1.0, 0.0, 1.0]])}
    out = _run(net, feeds)
    c, h = np_unit(feeds["c"][0], feeds["g"][0], feeds["k"][0])
    assert rel_err(out["c1"], c[None]) < 1e-5
    assert rel_err(out["h1"], h[None]) < 1e-5


def test_bad_recurrent_nets_are_typed_errors(tmp_path):
    path = _net(tmp_path, "LSTM", 3, 2, (4,), 5)
    text = path.read_text()
    path.write_text(text.replace("num_output: 5", "num_output: 0"))
    with pytest.raises(CaffeFormatError, match="num_output"):
        import_net(path)
    path.write_text(text.replace('top: "y"', 'top: "y" top: "z"'))
    with pytest.raises(CaffeFormatError, match="tops"):
        import_net(path)
    path.write_text(text.replace('input_param { shape { dim: 3 dim: 2 } }',
                                 'input_param { shape { dim: 3 dim: 7 } }'))
    with pytest.raises(CaffeFormatError, match="cont"):
        import_net(path)
    path.write_text(text.replace('type: "gaussian"', 'type: "bilinear"'))
    with pytest.raises(CaffeFormatError, match="weight_filler type 'bilinear'"):
        import_net(path)


# --------------------------------------------------------------------------------------------
# gradients: backend autodiff (float64 layers) vs central differences of the numpy


def _grads(layer, inputs, proj):
    """d sum(out[0] * proj) / d (layer weights..., inputs[0]) on the current backend."""
    backend = keras.backend.backend()
    ins = [keras.ops.convert_to_tensor(a, "float64") for a in inputs]
    proj = keras.ops.convert_to_tensor(proj, "float64")

    def first(out):
        return out[0] if isinstance(out, (list, tuple)) else out

    if backend == "tensorflow":
        import tensorflow as tf
        with tf.GradientTape() as tape:
            tape.watch(ins[0])
            loss = tf.reduce_sum(first(layer(ins)) * proj)
        gs = tape.gradient(loss, [w.value for w in layer.weights] + [ins[0]])
        return [np.asarray(g) for g in gs]
    if backend == "jax":
        import jax
        if not layer.built:  # (stateless_call needs built variables)
            layer(ins)

        def f(ws, x0):
            out, _ = layer.stateless_call(ws, [], [x0] + ins[1:])
            return (first(out) * proj).sum()
        gw, gx = jax.grad(f, argnums=(0, 1))([w.value for w in layer.weights], ins[0])
        return [np.asarray(g) for g in gw] + [np.asarray(gx)]
    import torch
    x0 = ins[0].detach().clone().requires_grad_(True)
    loss = (first(layer([x0] + ins[1:])) * proj).sum()
    gs = torch.autograd.grad(loss, [w.value for w in layer.weights] + [x0])
    return [g.detach().cpu().numpy() for g in gs]


def _fd(fn, arrays, eps=1e-6):
    """Central differences of scalar fn(arrays) w.r.t. each array."""
    out = []
    for k, a in enumerate(arrays):
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus = [b.copy() for b in arrays]
            minus = [b.copy() for b in arrays]
            plus[k][idx] += eps
            minus[k][idx] -= eps
            g[idx] = (fn(plus) - fn(minus)) / (2 * eps)
        out.append(g)
    return out


def check_lstm_gradients(static: bool = True, expose: bool = True):
    rng = np.random.default_rng(4)
    t_, n, i_, hid, s = 4, 2, 3, 2, 2
    layer = CaffeLSTM(hid, static_input=static, expose_hidden=expose, dtype="float64")
    x, cont = rng.normal(size=(t_, n, i_)), _cont(t_, n)
    xs, h0, c0 = rng.normal(size=(n, s)), rng.normal(size=(1, n, hid)), rng.normal(
        size=(1, n, hid))
    inputs = [from_caffe_layout(x), cont] + ([xs] if static else []) + (
        [from_caffe_layout(h0), from_caffe_layout(c0)] if expose else [])
    layer.build([np.shape(a) for a in inputs])
    w = [rng.normal(0, 0.5, tuple(v.shape)) for v in layer.weights]
    layer.set_weights(w)
    proj = rng.normal(size=(t_, n, hid))
    got = _grads(layer, inputs, from_caffe_layout(proj))

    def loss(arrays):
        *ws, xx = arrays
        if static:
            h = np_lstm(xx, cont, ws[0], ws[1], ws[3], xs, ws[2], h0 if expose else None,
                        c0 if expose else None)[0]
        else:
            h = np_lstm(xx, cont, ws[0], ws[1], ws[2], None, None, h0 if expose else None,
                        c0 if expose else None)[0]
        return float((h * proj).sum())
    ref = _fd(loss, w + [x])
    got[-1] = to_caffe_layout(got[-1])
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-6, (g, r)


def test_lstm_gradients_match_finite_differences():
    check_lstm_gradients(static=True, expose=True)
    check_lstm_gradients(static=False, expose=False)


def test_rnn_gradients_match_finite_differences():
    rng = np.random.default_rng(5)
    t_, n, i_, hid = 4, 2, 3, 3
    layer = CaffeRNN(hid, dtype="float64")
    x, cont = rng.normal(size=(t_, n, i_)), _cont(t_, n)
    inputs = [from_caffe_layout(x), cont]
    layer.build([np.shape(a) for a in inputs])
    w = [rng.normal(0, 0.5, tuple(v.shape)) for v in layer.weights]
    layer.set_weights(w)
    proj = rng.normal(size=(t_, n, hid))
    got = _grads(layer, inputs, from_caffe_layout(proj))
    got[-1] = to_caffe_layout(got[-1])
    ref = _fd(lambda a: float((np_rnn(a[5], cont, *a[:5])[0] * proj).sum()), w + [x])
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-6


def test_lstm_unit_gradients_match_finite_differences():
    rng = np.random.default_rng(6)
    n, hid = 3, 2
    layer = CaffeLSTMUnit(dtype="float64")
    c, g, cont = rng.normal(size=(1, n, hid)), rng.normal(size=(1, n, 4 * hid)), np.array(
        [[1.0, 0.0, 1.0]])
    proj = rng.normal(size=(1, n, hid))
    # gradient of sum(h * proj) w.r.t. the gates x (the layer's inputs[0] is c_prev: reorder)
    for k, (arr, wrt) in enumerate(((c, "c"), (g, "g"))):
        ins = [from_caffe_layout(c), from_caffe_layout(g), cont]
        ins = [ins[k]] + [a for j, a in enumerate(ins) if j != k]

        class Reordered(keras.layers.Layer):
            def call(self, inputs, _k=k):
                rest = list(inputs[1:])
                rest.insert(_k, inputs[0])
                return layer(rest)[1]  # h

        got = to_caffe_layout(_grads(Reordered(dtype="float64"), ins, from_caffe_layout(proj))[-1])

        def loss(a, _k=k):
            cc, gg = (a[0], g) if _k == 0 else (c, a[0])
            return float((np_unit(cc[0], gg[0], cont[0])[1] * proj[0]).sum())
        assert rel_err(got, _fd(loss, [arr])[0]) < 1e-6, wrt


def test_jax_and_torch_backends():
    """Gradients, the carried state and a fit step once under KERAS_BACKEND=jax and =torch."""
    for backend in ("jax", "torch"):
        code = (f"import keras; assert keras.backend.backend() == {backend!r}; "
                "from tests.caffe.test_recurrent import check_lstm_gradients as c; "
                "c(True, True); c(False, False); "
                "from tests.caffe.test_recurrent import check_carried_state as s; "
                "import tempfile; s(tempfile.mkdtemp()); "
                "from tests.caffe.test_recurrent import check_fit_step as f; "
                "f(tempfile.mkdtemp()); print('ok')")
        env = dict(os.environ, KERAS_BACKEND=backend)
        res = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and "ok" in res.stdout, (backend, res.stderr[-3000:])


def test_opencv_does_not_read_caffe_lstm_blobs(tmp_path):
    """OpenCV's Caffe importer wants (Wh, Wx, b): a caffemodel in Caffe's order fails there, so
    it cannot be a reference. Should OpenCV start reading it, compare against it here."""
    pytest.importorskip("cv2")
    rng = np.random.default_rng(7)
    t_, n, i_, hid = 3, 2, 4, 5
    proto_path = _net(tmp_path, "LSTM", t_, n, (i_,), hid)
    w = [_randn(rng, 4 * hid, i_), _randn(rng, 4 * hid), _randn(rng, 4 * hid, hid)]
    model_path = _caffemodel(tmp_path / "lstm.caffemodel", "rec", "LSTM", w)
    code = ("import cv2, numpy as np, sys\n"
            f"net = cv2.dnn.readNetFromCaffe({str(proto_path)!r}, {str(model_path)!r})\n"
            f"net.setInput(np.zeros(({t_}, {n}, {i_}), np.float32), 'x')\n"
            f"net.setInput(np.ones(({t_}, {n}), np.float32), 'cont')\n"
            "try:\n    net.forward('rec')\nexcept cv2.error as e:\n"
            "    print('REJECTED', str(e).splitlines()[-1]); sys.exit(0)\n"
            "print('READ')\n")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=300)
    assert "REJECTED" in res.stdout, (res.returncode, res.stdout, res.stderr[-2000:])


def test_fillers_as_caffe():
    """xavier: U(-sqrt(3/fan_in), +) with Caffe's fan_in = count / shape[0]; msra: N(0,
    sqrt(2/fan_in)); the default filler is Caffe's constant 0."""
    layer = CaffeLSTM(50, weight_filler={"type": "xavier"}, bias_filler={"type": "msra"})
    layer.build([(7, 30, 2), (7, 2)])
    w_xc, b_c, w_hc = (keras.ops.convert_to_numpy(v) for v in layer.weights)
    assert np.abs(w_xc).max() <= np.sqrt(3 / 30) and np.abs(w_xc).max() > 0.9 * np.sqrt(3 / 30)
    assert np.abs(w_hc).max() <= np.sqrt(3 / 50) and np.abs(w_hc).max() > 0.9 * np.sqrt(3 / 50)
    assert 0.7 < b_c.std() / np.sqrt(2.0) < 1.3  # a 1-D blob: fan_in = 1
    plain = CaffeRNN(3)
    plain.build([(4, 5, 2), (4, 2)])
    assert all(not keras.ops.convert_to_numpy(v).any() for v in plain.weights)
    with pytest.raises(ValueError, match="weight_filler"):
        CaffeLSTM(3, weight_filler={"type": "bilinear"})
