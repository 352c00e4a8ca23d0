"""Caffe's ``extract_features``: the values of some blobs of a net over batches read by its
data layers, saved per image.

As Caffe does, each blob goes to its own LMDB: one ``Datum`` per image, keyed ``%010d`` (the
image's index), its ``float_data`` the blob's values in Caffe's (C, H, W) order with
``channels``/``height``/``width`` set (1 for the axes a 2-D blob lacks). ``.npz`` output keeps
every blob in one file instead, as ``(N, C[, H, W])`` float32 arrays named by the blob.
Nothing is written until every batch has run; each database is written to a temporary folder
and renamed, so an error leaves no half-written output.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict, List, Sequence

import numpy as np

from keras_cct._files import atomic_path
from keras_cct.caffe.io import proto
from keras_cct.caffe.io.filter import filter_net
from keras_cct.caffe.io.text import read_net
from keras_cct.caffe.io.types import DATA_TYPES
from keras_cct.caffe.io.lmdb_io import write_datums
from keras_cct.caffe.tools.mean import progress_bar
from keras_cct.errors import CaffeFormatError, DataError, KerasCCTError

__all__ = ["extract_features", "save_features", "features_to_datums"]

DB_TYPES = ("lmdb", "npz")


def _check_net(model_path: str, stages: Sequence[str]) -> None:
    fp = filter_net(read_net(model_path), phase="TEST", stages=list(stages))
    if not any(lp.type in DATA_TYPES and lp.type != "Input" for lp in fp.layer):
        raise CaffeFormatError(
            "the TEST net has no data layer, so there are no images to extract features of",
            path=model_path, hint="give a net whose Data/ImageData/HDF5Data layer reads the "
                                  "images (Caffe's extract_features needs one too)")


def extract_features(model_path: str, weights: str, blobs: Sequence[str], batches: int, *,
                     stages: Sequence[str] = (), progress: bool = False
                     ) -> Dict[str, np.ndarray]:
    """``{blob: (N, C[, H, W]) float32}`` over ``batches`` mini-batches of the TEST net's data
    layers, with ``weights`` loaded (Caffe's ``CopyTrainedLayersFrom``)."""
    if batches <= 0:
        raise KerasCCTError(f"num_mini_batches {batches}: give a positive number of batches")
    if not blobs:
        raise KerasCCTError("no blob names: give them as conv5,fc7")
    _check_net(model_path, stages)
    from keras_cct.caffe.net.layout import to_caffe_perm  # Keras from here on
    from keras_cct.caffe.train.data import merge_batches
    from keras_cct.caffe.train.model import build_phase_net
    model, sources, net = build_phase_net(model_path, phase="TEST", stages=stages,
                                          weights=weights)
    missing = [b for b in blobs if b not in net.blobs]
    if missing:
        raise CaffeFormatError(f"the TEST net has no blob {', '.join(map(repr, missing))}",
                               path=model_path,
                               hint=f"its blobs are {', '.join(sorted(net.blobs))}")
    sub = net.submodel(list(blobs))
    feed_names = list(model.input_blobs)
    out: Dict[str, List[np.ndarray]] = {b: [] for b in blobs}
    stream = merge_batches(sources)
    for _ in progress_bar(range(batches), batches, show=progress, unit="batch",
                          desc="features"):
        batch = next(stream)
        feed = [batch[k] for k in feed_names]
        values = sub.predict_on_batch(feed if len(feed) > 1 else feed[0])
        values = values if isinstance(values, (list, tuple)) else [values]
        for b, v in zip(blobs, values):
            v = np.asarray(v, np.float32)
            out[b].append(np.transpose(v, to_caffe_perm(v.ndim)))
    return {b: np.concatenate(v) for b, v in out.items()}


def features_to_datums(array: np.ndarray):
    """``(key, Datum)`` per image of an ``(N, C[, H, W])`` array, as extract_features writes."""
    for i, item in enumerate(np.asarray(array, np.float32)):
        dims = tuple(item.shape) + (1,) * (3 - item.ndim)
        datum = proto.Datum(channels=int(dims[0]), height=int(dims[1]), width=int(dims[2]))
        datum.float_data.extend(item.ravel().tolist())
        yield f"{i:010d}", datum


def check_outputs(outputs: Sequence[str], blobs: Sequence[str], db_type: str,
                  overwrite: bool = False) -> None:
    """Before any work: one output per blob (LMDB) or one .npz, none existing (unless
    ``overwrite``), their folders writable."""
    from keras_cct._args import check_output_dir, check_output_file
    if db_type not in DB_TYPES:
        hint = "write LMDB (Caffe's default) or npz" if db_type == "leveldb" else \
            f"use one of {', '.join(DB_TYPES)}"
        raise KerasCCTError(f"db_type {db_type!r} is not supported; {hint}")
    if db_type == "npz":
        if len(outputs) != 1 or not outputs[0].endswith(".npz"):
            raise KerasCCTError(f"db_type npz writes one file ending in .npz; got "
                                f"{','.join(outputs)}")
        check_output_file(outputs[0], "the .npz")
        return
    if len(outputs) != len(blobs):
        raise KerasCCTError(f"{len(blobs)} blob names ({','.join(blobs)}) but {len(outputs)} "
                            f"dataset names ({','.join(outputs)}); give one LMDB per blob")
    for out in outputs:
        if os.path.exists(os.path.join(out, "data.mdb")) and not overwrite:
            raise DataError("an LMDB already exists there", path=out,
                            hint="remove it, choose another name, or pass --overwrite")
        check_output_dir(out, "the dataset")


def save_features(features: Dict[str, np.ndarray], outputs: Sequence[str], db_type: str,
                  overwrite: bool = False) -> None:
    """Write the features as :func:`extract_features` computed them (see the module
    docstring)."""
    if db_type == "npz":
        with atomic_path(outputs[0], suffix=".npz") as tmp:
            np.savez(tmp, **features)
        return
    for (blob, array), out in zip(features.items(), outputs):
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
        try:
            write_datums(tmp, features_to_datums(array))
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; give the usual mode
            if os.path.exists(out) and overwrite:
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
