"""The dtype a 16-bit convolution computes in on this machine.

Under ``mixed_bfloat16`` (or ``mixed_float16``) a layer's inputs and kernel are 16-bit floats.
On a CPU with 16-bit arithmetic (AVX512-BF16, AMX-BF16) the backends' 16-bit convolutions and
GEMMs run several times faster than their float32 ones. On a CPU without it they may run far
slower: on an AMD EPYC with AVX2 only, TensorFlow's bfloat16 convolution ran 8 GFLOP/s against
float32's 105-127, PyTorch's 6-11 against 132-157 (its lowerings' GEMMs 2-5; docs/lowering.md).
There a 16-bit convolution computes faster in float32: its 16-bit inputs are cast up (exactly),
the products are summed in float32 (as the 16-bit kernels sum them too) and the result is cast
back to the 16-bit dtype, so the layer's output, its dtype and its memory between layers are
unchanged.

:func:`arithmetic_dtype` says which, per backend and machine: ``$KERAS_CCT_16BIT`` set to
``"float32"`` or ``"keep"`` decides; unset (or ``"auto"``), a 16-bit dtype is kept on an
accelerator and on a CPU that has 16-bit arithmetic (:data:`FAST_FLAGS`), and elsewhere a
one-time measurement decides (:func:`measure`: the backend's own convolution and a lowered one,
forward+backward, on a small shape, in the 16-bit dtype and in float32, interleaved), cached on
disk beside the planner's choices: 16-bit arithmetic is kept unless it measures more than
:data:`SLOWER_BY` times float32's time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

from keras_cct._files import cache_dir, read_cache_entries, write_cache_entries
from keras_cct._system import cpu_fingerprint, cpu_flags, cpu_name
from keras_cct.errors import LoweringError, PlannerCacheWarning
from keras_cct.lowering import _backend as B
from keras_cct.lowering.geometry import conv_geometry
from keras_cct.lowering.timing import interleaved_best, make_step

#: The dtypes this module may compute in float32.
SIXTEEN_BIT = ("bfloat16", "float16")
#: ``$KERAS_CCT_16BIT``'s values: measure (the default), always float32, always the 16-bit dtype.
MODES = ("auto", "float32", "keep")
ENV = "KERAS_CCT_16BIT"
#: A 16-bit dtype is computed in float32 where its measured time is more than this factor of
#: float32's (a margin for a noisy machine: where the two are close, 16-bit values keep their
#: halved memory traffic).
SLOWER_BY = 1.2
#: The measured shape: 8 images of 14x14x64 into 128 channels by a 3x3 kernel (0.7 GFLOP
#: forward+backward: a few milliseconds in float32, well above the backends' per-call costs).
SHAPE = ((8, 14, 14, 64), (3, 3, 64, 128))
#: What is timed in each dtype: the backend's own convolution and a lowered one (its GEMMs).
TIMED = ("native", "type2")
ROUNDS = 3
#: CPU flags (``/proc/cpuinfo``) of units that compute the 16-bit dtype natively: with one of
#: them the dtype is kept unmeasured (a small measured shape could rank a CPU's 16-bit units
#: below their worth; on the Intel Xeon with AMX-BF16 bfloat16 GEMMs ran 4-6x float32's).
FAST_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),
              "float16": ("avx512_fp16", "amx_fp16")}
CACHE_VERSION = 1

_decided: Dict[Tuple[str, str], str] = {}


def mode() -> str:
    """``$KERAS_CCT_16BIT`` (default ``"auto"``), validated."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise LoweringError(f"${ENV}={os.environ[ENV]!r}: expected one of {MODES} (unset "
                            "means 'auto': measured once per backend and machine)")
    return value


def arithmetic_dtype(dtype: str) -> str:
    """The dtype a convolution of ``dtype`` inputs computes in here: ``dtype`` itself, or
    ``"float32"`` for a 16-bit dtype this backend and machine compute slower than float32
    (see the module docstring). The first call for a 16-bit dtype may measure (about a second,
    once per backend and machine; the result is cached)."""
    if dtype not in SIXTEEN_BIT:
        return dtype
    how = mode()
    if how != "auto":
        return "float32" if how == "float32" else dtype
    memo = (B.NAME, dtype)  # asked in a layer's call: decided once per backend and dtype
    if memo not in _decided:
        _decided[memo] = _auto_choice(dtype)
    return _decided[memo]


def _auto_choice(dtype: str) -> str:
    """``$KERAS_CCT_16BIT=auto``'s answer: the dtype on an accelerator or with
    :data:`FAST_FLAGS`, else the cached or a new measurement's."""
    if B.device_name() or cpu_flags() & set(FAST_FLAGS[dtype]):
        return dtype
    key = _key(dtype)
    entry = _read_cache().get(key)
    if not _valid(entry):
        entry = measure(dtype)
        entries = _read_cache()
        entries[key] = entry
        _write_cache(entries)
    return entry["compute"]


def measure(dtype: str) -> dict:
    """Time :data:`TIMED` forward+backward on :data:`SHAPE` in ``dtype`` and in float32, the four
    steps interleaved over :data:`ROUNDS` rounds (best of each); returns the seconds summed per
    dtype and the decision (``"compute"``)."""
    import concurrent.futures
    # Called while a layer is traced (TF's graph is thread-local): measure on a fresh thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_measure, dtype).result()


def _measure(dtype: str) -> dict:
    geo = conv_geometry(SHAPE[0], SHAPE[1], padding="same")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE[0], dtype=np.float32)
    k = rng.standard_normal(SHAPE[1], dtype=np.float32) * 0.1
    steps = {(low, dt): make_step(geo, low, x, k, dtype=dt)
             for dt in (dtype, "float32") for low in TIMED}
    for step in steps.values():
        step()  # compile, first touch
    best = interleaved_best(steps, ROUNDS)
    t16 = sum(best[(low, dtype)] for low in TIMED)
    t32 = sum(best[(low, "float32")] for low in TIMED)
    return {"seconds": {dtype: t16, "float32": t32},
            "per_step": {f"{low} {dt}": t for (low, dt), t in best.items()},
            "compute": "float32" if t16 > SLOWER_BY * t32 else dtype}


def _valid(entry) -> bool:
    return isinstance(entry, dict) and entry.get("compute") in SIXTEEN_BIT + ("float32",)


def _key(dtype: str) -> str:
    import keras
    from keras_cct._version import __version__
    device = B.device_name() or f"cpu:{cpu_name()}:{cpu_fingerprint()}:{os.cpu_count()}"
    return "|".join((__version__, keras.backend.backend(), device, dtype))


def _cache_file() -> Path:
    return cache_dir() / "precision.json"


def _read_cache() -> Dict[str, dict]:
    return read_cache_entries(_cache_file(), CACHE_VERSION, "the 16-bit arithmetic cache",
                              PlannerCacheWarning)


def _write_cache(entries: Dict[str, dict]) -> None:
    write_cache_entries(_cache_file(), CACHE_VERSION, entries, "the 16-bit arithmetic cache",
                        PlannerCacheWarning)
