"""The depthwise lowering: a convolution with one input channel per group (MobileNet's
depthwise layers, Caffe's ``group == num_output`` or the forks' ``ConvolutionDepthwise``) as
``kh * kw`` shifted multiply-adds.

Each output channel reads one input channel, so there is no GEMM to lower into: the output is
the sum, over the kernel's taps, of the input shifted by the tap's offset (a strided slice of
the padded input) times the tap's weights, one per channel:

    y[b, h, w, c] = sum_{i, j} xpad[b, s*h + d*i, s*w + d*j, c] * k[i, j, 0, c]

A channel multiplier ``m`` (``filters = m * channels``) repeats every input channel ``m`` times
first, as Caffe orders a group's outputs. The gradients are the same slices run backwards: the
input's is the sum of the shifted, kernel-weighted output gradient; the kernel's, for each
tap, the sum over batch and space of the shifted input times the output gradient.

Where it pays: on **JAX**, where XLA's CPU convolution with ``feature_group_count = channels``
runs far from the memory speed such a layer needs (MobileNet v1's depthwise layers at batch
16, forward+backward: 66-498 ms, against 0.6-9 ms for PyTorch's oneDNN kernel). There
:func:`keras_cct.lowering._backend.jax.depthwise_conv` fuses the forward's taps into one pass
(16-bit inputs converted to float32 once) and runs forward and backward through the batch in
cache-sized chunks of images (``lax.scan``), whose slices stay in cache: XLA's reductions over
the whole batch at once made one pass over memory per tap. TensorFlow (``tf.nn.depthwise_conv2d``) and PyTorch (oneDNN's
grouped convolution) have depthwise kernels of their own, which the planner keeps; the
``keras.ops`` form here (autodiff gradients) runs there too, for a user who asks for it.
"""

from __future__ import annotations

from keras_cct.lowering import _backend as B
from keras_cct.lowering.geometry import ConvGeometry


def depthwise_applies(geo: ConvGeometry) -> bool:
    """Whether ``geo`` has one input channel per group (a depthwise convolution, with any
    channel multiplier, stride, dilation and padding)."""
    return geo.cg == 1 and geo.filters % geo.channels == 0


def depthwise_conv2d(x, kernel, geo: ConvGeometry):
    """Depthwise convolution of channels-last ``x`` (b, h, w, c) by ``kernel`` (kh, kw, 1,
    m * c) as shifted multiply-adds (no bias), in the backend's form
    (:func:`keras_cct.lowering._backend.generic.depthwise_conv`)."""
    return B.depthwise_conv(B.as_tensor(x), B.as_tensor(kernel), geo)
