"""Caffe's shape layers (axes are Caffe axes): :class:`CaffeConcat`, :class:`CaffeSlice`,
:class:`CaffeSoftmax`, :class:`CaffeFlatten`, :class:`CaffeReshape`, :class:`CaffeCrop`."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import keras
from keras import ops

from keras_cct.caffe.net.layout import (caffe_axis, caffe_shape, from_caffe_layout,
                                        from_caffe_perm, keras_shape, to_caffe_layout)

_PKG = "keras_cct"

__all__ = ["CaffeConcat", "CaffeSlice", "CaffeSoftmax", "CaffeFlatten", "CaffeReshape",
           "CaffeCrop"]


# --------------------------------------------------------------------------------------------
# Shape layers (axes are Caffe axes)


class _CaffeAxisLayer(keras.layers.Layer):
    """A layer with one Caffe axis parameter, ``axis`` (default 1, the channels)."""

    def __init__(self, axis: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeConcat(_CaffeAxisLayer):
    """Caffe's Concat along Caffe axis ``axis``."""

    def compute_output_shape(self, input_shape):
        rank = len(input_shape[0])
        ax = caffe_axis(self.axis, rank)
        out = list(input_shape[0])
        dims = [s[ax] for s in input_shape]
        out[ax] = None if any(d is None for d in dims) else sum(dims)
        return tuple(out)

    def call(self, inputs):
        return ops.concatenate(list(inputs), axis=caffe_axis(self.axis, len(inputs[0].shape)))


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeSlice(keras.layers.Layer):
    """Caffe's Slice along Caffe axis ``axis`` at ``slice_points`` (or ``num_outputs`` equal
    parts); returns a list of tensors."""

    def __init__(self, axis: int = 1, slice_points: Sequence[int] = (), num_outputs: int = 2,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.slice_points = [int(p) for p in slice_points]
        self.num_outputs = int(num_outputs)

    def _bounds(self, size: int) -> List[Tuple[int, int]]:
        if self.slice_points:
            pts = [0] + self.slice_points + [size]
            if len(pts) - 1 != self.num_outputs:
                raise ValueError(f"Slice '{self.name}': {len(self.slice_points)} slice points "
                                 f"for {self.num_outputs} outputs")
        else:
            if size % self.num_outputs:
                raise ValueError(f"Slice '{self.name}': axis size {size} does not divide into "
                                 f"{self.num_outputs} equal parts")
            step = size // self.num_outputs
            pts = [i * step for i in range(self.num_outputs + 1)]
        if any(b <= a for a, b in zip(pts, pts[1:])) or pts[-1] > size:
            raise ValueError(f"Slice '{self.name}': slice points {self.slice_points} invalid for "
                             f"an axis of size {size}")
        return list(zip(pts, pts[1:]))

    def compute_output_shape(self, input_shape):
        ax = caffe_axis(self.axis, len(input_shape))
        out = []
        for a, b in self._bounds(int(input_shape[ax])):
            s = list(input_shape)
            s[ax] = b - a
            out.append(tuple(s))
        return out

    def call(self, x):
        rank = len(x.shape)
        ax = caffe_axis(self.axis, rank)
        outs = []
        for a, b in self._bounds(int(x.shape[ax])):
            idx = [slice(None)] * rank
            idx[ax] = slice(a, b)
            outs.append(x[tuple(idx)])
        return outs

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, slice_points=self.slice_points, num_outputs=self.num_outputs)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeSoftmax(_CaffeAxisLayer):
    """Caffe's Softmax along Caffe axis ``axis`` (default 1, the channels)."""

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return ops.softmax(x, axis=caffe_axis(self.axis, len(x.shape)))


