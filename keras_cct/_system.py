"""Facts about this machine that several packages need (no keras_cct imports)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path
from typing import Dict, Optional, Set


def physical_memory() -> Optional[int]:
    """Bytes of physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> Dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (empty where there is none), read once
    per process (a layer's call asks for the CPU's flags: 0.35 ms a read)."""
    fields: Dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    return _name(_cpuinfo())


def cpu_flags() -> Set[str]:
    """The CPU's instruction-set flags (``/proc/cpuinfo``'s ``flags``, ``Features`` on ARM);
    empty where the OS does not say."""
    return _flags(_cpuinfo())


def cpu_fingerprint() -> str:
    """A short digest of the CPU's name and instruction-set flags: code compiled for this CPU
    (XLA's executables) may use instructions another CPU lacks, so caches of it are kept apart
    per fingerprint (a home folder shared by machines)."""
    info = _cpuinfo()
    text = "|".join((_name(info), " ".join(sorted(_flags(info))), platform.machine()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _name(info: Dict[str, str]) -> str:
    return info.get("model name") or platform.processor() or platform.machine()


def _flags(info: Dict[str, str]) -> Set[str]:
    return set((info.get("flags") or info.get("Features") or "").split())
