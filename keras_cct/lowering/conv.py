"""The front of :mod:`keras_cct.lowering`: one ``conv2d`` for every lowering, ``"auto"`` among
them (the planner chooses)."""

from __future__ import annotations


from keras_cct.lowering.dispatch import check_lowering, common_dtype, conv2d_geo
from keras_cct.lowering.geometry import PaddingArg, conv_geometry
from keras_cct.lowering.planner import choose_for
from keras_cct.lowering.precision import arithmetic_dtype


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
            (F(2x2, 3x3) / F(4x4, 3x3) or F(4x4, 5x5): 3x3 / 3x3 or 5x5, stride 1),
            ``"space_to_depth"`` (strided, e.g. a first layer), ``"depthwise"`` (one input
            channel per group: shifted multiply-adds), ``"native"`` (the backend's own
            convolution) or ``"auto"`` (chosen by :func:`keras_cct.lowering.choose`).
        planner: the ``mode`` :func:`~keras_cct.lowering.choose` uses for ``"auto"``.

    Returns:
        ``(batch, out_h, out_w, filters)``, in the inputs' dtype; 16-bit inputs are computed in
        float32 where this machine computes them slower
        (:func:`~keras_cct.lowering.precision.arithmetic_dtype`).
    """
    check_lowering(lowering)
    geo = conv_geometry(tuple(x.shape), tuple(kernel.shape), strides=strides, padding=padding,
                        dilation_rate=dilation_rate, groups=groups)
    arith = arithmetic_dtype(common_dtype(x, kernel))
    if lowering == "auto":
        lowering = choose_for(geo, mode=planner, dtype=arith, bias=bias is not None)
    return conv2d_geo(x, kernel, geo, lowering, bias=bias, compute_dtype=arith)
