"""Keras layers of keras_cct: :class:`HybridConv2D`, a drop-in for ``keras.layers.Conv2D``."""

from keras_cct.layers.hybrid_conv2d import HybridConv2D

__all__ = ["HybridConv2D"]
