"""LMDB datasets of Caffe ``Datum`` records: writer, reader and ``convert_imageset``.

Caffe's ``Data`` layer reads an LMDB whose values are serialized ``caffe.Datum`` messages: either
raw pixels (``channels``, ``height``, ``width``, ``data`` as uint8 in CHW order, or
``float_data``) or an encoded image file (``encoded: true``, the bytes of a JPEG/PNG) plus a
``label``. Keys are ``%08d`` (``convert_mnist_data``) or ``%08d_<filename>``
(``convert_imageset``); the layer reads them in key order.

* :func:`write_datums` / :func:`write_arrays` -- write arrays (HWC, as OpenCV loads images:
  BGR for colour) as raw or encoded Datums.
* :func:`convert_imageset` -- Caffe's ``convert_imageset`` tool: a list file of ``path label``
  lines (or a folder with one sub-folder per class), optional resize, gray, shuffle, encoding.
* :class:`DatumReader` -- iterate ``(key, Datum)``; :func:`datum_to_array` decodes one to HWC.

Errors are :class:`keras_cct.errors.DataError` naming the file and the record.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from google.protobuf import message as pb_message

from keras_cct.caffe.io import proto
from keras_cct.errors import DataError

PathLike = Union[str, os.PathLike]
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".pgm", ".ppm", ".tif", ".tiff", ".webp")

__all__ = ["array_to_datum", "datum_to_array", "write_datums", "write_arrays",
           "convert_imageset", "list_image_folder", "read_image_list", "DatumReader",
           "IMAGE_EXTENSIONS"]


def _lmdb():
    try:
        import lmdb
    except ImportError:  # pragma: no cover - lmdb is in the caffe extra
        raise DataError("reading/writing LMDB needs the `lmdb` package",
                        hint="pip install 'keras_cct[caffe]'") from None
    return lmdb


# py-lmdb allows one open environment per database and process: readers share it.
_ENVS: dict = {}


def _env_key(path: str) -> str:
    return os.path.realpath(path)


def _drop_env(path: str) -> None:
    env = _ENVS.pop(_env_key(path), None)
    if env is not None:
        env.close()


def _cv2():
    try:
        import cv2
    except ImportError:  # pragma: no cover
        raise DataError("decoding images needs OpenCV",
                        hint="pip install opencv-python-headless") from None
    return cv2


def array_to_datum(image: np.ndarray, label: int = 0, *, encode: str = "") -> "proto.Datum":
    """One image as a ``Datum``.

    Args:
        image: ``(H, W)`` or ``(H, W, C)`` uint8 (raw ``data``) or float (``float_data``), HWC
            in the channel order Caffe will see (OpenCV's BGR for colour images).
        label: the integer label.
        encode: ``""`` for raw pixels, or ``"png"``/``"jpg"`` to store an encoded image.
    """
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise DataError(f"an image must be (H, W) or (H, W, C), got shape {arr.shape}")
    h, w, c = arr.shape
    datum = proto.Datum(channels=c, height=h, width=w, label=int(label))
    if encode:
        if arr.dtype != np.uint8:
            raise DataError(f"only uint8 images can be encoded, got {arr.dtype}")
        ok, buf = _cv2().imencode("." + encode.lower().lstrip("."), arr)
        if not ok:
            raise DataError(f"OpenCV could not encode the image as {encode}")
        datum.data = buf.tobytes()
        datum.encoded = True
    elif arr.dtype == np.uint8:
        datum.data = np.ascontiguousarray(arr.transpose(2, 0, 1)).tobytes()
    else:
        datum.float_data.extend(np.asarray(arr, np.float32).transpose(2, 0, 1).ravel().tolist())
    return datum


def datum_to_array(datum: "proto.Datum", *, path: Optional[str] = None,
                   key: Optional[str] = None, force_color: bool = False,
                   force_gray: bool = False) -> np.ndarray:
    """A ``Datum`` as an ``(H, W, C)`` array: uint8 for byte data and encoded images, float32
    for ``float_data``. Encoded images decode like Caffe's ``DecodeDatumToCVMatNative`` (or
    forced to colour/gray).

    Raises:
        DataError: the data size does not match ``channels*height*width``, or the image does
            not decode (naming ``path`` and ``key``).
    """
    where = f"record {key!r}" if key is not None else None
    if datum.encoded:
        cv2 = _cv2()
        flag = (cv2.IMREAD_COLOR if force_color else cv2.IMREAD_GRAYSCALE if force_gray
                else cv2.IMREAD_ANYCOLOR)
        img = cv2.imdecode(np.frombuffer(datum.data, np.uint8), flag)
        if img is None:
            raise DataError("the encoded image does not decode", path=path, layer=where,
                            hint="the record holds corrupt or unsupported image bytes")
        return img[:, :, None] if img.ndim == 2 else img
    c, h, w = int(datum.channels), int(datum.height), int(datum.width)
    size = c * h * w

    def check(n: int, what: str) -> None:
        if n != size:
            raise DataError(
                f"Datum holds {n} {what} but channels*height*width = {c}*{h}*{w} = {size}",
                path=path, layer=where,
                hint="the record is corrupt or was written with wrong dimensions")

    if len(datum.data):
        check(len(datum.data), "bytes")
        arr = np.frombuffer(datum.data, np.uint8).reshape(c, h, w)
    elif len(datum.float_data):
        check(len(datum.float_data), "floats")
        arr = np.asarray(datum.float_data, np.float32).reshape(c, h, w)
    else:
        raise DataError("Datum holds no data", path=path, layer=where)
    return arr.transpose(1, 2, 0)


def write_datums(path: PathLike, datums: Iterable[Tuple[str, "proto.Datum"]], *,
                 overwrite: bool = False, commit_every: int = 1000) -> int:
    """Write ``(key, Datum)`` pairs to a new LMDB at ``path``; returns the record count.

    The map grows as needed. Refuses to overwrite an existing database unless ``overwrite``.
    """
    lmdb = _lmdb()
    path = str(path)
    _drop_env(path)
    if os.path.exists(os.path.join(path, "data.mdb")):
        if not overwrite:
            raise DataError("an LMDB already exists there", path=path,
                            hint="remove it or pass overwrite=True (--overwrite)")
        for name in ("data.mdb", "lock.mdb"):
            if os.path.exists(os.path.join(path, name)):
                os.remove(os.path.join(path, name))
    map_size = 64 << 20
    try:
        os.makedirs(path, exist_ok=True)
        env = lmdb.open(path, map_size=map_size, subdir=True, lock=True)
    except (OSError, lmdb.Error) as exc:
        raise DataError(f"cannot create the LMDB: {exc}", path=path,
                        hint="choose a writable folder") from None
    count = 0
    pending: List[Tuple[bytes, bytes]] = []

    def flush():
        nonlocal map_size
        while True:
            try:
                with env.begin(write=True) as txn:
                    for k, v in pending:
                        txn.put(k, v)
                break
            except lmdb.MapFullError:
                map_size *= 2
                env.set_mapsize(map_size)
        pending.clear()

    try:
        for key, datum in datums:
            pending.append((str(key).encode("utf-8"), datum.SerializeToString()))
            count += 1
            if len(pending) >= commit_every:
                flush()
        if pending:
            flush()
    except lmdb.Error as exc:  # disk full, a file system that refuses the map, ...
        raise DataError(f"cannot write the LMDB: {exc}", path=path) from None
    finally:
        env.close()
    return count


def write_arrays(path: PathLike, images: Union[np.ndarray, Sequence[np.ndarray]],
                 labels: Sequence[int], *, encode: str = "", overwrite: bool = False) -> int:
    """Write images (``(N, H, W[, C])`` or a list of HWC arrays) and labels as an LMDB of
    Datums with keys ``%08d``; returns the record count."""
    if len(images) != len(labels):
        raise DataError(f"{len(images)} images but {len(labels)} labels", path=str(path))
    return write_datums(path, ((f"{i:08d}", array_to_datum(img, int(lab), encode=encode))
                               for i, (img, lab) in enumerate(zip(images, labels))),
                        overwrite=overwrite)


def read_image_list(listfile: PathLike) -> List[Tuple[str, int]]:
    """Caffe's image list file: one ``path label`` per line (the path may contain spaces; the
    label is the last field)."""
    listfile = str(listfile)
    try:
        lines = Path(listfile).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DataError(f"cannot read the image list: {exc.strerror}", path=listfile,
                        hint="check the path") from None
    out = []
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        name, _, label = text.rpartition(" ")
        try:
            out.append((name.strip(), int(label)))
        except ValueError:
            raise DataError(f"expected 'path label', got {text!r}", path=listfile,
                            line=lineno, hint="each line is an image path, a space, an int label"
                            ) from None
        if not name.strip():
            raise DataError(f"expected 'path label', got {text!r}", path=listfile, line=lineno)
    if not out:
        raise DataError("the image list is empty", path=listfile)
    return out


def list_image_folder(folder: PathLike) -> Tuple[List[Tuple[str, int]], List[str]]:
    """``folder/<class>/<image>`` -> (``[(relative path, label)]``, class names); labels number
    the class folders in sorted order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError("image folder not found", path=str(folder), hint="check the path")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise DataError("the folder has no class sub-folders", path=str(folder),
                        hint="put the images of class k in FOLDER/<class name>/")
    items = []
    for label, cls in enumerate(classes):
        for img in sorted((folder / cls).iterdir()):
            if img.suffix.lower() in IMAGE_EXTENSIONS:
                items.append((f"{cls}/{img.name}", label))
    if not items:
        raise DataError("no images found", path=str(folder),
                        hint=f"supported extensions: {', '.join(IMAGE_EXTENSIONS)}")
    return items, classes


