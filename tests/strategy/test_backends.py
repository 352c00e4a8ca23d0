"""CCTStrategy on the JAX and PyTorch backends: (backend CPU, opencl:0:0) splits give the results
of keras' own Conv2D (an independent reference), in the layer, in a compiled JAX step and
through model.fit; rebalancing and failing devices behave as on TensorFlow."""

import os
import signal
import warnings

import keras
import numpy as np
import pytest

from keras_cct import CCTStrategy, HybridConv2D
from keras_cct.errors import DeviceDroppedWarning, WorkerError
from tests import reference as ref
from tests.backend_grads import layer_grads

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(BACKEND not in ("jax", "torch"),
                                reason="the JAX and PyTorch split (TF: test_strategy.py)")
CPU = {"jax": "jax:cpu:0", "torch": "torch:cpu"}.get(BACKEND)
TOL = 1e-5


def _pair(strategy, x_shape, **kw):
    """A strategy-bound HybridConv2D and keras' Conv2D with the same (non-zero) weights."""
    with strategy.scope():
        split = HybridConv2D(**kw)
    split.build(x_shape)
    rng = np.random.default_rng(7)
    split.set_weights([rng.standard_normal(w.shape).astype("float32") * 0.3
                       for w in split.get_weights()])
    conv = keras.layers.Conv2D(**kw)
    conv.build(x_shape)
    conv.set_weights(split.get_weights())
    return split, conv


def _assert_close(got, want):
    (y, g), (y0, g0) = got, want
    assert ref.rel_err(y, y0) <= TOL
    assert len(g) == len(g0)
    for a, b in zip(g, g0):
        assert ref.rel_err(a, b) <= TOL


@pytest.mark.parametrize("batch", [1, 3, 10])
def test_outputs_and_gradients_equal_conv2d(opencl, batch):
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.7, 0.3], rebalance=False)
    split, conv = _pair(s, (batch, 11, 11, 6), filters=8, kernel_size=3, strides=2,
                        padding="same", groups=2)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 11, 11, 6)).astype("float32")
    dy = rng.standard_normal((batch, 6, 6, 8)).astype("float32")
    _assert_close(layer_grads(split, x, dy), layer_grads(conv, x, dy))
    rows = s.report()
    expected = list(np.diff(np.round(np.cumsum([0.7, 0.3]) * batch).astype(int), prepend=0))
    assert [r["images"] for r in rows] == expected
    assert [r["bwd_images"] for r in rows] == expected
    assert all(r["device"] in (CPU.replace("torch:cpu", "torch:cpu:0"), "opencl:0:0")
               for r in rows)


def test_a_backward_split_unlike_the_forward_gives_the_same_gradients(opencl):
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.7, 0.3], rebalance=False,
                    backward_split="own")
    split, conv = _pair(s, (10, 9, 9, 4), filters=6, kernel_size=3, padding="same")
    split(np.zeros((10, 9, 9, 4), "float32"))  # makes the layer's plan
    s._plans[id(split)].phases["backward"].fractions = np.array([0.2, 0.8])
    rng = np.random.default_rng(11)
    x = rng.standard_normal((10, 9, 9, 4)).astype("float32")
    dy = rng.standard_normal((10, 9, 9, 6)).astype("float32")
    _assert_close(layer_grads(split, x, dy), layer_grads(conv, x, dy))
    rows = s.report()
    assert [r["images"] for r in rows] == [7, 3]
    assert [r["bwd_images"] for r in rows] == [2, 8]


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit")
@pytest.mark.parametrize("backward_split", ["forward", "own"])
def test_jit_compiled_step_equals_conv2d(opencl, backward_split):
    """Under jax.jit (host callbacks in the compiled step) the output and gradients are
    Conv2D's; tied, the backward's shards are the forward's."""
    import jax
    import jax.numpy as jnp
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.6, 0.4], rebalance=False,
                    backward_split=backward_split)
    split, conv = _pair(s, (10, 9, 9, 16), filters=8, kernel_size=3, padding="same")
    split(np.zeros((10, 9, 9, 16), "float32"))
    if backward_split == "own":
        s._plans[id(split)].phases["backward"].fractions = np.array([0.3, 0.7])
    rng = np.random.default_rng(12)
    x = rng.standard_normal((10, 9, 9, 16)).astype("float32")
    dy = rng.standard_normal((10, 9, 9, 8)).astype("float32")

    def step_of(layer):
        def loss(xx, tw):
            y, _ = layer.stateless_call(tw, [], xx)
            return jnp.sum(y * dy), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    for _ in range(2):  # the second call runs the compiled step again
        got = step_of(split)(jnp.asarray(x), [w.value for w in split.trainable_weights])
        want = step_of(conv)(jnp.asarray(x), [w.value for w in conv.trainable_weights])
        (_, y), (dx, dw) = got
        (_, y0), (dx0, dw0) = want
        _assert_close((np.asarray(y), [np.asarray(dx)] + [np.asarray(g) for g in dw]),
                      (np.asarray(y0), [np.asarray(dx0)] + [np.asarray(g) for g in dw0]))
    rows = s.report()
    tied = [r["bwd_images"] for r in rows] == [r["images"] for r in rows]
    assert tied == (backward_split == "forward"), rows


