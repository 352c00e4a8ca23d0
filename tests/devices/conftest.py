"""Fixtures of the device tests: the first working OpenCL device (skip without one, except under
CI=true where a missing OpenCL platform is a failure) and a private calibration cache."""

from __future__ import annotations

import pytest

from tests.conftest import IN_CI


def first_opencl_device() -> str:
    from keras_cct.devices.registry import opencl_platforms
    info = opencl_platforms()
    for plat in info["platforms"]:
        for dev in plat["devices"]:
            if not dev["build_error"]:
                return f"opencl:{plat['index']}:{dev['index']}"
    msg = ("no working OpenCL device (install pyopencl and an OpenCL platform such as "
           f"Debian's pocl-opencl-icd): {info.get('error') or info['platforms']}")
    if IN_CI:
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def opencl_device() -> str:
    return first_opencl_device()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
