"""CCTStrategy with a stalled OpenCL device (its worker SIGSTOPped, like a hung driver): the
request misses its deadline, the worker is killed, the device dropped and its shard recomputed
on the host -- fit finishes with the weights of a run without the device. With no device left
to take over, fit raises the typed DeviceTimeoutError itself."""

import os
import signal
import time

import keras
import numpy as np
import pytest

from keras_cct import CCTStrategy, HybridConv2D
from keras_cct.errors import DeviceDroppedWarning, DeviceTimeoutError
from tests.strategy.test_strategy import _assert_same_weights, _data, _model
from tests.processes import gone


pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                reason="the TensorFlow split op (tf.device shards, tf.function graphs); "
                                "JAX and PyTorch: test_backends.py")

DEADLINE = 3.0


class _StopWorker(keras.callbacks.Callback):
    """SIGSTOPs the device's worker after training batch ``at`` (once it is warm)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.pid, self.when = at, None, None

    def on_train_batch_end(self, batch, logs=None):
        from keras_cct.devices.opencl.client import client_for
        if batch == self.at:
            self.pid = client_for("opencl:0:0").pid
            assert self.pid is not None
            os.kill(self.pid, signal.SIGSTOP)
            self.when = time.monotonic()


def test_stalled_device_is_dropped_and_fit_gives_the_weights_without_it(opencl, monkeypatch):
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", str(DEADLINE))
    x, y = _data(24)
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.7, 0.3], rebalance=False)
    model, baseline = _model(s), _model()
    baseline.set_weights(model.get_weights())
    stop = _StopWorker(at=2)
    with pytest.warns(DeviceDroppedWarning, match=r"opencl:0:0 failed .*did not answer "
                                                  r"'conv_forward' within its deadline"):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    stalled_for = time.monotonic() - stop.when
    baseline.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(model, baseline)
    assert DEADLINE <= stalled_for < DEADLINE + 20, stalled_for  # not forever
    assert {r["device"]: r["active"] for r in s.report()} == {"tf:cpu:0": True,
                                                              "opencl:0:0": False}
    assert gone(stop.pid)  # the stopped worker was killed and reaped


def test_stalled_only_device_raises_the_typed_error_from_fit(opencl, monkeypatch):
    """Nowhere to recompute the shard: fit raises DeviceTimeoutError itself (not TF's
    UnknownError, which is its cause), within the deadline."""
    import tensorflow as tf
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", str(DEADLINE))
    x, y = _data(8)
    s = CCTStrategy(["opencl:0:0"], rebalance=False)
    with s.scope():
        model = keras.Sequential([keras.Input((12, 12, 3)), HybridConv2D(4, 3),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # warm
    stop = _StopWorker(at=0)
    with pytest.raises(DeviceTimeoutError, match="opencl:0:0.*KERAS_CCT_DEVICE_TIMEOUT") as info:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[stop])
    assert DEADLINE <= time.monotonic() - stop.when < DEADLINE + 10
    # raised `from` TF's error (Keras' traceback filter re-raises it `from None`, which
    # leaves TF's error as the context)
    cause = info.value.__cause__ or info.value.__context__
    assert isinstance(cause, tf.errors.UnknownError) and "DeviceTimeoutError" in str(cause)
    assert gone(stop.pid)
    assert np.all(s.active)  # the only device is kept: the next step starts a fresh worker


def test_worker_killed_again_while_it_restarts_is_survived(opencl):
    """The worker is SIGKILLed after a step, and each worker started to replace it is killed as
    soon as it appears (during its start and attach), twice: the client restarts it a third
    time within the same request, so the device is not dropped and nothing changes."""
    import threading
    import warnings

    from keras_cct.devices.opencl.client import client_for
    x, y = _data(24)
    s = CCTStrategy(["tf:cpu:0", "opencl:0:0"], split=[0.6, 0.4], rebalance=False)
    model, baseline = _model(s), _model()
    baseline.set_weights(model.get_weights())
    client = client_for("opencl:0:0")
    killed = []

    def kill_replacements(first):
        end = time.monotonic() + 20
        while len(killed) < 3 and time.monotonic() < end:
            pid = client.pid
            if pid is not None and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.0005)

    class Kill(keras.callbacks.Callback):
        thread = None

        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                first = client.pid
                os.kill(first, signal.SIGKILL)
                killed.append(first)
                self.thread = threading.Thread(target=kill_replacements, args=(first,))
                self.thread.start()

    kill = Kill()
    starts = client.starts
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceDroppedWarning)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[kill])
    kill.thread.join()
    baseline.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(model, baseline)
    assert len(killed) == 3 and client.starts >= starts + 3, (killed, client.starts - starts)
    assert np.all(s.active)
    assert all(r["images"] > 0 for r in s.report() if r["device"] == "opencl:0:0")
