"""keras_cct: Caffe con Troll's ideas for Keras 3.

* :class:`HybridConv2D` -- a drop-in ``keras.layers.Conv2D`` computed by lowering + GEMM +
  lifting (CcT's Type 1/2/3 lowerings), chosen per layer by a planner.
* :mod:`keras_cct.lowering` -- the pure functions behind it, with their cost model.
* :class:`CCTStrategy` -- split each mini-batch across devices in proportion to their FLOPS.
* :mod:`keras_cct.devices` -- device discovery, FLOPS calibration, OpenCL kernels.
* :mod:`keras_cct.caffe` -- Caffe prototxt / caffemodel / solver compatibility.
* :mod:`keras_cct.export` -- ONNX export.

The names below are imported on first use (PEP 562), so that importing a light sub-package
(``keras_cct.caffe.io`` reads Caffe's files with protobuf and numpy only) works without Keras.
Where Keras is installed, ``import keras_cct`` registers every keras_cct layer (HybridConv2D and
the Caffe layers) for ``keras.saving.load_model``, which imports no package of its own accord
but Keras' own.
"""

import importlib

from keras_cct import errors
from keras_cct._lazy import lazy_attributes
from keras_cct._version import __version__

_EXPORTS = {
    "CCTStrategy": "keras_cct.strategy",
    "HybridConv2D": "keras_cct.layers",
    "export_onnx": "keras_cct.export",
    "hybridize": "keras_cct.strategy",
    "list_devices": "keras_cct.devices",
}

__all__ = ["CCTStrategy", "HybridConv2D", "errors", "export_onnx", "hybridize", "list_devices",
           "__version__"]


#: sub-packages reachable as attributes of the root (``keras_cct.caffe.load_net``)
_SUBPACKAGES = {name: f"keras_cct.{name}" for name in
                ("caffe", "devices", "export", "layers", "lowering", "ops", "strategy")}

__getattr__, __dir__ = lazy_attributes(globals(), _EXPORTS, _SUBPACKAGES)


def _register_layers() -> None:
    try:
        import keras  # noqa: F401
    except ImportError:  # keras_cct.caffe.io reads Caffe's files without Keras
        return
    for module in ("keras_cct.layers", "keras_cct.caffe.net.layers"):
        importlib.import_module(module)


_register_layers()
