"""One convolution by lowering name: :func:`conv2d_geo` runs the lowering a name stands for on
a validated geometry; :func:`available` and :func:`check_available` say which names a geometry
can take. No planning here (the planner and the timing harness build on this module)."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

from keras import backend, ops

from keras_cct.errors import LoweringError
from keras_cct.lowering.depthwise import depthwise_applies, depthwise_conv2d
from keras_cct.lowering.engine import lowered_conv2d
from keras_cct.lowering.geometry import ConvGeometry
from keras_cct.lowering.names import ALL_LOWERINGS, LOWERED_TYPES, LOWERING_NAMES
from keras_cct.lowering.native import native_conv2d
from keras_cct.lowering.space_to_depth import space_to_depth_applies, space_to_depth_conv2d
from keras_cct.lowering.winograd import winograd_applies, winograd_conv2d

#: What each lowering that does not take every convolution needs (for error messages).
NEEDS = {
    "winograd": "a 3x3 kernel at stride 1 without dilation",
    "winograd4": "a 3x3 or 5x5 kernel at stride 1 without dilation",
    "space_to_depth": "a stride above 1, one group, no dilation and a kernel whose zero-padding "
                      "to a multiple of the stride adds at most 40% to its size",
    "depthwise": "one input channel per group (a depthwise convolution)",
}
#: The output tile of each Winograd lowering: F(2x2, r x r) and F(4x4, r x r).
WINOGRAD_TILE = {"winograd": 2, "winograd4": 4}
_APPLIES = {"winograd": functools.partial(winograd_applies, tile=2),
            "winograd4": functools.partial(winograd_applies, tile=4),
            "space_to_depth": space_to_depth_applies, "depthwise": depthwise_applies}


def check_lowering(lowering: str) -> str:
    """Validate a lowering name (``"auto"`` or one of :data:`ALL_LOWERINGS`)."""
    if lowering not in LOWERING_NAMES:
        raise LoweringError(f"`lowering` must be one of {LOWERING_NAMES}, got {lowering!r}")
    return lowering


def available(geo: ConvGeometry) -> Tuple[str, ...]:
    """The lowerings that can compute ``geo`` (on every Keras backend): the three types and
    ``"native"`` always, ``"winograd"``, ``"space_to_depth"`` and ``"depthwise"`` where
    :data:`NEEDS` says."""
    return tuple(c for c in ALL_LOWERINGS if c not in _APPLIES or _APPLIES[c](geo))


def check_available(geo: ConvGeometry, lowering: str) -> None:
    """Raise :class:`LoweringError` when ``lowering`` cannot compute ``geo`` (:data:`NEEDS`),
    naming what it needs and the lowerings that can."""
    if lowering in NEEDS and lowering not in available(geo):
        raise LoweringError(
            f"lowering {lowering!r} needs {NEEDS[lowering]}; got kernel ({geo.kh}, {geo.kw}), "
            f"strides ({geo.sh}, {geo.sw}), dilation ({geo.dh}, {geo.dw}), groups "
            f"{geo.groups}. Use 'auto' or one of {available(geo)}")


def conv2d_geo(x, kernel, geo: ConvGeometry, lowering: str, bias=None,
               compute_dtype: Optional[str] = None):
    """Convolution of ``x`` by ``kernel`` (plus ``bias``, if given) for a validated geometry and
    a concrete lowering name. ``"native"`` adds the bias inside the backend's op (TensorFlow:
    after each group's convolution, where oneDNN fuses it). With ``compute_dtype`` other than
    the inputs' (float32 for 16-bit inputs: :func:`~keras_cct.lowering.precision.
    arithmetic_dtype`), the inputs are cast to it and the result back to theirs
    (:func:`computed_in`)."""
    return computed_in(compute_dtype, lambda a, k, b: _conv2d(a, k, geo, lowering, b),
                       x, kernel, bias)


def computed_in(compute_dtype: Optional[str], conv: Callable, x, kernel, bias=None):
    """``conv(x, kernel, bias)`` with ``x`` and ``kernel`` in :func:`common_dtype`, computed in
    ``compute_dtype`` where that is given and wider: the inputs cast to it, the result cast
    back (16-bit inputs computed in float32). Never narrower: a bfloat16 layer called outside
    its autocast scope (``layer.stateless_call``: a bfloat16 input, the float32 kernel)
    computes in float32, as keras Conv2D does, on a machine whose arithmetic dtype for
    bfloat16 is bfloat16 too. One definition for every path that convolves (``conv2d_geo``,
    and CCTStrategy's split, whose shards then all receive the arithmetic dtype)."""
    x, kernel = _in_common_dtype(x, kernel)
    dtype = backend.standardize_dtype(x.dtype)
    if compute_dtype is None or compute_dtype == dtype or \
            backend.result_type(compute_dtype, dtype) != compute_dtype:
        return conv(x, kernel, bias)
    y = conv(ops.cast(x, compute_dtype), ops.cast(kernel, compute_dtype),
             None if bias is None else ops.cast(bias, compute_dtype))
    return ops.cast(y, dtype)


def _conv2d(x, kernel, geo: ConvGeometry, lowering: str, bias=None):
    if lowering == "native":
        return native_conv2d(x, kernel, geo, bias)
    y = _lowered(x, kernel, geo, lowering)
    return y if bias is None else ops.add(y, bias)


def common_dtype(x, kernel) -> str:
    """The dtype a convolution of ``x`` by ``kernel`` computes in: theirs where they agree (a
    float64 pair stays float64), else their common one, as ``keras.ops.conv`` and keras Conv2D
    compute them (a layer called outside its autocast scope, as ``layer.stateless_call`` calls
    it: a bfloat16 input and the float32 kernel)."""
    dx, dk = backend.standardize_dtype(x.dtype), backend.standardize_dtype(kernel.dtype)
    return dx if dx == dk else backend.result_type(dx, dk)


def _in_common_dtype(x, kernel):
    """``x`` and ``kernel`` in :func:`common_dtype`."""
    common = common_dtype(x, kernel)
    if backend.standardize_dtype(x.dtype) != common:
        x = ops.cast(x, common)
    if backend.standardize_dtype(kernel.dtype) != common:
        kernel = ops.cast(kernel, common)
    return x, kernel


def _lowered(x, kernel, geo: ConvGeometry, lowering: str):
    if lowering in LOWERED_TYPES:
        return lowered_conv2d(x, kernel, geo, lowering)
    if lowering in NEEDS:
        check_available(geo, lowering)
        if lowering in WINOGRAD_TILE:
            return winograd_conv2d(x, kernel, geo, tile=WINOGRAD_TILE[lowering])
        if lowering == "depthwise":
            return depthwise_conv2d(x, kernel, geo)
        return space_to_depth_conv2d(x, kernel, geo)
    raise LoweringError(f"`lowering` must be one of {ALL_LOWERINGS} here, got {lowering!r}")
