"""CCTStrategy: the split changes speed, never results (TensorFlow backend, PoCL in CI)."""

import os
import signal
import warnings

import keras
import numpy as np
import pytest

from keras_cct import CCTStrategy, HybridConv2D, hybridize
from keras_cct.errors import DeviceDroppedWarning, WorkerError
from tests import reference as ref
from tests.backend_grads import layer_grads, to_numpy

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                reason="the TensorFlow split op (tf.device shards, tf.function graphs); "
                                "JAX and PyTorch: test_backends.py")


def _pair(strategy, x_shape, **kw):
    """A strategy-bound layer and an equal plain one with the same weights."""
    with strategy.scope():
        split = HybridConv2D(**kw)
    split.build(x_shape)
    weights = split.get_weights()
    if len(weights) == 2:  # a non-zero bias, so that each shard's bias add is checked too
        weights[1] = np.random.default_rng(7).standard_normal(weights[1].shape).astype("float32")
        split.set_weights(weights)
    plain = HybridConv2D(**kw)
    plain.build(x_shape)
    plain.set_weights(split.get_weights())
    return split, plain


@pytest.mark.parametrize("devices, fractions", [
    (["tf:cpu:0", "opencl:0:0"], [0.7, 0.3]),
    (["tf:cpu:0", "opencl:0:0.0", "opencl:0:0.1"], [0.5, 0.2, 0.3]),
])
@pytest.mark.parametrize("batch", [1, 3, 10])
def test_outputs_and_gradients_equal_single_device(opencl, devices, fractions, batch):
    s = CCTStrategy(devices, split=fractions, rebalance=False)
    split, plain = _pair(s, (batch, 11, 11, 6), filters=8, kernel_size=3, strides=2,
                         padding=1, groups=2)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 11, 11, 6)).astype("float32")
    dy = rng.standard_normal((batch, 6, 6, 8)).astype("float32")
    y, g = layer_grads(split, x, dy)
    y0, g0 = layer_grads(plain, x, dy)
    assert ref.rel_err(y, y0) <= 1e-5
    for a, b in zip(g, g0):
        assert ref.rel_err(a, b) <= 1e-5
    sizes = [r["images"] for r in s.report()]
    assert sum(sizes) == batch
    expected = np.diff(np.round(np.cumsum(fractions) * batch).astype(int), prepend=0)
    assert sizes == list(expected)


def test_a_backward_split_unlike_the_forward_gives_the_same_gradients(opencl):
    """The backward pass re-splits the batch by its own fractions (shards of x and dy that
    differ from the forward's); the gradients are still the single-device ones."""
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.7, 0.3], rebalance=False)
    split, plain = _pair(s, (10, 9, 9, 4), filters=6, kernel_size=3, padding=1)
    split(np.zeros((10, 9, 9, 4), "float32"))  # makes the layer's plan
    s._plans[id(split)].phases["backward"].fractions = np.array([0.2, 0.8])
    rng = np.random.default_rng(11)
    x = rng.standard_normal((10, 9, 9, 4)).astype("float32")
    dy = rng.standard_normal((10, 9, 9, 6)).astype("float32")
    y, g = layer_grads(split, x, dy)
    y0, g0 = layer_grads(plain, x, dy)
    assert ref.rel_err(y, y0) <= 1e-5
    for a, b in zip(g, g0):
        assert ref.rel_err(a, b) <= 1e-5
    rows = s.report()
    assert [r["images"] for r in rows] == [7, 3]
    assert [r["bwd_images"] for r in rows] == [2, 8]
    assert s.fractions(split, "backward") == pytest.approx({"tf:cpu:0": 0.2, "opencl:0:0": 0.8})


