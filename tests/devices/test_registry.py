"""Device discovery, calibration and its on-disk cache, and ``cct devices``."""

from __future__ import annotations

import json

import keras
import pytest

from keras_cct.cli import main as cct_main
from keras_cct.devices import Device, calibrate, get_device, list_devices
from keras_cct.errors import DeviceError

PREFIX = {"tensorflow": "tf", "jax": "jax", "torch": "torch"}[keras.backend.backend()]


@pytest.mark.opencl
def test_list_devices_has_backend_and_opencl_devices(opencl_device, cache_dir):
    devices = list_devices(calibrate=False)
    names = [d.name for d in devices]
    assert f"{PREFIX}:cpu:0" in names
    assert opencl_device in names
    cl = next(d for d in devices if d.name == opencl_device)
    assert cl.backend == "opencl" and cl.kind in ("cpu", "gpu", "accelerator", "other")
    assert cl.compute_units >= 1 and cl.memory > 0
    assert cl.gflops is None  # nothing cached in a fresh cache dir


@pytest.mark.opencl
def test_sub_devices_are_listed_and_usable(opencl_device, cache_dir):
    import numpy as np
    from keras_cct.devices.opencl import conv2d_forward
    from tests import reference as R
    subs = [d for d in list_devices(calibrate=False, sub_devices=True)
            if d.name.startswith(opencl_device + ".")]
    if not subs:
        pytest.skip("this OpenCL device does not support fission")
    assert all(d.compute_units == 1 for d in subs)
    x = np.random.default_rng(0).standard_normal((1, 5, 5, 2)).astype(np.float32)
    k = np.random.default_rng(1).standard_normal((2, 2, 2, 3)).astype(np.float32)
    assert R.rel_err(conv2d_forward(subs[-1].name, x, k), R.conv2d(x, k)) <= 1e-5


@pytest.mark.opencl
def test_calibrate_measures_then_caches(opencl_device, cache_dir):
    gflops = calibrate(opencl_device)
    assert 0.01 < gflops < 1e6
    data = json.loads((cache_dir / "calibration.json").read_text())
    (key, entry), = data.items()
    assert opencl_device in key and entry["gflops"] == gflops
    # A cached figure is returned as is: plant a distinctive value and read it back.
    data[key]["gflops"] = 12345.5
    (cache_dir / "calibration.json").write_text(json.dumps(data))
    assert calibrate(opencl_device) == 12345.5
    dev = next(d for d in list_devices(calibrate=False) if d.name == opencl_device)
    assert dev.gflops == 12345.5
    assert calibrate(opencl_device, refresh=True) != 12345.5


def test_backend_device_calibration(cache_dir):
    gflops = calibrate(f"{PREFIX}:cpu:0", seconds=0.05)
    assert 0.01 < gflops < 1e6


@pytest.mark.parametrize("garbage", ["{not json", "[1, 2]", '{"x": {"gflops": "fast"}}'])
def test_corrupt_cache_is_ignored(cache_dir, garbage):
    cache_dir.mkdir(parents=True)
    (cache_dir / "calibration.json").write_text(garbage)
    with pytest.warns(UserWarning) if garbage != '{"x": {"gflops": "fast"}}' else _nothing():
        gflops = calibrate(f"{PREFIX}:cpu:0", seconds=0.05)
    assert gflops > 0
    data = json.loads((cache_dir / "calibration.json").read_text())
    assert any(f"{PREFIX}:cpu:0" in k for k in data)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_get_device_errors():
    with pytest.raises(DeviceError, match="no device 'tf:tpu:7'"):
        get_device("tf:tpu:7")
    with pytest.raises(DeviceError, match="opencl:P:D"):
        get_device("opencl:x")
    d = get_device(f"{PREFIX}:cpu:0")
    assert isinstance(d, Device) and d.kind == "cpu" and not d.is_opencl
    assert {d: 1}[get_device(f"{PREFIX}:cpu:0")] == 1  # hashable, equal by value


@pytest.mark.opencl
def test_cct_devices_prints_a_table(opencl_device, cache_dir, capsys):
    assert cct_main(["devices"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["device", "kind", "units", "memory", "GFLOP/s"]
    row = next(line for line in lines if line.startswith(opencl_device + " "))
    col = lines[0].index("GFLOP/s")
    assert float(row[col:].split()[0]) > 0  # measured
    assert cct_main(["devices", "--json", "--no-calibrate"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["name"] == opencl_device and r["gflops"] > 0 for r in rows)


def test_no_opencl_platform_is_reported_not_fatal(monkeypatch, tmp_path, capsys, cache_dir):
    """With no OpenCL ICD visible, discovery lists no OpenCL device and says why."""
    import keras_cct.devices.registry as registry
    from keras_cct.devices.opencl.client import client_for
    monkeypatch.setattr(registry, "_OPENCL_CACHE", None)
    discovery = client_for(None, env={"OCL_ICD_VENDORS": str(tmp_path)})  # an empty folder
    try:
        info = registry.opencl_platforms(refresh=True)
        assert info["platforms"] == [] and info["error"]
        assert all(not d.is_opencl for d in list_devices(calibrate=False))
        assert cct_main(["devices", "--no-calibrate"]) == 0
        assert "OpenCL: none available" in capsys.readouterr().out
    finally:
        discovery.set_env({})