def read_image(path: str, *, is_color: bool = True, new_height: int = 0,
               new_width: int = 0, line: Optional[int] = None,
               listfile: Optional[str] = None) -> np.ndarray:
    """Caffe's ``ReadImageToCVMat``: OpenCV load (BGR or gray), optional resize; HWC uint8."""
    cv2 = _cv2()
    if not os.path.exists(path):
        raise DataError(f"image not found: {path}", path=listfile, line=line,
                        hint="check the list file and root_folder")
    img = cv2.imread(path, cv2.IMREAD_COLOR if is_color else cv2.IMREAD_GRAYSCALE)
    if img is None:
        raise DataError(f"the image does not decode: {path}", path=listfile, line=line,
                        hint="the file is corrupt or not an image")
    if new_height > 0 and new_width > 0:
        img = cv2.resize(img, (int(new_width), int(new_height)))
    return img[:, :, None] if img.ndim == 2 else img


def convert_imageset(root: PathLike, listfile: Optional[PathLike], db_path: PathLike, *,
                     resize_height: int = 0, resize_width: int = 0, gray: bool = False,
                     shuffle: bool = False, encode: str = "", check_size: bool = False,
                     seed: int = 0, overwrite: bool = False) -> int:
    """Caffe's ``convert_imageset ROOT LISTFILE DB``: write an LMDB of Datums.

    Args:
        root: the folder the list's paths are relative to.
        listfile: ``path label`` lines; ``None`` lists ``root/<class>/<image>`` instead.
        db_path: the LMDB folder to create.
        resize_height, resize_width: resize every image (both > 0).
        gray: load as gray (1 channel).
        shuffle: shuffle the order (seeded by ``seed``).
        encode: ``""`` stores raw pixels; ``"png"``/``"jpg"`` stores encoded images.
        check_size: require every image to have the size of the first.

    Returns:
        the number of records written. Keys are ``%08d_<path>`` as in Caffe.
    """
    root = str(root)
    if listfile is None:
        items, _ = list_image_folder(root)
        src = root
    else:
        items = read_image_list(listfile)
        src = str(listfile)
    order = list(range(len(items)))
    if shuffle:
        random.Random(seed).shuffle(order)
    first_shape = None

    def gen():
        nonlocal first_shape
        for n, idx in enumerate(order):
            name, label = items[idx]
            img = read_image(os.path.join(root, name), is_color=not gray,
                             new_height=resize_height, new_width=resize_width,
                             line=idx + 1 if listfile is not None else None, listfile=src)
            if check_size:
                if first_shape is None:
                    first_shape = img.shape
                elif img.shape != first_shape:
                    raise DataError(f"{name} has shape {img.shape}, the first image "
                                    f"{first_shape}", path=src, hint="resize or drop --check_size")
            yield f"{n:08d}_{name}", array_to_datum(img, label, encode=encode)

    return write_datums(db_path, gen(), overwrite=overwrite)


