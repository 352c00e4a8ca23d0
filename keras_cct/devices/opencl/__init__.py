"""OpenCL kernels for the lowered convolution, run in a worker process that never imports
TensorFlow (PoCL's LLVM and TensorFlow's clash in one process)."""
