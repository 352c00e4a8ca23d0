"""Helpers shared by the benchmarks: timing, machine description, writing results."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from keras_cct.lowering.timing import best_of  # noqa: F401 -- the benchmarks' timer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "benchmarks"


def layer_train_step(layer):
    """A ``tf.function`` of one forward+backward pass of ``layer`` (gradients of
    ``sum(y * y)`` with respect to the input and the weights), returning a scalar so that
    ``step(x).numpy()`` waits for all of it."""
    import tensorflow as tf

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(y * y)
        g = tape.gradient(loss, [x] + layer.trainable_weights)
        return sum(tf.reduce_sum(t[..., :1]) for t in g)

    return step


def spawn_config(module: str, spec: dict, *, env: Optional[Dict[str, str]] = None,
                 timeout: float = 1200) -> dict:
    """``module.run_config(spec)`` in a fresh Python process (TensorFlow fixes its thread pools
    at start-up, so each configuration needs its own), on the TensorFlow backend."""
    import subprocess
    import sys
    full_env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3",
                    **(env or {}))
    code = (f"import json,sys; from {module} import run_config; "
            "print('RESULT' + json.dumps(run_config(json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[6:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"{module} configuration {spec} failed (exit code {proc.returncode}): "
                       f"{tail[0][:300]}")


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
