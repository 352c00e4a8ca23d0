"""Benchmark of the planner (CcT's RQ3): the lowering it chooses against the fastest one.

1. Per layer: for CaffeNet's five convolutions, the forward+backward time of every lowering
   (Type 1, 2, 3 and ``"native"``), the choice of ``choose(mode="model")`` (cost model) and of
   ``choose(mode="measure")`` (timed once, cached), and each choice's *regret*:
   ``time(choice) / time(fastest) - 1``. The times are taken from ``lowering.json`` in the
   output folder when :mod:`benchmarks.lowering` has just written it for the same batch (as
   ``python -m benchmarks`` does), otherwise measured here the same way.
2. The d/o sweep of :mod:`benchmarks.lowering` (when present): share of points where the cost
   model is within 10% of the fastest lowering, mean and worst regret.
3. End to end: one training step (``train_on_batch``) of a CaffeNet-shaped model built from
   ``HybridConv2D`` layers, with every layer on the planner's choice (``planner="model"``, and
   the per-layer picks of ``mode="measure"`` from part 1) against the *oracle* (each layer
   on its fastest lowering from part 1)
   and, unless ``--quick``, against every layer forced to one lowering.

Writes ``planner.json``, ``planner.md`` and ``planner.png`` under ``docs/benchmarks/``.
Run: ``python -m benchmarks.planner [--quick] [--out DIR] [--batch B]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from benchmarks.common import DEFAULT_OUT, markdown_table, write_results
from benchmarks.lowering import CAFFENET

CANDIDATES = ("type1", "type2", "type3", "native")
CCT_PUBLISHED = ("CcT chooses by the ratio of input to output channels: Type 1 when d < o, "
                 "Type 3 when d > o (crossover at d/o about 1); it publishes no regret figure")


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (TF's carry whole tracebacks), shortened."""
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else ""


