"""Benchmark of the lowerings (CcT's RQ2), in float32 and bfloat16.

1. CaffeNet's five convolutions at batch 32: forward and forward+backward time of every lowering
   the layer can use (Type 1/2/3, ``"native"``, Winograd F(2x2) and F(4x4), space-to-depth),
   ``keras.layers.Conv2D(groups=g)``'s own op (the peer a Keras user runs) and Type 1 with
   autodiff's gradient, interleaved; the picks of the three planner modes (``"auto"``, what
   HybridConv2D does by default, ``"measure"`` and the cost model ``"model"``); the machine's
   square-GEMM ceiling in the same dtype (the backend's library and PyTorch's,
   :class:`Ceiling`). A direct-flop rate above the ceiling (a Winograd lowering's: the rate of
   the products it runs) is a measuring error, listed and left out of the ratios.
2. CcT's Type 1 vs Type 3 figure: a sweep of input/output channel ratio d/o from 1/32 to 32 at
   constant flops, with the cost model's pick (``choose(mode="model")``) against the fastest.
3. CcT's batch partitioning: Type 1 forward and forward+backward GFLOP/s on conv2-conv5 for a
   range of lowered bytes per partition, counted in the run's dtype (0 = the whole batch in
   one matrix), which is how :data:`keras_cct.lowering.cost.PARTITION_BYTES` was chosen, and
   the engine's own choice beside them.

A layer's *fastest lowering* (and RQ3's oracle) is the fastest one the planner may pick in the
dtype (:func:`pickable`): F(4x4) is timed in bfloat16 but not picked there, for its error.

Every forward+backward step fetches the loss with both gradients (the forward is part of the
time). bfloat16 casts the inputs and kernel (as ``mixed_bfloat16`` computes a layer).

Writes ``lowering.json``, ``lowering.md`` and ``lowering.png`` under ``docs/benchmarks/``.
Run: ``python -m benchmarks.lowering [--quick] [--dtypes float32,bfloat16] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from benchmarks.common import (DEFAULT_OUT, best_of, cpu_info, library_versions, machine_line,
                               markdown_table, winograd_share, write_results)

CAFFENET = {  # name: (input h=w, channels, filters, kernel, stride, pad, groups)
    "conv1": (227, 3, 96, 11, 4, 0, 1),
    "conv2": (27, 96, 256, 5, 1, 2, 2),
    "conv3": (13, 256, 384, 3, 1, 1, 1),
    "conv4": (13, 384, 384, 3, 1, 1, 2),
    "conv5": (13, 384, 256, 3, 1, 1, 2),
}
LOWERED = ("type1", "type2", "type3")
DTYPES = ("float32", "bfloat16")
#: The planner modes whose picks are reported ("auto" is HybridConv2D's default).
MODES = ("auto", "measure", "model")
#: Columns of the CaffeNet tables: every lowering, then the Keras peer.
COLUMNS = ("type1", "type2", "type3", "native", "winograd", "winograd4", "space_to_depth",
           "keras_conv2d")


def geometry(name: str, batch: int, layers=CAFFENET):
    """The :class:`~keras_cct.lowering.geometry.ConvGeometry` of layer ``name``."""
    from keras_cct.lowering import conv_geometry
    hw, c, o, k, s, p, g = layers[name]
    return conv_geometry((batch, hw, hw, c), (k, k, c // g, o), strides=s, padding=p, groups=g)


def lowerings_of(geo) -> tuple:
    """Every lowering that can compute ``geo`` (``depthwise`` aside: no CaffeNet layer is)."""
    from keras_cct.lowering.dispatch import available
    return tuple(c for c in available(geo) if c != "depthwise")


def keras_grouped_conv(x, k, geo):
    """What ``keras.layers.Conv2D(groups=g)`` runs: one grouped ``ops.conv`` (with
    ``padding="same"`` where that is the layer's padding, as a Keras user would write it)."""
    from keras import ops
    padding = geo.keras_padding
    if padding is None:
        (pt, pb), (pl, pr) = geo.pad
        x = ops.pad(x, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
        padding = "valid"
    return ops.conv(x, k, strides=(geo.sh, geo.sw), padding=padding,
                    dilation_rate=(geo.dh, geo.dw))


def type1_autodiff(x, k, geo):
    """Type 1 with the same forward ops but autodiff's gradient (not the hand-written one)."""
    from keras_cct.lowering.engine import lowered_conv2d
    return lowered_conv2d(x, k, geo, "type1", custom_gradient=False)


def _inputs(geo, batch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, geo.in_h, geo.in_w, geo.channels)).astype("float32")
    k = (rng.standard_normal((geo.kh, geo.kw, geo.cg, geo.filters)) * 0.05).astype("float32")
    return x, k


def _cast(dtype: str) -> Optional[str]:
    return None if dtype == "float32" else dtype


def time_conv(geo, how, batch, training, repeats, dtype: str = "float32"):
    from keras_cct.lowering.timing import make_step
    x, k = _inputs(geo, batch)
    return best_of(make_step(geo, how, x, k, training=training, dtype=_cast(dtype)), repeats)


def time_interleaved(geo, hows: dict, batch, training, repeats, dtype: str = "float32",
                     ceiling: Optional["Ceiling"] = None) -> dict:
    """Best-of-``repeats`` seconds of each candidate, timed round-robin (one call of each per
    round, in an order shuffled per round) so that a burst of load on this shared machine hits
    all candidates alike, and none always follows the same one (a step right after a large
    one ran slower: in a fixed order, CaffeNet conv3's ``"native"`` after Type 3 took 48.3 ms
    in bfloat16 against 41.3 for keras Conv2D's identical op); the ``ceiling``'s GEMMs are
    probed in every round too (the same load, as many tries)."""
    import random
    import time
    from keras_cct.lowering.timing import make_step
    x, k = _inputs(geo, batch)
    steps = {label: make_step(geo, how, x, k, training=training, dtype=_cast(dtype))
             for label, how in hows.items()}
    for step in steps.values():
        step()
    best = {label: float("inf") for label in steps}
    for rnd in range(repeats):
        if ceiling is not None:
            ceiling.probe()
        order = list(steps)
        random.Random(rnd).shuffle(order)
        for label in order:
            t0 = time.perf_counter()
            steps[label]()
            best[label] = min(best[label], time.perf_counter() - t0)
    return best


class Ceiling:
    """The machine's GEMM ceiling in a run: the best rate of the square products (512, 1024
    and 2048) in ``dtype`` of the backend's library and of PyTorch (the peer every run has:
    on an Intel Xeon with AMX its bfloat16 product ran at 1,659 GFLOP/s against TensorFlow's
    1,217, and TensorFlow's oneDNN convolutions at up to 1,572, above TensorFlow's own
    product), probed at the start and in every round of the timings, so that it gets as many
    tries under the same load as the candidates (a 2048 product alone, measured once, ran at
    40% of its rate on this 2-core VM's shared cache). ``gflops`` is keyed
    ``"<library> <n>"``."""

    SIZES = (512, 1024, 2048)

    def __init__(self, dtype: str, libraries: Optional[Sequence[str]] = None):
        import keras
        from benchmarks.convs import gemm_probe
        self.dtype = dtype
        libs = libraries or dict.fromkeys((keras.backend.backend(), "torch"))
        self._probes = {f"{lib} {n}": gemm_probe(f"{lib} {dtype} {n}")
                        for lib in libs for n in self.SIZES}
        self.gflops = dict.fromkeys(self._probes, 0.0)

    def probe(self, times: int = 1) -> None:
        for _ in range(times):
            for key, probe in self._probes.items():
                self.gflops[key] = max(self.gflops[key], probe())

    @property
    def value(self) -> float:
        return max(self.gflops.values())


def _rate(geo, label: str, seconds: float, batch: int, training: bool) -> float:
    """GFLOP/s of the products ``label`` runs (direct flops; a Winograd lowering's fewer)."""
    flops = geo.flops(batch) * (3 if training else 1)
    share = winograd_share(geo, label) if label.startswith("winograd") else 1.0
    return flops * share / seconds / 1e9


def _hows(geo, batch) -> Dict[str, object]:
    """The candidates timed on ``geo``: its lowerings whose temporaries fit in memory, the
    Keras peer and Type 1 with autodiff's gradient."""
    from keras_cct.lowering.planner import fits_in_memory
    hows: Dict[str, object] = {low: low for low in lowerings_of(geo)
                               if fits_in_memory(geo, low, batch)}
    hows["keras_conv2d"] = keras_grouped_conv
    if "type1" in hows:
        hows["type1_autodiff"] = type1_autodiff
    return hows


def _picks(geo, batch: int, dtype: str, runnable) -> Dict[str, str]:
    from keras_cct.lowering import choose_for
    return {"auto": choose_for(geo, mode="auto", dtype=dtype, batch=batch),
            # "measure" among what fits (Type 3 on conv1 needs tens of GB at batch 32)
            "measure": choose_for(geo, mode="measure", dtype=dtype, batch=batch,
                                  candidates=runnable),
            "model": choose_for(geo, mode="model", dtype=dtype, batch=batch)}


def caffenet_part(batch, repeats, progress, dtype: str = "float32",
                  ceiling: Optional[Ceiling] = None, layers=CAFFENET) -> dict:
    """Every candidate of every CaffeNet convolution (module docstring, part 1); ``layers``
    (``{name: (hw, c, o, k, s, p, g)}``) replaces CaffeNet's. Judge the rates with
    :func:`flag` once the ceiling has had all its tries."""
    results = {}
    for name in layers:
        geo = geometry(name, batch, layers)
        hows = _hows(geo, batch)
        runnable = [h for h in hows if h in lowerings_of(geo)]
        res = {"gflop": geo.flops(batch) / 1e9, "picks": _picks(geo, batch, dtype, runnable),
               "not_run": [c for c in lowerings_of(geo) if c not in hows]}
        for mode, training in (("fwd", False), ("fwd_bwd", True)):
            secs = time_interleaved(geo, hows, batch, training, repeats, dtype, ceiling)
            res[f"{mode}_ms"] = {label: 1e3 * t for label, t in secs.items()}
            res[f"{mode}_gflops"] = {label: _rate(geo, label, t, batch, training)
                                     for label, t in secs.items()}
            progress.update(len(hows))
        results[name] = res
    return {"layers": results}


def flag(part: dict, ceiling: float, dtype: str) -> dict:
    """Mark every rate of :func:`caffenet_part`'s result above ``ceiling`` as a measuring
    error and compute each layer's ratios without them; returns ``part``."""
    part["ceiling_gflops"] = ceiling
    for name, res in part["layers"].items():
        res["above_ceiling"], res["measuring_errors"] = [], []
        for mode in ("fwd", "fwd_bwd"):
            for label, rate in res[f"{mode}_gflops"].items():
                if rate > ceiling:
                    res["above_ceiling"].append(label)
                    res["measuring_errors"].append(
                        f"{name} {label} {mode}: {rate:.0f} GFLOP/s > the {dtype} GEMM "
                        f"ceiling {ceiling:.0f}")
        res.update(_ratios(res, ceiling, dtype))
    return part


def pickable(labels, dtype: str) -> List[str]:
    """The lowerings of ``labels`` the planner may pick in ``dtype``: not the ones it leaves
    out for their error there (:data:`keras_cct.lowering.planner.IMPRECISE`: F(4x4) in
    bfloat16), which a user gets only by naming them. The fastest lowering of a layer, and
    RQ3's oracle, are the fastest of these."""
    from keras_cct.lowering.planner import IMPRECISE
    return [c for c in labels if c not in IMPRECISE.get(dtype, ())]


def _ratios(res: dict, ceiling: float, dtype: str = "float32") -> dict:
    """A layer's headline ratios (forward+backward), leaving out any measuring error and the
    lowerings not picked in ``dtype`` (:func:`pickable`)."""
    bad = set(res["above_ceiling"])
    fb = {k: v for k, v in res["fwd_bwd_ms"].items() if k not in bad}
    lowerings = {k: fb[k] for k in pickable(fb, dtype)
                 if k not in ("keras_conv2d", "type1_autodiff")}
    auto = fb.get(res["picks"]["auto"])
    out = {"fastest": min(lowerings, key=lowerings.get) if lowerings else None}
    out["default_vs_keras"] = fb["keras_conv2d"] / auto if auto and "keras_conv2d" in fb \
        else None
    out["fastest_vs_default"] = lowerings[out["fastest"]] / auto if auto and lowerings \
        else None
    t1 = res["fwd_gflops"].get("type1")
    out["type1_fwd_vs_ceiling"] = t1 / ceiling if t1 and "type1" not in bad else None
    out["custom_grad_speedup"] = fb["type1_autodiff"] / fb["type1"] \
        if "type1" in fb and "type1_autodiff" in fb else None
    return out


def caffenet_markdown(part: dict, batch: int, dtype: str) -> str:
    """The CaffeNet tables of one dtype: forward+backward and forward ms, then the ratios."""
    layers = part["layers"]
    cols = [c for c in COLUMNS if any(c in r["fwd_ms"] for r in layers.values())]
    names = {"keras_conv2d": "keras Conv2D", "space_to_depth": "space-to-depth"}
    md = ""
    for mode, title in (("fwd_bwd", "forward+backward"), ("fwd", "forward")):
        rows = [[n, r["picks"]["auto"]] + [r[f"{mode}_ms"].get(c, "-") for c in cols]
                for n, r in layers.items()]
        md += (f"\n{title}, ms (`-`: the layer cannot use it, or its temporaries do not fit):"
               f"\n\n" + markdown_table(["layer", "default pick"] +
                                         [names.get(c, c) for c in cols], rows))
    rows = [[n, r["picks"]["auto"], r["picks"]["measure"], r["picks"]["model"], r["fastest"],
             _fmt(r["default_vs_keras"]), _fmt(r["fastest_vs_default"]),
             _fmt(r["type1_fwd_vs_ceiling"]), _fmt(r["custom_grad_speedup"])]
            for n, r in layers.items()]
    md += ("\nPicks and ratios (forward+backward):\n\n" + markdown_table(
        ["layer", "default (auto)", "measure", "model", "fastest lowering",
         "keras Conv2D / default", "fastest / default", "T1 fwd / ceiling",
         "T1 autodiff / custom grad"], rows))
    errors = [e for r in layers.values() for e in r["measuring_errors"]]
    md += ("\nMeasuring errors (left out of the ratios): " + "; ".join(errors) + "\n"
           if errors else f"\nNo rate above the {dtype} GEMM ceiling.\n")
    return md


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def sweep_part(batch, hw, repeats, points, progress, dtype: str = "float32"):
    from keras_cct.lowering import choose_for, conv_geometry
    rows, results = [], []
    for e in points:  # d/o = 2**e at constant d*o
        d, o = int(2 ** (7.5 + e / 2)), int(2 ** (7.5 - e / 2))
        geo = conv_geometry((batch, hw, hw, d), (3, 3, d, o), padding=1)
        times = {low: 1e3 * t for low, t in time_interleaved(
            geo, {low: low for low in LOWERED}, batch, True, repeats, dtype).items()}
        progress.update(len(LOWERED))
        best = min(times, key=times.get)
        pick = choose_for(geo, mode="model", dtype=dtype, batch=batch)
        regret = times[pick] / times[best] - 1
        results.append({"d": d, "o": o, "ratio": d / o, "ms": times, "fastest": best,
                        "model_choice": pick, "regret": regret})
        rows.append([f"{d}/{o}", times["type1"], times["type2"], times["type3"], best, pick,
                     f"{100 * regret:.0f}%"])
    within = float(np.mean([r["regret"] <= 0.10 for r in results]))
    header = ["d/o", "T1 f+b ms", "T2 f+b ms", "T3 f+b ms", "fastest", "model pick", "regret"]
    return {"points": results, "model_within_10pct": within}, markdown_table(header, rows)


PARTITION_TARGETS_MB = (0, 1, 2, 4, 8, 16, 32)


def partition_part(batch, repeats, targets, progress, dtype: str = "float32",
                   ceiling: Optional[Ceiling] = None) -> dict:
    """Type 1 on conv2-conv5 at each target of lowered bytes per partition (counted in
    ``dtype``, as the engine counts them; 0: the whole batch), and ``"default"``: what the
    engine runs unasked (:func:`keras_cct.lowering.engine.default_partitions`, JAX's cap on
    the count included)."""
    from keras_cct.lowering import conv_geometry
    from keras_cct.lowering.cost import partitions, value_bytes
    from keras_cct.lowering.engine import default_partitions, lowered_conv2d
    results = {}
    for name in ("conv2", "conv3", "conv4", "conv5"):
        hw, c, o, k, s, p, g = CAFFENET[name]
        geo = conv_geometry((batch, hw, hw, c), (k, k, c // g, o), strides=s, padding=p,
                            groups=g)
        parts = {str(mb): 1 if mb == 0 else partitions(geo, "type1", batch,
                                                        dtype_bytes=value_bytes(dtype),
                                                        target_bytes=int(mb * (1 << 20)))
                 for mb in targets}
        hows = {key: (lambda x, kk, geo_, n=n: lowered_conv2d(x, kk, geo_, "type1",
                                                               partitions=n))
                for key, n in parts.items()}
        parts["default"] = default_partitions(geo, "type1", batch, dtype)
        hows["default"] = lambda x, kk, geo_: lowered_conv2d(x, kk, geo_, "type1")
        fwd = time_interleaved(geo, hows, batch, False, repeats, dtype, ceiling)
        fb = time_interleaved(geo, hows, batch, True, repeats, dtype, ceiling)
        gf = geo.flops(batch) / 1e9
        res = {key: {"partitions": parts[key], "fwd_gflops": gf / fwd[key],
                     "fwd_bwd_gflops": 3 * gf / fb[key]} for key in parts}
        progress.update(len(hows))
        results[name] = res
    return {"targets_mb": list(targets), "layers": results}


def partition_markdown(part: dict, ceiling: float) -> str:
    """One row per layer: the engine's default, then each target."""
    keys = ["default"] + [str(mb) for mb in part["targets_mb"]]
    rows = [[name] + [_partition_cell(res[key], ceiling) for key in keys]
            for name, res in part["layers"].items()]
    names = {"default": "default (as shipped)", "0": "whole batch"}
    return markdown_table(["layer"] + [names.get(k, f"{k} MB") for k in keys], rows)


def _partition_cell(r: dict, ceiling: Optional[float]) -> str:
    """``fwd / f+b (p=n)``; a rate above the GEMM ceiling is marked as a measuring error."""
    def rate(v):
        return f"{v:.0f}" + (" (above the ceiling: a measuring error)"
                             if ceiling and v > ceiling else "")
    return f"{rate(r['fwd_gflops'])} / {rate(r['fwd_bwd_gflops'])} (p={r['partitions']})"


def plot(data, path: Path) -> None:
    """Per dtype: CaffeNet's forward+backward ms of each candidate (log scale; the default's
    pick ringed) and the d/o sweep."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = data["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(14, 4.6 * len(runs)), squeeze=False)
    for (dtype, run), (a1, a2) in zip(runs.items(), axes):
        layers = run["caffenet"]["layers"]
        names = list(layers)
        cols = [c for c in COLUMNS if any(c in r["fwd_bwd_ms"] for r in layers.values())]
        width = 0.8 / len(cols)
        for i, c in enumerate(cols):
            xs = np.arange(len(names)) + (i - (len(cols) - 1) / 2) * width
            vals = [layers[n]["fwd_bwd_ms"].get(c, np.nan) for n in names]
            a1.bar(xs, vals, width, label=c.replace("keras_conv2d", "keras Conv2D"))
            picked = [(x, v) for x, v, n in zip(xs, vals, names)
                      if layers[n]["picks"]["auto"] == c]
            if picked:
                a1.scatter(*zip(*picked), s=60, facecolors="none", edgecolors="k", zorder=3)
        a1.set_xticks(np.arange(len(names)), names)
        a1.set_ylabel(f"forward+backward ms (batch {data['batch']})")
        a1.set_yscale("log")
        a1.set_title(f"CaffeNet convolutions, {dtype} (ringed: the default's pick)")
        a1.legend(fontsize=7, ncol=2)
        pts = run["sweep"]["points"]
        ratios = [p["ratio"] for p in pts]
        for low in LOWERED:
            a2.plot(ratios, [p["ms"][low] for p in pts], marker="o", label=low)
        a2.scatter(ratios, [p["ms"][p["model_choice"]] for p in pts], s=120,
                   facecolors="none", edgecolors="k", label="cost model's pick")
        a2.set_xscale("log", base=2)
        a2.set_xlabel("input / output channels (d/o), constant flops")
        a2.set_ylabel("forward+backward ms")
        a2.set_title(f"Type 1 vs Type 3 (CcT's crossover), {dtype}")
        a2.axvline(1.0, color="grey", lw=0.5)
        a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _default_partition_mb() -> float:
    from keras_cct.lowering.cost import PARTITION_BYTES
    return PARTITION_BYTES / (1 << 20)


def _dtypes(value: str) -> List[str]:
    out = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in out if v not in DTYPES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--dtypes takes some of {DTYPES}, got {value!r}")
    return out


def run_dtype(dtype: str, batch: int, repeats: int, points, sweep_size, targets,
              progress) -> dict:
    """The three parts in one dtype; the rates judged against the GEMM ceiling probed
    throughout."""
    ceiling = Ceiling(dtype)
    ceiling.probe(3)
    caffenet = caffenet_part(batch, repeats, progress, dtype, ceiling)
    sweep, sweep_md = sweep_part(*sweep_size, repeats, points, progress, dtype)
    parts = partition_part(batch, repeats, targets, progress, dtype, ceiling)
    ceiling.probe(3)
    return {"ceiling_gflops": ceiling.value, "ceiling_by_product": ceiling.gflops,
            "caffenet": flag(caffenet, ceiling.value, dtype),
            "sweep": {"batch": sweep_size[0], "hw": sweep_size[1], **sweep},
            "partitions": parts,
            "markdown": {"sweep": sweep_md,
                         "partitions": partition_markdown(parts, ceiling.value)}}


def run_machine() -> dict:
    """What RQ2 and RQ3 record of the machine: the CPU and its units, the libraries, the
    backend."""
    import keras
    return {"cpu": cpu_info(), "versions": library_versions(),
            "backend": keras.backend.backend()}


def report_head(title: str, machine: dict, command: str) -> str:
    """A report's first lines: its title, the machine (:func:`run_machine`), the command."""
    return (f"# {title}\n\n{machine_line(machine)} Backend: {machine['backend']}.\n\n"
            f"Command: `{command}`.")


def _ceiling_line(run: dict) -> str:
    """What a run's ceiling is: the best product of each library it probed."""
    by_lib: Dict[str, float] = {}
    for key, rate in run["ceiling_by_product"].items():
        lib = key.split()[0]
        by_lib[lib] = max(by_lib.get(lib, 0.0), rate)
    libs = ", ".join(f"{lib} {rate:.0f}" for lib, rate in by_lib.items())
    return (f"GEMM ceiling (the best square product of 512, 1024 and 2048 of the backend's "
            f"library and PyTorch's, probed in every round): {run['ceiling_gflops']:.0f} "
            f"GFLOP/s ({libs}).")


def markdown(data: dict, command: str) -> str:
    batch = data["batch"]
    md = (report_head("Lowering benchmark (CcT RQ2)", data["machine"], command) +
          f" Best of {data['repeats']} interleaved rounds; every forward+backward step "
          "fetches the loss with both gradients. The default pick is `planner=\"auto\"` "
          "(HybridConv2D's default, from its cache where the shape was planned before).\n")
    for dtype, run in data["runs"].items():
        sw, md_parts = run["sweep"], run["markdown"]
        md += (f"\n## {dtype}\n\n{_ceiling_line(run)}\n\n### CaffeNet convolutions, batch "
               f"{batch}\n" +
               caffenet_markdown(run["caffenet"], batch, dtype) +
               f"\n### d/o sweep (batch {sw['batch']}, {sw['hw']}x{sw['hw']}, 3x3, constant "
               f"flops)\n\nCost model within 10% of the fastest lowered type on "
               f"{100 * sw['model_within_10pct']:.0f}% of the points.\n\n{md_parts['sweep']}\n"
               f"### Batch partitions (Type 1, batch {batch})\n\nGFLOP/s forward / "
               f"forward+backward (p = partitions) by lowered bytes per partition, counted "
               f"in the run's dtype as the engine counts them, and the engine's own choice "
               f"(default, as shipped: on JAX at most 4 partitions); the default target is "
               f"{_default_partition_mb():g} MB.\n\n{md_parts['partitions']}")
    return md


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, fewer points")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtypes", type=_dtypes, default=list(DTYPES))
    args = parser.parse_args(argv)
    from tqdm import tqdm
    batch = args.batch or (8 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 3)
    points = [-5, -3, -1, 0, 1, 3, 5] if args.quick else list(range(-5, 6))
    sweep_size = (8, 14) if args.quick else (16, 28)
    targets = (0, 2, 8) if args.quick else PARTITION_TARGETS_MB
    per_dtype = sum(2 * len(_hows(geometry(n, batch), batch)) for n in CAFFENET) + \
        len(points) * len(LOWERED) + 4 * (len(targets) + 1)
    with tqdm(total=per_dtype * len(args.dtypes), desc="lowering benchmark",
              unit="run") as progress:
        runs = {d: run_dtype(d, batch, repeats, points, sweep_size, targets, progress)
                for d in args.dtypes}
    data = {"machine": run_machine(), "batch": batch, "repeats": repeats, "runs": runs}
    command = " ".join(["python -m benchmarks.lowering"] +
                       list(sys.argv[1:] if argv is None else argv))
    md = markdown(data, command)
    write_results(args.out, "lowering", data, md)
    plot(data, args.out / "lowering.png")
    print(md)
    return data


if __name__ == "__main__":
    main()
