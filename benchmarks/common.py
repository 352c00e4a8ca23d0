"""Helpers shared by the benchmarks: timing, machine description, writing results."""

from __future__ import annotations

import functools
import json
import os
import platform
import random
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from keras_cct.lowering.timing import best_of  # noqa: F401 -- the benchmarks' timer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "benchmarks"


def spawn_config(module: str, spec: dict, *, env: Optional[Dict[str, str]] = None,
                 timeout: float = 1200, backend: str = "tensorflow",
                 on_line: Optional[Callable[[str], None]] = None,
                 log_path: Optional[Path] = None, entry: str = "run_config") -> dict:
    """``module.run_config(spec)`` (or ``module.<entry>(spec)``) in a fresh Python process
    (TensorFlow fixes its thread pools at start-up, and ``KERAS_BACKEND`` must be set before
    keras is imported, so each configuration needs its own), on the Keras ``backend`` (default
    TensorFlow).

    ``on_line`` is called with each line the process prints (other than the result), as it
    prints it (a progress bar); its standard error goes to ``log_path`` when given.
    """
    import subprocess
    import sys
    import tempfile
    import time
    full_env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3",
                    **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    code = (f"import json,sys; from {module} import {entry} as run; "
            "print('RESULT' + json.dumps(run(json.loads(sys.argv[1]))), flush=True)")
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        err = open(log_path, "w+")
    else:
        err = tempfile.TemporaryFile("w+")
    result, lines = None, []
    deadline = time.monotonic() + timeout
    with err:
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT,
                                env=full_env, stdout=subprocess.PIPE, stderr=err, text=True)
        timer = None
        try:
            import threading
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("RESULT"):
                    result = json.loads(line[6:])
                else:
                    lines.append(line)
                    if on_line is not None:
                        on_line(line)
            proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if result is not None:
            return result
        err.seek(0)
        text = (err.read().strip() or "\n".join(lines).strip()).splitlines()
        tail = [ln for ln in text if "Error" in ln][-1:] or text[-1:] or ["no output"]
    why = "timed out" if time.monotonic() >= deadline else f"exit code {proc.returncode}"
    raise RuntimeError(f"{module} configuration {spec if len(str(spec)) < 300 else '...'} "
                       f"failed ({why}): {tail[0][:300]}")


# ------------------------------------------------------------------------------ the machine

#: /proc/cpuinfo flags naming the vector and matrix units that matter for GEMM and convolution.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8", "amx_fp16", "asimd", "sve", "sve2", "bf16", "sme")


def cpu_info() -> Dict[str, object]:
    """The CPU's model name, logical cores (and those this process may use), and which vector
    / matrix units it has, from ``/proc/cpuinfo``."""
    from keras_cct._system import cpu_flags, cpu_name
    flags = cpu_flags()
    have = [f for f in ISA_FLAGS if f in flags]
    if "amx_bf16" in flags:
        matrix = "AMX-BF16" + (" + AMX-FP16" if "amx_fp16" in flags else "")
    elif "sme" in flags:
        matrix = "SME"
    else:
        matrix = "none"
    if "avx512f" in flags:
        vector = "AVX-512" + (" + AVX512-BF16" if "avx512_bf16" in flags else "") + \
            (" + AVX512-FP16" if "avx512_fp16" in flags else "")
    elif "avx2" in flags:
        vector = "AVX2" + (" + FMA" if "fma" in flags else "")
    elif "asimd" in flags:
        vector = "NEON" + (" + SVE" if "sve" in flags else "")
    else:
        vector = "unknown"
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"model": cpu_name(), "logical_cores": os.cpu_count(), "usable_cores": usable,
            "vector_units": vector, "matrix_units": matrix, "isa_flags": have,
            "machine": platform.machine()}


