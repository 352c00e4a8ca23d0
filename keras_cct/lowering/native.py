"""The backend's own convolution ("native"), in the fastest form each backend offers: one
function per backend in :mod:`keras_cct.lowering._backend`, chosen once.

* **TensorFlow**: ``tf.nn.conv2d`` (oneDNN on x86 CPUs) with Caffe's explicit padding passed to
  the op (no padded copy). Grouped convolutions use the *split form*: one ``tf.split`` of the
  input and of the kernel, one convolution per group, one ``concat`` -- TensorFlow's own grouped
  ``Conv2D`` is not a oneDNN convolution on CPUs and trains 7-9x slower (CaffeNet conv2: 967 ms
  against 104 ms forward+backward at batch 32); ``tf.split`` is one op whose gradient is one
  ``concat``, where per-group slices cost a zero-filled scatter each in the backward.
  Depthwise convolutions (one input channel per group) use ``tf.nn.depthwise_conv2d``.
* **PyTorch**: ``torch.nn.functional.conv2d(groups=g)`` (oneDNN's grouped convolution) on the
  channels-last tensor viewed as NCHW: that view *is* PyTorch's ``channels_last`` memory
  format, so the input is not copied (``keras.ops.conv`` makes an NCHW copy and then a
  channels-last one) and the output comes back channels-last in place; the kernel is stored
  channels-last as well.
* **JAX**: ``lax.conv_general_dilated`` with NHWC/HWIO dimension numbers and explicit padding;
  grouped convolutions in the split form (XLA's CPU grouped convolution measured 5x slower on
  CaffeNet's grouped layers).
* Any other backend: ``keras.ops.conv`` (explicit padding as a pad).

Caffe allows strides together with dilation; TensorFlow does not: there it convolves at stride 1
and keeps every s-th output.
"""

from __future__ import annotations

from keras_cct.lowering import _backend as B
from keras_cct.lowering.geometry import ConvGeometry


def native_conv2d(x, kernel, geo: ConvGeometry, bias=None):
    """``x`` (b, h, w, c) convolved with ``kernel`` (kh, kw, c/groups, o) by the backend's op,
    plus ``bias`` (o,) if given."""
    return B.native_conv(B.as_tensor(x), B.as_tensor(kernel), geo,
                         None if bias is None else B.as_tensor(bias))
