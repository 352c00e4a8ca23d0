"""Choosing a lowering per convolution (CcT's optimizer).

Three modes:

* ``mode="auto"`` (what :class:`~keras_cct.HybridConv2D` uses by default): the fastest, as timed
  here, of a shortlist that always holds the backend's own convolution. The shortlist --
  ``"native"`` (the backend's own convolution in its fastest form), the cost model's best
  lowered type and, where they apply, ``"winograd"`` (F(2x2, 3x3)), ``"winograd4"`` (F(4x4, 3x3)
  or F(4x4, 5x5); not in 16-bit floats: :data:`IMPRECISE`; neither below
  :data:`WINOGRAD_MIN_CHANNELS` input channels per group) and ``"space_to_depth"``
  (:data:`~keras_cct.lowering.dispatch.NEEDS`) -- is timed once for the exact shape, batch,
  backend, dtype and machine (forward+backward at up to :data:`AUTO_BATCH` images,
  :func:`auto_batch`; :data:`AUTO_REPEATS` rounds, the candidates interleaved so that a burst of
  load on the machine falls on all of them). A winner other than ``"native"`` must beat it by
  :data:`NATIVE_MARGIN`, and where ``"native"`` and the fastest other candidate are within
  :data:`CONFIRM_BELOW` of each other (either ahead) at a batch smaller than the layer's, the
  two are timed again at a larger batch (:func:`confirm_batch`; rankings at 4 images and at 32
  can differ; on a backend whose module sets ``CONFIRM_EVERY_WIN``, PyTorch's, any winner other
  than ``"native"`` is). Where a candidate is compiled per shape in pieces the layer reuses
  (TensorFlow's Winograd), one race at the layer's own batch instead (:func:`race_batch`). A
  close race that is not confirmed at a larger batch (that one, or one with no larger batch to
  confirm at, as at the layer's whole batch) gets as many rounds again on its warm steps
  (``again_if_close`` of :func:`time_lowerings`). The planning of a shape has a budget
  (:data:`AUTO_BUDGET_S`, a second): ``"native"`` first, then the others in :data:`AUTO_ORDER`,
  none started once it is spent, nor a second Winograd (and none after it) whose start
  (compilation) took longer on this machine's earlier races than is left
  (:func:`expected_start_s`). The choice is cached on disk, so only the first use of a shape
  pays for the race: about a second, more where Winograd is compiled (docs/benchmarks.md), and
  later ones nothing. The same shape at another batch size (fit's last partial batch, a
  predict, an evaluate) takes a cached race's pick where that race timed the same images, or
  at least :data:`AUTO_BATCH` as it would, or more than it would with a clear pick where it
  would time at least :data:`FEWER_FROM` (:func:`_same_race`); else it is raced. A
  convolution of less than :data:`AUTO_MIN_FLOPS` is not worth timing: it runs ``"native"``
  (one op, where a lowering is several), except a 1x1 one where ``LOWER_1X1`` (below) says.
  A depthwise convolution (one input channel per group) is not timed either: it runs what the
  backend module names (``DEPTHWISE``: the backend's own depthwise op on TensorFlow and PyTorch,
  ``"depthwise"``'s shifted multiply-adds on JAX, whose grouped convolution is 6.6-27x slower;
  :mod:`keras_cct.lowering.depthwise`). Where the module sets ``LOWER_1X1`` (JAX), an ungrouped
  1x1 convolution runs the cost model's lowered type (one GEMM) untimed, however small.
* ``mode="model"`` applies CcT's rule through the cost model, without running anything: Type 1
  (replicate the input) wins when input channels are fewer than output channels, Type 3
  (replicate the output) in the opposite case, Type 2 in between; the estimate in
  :mod:`keras_cct.lowering.cost` decides, so the extra work of a strided Type 3 is weighed too.
* ``mode="measure"`` times every available lowering at the full batch and caches the winner.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from keras_cct._files import cache_dir, read_cache_entries, write_cache_entries
from keras_cct._system import cpu_name, physical_memory
from keras_cct.errors import LoweringError, PlannerCacheWarning
from keras_cct.lowering import _backend as B
from keras_cct.lowering._backend.common import MAX_SPLIT_GROUPS
from keras_cct.lowering.cost import Machine, cost, estimate_seconds, value_bytes
from keras_cct.lowering.dispatch import WINOGRAD_TILE, available
from keras_cct.lowering.geometry import PLAN_BATCH, ConvGeometry, conv_geometry
from keras_cct.lowering.names import ALL_LOWERINGS, LOWERED_TYPES, PLANNER_MODES
from keras_cct.lowering.timing import interleaved_best, make_step
from keras_cct.lowering.winograd import partition_images

CACHE_VERSION = 28  # what each version made stale: docs/lowering.md, "Planner cache versions"

#: ``mode="auto"`` times candidates at no more than this many images, and no more than
#: :data:`AUTO_FLOPS_PER_CALL` forward+backward flops per call (time grows with the batch, the
#: ranking hardly does), to keep the first use of a shape near a second.
AUTO_BATCH = 16
AUTO_FLOPS_PER_CALL = 6e9
#: Rounds ``mode="auto"`` times its shortlist in (best of each; the candidates interleaved) --
#: at least; short calls get more rounds, until each candidate has :data:`AUTO_MIN_TIMED_S`
#: seconds of timed calls, at most :data:`AUTO_MAX_ROUNDS` rounds: three calls of 2-3 ms on a
#: busy machine decide nothing (TF, Intel Xeon with AMX: ResNet-50's res2a_branch2a at batch 4
#: picked Type 1, 2.9 ms, against keras Conv2D's 2.5 ms for the same op as ``"native"``).
AUTO_REPEATS = 3
AUTO_MIN_TIMED_S = 0.05
AUTO_MAX_ROUNDS = 15
#: ``mode="auto"`` times a candidate no more once its best time is this factor behind the
#: fastest one's after a round: it cannot win, and its calls are the slowest of the race (JAX,
#: VGG16's conv1_2 at 8 images: ``"native"`` 306 ms a call against F(4x4)'s 158).
AUTO_DROP_BEHIND = 1.5
#: Forward flops under which ``mode="auto"`` picks ``"native"`` without timing (it does the
#: same for more than :data:`~keras_cct.lowering._backend.common.MAX_SPLIT_GROUPS` groups, depthwise
#: layers included: the lowerings run one GEMM per group, the backend one grouped op): at a few
#: hundred GFLOP/s such a convolution takes well under a millisecond, where the op count of a
#: lowering (pad, gather, GEMM, reshape, lifting) dominates.
AUTO_MIN_FLOPS = 100e6
#: ``mode="auto"`` keeps ``"native"`` unless another candidate times at least this fraction
#: faster: the backend's own op is one op with no temporaries, and two repeats on a busy
#: machine differ by a few percent.
NATIVE_MARGIN = 0.05
#: Where ``"native"`` and the fastest other candidate are within this factor of each other
#: (either ahead) at :func:`auto_batch` images, both are timed again at :func:`confirm_batch`
#: images (at most :data:`CONFIRM_FLOPS_PER_CALL` forward+backward flops per call), and that
#: timing decides. Winograd's fixed costs weigh more on a few images: CaffeNet conv4 and conv5
#: in bfloat16 (TF, batch 32) kept ``"native"`` from a race at 8 images, where F(2x2) then ran
#: 24.4 / 18.9 ms against native's 31.6 / 21.3 at the layer's batch.
CONFIRM_BELOW = 1.3
CONFIRM_FLOPS_PER_CALL = 24e9
#: A batch raced at this many images or more, fewer than a cached race of its shape, takes
#: that race's clear pick (:func:`_clear_pick`; a ``predict`` of a few images after ``fit``):
#: such picks held at 8 and 4 images in 36 of 38 cases, not at 1 (docs/lowering.md).
FEWER_FROM = 4
#: Forward+backward flops per call up to which a shortlist with a compiled candidate is raced
#: at the layer's own batch (:func:`race_batch`): VGG16's 3x3 layers at 8 images (22 GFLOP)
#: and CaffeNet's conv2-conv5 at 32 (19-43 GFLOP), not CaffeNet's at 128. (CaffeNet conv2, TF,
#: float32, where F(4x4, 5x5) is compiled: first use 4.5-4.6 s with the limit at 40 GFLOP, a
#: race at 17 images, and 3.9-4.1 s raced at 32.)
COMPILED_FLOPS_PER_CALL = 48e9
#: ``mode="auto"`` leaves Winograd off the shortlist below this many input channels per group:
#: its transforms then cost more than the GEMM they shrink. VGG16 conv1_1 (3 -> 64, 112x112,
#: batch 8): F(2x2)/F(4x4) 55/36 ms against native 20 on TensorFlow (float32), and on JAX
#: (bfloat16) 124/49 against 20, after 2.6/3.3 s of compiling each.
WINOGRAD_MIN_CHANNELS = 16
#: Seconds ``mode="auto"`` may spend on a new shape before it starts no further candidate
#: (``$KERAS_CCT_PLAN_BUDGET`` overrides; ``mode="measure"`` has no budget), counted from the
#: moment ``"native"``, always first, is compiled (what keras Conv2D costs as well); the others
#: follow in the order of :data:`AUTO_ORDER`. The rounds run on the candidates started, and a close
#: race's confirmation (two more compilations) runs regardless. Compiling a candidate is most of a
#: first use on JAX (XLA: 0.3-1.8 s each on VGG16 conv1_2, F(4x4) the slowest) and on TensorFlow
#: (0.2-1.9 s for the first trace of a lowering in a process); without the budget a first use took
#: up to 6.5 s. The race also ends before a second Winograd whose start, as long as that lowering's
#: took in the races cached for this backend, device, dtype and grouping (:func:`expected_start_s`;
#: where none recorded it, as long as the first Winograd's start in this race,
#: :func:`_start_estimate`), would end past the budget: its compilation (0.8-1.5 s) took a first
#: use past two seconds for a pick 0-9% faster than the first Winograd, where it won at all
#: (TensorFlow and JAX, 2-core Intel Xeon). Only a second Winograd: leaving out any candidate by
#: its estimate changed which were raced, and JAX's VGG16 conv4_2 then ran ``"native"`` in float32
#: (1.01x keras Conv2D, F(2x2) 1.53x), its 7x7x512 layers in bfloat16 F(2x2) instead of Type 1
#: (1.85x against 2.44x).
AUTO_BUDGET_S = 1.0
#: The order ``mode="auto"`` times its shortlist in after ``"native"``: Winograd F(2x2) (2.25x
#: fewer multiplications on 3x3 layers; the one that won on TensorFlow, in float32 and
#: bfloat16) before F(4x4) (4x fewer; the slowest to compile: 1.6 s on JAX for VGG16's
#: conv1_2, and the first Winograd TensorFlow traces in a process takes 1.5 s), then the
#: cost model's lowered type, then space-to-depth (a first layer's full-width GEMM). The
#: lowered type goes before space-to-depth because a first layer's race can spend the budget
#: on two candidates (ResNet-50's conv1 on JAX, a 2-core AMD EPYC, kept ``"native"``, 605 ms
#: against the unraced Type 1's 355: docs/lowering.md).
AUTO_ORDER = ("winograd", "winograd4") + LOWERED_TYPES + ("space_to_depth",)
#: Output planes at least this large on both sides take F(4x4) before F(2x2) in that order
#: (:func:`auto_order`): its 4x fewer multiplications pay for its larger transforms there, and
#: the budget may leave time for only one. In this project's four float32 runs of
#: ``benchmarks.convs`` kept in docs/benchmarks (Intel Xeon and AMD, TensorFlow and JAX), of
#: the layers that ran Winograd, 37 of the 39 with 28x28-112x112 outputs ran F(4x4), and 44
#: of the 46 with 7x7-14x14 outputs F(2x2).
WINOGRAD4_FIRST_FROM = 28


def auto_order(geo: ConvGeometry, shortlist: Sequence[str]) -> List[str]:
    """The order ``mode="auto"`` starts ``shortlist`` in: ``"native"``, then
    :data:`AUTO_ORDER`, with ``"winograd4"`` before ``"winograd"`` on outputs of at least
    :data:`WINOGRAD4_FIRST_FROM` on both sides."""
    order = ("native",) + AUTO_ORDER
    if min(geo.out_h, geo.out_w) >= WINOGRAD4_FIRST_FROM:
        order = ("native", "winograd4", "winograd") + AUTO_ORDER[2:]
    return [c for c in order if c in shortlist] + [c for c in shortlist if c not in order]


def _device_name() -> str:
    return B.device_name() or f"cpu:{cpu_name()}:{os.cpu_count()}"


#: Lowerings the planner does not pick for a dtype, for their error: F(4x4, 3x3) loses about
#: 0.1 of the result's relative precision in bfloat16 (its GEMM's bfloat16 result amplified by
#: the lifting; F(2x2, 3x3): 5e-3, the backend's own convolution: 3e-3), and F(4x4, 5x5) 0.13
#: on CaffeNet conv2's shape (the direct convolution 3.4e-3). A user may still ask for them
#: by name.
IMPRECISE = {"bfloat16": ("winograd4",), "float16": ("winograd4",)}


def choose_for(geo: ConvGeometry, *, mode: str = "model", dtype: str = "float32",
               training: bool = True, candidates: Optional[Sequence[str]] = None,
               batch: Optional[int] = None, machine: Machine = Machine(),
               bias: bool = False) -> str:
    """:func:`choose` for an already validated geometry."""
    b = batch or geo.batch or PLAN_BATCH
    if mode == "model":
        cands = tuple(candidates) if candidates else LOWERED_TYPES
        bad = [c for c in cands if c not in LOWERED_TYPES]
        if bad:
            raise LoweringError(f"mode='model' only ranks {LOWERED_TYPES}, got {bad}")
        return _model_choice(geo, cands, b, training, machine)
    if mode not in ("auto", "measure"):
        raise LoweringError(f"`mode` must be one of {PLANNER_MODES}, got {mode!r}")
    usable = tuple(c for c in available(geo) if c not in IMPRECISE.get(dtype, ()))
    if candidates:
        bad = [c for c in candidates if c not in ALL_LOWERINGS]
        if bad:
            raise LoweringError(f"unknown lowerings {bad}; expected some of {ALL_LOWERINGS}")
        usable = tuple(c for c in candidates if c in usable) or ("native",)
    if mode == "measure":
        return _measured_choice(geo, usable, dtype, training, b, bias=bias)
    if "depthwise" in usable and geo.groups > 1 and B.DEPTHWISE in usable:
        return B.DEPTHWISE
    usable = tuple(c for c in usable if c != "depthwise") or usable
    lowered = tuple(c for c in usable if c in LOWERED_TYPES and fits_in_memory(geo, c, b))
    if B.LOWER_1X1 and lowered and geo.kh == geo.kw == 1 and geo.groups == 1:
        return _model_choice(geo, lowered, b, training, machine)  # small ones too
    if geo.flops(b) < AUTO_MIN_FLOPS or geo.groups > MAX_SPLIT_GROUPS:
        return "native" if "native" in usable else usable[0]
    if geo.cg < WINOGRAD_MIN_CHANNELS:
        usable = tuple(c for c in usable if not c.startswith("winograd")) or usable
    shortlist = tuple(c for c in usable if c not in LOWERED_TYPES)
    if lowered:
        shortlist += (_model_choice(geo, lowered, b, training, machine),)
    if len(shortlist) == 1:
        return shortlist[0]
    return _auto_choice(geo, shortlist, dtype, training, b, bias)


def auto_batch(geo: ConvGeometry, batch: int) -> int:
    """Images ``mode="auto"`` times a shape at (see :data:`AUTO_BATCH`)."""
    per_image = 3 * geo.flops(1)
    return max(1, min(AUTO_BATCH, batch, int(AUTO_FLOPS_PER_CALL // per_image)))


def confirm_batch(geo: ConvGeometry, batch: int) -> int:
    """Images a close ``mode="auto"`` winner is timed again at, beside ``"native"`` (at most
    ``batch`` and :data:`CONFIRM_FLOPS_PER_CALL` forward+backward flops per call)."""
    per_image = 3 * geo.flops(1)
    return max(auto_batch(geo, batch), min(batch, int(CONFIRM_FLOPS_PER_CALL // per_image)))


def race_batch(geo: ConvGeometry, batch: int, shortlist: Sequence[str],
               dtype: str = "float32") -> int:
    """Images ``mode="auto"`` times ``shortlist`` at: :func:`auto_batch`; but where the shortlist
    holds a lowering the backend compiles per input shape, in pieces the layer then runs itself
    (``COMPILED`` of :mod:`keras_cct.lowering._backend`: Winograd's XLA clusters on
    TensorFlow), images the layer's own call compiles nothing new for, and no second race: a
    race at a few images, its confirmation and the layer's first call each compiled the
    clusters again (CaffeNet conv3-conv5 in float32, TF, batch 32: 31 compilations, 11.3 s,
    where one race at the layer's batch compiles 16, in 6.1 s, and the layer none).

    Where Winograd runs in batch partitions (:func:`~keras_cct.lowering.winograd.
    partition_images`, fewer images than ``batch``), that is the fewest whole partitions of the
    first Winograd candidate holding :func:`auto_batch` images: the layer runs that partition
    shape, and time per partition is what it repeats (CaffeNet conv3-conv5 on TF in float32,
    the first ``train_on_batch`` of a process with an empty cache, ``benchmarks.first_step``:
    18.0 -> 14.2 s at batch 32, 19.6 -> 15.5 s at 128, the same picks; VGG16 at batch 8 and
    ResNet-50 at 16, ``benchmarks.nets``: 71.5 -> 52.9 s of planning over 29 shapes, the same
    Winograd picks, on a 2-core AMD EPYC). Otherwise the layer's own ``batch`` (above
    :data:`COMPILED_FLOPS_PER_CALL`, :func:`confirm_batch`)."""
    if not any(c in B.COMPILED for c in shortlist):
        return auto_batch(geo, batch)
    tiles = [WINOGRAD_TILE[c] for c in shortlist if c in WINOGRAD_TILE]
    part = partition_images(geo, tiles[0], batch, value_bytes(dtype)) if tiles else batch
    if part < batch:
        return min(batch, -(-auto_batch(geo, batch) // part) * part)
    if 3 * geo.flops(batch) <= COMPILED_FLOPS_PER_CALL:
        return batch
    return confirm_batch(geo, batch)


def _keep_native(times: Dict[str, float]) -> str:
    """The fastest of ``times``, unless ``"native"`` is within :data:`NATIVE_MARGIN` of it."""
    best = min(times, key=times.get)
    if "native" in times and times[best] * (1 + NATIVE_MARGIN) > times["native"]:
        return "native"
    return best


def _rival(times: Dict[str, float]) -> Optional[str]:
    """The fastest of ``times`` but ``"native"`` (None if there is none)."""
    return min((c for c in times if c != "native"), key=times.get, default=None)


def _close_race(times: Dict[str, float]) -> bool:
    """Whether ``"native"`` and the fastest other candidate of ``times`` are within
    :data:`CONFIRM_BELOW` of each other."""
    rival = _rival(times)
    if rival is None or "native" not in times:
        return False
    a, b = times["native"], times[rival]
    return max(a, b) < CONFIRM_BELOW * min(a, b)


def plan_budget_s() -> float:
    """:data:`AUTO_BUDGET_S`, or ``$KERAS_CCT_PLAN_BUDGET`` (seconds) when set."""
    env = os.environ.get("KERAS_CCT_PLAN_BUDGET")
    return float(env) if env else AUTO_BUDGET_S


def _auto_choice(geo: ConvGeometry, shortlist, dtype: str, training: bool, batch: int,
                 bias: bool = False) -> str:
    fitting = tuple(c for c in shortlist if fits_in_memory(geo, c, batch))
    shortlist = fitting or shortlist
    key = _cache_key(geo, shortlist, dtype, training, batch, mode="auto", bias=bias)
    cached = _read_cache()
    hit = cached.get(key)
    if isinstance(hit, dict) and hit.get("choice") in shortlist:
        return hit["choice"]
    order = auto_order(geo, shortlist)
    small = race_batch(geo, batch, order, dtype)
    compiled = any(c in B.COMPILED for c in order)
    big = small if compiled else confirm_batch(geo, batch)
    shape = _shape_key(geo, shortlist, dtype, training, bias)
    same = _same_race(cached, shape, small, big)
    if same is not None:
        return same
    start = time.perf_counter()
    where = _start_where(geo, dtype)
    started: Dict[str, float] = {}
    # a close race is confirmed at a larger batch, or else (compiled pieces; no larger batch
    # to confirm at, as at the layer's whole batch) given as many rounds again, warm
    times = time_lowerings(geo, order, batch=small, dtype=dtype, training=training,
                           repeats=AUTO_REPEATS, budget_s=plan_budget_s(),
                           min_timed_s=AUTO_MIN_TIMED_S, max_rounds=AUTO_MAX_ROUNDS, bias=bias,
                           drop_behind=AUTO_DROP_BEHIND, again_if_close=big <= small,
                           start_estimates=expected_start_s(cached, where),
                           start_seconds=started)
    best = _keep_native(times)
    entry = {"batch": small, "seconds": times, "shape": shape,
             "not_timed": [c for c in order if c not in times],
             "start": {"where": where, "seconds": started}}
    rival = _rival(times)
    if big > small and _to_confirm(times):
        again = time_lowerings(geo, ("native", rival), batch=big, dtype=dtype,
                               training=training, repeats=AUTO_REPEATS,
                               min_timed_s=AUTO_MIN_TIMED_S, max_rounds=AUTO_MAX_ROUNDS,
                               bias=bias)
        entry.update(confirm_batch=big, confirm_seconds=again)
        best = _keep_native(again)
    entry["plan_seconds"] = time.perf_counter() - start
    entries = _read_cache()
    entries[key] = dict(entry, choice=best)
    _write_cache(entries)
    return best


def _start_where(geo: ConvGeometry, dtype: str) -> list:
    """What a candidate's start (compilation, first call) is recorded and looked up under:
    the backend, the device, the dtype and whether the layer is grouped (F(2x2) compiled in
    0.9-1.7 s on CaffeNet's grouped conv4, 0.4-0.8 s on VGG16's ungrouped conv4_2)."""
    import keras
    return [keras.backend.backend(), _device_name(), dtype, geo.groups > 1]


def expected_start_s(entries: Dict[str, dict], where: list) -> Dict[str, float]:
    """Seconds each lowering's start (make, compile, first call) took, the median over the
    cached races recorded under ``where`` (:func:`_start_where`); a lowering never started
    there is not in the result."""
    seen: Dict[str, List[float]] = {}
    for entry in entries.values():
        rec = entry.get("start") if isinstance(entry, dict) else None
        if isinstance(rec, dict) and rec.get("where") == where and \
                isinstance(rec.get("seconds"), dict):
            for low, sec in rec["seconds"].items():
                if isinstance(sec, (int, float)):
                    seen.setdefault(low, []).append(float(sec))
    return {low: float(np.median(secs)) for low, secs in seen.items()}


def _second_winograd(lowering: str, started) -> bool:
    """Whether ``lowering`` is a Winograd and one was ``started`` already."""
    return lowering in WINOGRAD_TILE and any(c in WINOGRAD_TILE for c in started)


def _start_estimate(lowering: str, recorded: Dict[str, float], took: Dict[str, float]) -> float:
    """Seconds the start of ``lowering``, a second Winograd, is expected to take: as long as
    in the races cached (``recorded``, :func:`expected_start_s`), or, where none recorded it,
    as long as the first Winograd's start just ``took`` (on an empty cache: TensorFlow,
    CaffeNet's conv3 at 16 images in float32, 0.93 s for F(2x2), then 0.95 s for F(4x4))."""
    if lowering in recorded:
        return recorded[lowering]
    return max((s for c, s in took.items() if c in WINOGRAD_TILE), default=0.0)


