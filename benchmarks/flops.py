"""Benchmark of FLOPS proportionality (CcT's RQ5): convolution throughput against each device's
calibrated GFLOP/s.

CcT's claim: once the lowering is batched, a device's training throughput is proportional to
the FLOPS it delivers, which is what lets :class:`keras_cct.CCTStrategy` split a batch by
calibrated GFLOP/s. Here the FLOPS of the devices are varied and both sides are measured:

* ``tf:cpu:0`` with 1 .. cores intra-op threads;
* the first OpenCL device with PoCL limited to 1 .. cores threads (``POCL_MAX_PTHREAD_COUNT``
  in the worker's environment);
* one fission sub-device ``opencl:P:D.0`` (one compute unit; fission alone does not limit
  PoCL's threads, so keras_cct starts a sub-device's worker with ``POCL_MAX_PTHREAD_COUNT=1``).

Each configuration runs in a fresh process (TensorFlow fixes its thread pools at start-up) with
its own empty calibration cache, so :func:`keras_cct.devices.calibrate` measures the device as
configured (an SGEMM timed for 1.5 s, 0.3 s with ``--quick``). Throughput is CaffeNet's conv3
(13x13x256 -> 384, 3x3, pad 1), forward+backward, through ``HybridConv2D`` (``device=`` the
OpenCL device for OpenCL). The fitted line is a least
squares fit through the origin, images/s = a x GFLOP/s, with its R^2; the efficiency of a
point is the GFLOP/s the convolution reached over the calibrated GFLOP/s.

Writes ``flops.json``, ``flops.md`` and ``flops.png`` under ``docs/benchmarks/``.
Run: ``python -m benchmarks.flops [--quick] [--out DIR] [--batch B]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from benchmarks.common import (DEFAULT_OUT, best_of, markdown_table,
                               spawn_config, write_results)

ROOT = Path(__file__).resolve().parents[1]
CONV3 = dict(hw=13, channels=256, filters=384, kernel=3, pad=1)
CCT_PUBLISHED = ("CcT: throughput is proportional to the device's FLOPS (its hybrid split and "
                 "its CPU/GPU results rest on this)")


# ------------------------------------------------------------------------------ worker side

def run_config(spec: dict) -> dict:
    """Calibrate and time one configuration in this (fresh) process."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(spec["tf_threads"])
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from keras_cct import HybridConv2D
    from keras_cct.devices import calibrate, get_device
    from keras_cct.lowering.timing import block, layer_steps
    name = spec["device"]
    env = spec.get("env")
    device = get_device(name, env=env) if name.startswith("opencl") else get_device(name)
    gflops = calibrate(device, refresh=True, seconds=spec.get("calibrate_s", 0.3))
    lay = spec.get("layer", CONV3)
    batch, hw = spec["batch"], lay["hw"]
    layer = HybridConv2D(lay["filters"], lay["kernel"], padding=lay["pad"],
                         device=name if name.startswith("opencl") else None)
    layer.build((batch, hw, hw, lay["channels"]))
    x = tf.constant(np.random.default_rng(0).standard_normal((batch, hw, hw, lay["channels"])),
                    tf.float32)

    _, step = layer_steps(layer, [x])
    best = best_of(lambda: block(step(x)), spec["repeats"])
    out_hw = hw + 2 * lay["pad"] - lay["kernel"] + 1
    flops = 3 * 2.0 * batch * out_hw ** 2 * lay["kernel"] ** 2 * lay["channels"] * lay["filters"]
    return {"calibrated_gflops": gflops, "step_s": best, "images_per_s": batch / best,
            "achieved_gflops": flops / best / 1e9, "device_description": device.description}


# ------------------------------------------------------------------------------ driver side

def configurations(cores: int, opencl: str = "opencl:0:0", sub_device: bool = True) -> Dict[str,
                                                                                         dict]:
    """name -> spec (without batch/repeats) of every configuration."""
    out = {f"tf {t}T": dict(device="tf:cpu:0", tf_threads=t, threads=t)
           for t in range(1, cores + 1)}
    for t in range(1, cores + 1):
        out[f"opencl {t}T"] = dict(device=opencl, tf_threads=1, threads=t,
                                   env={"POCL_MAX_PTHREAD_COUNT": str(t)})
    if sub_device:
        out["opencl sub-device 0"] = dict(device=opencl + ".0", tf_threads=1, threads=None)
    return out


def spawn(spec: dict, timeout: float = 900) -> dict:
    """Run :func:`run_config` in a fresh process with an empty calibration cache."""
    with tempfile.TemporaryDirectory(prefix="cct-flops-") as cache:
        return spawn_config("benchmarks.flops", spec, env={"KERAS_CCT_CACHE_DIR": cache},
                            timeout=timeout)


