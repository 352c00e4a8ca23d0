"""The lowered convolution on an OpenCL device, on numpy arrays (forward and backward).

These functions validate the request in this process (with
:func:`keras_cct.lowering.geometry.conv_geometry`, so every part of keras_cct agrees on padding
and output sizes), then run it in the device's worker. :func:`keras_cct.ops.conv2d_on` wraps
them into a differentiable op for each Keras backend.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import numpy as np

from keras_cct.errors import DeviceError, LoweringError
from keras_cct.lowering.geometry import ConvGeometry, PaddingArg, conv_geometry
from keras_cct.lowering.names import LOWERED_TYPES
from keras_cct.devices.opencl.client import client_for

#: The lowerings the OpenCL kernels compute: CcT's three types.
LOWERINGS = LOWERED_TYPES
#: Bytes of lowered data (im2col or Type 3 GEMM output) per batch partition.
CHUNK_BYTES = 8 << 20
#: Fewest output pixels per batch partition in the backward pass (its kernel-gradient GEMM sums
#: over them; smaller partitions spend their time re-reading and re-writing dW).
MIN_ROWS_BACKWARD = 1024


def _f32(name: str, a, shape_hint: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype != np.float32:
        raise DeviceError(f"the OpenCL kernels take float32 only; `{name}` {shape_hint} is "
                          f"{arr.dtype} (cast it to float32, or use a float32 dtype policy)")
    return np.ascontiguousarray(arr)


def choose_lowering(geom: ConvGeometry) -> str:
    """The lowering ``"auto"`` picks on OpenCL, after CcT's rule.

    Type 1 copies ``kh*kw*cg`` values per output pixel (and its backward scatters them back);
    Type 3 writes and lifts ``kh*kw*og`` per pixel but computes at every input pixel. So with
    stride 1, Type 3 when the input channels per group are at least twice the filters per group
    (measured on PoCL, CPU seconds forward+backward: 13x13, 384 -> 64 channels, k3: Type 1 0.066,
    Type 3 0.044; 64 -> 384: Type 1 0.040, Type 3 0.052) or for a 1x1 unpadded kernel (the
    plain GEMM); otherwise Type 1.
    """
    if geom.sh == geom.sw == 1:
        if geom.kh * geom.kw == 1 and geom.pad == ((0, 0), (0, 0)):
            return "type3"
        if geom.cg >= 2 * geom.og:
            return "type3"
    return "type1"


def _plan(x_shape, k_shape, strides, padding, dilation_rate, groups, lowering):
    geom = conv_geometry(x_shape, k_shape, strides=strides, padding=padding,
                         dilation_rate=dilation_rate, groups=groups)
    if lowering in ("auto", None):
        lowering = choose_lowering(geom)
    if lowering not in LOWERINGS:
        raise LoweringError(f"`lowering`={lowering!r} is not available on OpenCL devices; use "
                            f"'auto' or one of {LOWERINGS}")
    g = {"N": int(x_shape[0]), "H": geom.in_h, "W": geom.in_w, "C": geom.channels,
         "F": geom.filters, "kh": geom.kh, "kw": geom.kw, "groups": geom.groups,
         "sh": geom.sh, "sw": geom.sw, "dh": geom.dh, "dw": geom.dw,
         "pt": geom.pad[0][0], "pl": geom.pad[1][0], "oh": geom.out_h, "ow": geom.out_w}
    return geom, g, lowering


def _flops(geom: ConvGeometry, batch: int) -> float:
    """Floating-point operations of one forward pass (for the request's default deadline)."""
    return 2.0 * batch * geom.out_h * geom.out_w * geom.filters * geom.kh * geom.kw * geom.cg


def _then(future: Future, fn: Callable) -> Future:
    """A future of ``fn(future.result())``."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out.set_exception(exc)

    future.add_done_callback(done)
    return out


def _ready(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def conv2d_forward(device: str, x, kernel, bias=None, *, strides=1,
                   padding: PaddingArg = "valid", dilation_rate=1, groups: int = 1,
                   lowering: str = "auto", wait: bool = True):
    """Channels-last float32 convolution computed on OpenCL device ``device``.

    Args:
        device: ``"opencl:P:D"`` or ``"opencl:P:D.S"``.
        x: ``(batch, height, width, channels)`` float32.
        kernel: ``(kh, kw, channels // groups, filters)`` float32 (Keras' Conv2D layout).
        bias: ``(filters,)`` float32 or None.
        strides, padding, dilation_rate, groups: as :func:`conv_geometry`.
        lowering: ``"type1"`` (im2col), ``"type2"`` (lowered along the height, lifted along
            the width), ``"type3"`` (shift-and-add) or ``"auto"``.
        wait: False: validate, queue the request on the device and return a
            :class:`concurrent.futures.Future` of the result at once (``x``, ``kernel`` and
            ``bias`` must not change until it is done).

    Returns:
        ``(batch, out_h, out_w, filters)`` float32 (its future with ``wait=False``).

    Raises:
        LoweringError: inconsistent shapes or arguments. DeviceError: a dtype other than
        float32. OpenCLError / WorkerError: the device failed. DeviceTimeoutError: it did not
        answer within its deadline (``KERAS_CCT_DEVICE_TIMEOUT``).
    """
    x = _f32("x", x, "(the input)")
    kernel = _f32("kernel", kernel, "")
    geom, g, lowering = _plan(x.shape, kernel.shape, strides, padding, dilation_rate, groups,
                              lowering)
    inputs = {"x": x, "w": kernel}
    if bias is not None:
        bias = _f32("bias", bias, "")
        if bias.shape != (geom.filters,):
            raise LoweringError(f"`bias` must have shape ({geom.filters},), got {bias.shape}")
        inputs["b"] = bias
    out_shape = (g["N"], geom.out_h, geom.out_w, geom.filters)
    if g["N"] == 0:
        future = _ready(np.zeros(out_shape, np.float32))
    else:
        future = _then(client_for(device).submit(
            "conv_forward", inputs, {"y": (out_shape, np.float32)}, g=g, lowering=lowering,
            chunk_bytes=CHUNK_BYTES, work=_flops(geom, g["N"])), lambda reply: reply[1]["y"])
    return future.result() if wait else future


def conv2d_backward(device: str, x, kernel, dy, *, strides=1, padding: PaddingArg = "valid",
                    dilation_rate=1, groups: int = 1, lowering: str = "auto",
                    with_bias: bool = True, need_dx: bool = True, wait: bool = True):
    """Gradients ``(dx, dkernel, dbias)`` of ``sum(conv2d_forward(...) * dy)`` on ``device``.

    ``dbias`` is None when ``with_bias`` is False, ``dx`` None (and not computed) when
    ``need_dx`` is False (e.g. a network's first layer). Same arguments (``wait=False``: a
    future of the triple) and errors as :func:`conv2d_forward`; ``dy`` has the forward
    output's shape.
    """
    x = _f32("x", x, "(the input)")
    kernel = _f32("kernel", kernel, "")
    dy = _f32("dy", dy, "(the output gradient)")
    geom, g, lowering = _plan(x.shape, kernel.shape, strides, padding, dilation_rate, groups,
                              lowering)
    out_shape = (g["N"], geom.out_h, geom.out_w, geom.filters)
    if dy.shape != out_shape:
        raise LoweringError(f"`dy` must have the output's shape {out_shape}, got {dy.shape}")
    if g["N"] == 0:
        future = _ready((np.zeros(x.shape, np.float32) if need_dx else None,
                         np.zeros(kernel.shape, np.float32),
                         np.zeros((geom.filters,), np.float32) if with_bias else None))
        return future.result() if wait else future
    outputs = {"dw": (kernel.shape, np.float32)}
    if need_dx:
        outputs["dx"] = (x.shape, np.float32)
    if with_bias:
        outputs["db"] = ((geom.filters,), np.float32)
    future = _then(client_for(device).submit(
        "conv_backward", {"x": x, "w": kernel, "dy": dy}, outputs, g=g, lowering=lowering,
        chunk_bytes=CHUNK_BYTES, min_rows=MIN_ROWS_BACKWARD,
        work=_flops(geom, g["N"]) * (2 if need_dx else 1)),
        lambda reply: (reply[1].get("dx"), reply[1]["dw"], reply[1].get("db")))
    return future.result() if wait else future


def sgemm(device: str, a, b, *, trans_a: bool = False) -> np.ndarray:
    """``a @ b`` (or ``a.T @ b`` with ``trans_a``) in float32 on ``device`` (for tests and
    benchmarks of the GEMM kernel)."""
    a = _f32("a", a, "")
    b = _f32("b", b, "")
    if a.ndim != 2 or b.ndim != 2:
        raise LoweringError(f"sgemm takes 2-D arrays, got {a.shape} and {b.shape}")
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    if b.shape[0] != K:
        raise LoweringError(f"sgemm: inner sizes differ ({a.shape}{'^T' if trans_a else ''} "
                            f"x {b.shape})")
    N = b.shape[1]
    _, outs = client_for(device).call("gemm", {"a": a, "b": b}, {"c": ((M, N), np.float32)},
                                      M=int(M), N=int(N), K=int(K), trans_a=bool(trans_a),
                                      work=2.0 * M * N * K)
    return outs["c"]
