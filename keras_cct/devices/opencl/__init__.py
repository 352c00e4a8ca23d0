"""OpenCL kernels for the lowered convolution, run in a worker process that never imports
TensorFlow (PoCL's LLVM and TensorFlow's clash in one process).

* ``kernels.cl`` -- register-blocked SGEMM, im2col / col2im (Type 1), shift-and-add lifting and
  its inverse (Type 3), bias gradient.
* :mod:`.worker` -- the child process (a script: numpy + pyopencl only).
* :mod:`.client` -- starts, restarts and talks to workers; arrays cross in shared memory.
* :mod:`.conv` -- :func:`conv2d_forward`, :func:`conv2d_backward`, :func:`sgemm` on numpy arrays.
"""

from keras_cct.devices.opencl.client import WorkerClient, client_for, stop_all
from keras_cct.devices.opencl.conv import conv2d_backward, conv2d_forward, sgemm

__all__ = ["WorkerClient", "client_for", "conv2d_backward", "conv2d_forward", "sgemm",
           "stop_all"]
