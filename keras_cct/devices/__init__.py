"""Devices: discovery of the Keras backend's and OpenCL's devices, FLOPS calibration, and the
OpenCL kernels (:mod:`keras_cct.devices.opencl`) that run the lowered convolution."""
