"""The three lowered convolutions of Caffe con Troll, with hand-written gradients.

A convolution is computed as *lowering* (tensor -> matrix), one GEMM per channel group, and
*lifting* (matrix -> tensor). Each spatial axis is either **lowered** (the input is replicated k
times along it, im2col-style) or **lifted** (the GEMM output is replicated k times along it and
a k-way shift-and-add brings it back):

=========  ==========  ==========  =========================================================
lowering   height      width       GEMM (per group)
=========  ==========  ==========  =========================================================
type1      lowered     lowered     (b*oh*ow, kh*kw*d) x (kh*kw*d, o)             (im2col)
type2      lowered     lifted      (b*oh*pw, kh*d)    x (kh*d, kw*o), kw-way lifting
type3      lifted      lifted      (b*ph*pw, d)       x (d, kh*kw*o), kh*kw-way lifting
=========  ==========  ==========  =========================================================

(``d`` input channels per group, ``o`` filters per group, ``ph, pw`` the padded input size.)

A lowering is one gather of whole channel rows of the padded input (:func:`_lower_index` lists
them), so the lowered matrix is written in a single pass. CcT's batch partitioning: the batch is
cut into contiguous partitions of about :data:`keras_cct.lowering.cost.PARTITION_BYTES` of
lowered data each, and each partition is lowered and multiplied in turn while its matrix is still
in cache (a whole-batch matrix of CaffeNet's conv2 is 112 MB per group).

The gradient of a lowering is a lifting and vice versa: the adjoint of im2col is col2im, a
shift-and-add (:func:`_unlower`), and the adjoint of a shift-and-add lifting is a lowering of the
output gradient (:func:`_unlift`). Both are written out in :func:`lowered_conv2d`'s custom
gradient, so that backpropagation runs two GEMMs per group plus those data movements, instead of
autodiff's per-slice scatter of zeros. All tensors are channels-last and all ops are
``keras.ops`` (plus :mod:`._backend` for transposed GEMMs), so this runs on TensorFlow (also
under XLA), JAX and PyTorch.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
from keras import ops

from keras_cct.lowering import _backend as B
from keras_cct.lowering.cost import copies_nothing
from keras_cct.lowering.cost import partitions as _partitions
from keras_cct.lowering.cost import value_bytes
from keras_cct.lowering.geometry import ConvGeometry
from keras_cct.lowering.names import LOWERED_TYPES

#: How each lowering treats the (height, width) axes.
MODES = dict(zip(LOWERED_TYPES, (("lower", "lower"), ("lower", "lift"), ("lift", "lift"))))


@dataclass(frozen=True)
class _Axis:
    """One spatial axis of a convolution: taps ``k``, stride, dilation, output and padded size."""

    dim: int  # tensor axis (1 = height, 2 = width)
    k: int
    s: int
    d: int
    out: int
    size: int  # padded input size

    def tap(self, i: int) -> slice:
        """Positions of the padded input read by tap ``i`` for every output position."""
        start = i * self.d
        return slice(start, start + (self.out - 1) * self.s + 1, self.s)


def _axes(geo: ConvGeometry) -> Tuple[_Axis, _Axis]:
    return (_Axis(1, geo.kh, geo.sh, geo.dh, geo.out_h, geo.padded_h),
            _Axis(2, geo.kw, geo.sw, geo.dw, geo.out_w, geo.padded_w))


def _index(**by_dim) -> tuple:
    idx = [slice(None)] * 4
    for dim, sl in by_dim.items():
        idx[int(dim[1:])] = sl
    return tuple(idx)


def _static_shape(t) -> List[int]:
    shape = [int(v) if v is not None else -1 for v in t.shape]
    shape[0] = -1
    return shape


def _zero_insert(t, axis: _Axis):
    """Insert ``s - 1`` zeros between elements along ``axis`` (the adjoint of a strided read)."""
    if axis.s == 1:
        return t
    shape = _static_shape(t)
    t = ops.expand_dims(t, axis.dim + 1)
    pads = [[0, 0]] * 5
    pads[axis.dim + 1] = [0, axis.s - 1]
    t = ops.pad(t, pads)
    shape[axis.dim] = shape[axis.dim] * axis.s
    t = ops.reshape(t, shape)
    return t[_index(**{f"d{axis.dim}": slice(0, (axis.out - 1) * axis.s + 1)})]


def _place(t, axis: _Axis, i: int):
    """Adjoint of reading tap ``i`` along ``axis``: put ``t`` (already zero-inserted) back at its
    positions in a zero tensor of the padded size."""
    before = i * axis.d
    after = axis.size - before - ((axis.out - 1) * axis.s + 1)
    pads = [[0, 0]] * 4
    pads[axis.dim] = [before, after]
    return ops.pad(t, pads)


@functools.lru_cache(maxsize=512)
def _lower_index(axes: Tuple[_Axis, _Axis], mode, groups: int, g: int) -> np.ndarray:
    """Rows of the padded input (viewed as ``(ph * pw * groups, cg)`` per image) that make up
    group ``g``'s lowered matrix, in its row-major order: output rows along lowered axes and
    input positions along lifted axes, then the taps of the lowered axes in (height, width)
    order. One gather of these rows is the whole lowering (im2col in one pass). Cached: the
    same layer asks for the same rows every step (the array must not be modified)."""
    per_axis = []
    for a, m in zip(axes, mode):
        if m == "lower":  # (out, k): position of tap i for output o
            per_axis.append(np.arange(a.out)[:, None] * a.s + np.arange(a.k)[None, :] * a.d)
        else:  # every padded position, no taps
            per_axis.append(np.arange(a.size)[:, None])
    (hpos, wpos), width = per_axis, axes[1].size
    pos = (hpos[:, None, :, None] * width + wpos[None, :, None, :])  # (H, W, th, tw)
    return (pos.reshape(-1) * groups + g).astype(np.int32)


def _lower(xp, axes: Sequence[_Axis], mode, groups: int, g: int, channels: int, rows):
    """Group ``g``'s lowered matrix of ``xp``: ``(b * rows, taps * channels)`` (Type 1: im2col;
    Type 2: along the height only; a grouped Type 3: the group's channels; a lowering that copies
    nothing is a reshape of ``xp`` instead, in :func:`lowered_conv2d`). ``rows``: the
    :func:`_lower_index` of the group as a backend index tensor (made once per call when the
    batch is lowered partition by partition)."""
    ph, pw = axes[0].size, axes[1].size
    taps = 1
    for a, m in zip(axes, mode):
        if m == "lower":
            taps *= a.k
    flat = ops.reshape(xp, (-1, ph * pw * groups, channels))
    cols = B.take_rows(flat, rows)
    return ops.reshape(cols, (-1, taps * channels))


def _unlower(dcols, axes: Sequence[_Axis], mode, channels: int):
    """col2im: the adjoint of :func:`_lower`. Sums each tap's gradient into its positions, one
    axis at a time (width first), so that a kh x kw lowering costs kh*kw + kh placements."""
    lowered = [a for a, m in zip(axes, mode) if m == "lower"]
    count = 1
    for a in lowered:
        count *= a.k
    pieces = [dcols[..., t * channels:(t + 1) * channels] for t in range(count)] \
        if count > 1 else [dcols]
    for a in reversed(lowered):
        grouped = [pieces[g:g + a.k] for g in range(0, len(pieces), a.k)]
        pieces = [B.add_n([_place(_zero_insert(p, a), a, i) for i, p in enumerate(group)])
                  for group in grouped]
    (dxp,) = pieces
    return dxp


#: Below this many channels per group, col2im is one segment sum instead of shifted additions:
#: each shifted addition writes a whole padded input, which for CaffeNet's conv1 (3 channels,
#: 11x11 taps) is 121 passes over 20 MB (210 ms at batch 32) against 25 ms for the segment sum;
#: from about 48 channels on the additions are as fast or faster (conv2: 17 vs 19 ms).
SEGMENT_COL2IM_CHANNELS = 16


def _unlower_segments(dcols, axes: Sequence[_Axis], mode, channels: int):
    """col2im as the exact adjoint of :func:`_lower`'s gather: a segment sum of the rows of
    ``dcols`` ``(b, H, W, taps * channels)`` into ``(b, ph, pw, channels)``, with the batch
    moved inside each row so that every segment adds ``b * channels`` contiguous values."""
    ph, pw = axes[0].size, axes[1].size
    idx = _lower_index(tuple(axes), mode, 1, 0)
    rows = ops.reshape(dcols, (-1, int(idx.size), channels))
    rows = ops.transpose(rows, (1, 0, 2))
    summed = B.segment_sum(rows, idx, ph * pw)
    return ops.reshape(ops.transpose(summed, (1, 0, 2)), (-1, ph, pw, channels))


def _lift(p, axes: Sequence[_Axis], mode, filters: int):
    """Shift-and-add: the k-way (or kh*kw-way) lifting of the GEMM output along lifted axes."""
    lifted = [a for a, m in zip(axes, mode) if m == "lift"]
    if not lifted:
        return p
    pieces = []
    for t, taps in enumerate(itertools.product(*[range(a.k) for a in lifted])):
        idx = {f"d{a.dim}": a.tap(i) for a, i in zip(lifted, taps)}
        idx["d3"] = slice(t * filters, (t + 1) * filters)
        pieces.append(p[_index(**idx)])
    return B.add_n(pieces)


def _unlift(dy, axes: Sequence[_Axis], mode):
    """Adjoint of :func:`_lift`: each tap's copy of the GEMM output gets ``dy`` placed at the
    positions that tap wrote (a lowering of the output gradient)."""
    lifted = [a for a, m in zip(axes, mode) if m == "lift"]
    if not lifted:
        return dy
    for a in lifted:
        dy = _zero_insert(dy, a)
    pieces = []
    for taps in itertools.product(*[range(a.k) for a in lifted]):
        t = dy
        for a, i in zip(lifted, taps):
            t = _place(t, a, i)
        pieces.append(t)
    return ops.concatenate(pieces, axis=-1) if len(pieces) > 1 else pieces[0]


def _kernel_perm(mode) -> Tuple[int, ...]:
    lowered = [i for i, m in enumerate(mode) if m == "lower"]
    lifted = [i for i, m in enumerate(mode) if m == "lift"]
    return tuple(lowered) + (2,) + tuple(lifted) + (3,)


def _kernel_matrix(kernel, mode):
    """(kh, kw, d, o) -> the GEMM's (lowered taps * d, lifted taps * o) matrix."""
    perm = _kernel_perm(mode)
    k = ops.transpose(kernel, perm) if perm != (0, 1, 2, 3) else kernel
    shape = [int(v) for v in k.shape]
    split = perm.index(2) + 1
    rows = 1
    for v in shape[:split]:
        rows *= v
    return ops.reshape(k, (rows, -1)), shape


