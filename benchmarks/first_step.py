"""Benchmark: a model's first training step, process after process -- what a user waits for
before training starts. HybridConv2D plans each layer shape on its first use (a race of
candidates, :mod:`keras_cct.lowering.planner`) and caches the choice on disk; on TensorFlow
Winograd's compiled XLA clusters are cached there too. The same model with keras Conv2D is
the anchor.

The model: CaffeNet's conv3-conv5 (13x13x256 in, batch 32: its 3x3 layers, where a first use
costs most: Winograd is compiled), each with a ReLU, then global average pooling and a
Dense(10), SGD, random data. Each process builds one model, times its first
``train_on_batch`` (tracing, compiling and, for HybridConv2D, planning included) and the best
of five more (the steady step); with ``--fit``, ``model.fit`` instead, on a model whose batch
size is not fixed (Keras' ``fit`` then traces its step with an unknown batch, and HybridConv2D
runs Winograd's partitions in a loop): the first ``fit`` of one batch, then the fastest step
of a ``fit`` of five batches. HybridConv2D's processes share one cache folder, empty at the
start (``KERAS_CCT_CACHE_DIR``): the first plans, later ones read what it wrote. Each keras
Conv2D process runs right before the HybridConv2D process of the same index, with an empty
cache folder of its own and keras_cct's XLA caches off (``KERAS_CCT_XLA_CACHE=0``: JAX's
persistent compilation cache is off unless a user turns it on).
The report lists what each race of a first step cost (from the planner's cache entries):
every candidate's start (making, compiling and first calling its step), its best time, the
candidates the budget left out, a close race's confirmation and the whole plan's seconds.

With ``--later`` (which implies ``--fit``), each process then makes the calls a user makes next
at other batch sizes, each timed whole, with the plans it added: a ``fit`` of one batch and a
last partial batch of a quarter of it, a ``predict`` of :data:`PREDICT_IMAGES` images and an
``evaluate`` at half the batch (JAX and PyTorch run each new batch size as a new shape; a
HybridConv2D shape is raced again only where the race would time other images).

Run::

    python -m benchmarks.first_step [--backends tensorflow,jax,torch] [--dtypes float32,bfloat16]
        [--processes 4] [--batch 32] [--fit] [--later] [--out docs/benchmarks] [--quick]

``--quick`` (the suite's smoke run): TensorFlow, float32, two processes at batch 8.

Writes ``first_step.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from benchmarks.common import (DEFAULT_OUT, cpu_info, library_versions, machine_line,
                               markdown_table, spawn_config, write_results)

KINDS = ("keras_conv2d", "hybrid")
LAYERS = (("conv3", 384, 1), ("conv4", 384, 2), ("conv5", 256, 2))  # name, filters, groups
INPUT = (13, 13, 256)
STEADY_STEPS = 5
#: ``--later``: the calls after the first steps (see the module docstring), in order.
LATER = ("partial_fit", "predict", "evaluate")
PREDICT_IMAGES = 4


# ------------------------------------------------------------------------------ one process

def build(kind: str, batch: Optional[int]):
    """CaffeNet conv3-conv5 with keras Conv2D or HybridConv2D, compiled for training (``batch``
    None: a model whose batch size is not fixed)."""
    import keras
    from keras_cct import HybridConv2D
    conv = HybridConv2D if kind == "hybrid" else keras.layers.Conv2D
    layers = [keras.Input(INPUT, batch_size=batch)]
    layers += [conv(filters, 3, padding="same", groups=groups, activation="relu", name=name)
               for name, filters, groups in LAYERS]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _plan_entries() -> Dict[str, dict]:
    """The planner's cache entries in this process' cache folder, in the order planned."""
    import json
    from keras_cct._files import cache_dir
    path = cache_dir() / "planner.json"
    return json.loads(path.read_text()).get("entries", {}) if path.exists() else {}


def _cache_files() -> Dict[str, int]:
    """Planner entries and XLA executables in this process' cache folder."""
    from keras_cct._files import cache_dir
    root = cache_dir()
    xla = sum(1 for p in (root / "xla").rglob("*") if p.is_file()) if (root / "xla").exists() \
        else 0
    return {"plans": len(_plan_entries()), "xla_executables": xla}


