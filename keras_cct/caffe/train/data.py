"""Caffe's data layers as input pipelines (numpy readers wrapped in prefetching ``tf.data``).

Each data layer of a net (``Data`` from LMDB, ``ImageData``, ``HDF5Data``, ``MemoryData``,
``Input``, ``WindowData``: :mod:`keras_cct.caffe.train.window_data`) becomes a :class:`DataSource`: an endless iterator of batches ``{top: array}`` in
channels-last layout (images ``(N, H, W, C)`` float32, labels ``(N,)`` float32 as Caffe's label
blobs), read in Caffe's order (LMDB key order, list-file order, cycling at the end) and
transformed exactly as Caffe's ``DataTransformer``:

* ``crop_size``: random offsets in TRAIN, the centre in TEST;
* ``mirror``: a random horizontal flip (probability 1/2, in both phases, as Caffe does);
* ``mean_file`` (a .binaryproto the size of the un-cropped image, cropped at the same offsets)
  or ``mean_value`` (one value, or one per channel), subtracted before ``scale`` multiplies:
  ``out = (pixel - mean) * scale``.

:meth:`DataSource.dataset` returns the ``tf.data.Dataset`` (prefetching in a background
thread); :meth:`DataSource.batches` is the plain Python iterator.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.binary import blob_to_array, read_binaryproto
from keras_cct.caffe.io.lmdb_io import DatumReader, datum_to_array, read_image, read_image_list
from keras_cct.caffe.train import window_data
from keras_cct.errors import CaffeFormatError, DataError

PathLike = Union[str, os.PathLike]

__all__ = ["DataTransformer", "DataSource", "data_source", "net_data_sources",
           "resolve_path", "merge_batches", "skip_batches", "layer_batch"]


def resolve_path(path: str, base_dirs: Sequence[PathLike] = ()) -> str:
    """Find a file a Caffe file names: as given (relative to the working directory, as Caffe
    does), else relative to each of ``base_dirs``, else its last part in ``base_dirs`` (Caffe's
    examples name ``examples/mnist/...`` relative to Caffe's root). Returns the first that
    exists, or ``path`` unchanged."""
    if not path:
        return path
    if os.path.exists(path) or os.path.isabs(path):
        return path
    for base in base_dirs:
        cand = os.path.join(str(base), path)
        if os.path.exists(cand):
            return cand
    name = os.path.basename(path.rstrip("/"))
    for base in base_dirs:
        cand = os.path.join(str(base), name)
        if os.path.exists(cand):
            return cand
    return path


def _phase_name(phase) -> str:
    if isinstance(phase, str):
        p = phase.upper()
    else:
        p = "TRAIN" if int(phase) == proto.TRAIN else "TEST"
    if p not in ("TRAIN", "TEST"):
        raise CaffeFormatError(f"phase must be 'TRAIN' or 'TEST', got {phase!r}")
    return p


class DataTransformer:
    """Caffe's ``DataTransformer`` on one channels-last image.

    Args:
        param: a ``TransformationParameter``.
        phase: ``"TRAIN"`` (random crop) or ``"TEST"`` (centre crop).
        base_dirs: where to look for ``mean_file``.
        seed: seed of the crop/mirror random generator.
        layer: the layer name, for error messages.
    """

    def __init__(self, param=None, phase: str = "TEST", *, base_dirs: Sequence[PathLike] = (),
                 seed: Optional[int] = None, layer: Optional[str] = None) -> None:
        param = param if param is not None else proto.TransformationParameter()
        self.phase = _phase_name(phase)
        self.scale = float(param.scale)
        self.mirror = bool(param.mirror)
        self.crop_size = int(param.crop_size)
        self.force_color = bool(param.force_color)
        self.force_gray = bool(param.force_gray)
        self.layer = layer
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.mean: Optional[np.ndarray] = None  # HWC, from mean_file
        self.mean_values: Optional[np.ndarray] = None
        if param.mean_file and len(param.mean_value):
            raise CaffeFormatError("transform_param sets both mean_file and mean_value",
                                   layer=layer, hint="keep only one (Caffe refuses both)")
        if param.mean_file:
            path = resolve_path(param.mean_file, base_dirs)
            if not os.path.exists(path):
                raise DataError("mean_file not found", path=param.mean_file, layer=layer,
                                hint="fix transform_param.mean_file (Caffe resolves it from "
                                     "the working directory)")
            arr = blob_to_array(read_binaryproto(path))
            if arr.ndim == 4:
                arr = arr[0]
            if arr.ndim != 3:
                raise DataError(f"mean_file blob has shape {arr.shape}, expected (1, C, H, W)",
                                path=path, layer=layer)
            self.mean = arr.transpose(1, 2, 0).astype(np.float32)
            self.mean_path = path
        elif len(param.mean_value):
            self.mean_values = np.asarray(param.mean_value, np.float32)

    def fresh(self) -> "DataTransformer":
        """A copy whose random generator restarts from the seed (each pass over a source
        starts the same random crop/mirror sequence, so resumed runs stay in step)."""
        other = copy.copy(self)
        other.rng = np.random.default_rng(self.seed)
        return other

    @property
    def is_random(self) -> bool:
        return self.mirror or (self.crop_size > 0 and self.phase == "TRAIN")

    def output_shape(self, shape: Tuple[int, int, int]) -> Tuple[int, int, int]:
        """The transformed shape of an ``(H, W, C)`` image."""
        h, w, c = shape
        if self.crop_size:
            return (self.crop_size, self.crop_size, c)
        return (h, w, c)

    def __call__(self, img: np.ndarray, *, where: Optional[str] = None) -> np.ndarray:
        h, w, c = img.shape
        do_mirror = self.mirror and bool(self.rng.integers(2))
        h_off = w_off = 0
        ch = cw = None
        if self.crop_size:
            ch = cw = self.crop_size
            if ch > h or cw > w:
                raise DataError(f"crop_size {self.crop_size} is larger than the image "
                                f"({h}x{w})", layer=self.layer, path=where)
            if self.phase == "TRAIN":
                h_off = int(self.rng.integers(h - ch + 1))
                w_off = int(self.rng.integers(w - cw + 1))
            else:
                h_off, w_off = (h - ch) // 2, (w - cw) // 2
        else:
            ch, cw = h, w
        out = img[h_off:h_off + ch, w_off:w_off + cw, :].astype(np.float32)
        if self.mean is not None:
            if self.mean.shape != (h, w, c):
                raise DataError(
                    f"mean_file has shape (C, H, W) = {self.mean.shape[2], *self.mean.shape[:2]}"
                    f" but the data is {(c, h, w)}", path=self.mean_path, layer=self.layer,
                    hint="compute the mean of this dataset (cct data --mean)")
            out -= self.mean[h_off:h_off + ch, w_off:w_off + cw, :]
        elif self.mean_values is not None:
            mv = self.mean_values
            if mv.size not in (1, c):
                raise DataError(f"{mv.size} mean_value entries for {c} channels",
                                layer=self.layer, hint="give one value or one per channel")
            out -= mv.reshape(1, 1, -1)
        if self.scale != 1.0:
            out *= np.float32(self.scale)
        if do_mirror:
            out = out[:, ::-1, :]
        return out


@dataclass
class DataSource:
    """One data layer's endless stream of batches.

    Attributes:
        name: the layer name; type: its Caffe type; tops: the blobs it produces.
        batch_size: images per batch.
        shapes: per-sample channels-last shape of each top (labels ``()``).
        size: the number of records (one epoch), when known.
    """

    name: str
    type: str
    tops: List[str]
    batch_size: int
    shapes: Dict[str, Tuple[int, ...]]
    size: Optional[int] = None
    _make: Optional[Callable[[], Iterator[Dict[str, np.ndarray]]]] = field(default=None,
                                                                          repr=False)

    def batches(self) -> Iterator[Dict[str, np.ndarray]]:
        """An endless iterator of ``{top: array}`` batches (restarts at the end like Caffe)."""
        return self._make()

    def dataset(self, prefetch: int = 4):
        """The batches as a prefetching ``tf.data.Dataset``."""
        import tensorflow as tf  # heavy and optional: only this method needs it
        sig = {t: tf.TensorSpec((self.batch_size,) + tuple(s), tf.float32)
               for t, s in self.shapes.items()}
        ds = tf.data.Dataset.from_generator(self.batches, output_signature=sig)
        return ds.prefetch(prefetch)


def _batched(records: Callable[[], Iterator[Tuple[np.ndarray, float, str]]], batch_size: int,
             transform: Optional[DataTransformer], tops: Sequence[str], where: str,
             ) -> Iterator[Dict[str, np.ndarray]]:
    """Group an endless record stream into batches, transforming each image."""
    it = records()
    transform = transform.fresh() if transform is not None else None
    while True:
        imgs, labels = [], []
        for _ in range(batch_size):
            img, label, key = next(it)
            imgs.append(transform(img, where=where) if transform else img.astype(np.float32))
            labels.append(label)
        batch = {tops[0]: np.stack(imgs).astype(np.float32, copy=False)}
        if len(tops) > 1:
            batch[tops[1]] = np.asarray(labels, np.float32)
        yield batch


def _cycle(make_once: Callable[[], Iterator], where: str, skip: int = 0) -> Iterator:
    first = True
    while True:
        n = 0
        for item in make_once():
            if first and skip:
                skip -= 1
                continue
            n += 1
            yield item
        first = False
        if n == 0:
            raise DataError("the data source yields no records", path=where)


def _lmdb_source(layer, phase, base_dirs, seed) -> DataSource:
    p = layer.data_param
    if not p.source:
        raise CaffeFormatError("data_param.source is empty", layer=layer.name,
                               hint="name the LMDB folder in data_param.source")
    if p.HasField("backend") and p.backend == proto.DataParameter.LEVELDB:
        # Caffe's default is LEVELDB; many nets leave it unset but point at an LMDB.
        src = resolve_path(p.source, base_dirs)
        if not os.path.exists(os.path.join(src, "data.mdb")):
            raise DataError("LevelDB datasets are not supported", path=p.source,
                            layer=layer.name, hint="convert it to LMDB (cct data) and set "
                                                   "backend: LMDB")
    path = resolve_path(p.source, base_dirs)
    if not p.batch_size:
        raise CaffeFormatError("data_param.batch_size is 0", layer=layer.name,
                               hint="set data_param.batch_size")
    reader = DatumReader(path)
    tp = layer.transform_param
    transform = DataTransformer(tp, phase, base_dirs=base_dirs, seed=seed, layer=layer.name)
    key0, datum0 = reader.first()
    img0 = datum_to_array(datum0, path=path, key=key0, force_color=tp.force_color,
                          force_gray=tp.force_gray)
    transform(img0, where=path)  # validates mean/crop against the data before training
    tops = list(layer.top)
    shapes = {tops[0]: transform.output_shape(img0.shape)}
    if len(tops) > 1:
        shapes[tops[1]] = ()

    def records():
        def once():
            for k, arr, label in reader.arrays(force_color=tp.force_color,
                                               force_gray=tp.force_gray):
                if arr.shape != img0.shape:
                    raise DataError(f"record has shape {arr.shape}, the first record "
                                    f"{img0.shape}", path=path, layer=f"record {k!r}",
                                    hint="all images of a Data layer must have one size "
                                         "(resize when converting)")
                yield arr, float(label), k
        return _cycle(once, path, int(p.rand_skip))

    return DataSource(layer.name, "Data", tops, int(p.batch_size), shapes, len(reader),
                      lambda: _batched(records, int(p.batch_size), transform, tops, path))


def _image_data_source(layer, phase, base_dirs, seed) -> DataSource:
    p = layer.image_data_param
    listfile = resolve_path(p.source, base_dirs)
    items = read_image_list(listfile)
    root = p.root_folder
    tp = layer.transform_param
    transform = DataTransformer(tp, phase, base_dirs=base_dirs, seed=seed, layer=layer.name)
    nh, nw = int(p.new_height), int(p.new_width)
    if (nh > 0) != (nw > 0):
        raise CaffeFormatError("image_data_param needs both new_height and new_width",
                               layer=layer.name)
    lines = {i: i + 1 for i in range(len(items))}

    def load(i):
        name, label = items[i]
        return read_image(os.path.join(root, name) if root else name, is_color=p.is_color,
                          new_height=nh, new_width=nw, line=lines[i], listfile=listfile)

    img0 = load(0)
    transform(img0, where=listfile)
    tops = list(layer.top)
    shapes = {tops[0]: transform.output_shape(img0.shape)}
    if len(tops) > 1:
        shapes[tops[1]] = ()
    def records():
        rng = np.random.default_rng(seed)

        def once():
            order = np.arange(len(items))
            if p.shuffle:
                rng.shuffle(order)
            for i in order:
                img = load(int(i))
                if img.shape != img0.shape:
                    raise DataError(f"image has shape {img.shape}, the first {img0.shape}",
                                    path=listfile, line=lines[int(i)],
                                    hint="set new_height/new_width to resize all images")
                yield img, float(items[int(i)][1]), items[int(i)][0]
        return _cycle(once, listfile, int(p.rand_skip))

    bs = int(p.batch_size)
    return DataSource(layer.name, "ImageData", tops, bs, shapes, len(items),
                      lambda: _batched(records, bs, transform, tops, listfile))


def _hdf5_source(layer, phase, base_dirs, seed) -> DataSource:
    import h5py  # optional and heavy: imported only for an HDF5Data layer
    p = layer.hdf5_data_param
    listfile = resolve_path(p.source, base_dirs)
    try:
        names = [ln.strip() for ln in Path(listfile).read_text().splitlines() if ln.strip()]
    except OSError as exc:
        raise DataError(f"cannot read the HDF5 file list: {exc.strerror}", path=listfile,
                        layer=layer.name, hint="data_param.source lists .h5 files") from None
    if not names:
        raise DataError("the HDF5 file list is empty", path=listfile, layer=layer.name)
    files = [resolve_path(n, [os.path.dirname(listfile)] + list(base_dirs)) for n in names]
    tops = list(layer.top)

    def load(path):
        try:
            with h5py.File(path, "r") as f:
                out = {}
                for t in tops:
                    if t not in f:
                        raise DataError(f"the file has no dataset {t!r} (has "
                                        f"{sorted(f.keys())})", path=path, layer=layer.name)
                    arr = np.asarray(f[t], np.float32)
                    out[t] = arr.transpose(0, 2, 3, 1) if arr.ndim == 4 else arr
        except OSError as exc:
            raise DataError(f"cannot read the HDF5 file: {exc}", path=path,
                            layer=layer.name) from None
        n = {len(a) for a in out.values()}
        if len(n) != 1:
            raise DataError(f"datasets have different lengths {sorted(n)}", path=path,
                            layer=layer.name)
        return out

    first = load(files[0])
    shapes = {t: tuple(a.shape[1:]) for t, a in first.items()}
    for t in tops:
        if len(shapes[t]) == 1 and shapes[t][0] == 1:
            shapes[t] = ()
    bs = int(p.batch_size)

    def gen():
        rng = np.random.default_rng(seed)
        buf: Dict[str, List[np.ndarray]] = {t: [] for t in tops}
        count = 0
        while True:
            order = list(range(len(files)))
            if p.shuffle:
                rng.shuffle(order)
            for fi in order:
                data = load(files[fi])
                rows = np.arange(len(data[tops[0]]))
                if p.shuffle:
                    rng.shuffle(rows)
                for r in rows:
                    for t in tops:
                        buf[t].append(data[t][r].reshape(shapes[t]))
                    count += 1
                    if count == bs:
                        yield {t: np.stack(v).astype(np.float32) for t, v in buf.items()}
                        buf = {t: [] for t in tops}
                        count = 0

    return DataSource(layer.name, "HDF5Data", tops, bs, shapes, None, gen)


def _memory_source(layer, arrays: Optional[Mapping[str, np.ndarray]], seed,
                   phase) -> DataSource:
    tops = list(layer.top)
    if layer.type == "MemoryData":
        p = layer.memory_data_param
        bs = int(p.batch_size)
        sample = (int(p.height), int(p.width), int(p.channels))
    else:  # Input
        shape = tuple(int(d) for d in layer.input_param.shape[0].dim) \
            if len(layer.input_param.shape) else None
        bs = shape[0] if shape else 0
        sample = (shape[2], shape[3], shape[1]) if shape and len(shape) == 4 else \
            (tuple(shape[1:]) if shape else None)
    if arrays is None or tops[0] not in arrays:
        raise DataError(f"the {layer.type} layer needs arrays for {tops}", layer=layer.name,
                        hint="pass them: Solver(..., arrays={'data': x, 'label': y})")
    data = {t: np.asarray(arrays[t], np.float32) for t in tops if t in arrays}
    n = {len(a) for a in data.values()}
    if len(n) != 1:
        raise DataError(f"arrays for {tops} have different lengths {sorted(n)}",
                        layer=layer.name)
    n = n.pop()
    shapes = {t: tuple(a.shape[1:]) for t, a in data.items()}
    if layer.type == "MemoryData" and sample != shapes[tops[0]] and all(sample):
        raise DataError(f"MemoryData expects images of (H, W, C) = {sample}, got "
                        f"{shapes[tops[0]]}", layer=layer.name)
    bs = bs or min(n, 64)
    tp = layer.transform_param if layer.HasField("transform_param") else None
    transform = DataTransformer(tp, phase, seed=seed, layer=layer.name) if tp else None
    if transform is not None:
        shapes[tops[0]] = transform.output_shape(shapes[tops[0]])

    def gen():
        i = 0
        tr = transform.fresh() if transform is not None else None
        while True:
            idx = [(i + k) % n for k in range(bs)]
            i = (i + bs) % n
            batch = {t: a[idx] for t, a in data.items()}
            if transform is not None:
                batch[tops[0]] = np.stack([tr(img) for img in batch[tops[0]]])
            yield batch

    return DataSource(layer.name, layer.type, tops, bs, shapes, n, gen)


#: the data layers read from files, by type
def _window_data_source(layer, phase, base_dirs, seed) -> DataSource:
    """WindowData (:mod:`keras_cct.caffe.train.window_data`); its mean and crop/mirror from
    ``transform_param``, ``scale`` from ``window_data_param`` (as Caffe's layer reads them)."""
    p = layer.window_data_param
    where = resolve_path(p.source, base_dirs)
    tp = layer.transform_param
    if tp.crop_size <= 0 or not p.batch_size:
        raise CaffeFormatError("WindowData needs transform_param.crop_size > 0 and "
                               "window_data_param.batch_size > 0", layer=layer.name)
    if p.crop_mode not in ("warp", "square"):
        raise CaffeFormatError(f"window_data_param.crop_mode {p.crop_mode!r} is not 'warp' or "
                               f"'square'", layer=layer.name)
    transform = DataTransformer(tp, phase, base_dirs=base_dirs, seed=seed, layer=layer.name)
    images, windows = window_data.read_window_file(where, p.root_folder)
    fg, bg = window_data.split_windows(windows, p.fg_threshold, p.bg_threshold, path=where)
    kw = dict(batch_size=int(p.batch_size), crop_size=int(tp.crop_size),
              fg_fraction=float(p.fg_fraction), context_pad=int(p.context_pad),
              square=p.crop_mode == "square", mirror=bool(tp.mirror), scale=float(p.scale),
              mean=transform.mean, mean_values=transform.mean_values, seed=seed, where=where)
    tops = list(layer.top)
    channels = next(iter(images.values()))[1][0] if images else 3
    shapes = {tops[0]: (int(tp.crop_size), int(tp.crop_size), 3)}
    if channels != 3:
        raise DataError(f"the window file says {channels} channels; WindowData reads color "
                        f"(3-channel) images", path=where)
    if len(tops) > 1:
        shapes[tops[1]] = ()

    def batches():
        for data, label in window_data.window_batches(images, fg, bg, **kw):
            yield dict(zip(tops, (data, label)))
    return DataSource(layer.name, "WindowData", tops, int(p.batch_size), shapes, None, batches)


_FILE_READERS = {"Data": _lmdb_source, "ImageData": _image_data_source,
                 "HDF5Data": _hdf5_source, "WindowData": _window_data_source}
#: the layer types a :class:`DataSource` reads (files, then arrays)
READ_TYPES = tuple(_FILE_READERS) + ("MemoryData", "Input")


def data_source(layer, *, phase="TRAIN", base_dirs: Sequence[PathLike] = (),
                seed: Optional[int] = None,
                arrays: Optional[Mapping[str, np.ndarray]] = None) -> DataSource:
    """The :class:`DataSource` of one data ``LayerParameter``.

    Args:
        layer: a ``LayerParameter`` of type Data, ImageData, HDF5Data, MemoryData or Input.
        phase: ``"TRAIN"`` or ``"TEST"`` (crop randomness).
        base_dirs: folders to look for the files it names in (besides the working directory).
        seed: random seed (crop, mirror, shuffle).
        arrays: ``{top: array}`` for MemoryData and Input layers (channels-last images).

    Raises:
        DataError: a missing or unreadable file, a bad record (checked on the first record
            before training starts).
    """
    phase = _phase_name(phase)
    t = layer.type
    if t in ("MemoryData", "Input"):
        return _memory_source(layer, arrays, seed, phase)
    reader = _FILE_READERS.get(t)
    if reader is None:
        raise CaffeFormatError(f"layer type {t!r} is not a supported data layer",
                               layer=layer.name, hint=f"supported: {', '.join(READ_TYPES)}")
    return reader(layer, phase, base_dirs, seed)


def net_data_sources(net, *, phase="TRAIN", base_dirs: Sequence[PathLike] = (),
                     seed: Optional[int] = None,
                     arrays: Optional[Mapping[str, np.ndarray]] = None) -> List[DataSource]:
    """The data sources of a (phase-filtered) ``NetParameter``'s data layers, in net order.

    Arrays given for tops of non-Input data layers replace those layers (so tests and API
    users can feed a net whose files are elsewhere)."""
    out = []
    for layer in net.layer:
        if layer.type in READ_TYPES:
            if arrays is not None and layer.top and layer.top[0] in arrays \
                    and layer.type not in ("MemoryData", "Input"):
                fake = proto.LayerParameter()
                fake.CopyFrom(layer)
                fake.type = "MemoryData"
                fake.ClearField("transform_param")
                fake.memory_data_param.batch_size = layer_batch(layer)
                out.append(_memory_source(fake, arrays, seed, phase))
            else:
                out.append(data_source(layer, phase=phase, base_dirs=base_dirs, seed=seed,
                                       arrays=arrays))
    return out


def layer_batch(layer) -> int:
    for name in ("data_param", "image_data_param", "hdf5_data_param", "memory_data_param",
                 "window_data_param"):
        if layer.HasField(name):
            return int(getattr(layer, name).batch_size)
    return 0


def merge_batches(sources: Sequence[DataSource]) -> Iterator[Dict[str, np.ndarray]]:
    """Zip several sources' batches into one dict per step."""
    its = [s.batches() for s in sources]
    while True:
        out: Dict[str, np.ndarray] = {}
        for it in its:
            out.update(next(it))
        yield out


#: records a resume may replay to put a source exactly where an uninterrupted run would be
EXACT_REPLAY_RECORDS = 200_000


def skip_batches(sources: Sequence, skip: int, log=None) -> Iterator[Dict]:
    """The merged batches of ``sources`` from mini-batch ``skip`` on, without replaying
    ``skip`` batches.

    A source of ``size`` records cut into batches of ``batch_size`` repeats its record order
    every ``size / gcd(size, batch_size)`` batches, so it skips ``skip`` modulo that period:
    when that replay reads at most ``max(size, EXACT_REPLAY_RECORDS)`` records, the next
    batch holds exactly the records of an uninterrupted run. Otherwise it replays
    ``r // batch_size`` batches (less than one epoch), ``r`` being the record an uninterrupted
    run would be at: the next batch starts up to ``batch_size - 1`` records early (logged).
    Random crops, mirrors and shuffles, drawn afresh, match an uninterrupted run only when
    nothing was left out. A source whose size is unknown (HDF5Data) skips at most 10,000
    batches (logged). (Caffe itself restarts its data layers at the first record.)
    """
    its = []
    for s in sources:
        size, bs = getattr(s, "size", None), max(int(getattr(s, "batch_size", 1) or 1), 1)
        if size:
            n = skip % (size // math.gcd(size, bs))
            if n * bs > max(size, EXACT_REPLAY_RECORDS):
                r = (skip * bs) % size
                n = r // bs
                if r % bs and log is not None:
                    log(f"{s.name}: resumed at record {r - r % bs} of {size}, {r % bs} "
                        f"before where the interrupted run was")
        else:
            n = min(skip, 10_000)
            if n < skip and log is not None:
                log(f"{s.name}: the data position on resume is approximate (its size is "
                    f"unknown; {n} of {skip} batches skipped)")
        it = s.batches()
        for _ in range(n):
            next(it)
        its.append(it)

    def merged():
        while True:
            out: Dict = {}
            for it in its:
                out.update(next(it))
            yield out
    return merged()
