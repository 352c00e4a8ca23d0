"""Facts about this machine that several packages need (no keras_cct imports)."""

from __future__ import annotations

import os
from typing import Optional


def physical_memory() -> Optional[int]:
    """Bytes of physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
