"""Caffe's ``WindowData`` layer (R-CNN's fine-tuning input) as numpy batches.

The window file (``window_data_param.source``) lists images and their boxes::

    # 0                      <- "#" and the image index
    /path/to/image.jpg       <- root_folder + this path
    3                        <- channels
    480                      <- height
    640                      <- width
    2                        <- the number of windows, then one line each:
    1 0.8 10 20 110 220      <- class_index overlap x1 y1 x2 y2 (inclusive corners)
    0 0.1 0 0 50 50

Boxes whose ``overlap >= fg_threshold`` are foreground (their label must be > 0), those with
``overlap < bg_threshold`` background (label and overlap forced to 0), others are dropped.
Each batch holds ``batch_size - int(batch_size * fg_fraction)`` background windows then the
foreground ones, each drawn at random (with replacement), cut out of its image (with
``context_pad`` pixels of context and, with ``crop_mode: "square"``, a square region), warped
to ``crop_size`` x ``crop_size`` by OpenCV's bilinear resize, flipped at random with
``mirror``, and written as ``(pixel - mean) * scale`` into a zero image, as Caffe's
``WindowDataLayer::load_batch``. Only the random draws differ from Caffe's (numpy's generator,
seeded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from keras_cct.caffe.io.lmdb_io import read_image
from keras_cct.errors import DataError

__all__ = ["Window", "read_window_file", "split_windows", "warp_window", "window_batches"]


@dataclass(frozen=True)
class Window:
    """One box of the window file: its image index, class, overlap and inclusive corners."""

    image: int
    label: int
    overlap: float
    x1: int
    y1: int
    x2: int
    y2: int


def read_window_file(path: str, root_folder: str = ""
                     ) -> Tuple[Dict[int, Tuple[str, Tuple[int, int, int]]], List[Window]]:
    """``({image index: (root_folder + path, (channels, height, width))}, [Window])`` of a
    Caffe window file, in file order.

    Raises:
        DataError: the file is missing, empty or malformed (naming the line).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i + 1, ln.strip()) for i, ln in enumerate(f) if ln.strip()]
    except OSError as exc:
        raise DataError(f"cannot read the window file: {exc.strerror}", path=path,
                        hint="check window_data_param.source") from None
    if not lines:
        raise DataError("the window file is empty", path=path)
    images: Dict[int, Tuple[str, Tuple[int, int, int]]] = {}
    windows: List[Window] = []
    pos = 0

    def take(n: int, what: str) -> List[Tuple[int, str]]:
        nonlocal pos
        if pos + n > len(lines):
            raise DataError(f"the window file ends where {what} was expected", path=path,
                            line=lines[-1][0])
        out = lines[pos:pos + n]
        pos += n
        return out

    while pos < len(lines):
        lineno, head = take(1, "'# image_index'")[0]
        parts = head.split()
        try:
            if len(parts) != 2 or parts[0] != "#":
                raise ValueError
            index = int(parts[1])
            (_, img_path), *dims = take(4, "an image path and its channels, height, width")
            c, h, w = (int(v) for _, v in dims)
            n_lineno, n_text = take(1, "the number of windows")[0]
            lineno = n_lineno
            n = int(n_text)
        except DataError:
            raise
        except ValueError:
            raise DataError(f"bad image record near {head!r}", path=path, line=lineno,
                            hint="each image is '# index', path, channels, height, width, "
                                 "the number of windows, then that many window lines") from None
        images[index] = (root_folder + img_path, (c, h, w))
        for lineno, text in take(n, f"{n} window lines"):
            v = text.split()
            try:
                if len(v) != 6:
                    raise ValueError
                windows.append(Window(index, int(v[0]), float(v[1]), int(v[2]), int(v[3]),
                                      int(v[4]), int(v[5])))
            except ValueError:  # (no DataError can rise in the try)
                raise DataError(f"expected 'class_index overlap x1 y1 x2 y2', got {text!r}",
                                path=path, line=lineno) from None
    return images, windows


def split_windows(windows: List[Window], fg_threshold: float, bg_threshold: float,
                  *, path: Optional[str] = None) -> Tuple[List[Window], List[Window]]:
    """Caffe's foreground (``overlap >= fg_threshold``, label > 0) and background
    (``overlap < bg_threshold``, label and overlap set to 0) lists; others are dropped."""
    fg, bg = [], []
    for w in windows:
        if w.overlap >= fg_threshold:
            if w.label <= 0:
                raise DataError(f"a foreground window (overlap {w.overlap}) of image {w.image} "
                                f"has label {w.label}: it must be > 0", path=path,
                                hint="label 0 is the background class")
            fg.append(w)
        elif w.overlap < bg_threshold:
            bg.append(Window(w.image, 0, 0.0, w.x1, w.y1, w.x2, w.y2))
    return fg, bg


def _round(x) -> int:
    """C's ``round`` (half away from zero), on Caffe's float32 values."""
    x = float(x)
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


