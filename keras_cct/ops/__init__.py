"""Differentiable operations that cross to other devices.

* :func:`conv2d_on` -- a channels-last convolution whose forward and backward passes run on an
  OpenCL device (in its worker process), usable inside Keras models on the TensorFlow, JAX and
  PyTorch backends.
"""

from keras_cct.ops.conv import conv2d_on

__all__ = ["conv2d_on"]
