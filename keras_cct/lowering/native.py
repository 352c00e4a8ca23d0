"""The backend's own convolution ("native"), as the baseline every lowering is measured against.

For ``groups > 1`` it uses the *split form*: one convolution per group, concatenated. Measured
on TensorFlow's CPU build, ``Conv2D(groups=2)`` is not a oneDNN convolution (it runs as many small
GEMMs) and trains 7-9x slower than the split form. Depthwise convolutions (one input channel per
group) use the backend's depthwise kernel; more than :data:`MAX_SPLIT_GROUPS` other groups use
the backend's grouped convolution.
"""

from __future__ import annotations

from keras import ops

from keras_cct.lowering.geometry import ConvGeometry

MAX_SPLIT_GROUPS = 16


def native_conv2d(x, kernel, geo: ConvGeometry):
    """``x`` (b, h, w, c) convolved with ``kernel`` (kh, kw, c/groups, o) by the backend's op."""
    strides = (geo.sh, geo.sw)
    dilation = (geo.dh, geo.dw)
    subsample = None
    if max(strides) > 1 and max(dilation) > 1:
        # Backends reject stride > 1 together with dilation > 1 (Caffe allows it): convolve at
        # stride 1 and keep every s-th output.
        subsample, strides = strides, (1, 1)
    # The backend pads inside its convolution when its own mode gives the same padding (no
    # padded copy of the input, no slicing of its gradient); otherwise pad explicitly.
    padding = geo.keras_padding if subsample is None else None
    if padding is None:
        (pt, pb), (pl, pr) = geo.pad
        x = ops.pad(x, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
        padding = "valid"

    def conv(inp, k):
        return ops.conv(inp, k, strides=strides, padding=padding, dilation_rate=dilation)

    if geo.groups == 1:
        y = conv(x, kernel)
    elif geo.cg == 1:
        k = ops.reshape(kernel, (geo.kh, geo.kw, geo.channels, geo.og))
        y = ops.depthwise_conv(x, k, strides=strides, padding=padding, dilation_rate=dilation)
    elif geo.groups <= MAX_SPLIT_GROUPS:
        cg, og = geo.cg, geo.og
        y = ops.concatenate(
            [conv(x[..., g * cg:(g + 1) * cg], kernel[..., g * og:(g + 1) * og])
             for g in range(geo.groups)], axis=-1)
    else:
        y = conv(x, kernel)
    if subsample is not None:
        y = y[:, ::subsample[0], ::subsample[1], :]
    return y
