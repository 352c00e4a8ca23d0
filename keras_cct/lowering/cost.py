"""Cost model of the three lowerings (CcT section 3.1), forward and backward.

For one convolution it counts, per lowering: elements written by the lowering, GEMM flops,
elements read by the lifting, and the peak temporary bytes. :func:`estimate_seconds` turns those
counts into a time with two machine constants (GEMM throughput and data-movement throughput),
which :mod:`keras_cct.lowering.planner` uses to choose a lowering without running anything.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from keras_cct.errors import LoweringError
from keras_cct.lowering.geometry import ConvGeometry
from keras_cct.lowering.names import LOWERED_TYPES


#: Bytes of lowered data per batch partition (CcT's partitioning): the lowered matrix of a
#: partition is built and multiplied while it is still in the last-level cache. Measured on
#: CaffeNet's conv2-conv5 (``python -m benchmarks.lowering``, partition sweep): 2-7 MB of
#: lowered data per partition is fastest on a 32 MB L3, one whole-batch matrix (37-112 MB)
#: 5-15% slower. ``$KERAS_CCT_PARTITION_BYTES`` overrides it (0: never partition).
PARTITION_BYTES = 4 << 20


@dataclass(frozen=True)
class Cost:
    """Counts for one lowering of one convolution, for a given batch size.

    Attributes:
        lowering_elements: elements written when building the lowered data matrix (forward).
        gemm_flops: flops of the forward GEMMs (2 * m * k * n summed over groups).
        lifting_reads: elements read by the shift-and-add lifting (forward).
        temp_bytes: peak bytes of temporaries (lowered matrix + GEMM output) in the forward pass.
        backward_movement: elements moved by the backward's lowering of ``dy`` and col2im.
    """

    lowering_elements: int
    gemm_flops: int
    lifting_reads: int
    temp_bytes: int
    backward_movement: int

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)


def _lowered_axes(geo: ConvGeometry, lowering: str) -> List[Tuple[int, int]]:
    """(taps, stride) of each axis ``lowering`` lowers (replicates the input along): both for
    Type 1, the height for Type 2, none for Type 3."""
    axes = {"type1": [(geo.kh, geo.sh), (geo.kw, geo.sw)], "type2": [(geo.kh, geo.sh)],
            "type3": []}
    if lowering not in axes:
        raise ValueError(f"unknown lowering {lowering!r}; expected one of {LOWERED_TYPES}")
    return axes[lowering]


def replicates(geo: ConvGeometry, lowering: str) -> bool:
    """Whether ``lowering``'s lowered matrix repeats input values: a lowered axis with more
    than one tap. Otherwise the matrix is at most a copy of the input (a 1x1 kernel's Type 1,
    any Type 3), and there is nothing for a batch partition to keep in cache
    (:func:`partitions`)."""
    return any(k > 1 for k, _ in _lowered_axes(geo, lowering))


def copies_nothing(geo: ConvGeometry, lowering: str) -> bool:
    """Whether ``lowering``'s lowered matrix is the (padded) input itself, reshaped: one channel
    group, and every lowered axis one tap at stride 1 (an ungrouped Type 3; a 1x1 kernel's Type
    1 at stride 1; a one-row kernel's Type 2 at a height stride of 1). Its col2im is then a
    reshape too (:func:`keras_cct.lowering.engine.lowered_conv2d`)."""
    return geo.groups == 1 and all(k == s == 1 for k, s in _lowered_axes(geo, lowering))


def lowered_bytes_per_image(geo: ConvGeometry, lowering: str, dtype_bytes: int = 4) -> int:
    """Bytes of one image's lowered matrix for one channel group (:func:`cost`'s lowering
    elements for one image), counted for :func:`partitions`: 0 when the lowering repeats no
    input value (:func:`replicates`)."""
    if not replicates(geo, lowering):
        return 0
    return cost(geo, lowering, batch=1).lowering_elements // geo.groups * dtype_bytes


def value_bytes(dtype) -> int:
    """Bytes of one value of ``dtype`` (a NumPy, JAX or PyTorch dtype, a TensorFlow ``DType``
    or a name such as ``"bfloat16"``): what :func:`partitions` counts a lowered value at."""
    size = getattr(dtype, "itemsize", None)  # NumPy / JAX / PyTorch dtypes
    if size is None:
        size = getattr(dtype, "size", None)  # a TensorFlow DType
    if isinstance(size, int) and size > 0:
        return size
    digits = "".join(ch for ch in str(getattr(dtype, "name", dtype)) if ch.isdigit())
    if not digits or int(digits) % 8:
        raise LoweringError(f"cannot tell the bytes per value of dtype {dtype!r}: lowered "
                            "convolutions take floating-point tensors")
    return int(digits) // 8


def partition_bytes() -> int:
    """Target bytes of lowered data per batch partition (:data:`PARTITION_BYTES` or
    ``$KERAS_CCT_PARTITION_BYTES``)."""
    env = os.environ.get("KERAS_CCT_PARTITION_BYTES")
    return int(float(env)) if env else PARTITION_BYTES


def partitions(geo: ConvGeometry, lowering: str, batch: Optional[int], *,
               dtype_bytes: int = 4, target_bytes: Optional[int] = None) -> int:
    """How many batch partitions ``lowering`` cuts a batch of ``batch`` images into: as many
    whole images per partition as fit ``target_bytes`` of lowered data (at least one), so
    ``ceil(batch / images_per_partition)`` partitions; 1 for an unknown batch size, and for a
    lowering that repeats no input value (:func:`replicates`): cut into partitions, a 1x1
    kernel's Type 1 or a grouped Type 3 ran as fast or slower on every backend (forward+backward
    on a 2-core Intel Xeon, one partition against 2-4: ResNet-50's 56x56x64 -> 256 1x1 layer at
    batch 16, float32, 51.8 / 56.3 ms on TensorFlow, 81.2 / 90.6 on PyTorch, 53.5 / 73.2 on
    JAX; CaffeNet's conv2 by Type 3 at batch 32, 683 / 761, 1227 / 1220, 863 / 1130)."""
    target = partition_bytes() if target_bytes is None else target_bytes
    per_image = lowered_bytes_per_image(geo, lowering, dtype_bytes)
    if not batch or target <= 0 or per_image == 0:
        return 1
    images = max(1, target // per_image)
    return max(1, math.ceil(int(batch) / images))


def cost(geo: ConvGeometry, lowering: str, *, batch: int | None = None,
         dtype_bytes: int = 4) -> Cost:
    """Count the work of ``lowering`` ("type1", "type2" or "type3") for ``geo``."""
    b = batch if batch is not None else (geo.batch or 1)
    oh, ow, ph, pw = geo.out_h, geo.out_w, geo.padded_h, geo.padded_w
    kh, kw, d, o, g = geo.kh, geo.kw, geo.cg, geo.og, geo.groups
    out = b * oh * ow * o * g
    # a lowering that is a reshape of the input copies only what the padding adds
    reshaped = lowering != "type3" and copies_nothing(geo, lowering)
    padding = b * ph * pw * d if (ph, pw) != (geo.in_h, geo.in_w) else 0
    if lowering == "type1":
        rows, inner, cols = b * oh * ow, kh * kw * d, o
        lowered = padding if reshaped else rows * inner * g
        lift = 0
        gemm_out = rows * cols * g
        # col2im: kh*kw placements along w, kh along h (a reshape: the padding cropped)
        back = lowered if reshaped else lowered + kh * b * oh * pw * d * g
    elif lowering == "type2":
        rows, inner, cols = b * oh * pw, kh * d, kw * o
        lowered = padding if reshaped else rows * inner * g
        gemm_out = rows * cols * g
        lift = kw * out
        back = lowered + gemm_out  # unlift dy (kw placements) + col2im along h
    elif lowering == "type3":
        rows, inner, cols = b * ph * pw, d, kh * kw * o
        lowered = b * ph * pw * d * g  # the padded input itself
        gemm_out = rows * cols * g
        lift = kh * kw * out
        back = gemm_out  # unlift: dy placed kh*kw times
    else:
        raise ValueError(f"unknown lowering {lowering!r}; expected one of {LOWERED_TYPES}")
    flops = 2 * rows * inner * cols * g
    temp = (lowered + gemm_out) * dtype_bytes
    return Cost(lowered, flops, lift, temp, back)


@dataclass(frozen=True)
class Machine:
    """The two throughputs the cost model needs.

    Attributes:
        gemm_flops_per_s: sustained GEMM throughput (flop/s).
        move_elements_per_s: sustained throughput of copies/adds of float32 elements (elem/s),
            counting each element written (lowering) or read (lifting) once.
    """

    gemm_flops_per_s: float = 3.0e11
    move_elements_per_s: float = 1.5e9


def estimate_seconds(c: Cost, machine: Machine = Machine(), *, training: bool = True) -> float:
    """Estimated time of one forward (and backward, if ``training``) pass from the counts."""
    fwd = c.gemm_flops / machine.gemm_flops_per_s + \
        (c.lowering_elements + c.lifting_reads) / machine.move_elements_per_s
    if not training:
        return fwd
    bwd = 2 * c.gemm_flops / machine.gemm_flops_per_s + \
        c.backward_movement / machine.move_elements_per_s
    return fwd + bwd