def _model_choice(geo, cands, batch, training, machine) -> str:
    return min(cands, key=lambda c: estimate_seconds(cost(geo, c, batch=batch), machine,
                                                     training=training))


def choose(input_shape: Sequence, kernel_shape: Sequence[int], *, strides=1, padding="valid",
           dilation_rate=1, groups: int = 1, mode: str = "model", dtype: str = "float32",
           training: bool = True, candidates: Optional[Sequence[str]] = None,
           batch: Optional[int] = None, bias: bool = False) -> str:
    """Pick the lowering for one convolution.

    Args:
        input_shape: ``(batch, height, width, channels)`` (batch may be ``None``).
        kernel_shape: ``(kh, kw, channels // groups, filters)``.
        strides, padding, dilation_rate, groups: as in :func:`keras_cct.lowering.conv2d`.
        mode: ``"model"`` (cost model, instant), ``"auto"`` (time a shortlist with the
            backend's own convolution on it once, cached; see the module docstring) or
            ``"measure"`` (time every available lowering once; the winner is cached on disk).
        dtype: element type, part of the measurement cache key.
        training: rank by forward+backward time (True) or forward only.
        candidates: lowerings to consider (default: the three types for ``"model"``; every
            lowering :func:`available` for the shape for ``"auto"`` and ``"measure"``).
        batch: batch size to rank for when ``input_shape`` has none (default 32).
        bias: whether the convolution adds a bias (``"auto"`` and ``"measure"`` time it with
            one, as the layer runs; part of the cache key).

    Returns:
        One of :data:`ALL_LOWERINGS`.
    """
    geo = conv_geometry(input_shape, kernel_shape, strides=strides, padding=padding,
                        dilation_rate=dilation_rate, groups=groups)
    return choose_for(geo, mode=mode, dtype=dtype, training=training, candidates=candidates,
                      batch=batch, bias=bias)