def _model(strategy=None):
    """A small network of HybridConv2D under ``strategy``, or of keras Conv2D without."""
    keras.utils.set_random_seed(3)
    Conv = keras.layers.Conv2D if strategy is None else HybridConv2D
    scope = strategy.scope() if strategy else _nullscope()
    with scope:
        inp = keras.Input((12, 12, 3))
        h = Conv(8, 3, padding="same", activation="relu")(inp)
        h = Conv(6, 3, strides=2, padding="same", groups=2)(h)
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
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for u, v in zip(wa, wb):
        assert ref.rel_err(u, v) <= TOL


def test_fit_under_the_strategy_gives_conv2d_weights(opencl):
    x, y = _data(20)
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.7, 0.3], rebalance=True)
    model, baseline = _model(s), _model()
    model.set_weights(baseline.get_weights())
    # batch 4 -> five steps; then batch 3 with a partial last batch (20 = 6*3 + 2).
    for batch in (4, 3):
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        baseline.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        _assert_same_weights(model, baseline)
    np.testing.assert_allclose(model.predict(x[:7], batch_size=3, verbose=0),
                               baseline.predict(x[:7], batch_size=3, verbose=0), rtol=1e-4,
                               atol=1e-5)
    assert model.jit_compile == (BACKEND == "jax")  # JAX: the step stays compiled
    rows = s.report()
    assert [r["device"] for r in rows] == s.device_names * 2 and all(r["active"] for r in rows)
    assert all(np.isfinite(r["last_ms"]) and np.isfinite(r["last_bwd_ms"]) for r in rows)


def _slow_opencl_forward(monkeypatch, seconds: float) -> None:
    """Every OpenCL forward shard takes ``seconds`` longer."""
    import time as _time
    from keras_cct.devices.opencl import conv as cl_conv
    real = cl_conv.conv2d_forward

    def slow(*args, **kwargs):
        _time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(cl_conv, "conv2d_forward", slow)


def test_rebalancing_moves_work_away_from_a_slow_device(opencl, monkeypatch):
    _slow_opencl_forward(monkeypatch, 0.05)
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.5, 0.5], rebalance=True)
    model = _model(s)
    x, y = _data(40)
    log = s.callback(verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[log])
    rows = [r for r in s.report() if r["device"] == "opencl:0:0"]
    assert all(r["fraction"] < 0.3 for r in rows), rows
    assert all(r["images"] <= 2 for r in rows), rows  # the shards that ran, not only fractions
    assert len(log.history) == 2


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's compiled step is traced again for new sizes")
def test_rebalancing_retraces_the_compiled_step_a_few_times_only(opencl, monkeypatch):
    """While rebalancing moves work off a slow device for 40 steps, the jit-compiled step is
    traced again a handful of times (after 2, 4, 8, ... steps), not at every move: each trace
    compiles the whole training step."""
    from keras_cct.strategy import _jax
    _slow_opencl_forward(monkeypatch, 0.03)
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.5, 0.5], rebalance=True)
    model = _model(s)
    x, y = _data(160)
    start = _jax._GENERATION[0]
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)  # 40 steps
    retraces = _jax._GENERATION[0] - start
    assert 1 <= retraces <= 4, retraces  # waits of 2 + 4 + 8 + 16 steps fit in 40
    assert getattr(s, "_jax_retraces", 0) == retraces
    rows = [r for r in s.report() if r["device"] == "opencl:0:0"]
    assert all(r["fraction"] < 0.4 for r in rows), rows