def fit(points: List[dict]) -> Optional[dict]:
    """Least squares line through the origin, images/s = slope x calibrated GFLOP/s."""
    ok = [p for p in points if p.get("images_per_s")]
    if len(ok) < 2:
        return None
    x = np.array([p["calibrated_gflops"] for p in ok])
    y = np.array([p["images_per_s"] for p in ok])
    slope = float(x @ y / (x @ x))
    ss_res = float(np.sum((y - slope * x) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return {"slope_images_per_gflop": slope,
            "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "max_rel_deviation": float(np.max(np.abs(y - slope * x) / (slope * x)))}


def run(cores: int, batch: int, repeats: int, opencl: str = "opencl:0:0",
        sub_device: bool = True, progress=None, calibrate_s: float = 0.3) -> dict:
    """Every configuration, each in a fresh process (a failed one records its error)."""
    configs = configurations(cores, opencl, sub_device)
    results: Dict[str, dict] = {}
    for name, spec in configs.items():
        try:
            results[name] = dict(spec, **spawn(dict(spec, batch=batch, repeats=repeats,
                                                    calibrate_s=calibrate_s)))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            results[name] = dict(spec, error=str(exc))
        if progress is not None:
            progress.update(1)
    points = [r for r in results.values() if "error" not in r]
    return {"batch": batch, "cores": cores, "layer": CONV3, "configs": results,
            "fit": fit(points),
            "fit_tf": fit([r for r in points if r["device"].startswith("tf")]),
            "fit_opencl": fit([r for r in points if r["device"].startswith("opencl")])}


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    pts = {k: v for k, v in data["configs"].items() if "error" not in v}
    for i, (name, r) in enumerate(pts.items()):
        ax.scatter(r["calibrated_gflops"], r["images_per_s"], s=50,
                   marker="o" if r["device"].startswith("tf") else "s", color=f"C{i}",
                   label=name)
    if data["fit"] and pts:
        xmax = 1.1 * max(r["calibrated_gflops"] for r in pts.values())
        xs = np.linspace(0, xmax, 10)
        f = data["fit"]
        ax.plot(xs, f["slope_images_per_gflop"] * xs, "k--", lw=1,
                label=f"fit through 0 (R$^2$ = {f['r2']:.2f})")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("calibrated SGEMM GFLOP/s of the device")
    ax.set_ylabel("CaffeNet conv3 images/s (forward+backward)")
    ax.set_title(f"FLOPS proportionality, batch {data['batch']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(data: dict, command: str) -> str:
    rows = []
    for name, r in data["configs"].items():
        if "error" in r:
            rows.append([name, r["device"], "-", "-", "-", "-", "failed: " + r["error"][:120]])
        else:
            rows.append([name, r["device"], r["calibrated_gflops"], r["images_per_s"],
                         r["achieved_gflops"], r["achieved_gflops"] / r["calibrated_gflops"], ""])
    md = (f"# FLOPS proportionality benchmark (CcT RQ5)\n\nCommand: `{command}`. CaffeNet conv3 "
          f"forward+backward at batch {data['batch']}; each configuration in a fresh process "
          "with a fresh calibration.\n\n" +
          markdown_table(["config", "device", "calibrated GFLOP/s", "img/s", "conv GFLOP/s",
                          "conv / calibrated", "note"], rows))
    for key, label in (("fit", "all devices"), ("fit_tf", "TensorFlow"),
                       ("fit_opencl", "OpenCL")):
        f = data.get(key)
        if f:
            md += (f"\n- Fit through the origin, {label}: {f['slope_images_per_gflop']:.3g} "
                   f"images/s per calibrated GFLOP/s, R^2 = {f['r2']:.2f}, largest deviation "
                   f"from the line {100 * f['max_rel_deviation']:.0f}%.")
    return md + f"\n\n{CCT_PUBLISHED}.\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, fewer repeats")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--cores", type=int, default=None, help="default: os.cpu_count()")
    parser.add_argument("--opencl", default="opencl:0:0", help="OpenCL device to vary")
    parser.add_argument("--no-sub-device", action="store_true")
    args = parser.parse_args(argv)
    from tqdm import tqdm
    from benchmarks.common import machine
    batch = args.batch or (8 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 4)
    cores = args.cores or os.cpu_count() or 1
    n = len(configurations(cores, args.opencl, not args.no_sub_device))
    with tqdm(total=n, desc="flops benchmark", unit="config") as progress:
        data = run(cores, batch, repeats, args.opencl, not args.no_sub_device, progress,
                   calibrate_s=0.3 if args.quick else 1.5)
    data["machine"] = machine()
    md = markdown(data, "python -m benchmarks.flops" + (" --quick" if args.quick else ""))
    write_results(args.out, "flops", data, md)
    plot(data, args.out / "flops.png")
    print(md)
    return data


if __name__ == "__main__":
    main()
