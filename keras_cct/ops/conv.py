"""``conv2d_on``: a differentiable convolution computed on another device (an OpenCL worker).

The forward and backward passes run in the device's worker process on numpy arrays
(:mod:`keras_cct.devices.opencl.conv`); this module wraps them for each Keras backend:

* TensorFlow: ``tf.numpy_function(..., stateful=False)`` inside ``tf.custom_gradient``
  (``stateful=False`` lets two such ops -- or one and a TF op -- run at the same time);
* JAX: ``jax.pure_callback`` inside ``jax.custom_vjp`` (works under ``jax.jit``);
* PyTorch: a ``torch.autograd.Function``.

None of them can be compiled by XLA: a layer that uses this op reports ``supports_jit = False``.

A device failure (:class:`~keras_cct.errors.DeviceError`: a dead worker that did not come back,
a missed deadline) reaches the caller as itself, not as the backend's error for a failed
callback: see :mod:`keras_cct.ops.failures`.
"""

from __future__ import annotations

import functools
import numpy as np

from keras_cct.errors import DeviceError, KerasCCTError, LoweringError
from keras_cct.lowering.geometry import PaddingArg, conv_geometry
from keras_cct.ops import failures


def _canon(value):
    """Hashable form of strides / padding / dilation arguments."""
    if isinstance(value, (list, tuple)):
        return tuple(_canon(v) for v in value)
    return value


def _dtype_name(t) -> str:
    d = getattr(t, "dtype", None)
    if d is None:
        return np.asarray(t).dtype.name
    name = getattr(d, "name", None) or str(d)
    return str(name).replace("torch.", "")


def conv2d_on(device: str, x, kernel, bias=None, *, strides=1, padding: PaddingArg = "valid",
              dilation_rate=1, groups: int = 1, lowering: str = "auto"):
    """Channels-last 2-D convolution computed on ``device``, differentiable on every backend.

    Args:
        device: an OpenCL device name, ``"opencl:P:D"`` or ``"opencl:P:D.S"``
            (see :func:`keras_cct.devices.list_devices`).
        x: ``(batch, height, width, channels)`` float32 tensor of the current Keras backend.
        kernel: ``(kh, kw, channels // groups, filters)`` float32 (``keras.layers.Conv2D``'s
            layout).
        bias: ``(filters,)`` float32 or None.
        strides, dilation_rate: int or ``(h, w)``.
        padding: ``"valid"``, ``"same"``, int, ``(pad_h, pad_w)`` or
            ``((top, bottom), (left, right))``.
        groups: channel groups.
        lowering: ``"auto"``, ``"type1"`` (im2col), ``"type2"`` (lowered along the height) or
            ``"type3"`` (shift-and-add).

    Returns:
        ``(batch, out_h, out_w, filters)`` float32 tensor; its gradients with respect to ``x``,
        ``kernel`` and ``bias`` are computed on the same device.

    Raises:
        DeviceError: ``device`` is not an OpenCL device, or a dtype is not float32; or the
            device failed (:class:`~keras_cct.errors.WorkerError`,
            :class:`~keras_cct.errors.DeviceTimeoutError` after ``KERAS_CCT_DEVICE_TIMEOUT``
            seconds), also inside ``fit`` (see :mod:`keras_cct.ops.failures`).
        LoweringError: inconsistent shapes or arguments (checked before anything runs).
    """
    from keras_cct.devices.opencl.client import parse_opencl_name
    parse_opencl_name(device)
    for name, t in (("x", x), ("kernel", kernel), ("bias", bias)):
        if t is not None and _dtype_name(t) != "float32":
            raise DeviceError(
                f"conv2d_on({device!r}): the OpenCL kernels take float32 only; `{name}` is "
                f"{_dtype_name(t)} (use a float32 dtype policy or cast it)")
    x_shape = tuple(None if d is None else int(d) for d in x.shape)
    k_shape = tuple(int(d) for d in kernel.shape)
    geom = conv_geometry(x_shape, k_shape, strides=strides, padding=padding,
                         dilation_rate=dilation_rate, groups=groups)
    from keras_cct.devices.opencl.conv import LOWERINGS
    if lowering not in ("auto",) + LOWERINGS:
        raise LoweringError(f"`lowering`={lowering!r} is not available on OpenCL devices; use "
                            f"'auto' or one of {LOWERINGS}")
    if bias is not None and tuple(int(d) for d in bias.shape) != (geom.filters,):
        raise LoweringError(f"`bias` must have shape ({geom.filters},), got {tuple(bias.shape)}")
    import keras
    x = keras.ops.convert_to_tensor(x)
    kernel = keras.ops.convert_to_tensor(kernel)
    if bias is not None:
        bias = keras.ops.convert_to_tensor(bias)
    cfg = (device, _canon(strides), _canon(padding), _canon(dilation_rate), int(groups),
           str(lowering))
    backend = keras.backend.backend()
    failures.install_keras_hook()
    if backend == "tensorflow":
        return failures.call_typed(_tf_conv, cfg, x, kernel, bias, geom)
    if backend == "jax":
        return failures.call_typed(_jax_op(cfg, bias is not None), x, kernel,
                                   *(() if bias is None else (bias,)))
    if backend == "torch":
        return _TorchConv.apply(x, kernel, bias, cfg)
    raise DeviceError(f"conv2d_on does not support the {backend!r} Keras backend "
                      "(use tensorflow, jax or torch)")


