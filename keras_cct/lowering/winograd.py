"""Winograd convolution F(m x m, 3 x 3) as a lowering, one batched GEMM and a lifting.

For 3x3 kernels at stride 1 and dilation 1 (any padding, any groups), Lavin & Gray's minimal
filtering computes each m x m output tile from an n x n input tile (n = m + 2) with n*n
multiplications per channel pair instead of 9*m*m:

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A        (per channel pair, summed over channels)

and the sum over channels of the element-wise product is, for each of the n*n tile positions,
one GEMM: a batched GEMM ``(n*n, tiles, c) x (n*n, c, o)``. Here, in Caffe con Troll's terms:

* **lowering** (input transform ``B^T d B``): the padded input, viewed as ``(b, th+1, m, W, c)``,
  gives the n rows of every tile as n slices (no gather); ``B^T``'s few additions along the
  height turn them into n tensors, stacked on a leading axis, and the same again along the
  width, so the result is already ``(n*n, b*th*tw, c)``, the GEMM's batched data matrix (for
  F(2x2) each of the n*n results is written directly as one sum of its tile's slices, with no
  stacked intermediate: :attr:`_Tiling.one_pass`);
* **kernel transform** ``G g G^T`` (tiny): ``(3, 3, c, o) -> (n*n, c, o)``, one small GEMM by
  ``G (x) G``;
* one batched GEMM for every channel group on TensorFlow (each group's images are transformed as
  images of their own, the groups then side by side on the GEMM's batched axis: one program
  for XLA to compile, not one per group: ``WINOGRAD_GROUPS_AT_ONCE``), one per group on JAX
  and PyTorch;
* **lifting** (output transform ``A^T m A``): additions along the height, then the width, and one
  interleave of the m*m results to ``(b, m*th, m*tw, o)``, cropped to the output size.

The batch goes through these steps a partition at a time (CcT's batch partitioning, sized to
the cache rather than to the GEMM): about :func:`images_per_partition` images, whose data fits
:data:`PARTITION_BYTES` (:func:`partition_images`: a near divisor of the batch; JAX, which
compiles the whole step, runs the whole batch). A whole batch's data is read back from memory
at every step (CaffeNet's conv3-conv5 at batch 128: 250-300 MB): forward+backward of
conv2-conv5 there on TensorFlow (AMD EPYC, AVX2) took 3.2 s as one partition, 2.1 s as 8.

The gradients are written out (as :func:`keras_cct.lowering.engine.lowered_conv2d` does): the
output gradient goes through the adjoint of the lifting (``A dY A^T``, a lowering of ``dy``),
two batched GEMMs give the transformed kernel's and data's gradients, ``G^T dU G`` the kernel's,
and the adjoint of the input transform (``B dV B^T``, then an overlap-add of the stride-m,
n x n tiles as padded additions) the input's. Every step is a handful of slices and additions
written with ``keras.ops``, so it runs on TensorFlow (also under XLA), JAX and PyTorch, for any
(also unknown) batch size, in the input's dtype (bfloat16 included).

The four data transforms go through the backend's ``fused``
(:mod:`keras_cct.lowering._backend`): on TensorFlow each is one XLA cluster, compiled once per
shape, so that its slices and additions make few passes over memory instead of one per op
(CaffeNet conv3, forward+backward at batch 32 in float32, F(2x2) / F(4x4): 52 / 52 ms as
separate ops, 40 / 36 as clusters, against 52-56 for oneDNN's direct convolution); in 16-bit
floats (TensorFlow and JAX) the transforms compute in float32 and only the GEMMs' operands are
rounded back. How many passes XLA's CPU compiler makes follows its fusion rules: it stores a
value read along more than 15 index paths, a stack of more than 8 tensors and a concatenation
along the last axis. So F(2x2)'s transforms read their leaves straight from one (padded) input,
stack at most n tensors at a time, put channel groups side by side as a stack and a reshape, and
the lifting takes its GEMM results one tensor per tile position (otherwise the conversion of the
whole 16-bit result to float32 was a pass of its own): at batch 32 the four transforms of
CaffeNet conv4 took 16.2 -> 10.0 ms in bfloat16 and 13.6 -> 11.2 in float32, the layer's
forward+backward 27.4 -> 23.2 and 46.4 -> 44.0 ms (oneDNN's direct convolution 29.0 / 54.1).

``tile=2`` is F(2x2, 3x3): 16 products per 4 outputs (2.25x fewer multiplications than the
direct convolution), transforms of additions only; relative error about 8e-7 in float32 (the
backend's direct convolution: about 2e-6) and 5e-3 in bfloat16 (the direct one: 3e-3). ``tile=4``
is F(4x4, 3x3): 36 per 16 (4x fewer), larger transforms, relative error about 1e-5 in float32 but
about 1e-1 in bfloat16 (the GEMM's bfloat16 output, amplified by the lifting's entries up to 8):
use ``tile=2`` for bfloat16. (Errors against a float64 convolution of CaffeNet's conv3 shape at
batch 8, TensorFlow.)

On PyTorch (eager) the transforms write their results in place into a tile-major layout and the
batched GEMMs are grouped 1x1 convolutions (:mod:`keras_cct.lowering.winograd_torch`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
from keras import ops

from keras_cct.lowering import _backend as B
from keras_cct.lowering._backend.common import partition_size
from keras_cct.lowering.cost import value_bytes
from keras_cct.lowering.geometry import PLAN_BATCH, ConvGeometry
from keras_cct.lowering.winograd_matrices import (KERNELS, TILE_KERNELS, _matrices,
                                                 winograd_applies)
from keras_cct.lowering.winograd_torch import torch_transforms


#: Bytes of transformed data (the GEMMs' operand ``V`` and product ``M``, every channel group)
#: per batch partition (:func:`images_per_partition`): about the last-level cache of the CPU
#: it was measured on (32 MB; a 2-core AMD EPYC with AVX2, float32). There, forward+backward
#: ms per image at batch 64 by images per partition, 8 / 16 / 32 / 64 (the whole batch), and
#: this default's (``python -m benchmarks.partitions``, docs/benchmarks/epyc-avx2/partitions):
#:
#: ============================  =============================  =============================
#: CaffeNet layer (MB an image)  TensorFlow                     PyTorch
#: ============================  =============================  =============================
#: conv2, F(4x4, 5x5) (4.4)      5.5 6.3 7.9 9.4 / 5.5 (7)      7.1 7.1 9.1 15.0 / 7.3 (7)
#: conv3 (2.0)                   4.0 3.7 4.1 4.8 / 3.8 (16)     4.9 4.3 4.7 6.2 / 4.6 (16)
#: conv4 (2.4)                   4.0 3.3 3.8 5.2 / 3.6 (13)     3.9 3.6 4.2 5.4 / 3.9 (13)
#: conv5 (2.0)                   2.8 2.4 2.3 2.9 / 2.4 (16)     3.0 2.8 2.7 3.5 / 2.9 (16)
#: ============================  =============================  =============================
#:
#: (The defaults in brackets aimed at that many images; a partition now takes a near divisor
#: of the batch, :func:`partition_images`: conv4's 16 at batch 64. JAX runs the whole batch:
#: ``WINOGRAD_PARTITIONS`` of its backend module.) On TensorFlow
#: at batch 16, by 1 / 2 / 4 / 8 / 16 images (an earlier form, split around the whole
#: convolution): VGG16's conv3_1 (19 MB an image) 27.7 / 28.1 / 33.5 / 36.6 / 40.4, conv4_2
#: (12.8 MB) 48.3 / 39.6 / 41.0 / 45.8 / 52.8, ResNet-50's 7x7x512 layer (1 MB) 16.9 / 11.0 /
#: 6.9 / 4.7 / 3.7 (its kernel, 16 MB transformed, is read and its gradient written once per
#: partition).
PARTITION_BYTES = 32 << 20


# ------------------------------------------------------------------ the 1-D transforms

def _combine(pieces: Sequence, mat: np.ndarray) -> List:
    """``[sum_j mat[i, j] * pieces[j] for each row i]``, with additions and subtractions for
    coefficients +-1, a scaling for the others, and zero coefficients skipped."""
    out = []
    for row in mat:
        pos, neg = [], []
        for c, p in zip(row, pieces):
            if c == 1:
                pos.append(p)
            elif c == -1:
                neg.append(p)
            elif c > 0:
                pos.append(p * float(c))
            elif c < 0:
                neg.append(p * float(-c))
        if pos:
            acc = B.add_n(pos)
            out.append(ops.subtract(acc, B.add_n(neg)) if neg else acc)
        else:
            out.append(ops.negative(B.add_n(neg)))
    return out


def _shape(t) -> List[int]:
    """Static shape with -1 for the (only) unknown size, the batch."""
    return [-1 if v is None else int(v) for v in t.shape]


def _tile_slices(t, axis: int, tiles: int, m: int, n: int) -> List:
    """The n slices of ``t`` (size ``m * (tiles + (n - 1) // m)`` along ``axis``) holding element
    ``i`` of every stride-m tile: ``t[..., i : i + m * tiles : m, ...]`` for i < n, taken from
    the view ``(..., tiles + (n - 1) // m, m, ...)`` as plain (unstrided) slices."""
    shape = _shape(t)
    view = ops.reshape(t, shape[:axis] + [shape[axis] // m, m] + shape[axis + 1:])
    idx = [slice(None)] * (len(shape) + 1)
    out = []
    for i in range(n):
        idx[axis], idx[axis + 1] = slice(i // m, i // m + tiles), i % m
        out.append(view[tuple(idx)])
    return out


def _overlap_add(pieces: Sequence, axis: int, tiles: int, m: int):
    """Adjoint of :func:`_tile_slices`: ``pieces[i]`` (``tiles`` long along ``axis``) summed into
    positions ``i + m * t`` of a tensor of size ``m * (tiles + (n - 1) // m)`` along ``axis``
    (n pieces)."""
    rank, spare = len(pieces[0].shape), (len(pieces) - 1) // m
    residues = []
    for r in range(m):
        parts = []
        for i in range(r, len(pieces), m):
            pads = [[0, 0]] * rank
            pads[axis] = [i // m, spare - i // m]
            parts.append(ops.pad(pieces[i], pads))
        residues.append(B.add_n(parts))
    t = ops.stack(residues, axis=axis + 1)
    shape = _shape(t)
    return ops.reshape(t, shape[:axis] + [m * (tiles + spare)] + shape[axis + 2:])


def _interleave(pieces: Sequence, axis: int):
    """``pieces`` (m tensors) interleaved along ``axis``: element t of piece j at ``m * t + j``."""
    t = ops.stack(list(pieces), axis=axis + 1)
    shape = _shape(t)
    return ops.reshape(t, shape[:axis] + [shape[axis] * len(pieces)] + shape[axis + 2:])


def _sums(leaf, rows: np.ndarray, cols: np.ndarray) -> List[List]:
    """``out[q][p] = sum_i sum_j rows[p, i] * cols[q, j] * leaf(i, j)``, the 2-D transform of
    every tile, as one expression per output (summed along ``j``, then ``i``) with no stacked
    intermediate: XLA computes it inside the pass that writes the result."""
    part = [_combine([leaf(i, j) for j in range(cols.shape[1])], cols)
            for i in range(rows.shape[1])]
    return [_combine([part[i][q] for i in range(rows.shape[1])], rows)
            for q in range(cols.shape[0])]


def _grid(out: Sequence[Sequence], axis_p: int, axis_q: int):
    """``out[q][p]`` stacked: ``q`` on ``axis_q`` inside, then ``p`` on ``axis_p`` (stacks of
    at most 8 tensors, the most XLA's CPU compiler fuses into a consumer)."""
    return ops.stack([ops.stack([row[p] for row in out], axis=axis_q)
                      for p in range(len(out[0]))], axis=axis_p)


def _join(parts: Sequence):
    """Channel groups side by side along the last axis, as a stack on the axis before it and a
    reshape: XLA fuses that into the pass computing them, where it runs a concatenation along
    the last axis as a separate pass."""
    if len(parts) == 1:
        return parts[0]
    y = ops.stack(list(parts), axis=-2)
    shape = _shape(y)
    return ops.reshape(y, shape[:-2] + [shape[-2] * shape[-1]])


# ------------------------------------------------------------------ keras.ops: fused per backend

@dataclass(frozen=True)
class _Tiling:
    """The tiling of one convolution by F(tile x tile, r x r): everything the transforms depend
    on (hashable, so that their compiled forms are cached by it)."""

    geo: ConvGeometry
    tile: int

    @property
    def m(self) -> int:
        return self.tile

    @property
    def r(self) -> int:
        return self.geo.kh

    @property
    def n(self) -> int:
        return self.tile + self.r - 1

    @property
    def spare(self) -> int:
        """Tiles' worth of input beyond the last tile's start (a tile reads n = m + r - 1)."""
        return (self.n - 1) // self.m

    @property
    def nn(self) -> int:
        return self.n * self.n

    @property
    def th(self) -> int:
        return -(-self.geo.out_h // self.m)

    @property
    def tw(self) -> int:
        return -(-self.geo.out_w // self.m)

    @property
    def one_pass(self) -> bool:
        """Whether the transforms compute each output from its tile's slices in one expression
        (F(2x2): at most 4 terms after the input, 9 before the output transform) rather than in
        two stages with a stored intermediate (F(4x4): up to 16 and 25 terms, which XLA's
        loops then recompute per element: measured 1.3-5x slower in one pass)."""
        return self.tile == 2 and self.r == 3

    @property
    def pads(self) -> List[List[int]]:
        """The input's padding: Caffe's, then enough for every tile (and :attr:`spare`) to fit."""
        (pt, _), (pl, _) = self.geo.pad
        hp, wp = self.m * (self.th + self.spare), self.m * (self.tw + self.spare)
        return [[0, 0], [pt, hp - self.geo.in_h - pt], [pl, wp - self.geo.in_w - pl], [0, 0]]


def _groups(t, groups: int, width: int) -> List:
    """``t``'s channel groups (the last axis cut into ``groups`` slices of ``width``)."""
    return [t[..., g * width:(g + 1) * width] for g in range(groups)] if groups > 1 else [t]


def _concat(ts: Sequence):
    return ops.concatenate(list(ts), axis=-1) if len(ts) > 1 else ts[0]


def _groups_to_batch(x, groups: int):
    """``(b, h, w, groups * c)`` -> ``(groups * b, h, w, c)``: each channel group as images of
    its own, so that every group goes through one transform (one expression for XLA to
    compile, where one per group made the program and its compilation as many times larger)
    and, the transformed groups lying side by side on the GEMMs' batched axis, one batched
    GEMM. The images are transposed, not the (larger) transformed data."""
    if groups == 1:
        return x
    shape = _shape(x)
    x = ops.transpose(ops.reshape(x, shape[:3] + [groups, shape[3] // groups]), (3, 0, 1, 2, 4))
    return ops.reshape(x, [-1] + shape[1:3] + [shape[3] // groups])


def _groups_to_channels(t: _Tiling, v, width: int):
    """Inverse of :func:`_groups_to_batch` on the transformed side: ``(..., groups * b*th*tw,
    width)`` (a GEMM's result, the groups on its rows) -> ``(..., b, th, tw, groups, width)``
    (``(..., b, th, tw, width)`` for one group), for the lifting and the input's gradient,
    which keep the groups as an axis of their own before the channels (:func:`_merged`) until
    their result: XLA then computes it in one pass, where regrouping the result added a pass
    and merging the groups into the channels first slowed that pass by its index arithmetic.
    (F(2x2)'s lifting, of 16 inputs, lifts a group at a time: faster still.)"""
    lead = _shape(v)[:-2]
    g = t.geo.groups
    if g == 1:
        return ops.reshape(v, lead + [-1, t.th, t.tw, width])
    k = len(lead)
    v = ops.reshape(v, lead + [g, -1, t.th, t.tw, width])
    return ops.transpose(v, tuple(range(k)) + (k + 1, k + 2, k + 3, k, k + 4))


def _merged(t: _Tiling, y):
    """``(b, h, w, groups, width)`` -> ``(b, h, w, groups * width)`` (one group: ``y``)."""
    if t.geo.groups == 1:
        return y
    shape = _shape(y)
    return ops.reshape(y, shape[:3] + [shape[3] * shape[4]])


def _input_transform(t: _Tiling, x):
    """Lowering: ``(b, h, w, c)`` -> ``(nn * groups, b*th*tw, cg)`` (``B^T d B``, every channel
    group at once: :func:`_groups_to_batch`)."""
    bt, geo, m = _matrices(t.tile, t.r)[0], t.geo, t.m
    xp = ops.pad(_groups_to_batch(x, geo.groups), t.pads)
    if t.one_pass:  # slices of one padded view
        shape = _shape(xp)
        view = ops.reshape(xp, [shape[0], t.th + t.spare, m, t.tw + t.spare, m, shape[3]])
        v = _grid(_sums(lambda i, j: view[:, i // m:i // m + t.th, i % m,
                                          j // m:j // m + t.tw, j % m], bt, bt), 0, 0)
    else:
        rows = ops.stack(_combine(_tile_slices(xp, 1, t.th, m, t.n), bt), axis=0)
        v = ops.stack(_combine(_tile_slices(rows, 3, t.tw, m, t.n), bt), axis=1)
    return ops.reshape(v, (t.nn * geo.groups, -1, geo.cg))  # from (n, n, g*b, th, tw, cg)


def _input_adjoint(t: _Tiling, dv):
    """Adjoint of :func:`_input_transform`: ``(nn * groups, b*th*tw, cg)`` -> ``(b, h, w, c)``."""
    bt, geo, m = _matrices(t.tile, t.r)[0], t.geo, t.m
    (pt, _), (pl, _) = geo.pad
    dv = _groups_to_channels(t, ops.reshape(dv, (t.n, t.n, -1, geo.cg)), geo.cg)
    cols = _combine([dv[:, j] for j in range(t.n)], bt.T)  # n x (n, b, th, tw, [g,] cg)
    rows = _overlap_add(cols, 3, t.tw, m)  # (n, b, th, wp, [g,] cg)
    dxp = _overlap_add(_combine([rows[i] for i in range(t.n)], bt.T), 1, t.th, m)
    return _merged(t, dxp[:, pt:pt + geo.in_h, pl:pl + geo.in_w])


def _output_transform(t: _Tiling, mm):
    """Lifting (``A^T M A``): ``(nn * groups, b*th*tw, og)`` -- for F(2x2), as the list of its
    ``nn * groups`` rows (tile position, then group), each ``(b*th*tw, og)`` (see
    :func:`_transforms`), lifted a group at a time -- -> ``(b, out_h, out_w, o)``."""
    at, geo, m, n = _matrices(t.tile, t.r)[2], t.geo, t.m, t.n
    if t.one_pass:
        g = geo.groups
        outs = []
        for k in range(g):
            mk = [ops.reshape(z, (-1, t.th, t.tw, geo.og)) for z in mm[k::g]]
            y = _grid(_sums(lambda i, j: mk[i * n + j], at, at), 2, 3)  # (b, th, m, tw, m, o)
            shape = _shape(y)
            y = ops.reshape(y, [shape[0], shape[1] * m, shape[3] * m, shape[5]])
            outs.append(y[:, :geo.out_h, :geo.out_w])
        return _join(outs)
    mm = _groups_to_channels(t, ops.reshape(mm, (n, n, -1, geo.og)), geo.og)
    rows = _combine([mm[i] for i in range(n)], at)  # m x (n, b, th, tw, [g,] og)
    y = _interleave([_interleave(_combine([r[j] for j in range(n)], at), 2) for r in rows], 1)
    return _merged(t, y[:, :geo.out_h, :geo.out_w])


def _output_adjoint(t: _Tiling, dy):
    """Adjoint of :func:`_output_transform`: ``(b, out_h, out_w, o)`` -> ``(nn * groups,
    b*th*tw, og)``."""
    at, geo, m = _matrices(t.tile, t.r)[2], t.geo, t.m
    dy = _groups_to_batch(dy, geo.groups)
    if (m * t.th, m * t.tw) != (geo.out_h, geo.out_w):
        dy = ops.pad(dy, [[0, 0], [0, m * t.th - geo.out_h], [0, m * t.tw - geo.out_w], [0, 0]])
    view = ops.reshape(dy, (-1, t.th, m, t.tw, m, geo.og))
    if t.one_pass:
        dm = _grid(_sums(lambda i, j: view[:, :, i, :, j], at.T, at.T), 0, 0)
    else:
        cols = ops.stack(_combine([view[:, :, :, :, j] for j in range(m)], at.T), axis=0)
        dm = ops.stack(_combine([cols[:, :, :, i] for i in range(m)], at.T), axis=0)
    return ops.reshape(dm, (t.nn * geo.groups, -1, geo.og))  # from (n, n, g*b, th, tw, og)


def _per_group(fn, groups: int, width: int):
    """``fn`` on each channel group of a whole tensor, one at a time (PyTorch's transforms)."""
    return lambda a: [fn(p) for p in _groups(a, groups, width)]


def _joined(fn):
    """``fn`` on each group's tensor, the results concatenated along the channels."""
    return lambda parts: _concat([fn(p) for p in parts])


def _in_lists(fn, takes: bool, gives: bool, unstack: bool = False):
    """``fn`` (every group in one tensor) behind the per-group interface of :func:`_transforms`:
    a list of one in (``takes``; unstacked along its first axis with ``unstack``) and out
    (``gives``); ``fn`` stays reachable as ``.fused``."""
    def run(a):
        if takes:
            (a,) = a
            a = ops.unstack(a) if unstack else a
        y = fn(a)
        return [y] if gives else y

    run.fused = fn
    return run


def _kernel_transforms(t: _Tiling) -> Tuple[Callable, Callable]:
    """``(transform, adjoint)`` of the kernel, ``G g G^T`` as one small GEMM: ``transform``
    takes ``(r, r, cg, o)`` to the list of what the GEMMs take, on PyTorch one ``(nn, cg, og)``
    per group, elsewhere ``[(nn * groups, cg, og)]``, the groups on the batched axis as
    :func:`_input_transform` puts them; ``adjoint`` takes the list of their gradients back to
    ``(r, r, cg, o)``. The groups are reordered on the kernel (r*r values a channel pair), not
    on its transform (nn)."""
    geo, r = t.geo, t.r
    g, cg, og, o = geo.groups, geo.cg, geo.og, geo.filters
    gm = _matrices(t.tile, r)[1]
    gg = np.kron(gm, gm)  # (nn, r*r): G g G^T for every (c, o) pair at once
    fold = g > 1 and B.WINOGRAD_GROUPS_AT_ONCE

    def transform(k):
        if fold:  # each group's filters after the other's: (r, r, g, cg, og)
            k = ops.transpose(ops.reshape(k, (r, r, cg, g, og)), (0, 1, 3, 2, 4))
        u = B.matmul(B.constant(gg, k), ops.reshape(k, (r * r, cg * o)))
        if fold:
            return [ops.reshape(u, (t.nn * g, cg, og))]
        return _groups(ops.reshape(u, (t.nn, cg, o)), g, og)

    def adjoint(dus):
        du = dus[0] if fold else _concat(dus)
        dk = B.matmul_tn(B.constant(gg, du), ops.reshape(du, (t.nn, cg * o)))
        if fold:
            dk = ops.transpose(ops.reshape(dk, (r, r, g, cg, og)), (0, 1, 3, 2, 4))
        return ops.reshape(dk, (r, r, cg, o))

    return transform, adjoint


#: The axis that follows the batch in each kind of the transforms' arguments, by rank: images
#: ``(b, h, w, c)``, a GEMM's operand ``(nn, b*th*tw, c)`` and one tile position's rows
#: ``(b*th*tw, c)`` (the backend's ``fused`` traces each transform once for every batch).
BATCH_AXES = {4: 0, 3: 1, 2: 0}


def _one_group(t: _Tiling) -> _Tiling:
    """The tiling of one channel group's convolution."""
    g = t.geo
    return _Tiling(replace(g, channels=g.cg, filters=g.og, groups=1), t.tile)


def _side(t: _Tiling, output: bool) -> _Tiling:
    """``t`` with only what one side's transforms read: the input's (the input transform and
    its adjoint: no output channels) or the output's (the lifting and its adjoint: no input
    size, padding or channels), and no batch; layers alike on that side share its compiled
    clusters (CaffeNet's conv4 and conv5 the input's, VGG16's conv3_1 and conv3_2 the
    output's: two XLA compilations fewer each)."""
    g = t.geo
    if output:
        return _Tiling(replace(g, batch=None, in_h=0, in_w=0, channels=g.groups,
                               pad=((0, 0), (0, 0))), t.tile)
    return _Tiling(replace(g, batch=None, filters=g.groups), t.tile)


@functools.lru_cache(maxsize=512)
def _fused(f: Callable, t: _Tiling) -> Callable:
    """The transform ``f`` of ``t`` through the backend's ``fused`` (made once per tiling)."""
    return B.fused(functools.partial(f, t), BATCH_AXES, key=repr((f.__name__, t)))


@functools.lru_cache(maxsize=256)
def _transforms(t: _Tiling) -> Tuple:
    """``(input_transform, input_adjoint, output_transform, output_adjoint, gemm, gemm_dv,
    gemm_du, kernel_transform, kernel_adjoint)`` for ``t``, the data of each channel group as
    one item of a list: the ``keras.ops`` transforms, each passed through the backend's
    ``fused`` (on TensorFlow one XLA cluster each, made once per tiling of its side:
    :func:`_side`), every group at once (a list of one: :func:`_groups_to_batch`) or, where
    the backend's ``WINOGRAD_GROUPS_AT_ONCE`` is off, one group's transforms per group
    (:func:`_one_group`; on PyTorch the in-place forms of
    :mod:`keras_cct.lowering.winograd_torch`), and batched GEMMs. The transformed kernel goes
    through ``kernel_transform`` to the GEMMs and its gradient back through ``kernel_adjoint``
    (:func:`_kernel_transforms`). F(2x2)'s lifting gets its GEMM results unstacked (one tensor
    per tile position; on TensorFlow views, no copy): from one 16-bit tensor, XLA converted
    the whole of it to float32 in a pass of its own before the lifting (CaffeNet conv4 at
    batch 32 in bfloat16: 3.6-5.1 ms one tensor, 1.9-2.1 ms unstacked)."""
    kernel = _kernel_transforms(t)
    geo = t.geo
    if B.NAME == "torch":
        (input_transform, input_adjoint, output_transform, output_adjoint,
         *gemms) = torch_transforms(t)
        return (_per_group(input_transform, geo.groups, geo.cg), _joined(input_adjoint),
                _joined(output_transform), _per_group(output_adjoint, geo.groups, geo.og),
                *gemms, *kernel)
    if geo.groups > 1 and not B.WINOGRAD_GROUPS_AT_ONCE:  # one group's transforms per group
        fi, fia, fo, foa, *gemms = _transforms(_one_group(t))[:7]
        return (lambda x: [v for xg in _groups(x, geo.groups, geo.cg) for v in fi(xg)],
                lambda dvs: _join([fia([dv]) for dv in dvs]),
                lambda mms: _join([fo([mm]) for mm in mms]),
                lambda dy: [dm for dg in _groups(dy, geo.groups, geo.og) for dm in foa(dg)],
                *gemms, *kernel)
    fi, fia, fo, foa = (_fused(f, _side(t, output=i >= 2)) for i, f in enumerate(
        (_input_transform, _input_adjoint, _output_transform, _output_adjoint)))
    # F(2x2)'s lifting takes each tile position's GEMM result as its own tensor
    return (_in_lists(fi, takes=False, gives=True), _in_lists(fia, takes=True, gives=False),
            _in_lists(fo, takes=True, gives=False, unstack=t.one_pass),
            _in_lists(foa, takes=False, gives=True), B.bmm,
            lambda dm, u: B.bmm(dm, u, tb=True),
            lambda v, dm: B.bmm(v, dm, ta=True), *kernel)


# ------------------------------------------------------------------ the convolution

def transformed_bytes_per_image(geo: ConvGeometry, tile: int = 2, dtype_bytes: int = 4) -> int:
    """Bytes of one image's transformed data: the GEMMs' operand ``V`` and product ``M``,
    ``n*n*th*tw*(c + o)`` values."""
    t = _Tiling(geo, tile)
    return t.nn * t.th * t.tw * (geo.channels + geo.filters) * dtype_bytes


def images_per_partition(geo: ConvGeometry, tile: int = 2, dtype_bytes: int = 4) -> int:
    """Images per batch partition of :func:`winograd_conv2d`: as many whole images as keep one
    partition's transformed data (:func:`transformed_bytes_per_image`) within
    :data:`PARTITION_BYTES` (at least one image)."""
    return max(1, PARTITION_BYTES // transformed_bytes_per_image(geo, tile, dtype_bytes))


def partition_target(geo: ConvGeometry, tile: int, batch: int, dtype_bytes: int = 4) -> int:
    """Images a partition aims at: :func:`images_per_partition`, in at most ``MAX_PARTITIONS``
    (the whole batch where the backend's ``WINOGRAD_PARTITIONS`` is off: JAX)."""
    if not B.WINOGRAD_PARTITIONS:
        return max(1, batch)
    images = images_per_partition(geo, tile, dtype_bytes)
    if B.MAX_PARTITIONS:
        images = max(images, -(-batch // B.MAX_PARTITIONS))
    return images


def partition_images(geo: ConvGeometry, tile: int, batch: int, dtype_bytes: int = 4) -> int:
    """Images per partition :func:`winograd_conv2d` takes for ``batch`` by default: a near
    divisor of it (:func:`~keras_cct.lowering._backend.common.partition_size`) aiming at
    :func:`partition_target`: one shape, the planner's race's (CaffeNet conv4 at batch 32:
    16 + 16, where 13 + 13 + 6 compiled the transforms twice)."""
    return partition_size(batch, partition_target(geo, tile, batch, dtype_bytes))


def _partitions(x, images: int) -> List:
    """``x`` (a static batch) in partitions of ``images`` images, the last the remainder."""
    return [x[i:i + images] for i in range(0, x.shape[0], images)]


def winograd_conv2d(x, kernel, geo: ConvGeometry, *, tile: int = 2,
                    images: Optional[int] = None):
    """Convolution of channels-last ``x`` (b, h, w, c) with ``kernel`` (3, 3, c/groups, o) by
    Winograd's F(tile x tile, 3 x 3); no bias. Returns (b, out_h, out_w, o), differentiable
    with a hand-written gradient. Requires :func:`winograd_applies`.

    The batch is transformed, multiplied and lifted ``images`` images at a time (CcT's batch
    partitioning, so that a partition's transformed data is still in cache when the next step
    reads it; None: :func:`partition_images`; the last partition the remainder where
    ``images`` does not divide the batch). Where the batch size is not static (TensorFlow's
    ``fit``), the backend's ``map_batch`` loops over the batch's partitions (sized there by
    the rule of :func:`partition_images`, aiming at ``images`` or :func:`partition_target`),
    and the backward transforms each partition's input again rather than keep the whole
    batch's (TensorFlow, CaffeNet conv2-conv5 forward+backward at batch 32 and 128: 0.90-1.06x
    the time of keeping it)."""
    if not any(winograd_applies(geo, m) for m in TILE_KERNELS):
        raise ValueError(f"winograd_conv2d needs a {' or '.join(f'{k}x{k}' for k in KERNELS)} "
                         "kernel at stride 1 and dilation 1")
    t = _Tiling(geo, tile)
    (input_transform, input_adjoint, output_transform, output_adjoint,
     gemm, gemm_dv, gemm_du, kernel_transform, kernel_adjoint) = _transforms(t)
    n = x.shape[0]
    if images is None:  # a static batch: partition_images; an unknown one: sized in the loop
        sizer = partition_images if n is not None else partition_target
        images = sizer(geo, tile, n or geo.batch or PLAN_BATCH, value_bytes(x.dtype))
    images = max(1, int(images))

    def lift(xq, us):
        vs = input_transform(xq)
        return output_transform([gemm(v, u) for v, u in zip(vs, us)]), vs

    def lift_adjoint(vs, dyq, us):  # -> (dx, [du per group])
        dms = output_adjoint(dyq)
        return (input_adjoint([gemm_dv(dm, u) for dm, u in zip(dms, us)]),
                [gemm_du(v, dm) for v, dm in zip(vs, dms)])

    def forward(x, kernel):
        us = kernel_transform(kernel)
        if n is None:  # a loop in the graph; the backward transforms x again
            (y,), _ = B.map_batch(lambda xq: ([lift(xq, us)[0]], []), [x], images)
            return y, (None, x, us)
        ys, saved = [], []
        for xq in _partitions(x, images):
            y, vs = lift(xq, us)
            ys.append(y)
            saved.append(vs)
        return _concat_batch(ys), (saved, None, us)

    def backward(dy, saved):
        vparts, x, us = saved
        if vparts is None:  # a batch of unknown size
            def part(xq, dyq):
                dx, dus = lift_adjoint(input_transform(xq), dyq, us)
                return [dx], dus

            (dx,), dus = B.map_batch(part, [x, dy], images)
            return dx, kernel_adjoint(dus)
        dxs, dus = [], []
        for vs, dyq in zip(vparts, _partitions(dy, images)):
            dx, du = lift_adjoint(vs, dyq, us)
            dxs.append(dx)
            dus.append(du)
        du = [B.add_n(list(per_group)) for per_group in zip(*dus)]
        return _concat_batch(dxs), kernel_adjoint(du)

    return B.custom_conv(forward, backward, x, kernel)


def _concat_batch(ts: Sequence):
    return ops.concatenate(list(ts), axis=0) if len(ts) > 1 else ts[0]
