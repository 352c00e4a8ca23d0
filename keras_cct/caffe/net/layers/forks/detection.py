"""SSD's layers (weiliu89/caffe): :class:`CaffePermute`, :class:`CaffeNormalize` and
:class:`CaffePriorBox` (DetectionOutput: :mod:`.nms`), with SSD's exact semantics on
channels-last tensors (a Caffe blob ``(N, C, d...)`` is held as ``(N, d..., C)``)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import keras
from keras import ops

from keras_cct.caffe.net.layout import from_caffe_perm, to_caffe_perm

_PKG = "keras_cct"

__all__ = ["CaffePermute", "CaffeNormalize", "CaffePriorBox", "prior_boxes"]


@keras.saving.register_keras_serializable(package=_PKG)
class CaffePermute(keras.layers.Layer):
    """SSD's Permute: Caffe axes reordered by ``order`` (Caffe axes; the axes not named keep
    their order after the named ones, as SSD's PermuteLayer)."""

    def __init__(self, order: Sequence[int] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.order = [int(a) for a in order]
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"Permute order {self.order} repeats an axis")

    def _caffe_order(self, rank: int) -> List[int]:
        order = [a + rank if a < 0 else a for a in self.order]
        if any(not 0 <= a < rank for a in order):
            raise ValueError(f"Permute order {self.order} is out of range for a {rank}-D blob")
        return order + [a for a in range(rank) if a not in order]

    def _perm(self, rank: int) -> List[int]:
        # keras -> caffe layout, the permutation (caffe axes), caffe -> keras layout
        to_c, order, from_c = to_caffe_perm(rank), self._caffe_order(rank), from_caffe_perm(rank)
        return [to_c[order[a]] for a in from_c]

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[a] for a in self._perm(len(input_shape)))

    def call(self, x):
        perm = self._perm(len(x.shape))
        return x if perm == list(range(len(perm))) else ops.transpose(x, perm)

    def get_config(self):
        return {**super().get_config(), "order": self.order}


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeNormalize(keras.layers.Layer):
    """SSD's Normalize (ParseNet's L2 norm): ``y = scale * x / sqrt(sum x^2 + eps)``, the sum
    over (C, H, W) of each image (``across_spatial``) or over C at each position; ``scale`` is
    one learned value (``channel_shared``) or one per channel, held as SSD's blob (a 0-D
    scalar, ``vector<int>(0)``, or ``(C,)``)."""

    caffe_type = "Normalize"

    def __init__(self, across_spatial: bool = True, channel_shared: bool = True,
                 eps: float = 1e-10, scale_initializer="ones", **kwargs) -> None:
        super().__init__(**kwargs)
        self.across_spatial = bool(across_spatial)
        self.channel_shared = bool(channel_shared)
        self.eps = float(eps)
        self.scale_initializer = keras.initializers.get(scale_initializer)

    def build(self, input_shape):
        if len(input_shape) < 2 or input_shape[-1] is None:
            raise ValueError("Normalize needs an input with a known channel axis")
        shape = () if self.channel_shared else (int(input_shape[-1]),)
        self.scale = self.add_weight(shape=shape, initializer=self.scale_initializer,
                                     name="scale")

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        axes = tuple(range(1, len(x.shape))) if self.across_spatial else (-1,)
        norm = ops.sqrt(ops.sum(ops.square(x), axis=axes, keepdims=True) + self.eps)
        return x / norm * self.scale

    def get_config(self):
        return {**super().get_config(), "across_spatial": self.across_spatial,
                "channel_shared": self.channel_shared, "eps": self.eps,
                "scale_initializer": keras.initializers.serialize(self.scale_initializer)}


