"""CcT's hybrid on a GPU machine (its RQ4 with a real GPU): one CaffeNet convolution's
mini-batch split by ``CCTStrategy`` between the CPU cores and a CUDA GPU, on Keras' PyTorch
backend, against each device alone.

Configurations, all in one process, timed round-robin (forward+backward of the layer: its output
and all gradients, waited for; :func:`keras_cct.lowering.timing.layer_steps`):

* ``gpu``: ``HybridConv2D`` with no strategy (Keras computes on the GPU): what a user runs;
* ``cpu``: under ``CCTStrategy(["torch:cpu"])``: the CPU alone, all its cores;
* ``hybrid``: ``CCTStrategy(["torch:cpu", "torch:cuda:0"])`` as shipped (``split="flops"``,
  rebalancing on), timed after settling steps;
* ``cpu_<f>``: fixed splits giving the CPU the fraction ``f`` of the batch.

Reports images/s, the fractions the hybrid ended with, the hybrid against the GPU alone and
against the sum of the two devices' rates (CcT's ideal). Writes ``hybrid_gpu.json``, ``.md``,
``.png``. Run on a machine where torch sees a GPU:
``KERAS_BACKEND=torch python -m benchmarks.hybrid_gpu [--batch N] [--rounds N] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict

import numpy as np

from benchmarks.common import DEFAULT_OUT, cpu_info, library_versions, markdown_table, \
    write_results

#: CaffeNet's conv2 and conv3 (input h/w, channels; HybridConv2D arguments)
LAYERS = {"conv2": (27, 96, dict(filters=256, kernel_size=5, padding=2, groups=2)),
          "conv3": (13, 256, dict(filters=384, kernel_size=3, padding=1))}
FIXED = (0.01, 0.03, 0.1)


def _step(strategy, hw: int, channels: int, kw: dict, batch: int) -> Callable[[], None]:
    import contextlib

    import keras

    from keras_cct import HybridConv2D
    from keras_cct.lowering.timing import block, layer_steps
    with strategy.scope() if strategy else contextlib.nullcontext():
        layer = HybridConv2D(**kw)
    layer.build((batch, hw, hw, channels))
    x = keras.ops.convert_to_tensor(np.random.default_rng(0).standard_normal(
        (batch, hw, hw, channels)).astype("float32"))
    _, fb = layer_steps(layer, [x])
    return lambda: block(fb(x))


def measure(name: str, batch: int, rounds: int, settle: int,
            accelerator: str = "torch:cuda:0") -> dict:
    """The configurations on one layer and batch; ``accelerator``: the device the CPU shares
    with (an OpenCL device stands in for the GPU in the tests)."""
    from keras_cct import CCTStrategy
    hw, channels, kw = LAYERS[name]
    pair = ["torch:cpu", accelerator]
    strategies = {"gpu": None, "cpu": CCTStrategy(["torch:cpu"]),
                  "hybrid": CCTStrategy(pair, split="flops", rebalance=True)}
    strategies.update({f"cpu_{f}": CCTStrategy(pair, split=[f, 1 - f], rebalance=False)
                       for f in FIXED})
    steps: Dict[str, Callable[[], None]] = {k: _step(s, hw, channels, kw, batch)
                                            for k, s in strategies.items()}
    for _ in range(settle):  # compile, warm up, and let the hybrid's rebalancing settle
        for step in steps.values():
            step()
    best = {k: float("inf") for k in steps}
    for r in range(rounds):
        for k in list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]:
            t0 = time.perf_counter()
            steps[k]()
            best[k] = min(best[k], time.perf_counter() - t0)
    hyb = strategies["hybrid"]
    out = {"layer": name, "batch": batch,
           "images_per_s": {k: batch / v for k, v in best.items()},
           "ms": {k: 1e3 * v for k, v in best.items()},
           "flops_fractions": dict(zip(hyb.device_names, map(float, hyb.flops_fractions()))),
           "hybrid_report": [{k: r[k] for k in ("device", "fraction", "bwd_fraction", "images",
                                                "bwd_images", "last_ms", "last_bwd_ms")}
                             for r in hyb.report()]}
    ips = out["images_per_s"]
    out["hybrid_vs_gpu"] = ips["hybrid"] / ips["gpu"]
    out["hybrid_vs_sum"] = ips["hybrid"] / (ips["gpu"] + ips["cpu"])
    out["best_fixed_vs_gpu"] = max(ips[f"cpu_{f}"] for f in FIXED) / ips["gpu"]
    return out


def run_config(spec: dict) -> dict:
    """:func:`measure` in a fresh process (:func:`benchmarks.common.spawn_config`)."""
    return measure(spec["layer"], spec["batch"], spec["rounds"], spec["settle"],
                   spec.get("accelerator", "torch:cuda:0"))


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = data["results"]
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.8), squeeze=False)
    for ax, res in zip(axes[0], rows):
        names = list(res["images_per_s"])
        ax.bar(names, [res["images_per_s"][n] for n in names],
               color=["C0" if n == "gpu" else "C7" if n == "cpu" else "C2" if n == "hybrid"
                      else "C1" for n in names])
        ax.axhline(res["images_per_s"]["gpu"] + res["images_per_s"]["cpu"], color="k", ls="--",
                   lw=1, label="GPU + CPU rates (ideal)")
        ax.set_title(f"CaffeNet {res['layer']}, batch {res['batch']}, f+b")
        ax.set_ylabel("images/s")
        ax.tick_params(axis="x", labelrotation=30)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(data: dict) -> str:
    rows = []
    for res in data["results"]:
        ips, fr = res["images_per_s"], res["hybrid_report"]
        rows.append([res["layer"], res["batch"], ips["gpu"], ips["cpu"], ips["hybrid"]]
                    + [ips[f"cpu_{f}"] for f in FIXED]
                    + [", ".join(f"{r['device']} {r['fraction']:.3f}/{r['bwd_fraction']:.3f}"
                                 for r in fr),
                       res["hybrid_vs_gpu"], res["hybrid_vs_sum"]])
    header = (["layer", "batch", "GPU alone img/s", "CPU alone img/s", "hybrid (flops) img/s"]
              + [f"CPU {f:g} fixed" for f in FIXED]
              + ["hybrid fractions (fwd/bwd)", "hybrid / GPU", "hybrid / (GPU + CPU)"])
    m = data["machine"]
    return (f"# CcT's hybrid (CPU + GPU) on a GPU machine, PyTorch backend\n\n"
            f"Command: `{data['command']}` ({data['when']}). Machine: {m['gpu']}; CPU "
            f"{m['cpu']['model']} ({m['cores']} cores; vector units: "
            f"{m['cpu']['vector_units']}, matrix units: {m['cpu']['matrix_units']}). Libraries: "
            + ", ".join(f"{k} {v}" for k, v in data["versions"].items())
            + ".\n\nForward+backward of one layer (output and all gradients waited for), "
            f"best of {data['rounds']} interleaved rounds after {data['settle']} settling "
            "rounds; images/s. `hybrid`: `CCTStrategy(['torch:cpu', 'torch:cuda:0'])` with "
            "its defaults (`split=\"flops\"`, rebalancing on); `CPU f fixed`: the CPU given "
            "the fraction f of each batch, no rebalancing.\n\n"
            + markdown_table(header, rows) + "\n" + _reading(data)
            + "\n![hybrid on a GPU machine](hybrid_gpu.png)\n")


def _reading(data: dict) -> str:
    """What the table says, computed from it."""
    res = data["results"]

    def span(key):
        vals = [r[key] for r in res]
        return f"{min(vals):.2f}-{max(vals):.2f}"

    ratio = [r["images_per_s"]["gpu"] / r["images_per_s"]["cpu"] for r in res]
    flops = [r["flops_fractions"].get("torch:cpu:0", float("nan")) for r in res]
    parked = sum(1 for r in res for d in r["hybrid_report"] if d["device"] == "torch:cpu:0"
                 for k in ("fraction", "bwd_fraction") if d[k] == 0.0)
    return (f"- The GPU alone runs these layers {min(ratio):.0f}-{max(ratio):.0f}x as fast as "
            f"the CPU alone; the calibrated GEMM rates (`split=\"flops\"`) give the CPU "
            f"{100 * min(flops):.1f}% of the batch.\n"
            f"- Any fixed share for the CPU makes the step slower than the GPU alone: best "
            f"fixed split / GPU alone {span('best_fixed_vs_gpu')}.\n"
            f"- The hybrid as shipped parks the CPU (no shard once its one image takes longer "
            f"than the GPU's whole batch) in {parked} of {2 * len(res)} passes, and runs at "
            f"{span('hybrid_vs_gpu')} of the GPU alone: the split op's own cost (not timed "
            "apart; on PyTorch its backward computes the forward again). Beside a GPU like "
            "this one, train without the CPU in the strategy.\n")


def main(argv=None) -> int:
    import keras
    if keras.backend.backend() != "torch":
        print("run with KERAS_BACKEND=torch", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("torch sees no GPU: this benchmark needs one", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--settle", type=int, default=10)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT / "gpu")
    args = p.parse_args(argv)
    results = []
    for name in args.layers:
        for batch in args.batch:
            results.append(measure(name, batch, args.rounds, args.settle))
            r = results[-1]
            print(name, batch, {k: round(v, 1) for k, v in r["images_per_s"].items()},
                  flush=True)
    data = {"command": "KERAS_BACKEND=torch python -m benchmarks.hybrid_gpu "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "rounds": args.rounds, "settle": args.settle,
            "machine": {"gpu": torch.cuda.get_device_name(0), "cpu": cpu_info(),
                        "cores": os.cpu_count()},
            "versions": library_versions(), "results": results}
    write_results(args.out, "hybrid_gpu", data, markdown(data))
    plot(data, args.out / "hybrid_gpu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