# ---------------------------------------------------------------------------------- measuring

def _key_fields(geo: ConvGeometry, dtype: str, training: bool, bias: bool, mode: str) -> dict:
    """What a cached choice depends on, but the batch and the candidates."""
    import keras
    from keras_cct._version import __version__
    return dict(v=CACHE_VERSION, mode=mode, pkg=__version__, backend=keras.backend.backend(),
                device=_device_name(), dtype=dtype, training=training, bias=bias,
                geo=[geo.in_h, geo.in_w, geo.channels, geo.kh, geo.kw, geo.filters, geo.groups,
                     geo.sh, geo.sw, geo.dh, geo.dw, [list(p) for p in geo.pad]])


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _cache_key(geo: ConvGeometry, cands, dtype: str, training: bool, batch: int,
               mode: str = "measure", bias: bool = False) -> str:
    return _digest(dict(_key_fields(geo, dtype, training, bias, mode), batch=batch,
                        cands=list(cands)))


def _shape_key(geo: ConvGeometry, cands, dtype: str, training: bool, bias: bool) -> str:
    """:func:`_cache_key` of a ``mode="auto"`` race but the layer's batch: what races of the
    same layer shape and shortlist at other batches are found by (:func:`_same_race`)."""
    return _digest(dict(_key_fields(geo, dtype, training, bias, "auto"), cands=list(cands)))


