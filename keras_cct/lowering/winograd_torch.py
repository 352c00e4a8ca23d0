"""Winograd's data transforms on PyTorch (:func:`keras_cct.lowering.winograd.winograd_conv2d`
runs them there): eager execution, every result written in place into a preallocated tile-major
tensor, so that no op stacks copies and each term is one fused multiply-add."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from keras import ops

from keras_cct.lowering.winograd_matrices import _matrices


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


def torch_transforms(t):
    """PyTorch's data transforms and GEMMs of one channel group for the tiling ``t`` (a
    :class:`~keras_cct.lowering.winograd._Tiling`; eager execution): the same arithmetic,
    every result written in place into its final layout, and the data kept tile-major, ``(b, th, tw, n*n, c)``, which *is* a channels-last ``(b, n*n*c, th, tw)``
    image: the batched GEMMs are then grouped 1x1 convolutions (``groups = n*n``), which
    PyTorch runs on oneDNN (its batched matmul, MKL, measured about 1.1-1.3x slower
    on an AMD EPYC)."""
    import torch
    import torch.nn.functional as F
    geo, m, n, nn, th, tw = t.geo, t.m, t.n, t.nn, t.th, t.tw
    bt, _, at = _matrices(m, t.r)
    hp, wp = m * (th + t.spare), m * (tw + t.spare)
    (pt, _), (pl, _) = geo.pad

    def tiles(v, axis, count):  # views: element i of every tile along axis
        shape = list(v.shape)
        view = v.reshape(shape[:axis] + [count + t.spare, m] + shape[axis + 1:])
        idx = [slice(None)] * (len(shape) + 1)
        out = []
        for i in range(n):
            idx[axis], idx[axis + 1] = slice(i // m, i // m + count), i % m
            out.append(view[tuple(idx)])
        return out

    def image(v):  # (b, th, tw, n, n, c) -> channels-last (b, n*n*c, th, tw) view
        return v.reshape(v.shape[0], th, tw, -1).permute(0, 3, 1, 2)

    def tiled(v):  # the inverse of image
        return v.permute(0, 2, 3, 1).reshape(v.shape[0], th, tw, n, n, -1)

    def rows_of(v):  # (b, th, tw, nn, c) as the GEMMs' (nn, b*th*tw, c), a strided view
        return v.reshape(-1, nn, v.shape[-1]).transpose(0, 1)

    def input_transform(xg):  # -> (b, th, tw, n_h, n_w, c)
        xp = ops.pad(xg, t.pads)
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

    return (input_transform, input_adjoint, output_transform, output_adjoint, gemm, gemm_dv,
            gemm_du)
