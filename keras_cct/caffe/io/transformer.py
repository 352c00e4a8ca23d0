"""pycaffe's ``caffe.io`` helpers with numpy and Pillow only (no Keras): :class:`Transformer`
(``set_transpose``, ``set_channel_swap``, ``set_raw_scale``, ``set_mean``, ``set_input_scale``;
``preprocess`` / ``deprocess``), :func:`load_image`, :func:`resize_image`, :func:`oversample`,
:func:`blobproto_to_array` / :func:`array_to_blobproto` and :func:`datum_to_array` /
:func:`array_to_datum` in pycaffe's ``(C, H, W)`` order.

Same semantics as BVLC Caffe's ``python/caffe/io.py``, with one difference: images are read
with Pillow (not scikit-image) and resized by bilinear interpolation in numpy (pixel centres
at half-integers, edges clamped, no anti-aliasing), where pycaffe calls
``skimage.transform.resize`` (which pads with zeros at the border and, in recent versions,
blurs before downscaling): values away from the border agree, a resized border may differ
slightly.
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from keras_cct.caffe.io import lmdb_io, proto
from keras_cct.caffe.io.binary import array_to_blob, blob_shape
from keras_cct.errors import CaffeFormatError, DataError

__all__ = ["Transformer", "load_image", "resize_image", "oversample", "blobproto_to_array",
           "array_to_blobproto", "datum_to_array", "array_to_datum"]

PathLike = Union[str, os.PathLike]


# --------------------------------------------------------------------------------------------
# images


def load_image(filename: PathLike, color: bool = True) -> np.ndarray:
    """An image file as a float32 ``(H, W, 3)`` RGB (``color``) or ``(H, W, 1)`` array in
    [0, 1], as pycaffe's ``caffe.io.load_image`` (gray images are tiled to 3 channels when
    ``color``; an alpha channel is dropped).

    Raises:
        DataError: the file is missing or is not an image Pillow reads.
    """
    from PIL import Image, UnidentifiedImageError  # Pillow: only to read images
    try:
        with Image.open(filename) as im:
            im.load()
            mode = im.mode
            if mode in ("I;16", "I;16B", "I;16L", "I"):
                arr = np.asarray(im, np.float64) / (65535.0 if mode.startswith("I;16") else
                                                    max(float(np.max(im)), 1.0))
            else:
                target = "RGB" if color else "L"
                arr = np.asarray(im.convert(target), np.float64) / 255.0
    except FileNotFoundError:
        raise DataError("the image file was not found", path=str(filename)) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"cannot read the image: {exc}", path=str(filename),
                        hint="give a PNG, JPEG, BMP or other file Pillow reads") from None
    if arr.ndim == 2:
        arr = arr[:, :, None]
        if color:
            arr = np.tile(arr, (1, 1, 3))
    return arr.astype(np.float32)


def _interp_axis(im: np.ndarray, new: int, axis: int, order: int) -> np.ndarray:
    """``im`` resampled along ``axis`` to ``new`` samples (half-pixel centres, edges clamped)."""
    old = im.shape[axis]
    if old == new:
        return im
    pos = (np.arange(new, dtype=np.float64) + 0.5) * (old / new) - 0.5
    if order == 0:
        idx = np.clip(np.floor(pos + 0.5).astype(np.int64), 0, old - 1)
        return np.take(im, idx, axis=axis)
    pos = np.clip(pos, 0.0, old - 1.0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, old - 1)
    frac = (pos - lo).reshape([-1 if a == axis else 1 for a in range(im.ndim)])
    return np.take(im, lo, axis=axis) * (1.0 - frac) + np.take(im, hi, axis=axis) * frac


def resize_image(im: np.ndarray, new_dims: Sequence[int], interp_order: int = 1) -> np.ndarray:
    """An ``(H, W, K)`` image resized to ``new_dims = (height, width)`` (pycaffe's
    ``caffe.io.resize_image``): bilinear (``interp_order=1``) or nearest (``0``) interpolation,
    float32 out."""
    im = np.asarray(im)
    if im.ndim != 3:
        raise ValueError(f"resize_image takes an (H, W, K) image, got shape {im.shape}")
    if interp_order not in (0, 1):
        raise ValueError(f"interp_order must be 0 (nearest) or 1 (bilinear), got "
                         f"{interp_order}")
    h, w = (int(d) for d in new_dims[:2])
    if h <= 0 or w <= 0:
        raise ValueError(f"new_dims must be positive, got {tuple(new_dims)}")
    out = np.asarray(im, np.float64)
    out = _interp_axis(out, h, 0, interp_order)
    out = _interp_axis(out, w, 1, interp_order)
    return out.astype(np.float32)


def oversample(images: Sequence[np.ndarray], crop_dims: Sequence[int]) -> np.ndarray:
    """pycaffe's 10-crop oversampling: for each ``(H, W, K)`` image the four corner crops and
    the centre crop of ``crop_dims``, then the same five mirrored left-right; returns
    ``(10 * N, h, w, K)`` float32."""
    im_shape = np.array(images[0].shape)
    crop = np.array([int(d) for d in crop_dims[:2]])
    if np.any(crop > im_shape[:2]):
        raise ValueError(f"crop {tuple(crop)} is larger than the image {tuple(im_shape[:2])}")
    center = im_shape[:2] / 2.0
    ix = np.empty((5, 4), dtype=int)
    k = 0
    for i in (0, im_shape[0] - crop[0]):
        for j in (0, im_shape[1] - crop[1]):
            ix[k] = (i, j, i + crop[0], j + crop[1])
            k += 1
    ix[4] = np.tile(center, (1, 2)) + np.concatenate([-crop / 2.0, crop / 2.0])
    ix = np.tile(ix, (2, 1))
    crops = np.empty((10 * len(images), crop[0], crop[1], im_shape[-1]), dtype=np.float32)
    n = 0
    for im in images:
        for c in ix:
            crops[n] = im[c[0]:c[2], c[1]:c[3], :]
            n += 1
        crops[n - 5:n] = crops[n - 5:n, :, ::-1, :]  # the mirrors
    return crops


# --------------------------------------------------------------------------------------------
# blobs and datums (pycaffe's names and (C, H, W) order)


def blobproto_to_array(blob, return_diff: bool = False) -> np.ndarray:
    """A ``BlobProto``'s data (or ``diff``) as a numpy array of its shape (legacy 4-D
    ``num/channels/height/width`` shapes too), as pycaffe's."""
    shape = blob_shape(blob)
    if return_diff:
        values = np.asarray(blob.double_diff if len(blob.double_diff) else blob.diff)
    else:
        values = np.asarray(blob.double_data if len(blob.double_data) else blob.data)
    if values.size != int(np.prod(shape)):
        raise CaffeFormatError(f"blob of shape {shape} holds {values.size} "
                               f"{'diff' if return_diff else 'data'} values",
                               hint="the blob is corrupt (or has no diff)")
    return values.reshape(shape)