def _to_confirm(times: Dict[str, float]) -> bool:
    """Whether a race that timed ``times`` is timed again at a larger batch, where there is
    one: ``"native"`` and its rival close, or (``CONFIRM_EVERY_WIN``) any rival winning."""
    rival = _rival(times)
    return _close_race(times) or (B.CONFIRM_EVERY_WIN and "native" in times and
                                  rival is not None and _keep_native(times) == rival)


def _same_race(entries: Dict[str, dict], shape: str, small: int, big: int) -> Optional[str]:
    """The pick of a race cached for the layer shape ``shape`` (:func:`_shape_key`) at another
    batch that timed what a race at this one would: ``small`` images and, where that race was
    confirmed (or would be, with a larger batch to confirm at), ``big``; None if there is
    none. A shape raced at fit's batch is not raced again for the last partial batch or a
    predict or evaluate at another batch where those images are the same. A race of at least
    :data:`AUTO_BATCH` images (a compiled shortlist's, at the layer's own batch:
    :func:`race_batch`) also serves any other batch raced at that many (TensorFlow: 25 pairs
    of races at 32 and 16 or 64 and 32 images kept the same pick in 20 and differed in the rest
    as two races at one batch do: docs/lowering.md), and a race of more images one raced at
    :data:`FEWER_FROM` or more, where its pick was clear (:func:`_clear_pick`)."""
    near = fewer = None
    for e in entries.values():
        if not isinstance(e, dict) or e.get("shape") != shape:
            continue
        if e.get("batch") != small:
            if near is None and min(small, e.get("batch") or 0) >= AUTO_BATCH:
                near = e.get("choice")
            elif fewer is None and FEWER_FROM <= small < (e.get("batch") or 0):
                fewer = _clear_pick(e)
            continue
        if "confirm_batch" in e:
            if e["confirm_batch"] == big:
                return e.get("choice")
        elif big <= small or not _to_confirm(e.get("seconds") or {}):
            return e.get("choice")
    return near or fewer


