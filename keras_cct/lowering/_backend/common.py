"""What every backend module of :mod:`keras_cct.lowering._backend` shares."""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import keras
from keras import ops

from keras_cct.errors import PlannerCacheWarning
from keras_cct.lowering.geometry import ConvGeometry

#: Set to ``0`` to leave the backends' on-disk caches of compiled XLA executables off
#: (TensorFlow's persistent XLA cache, JAX's persistent compilation cache).
XLA_CACHE_ENV = "KERAS_CCT_XLA_CACHE"


#: Megabytes the folder of compiled XLA executables (``<cache_dir>/xla``, every backend, version
#: and CPU together) may hold; ``$KERAS_CCT_XLA_CACHE_MB`` overrides (``0``: no limit).
XLA_CACHE_MB = 1024
XLA_CACHE_MB_ENV = "KERAS_CCT_XLA_CACHE_MB"


def xla_cache_folder(name: str) -> Optional[Path]:
    """``<cache_dir>/xla/<name>-<cpu fingerprint>``, made, for a backend's cache of compiled
    XLA executables (``name``: the library and its version); None where ``$KERAS_CCT_XLA_CACHE``
    is ``0`` or the folder cannot be made. One folder per CPU
    (:func:`~keras_cct._system.cpu_fingerprint`): an executable may use instructions another
    CPU lacks. The ``xla`` folder is first trimmed to :data:`XLA_CACHE_MB`
    (:func:`prune_xla_cache`): neither backend bounds its cache by default."""
    from keras_cct._files import cache_dir
    from keras_cct._system import cpu_fingerprint
    if os.environ.get(XLA_CACHE_ENV, "1") == "0":
        return None
    prune_xla_cache(cache_dir() / "xla", xla_cache_bytes())
    path = cache_dir() / "xla" / f"{name}-{cpu_fingerprint()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path


def xla_cache_bytes() -> int:
    """:data:`XLA_CACHE_MB` (or ``$KERAS_CCT_XLA_CACHE_MB``) in bytes; 0 for no limit."""
    env = os.environ.get(XLA_CACHE_MB_ENV, "").strip()
    try:
        mb = float(env) if env else XLA_CACHE_MB
    except ValueError:
        warnings.warn(f"${XLA_CACHE_MB_ENV}={env!r} is not a number of megabytes; using "
                      f"{XLA_CACHE_MB}", PlannerCacheWarning, stacklevel=2)
        mb = XLA_CACHE_MB
    return max(0, int(mb * (1 << 20)))


