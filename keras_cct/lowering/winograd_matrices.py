"""Winograd's matrices: ``(B^T, G, A^T)`` of F(m x m, r x r), written out for 3x3 kernels and
built by Toom-Cook for 5x5 ones, and which convolutions each output tile is offered for
(:func:`winograd_applies`). Pure numpy; :mod:`keras_cct.lowering.winograd` computes with them."""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Tuple

import numpy as np

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

#: The finite interpolation points (infinity is the last) for n = m + r - 1 points in all:
#: F(2x2, 5x5) the same as F(4x4, 3x3)'s, F(4x4, 5x5) those and +-1/2.
POINTS = {6: (0, 1, -1, 2, -2), 8: (0, 1, -1, 2, -2, 0.5, -0.5)}


#: The kernel sizes each output tile is offered for as a lowering (``"winograd"`` is tile 2,
#: ``"winograd4"`` tile 4). Not F(2x2, 5x5): it reads a 6x6 input tile per 2x2 outputs, and its
#: transformed data (9 values per output and channel) made it slower than the direct
#: convolution (CaffeNet conv2, TF, float32, batch 32, forward+backward: 181.9 ms against
#: oneDNN's 131.4, where F(4x4, 5x5) ran 104.6 and F(3x3, 5x5) 123.1).
TILE_KERNELS = {2: (3,), 4: (3, 5)}
#: Kernel sizes Winograd computes: 3x3 with the matrices above; 5x5 with matrices built by
#: :func:`_cook_toom` from the interpolation points :data:`POINTS`.
KERNELS = tuple(sorted({r for sizes in TILE_KERNELS.values() for r in sizes}))


def winograd_applies(geo: ConvGeometry, tile: int = 2) -> bool:
    """Whether ``tile``'s Winograd lowering computes this convolution: a square kernel of a size
    in :data:`TILE_KERNELS`, stride 1, dilation 1 (:func:`winograd_conv2d` itself takes every
    size in :data:`KERNELS`)."""
    return (geo.kh == geo.kw and geo.kh in TILE_KERNELS.get(tile, ())
            and (geo.sh, geo.sw, geo.dh, geo.dw) == (1, 1, 1, 1))


def _cook_toom(m: int, r: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B^T, G, A^T) of F(m, r) by Toom-Cook at the points :data:`POINTS` and infinity:
    ``A^T[i, j] = p_j^i`` and ``G[j, k] = p_j^k / prod_(l != j) (p_j - p_l)`` (the last column
    of A^T and the last row of G for infinity), and B^T the one matrix for which
    ``A^T [(G g) * (B^T d)]`` is the correlation of ``d`` with ``g`` for every ``d`` and ``g``
    (a linear system, solved in float64; its entries are small fractions, rounded to them)."""
    n = m + r - 1
    pts = POINTS[n]
    at, g = np.zeros((m, n)), np.zeros((n, r))
    for j, p in enumerate(pts):
        scale = np.prod([p - q for q in pts if q != p])
        at[:, j] = [p ** i for i in range(m)]
        g[j] = [p ** k / scale for k in range(r)]
    at[m - 1, n - 1] = g[n - 1, r - 1] = 1
    # sum_j at[i, j] g[j, k] bt[j, l] = [l == i + k] for every i, k, l: n*n unknowns
    eqs = np.einsum("ij,jk,jJ,lL->iklJL", at, g, np.eye(n), np.eye(n)).reshape(m * r * n, -1)
    rhs = np.array([float(l == i + k) for i in range(m) for k in range(r) for l in range(n)])
    bt = np.linalg.lstsq(eqs, rhs, rcond=None)[0].reshape(n, n)
    bt = np.vectorize(lambda v: float(Fraction(v).limit_denominator(64)))(bt)
    return bt, g, at


@functools.lru_cache(maxsize=None)
def _matrices(tile: int, r: int = 3) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B^T, G, A^T) of F(tile x tile, r x r)."""
    if r == 3 and tile in _MATRICES:
        return tuple(np.asarray(mat, np.float64) for mat in _MATRICES[tile])  # type: ignore
    if r not in KERNELS or tile + r - 1 not in POINTS:
        raise ValueError(f"no Winograd F({tile}x{tile}, {r}x{r}) here")
    return _cook_toom(tile, r)
