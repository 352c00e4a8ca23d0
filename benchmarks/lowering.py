"""Benchmark of the lowerings (issue: foundation; CcT's RQ2).

1. CaffeNet's five convolutions at batch 32: forward and forward+backward time of each lowering,
   ``"auto"`` (planner="measure"), ``keras.layers.Conv2D(groups=g)``'s own op and the split-groups
   form ("native"), plus a bare GEMM of the Type 1 shape and a large square SGEMM (the ceiling).
2. CcT's Type 1 vs Type 3 figure: a sweep of input/output channel ratio d/o from 1/32 to 32 at
   constant flops, with the cost model's pick (``choose(mode="model")``) against the fastest.
3. CcT's batch partitioning: Type 1 forward and forward+backward GFLOP/s on conv2-conv5 for a
   range of lowered bytes per partition (0 = the whole batch in one matrix), which is how
   :data:`keras_cct.lowering.cost.PARTITION_BYTES` was chosen.

Writes ``lowering.json``, ``lowering.md`` and ``lowering.png`` under ``docs/benchmarks/``.
Run: ``python -m benchmarks.lowering [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common import DEFAULT_OUT, best_of, machine, markdown_table, write_results

CAFFENET = {  # name: (input h=w, channels, filters, kernel, stride, pad, groups)
    "conv1": (227, 3, 96, 11, 4, 0, 1),
    "conv2": (27, 96, 256, 5, 1, 2, 2),
    "conv3": (13, 256, 384, 3, 1, 1, 1),
    "conv4": (13, 384, 384, 3, 1, 1, 2),
    "conv5": (13, 384, 256, 3, 1, 1, 2),
}
LOWERED = ("type1", "type2", "type3")


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


def gemm_gflops(m: int, k: int, n: int, repeats: int) -> float:
    import tensorflow as tf
    a = tf.constant(np.random.default_rng(0).random((m, k), dtype=np.float32))
    b = tf.constant(np.random.default_rng(1).random((k, n), dtype=np.float32))
    fn = tf.function(lambda a, b: tf.matmul(a, b)[:1, :1])
    return 2 * m * k * n / best_of(lambda: fn(a, b).numpy(), repeats) / 1e9


def _inputs(geo, batch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, geo.in_h, geo.in_w, geo.channels)).astype("float32")
    k = (rng.standard_normal((geo.kh, geo.kw, geo.cg, geo.filters)) * 0.05).astype("float32")
    return x, k


def time_conv(geo, how, batch, training, repeats):
    from keras_cct.lowering.timing import make_step
    x, k = _inputs(geo, batch)
    return best_of(make_step(geo, how, x, k, training=training), repeats)


def time_interleaved(geo, hows: dict, batch, training, repeats) -> dict:
    """Best-of-``repeats`` seconds of each candidate, timed round-robin (one call of each per
    round) so that a burst of load on this shared machine hits all candidates alike."""
    import time
    from keras_cct.lowering.timing import make_step
    x, k = _inputs(geo, batch)
    steps = {label: make_step(geo, how, x, k, training=training) for label, how in hows.items()}
    for step in steps.values():
        step()
    best = {label: float("inf") for label in steps}
    for _ in range(repeats):
        for label, step in steps.items():
            t0 = time.perf_counter()
            step()
            best[label] = min(best[label], time.perf_counter() - t0)
    return best


def caffenet_part(batch, repeats, progress):
    from keras_cct.lowering import choose_for, conv_geometry
    from keras_cct.lowering.planner import fits_in_memory
    rows, results = [], {}
    ceiling = gemm_gflops(2048, 2048, 2048, repeats)
    for name, (hw, c, o, k, s, p, g) in CAFFENET.items():
        geo = conv_geometry((batch, hw, hw, c), (k, k, c // g, o), strides=s, padding=p,
                            groups=g)
        auto = choose_for(geo, mode="measure", batch=batch)
        model_pick = choose_for(geo, mode="model", batch=batch)
        hows = {low: low for low in LOWERED + ("native",)}
        hows["keras_conv2d"] = keras_grouped_conv
        hows["type1_autodiff"] = type1_autodiff
        res = {"auto_choice": auto, "model_choice": model_pick, "gflop": geo.flops(batch) / 1e9}
        # e.g. Type 3 on conv1 (a (b*227*227, 121*96) lifted matrix) is not run
        runnable = {label: how for label, how in hows.items()
                    if fits_in_memory(geo, label.replace("_autodiff", ""), batch)}
        for mode, training in (("fwd", False), ("fwd_bwd", True)):
            secs = time_interleaved(geo, runnable, batch, training, repeats)
            for label in hows:
                res[f"{label}_{mode}_ms"] = 1e3 * secs.get(label, float("nan"))
            progress.update(len(hows))
            res[f"auto_{mode}_ms"] = res[f"{auto}_{mode}_ms"]
        m, kk, n = batch * geo.out_h * geo.out_w, geo.kh * geo.kw * geo.cg, geo.og
        res["gemm_gflops"] = gemm_gflops(m * geo.groups, kk, n, repeats)
        res["type1_fwd_gflops"] = geo.flops(batch) / res["type1_fwd_ms"] / 1e6
        res["type1_fwd_vs_ceiling"] = res["type1_fwd_gflops"] / ceiling
        best_keras = min(res["keras_conv2d_fwd_bwd_ms"], res["native_fwd_bwd_ms"])
        res["auto_vs_best_keras"] = best_keras / res["auto_fwd_bwd_ms"]
        res["auto_vs_keras_grouped"] = res["keras_conv2d_fwd_bwd_ms"] / res["auto_fwd_bwd_ms"]
        res["custom_grad_speedup"] = res["type1_autodiff_fwd_bwd_ms"] / res["type1_fwd_bwd_ms"]
        results[name] = res
        rows.append([name, g, auto, model_pick] +
                    [res[f"{h}_fwd_ms"] for h in LOWERED + ("native", "keras_conv2d")] +
                    [res[f"{h}_fwd_bwd_ms"] for h in LOWERED + ("native", "keras_conv2d")] +
                    [res["type1_fwd_vs_ceiling"], res["auto_vs_best_keras"],
                     res["auto_vs_keras_grouped"], res["custom_grad_speedup"]])
    header = ["layer", "groups", "auto", "model"] + \
        [f"{h} fwd ms" for h in ("T1", "T2", "T3", "native", "Conv2D")] + \
        [f"{h} f+b ms" for h in ("T1", "T2", "T3", "native", "Conv2D")] + \
        ["T1 fwd / ceiling", "best Keras / auto (f+b)", "Conv2D(groups) / auto (f+b)",
         "T1 autodiff / T1 custom grad (f+b)"]
    return {"ceiling_gflops": ceiling, "layers": results}, markdown_table(header, rows)


def sweep_part(batch, hw, repeats, points, progress):
    from keras_cct.lowering import choose_for, conv_geometry
    rows, results = [], []
    for e in points:  # d/o = 2**e at constant d*o
        d, o = int(2 ** (7.5 + e / 2)), int(2 ** (7.5 - e / 2))
        geo = conv_geometry((batch, hw, hw, d), (3, 3, d, o), padding=1)
        times = {low: 1e3 * t for low, t in time_interleaved(
            geo, {low: low for low in LOWERED}, batch, True, repeats).items()}
        progress.update(len(LOWERED))
        best = min(times, key=times.get)
        pick = choose_for(geo, mode="model", batch=batch)
        regret = times[pick] / times[best] - 1
        results.append({"d": d, "o": o, "ratio": d / o, "ms": times, "fastest": best,
                        "model_choice": pick, "regret": regret})
        rows.append([f"{d}/{o}", times["type1"], times["type2"], times["type3"], best, pick,
                     f"{100 * regret:.0f}%"])
    within = float(np.mean([r["regret"] <= 0.10 for r in results]))
    header = ["d/o", "T1 f+b ms", "T2 f+b ms", "T3 f+b ms", "fastest", "model pick", "regret"]
    return {"points": results, "model_within_10pct": within}, markdown_table(header, rows)


PARTITION_TARGETS_MB = (0, 1, 2, 4, 8, 16, 32)


def partition_part(batch, repeats, targets, progress):
    from keras_cct.lowering import conv_geometry
    from keras_cct.lowering.cost import partitions
    from keras_cct.lowering.engine import lowered_conv2d
    rows, results = [], {}
    for name in ("conv2", "conv3", "conv4", "conv5"):
        hw, c, o, k, s, p, g = CAFFENET[name]
        geo = conv_geometry((batch, hw, hw, c), (k, k, c // g, o), strides=s, padding=p,
                            groups=g)
        parts = {str(mb): 1 if mb == 0 else partitions(geo, "type1", batch,
                                                        target_bytes=int(mb * (1 << 20)))
                 for mb in targets}
        hows = {key: (lambda x, kk, geo_, n=n: lowered_conv2d(x, kk, geo_, "type1",
                                                               partitions=n))
                for key, n in parts.items()}
        fwd = time_interleaved(geo, hows, batch, False, repeats)
        fb = time_interleaved(geo, hows, batch, True, repeats)
        gf = geo.flops(batch) / 1e9
        res = {key: {"partitions": parts[key], "fwd_gflops": gf / fwd[key],
                     "fwd_bwd_gflops": 3 * gf / fb[key]} for key in parts}
        progress.update(len(targets))
        results[name] = res
        rows.append([name] + [f"{res[str(mb)]['fwd_gflops']:.0f} / "
                              f"{res[str(mb)]['fwd_bwd_gflops']:.0f} "
                              f"(p={res[str(mb)]['partitions']})" for mb in targets])
    header = ["layer"] + ["whole batch" if mb == 0 else f"{mb} MB" for mb in targets]
    return {"targets_mb": list(targets), "layers": results}, markdown_table(header, rows)


def plot(data, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    layers = list(data["caffenet"]["layers"])
    hows = ["type1", "type2", "type3", "native", "keras_conv2d"]
    width = 0.16
    for i, h in enumerate(hows):
        vals = [data["caffenet"]["layers"][n][f"{h}_fwd_bwd_ms"] for n in layers]
        a1.bar(np.arange(len(layers)) + (i - 2) * width, vals, width,
               label=h.replace("keras_conv2d", "Conv2D(groups=g)"))
    a1.set_xticks(np.arange(len(layers)), layers)
    a1.set_ylabel("forward+backward ms (batch %d)" % data["batch"])
    a1.set_yscale("log")
    a1.set_title("CaffeNet convolutions")
    a1.legend(fontsize=8)
    pts = data["sweep"]["points"]
    ratios = [p["ratio"] for p in pts]
    for low in LOWERED:
        a2.plot(ratios, [p["ms"][low] for p in pts], marker="o", label=low)
    a2.scatter(ratios, [p["ms"][p["model_choice"]] for p in pts], s=120, facecolors="none",
               edgecolors="k", label="cost model's pick")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("input / output channels (d/o), constant flops")
    a2.set_ylabel("forward+backward ms")
    a2.set_title("Type 1 vs Type 3 (CcT's crossover)")
    a2.axvline(1.0, color="grey", lw=0.5)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _default_partition_mb() -> float:
    from keras_cct.lowering.cost import PARTITION_BYTES
    return PARTITION_BYTES / (1 << 20)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, fewer points")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    from tqdm import tqdm
    batch = args.batch or (8 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 3)
    points = [-5, -3, -1, 0, 1, 3, 5] if args.quick else list(range(-5, 6))
    sweep_batch, sweep_hw = (8, 14) if args.quick else (16, 28)
    targets = (0, 2, 8) if args.quick else PARTITION_TARGETS_MB
    total = len(CAFFENET) * 12 + len(points) * 3 + 4 * len(targets)
    with tqdm(total=total, desc="lowering benchmark", unit="run") as progress:
        caffenet, md1 = caffenet_part(batch, repeats, progress)
        sweep, md2 = sweep_part(sweep_batch, sweep_hw, repeats, points, progress)
        parts, md3 = partition_part(batch, repeats, targets, progress)
    data = {"machine": machine(), "batch": batch, "caffenet": caffenet,
            "sweep": {"batch": sweep_batch, "hw": sweep_hw, **sweep}, "partitions": parts}
    md = (f"# Lowering benchmark\n\nMachine: {data['machine']}\n\n"
          f"Command: `python -m benchmarks.lowering{' --quick' if args.quick else ''}`\n\n"
          f"## CaffeNet convolutions, batch {batch}\n\nSGEMM ceiling (2048^3): "
          f"{caffenet['ceiling_gflops']:.0f} GFLOP/s. `auto` = planner='measure'. nan: the "
          f"lowering's temporaries exceed a quarter of the memory, so it is not run.\n\n{md1}\n"
          f"## d/o sweep (batch {sweep_batch}, {sweep_hw}x{sweep_hw}, 3x3, constant flops)\n\n"
          f"Cost model within 10% of the fastest lowering on "
          f"{100 * sweep['model_within_10pct']:.0f}% of the points.\n\n{md2}\n"
          f"## Batch partitions (Type 1, batch {batch})\n\nGFLOP/s forward / forward+backward "
          f"(p = partitions) by lowered bytes per partition; the default is "
          f"{_default_partition_mb():g} MB.\n\n{md3}")
    write_results(args.out, "lowering", data, md)
    plot(data, args.out / "lowering.png")
    print(md)
    return data


if __name__ == "__main__":
    main()
