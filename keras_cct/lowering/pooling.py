"""Max pooling lowered into its windows, with its gradient written out.

A ``kh x kw`` window at stride ``(sh, sw)`` is ``kh * kw`` strided slices of the (padded)
input. The forward keeps a running maximum over them and the position of each window's first
maximum (row-major, as Caffe's ``PoolingLayer`` and TensorFlow's ``MaxPoolGrad`` pick it), in
one pass (an 8-bit index per output). The gradient then reads only that index and the
upstream gradient, not the input: each slice's share is ``where(index == k, dy, 0)``, and the
shares of the slices that land on the same rows and columns modulo the stride are added,
shifted, and interleaved into the input's shape (:func:`_scatter`).

Both halves run as the backend's fused form (:func:`keras_cct.lowering._backend.fused`: one XLA
cluster each on TensorFlow). Where TensorFlow runs without its oneDNN operations, its
``MaxPoolGrad`` recomputes every window's maximum from the input; CaffeNet's pool1 at batch 32
(forward+backward, 2-core AMD EPYC, AVX2) took 56-70 ms there and 24-39 ms here in probes
of one session (PyTorch's channels-last ``max_pool2d``: 17-29). Backends that do not take this form
(:data:`keras_cct.lowering._backend.WINDOWED_MAX_POOL`: on JAX, XLA fuses the index into the
gradient and recomputes it for every element; on PyTorch each slice is an op of its own), and
windows of more than :data:`MAX_TAPS` elements (each slice is unrolled into the program), run
``keras.ops.max_pool``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator, Tuple

from keras import ops

from keras_cct.lowering import _backend

__all__ = ["MAX_TAPS", "backend_op", "max_pool", "windowed"]

#: The largest window (``kh * kw`` elements) pooled by its slices; larger ones (a global
#: pooling of a whole feature map) run the backend's op.
MAX_TAPS = 25   # below 127: the index is 8-bit (:data:`INDEX_DTYPE`)

Pair = Tuple[int, int]
Pads = Tuple[Pair, Pair]

_STATE = threading.local()


@contextlib.contextmanager
def backend_op() -> Iterator[None]:
    """Within it (on this thread), :func:`max_pool` runs the backend's own op: for a graph that
    leaves TensorFlow, as ONNX export's (tf2onnx converts no XLA cluster)."""
    before = getattr(_STATE, "backend_op", False)
    _STATE.backend_op = True
    try:
        yield
    finally:
        _STATE.backend_op = before


def windowed(kernel: Pair) -> bool:
    """Whether :func:`max_pool` pools a ``kernel`` window by its slices: on a backend that
    wants it, computing on the CPU, for a window of at most :data:`MAX_TAPS` elements, outside
    :func:`backend_op`."""
    return (bool(_backend.WINDOWED_MAX_POOL) and kernel[0] * kernel[1] <= MAX_TAPS
            and not getattr(_STATE, "backend_op", False) and _backend.device_name() is None)


def max_pool(x, kernel: Pair, strides: Pair, pads: Pads = ((0, 0), (0, 0)), *,
             relu: bool = False):
    """Max pooling of channels-last ``x`` (N, H, W, C) over ``kernel`` windows at ``strides``,
    ``x`` padded by ``pads`` (``((top, bottom), (left, right))``) with ``-inf`` first (no
    padded element is ever a window's maximum, as in Caffe's clipped windows).
    The gradient goes to each window's first maximum. The output has the windows that fit
    the padded input: ``(H + top + bottom - kh) // sh + 1`` rows.

    With ``relu``, ``max(relu(window)) = relu(max(window))`` is computed the second way, on
    the pooled output, with the same values and gradients as a ReLU before the pooling
    (Caffe's, whose gradient at 0 is 0): a window whose maximum is not positive sends none.
    The slices' form keeps that in its index (no maximum to send to); no extra pass."""
    kernel, strides = tuple(kernel), tuple(strides)
    pads = (tuple(pads[0]), tuple(pads[1]))
    if not windowed(kernel):
        y = _op_pool(x, kernel, strides, pads)
        return ops.relu(y) if relu else y
    h, w = int(x.shape[1]), int(x.shape[2])
    forward, backward = _halves(kernel, strides, pads, h, w, bool(relu))

    @ops.custom_gradient
    def pool(x):
        y, index = forward(x)

        def grad(*args, upstream=None):
            dy = upstream if upstream is not None else args[0]
            return backward(dy, index)

        return y, grad

    return pool(x)


def _op_pool(x, kernel: Pair, strides: Pair, pads: Pads):
    """``keras.ops.max_pool`` on the padded input."""
    x = _pad(x, pads)
    return ops.max_pool(x, kernel, strides, padding="valid", data_format="channels_last")


def _pad(x, pads: Pads):
    """``x`` padded with ``-inf``: no padded element wins a window (each window holds at least
    one element of the image, as Caffe's output size makes sure)."""
    if not any(sum(p) for p in pads):
        return x
    return ops.pad(x, [[0, 0], list(pads[0]), list(pads[1]), [0, 0]],
                   constant_values=float("-inf"))


