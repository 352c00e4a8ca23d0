"""Caffe's layers that are learned blobs: :class:`CaffeEmbed` (a lookup table) and
:class:`CaffeParameter` (a blob as a top). Their variables are Caffe's blobs as is (same order
and shapes, ``caffe_type``), so caffemodels load and save with no conversion."""

from __future__ import annotations

from typing import Sequence

import keras
from keras import ops

from keras_cct.caffe.net.layout import caffe_shape, from_caffe_layout, keras_shape, to_caffe_layout

_PKG = "keras_cct"

__all__ = ["CaffeEmbed", "CaffeParameter"]


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeEmbed(keras.layers.Layer):
    """Caffe's ``Embed``: each input value ``i`` (a float, truncated to an int) becomes row
    ``i`` of the ``(input_dim, num_output)`` weight blob (plus the bias): a Caffe bottom of
    shape ``S`` gives a top of Caffe shape ``S + (num_output,)``. The backward adds each top
    gradient into the row it came from (no gradient reaches the input, as in Caffe).
    Indices must lie in ``[0, input_dim)`` (Caffe checks this only in debug builds)."""

    caffe_type = "Embed"

    def __init__(self, num_output: int, input_dim: int, bias_term: bool = True,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if int(num_output) < 1 or int(input_dim) < 1:
            raise ValueError(f"Embed num_output and input_dim must be >= 1, got "
                             f"{num_output} and {input_dim}")
        self.num_output = int(num_output)
        self.input_dim = int(input_dim)
        self.bias_term = bool(bias_term)

    def build(self, input_shape):
        self.kernel = self.add_weight(name="kernel", shape=(self.input_dim, self.num_output),
                                      initializer="glorot_uniform")
        self.bias = (self.add_weight(name="bias", shape=(self.num_output,), initializer="zeros")
                     if self.bias_term else None)
        self.built = True

    def compute_output_shape(self, input_shape):
        return keras_shape(caffe_shape(input_shape) + (self.num_output,))

    def call(self, x):
        idx = ops.cast(ops.stop_gradient(to_caffe_layout(x)), "int32")
        y = ops.take(self.kernel, idx, axis=0)
        if self.bias is not None:
            y = y + self.bias
        return from_caffe_layout(y)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(num_output=self.num_output, input_dim=self.input_dim,
                   bias_term=self.bias_term)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeParameter(keras.layers.Layer):
    """Caffe's ``Parameter``: a learned blob of Caffe shape ``shape`` as the layer's top
    (channels-last, as every blob). Caffe's layer has no bottom; in a Keras functional model
    the layer is called on an anchor tensor (e.g. the net's first input) whose values it
    ignores."""

    caffe_type = "Parameter"

    def __init__(self, shape: Sequence[int], **kwargs) -> None:
        super().__init__(**kwargs)
        shape = tuple(int(d) for d in shape)
        if not shape or min(shape) < 1:
            raise ValueError(f"Parameter shape must have positive dims, got {shape}")
        self.shape = shape

    def build(self, input_shape):
        self.blob = self.add_weight(name="blob", shape=self.shape, initializer="zeros")
        self.built = True

    def compute_output_shape(self, input_shape):
        return keras_shape(self.shape)

    def call(self, anchor):
        return from_caffe_layout(ops.convert_to_tensor(self.blob))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(shape=list(self.shape))
        return cfg