def _plan_summary(entry: dict) -> dict:
    """What one race of the planner cost (a cache entry of ``mode="auto"``): the images it
    timed, each candidate's start (make, compile, first call) and best time, the candidates the
    budget left out, the images a close race was confirmed at, the whole plan's seconds and
    the pick."""
    start = entry.get("start", {}).get("seconds", {})
    return {"images": entry.get("batch"), "starts_s": start,
            "timed_ms": {c: s * 1e3 for c, s in entry.get("seconds", {}).items()},
            "not_started": entry.get("not_timed", []),
            "confirm_images": entry.get("confirm_batch"),
            "plan_s": entry.get("plan_seconds"), "pick": entry.get("choice")}


def _step_timer(seconds: List[float]):
    """A Keras callback appending the seconds of each training step of a ``fit`` to
    ``seconds``."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            seconds.append(time.perf_counter() - self.t0)
    return StepTimer()


def _steps(model, x, y, fit: bool):
    """The first training step's seconds and the fastest of :data:`STEADY_STEPS` more, and the
    last loss: ``train_on_batch`` calls, or with ``fit`` a ``model.fit`` of one batch and one
    of :data:`STEADY_STEPS` batches (timed per step by a callback)."""
    batch = len(x)
    t0 = time.perf_counter()
    if not fit:
        model.train_on_batch(x, y)
        first = time.perf_counter() - t0
        steady = float("inf")
        for _ in range(STEADY_STEPS):
            t0 = time.perf_counter()
            loss = model.train_on_batch(x, y)
            steady = min(steady, time.perf_counter() - t0)
        return first, steady, loss
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    first = time.perf_counter() - t0
    seconds: List[float] = []
    xs, ys = np.concatenate([x] * STEADY_STEPS), np.concatenate([y] * STEADY_STEPS)
    hist = model.fit(xs, ys, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                     callbacks=[_step_timer(seconds)])
    return first, min(seconds), hist.history["loss"][-1]


def _later(model, x, y) -> Dict[str, dict]:
    """:data:`LATER`'s calls on ``x``/``y`` (one batch): seconds of each whole call, and the
    plans each added to the cache."""
    batch = len(x)
    part = max(1, batch // 4)
    calls = {"partial_fit": lambda: model.fit(np.concatenate([x, x[:part]]),
                                              np.concatenate([y, y[:part]]), batch_size=batch,
                                              epochs=1, verbose=0, shuffle=False),
             "predict": lambda: model.predict(x[:PREDICT_IMAGES], verbose=0),
             "evaluate": lambda: model.evaluate(x, y, batch_size=max(1, batch // 2),
                                                verbose=0)}
    out = {}
    for name in LATER:
        before = _cache_files()["plans"]
        t0 = time.perf_counter()
        calls[name]()
        out[name] = {"s": time.perf_counter() - t0,
                     "new_plans": _cache_files()["plans"] - before}
    return out


def run_config(spec: dict) -> dict:
    """One process: ``spec`` = ``{"kind", "batch", "dtype", "fit", "later"}``; the first step's
    and the steady step's seconds (with ``later``, :func:`_later`'s calls after them), and for
    HybridConv2D its picks and the cache's growth."""
    import keras
    if spec["dtype"] == "bfloat16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((spec["batch"],) + INPUT, dtype=np.float32)
    y = rng.integers(0, 10, spec["batch"])
    before, known = _cache_files(), set(_plan_entries())
    fit = bool(spec.get("fit"))
    model = build(spec["kind"], None if fit else spec["batch"])
    first, steady, loss = _steps(model, x, y, fit)
    after, plans = _cache_files(), _plan_entries()
    out = {"kind": spec["kind"], "first_s": first, "steady_s": steady,
           "loss": float(np.asarray(loss).reshape(-1)[0])}
    if spec.get("later"):
        out["later"] = _later(model, x, y)
    if spec["kind"] == "hybrid":
        out["picks"] = [model.get_layer(name).chosen_lowering for name, _, _ in LAYERS]
        out["new_plans"] = after["plans"] - before["plans"]
        out["new_xla_executables"] = after["xla_executables"] - before["xla_executables"]
        out["plans"] = [_plan_summary(e) for k, e in plans.items() if k not in known]
    return out


