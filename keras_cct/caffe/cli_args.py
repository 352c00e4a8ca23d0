"""Argument checks of ``cct train / test / time / data``, done before any net is built or any
data is read (see :mod:`keras_cct._args` for the generic ones). Each raises a one-line typed
error naming the argument and how to fix it."""

from __future__ import annotations

import argparse
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from keras_cct._args import (check_device_name, check_input_shapes, check_output_dir,
                             check_output_file)
from keras_cct.caffe.io.filter import filter_net
from keras_cct.caffe.io.text import read_net
from keras_cct.caffe.io.types import DATA_TYPES
from keras_cct.caffe.io.validate import max_bytes
from keras_cct.caffe.train.data import layer_batch
from keras_cct.errors import DataError, KerasCCTError


def add_python_layers_flag(p: argparse.ArgumentParser) -> None:
    """``--python-layers``: build the net's ``Python`` layers (import their modules and run
    their code). Off by default: such a net is refused, naming the module and class."""
    p.add_argument("--python-layers", dest="python_layers", action="store_true",
                   help="run the net's Python layers (imports python_param.module: only for "
                        "files and modules you trust)")


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


#: Data layers whose blob shapes come from reading their source (the others, MemoryData and
#: DummyData, declare them).
_SOURCE_TYPES = tuple(t for t in DATA_TYPES if t not in ("MemoryData", "DummyData"))


def _input_dims(fp) -> Dict[str, Tuple[int, ...]]:
    """The Caffe shapes the net's Input layers (and legacy ``input:`` fields) declare."""
    dims: Dict[str, Tuple[int, ...]] = {}
    for lp in fp.layer:
        if lp.type == "Input":
            for i, top in enumerate(lp.top):
                shp = lp.input_param.shape
                if len(shp):
                    dims[top] = tuple(int(d) for d in shp[min(i, len(shp) - 1)].dim)
    legacy = [tuple(int(d) for d in s.dim) for s in fp.input_shape] or \
        [tuple(int(d) for d in fp.input_dim[i:i + 4]) for i in range(0, len(fp.input_dim), 4)]
    for name, shp in zip(fp.input, legacy):
        dims.setdefault(name, shp)
    return dims


def check_time_inputs(args: argparse.Namespace, shapes: dict) -> bool:
    """``cct time``'s inputs, checked before building; returns whether to feed random data.

    * every ``--input-shape`` name is an input or data-layer top of the net, every dim
      positive;
    * without ``--random-data`` the data layers read batches of their own ``batch_size``, so
      an ``--input-shape`` of another batch for one of their tops cannot be fed;
    * a net without data layers (a deploy net: Input layers only) is timed on random data, as
      ``caffe time`` does;
    * ``--batch`` times the inputs' size stays under the memory bound of the Caffe readers
      (``KERAS_CCT_CAFFE_MAX_BYTES``)."""
    fp = filter_net(read_net(args.model), phase=args.phase, stages=list(args.stage or ()))
    inputs = _input_dims(fp)
    known = list(fp.input)
    for lp in fp.layer:
        if lp.type == "Input" or lp.type in DATA_TYPES:
            known += [t for t in lp.top if t not in known]
    check_input_shapes(shapes, known)
    data_layers = [lp for lp in fp.layer if lp.type in DATA_TYPES]
    random_data = bool(args.random_data or not data_layers)
    if random_data:  # the sources are not read: their image tops need a shape
        for lp in data_layers:
            if lp.type in _SOURCE_TYPES and lp.top and lp.top[0] not in shapes:
                raise KerasCCTError(
                    f"--random-data: the {lp.type} layer '{lp.name}' is not read, so its top "
                    f"'{lp.top[0]}' needs a shape: add --input-shape {lp.top[0]}=N,C,H,W")
    if args.batch:
        need = 0
        for top, dims in {**inputs, **shapes}.items():
            need += args.batch * int(np.prod(dims[1:], dtype=np.int64)) * 4
        if need > max_bytes():
            raise KerasCCTError(
                f"--batch {args.batch}: the random inputs would need {need / (1 << 30):.3g} GiB, "
                f"more than the {max_bytes() / (1 << 30):.3g} GiB allowed; give a smaller "
                f"batch (or raise KERAS_CCT_CAFFE_MAX_BYTES)")
    if random_data:
        return True
    for lp in data_layers:
        bs = layer_batch(lp)  # 0 for the layers that read no source
        for top in lp.top:
            if top in shapes and bs and shapes[top][0] != bs:
                raise KerasCCTError(
                    f"--input-shape {top}={','.join(map(str, shapes[top]))}: the {lp.type} "
                    f"layer '{lp.name}' reads batches of {bs} from its source; add "
                    f"--random-data to time the net at batch {shapes[top][0]}")
    return False


def check_test_net(args: argparse.Namespace) -> None:
    """``cct test`` scores batches read by the net's data layers: a net whose inputs are only
    Input blobs (a deploy net) has nothing to score."""
    fp = filter_net(read_net(args.model), phase=args.phase, stages=list(args.stage or ()))
    inputs = _input_dims(fp)
    if inputs and not any(lp.type in DATA_TYPES for lp in fp.layer):
        raise KerasCCTError(
            f"--model {args.model}: the {args.phase} net has no data layer (only the input "
            f"blob(s) {', '.join(inputs)}), so there is nothing to score; give the "
            f"train_val prototxt, whose Data/ImageData/HDF5Data layers read the test set")


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


def caffe_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add ``--name`` with Caffe's spellings too (gflags: ``-name``, ``--name``, words joined by
    ``_``), so Caffe command lines work as pasted (``-solver s.prototxt``,
    ``--sigint_effect=stop``); ``dest`` is the name with ``_``."""
    under = name.replace("-", "_")
    spellings = [f"--{name}"]
    for s in (f"--{under}", f"-{under}", f"-{name}"):
        if s not in spellings:
            spellings.append(s)
    kwargs.setdefault("dest", under)
    parser.add_argument(*spellings, **kwargs)


def weight_files(weights: Optional[str]) -> List[str]:
    """``-weights a.caffemodel,b.caffemodel`` as a list (Caffe's ``CopyLayers`` loads them in
    order, a later file's layers over an earlier one's); each must exist."""
    names = [w.strip() for w in (weights or "").split(",") if w.strip()]
    if weights is not None and not names:
        raise KerasCCTError("--weights is empty; give a .caffemodel (or several, a,b)")
    for w in names:
        if not os.path.isfile(w):
            raise DataError("weights file not found", path=w,
                            hint="-weights takes .caffemodel files separated by commas")
    return names


def ignored_flags(args: argparse.Namespace, command: str) -> None:
    """Caffe flags a command accepts but does not use (gflags are global, so ``caffe train``
    ignores ``-model``...): a note on stderr for each one given."""
    import sys
    notes = {
        "gpu": "keras_cct runs on the Keras backend's device (CUDA_VISIBLE_DEVICES picks the "
               "GPU; --devices an OpenCL device; see `cct devices`)",
        "model": "caffe train reads the net the solver names",
        "iterations": "caffe train runs the solver's max_iter",
    }
    for name, why in notes.items():
        value = getattr(args, f"ignored_{name}", None)
        if value is not None:
            print(f"cct {command}: note: -{name} {value} ignored: {why}", file=sys.stderr,
                  flush=True)
