"""The benchmark suite cannot rot: a tiny configuration of each part (RQ1-RQ5), the kernels of
the batching benchmark against the float64 reference, the summary and ``cct bench``."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests import reference as ref
from tests.conftest import IN_CI, ROOT

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                reason="the benchmarks run on the TensorFlow backend")


class _Count:
    """A stand-in for tqdm that counts updates."""

    def __init__(self):
        self.n = 0

    def update(self, k=1):
        self.n += k


def _finite_positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


@pytest.fixture(scope="module")
def opencl_name():
    from keras_cct.devices import list_devices
    names = [d.name for d in list_devices(calibrate=False, sub_devices=True) if d.is_opencl]
    if "opencl:0:0" not in names:
        if IN_CI:
            pytest.fail("no OpenCL device: ci/test installs PoCL (pocl-opencl-icd)")
        pytest.skip("no OpenCL platform on this machine (install pocl-opencl-icd)")
    return "opencl:0:0"


# ------------------------------------------------------------------------------ RQ1 batching

@pytest.mark.parametrize("hw,c,o,k,s,p,g", [(9, 4, 6, 3, 2, 1, 2), (7, 3, 4, 3, 1, 0, 1)])
def test_batching_kernels_match_reference(hw, c, o, k, s, p, g):
    """The lowering + GEMM + col2im the benchmark times compute the real convolution and its
    gradients, also when the batch is run as two partitions (kernel gradients summed)."""
    from benchmarks.batching import ConvSpec, _ConvWork
    spec = ConvSpec("t", hw, c, o, k, s, p, g)
    work = _ConvWork(spec, 3, np.random.default_rng(0))
    x = work.xp[:, p:p + hw, p:p + hw].copy()
    kernel = np.concatenate([w.reshape(k, k, c // g, o // g) for w in work.w], axis=-1)
    rows = spec.out * spec.out
    dy = work.dy.reshape(g, 3, spec.out, spec.out, o // g).transpose(1, 2, 3, 0, 4).reshape(
        3, spec.out, spec.out, o)
    work.run(0, 1)
    work.run(1, 2)  # a second partition accumulating into the same kernel gradient
    y = work.y.reshape(g, 3, spec.out, spec.out, o // g).transpose(1, 2, 3, 0, 4).reshape(
        3, spec.out, spec.out, o)
    assert ref.rel_err(y, ref.conv2d(x, kernel, strides=s, padding=p, groups=g)) < 1e-5
    dx, dk, _ = ref.conv2d_grads(x, kernel, dy, strides=s, padding=p, groups=g)
    got_dk = np.concatenate([w.reshape(k, k, c // g, o // g) for w in work.dw], axis=-1)
    assert ref.rel_err(got_dk, dk) < 1e-5
    assert ref.rel_err(work.dxp[:, p:p + hw, p:p + hw], dx) < 1e-5
    assert rows * 3 == work.y.shape[1]


def test_batching_split():
    from benchmarks.batching import _split
    assert _split(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert _split(2, 4) == [(0, 1), (1, 1)]


def test_batching_tiny_run(tmp_path):
    from benchmarks import batching
    from benchmarks.common import write_results
    convs = [batching.ConvSpec("a", 9, 3, 8, 3, 2, 1, 1, need_dx=False),
             batching.ConvSpec("b", 5, 8, 8, 3, 1, 1, 2)]
    progress = _Count()
    data = batching.run(batch=3, repeats=1, cores=2, convs=convs, fcs={"fc": (32, 10)},
                        progress=progress)
    assert progress.n == 3 * len(batching.configurations(2))
    assert data["configs"] == ["caffe", "caffe 1T", "batch whole", "batch p=1", "batch p=2"]
    for name in ("a", "b", "iteration"):
        assert all(_finite_positive(v) for v in data["images_per_s"][name].values())
    md = batching.markdown(data, "test")
    write_results(tmp_path, "batching", data, md)
    batching.plot(data, tmp_path / "batching.png")
    assert (tmp_path / "batching.png").stat().st_size > 1000
    assert "| iteration |" in md


# ------------------------------------------------------------------------------ RQ2 lowering

def test_lowering_sweep_tiny():
    from benchmarks import lowering
    progress = _Count()
    sweep, md = lowering.sweep_part(batch=1, hw=6, repeats=1, points=[-3, 3], progress=progress)
    assert progress.n == 6 and len(sweep["points"]) == 2
    for pt in sweep["points"]:
        assert pt["ms"][pt["fastest"]] == min(pt["ms"].values())
        assert pt["regret"] >= 0
    assert "d/o" in md


def test_lowering_caffenet_part_tiny():
    """Every lowering the layer can use, the Keras peer and the planner's picks are timed; a
    rate above the GEMM ceiling is a measuring error, left out of the ratios."""
    from benchmarks import lowering
    layers = {"a": (9, 8, 8, 3, 1, 1, 1), "b": (9, 4, 8, 3, 2, 0, 2)}
    for ceiling, flagged in ((1e9, False), (1e-9, True)):
        progress = _Count()
        part = lowering.flag(lowering.caffenet_part(2, 1, progress, layers=layers), ceiling,
                             "float32")
        for name, r in part["layers"].items():
            geo = lowering.geometry(name, 2, layers)
            timed = set(lowering.lowerings_of(geo)) | {"keras_conv2d", "type1_autodiff"}
            assert set(r["fwd_ms"]) == set(r["fwd_bwd_ms"]) == timed
            assert all(_finite_positive(v) for v in r["fwd_bwd_ms"].values())
            assert all(r["picks"][m] in lowering.lowerings_of(geo) for m in lowering.MODES)
            fb = r["fwd_bwd_ms"]
            if flagged:
                assert len(r["measuring_errors"]) == 2 * len(timed), r["measuring_errors"]
                assert r["default_vs_keras"] is None and r["fastest"] is None
            else:
                assert r["measuring_errors"] == []
                assert math.isclose(r["default_vs_keras"],
                                    fb["keras_conv2d"] / fb[r["picks"]["auto"]])
                assert r["fastest"] == min((c for c in fb if c in lowering.COLUMNS and
                                            c != "keras_conv2d"), key=fb.get)
        assert progress.n == 2 * sum(len(r["fwd_ms"]) for r in part["layers"].values())
    md = lowering.caffenet_markdown(part, 2, "float32")
    assert "keras Conv2D" in md and "Measuring errors" in md


def test_lowering_fastest_is_among_the_pickable():
    """A layer's fastest lowering is the fastest the planner may pick in the dtype: F(4x4) is
    timed in bfloat16 but left out there (its error), so it is not the fastest there."""
    from benchmarks import lowering
    res = {"above_ceiling": [], "picks": {"auto": "native"}, "fwd_gflops": {},
           "fwd_bwd_ms": {"native": 10.0, "winograd": 8.0, "winograd4": 5.0,
                          "keras_conv2d": 12.0}}
    assert lowering._ratios(res, 1e9, "float32")["fastest"] == "winograd4"
    r = lowering._ratios(res, 1e9, "bfloat16")
    assert r["fastest"] == "winograd" and math.isclose(r["fastest_vs_default"], 0.8)
    assert lowering.pickable(["native", "winograd4"], "bfloat16") == ["native"]


@pytest.mark.slow
def test_lowering_partition_part_times_the_default_too():
    """The partition sweep counts a target in the run's dtype, as the engine does, and times
    the engine's own choice (``default``) beside the targets."""
    from benchmarks import lowering
    from keras_cct.lowering import conv_geometry
    from keras_cct.lowering.cost import lowered_bytes_per_image
    from keras_cct.lowering.engine import default_partitions
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
        part = lowering.partition_part(4, 1, (0, 1), _Count(), dtype)
        hw, c, o, k, s, p, g = lowering.CAFFENET["conv3"]
        geo = conv_geometry((4, hw, hw, c), (k, k, c // g, o), strides=s, padding=p)
        res = part["layers"]["conv3"]
        assert set(res) == {"default", "0", "1"}
        assert res["default"]["partitions"] == default_partitions(geo, "type1", 4, dtype)
        per_image = lowered_bytes_per_image(geo, "type1", nbytes)
        assert res["1"]["partitions"] == -(-4 // max(1, (1 << 20) // per_image))
        assert all(_finite_positive(r["fwd_bwd_gflops"]) for r in res.values())
        md = lowering.partition_markdown(part, 1e9)
        assert "default (as shipped)" in md and "whole batch" in md


def test_lowering_ceiling_is_the_best_probe():
    """The ceiling keeps each product's best rate over its probes, and is the best of them."""
    from benchmarks import lowering
    ceiling = lowering.Ceiling("float32")
    ceiling.probe()
    first = dict(ceiling.gflops)
    ceiling.probe(2)
    assert set(first) == {f"{lib} {n}" for lib in (keras.backend.backend(), "torch")
                          for n in lowering.Ceiling.SIZES}
    assert all(ceiling.gflops[key] >= first[key] > 0 for key in first)
    assert ceiling.value == max(ceiling.gflops.values())


# ------------------------------------------------------------------------------ RQ3 planner

def test_planner_tiny(tmp_path):
    from benchmarks import planner
    layers = {"conv1": (9, 3, 8, 3, 2, 0, 1), "conv2": (5, 8, 8, 3, 1, 1, 2)}
    errors: list = []
    times = planner.layer_times(2, 1, tmp_path, layers=layers, errors=errors)
    assert errors == []
    res = planner.per_layer(2, times, layers=layers, errors=errors)
    assert errors == []
    for name, r in res.items():
        t = r["ms"]
        assert set(t) == set(planner.lowerings_of(planner._geometry(name, 2, layers)))
        assert r["fastest"] == min(t, key=t.get)
        assert r["model_choice"] in ("type1", "type2", "type3")
        assert r["measure_choice"] in t and r["auto_choice"] in t
        for mode in planner.MODES:
            assert math.isclose(r[f"{mode}_regret"],
                                t[r[f"{mode}_choice"]] / min(t.values()) - 1)
    tot = planner.totals(res)
    assert tot["auto_ms"] >= tot["fastest_ms"] > 0 and tot["model_ms"] >= tot["fastest_ms"]


def test_planner_reuses_lowering_json(tmp_path):
    """Times come from benchmarks.lowering's JSON when it holds the same batch and dtype; a
    lowering it did not run (NaN) or flagged as a measuring error is missing, and the fastest
    is taken among the others."""
    from benchmarks import planner
    layer = {n: {"fwd_bwd_ms": {c: 10.0 + i for i, c in enumerate(planner.CANDIDATES)}}
             for n in planner.CAFFENET}
    layer["conv1"]["fwd_bwd_ms"]["type1"] = float("nan")
    layer["conv3"]["above_ceiling"] = ["winograd"]
    (tmp_path / "lowering.json").write_text(json.dumps(
        {"batch": 4, "runs": {"float32": {"caffenet": {"layers": layer}}}}))
    errors: list = []
    times = planner.layer_times(4, 1, tmp_path, errors=errors)
    assert times["conv1"]["type1"] is None and times["conv2"]["type1"] == 10.0
    assert times["conv3"]["winograd"] is None and times["conv3"]["winograd4"] == 15.0
    assert "winograd" not in times["conv1"]  # an 11x11 stride-4 layer cannot use it
    assert errors == ["conv1 type1: not run by benchmarks.lowering",
                      "conv3 winograd: a measuring error in benchmarks.lowering"]
    # regret is taken among the lowerings that ran: type3 (12) vs type2 (11) on conv1
    assert math.isclose(planner._regret(times["conv1"], "type3", times["conv1"]), 1 / 11)
    assert planner._regret(times["conv1"], "type1", times["conv1"]) is None
    # another dtype or batch is not read from it
    assert planner._from_lowering_json(tmp_path, 4, "bfloat16", []) is None
    assert planner._from_lowering_json(tmp_path, 8, "float32", []) is None


def test_planner_memory_guard(monkeypatch):
    """Type 3 on CaffeNet's conv1 is skipped (its temporaries would not fit), not run, by the
    guard keras_cct's planner applies (its budget set here as a user would)."""
    from benchmarks import planner
    from keras_cct.lowering import cost
    monkeypatch.setenv("KERAS_CCT_MEMORY_BUDGET", str(16 << 30))
    geo = planner._geometry("conv1", 32)
    skip = planner.feasible(geo, 32)
    need = 2 * cost(geo, "type3", batch=32).temp_bytes
    assert need > 16 << 30  # the cost model's count: about 77 GB of temporaries, doubled
    assert skip["type3"] and f"{need / 1e9:.1f} GB" in skip["type3"]
    assert skip["type1"] is None and skip["native"] is None and skip["space_to_depth"] is None


@pytest.mark.slow
def test_planner_end_to_end_tiny():
    from benchmarks import planner
    oracle = {n: "type1" for n in planner.CAFFENET}
    for dtype in ("float32", "bfloat16"):
        e2e = planner.end_to_end(1, 1, oracle, oracle, hw=67, fc=16, dtype=dtype)
        assert all(_finite_positive(v) for v in e2e["step_s"].values()), e2e
        assert set(e2e["step_s"]) == {"default (auto)", "planner (model)",
                                      "planner (measure)", "oracle"}
        assert e2e["regret_vs_oracle"]["oracle"] == 0
        assert e2e["lowerings"]["oracle"] == oracle
        assert keras.mixed_precision.global_policy().name == "float32"


# ------------------------------------------------------------------------------ RQ4 hybrid

@pytest.mark.slow
@pytest.mark.opencl
def test_hybrid_tiny_config(opencl_name):
    from benchmarks import hybrid
    res = hybrid._spawn(dict(batch=2, repeats=1, steps=1, cl_threads=1, split=[0.5, 0.5],
                             devices=["tf:cpu:0", opencl_name], tf_threads=1))
    assert _finite_positive(res["layer_images_per_s"])
    assert _finite_positive(res["model_images_per_s"])
    assert math.isclose(sum(res["fractions"].values()), 1.0, rel_tol=1e-6)


# ------------------------------------------------------------------------------ RQ5 flops

def test_flops_fit_against_lstsq():
    from benchmarks.flops import fit
    rng = np.random.default_rng(0)
    x = rng.uniform(10, 400, 6)
    y = 0.3 * x * (1 + 0.05 * rng.standard_normal(6))
    f = fit([{"calibrated_gflops": a, "images_per_s": b} for a, b in zip(x, y)])
    slope = np.linalg.lstsq(x[:, None], y, rcond=None)[0][0]
    assert math.isclose(f["slope_images_per_gflop"], slope, rel_tol=1e-12)
    r2 = 1 - np.sum((y - slope * x) ** 2) / np.sum((y - y.mean()) ** 2)
    assert math.isclose(f["r2"], r2, rel_tol=1e-12)
    assert fit([{"calibrated_gflops": 1.0, "images_per_s": 1.0}]) is None


@pytest.mark.slow
@pytest.mark.opencl
def test_flops_tiny_configs(tmp_path, opencl_name):
    from benchmarks import flops
    layer = dict(hw=6, channels=8, filters=8, kernel=3, pad=1)
    configs = flops.configurations(1, opencl_name, sub_device=False)
    assert list(configs) == ["tf 1T", "opencl 1T"]
    results = {}
    for name, spec in configs.items():
        results[name] = dict(spec, **flops.spawn(dict(spec, batch=2, repeats=1, layer=layer)))
        r = results[name]
        assert _finite_positive(r["calibrated_gflops"]) and _finite_positive(r["step_s"])
        flop = 3 * 2.0 * 2 * 6 * 6 * 9 * 8 * 8
        assert math.isclose(r["achieved_gflops"], flop / r["step_s"] / 1e9, rel_tol=1e-9)
    data = {"batch": 2, "cores": 1, "layer": layer, "configs": results,
            "fit": flops.fit(list(results.values())), "fit_tf": None, "fit_opencl": None}
    flops.plot(data, tmp_path / "flops.png")
    assert "R^2" in flops.markdown(data, "test")


# ------------------------------------------------------------------------------ convs (peers)

_TINY_CONVS = [  # a grouped 3x3 (every candidate applies) and a depthwise one
    {"h": 6, "w": 6, "c": 4, "o": 8, "k": [3, 3], "s": [1, 1], "pad": [[1, 1], [1, 1]],
     "d": [1, 1], "g": 2, "bias": True, "names": ["a"]},
    {"h": 5, "w": 5, "c": 4, "o": 4, "k": [3, 3], "s": [2, 2], "pad": [[1, 1], [1, 1]],
     "d": [1, 1], "g": 4, "bias": False, "names": ["b", "b2"]},
]


def _check_convs_run(run, backend, dtype):
    from benchmarks import convs_report, peers
    assert run["backend"] == backend and run["dtype"] == dtype
    assert _finite_positive(run["ceiling_gflops"]) and _finite_positive(run["peak"]["gflops"])
    a, b = run["layers"]
    assert b["names"] == ["b", "b2"]
    for layer in (a, b):
        cands = layer["candidates"]
        assert set(cands) == set(peers.candidate_names(layer["shape"]))
        for name, e in cands.items():
            if name.startswith("hybrid_winograd") and "error" in e:
                continue  # the lowering may not be wired into HybridConv2D yet
            assert "error" not in e, (name, e)
            assert ("ms" in e) != ("skipped" in e), (name, e)
            if "ms" in e:
                assert _finite_positive(e["ms"]) and _finite_positive(e["gflops"])
                assert e["rounds"] >= 1 and "above_gemm" in e
        assert "pick" in cands["hybrid"] and "plan_ms" in cands["hybrid"]
    assert "skipped" in a["candidates"]["keras_depthwise"]
    for layer in (a, b):  # the control: keras Conv2D again, timed, never a peer
        assert "ms" in layer["candidates"]["keras_conv2d_again"]
        assert convs_report.ratios(layer)["noise"] > 0
    assert "ms" in a["candidates"]["keras_split"] and "ms" in b["candidates"]["keras_depthwise"]
    assert "skipped" in b["candidates"]["hybrid_winograd"]  # stride 2
    for name, tile in (("hybrid_winograd", 2), ("hybrid_winograd4", 4)):
        e = a["candidates"][name]  # 6x6 output: (tile + 2)^2 products per tile of tile^2
        if "ms" in e:  # judged by the products its GEMMs do, not the direct convolution's
            share = (tile + 2) ** 2 * (-(-6 // tile)) ** 2 / (9 * 36)
            assert math.isclose(e["work_gflops"], e["gflops"] * share)
    rt = convs_report.ratios(a)
    assert rt["best_peer"] in convs_report.PEER_SET


def test_convs_tiny_in_process(tmp_path, monkeypatch):
    """Every candidate of the per-layer benchmark builds, trains and is timed on two tiny
    shapes (TensorFlow, float32), and the report (markdown, PNG) is written."""
    from benchmarks import convs, convs_report
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path / "cache"))
    from benchmarks.common import cpu_info, library_versions
    run = convs.run_config({"net": "tiny", "batch": 2, "size": 6, "dtype": "float32",
                            "repeats": 1, "shapes": _TINY_CONVS, "quick": True,
                            "ceiling_sizes": [256]})
    _check_convs_run(run, "tensorflow", "float32")
    data = {"command": "test", "when": "now", "seconds": 1.0, "repeats": 1,
            "machine": {"cpu": cpu_info(), "versions": library_versions()},
            "runs": [run], "failures": [], "flag_above": "gemm"}
    data["summary"] = convs_report.summarize([run])
    data["summary_above_gemm_kept"] = convs_report.summarize([run], loose=True)
    assert data["summary"]["tensorflow float32"]["layers"] == 2
    md = convs_report.markdown(data)
    assert "## tiny, tensorflow, float32" in md and "GEMM ceiling" in md
    convs_report.plot(data, tmp_path / "convs.png")
    assert (tmp_path / "convs.png").stat().st_size > 1000


def test_convs_rounds_follow_min_timed_and_max_rounds(tmp_path, monkeypatch):
    """--min-timed / --max-rounds: a candidate short of the timed seconds gets rounds up to
    the maximum, no more."""
    from benchmarks import convs
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path / "cache"))
    run = convs.run_config({"net": "tiny", "batch": 2, "size": 6, "dtype": "float32",
                            "repeats": 1, "shapes": _TINY_CONVS[:1], "quick": True,
                            "ceiling_sizes": [256], "lowerings": False,
                            "max_rounds": 3, "min_timed_s": 100.0})
    rounds = {name: c["rounds"] for name, c in run["layers"][0]["candidates"].items()
              if "rounds" in c}
    assert rounds and set(rounds.values()) == {3}, rounds


@pytest.mark.slow
def test_convs_tiny_spawned_jax_bfloat16(tmp_path):
    """The same in its own process on the JAX backend under the mixed_bfloat16 policy (the
    PyTorch peers under autocast), HybridConv2D told to compute in float32: the run records
    it."""
    from benchmarks.common import spawn_config
    lines = []
    run = spawn_config("benchmarks.convs", {
        "net": "tiny", "batch": 2, "size": 6, "dtype": "bfloat16", "repeats": 1,
        "shapes": _TINY_CONVS, "quick": True, "ceiling_sizes": [256]}, backend="jax",
        on_line=lines.append, timeout=600,
        env={"KERAS_CCT_CACHE_DIR": str(tmp_path), "KERAS_CCT_16BIT": "float32"})
    _check_convs_run(run, "jax", "bfloat16")
    assert run["arithmetic"] == "float32"
    assert lines[0] == "SHAPES 2" and sum(x.startswith("PROGRESS") for x in lines) == 2


def test_round_order_has_no_fixed_neighbour():
    """Each round times every candidate once, each library's together, the backend's and
    PyTorch's first in turn; over the rounds no candidate always follows the same one (a fixed
    order had put the default HybridConv2D right after PyTorch's steps in every round, which
    cost it 5-10% on short layers)."""
    from benchmarks.common import round_order
    names = ["hybrid", "hybrid_native", "keras_conv2d", "keras_split", "torch_nchw",
             "torch_cl"]
    before = {n: set() for n in names}
    for rnd in range(10):
        order = round_order(names, rnd, "tensorflow")
        assert sorted(order) == sorted(names)
        libs = ["torch" if n.startswith("torch_") else "tf" for n in order]
        first = "tf" if rnd % 2 == 0 else "torch"  # each library's block first in turn
        assert libs == sorted(libs, key=lambda lib: lib != first)
        for prev, name in zip(["probes"] + order, order):
            before[name].add(prev)
    assert all(len(prev) >= 3 for prev in before.values()), before


def test_nets_rounds_change_order():
    """benchmarks.nets times every candidate once per round, Keras' and PyTorch's first in
    turn (a fixed order had charged the step after a library switch to keras_cct and
    torch_nchw in every round)."""
    from benchmarks import nets
    calls = []
    steps = {k: (lambda k=k: calls.append(k)) for k in
             ("keras_cct", "keras_conv2d", "torch_nchw", "torch_cl")}
    times = nets.measure(steps, rounds=6, warmup=1, gap=0.0)
    assert all(len(v) == 6 for v in times.values())
    rounds = [calls[i:i + 4] for i in range(0, len(calls), 4)]
    assert len(rounds) == 7 and all(sorted(r) == sorted(steps) for r in rounds)
    firsts = [r[0].startswith("torch_") for r in rounds]
    assert firsts == [i % 2 == 1 for i in range(7)], rounds
    after_switch = {r[2] for r in rounds}  # the first of the second library's block
    assert len(after_switch) == 4, rounds


def test_convs_flags_and_ratios():
    """Rates above the GEMM ceiling are measuring errors (or only above the peak with
    policy "peak") and are left out of the ratios; the best peer is the fastest valid one."""
    from benchmarks import convs, convs_report
    gf = 1.0  # forward GFLOP: rate = 3 / seconds

    def layer(**ms):
        return {"names": ["x"], "gflop_fwd": gf, "candidates": {
            k: {"ms": v, "gflops": 3 * gf / (v / 1e3)} for k, v in ms.items()}}

    a = layer(hybrid=30.0, keras_conv2d=40.0, torch_nchw=20.0, torch_cl=35.0)
    convs.flag([a], ceiling=120.0, peak=1000.0, dtype="float32", policy="gemm")
    c = a["candidates"]
    assert "measuring_error" in c["torch_nchw"] and "measuring_error" not in c["hybrid"]
    rt = convs_report.ratios(a)
    assert rt["best_peer"] == "torch_cl" and math.isclose(rt["vs_best_peer"], 35 / 30)
    assert math.isclose(rt["vs_conv2d"], 40 / 30)  # speed-ups: > 1, keras_cct faster
    b = layer(hybrid=2.0, keras_conv2d=40.0, torch_nchw=20.0)
    convs.flag([b], ceiling=120.0, peak=1000.0, dtype="float32", policy="peak")
    assert b["candidates"]["torch_nchw"]["above_gemm"]
    assert "measuring_error" not in b["candidates"]["torch_nchw"]
    assert "peak" in b["candidates"]["hybrid"]["measuring_error"]
    assert convs_report.ratios(b)["vs_conv2d"] is None
    convs.flag([a], ceiling=120.0, peak=1000.0, dtype="float32", policy="gemm")
    loose = convs_report.ratios(a, loose=True)  # torch_nchw's 150 GFLOP/s kept: below the peak
    assert loose["best_peer"] == "torch_nchw" and math.isclose(loose["vs_best_peer"], 20 / 30)
    # the control (keras Conv2D again) is the noise floor, never the best peer
    d = layer(hybrid=30.0, keras_conv2d=40.0, torch_cl=35.0, keras_conv2d_again=32.0)
    convs.flag([d], ceiling=1000.0, peak=1000.0, dtype="float32", policy="gemm")
    rt = convs_report.ratios(d)
    assert rt["best_peer"] == "torch_cl" and math.isclose(rt["noise"], 40 / 32)
    summary = convs_report.summarize([{"backend": "jax", "dtype": "float32", "net": "n",
                                       "layers": [d, a]}])["jax float32"]
    assert (summary["noise_compared"], summary["noise_under_097"]) == (1, 0)
    assert math.isclose(summary["min_noise"], 40 / 32)


def test_convs_on_an_accelerator_flags_against_its_gemm_only():
    """A run on a GPU has no CPU peak (None): only the GEMM ceiling measured there strikes."""
    from benchmarks import convs
    cand = {"hybrid": {"ms": 1.0, "gflops": 3000.0}, "keras_conv2d": {"ms": 0.5, "gflops": 6000.0}}
    layer = {"names": ["x"], "gflop_fwd": 1.0, "candidates": cand}
    convs.flag([layer], ceiling=5000.0, peak=None, dtype="float32", policy="gemm")
    assert "measuring_error" not in cand["hybrid"] and not cand["hybrid"]["above_peak"]
    assert "GEMM ceiling 5000" in cand["keras_conv2d"]["measuring_error"]


def test_convs_shapes_from_an_earlier_run(tmp_path):
    """--shapes-from reads each net's shapes (with their layer names) from a convs.json, for a
    machine without ../shared; a file that is not one stops with its path."""
    from benchmarks import convs
    shape = {"h": 13, "w": 13, "c": 8, "o": 4, "k": [3, 3], "s": [1, 1], "pad": [[1, 1], [1, 1]],
             "d": [1, 1], "g": 1, "bias": True}
    path = tmp_path / "convs.json"
    path.write_text(json.dumps({"runs": [{"net": "caffenet", "layers": [
        {"shape": shape, "names": ["conv3"]}]}]}))
    assert convs.shapes_from(path) == {"caffenet": [dict(shape, names=["conv3"])]}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="bad.json"):
        convs.shapes_from(tmp_path / "bad.json")


