"""The host callback of :class:`~.python_layer.CaffePythonLayer` for each Keras backend, in the
pattern of :mod:`keras_cct.ops.conv`: TensorFlow's ``tf.numpy_function`` inside
``tf.custom_gradient``, JAX's ``jax.pure_callback`` inside ``jax.custom_vjp``, a
``torch.autograd.Function`` on PyTorch. The forward callback returns the tops, the backward one
the bottoms' and the blobs' diffs (float32, Caffe's order)."""

from __future__ import annotations

import functools

import keras
import numpy as np

__all__ = ["call"]


def call(layer, args, n_bottom: int):
    """The layer's tops for ``args`` (the bottoms, then the blobs' values; Caffe order)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return _tf_call(layer, args, n_bottom)
    if backend == "jax":
        return list(_jax_op(layer, n_bottom, len(args))(*args))
    if backend == "torch":
        return list(_torch_function().apply(layer, n_bottom, *args))
    raise NotImplementedError(f"Caffe Python layers do not support the {backend!r} backend "
                              "(use tensorflow, jax or torch)")


# -- TensorFlow -------------------------------------------------------------------------------
def _tf_call(layer, args, n_bottom: int):
    import tensorflow as tf
    args = [tf.convert_to_tensor(a) for a in args]
    top_shapes = layer.static_top_shapes(args[:n_bottom])
    n_top = len(top_shapes)

    @tf.custom_gradient
    def op(*a):
        outs = tf.numpy_function(layer._forward_np(n_bottom), list(a), [tf.float32] * n_top,
                                 stateful=True, name="caffe_python_layer")
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for o, s in zip(outs, top_shapes, strict=True):
            o.set_shape(s)

        def grad(*dys):
            dys = [tf.zeros_like(o) if d is None else d for o, d in zip(outs, dys, strict=True)]
            gs = tf.numpy_function(layer._backward_np(n_bottom, len(a)), list(a) + dys,
                                   [tf.float32] * len(a), stateful=True,
                                   name="caffe_python_layer_grad")
            gs = list(gs) if isinstance(gs, (list, tuple)) else [gs]
            for g, src in zip(gs, a, strict=True):
                g.set_shape(src.shape)
            return list(gs)

        return outs, grad

    out = op(*args)
    return list(out) if isinstance(out, (list, tuple)) else [out]


# -- JAX --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _jax_op(layer, n_bottom: int, n_args: int):
    import jax

    @jax.custom_vjp
    def op(*a):
        shapes = layer.static_top_shapes(a[:n_bottom])
        structs = tuple(jax.ShapeDtypeStruct(s, np.float32) for s in shapes)
        return jax.pure_callback(layer._forward_np(n_bottom), structs, *a)

    def fwd(*a):
        return op(*a), a

    def bwd(res, dys):
        structs = tuple(jax.ShapeDtypeStruct(x.shape, np.float32) for x in res)
        return tuple(jax.pure_callback(layer._backward_np(n_bottom, n_args), structs,
                                       *res, *dys))

    op.defvjp(fwd, bwd)
    return op


# -- PyTorch ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _torch_function():
    import torch

    class CaffePythonFunction(torch.autograd.Function):
        """A Caffe Python layer for PyTorch: forward and backward run the object's methods."""

        @staticmethod
        def forward(ctx, layer, n_bottom, *args):  # noqa: D401
            ctx.layer, ctx.n_bottom = layer, n_bottom
            ctx.save_for_backward(*args)
            arrays = [a.detach().cpu().numpy() for a in args]
            device = args[0].device
            return tuple(torch.from_numpy(o).to(device)
                         for o in layer._forward_np(n_bottom)(*arrays))

        @staticmethod
        def backward(ctx, *dys):
            args = ctx.saved_tensors
            arrays = [a.detach().cpu().numpy() for a in args]
            dys = [d.detach().contiguous().cpu().numpy() for d in dys]  # zeros if unused
            grads = ctx.layer._backward_np(ctx.n_bottom, len(args))(*arrays, *dys)
            device = args[0].device
            return (None, None) + tuple(torch.from_numpy(np.ascontiguousarray(g)).to(device)
                                        for g in grads)

    return CaffePythonFunction