def test_worker_killed_mid_fit_is_survived(opencl):
    from keras_cct.devices.opencl.client import client_for
    x, y = _data(24)
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.6, 0.4], rebalance=False)
    model, baseline = _model(s), _model()
    model.set_weights(baseline.get_weights())

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
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.6, 0.4], rebalance=False)
    model, baseline = _model(s), _model()
    model.set_weights(baseline.get_weights())
    with pytest.warns(DeviceDroppedWarning, match="opencl:0:0 failed"):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    baseline.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(model, baseline)
    assert {r["device"]: r["active"] for r in s.report()} == {
        s.device_names[0]: True, "opencl:0:0": False}
    assert all(r["images"] == 0 for r in s.report() if r["device"] == "opencl:0:0")


def test_backend_devices_are_listed_and_named():
    from keras_cct.devices import get_device, list_devices
    names = [d.name for d in list_devices(calibrate=False, opencl=False)]
    assert get_device(CPU).name in names
    s = CCTStrategy([CPU])
    assert s.device_names == [get_device(CPU).name]
    with pytest.raises(Exception, match="no device 'tf:cpu:0'"):
        CCTStrategy(["tf:cpu:0"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with s.scope():
            layer = HybridConv2D(2, 1)
        assert layer._strategy is s


def test_stalled_device_is_dropped_and_fit_gives_conv2d_weights(opencl, monkeypatch):
    """A worker SIGSTOPped mid-fit (a hung driver) misses its deadline: its shard is
    recomputed on the host, the device dropped, and the weights are Conv2D's."""
    import time

    from tests.processes import gone
    from tests.strategy.test_stalled_device import DEADLINE, _StopWorker
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", str(DEADLINE))
    x, y = _data(24)
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.7, 0.3], rebalance=False)
    model, baseline = _model(s), _model()
    model.set_weights(baseline.get_weights())
    stop = _StopWorker(at=2)
    with pytest.warns(DeviceDroppedWarning, match=r"opencl:0:0 failed .*did not answer "
                                                  r"'conv_forward' within its deadline"):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    stalled_for = time.monotonic() - stop.when
    baseline.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(model, baseline)
    assert DEADLINE <= stalled_for < DEADLINE + 20, stalled_for
    assert [r["active"] for r in s.report()] == [True, False] * 2
    assert gone(stop.pid)


