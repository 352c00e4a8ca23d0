"""The strategy tests' OpenCL fixture."""

import pytest


@pytest.fixture(scope="module")
def opencl():
    """The OpenCL device names (sub-devices included). Skip without an OpenCL platform, but
    fail under CI=true (CI installs PoCL)."""
    from keras_cct.devices import list_devices
    from tests.conftest import IN_CI
    names = [d.name for d in list_devices(calibrate=False, sub_devices=True) if d.is_opencl]
    if "opencl:0:0" not in names:
        if IN_CI:
            pytest.fail("no OpenCL device: ci/test installs PoCL (pocl-opencl-icd)")
        pytest.skip("no OpenCL platform on this machine (install pocl-opencl-icd)")
    return names