def _geometry(name: str, batch: int, layers=CAFFENET):
    from keras_cct.lowering import conv_geometry
    hw, c, o, k, s, p, g = layers[name]
    return conv_geometry((batch, hw, hw, c), (k, k, c // g, o), strides=s, padding=p, groups=g)


def available_bytes() -> int:
    """Physical memory currently free (bytes); 8 GiB when the OS does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def feasible(geo, batch: int, budget: Optional[int] = None) -> Dict[str, Optional[str]]:
    """Per candidate: ``None`` if it fits in memory, else why it is skipped.

    A lowering whose forward temporaries (cost model's ``temp_bytes``), times 3 for the
    backward pass, exceed half the free memory is not run: Type 3 on CaffeNet's conv1 needs
    about 77 GB at batch 32 and would get the process killed rather than raise.
    """
    from keras_cct.lowering import cost
    budget = budget or available_bytes() // 2
    out: Dict[str, Optional[str]] = {}
    for c in CANDIDATES:
        need = 0 if c == "native" else 3 * cost(geo, c, batch=batch).temp_bytes
        out[c] = None if need <= budget else (
            f"skipped: needs about {need / 1e9:.1f} GB of temporaries "
            f"({budget / 1e9:.1f} GB budget)")
    return out


def _finite(v) -> Optional[float]:
    """``v`` as a float, or None for a missing / NaN / infinite time."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) and v > 0 else None


def layer_times(batch: int, repeats: int, out: Path, layers=CAFFENET, progress=None,
                errors: Optional[list] = None) -> Dict[str, Dict[str, Optional[float]]]:
    """Forward+backward ms of each candidate on each layer, from ``lowering.json`` if it holds
    this batch, else measured. A candidate that fails is ``None`` (its error is appended to
    ``errors``)."""
    errors = [] if errors is None else errors
    cached = out / "lowering.json"
    if cached.exists() and layers is CAFFENET:
        try:
            data = json.loads(cached.read_text())
            if data.get("batch") == batch:
                times = {n: {c: _finite(data["caffenet"]["layers"][n].get(f"{c}_fwd_bwd_ms"))
                             for c in CANDIDATES} for n in layers}
                for n, t in times.items():
                    errors.extend(f"{n} {c}: not run by benchmarks.lowering"
                                  for c, v in t.items() if v is None)
                if progress is not None:
                    progress.update(len(layers) * len(CANDIDATES))
                return times
        except (ValueError, KeyError, TypeError):
            pass  # stale or foreign file: measure
    from benchmarks.lowering import time_conv
    times = {}
    for name in layers:
        geo = _geometry(name, batch, layers)
        times[name] = {}
        skip = feasible(geo, batch)
        for c in CANDIDATES:
            times[name][c] = None
            if skip[c]:
                errors.append(f"{name} {c}: {skip[c]}")
                continue
            try:
                times[name][c] = 1e3 * time_conv(geo, c, batch, True, repeats)
            except Exception as exc:  # noqa: BLE001 - a failing lowering is a result too
                errors.append(f"{name} {c}: {type(exc).__name__}: {_first_line(exc)}")
            if progress is not None:
                progress.update(1)
    return times


def _regret(t: Dict[str, Optional[float]], pick: Optional[str], among) -> Optional[float]:
    ok = [c for c in among if t.get(c) is not None]
    if not ok or pick is None or t.get(pick) is None:
        return None
    return t[pick] / min(t[c] for c in ok) - 1


def per_layer(batch: int, times: Dict[str, Dict[str, Optional[float]]], layers=CAFFENET,
              errors: Optional[list] = None) -> dict:
    """Choices of both planner modes and their regrets, per layer (``None`` where the choice
    or its time is missing)."""
    from keras_cct.lowering import choose_for
    errors = [] if errors is None else errors
    out = {}
    for name in layers:
        geo = _geometry(name, batch, layers)
        t = times[name]
        ok = [c for c in CANDIDATES if t.get(c) is not None]
        res = {"ms": t, "fastest": min(ok, key=t.get) if ok else None}
        skip = feasible(geo, batch)
        for mode in ("model", "measure"):
            # "model" ranks the three types as HybridConv2D does; "measure" times only what fits
            cands = None if mode == "model" else [c for c in CANDIDATES if not skip[c]]
            try:
                pick = choose_for(geo, mode=mode, batch=batch, candidates=cands)
            except Exception as exc:  # noqa: BLE001
                pick = None
                errors.append(f"{name} choose(mode={mode!r}): {type(exc).__name__}: "
                              f"{_first_line(exc)}")
            res[f"{mode}_choice"] = pick
            res[f"{mode}_regret"] = _regret(t, pick, CANDIDATES)
        # the cost model only ranks the three lowered types: its regret among them too
        res["model_regret_lowered"] = _regret(t, res["model_choice"], CANDIDATES[:3])
        out[name] = res
    return out


def sweep_summary(out: Path) -> Optional[dict]:
    """Regret of the cost model on the d/o sweep of ``lowering.json``, if present."""
    try:
        pts = json.loads((out / "lowering.json").read_text())["sweep"]["points"]
    except (OSError, ValueError, KeyError):
        return None
    regrets = [p["regret"] for p in pts]
    return {"points": len(pts), "within_10pct": float(np.mean([r <= 0.10 for r in regrets])),
            "mean_regret": float(np.mean(regrets)), "max_regret": float(np.max(regrets))}


def caffenet_model(lowerings, planner: str = "model", hw: int = 227, fc: int = 4096):
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


def time_training_step(model, batch: int, repeats: int, hw: int = 227) -> float:
    """Best seconds of ``model.train_on_batch`` on random data, after one warm-up step."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, hw, hw, 3)).astype("float32")
    y = rng.integers(0, 1000, batch)
    model.train_on_batch(x, y)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.train_on_batch(x, y)
        best = min(best, time.perf_counter() - t0)
    return best


def end_to_end(batch: int, repeats: int, oracle: Dict[str, str],
               measured: Dict[str, str], fixed=(), hw: int = 227, fc: int = 4096,
               progress=None, errors: Optional[list] = None) -> dict:
    """Training-step seconds of the CaffeNet-shaped model per lowering plan (``None`` for a
    plan that failed; its error is appended to ``errors``).

    ``oracle`` is each layer's fastest lowering, ``measured`` the picks of
    ``choose(mode="measure")`` from :func:`per_layer` (timed among the lowerings that fit in
    memory; the layer's own ``planner="measure"`` would also time Type 3 on conv1).
    """
    import keras
    errors = [] if errors is None else errors
    plans = {"planner (model)": ("auto", "model"), "planner (measure)": (measured, "model"),
             "oracle": (oracle, "model")}
    plans.update({f"all {f}": (f, "model") for f in fixed})
    res, chosen = {}, {}
    for label, (lowerings, planner) in plans.items():
        keras.backend.clear_session()
        try:
            model = caffenet_model(lowerings, planner, hw, fc)
            res[label] = time_training_step(model, batch, repeats, hw)
            chosen[label] = {n: model.get_layer(n).chosen_lowering for n in CAFFENET}
        except Exception as exc:  # noqa: BLE001 - reported, the other plans still run
            res[label], chosen[label] = None, {}
            errors.append(f"end to end, {label}: {type(exc).__name__}: {_first_line(exc)}")
        if progress is not None:
            progress.update(1)
    base = res.get("oracle")
    regret = {k: (v / base - 1 if v is not None and base else None) for k, v in res.items()}
    return {"step_s": res, "regret_vs_oracle": regret, "lowerings": chosen, "hw": hw, "fc": fc}


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = data["layers"]
    names = list(layers)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(CANDIDATES)

    def rel(n, c):
        t = layers[n]["ms"]
        return t[c] / t[layers[n]["fastest"]] if t.get(c) is not None else np.nan

    for i, c in enumerate(CANDIDATES):
        a1.bar(np.arange(len(names)) + (i - 1.5) * width, [rel(n, c) for n in names], width,
               label=c)
    for mode, marker in (("model", "v"), ("measure", "^")):
        pts = [(j + (CANDIDATES.index(layers[n][f"{mode}_choice"]) - 1.5) * width,
                rel(n, layers[n][f"{mode}_choice"]))
               for j, n in enumerate(names) if layers[n][f"{mode}_choice"] is not None]
        if pts:
            a1.scatter(*zip(*pts), marker=marker, color="k", zorder=3,
                       label=f"planner ({mode}) pick")
    a1.set_xticks(np.arange(len(names)), names)
    a1.set_yscale("log")
    a1.set_ylabel("time / fastest (forward+backward)")
    a1.set_title(f"Per layer, batch {data['batch']} (missing bar: lowering failed)")
    a1.legend(fontsize=8)
    e2e = data["end_to_end"]["step_s"]
    labels = list(e2e)
    a2.bar(labels, [np.nan if e2e[k] is None else e2e[k] for k in labels],
           color=[f"C{i}" for i in range(len(labels))])
    a2.set_ylabel("seconds per training step")
    a2.set_title(f"CaffeNet-shaped model, batch {data['end_to_end_batch']}")
    a2.tick_params(axis="x", labelrotation=25, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _num(v: Optional[float]):
    return "n/a" if v is None else v


def markdown(data: dict, command: str) -> str:
    rows = []
    for n, r in data["layers"].items():
        rows.append([n] + [_num(r["ms"][c]) for c in CANDIDATES] +
                    [r["fastest"], r["model_choice"], _pct(r["model_regret"]),
                     _pct(r["model_regret_lowered"]), r["measure_choice"],
                     _pct(r["measure_regret"])])
    md = (f"# Planner benchmark (CcT RQ3)\n\nCommand: `{command}`. Forward+backward ms at batch "
          f"{data['batch']}; regret = time(choice) / time(fastest) - 1. The cost model ranks "
          "only the three lowered types (HybridConv2D's `planner=\"model\"`), so its regret is "
          "also given against the fastest of those; `measure` also times `native`.\n\n" +
          markdown_table(["layer"] + [f"{c} ms" for c in CANDIDATES] +
                         ["fastest", "model pick", "regret", "regret among T1-T3",
                          "measure pick", "regret"], rows))
    tot = data["totals"]
    if tot:
        md += (f"\nSum over the five layers: model's picks {tot['model_ms']:.1f} ms, measure's "
               f"{tot['measure_ms']:.1f} ms, per-layer fastest {tot['fastest_ms']:.1f} ms "
               f"(regret {_pct(tot['model_regret'])} and {_pct(tot['measure_regret'])}); "
               f"fastest of the three lowered types {tot['fastest_lowered_ms']:.1f} ms (model's "
               f"regret among them {_pct(tot['model_regret_lowered'])}).\n")
    sw = data.get("sweep")
    if sw:
        md += (f"\nd/o sweep ({sw['points']} points, from `lowering.json`): the cost model is "
               f"within 10% of the fastest lowering on {100 * sw['within_10pct']:.0f}% of the "
               f"points; mean regret {_pct(sw['mean_regret'])}, worst "
               f"{_pct(sw['max_regret'])}.\n")
    e2e = data["end_to_end"]
    rows = [[k, _num(v), _pct(e2e["regret_vs_oracle"][k]),
             ", ".join(f"{n}={c}" for n, c in e2e["lowerings"][k].items())]
            for k, v in e2e["step_s"].items()]
    md += (f"\n## End to end: CaffeNet-shaped training step, batch {data['end_to_end_batch']}, "
           f"{e2e['hw']}x{e2e['hw']} input\n\n" +
           markdown_table(["plan", "s/step", "regret vs oracle", "lowerings"], rows) +
           f"\n{CCT_PUBLISHED}.\n")
    if data.get("errors"):
        md += "\nFailures:\n\n" + "".join(f"- {e}\n" for e in data["errors"])
    return md


def totals(layers: dict) -> dict:
    """Summed forward+backward ms of each mode's picks against the per-layer fastest (empty
    when a pick or time is missing)."""
    try:
        fastest = sum(r["ms"][r["fastest"]] for r in layers.values())
        out = {"fastest_ms": fastest}
        for mode in ("model", "measure"):
            out[f"{mode}_ms"] = sum(r["ms"][r[f"{mode}_choice"]] for r in layers.values())
            out[f"{mode}_regret"] = out[f"{mode}_ms"] / fastest - 1
        lowered = sum(min(r["ms"][c] for c in CANDIDATES[:3] if r["ms"][c] is not None)
                      for r in layers.values())
        out["fastest_lowered_ms"] = lowered
        out["model_regret_lowered"] = out["model_ms"] / lowered - 1
        return out
    except (KeyError, TypeError, ValueError):
        return {}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, no fixed plans")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch", type=int, default=None, help="per-layer batch")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    from tqdm import tqdm
    from benchmarks.common import machine
    batch = args.batch or (8 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 3)
    e2e_batch = 4 if args.quick else batch
    fixed = () if args.quick else ("type1", "type3", "native")
    total = len(CAFFENET) * len(CANDIDATES) + 3 + len(fixed)
    errors: list = []
    with tqdm(total=total, desc="planner benchmark", unit="run") as progress:
        times = layer_times(batch, repeats, args.out, progress=progress, errors=errors)
        layers = per_layer(batch, times, errors=errors)
        oracle = {n: r["fastest"] or "auto" for n, r in layers.items()}
        measured = {n: r["measure_choice"] or "auto" for n, r in layers.items()}
        e2e = end_to_end(e2e_batch, repeats, oracle, measured, fixed, progress=progress,
                         errors=errors)
    data = {"machine": machine(), "batch": batch, "layers": layers, "totals": totals(layers),
            "sweep": sweep_summary(args.out), "end_to_end": e2e, "end_to_end_batch": e2e_batch,
            "errors": errors}
    md = markdown(data, "python -m benchmarks.planner" + (" --quick" if args.quick else ""))
    write_results(args.out, "planner", data, md)
    plot(data, args.out / "planner.png")
    print(md)
    return data


if __name__ == "__main__":
    main()
