"""The OpenCL worker process: isolation from TensorFlow, restart after SIGKILL, typed errors that
leave it usable, per-device environment, clean exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from keras_cct.devices.opencl import client_for, conv2d_forward
from keras_cct.devices.opencl.client import WorkerClient, parse_opencl_name
from keras_cct.errors import DeviceError, LoweringError, OpenCLError, WorkerError
from tests import reference as R

pytestmark = pytest.mark.opencl


def _small(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, 6, 6, 3)).astype(np.float32),
            rng.standard_normal((3, 3, 3, 4)).astype(np.float32))


def _check_conv(device):
    x, k = _small()
    assert R.rel_err(conv2d_forward(device, x, k, padding=1), R.conv2d(x, k, None, 1, 1)) <= 1e-5


def test_worker_never_imports_tensorflow_or_keras(opencl_device):
    _check_conv(opencl_device)  # the worker has run kernels
    modules = client_for(opencl_device).request("modules")
    heavy = [m for m in modules if m.split(".")[0] in ("tensorflow", "keras", "keras_cct", "jax",
                                                        "torch")]
    assert heavy == []
    assert "pyopencl" in modules


def test_sigkill_between_calls_restarts_transparently(opencl_device):
    client = client_for(opencl_device)
    _check_conv(opencl_device)
    pid = client.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    _check_conv(opencl_device)
    assert client.pid not in (None, pid)


def test_sigkill_before_the_death_is_noticed(opencl_device):
    """The kill races the next request: the client still retries on a fresh worker."""
    client = client_for(opencl_device)
    _check_conv(opencl_device)
    os.kill(client.pid, signal.SIGKILL)
    _check_conv(opencl_device)


def test_worker_dying_during_a_request_raises_worker_error(opencl_device):
    client = WorkerClient(parse_opencl_name(opencl_device), name=opencl_device)
    try:
        with pytest.raises(WorkerError, match="died"):
            client.request("crash")  # dies on both attempts
        assert client.request("ping") > 0  # and comes back on the next call
    finally:
        client.stop()


def test_bad_dtype_is_a_clear_error_and_the_worker_survives(opencl_device):
    _check_conv(opencl_device)
    pid = client_for(opencl_device).pid
    x, k = _small()
    with pytest.raises(DeviceError, match="float32"):
        conv2d_forward(opencl_device, x.astype(np.float64), k)
    with pytest.raises(LoweringError, match="groups"):
        conv2d_forward(opencl_device, x, k, groups=2)
    _check_conv(opencl_device)
    assert client_for(opencl_device).pid == pid


def test_request_rejected_inside_the_worker_leaves_it_usable(opencl_device):
    _check_conv(opencl_device)
    client = client_for(opencl_device)
    pid = client.pid
    x, k = _small()
    g = {"N": 2, "H": 6, "W": 6, "C": 3, "F": 4, "kh": 3, "kw": 3, "groups": 1, "sh": 1,
         "sw": 1, "dh": 1, "dw": 1, "pt": 0, "pl": 0, "oh": 4, "ow": 4}
    with pytest.raises(DeviceError, match="lies outside the arena"):  # x claims a huge batch
        client.call("conv_forward", {"x": x, "w": k}, {"y": ((2, 4, 4, 4), np.float32)},
                    g=dict(g, N=10 ** 6), lowering="type1")
    with pytest.raises(DeviceError, match="'y'.*lies outside the arena"):  # checked first
        client.call("conv_forward", {"x": x, "w": k}, {"y": ((2, 4, 4, 4), np.float32)},
                    g=dict(g, oh=1000, ow=1000), lowering="type1")
    with pytest.raises(DeviceError, match="lowering"):
        client.call("conv_forward", {"x": x, "w": k}, {"y": ((2, 4, 4, 4), np.float32)},
                    g=g, lowering="type9")
    _check_conv(opencl_device)
    assert client.pid == pid


def test_kernel_build_error_carries_the_build_log(opencl_device):
    client = client_for(opencl_device)
    with pytest.raises(OpenCLError) as info:
        client.request("build", source="__kernel void broken(__global float *a) "
                                       "{ a[0] = undefined_symbol_xyz; }")
    assert "undefined_symbol_xyz" in str(info.value)
    assert opencl_device in str(info.value)
    assert client.request("build", source="__kernel void fine(__global float *a) "
                                          "{ a[0] = 1.0f; }") == ["fine"]
    _check_conv(opencl_device)


def test_bad_device_names(opencl_device):
    with pytest.raises(DeviceError, match="opencl:P:D"):
        parse_opencl_name("opencl:zero")
    with pytest.raises(DeviceError, match="no OpenCL platform"):
        client_for("opencl:99:0").request("info")


def test_worker_environment_is_configurable(opencl_device):
    """POCL_MAX_PTHREAD_COUNT in a worker's environment limits PoCL's threads (compute units)."""
    name = opencl_device
    info = client_for(name).request("info")
    if "Portable Computing Language" not in info["platform"]:
        pytest.skip("POCL_MAX_PTHREAD_COUNT only applies to PoCL")
    client = WorkerClient(parse_opencl_name(name), {"POCL_MAX_PTHREAD_COUNT": "1"}, name=name)
    try:
        assert client.request("info")["compute_units"] == 1
        pid = client.pid
        client.set_env({})
        assert client.request("info")["compute_units"] == info["compute_units"]
        assert client.pid != pid
    finally:
        client.stop()


def test_worker_cpus_pin_the_worker_and_bad_values_are_clear(opencl_device):
    """KERAS_CCT_WORKER_CPUS confines the worker and every thread it starts (PoCL's too) to the
    given cores, and the client's device thread (which copies the arrays) with them; a malformed
    list makes the start fail with a WorkerError that quotes it."""
    name = opencl_device
    last = max(os.sched_getaffinity(0))
    client = WorkerClient(parse_opencl_name(name), {"KERAS_CCT_WORKER_CPUS": str(last)},
                          name=name)
    try:
        assert client.request("info")["compute_units"] >= 1  # starts it, creates a context
        tasks = os.listdir(f"/proc/{client.pid}/task")
        for tid in tasks:
            assert os.sched_getaffinity(int(tid)) == {last}
        device_thread = client._thread
        assert device_thread.is_alive() and device_thread is not threading.current_thread()
        assert os.sched_getaffinity(device_thread.native_id) == {last}
    finally:
        client.stop()
    bad = WorkerClient(parse_opencl_name(name), {"KERAS_CCT_WORKER_CPUS": "1-x"}, name=name)
    try:
        with pytest.raises(WorkerError, match="KERAS_CCT_WORKER_CPUS='1-x'"):
            bad.request("info")
    finally:
        bad.stop()


def test_worker_stops_when_the_interpreter_exits(opencl_device, tmp_path):
    code = ("import numpy as np\n"
            "from keras_cct.devices.opencl import client_for\n"
            f"c = client_for({opencl_device!r})\n"
            "print(c.request('ping'), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"worker {pid} still runs after its parent exited")


def test_too_little_shared_memory_is_a_clear_error(opencl_device, monkeypatch):
    import keras_cct.devices.opencl.client as client_mod
    x, k = _small()
    _check_conv(opencl_device)
    monkeypatch.setattr(client_mod, "_shm_free_bytes", lambda: 1000)
    big = np.zeros((256, 128, 128, 3), np.float32)  # 48 MiB: more than the current arena
    with pytest.raises(DeviceError, match="/dev/shm"):
        conv2d_forward(opencl_device, big, k)
    monkeypatch.undo()
    _check_conv(opencl_device)


def test_worker_starts_no_helper_processes(opencl_device):
    """Attaching the shared memory must not start a resource tracker inside the worker (it
    would unlink the parent's segment when the worker exits)."""
    import shutil
    if shutil.which("ps") is None:
        pytest.skip("needs ps")
    _check_conv(opencl_device)
    pid = client_for(opencl_device).pid
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True,
                         text=True)
    assert out.stdout.strip() == ""


def test_two_workers_run_at_the_same_time(opencl_device):
    """Waiting on a worker releases the GIL, so requests to two devices overlap."""
    import threading
    a = WorkerClient(parse_opencl_name(opencl_device), name="a")
    b = WorkerClient(parse_opencl_name(opencl_device), name="b")
    try:
        a.request("ping"), b.request("ping")
        threads = [threading.Thread(target=c.request, args=("sleep",), kwargs={"seconds": 1.0})
                   for c in (a, b)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.perf_counter() - t0 < 1.8
    finally:
        a.stop()
        b.stop()


def test_parent_process_never_loads_pyopencl(opencl_device):
    """Only workers load OpenCL: this (TensorFlow-importing) process must not."""
    import sys
    from keras_cct.devices import list_devices
    _check_conv(opencl_device)
    list_devices(calibrate=False)
    assert not any(m == "pyopencl" or m.startswith("pyopencl.") for m in sys.modules)
