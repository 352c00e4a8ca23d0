"""Deployment: ONNX export of Keras models with HybridConv2D layers (through tf2onnx)."""