def _kernel_from_matrix(m, permuted_shape, mode):
    perm = _kernel_perm(mode)
    k = ops.reshape(m, permuted_shape)
    if perm == (0, 1, 2, 3):
        return k
    inverse = [perm.index(i) for i in range(4)]
    return ops.transpose(k, inverse)


def _rows_shape(axes: Sequence[_Axis], mode) -> List[int]:
    """``[-1, H, W]`` of the GEMM's rows: output size along lowered axes, padded size along
    lifted ones."""
    return [-1] + [a.out if m == "lower" else a.size for a, m in zip(axes, mode)]


def default_partitions(geo: ConvGeometry, lowering: str, batch: Optional[int], dtype) -> int:
    """Batch partitions :func:`lowered_conv2d` cuts ``batch`` images of ``dtype`` into by
    default: :func:`keras_cct.lowering.cost.partitions`, the lowered values counted at their
    own size (a bfloat16 partition holds twice the images of a float32 one), at most the
    backend's ``MAX_PARTITIONS`` (JAX: each partition is unrolled in the compiled program)."""
    parts = _partitions(geo, lowering, batch, dtype_bytes=value_bytes(dtype))
    return min(parts, B.MAX_PARTITIONS) if B.MAX_PARTITIONS else parts


def lowered_conv2d(x, kernel, geo: ConvGeometry, lowering: str, *,
                   custom_gradient: bool = True, partitions: Optional[int] = None):
    """Convolution of channels-last ``x`` with ``kernel`` (kh, kw, d/groups, o) by ``lowering``.

    No bias: callers add it. Differentiable on every backend, with the gradient written out
    (``custom_gradient=False`` leaves it to autodiff, for comparison in the benchmarks).

    The batch is cut into ``partitions`` contiguous partitions (CcT's batch partitioning): each
    is lowered and multiplied by the kernel in turn, so its lowered matrix is still in cache
    when the GEMM reads it. None: :func:`default_partitions` for the static batch size, else
    ``geo.batch`` (about 4 MB of lowered data per partition, counted in ``x``'s dtype; 1 when
    neither is known, or when the lowering repeats no input value), at most the backend's
    ``MAX_PARTITIONS`` (JAX: 4, :mod:`keras_cct.lowering._backend.jax`).
    """
    mode = MODES[lowering]
    axes = _axes(geo)
    groups, cg, og = geo.groups, geo.cg, geo.og
    (pt, pb), (pl, pr) = geo.pad
    pads = [[0, 0], [pt, pb], [pl, pr], [0, 0]]
    padded = pt or pb or pl or pr
    lifted_taps = 1
    for a, m in zip(axes, mode):
        if m == "lift":
            lifted_taps *= a.k
    rows_shape = _rows_shape(axes, mode)
    unlower = _unlower_segments if cg < SEGMENT_COL2IM_CHANNELS and lowering != "type3" \
        else _unlower
    rows_per_image = rows_shape[1] * rows_shape[2]
    # the lowered matrix is the padded input itself (an ungrouped Type 3, a 1x1 Type 1 at
    # stride 1): no gather, and col2im is a reshape
    reshaped = copies_nothing(geo, lowering)
    if partitions is None:  # a shard of a split batch has no static size: plan for the whole
        partitions = default_partitions(geo, lowering, x.shape[0] or geo.batch, x.dtype)
    parts = max(int(partitions), 1)

    def group_slice(t, g, width):
        return t[..., g * width:(g + 1) * width] if groups > 1 else t

    def concat_rows(ts):
        return ops.concatenate(ts, axis=0) if len(ts) > 1 else ts[0]

    def forward(x, kernel):
        xp = ops.pad(x, pads) if padded else x
        xparts = B.split_batch(xp, parts)
        outs, saved = [], []
        for g in range(groups):
            wm, wshape = _kernel_matrix(group_slice(kernel, g, og), mode)
            if reshaped:
                cols = [ops.reshape(xq, (-1, cg)) for xq in xparts]
            else:
                rows = B.index_tensor(_lower_index(axes, mode, groups, g), like=xp)
                cols = [_lower(xq, axes, mode, groups, g, cg, rows) for xq in xparts]
            p = concat_rows([B.matmul(c, wm) for c in cols])
            p = ops.reshape(p, rows_shape + [lifted_taps * og])
            outs.append(_lift(p, axes, mode, og))
            saved.append((cols, wm, wshape))
        y = ops.concatenate(outs, axis=-1) if groups > 1 else outs[0]
        return y, saved

    def backward(dy, saved):
        dxs, dks = [], []
        for g, (cols, wm, wshape) in enumerate(saved):
            dp = _unlift(group_slice(dy, g, og), axes, mode)
            dp2d = ops.reshape(dp, (-1, lifted_taps * og))
            dparts = B.split_batch(dp2d, parts, unit=rows_per_image)
            dk = B.add_n([B.matmul_tn(c, d) for c, d in zip(cols, dparts)])
            dks.append(_kernel_from_matrix(dk, wshape, mode))
            dcols = ops.reshape(B.matmul_nt(dp2d, wm), rows_shape + [int(wm.shape[0])])
            dxs.append(dcols if reshaped else unlower(dcols, axes, mode, cg))
        dxp = ops.concatenate(dxs, axis=-1) if groups > 1 else dxs[0]
        if padded:
            dxp = dxp[:, pt:pt + geo.in_h, pl:pl + geo.in_w, :]
        dk = ops.concatenate(dks, axis=-1) if groups > 1 else dks[0]
        return dxp, dk

    if not custom_gradient:
        return forward(x, kernel)[0]
    return B.custom_conv(forward, backward, x, kernel)
