"""Caffe weights <-> Keras variables: ``load_weights``, ``save_weights`` and blob layouts.

Each Keras layer that an imported net uses for a weighted Caffe layer has a converter here that
knows Caffe's blob shapes and layouts:

=====================  ==================  ===================================================
Caffe type             Keras layer         blobs -> variables
=====================  ==================  ===================================================
Convolution            HybridConv2D        (O, I/g, kh, kw) -> kernel (kh, kw, I/g, O); bias
Deconvolution          CaffeDeconvolution  (I, O/g, kh, kw) -> kernel (kh, kw, O/g, I); bias
InnerProduct           CaffeInnerProduct   (O, K) -> kernel (O, K) (a transpose blob (K, O) too)
PReLU                  CaffePReLU          (C,) or (1,) -> alpha
BatchNorm              CaffeBatchNorm      mean (C,), variance (C,), scale factor (1,)
Scale / Bias           CaffeScale / Bias   as is (Caffe shapes)
=====================  ==================  ===================================================

Blobs are matched by layer name (``/`` in a Caffe name is ``__`` in Keras, see
:func:`keras_name`); legacy 4-D blob shapes (``num/channels/height/width``, e.g. a bias stored
as ``(1, 1, 1, O)``) are accepted when they equal the expected shape padded with leading ones,
as Caffe's ``Blob::ShapeEquals`` does.

Reading a large caffemodel is dominated by turning protobuf's repeated floats into numpy; the
blob payloads are therefore read straight from the (packed, little-endian) wire bytes with
``numpy.frombuffer`` after protobuf has parsed and validated the message, and written the same
way (protobuf parses the encoded file back, so every file we write is checked by protobuf).
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from keras_cct._files import atomic_path, atomic_write
from keras_cct.caffe.io import proto
from keras_cct.caffe.io.binary import blob_shape, parse_caffemodel
from keras_cct.caffe.io.validate import read_bounded
from keras_cct.errors import CaffeFormatError

PathLike = Union[str, os.PathLike]

__all__ = ["keras_name", "caffe_name", "caffe_type_of", "layer_blobs_to_keras",
           "keras_layer_to_blobs", "keras_arrays_to_blobs", "caffe_params",
           "expected_blob_shapes", "blob_array", "load_weights", "save_weights",
           "WEIGHTED_TYPES"]

WEIGHTED_TYPES = ("Convolution", "Deconvolution", "InnerProduct", "PReLU", "BatchNorm",
                  "Scale", "Bias")


def keras_name(name: str) -> str:
    """The Keras layer name of a Caffe layer/blob name (Keras forbids ``/``: it becomes
    ``__``)."""
    return name.replace("/", "__")


def caffe_name(name: str) -> str:
    """Inverse of :func:`keras_name`."""
    return name.replace("__", "/")


# --------------------------------------------------------------------------------------------
# Fast blob payloads


def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def blob_array(blob, *, path: Optional[str] = None, layer: Optional[str] = None) -> np.ndarray:
    """The values of a ``BlobProto`` as a float32 numpy array of its (possibly legacy) shape."""
    shape = blob_shape(blob)
    values = None
    if not len(blob.double_data):
        raw = blob.SerializeToString()
        chunks = []
        ok = True
        try:
            for field, wire, start, end in _fields(raw, 0, len(raw)):
                if field == 5 and wire == 2:  # packed floats
                    chunks.append(np.frombuffer(raw, dtype="<f4", count=(end - start) // 4,
                                                offset=start))
                elif field == 5 and wire == 5:  # unpacked floats: protobuf's own list
                    ok = False
                    break
        except ValueError:  # a wire type _fields does not read
            ok = False
        if ok:
            values = (np.concatenate(chunks) if len(chunks) > 1 else
                      chunks[0] if chunks else np.zeros((0,), np.float32))
    if values is None:
        values = (np.asarray(blob.double_data, np.float64) if len(blob.double_data)
                  else np.asarray(blob.data, np.float32))
    size = math.prod(shape)
    if values.size != size or any(d < 0 for d in shape):
        raise CaffeFormatError(f"blob of shape {shape} holds {values.size} values, expected "
                               f"{size}", path=path, layer=layer,
                               hint="the caffemodel is corrupt")
    return values.astype(np.float32, copy=False).reshape(shape)


def _len_field(key: bytes, payload: bytes) -> bytes:
    """One length-delimited protobuf field: key, varint length, payload."""
    return key + _encode_varint(len(payload)) + payload


_KEY_BLOB_SHAPE = b"\x3a"      # BlobProto.shape = 7, length-delimited
_KEY_BLOB_DATA = b"\x2a"       # BlobProto.data = 5, packed floats
_KEY_LAYER_BLOBS = b"\x3a"     # LayerParameter.blobs = 7
_KEY_NET_LAYER = b"\xa2\x06"   # NetParameter.layer = 100


def _blob_bytes(array: np.ndarray) -> bytes:
    """The wire bytes of a BlobProto (``shape`` + packed little-endian float ``data``)."""
    arr = np.ascontiguousarray(np.asarray(array, dtype="<f4"))
    shape = proto.BlobShape()
    shape.dim.extend(int(d) for d in arr.shape)
    return (_len_field(_KEY_BLOB_SHAPE, shape.SerializeToString())
            + _len_field(_KEY_BLOB_DATA, arr.tobytes()))


# --------------------------------------------------------------------------------------------
# Per-layer conversions


def caffe_type_of(layer) -> Optional[str]:
    """The Caffe type a Keras layer imports/exports as (``None``: no weights to convert).

    A layer class may declare it with a ``caffe_type`` class attribute; its variables are then
    Caffe's blobs as is (same order and shapes), as for Scale and Bias."""
    cls = type(layer).__name__
    declared = getattr(type(layer), "caffe_type", None)
    if declared is not None:
        return str(declared) if layer.weights else None
    table = {"HybridConv2D": "Convolution", "Conv2D": "Convolution",
             "CaffeDeconvolution": "Deconvolution", "CaffeInnerProduct": "InnerProduct",
             "CaffePReLU": "PReLU", "CaffeBatchNorm": "BatchNorm", "CaffeScale": "Scale",
             "CaffeBias": "Bias"}
    t = table.get(cls)
    if t is None or not layer.weights:
        return None
    return t