def _clear_pick(entry: dict) -> Optional[str]:
    """A cached race's pick where it serves fewer images: ``"native"`` (what the layer
    replaces) or one that led it by :data:`CONFIRM_BELOW` in the race; None after a close race
    (VGG16's conv1_1, JAX: Type 1 tied with ``"native"`` at 16, 0.50x Conv2D's at 8)."""
    pick = entry.get("choice")
    return pick if pick == "native" or not _close_race(entry.get("seconds") or {}) else None


def _cache_file() -> Path:
    return cache_dir() / "planner.json"


def _read_cache() -> Dict[str, dict]:
    return read_cache_entries(_cache_file(), CACHE_VERSION, "the planner cache",
                              PlannerCacheWarning)


def _write_cache(entries: Dict[str, dict]) -> None:
    write_cache_entries(_cache_file(), CACHE_VERSION, entries, "the planner cache",
                        PlannerCacheWarning)


def memory_budget_bytes() -> int:
    """Bytes of temporaries a lowering may need before it is not even tried: a quarter of the
    physical memory (``$KERAS_CCT_MEMORY_BUDGET`` overrides)."""
    env = os.environ.get("KERAS_CCT_MEMORY_BUDGET")
    if env:
        return int(float(env))
    total = physical_memory()
    return total // 4 if total else 4 << 30


