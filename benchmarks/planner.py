"""Benchmark of the planner (CcT's RQ3): the lowering it chooses against the fastest one,
in float32 and bfloat16.

1. Per layer: for CaffeNet's five convolutions, the forward+backward time of every lowering the
   layer can use (Type 1/2/3, ``"native"``, Winograd F(2x2) and F(4x4), space-to-depth), the
   picks of the three planner modes -- ``"auto"`` (HybridConv2D's default: times a shortlist
   once, cached), ``"measure"`` (times every lowering once, cached) and ``"model"`` (the cost
   model, instant; it ranks only the three lowered types) -- and each pick's *regret*:
   ``time(pick) / time(fastest) - 1``. The times are taken from ``lowering.json`` in the
   output folder when :mod:`benchmarks.lowering` has just written it for the same batch and
   dtype (as ``python -m benchmarks`` does), otherwise measured here the same way.
2. The d/o sweep of :mod:`benchmarks.lowering` (when present): share of points where the cost
   model is within 10% of the fastest lowered type, mean and worst regret.
3. End to end: one training step (``train_on_batch``) of a CaffeNet-shaped model built from
   ``HybridConv2D`` layers: the defaults, ``planner="model"``, the per-layer picks of
   ``"measure"`` and the *oracle* (each layer on its fastest lowering from part 1) and, unless
   ``--quick``, every layer forced to one lowering. bfloat16 runs under ``mixed_bfloat16``.

Writes ``planner.json``, ``planner.md`` and ``planner.png`` under ``docs/benchmarks/``.
Run: ``python -m benchmarks.planner [--quick] [--dtypes float32,bfloat16] [--out DIR]
[--batch B]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from benchmarks.common import DEFAULT_OUT, markdown_table, write_results
from benchmarks.lowering import (CAFFENET, COLUMNS, DTYPES, LOWERED, MODES, _dtypes, _picks,
                                 geometry, lowerings_of, pickable, report_head, run_machine,
                                 time_conv, time_interleaved)

#: Every lowering a CaffeNet layer may get, in the tables' order.
CANDIDATES = tuple(c for c in COLUMNS if c != "keras_conv2d")
CCT_PUBLISHED = ("CcT chooses by the ratio of input to output channels: Type 1 when d < o, "
                 "Type 3 when d > o (crossover at d/o about 1); it publishes no regret figure")


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (TF's carry whole tracebacks), shortened."""
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else ""


def _geometry(name: str, batch: int, layers=CAFFENET):
    return geometry(name, batch, layers)


def feasible(geo, batch: int) -> Dict[str, Optional[str]]:
    """Per lowering of ``geo``: ``None`` if it runs, else why it is skipped: the project's own
    memory guard (:func:`keras_cct.lowering.planner.fits_in_memory`, the one the planner and
    benchmarks.lowering apply), so a lowering is skipped here exactly where keras_cct would
    not try it. Type 3 on CaffeNet's conv1 needs tens of GB at batch 32 and would get the
    process killed rather than raise."""
    from keras_cct.lowering.planner import (fits_in_memory, memory_budget_bytes,
                                            memory_needed_bytes)
    out: Dict[str, Optional[str]] = {}
    for c in lowerings_of(geo):
        if fits_in_memory(geo, c, batch):
            out[c] = None
            continue
        need = memory_needed_bytes(geo, c, batch)
        out[c] = (f"skipped: needs about {need / 1e9:.1f} GB of temporaries "
                  f"({memory_budget_bytes() / 1e9:.1f} GB budget, keras_cct's "
                  "memory guard: $KERAS_CCT_MEMORY_BUDGET)")
    return out