def peak_gflops(dtype: str = "float32", cpu: Optional[dict] = None) -> Dict[str, float]:
    """An upper bound of this CPU's arithmetic rate (GFLOP/s on the usable cores): flops per
    cycle per core from its vector / matrix units (AVX-512: two 512-bit FMA pipes, 64 float32
    flops; AVX512-BF16 doubles that for bfloat16; AMX-BF16: 1024 bfloat16 flops) times the
    highest clock (cpufreq's maximum, else twice the nominal ``cpu MHz``: no boost is higher).
    No measured rate can pass it; a benchmark that does has not measured what it thinks."""
    cpu = cpu or cpu_info()
    flags = set(cpu["isa_flags"])
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else 16
    if dtype == "bfloat16":
        if "amx_bf16" in flags:
            per_cycle = 1024
        elif "avx512_bf16" in flags or "avx512_fp16" in flags:
            per_cycle *= 2
    mhz, source = None, "cpufreq maximum"
    try:
        mhz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e3
    except (OSError, ValueError):
        pass
    if not mhz:
        source = "2 x the nominal cpu MHz"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("cpu MHz"):
                    mhz = 2 * float(line.split(":", 1)[1])
                    break
        except (OSError, ValueError):
            pass
    mhz = mhz or 8000.0
    return {"gflops": cpu["usable_cores"] * per_cycle * mhz / 1e3, "flops_per_cycle": per_cycle,
            "mhz": mhz, "clock_from": source}


def library_versions() -> Dict[str, str]:
    """Versions of the libraries a benchmark may run (those importable; none is imported
    here that was not already, except to read ``__version__``)."""
    from importlib import metadata
    out = {"python": platform.python_version()}
    for dist in ("keras", "tensorflow", "jax", "jaxlib", "torch", "numpy", "keras_cct"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


#: What the ONEDNN_VERBOSE probe runs: one oneDNN matrix product in TensorFlow.
_TF_ONEDNN_PROBE = ("import tensorflow as tf; a = tf.ones((64, 64), tf.bfloat16); "
                    "tf.matmul(a, a).numpy()")


@functools.lru_cache(maxsize=None)
def onednn_versions() -> Dict[str, str]:
    """The oneDNN each library was built with (TensorFlow and PyTorch ship their own; the same
    primitive can run at different speeds in each: see docs/benchmarks.md). PyTorch's from its
    build configuration; TensorFlow's from what oneDNN prints in a short child process with
    ``ONEDNN_VERBOSE=1`` (it prints nothing once a process has used it). Libraries that are
    not installed, or whose version cannot be read, are left out."""
    import importlib.util
    import re
    import subprocess
    import sys
    out = {}
    if importlib.util.find_spec("torch") is not None:
        import torch
        m = re.search(r"(?:MKL-DNN|oneDNN) v(\S+)", torch.__config__.show())
        if m:
            out["torch"] = m.group(1)
    if importlib.util.find_spec("tensorflow") is not None:
        env = dict(os.environ, ONEDNN_VERBOSE="1", TF_CPP_MIN_LOG_LEVEL="3",
                   CUDA_VISIBLE_DEVICES="")
        try:
            run = subprocess.run([sys.executable, "-c", _TF_ONEDNN_PROBE], env=env,
                                 capture_output=True, text=True, timeout=300)
            m = re.search(r"oneDNN v(\S+)", run.stdout + run.stderr)
            if m:
                out["tensorflow"] = m.group(1)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return out


def matmul_step(library: str, dtype: str = "float32", n: int = 2048):
    """(step, flops): a no-argument callable computing one ``n``-cubed matrix product in
    ``library`` (``"tensorflow"``, ``"jax"`` or ``"torch"``) and ``dtype`` (``"float32"`` /
    ``"bfloat16"``), blocking until it is done, and the product's flops. Each library's
    fastest form for the dtype: on JAX a bfloat16 product accumulates in float32."""
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n)).astype("float32")
    b_np = rng.standard_normal((n, n)).astype("float32")
    if library == "tensorflow":
        import tensorflow as tf
        a, b = (tf.cast(tf.constant(v), dtype) for v in (a_np, b_np))
        fn = tf.function(lambda a, b: tf.matmul(a, b))
        step = lambda: fn(a, b)  # noqa: E731 -- eager on CPU: done when it returns
    elif library == "jax":
        import jax
        import jax.numpy as jnp
        a, b = (jnp.asarray(v, dtype=dtype) for v in (a_np, b_np))
        # a 16-bit product accumulated in float32, the form XLA hands to its library GEMM on
        # the CPU (oneDNN; keras_cct's lowerings take it): a plain bfloat16 jnp.matmul stays in
        # XLA's own loops (Intel Xeon with AMX, n = 1024: 229 GFLOP/s against 1,124)
        acc = jnp.float32 if jnp.dtype(dtype).itemsize < 4 else None
        fn = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=acc).astype(a.dtype))
        step = lambda: jax.block_until_ready(fn(a, b))  # noqa: E731
    elif library == "torch":
        import torch
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        dev = torch_device()
        a, b = (torch.from_numpy(v).to(dev, tdt) for v in (a_np, b_np))
        wait = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        step = lambda: (torch.mm(a, b), wait())  # noqa: E731
    else:
        raise ValueError(f"no matrix product for library {library!r}")
    return step, 2 * n ** 3