class DatumReader:
    """Read an LMDB of Datums in key order.

    Args:
        path: the LMDB folder (or its ``data.mdb``).

    Raises:
        DataError: the database is missing or unreadable, or empty.
    """

    def __init__(self, path: PathLike) -> None:
        lmdb = _lmdb()
        path = str(path)
        subdir = not path.endswith(".mdb")
        if subdir and not os.path.exists(os.path.join(path, "data.mdb")):
            raise DataError("LMDB not found (no data.mdb)", path=path,
                            hint="create it with `cct data` or Caffe's convert_imageset")
        env = _ENVS.get(_env_key(path))
        if env is None:
            try:
                env = lmdb.open(path, readonly=True, lock=False, readahead=False,
                                subdir=subdir, max_readers=126)
            except lmdb.Error as exc:
                raise DataError(f"cannot open the LMDB: {exc}", path=path) from None
            _ENVS[_env_key(path)] = env
        self._env = env
        self.path = path
        self.length = int(self._env.stat()["entries"])
        if self.length == 0:
            raise DataError("the LMDB has no records", path=path)

    def __len__(self) -> int:
        return self.length

    def items(self) -> Iterator[Tuple[str, "proto.Datum"]]:
        """``(key, Datum)`` in key order, once."""
        with self._env.begin(buffers=False) as txn:
            for key, value in txn.cursor():
                k = key.decode("utf-8", "replace")
                datum = proto.Datum()
                try:
                    datum.ParseFromString(value)
                except pb_message.DecodeError:
                    raise DataError("the record is not a Caffe Datum", path=self.path,
                                    layer=f"record {k!r}") from None
                yield k, datum

    def arrays(self, **kwargs) -> Iterator[Tuple[str, np.ndarray, int]]:
        """``(key, HWC array, label)`` in key order, once."""
        for k, datum in self.items():
            yield k, datum_to_array(datum, path=self.path, key=k, **kwargs), int(datum.label)

    def first(self) -> Tuple[str, "proto.Datum"]:
        return next(iter(self.items()))

    def close(self) -> None:
        """Release this reader (the environment stays open for other readers)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
