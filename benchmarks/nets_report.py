"""The report of a whole-net run (:mod:`benchmarks.nets`): from its data (each net's step
times, the per-layer profile, the machine, the command), the images per second of each
candidate, the markdown page (``nets.md``) and the plot (``nets.png``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List

import numpy as np

from benchmarks.convs_report import onednn_line

#: The profile's mark for a MAX pooling that computes the ReLU before it (the net builder
#: moves a plain ReLU into the MAX pooling that reads it: that ReLU has no row of its own).
RELU_MOVED = "+ ReLU before it"

# The run's nets and candidates the report states; :mod:`benchmarks.nets` runs them (defined
# here, not there: nets.py imports this module).

# the full run: CaffeNet at CcT's batches; VGG16 and ResNet-50 at 224x224 (their real input:
# VGG's fc6 and ResNet's 7x7 pool5 fix it) with batches that keep the whole run near 15 min on
# 2 cores (one VGG16 step at batch 8 is ~370 GFLOP).
DEFAULT_NETS = "caffenet:32,caffenet:128,vgg16:8,resnet50:16"
CANDIDATES = ("keras_cct", "keras_conv2d", "torch_nchw", "torch_cl")
LABELS = {"keras_cct": "keras_cct (HybridConv2D)", "keras_conv2d": "keras Conv2D",
          "torch_nchw": "PyTorch NCHW", "torch_cl": "PyTorch channels_last"}


def summarize(times: Dict[str, List[float]], batch: int) -> Dict[str, dict]:
    out = {}
    for k, v in times.items():
        if not v:
            continue
        out[k] = {"best_s": min(v), "median_s": statistics.median(v), "rounds": v,
                  "images_per_s": batch / min(v), "images_per_s_median": batch / statistics.median(v)}
    return out


def _fmt(v, nd=1):
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    return f"{v:.{nd}f}"


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = ["# Whole nets: one training step (forward + backward + SGD update)", "",
             f"Command: `{data['command']}` ({data['when']}); best of {data['rounds']} "
             f"interleaved rounds after one warm-up (median in nets.json), "
             f"{data.get('order', 'in a fixed order')}.", "",
             f"Machine: {m.get('cpu')} ({m.get('cores')} cores; ISA: "
             f"{', '.join(m.get('isa', [])) or 'n/a'}); TensorFlow {m.get('tensorflow')}, "
             f"Keras {m.get('keras')}, PyTorch {m.get('torch')} ({m.get('torch_threads')} "
             f"threads), keras_cct {m.get('keras_cct', '?')}, Python {m.get('python')}"
             + onednn_line(m)
             + (f"; environment: {', '.join(f'{k}={v}' for k, v in m['env'].items())}"
                if m.get("env") else "") + ".", "",
             "| net | batch | dtype | keras_cct img/s | PyTorch best img/s | keras Conv2D img/s "
             "| keras_cct / PyTorch | keras_cct / keras Conv2D | PyTorch NCHW | "
             "PyTorch channels_last |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        c = r["candidates"]

        def ips(k):
            return c[k]["images_per_s"] if k in c else None
        kc, kk = ips("keras_cct"), ips("keras_conv2d")
        tn, tc = ips("torch_nchw"), ips("torch_cl")
        tb = max([v for v in (tn, tc) if v is not None], default=None)
        lines.append(
            f"| {r['net']} | {r['batch']} | {r['dtype']} | {_fmt(kc)} | {_fmt(tb)} | "
            f"{_fmt(kk)} | {_fmt(kc / tb if kc and tb else None, 2)} | "
            f"{_fmt(kc / kk if kc and kk else None, 2)} | {_fmt(tn)} | {_fmt(tc)} |")
    for r in data["results"]:
        for k, why in r.get("failed", {}).items():
            lines.append(f"\n- {r['net']} batch {r['batch']} {r['dtype']}: {LABELS.get(k, k)} "
                         f"failed: {why}")
    lines += ["", "Candidates: keras_cct = the net as `cct time --random-data --input-shape "
              "data=N,...` builds and trains it (HybridConv2D, defaults as shipped, TensorFlow "
              "backend); keras Conv2D = the same net with `keras.layers.Conv2D` (`cct time "
              "--conv keras`); PyTorch = the same prototxt through `benchmarks/torch_net.py`, "
              "plain NCHW and channels_last (the faster is \"best\"). bfloat16: Keras "
              "`mixed_bfloat16`, PyTorch `torch.autocast('cpu', torch.bfloat16)`.",
              "", "Deploy nets (VGG16, ResNet-50) are made trainable: final Softmax -> "
              "SoftmaxWithLoss on a `label` Input, BatchNorm's `use_global_stats` dropped "
              f"(batch statistics). Full-run choice: `{DEFAULT_NETS}` at 224x224 "
              "(227 for CaffeNet), to keep a full run near 15 min on 2 cores."]
    prof = data.get("profile")
    if prof:
        lines += ["", f"## Per layer type: {prof['net']} batch {prof['batch']}, float32", "",
                  "Each layer alone at its real input shape: Keras (`cct time`'s per-layer "
                  "timers on the keras_cct net, TensorFlow) vs the PyTorch module, forward "
                  "and forward+backward, ms summed over the layers of the type (best of "
                  f"{prof['rounds']} rounds). Whole-step sums do not add up to the step time "
                  "(fusion, the update, the loss, host overheads). A pooling marked "
                  f"\"{RELU_MOVED}\" computes the ReLU that reads into it (the net builder "
                  "moves it there); that ReLU has no row, in either framework, and PyTorch's "
                  "pooling row does not include it.", "",
                  "| type | layers | Keras fwd | Keras fwd+bwd | PyTorch NCHW fwd+bwd | "
                  "PyTorch channels_last fwd+bwd | Keras / PyTorch best (fwd+bwd) |",
                  "|---|---|---|---|---|---|---|"]
        for g in sorted(prof["groups"], key=lambda g: -g["keras_fb"]):
            lines.append(f"| {g['group']} | {g['layers']} | {_fmt(g['keras_fwd'], 2)} | "
                         f"{_fmt(g['keras_fb'], 2)} | {_fmt(g['torch_nchw_fb'], 2)} | "
                         f"{_fmt(g['torch_cl_fb'], 2)} | {_fmt(g['keras_vs_torch_fb'], 2)} |")
        lines += ["", "Per layer (ms):", "",
                  "| layer | type | input (NCHW) | Keras fwd | Keras fwd+bwd | PyTorch NCHW "
                  "fwd / fwd+bwd | PyTorch CL fwd / fwd+bwd | lowering |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in prof["layers"]:
            cl = (f"{_fmt(r.get('torch_cl_fwd'), 2)} / {_fmt(r.get('torch_cl_fb'), 2)}"
                  if "torch_cl_fb" in r else "-")
            lines.append(f"| {r['layer']} | {r['type']} | {'x'.join(map(str, r['input_shape']))}"
                         f" | {_fmt(r['keras_fwd'], 2)} | {_fmt(r['keras_fb'], 2)} | "
                         f"{_fmt(r['torch_nchw_fwd'], 2)} / {_fmt(r['torch_nchw_fb'], 2)} | "
                         f"{cl} | {r.get('keras_lowering') or ''} |")
    notes = data.get("notes") or []
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = data["results"]
    if not res:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(res)), 4))
    width = 0.2
    x = np.arange(len(res))
    for i, k in enumerate(CANDIDATES):
        vals = [r["candidates"].get(k, {}).get("images_per_s", 0.0) for r in res]
        ax.bar(x + (i - 1.5) * width, vals, width, label=LABELS[k])
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['net']}\nb{r['batch']} {r['dtype'].replace('float', 'f')}"
                        for r in res], fontsize=8)
    ax.set_ylabel("images/s (training step)")
    ax.set_title("Whole-net training step: keras_cct vs Keras Conv2D vs PyTorch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
