"""Draws ``docs/images/architecture.png``, the data-flow diagram of docs/architecture.md.

Run from the checkout: ``python docs/diagrams/architecture.py`` (matplotlib only; mermaid is not
available offline).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "images" / "architecture.png"

# name: (x, y, width, height, title, body, colour)
BOXES = {
    "caffe_files": (0.2, 8.6, 3.4, 1.1, "Caffe files",
                    ".prototxt  .caffemodel\nsolver  LMDB / HDF5 data", "#f2f2f2"),
    "user": (4.2, 8.6, 3.4, 1.1, "Your Keras code",
             "keras.Model with HybridConv2D\nhybridize(model, strategy)", "#f2f2f2"),
    "cli": (8.2, 8.6, 7.4, 1.1, "cct command line",
            "convert  info  train  test  time  data  export  devices  bench\n"
            "(thin wrappers over the modules below)", "#f2f2f2"),
    "caffe": (0.2, 6.5, 3.4, 1.5, "keras_cct.caffe",
              "text_format parser, weights,\nbuilder -> keras.Model,\nsolver, data layers",
              "#dbe9f6"),
    "layer": (4.2, 6.5, 3.4, 1.5, "HybridConv2D",
              "Conv2D's arguments & weights;\nplans a lowering per\ninput shape", "#dbe9f6"),
    "strategy": (8.2, 6.5, 3.4, 1.5, "CCTStrategy",
                 "shard sizes from fractions,\nrebalance by measured time,\ndrop failed devices",
                 "#dbe9f6"),
    "devices": (12.2, 4.3, 3.4, 1.5, "devices",
                "list_devices(), calibrate():\nGFLOP/s per device,\ncached on disk", "#fbe5d6"),
    "planner": (0.2, 4.3, 3.4, 1.5, "lowering.planner",
                "choose(): cost model (CcT's\nd/o rule) or measure once,\ncached on disk",
                "#e4f2e0"),
    "lowering": (4.2, 4.3, 3.4, 1.5, "lowering.conv2d",
                 "keras.ops: lower -> one GEMM\nper group -> lift; Type 1/2/3,\n"
                 "native; own gradients",
                 "#e4f2e0"),
    "ops": (8.2, 4.3, 3.4, 1.5, "ops.conv2d_on",
            "numpy_function / pure_callback /\nautograd.Function around\nthe device worker",
            "#e4f2e0"),
    "export": (12.2, 6.5, 3.4, 1.5, "export.export_onnx",
               "HybridConv2D -> one ONNX Conv;\nmodel.onnx for onnxruntime,\nTensorRT, OpenVINO...",
               "#f6e0ef"),
    "backend": (4.2, 2.1, 3.4, 1.5, "Keras backend",
                "TensorFlow (XLA too), JAX,\nPyTorch: CPU or GPU", "#fbe5d6"),
    "worker": (8.2, 2.1, 3.4, 1.5, "OpenCL worker process",
               "pyopencl kernels: im2col, SGEMM,\nlift, col2im; shared memory;\nnever imports TF",
               "#fbe5d6"),
}
# (from, to, label, (from side, to side)); sides: t(op) b(ottom) l(eft) r(ight)
ARROWS = [
    ("caffe_files", "caffe", "", "bt"), ("user", "layer", "", "bt"),
    ("caffe", "layer", "builds", "rl"), ("layer", "planner", "which lowering?", "bt"),
    ("layer", "lowering", "device=None", "bt"), ("layer", "strategy", "under scope()", "rl"),
    ("layer", "ops", "device='opencl:P:D'", "bt"), ("strategy", "lowering", "TF shards", "bt"),
    ("strategy", "ops", "OpenCL shards", "bt"), ("lowering", "backend", "", "bt"),
    ("ops", "worker", "", "bt"), ("devices", "strategy", "GFLOP/s", "lb"),
]


def _side(box, side, shift=0.0):
    x, y, w, h = BOXES[box][:4]
    return {"t": (x + w / 2 + shift, y + h), "b": (x + w / 2 + shift, y),
            "l": (x, y + h / 2), "r": (x + w, y + h / 2)}[side]


def main() -> Path:
    fig, ax = plt.subplots(figsize=(15, 8.6))
    ax.set_xlim(0, 15.8)
    ax.set_ylim(1.9, 10)
    ax.axis("off")
    for x, y, w, h, title, body, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                    fc=colour, ec="#555555", lw=1.2))
        ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=11,
                fontweight="bold", family="monospace")
        ax.text(x + w / 2, y + h - 0.55, body, ha="center", va="top", fontsize=8.6)
    shifts = {("layer", "planner"): (-1.2, 0.6), ("layer", "ops"): (1.2, -0.6),
              ("strategy", "lowering"): (-1.2, 0.6), ("devices", "strategy"): (0.0, 1.2)}
    label_at = {("layer", "ops"): 0.3, ("strategy", "lowering"): 0.75}
    for a, b, label, sides in ARROWS:
        da, db = shifts.get((a, b), (0.0, 0.0))
        p, q = _side(a, sides[0], da), _side(b, sides[1], db)
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=14, lw=1.1,
                                     color="#333333"))
        if label:
            f = label_at.get((a, b), 0.5)
            ax.text(p[0] + f * (q[0] - p[0]), p[1] + f * (q[1] - p[1]) + 0.08, label, fontsize=7.5,
                    ha="center", color="#1f4e79", style="italic",
                    bbox=dict(fc="white", ec="none", pad=0.5, alpha=0.85))
    # a model, built by keras_cct.caffe or by hand, goes to the exporter
    ax.annotate("", xy=_side("export", "t"), xytext=_side("layer", "t", 1.2),
                arrowprops=dict(arrowstyle="-|>", color="#8e3b73", lw=1.1, ls="--",
                                connectionstyle="arc3,rad=-0.06"))
    ax.text(10.4, 8.3, "the trained model", fontsize=7.5, color="#8e3b73", style="italic",
            ha="center", bbox=dict(fc="white", ec="none", pad=0.5))
    ax.set_title("keras_cct: how a convolution's data flows", fontsize=13)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(OUT, dpi=100)
    return OUT


if __name__ == "__main__":
    print(main())
