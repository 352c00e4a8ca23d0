"""The front of :mod:`keras_cct.lowering`: one ``conv2d`` for every lowering."""

from __future__ import annotations

from keras import ops

from keras_cct.errors import LoweringError
from keras_cct.lowering.engine import MODES, lowered_conv2d
from keras_cct.lowering.geometry import ConvGeometry, PaddingArg, conv_geometry
from keras_cct.lowering.native import native_conv2d
from keras_cct.lowering.planner import ALL_LOWERINGS, NEEDS, check_available, choose_for
from keras_cct.lowering.space_to_depth import space_to_depth_conv2d
from keras_cct.lowering.winograd import winograd_conv2d

LOWERING_NAMES = ("auto",) + ALL_LOWERINGS


def check_lowering(lowering: str) -> str:
    """Validate a lowering name (``"auto"`` or one of :data:`ALL_LOWERINGS`)."""
    if lowering not in LOWERING_NAMES:
        raise LoweringError(f"`lowering` must be one of {LOWERING_NAMES}, got {lowering!r}")
    return lowering


def conv2d_geo(x, kernel, geo: ConvGeometry, lowering: str):
    """Convolution (no bias) of ``x`` by ``kernel`` for a validated geometry and a concrete
    lowering name."""
    if lowering == "native":
        return native_conv2d(x, kernel, geo)
    if lowering in MODES:
        return lowered_conv2d(x, kernel, geo, lowering)
    if lowering in NEEDS:
        check_available(geo, lowering)
        if lowering in ("winograd", "winograd4"):
            return winograd_conv2d(x, kernel, geo, tile=2 if lowering == "winograd" else 4)
        return space_to_depth_conv2d(x, kernel, geo)
    raise LoweringError(f"`lowering` must be one of {ALL_LOWERINGS} here, got {lowering!r}")


def conv2d(x, kernel, bias=None, *, strides=1, padding: PaddingArg = "valid", dilation_rate=1,
           groups: int = 1, lowering: str = "auto", planner: str = "auto"):
    """2-D convolution of channels-last ``x`` computed by a CcT lowering.

    Args:
        x: input ``(batch, height, width, channels)``.
        kernel: ``(kh, kw, channels // groups, filters)`` (``keras.layers.Conv2D``'s layout).
        bias: optional ``(filters,)``.
        strides, dilation_rate: int or ``(h, w)``.
        padding: ``"valid"``, ``"same"``, an int, ``(pad_h, pad_w)`` or
            ``((top, bottom), (left, right))``.
        groups: channel groups (``channels`` and ``filters`` must be multiples of it).
        lowering: ``"type1"``, ``"type2"``, ``"type3"``, ``"winograd"`` / ``"winograd4"``
            (F(2x2, 3x3) / F(4x4, 3x3): 3x3, stride 1),
            ``"space_to_depth"`` (strided, e.g. a first layer), ``"native"`` (the backend's own
            convolution) or ``"auto"`` (chosen by :func:`keras_cct.lowering.choose`).
        planner: the ``mode`` :func:`~keras_cct.lowering.choose` uses for ``"auto"``.

    Returns:
        ``(batch, out_h, out_w, filters)``.
    """
    check_lowering(lowering)
    geo = conv_geometry(tuple(x.shape), tuple(kernel.shape), strides=strides, padding=padding,
                        dilation_rate=dilation_rate, groups=groups)
    if lowering == "auto":
        lowering = choose_for(geo, mode=planner)
    y = conv2d_geo(x, kernel, geo, lowering)
    if bias is not None:
        y = ops.add(y, bias)
    return y