def test_convs_cli_rejects_unknown_backend():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.convs", "--backends", "mxnet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "mxnet" in proc.stderr


# ------------------------------------------------------------------------------ suite, CLI

def test_summary_and_page(tmp_path):
    from benchmarks import __main__ as suite
    (tmp_path / "batching.json").write_text(json.dumps(
        {"speedup_p_cores_vs_caffe": {"iteration": 1.25}, "cores": 2, "batch": 32,
         "images_per_s": {"iteration": {"caffe": 4.0, "caffe 1T": 2.0, "batch p=2": 5.0}},
         "machine": {"cpu": {"model": "Some CPU 9000"}}}))
    (tmp_path / "batching.png").write_bytes(b"png")
    (tmp_path / "flops.json").write_text(json.dumps(
        {"fit": {"slope_images_per_gflop": 0.5, "r2": 0.97, "max_rel_deviation": 0.1}}))
    table, data = suite.summary(tmp_path, {"batching": "ok", "hybrid": "exit code 1"})
    assert "1.25x" in data["batching"]["keras_cct"]
    assert "2.50x Caffe's way with a one-thread BLAS" in data["batching"]["keras_cct"]
    assert data["batching"]["cct"].startswith("4.5x")
    assert data["hybrid"]["keras_cct"].startswith("failed")
    assert data["lowering"]["keras_cct"] == "not run"
    assert data["flops"]["keras_cct"].startswith("(not run this time")
    # each row names the CPU its part ran on (parts may come from different machines)
    assert data["batching"]["keras_cct"].startswith("on Some CPU 9000: ")
    assert "(CPU not recorded)" in data["flops"]["keras_cct"]
    assert suite.cpu_of({"machine": {"cpu": "AMD EPYC"}}) == "AMD EPYC"
    assert "[plot](batching.png)" in table
    page = tmp_path / "page.md"
    page.write_text(f"# B\n\nbefore\n{suite.BEGIN}\nold\n{suite.END}\nafter\n")
    assert suite.update_page(page, table, "cmd", "now")
    text = page.read_text()
    assert "old" not in text and "before" in text and "after" in text
    assert "[plot](benchmarks/batching.png)" in text
    assert not suite.update_page(tmp_path / "absent.md", table, "cmd", "now")