@pytest.mark.parametrize("backward_split", ["forward", "own", "auto"])
def test_compiled_training_step_with_each_backward_split(opencl, backward_split):
    """In a tf.function (where a tied backward reuses the forward's lowered data) the
    gradients equal the single-device ones for each ``backward_split``; tied, the backward's
    shards are the forward's."""
    import tensorflow as tf
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.6, 0.4], rebalance=False,
                    backward_split=backward_split)
    # 64 -> 64 channels: lowering is a small part of this layer's backward, so "auto" gives
    # it a backward split of its own
    split, plain = _pair(s, (10, 9, 9, 64), filters=64, kernel_size=3, padding=1,
                         lowering="type1")
    split(np.zeros((10, 9, 9, 64), "float32"))
    if backward_split != "forward":
        s._plans[id(split)].phases["backward"].fractions = np.array([0.3, 0.7])
    rng = np.random.default_rng(12)
    x = tf.constant(rng.standard_normal((10, 9, 9, 64)).astype("float32"))
    dy = tf.constant(rng.standard_normal((10, 9, 9, 64)).astype("float32"))

    def step_of(layer):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
            return [y] + tape.gradient(y, [x] + layer.trainable_weights, output_gradients=dy)
        return step

    got, want = step_of(split)(x), step_of(plain)(x)
    for a, b in zip(got, want):
        assert ref.rel_err(a.numpy(), b.numpy()) <= 1e-5
    rows = s.report()
    tied = [r["bwd_images"] for r in rows] == [r["images"] for r in rows]
    assert tied == (backward_split == "forward"), rows


def _model(strategy=None):
    keras.utils.set_random_seed(3)
    scope = strategy.scope() if strategy else _nullscope()
    with scope:
        inp = keras.Input((12, 12, 3))
        h = HybridConv2D(8, 3, padding=1, activation="relu", lowering="type1")(inp)
        h = HybridConv2D(6, 3, strides=2, padding=1, groups=2, lowering="type3")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _nullscope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _data(n=20):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, 12, 12, 3)).astype("float32")
    return x, rng.integers(0, 3, n)


def _assert_same_weights(a, b):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        assert ref.rel_err(wa, wb) <= 1e-5


def test_fit_under_the_strategy_gives_the_same_weights(opencl):
    x, y = _data(20)
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.7, 0.3], rebalance=True)
    model, baseline = _model(s), _model()
    baseline.set_weights(model.get_weights())
    # batch 4 -> five steps; then batch 3 with a partial last batch (20 = 6*3 + 2).
    for batch in (4, 3):
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        baseline.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        _assert_same_weights(model, baseline)
    np.testing.assert_allclose(model.predict(x[:7], batch_size=3, verbose=0),
                               baseline.predict(x[:7], batch_size=3, verbose=0), rtol=1e-4,
                               atol=1e-5)
    assert not any(layer.supports_jit for layer in model.layers
                   if isinstance(layer, HybridConv2D))


def test_flops_split_is_proportional_to_calibrated_throughput(opencl):
    from keras_cct.devices import calibrate
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0.0", "opencl:0:0.1"], split="flops",
                    rebalance=False)
    g = np.array([calibrate(name) for name in s.device_names])
    layer, _ = _pair(s, (4, 8, 8, 4), filters=4, kernel_size=3)
    layer(np.zeros((4, 8, 8, 4), "float32"))
    np.testing.assert_allclose(list(s.fractions(layer).values()), g / g.sum(), rtol=1e-9)


def test_rebalancing_moves_work_away_from_a_slow_device(opencl, monkeypatch):
    import time as _time
    from keras_cct.devices.opencl import conv as cl_conv
    real = cl_conv.conv2d_forward

    def slow(*args, **kwargs):
        _time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(cl_conv, "conv2d_forward", slow)
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.5, 0.5], rebalance=True)
    model = _model(s)
    x, y = _data(40)
    log = s.callback(verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[log])
    rows = [r for r in s.report() if r["device"] == "opencl:0:0"]
    assert all(r["fraction"] < 0.3 for r in rows), rows
    assert len(log.history) == 2