def expected_blob_shapes(layer, *, transpose: bool = False) -> List[Tuple[int, ...]]:
    """Caffe blob shapes of a built Keras layer's variables, in Caffe's blob order."""
    t = caffe_type_of(layer)
    shapes = [tuple(int(d) for d in v.shape) for v in layer.weights]
    if t == "Convolution":
        kh, kw, cg, o = shapes[0]
        return [(o, cg, kh, kw)] + shapes[1:]
    if t == "Deconvolution":
        kh, kw, og, ci = shapes[0]
        return [(ci, og, kh, kw)] + shapes[1:]
    if t == "InnerProduct":
        o, k = shapes[0]
        return [(k, o) if transpose else (o, k)] + shapes[1:]
    return shapes


def layer_blobs_to_keras(layer, arrays: Sequence[np.ndarray], *, transpose: bool = False
                         ) -> List[np.ndarray]:
    """Caffe blob arrays (already checked against :func:`expected_blob_shapes`) -> the values
    for ``layer.set_weights``."""
    t = caffe_type_of(layer)
    exp = expected_blob_shapes(layer, transpose=transpose)
    arrays = [np.asarray(a, np.float32).reshape(s) for a, s in zip(arrays, exp)]
    if t in ("Convolution", "Deconvolution"):
        arrays[0] = np.transpose(arrays[0], (2, 3, 1, 0))
    elif t == "InnerProduct" and transpose:
        arrays[0] = np.ascontiguousarray(arrays[0].T)
    return arrays  # (transposed views: the backend copies them once, into the variables)


def keras_layer_to_blobs(layer) -> List[np.ndarray]:
    """A Keras layer's variables as Caffe blob arrays (Caffe shapes and layouts)."""
    t = caffe_type_of(layer)
    arrays = [np.asarray(w, np.float32) for w in layer.get_weights()]
    if t in ("Convolution", "Deconvolution"):
        arrays[0] = np.transpose(arrays[0], (3, 2, 0, 1))
    return arrays


