"""Batch normalization without the affine part, in the fastest form each backend offers.

One function per backend, chosen once (as :mod:`keras_cct.lowering.native` does), behind
:func:`normalize_batch` (training: the batch's own statistics) and :func:`normalize_with`
(given statistics):

* **TensorFlow**: ``FusedBatchNormV3`` (oneDNN on x86 CPUs), one op forward and one backward,
  where the composed form (mean, variance, subtract, divide) is five passes each way: Caffe's
  BatchNorm + Scale + ReLU on a 16x56x56x256 blob trained 2.3x faster so (91.6 -> 39.3 ms
  forward+backward, interleaved, on a busy 2-core machine).
* **PyTorch**: ``torch.nn.functional.batch_norm`` on the channels-last tensor viewed as NCHW
  (no copy); the batch statistics come back through zeroed running buffers at momentum 1.
* **JAX** (and any other backend): ``keras.ops``; XLA fuses the elementwise passes itself.

Both take an optional per-channel affine part (``scale``, ``offset``: Caffe's Scale layer after
its BatchNorm, see :mod:`keras_cct.caffe.net.fusion`), which the fused ops apply in the same
pass: on TensorFlow a separate Scale layer (a multiply and an add, and their gradients) made
BatchNorm + Scale + ReLU 2.5x slower under ``mixed_bfloat16`` (16x56x56x256: 70.3 -> 27.6 ms
forward+backward) and 1.8x in float32 (87.1 -> 47.2 ms).

Every form returns the batch mean and the *unbiased* batch variance (``m / (m - 1)`` times the
biased one that normalizes, 0 for a single value), which is what Caffe adds to its blobs.
"""

from __future__ import annotations

import functools

import keras
from keras import ops


def normalize_batch(x, eps: float, scale=None, offset=None):
    """``(x - mean) / sqrt(var + eps)`` over every axis but the last, with the batch's mean and
    biased variance, then ``* scale + offset`` per channel where given; returns
    ``(y, mean, unbiased_var)`` (statistics in float32, no gradient)."""
    return _implementation()[0](x, float(eps), scale, offset)


def normalize_with(x, mean, var, eps: float, scale=None, offset=None):
    """``(x - mean) / sqrt(var + eps)`` for given per-channel statistics, then
    ``* scale + offset`` where given."""
    return _implementation()[1](x, mean, var, float(eps), scale, offset)


@functools.lru_cache(maxsize=None)
def _implementation():
    return {"tensorflow": (_tf_batch, _tf_with), "torch": (_torch_batch, _torch_with)}.get(
        keras.backend.backend(), (_ops_batch, _ops_with))


def _count(x):
    """Values per channel, as a float32 scalar tensor (the batch may be unknown)."""
    return ops.cast(ops.size(x) // int(x.shape[-1]), "float32")


def _unbiased_or_zero(var, m):
    return ops.where(m > 1, var, ops.zeros_like(var))


def _affine(c, scale, offset):
    """``(scale, offset)`` as float32 vectors of ``c`` values (ones / zeros where absent)."""
    scale = ops.ones((c,), "float32") if scale is None else ops.cast(scale, "float32")
    offset = ops.zeros((c,), "float32") if offset is None else ops.cast(offset, "float32")
    return scale, offset


# ------------------------------------------------------------------------------ TensorFlow

def _tf_batch(x, eps, scale=None, offset=None):
    import tensorflow as tf
    if len(x.shape) != 4:  # FusedBatchNormV3 takes 4-D blobs only
        return _ops_batch(x, eps, scale, offset)
    y, mean, var = tf.compat.v1.nn.fused_batch_norm(
        x, *_affine(int(x.shape[-1]), scale, offset), epsilon=eps, is_training=True)
    # FusedBatchNormV3 already answers the unbiased variance (NaN for one value per channel).
    stats = tf.stop_gradient(mean), tf.stop_gradient(_unbiased_or_zero(var, _count(x)))
    return (y,) + stats


def _tf_with(x, mean, var, eps, scale=None, offset=None):
    import tensorflow as tf
    if len(x.shape) != 4:
        return _ops_with(x, mean, var, eps, scale, offset)
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(
        x, *_affine(int(x.shape[-1]), scale, offset), tf.cast(mean, tf.float32),
        tf.cast(var, tf.float32), epsilon=eps, is_training=False)
    return y


# ------------------------------------------------------------------------------ PyTorch

def _torch_batch(x, eps, scale=None, offset=None):
    import torch
    import torch.nn.functional as F
    c = int(x.shape[-1])
    if x.numel() <= c:  # F.batch_norm refuses one value per channel; Caffe answers 0
        return _ops_batch(x, eps, scale, offset)
    mean = torch.zeros(c, dtype=torch.float32, device=x.device)
    var = torch.zeros(c, dtype=torch.float32, device=x.device)
    # momentum 1: the running buffers become the batch mean and the unbiased batch variance.
    y = F.batch_norm(x.permute(0, 3, 1, 2) if x.ndim == 4 else x.reshape(-1, c), mean, var,
                     *_torch_affine(scale, offset), True, 1.0, eps)
    y = y.permute(0, 2, 3, 1) if x.ndim == 4 else y.reshape(x.shape)
    return y, mean, _unbiased_or_zero(var, _count(x))


def _torch_with(x, mean, var, eps, scale=None, offset=None):
    import torch.nn.functional as F
    c = int(x.shape[-1])
    mean, var = (ops.cast(v, "float32") for v in (mean, var))
    affine = _torch_affine(scale, offset)
    if x.ndim == 4:
        return F.batch_norm(x.permute(0, 3, 1, 2), mean, var, *affine, False, 0.0,
                            eps).permute(0, 2, 3, 1)
    return F.batch_norm(x.reshape(-1, c), mean, var, *affine, False, 0.0,
                        eps).reshape(x.shape)


def _torch_affine(scale, offset):
    """F.batch_norm's ``(weight, bias)`` in float32 (None where absent)."""
    return tuple(None if v is None else ops.cast(v, "float32") for v in (scale, offset))


# ------------------------------------------------------------------------------ any other

def _ops_batch(x, eps, scale=None, offset=None):
    axes = list(range(len(x.shape) - 1))
    xf = ops.cast(x, "float32")
    mean = ops.mean(xf, axis=axes)
    var = ops.mean(ops.square(xf - mean), axis=axes)
    y = ops.cast(_ops_affine((xf - mean) / ops.sqrt(var + eps), scale, offset), x.dtype)
    m = _count(x)
    unbiased = var * m / ops.maximum(m - 1, 1.0)
    return y, ops.stop_gradient(mean), ops.stop_gradient(_unbiased_or_zero(unbiased, m))


def _ops_with(x, mean, var, eps, scale=None, offset=None):
    y = (ops.cast(x, "float32") - mean) / ops.sqrt(var + eps)
    return ops.cast(_ops_affine(y, scale, offset), x.dtype)


def _ops_affine(y, scale, offset):
    if scale is not None:
        y = y * ops.cast(scale, "float32")
    return y if offset is None else y + ops.cast(offset, "float32")
