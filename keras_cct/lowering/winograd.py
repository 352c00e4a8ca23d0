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
  width, so the result is already ``(n*n, b*th*tw, c)``, the GEMM's batched data matrix;
* **kernel transform** ``G g G^T`` (tiny): ``(3, 3, c, o) -> (n*n, c, o)``, one small GEMM by
  ``G (x) G``;
* one batched GEMM per channel group;
* **lifting** (output transform ``A^T m A``): additions along the height, then the width, and one
  interleave of the m*m results to ``(b, m*th, m*tw, o)``, cropped to the output size.

The gradients are written out (as :func:`keras_cct.lowering.engine.lowered_conv2d` does): the
output gradient goes through the adjoint of the lifting (``A dY A^T``, a lowering of ``dy``),
two batched GEMMs give the transformed kernel's and data's gradients, ``G^T dU G`` the kernel's,
and the adjoint of the input transform (``B dV B^T``, then an overlap-add of the stride-m,
n x n tiles as padded additions) the input's. Every step is a handful of slices and additions
written with ``keras.ops``, so it runs on TensorFlow (also under XLA), JAX and PyTorch, for any
(also unknown) batch size, in the input's dtype (bfloat16 included).

``tile=2`` is F(2x2, 3x3): 16 products per 4 outputs (2.25x fewer multiplications than the
direct convolution), transforms of additions only; relative error about 5e-7 in float32 (the
backend's direct convolution: about 2e-6) and 1e-2 in bfloat16. ``tile=4`` is F(4x4, 3x3):
36 per 16 (4x fewer), larger transforms, relative error about 1e-5 in float32 but about 1e-1 in
bfloat16: use ``tile=2`` for bfloat16. (Errors against a float64 convolution, CaffeNet's conv3.)

On PyTorch (eager) the transforms write their results in place into a tile-major layout and the
batched GEMMs are grouped 1x1 convolutions (see :func:`_torch_transforms`).
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

import numpy as np
from keras import ops

from keras_cct.lowering import _backend as B
from keras_cct.lowering.geometry import ConvGeometry

#: (B^T, G, A^T) for F(m x m, 3 x 3), m in {2, 4}: interpolation points 0, +-1 (and +-2), inf.
_MATRICES = {
    2: ([[1, 0, -1, 0],
         [0, 1, 1, 0],
         [0, -1, 1, 0],
         [0, 1, 0, -1]],
        [[1, 0, 0],
         [0.5, 0.5, 0.5],
         [0.5, -0.5, 0.5],
         [0, 0, 1]],
        [[1, 1, 1, 0],
         [0, 1, -1, -1]]),
    4: ([[4, 0, -5, 0, 1, 0],
         [0, -4, -4, 1, 1, 0],
         [0, 4, -4, -1, 1, 0],
         [0, -2, -1, 2, 1, 0],
         [0, 2, -1, -2, 1, 0],
         [0, 4, 0, -5, 0, 1]],
        [[1 / 4, 0, 0],
         [-1 / 6, -1 / 6, -1 / 6],
         [-1 / 6, 1 / 6, -1 / 6],
         [1 / 24, 1 / 12, 1 / 6],
         [1 / 24, -1 / 12, 1 / 6],
         [0, 0, 1]],
        [[1, 1, 1, 1, 1, 0],
         [0, 1, -1, 2, -2, 0],
         [0, 1, 1, 4, 4, 0],
         [0, 1, -1, 8, -8, 1]]),
}

TILES = tuple(sorted(_MATRICES))

def winograd_applies(geo: ConvGeometry) -> bool:
    """Whether :func:`winograd_conv2d` computes this convolution: 3x3, stride 1, dilation 1."""
    return (geo.kh, geo.kw, geo.sh, geo.sw, geo.dh, geo.dw) == (3, 3, 1, 1, 1, 1)


@functools.lru_cache(maxsize=None)
def _matrices(tile: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    if tile not in _MATRICES:
        raise ValueError(f"tile must be one of {TILES}, got {tile!r}")
    return tuple(np.asarray(m, np.float64) for m in _MATRICES[tile])  # type: ignore


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
    """The n slices of ``t`` (size ``m * (tiles + 1)`` along ``axis``) holding element ``i`` of
    every stride-m tile: ``t[..., i : i + m * tiles : m, ...]`` for i < n, taken from the view
    ``(..., tiles + 1, m, ...)`` as plain (unstrided) slices."""
    shape = _shape(t)
    view = ops.reshape(t, shape[:axis] + [tiles + 1, m] + shape[axis + 1:])
    idx = [slice(None)] * (len(shape) + 1)
    out = []
    for i in range(n):
        idx[axis], idx[axis + 1] = slice(i // m, i // m + tiles), i % m
        out.append(view[tuple(idx)])
    return out


def _overlap_add(pieces: Sequence, axis: int, tiles: int, m: int):
    """Adjoint of :func:`_tile_slices`: ``pieces[i]`` (``tiles`` long along ``axis``) summed into
    positions ``i + m * t`` of a tensor of size ``m * (tiles + 1)`` along ``axis``."""
    rank = len(pieces[0].shape)
    residues = []
    for r in range(m):
        parts = []
        for i in range(r, len(pieces), m):
            pads = [[0, 0]] * rank
            pads[axis] = [i // m, 1 - i // m]
            parts.append(ops.pad(pieces[i], pads))
        residues.append(B.add_n(parts))
    t = ops.stack(residues, axis=axis + 1)
    shape = _shape(t)
    return ops.reshape(t, shape[:axis] + [m * (tiles + 1)] + shape[axis + 2:])


def _interleave(pieces: Sequence, axis: int):
    """``pieces`` (m tensors) interleaved along ``axis``: element t of piece j at ``m * t + j``."""
    t = ops.stack(list(pieces), axis=axis + 1)
    shape = _shape(t)
    return ops.reshape(t, shape[:axis] + [shape[axis] * len(pieces)] + shape[axis + 2:])


# ------------------------------------------------------------------ PyTorch: in place

def _apply(pieces: Sequence, mat: np.ndarray, outs: Sequence, accumulate: bool = False):
    """PyTorch: ``outs[i] (+)= sum_j mat[i, j] * pieces[j]``, written into the (possibly strided)
    views ``outs`` of a preallocated tensor: no stacking copy and one fused multiply-add
    (``add_(p, alpha=c)``) per term."""
    import torch
    for row, out in zip(mat, outs):
        terms = sorted(((float(c), p) for c, p in zip(row, pieces) if c != 0),
                       key=lambda t: t[0] != 1)
        if not accumulate:
            (c0, p0), terms = terms[0], terms[1:]
            if c0 == 1 and terms:
                (c1, p1), terms = terms[0], terms[1:]
                torch.add(p0, p1, alpha=c1, out=out)
            elif c0 == 1:
                out.copy_(p0)
            else:
                torch.mul(p0, c0, out=out)
        for c, p in terms:
            out.add_(p, alpha=c)


def _torch_transforms(geo: ConvGeometry, tile: int, th: int, tw: int, pads):
    """PyTorch's data transforms and GEMMs for :func:`winograd_conv2d` (eager execution): the
    same arithmetic, every result written in place into its final layout, and the data kept
    tile-major, ``(b, th, tw, n*n, c)``, which *is* a channels-last ``(b, n*n*c, th, tw)``
    image: the batched GEMMs are then grouped 1x1 convolutions (``groups = n*n``), which
    PyTorch runs on oneDNN (its batched matmul, MKL, measured about 1.1-1.3x slower
    on an AMD EPYC)."""
    import torch
    import torch.nn.functional as F
    bt, _, at = _matrices(tile)
    m, n = tile, tile + 2
    nn = n * n
    hp, wp = m * (th + 1), m * (tw + 1)
    (pt, _), (pl, _) = geo.pad

    def tiles(t, axis, count):  # views: element i of every tile along axis
        shape = list(t.shape)
        view = t.reshape(shape[:axis] + [count + 1, m] + shape[axis + 1:])
        idx = [slice(None)] * (len(shape) + 1)
        out = []
        for i in range(n):
            idx[axis], idx[axis + 1] = slice(i // m, i // m + count), i % m
            out.append(view[tuple(idx)])
        return out

    def image(t):  # (b, th, tw, n, n, c) -> channels-last (b, n*n*c, th, tw) view
        return t.reshape(t.shape[0], th, tw, -1).permute(0, 3, 1, 2)

    def tiled(t):  # the inverse of image
        return t.permute(0, 2, 3, 1).reshape(t.shape[0], th, tw, n, n, -1)

    def rows_of(t):  # (b, th, tw, nn, c) as the GEMMs' (nn, b*th*tw, c), a strided view
        return t.reshape(-1, nn, t.shape[-1]).transpose(0, 1)

    def input_transform(xg):  # -> (b, th, tw, n_h, n_w, c)
        xp = ops.pad(xg, pads)
        b, c = xp.shape[0], xp.shape[-1]
        rows = xp.new_empty((n, b, th, wp, c))
        _apply(tiles(xp, 1, th), bt, list(rows))
        v = xp.new_empty((b, th, tw, n, n, c))
        vt = v.permute(3, 0, 1, 2, 4, 5)  # (n_h, b, th, tw, n_w, c)
        _apply(tiles(rows, 3, tw), bt, [vt[..., j, :] for j in range(n)])
        return v

    def input_adjoint(dv):
        b, c = dv.shape[0], dv.shape[-1]
        dvt = dv.permute(3, 0, 1, 2, 4, 5)
        rows = dv.new_zeros((n, b, th, wp, c))
        _apply([dvt[..., j, :] for j in range(n)], bt.T, tiles(rows, 3, tw), accumulate=True)
        dxp = dv.new_zeros((b, hp, wp, c))
        _apply(list(rows), bt.T, tiles(dxp, 1, th), accumulate=True)
        return dxp[:, pt:pt + geo.in_h, pl:pl + geo.in_w, :]

    def output_transform(mm):  # (b, th, tw, n_h, n_w, o) -> (b, out_h, out_w, o)
        b, o = mm.shape[0], mm.shape[-1]
        rows = mm.new_empty((m, b, th, tw, n, o))
        _apply([mm[:, :, :, a] for a in range(n)], at, list(rows))
        y = mm.new_empty((b, th, m, tw, m, o))
        for i in range(m):
            _apply([rows[i][:, :, :, k] for k in range(n)], at, [y[:, :, i, :, j] for j in range(m)])
        return y.reshape(b, m * th, m * tw, o)[:, :geo.out_h, :geo.out_w, :]

    def output_adjoint(dy):  # -> (b, th, tw, n_h, n_w, o)
        b, o = dy.shape[0], dy.shape[-1]
        if (m * th, m * tw) != (geo.out_h, geo.out_w):
            padded = dy.new_zeros((b, m * th, m * tw, o))
            padded[:, :geo.out_h, :geo.out_w].copy_(dy)
            dy = padded
        dy = dy.reshape(b, th, m, tw, m, o)
        cols = dy.new_empty((n, b, th, m, tw, o))
        _apply([dy[:, :, :, :, j] for j in range(m)], at.T, list(cols))
        dm = dy.new_empty((b, th, tw, n, n, o))
        _apply([cols[:, :, :, i] for i in range(m)], at.T, list(dm.permute(3, 4, 0, 1, 2, 5)))
        return dm

    def gemm(v, u):  # V (b, th, tw, n, n, c) times U (nn, c, o), per tile position
        w = u.permute(0, 2, 1).reshape(-1, u.shape[1], 1, 1)
        return tiled(F.conv2d(image(v), w, groups=nn))

    def gemm_dv(dm, u):  # dM U^T
        return tiled(F.conv2d(image(dm), u.reshape(-1, u.shape[2], 1, 1), groups=nn))

    def gemm_du(v, dm):  # V^T dM: (nn, c, o)
        return torch.bmm(rows_of(v).transpose(1, 2), rows_of(dm))

    return (input_transform, input_adjoint, output_transform, output_adjoint,
            gemm, gemm_dv, gemm_du)


# ------------------------------------------------------------------ the convolution

def winograd_conv2d(x, kernel, geo: ConvGeometry, *, tile: int = 2):
    """Convolution of channels-last ``x`` (b, h, w, c) with ``kernel`` (3, 3, c/groups, o) by
    Winograd's F(tile x tile, 3 x 3); no bias. Returns (b, out_h, out_w, o), differentiable
    with a hand-written gradient. Requires :func:`winograd_applies`."""
    if not winograd_applies(geo):
        raise ValueError("winograd_conv2d needs a 3x3 kernel at stride 1 and dilation 1")
    bt, gm, at = _matrices(tile)
    m, n = tile, tile + 2
    nn = n * n
    groups, cg, og = geo.groups, geo.cg, geo.og
    th, tw = -(-geo.out_h // m), -(-geo.out_w // m)
    (pt, pb), (pl, pr) = geo.pad
    hp, wp = m * (th + 1), m * (tw + 1)  # padded so that every tile (and one spare) fits
    pads = [[0, 0], [pt, hp - geo.in_h - pt], [pl, wp - geo.in_w - pl], [0, 0]]

    def group(t, g, width):
        return t[..., g * width:(g + 1) * width] if groups > 1 else t

    def concat(ts):
        return ops.concatenate(ts, axis=-1) if len(ts) > 1 else ts[0]

    gg = np.kron(gm, gm)  # (nn, 9): G g G^T for every (c, o) pair at once

    def kernel_transform(k):  # (3, 3, cg, o) -> (nn, cg, o): one small GEMM
        u = B.matmul(B.constant(gg, k), ops.reshape(k, (9, cg * geo.filters)))
        return ops.reshape(u, (nn, cg, geo.filters))

    def kernel_adjoint(du):  # (nn, cg, o) -> (3, 3, cg, o)
        dk = B.matmul_tn(B.constant(gg, du), ops.reshape(du, (nn, cg * geo.filters)))
        return ops.reshape(dk, (3, 3, cg, geo.filters))

    def input_transform(xg):  # (b, h, w, cg) -> (nn, b*th*tw, cg)
        xp = ops.pad(xg, pads)
        rows = ops.stack(_combine(_tile_slices(xp, 1, th, m, n), bt), axis=0)  # (n, b, th, wp, c)
        v = ops.stack(_combine(_tile_slices(rows, 3, tw, m, n), bt), axis=1)  # (n, n, b, th, tw, c)
        return ops.reshape(v, (nn, -1, cg))

    def input_adjoint(dv):  # (nn, b*th*tw, cg) -> (b, h, w, cg)
        dv = ops.reshape(dv, (n, n, -1, th, tw, cg))
        cols = _combine([dv[:, j] for j in range(n)], bt.T)  # n x (n, b, th, tw, c)
        rows = _overlap_add(cols, 3, tw, m)  # (n, b, th, wp, c)
        dxp = _overlap_add(_combine([rows[i] for i in range(n)], bt.T), 1, th, m)
        return dxp[:, pt:pt + geo.in_h, pl:pl + geo.in_w, :]

    def output_transform(mm):  # (nn, b*th*tw, o) -> (b, out_h, out_w, o)
        mm = ops.reshape(mm, (n, n, -1, th, tw, og))
        rows = _combine([mm[i] for i in range(n)], at)  # m x (n, b, th, tw, o)
        y = _interleave([_interleave(_combine([r[j] for j in range(n)], at), 2) for r in rows], 1)
        return y[:, :geo.out_h, :geo.out_w, :]

    def output_adjoint(dy):  # (b, out_h, out_w, o) -> (nn, b*th*tw, o)
        dy = ops.pad(dy, [[0, 0], [0, m * th - geo.out_h], [0, m * tw - geo.out_w], [0, 0]])
        dy = ops.reshape(dy, (-1, th, m, tw, m, og))
        cols = ops.stack(_combine([dy[:, :, :, :, j] for j in range(m)], at.T), axis=0)
        rows = ops.stack(_combine([cols[:, :, :, i] for i in range(m)], at.T), axis=0)
        return ops.reshape(rows, (nn, -1, og))  # (n_h, n_w, b, th, tw, o) flattened

    def gemm(v, u):  # (nn, tiles, c) x (nn, c, o)
        return B.bmm(v, u)

    def gemm_dv(dm, u):
        return B.bmm(dm, u, tb=True)

    def gemm_du(v, dm):
        return B.bmm(v, dm, ta=True)

    if B.NAME == "torch":
        (input_transform, input_adjoint, output_transform, output_adjoint,
         gemm, gemm_dv, gemm_du) = _torch_transforms(geo, tile, th, tw, pads)

    def forward(x, kernel):
        u = kernel_transform(kernel)
        outs, saved = [], []
        for g in range(groups):
            v = input_transform(group(x, g, cg))
            ug = group(u, g, og)
            outs.append(output_transform(gemm(v, ug)))
            saved.append((v, ug))
        return concat(outs), saved

    def backward(dy, saved):
        dxs, dus = [], []
        for g, (v, ug) in enumerate(saved):
            dm = output_adjoint(group(dy, g, og))
            dus.append(gemm_du(v, dm))
            dxs.append(input_adjoint(gemm_dv(dm, ug)))
        return concat(dxs), kernel_adjoint(concat(dus))

    return B.custom_conv(forward, backward, x, kernel)
