"""Caffe's lr policies and update rules against numpy transcriptions of Caffe's C++ code."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import keras

from keras_cct.caffe.train.optimizer import (CaffeLRSchedule, CaffeOptimizer,
                                             caffe_learning_rate, canonical_solver_type)
from keras_cct.errors import CaffeFormatError
from tests.caffe.caffe_numpy import NumpyCaffeSolver, caffe_rate

POLICIES = [
    ("fixed", {}),
    ("step", {"gamma": 0.1, "stepsize": 7}),
    ("exp", {"gamma": 0.97}),
    ("inv", {"gamma": 0.0001, "power": 0.75}),
    ("multistep", {"gamma": 0.5, "stepvalue": (3, 10, 11, 40)}),
    ("poly", {"power": 1.5, "max_iter": 50}),
    ("sigmoid", {"gamma": -0.2, "stepsize": 20}),
]


@pytest.mark.parametrize("policy,kw", POLICIES, ids=[p for p, _ in POLICIES])
def test_lr_policy_matches_caffe_formula(policy, kw):
    its = [0, 1, 2, 3, 6, 7, 10, 11, 12, 25, 39, 40, 49]
    expected = np.array([caffe_rate(policy, i, 0.05, **kw) for i in its])
    sched = CaffeLRSchedule(policy, base_lr=0.05, **kw)
    got_py = np.array([sched.rate(i) for i in its])
    got_ops = np.array([float(keras.ops.convert_to_numpy(sched(i))) for i in its])
    np.testing.assert_allclose(got_py, expected, rtol=1e-6)
    np.testing.assert_allclose(got_ops, expected, rtol=1e-5)
    # with iter_size the raw optimizer step counts mini-batches: the schedule divides
    sched3 = CaffeLRSchedule(policy, base_lr=0.05, iter_size=3, **kw)
    got3 = np.array([float(keras.ops.convert_to_numpy(sched3(3 * i + 2))) for i in its])
    np.testing.assert_allclose(got3, expected, rtol=1e-5)


def test_bad_policy_and_type():
    with pytest.raises(CaffeFormatError, match="unknown lr_policy 'cosine'"):
        CaffeLRSchedule("cosine")
    with pytest.raises(CaffeFormatError, match="needs stepsize"):
        caffe_learning_rate("step", 3, base_lr=0.1, gamma=0.1)
    with pytest.raises(CaffeFormatError, match="unknown solver type 'Lion'"):
        canonical_solver_type("Lion")
    assert canonical_solver_type("ADAM") == "Adam"
    with pytest.raises(CaffeFormatError, match="momentum cannot be used with AdaGrad"):
        CaffeOptimizer("AdaGrad", momentum=0.9)


SOLVERS = [
    ("SGD", {"momentum": 0.9}),
    ("Nesterov", {"momentum": 0.95}),
    ("AdaGrad", {}),
    ("RMSProp", {"rms_decay": 0.98}),
    ("AdaDelta", {"momentum": 0.95, "delta": 1e-6}),
    ("Adam", {"momentum": 0.9, "momentum2": 0.999}),
]


def _tiny_net(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc")])
    w0 = rng.normal(size=(4, 3)).astype("float32")
    b0 = rng.normal(size=(3,)).astype("float32")
    model.get_layer("fc").set_weights([w0, b0])
    return model, x, y, [w0, b0]


def _mse_grads(w, b, x, y):
    """Gradient of keras' mean squared error of x @ w + b, in float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    d = 2.0 * (x @ w + b - y) / y.size
    return [x.T @ d, d.sum(axis=0)]


