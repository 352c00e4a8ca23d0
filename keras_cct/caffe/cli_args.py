"""Argument checks of ``cct train / test / time / data``, done before any net is built or any
data is read (see :mod:`keras_cct._args` for the generic ones). Each raises a one-line typed
error naming the argument and how to fix it."""

from __future__ import annotations

import argparse
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from keras_cct._args import check_device_name, check_input_shapes, check_output_dir
from keras_cct.errors import DataError, KerasCCTError


def device_names(devices: Optional[str]) -> List[str]:
    """``--devices a,b,c`` as a list of names (empty when not given)."""
    return [d.strip() for d in (devices or "").split(",") if d.strip()]


def check_one_device(devices: Optional[str]) -> None:
    """``--devices`` of a command that runs one net on one device: one name, that exists."""
    names = device_names(devices)
    if devices is not None and not names:
        raise KerasCCTError("--devices is empty; give a device such as opencl:0:0 (see "
                            "`cct devices`)")
    if len(names) > 1:
        raise KerasCCTError(
            f"--devices {devices}: several devices are supported by `cct train` (a "
            f"CCTStrategy splits each convolution's batch); this command runs one net on "
            f"one device: give one name")
    if names:
        check_device_name(names[0])


def parse_shapes(items) -> Dict[str, Tuple[int, ...]]:
    """``--input-shape NAME=N,C,H,W`` (repeatable) as ``{name: dims}``."""
    shapes = {}
    for item in items or ():
        name, _, dims = item.partition("=")
        try:
            shapes[name.strip()] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise KerasCCTError(f"--input-shape {item!r}: expected NAME=N,C,H,W") from None
        if not name.strip() or not shapes[name.strip()]:
            raise KerasCCTError(f"--input-shape {item!r}: expected NAME=N,C,H,W")
    return shapes


def check_time_shapes(args: argparse.Namespace, shapes: dict) -> None:
    """``cct time --input-shape``: every name is an input or data-layer top of the net, every
    dim positive; without ``--random-data`` the data layers read batches of their own
    ``batch_size``, so an ``--input-shape`` of another batch for one of their tops cannot be
    fed (say so before building)."""
    if not shapes:
        return
    from keras_cct.caffe.builder import DATA_TYPES
    from keras_cct.caffe.data import _layer_batch
    from keras_cct.caffe.prototxt import filter_net, read_net
    fp = filter_net(read_net(args.model), phase=args.phase, stages=list(args.stage or ()))
    known = list(fp.input)
    for lp in fp.layer:
        if lp.type == "Input" or lp.type in DATA_TYPES:
            known += [t for t in lp.top if t not in known]
    check_input_shapes(shapes, known)
    if args.random_data:
        return
    for lp in fp.layer:
        if lp.type in DATA_TYPES:
            bs = _layer_batch(lp)  # 0 for the layers that read no source
            for top in lp.top:
                if top in shapes and bs and shapes[top][0] != bs:
                    raise KerasCCTError(
                        f"--input-shape {top}={','.join(map(str, shapes[top]))}: the {lp.type} "
                        f"layer '{lp.name}' reads batches of {bs} from its source; add "
                        f"--random-data to time the net at batch {shapes[top][0]}")


def check_snapshot_folder(solver) -> None:
    """The folder of the solver's ``snapshot_prefix`` can be written (checked before training,
    not at the first snapshot after it ran)."""
    p = solver.param
    if not (p.snapshot > 0 or p.snapshot_after_train):
        return
    prefix = solver.snapshot_prefix
    folder = os.path.dirname(os.path.abspath(prefix + "_")) or "."
    try:
        check_output_dir(folder, "snapshot_prefix")
    except KerasCCTError as exc:
        raise KerasCCTError(f"{exc} (snapshot_prefix {prefix!r}: set --snapshot-prefix or the "
                            f"solver's snapshot_prefix to a writable folder)") from None


def load_npz(path: str) -> Tuple[np.ndarray, np.ndarray]:
    """The images and labels of ``cct data ARRAYS.npz``, checked: (N, H, W[, C]) images, one
    label per image, at least one image."""
    try:
        data = np.load(path)
        keys = set(data.files)
    except Exception as exc:  # empty, truncated, not a zip, pickled objects
        raise DataError(f"cannot read the arrays: {type(exc).__name__}: {exc}", path=path,
                        hint="write it with numpy.savez(path, images=..., labels=...)") from None
    ik = next((k for k in ("images", "x", "data") if k in keys), None)
    lk = next((k for k in ("labels", "y", "label") if k in keys), None)
    if ik is None or lk is None:
        raise DataError(f"the .npz must hold images ('images'/'x'/'data') and labels "
                        f"('labels'/'y'/'label'); it has {sorted(keys)}", path=path)
    try:
        images, labels = np.asarray(data[ik]), np.asarray(data[lk])
    except Exception as exc:
        raise DataError(f"cannot read the arrays: {type(exc).__name__}: {exc}",
                        path=path) from None
    if images.ndim not in (3, 4):
        raise DataError(f"'{ik}' has shape {images.shape}; expected (N, H, W) or "
                        f"(N, H, W, C) images", path=path)
    if len(images) == 0:
        raise DataError(f"'{ik}' holds no images", path=path)
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(f"{len(images)} images but labels of shape {labels.shape}; give one "
                        f"label per image", path=path)
    if not np.issubdtype(labels.dtype, np.number):
        raise DataError(f"the labels are {labels.dtype}, not numbers", path=path)
    return images, labels


def check_data_args(args: argparse.Namespace) -> None:
    """``cct data``: both resize sizes or neither, the source exists, the DB folder and
    ``--mean`` file can be written."""
    from keras_cct._args import check_output_file
    if bool(args.resize_height) != bool(args.resize_width):
        raise KerasCCTError(f"--resize-height {args.resize_height} --resize-width "
                            f"{args.resize_width}: give both sizes (or neither)")
    if not os.path.exists(args.source):
        raise DataError("not found", path=args.source,
                        hint="give a folder of images or a .npz of arrays")
    if os.path.isfile(args.source) and not args.source.endswith(".npz"):
        raise DataError("is a file but not a .npz of arrays", path=args.source,
                        hint="give a folder of images (FOLDER/<class>/<image>, or --list) or "
                             "a .npz with images and labels")
    if args.list is not None and not os.path.isfile(args.list):
        raise DataError("list file not found", path=args.list,
                        hint="--list names a file of 'path label' lines")
    check_output_dir(args.db, "DB")
    if args.mean:
        check_output_file(args.mean, "--mean")
