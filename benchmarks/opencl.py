"""Benchmark of the OpenCL device (not a test): SGEMM, CaffeNet convolutions, crossing cost.

Measures, on the first working OpenCL device (or ``--device``) and the same CPU cores:

1. SGEMM GFLOP/s of keras_cct's kernel (and CLBlast's, when ``pyclblast`` is installed) on
   conv-shaped GEMMs, timed inside the worker, against numpy's GEMM in this process;
2. the five CaffeNet convolution layers at batch ``--batch`` (default 32), forward and
   forward+backward, computed on OpenCL through ``keras_cct.ops.conv2d_on`` inside a
   ``tf.function`` against TensorFlow's ``keras.layers.Conv2D`` (and, for grouped layers,
   the faster of Conv2D(groups=g) and g separate Conv2Ds);
3. the per-call cost of crossing to the worker (a ping, a tiny convolution, the same inside
   ``tf.function``).

Each figure is the minimum over ``--rounds`` interleaved rounds of ``--reps`` calls (the machine
is shared, so the minimum is the least disturbed). Writes ``docs/benchmarks/opencl.json`` and
``docs/benchmarks/opencl.md``.

Usage: ``KERAS_BACKEND=tensorflow python benchmarks/opencl.py [--batch 32] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import best_of  # noqa: E402

# name: (input HWC, kernel kh, filters, stride, pad, groups)
CAFFENET = {
    "conv1": ((227, 227, 3), 11, 96, 4, 0, 1),
    "conv2": ((27, 27, 96), 5, 256, 1, 2, 2),
    "conv3": ((13, 13, 256), 3, 384, 1, 1, 1),
    "conv4": ((13, 13, 384), 3, 384, 1, 1, 2),
    "conv5": ((13, 13, 384), 3, 256, 1, 1, 2),
}
# conv-shaped GEMMs (M, N, K): CaffeNet conv2 and conv3 forward at batch 32, per group.
GEMMS = [(23328, 128, 1200), (5408, 384, 2304), (2048, 256, 1024)]


def best_time(fn, reps: int) -> float:
    """Seconds per call: min over ``reps`` timed calls (after the caller's warm-up)."""
    return best_of(fn, reps, warmup=0)


def cpu_seconds(workers=()) -> float:
    """CPU seconds used so far by this process (all threads) and the given OpenCL workers."""
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime + sum(w.request("cputime") for w in workers)


def interleaved(fns: dict, rounds: int, reps: int, workers=None) -> dict:
    """Run each function once (warm-up), then ``rounds`` rounds of ``reps`` calls each.

    Returns the minimum wall seconds per call of each; with ``workers`` (name -> list of
    worker clients whose CPU time counts for that function) also ``"<name>:cpu"``, the minimum
    CPU seconds per call (this process plus those workers): unlike wall time, that barely
    changes when other jobs share the cores.
    """
    for f in fns.values():
        f()
    out = {k: float("inf") for k in fns}
    if workers is not None:
        out.update({f"{k}:cpu": float("inf") for k in fns})
    for _ in range(rounds):
        for k, f in fns.items():
            out[k] = min(out[k], best_time(f, reps))
            if workers is not None:
                for _ in range(reps):
                    c0 = cpu_seconds(workers.get(k, ()))
                    f()
                    out[f"{k}:cpu"] = min(out[f"{k}:cpu"],
                                          cpu_seconds(workers.get(k, ())) - c0)
    return out


def bench_gemm(device, rounds, reps, results):
    from keras_cct.devices.opencl import client_for
    client = client_for(device)
    rows = []
    for M, N, K in GEMMS:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((M, K), dtype=np.float32)
        b = rng.standard_normal((K, N), dtype=np.float32)
        flops = 2.0 * M * N * K
        own = {"nn": 0.0, "tn": 0.0}
        own_cpu = 0.0
        clb = None
        npt = npc = float("inf")
        a @ b
        for _ in range(rounds):
            npt = min(npt, best_time(lambda: a @ b, reps))
            for _ in range(reps):
                c0 = cpu_seconds()
                a @ b
                npc = min(npc, cpu_seconds() - c0)
            for t, trans in (("nn", False), ("tn", True)):
                r = client.request("bench_gemm", M=M, N=N, K=K, trans_a=trans, seconds=0.2)
                own[t] = max(own[t], r["gflops"])
                if t == "nn":
                    own_cpu = max(own_cpu, r["gflop_per_cpu_s"])
            try:
                r = client.request("bench_gemm", M=M, N=N, K=K, seconds=0.2, library="clblast")
                clb = max(clb or 0.0, r["gflops"])
            except Exception as exc:  # noqa: BLE001 - pyclblast is optional
                clb = None
                results.setdefault("notes", []).append(f"CLBlast not measured: {exc}")
                results["notes"] = sorted(set(results["notes"]))
        row = {"M": M, "N": N, "K": K, "numpy_gflops": flops / npt / 1e9,
               "opencl_nn_gflops": own["nn"], "opencl_tn_gflops": own["tn"],
               "clblast_gflops": clb}
        row["opencl_vs_numpy"] = row["opencl_nn_gflops"] / row["numpy_gflops"]
        row["numpy_gflop_per_cpu_s"] = flops / npc / 1e9
        row["opencl_nn_gflop_per_cpu_s"] = own_cpu
        row["opencl_vs_numpy_per_cpu_s"] = own_cpu / row["numpy_gflop_per_cpu_s"]
        rows.append(row)
        print(f"SGEMM {M}x{N}x{K}: numpy {row['numpy_gflops']:.0f}, OpenCL NN "
              f"{own['nn']:.0f} / TN {own['tn']:.0f}, CLBlast "
              f"{'-' if clb is None else f'{clb:.0f}'} GFLOP/s; per CPU-second: numpy "
              f"{row['numpy_gflop_per_cpu_s']:.0f}, OpenCL NN {own_cpu:.0f}", flush=True)
    results["sgemm"] = rows


def bench_conv(device, batch, layers, rounds, reps, results):
    import keras
    import tensorflow as tf
    from keras_cct.lowering.geometry import conv_geometry
    from keras_cct.ops import conv2d_on
    rows = []
    for name in layers:
        (h, w, c), k, f, s, p, g = CAFFENET[name]
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((batch, h, w, c), dtype=np.float32))
        kernel = tf.Variable(0.01 * rng.standard_normal((k, k, c // g, f), dtype=np.float32))
        bias = tf.Variable(np.zeros(f, np.float32))
        geo = conv_geometry(x.shape, kernel.shape, strides=s, padding=p, groups=g)
        flops = geo.flops(batch)

        def opencl(x):
            return conv2d_on(device, x, kernel, bias, strides=s, padding=p, groups=g)

        conv = keras.layers.Conv2D(f, k, strides=s, groups=g, padding="valid")
        pad = keras.layers.ZeroPadding2D(p) if p else (lambda t: t)
        conv.build((None, h + 2 * p, w + 2 * p, c))
        split = [keras.layers.Conv2D(f // g, k, strides=s, padding="valid") for _ in range(g)]
        for layer in split:
            layer.build((None, h + 2 * p, w + 2 * p, c // g))

        def tf_conv(x):
            return conv(pad(x))

        def tf_split(x):
            xp = pad(x)
            parts = tf.split(xp, g, axis=-1)
            return tf.concat([lay(t) for lay, t in zip(split, parts)], axis=-1)

        impls = {"opencl": (opencl, [kernel, bias]),
                 "tf_conv2d": (tf_conv, [v.value for v in conv.trainable_weights])}
        if g > 1:
            impls["tf_split"] = (tf_split, [v.value for lay in split
                                            for v in lay.trainable_weights])
        fwd, fwdbwd = {}, {}
        for key, (fn, weights) in impls.items():
            ffn = tf.function(fn)

            def train(x, fn=fn, weights=weights):
                # gradients for the input and the weights, as in the middle of a network
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = fn(x)
                    loss = tf.reduce_sum(y)
                # the loss is returned too, so that the forward pass cannot be pruned
                return [loss] + tape.gradient(loss, [x] + list(weights))
            tfn = tf.function(train)
            fwd[key] = (lambda ffn=ffn: ffn(x).numpy())
            fwdbwd[key] = (lambda tfn=tfn: [t.numpy() for t in tfn(x)])
        from keras_cct.devices.opencl import client_for
        workers = {"opencl": [client_for(device)]}
        tf_ = interleaved(fwd, rounds, reps, workers)
        tb = interleaved(fwdbwd, rounds, reps, workers)
        row = {"layer": name, "batch": batch, "gflop": flops / 1e9}
        for key in impls:
            row[f"{key}_fwd_ms"] = 1e3 * tf_[key]
            row[f"{key}_fwdbwd_ms"] = 1e3 * tb[key]
            row[f"{key}_fwd_cpu_s"] = tf_[f"{key}:cpu"]
            row[f"{key}_fwdbwd_cpu_s"] = tb[f"{key}:cpu"]
        best_tf_fwd = min(v for k_, v in tf_.items() if k_ in impls and k_ != "opencl")
        best_tf_fb = min(v for k_, v in tb.items() if k_ in impls and k_ != "opencl")
        best_tf_fb_cpu = min(tb[f"{k_}:cpu"] for k_ in impls if k_ != "opencl")
        row["fwdbwd_cpu_ratio_vs_best_tf"] = tb["opencl:cpu"] / best_tf_fb_cpu
        row["opencl_fwd_gflops"] = flops / tf_["opencl"] / 1e9
        row["opencl_fwdbwd_gflops"] = 3 * flops / tb["opencl"] / 1e9
        row["fwd_ratio_vs_best_tf"] = tf_["opencl"] / best_tf_fwd
        row["fwdbwd_ratio_vs_best_tf"] = tb["opencl"] / best_tf_fb
        rows.append(row)
        print(f"{name}: OpenCL fwd {row['opencl_fwd_ms']:.1f} ms, fwd+bwd "
              f"{row['opencl_fwdbwd_ms']:.1f} ms; TF Conv2D {row['tf_conv2d_fwd_ms']:.1f} / "
              f"{row['tf_conv2d_fwdbwd_ms']:.1f} ms"
              + (f"; TF split {row['tf_split_fwd_ms']:.1f} / {row['tf_split_fwdbwd_ms']:.1f} ms"
                 if g > 1 else "")
              + f"; fwd+bwd ratio vs best TF {row['fwdbwd_ratio_vs_best_tf']:.2f} (wall), "
              f"{row['fwdbwd_cpu_ratio_vs_best_tf']:.2f} (CPU seconds)", flush=True)
    results["conv"] = rows


def bench_crossing(device, rounds, results):
    import tensorflow as tf
    from keras_cct.devices.opencl import client_for, conv2d_forward
    from keras_cct.ops import conv2d_on
    client = client_for(device)
    x = np.ones((1, 4, 4, 1), np.float32)
    k = np.ones((1, 1, 1, 1), np.float32)
    big = np.ones((1, 768, 768, 4), np.float32)  # 9 MiB in and out
    kb = np.ones((1, 1, 4, 4), np.float32)
    tx, tk = tf.constant(x), tf.constant(k)
    op = tf.function(lambda: conv2d_on(device, tx, tk))
    fns = {"ping": lambda: client.request("ping"),
           "tiny_conv": lambda: conv2d_forward(device, x, k),
           "tiny_conv_tf_function": lambda: op().numpy(),
           # 9 MiB in and 9 MiB out, a 1x1 4->4 convolution: mostly the copies
           "conv1x1_9MiB_in_out": lambda: conv2d_forward(device, big, kb)}
    t = interleaved(fns, rounds, 20)
    results["crossing_ms"] = {k_: 1e3 * v for k_, v in t.items()}
    print("crossing (ms): " + ", ".join(f"{k_} {1e3 * v:.3f}" for k_, v in t.items()), flush=True)


def write(results, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "opencl.json").write_text(json.dumps(results, indent=1))
    lines = [f"# OpenCL benchmark ({results['device']})", "",
             f"Machine: {results['machine']}; command: `{results['command']}`.",
             "Minimum over interleaved rounds; the machine is shared, so figures are noisy.", ""]
    if "sgemm" in results:
        lines += ["## SGEMM (GFLOP/s, same cores)", "",
                  "| M x N x K | numpy | OpenCL NN | OpenCL TN | CLBlast | OpenCL NN / numpy | "
                  "numpy per CPU-s | OpenCL NN per CPU-s | ratio per CPU-s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in results["sgemm"]:
            clb = "-" if r["clblast_gflops"] is None else f"{r['clblast_gflops']:.0f}"
            lines.append(f"| {r['M']}x{r['N']}x{r['K']} | {r['numpy_gflops']:.0f} | "
                         f"{r['opencl_nn_gflops']:.0f} | {r['opencl_tn_gflops']:.0f} | {clb} | "
                         f"{r['opencl_vs_numpy']:.2f} | {r['numpy_gflop_per_cpu_s']:.0f} | "
                         f"{r['opencl_nn_gflop_per_cpu_s']:.0f} | "
                         f"{r['opencl_vs_numpy_per_cpu_s']:.2f} |")
        lines.append("")
    if "conv" in results:
        lines += [f"## CaffeNet convolutions, batch {results['conv'][0]['batch']} (ms)", "",
                  "| layer | GFLOP | OpenCL fwd | OpenCL fwd+bwd | TF Conv2D fwd | "
                  "TF Conv2D fwd+bwd | TF split fwd | TF split fwd+bwd | "
                  "OpenCL / best TF fwd+bwd, wall | same, CPU seconds |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["conv"]:
            sf = f"{r['tf_split_fwd_ms']:.1f}" if "tf_split_fwd_ms" in r else "-"
            sb = f"{r['tf_split_fwdbwd_ms']:.1f}" if "tf_split_fwdbwd_ms" in r else "-"
            lines.append(f"| {r['layer']} | {r['gflop']:.2f} | {r['opencl_fwd_ms']:.1f} | "
                         f"{r['opencl_fwdbwd_ms']:.1f} | {r['tf_conv2d_fwd_ms']:.1f} | "
                         f"{r['tf_conv2d_fwdbwd_ms']:.1f} | {sf} | {sb} | "
                         f"{r['fwdbwd_ratio_vs_best_tf']:.2f} | "
                         f"{r['fwdbwd_cpu_ratio_vs_best_tf']:.2f} |")
        lines += ["", "CPU seconds: this process (all threads) plus the OpenCL worker, per call; "
                  "less disturbed by other jobs than wall time. Per-layer CPU seconds are in "
                  "the JSON file.", ""]
    if "crossing_ms" in results:
        lines += ["## Crossing to the worker (ms per call)", "", "| call | ms |", "|---|---|"]
        for k, v in results["crossing_ms"].items():
            lines.append(f"| {k} | {v:.3f} |")
        lines.append("")
    for note in results.get("notes", []):
        lines.append(f"Note: {note}")
    (out_dir / "opencl.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="OpenCL device (default: first working)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", default=",".join(CAFFENET))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list of: sgemm,conv,crossing")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    from keras_cct.devices.registry import opencl_platforms
    device = args.device
    if device is None:
        for plat in opencl_platforms()["platforms"]:
            for d in plat["devices"]:
                if not d["build_error"] and device is None:
                    device = f"opencl:{plat['index']}:{d['index']}"
                    desc = f"{d['name']} ({plat['name']}), {d['compute_units']} compute units"
        if device is None:
            print(f"no working OpenCL device: {opencl_platforms()}", file=sys.stderr)
            return 1
    else:
        desc = device
    results = {"device": f"{device}: {desc}",
               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                          f"load average {os.getloadavg()[0]:.1f} at start",
               "command": "python benchmarks/opencl.py " + " ".join(argv or sys.argv[1:])}
    skip = set(filter(None, args.skip.split(",")))
    if "sgemm" not in skip:
        bench_gemm(device, args.rounds, args.reps, results)
    if "crossing" not in skip:
        bench_crossing(device, args.rounds, results)
    if "conv" not in skip:
        bench_conv(device, args.batch, args.layers.split(","), args.rounds, args.reps, results)
    results["machine"] += f", {os.getloadavg()[0]:.1f} at end"
    write(results, Path(args.out))
    print(f"wrote {args.out}/opencl.json and opencl.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
