"""Keras layers of keras_cct: :class:`HybridConv2D`, a drop-in for ``keras.layers.Conv2D``, and
:mod:`keras_cct.layers.convert`, the one converter between it and ``keras.layers.Conv2D``.

(The layers with Caffe's semantics are in :mod:`keras_cct.caffe.net.layers`.)"""

from keras_cct.layers.hybrid_conv2d import HybridConv2D

__all__ = ["HybridConv2D"]
