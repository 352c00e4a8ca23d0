"""Caffe's ``compute_image_mean``: the mean image of an LMDB of Datums (or of an image list)
as a ``(1, C, H, W)`` float32 .binaryproto, the file Caffe's ``transform_param { mean_file }``
reads.

The sum runs in float64 over the records' pixels (Datums: ``data`` bytes, ``float_data`` or an
encoded image, decoded as Caffe's ``DecodeDatumNative``); every record must have the size of the
first, as in Caffe.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Iterator, Optional, Tuple

import numpy as np

from keras_cct.caffe.io.binary import write_binaryproto
from keras_cct.caffe.io.lmdb_io import DatumReader, read_image, read_image_list
from keras_cct.errors import DataError

__all__ = ["mean_of", "db_mean", "list_mean", "write_mean", "progress_bar"]


def progress_bar(items: Iterable, total: Optional[int], *, show: bool, unit: str,
                 desc: str = "") -> Iterable:
    """``items`` wrapped in a tqdm bar on stderr when ``show`` (as ``cct train --progress``)."""
    if not show:
        return items
    from tqdm import tqdm  # only with a progress bar
    return tqdm(items, total=total, unit=unit, desc=desc or None, file=sys.stderr, leave=False)


def mean_of(records: Iterable[Tuple[str, np.ndarray]], *, path: str) -> Tuple[np.ndarray, int]:
    """``((1, C, H, W) float32 mean, count)`` of ``(key, HWC array)`` records.

    Raises:
        DataError: no record, or a record whose size is not the first one's.
    """
    total = None
    count = 0
    for key, arr in records:
        a = np.asarray(arr, np.float64)
        if total is None:
            total = a.copy()
        elif a.shape != total.shape:
            raise DataError(f"record has shape {a.shape} (H, W, C), the first {total.shape}: the "
                            f"mean needs one size", path=path, layer=f"record {key!r}",
                            hint="resize the images when writing the DB (`cct data "
                                 "--resize-height H --resize-width W`)")
        else:
            total += a
        count += 1
    if total is None:
        raise DataError("no records", path=path)
    return (total / count).transpose(2, 0, 1)[None].astype(np.float32), count


def _db_records(reader: DatumReader) -> Iterator[Tuple[str, np.ndarray]]:
    for key, arr, _ in reader.arrays():
        yield key, arr


def db_mean(db: str, *, progress: bool = False) -> Tuple[np.ndarray, int]:
    """The mean image of an LMDB of Datums: ``((1, C, H, W) float32, count)``."""
    with DatumReader(db) as reader:
        return mean_of(progress_bar(_db_records(reader), len(reader), show=progress,
                                    unit="img", desc="mean"), path=db)


def list_mean(listfile: str, *, root: str = "", gray: bool = False, resize_height: int = 0,
              resize_width: int = 0, progress: bool = False) -> Tuple[np.ndarray, int]:
    """The mean image of the images of a ``path label`` list (paths relative to ``root``),
    loaded as Caffe's ``ReadImageToCVMat`` (BGR, or gray; optional resize)."""
    items = read_image_list(listfile)

    def records():
        for i, (name, _) in enumerate(items):
            yield name, read_image(os.path.join(root, name), is_color=not gray,
                                   new_height=resize_height, new_width=resize_width,
                                   line=i + 1, listfile=listfile)

    return mean_of(progress_bar(records(), len(items), show=progress, unit="img",
                                desc="mean"), path=listfile)


def write_mean(path: str, mean: np.ndarray) -> None:
    """Write the mean as a .binaryproto (atomically), as compute_image_mean does: a BlobProto with
    the legacy ``num/channels/height/width`` fields."""
    write_binaryproto(path, np.asarray(mean, np.float32), legacy_shape=True)
