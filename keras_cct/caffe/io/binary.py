"""Caffe's binary files: .caffemodel (a ``NetParameter``), .binaryproto (one ``BlobProto``, e.g.
a mean file), .solverstate (a ``SolverState``), and blobs <-> numpy arrays.

* :func:`read_caffemodel` / :func:`parse_caffemodel` -- trained weights, upgraded to ``layer``.
* :func:`read_binaryproto` / :func:`write_binaryproto` -- one ``BlobProto``.
* :func:`read_solverstate` / :func:`write_solverstate` -- a solver's snapshot state.
* :func:`blob_to_array` / :func:`array_to_blob` -- a ``BlobProto`` <-> numpy, with Caffe's
  legacy 4-D ``num/channels/height/width`` shapes.

Every problem raises :class:`keras_cct.errors.CaffeFormatError` naming the file (and the layer
where known). Files are read with :func:`~keras_cct.caffe.io.validate.read_bounded` and parsed by
protobuf's parser only; they are written atomically (:func:`keras_cct._files.atomic_write`).
"""

from __future__ import annotations

import math
import os
from typing import Sequence, Tuple, Union

import numpy as np
from google.protobuf import message as _pb_message

from keras_cct._files import atomic_write
from keras_cct.caffe.io import proto
from keras_cct.caffe.io.upgrade import upgrade_net
from keras_cct.caffe.io.validate import check_solverstate, check_strings, read_bounded
from keras_cct.errors import CaffeFormatError

PathLike = Union[str, os.PathLike]

__all__ = ["read_caffemodel", "parse_caffemodel", "read_binaryproto", "write_binaryproto",
           "read_solverstate", "write_solverstate", "blob_to_array", "array_to_blob",
           "blob_shape"]


def parse_caffemodel(data: bytes, *, path: str = "<bytes>", upgrade: bool = True):
    """Parse the bytes of a .caffemodel (binary ``NetParameter``)."""
    net = proto.NetParameter()
    if not data:
        raise CaffeFormatError("empty caffemodel", path=path,
                               hint="the file is empty; download or write it again")
    try:
        net.ParseFromString(data)
    except _pb_message.DecodeError as exc:
        raise CaffeFormatError(
            f"not a valid caffemodel: {exc or 'protobuf decoding failed'}", path=path,
            hint="the file is truncated or is not a binary Caffe NetParameter "
                 "(a .prototxt is text, a .solverstate is a SolverState)") from None
    if not len(net.layer) and not len(net.layers):
        raise CaffeFormatError("the caffemodel contains no layers", path=path,
                               hint="the file is not a Caffe model (or is truncated)")
    check_strings(net, path, "caffemodel")
    if upgrade:
        upgrade_net(net, path=path)
    return net


def read_caffemodel(path: PathLike, *, upgrade: bool = True):
    """Read a .caffemodel (trained weights, binary ``NetParameter``), upgraded to ``layer``.

    Raises:
        CaffeFormatError: missing file, truncated or non-protobuf content, no layers.
    """
    path = str(path)
    data = read_bounded(path, "caffemodel")
    return parse_caffemodel(data, path=path, upgrade=upgrade)


def read_binaryproto(path: PathLike) -> "proto.BlobProto":
    """Read a .binaryproto file (one ``BlobProto``, e.g. Caffe's mean file)."""
    path = str(path)
    data = read_bounded(path, "binaryproto")
    blob = proto.BlobProto()
    try:
        blob.ParseFromString(data)
    except _pb_message.DecodeError as exc:
        raise CaffeFormatError(f"not a valid binaryproto: {exc}", path=path,
                               hint="the file is truncated or not a Caffe BlobProto") from None
    if not (len(blob.data) or len(blob.double_data)):
        raise CaffeFormatError("the binaryproto holds no data", path=path)
    shape, n = blob_shape(blob), len(blob.double_data) or len(blob.data)
    if any(d < 0 for d in shape) or math.prod(shape) != n:
        raise CaffeFormatError(f"the blob declares shape {shape} but holds {n} values",
                               path=path, hint="the file is corrupt; write it again")
    return blob


