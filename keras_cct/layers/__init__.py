"""Keras layers of keras_cct: :class:`HybridConv2D`, a drop-in for ``keras.layers.Conv2D``."""

from keras_cct.layers.hybrid_conv2d import HybridConv2D
from keras_cct.layers import caffe_layers  # noqa: F401  (registers them for load_model)

__all__ = ["HybridConv2D"]
