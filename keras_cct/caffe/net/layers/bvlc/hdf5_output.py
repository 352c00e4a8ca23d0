"""Caffe's ``HDF5Output``: :func:`write_hdf5_output` writes blobs as Caffe's layer does, and
:class:`CaffeHDF5Output` is the layer that calls it when it runs eagerly."""

from __future__ import annotations

import os
from typing import Union

import keras
import numpy as np
from keras import ops

from keras_cct.caffe.net.layout import to_caffe_layout
from keras_cct.errors import KerasCCTError

_PKG = "keras_cct"

__all__ = ["CaffeHDF5Output", "write_hdf5_output"]


def _legacy_4d(a: np.ndarray) -> np.ndarray:
    """Caffe's ``Reshape(num, channels, height, width)`` of a blob: 4-D, trailing ones."""
    if a.ndim > 4:
        raise ValueError(f"HDF5Output writes blobs of at most 4 axes, got shape {a.shape}")
    return a.reshape(a.shape + (1,) * (4 - a.ndim))


def write_hdf5_output(path: Union[str, os.PathLike], data, label) -> None:
    """Write ``data`` and ``label`` (channels-last arrays or tensors) to a new HDF5 file as
    Caffe's ``HDF5OutputLayer`` does: the file truncated, float32 datasets ``"data"`` and
    ``"label"`` in Caffe's (N, C, H, W) order (blobs of fewer axes padded with trailing 1s).
    The two must have the same batch size."""
    import h5py
    d = np.asarray(to_caffe_layout(np.asarray(ops.convert_to_numpy(data))), np.float32)
    lab = np.asarray(to_caffe_layout(np.asarray(ops.convert_to_numpy(label))), np.float32)
    if d.shape[0] != lab.shape[0]:
        raise ValueError(f"HDF5Output: data and label have batch sizes {d.shape[0]} and "
                         f"{lab.shape[0]}: they must be the same")
    with h5py.File(str(path), "w") as f:
        f.create_dataset("data", data=_legacy_4d(d))
        f.create_dataset("label", data=_legacy_4d(lab))


def _is_symbolic(x) -> bool:
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        return isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf
        return not tf.executing_eagerly()
    return False


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeHDF5Output(keras.layers.Layer):
    """Caffe's ``HDF5Output`` on inputs ``[data, label]``: each eager call writes them to
    ``file_name`` (:func:`write_hdf5_output`; a later call replaces the file's datasets, where
    Caffe, which can write them once, stops). It returns ``data`` unchanged. Inside a compiled
    function (``tf.function``, JAX jit) it cannot write and raises
    :class:`~keras_cct.errors.KerasCCTError`."""

    def __init__(self, file_name: str, **kwargs) -> None:
        super().__init__(**kwargs)
        if not file_name:
            raise ValueError("HDF5Output needs a file_name")
        self.file_name = str(file_name)

    def compute_output_shape(self, input_shape):
        return input_shape[0]

    def call(self, inputs):
        data, label = inputs
        if _is_symbolic(data):
            raise KerasCCTError(
                f"HDF5Output layer '{self.name}' writes files and runs only eagerly: call the "
                f"model directly (model(x)), not inside predict/fit/jit")
        write_hdf5_output(self.file_name, data, label)
        return data

    def get_config(self):
        cfg = super().get_config()
        cfg.update(file_name=self.file_name)
        return cfg