def test_suite_rejects_unknown_part():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--parts", "nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown part" in proc.stderr


def test_cct_bench_locates_checkout_or_explains(tmp_path):
    from keras_cct.benchmarks_cli import BenchmarksNotFoundError, benchmarks_root
    assert benchmarks_root() == ROOT
    (tmp_path / "keras_cct").mkdir()
    with pytest.raises(BenchmarksNotFoundError, match="source checkout"):
        benchmarks_root(tmp_path / "keras_cct")


def test_cct_bench_cli_runs_suite(tmp_path):
    """``cct bench`` passes its options to ``python -m benchmarks`` (here a rejected part)."""
    from keras_cct.cli import main
    assert main(["bench", "--out", str(tmp_path), "--parts", "nope"]) == 2


# ------------------------------------------------------------------------------ whole nets

_NETS_DEPLOY = """name: "tiny_deploy"
input: "data"
input_shape { dim: 1 dim: 3 dim: 19 dim: 19 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1"
  batch_norm_param { use_global_stats: true } }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
  lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 group: 2 } }
layer { name: "sum" type: "Eltwise" bottom: "pool1" bottom: "conv2" top: "sum" }
layer { name: "apool" type: "Pooling" bottom: "sum" top: "apool"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 pad: 1 } }
layer { name: "cat" type: "Concat" bottom: "apool" bottom: "apool" top: "cat" }
layer { name: "fc" type: "InnerProduct" bottom: "cat" top: "fc"
  inner_product_param { num_output: 5 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def test_nets_torch_translator_matches_keras(tmp_path):
    """The same prototxt (a deploy net made trainable) through cct time's builder and through
    the PyTorch translator, with the same weights: the same outputs."""
    import torch

    from benchmarks.nets import train_prototxt
    from benchmarks.torch_net import load_caffemodel, load_torch_net
    from keras_cct.caffe.train_commands import time_model
    from keras_cct.caffe.net.weights import save_weights
    src = tmp_path / "tiny.prototxt"
    src.write_text(_NETS_DEPLOY)
    path, shapes = train_prototxt(str(src), 3, tmp_path)
    assert shapes == {"data": (3, 3, 19, 19), "label": (3,)}
    model, batch = time_model(str(path), random_data=True, input_shapes=shapes)
    assert [h.type for h in model.heads] == ["SoftmaxWithLoss"]
    save_weights(model.net, tmp_path / "w.caffemodel")
    net = load_torch_net(path, shapes)
    assert load_caffemodel(net, tmp_path / "w.caffemodel") == 5  # conv1 bn1 sc1 conv2 fc
    net.train()  # batch statistics on both sides (use_global_stats was dropped)
    x = batch["data"]
    loss, blobs = net({"data": torch.from_numpy(x.transpose(0, 3, 1, 2).copy()),
                       "label": torch.zeros(3, dtype=torch.long)})
    outs = model.net([batch[k] for k in model.input_blobs], training=True)
    fc = keras.ops.convert_to_numpy(outs[model.output_blobs.index("fc")])
    np.testing.assert_allclose(blobs["fc"].detach().numpy(), fc, rtol=1e-4, atol=1e-5)
    loss.backward()  # in-place ReLU and the rest differentiate


def test_nets_tiny_run(tmp_path):
    """``python -m benchmarks.nets`` on a tiny train_val net: every candidate, the table, the
    plot and the per-layer profile."""
    from benchmarks import nets, nets_report
    src = tmp_path / "tiny_train_val.prototxt"
    src.write_text(_NETS_DEPLOY.replace('input: "data"\ninput_shape { dim: 1 dim: 3 dim: 19 '
                                        'dim: 19 }', "").replace(
        "name: \"tiny_deploy\"", "name: \"tiny\"\nlayer { name: \"data\" type: \"Data\" top: "
        "\"data\" top: \"label\" transform_param { crop_size: 19 } data_param { source: "
        "\"nowhere\" batch_size: 64 } }").replace(
        'layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }',
        'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" '
        'top: "loss" }'))
    assert nets.main(["--nets", f"{src}:4", "--dtypes", "float32,bfloat16", "--rounds", "1",
                      "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "nets.json").read_text())
    assert [(r["net"], r["batch"], r["dtype"]) for r in data["results"]] == [
        ("tiny_train_val", 4, "float32"), ("tiny_train_val", 4, "bfloat16")]
    for r in data["results"]:
        assert set(r["candidates"]) == set(nets_report.CANDIDATES), r["failed"]
        assert all(_finite_positive(c["images_per_s"]) for c in r["candidates"].values())
    groups = {g["group"] for g in data["profile"]["groups"]}
    assert {"conv", "LRN", "pooling", "InnerProduct", "BatchNorm", "Scale"} <= groups
    md = (tmp_path / "out" / "nets.md").read_text()
    assert "| tiny_train_val | 4 | float32 |" in md and "Per layer type" in md
    assert (tmp_path / "out" / "nets.png").stat().st_size > 0


def test_convs_headline_says_what_keeping_struck_rates_gives():
    """The summary's per-layer headline counts layers against the strict ratios (rates above
    the GEMM ceiling struck) and, where keeping them up to the peak changes the count, says so."""
    from benchmarks.__main__ import HEADLINES

    def summ(under_peer):
        return {"tensorflow caffenet float32": {"layers": 5, "under_097_conv2d": 0,
                                                "under_1_best_peer": under_peer,
                                                "min_vs_conv2d": 1.1}}
    line = HEADLINES["convs"]({"summary": summ(0), "summary_above_gemm_kept": summ(1)})
    assert "best peer's on 0/5 (1/5 with every rate up to the CPU's peak kept)" in line
    line = HEADLINES["convs"]({"summary": summ(2), "summary_above_gemm_kept": summ(2)})
    assert "best peer's on 2/5" in line and "peak kept" not in line


@pytest.mark.slow
@pytest.mark.opencl
def test_hybrid_gpu_tiny_with_opencl_standing_in_for_the_gpu(opencl_name, tmp_path):
    """The GPU machine's hybrid benchmark, end to end on the PyTorch backend with the OpenCL
    device in the GPU's place: every configuration timed, the hybrid's split reported, the
    page and the plot written."""
    from benchmarks import hybrid_gpu
    from benchmarks.common import spawn_config
    res = spawn_config("benchmarks.hybrid_gpu", dict(layer="conv3", batch=4, rounds=1, settle=1,
                                                     accelerator=opencl_name), backend="torch")
    expected = {"gpu", "cpu", "hybrid"} | {f"cpu_{f}" for f in hybrid_gpu.FIXED}
    assert set(res["images_per_s"]) == expected
    assert all(_finite_positive(v) for v in res["images_per_s"].values())
    devices = [r["device"] for r in res["hybrid_report"]]
    assert devices == ["torch:cpu:0", opencl_name]
    assert math.isclose(sum(r["fraction"] for r in res["hybrid_report"]), 1.0, rel_tol=1e-6)
    assert sum(r["images"] for r in res["hybrid_report"]) == 4
    data = {"command": "test", "when": "now", "rounds": 1, "settle": 1,
            "machine": {"gpu": "none", "cpu": {"model": "cpu", "vector_units": "v",
                                               "matrix_units": "m"}, "cores": 2},
            "versions": {"keras": "3"}, "results": [res]}
    page = hybrid_gpu.markdown(data)
    assert "| conv3 | 4 |" in page
    hybrid_gpu.plot(data, tmp_path / "hybrid_gpu.png")
    assert (tmp_path / "hybrid_gpu.png").stat().st_size > 1000


def test_convs_writes_what_is_done_when_a_run_stops(tmp_path, monkeypatch):
    """After each process the results so far are written (marked partial), so a run cut short
    (a lent machine's time limit) keeps them; the PNG comes with the complete run."""
    from benchmarks import convs
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path / "cache"))
    run = convs.run_config({"net": "tiny", "batch": 2, "size": 6, "dtype": "float32",
                            "repeats": 1, "shapes": _TINY_CONVS, "quick": True,
                            "ceiling_sizes": [256]})
    calls = []

    def spawn(module, spec, **kw):
        calls.append(spec["dtype"])
        if len(calls) > 1:
            raise KeyboardInterrupt  # the run is stopped during its second process
        return run

    monkeypatch.setattr(convs, "spawn_config", spawn)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convs.main(["--nets", "caffenet", "--backends", "tensorflow",
                    "--dtypes", "float32,bfloat16", "--out", str(out)])
    data = json.loads((out / "convs.json").read_text())
    assert data["processes"] == {"done": 1, "planned": 2} and len(data["runs"]) == 1
    page = (out / "convs.md").read_text()
    assert "**Partial**: 1 of 2 processes" in page and "## tiny, tensorflow, float32" in page
    assert not (out / "convs.png").exists()


