"""Per-layer convolution benchmark: is keras_cct faster than what users would run instead?

Every convolution of CaffeNet, VGG16, ResNet-50 and MobileNet v1 (read from the prototxts in
``../shared/caffe-models/prototxt-only/`` by ``keras_cct.caffe.load_net``; identical shapes
measured once, with their count), one training step (forward + backward, the forward's output
always fetched) of each candidate:

* ``hybrid``: ``keras_cct.HybridConv2D`` with all its defaults, as shipped (its pick is
  reported), and ``hybrid_<lowering>`` for each explicit ``lowering=`` (type1, type2, type3,
  native, winograd where 3x3 stride 1 and HybridConv2D accepts the name);
* ``keras_conv2d``: ``keras.layers.Conv2D(groups=g)`` (``padding="same"`` where equivalent to
  Caffe's padding, else ``ZeroPadding2D`` + ``"valid"``), ``keras_split`` (groups > 1:
  ``keras.ops.split`` -- ``tf.split`` on TensorFlow -- + one Conv2D per group + Concatenate),
  ``keras_depthwise`` (depthwise layers: ``keras.layers.DepthwiseConv2D``, what a Keras user
  writes there instead of a split into hundreds of groups);
* ``torch_nchw`` / ``torch_cl``: ``torch.nn.Conv2d(groups=g)`` on NCHW tensors, contiguous or
  ``channels_last`` (input and module), eager; measured in every backend's process too.
* ``keras_conv2d_again``, a control: keras Conv2D built and timed a second time. Its speed
  against the first copy's is the run's noise floor, what the same op measures apart
  (:data:`benchmarks.peers.CONTROLS`).

on each Keras backend (one process per backend, dtype and net; ``KERAS_BACKEND`` is set before
keras is imported) in float32 and bfloat16 (Keras: the ``mixed_bfloat16`` policy; PyTorch:
``torch.autocast("cpu", torch.bfloat16)``; float32 weights). Candidates are timed side by side
in rounds (per round, each library's candidates together in a shuffled order, each timed call
after an untimed one -- after up to four where the library changed: :func:`round_order`,
:data:`SWITCH_WARM_CALLS`), best of ``--repeats`` rounds -- more on short layers: rounds are
added (up to :data:`MAX_ROUNDS`, ``--max-rounds``) until every candidate has been timed for
:data:`MIN_TIMED_S` seconds (``--min-timed``), since a best of 3 on a 2-9 ms layer differed by
about 10% from one run of the table to the next on a 2-core machine.

The GEMM ceiling: the best square matrix product (512, 1024 and 2048) of the backend, PyTorch
and JAX in the run's dtype (and float32), measured in each process at the start and the
fastest again in every round, beside the candidates; a candidate whose forward+backward rate
(3 x the direct convolution's flops / time; for a Winograd lowering, 3 x the multiplications
its GEMMs do) exceeds it is flagged as a measuring error, not reported (``--flag-above peak``: only above the CPU's arithmetic peak,
:func:`benchmarks.common.peak_gflops`; both are recorded).

"plan ms": what the first use of a shape costs the default HybridConv2D beyond what it costs
keras Conv2D: (its first training step, with an empty planner cache -- ``KERAS_CCT_CACHE_DIR``
is a fresh folder per process -- minus a steady-state step) minus the same for keras Conv2D
(both trace a training step, and on JAX compile it: under mixed_bfloat16 a keras Conv2D's
first step alone took 16-29 s on VGG16's layers).

The explicit lowerings are measured on CaffeNet only by default (``--lowerings all``: on every
net; each costs a trace per shape, which dominates the run on ResNet-50's and MobileNet's many
small shapes).

Writes ``convs.json``, ``convs.md`` and ``convs.png`` (the page and the plot rendered by
:mod:`benchmarks.convs_report`) under ``--out`` (default ``docs/benchmarks/``); the JSON and
the page also after each process, marked partial, so that a run cut short keeps what it
measured; each process' standard error goes to ``<out>/logs/convs-*.log``.
Run: ``python -m benchmarks.convs [--quick] [--nets caffenet,vgg16,resnet50,mobilenet]
[--backends tensorflow,jax,torch] [--dtypes float32,bfloat16] [--repeats N] [--out DIR]
[--lowerings all|caffenet|none] [--flag-above gemm|peak] [--layers a,b] [--batch N]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.common import (DEFAULT_OUT, ROOT, cpu_info, library_of, library_versions,
                               matmul_ceiling, onednn_versions, peak_gflops, round_order,
                               spawn_config, winograd_share)
from benchmarks.convs_report import (CEILING_SIZES, MAX_ROUNDS, MIN_TIMED_S, SLOW_FACTOR, SLOW_S,
                                     markdown, plot, summarize)

PROTOTXT = ROOT.parent / "shared" / "caffe-models" / "prototxt-only"
# net: (prototxt under PROTOTXT, batch, input h=w). CaffeNet at its real size; the others
# reduced so that the whole run (4 nets x 3 backends x 2 dtypes) takes about half an hour on
# two cores: VGG16 at batch 8 on 112x112 (a quarter of the flops of 224x224), ResNet-50 at
# batch 4 on 224x224 (its 7x7 pool5 needs the full size), MobileNet at batch 16 on 224x224.
NETS = {
    "caffenet": ("bvlc_reference_caffenet/deploy.prototxt", 32, 227),
    "vgg16": ("vgg16/deploy.prototxt", 8, 112),
    "resnet50": ("resnet50/ResNet-50-deploy.prototxt", 4, 224),
    "mobilenet": ("mobilenet_caffe/mobilenet_deploy.prototxt", 16, 224),
}
#: --quick: a smoke test of the whole harness (every backend, dtype and peer; the explicit
#: lowerings are left to tests/test_benchmarks.py) in about 3 minutes on a quiet machine.
QUICK = {"net": "caffenet", "layers": ("conv2", "conv3"), "batch": 8, "repeats": 2}
BACKENDS = ("tensorflow", "jax", "torch")
DTYPES = ("float32", "bfloat16")
#: Idle seconds (not counted) before every timed call: the previous call's thread pools stop
#: spinning, so that an idle pool does not slow the next candidate down (PyTorch's convolutions
#: in the TensorFlow process measured up to 40x slower without it: 119 ms instead of 2.9 ms on
#: a ResNet-50 1x1 convolution; a pause only where the library changes was not enough).
SETTLE_S = float(os.environ.get("CCT_CONVS_SETTLE_S", "0.02"))
#: Each timed call follows an untimed call of the same candidate: what ran before it (the other
#: library's step, a pause) otherwise changes its time by more than the differences measured.
#: Seen (ResNet-50 res4b_branch2a, TF, batch 4): a 4.5 ms TF convolution took 5.4 ms after a
#: PyTorch step and 5.0 ms after a TF step, each followed by a 50 ms pause.
WARM_CALLS = 1
#: Untimed calls before a timed call that follows another library's step (or the round's GEMM
#: probes): one is not enough. A library's threads slow down while the other library runs, and
#: the next steps are slow until they are busy again. Seen (56x56x256->128 1x1 stride 2,
#: batch 4, TF, min of 40, ms, by step after the switch): TF after PyTorch 5.39, 5.06, 4.86,
#: 4.67, 4.64 against 4.69, 4.58, 4.51, 4.43, 4.43 after TF; PyTorch after TF 4.75, 4.39, 4.26,
#: 4.10, 4.04 against 4.08, 4.02, 4.09, 3.99, 4.10 after PyTorch. With a fixed round-robin order
#: (the default HybridConv2D always the first TF candidate after PyTorch's), this cost the
#: default 5-10% against keras Conv2D on 2-6 ms layers: swapping the two candidates' places
#: swapped which one lost (ratios 0.90-0.97 -> 1.02-1.18). At most :data:`SWITCH_WARM_S` seconds
#: of them (on the long layers a step's share of the slowdown is small).
SWITCH_WARM_CALLS, SWITCH_WARM_S = 4, 0.3
#: The timing procedure, as the report states it.
TIMING = ("all candidates of a shape timed in one process, in rounds; per round each library's "
          "candidates together (the backend's or PyTorch's first, alternately) in a shuffled "
          "order, each timed call right after an untimed call of the same candidate, after "
          f"up to {SWITCH_WARM_CALLS} ({SWITCH_WARM_S:g} s) where the library changed")


# ------------------------------------------------------------------------------ layer shapes

def net_layers(net: str, batch: int, size: int) -> List[dict]:
    """The distinct convolution shapes of ``net`` (in order of first use), each with the names
    of the layers that have it."""
    import keras  # noqa: F401 -- the backend this process runs
    from keras_cct import HybridConv2D
    from keras_cct.caffe import load_net
    path = PROTOTXT / NETS[net][0]
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found; the benchmark reads the Caffe prototxts "
                                f"from ../shared/caffe-models/prototxt-only/ beside the checkout")
    # lowering="native": no planner work while reading the shapes
    model = load_net(str(path), input_shape=(batch, 3, size, size),
                     conv_options={"lowering": "native"})
    shapes: Dict[str, dict] = {}
    for layer in model.layers:
        if not isinstance(layer, HybridConv2D):
            continue
        _, h, w, c = layer.input.shape
        shp = {"h": int(h), "w": int(w), "c": int(c), "o": layer.filters,
               "k": list(layer.kernel_size), "s": list(layer.strides),
               "pad": [list(p) for p in layer.padding], "d": list(layer.dilation_rate),
               "g": layer.groups, "bias": bool(layer.use_bias)}
        key = json.dumps(shp, sort_keys=True)
        shapes.setdefault(key, dict(shp, names=[]))["names"].append(layer.name)
    return list(shapes.values())


def shape_label(shp: dict) -> str:
    (pt, _), (pl, _) = shp["pad"]
    g = f" g{shp['g']}" if shp["g"] > 1 else ""
    return (f"{shp['h']}x{shp['w']}x{shp['c']}->{shp['o']} k{shp['k'][0]}x{shp['k'][1]} "
            f"s{shp['s'][0]} p{pt}{g}")


# ------------------------------------------------------------------------------ one process

def _gflop(shp: dict, batch: int) -> float:
    from benchmarks.peers import geometry
    return geometry(shp, batch).flops(batch) / 1e9


#: Libraries whose GEMM is measured in every process (besides the backend's): the ceiling is
#: the best of them, since one library's GEMM may be far from the machine's (PyTorch's float32
#: ``mm`` goes to MKL, which runs a slow path on AMD CPUs, while its convolutions use oneDNN).
CEILING_LIBS = ("torch", "jax")


#: How many of the fastest products are measured again in every round, beside the candidates
#: (the ceiling's best-of gets as many tries under the same load as theirs).
PROBES = 3


def ceiling_keys(backend: str, dtype: str, sizes=None) -> List[str]:
    """``"<library> <dtype> <n>"`` of the GEMMs bounding a run: every library in ``dtype``, and
    in float32 too for bfloat16 runs (a library may compute a bfloat16 op in float32), at each
    of :data:`CEILING_SIZES`."""
    libs = list(dict.fromkeys((backend,) + CEILING_LIBS))
    dtypes = list(dict.fromkeys((dtype, "float32")))
    return [f"{lib} {dt} {n}" for dt in dtypes for lib in libs for n in sizes or CEILING_SIZES]


def gemm_probe(key: str):
    """A callable timing one product of ``key`` (``"<library> <dtype> <n>"``), returning
    GFLOP/s."""
    from benchmarks.common import matmul_step
    lib, dt, n = key.split()
    step, flop = matmul_step(lib, dt, int(n))

    def probe():
        t0 = time.perf_counter()
        step()
        return flop / (time.perf_counter() - t0) / 1e9

    probe()
    return probe


def _why(exc: BaseException) -> str:
    """One line saying why a candidate failed (TensorFlow puts the cause on the last lines of
    its 'in user code:' traceback)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    cause = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
    return f"{type(exc).__name__}: {cause[:400]}"