def prune_xla_cache(folder: Path, max_bytes: int) -> List[Path]:
    """Delete the least recently used files under ``folder`` (last read or written, as the file
    system records it) until the rest hold at most ``max_bytes``; return those deleted. Nothing
    happens with ``max_bytes`` 0 or no folder. A file another process deletes meanwhile is
    skipped; an executable deleted here is compiled again when next needed. Files of a library
    version or CPU no longer in use are the oldest, so they go first."""
    if max_bytes <= 0 or not folder.is_dir():
        return []
    files = []
    for path in folder.rglob("*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            files.append((max(st.st_atime, st.st_mtime), st.st_size, path))
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, path in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            continue
        total -= size
        removed.append(path)
    return removed

#: More groups than this (other than depthwise) use the backend's grouped convolution; up to
#: it, the backends whose grouped convolution is slow on CPUs run the split form (one
#: convolution per group).
MAX_SPLIT_GROUPS = 16


def split_groups(geo: ConvGeometry) -> bool:
    """Whether a grouped convolution runs in the split form (see :data:`MAX_SPLIT_GROUPS`)."""
    return 1 < geo.groups <= MAX_SPLIT_GROUPS and geo.cg > 1


def custom_conv(forward, backward, x, kernel, as_tensor=ops.convert_to_tensor):
    """``forward(x, kernel) -> (y, saved)`` as a differentiable op on every backend, whose
    gradient is ``backward(dy, saved) -> (dx, dkernel)`` (``keras.ops.custom_gradient``).
    Variables enter as tensors (``as_tensor``): TF's custom_gradient would otherwise insist on
    handling their gradients itself."""
    @ops.custom_gradient
    def conv(x, kernel):
        y, saved = forward(x, kernel)

        def grad(*args, upstream=None):
            dy = upstream if upstream is not None else args[0]
            return backward(dy, saved)

        return y, grad

    return conv(as_tensor(x), as_tensor(kernel))


def in_float32(fn: Callable) -> Callable:
    """``fn`` with 16-bit float inputs (tensors or lists of them; their floats all of one
    dtype) computed in float32 and its float results cast back; other dtypes (an integer
    index) pass through both ways. XLA's CPU loops convert a 16-bit float element by element
    for every operation, so one conversion each way is cheaper (the backends' ``fused``)."""
    def run(*args):
        dtypes = {keras.backend.standardize_dtype(t.dtype) for t in keras.tree.flatten(args)}
        low = dtypes & {"bfloat16", "float16"}
        if not low:
            return fn(*args)
        dtype = low.pop()

        def cast(t, source, target):
            same = keras.backend.standardize_dtype(t.dtype) == source
            return ops.cast(t, target) if same else t

        out = fn(*keras.tree.map_structure(lambda t: cast(t, dtype, "float32"), args))
        return keras.tree.map_structure(lambda t: cast(t, "float32", dtype), out)

    return run


#: A batch partition (:func:`partition_size`) may hold from half to this many times the images
#: it aims at, so that every partition has one size.
PARTITION_SLACK = 1.5
#: Fixed-point scale of :func:`partition_key` (integers: the TensorFlow loop computes the same).
PARTITION_KEY_SCALE = 1 << 16


def partition_key(size: int, images: int) -> int:
    """How far ``size`` images are from ``images``, as a ratio either way (``max(size /
    images, images / size)``, scaled by :data:`PARTITION_KEY_SCALE`, floored): integers, so
    that :func:`partition_size` and TensorFlow's form of it rank sizes alike."""
    scale = PARTITION_KEY_SCALE
    return max((images * scale) // size, (size * scale) // images)


def partition_bounds(images: int) -> Tuple[int, int]:
    """Partition sizes (lowest, highest) :func:`partition_size` considers for ``images``."""
    images = max(1, int(images))
    return max(1, images // 2), max(images, int(images * PARTITION_SLACK))


def partition_size(n: int, images: int) -> int:
    """Images per batch partition for a batch of ``n`` aiming at ``images``: of the divisors of
    ``n`` from half of ``images`` to :data:`PARTITION_SLACK` times it, the nearest to
    ``images`` by ratio (:func:`partition_key`; on a tie, the smaller), so that every
    partition has one size: on TensorFlow each size is compiled (XLA's clusters; the planner's
    race compiles the same one) and a padded partition costs a copy. Where there is none,
    ``ceil(n / ceil(n / images))``: near-equal partitions, the last one smaller (padded in
    TensorFlow's loop). CaffeNet conv4 (13 images aimed at), forward+backward ms on TensorFlow,
    2-core AMD EPYC: batch 32, partitions of 8 / 13 (13, 13, 6) / 16: 141 / 147 / 125; batch
    128: 567 / 540 / 504; conv3 at 128 (16 aimed at) by 8 / 16 / 32: 617 / 534 / 647."""
    lo, hi = partition_bounds(images)
    images = max(1, int(images))
    fits = [d for d in range(lo, min(hi, n) + 1) if n % d == 0]
    if fits:
        return min(fits, key=lambda d: (partition_key(d, images), d))
    return -(-n // max(1, -(-n // images))) if n > 0 else 1


def batch_bounds(x, parts: int, unit: int = 1) -> List:
    """Start offsets (``parts + 1`` of them) along axis 0 of ``x`` that cut its ``n = len(x) /
    unit`` blocks of ``unit`` rows into ``parts`` contiguous, near-equal partitions (Python ints
    when the size is static, scalar tensors otherwise; an empty partition when ``n < parts``)."""
    n = x.shape[0]
    if n is None:
        n = ops.shape(x)[0]
    n = n // unit
    return [(n * i) // parts * unit for i in range(parts + 1)]