# ------------------------------------------------------------------------------ first step

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["steps", "fit", "later"])
def test_first_step_two_processes(tmp_path, mode):
    """The first-step benchmark runs its processes: the first HybridConv2D process plans the
    model's three shapes, the second reads them from the shared cache (plans nothing, picks
    the same), each keras Conv2D process beside it; the report is written. Also by
    ``model.fit`` on a model of unknown batch size (``--fit``), and then the later calls at
    other batch sizes (``--later``), which the second process plans nothing for either."""
    from benchmarks import first_step
    from keras_cct.lowering.names import ALL_LOWERINGS
    fit = mode != "steps"
    data = first_step.main(["--backends", "tensorflow", "--dtypes", "float32",
                            "--processes", "2", "--batch", "2", "--out", str(tmp_path)] +
                           ([] if mode == "steps" else [f"--{mode}"]))
    assert data["fit"] is fit and data["later"] is (mode == "later")
    assert data["failures"] == [] and len(data["runs"]) == 1
    run = data["runs"][0]
    assert len(run["keras_conv2d"]) == len(run["hybrid"]) == 2
    for r in run["keras_conv2d"] + run["hybrid"]:
        assert _finite_positive(r["first_s"]) and _finite_positive(r["steady_s"])
        assert math.isfinite(r["loss"])
    one, two = run["hybrid"]
    assert one["new_plans"] == 3 and two["new_plans"] == 0
    # each of the first process' races, with what its candidates' starts took
    assert len(one["plans"]) == 3 and two["plans"] == []
    for plan in one["plans"]:
        assert _finite_positive(plan["plan_s"]) and plan["pick"] in plan["timed_ms"]
        assert "native" in plan["starts_s"] and set(plan["starts_s"]) == set(plan["timed_ms"])
        assert plan["images"] >= 1 and all(map(_finite_positive, plan["starts_s"].values()))
    assert one["picks"] == two["picks"] and set(one["picks"]) <= set(ALL_LOWERINGS)
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"first_step.{suffix}").stat().st_size > 500
    md = (tmp_path / "first_step.md").read_text()
    assert "| tensorflow | float32 | 2 |" in md
    assert ("`model.fit` of one batch" in md) is fit
    assert ("## Later calls at other batch sizes" in md) is (mode == "later")
    assert "## The races of the first step" in md and "| tensorflow | float32 | 1 | 3 |" in md
    if mode == "later":
        for r in run["keras_conv2d"] + run["hybrid"]:
            assert list(r["later"]) == list(first_step.LATER)
            assert all(_finite_positive(c["s"]) for c in r["later"].values())
        assert [c["new_plans"] for c in two["later"].values()] == [0, 0, 0]
    from benchmarks.__main__ import HEADLINES
    line = HEADLINES["first_step"](data)
    assert "tensorflow float32: HybridConv2D" in line and "processes 1-2" in line