def warp_window(img: np.ndarray, box: Window, crop_size: int, *, context_pad: int = 0,
                square: bool = False, mirror: bool = False) -> Tuple[np.ndarray, int, int]:
    """One window cut out of an ``(H, W, C)`` uint8 image and warped as Caffe does:
    ``(patch, pad_h, pad_w)`` where ``patch`` (uint8, at most ``crop_size`` square, flipped when
    ``mirror``) goes at row ``pad_h``, column ``pad_w`` of the zero ``crop_size`` image."""
    import cv2
    rows, cols = img.shape[:2]
    x1, y1, x2, y2 = box.x1, box.y1, box.x2, box.y2
    pad_h = pad_w = 0
    out_w = out_h = crop_size
    f32 = np.float32
    if context_pad > 0 or square:
        context_scale = f32(crop_size) / f32(crop_size - 2 * context_pad)
        half_h, half_w = f32(y2 - y1 + 1) / f32(2.0), f32(x2 - x1 + 1) / f32(2.0)
        cx, cy = f32(x1) + half_w, f32(y1) + half_h
        if square:
            half_h = half_w = max(half_h, half_w)
        x1, x2 = _round(cx - half_w * context_scale), _round(cx + half_w * context_scale)
        y1, y2 = _round(cy - half_h * context_scale), _round(cy + half_h * context_scale)
        unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
        px1, py1 = max(0, -x1), max(0, -y1)
        px2, py2 = max(0, x2 - cols + 1), max(0, y2 - rows + 1)
        x1, x2, y1, y2 = x1 + px1, x2 - px2, y1 + py1, y2 - py2
        scale_x = f32(crop_size) / f32(unclipped_w)
        scale_y = f32(crop_size) / f32(unclipped_h)
        out_w = _round(f32(x2 - x1 + 1) * scale_x)
        out_h = _round(f32(y2 - y1 + 1) * scale_y)
        px1, px2 = _round(f32(px1) * scale_x), _round(f32(px2) * scale_x)
        py1 = _round(f32(py1) * scale_y)
        pad_h = py1
        pad_w = px2 if mirror else px1  # the padding is mirrored too
        out_h = min(out_h, crop_size - pad_h)
        out_w = min(out_w, crop_size - pad_w)
    if not (0 <= x1 <= x2 < cols and 0 <= y1 <= y2 < rows):
        raise DataError(f"window ({box.x1}, {box.y1}, {box.x2}, {box.y2}) of image {box.image} "
                        f"lies outside the {cols}x{rows} image")
    patch = cv2.resize(img[y1:y2 + 1, x1:x2 + 1], (out_w, out_h),
                       interpolation=cv2.INTER_LINEAR)
    if patch.ndim == 2:
        patch = patch[:, :, None]
    if mirror:
        patch = patch[:, ::-1]
    return patch, pad_h, pad_w


def _item(patch: np.ndarray, pad_h: int, pad_w: int, crop_size: int, scale: float,
          mean: Optional[np.ndarray], mean_values: Optional[np.ndarray]) -> np.ndarray:
    """The zero ``(crop, crop, C)`` image with ``(pixel - mean) * scale`` at the patch; a mean
    image is read at ``(h + off + pad_h, w + off + pad_w)``, ``off = (mean width - crop) // 2``
    (Caffe uses the width's offset for both axes)."""
    h, w, c = patch.shape
    out = np.zeros((crop_size, crop_size, c), np.float32)
    vals = patch.astype(np.float32)
    if mean is not None:
        off = (mean.shape[1] - crop_size) // 2
        vals = vals - mean[off + pad_h:off + pad_h + h, off + pad_w:off + pad_w + w, :]
    elif mean_values is not None:
        vals = vals - mean_values.reshape(1, 1, -1)
    out[pad_h:pad_h + h, pad_w:pad_w + w, :] = vals * np.float32(scale)
    return out


def window_batches(images: Dict[int, Tuple[str, Tuple[int, int, int]]], fg: List[Window],
                   bg: List[Window], *, batch_size: int, crop_size: int,
                   fg_fraction: float = 0.25, context_pad: int = 0, square: bool = False,
                   mirror: bool = False, scale: float = 1.0, mean: Optional[np.ndarray] = None,
                   mean_values: Optional[np.ndarray] = None, seed: Optional[int] = None,
                   where: Optional[str] = None) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """Endless ``(data (N, crop, crop, C) float32, label (N,) float32)`` batches, each drawn as
    in Caffe's ``load_batch`` (see the module docstring). ``mean`` is an ``(H, W, C)`` mean
    image, ``mean_values`` one value or one per channel."""
    num_fg = int(np.float32(batch_size) * np.float32(fg_fraction))
    plan = [(bg, batch_size - num_fg, "background"), (fg, num_fg, "foreground")]
    for pool, count, what in plan:
        if count and not pool:
            raise DataError(f"the batch needs {count} {what} windows but the window file has "
                            f"none", path=where, hint="check fg_threshold/bg_threshold and "
                                                      "fg_fraction")
    rng = np.random.default_rng(seed)
    while True:
        data, labels = [], []
        for pool, count, _ in plan:
            for _ in range(count):
                box = pool[int(rng.integers(len(pool)))]
                do_mirror = mirror and bool(rng.integers(2))
                path, _dims = images[box.image]
                img = read_image(path, is_color=True, listfile=where)
                patch, ph, pw = warp_window(img, box, crop_size, context_pad=context_pad,
                                            square=square, mirror=do_mirror)
                data.append(_item(patch, ph, pw, crop_size, scale, mean, mean_values))
                labels.append(box.label)
        yield np.stack(data), np.asarray(labels, np.float32)