# ------------------------------------------------------------------------------ the report

def render(data: dict) -> str:
    lines = ["# First training step, process after process: HybridConv2D vs keras Conv2D", "",
             f"Command: `{data['command']}` ({data['when']}, {data['seconds']:.0f} s).", "",
             machine_line(data["machine"]), "",
             "Model: CaffeNet conv3-conv5 (13x13x256 in, batch "
             f"{data['batch']}), ReLU, global average pooling, Dense(10), SGD. Each row is one "
             "process: " + (
                 "its first `model.fit` of one batch, the model's batch size not fixed "
                 "(traced with an unknown batch, as `fit` traces it; tracing, compiling and "
                 "HybridConv2D's planning included), and the fastest step of a `fit` of five "
                 "batches (timed by a callback)." if data.get("fit") else
                 "its first `train_on_batch` (tracing, compiling and HybridConv2D's "
                 "planning included) and the best of five more.") +
             " HybridConv2D's processes share "
             "one cache folder, empty before process 1; each keras Conv2D process runs just "
             "before the HybridConv2D process of the same index, keras_cct's XLA caches off. "
             "new plans / new XLA "
             "executables: what the process added to that cache.", ""]
    rows = []
    for run in data["runs"]:
        for i, (k, h) in enumerate(zip(run["keras_conv2d"], run["hybrid"]), 1):
            rows.append([run["backend"], run["dtype"], i, k["first_s"], h["first_s"],
                         ", ".join(h["picks"]), h["new_plans"], h["new_xla_executables"],
                         k["steady_s"] * 1e3, h["steady_s"] * 1e3])
    lines.append(markdown_table(
        ["backend", "dtype", "process", "keras Conv2D first step s", "HybridConv2D first step s",
         "HybridConv2D picks (conv3, conv4, conv5)", "new plans", "new XLA executables",
         "keras Conv2D steady ms", "HybridConv2D steady ms"], rows))
    lines += _plans_section(data)
    if data.get("later"):
        lines += ["", "## Later calls at other batch sizes", "",
                  f"In each process after its steps (`--later`): a `fit` of one batch and a "
                  f"last partial batch of {max(1, data['batch'] // 4)}, a `predict` of "
                  f"{PREDICT_IMAGES} images, an `evaluate` at batch {max(1, data['batch'] // 2)}"
                  "; seconds of each whole call (tracing, compiling and HybridConv2D's "
                  "planning included), and the plans HybridConv2D added to the cache in it.",
                  ""]
        rows = []
        for run in data["runs"]:
            for i, (k, h) in enumerate(zip(run["keras_conv2d"], run["hybrid"]), 1):
                if "later" not in h:
                    continue
                rows.append([run["backend"], run["dtype"], i] + [
                    f"{k['later'][c]['s']:.2f} / {h['later'][c]['s']:.2f} "
                    f"({h['later'][c]['new_plans']})" for c in LATER])
        lines.append(markdown_table(
            ["backend", "dtype", "process"] + [
                f"{c.replace('_', ' ')} s: keras Conv2D / HybridConv2D (new plans)"
                for c in LATER], rows))
    for fail in data["failures"]:
        lines.append(f"- failed: {fail['backend']} {fail['dtype']} {fail['kind']} process "
                     f"{fail['process']}: {fail['error']}")
    return "\n".join(lines) + "\n"


