"""Run keras_cct's whole benchmark suite: ``python -m benchmarks [--quick] [--out DIR]``.

One part per research question of Caffe con Troll, each in its own process (so that a crash
or a TensorFlow thread setting of one part cannot affect another), in this order:

======  =============================  ==========================================
RQ      part                           module
======  =============================  ==========================================
RQ1     batching                       :mod:`benchmarks.batching`
RQ2     lowering types, d/o sweep      :mod:`benchmarks.lowering`
RQ3     planner regret                 :mod:`benchmarks.planner` (reuses RQ2's times)
RQ4     hybrid CPU + OpenCL            :mod:`benchmarks.hybrid`
RQ5     FLOPS proportionality          :mod:`benchmarks.flops`
nets    whole nets vs PyTorch          :mod:`benchmarks.nets`
convs   every conv vs Keras / PyTorch  :mod:`benchmarks.convs`
first   first training step, per       :mod:`benchmarks.first_step`
        process (planning, caches)
gemm    the libraries' own GEMM        :mod:`benchmarks.gemm`
        (TensorFlow vs PyTorch)
keras   keras.applications models,     :mod:`benchmarks.keras_models`
        hybridized vs as built
======  =============================  ==========================================

Each part writes ``<part>.json``, ``<part>.md`` and ``<part>.png`` under ``--out`` (default
``docs/benchmarks/``); its printed output goes to ``<out>/logs/<part>.log``. At the end
``summary.md`` / ``summary.json`` put each question's headline figure next to CcT's published
one; when ``--out`` is the default folder, the same table also replaces the section between
the ``results`` markers of ``docs/benchmarks.md``. The exit status is 1 if any part failed
(the others still run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "benchmarks"
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# part name -> research question, title
PARTS = {
    "batching": ("RQ1", "batching: Caffe's per-image lowering vs batch partitions"),
    "lowering": ("RQ2", "lowering types on CaffeNet and the d/o sweep"),
    "planner": ("RQ3", "the planner's choice vs the fastest lowering"),
    "hybrid": ("RQ4", "hybrid execution under CCTStrategy"),
    "flops": ("RQ5", "throughput proportional to calibrated FLOPS"),
    "nets": ("nets", "whole Caffe nets' training step: keras_cct vs Keras Conv2D vs PyTorch"),
    "convs": ("convs", "every CaffeNet/VGG16/ResNet-50/MobileNet convolution: keras_cct vs "
                       "Keras Conv2D vs PyTorch"),
    "first_step": ("first", "a model's first training step, process after process: "
                            "HybridConv2D (planning, its caches) vs keras Conv2D"),
    "gemm": ("gemm", "the matrix products under the convolutions: TensorFlow's vs PyTorch's"),
    "keras_models": ("keras", "Keras' own models (keras.applications): keras_cct.hybridize vs "
                              "the model as built"),
}


def _load(out: Path, name: str) -> Optional[dict]:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _rq1(d: dict) -> str:
    s = d["speedup_p_cores_vs_caffe"]["iteration"]
    it = d["images_per_s"]["iteration"]
    line = (f"whole CaffeNet iteration: {d['cores']} partitions = {s:.2f}x Caffe's per-image "
            f"lowering on {d['cores']} cores (batch {d['batch']})")
    if "caffe 1T" in it:
        best = it["batch p=%d" % d["cores"]]
        line += f"; {best / it['caffe 1T']:.2f}x Caffe's way with a one-thread BLAS"
    return line


def _rq2(d: dict) -> str:
    parts = []
    for dtype, run in d["runs"].items():
        pts = sorted(run["sweep"]["points"], key=lambda p: p["ratio"])
        cross = next((p["ratio"] for p in pts if p["ms"]["type3"] < p["ms"]["type1"]), None)
        line = (f"{dtype}: " + (f"Type 3 first beats Type 1 at d/o = {cross:g}"
                                if cross is not None else "Type 3 never beat Type 1")
                + f", cost model within 10% of the fastest type on "
                f"{100 * run['sweep']['model_within_10pct']:.0f}% of the sweep")
        layers = run["caffenet"]["layers"].values()
        vs = [r["default_vs_keras"] for r in layers if r.get("default_vs_keras")]
        if vs:
            line += (f"; CaffeNet conv1-5 (batch {d['batch']}), keras Conv2D / the default "
                     f"(f+b) {min(vs):.2f}-{max(vs):.2f}")
        parts.append(line)
    return "; ".join(parts) or "no complete result"


def _rq3(d: dict) -> str:
    parts = []
    for dtype, run in d["runs"].items():
        t = run.get("totals") or {}
        e2e = run["end_to_end"]["regret_vs_oracle"].get("default (auto)")
        chosen = run["end_to_end"].get("lowerings", {})
        same = chosen.get("default (auto)") and chosen.get("default (auto)") == \
            chosen.get("oracle")
        bits = []
        if t:
            bits.append(f"the default's picks +{100 * t['auto_regret']:.0f}% over the per-layer "
                        f"fastest (summed), the cost model's +{100 * t['model_regret']:.0f}%")
        if e2e is not None:
            bits.append(f"end to end (batch {d['end_to_end_batch']}) the default "
                        f"{100 * e2e:+.0f}% vs the per-layer oracle"
                        + (" (the same lowerings: the run's resolution)" if same else ""))
        if bits:
            parts.append(f"{dtype}: " + ", ".join(bits))
    return "; ".join(parts) or "no complete result"


def _rq4(d: dict) -> str:
    s = d["summary"]["layer_images_per_s"]
    m = d["summary"]["model_images_per_s"]
    balance = d["configs"]["hybrid"].get("balance_efficiency")
    return (f"hybrid / (TF 1 core + OpenCL 1 core): conv2 {s['hybrid_vs_ideal']:.2f}, "
            f"small model {m['hybrid_vs_ideal']:.2f}; hybrid / TF on all cores: conv2 "
            f"{s['hybrid_vs_tf2']:.2f}, small model {m['hybrid_vs_tf2']:.2f}"
            + (f"; conv2 hybrid / both devices at once unsplit {s['hybrid_vs_both_at_once']:.2f}"
               if "hybrid_vs_both_at_once" in s else "")
            + (f"; balance efficiency {balance:.2f}" if balance is not None else ""))


def _rq5(d: dict) -> str:
    f = d.get("fit")
    if not f:
        return "fewer than two configurations measured"
    return (f"images/s = {f['slope_images_per_gflop']:.3g} x calibrated GFLOP/s, R^2 = "
            f"{f['r2']:.2f}, largest deviation {100 * f['max_rel_deviation']:.0f}%")


def _nets(d: dict) -> str:
    parts = []
    for r in d["results"]:
        c = r["candidates"]
        torch_best = max([c[k]["images_per_s"] for k in ("torch_nchw", "torch_cl") if k in c],
                         default=0)
        if "keras_cct" in c and torch_best:
            parts.append(f"{r['net']} b{r['batch']} {r['dtype']}: "
                         f"{c['keras_cct']['images_per_s'] / torch_best:.2f}x PyTorch")
    return "keras_cct training step vs PyTorch: " + ("; ".join(parts) or "no result")


def _convs(d: dict) -> str:
    s, loose = d["summary"], d.get("summary_above_gemm_kept", {})
    parts = []
    for key in ("tensorflow caffenet float32", "tensorflow caffenet bfloat16"):
        if key in s:
            n, kept = s[key]["layers"], loose.get(key, {}).get("under_1_best_peer")
            part = (f"TF CaffeNet {key.split()[-1]}: default HybridConv2D below 0.97x "
                    f"keras Conv2D's speed on {s[key]['under_097_conv2d']}/{n} layers, below "
                    f"1.0x the best peer's on {s[key]['under_1_best_peer']}/{n}")
            if kept is not None and kept != s[key]["under_1_best_peer"]:
                # a peer's real rate above the GEMM ceiling was struck: say what keeping it gives
                part += f" ({kept}/{n} with every rate up to the CPU's peak kept)"
            parts.append(part)
    mins = [f"{k} {v['min_vs_conv2d']:.2f}" for k, v in s.items()
            if v.get("min_vs_conv2d") is not None]
    if mins:
        parts.append("lowest speed-up vs keras Conv2D over all nets: " + ", ".join(mins))
    return "; ".join(parts) or "no complete result"


def _first_step(d: dict) -> str:
    parts = []
    for run in d["runs"]:
        h = [r["first_s"] for r in run["hybrid"]]
        k = sorted(r["first_s"] for r in run["keras_conv2d"])
        parts.append(f"{run['backend']} {run['dtype']}: HybridConv2D "
                     + " / ".join(f"{v:.1f}" for v in h)
                     + f" s in processes 1-{len(h)}, keras Conv2D {k[0]:.1f}-{k[-1]:.1f} s")
    return "CaffeNet conv3-conv5's first step: " + ("; ".join(parts) or "no result")


def _gemm(d: dict) -> str:
    threads = max(d["threads"])
    by = {(r["library"], r["shape"], r["dtype"]): r["gflops"] for r in d["results"]
          if r["threads"] == threads}
    parts = []
    for dtype in d["dtypes"]:
        ratios = [by[("tensorflow", s, dtype)] / by[("torch", s, dtype)] for s in d["shapes"]
                  if ("tensorflow", s, dtype) in by and ("torch", s, dtype) in by]
        if ratios:
            parts.append(f"{dtype} {min(ratios):.2f}-{max(ratios):.2f}x")
    v = d["machine"].get("onednn", {})
    return (f"TensorFlow's GEMM vs PyTorch's ({threads} thread{'s' * (threads != 1)}): "
            + ", ".join(parts)
            + (f" (oneDNN {v.get('tensorflow')} vs {v.get('torch')})" if v else ""))


def _keras_models(d: dict) -> str:
    parts = []
    for run in d["runs"]:
        ratios = [r["images_per_s"]["hybrid"] / r["images_per_s"]["keras"]
                  for r in run["results"]]
        twins = [r["images_per_s"]["keras_again"] / r["images_per_s"]["keras"]
                 for r in run["results"]]
        if ratios:
            parts.append(f"{run['backend']} {run['dtype']} {min(ratios):.2f}-{max(ratios):.2f}x"
                         f" (Keras' second copy {min(twins):.2f}-{max(twins):.2f}x)")
    return "hybridized Keras models' training step vs as built: " + ("; ".join(parts)
                                                                    or "no result")


HEADLINES: Dict[str, Callable[[dict], str]] = {
    "batching": _rq1, "lowering": _rq2, "planner": _rq3, "hybrid": _rq4, "flops": _rq5,
    "nets": _nets, "convs": _convs, "first_step": _first_step, "gemm": _gemm,
    "keras_models": _keras_models}
CCT = {
    "batching": "4.5x over Caffe at 8-16 cores",
    "lowering": "Type 1 best for d < o, Type 3 for d > o: crossover at d/o about 1",
    "planner": "picks the lowering by that crossover (no regret figure published)",
    "hybrid": "about 0.88 of the ideal (sum of the devices)",
    "flops": "throughput proportional to device FLOPS",
    "nets": "CaffeNet: CcT matched Caffe's GPU speed on a CPU (no PyTorch figure)",
    "convs": "(CcT compared with Caffe only; no per-layer Keras / PyTorch figure)",
    "first_step": "(CcT chose lowerings by its cost model, timing nothing; no figure)",
    "gemm": "(CcT ran one BLAS for every candidate; no figure)",
    "keras_models": "(CcT ran Caffe's nets only; no figure)",
}


def cpu_of(d: dict) -> Optional[str]:
    """The CPU a part's result names (its ``machine``: a :func:`benchmarks.common.machine`
    dict, a ``{"cpu": cpu_info()}`` one, or a line), or None when it records none. The
    summary gathers parts run at different times, possibly on different machines: each row
    says which."""
    m = d.get("machine")
    cpu = m.get("cpu") if isinstance(m, dict) else m
    if isinstance(cpu, dict):
        cpu = cpu.get("model")
    return cpu if isinstance(cpu, str) and cpu else None


def summary(out: Path, status: Dict[str, str]) -> tuple:
    """(markdown, json-able dict) of every part's headline figure next to CcT's."""
    rows, data = [], {}
    for name, (rq, title) in PARTS.items():
        d = _load(out, name)
        if status.get(name, "ok") != "ok":
            line = f"failed: {status[name]}"
        elif d is None:
            line = "not run"
        else:
            try:
                line = HEADLINES[name](d)
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
                line = f"incomplete result ({type(exc).__name__}: {exc})"
            cpu = cpu_of(d)
            line = f"on {cpu}: {line}" if cpu else f"(CPU not recorded) {line}"
            if name not in status:
                line = f"(not run this time; earlier result) {line}"
        data[name] = {"rq": rq, "title": title, "keras_cct": line, "cct": CCT[name]}
        png = f"{name}.png" if (out / f"{name}.png").exists() else ""
        rows.append(f"| {rq} | {title} | {line} | {CCT[name]} | "
                    + (f"[plot]({png}), [table]({name}.md)" if png else "-") + " |")
    md = ("| RQ | question | keras_cct, this run | CcT (published) | details |\n"
          "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    return md, data


def update_page(page: Path, table: str, command: str, when: str) -> bool:
    """Replace the text between the results markers of ``page``; False if it has none."""
    try:
        text = page.read_text()
    except OSError:
        return False
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    # links in the page are relative to docs/, the table's to docs/benchmarks/
    table = table.replace("](", "](benchmarks/")
    body = f"\n_Last run: `{command}`, {when}._\n\n{table}\n"
    page.write_text(head + BEGIN + body + END + tail)
    return True


def run_part(name: str, argv: Sequence[str], out: Path, timeout: float) -> str:
    """Run ``python -m benchmarks.<name> argv`` from the source root; 'ok' or why it failed."""
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3"),
               KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow"),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    with open(log_dir / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *argv],
                                  cwd=ROOT, env=env, stdout=log, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        return f"exit code {proc.returncode} (see {log_dir / (name + '.log')})"
    return "ok"


def _summary_only(out: Path) -> int:
    status = {name: "ok" for name in PARTS if _load(out, name) is not None}
    table, data = summary(out, status)
    command = "python -m benchmarks --summary (each part's command is on its page)"
    when = time.strftime("%Y-%m-%d %H:%M %Z")
    (out / "summary.md").write_text(f"# Benchmark summary\n\nCommand: `{command}` ({when})."
                                    "\n\n" + table)
    (out / "summary.json").write_text(json.dumps(
        {"command": command, "when": when, "parts": data}, indent=1))
    if out == DEFAULT_OUT.resolve():
        update_page(PAGE, table, command, when)
    print(table)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="Run keras_cct's benchmark suite (CcT RQ1-RQ5).")
    parser.add_argument("--quick", action="store_true",
                        help="small batches and few repeats (minutes, not the real figures)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for the JSON, markdown and PNG results "
                             "(default: docs/benchmarks/ of the source checkout)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated subset of: " + ", ".join(PARTS))
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds allowed per part (default 3600)")
    parser.add_argument("--summary", action="store_true",
                        help="run nothing: rebuild the summary (and the docs page's table) from "
                             "the results already in --out, each part as its own page says it "
                             "was run")
    args = parser.parse_args(argv)
    if args.summary:
        return _summary_only(args.out.resolve())
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm
    status, seconds = {}, {}
    sub = (["--quick"] if args.quick else []) + ["--out", str(out)]
    with tqdm(parts, desc="benchmark suite", unit="part", position=0) as bar:
        for name in bar:
            bar.set_postfix_str(f"{PARTS[name][0]} {name}")
            t0 = time.perf_counter()
            status[name] = run_part(name, sub, out, args.timeout)
            seconds[name] = time.perf_counter() - t0
            if status[name] != "ok":
                tqdm.write(f"{name}: {status[name]}", file=sys.stderr)
    table, data = summary(out, status)
    command = "python -m benchmarks" + (" --quick" if args.quick else "")
    when = time.strftime("%Y-%m-%d %H:%M %Z")
    (out / "summary.md").write_text(f"# Benchmark summary\n\nCommand: `{command}` ({when}).\n\n"
                                    + table)
    (out / "summary.json").write_text(json.dumps(
        {"command": command, "when": when, "parts": data, "status": status,
         "seconds": seconds}, indent=1))
    if out == DEFAULT_OUT.resolve():
        update_page(PAGE, table, command, when)
    print(table)
    return 0 if all(s == "ok" for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
