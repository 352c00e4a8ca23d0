"""Caffe's blob layout in Keras: a Caffe blob of shape ``(N, C, d1, ..., dk)`` is held as the
channels-last tensor ``(N, d1, ..., dk, C)``; blobs of rank <= 2 are unchanged.

* :func:`caffe_axis` -- the Keras axis of a Caffe axis (the one helper for every layer, loss and
  metric that takes Caffe's ``axis``).
* :func:`to_caffe_layout` / :func:`from_caffe_layout` -- arrays or tensors between the orders.
* :func:`caffe_shape` / :func:`keras_shape` -- shapes between the orders.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
from keras import ops

from keras_cct.errors import CaffeFormatError

__all__ = ["caffe_axis", "to_caffe_layout", "from_caffe_layout", "caffe_shape", "keras_shape",
           "pair", "to_caffe_perm", "from_caffe_perm"]


def caffe_axis(axis: int, rank: int) -> int:
    """The Keras (channels-last) axis of Caffe axis ``axis`` of a rank-``rank`` blob (for 3-D
    and higher blobs Caffe's channel axis 1 is last and the spatial axes shift left by one).

    Raises:
        CaffeFormatError: (a ``ValueError``) the axis is out of range.
    """
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise CaffeFormatError(f"axis {axis} is out of range for a {rank}-D blob")
    if rank <= 2 or a == 0:
        return a
    return rank - 1 if a == 1 else a - 1


def to_caffe_perm(rank: int) -> List[int]:
    return [0, rank - 1] + list(range(1, rank - 1)) if rank > 2 else list(range(rank))


def from_caffe_perm(rank: int) -> List[int]:
    return [0] + list(range(2, rank)) + [1] if rank > 2 else list(range(rank))


def _permuted(x, perm_of):
    rank = len(x.shape)
    if rank <= 2:
        return x
    perm = perm_of(rank)
    return np.transpose(x, perm) if isinstance(x, np.ndarray) else ops.transpose(x, perm)


def to_caffe_layout(x):
    """A channels-last tensor/array in Caffe's order (N, C, ...). numpy in, numpy out."""
    return _permuted(x, to_caffe_perm)


def from_caffe_layout(x):
    """A Caffe-ordered (N, C, ...) tensor/array in channels-last order."""
    return _permuted(x, from_caffe_perm)


def caffe_shape(shape: Sequence) -> Tuple:
    """Caffe's shape of a channels-last Keras shape."""
    shape = tuple(shape)
    return tuple(shape[i] for i in to_caffe_perm(len(shape)))


def keras_shape(shape: Sequence) -> Tuple:
    """The channels-last shape of a Caffe blob shape."""
    shape = tuple(shape)
    return tuple(shape[i] for i in from_caffe_perm(len(shape)))


def pair(v, name: str) -> Tuple[int, int]:
    if isinstance(v, (int, np.integer)):
        return int(v), int(v)
    v = tuple(int(a) for a in v)
    if len(v) != 2:
        raise ValueError(f"`{name}` must be an int or a pair, got {v}")
    return v  # type: ignore[return-value]