@pytest.mark.skipif(platform.machine() != "x86_64", reason="TensorFlow and PyTorch use oneDNN "
                    "on x86-64 CPUs")
def test_onednn_versions_are_read_for_both_libraries():
    """The benchmarks record the oneDNN in TensorFlow and in PyTorch (the same primitive runs at
    different speeds in each), and the reports print them."""
    import re

    from benchmarks.common import onednn_versions
    from benchmarks.convs_report import onednn_line
    v = onednn_versions()
    assert set(v) == {"tensorflow", "torch"}, v
    assert all(re.fullmatch(r"\d+\.\d+(\.\d+)?", x) for x in v.values()), v
    line = onednn_line({"onednn": v})
    assert line == f"; oneDNN: tensorflow {v['tensorflow']}, torch {v['torch']}"
    assert onednn_line({}) == ""


def test_gemm_quick_run_and_headline(tmp_path):
    """``python -m benchmarks.gemm --quick``: both libraries, each dtype, rates below the CPU's
    peak, which oneDNN implementation ran, the table, the plot, and the suite's headline."""
    from benchmarks import gemm
    from benchmarks.__main__ import HEADLINES
    assert gemm.main(["--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gemm.json").read_text())
    keys = {(r["library"], r["dtype"], r["threads"]) for r in data["results"]}
    assert keys == {(lib, d, 1) for lib in ("tensorflow", "torch")
                    for d in ("float32", "bfloat16")}
    for r in data["results"]:
        m, k, n = r["mkn"]
        assert math.isclose(r["gflops"], 2 * m * k * n / r["ms"] / 1e6, rel_tol=1e-9)
        assert 0 < r["gflops"] < data["peak_gflops"][r["dtype"]], r
    assert set(data["implementations"]) == {"tensorflow", "torch"}
    md = (tmp_path / "gemm.md").read_text()
    assert "| 1 | bfloat16 | small | 256x256x256 |" in md
    assert (tmp_path / "gemm.png").stat().st_size > 0
    line = HEADLINES["gemm"](data)
    assert line.startswith("TensorFlow's GEMM vs PyTorch's (1 thread): float32 ")


