"""Geometry of a 2-D convolution: normalized strides, dilation, padding and output sizes.

Shared by the lowerings, the OpenCL kernels and the Caffe importer so that every part agrees on
what ``padding="same"``, an int, ``(pad_h, pad_w)`` or ``((top, bottom), (left, right))`` mean.
All shapes are channels-last: input ``(batch, height, width, channels)``, kernel
``(kh, kw, channels // groups, filters)`` (Keras' Conv2D kernel layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from keras_cct.errors import LoweringError

#: The batch size a convolution is planned for where its own is unknown (a model traced with
#: an unknown batch, as Keras' ``fit`` traces it on TensorFlow): Keras' default ``batch_size``.
PLAN_BATCH = 32

PaddingArg = Union[str, int, Sequence[int], Sequence[Sequence[int]]]
Pair = Tuple[int, int]


def normalize_pair(value: Union[int, Sequence[int]], name: str, *, minimum: int = 1) -> Pair:
    """Return ``(h, w)`` from an int or a pair, checking each is an int >= ``minimum``."""
    if isinstance(value, int) and not isinstance(value, bool):
        pair = (value, value)
    else:
        try:
            pair = tuple(int(v) for v in value)  # type: ignore[union-attr]
        except TypeError:
            raise LoweringError(f"`{name}` must be an int or a pair of ints, got {value!r}")
        if len(pair) != 2:
            raise LoweringError(f"`{name}` must be an int or a pair of ints, got {value!r}")
    if any(v < minimum for v in pair):
        raise LoweringError(f"`{name}` must be >= {minimum}, got {value!r}")
    return pair  # type: ignore[return-value]


def normalize_padding(padding: PaddingArg) -> Union[str, Tuple[Pair, Pair]]:
    """Return ``"same"``, ``"valid"`` or explicit ``((top, bottom), (left, right))``."""
    if isinstance(padding, str):
        p = padding.lower()
        if p not in ("same", "valid"):
            raise LoweringError(
                f"`padding` must be 'same', 'valid', an int, (pad_h, pad_w) or "
                f"((top, bottom), (left, right)); got {padding!r}")
        return p
    if isinstance(padding, int) and not isinstance(padding, bool):
        if padding < 0:
            raise LoweringError(f"`padding` must be >= 0, got {padding}")
        return ((padding, padding), (padding, padding))
    try:
        items = list(padding)  # type: ignore[arg-type]
    except TypeError:
        raise LoweringError(f"`padding` not understood: {padding!r}")
    if len(items) != 2:
        raise LoweringError(f"`padding` must have 2 entries (height, width), got {padding!r}")
    out = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            pair = (item, item)
        else:
            pair = tuple(int(v) for v in item)
            if len(pair) != 2:
                raise LoweringError(f"`padding` entry {item!r} must be an int or (before, after)")
        if min(pair) < 0:
            raise LoweringError(f"`padding` must be >= 0, got {padding!r}")
        out.append(pair)
    return (out[0], out[1])  # type: ignore[return-value]


def padding_to_config(padding: Union[str, Tuple[Pair, Pair]]):
    """A JSON-friendly form of a normalized padding (for ``get_config``)."""
    if isinstance(padding, str):
        return padding
    (t, b), (l, r) = padding
    if t == b and l == r:
        return [t, l] if t != l else t
    return [[t, b], [l, r]]


@dataclass(frozen=True)
class ConvGeometry:
    """Everything a lowering needs to know about one convolution's shape.

    Attributes:
        batch, in_h, in_w, channels: input shape (batch may be ``None``).
        kh, kw, filters, groups: kernel shape and channel groups.
        sh, sw: strides; dh, dw: dilation; pad: ((top, bottom), (left, right)).
        out_h, out_w: output size.
    """

    batch: object
    in_h: int
    in_w: int
    channels: int
    kh: int
    kw: int
    filters: int
    groups: int
    sh: int
    sw: int
    dh: int
    dw: int
    pad: Tuple[Pair, Pair]
    out_h: int
    out_w: int

    @property
    def padded_h(self) -> int:
        return self.in_h + self.pad[0][0] + self.pad[0][1]

    @property
    def padded_w(self) -> int:
        return self.in_w + self.pad[1][0] + self.pad[1][1]

    @property
    def ekh(self) -> int:
        """Effective (dilated) kernel height."""
        return (self.kh - 1) * self.dh + 1

    @property
    def ekw(self) -> int:
        return (self.kw - 1) * self.dw + 1

    @property
    def cg(self) -> int:
        """Input channels per group."""
        return self.channels // self.groups

    @property
    def og(self) -> int:
        """Filters per group."""
        return self.filters // self.groups

    @property
    def keras_padding(self) -> Optional[str]:
        """``"valid"`` or ``"same"`` when the backend's own padding mode computes this padding
        (``"same"`` only for symmetric pads, where every backend's "same" agrees), else None."""
        if self.pad == ((0, 0), (0, 0)):
            return "valid"
        (t, b), (l, r) = self.pad
        return "same" if self.pads_are_same and t == b and l == r else None

    @property
    def pads_are_same(self) -> bool:
        """Whether the pads are those of Keras' ``padding="same"`` (the extra row and column,
        where the total is odd, at the bottom and right, as TensorFlow and XLA put it): what a
        ``Conv2D(padding="same")`` computes, symmetric or not."""
        return self.pad == (_same_pads(self.in_h, self.ekh, self.sh),
                            _same_pads(self.in_w, self.ekw, self.sw))

    def flops(self, batch: int | None = None) -> int:
        """Multiply-add flops (x2) of the direct convolution for ``batch`` images."""
        b = batch if batch is not None else (self.batch or 1)
        return 2 * b * self.out_h * self.out_w * self.kh * self.kw * self.cg * self.filters


def _same_pads(size: int, k_eff: int, stride: int) -> Pair:
    out = -(-size // stride)
    total = max((out - 1) * stride + k_eff - size, 0)
    return (total // 2, total - total // 2)


def conv_geometry(input_shape: Sequence, kernel_shape: Sequence[int], *, strides=1,
                  padding: PaddingArg = "valid", dilation_rate=1, groups: int = 1) -> ConvGeometry:
    """Validate a convolution and compute its geometry.

    Args:
        input_shape: ``(batch, height, width, channels)``; batch may be ``None``.
        kernel_shape: ``(kh, kw, channels // groups, filters)``.
        strides, dilation_rate: int or ``(h, w)``.
        padding: ``"valid"``, ``"same"``, int, ``(pad_h, pad_w)`` or
            ``((top, bottom), (left, right))``.
        groups: number of channel groups.

    Raises:
        LoweringError: naming the argument that is inconsistent.
    """
    if len(input_shape) != 4:
        raise LoweringError(f"input must be 4-D (batch, height, width, channels), got shape "
                            f"{tuple(input_shape)}")
    if len(kernel_shape) != 4:
        raise LoweringError(f"kernel must be 4-D (kh, kw, in/groups, filters), got shape "
                            f"{tuple(kernel_shape)}")
    batch, in_h, in_w, channels = input_shape
    kh, kw, cg, filters = (int(v) for v in kernel_shape)
    if in_h is None or in_w is None or channels is None:
        raise LoweringError(f"input height, width and channels must be known, got shape "
                            f"{tuple(input_shape)}")
    in_h, in_w, channels = int(in_h), int(in_w), int(channels)
    if not isinstance(groups, int) or groups < 1:
        raise LoweringError(f"`groups` must be a positive int, got {groups!r}")
    if channels % groups:
        raise LoweringError(f"`groups`={groups} must divide the input channels ({channels})")
    if filters % groups:
        raise LoweringError(f"`groups`={groups} must divide `filters` ({filters})")
    if cg * groups != channels:
        raise LoweringError(f"kernel expects {cg} channels per group x {groups} groups = "
                            f"{cg * groups} input channels, but the input has {channels}")
    sh, sw = normalize_pair(strides, "strides")
    dh, dw = normalize_pair(dilation_rate, "dilation_rate")
    if (sh > 1 or sw > 1) and (dh > 1 or dw > 1):
        # Keras' Conv2D forbids it; Caffe allows it and so do the lowerings.
        pass
    pad = normalize_padding(padding)
    ekh, ekw = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    if pad == "same":
        pad = (_same_pads(in_h, ekh, sh), _same_pads(in_w, ekw, sw))
    elif pad == "valid":
        pad = ((0, 0), (0, 0))
    ph, pw = in_h + sum(pad[0]), in_w + sum(pad[1])
    if ekh > ph or ekw > pw:
        raise LoweringError(
            f"kernel_size ({kh}, {kw}) with dilation_rate ({dh}, {dw}) spans ({ekh}, {ekw}), "
            f"larger than the padded input ({ph}, {pw}); use a smaller kernel or more padding")
    out_h = (ph - ekh) // sh + 1
    out_w = (pw - ekw) // sw + 1
    return ConvGeometry(batch, in_h, in_w, channels, kh, kw, filters, groups, sh, sw, dh, dw,
                        pad, out_h, out_w)  # type: ignore[arg-type]