@pytest.mark.parametrize("solver_type,kw", SOLVERS, ids=[s for s, _ in SOLVERS])
def test_solver_matches_numpy_caffe_on_tiny_net(solver_type, kw):
    """Five training steps of a Dense net through Keras' train step; lr_mult 2 / decay_mult 0
    on the bias as Caffe's usual ``param {}``; weight decay and the inv policy."""
    model, x, y, params = _tiny_net(0)
    sched = CaffeLRSchedule("inv", base_lr=0.05, gamma=0.1, power=0.75)
    opt = CaffeOptimizer(solver_type, learning_rate=sched, weight_decay=0.01,
                         param_specs={"fc/bias": (2.0, 0.0)}, **kw)
    model.compile(optimizer=opt, loss="mean_squared_error")
    ref = NumpyCaffeSolver(params, solver_type, weight_decay=0.01, lr_mults=[1.0, 2.0],
                           decay_mults=[1.0, 0.0], **kw)
    for it in range(5):
        model.train_on_batch(x, y)
        ref.apply_update(_mse_grads(ref.w[0], ref.w[1], x, y),
                         caffe_rate("inv", it, 0.05, gamma=0.1, power=0.75))
    for got, want in zip(model.get_layer("fc").get_weights(), ref.w):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    hist = opt.history_arrays()
    assert len(hist) == (4 if solver_type in ("AdaDelta", "Adam") else 2)
    np.testing.assert_allclose(hist[0], ref.history[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reg", ["L2", "L1"])
def test_l1_l2_clip_and_iter_size(reg):
    """iter_size=2 accumulates two mini-batches; clip_gradients clips the *sum* as Caffe does."""
    model, x, y, params = _tiny_net(1)
    opt = CaffeOptimizer("SGD", learning_rate=CaffeLRSchedule("step", 0.1, gamma=0.5,
                                                              stepsize=2, iter_size=2),
                         momentum=0.9, weight_decay=0.05, regularization_type=reg,
                         clip_gradients=0.5, iter_size=2)
    model.compile(optimizer=opt, loss="mean_squared_error")
    ref = NumpyCaffeSolver(params, "SGD", momentum=0.9, weight_decay=0.05,
                           regularization_type=reg, clip_gradients=0.5, iter_size=2)
    halves = [(x[:4], y[:4]), (x[4:], y[4:])]
    clipped = False
    for it in range(4):
        total = None
        for xb, yb in halves:
            model.train_on_batch(xb, yb)
            g = _mse_grads(ref.w[0], ref.w[1], xb, yb)
            total = g if total is None else [a + b for a, b in zip(total, g)]
        clipped |= np.sqrt(sum(float(np.sum(t * t)) for t in total)) > 0.5
        ref.apply_update(total, caffe_rate("step", it, 0.1, gamma=0.5, stepsize=2))
    assert clipped  # the test exercises the clipping
    for got, want in zip(model.get_layer("fc").get_weights(), ref.w):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


FUSED = keras.backend.backend() in ("tensorflow", "torch")


@pytest.mark.parametrize("distributed", [False, True] if keras.backend.backend() == "tensorflow"
                         else [False])
def test_sgd_runs_fused_where_the_backend_has_a_form_and_matches_caffe(monkeypatch,
                                                                        distributed):
    """SGD's ``h = m h + rate g; w -= h`` runs in place where the backend offers a fused form
    (TensorFlow: one ``ResourceApplyMomentum`` per weight; PyTorch: in-place products), as
    the ops written out elsewhere (JAX; a ``tf.distribute`` strategy). Every path gives Caffe's
    weights and history (float64 numpy solver)."""
    from keras_cct.lowering import _backend
    taken = []
    fused = _backend.sgd_step

    def recorded(*args):
        taken.append(fused(*args))
        return taken[-1]

    monkeypatch.setattr(_backend, "sgd_step", recorded)
    scope = contextlib.nullcontext()
    if distributed:
        import tensorflow as tf
        scope = tf.distribute.MirroredStrategy(["/cpu:0"]).scope()
    with scope:
        model, x, y, params = _tiny_net(2)
        opt = CaffeOptimizer("SGD", learning_rate=0.05, momentum=0.9, weight_decay=0.01)
        model.compile(optimizer=opt, loss="mean_squared_error")
    ref = NumpyCaffeSolver(params, "SGD", momentum=0.9, weight_decay=0.01)
    for _ in range(3):
        model.train_on_batch(x, y)
        ref.apply_update(_mse_grads(ref.w[0], ref.w[1], x, y), 0.05)
    assert taken and set(taken) == {FUSED and not distributed}
    for got, want in zip(model.get_layer("fc").get_weights(), ref.w):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(opt.history_arrays()[0], ref.history[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reg", ["L2", "L1"])
def test_sgd_at_momentum_zero_matches_caffe_without_its_history(monkeypatch, reg):
    """SGD at momentum 0 moves the weights by ``-rate (g + decay reg)`` with no history (Caffe
    never reads it again): fused where the backend has a form (TensorFlow's
    ``ResourceApplyGradientDescent``, PyTorch in place), the ops elsewhere. Five steps give
    float64 numpy Caffe's weights, with lr_mult 2 / decay_mult 0 on the bias; the history
    stays as it was."""
    from keras_cct.lowering import _backend
    taken = []
    fused = _backend.sgd_step

    def recorded(variable, history, *args):
        taken.append((history is None, fused(variable, history, *args)))
        return taken[-1][1]

    monkeypatch.setattr(_backend, "sgd_step", recorded)
    model, x, y, params = _tiny_net(3)
    opt = CaffeOptimizer("SGD", learning_rate=0.05, weight_decay=0.02, regularization_type=reg,
                         param_specs={"fc/bias": (2.0, 0.0)})
    model.compile(optimizer=opt, loss="mean_squared_error")
    ref = NumpyCaffeSolver(params, "SGD", weight_decay=0.02, regularization_type=reg,
                           lr_mults=[1.0, 2.0], decay_mults=[1.0, 0.0])
    for _ in range(5):
        model.train_on_batch(x, y)
        ref.apply_update(_mse_grads(ref.w[0], ref.w[1], x, y), 0.05)
    assert taken and set(taken) == {(True, FUSED)}
    for got, want in zip(model.get_layer("fc").get_weights(), ref.w):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.abs(ref.history[0]).max() > 0  # Caffe's would hold the last update
    assert all(not h.any() for h in opt.history_arrays())
