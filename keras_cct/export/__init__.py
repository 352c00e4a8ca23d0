"""Deployment: ONNX export of Keras models with HybridConv2D layers (through tf2onnx).

:func:`export_onnx` rewrites each HybridConv2D into one standard convolution (so the ONNX graph
has a ``Conv`` node per layer, never the lowered ops), converts the model with tf2onnx on the
TensorFlow backend, checks it with ``onnx.checker`` and onnxruntime, and writes it atomically.
``cct export`` (:mod:`keras_cct.export.commands`) does the same from the command line, for a
``.keras`` file or a Caffe ``.prototxt`` (+ ``.caffemodel``).
"""

from keras_cct.export.onnx_export import export_onnx, to_onnx_proto

__all__ = ["export_onnx", "to_onnx_proto"]