def measure_layer(shp: dict, batch: int, backend: str, dtype: str, repeats: int,
                  ceilings: Dict[str, float], probes: Optional[dict] = None,
                  lowerings: bool = True, max_rounds: int = MAX_ROUNDS,
                  min_timed_s: float = MIN_TIMED_S) -> dict:
    """Every candidate on one shape: first-call ms, best-of-rounds ms, GFLOP/s. ``ceilings``
    (GFLOP/s per GEMM) is raised by the ``probes`` (run in every round: the ceiling is
    measured under the same load as the candidates); measuring errors are flagged afterwards
    by :func:`flag` against the process' final ceiling."""
    from benchmarks import peers
    from keras_cct.lowering.dispatch import WINOGRAD_TILE
    bf16 = dtype == "bfloat16"
    x, r = peers.inputs(shp, batch)
    gflop = _gflop(shp, batch)
    res: Dict[str, dict] = {}
    steps = {}
    # the default first (its first call is the plan cost, nothing of this shape warmed up)
    for name in peers.candidate_names(shp):
        entry = res[name] = {}
        if not lowerings and name.startswith("hybrid_"):
            entry["skipped"] = "explicit lowerings not run on this net (--lowerings)"
            continue
        try:
            t0 = time.perf_counter()
            step, info = peers.build(name, shp, batch, x, r, bf16)
            step()
            entry["first_ms"] = 1e3 * (time.perf_counter() - t0)
            entry.update(info)
            steps[name] = step
        except peers.Skip as exc:
            entry["skipped"] = str(exc)
        except Exception as exc:  # noqa: BLE001 -- recorded, the others still run
            entry["error"] = _why(exc)
    best = {name: math.inf for name in steps}
    rounds = {name: 0 for name in steps}
    names = list(steps)
    timed = {name: 0.0 for name in steps}
    rnd = 0
    while names and (rnd < repeats or (rnd < max_rounds and min(
            timed[n] for n in names) < min_timed_s)):
        order = round_order(names, rnd, backend)
        rnd += 1
        for key, probe in (probes or {}).items():
            time.sleep(SETTLE_S)
            ceilings[key] = max(ceilings[key], probe())
        last_lib = "probes"
        for name in order:
            try:
                lib = library_of(name, backend)
                t_warm = time.perf_counter()
                for i in range(SWITCH_WARM_CALLS if lib != last_lib else WARM_CALLS):
                    if i and time.perf_counter() - t_warm > SWITCH_WARM_S:
                        break
                    time.sleep(SETTLE_S)
                    steps[name]()  # untimed
                last_lib = lib
                time.sleep(SETTLE_S)
                t0 = time.perf_counter()
                steps[name]()
                dt = time.perf_counter() - t0
                best[name] = min(best[name], dt)
                timed[name] += dt
                rounds[name] += 1
            except Exception as exc:  # noqa: BLE001
                res[name]["error"] = _why(exc)
                names.remove(name)
        fastest = min((best[n] for n in names), default=math.inf)
        names = [n for n in names if best[n] <= max(SLOW_S, SLOW_FACTOR * fastest)]
    for name, t in best.items():
        entry = res[name]
        if "error" in entry or not math.isfinite(t):
            continue
        entry["ms"] = 1e3 * t
        entry["rounds"] = rounds[name]
        entry["gflops"] = 3 * gflop / t
        lowering = entry.get("lowering") or entry.get("pick")
        if lowering in WINOGRAD_TILE:  # fewer multiplications than the direct convolution
            entry["work_gflops"] = entry["gflops"] * _winograd_share(shp, batch, lowering)
    for name in ("hybrid", "keras_conv2d"):
        if "ms" in res.get(name, {}):  # first use: build + trace (+ plan) minus a steady step
            res[name]["first_extra_ms"] = res[name]["first_ms"] - res[name]["ms"]
    if "ms" in res.get("hybrid", {}) and "ms" in res.get("keras_conv2d", {}):
        # what choosing costs: both first uses trace (JAX: compile) a training step
        res["hybrid"]["plan_ms"] = max(0.0, res["hybrid"]["first_extra_ms"]
                                       - res["keras_conv2d"]["first_extra_ms"])
    del steps
    gc.collect()
    return {"shape": {k: v for k, v in shp.items() if k != "names"}, "names": shp["names"],
            "label": shape_label(shp), "gflop_fwd": gflop, "candidates": res}


