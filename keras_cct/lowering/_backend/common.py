"""What every backend module of :mod:`keras_cct.lowering._backend` shares."""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path
from typing import Callable, List, Optional

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
    """``fn`` with 16-bit float inputs (tensors or lists of them, all one dtype) computed in
    float32 and the results cast back; other dtypes pass through. XLA's CPU loops convert a
    16-bit float element by element for every operation, so one conversion each way is
    cheaper (the backends' ``fused``)."""
    def run(*args):
        dtype = keras.backend.standardize_dtype(keras.tree.flatten(args)[0].dtype)
        if dtype not in ("bfloat16", "float16"):
            return fn(*args)
        out = fn(*keras.tree.map_structure(lambda t: ops.cast(t, "float32"), args))
        return keras.tree.map_structure(lambda t: ops.cast(t, dtype), out)

    return run


def batch_bounds(x, parts: int, unit: int = 1) -> List:
    """Start offsets (``parts + 1`` of them) along axis 0 of ``x`` that cut its ``n = len(x) /
    unit`` blocks of ``unit`` rows into ``parts`` contiguous, near-equal partitions (Python ints
    when the size is static, scalar tensors otherwise; an empty partition when ``n < parts``)."""
    n = x.shape[0]
    if n is None:
        n = ops.shape(x)[0]
    n = n // unit
    return [(n * i) // parts * unit for i in range(parts + 1)]
