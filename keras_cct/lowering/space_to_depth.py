"""The space-to-depth lowering of a strided convolution (for a network's first layer).

A convolution at stride ``s`` reads every ``s``-th position. Cutting the padded input into
``s x s`` blocks and stacking each block's pixels on the channel axis (space to depth) turns it
into a convolution at stride 1 with ``ceil(k / s)`` taps per axis and ``s*s`` times the
channels; the kernel is zero-padded to a multiple of ``s`` taps and rearranged the same way:

    x (b, s*H', s*W', c)    -> (b, H', W', s*s*c)
    w (k, k, c, o)          -> (ceil(k/s), ceil(k/s), s*s*c, o)

CaffeNet's conv1 (3 channels, 11x11, stride 4) becomes a 3x3, stride 1 convolution on 48
channels: (12/11)^2 = 1.19x the multiplications, but a shape that GEMM-based and direct
convolutions run at full speed, where 3 input channels at stride 4 leave most of the vector
lanes idle. The rearrangements are a pad, reshapes and one transpose of the input (20 MB at
CaffeNet's batch 32) and of the kernel, so the gradients are autodiff's; in a network the
first layer's input gradient is never asked for, and no backend computes it.

:func:`space_to_depth_applies` limits it to ungrouped, undilated, strided convolutions whose
zero-padded kernel does at most :data:`MAX_EXTRA_WORK` times the multiplications; the planner
times it against the backend's own convolution.
"""

from __future__ import annotations

import math

from keras import ops

from keras_cct.lowering.geometry import ConvGeometry, conv_geometry
from keras_cct.lowering.native import native_conv2d

#: Largest ratio of multiplications (zero-padded kernel over the real one) worth trying.
MAX_EXTRA_WORK = 1.4


def _blocks(geo: ConvGeometry):
    """Taps per axis of the rearranged kernel."""
    return math.ceil(geo.kh / geo.sh), math.ceil(geo.kw / geo.sw)


def space_to_depth_applies(geo: ConvGeometry) -> bool:
    """Whether the space-to-depth lowering can (and may usefully) compute ``geo``."""
    if geo.groups != 1 or geo.dh != 1 or geo.dw != 1 or max(geo.sh, geo.sw) == 1:
        return False
    th, tw = _blocks(geo)
    return (th * geo.sh * tw * geo.sw) / (geo.kh * geo.kw) <= MAX_EXTRA_WORK


def space_to_depth_conv2d(x, kernel, geo: ConvGeometry):
    """Convolution of channels-last ``x`` by ``kernel`` (kh, kw, c, o) as a stride-1
    convolution of the space-to-depth rearranged input (no bias)."""
    sh, sw = geo.sh, geo.sw
    th, tw = _blocks(geo)
    hs, ws = geo.out_h + th - 1, geo.out_w + tw - 1  # rearranged input size
    (pt, pb), (pl, pr) = geo.pad
    # Pad (or crop: rows past the last window are never read) to exactly hs*sh x ws*sw.
    pb, pr = hs * sh - geo.in_h - pt, ws * sw - geo.in_w - pl
    x = ops.pad(x, [[0, 0], [pt, max(pb, 0)], [pl, max(pr, 0)], [0, 0]])
    x = x[:, :hs * sh, :ws * sw, :]
    c, o = geo.channels, geo.filters
    x = ops.reshape(x, (-1, hs, sh, ws, sw, c))
    x = ops.reshape(ops.transpose(x, (0, 1, 3, 2, 4, 5)), (-1, hs, ws, sh * sw * c))
    k = ops.pad(kernel, [[0, th * sh - geo.kh], [0, tw * sw - geo.kw], [0, 0], [0, 0]])
    k = ops.reshape(k, (th, sh, tw, sw, c, o))
    k = ops.reshape(ops.transpose(k, (0, 2, 1, 3, 4, 5)), (th, tw, sh * sw * c, o))
    inner = conv_geometry((geo.batch, hs, ws, sh * sw * c), (th, tw, sh * sw * c, o))
    return native_conv2d(x, k, inner)