def _plans_section(data: dict) -> List[str]:
    """The races HybridConv2D's processes ran for their first step, one row each."""
    rows = []
    for run in data["runs"]:
        for i, h in enumerate(run["hybrid"], 1):
            for n, p in enumerate(h.get("plans", []), 1):
                starts = ", ".join(f"{c} {s:.2f}" for c, s in p["starts_s"].items())
                timed = ", ".join(f"{c} {ms:.1f}" for c, ms in p["timed_ms"].items())
                rows.append([run["backend"], run["dtype"], i, n, p["images"], starts, timed,
                             ", ".join(p["not_started"]) or "-", p["confirm_images"] or "-",
                             p["plan_s"], p["pick"]])
    if not rows:
        return []
    return ["", "## The races of the first step", "",
            "Each race HybridConv2D's planner ran for a process' first step, in the order "
            "planned (one per new layer shape: conv3, conv4, conv5 where all three are new): "
            "the images it timed, each candidate's start (making its step, compiling it, the "
            "first call), each one's best time, the candidates the budget left out "
            "(`planner.AUTO_BUDGET_S`), the images a close race was timed again at, and the "
            "whole plan's seconds.", "",
            markdown_table(["backend", "dtype", "process", "race", "images", "starts s",
                            "best ms", "not started", "confirmed at", "plan s", "pick"],
                           rows)]


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = data["runs"]
    cols = max(1, min(3, len(runs)))
    rows = max(1, -(-len(runs) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.axis("off")
    for ax, run in zip(axes.flat, runs):
        n = len(run["hybrid"])
        xs = np.arange(1, n + 1)
        ax.bar(xs - 0.2, [r["first_s"] for r in run["keras_conv2d"]], 0.4,
               label="keras Conv2D")
        ax.bar(xs + 0.2, [r["first_s"] for r in run["hybrid"]], 0.4, label="HybridConv2D")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xlabel("process", fontsize=8)
        ax.set_ylabel("first training step (s)", fontsize=8)
        ax.set_title(f"{run['backend']} {run['dtype']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ the parent

def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fit", action="store_true",
                        help="train by model.fit on a model of unknown batch size")
    parser.add_argument("--later", action="store_true",
                        help="then a partial batch, a predict and an evaluate at other batch "
                             "sizes (implies --fit)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true",
                        help="TensorFlow, float32, two processes at batch 8 (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.backends, args.dtypes, args.processes, args.batch = "tensorflow", "float32", 2, 8
    args.fit = args.fit or args.later
    from tqdm import tqdm
    jobs = [(b, d) for b in args.backends.split(",") for d in args.dtypes.split(",")]
    t0 = time.perf_counter()
    runs, failures = [], []
    out = args.out.resolve()
    with tqdm(total=len(jobs) * args.processes * len(KINDS), desc="first_step",
              unit="process") as bar:
        for backend, dtype in jobs:
            shared = tempfile.mkdtemp(prefix="cct-first-step-")
            run = {"backend": backend, "dtype": dtype, "keras_conv2d": [], "hybrid": []}
            try:
                for i in range(1, args.processes + 1):
                    for kind in KINDS:
                        bar.set_postfix_str(f"{backend} {dtype} {kind} {i}")
                        own = tempfile.mkdtemp(prefix="cct-first-step-") \
                            if kind == "keras_conv2d" else shared
                        try:
                            run[kind].append(spawn_config(
                                "benchmarks.first_step",
                                {"kind": kind, "batch": args.batch, "dtype": dtype,
                                 "fit": args.fit, "later": args.later},
                                backend=backend, timeout=args.timeout,
                                env={"KERAS_CCT_CACHE_DIR": own, **(
                                    {} if kind == "hybrid" else {"KERAS_CCT_XLA_CACHE": "0"})},
                                log_path=out / "logs" / f"first_step-{backend}-{dtype}-"
                                                        f"{kind}-{i}.log"))
                        finally:
                            if own != shared:
                                shutil.rmtree(own, ignore_errors=True)
                        bar.update(1)
                runs.append(run)
            except RuntimeError as exc:
                failures.append({"backend": backend, "dtype": dtype, "kind": kind,
                                 "process": i, "error": str(exc)})
                tqdm.write(f"{backend} {dtype}: {exc}", file=sys.stderr)
                done = sum(len(run[k]) for k in KINDS)
                bar.update(args.processes * len(KINDS) - done)  # the job's remaining ones
            finally:
                shutil.rmtree(shared, ignore_errors=True)
    data = {"command": "python -m benchmarks.first_step " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "seconds": time.perf_counter() - t0, "batch": args.batch, "fit": args.fit,
            "later": args.later,
            "processes": args.processes,
            "machine": {"cpu": cpu_info(), "versions": library_versions()},
            "runs": runs, "failures": failures}
    md = render(data)
    write_results(out, "first_step", data, md)
    plot(data, out / "first_step.png")
    print(md)
    return data


if __name__ == "__main__":
    main()
