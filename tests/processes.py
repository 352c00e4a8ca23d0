"""Process helpers shared by the device and strategy tests."""

from __future__ import annotations

import os


def gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (a killed worker that was also reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
