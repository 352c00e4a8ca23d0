"""Deadlines and restarts of the OpenCL worker: a stalled (SIGSTOPped) worker is killed and its
request fails with a typed DeviceTimeoutError within the deadline; a worker killed twice within
one request is restarted (with a pause) and the request still succeeds; the typed error reaches
the caller of a layer and of ``fit`` as itself, not as the backend's callback error; a stalled
worker does not hold up the interpreter's exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

from keras_cct import HybridConv2D
from keras_cct.devices.opencl import client_for, conv2d_forward
from keras_cct.devices.opencl.client import WorkerClient, parse_opencl_name, request_timeout
from keras_cct.errors import DeviceError, DeviceTimeoutError, WorkerError
from tests import reference as R
from tests.processes import gone

pytestmark = pytest.mark.opencl


def _small(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, 6, 6, 3)).astype(np.float32),
            rng.standard_normal((3, 3, 3, 4)).astype(np.float32))


@pytest.fixture
def fresh(opencl_device):
    """A private client of the device (the shared one stays untouched)."""
    client = WorkerClient(parse_opencl_name(opencl_device), name=opencl_device)
    yield client
    client.stop()


def test_stopped_worker_times_out_is_killed_and_replaced(fresh):
    assert fresh.request("ping") > 0
    pid = fresh.pid
    os.kill(pid, signal.SIGSTOP)  # a hung driver
    t0 = time.monotonic()
    with pytest.raises(DeviceTimeoutError, match=r"did not answer 'ping' within its deadline "
                                                 r"of 1\.5 s.*KERAS_CCT_DEVICE_TIMEOUT"):
        fresh.call("ping", timeout=1.5)
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 4.0, elapsed
    assert gone(pid)  # killed (SIGKILL ends a stopped process) and reaped
    assert fresh.request("ping") not in (None, pid)  # the next call starts a fresh worker
    assert fresh.starts == 2


def test_deadline_applies_to_a_slow_worker_but_not_to_its_start(fresh, monkeypatch):
    # 0.3 s per request, but a cold worker (start, first request of each command) gets
    # KERAS_CCT_DEVICE_START_TIMEOUT more: starting and building kernels do not trip it.
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", "0.3")
    x, k = _small()
    _, outs = fresh.call("conv_forward", {"x": x, "w": k}, {"y": ((2, 4, 4, 4), np.float32)},
                         g={"N": 2, "H": 6, "W": 6, "C": 3, "F": 4, "kh": 3, "kw": 3,
                            "groups": 1, "sh": 1, "sw": 1, "dh": 1, "dw": 1, "pt": 0, "pl": 0,
                            "oh": 4, "ow": 4}, lowering="type1", chunk_bytes=1 << 20)
    assert outs["y"].shape == (2, 4, 4, 4) and np.isfinite(outs["y"]).all()
    assert fresh.request("sleep", seconds=0.0) > 0  # warms 'sleep'
    pid = fresh.pid
    t0 = time.monotonic()
    with pytest.raises(DeviceTimeoutError, match="0.3 s"):
        fresh.request("sleep", seconds=5.0)
    assert time.monotonic() - t0 < 2.5
    assert gone(pid)
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", "0")  # no deadline
    assert fresh.request("sleep", seconds=0.5) == fresh.pid


def test_deadline_setting(monkeypatch):
    monkeypatch.delenv("KERAS_CCT_DEVICE_TIMEOUT", raising=False)
    assert request_timeout() == 60.0
    assert request_timeout(2e12) == 60.0 + 2000.0  # grows with the work
    assert request_timeout(work=1e9, env={"KERAS_CCT_DEVICE_TIMEOUT": "7"}) == 7.0
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", "2.5")
    assert request_timeout(1e15) == 2.5
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", "0")
    assert request_timeout() == float("inf")
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", bad)
        with pytest.raises(DeviceError, match=f"KERAS_CCT_DEVICE_TIMEOUT='{bad}'"):
            request_timeout()


def test_two_deaths_within_one_request_are_survived(fresh):
    """Killed once during the request, and the restarted worker killed again as soon as it
    appears (while it starts): the third worker answers."""
    first = fresh.request("sleep", seconds=0.0)
    starts = fresh.starts
    victims = []

    def killer():
        time.sleep(0.3)  # inside the 1 s request
        victims.append(first)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pid = fresh.pid
            if pid not in (None, first):
                victims.append(pid)
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=killer)
    thread.start()
    answer = fresh.request("sleep", seconds=1.0)
    thread.join()
    assert len(victims) == 2 and answer not in victims
    assert answer == fresh.pid and fresh.starts == starts + 2


def test_a_worker_that_keeps_dying_is_a_worker_error(fresh):
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="died 4 times in a row"):
        fresh.request("crash")
    assert time.monotonic() - t0 >= 0.1 + 0.2 + 0.4  # paused between restarts
    assert fresh.request("ping") == fresh.pid


def _layer_model(device):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6, 6, 3)), HybridConv2D(4, 3, device=device),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_stalled_device_raises_the_typed_error_from_a_layer_and_from_fit(opencl_device,
                                                                          monkeypatch):
    """A single-device layer (no strategy): a stopped worker is a DeviceTimeoutError (a
    DeviceError) within the deadline, raised as itself by an eager call and by ``fit`` --
    not the backend's error for a failed callback (TF's UnknownError, JAX's
    XlaRuntimeError)."""
    x, _ = _small()
    y = np.array([0, 1])
    model = _layer_model(opencl_device)
    model.fit(x, y, epochs=1, batch_size=2, verbose=0)  # warm: worker started, kernels built
    monkeypatch.setenv("KERAS_CCT_DEVICE_TIMEOUT", "2")
    client = client_for(opencl_device)
    for run in ("call", "fit"):
        keras.ops.convert_to_numpy(model(x))  # a (re)started worker warmed up
        pid = client.pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(DeviceError) as info:
            if run == "call":
                keras.ops.convert_to_numpy(model(x))
            else:
                model.fit(x, y, epochs=1, batch_size=2, verbose=0)
        elapsed = time.monotonic() - t0
        assert type(info.value) is DeviceTimeoutError, (run, type(info.value), info.value)
        assert opencl_device in str(info.value) and "KERAS_CCT_DEVICE_TIMEOUT" in str(info.value)
        assert 2.0 <= elapsed < 8.0, (run, elapsed)
        assert gone(pid)
    monkeypatch.delenv("KERAS_CCT_DEVICE_TIMEOUT")
    # a fresh worker: the device computes again
    k = np.random.default_rng(2).standard_normal((3, 3, 3, 4)).astype(np.float32)
    assert R.rel_err(conv2d_forward(opencl_device, x, k), R.conv2d(x, k, None, 1, 0)) <= 1e-5
    assert client.pid not in (None, pid)
    if keras.backend.backend() != "jax":  # Keras' JAX trainer loses the variables when a step
        model.fit(x, y, epochs=1, batch_size=2, verbose=0)  # raises: no second fit there


def test_a_stalled_worker_does_not_hold_up_exit(opencl_device, tmp_path):
    code = ("import os, signal, numpy as np\n"
            "from keras_cct.devices.opencl import client_for\n"
            f"c = client_for({opencl_device!r})\n"
            "print(c.request('ping'), flush=True)\n"
            "os.kill(c.pid, signal.SIGSTOP)\n"
            "f = c.submit('ping')\n"  # in flight on the device thread, default deadline
            "raise SystemExit(3)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=str(tmp_path))
    assert out.returncode == 3, out.stderr
    assert time.monotonic() - t0 < 20
    pid = int(out.stdout.split()[-1])
    for _ in range(50):
        if gone(pid):
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"stopped worker {pid} still exists after its parent exited")
