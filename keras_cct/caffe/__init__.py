"""Caffe compatibility: proto schema, prototxt / caffemodel / solver readers, the network
builder, and Caffe's data layers."""