def _winograd_share(shp: dict, batch: int, lowering: str) -> float:
    """:func:`benchmarks.common.winograd_share` of a layer's shape."""
    from benchmarks.peers import geometry
    return winograd_share(geometry(shp, batch), lowering)


def flag(layers: List[dict], ceiling: float, peak: Optional[float], dtype: str,
         policy: str) -> None:
    """Mark each candidate faster than the GEMM ceiling (``above_gemm``) or than the CPU's
    peak (``above_peak``; none on an accelerator: ``peak`` None); with ``policy`` "gemm" the
    first, with "peak" only the second is a measuring error (left out of the ratios)."""
    for layer in layers:
        for entry in layer["candidates"].values():
            if "gflops" not in entry:
                continue
            # a Winograd lowering is judged by the multiplications it does, not the direct ones
            rate = entry.get("work_gflops", entry["gflops"])
            entry["above_gemm"] = rate > ceiling
            entry["above_peak"] = peak is not None and rate > peak
            if entry["above_peak"]:
                entry["measuring_error"] = (f"{rate:.0f} GFLOP/s > the CPU's {dtype} "
                                            f"peak {peak:.0f}")
            elif entry["above_gemm"] and policy == "gemm":
                entry["measuring_error"] = (f"{rate:.0f} GFLOP/s > the {dtype} "
                                            f"GEMM ceiling {ceiling:.0f}")