def _finite(v) -> Optional[float]:
    """``v`` as a float, or None for a missing / NaN / infinite time."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) and v > 0 else None


def _from_lowering_json(out: Path, batch: int, dtype: str, errors: list):
    """Forward+backward ms per layer and lowering from ``lowering.json``, or None when it is
    missing, foreign or of another batch or dtype. A lowering it did not run, or whose rate
    it flagged as a measuring error, is None."""
    try:
        data = json.loads((out / "lowering.json").read_text())
        if data.get("batch") != batch or dtype not in data.get("runs", {}):
            return None
        layers = data["runs"][dtype]["caffenet"]["layers"]
        times, missing = {}, []
        for n in CAFFENET:
            ms, bad = layers[n]["fwd_bwd_ms"], set(layers[n].get("above_ceiling", ()))
            times[n] = {c: None if c in bad else _finite(ms.get(c))
                        for c in lowerings_of(_geometry(n, batch))}
            missing += [f"{n} {c}: " + ("a measuring error in benchmarks.lowering"
                                        if c in bad else "not run by benchmarks.lowering")
                        for c, v in times[n].items() if v is None]
        errors.extend(missing)  # (a file that breaks halfway adds none)
        return times
    except (OSError, ValueError, KeyError, TypeError):
        return None


def layer_times(batch: int, repeats: int, out: Path, layers=CAFFENET, progress=None,
                errors: Optional[list] = None, dtype: str = "float32"
                ) -> Dict[str, Dict[str, Optional[float]]]:
    """Forward+backward ms of each lowering on each layer, from ``lowering.json`` if it holds
    this batch and dtype, else measured (interleaved). A lowering that fails is ``None`` (its
    error is appended to ``errors``)."""
    errors = [] if errors is None else errors
    if layers is CAFFENET:
        cached = _from_lowering_json(out, batch, dtype, errors)
        if cached is not None:
            if progress is not None:
                progress.update(sum(len(t) for t in cached.values()))
            return cached
    times = {}
    for name in layers:
        geo = _geometry(name, batch, layers)
        skip = feasible(geo, batch)
        times[name] = dict.fromkeys(skip)
        errors.extend(f"{name} {c}: {why}" for c, why in skip.items() if why)
        runnable = {c: c for c, why in skip.items() if not why}
        try:
            secs = time_interleaved(geo, runnable, batch, True, repeats, dtype)
        except Exception:  # noqa: BLE001 - find the failing one: each alone
            secs = {}
            for c in runnable:
                try:
                    secs[c] = time_conv(geo, c, batch, True, repeats, dtype)
                except Exception as exc:  # noqa: BLE001 - a failing lowering is a result too
                    errors.append(f"{name} {c}: {type(exc).__name__}: {_first_line(exc)}")
        times[name].update({c: 1e3 * t for c, t in secs.items()})
        if progress is not None:
            progress.update(len(skip))
    return times


def _regret(t: Dict[str, Optional[float]], pick: Optional[str], among) -> Optional[float]:
    ok = [c for c in among if t.get(c) is not None]
    if not ok or pick is None or t.get(pick) is None:
        return None
    return t[pick] / min(t[c] for c in ok) - 1


def per_layer(batch: int, times: Dict[str, Dict[str, Optional[float]]], layers=CAFFENET,
              errors: Optional[list] = None, dtype: str = "float32") -> dict:
    """Picks of the three planner modes and their regrets, per layer (``None`` where the pick
    or its time is missing)."""
    errors = [] if errors is None else errors
    out = {}
    for name in layers:
        geo = _geometry(name, batch, layers)
        t = times[name]
        ok = pickable([c for c in t if t[c] is not None], dtype)
        res = {"ms": t, "fastest": min(ok, key=t.get) if ok else None}
        try:
            picks = _picks(geo, batch, dtype, [c for c, why in feasible(geo, batch).items()
                                               if not why])
        except Exception as exc:  # noqa: BLE001
            picks = dict.fromkeys(MODES)
            errors.append(f"{name} picks: {type(exc).__name__}: {_first_line(exc)}")
        for mode in MODES:
            res[f"{mode}_choice"] = picks[mode]
            res[f"{mode}_regret"] = _regret(t, picks[mode], ok)
        # the cost model only ranks the three lowered types: its regret among them too
        res["model_regret_lowered"] = _regret(t, res["model_choice"], LOWERED)
        out[name] = res
    return out


def sweep_summary(out: Path, dtype: str = "float32") -> Optional[dict]:
    """Regret of the cost model on the d/o sweep of ``lowering.json``, if present."""
    try:
        pts = json.loads((out / "lowering.json").read_text())["runs"][dtype]["sweep"]["points"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    regrets = [p["regret"] for p in pts]
    return {"points": len(pts), "within_10pct": float(np.mean([r <= 0.10 for r in regrets])),
            "mean_regret": float(np.mean(regrets)), "max_regret": float(np.max(regrets))}


def caffenet_model(lowerings, planner: str = "auto", hw: int = 227, fc: int = 4096):
    """CaffeNet's layer shapes (LRN left out) with HybridConv2D convolutions.

    ``lowerings`` is one lowering for every conv layer, or a dict ``{conv name: lowering}``.
    """
    import keras
    from keras_cct import HybridConv2D
    if isinstance(lowerings, str):
        lowerings = {n: lowerings for n in CAFFENET}
    inp = keras.Input((hw, hw, 3))
    h = inp
    for name, (_, c, o, k, s, p, g) in CAFFENET.items():
        h = HybridConv2D(o, k, strides=s, padding=p, groups=g, activation="relu",
                         lowering=lowerings[name], planner=planner, name=name)(h)
        if name in ("conv1", "conv2", "conv5"):
            h = keras.layers.MaxPooling2D(3, 2)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(fc, activation="relu", name="fc6")(h)
    h = keras.layers.Dense(fc, activation="relu", name="fc7")(h)
    model = keras.Model(inp, keras.layers.Dense(1000, name="fc8")(h))
    model.compile(keras.optimizers.SGD(0.001, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _batch(batch: int, hw: int):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch, hw, hw, 3)).astype("float32"),
            rng.integers(0, 1000, batch))


def end_to_end(batch: int, repeats: int, oracle: Dict[str, str],
               measured: Dict[str, str], fixed=(), hw: int = 227, fc: int = 4096,
               progress=None, errors: Optional[list] = None, dtype: str = "float32") -> dict:
    """Training-step seconds of the CaffeNet-shaped model per plan (``None`` for a plan that
    failed; its error is appended to ``errors``), under ``mixed_bfloat16`` for bfloat16: every
    plan's model built and warmed up (planned, traced), then timed in ``repeats`` rounds of
    one step each, in an order shuffled per round; best of the rounds.

    ``oracle`` is each layer's fastest lowering, ``measured`` the picks of
    ``choose(mode="measure")`` from :func:`per_layer` (timed among the lowerings that fit in
    memory; the layer's own ``planner="measure"`` would also time Type 3 on conv1).
    """
    import random

    import keras
    errors = [] if errors is None else errors
    plans = {"default (auto)": ("auto", "auto"), "planner (model)": ("auto", "model"),
             "planner (measure)": (measured, "model"), "oracle": (oracle, "model")}
    plans.update({f"all {f}": (f, "model") for f in fixed})
    keras.backend.clear_session()  # (it resets the policy too: set it after)
    keras.mixed_precision.set_global_policy(
        "mixed_bfloat16" if dtype == "bfloat16" else "float32")
    x, y = _batch(batch, hw)
    models, chosen = {}, {}
    for label, (lowerings, planner) in plans.items():
        chosen[label] = {}
        try:
            model = caffenet_model(lowerings, planner, hw, fc)
            model.train_on_batch(x, y)
            models[label] = model
            chosen[label] = {n: model.get_layer(n).chosen_lowering for n in CAFFENET}
        except Exception as exc:  # noqa: BLE001 - reported, the other plans still run
            errors.append(f"end to end, {label}: {type(exc).__name__}: {_first_line(exc)}")
        if progress is not None:
            progress.update(1)
    best = dict.fromkeys(models, float("inf"))
    for rnd in range(repeats):
        order = list(models)
        random.Random(rnd).shuffle(order)
        for label in order:
            t0 = time.perf_counter()
            models[label].train_on_batch(x, y)
            best[label] = min(best[label], time.perf_counter() - t0)
    keras.mixed_precision.set_global_policy("float32")
    res = {label: best.get(label) for label in plans}
    base = res.get("oracle")
    regret = {k: (v / base - 1 if v is not None and base else None) for k, v in res.items()}
    return {"step_s": res, "regret_vs_oracle": regret, "lowerings": chosen, "hw": hw, "fc": fc,
            "rounds": repeats}


def plot(data: dict, path: Path) -> None:
    """Per dtype: each lowering's time over the layer's fastest, the modes' picks marked; the
    end-to-end step per plan."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = data["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(14, 4.6 * len(runs)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(CANDIDATES)
    for (dtype, run), (a1, a2) in zip(runs.items(), axes):
        layers = run["layers"]
        names = list(layers)

        def rel(n, c, layers=layers):
            t, fastest = layers[n]["ms"], layers[n]["fastest"]
            return t[c] / t[fastest] if fastest and t.get(c) is not None else np.nan

        def x_of(j, c):
            return j + (CANDIDATES.index(c) - (len(CANDIDATES) - 1) / 2) * width

        for c in CANDIDATES:
            a1.bar([x_of(j, c) for j in range(len(names))], [rel(n, c) for n in names], width,
                   label=c)
        for mode, marker in (("auto", "o"), ("model", "v"), ("measure", "^")):
            pts = [(x_of(j, layers[n][f"{mode}_choice"]), rel(n, layers[n][f"{mode}_choice"]))
                   for j, n in enumerate(names) if layers[n][f"{mode}_choice"] is not None]
            if pts:
                a1.scatter(*zip(*pts), marker=marker, color="k", zorder=3,
                           label=f"{mode} pick" + (" (default)" if mode == "auto" else ""))
        a1.set_xticks(np.arange(len(names)), names)
        a1.set_yscale("log")
        a1.set_ylabel("time / fastest (forward+backward)")
        a1.set_title(f"Per layer, {dtype}, batch {data['batch']} (no bar: not run)")
        a1.legend(fontsize=7, ncol=2)
        e2e = run["end_to_end"]["step_s"]
        labels = list(e2e)
        a2.bar(labels, [np.nan if e2e[k] is None else e2e[k] for k in labels],
               color=[f"C{i}" for i in range(len(labels))])
        a2.set_ylabel("seconds per training step")
        a2.set_title(f"CaffeNet-shaped model, {dtype}, batch {data['end_to_end_batch']}")
        a2.tick_params(axis="x", labelrotation=25, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _num(v: Optional[float]):
    return "-" if v is None else v


def markdown(data: dict, command: str) -> str:
    md = (report_head("Planner benchmark (CcT RQ3)", data["machine"], command) +
          f" Forward+backward ms at batch {data['batch']}; regret = time(pick) / "
          "time(fastest) - 1. `auto` is HybridConv2D's default; the cost model (`model`) "
          "ranks only the three lowered types, so its regret is also given against the "
          "fastest of those.\n")
    for dtype, run in data["runs"].items():
        md += f"\n## {dtype}\n\n" + _run_markdown(run, data)
    if any(run.get("errors") for run in data["runs"].values()):
        md += "\nNot run or failed:\n\n" + "".join(
            f"- {dtype}: {e}\n" for dtype, run in data["runs"].items() for e in run["errors"])
    return md + f"\n{CCT_PUBLISHED}.\n"


def _run_markdown(run: dict, data: dict) -> str:
    rows = []
    for n, r in run["layers"].items():
        rows.append([n] + [_num(r["ms"].get(c)) for c in CANDIDATES] +
                    [r["fastest"]] + [f"{r[f'{m}_choice']} ({_pct(r[f'{m}_regret'])})"
                                      for m in MODES] + [_pct(r["model_regret_lowered"])])
    md = markdown_table(["layer"] + [f"{c} ms" for c in CANDIDATES] +
                        ["fastest", "auto (regret)", "measure (regret)", "model (regret)",
                         "model's regret among T1-T3"], rows)
    tot = run["totals"]
    if tot:
        md += (f"\nSum over the five layers: the default's (auto) picks {tot['auto_ms']:.1f} ms, "
               f"measure's {tot['measure_ms']:.1f}, model's {tot['model_ms']:.1f}, the per-layer "
               f"fastest {tot['fastest_ms']:.1f} (regret {_pct(tot['auto_regret'])}, "
               f"{_pct(tot['measure_regret'])}, {_pct(tot['model_regret'])}); the fastest of "
               f"the three lowered types {tot['fastest_lowered_ms']:.1f} ms (model's regret "
               f"among them {_pct(tot['model_regret_lowered'])}).\n")
    sw = run.get("sweep")
    if sw:
        md += (f"\nd/o sweep ({sw['points']} points, from `lowering.json`): the cost model is "
               f"within 10% of the fastest lowered type on {100 * sw['within_10pct']:.0f}% of "
               f"the points; mean regret {_pct(sw['mean_regret'])}, worst "
               f"{_pct(sw['max_regret'])}.\n")
    e2e = run["end_to_end"]
    rows = [[k, _num(v), _pct(e2e["regret_vs_oracle"][k]),
             ", ".join(f"{n}={c}" for n, c in e2e["lowerings"][k].items())]
            for k, v in e2e["step_s"].items()]
    return md + (f"\n### End to end: CaffeNet-shaped training step, batch "
                 f"{data['end_to_end_batch']}, {e2e['hw']}x{e2e['hw']} input\n\nEvery plan's "
                 f"model built and warmed up, then one step of each per round, shuffled, best "
                 f"of {e2e.get('rounds', '?')} rounds. Two plans with the same lowerings show "
                 f"the measurement's resolution.\n\n" +
                 markdown_table(["plan", "s/step", "regret vs oracle", "lowerings"], rows))


def totals(layers: dict) -> dict:
    """Summed forward+backward ms of each mode's picks against the per-layer fastest (empty
    when a pick or time is missing)."""
    try:
        fastest = sum(r["ms"][r["fastest"]] for r in layers.values())
        out = {"fastest_ms": fastest}
        for mode in MODES:
            out[f"{mode}_ms"] = sum(r["ms"][r[f"{mode}_choice"]] for r in layers.values())
            out[f"{mode}_regret"] = out[f"{mode}_ms"] / fastest - 1
        lowered = sum(min(r["ms"][c] for c in LOWERED if r["ms"].get(c) is not None)
                      for r in layers.values())
        out["fastest_lowered_ms"] = lowered
        out["model_regret_lowered"] = out["model_ms"] / lowered - 1
        return out
    except (KeyError, TypeError, ValueError):
        return {}


def run_dtype(dtype: str, batch: int, repeats: int, e2e_batch: int, fixed, out: Path,
              progress) -> dict:
    """Parts 1-3 in one dtype."""
    errors: list = []
    times = layer_times(batch, repeats, out, progress=progress, errors=errors, dtype=dtype)
    layers = per_layer(batch, times, errors=errors, dtype=dtype)
    oracle = {n: r["fastest"] or "auto" for n, r in layers.items()}
    measured = {n: r["measure_choice"] or "auto" for n, r in layers.items()}
    e2e = end_to_end(e2e_batch, max(repeats, 5), oracle, measured, fixed,
                     progress=progress, errors=errors, dtype=dtype)
    return {"layers": layers, "totals": totals(layers), "sweep": sweep_summary(out, dtype),
            "end_to_end": e2e, "errors": errors}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, no fixed plans")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch", type=int, default=None, help="per-layer batch")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtypes", type=_dtypes, default=list(DTYPES))
    args = parser.parse_args(argv)
    from tqdm import tqdm
    batch = args.batch or (8 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 3)
    e2e_batch = 4 if args.quick else batch
    fixed = () if args.quick else ("type1", "native")
    per_dtype = sum(len(lowerings_of(_geometry(n, batch))) for n in CAFFENET) + 4 + len(fixed)
    with tqdm(total=per_dtype * len(args.dtypes), desc="planner benchmark",
              unit="run") as progress:
        runs = {d: run_dtype(d, batch, repeats, e2e_batch, fixed, args.out, progress)
                for d in args.dtypes}
    data = {"machine": run_machine(), "batch": batch, "end_to_end_batch": e2e_batch, "runs": runs}
    md = markdown(data, " ".join(["python -m benchmarks.planner"] +
                                 list(sys.argv[1:] if argv is None else argv)))
    write_results(args.out, "planner", data, md)
    plot(data, args.out / "planner.png")
    print(md)
    return data


if __name__ == "__main__":
    main()
