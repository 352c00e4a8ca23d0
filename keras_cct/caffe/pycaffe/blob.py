"""pycaffe's blobs: :class:`Blob` (``data`` and ``diff`` as NCHW numpy arrays: the one the
Python layers see, from :mod:`keras_cct.caffe.net.layers.recurrent.python_layer`),
:class:`ParamBlob` (a learnable blob, backed by a Keras layer's variables through
:class:`ParamSet`), :func:`store`; the phase constants ``TRAIN`` / ``TEST``."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from keras_cct.caffe.net.layers.recurrent.python_layer import Blob
from keras_cct.caffe.net.weights import (expected_blob_shapes, keras_arrays_to_blobs,
                                         keras_layer_to_blobs, layer_blobs_to_keras)

__all__ = ["TRAIN", "TEST", "phase_name", "Blob", "ParamBlob", "ParamSet", "store"]

#: pycaffe's phase constants (Caffe's ``Phase`` enum values)
TRAIN = 0
TEST = 1


def phase_name(phase) -> str:
    """``"TRAIN"`` or ``"TEST"`` of ``caffe.TRAIN`` / ``caffe.TEST`` (or the names)."""
    if isinstance(phase, str) and phase.upper() in ("TRAIN", "TEST"):
        return phase.upper()
    if phase in (TRAIN, TEST) and not isinstance(phase, bool):
        return "TRAIN" if phase == TRAIN else "TEST"
    raise ValueError(f"phase must be caffe.TRAIN or caffe.TEST, got {phase!r}")


def store(blob: Blob, value) -> None:
    """Put a computed value in ``blob.data``: in place when the shape is unchanged (so arrays
    handed out earlier see it, as pycaffe's views do), else new zeroed-diff arrays."""
    value = np.asarray(value, np.float32)
    if value.shape == blob.data.shape:
        blob.data[...] = value
    else:
        blob.data = np.array(value, np.float32)
        blob.diff = np.zeros(value.shape, np.float32)


class ParamSet:
    """The Caffe blobs of one weighted Keras layer, in Caffe's layouts.

    Arrays are read from the Keras variables on first use and kept; :meth:`push` writes any
    changed array back to the variables (the net calls it before every computation that reads
    the weights), :meth:`pull` re-reads the variables into the same arrays (after training).
    """

    def __init__(self, layer, transpose: bool = False) -> None:
        self.layer = layer
        self.transpose = transpose
        self.arrays: Optional[List[np.ndarray]] = None
        self.synced: List[np.ndarray] = []
        self.diffs = [np.zeros(s, np.float32) for s in self._shapes()]

    def _shapes(self) -> List[Tuple[int, ...]]:
        return [tuple(s) for s in expected_blob_shapes(self.layer, transpose=self.transpose)]

    def _read(self) -> List[np.ndarray]:
        arrays = keras_layer_to_blobs(self.layer)
        if self.transpose:
            arrays[0] = arrays[0].T
        return [np.array(a, np.float32) for a in arrays]

    def get(self) -> List[np.ndarray]:
        if self.arrays is None:
            self.arrays = self._read()
            self.synced = [a.copy() for a in self.arrays]
        return self.arrays

    def push(self) -> None:
        """Write changed arrays to the Keras variables."""
        if self.arrays is None:
            return
        if all(np.array_equal(a, s) for a, s in zip(self.arrays, self.synced)):
            return
        self.layer.set_weights(layer_blobs_to_keras(self.layer, self.arrays,
                                                    transpose=self.transpose))
        self.synced = [a.copy() for a in self.arrays]

    def pull(self) -> None:
        """Re-read the Keras variables (into the arrays already handed out)."""
        if self.arrays is None:
            return
        for a, new in zip(self.arrays, self._read()):
            a[...] = new
        self.synced = [a.copy() for a in self.arrays]

    def add_grads(self, grads: Sequence[np.ndarray]) -> None:
        """Accumulate Keras-layout gradients of the variables into the Caffe ``diff`` arrays
        (Caffe accumulates parameter diffs until they are cleared)."""
        for d, g in zip(self.diffs, keras_arrays_to_blobs(self.layer, grads,
                                                          transpose=self.transpose)):
            d += g.reshape(d.shape)


class ParamBlob(Blob):
    """Learnable blob ``index`` of a :class:`ParamSet`: ``data`` reads and writes the Keras
    weights (written back before the net next computes), ``diff`` holds the gradient."""

    def __init__(self, params: ParamSet, index: int) -> None:  # no Blob.__init__: a view
        self._params = params
        self._index = index

    @property
    def data(self) -> np.ndarray:  # type: ignore[override]
        return self._params.get()[self._index]

    @data.setter
    def data(self, value) -> None:
        self.data[...] = value

    @property
    def diff(self) -> np.ndarray:  # type: ignore[override]
        return self._params.diffs[self._index]

    @diff.setter
    def diff(self, value) -> None:
        self.diff[...] = value

    def reshape(self, *shape: int) -> None:
        raise ValueError("a learnable blob's shape is fixed by its layer; rebuild the net "
                         "with another prototxt to change it")

    def __repr__(self) -> str:
        return f"<ParamBlob {self._params.layer.name}[{self._index}] shape={self.shape}>"
