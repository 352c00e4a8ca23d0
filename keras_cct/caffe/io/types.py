"""Lists of Caffe layer types that several parts of :mod:`keras_cct.caffe` read (one list each)."""

#: Caffe's data layers: they produce a net's inputs (from files, memory or constants); ``Input``
#: layers, which declare inputs fed by the caller, are not among them.
DATA_TYPES = ("Data", "ImageData", "HDF5Data", "MemoryData", "WindowData", "DummyData")

__all__ = ["DATA_TYPES"]