def run_config(spec: dict) -> dict:
    """One process: ``spec`` = {net, batch, size, dtype, repeats, layers (names to keep, or
    None), shapes (optional: use these instead of reading the net), flag ("gemm"/"peak"),
    quick, ceiling_sizes (optional)}. Prints ``SHAPES n``, then a ``PROGRESS`` line per shape
    measured."""
    import keras
    backend = keras.backend.backend()
    if backend == "tensorflow":  # one tf.function per candidate: retracing warnings are noise
        import tensorflow as tf
        tf.get_logger().setLevel("ERROR")
    dtype = spec["dtype"]
    if dtype == "bfloat16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    import torch  # the PyTorch peers run in every backend's process
    t_start = time.perf_counter()
    shapes = spec.get("shapes") or net_layers(spec["net"], spec["batch"], spec["size"])
    if spec.get("layers"):
        keep = set(spec["layers"])
        shapes = [dict(s, names=[n for n in s["names"] if n in keep]) for s in shapes]
        shapes = [s for s in shapes if s["names"]]
    print(f"SHAPES {len(shapes)}", flush=True)
    ceilings = {key: matmul_ceiling(key.split()[0], key.split()[1], int(key.split()[2]),
                                    repeats=2 if spec.get("quick") else 3)
                for key in ceiling_keys(backend, dtype, spec.get("ceiling_sizes"))}
    start_ceilings = dict(ceilings)
    # the fastest products (but not 2048^3: slow to repeat) again in every round of every shape
    fastest = sorted((k for k in ceilings if not k.endswith(" 2048")), key=ceilings.get,
                     reverse=True)[:PROBES]
    probes = {key: gemm_probe(key) for key in fastest}
    layers = []
    for shp in shapes:
        layers.append(measure_layer(shp, spec["batch"], backend, dtype, spec["repeats"],
                                    ceilings, probes, spec.get("lowerings", True),
                                    spec.get("max_rounds", spec["repeats"] if spec.get(
                                        "quick") else MAX_ROUNDS),
                                    spec.get("min_timed_s", MIN_TIMED_S)))
        print(f"PROGRESS {shp['names'][0]}", flush=True)
    ceiling = max(ceilings.values())
    from keras_cct.lowering import _backend as B
    device = B.device_name()
    # the CPU's peak bounds nothing run on an accelerator: there the GEMM ceiling, measured on
    # the device, is the only check
    peak = peak_gflops(dtype) if device is None else {
        "gflops": None, "note": f"on {device}: the CPU's peak does not apply"}
    flag(layers, ceiling, peak["gflops"], dtype, spec.get("flag", "gemm"))
    from keras_cct.lowering.precision import arithmetic_dtype
    return {"backend": backend, "dtype": dtype, "net": spec["net"], "batch": spec["batch"],
            "size": spec["size"], "device": device, "ceiling_gflops": ceiling,
            "arithmetic": arithmetic_dtype(dtype),  # what HybridConv2D computed dtype in
            "ceilings_gflops": ceilings,
            "peak": peak, "flag_policy": spec.get("flag", "gemm"),
            "ceilings_at_start_gflops": start_ceilings, "layers": layers,
            "torch_threads": torch.get_num_threads(), "versions": library_versions(),
            "seconds": time.perf_counter() - t_start}