def test_forward_and_backward_are_balanced_separately(opencl, monkeypatch):
    """Each pass has its own split, balanced on its own times. Here every TF convolution is
    made 30 ms slower (the forward's work must move to OpenCL) and OpenCL's backward 200 ms
    slower (the backward's work must move to TF); the report has both times and splits."""
    import time as _time

    import tensorflow as tf

    import keras_cct.lowering as lowering
    from keras_cct.devices.opencl import conv as cl_conv
    real_geo, real_bwd = lowering.conv2d_geo, cl_conv.conv2d_backward

    def slow_tf_forward(x, k, geo, low):
        def nap(_):
            _time.sleep(0.03)
            return np.int64(0)
        done = tf.numpy_function(nap, [tf.shape(x)[0]], tf.int64, stateful=True)
        with tf.control_dependencies([done]):
            x = tf.identity(x)
        return real_geo(x, k, geo, low)

    def slow_cl_backward(*args, **kwargs):
        _time.sleep(0.2)
        return real_bwd(*args, **kwargs)

    monkeypatch.setattr(lowering, "conv2d_geo", slow_tf_forward)
    monkeypatch.setattr(cl_conv, "conv2d_backward", slow_cl_backward)
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.5, 0.5], rebalance=True,
                    backward_split="own")
    model = _model(s)
    x, y = _data(40)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    rows = s.report()
    cl = [r for r in rows if r["device"] == "opencl:0:0"]
    assert all(r["fraction"] > 0.7 and r["bwd_fraction"] < 0.3 for r in cl), [
        {k: r[k] for k in ("fraction", "bwd_fraction", "bwd_images", "last_ms", "last_bwd_ms")}
        for r in rows]
    assert all(np.isfinite(r["last_bwd_ms"]) and r["last_bwd_ms"] > 0 for r in rows), rows
    assert all(r["last_bwd_ms"] >= 200 for r in cl), cl  # the sleep is inside the timing
    for layer in model.layers:
        if isinstance(layer, HybridConv2D):
            fwd, bwd = s.fractions(layer), s.fractions(layer, "backward")
            assert fwd["opencl:0:0"] > 0.7 and bwd["opencl:0:0"] < 0.3


def test_worker_killed_mid_fit_is_survived(opencl):
    from keras_cct.devices.opencl.client import client_for
    x, y = _data(24)
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.6, 0.4], rebalance=False)
    model, baseline = _model(s), _model()
    baseline.set_weights(model.get_weights())

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                os.kill(client_for("opencl:0:0").pid, signal.SIGKILL)

    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[Kill()])
    baseline.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(model, baseline)


def test_device_failing_during_a_step_is_dropped_and_nothing_is_lost(opencl, monkeypatch):
    from keras_cct.devices.opencl import conv as cl_conv
    real, calls = cl_conv.conv2d_forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise WorkerError("opencl:0:0 worker died (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(cl_conv, "conv2d_forward", flaky)
    x, y = _data(24)
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.6, 0.4], rebalance=False)
    model, baseline = _model(s), _model()
    baseline.set_weights(model.get_weights())
    with pytest.warns(DeviceDroppedWarning, match="opencl:0:0 failed"):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    baseline.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(model, baseline)
    assert {r["device"]: r["active"] for r in s.report()} == {"tf:cpu:0": True,
                                                              "opencl:0:0": False}
    assert all(r["images"] == 0 for r in s.report() if r["device"] == "opencl:0:0")


def test_hybridize_replaces_conv2d_with_equal_layers(opencl):
    keras.utils.set_random_seed(0)
    inp = keras.Input((10, 10, 3))
    h = keras.layers.Conv2D(6, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(4, 3, strides=2, groups=2)(h)
    model = keras.Model(inp, keras.layers.Flatten()(h))
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.5, 0.5])
    hybrid = hybridize(model, s)
    convs = [layer for layer in hybrid.layers if isinstance(layer, HybridConv2D)]
    assert len(convs) == 2 and all(c._strategy is s for c in convs)
    x = np.random.default_rng(0).standard_normal((5, 10, 10, 3)).astype("float32")
    assert ref.rel_err(to_numpy(hybrid(x)), to_numpy(model(x))) <= 1e-5


@pytest.mark.parametrize("kwargs, message", [
    (dict(devices=["tf:cpu:0"], split="fast"), "`split` must be one of"),
    (dict(devices=["tf:cpu:0"], split=[0.5, 0.5]), "one non-negative fraction per device"),
    (dict(devices=["tf:cpu:0"], backward_split="same"), "`backward_split` must be one of"),
    (dict(devices=["tf:cpu:0", "tf:cpu:0"]), "listed twice"),
    (dict(devices=["tf:tpu:7"]), "no device 'tf:tpu:7'"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError if "split" in message or "fraction" in message
                       else Exception, match=message):
        CCTStrategy(**kwargs)


def test_layer_outside_the_scope_is_not_split():
    s = CCTStrategy(["tf:cpu:0"])
    with s.scope():
        inside = HybridConv2D(2, 1)
    outside = HybridConv2D(2, 1)
    assert inside._strategy is s and outside._strategy is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outside(np.zeros((1, 3, 3, 1), "float32"))
