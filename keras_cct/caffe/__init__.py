"""Caffe compatibility: proto schema, prototxt / caffemodel / solver readers, the network
builder, and Caffe's data layers.

Public API (imported lazily, so ``import keras_cct.caffe.proto`` stays light):

* :func:`load_net` -- prototxt [+ caffemodel] -> ``keras.Model``; :func:`import_net` returns
  the :class:`CaffeNet` (model, inputs, outputs, heads) instead.
* :func:`build_net` -- a ``NetParameter`` -> :class:`CaffeNet` for one phase (training uses it).
* :func:`load_weights` / :func:`save_weights` -- .caffemodel <-> Keras variables.
* :func:`read_net`, :func:`read_caffemodel`, :func:`read_binaryproto`, :func:`blob_to_array`,
  :func:`array_to_blob` -- file readers (``keras_cct.caffe.prototxt``).
* :func:`load_solver` -- a solver.prototxt -> a training solver (``keras_cct.caffe.solver``).
* :mod:`keras_cct.caffe.proto` -- Caffe's protobuf message classes.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_net": "keras_cct.caffe.builder",
    "load_net": "keras_cct.caffe.builder",
    "import_net": "keras_cct.caffe.builder",
    "CaffeNet": "keras_cct.caffe.builder",
    "Head": "keras_cct.caffe.builder",
    "SUPPORTED_TYPES": "keras_cct.caffe.builder",
    "load_weights": "keras_cct.caffe.weights",
    "save_weights": "keras_cct.caffe.weights",
    "read_net": "keras_cct.caffe.prototxt",
    "parse_net": "keras_cct.caffe.prototxt",
    "read_caffemodel": "keras_cct.caffe.prototxt",
    "read_binaryproto": "keras_cct.caffe.prototxt",
    "write_binaryproto": "keras_cct.caffe.prototxt",
    "blob_to_array": "keras_cct.caffe.prototxt",
    "array_to_blob": "keras_cct.caffe.prototxt",
    "filter_net": "keras_cct.caffe.prototxt",
    "load_solver": "keras_cct.caffe.solver",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_cct.caffe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
