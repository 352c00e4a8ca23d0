"""Device discovery and FLOPS calibration.

A :class:`Device` is either one of the Keras backend's own devices (``"tf:cpu:0"``,
``"tf:gpu:0"``, ``"jax:cpu:0"``, ``"torch:cuda:0"``) or an OpenCL device (``"opencl:P:D"``, or a
sub-device ``"opencl:P:D.S"`` from device fission, one compute unit each). OpenCL discovery runs
in a worker process (see :mod:`keras_cct.devices.opencl.client`). :func:`calibrate` measures a
device's SGEMM throughput and caches it on disk under ``~/.cache/keras_cct`` (or
``$KERAS_CCT_CACHE_DIR``); unreadable cache entries are ignored and rewritten.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Union

import numpy as np

from keras_cct._files import atomic_write, cache_dir
from keras_cct._system import physical_memory
from keras_cct.errors import DeviceError, KerasCCTError

CALIBRATION_VERSION = "sgemm-2048x256x1024-v1"
_BACKEND_PREFIX = {"tensorflow": "tf", "jax": "jax", "torch": "torch", "numpy": "numpy"}


@dataclass(frozen=True)
class Device:
    """One device keras_cct can compute on.

    Attributes:
        name: ``"tf:cpu:0"``, ``"opencl:0:0"``, ``"opencl:0:0.1"``, ...
        kind: ``"cpu"``, ``"gpu"``, ``"accelerator"`` or ``"other"``.
        backend: ``"tensorflow"``, ``"jax"``, ``"torch"`` or ``"opencl"``.
        description: the device's own name (and platform for OpenCL).
        compute_units: cores / compute units (None if unknown).
        memory: bytes of device memory (None if unknown).
        gflops: measured SGEMM GFLOP/s (None until calibrated).
        env: extra environment of the OpenCL worker (e.g. ``POCL_MAX_PTHREAD_COUNT``).
    """

    name: str
    kind: str
    backend: str
    description: str = ""
    compute_units: Optional[int] = None
    memory: Optional[int] = None
    gflops: Optional[float] = None
    env: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def is_opencl(self) -> bool:
        return self.backend == "opencl"

    def calibrate(self, *, refresh: bool = False) -> "Device":
        """This device with ``gflops`` measured (or read from the cache)."""
        return replace(self, gflops=calibrate(self, refresh=refresh))


# -- cache --------------------------------------------------------------------------------------
def _cache_file() -> Path:
    return cache_dir() / "calibration.json"


_CACHE_LOCK = threading.Lock()


def _read_cache() -> Dict[str, dict]:
    path = _cache_file()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path}: unreadable calibration cache ignored ({exc})", stacklevel=3)
        return {}
    if not isinstance(data, dict):
        warnings.warn(f"{path}: calibration cache is not a JSON object; ignored", stacklevel=3)
        return {}
    return data


def _write_cache(data: Dict[str, dict]) -> None:
    path = _cache_file()
    try:
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as exc:  # a read-only home must not break calibration
        warnings.warn(f"could not write the calibration cache {path}: {exc}", stacklevel=3)


def _cache_key(device: Device) -> str:
    from keras_cct._version import __version__
    env = ",".join(f"{k}={v}" for k, v in sorted(device.env.items()))
    return f"{device.name}|{device.description}|{env}|{os.cpu_count()}|{__version__}|" \
           f"{CALIBRATION_VERSION}"


def _cached_gflops(device: Device) -> Optional[float]:
    entry = _read_cache().get(_cache_key(device))
    if isinstance(entry, dict):
        value = entry.get("gflops")
        if isinstance(value, (int, float)) and np.isfinite(value) and value > 0:
            return float(value)
    return None


# -- discovery ------------------------------------------------------------------------------------
_OPENCL_CACHE: Optional[dict] = None
_DISCOVERY_LOCK = threading.Lock()


def opencl_platforms(*, refresh: bool = False) -> dict:
    """Raw OpenCL discovery from the worker: ``{"platforms": [...], "error": str}``.

    Each device dict carries ``build_error`` (empty when a test kernel builds and runs).
    ``error`` is set when pyopencl or an OpenCL ICD is missing.
    """
    global _OPENCL_CACHE
    with _DISCOVERY_LOCK:
        if _OPENCL_CACHE is None or refresh:
            from keras_cct.devices.opencl.client import client_for
            discovery = client_for(None)
            try:
                _OPENCL_CACHE = discovery.request("list", probe=True)
            except KerasCCTError as exc:
                _OPENCL_CACHE = {"platforms": [], "error": str(exc)}
            finally:
                discovery.stop()  # only needed once
        return _OPENCL_CACHE


def _opencl_devices(sub_devices: bool, working_only: bool) -> List[Device]:
    from keras_cct.devices.opencl.client import client_for
    out = []
    for plat in opencl_platforms()["platforms"]:
        for d in plat["devices"]:
            if working_only and d["build_error"]:
                continue
            name = f"opencl:{plat['index']}:{d['index']}"
            desc = f"{d['name']} ({plat['name']})"
            out.append(Device(name, d["kind"], "opencl", desc, d["compute_units"], d["memory"],
                              env=dict(client_for(name).env)))
            if sub_devices:
                for s in range(d["sub_devices"]):
                    sname = f"{name}.{s}"
                    out.append(Device(sname, d["kind"], "opencl", f"{desc}, sub-device {s}", 1,
                                      d["memory"], env=dict(client_for(sname).env)))
    return out


def _backend_devices() -> List[Device]:
    import keras
    backend = keras.backend.backend()
    prefix = _BACKEND_PREFIX.get(backend, backend)
    out = []
    if backend == "tensorflow":
        import tensorflow as tf
        counts: Dict[str, int] = {}
        for d in tf.config.list_physical_devices():
            kind = d.device_type.lower()
            if kind not in ("cpu", "gpu"):
                continue
            i = counts[kind] = counts.get(kind, -1) + 1
            desc = d.name
            if kind == "gpu":
                try:
                    desc = tf.config.experimental.get_device_details(d).get("device_name", desc)
                except Exception:  # noqa: BLE001
                    pass
            out.append(Device(f"tf:{kind}:{i}", kind, backend, desc,
                              os.cpu_count() if kind == "cpu" else None,
                              physical_memory() if kind == "cpu" else None))
    elif backend == "jax":
        import jax
        counts = {}
        for d in jax.devices() + ([] if jax.default_backend() == "cpu" else jax.devices("cpu")):
            kind = "cpu" if d.platform == "cpu" else "gpu"
            i = counts[kind] = counts.get(kind, -1) + 1
            out.append(Device(f"jax:{kind}:{i}", kind, backend, str(d.device_kind),
                              os.cpu_count() if kind == "cpu" else None,
                              physical_memory() if kind == "cpu" else None))
    elif backend == "torch":
        import torch
        out.append(Device("torch:cpu:0", "cpu", backend, "CPU", os.cpu_count(), physical_memory()))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(Device(f"torch:cuda:{i}", "gpu", backend, p.name,
                              p.multi_processor_count, p.total_memory))
    else:
        out.append(Device(f"{prefix}:cpu:0", "cpu", backend, "CPU", os.cpu_count(),
                          physical_memory()))
    return out


def list_devices(*, calibrate: bool = True, opencl: bool = True, sub_devices: bool = False,
                 refresh: bool = False) -> List[Device]:
    """The Keras backend's devices, then every working OpenCL device.

    Args:
        calibrate: fill ``gflops`` by :func:`calibrate` (from the on-disk cache when present;
            a first measurement takes about a second per device). With False, ``gflops`` holds
            the cached figure or None.
        opencl: include OpenCL devices (discovered in a worker process).
        sub_devices: also list each OpenCL device's one-compute-unit sub-devices
            (``"opencl:P:D.S"``).
        refresh: re-discover OpenCL devices and re-measure instead of using the caches.
    """
    if refresh and opencl:
        opencl_platforms(refresh=True)
    devices = _backend_devices()
    if opencl:
        devices += _opencl_devices(sub_devices, working_only=True)
    if calibrate:
        return [d.calibrate(refresh=refresh) for d in devices]
    return [replace(d, gflops=_cached_gflops(d)) for d in devices]


_ALIASES = {"torch:cpu": "torch:cpu:0", "torch:cuda": "torch:cuda:0"}


def get_device(name: Union[str, Device], *, env: Optional[Mapping[str, str]] = None) -> Device:
    """The :class:`Device` called ``name`` (not calibrated: see :func:`calibrate`).

    Args:
        name: e.g. ``"tf:cpu:0"``, ``"jax:cpu:0"``, ``"torch:cpu"`` (or ``"torch:cpu:0"``),
            ``"torch:cuda:0"``, ``"opencl:0:0"``, ``"opencl:0:0.1"``.
        env: for OpenCL devices, the worker's extra environment (for example
            ``{"POCL_MAX_PTHREAD_COUNT": "1"}`` to limit PoCL to one thread); a change restarts
            that device's worker.

    Raises:
        DeviceError: no such device (the message lists the available ones).
    """
    if isinstance(name, Device):
        name = name.name
    name = _ALIASES.get(name, name)
    if str(name).startswith("opencl:"):
        from keras_cct.devices.opencl.client import client_for, parse_opencl_name
        spec = parse_opencl_name(name)
        base, _, sub = spec.partition(".")
        for d in _opencl_devices(sub_devices=bool(sub), working_only=False):
            if d.name == name:
                if env is not None:
                    client_for(name, env)
                    d = replace(d, env=dict(env))
                return d
    else:
        if env is not None:
            raise DeviceError(f"`env` only applies to OpenCL devices, not {name!r}")
        for d in _backend_devices():
            if d.name == name:
                return d
    names = [d.name for d in _backend_devices()] + \
        [d.name for d in _opencl_devices(sub_devices=True, working_only=False)]
    err = opencl_platforms()["error"]
    raise DeviceError(f"no device {name!r}; available: {', '.join(names) or 'none'}"
                      + (f" (OpenCL: {err})" if err else ""))


# -- calibration ----------------------------------------------------------------------------------
def _time_loop(run, sync, seconds: float) -> float:
    sync(run())
    n, t0 = 0, time.perf_counter()
    while True:
        out = run()
        n += 1
        if time.perf_counter() - t0 >= seconds and n >= 2:
            break
    sync(out)
    return (time.perf_counter() - t0) / n


def _measure_backend(device: Device, M: int, N: int, K: int, seconds: float) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    _, kind, index = device.name.split(":")
    if device.backend == "tensorflow":
        import tensorflow as tf
        with tf.device(f"/{kind.upper()}:{index}"):
            ta, tb = tf.constant(a), tf.constant(b)
            dt = _time_loop(lambda: tf.matmul(ta, tb), lambda o: o.numpy(), seconds)
    elif device.backend == "jax":
        import jax
        import jax.numpy as jnp
        dev = [d for d in jax.devices(kind if kind == "cpu" else None)
               if (d.platform == "cpu") == (kind == "cpu")][int(index)]
        ja, jb = jax.device_put(a, dev), jax.device_put(b, dev)
        mm = jax.jit(jnp.matmul)
        dt = _time_loop(lambda: mm(ja, jb), lambda o: o.block_until_ready(), seconds)
    elif device.backend == "torch":
        import torch
        dev = torch.device("cpu" if kind == "cpu" else f"cuda:{index}")
        ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
        sync = (lambda o: torch.cuda.synchronize(dev)) if kind != "cpu" else (lambda o: None)
        with torch.no_grad():
            dt = _time_loop(lambda: torch.matmul(ta, tb), sync, seconds)
    else:
        dt = _time_loop(lambda: a @ b, lambda o: None, seconds)
    return 2.0 * M * N * K / dt / 1e9


def calibrate(device: Union[str, Device], *, refresh: bool = False,
              seconds: float = 0.3) -> float:
    """Measured SGEMM throughput of ``device`` in GFLOP/s (2048x1024 times 1024x256, float32).

    The figure is cached on disk per device, worker environment and keras_cct version; with
    ``refresh`` it is measured again. OpenCL devices are measured in their worker with
    keras_cct's own SGEMM kernel; the backend's devices with its matmul.

    Raises:
        DeviceError: unknown device; OpenCLError / WorkerError if the OpenCL device fails.
    """
    if not isinstance(device, Device):
        device = get_device(device)
    if not refresh:
        cached = _cached_gflops(device)
        if cached is not None:
            return cached
    M, N, K = 2048, 256, 1024
    if device.is_opencl:
        from keras_cct.devices.opencl.client import client_for
        gflops = float(client_for(device.name).request("calibrate", M=M, N=N, K=K,
                                                       seconds=seconds))
    else:
        gflops = _measure_backend(device, M, N, K, seconds)
    with _CACHE_LOCK:
        data = _read_cache()
        data[_cache_key(device)] = {"gflops": gflops, "measured": time.time(),
                                    "device": device.name}
        _write_cache(data)
    return gflops