# ------------------------------------------------------------------------------ the parent

def shapes_from(path: Path) -> Dict[str, List[dict]]:
    """net -> its convolution shapes (with their layer names), as an earlier run recorded
    them in ``path`` (a convs.json)."""
    try:
        runs = json.loads(Path(path).read_text())["runs"]
        return {r["net"]: [dict(layer["shape"], names=layer["names"]) for layer in r["layers"]]
                for r in runs}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{path}: not a convs.json with shapes ({exc!r})") from None


def _csv(value: str, allowed) -> List[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
    return items


def _write(out: Path, args, argv, t0: float, repeats: int, nets: dict, runs: list,
           failures: list, jobs: int):
    """Write convs.json and convs.md (and, once every process is done, convs.png) from the
    processes done so far: a run cut short (a time limit on a lent machine) keeps them, marked
    partial. Returns ``(data, markdown)``."""
    command = "python -m benchmarks.convs " + " ".join(
        sys.argv[1:] if argv is None else argv)
    done = len(runs) + len(failures)
    data = {"command": command.strip(), "when": time.strftime("%Y-%m-%d %H:%M %Z"),
            "seconds": time.perf_counter() - t0, "repeats": repeats,
            "min_timed_s": args.min_timed, "max_rounds": args.max_rounds,
            "machine": {"cpu": cpu_info(), "versions": library_versions(),
                        "onednn": onednn_versions(),
                        "accelerators": sorted({r["device"] for r in runs if r.get("device")}),
                        "torch_threads": sorted({r["torch_threads"] for r in runs})},
            "nets": {n: {"batch": b, "size": s, "prototxt": NETS[n][0]}
                     for n, (b, s) in nets.items()},
            "timing": TIMING,
            "runs": runs, "failures": failures, "flag_above": args.flag_above,
            "lowerings": args.lowerings, "processes": {"done": done, "planned": jobs}}
    data["summary"] = summarize(runs)
    data["summary_above_gemm_kept"] = summarize(runs, loose=True)
    md = markdown(data)
    if failures:
        md += "\n## Failed processes\n\n" + "\n".join(
            f"- {f['backend']} {f['dtype']} {f['net']}: {f['error']}" for f in failures) + "\n"
    if done < jobs:
        title, rest = md.split("\n", 1)
        md = (f"{title}\n\n> **Partial**: {done} of {jobs} processes (backend, dtype, net) "
              f"done when this was written.\n{rest}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "convs.json").write_text(json.dumps(data, indent=1))
    (out / "convs.md").write_text(md)
    if done == jobs:
        plot(data, out / "convs.png")
    return data, md


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convs",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="CaffeNet conv2 + conv3 only, batch 8, 2 repeats (a smoke test)")
    parser.add_argument("--nets", type=lambda v: _csv(v, NETS), default=list(NETS))
    parser.add_argument("--backends", type=lambda v: _csv(v, BACKENDS), default=list(BACKENDS))
    parser.add_argument("--dtypes", type=lambda v: _csv(v, DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--min-timed", dest="min_timed", type=float, default=MIN_TIMED_S,
                        help=f"seconds of timed calls every candidate gets on a short layer "
                             f"(default {MIN_TIMED_S}; more resolves smaller differences)")
    parser.add_argument("--max-rounds", dest="max_rounds", type=int, default=None,
                        help=f"at most this many rounds per shape (default {MAX_ROUNDS}; "
                             f"--quick: --repeats)")
    parser.add_argument("--layers", default=None,
                        help="comma-separated layer names to keep (default: all)")
    parser.add_argument("--batch", type=int, default=None, help="override every net's batch")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    parser.add_argument("--lowerings", choices=("all", "caffenet", "none"), default=None,
                        help="where HybridConv2D's explicit lowerings (type1/2/3, native, "
                             "winograd) are measured beside the default: every net, CaffeNet "
                             "only (default; about 10 s of tracing per candidate and shape "
                             "otherwise dominates the run), or nowhere (default with --quick)")
    parser.add_argument("--shapes-from", type=Path, default=None,
                        help="each net's convolution shapes from an earlier convs.json instead "
                             "of the prototxts (a machine without ../shared beside the "
                             "checkout, e.g. a GPU machine)")
    parser.add_argument("--flag-above", choices=("gemm", "peak"), default="gemm",
                        help="a rate above what is a measuring error: the best GEMM measured "
                             "(default) or the CPU's arithmetic peak (both are recorded)")
    args = parser.parse_args(argv)
    from tqdm import tqdm
    nets = {n: (NETS[n][1], NETS[n][2]) for n in args.nets}
    layers = args.layers.split(",") if args.layers else None
    repeats = args.repeats or 3
    if args.lowerings is None:
        args.lowerings = "none" if args.quick else "caffenet"
    if args.quick:
        nets = {QUICK["net"]: (QUICK["batch"], NETS[QUICK["net"]][2])}
        layers = layers or list(QUICK["layers"])
        repeats = args.repeats or QUICK["repeats"]
    if args.max_rounds is None:
        args.max_rounds = repeats if args.quick else MAX_ROUNDS
    if args.batch:
        nets = {n: (args.batch, size) for n, (_, size) in nets.items()}
    known_shapes = shapes_from(args.shapes_from) if args.shapes_from else {}
    out = args.out.resolve()
    logs = out / "logs"
    t0 = time.perf_counter()
    jobs = [(b, d, n) for b in args.backends for d in args.dtypes for n in nets]
    runs, failures = [], []
    shape_counts: Dict[str, int] = {}  # net -> shapes, once a process has said (SHAPES n)

    def expected() -> int:
        known = [shape_counts[n] for _, _, n in jobs if n in shape_counts]
        guess = max(known, default=5)
        return sum(shape_counts.get(n, guess) for _, _, n in jobs)

    with tqdm(total=expected(), desc="convs", unit="shape") as bar:
        for backend, dtype, net in jobs:
            bar.set_postfix_str(f"{backend} {dtype} {net}")
            cache = tempfile.mkdtemp(prefix="cct-convs-cache-")
            spec = {"net": net, "batch": nets[net][0], "size": nets[net][1], "dtype": dtype,
                    "repeats": repeats, "layers": layers, "quick": args.quick,
                    "max_rounds": args.max_rounds, "min_timed_s": args.min_timed,
                    "lowerings": args.lowerings == "all" or (args.lowerings == "caffenet"
                                                             and net == "caffenet"),
                    "ceiling_sizes": [512, 1024] if args.quick else None,
                    "flag": args.flag_above, "shapes": known_shapes.get(net)}
            done = [0]

            def on_line(line, done=done, net=net):
                if line.startswith("SHAPES"):
                    shape_counts[net] = int(line.split()[1])
                    bar.total = expected()
                    bar.refresh()
                elif line.startswith("PROGRESS"):
                    done[0] += 1
                    bar.update(1)

            try:
                runs.append(spawn_config(
                    "benchmarks.convs", spec, backend=backend, timeout=args.timeout,
                    env={"KERAS_CCT_CACHE_DIR": cache}, on_line=on_line,
                    log_path=logs / f"convs-{backend}-{dtype}-{net}.log"))
            except RuntimeError as exc:
                failures.append({"backend": backend, "dtype": dtype, "net": net,
                                 "error": str(exc)})
                tqdm.write(f"{backend} {dtype} {net}: {exc}", file=sys.stderr)
                bar.update(max(shape_counts.get(net, done[0]) - done[0], 0))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            if len(runs) + len(failures) < len(jobs):  # what is done so far, in case the
                _write(out, args, argv, t0, repeats, nets, runs, failures, len(jobs))  # run stops
    data, md = _write(out, args, argv, t0, repeats, nets, runs, failures, len(jobs))
    print(md)
    return data


if __name__ == "__main__":
    main()
    sys.exit(0)