def _static_caffe_shape(layer, shape) -> List[Optional[int]]:
    cs = list(caffe_shape(shape))
    if any(d is None for d in cs[1:]):
        raise ValueError(f"'{layer.name}' needs known non-batch dims, got {tuple(shape)}")
    return cs


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeFlatten(keras.layers.Layer):
    """Caffe's Flatten of Caffe axes ``[axis, end_axis]`` in Caffe's element order."""

    def __init__(self, axis: int = 1, end_axis: int = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.end_axis = int(end_axis)

    def _out_caffe(self, shape):
        cs = _static_caffe_shape(self, shape)
        r = len(cs)
        a = self.axis + r if self.axis < 0 else self.axis
        e = self.end_axis + r if self.end_axis < 0 else self.end_axis
        if not 0 <= a <= e < r:
            raise ValueError(f"Flatten '{self.name}': axes [{self.axis}, {self.end_axis}] "
                             f"invalid for a {r}-D blob")
        mid = 1
        for d in cs[a:e + 1]:
            mid = None if (d is None or mid is None) else mid * d
        return cs[:a] + [mid] + cs[e + 1:]

    def compute_output_shape(self, input_shape):
        return keras_shape(self._out_caffe(input_shape))

    def call(self, x):
        out = self._out_caffe(x.shape)
        y = ops.reshape(to_caffe_layout(x), [-1] + [int(d) for d in out[1:]])
        return from_caffe_layout(y)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, end_axis=self.end_axis)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeReshape(keras.layers.Layer):
    """Caffe's Reshape: ``shape`` replaces Caffe axes ``[axis, axis + num_axes)``; 0 copies the
    input dim, -1 is inferred. The batch axis must be kept (0 or -1 there)."""

    def __init__(self, shape: Sequence[int], axis: int = 0, num_axes: int = -1,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.shape = [int(d) for d in shape]
        self.axis = int(axis)
        self.num_axes = int(num_axes)

    def _out_caffe(self, in_shape):
        cs = list(caffe_shape(in_shape))
        r = len(cs)
        a = self.axis + r + 1 if self.axis < 0 else self.axis
        end = r if self.num_axes == -1 else a + self.num_axes
        if not 0 <= a <= end <= r:
            raise ValueError(f"Reshape '{self.name}': axis {self.axis} / num_axes "
                             f"{self.num_axes} invalid for a {r}-D blob")
        new = []
        for i, d in enumerate(self.shape):
            new.append(cs[a + i] if d == 0 else d)
        out = cs[:a] + new + cs[end:]
        if self.shape.count(-1) > 1:
            raise ValueError(f"Reshape '{self.name}': at most one -1 in shape")
        if -1 in out:
            known = 1
            for d in out:
                if d not in (-1, None):
                    known *= d
            total = 1
            for d in cs[1:]:
                total *= d
            j = out.index(-1)
            if j == 0:
                out[0] = None  # batch inferred
            else:
                rest = 1
                for k, d in enumerate(out):
                    if k != j and k != 0:
                        rest *= d
                if out[0] is None or cs[0] is None or out[0] == cs[0]:
                    if total % rest:
                        raise ValueError(f"Reshape '{self.name}': cannot reshape {cs} to "
                                         f"{self.shape}")
                    out[j] = total // rest
        if out[0] is not None and out[0] != cs[0]:
            raise ValueError(f"Reshape '{self.name}': changing the batch axis is not supported")
        tot_in = int(np.prod([d for d in cs[1:]]))
        tot_out = int(np.prod([d for d in out[1:]]))
        if tot_in != tot_out:
            raise ValueError(f"Reshape '{self.name}': {cs} has {tot_in} values per item, "
                             f"{out} needs {tot_out}")
        return out

    def compute_output_shape(self, input_shape):
        return keras_shape(self._out_caffe(input_shape))

    def call(self, x):
        out = self._out_caffe(x.shape)
        return from_caffe_layout(ops.reshape(to_caffe_layout(x), [-1] + out[1:]))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(shape=self.shape, axis=self.axis, num_axes=self.num_axes)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeCrop(keras.layers.Layer):
    """Caffe's Crop: crops input 0 to the shape of input 1 on Caffe axes ``>= axis``, starting
    at ``offset`` (one value for all axes, one per axis, or none = 0)."""

    def __init__(self, axis: int = 2, offset: Sequence[int] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.offset = [int(o) for o in offset]

    def _slices(self, s0, s1):
        c0, c1 = list(caffe_shape(s0)), list(caffe_shape(s1))
        r = len(c0)
        a = self.axis + r if self.axis < 0 else self.axis
        if len(self.offset) not in (0, 1, r - a):
            raise ValueError(f"Crop '{self.name}': {len(self.offset)} offsets for {r - a} axes")
        sl = [slice(None)] * r
        shape = list(c0)
        for i in range(a, r):
            off = 0 if not self.offset else (self.offset[0] if len(self.offset) == 1
                                             else self.offset[i - a])
            if c1[i] is None or c0[i] is None:
                raise ValueError(f"Crop '{self.name}' needs known dims")
            if off + c1[i] > c0[i]:
                raise ValueError(f"Crop '{self.name}': offset {off} + size {c1[i]} exceeds "
                                 f"{c0[i]} on axis {i}")
            sl[i] = slice(off, off + c1[i])
            shape[i] = c1[i]
        kperm = from_caffe_perm(r)
        return [sl[i] for i in kperm], keras_shape(shape)

    def compute_output_shape(self, input_shape):
        return self._slices(input_shape[0], input_shape[1])[1]

    def call(self, inputs):
        x, ref = inputs
        sl, _ = self._slices(x.shape, ref.shape)
        return x[tuple(sl)]

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, offset=self.offset)
        return cfg
