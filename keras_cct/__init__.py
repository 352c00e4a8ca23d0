"""keras_cct: Caffe con Troll's ideas for Keras 3.

* :class:`HybridConv2D` -- a drop-in ``keras.layers.Conv2D`` computed by lowering + GEMM +
  lifting (CcT's Type 1/2/3 lowerings), chosen per layer by a planner.
* :mod:`keras_cct.lowering` -- the pure functions behind it, with their cost model.
* :class:`CCTStrategy` -- split each mini-batch across devices in proportion to their FLOPS.
* :mod:`keras_cct.devices` -- device discovery, FLOPS calibration, OpenCL kernels.
* :mod:`keras_cct.caffe` -- Caffe prototxt / caffemodel / solver compatibility.
* :mod:`keras_cct.export` -- ONNX export.
"""

from keras_cct import errors
from keras_cct._version import __version__
from keras_cct.devices import list_devices
from keras_cct.export import export_onnx
from keras_cct.layers import HybridConv2D
from keras_cct.strategy import CCTStrategy, hybridize

__all__ = ["CCTStrategy", "HybridConv2D", "errors", "export_onnx", "hybridize", "list_devices",
           "__version__"]
