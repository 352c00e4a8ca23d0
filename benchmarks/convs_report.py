"""The report of a per-layer convolution run (:mod:`benchmarks.convs`): from its data (the
processes' results, the machine, the command), the speed-ups of the default HybridConv2D over
keras Conv2D and the best peer, their summary, the markdown page (``convs.md``) and the plot
(``convs.png``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List, Optional

#: The peers of the default HybridConv2D: the "best peer" is the fastest valid one of them.
PEER_SET = ("keras_conv2d", "keras_split", "keras_depthwise", "torch_nchw", "torch_cl")

# The measurement's settings the report states; :mod:`benchmarks.convs` measures with them
# (defined here, not there: convs.py imports this module).
#: A candidate whose best time is above max(SLOW_S, SLOW_FACTOR x the fastest) after a round
#: is not timed in further rounds (its "rounds" says how many it got).
SLOW_S, SLOW_FACTOR = 5.0, 10.0
#: How runs written before ``convs.json`` recorded its ``timing`` timed their candidates.
OLD_TIMING = ("all candidates of a shape timed round-robin in one process, each timed call "
              "right after an untimed call of the same candidate")
#: Short layers get more rounds than ``--repeats``: until every candidate still timed has
#: :data:`MIN_TIMED_S` seconds of timed calls, at most :data:`MAX_ROUNDS` rounds.
MIN_TIMED_S, MAX_ROUNDS = 0.25, 10
#: Square GEMM sizes measured: the ceiling is the best of them (2048^3 in float32 moves 48 MB,
#: more than the L3 cache a shared machine leaves, and can run at half the rate of 1024^3).
CEILING_SIZES = (512, 1024, 2048)


def best_peer(cands: dict, loose: bool = False) -> Optional[str]:
    ok = {n: cands[n]["ms"] for n in PEER_SET if n in cands and valid(cands[n], loose)}
    return min(ok, key=ok.get) if ok else None


def valid(entry: dict, loose: bool = False) -> bool:
    """A result (not failed, not a measuring error; ``loose``: only rates above the CPU's
    peak are errors, those above the GEMM ceiling count)."""
    if "ms" not in entry or "error" in entry:
        return False
    return not entry.get("above_peak") if loose else "measuring_error" not in entry


def ratios(layer: dict, loose: bool = False) -> dict:
    c = layer["candidates"]
    h = c.get("hybrid", {})
    out = {"vs_conv2d": None, "vs_best_peer": None, "best_peer": best_peer(c, loose)}
    k, again = c.get("keras_conv2d", {}), c.get("keras_conv2d_again", {})
    # the noise floor: keras Conv2D's second copy against the first, as the default is judged
    out["noise"] = k["ms"] / again["ms"] if valid(k, loose) and valid(again, loose) else None
    if valid(h, loose):
        if valid(k, loose):
            out["vs_conv2d"] = k["ms"] / h["ms"]  # speed-up: > 1 faster
        if out["best_peer"]:
            out["vs_best_peer"] = c[out["best_peer"]]["ms"] / h["ms"]
    return out


def summarize(results: List[dict], loose: bool = False) -> dict:
    """Per (backend, dtype): min / max speed-ups of the default HybridConv2D, the layers where
    it is below 0.97x keras Conv2D's speed and below 1.0x the best peer's (the issue's
    acceptance); and the same for TensorFlow CaffeNet."""
    groups: Dict[str, dict] = {}
    for run in results:
        key = f"{run['backend']} {run['dtype']}"
        g = groups.setdefault(key, {"layers": 0, "conv2d": [], "peer": [], "plan": [],
                                    "under_097_conv2d": 0,
                                    "under_1_best_peer": 0, "hyb_ms": 0.0, "conv2d_ms": 0.0,
                                    "noise": [],
                                    "peer_ms": 0.0, "measuring_errors": 0, "errors": 0})
        for layer in run["layers"]:
            g["layers"] += 1
            if "plan_ms" in layer["candidates"].get("hybrid", {}):
                g["plan"].append(layer["candidates"]["hybrid"]["plan_ms"])
            rt = ratios(layer, loose)
            n = len(layer["names"])
            for c in layer["candidates"].values():
                g["measuring_errors"] += bool(c.get("above_peak")) if loose else \
                    "measuring_error" in c
                g["errors"] += "error" in c
            if rt["vs_conv2d"] is not None:
                g["conv2d"].append(rt["vs_conv2d"])
                g["under_097_conv2d"] += rt["vs_conv2d"] < 0.97
                g["hyb_ms"] += n * layer["candidates"]["hybrid"]["ms"]
                g["conv2d_ms"] += n * layer["candidates"]["keras_conv2d"]["ms"]
            if rt["noise"] is not None:
                g["noise"].append(rt["noise"])
            if rt["vs_best_peer"] is not None:
                g["peer"].append(rt["vs_best_peer"])
                g["under_1_best_peer"] += rt["vs_best_peer"] < 1.0
                g["peer_ms"] += n * layer["candidates"][rt["best_peer"]]["ms"]
    out = {}
    for key, g in groups.items():
        out[key] = {"layers": g["layers"],
                    "min_vs_conv2d": min(g["conv2d"], default=None),
                    "max_vs_conv2d": max(g["conv2d"], default=None),
                    "min_vs_best_peer": min(g["peer"], default=None),
                    "max_vs_best_peer": max(g["peer"], default=None),
                    "under_097_conv2d": g["under_097_conv2d"],
                    "under_1_best_peer": g["under_1_best_peer"],
                    "compared_conv2d": len(g["conv2d"]), "compared_best_peer": len(g["peer"]),
                    "measuring_errors": g["measuring_errors"], "errors": g["errors"],
                    "noise_under_097": sum(v < 0.97 for v in g["noise"]),
                    "noise_compared": len(g["noise"]),
                    "min_noise": min(g["noise"], default=None),
                    "max_noise": max(g["noise"], default=None),
                    "plan_ms_median": statistics.median(g["plan"]) if g["plan"] else None,
                    "plan_ms_max": max(g["plan"], default=None)}
    for run in results:
        if run["backend"] == "tensorflow" and run["net"] == "caffenet":
            rts = [ratios(layer, loose) for layer in run["layers"]]
            out[f"tensorflow caffenet {run['dtype']}"] = {
                "layers": len(rts),
                "under_097_conv2d": sum(r["vs_conv2d"] is not None and r["vs_conv2d"] < 0.97
                                        for r in rts),
                "under_1_best_peer": sum(r["vs_best_peer"] is not None and
                                         r["vs_best_peer"] < 1.0 for r in rts),
                "vs_conv2d": [r["vs_conv2d"] for r in rts],
                "vs_best_peer": [r["vs_best_peer"] for r in rts]}
    return out


def _fmt(entry: dict) -> str:
    if "ms" in entry:
        s = f"{entry['ms']:.3g}"
        if "measuring_error" in entry:
            return f"~~{s}~~ (>{'peak' if entry.get('above_peak') else 'GEMM'})"
        return f"{s} (>GEMM)" if entry.get("above_gemm") else s
    if "error" in entry:
        return "err"
    return "-"


def _r(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def onednn_line(machine: dict) -> str:
    """``"; oneDNN: tensorflow 3.7.3, torch 3.12.0"`` from a result's machine record (empty
    for results recorded before it was)."""
    v = machine.get("onednn") or {}
    return ("; oneDNN: " + ", ".join(f"{k} {x}" for k, x in sorted(v.items()))) if v else ""


def markdown(data: dict) -> str:
    m = data["machine"]
    cpu = m["cpu"]
    lines = [
        "# Per-layer convolutions: keras_cct vs what users run instead", "",
        f"Command: `{data['command']}` ({data['when']}, {data['seconds']:.0f} s).", "",
        f"Machine: **{cpu['model']}**, {cpu['logical_cores']} logical cores "
        f"({cpu['usable_cores']} usable), vector units: {cpu['vector_units']}, matrix units: "
        f"{cpu['matrix_units']} (flags: {', '.join(cpu['isa_flags'])})"
        + "".join(f"; accelerator: **{a}** (every candidate and GEMM ceiling on it)"
                  for a in m.get("accelerators", [])) + ". Libraries: "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + onednn_line(m) + ".", "",
        "Times: one training step (forward + backward, output fetched), best of the rounds "
        f"({data['repeats']}, more on short layers: until each candidate has "
        f"{data.get('min_timed_s', MIN_TIMED_S)} s of timed calls, at most "
        f"{data.get('max_rounds', MAX_ROUNDS)}; a candidate's rounds are in the JSON), "
        + data.get("timing", OLD_TIMING) + ". Speed-ups: keras "
        "Conv2D's time / the default HybridConv2D's, and the best peer's (fastest of "
        "keras_conv2d, keras_split, keras_depthwise, torch_nchw, torch_cl) / the default's; "
        "above 1 = keras_cct faster. Noise floor: keras_conv2d_again is keras Conv2D "
        "built and timed a second time beside the first; its speed against the first shows "
        "how far two copies of one op differ in this run. "
        "~~struck~~ (>GEMM or >peak): faster than the GEMM ceiling or the CPU's peak, "
        "a measuring error, left out of the ratios (see the ceilings below). err: failed "
        "(listed under the table). -: not applicable.", "",
        "Nets (batch, input size; distinct convolution shapes / convolutions): "
        + "; ".join(f"{n} {v['batch']}x{v['size']}x{v['size']}" + (
            f" ({len(r['layers'])} / {sum(len(x['names']) for x in r['layers'])})"
            if (r := next((r for r in data["runs"] if r["net"] == n), None)) else "")
            for n, v in data.get("nets", {}).items())
        + ". By default VGG16 at 112x112, ResNet-50 at batch 4 and MobileNet at batch 16 so "
        "that the whole run fits in about half an hour on two cores, CaffeNet at its real "
        "size and batch (32); `--batch` sets every net's batch.", "",
        "## Summary", ""]
    lines += _summary_md(data["summary"])
    if data.get("flag_above", "gemm") == "gemm" and "summary_above_gemm_kept" in data:
        lines += ["### The same, keeping rates above the GEMM ceiling (below the CPU's peak)",
                  "", "Where a library's GEMM is slower than its convolutions (e.g. oneDNN "
                  "convolutions vs MKL / Eigen GEMMs on AMD CPUs), the GEMM ceiling also "
                  "strikes real results; here only rates above the arithmetic peak are "
                  "errors.", ""]
        lines += _summary_md(data["summary_above_gemm_kept"])
    return _tables_md(data, lines)


def _summary_md(summary: dict) -> List[str]:
    from benchmarks.common import markdown_table
    lines, rows = [], []
    for key, s in summary.items():
        if "min_vs_conv2d" not in s:
            continue
        rows.append([key, s["layers"], f"{_r(s['min_vs_conv2d'])}-{_r(s['max_vs_conv2d'])}",
                     f"{s['under_097_conv2d']}/{s['compared_conv2d']}",
                     f"{_r(s['min_vs_best_peer'])}-{_r(s['max_vs_best_peer'])}",
                     f"{s['under_1_best_peer']}/{s['compared_best_peer']}",
                     "-" if not s.get("noise_compared") else
                     f"{s['noise_under_097']}/{s['noise_compared']} "
                     f"({_r(s['min_noise'])}-{_r(s['max_noise'])})",
                     s["measuring_errors"], s["errors"],
                     "-" if s.get("plan_ms_median") is None else
                     f"{s['plan_ms_median']:.0f} / {s['plan_ms_max']:.0f}"])
    lines.append(markdown_table(
        ["backend dtype", "shapes", "speed-up vs Conv2D (min-max)", "below 0.97x Conv2D",
         "speed-up vs best peer (min-max)", "below 1.0x best peer",
         "noise floor: keras Conv2D's twin below 0.97x Conv2D (min-max)", "measuring errors",
         "failed runs", "plan ms (median / max)"], rows))
    for key, s in summary.items():
        if key.startswith("tensorflow caffenet"):
            lines.append(f"**TensorFlow CaffeNet {key.split()[-1]}**: "
                         f"{s['under_097_conv2d']} of {s['layers']} layers below 0.97x keras "
                         f"Conv2D's speed, {s['under_1_best_peer']} below 1.0x the best peer's "
                         f"(speed-up vs Conv2D: {', '.join(_r(v) for v in s['vs_conv2d'])}; "
                         f"vs best peer: {', '.join(_r(v) for v in s['vs_best_peer'])}).\n")
    return lines


def _tables_md(data: dict, lines: List[str]) -> str:
    from benchmarks.common import markdown_table
    policy = data.get("flag_above", "gemm")
    lines += ["## GEMM ceilings (GFLOP/s)", "",
              "Best square product (n = " + ", ".join(map(str, CEILING_SIZES)) + ") of each "
              "library in each process (best of 3 at the start; the three fastest below 2048 "
              "again in every round of every shape, beside the candidates). The ceiling a "
              "run's candidates are checked against is "
              "the best of them (float32 products count for bfloat16 runs too). Peak: the "
              "CPU's arithmetic upper bound (usable cores x flops/cycle x highest clock). "
              + ("Rates above the GEMM ceiling are measuring errors (struck, left out). "
                 if policy == "gemm" else
                 "Only rates above the peak are measuring errors (`--flag-above peak`); those "
                 "above the GEMM ceiling are marked (>GEMM) and kept. ")
              + "Winograd does fewer multiplications than the direct convolution, so its "
              "direct-flop rate may legitimately pass the GEMM ceiling.", ""]
    crow = []
    for run in data["runs"]:
        per_lib: Dict[str, tuple] = {}
        for key, v in run["ceilings_gflops"].items():
            lib, dt, n = key.split()
            if v > per_lib.get(f"{lib} {dt}", (0,))[0]:
                per_lib[f"{lib} {dt}"] = (v, n)
        peak = run["peak"]["gflops"]
        crow.append([f"{run['backend']} {run['dtype']} {run['net']}",
                     f"{run['ceiling_gflops']:.0f}", "-" if peak is None else f"{peak:.0f}",
                     "; ".join(f"{k} {v:.0f} (n={n})" for k, (v, n) in per_lib.items())])
    lines.append(markdown_table(["process", "GEMM ceiling", "peak", "best GEMM per library"],
                                crow))
    from benchmarks.peers import CONTROLS, LOWERINGS
    cand_cols = (["hybrid"] + [f"hybrid_{low}" for low in LOWERINGS] + list(PEER_SET)
                 + list(CONTROLS))
    for run in data["runs"]:
        lines += [f"## {run['net']}, {run['backend']}, {run['dtype']} "
                  f"(batch {run['batch']}, {run['size']}x{run['size']})", ""]
        if run.get("arithmetic", run["dtype"]) != run["dtype"]:
            lines += [f"HybridConv2D computed these {run['dtype']} convolutions in "
                      f"{run['arithmetic']}: this machine computes {run['dtype']} slower "
                      "(`keras_cct.lowering.precision`).", ""]
        rows, notes = [], []
        for layer in run["layers"]:
            c = layer["candidates"]
            rt = ratios(layer)
            names = ",".join(layer["names"][:3]) + (
                f" (+{len(layer['names']) - 3})" if len(layer["names"]) > 3 else "")
            h = c.get("hybrid", {})
            rows.append([names, len(layer["names"]), layer["label"],
                         f"{3 * layer['gflop_fwd']:.3g}", h.get("pick", "-"),
                         f"{h['plan_ms']:.0f}" if "plan_ms" in h else "-"]
                        + [_fmt(c.get(n, {})) for n in cand_cols]
                        + [rt["best_peer"] or "-", _r(rt["vs_conv2d"]), _r(rt["vs_best_peer"])])
            for n in cand_cols:
                e = c.get(n, {})
                if "error" in e:
                    notes.append(f"- {layer['names'][0]} {n}: {e['error']}")
                if "measuring_error" in e:
                    notes.append(f"- {layer['names'][0]} {n}: measuring error, "
                                 f"{e['measuring_error']}")
                if e.get("rounds", repeats_of(data)) < repeats_of(data):
                    notes.append(f"- {layer['names'][0]} {n}: timed in {e['rounds']} round(s) "
                                 f"only (over {SLOW_FACTOR:g}x the fastest)")
        skipped = sorted({f"{n}: {e['skipped']}" for layer in run["layers"]
                          for n, e in layer["candidates"].items() if "skipped" in e})
        lines.append(markdown_table(
            ["layers", "n", "shape", "f+b GFLOP", "default's pick", "plan ms"]
            + [n.replace("hybrid_", "") for n in cand_cols]
            + ["best peer", "speed-up vs Conv2D", "speed-up vs best peer"], rows))
        if notes:
            lines += notes + [""]
        if skipped:
            lines += ["Not run: " + "; ".join(skipped) + ".", ""]
    return "\n".join(lines) + "\n"


def repeats_of(data: dict) -> int:
    return data["repeats"]


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    panels: Dict[str, list] = {}
    for run in data["runs"]:
        panels.setdefault(f"{run['backend']} {run['dtype']}", []).extend(
            (f"{run['net']}:{layer['names'][0]}", ratios(layer)) for layer in run["layers"])
    n = max((len(v) for v in panels.values()), default=1)
    fig, axes = plt.subplots(len(panels) or 1, 1, figsize=(max(8.0, 0.28 * n + 2), 3.2 *
                                                            max(len(panels), 1)), squeeze=False)
    for ax, (key, items) in zip(axes[:, 0], panels.items()):
        xs = np.arange(len(items))
        nan = float("nan")
        a = [rt["vs_conv2d"] if rt["vs_conv2d"] is not None else nan for _, rt in items]
        b = [rt["vs_best_peer"] if rt["vs_best_peer"] is not None else nan for _, rt in items]
        # bars from 1.0: up = keras_cct faster, down = slower
        ax.bar(xs - 0.2, [v - 1 for v in a], 0.4, bottom=1.0,
               label="speed-up of the default over keras Conv2D")
        ax.bar(xs + 0.2, [v - 1 for v in b], 0.4, bottom=1.0,
               label="speed-up of the default over the best peer")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        vals = [v for v in a + b if v == v]
        ax.set_ylim(min([0.5] + [v / 1.3 for v in vals]), max([2.0] + [v * 1.3 for v in vals]))
        ax.set_xlim(-0.6, len(items) - 0.4)
        ax.set_title(key, fontsize=9)
        ax.set_xticks(xs, [label for label, _ in items], rotation=90, fontsize=6)
        ax.set_ylabel("speed-up (>1: keras_cct faster)", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