def torch_device():
    """Where the benchmarks run PyTorch's own work (its GEMM, the ``nn.Conv2d`` peers): the GPU
    when torch sees one (a PyTorch user's choice there; Keras' torch backend picks it too),
    else the CPU."""
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def matmul_ceiling(library: str, dtype: str = "float32", n: int = 2048,
                   repeats: int = 5) -> float:
    # (a 2048^3 product of float32 needs 48 MB: on a machine whose L3 cache is shared with
    # other tenants it can run well below the GEMM's rate at 512-1024; see benchmarks.convs)
    """GFLOP/s of the best of ``repeats`` ``n``-cubed matrix products in ``library`` and
    ``dtype`` (see :func:`matmul_step`): what that library's GEMM delivers on this machine, the
    ceiling no convolution's direct-flop rate should exceed."""
    step, flop = matmul_step(library, dtype, n)
    return flop / best_of(step, repeats) / 1e9


def winograd_share(geo, lowering: str) -> float:
    """Multiplications of a Winograd lowering's GEMMs over the direct convolution's, for a
    :class:`~keras_cct.lowering.geometry.ConvGeometry`: F(m x m, r x r) does (m + r - 1)^2
    products per tile and pair of channels, the direct convolution r^2 m^2. A Winograd rate in
    direct flops times this is the rate of the products it runs (what a GEMM ceiling bounds)."""
    from keras_cct.lowering.dispatch import WINOGRAD_TILE
    m = WINOGRAD_TILE[lowering]
    tiles = -(-geo.out_h // m) * -(-geo.out_w // m)
    return (m + geo.kh - 1) ** 2 * tiles / (geo.kh ** 2 * geo.out_h * geo.out_w)


def machine() -> Dict[str, object]:
    """What the numbers were measured on."""
    import keras
    from keras_cct._system import cpu_name
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
            "keras": keras.__version__, "backend": keras.backend.backend()}
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        info["tensorflow"] = tf.__version__
    return info


def library_of(name: str, backend: str) -> str:
    """The library candidate ``name`` runs in: PyTorch for the ``torch_*`` peers, else the
    process' Keras backend."""
    return "torch" if name.startswith("torch_") else backend


def round_order(names: List[str], rnd: int, backend: str) -> List[str]:
    """The order of round ``rnd``: each library's candidates together (the backend's first in
    even rounds, PyTorch's first in odd ones), shuffled within a library (seeded by the round),
    so that no candidate always follows the same one: the first step after the other library
    ran is slow (its threads were idle; see ``benchmarks.convs.SWITCH_WARM_CALLS``), and a
    fixed order would always charge it to the same candidates."""
    rng = random.Random(rnd)
    blocks: Dict[str, List[str]] = {}
    for name in names:
        blocks.setdefault(library_of(name, backend), []).append(name)
    libs = sorted(blocks, key=lambda lib: (lib == backend) == bool(rnd % 2))
    order = []
    for lib in libs:
        block = list(blocks[lib])
        rng.shuffle(block)
        order += block
    return order


def machine_line(machine: dict) -> str:
    """The report's line naming the machine: ``machine["cpu"]`` (:func:`cpu_info`) and, where
    recorded, ``machine["versions"]`` (:func:`library_versions`)."""
    cpu = machine["cpu"]
    line = (f"Machine: **{cpu['model']}**, {cpu['logical_cores']} logical cores "
            f"({cpu['usable_cores']} usable), vector units: {cpu['vector_units']}, matrix "
            f"units: {cpu['matrix_units']}.")
    if machine.get("versions"):
        line += " Libraries: " + ", ".join(f"{k} {v}" for k, v in machine["versions"].items()) \
            + "."
    return line


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
