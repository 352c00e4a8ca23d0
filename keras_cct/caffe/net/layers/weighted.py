"""Caffe's weighted layers besides Convolution (a HybridConv2D): :class:`CaffeInnerProduct`
(Caffe's C-major flatten order, ``axis``, ``transpose``) and :class:`CaffeDeconvolution`."""

from __future__ import annotations


import keras
from keras import ops

from keras_cct.caffe.net.layout import caffe_shape, from_caffe_layout, keras_shape
from keras_cct.caffe.net.layout import pair as _pair
from keras_cct.caffe.net.layout import to_caffe_layout
from keras_cct.lowering import _backend
from keras_cct.lowering.precision import arithmetic_dtype

_PKG = "keras_cct"

__all__ = ["CaffeInnerProduct", "CaffeDeconvolution"]


# --------------------------------------------------------------------------------------------
# InnerProduct, Deconvolution


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeInnerProduct(keras.layers.Layer):
    """Caffe's InnerProduct: flattens Caffe axes ``[axis, end)`` in Caffe's (C-major) order,
    then ``y = x W^T + b``.

    Variables: ``kernel`` of shape ``(num_output, K)``, exactly Caffe's weight blob (so that
    importing a 240 MB caffemodel needs no transposition; a ``transpose: true`` blob is
    transposed once at import) and ``bias``. Under a 16-bit policy the product is computed in
    float32 where this machine computes 16-bit ones slower, as HybridConv2D does
    (:func:`~keras_cct.lowering.precision.arithmetic_dtype`).
    """

    def __init__(self, num_output: int, axis: int = 1, bias_term: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_output = int(num_output)
        self.axis = int(axis)
        self.bias_term = bool(bias_term)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def _split(self, shape):
        cshape = caffe_shape(shape)
        rank = len(cshape)
        a = self.axis + rank if self.axis < 0 else self.axis
        if not 0 < a < rank:
            raise ValueError(f"InnerProduct '{self.name}': axis {self.axis} invalid for a "
                             f"{rank}-D input")
        k = 1
        for d in cshape[a:]:
            if d is None:
                raise ValueError(f"InnerProduct '{self.name}' needs known input dims, got "
                                 f"{tuple(shape)}")
            k *= int(d)
        return cshape, a, k

    def build(self, input_shape):
        _, _, k = self._split(input_shape)
        # not cast by Keras' autocast: call casts it, to the 16-bit dtype or not at all (a cast
        # of fc6's 38M values, to bfloat16 and back, took 100 ms on an AVX2-only CPU)
        self.kernel = self.add_weight(name="kernel", shape=(self.num_output, k),
                                      initializer=self.kernel_initializer, autocast=False)
        if self.bias_term:
            self.bias = self.add_weight(name="bias", shape=(self.num_output,),
                                        initializer=self.bias_initializer)

    def compute_output_shape(self, input_shape):
        cshape, a, _ = self._split(input_shape)
        return keras_shape(tuple(cshape[:a]) + (self.num_output,))

    def call(self, x):
        cshape, a, k = self._split(x.shape)
        lead = [int(d) for d in cshape[1:a]]
        # Caffe's flatten order: a transpose of the (N, H, W, C) input to (N, C, H, W) (for
        # CaffeNet's fc6 at batch 32, 0.3 M values: well under 1% of the layer), then rows of K.
        x2 = ops.reshape(to_caffe_layout(x), (-1, k))
        # x @ kernel^T with the transpose as a matmul flag: on TensorFlow, ops.transpose of the
        # (O, K) kernel copies it in the forward and again for its gradient (fc6 at batch 32:
        # 1.6x the time of the flag form), and TF's einsum gradient builds an (N, O, K) tensor;
        # for a small batch TF computes (kernel @ x^T)^T (see the backend's matmul_nt).
        kernel = _backend.as_tensor(self.kernel)  # the variable's dtype (float32 under a policy)
        arith = arithmetic_dtype(self.compute_dtype)  # float32 where 16-bit GEMMs are slower
        y = _backend.matmul_nt(ops.cast(x2, arith), ops.cast(kernel, arith))
        if arith != self.compute_dtype:
            y = ops.cast(y, self.compute_dtype)
        if self.bias_term:
            y = y + self.bias
        if lead:
            y = ops.reshape(y, [-1] + lead + [self.num_output])
        return from_caffe_layout(y)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(num_output=self.num_output, axis=self.axis, bias_term=self.bias_term,
                   kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                   bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeDeconvolution(keras.layers.Layer):
    """Caffe's Deconvolution (the adjoint of a convolution), channels-last.

    Output size ``stride * (in - 1) + dilation * (kernel - 1) + 1 - 2 * pad``.
    Variables: ``kernel`` ``(kh, kw, filters // groups, in_channels)`` (Keras'
    ``conv_transpose`` layout; Caffe's blob is ``(in_channels, filters // groups, kh, kw)``)
    and ``bias``.
    """

    def __init__(self, filters: int, kernel_size, strides=1, padding=0, dilation_rate=1,
                 groups: int = 1, use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", **kwargs) -> None:
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        self.padding = _pair(padding, "padding")
        self.dilation_rate = _pair(dilation_rate, "dilation_rate")
        self.groups = int(groups)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        c = int(input_shape[-1])
        if c % self.groups or self.filters % self.groups:
            raise ValueError(f"Deconvolution '{self.name}': group {self.groups} must divide "
                             f"the input channels ({c}) and num_output ({self.filters})")
        kh, kw = self.kernel_size
        self.kernel = self.add_weight(name="kernel",
                                      shape=(kh, kw, self.filters // self.groups, c),
                                      initializer=self.kernel_initializer)
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(self.filters,),
                                        initializer=self.bias_initializer)

    def _out(self, size, k, s, p, d):
        return s * (size - 1) + d * (k - 1) + 1 - 2 * p

    def compute_output_shape(self, input_shape):
        n, h, w, _ = input_shape
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (self.kernel_size, self.strides,
                                                  self.padding, self.dilation_rate)
        return (n, self._out(h, kh, sh, ph, dh), self._out(w, kw, sw, pw, dw), self.filters)

    def call(self, x):
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (self.kernel_size, self.strides,
                                                  self.padding, self.dilation_rate)
        h, w, c = x.shape[1], x.shape[2], x.shape[3]
        oh, ow = self._out(h, kh, sh, ph, dh), self._out(w, kw, sw, pw, dw)
        full_h, full_w = oh + 2 * ph, ow + 2 * pw
        g = self.groups
        cg = c // g
        # dilation as zeros between the kernel's taps: TensorFlow's CPU transposed convolution
        # takes no dilation without its oneDNN operations (off by default on an AVX2-only AMD
        # EPYC: "Current CPU implementations do not yet support dilation rates larger than 1")
        kernel = _dilated(self.kernel, dh, dw)
        outs = []
        for i in range(g):
            xi = x[..., i * cg:(i + 1) * cg] if g > 1 else x
            ki = kernel[..., i * cg:(i + 1) * cg] if g > 1 else kernel
            yi = ops.conv_transpose(xi, ki, (sh, sw), padding="valid",
                                    output_padding=None, data_format="channels_last")
            outs.append(yi)
        y = ops.concatenate(outs, axis=-1) if g > 1 else outs[0]
        # 'valid' conv_transpose gives (in-1)*s + ek (or more when ek < s); crop Caffe's pad
        yh, yw = y.shape[1], y.shape[2]
        if yh is not None and yh < full_h or yw is not None and yw < full_w:
            y = ops.pad(y, [[0, 0], [0, max(0, full_h - yh)], [0, max(0, full_w - yw)],
                            [0, 0]])
        y = y[:, ph:ph + oh, pw:pw + ow, :]
        if self.use_bias:
            y = y + self.bias
        return y

    def get_config(self):
        cfg = super().get_config()
        cfg.update(filters=self.filters, kernel_size=self.kernel_size, strides=self.strides,
                   padding=self.padding, dilation_rate=self.dilation_rate, groups=self.groups,
                   use_bias=self.use_bias,
                   kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                   bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return cfg


def _dilated(kernel, dh: int, dw: int):
    """``kernel`` ``(kh, kw, a, b)`` with ``dh - 1`` / ``dw - 1`` zero rows / columns between its
    taps: ``((kh - 1) * dh + 1, (kw - 1) * dw + 1, a, b)``, the same convolution undilated."""
    kh, kw, a, b = kernel.shape
    if dh > 1:
        zeros = ops.zeros((kh, dh - 1, kw, a, b), kernel.dtype)
        kernel = ops.concatenate([ops.expand_dims(kernel, 1), zeros], axis=1)
        kernel = ops.reshape(kernel, (kh * dh, kw, a, b))[:(kh - 1) * dh + 1]
        kh = (kh - 1) * dh + 1
    if dw > 1:
        zeros = ops.zeros((kh, kw, dw - 1, a, b), kernel.dtype)
        kernel = ops.concatenate([ops.expand_dims(kernel, 2), zeros], axis=2)
        kernel = ops.reshape(kernel, (kh, kw * dw, a, b))[:, :(kw - 1) * dw + 1]
    return kernel
