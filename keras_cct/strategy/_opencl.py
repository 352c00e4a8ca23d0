"""One OpenCL shard of a split convolution, on numpy arrays: launched on its device (queued
on the client's device thread, like a GPU launch) and collected later, or recomputed on the
host when the device fails (the device is then dropped). Every backend's split op
(``_tf``, ``_jax``, ``_torch``) calls these from its host side."""

from __future__ import annotations

import time

from keras_cct.errors import DeviceError
from keras_cct.strategy import host


def conv_kwargs(geo) -> dict:
    return dict(strides=(geo.sh, geo.sw), padding=geo.pad, dilation_rate=(geo.dh, geo.dw),
                groups=geo.groups)


def launch(strategy, plan, phase: str, i: int, geo, arrays, *, need_dx: bool = True,
           with_bias: bool = False) -> object:
    """Queue shard ``i`` of ``phase`` on device ``i``; returns its future, the DeviceError it
    raised, or None for an inactive device. ``arrays``: forward ``(x, kernel(, bias))``,
    backward ``(x, dy, kernel(, bias))``. The request's completion records its time."""
    from keras_cct.devices.opencl import conv
    if not strategy.active[i]:
        return None
    name, kw, t0 = strategy.devices[i].name, conv_kwargs(geo), time.perf_counter()
    try:
        if phase == "forward":
            x, k, *b = arrays
            future = conv.conv2d_forward(name, x, k, b[0] if b else None, wait=False, **kw)
        else:
            x, dy, k = arrays[:3]
            future = conv.conv2d_backward(name, x, k, dy, wait=False, with_bias=with_bias,
                                          need_dx=need_dx, **kw)
    except DeviceError as exc:
        return exc
    future.add_done_callback(lambda f: f.exception() is None and plan.record(
        phase, i, time.perf_counter() - t0))
    return future


def collect(strategy, plan, phase: str, i: int, geo, launched, arrays, *,
            need_dx: bool = True, with_bias: bool = False) -> list:
    """The outputs of a :func:`launch` ed shard (forward ``[y]``; backward ``[dx, dkernel(,
    dbias)]``, without ``dx`` unless ``need_dx``): the device's, or the host's when the device
    failed (then dropped) or was inactive."""
    def outputs(dx, dk, db):
        return ([dx] if need_dx else []) + [dk] + ([db] if with_bias else [])

    try:
        if isinstance(launched, BaseException):
            raise launched
        if launched is not None:
            out = launched.result()
            return [out] if phase == "forward" else outputs(*out)
    except DeviceError as exc:
        strategy._drop(i, plan.name, exc)
    if phase == "forward":  # on the host
        x, k, *b = arrays
        y = host.forward(x, k, geo)
        return [y + b[0] if b else y]
    x, dy, k = arrays[:3]
    dx, dk = host.backward(x, k, dy, geo)
    return outputs(dx, dk, dy.sum(axis=(0, 1, 2)))
