"""Caffe compatibility, in three layers whose imports run one way (io <- net <- train <- the
``cct`` commands):

* :mod:`keras_cct.caffe.io` -- Caffe's files with protobuf and numpy only (no Keras): schema,
  prototxt / caffemodel / binaryproto / solverstate readers and writers, format upgrades, the
  phase filter, LMDB.
* :mod:`keras_cct.caffe.net` -- nets as Keras models: the builder, layers with Caffe's
  semantics, losses, weights.
* :mod:`keras_cct.caffe.train` -- the optimizer, solver files, data layers, the solver.
* ``commands``, ``train_commands``, ``cli_args`` -- the ``cct`` sub-commands.

Public API (imported lazily, so ``import keras_cct.caffe`` stays light):

* :func:`load_net` -- prototxt [+ caffemodel] -> ``keras.Model``; :func:`import_net` returns
  the :class:`CaffeNet` (model, inputs, outputs, heads) instead.
* :func:`build_net` -- a ``NetParameter`` -> :class:`CaffeNet` for one phase (training uses it).
* :func:`load_weights` / :func:`save_weights` -- .caffemodel <-> Keras variables.
* :func:`read_net`, :func:`read_caffemodel`, :func:`read_binaryproto`, :func:`blob_to_array`,
  :func:`array_to_blob` -- file readers (:mod:`keras_cct.caffe.io`).
* :func:`load_solver` -- a solver.prototxt -> a training :class:`Solver`.
* ``proto`` -- Caffe's protobuf message classes (:mod:`keras_cct.caffe.io.proto`).
* pycaffe's names (:mod:`keras_cct.caffe.pycaffe`), so that ``import keras_cct.caffe as caffe``
  runs a pycaffe script: :class:`Net`, :class:`Classifier`, :class:`Detector`,
  :func:`get_solver`, :class:`SGDSolver` & co., ``TRAIN`` / ``TEST``, ``set_mode_cpu`` /
  ``set_mode_gpu`` / ``set_device``, ``Layer`` (Python layers' base class), and ``io``
  (:mod:`keras_cct.caffe.io`: ``Transformer``, ``load_image``, ...).
"""

from __future__ import annotations

from keras_cct._lazy import lazy_attributes

_EXPORTS = {
    "build_net": "keras_cct.caffe.net.builder",
    "load_net": "keras_cct.caffe.net.builder",
    "import_net": "keras_cct.caffe.net.builder",
    "CaffeNet": "keras_cct.caffe.net.builder",
    "SUPPORTED_TYPES": "keras_cct.caffe.net.builder",
    "Head": "keras_cct.caffe.net.losses",
    "load_weights": "keras_cct.caffe.net.weights",
    "save_weights": "keras_cct.caffe.net.weights",
    "read_net": "keras_cct.caffe.io.text",
    "parse_net": "keras_cct.caffe.io.text",
    "read_caffemodel": "keras_cct.caffe.io.binary",
    "read_binaryproto": "keras_cct.caffe.io.binary",
    "write_binaryproto": "keras_cct.caffe.io.binary",
    "blob_to_array": "keras_cct.caffe.io.binary",
    "array_to_blob": "keras_cct.caffe.io.binary",
    "filter_net": "keras_cct.caffe.io.filter",
    "load_solver": "keras_cct.caffe.train.solver",
    "Solver": "keras_cct.caffe.train.solver",
    # pycaffe's API
    "Net": "keras_cct.caffe.pycaffe.net",
    "Classifier": "keras_cct.caffe.pycaffe.classifier",
    "Detector": "keras_cct.caffe.pycaffe.detector",
    "TRAIN": "keras_cct.caffe.pycaffe.blob",
    "TEST": "keras_cct.caffe.pycaffe.blob",
    "get_solver": "keras_cct.caffe.pycaffe.solver",
    "SGDSolver": "keras_cct.caffe.pycaffe.solver",
    "NesterovSolver": "keras_cct.caffe.pycaffe.solver",
    "AdaGradSolver": "keras_cct.caffe.pycaffe.solver",
    "RMSPropSolver": "keras_cct.caffe.pycaffe.solver",
    "AdaDeltaSolver": "keras_cct.caffe.pycaffe.solver",
    "AdamSolver": "keras_cct.caffe.pycaffe.solver",
    "set_mode_cpu": "keras_cct.caffe.pycaffe.mode",
    "set_mode_gpu": "keras_cct.caffe.pycaffe.mode",
    "set_device": "keras_cct.caffe.pycaffe.mode",
    "Layer": "keras_cct.caffe.net.layers.recurrent.python_layer",  # Python layers' base class
}

#: modules reachable as attributes (``from keras_cct.caffe import proto``)
_MODULES = {"proto": "keras_cct.caffe.io.proto", "io": "keras_cct.caffe.io"}

__all__ = sorted(_EXPORTS) + sorted(_MODULES)


__getattr__, __dir__ = lazy_attributes(globals(), _EXPORTS, _MODULES)