def array_to_blobproto(arr: np.ndarray, diff: Optional[np.ndarray] = None):
    """A numpy array (and optional diff of the same shape) as a ``BlobProto``."""
    blob = array_to_blob(arr)
    if diff is not None:
        d = np.asarray(diff, np.float32)
        if d.shape != np.shape(arr):
            raise ValueError(f"diff shape {d.shape} differs from data shape {np.shape(arr)}")
        blob.diff.extend(d.ravel().tolist())
    return blob


def array_to_datum(arr: np.ndarray, label: Optional[int] = None) -> "proto.Datum":
    """A ``(C, H, W)`` array as a ``Datum`` (uint8 -> ``data`` bytes, else ``float_data``),
    as pycaffe's."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError(f"array_to_datum takes a (C, H, W) array, got shape {arr.shape}")
    return lmdb_io.array_to_datum(arr.transpose(1, 2, 0), int(label or 0))


def datum_to_array(datum) -> np.ndarray:
    """A ``Datum`` as a ``(C, H, W)`` array (uint8 for byte data, else float), as pycaffe's."""
    return lmdb_io.datum_to_array(datum).transpose(2, 0, 1)


# --------------------------------------------------------------------------------------------
# Transformer


class Transformer:
    """pycaffe's ``caffe.io.Transformer``: images (``(H, W, K)`` float, e.g. from
    :func:`load_image`) <-> the net's input blobs (``(K, H, W)``).

    ``preprocess`` resizes to the blob's size, then transposes, swaps channels, multiplies by
    ``raw_scale``, subtracts the mean and multiplies by ``input_scale``, in that order;
    ``deprocess`` undoes it (without the resize).

    Args:
        inputs: ``{input name: blob shape (N, K, H, W)}``, e.g.
            ``{"data": net.blobs["data"].data.shape}``.
    """

    def __init__(self, inputs: Mapping[str, Sequence[int]]) -> None:
        self.inputs: Dict[str, Tuple[int, ...]] = {k: tuple(int(d) for d in v)
                                                   for k, v in inputs.items()}
        self.transpose: Dict[str, Tuple[int, ...]] = {}
        self.channel_swap: Dict[str, Tuple[int, ...]] = {}
        self.raw_scale: Dict[str, float] = {}
        self.mean: Dict[str, np.ndarray] = {}
        self.input_scale: Dict[str, float] = {}

    def _check_input(self, in_: str) -> None:
        if in_ not in self.inputs:
            raise KeyError(f"{in_!r} is not one of the net inputs: {sorted(self.inputs)}")

    def preprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        """An ``(H, W, K)`` image as the ``(K, H, W)`` float32 input of blob ``in_``."""
        self._check_input(in_)
        x = np.array(data, dtype=np.float32)
        in_dims = self.inputs[in_][2:]
        if x.shape[:2] != tuple(in_dims):
            x = resize_image(x, in_dims)
        if in_ in self.transpose:
            x = x.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            x = x[list(self.channel_swap[in_]), :, :]
        if in_ in self.raw_scale:
            x *= self.raw_scale[in_]
        if in_ in self.mean:
            x -= self.mean[in_]
        if in_ in self.input_scale:
            x *= self.input_scale[in_]
        return x

    def deprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        """Invert :meth:`preprocess` (but the resize) for one ``(K, H, W)`` input."""
        self._check_input(in_)
        x = np.array(data, dtype=np.float32).squeeze()
        if in_ in self.input_scale:
            x /= self.input_scale[in_]
        if in_ in self.mean:
            x += self.mean[in_]
        if in_ in self.raw_scale:
            x /= self.raw_scale[in_]
        if in_ in self.channel_swap:
            x = x[np.argsort(self.channel_swap[in_]), :, :]
        if in_ in self.transpose:
            x = x.transpose(np.argsort(self.transpose[in_]))
        return x

    def set_transpose(self, in_: str, order: Sequence[int]) -> None:
        """The axis order taking an image to the blob, e.g. ``(2, 0, 1)`` for HWC -> CHW."""
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise ValueError(f"transpose order {tuple(order)} must have "
                             f"{len(self.inputs[in_]) - 1} axes (the input's dimensions "
                             f"without the batch)")
        self.transpose[in_] = tuple(int(a) for a in order)

    def set_channel_swap(self, in_: str, order: Sequence[int]) -> None:
        """The channel order after the transpose, e.g. ``(2, 1, 0)`` for RGB -> BGR."""
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise ValueError(f"channel order {tuple(order)} must have {self.inputs[in_][1]} "
                             f"channels (the input's)")
        self.channel_swap[in_] = tuple(int(a) for a in order)

    def set_raw_scale(self, in_: str, scale: float) -> None:
        """Multiply by ``scale`` before the mean is subtracted (255 for [0, 1] images and
        models trained on [0, 255] pixels)."""
        self._check_input(in_)
        self.raw_scale[in_] = float(scale)

    def set_mean(self, in_: str, mean: np.ndarray) -> None:
        """The mean to subtract: per channel (``(K,)``) or per pixel (``(K, H, W)`` or
        ``(H, W)``; resized to the input's size when it differs)."""
        self._check_input(in_)
        mean = np.asarray(mean, np.float32)
        shape = self.inputs[in_]
        if mean.ndim == 1:
            if mean.shape[0] != shape[1]:
                raise ValueError(f"mean has {mean.shape[0]} channels, the input {shape[1]}")
            mean = mean[:, None, None]
        else:
            ms = mean.shape if mean.ndim != 2 else (1,) + mean.shape
            if len(ms) != 3:
                raise ValueError(f"mean must be (K,), (H, W) or (K, H, W), got {mean.shape}")
            mean = mean.reshape(ms)
            if ms != shape[1:]:
                lo, hi = float(mean.min()), float(mean.max())
                span = hi - lo if hi > lo else 1.0
                normal = ((mean - lo) / span).transpose(1, 2, 0)
                mean = resize_image(normal, shape[2:]).transpose(2, 0, 1) * span + lo
        self.mean[in_] = mean.astype(np.float32)

    def set_input_scale(self, in_: str, scale: float) -> None:
        """Multiply by ``scale`` after the mean is subtracted."""
        self._check_input(in_)
        self.input_scale[in_] = float(scale)