def test_stalled_only_device_raises_the_typed_error_from_fit(opencl, monkeypatch):
    from keras_cct.errors import DeviceTimeoutError
    from tests.strategy.test_stalled_device import DEADLINE, _StopWorker
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", str(DEADLINE))
    x, y = _data(8)
    s = CCTStrategy(["opencl:0:0"], rebalance=False)
    with s.scope():
        model = keras.Sequential([keras.Input((12, 12, 3)), HybridConv2D(4, 3),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # warm
    with pytest.raises(DeviceTimeoutError, match="opencl:0:0.*KERAS_CCT_DEVICE_TIMEOUT"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[_StopWorker(at=0)])
    assert np.all(s.active)  # the only device is kept: the next step starts a fresh worker


def test_measure_split_and_hybridize(opencl):
    """``split="measure"`` times the layer on each device; a hybridized Conv2D model gives
    the model's outputs."""
    from keras_cct import hybridize
    s = CCTStrategy([CPU, "opencl:0:0"], split="measure", rebalance=False)
    keras.utils.set_random_seed(0)
    inp = keras.Input((10, 10, 3))
    h = keras.layers.Conv2D(6, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(4, 3, strides=2, groups=2)(h)
    model = keras.Model(inp, keras.layers.Flatten()(h))
    hybrid = hybridize(model, s)
    x = np.random.default_rng(0).standard_normal((5, 10, 10, 3)).astype("float32")
    got = keras.ops.convert_to_numpy(hybrid(x))
    assert ref.rel_err(got, keras.ops.convert_to_numpy(model(x))) <= TOL
    for layer in hybrid.layers:
        if isinstance(layer, HybridConv2D):
            f = s.fractions(layer)
            assert sum(f.values()) == pytest.approx(1) and all(v > 0 for v in f.values())


_DATA_PARALLEL = """
import json, os, sys
sys.path.insert(0, os.getcwd())
import jax, keras
from keras_cct import CCTStrategy
from tests.strategy.test_backends import _data, _model
from tests import reference as ref
assert len(jax.devices()) == 2, jax.devices()
x, y = _data(16)
baseline = _model()  # keras Conv2D, one device, no distribution
weights = baseline.get_weights()
baseline.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
s = CCTStrategy(["jax:cpu:0", "opencl:0:0"], split=[0.7, 0.3], rebalance=True)
model = _model(s)
model.set_weights(weights)
from keras_cct.strategy import _jax
start = _jax._GENERATION[0]
first = []  # the first step's shards (0.7 / 0.3 of 4, each layer); later ones follow the timing
stale = keras.callbacks.LambdaCallback(  # the compiled sizes go stale mid-fit, as a rebalance makes them
    on_train_batch_end=lambda b, logs: (b == 0 and first.extend(r["images"] for r in s.report()),
                                        b == 1 and _jax._stale(_jax._GENERATION[0])),
    on_test_batch_end=lambda b, logs: b == 0 and _jax._stale(_jax._GENERATION[0]))
model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[stale],
          validation_data=(x[:8], y[:8]))
print(json.dumps({"jit": bool(model.jit_compile), "sharded": len(model.weights[0].value.sharding.device_set),
                  "retraces": _jax._GENERATION[0] - start,
                  "err": max(ref.rel_err(a, b) for a, b in zip(model.get_weights(), baseline.get_weights())),
                  "first": first, "images": [r["images"] for r in s.report()]}))
"""


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.DataParallel on JAX")
def test_strategy_model_trains_under_data_parallel(opencl):
    """Under keras.distribution.DataParallel over two local JAX devices
    (--xla_force_host_platform_device_count=2, in a subprocess), a CCTStrategy model's
    compiled step trains: four steps give the weights of keras Conv2D on one device, with the
    step functions made again mid-fit and mid-validation (as after a rebalance: Keras has
    detached the variables' values then, and DataParallel reads their shardings)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, KERAS_BACKEND="jax",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run = subprocess.run([sys.executable, "-c", _DATA_PARALLEL], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["jit"] and out["sharded"] == 2 and out["retraces"] >= 2, out
    assert out["err"] <= TOL, out
    # both devices ran a shard of the first step; later steps follow the measured times (a
    # device whose one image takes longer than the other's whole shard is parked after
    # PARK_AFTER steps: how loaded the machine is decides that, so only the total is asserted)
    assert out["first"] == [3, 1] * 2, out  # two layers, two devices each
    assert [sum(out["images"][i:i + 2]) for i in (0, 2)] == [4, 4], out


_TWO_JAX_DEVICES = """
import json, os, sys
sys.path.insert(0, os.getcwd())
import numpy as np
from keras_cct import CCTStrategy
from tests.strategy.test_backends import _data, _model, _pair, layer_grads
from tests import reference as ref
s = CCTStrategy(["jax:cpu:0", "jax:cpu:1", "opencl:0:0"], split=[0.5, 0.3, 0.2],
                rebalance=False, backward_split="own")
split, conv = _pair(s, (10, 9, 9, 4), filters=6, kernel_size=3, padding="same")
rng = np.random.default_rng(3)
x = rng.standard_normal((10, 9, 9, 4)).astype("float32")
dy = rng.standard_normal((10, 9, 9, 6)).astype("float32")
(y, g), (y0, g0) = layer_grads(split, x, dy), layer_grads(conv, x, dy)
errs = [ref.rel_err(y, y0)] + [ref.rel_err(a, b) for a, b in zip(g, g0)]
x, y = _data(20)
s2 = CCTStrategy(["jax:cpu:0", "jax:cpu:1", "opencl:0:0"], split=[0.5, 0.3, 0.2])
model, baseline = _model(s2), _model()
model.set_weights(baseline.get_weights())
for m in (model, baseline):
    m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
errs += [ref.rel_err(a, b) for a, b in zip(model.get_weights(), baseline.get_weights())]
print(json.dumps({"err": max(errs), "images": [r["images"] for r in s.report()],
                  "jit": bool(model.jit_compile),
                  "timed": all(np.isfinite(r["last_ms"]) for r in s2.report())}))
"""


@pytest.mark.skipif(BACKEND != "jax", reason="several JAX devices")
def test_a_second_jax_device_takes_a_shard(opencl):
    """(jax:cpu:0, jax:cpu:1, opencl:0:0) at 0.5/0.3/0.2, two local JAX devices in a
    subprocess: jax:cpu:1's shard runs on its device (launched from the compiled step);
    outputs, gradients and five fit steps equal keras Conv2D's."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, KERAS_BACKEND="jax",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run = subprocess.run([sys.executable, "-c", _TWO_JAX_DEVICES],
                         cwd=Path(__file__).resolve().parents[2], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["err"] <= TOL and out["images"] == [5, 3, 2], out
    assert out["jit"] and out["timed"], out


def test_the_opencl_shard_runs_while_the_backend_shard_computes(opencl, monkeypatch):
    """Launch first: with the OpenCL shard's request taking 1 s on its device (a delayed
    future) and the backend's shard 1 s (a sleep before its convolution), a forward pass
    takes about 1 s, not 2 s: the two ran at the same time. (The margin is wide: CI's run on
    a loaded 2-core machine once took 0.43 s above a 0.6 s nap.)"""
    import concurrent.futures
    import threading
    import time as _time

    import keras_cct.lowering as lowering
    from keras_cct.devices.opencl import conv as cl_conv
    real_cl, real_geo = cl_conv.conv2d_forward, lowering.conv2d_geo
    nap = {"s": 0.0}

    def slow_cl(*args, **kwargs):
        kwargs.pop("wait", None)
        result, future = real_cl(*args, **kwargs), concurrent.futures.Future()
        threading.Timer(nap["s"], future.set_result, (result,)).start()
        return future

    def slow_backend(x, k, geo, low):
        if BACKEND == "jax":
            import jax
            from jax.experimental import io_callback

            def sleep(_):
                _time.sleep(nap["s"])
                return np.float32(0)
            zero = io_callback(sleep, jax.ShapeDtypeStruct((), np.float32), x.shape[0],
                               ordered=False)
            x = x + zero
        else:
            _time.sleep(nap["s"])
        return real_geo(x, k, geo, low)

    monkeypatch.setattr(cl_conv, "conv2d_forward", slow_cl)
    monkeypatch.setattr(lowering, "conv2d_geo", slow_backend)
    s = CCTStrategy([CPU, "opencl:0:0"], split=[0.5, 0.5], rebalance=False)
    split, conv = _pair(s, (4, 9, 9, 4), filters=6, kernel_size=3, padding="same")
    x = np.random.default_rng(4).standard_normal((4, 9, 9, 4)).astype("float32")
    split(x)  # warm
    nap["s"] = 1.0
    t0 = _time.perf_counter()
    y = keras.ops.convert_to_numpy(split(x))
    wall = _time.perf_counter() - t0
    assert ref.rel_err(y, keras.ops.convert_to_numpy(conv(x))) <= TOL
    assert 1.0 <= wall < 1.6, wall  # one after the other: 2 s at least
    rows = s.report()
    assert all(r["last_ms"] >= 1000 for r in rows), rows


_ONE_CPU_FIT = """
import json, os, sys
os.sched_setaffinity(0, {0})  # before JAX starts its thread pools, as a 1-CPU container
sys.path.insert(0, os.getcwd())
import keras
import numpy as np
from keras_cct import CCTStrategy, HybridConv2D
s = CCTStrategy(["opencl:0:0"], split="flops")
with s.scope():
    inp = keras.Input((32, 32, 16))
    h = HybridConv2D(32, 3, padding="same", activation="relu")(inp)
    h = HybridConv2D(32, 3, padding="same")(h)
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(h)))
model.compile(keras.optimizers.SGD(0.01), "mse")
rng = np.random.default_rng(0)
x = rng.standard_normal((16 * 8, 32, 32, 16)).astype("float32")
y = rng.standard_normal((16 * 8, 4)).astype("float32")
hist = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
print(json.dumps({"loss": hist.history["loss"], "nproc": os.environ.get("NPROC"),
                  "images": [r["images"] for r in s.report()]}))
"""


@pytest.mark.skipif(BACKEND != "jax" or not hasattr(os, "sched_setaffinity"),
                    reason="XLA's CPU thread pool (JAX) on a one-CPU process")
def test_fit_in_a_one_cpu_process_does_not_hang(opencl):
    """A process that may use one CPU (pinned; a one-CPU container) trains under an
    OpenCL-only strategy: XLA sized its pool to one thread and ``fit``'s next step, dispatched
    ahead, held it while this step's host callback waited for its operands -- ``fit`` hung
    (benchmarks/hybrid.py's ``jax-cl1``). keras_cct gives the pool two threads (NPROC)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    env["KERAS_BACKEND"] = "jax"
    run = subprocess.run([sys.executable, "-c", _ONE_CPU_FIT], cwd=root, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["nproc"] == "2", out
    assert all(np.isfinite(out["loss"])) and out["images"] == [16, 16], out
