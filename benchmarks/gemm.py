"""The matrix products under the convolutions: TensorFlow's against PyTorch's, on the same CPU.

``python -m benchmarks.gemm [--quick] [--threads all,1] [--dtypes float32,bfloat16]
[--rounds N] [--out DIR]``

A convolution lowered to one GEMM (CcT's Type 1) or run by oneDNN's direct kernels can go no
faster than the library's own matrix product. TensorFlow and PyTorch each ship their own oneDNN
(a different version), and both run its ``brg_matmul`` primitive (on a CPU with AMX, its AMX
kernels) for these products; this benchmark measures what each delivers on:

* ``square``: a 2048-cubed product (the GEMM ceiling ``benchmarks.convs`` checks rates against);
* ``conv2`` ... ``conv5``: the forward GEMM each of CaffeNet's grouped 3x3 / 5x5 layers lowers to
  at batch 32, one group (M = images x output pixels, K = kernel x input channels of a group,
  N = output channels of a group).

For each number of threads (``all``: every core this process may use; ``1``), one fresh
process (TensorFlow fixes its thread pools at start-up) runs both libraries, interleaved: per
round each product once in each library, in a shuffled order, each timed call after an untimed
one. Best of the rounds, in GFLOP/s. ``ONEDNN_VERBOSE=1`` in one more process records which
oneDNN implementation each library runs for each dtype, and the oneDNN versions.

Writes ``gemm.json``, ``gemm.md`` and ``gemm.png`` under ``--out`` (default
``docs/benchmarks/``).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.common import (DEFAULT_OUT, ROOT, cpu_info, library_versions, machine_line,
                               markdown_table,
                               onednn_versions, peak_gflops, spawn_config, write_results)

#: name -> (M, K, N): the products timed (see the module docstring).
SHAPES = {"square": (2048, 2048, 2048),
          "conv2": (32 * 27 * 27, 5 * 5 * 48, 128),
          "conv3": (32 * 13 * 13, 3 * 3 * 256, 384),
          "conv4": (32 * 13 * 13, 3 * 3 * 192, 192),
          "conv5": (32 * 13 * 13, 3 * 3 * 192, 128)}
QUICK_SHAPES = {"small": (256, 256, 256)}
LIBRARIES = ("tensorflow", "torch")


def _steps(shapes: Dict[str, tuple], dtype: str):
    """name -> no-argument callable computing that product in that library (done when it
    returns: TensorFlow's result is fetched, PyTorch on the CPU is synchronous)."""
    import numpy as np
    import tensorflow as tf
    import torch
    rng = np.random.default_rng(0)
    steps = {}
    for name, (m, k, n) in shapes.items():
        a_np = rng.standard_normal((m, k)).astype("float32")
        b_np = rng.standard_normal((k, n)).astype("float32")
        a, b = (tf.cast(tf.constant(v), dtype) for v in (a_np, b_np))
        fn = tf.function(lambda a, b: tf.matmul(a, b))
        steps[("tensorflow", name)] = lambda fn=fn, a=a, b=b: fn(a, b).numpy()
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        ta, tb = (torch.from_numpy(v).to(tdt) for v in (a_np, b_np))
        steps[("torch", name)] = lambda ta=ta, tb=tb: torch.mm(ta, tb)
    return steps


def run_config(spec: dict) -> dict:
    """One process: ``spec["threads"]`` threads for both libraries, every shape and dtype of
    ``spec``, ``spec["rounds"]`` interleaved rounds. Returns GFLOP/s per library, shape, dtype."""
    threads = int(spec["threads"])
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    import torch
    torch.set_num_threads(threads)
    shapes = {k: tuple(v) for k, v in spec["shapes"].items()}
    out = []
    for dtype in spec["dtypes"]:
        steps = _steps(shapes, dtype)
        best = {key: float("inf") for key in steps}
        for rnd in range(int(spec["rounds"])):
            order = list(steps)
            random.Random(rnd).shuffle(order)
            for key in order:
                steps[key]()  # untimed: the library's threads are busy again
                t0 = time.perf_counter()
                steps[key]()
                best[key] = min(best[key], time.perf_counter() - t0)
            print(f"PROGRESS {dtype} {rnd + 1}", flush=True)
        for (lib, name), sec in best.items():
            m, k, n = shapes[name]
            out.append({"library": lib, "shape": name, "mkn": [m, k, n], "dtype": dtype,
                        "threads": threads, "ms": 1e3 * sec, "gflops": 2 * m * k * n / sec / 1e9})
    return {"results": out, "tf_threads": tf.config.threading.get_intra_op_parallelism_threads(),
            "torch_threads": torch.get_num_threads()}


#: What the ONEDNN_VERBOSE probe runs: one product per library and dtype.
_PROBE = """
import tensorflow as tf, torch
for dt in ("float32", "bfloat16"):
    print("LIB tensorflow", dt, flush=True)
    a = tf.cast(tf.ones((512, 512)), dt); tf.matmul(a, a).numpy()
    print("LIB torch", dt, flush=True)
    t = torch.ones(512, 512, dtype=getattr(torch, dt)); torch.mm(t, t)
"""


def implementations() -> Dict[str, Dict[str, str]]:
    """library -> dtype -> the oneDNN implementation that ran its matrix product (from
    ``ONEDNN_VERBOSE=1``: the primitive's implementation, or ``gemm_api`` for oneDNN's sgemm;
    ``"not oneDNN"`` where none printed, e.g. PyTorch's float32 product, which its BLAS runs)."""
    env = dict(os.environ, ONEDNN_VERBOSE="1", TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    found: Dict[str, Dict[str, str]] = {}
    lib = dtype = None
    for line in run.stdout.splitlines():
        if line.startswith("LIB "):
            lib, dtype = line.split()[1:]
            found.setdefault(lib, {})[dtype] = "not oneDNN"
        elif lib and ",exec,cpu," in line:
            m = re.search(r",exec,cpu,(matmul|gemm_api|inner_product),([^,]*),", line)
            if m:
                found[lib][dtype] = m.group(2) or m.group(1)  # gemm_api names none
    return found


def markdown(data: dict) -> str:
    v = data["machine"]["onednn"]
    lines = ["# Matrix products: TensorFlow against PyTorch", "",
             f"Command: `{data['command']}` ({data['when']}); best of {data['rounds']} "
             "interleaved rounds in one process per thread count, each timed call after an "
             "untimed one.", "",
             machine_line(data["machine"]) + " oneDNN: "
             + ", ".join(f"{k} {x}" for k, x in sorted(v.items())) + ". Implementation run "
             "(ONEDNN_VERBOSE): "
             + "; ".join(f"{lib} {dt} `{impl}`" for lib, per in sorted(data["implementations"]
                                                                    .items())
                         for dt, impl in sorted(per.items())) + ".", "",
             "GFLOP/s (M x K x N; CaffeNet's layers: one group's forward GEMM at batch 32):", ""]
    rows = []
    by = {(r["library"], r["shape"], r["dtype"], r["threads"]): r for r in data["results"]}
    for threads in data["threads"]:
        for dtype in data["dtypes"]:
            for shape, mkn in data["shapes"].items():
                tf_, th = by.get(("tensorflow", shape, dtype, threads)), by.get(
                    ("torch", shape, dtype, threads))
                if not (tf_ and th):
                    continue
                rows.append([threads, dtype, shape, "x".join(map(str, mkn)),
                             round(tf_["gflops"]), round(th["gflops"]),
                             round(tf_["gflops"] / th["gflops"], 2)])
    lines.append(markdown_table(["threads", "dtype", "product", "M x K x N", "TensorFlow",
                                 "PyTorch", "TensorFlow / PyTorch"], rows))
    peak = data.get("peak_gflops") or {}
    if peak:
        lines += ["", "The CPU's peak by its units and clock (all usable cores): "
                  + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items()) + "."]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    panels = [(t, d) for t in data["threads"] for d in data["dtypes"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    by = {(r["library"], r["shape"], r["dtype"], r["threads"]): r["gflops"]
          for r in data["results"]}
    shapes = list(data["shapes"])
    x = np.arange(len(shapes))
    for ax, (threads, dtype) in zip(axes[0], panels):
        for i, lib in enumerate(LIBRARIES):
            ax.bar(x + (i - 0.5) * 0.4, [by.get((lib, s, dtype, threads), 0) for s in shapes],
                   0.4, label={"tensorflow": "TensorFlow", "torch": "PyTorch"}[lib])
        ax.set_xticks(x, shapes)
        ax.set_title(f"{dtype}, {threads} thread{'s' if threads != 1 else ''}")
        ax.set_ylabel("GFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"Matrix products, {data['machine']['cpu']['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemm", description=__doc__
                                     .split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small product, 2 rounds")
    parser.add_argument("--threads", default="all,1",
                        help="thread counts, comma-separated; 'all' = every usable core")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 10; --quick 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    from tqdm import tqdm
    cpu = cpu_info()
    threads = [cpu["usable_cores"] if t.strip() == "all" else int(t)
               for t in args.threads.split(",") if t.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            raise SystemExit(f"unknown dtype {d!r} (float32, bfloat16)")
    rounds = args.rounds or (2 if args.quick else 10)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    results = []
    with tqdm(total=len(threads) * len(dtypes) * rounds + 1, desc="gemm", unit="round") as bar:
        for t in threads:
            bar.set_postfix_str(f"{t} threads")
            run = spawn_config("benchmarks.gemm", {"threads": t, "dtypes": dtypes,
                                                   "rounds": rounds, "shapes": shapes},
                               on_line=lambda ln: ln.startswith("PROGRESS") and bar.update(1))
            results += run["results"]
        bar.set_postfix_str("ONEDNN_VERBOSE")
        impls = implementations()
        bar.update(1)
    command = "python -m benchmarks.gemm" + (" " + " ".join(
        argv if argv is not None else sys.argv[1:])).rstrip()
    data = {"command": command, "when": time.strftime("%Y-%m-%d %H:%M %Z"), "rounds": rounds,
            "threads": threads, "dtypes": dtypes,
            "shapes": {k: list(v) for k, v in shapes.items()},
            "machine": {"cpu": cpu, "versions": library_versions(), "onednn": onednn_versions()},
            "implementations": impls,
            "peak_gflops": {d: peak_gflops(d, cpu)["gflops"] for d in dtypes},
            "results": results}
    md = markdown(data)
    write_results(args.out, "gemm", data, md)
    plot(data, args.out / "gemm.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
