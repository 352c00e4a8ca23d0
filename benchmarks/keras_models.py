"""Keras' own models, hybridized: what a Keras user gets from ``keras_cct.hybridize(model)``.

``python -m benchmarks.keras_models [--quick] [--models resnet50,mobilenet_v2,vgg16]
[--backends tensorflow,jax,torch] [--dtypes float32,bfloat16] [--batch N] [--size S]
[--rounds N] [--out DIR]``

The per-layer benchmark (:mod:`benchmarks.convs`) times the convolutions of Caffe nets, whose
padding is always symmetric. Models written in Keras pad ``"same"``, which at a stride on an even
size pads one more row and column at the bottom and right (MobileNet v2's and EfficientNet's
strided layers), and put BatchNormalization, activations and additions of their own between the
convolutions. Here each ``keras.applications`` model (``weights=None``: nothing downloaded;
``include_top=False`` with average pooling and a 1000-way Dense, so any input size works) is
timed as built (every ``Conv2D`` Keras' own) against ``keras_cct.hybridize`` of it (every
``Conv2D``, ``DepthwiseConv2D`` and ``SeparableConv2D`` made HybridConv2D layers with the
defaults as shipped, the same weights); a second copy of the
Keras model is timed as a control (the two Keras copies run the same ops: how far apart they
land is the noise of the run).

One process per backend and dtype (``mixed_bfloat16`` for bfloat16), a fresh keras_cct cache
folder for each, so the first use includes HybridConv2D's planning as a new user meets it.
Each model: ``train_on_batch`` on one random batch (SGD, sparse categorical cross-entropy; the
loss fetched, so the forward is included), ``model.compile``'s defaults (on TensorFlow no XLA on
a CPU, on JAX ``jax.jit``). First use, timed: ``predict_on_batch`` (HybridConv2D plans its
shapes at its first call; the hybridized model's predictions are checked against the Keras
model's) and the first ``train_on_batch`` (tracing, compiling). Then ``--rounds`` interleaved
rounds (each round in a shuffled order, each timed step after an untimed one); the best round
in images per second.

Writes ``keras_models.json``, ``keras_models.md`` and ``keras_models.png`` under ``--out``
(default ``docs/benchmarks/``).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List

import numpy as np

from benchmarks.common import (DEFAULT_OUT, cpu_info, library_versions, machine_line,
                               markdown_table, spawn_config, write_results)

#: name -> keras.applications constructor name
MODELS = {"resnet50": "ResNet50", "mobilenet_v2": "MobileNetV2", "vgg16": "VGG16",
          "efficientnet_b0": "EfficientNetB0", "densenet121": "DenseNet121",
          "xception": "Xception", "inception_v3": "InceptionV3"}
DEFAULT_MODELS = ("resnet50", "mobilenet_v2", "vgg16")
CANDIDATES = ("keras", "hybrid", "keras_again")
#: a model small enough for the tests (``--models tiny``): "same" padding at strides on even
#: sizes, a grouped layer, BatchNormalization
TINY = "tiny"


def build(name: str, size: int):
    """The Keras model ``name`` (a :data:`MODELS` key, or :data:`TINY`) on ``size`` x ``size``
    x 3 images, 1000 classes, not compiled."""
    import keras
    if name == TINY:
        inp = keras.Input((size, size, 3))
        h = keras.layers.Conv2D(8, 3, strides=2, padding="same")(inp)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
        h = keras.layers.Conv2D(16, 3, strides=2, padding="same", groups=2)(h)
        h = keras.layers.Conv2D(16, 1, padding="same", activation="relu")(h)
        out = keras.layers.Dense(1000)(keras.layers.GlobalAveragePooling2D()(h))
        return keras.Model(inp, out, name="tiny")
    base = getattr(keras.applications, MODELS[name])(
        weights=None, include_top=False, input_shape=(size, size, 3), pooling="avg")
    return keras.Model(base.input, keras.layers.Dense(1000)(base.output), name=name)


def _compiled(model):
    import keras
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run_config(spec: dict) -> dict:
    """One process: ``spec`` = ``{"models", "dtype", "batch", "size", "rounds"}`` on the
    backend it was started with. Per model: first-step seconds and the rounds' seconds of each
    candidate, the predictions' agreement and HybridConv2D's picks."""
    import keras

    from keras_cct import HybridConv2D, hybridize
    policy = "mixed_bfloat16" if spec["dtype"] == "bfloat16" else "float32"
    rng = np.random.default_rng(0)
    batch, size = int(spec["batch"]), int(spec["size"])
    x = rng.standard_normal((batch, size, size, 3), dtype=np.float32)
    y = rng.integers(0, 1000, batch)
    out = []
    for name in spec["models"]:
        keras.utils.set_random_seed(0)
        # set for each model: keras.backend.clear_session() below resets the global policy
        # (until 2026-12-05 every model after a process's first ran in float32 here)
        keras.mixed_precision.set_global_policy(policy)
        base = build(name, size)
        models = {"keras": base, "hybrid": hybridize(base),
                  "keras_again": keras.models.clone_model(base)}
        models["keras_again"].set_weights(base.get_weights())
        first, steps, preds = {}, {}, {}
        for kind, model in models.items():
            # first use: a prediction (HybridConv2D plans its shapes at its first call) and
            # the first training step (tracing, compiling)
            t0 = time.perf_counter()
            preds[kind] = np.asarray(model.predict_on_batch(x), np.float64)
            _compiled(model)
            model.train_on_batch(x, y)
            first[kind] = time.perf_counter() - t0
            steps[kind] = lambda m=model: float(np.asarray(m.train_on_batch(x, y)).reshape(-1)[0])
        times: Dict[str, List[float]] = {k: [] for k in steps}
        for rnd in range(int(spec["rounds"])):
            order = list(steps)
            random.Random(rnd).shuffle(order)
            for kind in order:
                steps[kind]()  # untimed: the previous candidate's state is gone
                t0 = time.perf_counter()
                steps[kind]()
                times[kind].append(time.perf_counter() - t0)
            print(f"PROGRESS {name} {rnd + 1}", flush=True)
        want = preds["keras"]
        agree = float(np.linalg.norm(preds["hybrid"] - want) / max(np.linalg.norm(want), 1e-30))
        convs = [layer for layer in models["hybrid"]._flatten_layers()  # nested: separable
                 if isinstance(layer, HybridConv2D)]
        picks = Counter(layer.chosen_lowering for layer in convs)
        out.append({"model": name, "first_s": first, "seconds": times,
                    "images_per_s": {k: batch / min(v) for k, v in times.items()},
                    "median_images_per_s": {k: batch / float(np.median(v))
                                            for k, v in times.items()},
                    "convs": len(convs), "picks": dict(picks), "predict_rel_err": agree,
                    "compute_dtypes": sorted({layer.compute_dtype for layer in convs})})
        del models, base
        keras.backend.clear_session()
    return {"results": out, "backend": keras.backend.backend(), "dtype": spec["dtype"]}


# ------------------------------------------------------------------------------ the report

def _ratio(r: dict, kind: str) -> float:
    return r["images_per_s"][kind] / r["images_per_s"]["keras"]


def markdown(data: dict) -> str:
    lines = ["# Keras' own models, hybridized", "",
             f"Command: `{data['command']}` ({data['when']}, {data['seconds']:.0f} s).", "",
             machine_line(data["machine"]), "",
             f"`keras.applications` models (`weights=None`, `include_top=False`, average "
             f"pooling, Dense(1000)) at batch {data['batch']}, {data['size']}x{data['size']}: "
             "images/s of `train_on_batch` (SGD), best of "
             f"{data['rounds']} interleaved rounds, against the same Keras model "
             "(`keras_cct.hybridize` keeps its weights). *Keras again*: a second copy of the "
             "Keras model, the run's noise. First use: seconds of the first `predict_on_batch` "
             "and the first `train_on_batch` (tracing, compiling; for HybridConv2D its "
             "planning too, from an empty cache).", ""]
    rows = []
    for run in data["runs"]:
        for r in run["results"]:
            ips = r["images_per_s"]
            rows.append([run["backend"], run["dtype"], r["model"], round(ips["keras"], 2),
                         round(ips["hybrid"], 2), round(_ratio(r, "hybrid"), 3),
                         round(_ratio(r, "keras_again"), 3), round(r["first_s"]["keras"], 1),
                         round(r["first_s"]["hybrid"], 1), r["convs"],
                         ", ".join(f"{k} {v}" for k, v in sorted(r["picks"].items())),
                         f"{r['predict_rel_err']:.1e}"])
    lines.append(markdown_table(
        ["backend", "dtype", "model", "Keras img/s", "hybridized img/s", "hybridized / Keras",
         "Keras again / Keras", "Keras first use s", "hybridized first use s",
         "HybridConv2D layers",
         "HybridConv2D picks", "predictions rel. diff."], rows))
    for fail in data["failures"]:
        lines.append(f"- failed: {fail['backend']} {fail['dtype']}: {fail['error']}")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels, hyb, twin = [], [], []
    for run in data["runs"]:
        for r in run["results"]:
            labels.append(f"{r['model']}\n{run['backend']} {run['dtype']}")
            hyb.append(_ratio(r, "hybrid"))
            twin.append(_ratio(r, "keras_again"))
    fig, ax = plt.subplots(figsize=(max(6, 1.15 * len(labels) + 2), 4.2))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, hyb, 0.4, label="hybridized / Keras")
    ax.bar(x + 0.2, twin, 0.4, label="Keras again / Keras (noise)", color="0.7")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("training step speed vs the Keras model")
    ax.set_title(f"keras.applications, hybridized ({data['machine']['cpu']['model']})",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.keras_models",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="MobileNet v2 only, batch 4 at 96x96, 2 rounds, TensorFlow")
    parser.add_argument("--models", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--backends", help="default tensorflow,jax,torch")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, help="default 8 (--quick 4)")
    parser.add_argument("--size", type=int, help="image size, default 160 (--quick 96)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; --quick 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    from tqdm import tqdm
    models = [m.strip() for m in (args.models or (
        "mobilenet_v2" if args.quick else ",".join(DEFAULT_MODELS))).split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS and m != TINY]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(MODELS)}")
    backends = [b.strip() for b in (args.backends or (
        "tensorflow" if args.quick else "tensorflow,jax,torch")).split(",") if b.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            raise SystemExit(f"unknown dtype {d!r} (float32, bfloat16)")
    batch = args.batch or (4 if args.quick else 8)
    size = args.size or (96 if args.quick else 160)
    rounds = args.rounds or (2 if args.quick else 5)
    t0 = time.perf_counter()
    runs, failures = [], []
    total = len(backends) * len(dtypes) * len(models) * rounds
    with tqdm(total=total, desc="keras_models", unit="round") as bar:
        for backend in backends:
            for dtype in dtypes:
                bar.set_postfix_str(f"{backend} {dtype}")
                spec = {"models": models, "dtype": dtype, "batch": batch, "size": size,
                        "rounds": rounds}
                with tempfile.TemporaryDirectory(prefix="cct_keras_models_") as cache:
                    try:
                        runs.append(spawn_config(
                            "benchmarks.keras_models", spec, backend=backend, timeout=3600,
                            env={"KERAS_CCT_CACHE_DIR": cache},
                            on_line=lambda ln: ln.startswith("PROGRESS") and bar.update(1)))
                    except RuntimeError as exc:
                        failures.append({"backend": backend, "dtype": dtype,
                                         "error": str(exc)})
    command = "python -m benchmarks.keras_models" + (" " + " ".join(
        argv if argv is not None else sys.argv[1:])).rstrip()
    data = {"command": command, "when": time.strftime("%Y-%m-%d %H:%M %Z"),
            "seconds": time.perf_counter() - t0, "batch": batch, "size": size, "rounds": rounds,
            "machine": {"cpu": cpu_info(), "versions": library_versions()},
            "runs": runs, "failures": failures}
    md = markdown(data)
    write_results(args.out, "keras_models", data, md)
    if runs:
        plot(data, args.out / "keras_models.png")
    print(md)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
