"""Host (numpy) convolution used when a device fails in the middle of a step.

The failed shard is recomputed here, on the CPU that runs the training loop, so the step
completes with the same result; the device is then dropped. Written as a sum of one GEMM per
kernel tap, float32, channels-last.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from keras_cct.lowering.geometry import ConvGeometry


def _taps(geo: ConvGeometry):
    for i in range(geo.kh):
        hs = slice(i * geo.dh, i * geo.dh + (geo.out_h - 1) * geo.sh + 1, geo.sh)
        for j in range(geo.kw):
            ws = slice(j * geo.dw, j * geo.dw + (geo.out_w - 1) * geo.sw + 1, geo.sw)
            yield i, j, hs, ws


def _pad(x: np.ndarray, geo: ConvGeometry) -> np.ndarray:
    return np.pad(x, ((0, 0), geo.pad[0], geo.pad[1], (0, 0)))


def forward(x: np.ndarray, kernel: np.ndarray, geo: ConvGeometry) -> np.ndarray:
    xp = _pad(x, geo)
    cg, og = geo.cg, geo.og
    y = np.zeros((x.shape[0], geo.out_h, geo.out_w, geo.filters), np.float32)
    for g in range(geo.groups):
        xs = xp[..., g * cg:(g + 1) * cg]
        for i, j, hs, ws in _taps(geo):
            y[..., g * og:(g + 1) * og] += xs[:, hs, ws, :] @ kernel[i, j, :, g * og:(g + 1) * og]
    return y


def backward(x: np.ndarray, kernel: np.ndarray, dy: np.ndarray,
             geo: ConvGeometry) -> Tuple[np.ndarray, np.ndarray]:
    xp = _pad(x, geo)
    dxp = np.zeros_like(xp)
    dk = np.zeros_like(kernel)
    cg, og = geo.cg, geo.og
    n = x.shape[0]
    for g in range(geo.groups):
        cs, os_ = slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)
        dyg = dy[..., os_].reshape(-1, og)
        for i, j, hs, ws in _taps(geo):
            patch = xp[:, hs, ws, cs]
            dk[i, j, :, os_] = patch.reshape(-1, cg).T @ dyg
            dxp[:, hs, ws, cs] += (dyg @ kernel[i, j, :, os_].T).reshape(
                n, geo.out_h, geo.out_w, cg)
    (t, _), (l, _) = geo.pad
    return dxp[:, t:t + geo.in_h, l:l + geo.in_w, :], dk
