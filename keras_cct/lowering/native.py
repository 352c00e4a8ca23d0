"""The backend's own convolution ("native"), in the fastest form each backend offers.

One function per backend, chosen once (as ``keras/src/backend/*`` does), behind
:func:`native_conv2d`:

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

Caffe allows strides together with dilation; TensorFlow does not: there it convolves at stride 1
and keeps every s-th output.
"""

from __future__ import annotations

import functools

import keras
from keras import ops

from keras_cct.lowering import _backend as B
from keras_cct.lowering.geometry import ConvGeometry

#: More groups than this (other than depthwise) use the backend's grouped convolution.
MAX_SPLIT_GROUPS = 16


def native_conv2d(x, kernel, geo: ConvGeometry):
    """``x`` (b, h, w, c) convolved with ``kernel`` (kh, kw, c/groups, o) by the backend's op."""
    return _implementation()(B.as_tensor(x), B.as_tensor(kernel), geo)


@functools.lru_cache(maxsize=None)
def _implementation():
    return {"tensorflow": _tf_conv, "torch": _torch_conv, "jax": _jax_conv}.get(
        keras.backend.backend(), _keras_conv)


def _split_groups(geo: ConvGeometry) -> bool:
    return 1 < geo.groups <= MAX_SPLIT_GROUPS and geo.cg > 1


# ------------------------------------------------------------------------------ TensorFlow

def _tf_conv(x, kernel, geo: ConvGeometry):
    import tensorflow as tf
    strides, dilation = (geo.sh, geo.sw), (geo.dh, geo.dw)
    subsample = max(strides) > 1 and max(dilation) > 1
    if subsample:
        strides = (1, 1)
    padding = geo.keras_padding
    padding = padding.upper() if padding else [[0, 0], list(geo.pad[0]), list(geo.pad[1]),
                                               [0, 0]]
    if geo.cg == 1 and geo.groups > 1:
        if not isinstance(padding, str):  # depthwise_conv2d has no explicit padding
            x, padding = tf.pad(x, padding), "VALID"
        k = tf.reshape(kernel, (geo.kh, geo.kw, geo.channels, geo.og))
        y = tf.nn.depthwise_conv2d(x, k, (1,) + strides + (1,), padding, dilations=dilation)
    else:
        if max(dilation) > 1:
            # TF's CPU Conv2D has no dilated gradient; tf.nn.convolution dilates by
            # space_to_batch, and takes no explicit padding.
            if not isinstance(padding, str):
                x, padding = tf.pad(x, padding), "VALID"

            def conv(inp, k):
                return tf.nn.convolution(inp, k, strides, padding, dilations=dilation)
        else:
            def conv(inp, k):
                return tf.nn.conv2d(inp, k, strides, padding)

        if _split_groups(geo):
            xs = tf.split(x, geo.groups, axis=-1)
            ks = tf.split(kernel, geo.groups, axis=-1)
            y = tf.concat([conv(a, b) for a, b in zip(xs, ks)], axis=-1)
        else:
            y = conv(x, kernel)
    if subsample:
        y = y[:, ::geo.sh, ::geo.sw, :]
    return y


# ------------------------------------------------------------------------------ PyTorch

def _torch_conv(x, kernel, geo: ConvGeometry):
    import torch
    import torch.nn.functional as F
    xc = x.permute(0, 3, 1, 2)  # the NHWC tensor seen as NCHW: channels_last memory format
    (pt, pb), (pl, pr) = geo.pad
    if pt == pb and pl == pr:
        padding = (pt, pl)
    else:
        xc, padding = F.pad(xc, (pl, pr, pt, pb)), (0, 0)
    # (kh, kw, cg, o) -> (o, cg, kh, kw), stored channels-last (o, kh, kw, cg) as keras.ops.conv
    # does: oneDNN reorders that layout to its own fast; the bare permuted view trained 3-10%
    # slower on two wide layers (7x7x512 -> 512 and -> 2048, batch 32, a busy machine).
    w = kernel.permute(3, 2, 0, 1).contiguous(memory_format=torch.channels_last)
    y = F.conv2d(xc, w, None, (geo.sh, geo.sw), padding, (geo.dh, geo.dw), geo.groups)
    return y.permute(0, 2, 3, 1)


# ------------------------------------------------------------------------------ JAX

def _jax_conv(x, kernel, geo: ConvGeometry):
    from jax import lax
    import jax.numpy as jnp

    def conv(inp, k, groups=1):
        return lax.conv_general_dilated(
            inp, k, (geo.sh, geo.sw), [tuple(geo.pad[0]), tuple(geo.pad[1])],
            rhs_dilation=(geo.dh, geo.dw), dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups)

    if _split_groups(geo):
        xs = jnp.split(x, geo.groups, axis=-1)
        ks = jnp.split(kernel, geo.groups, axis=-1)
        return jnp.concatenate([conv(a, b) for a, b in zip(xs, ks)], axis=-1)
    return conv(x, kernel, geo.groups)


# ------------------------------------------------------------------------------ any other

def _keras_conv(x, kernel, geo: ConvGeometry):
    """``keras.ops`` only, for a backend without a function of its own."""
    padding = geo.keras_padding
    if padding is None:
        (pt, pb), (pl, pr) = geo.pad
        x = ops.pad(x, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
        padding = "valid"
    return ops.conv(x, kernel, strides=(geo.sh, geo.sw), padding=padding,
                    dilation_rate=(geo.dh, geo.dw))