def test_keras_models_tiny_run(tmp_path):
    """``python -m benchmarks.keras_models`` on a tiny Keras model ("same" padding at strides
    on even sizes, a grouped layer, BatchNormalization) on this backend: the hybridized model's
    predictions are the Keras model's, every candidate is timed, the table, plot and headline."""
    from benchmarks import keras_models
    from benchmarks.__main__ import HEADLINES
    backend = keras.backend.backend()
    assert keras_models.main(["--models", "tiny", "--backends", backend, "--dtypes",
                              "float32", "--batch", "2", "--size", "16", "--rounds", "1",
                              "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "keras_models.json").read_text())
    (run,) = data["runs"]
    (res,) = run["results"]
    assert run["backend"] == backend and res["model"] == "tiny" and res["convs"] == 3
    assert sum(res["picks"].values()) == 3
    assert res["predict_rel_err"] < 1e-5
    assert set(res["images_per_s"]) == set(keras_models.CANDIDATES)
    assert all(_finite_positive(v) for v in res["images_per_s"].values())
    assert f"| {backend} | float32 | tiny |" in (tmp_path / "keras_models.md").read_text()
    assert (tmp_path / "keras_models.png").stat().st_size > 0
    assert HEADLINES["keras_models"](data).startswith(
        f"hybridized Keras models' training step vs as built: {backend} float32 ")


def test_keras_models_every_model_of_a_bfloat16_run_computes_in_bfloat16():
    """Each model of a process under mixed_bfloat16 (keras.backend.clear_session between
    them resets Keras' global policy: the second model ran in float32)."""
    from benchmarks import keras_models
    out = keras_models.run_config({"models": ["tiny", "tiny"], "dtype": "bfloat16", "batch": 2,
                                   "size": 16, "rounds": 1})
    try:
        assert [r["compute_dtypes"] for r in out["results"]] == [["bfloat16"], ["bfloat16"]]
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ------------------------------------------------------------------------------ partitions

@pytest.mark.slow
def test_partitions_quick(tmp_path):
    """The Winograd partition sweep times each size, the whole batch and the default in one
    TensorFlow process, and reports the default size the layer's own code chooses."""
    from benchmarks import partitions
    from keras_cct.lowering.geometry import conv_geometry
    from keras_cct.lowering.winograd import partition_images
    data = partitions.main(["--quick", "--out", str(tmp_path)])
    assert data["failures"] == [] and [r["backend"] for r in data["runs"]] == ["tensorflow"]
    res = data["runs"][0]["layers"]["conv5"]
    assert sorted(res["seconds"]) == ["1", "2", "4", "default"]
    assert all(_finite_positive(s) for s in res["seconds"].values())
    geo = conv_geometry((4, 13, 13, 384), (3, 3, 192, 256), padding=1, groups=2)
    assert res["default_images"] == partition_images(geo, 2, 4)
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"partitions.{suffix}").stat().st_size > 500
    md = (tmp_path / "partitions.md").read_text()
    assert "| tensorflow | conv5 | 2.0 |" in md and "4 images (whole)" in md


def test_nets_profile_marks_a_pooling_that_computes_the_relu_before_it(tmp_path):
    """The net builder moves a plain ReLU into the MAX pooling that reads it: the profile has
    no row for that ReLU and marks the pooling's, and the report says what the mark means."""
    from benchmarks import nets, nets_report
    src = tmp_path / "relu_pool_deploy.prototxt"
    src.write_text(
        'name: "relu_pool"\ninput: "data"\ninput_shape { dim: 1 dim: 3 dim: 9 dim: 9 }\n'
        'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
        'convolution_param { num_output: 4 kernel_size: 3 } }\n'
        'layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }\n'
        'layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" '
        'pooling_param { pool: MAX kernel_size: 3 stride: 2 } }\n'
        'layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc" '
        'inner_product_param { num_output: 3 } }\n'
        'layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }\n')
    path, shapes = nets.train_prototxt(str(src), 2, tmp_path / "nets")
    rows = {r["layer"]: r for r in nets.layer_profile(path, shapes, 1)}
    assert "relu" not in rows and rows["pool"]["keras_lowering"] == nets_report.RELU_MOVED
    assert rows["conv"]["keras_lowering"] != nets_report.RELU_MOVED