@functools.lru_cache(maxsize=None)
def _halves(kernel: Pair, strides: Pair, pads: Pads, h: int, w: int, relu: bool):
    """The fused forward and backward for one geometry (compiled once per shape on
    TensorFlow, the batch left free, named alike in every process for its persistent cache);
    the backward is the same with or without ``relu``."""
    key = _key(kernel, strides, pads, h, w)
    forward = _backend.fused(functools.partial(_forward, kernel=kernel, strides=strides,
                                               pads=pads, relu=relu),
                             batch_axes={4: 0}, key=key + (":relu" if relu else "") + ":forward")
    return forward, _backward(kernel, strides, pads, h, w)


@functools.lru_cache(maxsize=None)
def _backward(kernel: Pair, strides: Pair, pads: Pads, h: int, w: int):
    return _backend.fused(functools.partial(_scatter, kernel=kernel, strides=strides,
                                            pads=pads, size=(h, w)),
                          batch_axes={4: 0}, key=_key(kernel, strides, pads, h, w) + ":backward")


def _key(kernel: Pair, strides: Pair, pads: Pads, h: int, w: int) -> str:
    return f"max_pool:{kernel}:{strides}:{pads}:{h}x{w}"


#: The index's dtype: positions ``0 .. kh*kw`` (``kh*kw``: none, after a ReLU), at most
#: :data:`MAX_TAPS`.
INDEX_DTYPE = "int8"


def _out_size(size: int, k: int, s: int, pad: Pair) -> int:
    return (size + pad[0] + pad[1] - k) // s + 1


def _forward(x, *, kernel: Pair, strides: Pair, pads: Pads, relu: bool = False):
    """``(y, index)``: each window's maximum and the row-major position of its first one
    (with ``relu``: ``max(y, 0)``, and no position, ``kh * kw``, where ``y`` is not positive)."""
    (kh, kw), (sh, sw) = kernel, strides
    oh = _out_size(int(x.shape[1]), kh, sh, pads[0])
    ow = _out_size(int(x.shape[2]), kw, sw, pads[1])
    x = _pad(x, pads)
    dtype = INDEX_DTYPE
    y = index = None
    for i in range(kh):
        for j in range(kw):
            tap = x[:, i:i + (oh - 1) * sh + 1:sh, j:j + (ow - 1) * sw + 1:sw, :]
            if y is None:
                y, index = tap, ops.zeros(ops.shape(tap), dtype=dtype)
                continue
            larger = ops.greater(tap, y)
            y = ops.where(larger, tap, y)
            index = ops.where(larger, ops.convert_to_tensor(i * kw + j, dtype=dtype), index)
    if relu:
        positive = ops.greater(y, ops.zeros_like(y))
        y = ops.where(positive, y, ops.zeros_like(y))
        index = ops.where(positive, index, ops.convert_to_tensor(kh * kw, dtype=dtype))
    return y, index


def _scatter(dy, index, *, kernel: Pair, strides: Pair, pads: Pads, size: Pair):
    """The input's gradient: ``dy`` sent to each window's first maximum, summed where windows
    overlap. The padded input's row ``q * sh + r`` takes the slices ``i = a * sh + r`` of the
    outputs ``q - a``: per residue ``(r, t)`` of the stride, a plane of the shares shifted by
    ``(a, b)``; the planes interleaved are the padded input's gradient, and the padding is
    cut off."""
    (kh, kw), (sh, sw), (h, w) = kernel, strides, size
    oh, ow, c = int(dy.shape[1]), int(dy.shape[2]), int(dy.shape[3])
    # plane size: every shifted share fits, and the planes interleaved cover the padded input
    qh = max(-(-(h + sum(pads[0])) // sh), oh + (kh - 1) // sh)
    qw = max(-(-(w + sum(pads[1])) // sw), ow + (kw - 1) // sw)
    zero = ops.zeros_like(dy)
    rows = []
    for r in range(sh):
        planes = []
        for t in range(sw):
            plane = None
            for i in range(r, kh, sh):
                for j in range(t, kw, sw):
                    hit = ops.equal(index, ops.convert_to_tensor(i * kw + j, dtype=index.dtype))
                    share = ops.pad(ops.where(hit, dy, zero),
                                    [[0, 0], [i // sh, qh - oh - i // sh],
                                     [j // sw, qw - ow - j // sw], [0, 0]])
                    plane = share if plane is None else plane + share
            if plane is None:   # a stride longer than the window: rows no window reads
                plane = ops.pad(zero, [[0, 0], [0, qh - oh], [0, qw - ow], [0, 0]])
            planes.append(plane)
        rows.append(ops.stack(planes, axis=3))            # (N, qh, qw, sw, C)
    full = ops.reshape(ops.stack(rows, axis=2), (-1, qh * sh, qw * sw, c))
    top, left = pads[0][0], pads[1][0]
    return full[:, top:top + h, left:left + w, :]
