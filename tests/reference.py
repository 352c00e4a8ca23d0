"""Independent float64 numpy references for tests.

A direct convolution (sum over kernel taps, no lowering) and its exact gradients, written from the
definition so that it shares no code with keras_cct's lowerings or kernels.
"""

from __future__ import annotations

import numpy as np


def _pads(padding, in_h, in_w, kh, kw, sh, sw, dh, dw):
    ekh, ekw = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    if padding == "valid":
        return (0, 0), (0, 0)
    if padding == "same":
        def same(n, k, s):
            out = -(-n // s)
            tot = max((out - 1) * s + k - n, 0)
            return tot // 2, tot - tot // 2
        return same(in_h, ekh, sh), same(in_w, ekw, sw)
    if isinstance(padding, int):
        return (padding, padding), (padding, padding)
    a, b = padding
    a = (a, a) if isinstance(a, int) else tuple(a)
    b = (b, b) if isinstance(b, int) else tuple(b)
    return a, b


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def conv2d(x, w, b=None, strides=1, padding="valid", dilation=1, groups=1):
    """Direct NHWC convolution in float64. ``w`` is (kh, kw, c/groups, o)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    sh, sw = _pair(strides)
    dh, dw = _pair(dilation)
    n, h, wd, c = x.shape
    kh, kw, cg, o = w.shape
    (pt, pb), (pl, pr) = _pads(padding, h, wd, kh, kw, sh, sw, dh, dw)
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    oh = (h + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (wd + pl + pr - (kw - 1) * dw - 1) // sw + 1
    og = o // groups
    y = np.zeros((n, oh, ow, o))
    for g in range(groups):
        xs = xp[..., g * cg:(g + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, i * dh:i * dh + (oh - 1) * sh + 1:sh,
                           j * dw:j * dw + (ow - 1) * sw + 1:sw, :]
                y[..., g * og:(g + 1) * og] += patch @ w[i, j, :, g * og:(g + 1) * og]
    if b is not None:
        y += np.asarray(b, np.float64)
    return y


def conv2d_grads(x, w, dy, strides=1, padding="valid", dilation=1, groups=1):
    """Gradients (dx, dw, db) of sum(conv2d(x, w) * dy), from the definition."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    dy = np.asarray(dy, np.float64)
    sh, sw = _pair(strides)
    dh, dw_ = _pair(dilation)
    n, h, wd, c = x.shape
    kh, kw, cg, o = w.shape
    (pt, pb), (pl, pr) = _pads(padding, h, wd, kh, kw, sh, sw, dh, dw_)
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    dxp = np.zeros_like(xp)
    oh, ow = dy.shape[1:3]
    og = o // groups
    dw = np.zeros_like(w)
    for g in range(groups):
        cs, os_ = slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)
        for i in range(kh):
            for j in range(kw):
                hs = slice(i * dh, i * dh + (oh - 1) * sh + 1, sh)
                ws = slice(j * dw_, j * dw_ + (ow - 1) * sw + 1, sw)
                patch = xp[:, hs, ws, cs]
                dw[i, j, :, os_] = np.einsum("nhwc,nhwo->co", patch, dy[..., os_])
                dxp[:, hs, ws, cs] += dy[..., os_] @ w[i, j, :, os_].T
    dx = dxp[:, pt:pt + h, pl:pl + wd, :]
    db = dy.sum(axis=(0, 1, 2))
    return dx, dw, db


def rel_err(a, b) -> float:
    """max |a - b| / max(|b|, tiny): the relative error used throughout the tests."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