def memory_needed_bytes(geo: ConvGeometry, lowering: str, batch: int,
                        dtype_bytes: int = 4) -> int:
    """Bytes of ``lowering``'s temporaries for a forward+backward pass: about twice the forward
    peak (the lowered matrix is kept for the kernel gradient); 0 for a lowering that is not one
    of the three lowered types."""
    if lowering not in LOWERED_TYPES:
        return 0
    return 2 * cost(geo, lowering, batch=batch, dtype_bytes=dtype_bytes).temp_bytes


def fits_in_memory(geo: ConvGeometry, lowering: str, batch: int, dtype_bytes: int = 4) -> bool:
    """Whether :func:`memory_needed_bytes` fits :func:`memory_budget_bytes`."""
    return memory_needed_bytes(geo, lowering, batch, dtype_bytes) <= memory_budget_bytes()


def _measured_choice(geo: ConvGeometry, cands, dtype: str, training: bool, batch: int,
                     repeats: int = 3, bias: bool = False) -> str:
    fitting = tuple(c for c in cands if fits_in_memory(geo, c, batch))
    cands = fitting or cands
    key = _cache_key(geo, cands, dtype, training, batch, bias=bias)
    entries = _read_cache()
    hit = entries.get(key)
    if isinstance(hit, dict) and hit.get("choice") in cands:
        return hit["choice"]
    times = time_lowerings(geo, cands, batch=batch, dtype=dtype, training=training,
                           repeats=repeats, bias=bias)
    best = min(times, key=times.get)
    entries = _read_cache()
    entries[key] = {"choice": best, "seconds": times}
    _write_cache(entries)
    return best


