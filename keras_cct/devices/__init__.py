"""Devices: discovery of the Keras backend's and OpenCL's devices, FLOPS calibration, and the
OpenCL kernels (:mod:`keras_cct.devices.opencl`) that run the lowered convolution.

* :func:`list_devices` -- the backend's devices (``"tf:cpu:0"``, ``"tf:gpu:0"``, ...) and every
  working OpenCL device (``"opencl:P:D"``; with ``sub_devices=True`` also the one-compute-unit
  sub-devices ``"opencl:P:D.S"`` of device fission), each a :class:`Device` with its kind,
  compute units, memory and measured SGEMM ``gflops``.
* :func:`calibrate` -- measure (or read from the on-disk cache) a device's GFLOP/s.
* :func:`get_device` -- one device by name; for OpenCL also sets its worker's environment
  (e.g. ``POCL_MAX_PTHREAD_COUNT``).

OpenCL runs in a worker process per device that never imports TensorFlow (PoCL's LLVM and
TensorFlow's clash in one process); arrays cross through shared memory. ``cct devices`` prints
the table.
"""

from keras_cct._files import cache_dir
from keras_cct.devices.registry import Device, calibrate, get_device, list_devices

__all__ = ["Device", "cache_dir", "calibrate", "get_device", "list_devices"]