def keras_arrays_to_blobs(layer, arrays: Sequence[np.ndarray], *, transpose: bool = False
                          ) -> List[np.ndarray]:
    """Keras-layout arrays of a layer's variables (e.g. an optimizer's history) -> Caffe blob
    arrays: the exact inverse of :func:`layer_blobs_to_keras` (a permutation of elements), found
    by passing element indices through it, so that snapshots and restores can never disagree."""
    shapes = expected_blob_shapes(layer, transpose=transpose)
    sizes = [int(np.prod(e)) for e in shapes]
    # indices split in two float32-exact halves (the converter works in float32)
    hi = [(np.arange(n, dtype=np.int64) // 4096).astype(np.float32).reshape(e)
          for n, e in zip(sizes, shapes)]
    lo = [(np.arange(n, dtype=np.int64) % 4096).astype(np.float32).reshape(e)
          for n, e in zip(sizes, shapes)]
    khi = layer_blobs_to_keras(layer, hi, transpose=transpose)
    klo = layer_blobs_to_keras(layer, lo, transpose=transpose)
    out = []
    for arr, h, l, n, e in zip(arrays, khi, klo, sizes, shapes):
        idx = np.asarray(h, np.int64).ravel() * 4096 + np.asarray(l, np.int64).ravel()
        flat = np.empty(n, np.float32)
        flat[idx] = np.asarray(arr, np.float32).ravel()
        out.append(flat.reshape(e))
    return out


def caffe_params(model) -> List[Tuple[object, List]]:
    """``[(layer, [variables])]`` of the layers with Caffe blobs, in Caffe's blob order."""
    return [(layer, list(layer.weights)) for layer in model.layers
            if caffe_type_of(layer) is not None]


def _shape_matches(found: Tuple[int, ...], expected: Tuple[int, ...], legacy: bool) -> bool:
    if found == expected:
        return True
    if legacy and len(found) == 4 and len(expected) <= 4:
        return found == (1,) * (4 - len(expected)) + tuple(expected)
    return False


# --------------------------------------------------------------------------------------------
# load / save


def _model_of(model_or_net):
    return getattr(model_or_net, "model", model_or_net)


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _is_hdf5(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == _HDF5_SIGNATURE
    except OSError:
        return False


_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)  # h5py on a bad file


def _h5_array(ds, path: str, layer: str) -> np.ndarray:
    try:
        return np.asarray(ds, dtype=np.float32)
    except _H5_ERRORS as exc:
        raise CaffeFormatError(f"cannot read blob {ds.name}: {exc}", path=path, layer=layer,
                               hint="the HDF5 file is truncated or corrupt") from None


def _hdf5_entries(path: str) -> Dict[str, tuple]:
    """The entries of :func:`_weight_source` for Caffe's HDF5 weights (/data/<layer>/<i>);
    whatever h5py raises on a corrupt file is a CaffeFormatError."""
    import h5py  # optional and heavy: imported only for an HDF5 weights file
    entries: Dict[str, tuple] = {}

    def visit(name, obj):
        if not isinstance(obj, h5py.Group):
            return
        keys = [k for k in obj.keys() if isinstance(obj[k], h5py.Dataset)]
        if keys:
            keys.sort(key=lambda k: int(k) if k.isdigit() else 1 << 30)
            blobs = [(tuple(int(d) for d in obj[k].shape), False,
                      (lambda ds=obj[k], n=name: _h5_array(ds, path, n)))
                     for k in keys]
            entries.setdefault(keras_name(name), (name, blobs, None))
    try:
        f = h5py.File(path, "r")
        if "data" not in f:
            raise CaffeFormatError("HDF5 caffemodel without a /data group", path=path,
                                   hint="Caffe's HDF5 weights are /data/<layer>/<blob index>")
        f["data"].visititems(visit)
    except _H5_ERRORS as exc:
        raise CaffeFormatError(f"cannot read the HDF5 caffemodel: {exc}", path=path,
                               hint="the file is truncated or corrupt") from None
    return entries


def _weight_source(caffemodel):
    """(path, {keras layer name: (caffe name, [(shape, legacy, get_array)], LayerParameter)})."""
    entries: Dict[str, tuple] = {}
    if isinstance(caffemodel, (str, os.PathLike)) and _is_hdf5(str(caffemodel)):
        path = str(caffemodel)
        return path, _hdf5_entries(path)
    raw: Dict[str, List[np.ndarray]] = {}
    if isinstance(caffemodel, (str, os.PathLike)):
        path = str(caffemodel)
        data = read_bounded(path, "caffemodel")  # a regular file of a sane size
        weights = parse_caffemodel(data, path=path)   # protobuf validates the whole file
        raw = _raw_blob_payloads(data)
    else:
        path, weights = "<caffemodel>", caffemodel
    for lp in weights.layer:
        if len(lp.blobs) and keras_name(lp.name) not in entries:
            payloads = raw.get(lp.name)
            if payloads is not None and len(payloads) != len(lp.blobs):
                payloads = None
            blobs = []
            for i, b in enumerate(lp.blobs):
                shape = blob_shape(b)
                fast = payloads[i] if payloads is not None else None
                if fast is not None and fast.size == math.prod(shape) and not \
                        len(b.double_data):
                    get = (lambda a=fast, sh=shape: a.reshape(sh))
                else:
                    get = (lambda b=b, n=lp.name: blob_array(b, path=path, layer=n))
                blobs.append((shape, not b.HasField("shape"), get))
            entries[keras_name(lp.name)] = (lp.name, blobs, lp)
    return path, entries


def _fields(buf: bytes, start: int, end: int):
    """(field number, wire type, value start, value end) of the fields in buf[start:end]."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, pos = _varint(buf, pos)
            yield field, wire, pos, pos + length
            pos += length
        elif wire == 0:
            v0 = pos
            _, pos = _varint(buf, pos)
            yield field, wire, v0, pos
        elif wire == 5:
            yield field, wire, pos, pos + 4
            pos += 4
        elif wire == 1:
            yield field, wire, pos, pos + 8
            pos += 8
        else:
            raise ValueError("unsupported wire type")


def _raw_blob_payloads(data: bytes) -> Dict[str, List[Optional[np.ndarray]]]:
    """Zero-copy float32 views of every blob's packed ``data`` in a caffemodel's bytes, by layer
    name (current ``layer`` = field 100: name 1, blobs 7; V1 ``layers`` = field 2: name 4,
    blobs 6). A blob whose values are not one packed float field maps to ``None`` (the caller
    then reads it through protobuf). The file was already validated by protobuf."""
    out: Dict[str, List[Optional[np.ndarray]]] = {}
    try:
        for field, _, s, e in _fields(data, 0, len(data)):
            if field not in (100, 2):
                continue
            name_field, blob_field = (1, 7) if field == 100 else (4, 6)
            name, blobs = None, []
            for f2, _, s2, e2 in _fields(data, s, e):
                if f2 == name_field:
                    name = data[s2:e2].decode("utf-8", "replace")
                elif f2 == blob_field:
                    chunks = [(s3, e3, w3) for f3, w3, s3, e3 in _fields(data, s2, e2)
                              if f3 == 5]
                    if len(chunks) == 1 and chunks[0][2] == 2:
                        s3, e3, _ = chunks[0]
                        blobs.append(np.frombuffer(data, dtype="<f4", count=(e3 - s3) // 4,
                                                   offset=s3))
                    else:
                        blobs.append(None)
            if name is not None and blobs and name not in out:
                out[name] = blobs
    except (ValueError, IndexError):
        return {}
    return out


def load_weights(model_or_net, caffemodel, strict: bool = True, *,
                 net_param=None) -> List[str]:
    """Load a .caffemodel into a model built by :func:`keras_cct.caffe.build_net`/`load_net`.

    Layers are matched by name; caffemodel layers the model does not have (the TRAIN net's
    data and loss layers, ...) are ignored. Every blob is checked (count and shape) before any
    variable is assigned, so a failing call leaves the model unchanged.

    Args:
        model_or_net: a ``keras.Model`` or a ``CaffeNet``.
        caffemodel: a .caffemodel path (binary protobuf, or Caffe's HDF5 format
            ``/data/<layer>/<i>`` as in ``.caffemodel.h5`` snapshots), or an already read
            ``NetParameter``.
        strict: a model layer with weights but no blobs in the caffemodel is an error; with
            ``strict=False`` it is a warning and the layer keeps its initial values.
        net_param: the net's definition (for ``inner_product_param.transpose``); by default
            the caffemodel's own layer parameters are used.

    Returns:
        The names of the Keras layers that were loaded.

    Raises:
        CaffeFormatError: unreadable caffemodel, blob count or shape mismatch (expected vs
            found), missing weights in strict mode.
    """
    model = _model_of(model_or_net)
    path, entries = _weight_source(caffemodel)
    defs: Dict[str, object] = {}
    if net_param is not None:
        for lp in net_param.layer:
            defs.setdefault(keras_name(lp.name), lp)
    plan = []
    missing = []
    for layer in model.layers:
        t = caffe_type_of(layer)
        if t is None:
            continue
        entry = entries.get(layer.name)
        if entry is None:
            missing.append(layer.name)
            continue
        cname, blobs, own_def = entry
        definition = defs.get(layer.name, own_def)
        transpose = bool(t == "InnerProduct" and definition is not None
                         and definition.HasField("inner_product_param")
                         and definition.inner_product_param.transpose)
        expected = expected_blob_shapes(layer, transpose=transpose)
        if len(blobs) != len(expected):
            raise CaffeFormatError(
                f"{t} layer has {len(blobs)} blobs in the caffemodel, the net expects "
                f"{len(expected)} ({', '.join(str(s) for s in expected)})", path=path,
                layer=cname, hint="check bias_term and that the prototxt matches the weights")
        arrays = []
        for i, ((found, legacy, get), exp) in enumerate(zip(blobs, expected)):
            if not _shape_matches(found, exp, legacy):
                raise CaffeFormatError(
                    f"blob {i} has shape {found}, expected {exp}", path=path, layer=cname,
                    hint="the prototxt does not match these weights (num_output, kernel "
                         "size, group or input size differ)")
            arrays.append(get())
        plan.append((layer, layer_blobs_to_keras(layer, arrays, transpose=transpose)))
    if missing:
        msg = (f"{len(missing)} layer(s) need weights but the caffemodel has none for them: "
               f"{', '.join(caffe_name(m) for m in missing)}")
        if strict:
            raise CaffeFormatError(msg, path=path, hint="use the caffemodel trained with this "
                                   "net, or strict=False to keep their initial values")
        warnings.warn(f"{path}: {msg}; they keep their initial values", stacklevel=2)
    for layer, values in plan:
        layer.set_weights(values)
    return [layer.name for layer, _ in plan]


def save_weights(model_or_net, path: PathLike, *, name: Optional[str] = None,
                 net_param=None, format: str = "auto") -> int:  # noqa: A002
    """Write the model's weighted layers as a .caffemodel (binary ``NetParameter``).

    With ``format="hdf5"`` (or ``"auto"`` and a path ending in ``.h5``) the weights are written
    in Caffe's HDF5 layout instead (``/data/<layer>/<blob index>``, as Caffe's
    ``snapshot_format: HDF5``).

    Each layer is written with its Caffe name, type and blobs (Caffe shapes and layouts); Caffe
    and OpenCV match them by name with the .prototxt the model was imported from. The file is
    written atomically (temporary file, then rename).

    Args:
        model_or_net: a ``keras.Model`` or a ``CaffeNet`` (whose Caffe names and definition
            are then used).
        path: the .caffemodel to write.
        name: the net name stored in the file (default: the model's name).
        net_param: the net definition, for InnerProduct layers with ``transpose: true``
            (default: the CaffeNet's).

    Returns:
        The number of layers written.
    """
    model = _model_of(model_or_net)
    names = dict(getattr(model_or_net, "caffe_names", {}) or {})
    net_param = net_param if net_param is not None else getattr(model_or_net, "net_param", None)
    transposed = set()
    if net_param is not None:
        transposed = {keras_name(lp.name) for lp in net_param.layer
                      if lp.type == "InnerProduct" and lp.inner_product_param.transpose}
    if format not in ("auto", "binaryproto", "hdf5"):
        raise ValueError(f"format must be 'auto', 'binaryproto' or 'hdf5', got {format!r}")
    if format == "hdf5" or (format == "auto" and str(path).endswith(".h5")):
        return _save_hdf5(model, str(path), names, transposed)
    # The message is assembled from wire bytes (protobuf's repeated-float fields are slow to
    # fill from numpy), then parsed back by protobuf once, so every file written is valid.
    parts = [proto.NetParameter(name=name or model.name).SerializeToString()]
    count = 0
    for layer in model.layers:
        t = caffe_type_of(layer)
        if t is None:
            continue
        head = proto.LayerParameter(name=names.get(layer.name, caffe_name(layer.name)), type=t)
        arrays = keras_layer_to_blobs(layer)
        if layer.name in transposed:
            arrays[0] = arrays[0].T
        body = head.SerializeToString() + b"".join(
            _len_field(_KEY_LAYER_BLOBS, _blob_bytes(a)) for a in arrays)
        parts.append(_len_field(_KEY_NET_LAYER, body))
        count += 1
    data = b"".join(parts)
    check = proto.NetParameter.FromString(data)
    if len(check.layer) != count:  # pragma: no cover - a bug in the encoder above
        raise RuntimeError("save_weights produced an inconsistent caffemodel")
    del check
    atomic_write(path, data)
    return count


def _save_hdf5(model, path: str, names: Dict[str, str], transposed) -> int:
    import h5py  # optional and heavy: imported only for an HDF5 weights file
    count = 0
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            data = f.create_group("data")
            for layer in model.layers:
                if caffe_type_of(layer) is None:
                    continue
                group = data.create_group(names.get(layer.name, caffe_name(layer.name)))
                arrays = keras_layer_to_blobs(layer)
                if layer.name in transposed:
                    arrays[0] = arrays[0].T
                for i, arr in enumerate(arrays):
                    group.create_dataset(str(i), data=np.ascontiguousarray(arr, np.float32))
                count += 1
    return count