def prior_boxes(layer_hw, image_hw, min_sizes: Sequence[float],
                max_sizes: Sequence[float] = (), aspect_ratios: Sequence[float] = (),
                flip: bool = True, clip: bool = False, variance: Sequence[float] = (0.1,),
                step_hw=(0.0, 0.0), offset: float = 0.5) -> np.ndarray:
    """SSD's PriorBoxLayer output as a Caffe-ordered float32 array ``(1, 2, H*W*P*4)``:
    row 0 the boxes ``(xmin, ymin, xmax, ymax)`` normalized by the image size, row 1 their
    variances. ``step_hw`` 0 means image size / layer size."""
    lh, lw = (int(v) for v in layer_hw)
    ih, iw = (float(v) for v in image_hw)
    ratios = [1.0]
    for ar in aspect_ratios:
        if any(abs(ar - r) < 1e-6 for r in ratios):
            continue
        ratios.append(float(ar))
        if flip:
            ratios.append(1.0 / float(ar))
    step_h = float(step_hw[0]) or ih / lh
    step_w = float(step_hw[1]) or iw / lw
    boxes = []
    for h in range(lh):
        for w in range(lw):
            cx, cy = (w + offset) * step_w, (h + offset) * step_h
            for s, mn in enumerate(min_sizes):
                sizes = [(mn, mn)]
                if len(max_sizes):
                    side = np.sqrt(mn * max_sizes[s])
                    sizes.append((side, side))
                sizes += [(mn * np.sqrt(r), mn / np.sqrt(r)) for r in ratios
                          if abs(r - 1.0) >= 1e-6]
                for bw, bh in sizes:
                    boxes.append(((cx - bw / 2.0) / iw, (cy - bh / 2.0) / ih,
                                  (cx + bw / 2.0) / iw, (cy + bh / 2.0) / ih))
    b = np.asarray(boxes, np.float64).reshape(-1)
    if clip:
        b = np.clip(b, 0.0, 1.0)
    var = np.asarray(variance, np.float64)
    v = np.tile(var if var.size == 4 else np.repeat(var, 4), b.size // 4)
    return np.stack([b, v])[None].astype(np.float32)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffePriorBox(keras.layers.Layer):
    """SSD's PriorBox: the prior (default) boxes of a feature map, a constant of the feature
    map's and the image's sizes (the inputs' values are not read). Output: Caffe's
    ``(1, 2, H*W*P*4)`` blob, held channels-last as ``(1, H*W*P*4, 2)``.

    Args:
        min_sizes, max_sizes, aspect_ratios, flip, clip, variance, offset: SSD's fields.
        image_hw: ``(img_h, img_w)`` if given in the prototxt, else ``None`` (the second
            input's height and width).
        step_hw: ``(step_h, step_w)``; 0 for image size / feature map size.
    """

    def __init__(self, min_sizes: Sequence[float] = (), max_sizes: Sequence[float] = (),
                 aspect_ratios: Sequence[float] = (), flip: bool = True, clip: bool = False,
                 variance: Sequence[float] = (0.1,), image_hw: Optional[Sequence[int]] = None,
                 step_hw: Sequence[float] = (0.0, 0.0), offset: float = 0.5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.min_sizes = [float(v) for v in min_sizes]
        self.max_sizes = [float(v) for v in max_sizes]
        if not self.min_sizes:
            raise ValueError("PriorBox needs min_size")
        if self.max_sizes and len(self.max_sizes) != len(self.min_sizes):
            raise ValueError("PriorBox needs as many max_size as min_size")
        if any(mx <= mn for mn, mx in zip(self.min_sizes, self.max_sizes)):
            raise ValueError("PriorBox max_size must be greater than min_size")
        self.aspect_ratios = [float(v) for v in aspect_ratios]
        self.flip = bool(flip)
        self.clip = bool(clip)
        self.variance = [float(v) for v in variance] or [0.1]
        if len(self.variance) not in (1, 4):
            raise ValueError(f"PriorBox needs 1 or 4 variance values, got {len(self.variance)}")
        self.image_hw = None if image_hw is None else [int(v) for v in image_hw]
        self.step_hw = [float(v) for v in step_hw]
        self.offset = float(offset)

    def _boxes(self, shapes) -> np.ndarray:
        feat = shapes[0] if isinstance(shapes[0], (list, tuple)) else shapes
        layer_hw = feat[1:3]
        if self.image_hw is not None:
            image_hw = self.image_hw
        elif isinstance(shapes[0], (list, tuple)) and len(shapes) > 1:
            image_hw = shapes[1][1:3]
        else:
            raise ValueError("PriorBox needs the image as its second input, or img_size")
        if None in tuple(layer_hw) + tuple(image_hw):
            raise ValueError("PriorBox needs known feature map and image sizes")
        return prior_boxes(layer_hw, image_hw, self.min_sizes, self.max_sizes,
                           self.aspect_ratios, self.flip, self.clip, self.variance,
                           self.step_hw, self.offset)

    def compute_output_shape(self, input_shape):
        n = self._boxes(input_shape).shape[2]
        return (1, n, 2)

    def call(self, inputs):
        xs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
        boxes = self._boxes([tuple(x.shape) for x in xs])
        dtype = xs[0].dtype if "float" in str(xs[0].dtype) else "float32"
        return ops.convert_to_tensor(np.transpose(boxes, (0, 2, 1)), dtype=dtype)

    def get_config(self):
        return {**super().get_config(), "min_sizes": self.min_sizes,
                "max_sizes": self.max_sizes, "aspect_ratios": self.aspect_ratios,
                "flip": self.flip, "clip": self.clip, "variance": self.variance,
                "image_hw": self.image_hw, "step_hw": self.step_hw, "offset": self.offset}