def _kwargs(cfg):
    _, strides, padding, dilation, groups, lowering = cfg
    return dict(strides=strides, padding=padding, dilation_rate=dilation, groups=groups,
                lowering=lowering)


def _np_forward(cfg, x, k, b=None):
    from keras_cct.devices.opencl.conv import conv2d_forward
    try:
        return conv2d_forward(cfg[0], np.asarray(x), np.asarray(k),
                              None if b is None else np.asarray(b), **_kwargs(cfg))
    except KerasCCTError as exc:  # the backend hides it in its own error: keep it for the caller
        raise failures.remember(exc)


def _np_backward(cfg, with_bias, x, k, dy):
    from keras_cct.devices.opencl.conv import conv2d_backward
    try:
        dx, dk, db = conv2d_backward(cfg[0], np.asarray(x), np.asarray(k), np.asarray(dy),
                                     with_bias=with_bias, **_kwargs(cfg))
    except KerasCCTError as exc:
        raise failures.remember(exc)
    return (dx, dk, db) if with_bias else (dx, dk)


# -- TensorFlow -----------------------------------------------------------------------------------
def _tf_conv(cfg, x, kernel, bias, geom):
    import tensorflow as tf
    x = tf.convert_to_tensor(x)
    kernel = tf.convert_to_tensor(kernel)
    with_bias = bias is not None
    out_static = [x.shape[0], geom.out_h, geom.out_w, geom.filters]

    def forward(*args):
        return _np_forward(cfg, *args)

    def backward(x_, k_, dy_):
        return _np_backward(cfg, with_bias, x_, k_, dy_)

    @tf.custom_gradient
    def op(*args):
        y = tf.numpy_function(forward, list(args), tf.float32, stateful=False,
                              name="cct_opencl_conv2d")
        y.set_shape(out_static)

        def grad(dy):
            outs = failures.call_typed(  # eager (a GradientTape): raises here
                tf.numpy_function, backward, [args[0], args[1], dy],
                [tf.float32] * (3 if with_bias else 2), stateful=False,
                name="cct_opencl_conv2d_grad")
            for t, src in zip(outs, args):
                t.set_shape(src.shape)
            return list(outs)

        return y, grad

    if with_bias:
        return op(x, kernel, tf.convert_to_tensor(bias))
    return op(x, kernel)


# -- JAX ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _jax_op(cfg, with_bias):
    import jax

    def out_struct(x, k):
        geom = conv_geometry(x.shape, k.shape, strides=cfg[1], padding=cfg[2],
                             dilation_rate=cfg[3], groups=cfg[4])
        return jax.ShapeDtypeStruct((x.shape[0], geom.out_h, geom.out_w, geom.filters),
                                    np.float32)

    @jax.custom_vjp
    def op(x, k, *b):
        return jax.pure_callback(lambda *a: _np_forward(cfg, *a), out_struct(x, k), x, k, *b)

    def fwd(x, k, *b):
        return op(x, k, *b), (x, k)

    def bwd(res, dy):
        x, k = res
        shapes = [jax.ShapeDtypeStruct(x.shape, np.float32),
                  jax.ShapeDtypeStruct(k.shape, np.float32)]
        if with_bias:
            shapes.append(jax.ShapeDtypeStruct((k.shape[-1],), np.float32))
        return tuple(jax.pure_callback(
            lambda x_, k_, dy_: _np_backward(cfg, with_bias, x_, k_, dy_), tuple(shapes),
            x, k, dy))

    op.defvjp(fwd, bwd)
    return op


# -- PyTorch --------------------------------------------------------------------------------------
def _torch_function():
    import torch

    class TorchConv(torch.autograd.Function):
        """conv2d_on for PyTorch: the forward and backward run on the OpenCL device."""

        @staticmethod
        def forward(ctx, x, kernel, bias, cfg):  # noqa: D401
            ctx.cfg = cfg
            ctx.with_bias = bias is not None
            ctx.save_for_backward(x, kernel)
            y = _np_forward(cfg, x.detach().cpu().numpy(), kernel.detach().cpu().numpy(),
                            None if bias is None else bias.detach().cpu().numpy())
            return torch.from_numpy(y).to(x.device)

        @staticmethod
        def backward(ctx, dy):
            x, kernel = ctx.saved_tensors
            grads = _np_backward(ctx.cfg, ctx.with_bias, x.detach().cpu().numpy(),
                                 kernel.detach().cpu().numpy(),
                                 dy.detach().contiguous().cpu().numpy())
            out = [torch.from_numpy(np.ascontiguousarray(g)).to(x.device) for g in grads]
            if not ctx.with_bias:
                out.append(None)
            return out[0], out[1], out[2], None

    return TorchConv


class _LazyTorch:
    _fn = None

    def apply(self, *args):
        if _LazyTorch._fn is None:
            _LazyTorch._fn = _torch_function()
        return _LazyTorch._fn.apply(*args)


_TorchConv = _LazyTorch()

__all__ = ["conv2d_on"]