def time_lowering(geo: ConvGeometry, lowering: str, *, batch: int = 32, dtype: str = "float32",
                  training: bool = True, repeats: int = 3, bias: bool = False) -> float:
    """Best-of-``repeats`` seconds of one forward (+ backward) pass of ``lowering`` on ``geo``,
    after one warm-up call, on the current Keras backend."""
    return time_lowerings(geo, (lowering,), batch=batch, dtype=dtype, training=training,
                          repeats=repeats, bias=bias)[lowering]


def time_lowerings(geo: ConvGeometry, lowerings: Sequence[str], *, batch: int = 32,
                   dtype: str = "float32", training: bool = True, repeats: int = 3,
                   budget_s: Optional[float] = None, min_timed_s: float = 0.0,
                   max_rounds: int = 0, bias: bool = False,
                   drop_behind: Optional[float] = None,
                   again_if_close: bool = False,
                   start_estimates: Optional[Dict[str, float]] = None,
                   start_seconds: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Best-of-``repeats`` seconds of one forward (+ backward) pass of each of ``lowerings``
    on ``geo``, on the current Keras backend: one warm-up call each, then ``repeats`` rounds
    in which each is timed once, the order rotated every round (side by side, so that a burst
    of load on a busy machine does not fall on one candidate only), and further rounds, up to
    ``max_rounds`` in all, while some candidate has less than ``min_timed_s`` seconds of timed
    calls. With ``budget_s``, no further candidate is started once that many seconds have
    passed since the first one was compiled: the result holds the ones started (in
    ``lowerings``' order). ``bias``: each step adds a bias and differentiates it too. With
    ``drop_behind``, a candidate whose best time is more than that factor behind the fastest
    one's after a round is timed no more (its best so far is returned), and the rounds end
    when one is left. With ``again_if_close``, where ``"native"`` and the fastest other are
    within :data:`CONFIRM_BELOW` of each other after that, the two get as many rounds again,
    warm (nothing traced or compiled again), and the best of all rounds counts: a race of
    three rounds just after the compilation can rank a clear winner behind (CaffeNet conv4,
    TF, 16 images, 2-core AMD EPYC: ``"native"`` kept, 96 ms against F(2x2)'s 101, where ten
    interleaved rounds of the warm steps take 76 and 54). With ``budget_s``, a second
    Winograd (one after another was started) is not started, and no candidate after it, where
    the time spent and its expected start overrun the budget (:func:`_start_estimate`:
    ``start_estimates``, seconds a lowering's start took before, :func:`expected_start_s`,
    or else the first Winograd's start in this race); ``start_seconds``, when given, receives
    the seconds each started candidate's start took (make, compile, first call)."""
    import concurrent.futures
    # A layer may be built while TF traces a function (its graph and paused gradient tapes are
    # thread-local): time on a fresh thread, which starts in plain eager mode.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_time_lowerings, geo, tuple(lowerings), batch, dtype, training,
                           repeats, budget_s, min_timed_s, max_rounds, bias,
                           drop_behind, again_if_close, start_estimates,
                           start_seconds).result()


def _time_lowerings(geo, lowerings, batch, dtype, training, repeats, budget_s,
                    min_timed_s=0.0, max_rounds=0, bias=False,
                    drop_behind=None, again_if_close=False, estimates=None,
                    started=None) -> Dict[str, float]:
    estimates = estimates or {}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, geo.in_h, geo.in_w, geo.channels), dtype=np.float32)
    k = (rng.standard_normal((geo.kh, geo.kw, geo.cg, geo.filters), dtype=np.float32) * 0.1)
    steps, start = {}, None
    took = {} if started is None else started  # each started candidate's start, seconds
    for low in lowerings:
        if start is not None and budget_s is not None:
            spent = time.perf_counter() - start
            if spent >= budget_s or (_second_winograd(low, steps) and
                                     spent + _start_estimate(low, estimates, took) > budget_s):
                break
        t0 = time.perf_counter()
        steps[low] = make_step(geo, low, x, k, training=training, dtype=dtype, bias=bias)
        steps[low]()  # warm-up: compile, first-touch memory
        took[low] = time.perf_counter() - t0
        # The first candidate's compilation is what the layer costs without keras_cct too (a
        # model with keras Conv2D compiles its convolution): the budget counts from there.
        start = time.perf_counter() if start is None else start
    best = interleaved_best(steps, repeats, min_timed_s=min_timed_s, max_rounds=max_rounds,
                            drop_behind=drop_behind)
    if again_if_close and _close_race(best):
        rival = _rival(best)
        again = interleaved_best({c: steps[c] for c in ("native", rival)}, repeats,
                                 min_timed_s=min_timed_s, max_rounds=max_rounds)
        best.update({c: min(best[c], t) for c, t in again.items()})
    return best