def write_binaryproto(path: PathLike, array: np.ndarray, *, legacy_shape: bool = False) -> None:
    """Write ``array`` (Caffe's NCHW order) as a .binaryproto file, atomically."""
    atomic_write(str(path), array_to_blob(array, legacy_shape=legacy_shape)
                  .SerializeToString())


def write_solverstate(path: PathLike, *, it: int, learned_net: str,
                      history: Sequence[np.ndarray], current_step: int = 0) -> None:
    """Write a Caffe ``SolverState`` (history blobs in Caffe's shapes) atomically."""
    state = proto.SolverState(iter=int(it), learned_net=learned_net,
                              current_step=int(current_step))
    for arr in history:
        array_to_blob(arr, blob=state.history.add())
    atomic_write(str(path), state.SerializeToString())


def read_solverstate(path: PathLike):
    """Read a ``.solverstate`` file (a ``SolverState``).

    Raises:
        CaffeFormatError: missing, truncated or not a SolverState.
    """
    path = str(path)
    data = read_bounded(path, "solver state")
    state = proto.SolverState()
    try:
        state.ParseFromString(data)
    except _pb_message.DecodeError:
        raise CaffeFormatError("not a valid solverstate (protobuf decoding failed)", path=path,
                               hint="the file is truncated or is not a Caffe SolverState"
                               ) from None
    if not state.HasField("iter"):
        raise CaffeFormatError("the solverstate has no iteration", path=path,
                               hint="the file is not a Caffe SolverState")
    check_solverstate(state, path)
    return state


# --------------------------------------------------------------------------------------------
# Blobs


def blob_shape(blob) -> Tuple[int, ...]:
    """The shape of a ``BlobProto``: ``shape.dim``, else the legacy ``(num, channels, height,
    width)`` (Caffe's 4-D blobs, as written by 2014-era Caffe)."""
    if blob.HasField("shape"):
        return tuple(int(d) for d in blob.shape.dim)
    if blob.HasField("num") or blob.HasField("channels") or blob.HasField("height") \
            or blob.HasField("width"):
        return (int(blob.num), int(blob.channels), int(blob.height), int(blob.width))
    n = len(blob.data) or len(blob.double_data)
    return (n,)


def blob_to_array(blob, *, dtype=np.float32) -> np.ndarray:
    """A ``BlobProto`` as a numpy array of its shape (``data``, or ``double_data``)."""
    shape = blob_shape(blob)
    if len(blob.double_data):
        values = np.asarray(blob.double_data, dtype=np.float64)
    else:
        values = np.asarray(blob.data, dtype=np.float32)
    size = math.prod(shape)
    if values.size != size or any(d < 0 for d in shape):
        raise CaffeFormatError(f"blob of shape {shape} holds {values.size} values, "
                               f"expected {size}")
    return values.reshape(shape).astype(dtype, copy=False)


def array_to_blob(array, *, legacy_shape: bool = False, blob=None):
    """A numpy array as a ``BlobProto`` (float32 ``data`` and ``shape.dim``; with
    ``legacy_shape`` the 4-D ``num/channels/height/width`` fields instead)."""
    arr = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
    blob = proto.BlobProto() if blob is None else blob
    if legacy_shape:
        dims = (1,) * (4 - arr.ndim) + arr.shape if arr.ndim <= 4 else None
        if dims is None:
            raise ValueError(f"legacy 4-D blobs cannot hold a {arr.ndim}-D array")
        blob.num, blob.channels, blob.height, blob.width = (int(d) for d in dims)
    else:
        blob.shape.dim.extend(int(d) for d in arr.shape)
    blob.data.extend(arr.ravel().tolist())
    return blob


