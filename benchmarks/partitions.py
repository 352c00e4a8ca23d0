"""Benchmark: Winograd's batch partitions -- forward+backward time per image of a 3x3 (or, by
F(4x4, 5x5), 5x5) layer against the number of images transformed, multiplied and lifted at a
time, on each Keras backend. CcT cuts a batch into partitions so that each one's lowered
matrix is still in cache when its GEMM reads it; :func:`keras_cct.lowering.winograd.
images_per_partition` sizes Winograd's partitions the same way (the transformed data of a
partition within ``winograd.PARTITION_BYTES``). This measures that choice ("default") against
fixed partition sizes, the whole batch (one partition) included.

Each layer is ``winograd_conv2d(x, kernel, geo, tile=..., images=N)`` timed by
:func:`keras_cct.lowering.timing.make_step` (the loss, so the forward, fetched with both
gradients), every partition size of a layer interleaved in rounds, best of ``--rounds``. One
process per backend (:func:`benchmarks.common.spawn_config`).

Run::

    python -m benchmarks.partitions [--backends tensorflow,torch,jax] [--layers caffenet]
        [--batch N] [--images 8,16,32] [--rounds 5] [--out docs/benchmarks] [--quick]

``--quick`` (the suite's smoke run): TensorFlow, CaffeNet's conv5 at batch 4, 1 and 2 images,
two rounds.

Writes ``partitions.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.common import (DEFAULT_OUT, cpu_info, library_versions, machine_line,
                               markdown_table, spawn_config, write_results)

#: name: (input side, in channels, out channels, groups, kernel, padding, Winograd tile).
LAYERS = {
    "caffenet": {"conv2": (27, 96, 256, 2, 5, 2, 4), "conv3": (13, 256, 384, 1, 3, 1, 2),
                 "conv4": (13, 384, 384, 2, 3, 1, 2), "conv5": (13, 384, 256, 2, 3, 1, 2)},
    "vgg16": {"conv2_2": (112, 128, 128, 1, 3, 1, 2), "conv3_1": (56, 128, 256, 1, 3, 1, 2),
              "conv4_2": (28, 512, 512, 1, 3, 1, 2), "conv5_1": (14, 512, 512, 1, 3, 1, 2)},
    "resnet50": {"res3a_branch2b": (28, 128, 128, 1, 3, 1, 2),
                 "res5a_branch2b": (7, 512, 512, 1, 3, 1, 2)},
}
DEFAULT = "default"
#: The batch each net's layers are timed at unless ``--batch`` says otherwise (the smallest of
#: the nets chosen): the batches ``benchmarks.nets`` runs them at, CaffeNet's halved.
BATCH = {"caffenet": 64, "vgg16": 8, "resnet50": 16}


def _geometry(spec, batch: int):
    from keras_cct.lowering.geometry import conv_geometry
    side, c, o, g, k, pad, _ = spec
    return conv_geometry((batch, side, side, c), (k, k, c // g, o), padding=pad, groups=g)


def run_config(spec: dict) -> dict:
    """One backend (this process'): ``{layer: {"images": {size or "default": seconds}, ...}}``."""
    import numpy as np

    from keras_cct.lowering.timing import interleaved_best, make_step
    from keras_cct.lowering.winograd import partition_images, winograd_conv2d
    batch, out = spec["batch"], {}
    for name, layer in spec["layers"].items():
        side, c, o, g, k, pad, tile = layer
        geo = _geometry(layer, batch)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, side, side, c), dtype=np.float32)
        kernel = rng.standard_normal((k, k, c // g, o), dtype=np.float32) * 0.1
        steps = {}
        for size in [s for s in spec["images"] if s <= batch] + [DEFAULT]:
            images = None if size == DEFAULT else size

            def conv(xx, kk, gg, images=images, tile=tile):
                return winograd_conv2d(xx, kk, gg, tile=tile, images=images)
            steps[str(size)] = make_step(geo, conv, x, kernel)
            steps[str(size)]()  # warm-up: compile, first-touch memory
        times = interleaved_best(steps, spec["rounds"])
        out[name] = {"seconds": times, "default_images": partition_images(geo, tile, batch),
                     "tile": tile}
    return out


# ------------------------------------------------------------------------------ the report

def _bytes_per_image(spec) -> float:
    from keras_cct.lowering.winograd import transformed_bytes_per_image
    return transformed_bytes_per_image(_geometry(spec, 1), spec[-1])


def render(data: dict) -> str:
    lines = ["# Winograd's batch partitions: time per image by images per partition", "",
             f"Command: `{data['command']}` ({data['when']}, {data['seconds']:.0f} s).", "",
             machine_line(data["machine"]), "",
             f"Forward+backward of `winograd_conv2d` at batch {data['batch']}, float32, ms per "
             "image, best of "
             f"{data['rounds']} interleaved rounds; each column a number of images per "
             "partition (the last partition holds the rest), the whole batch being one "
             "partition; **default**: `partition_images` (its size in brackets; on JAX "
             "the whole batch), what the layers run. MB an image: the transformed data (V and "
             "M) of one image.", ""]
    sizes = [s for s in data["images"] if s <= data["batch"]]
    sizes = sizes + ([data["batch"]] if data["batch"] not in sizes else [])
    rows = []
    for run in data["runs"]:
        for name, res in run["layers"].items():
            sec = res["seconds"]
            cells = [sec[str(s)] * 1e3 / data["batch"] if str(s) in sec else "-" for s in sizes]
            best = min(v for v in sec.values())
            mb = _bytes_per_image(data["specs"][name]) / 1e6
            rows.append([run["backend"], name, f"{mb:.1f}",
                         *cells, f"{sec[DEFAULT] * 1e3 / data['batch']:.3g} "
                                 f"({res['default_images']})",
                         f"{sec[str(data['batch'])] / sec[DEFAULT]:.2f}" if str(data["batch"])
                         in sec else "-", f"{best / sec[DEFAULT]:.2f}"])
    lines.append(markdown_table(
        ["backend", "layer", "MB an image", *[f"{s} images" + (" (whole)" if s == data["batch"]
                                                               else "") for s in sizes],
         "default", "default / whole batch (speed-up)", "best / default"], rows))
    for fail in data["failures"]:
        lines.append(f"- failed: {fail['backend']}: {fail['error']}")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = data["runs"]
    fig, axes = plt.subplots(1, max(1, len(runs)), figsize=(4.6 * max(1, len(runs)), 3.4),
                             squeeze=False)
    for ax, run in zip(axes.flat, runs):
        for name, res in run["layers"].items():
            sec = res["seconds"]
            sizes = sorted(int(s) for s in sec if s != DEFAULT)
            line, = ax.plot(sizes, [sec[str(s)] * 1e3 / data["batch"] for s in sizes],
                            marker="o", label=name)
            ax.plot([res["default_images"]], [sec[DEFAULT] * 1e3 / data["batch"]], marker="*",
                    markersize=12, color=line.get_color(), linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("images per partition (star: the default)", fontsize=8)
        ax.set_ylabel("forward+backward ms per image", fontsize=8)
        ax.set_title(run["backend"], fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ the parent

def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.partitions",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="tensorflow,torch,jax")
    parser.add_argument("--layers", default="caffenet",
                        help=f"nets whose layers to time ({', '.join(LAYERS)}), or layer names")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"images per step (default: {BATCH}, the smallest of the nets')")
    parser.add_argument("--images", default="1,2,4,8,16,32",
                        help="images per partition to time (the whole batch always is)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per backend")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true",
                        help="TensorFlow, CaffeNet's conv5 at batch 4 (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.backends, args.layers, args.batch, args.images, args.rounds = \
            "tensorflow", "conv5", 4, "1,2", 2
    every = {n: s for net in LAYERS.values() for n, s in net.items()}
    specs: Dict[str, tuple] = {}
    for item in args.layers.split(","):
        if item in LAYERS:
            specs.update(LAYERS[item])
        elif item in every:
            specs[item] = every[item]
        else:
            parser.error(f"--layers: unknown net or layer {item!r}; nets: {', '.join(LAYERS)}; "
                         f"layers: {', '.join(every)}")
    if args.batch is None:
        args.batch = min(BATCH[net] for net, layers in LAYERS.items() if set(layers) & set(specs))
    images = sorted({int(v) for v in args.images.split(",")} | {args.batch})
    from tqdm import tqdm
    t0 = time.perf_counter()
    runs, failures = [], []
    out = args.out.resolve()
    backends = args.backends.split(",")
    for backend in tqdm(backends, desc="partitions", unit="backend"):
        try:
            layers = spawn_config("benchmarks.partitions",
                                  {"batch": args.batch, "images": images, "layers": specs,
                                   "rounds": args.rounds},
                                  backend=backend, timeout=args.timeout,
                                  log_path=out / "logs" / f"partitions-{backend}.log")
            runs.append({"backend": backend, "layers": layers})
        except RuntimeError as exc:
            failures.append({"backend": backend, "error": str(exc)})
            tqdm.write(f"{backend}: {exc}", file=sys.stderr)
    data = {"command": "python -m benchmarks.partitions " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "seconds": time.perf_counter() - t0, "batch": args.batch, "images": images,
            "rounds": args.rounds, "specs": specs,
            "machine": {"cpu": cpu_info(), "versions": library_versions()},
            "runs": runs, "failures": failures}
    md = render(data)
    write_results(out, "partitions", data, md)
    plot(data, out / "partitions.png")
    print(md)
    return data


if __name__ == "__main__":
    main()
