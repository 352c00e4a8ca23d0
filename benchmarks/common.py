"""Helpers shared by the benchmarks: timing, machine description, writing results."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def best_of(step: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Best wall time (seconds) of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def machine() -> Dict[str, object]:
    """What the numbers were measured on."""
    import keras
    from keras_cct.lowering.planner import _cpu_name
    info = {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
            "keras": keras.__version__, "backend": keras.backend.backend()}
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        info["tensorflow"] = tf.__version__
    return info


def markdown_table(header: Sequence[str], rows: List[Sequence[object]]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(out: Path, name: str, data: dict, markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    (out / f"{name}.md").write_text(markdown)
