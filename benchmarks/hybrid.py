"""Benchmark of CCTStrategy (CcT's RQ4 on this machine): each device alone against the hybrid.

Configurations, each in its own process (TF's thread pools are fixed at start-up):

* ``tf1``: TensorFlow alone, 1 intra-op thread, its process pinned to core 0.
* ``cl1``: the OpenCL device alone, PoCL limited to 1 thread (``POCL_MAX_PTHREAD_COUNT=1``),
  its worker pinned to core 1 (``KERAS_CCT_WORKER_CPUS=1``).
* ``hybrid``: both under CCTStrategy, each confined to its own core, with ``split="flops"``,
  and with fixed splits (to find the best fixed split).
* ``tf2``: TensorFlow alone on both cores (the best single device using both cores).
* ``both``: the two devices at the same time, each on half the batch of its own, with no
  split, join or synchronisation: what they deliver together, the hybrid's real ceiling.

For a CaffeNet convolution (conv2, batch 32) and a small CaffeNet-like model it reports
throughput (images/s, forward+backward), the fractions used, how far ``split="flops"`` was from
the best fixed split, and the balance efficiency (sum of per-device busy time / (devices x
step time) of a training step, forward + backward). Writes ``hybrid.json``, ``hybrid.md``,
``hybrid.png``.
Run: ``python -m benchmarks.hybrid [--backend tensorflow|jax|torch] [--quick] [--rounds N]
[--out DIR]``. With ``--backend jax`` or ``torch`` the same configurations run on that Keras
backend (``jax1``/``jax2``, ``torch1``/``torch2`` in place of ``tf1``/``tf2``: JAX's XLA CPU
client with one intra-op thread, PyTorch with ``torch.set_num_threads``; the ``2`` configuration
pinned to the two cores the hybrid uses) and write ``hybrid_jax.*`` / ``hybrid_torch.*``; the
summary gives hybrid / sum of the devices and hybrid / the backend alone on those cores.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (DEFAULT_OUT, best_of, cpu_info, library_versions, markdown_table,
                               spawn_config, write_results)

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("tensorflow", "jax", "torch")
#: the configurations' prefix and the CPU device name, per Keras backend
OWN = {"tensorflow": "tf", "jax": "jax", "torch": "torch"}
CPU = {"tensorflow": "tf:cpu:0", "jax": "jax:cpu:0", "torch": "torch:cpu"}
#: CaffeNet conv2, the layer measured alone (its input: 96 channels).
CONV2 = dict(filters=256, kernel_size=5, padding=2, groups=2)


# ------------------------------------------------------------------------------ worker side

def _layer(strategy_devices, split, hw, batch, rebalance):
    from keras_cct import CCTStrategy, HybridConv2D
    s = None
    if strategy_devices:
        s = CCTStrategy(strategy_devices, split=split, rebalance=rebalance)
    kw = dict(CONV2)
    if s:
        with s.scope():
            layer = HybridConv2D(**kw)
    else:
        layer = HybridConv2D(**kw)
    layer.build((batch, hw, hw, 96))
    return layer, s


def _model(strategy, batch):
    import keras
    from keras_cct import HybridConv2D
    import contextlib
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        inp = keras.Input((64, 64, 3))
        h = HybridConv2D(48, 7, strides=2, activation="relu")(inp)
        h = keras.layers.MaxPooling2D(3, 2)(h)
        h = HybridConv2D(128, 5, padding=2, groups=2, activation="relu")(h)
        h = keras.layers.MaxPooling2D(3, 2)(h)
        h = HybridConv2D(192, 3, padding=1, activation="relu")(h)
        h = HybridConv2D(192, 3, padding=1, groups=2, activation="relu")(h)
        h = HybridConv2D(128, 3, padding=1, groups=2, activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        h = keras.layers.Dense(256, activation="relu")(h)
        model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _confine(spec: dict) -> str:
    """Confine this process to its cores and threads before the backend starts its thread
    pools; returns the backend."""
    backend = spec.get("backend", "tensorflow")
    threads = spec["tf_threads"]  # the backend's threads (the key predates other backends)
    if hasattr(os, "sched_setaffinity"):
        if spec.get("pin"):
            # before the backend starts its thread pools, which inherit this mask: with one
            # intra-op thread TF still runs independent ops (e.g. batch partitions) on several
            # inter-op threads, so the thread counts alone do not confine it to one core
            os.sched_setaffinity(0, {0})
        elif backend != "tensorflow":  # the cores the hybrid uses
            os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:threads]))
    if backend == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    elif backend == "jax":
        if threads == 1:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       " --xla_cpu_multi_thread_eigen=false"
                                       " intra_op_parallelism_threads=1")
        import jax  # noqa: F401
    else:
        import torch
        torch.set_num_threads(threads)
    return backend


def _layer_step(layer, backend: str, batch: int, hw: int):
    """``(step, x)``: one forward+backward of ``layer`` (the output and the gradients with
    respect to the input and the weights: :func:`keras_cct.lowering.timing.layer_steps`),
    waited for, and its input."""
    import keras

    from keras_cct.lowering.timing import block, layer_steps
    x = keras.ops.convert_to_tensor(
        np.random.default_rng(0).standard_normal((batch, hw, hw, 96)).astype("float32"))
    _, step = layer_steps(layer, [x])
    return (lambda x: block(step(x))), x


def run_config(spec: dict) -> dict:
    """Measure one configuration in this process (called in a fresh subprocess)."""
    backend = _confine(spec)
    from keras_cct.devices import get_device
    devices = []
    for name in spec["devices"]:
        if name.startswith("opencl"):
            env = {"POCL_MAX_PTHREAD_COUNT": str(spec["cl_threads"])}
            if spec.get("pin"):
                env["KERAS_CCT_WORKER_CPUS"] = "1"
            devices.append(get_device(name, env=env))
        else:
            devices.append(get_device(name))
    use_strategy = spec["devices"] != [CPU[backend]]
    batch, hw, reps = spec["batch"], 27, spec["repeats"]
    if spec.get("concurrent"):
        return _concurrent(devices, batch, hw, spec.get("seconds", 6.0), backend)
    out = {}
    # --- one layer, forward+backward
    # the strategy as a user gets it: split="flops" then rebalancing while training runs
    # (fixed splits stay fixed); warm-up steps let the fractions settle before timing
    rebalance = spec["split"] == "flops"
    layer, s = _layer(devices if use_strategy else None, spec["split"], hw, batch, rebalance)
    step, x = _layer_step(layer, backend, batch, hw)
    for _ in range(spec.get("settle", 10)):
        step(x)
    out["layer_s"] = best_of(lambda: step(x), reps)
    if s is not None:
        # balance efficiency of a training step: sum over devices of their busy time (forward
        # + backward shard) / (devices x the step's wall time); the median of `reps` steps
        effs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step(x)
            wall = time.perf_counter() - t0
            rep = s.report()
            busy = [(r["last_ms"] if r["images"] else 0.0)
                    + (r["last_bwd_ms"] if r["bwd_images"] else 0.0) for r in rep]
            effs.append(sum(busy) / 1e3 / (len(rep) * wall))
        out["fractions"] = {r["device"]: r["fraction"] for r in rep}
        out["bwd_fractions"] = {r["device"]: r["bwd_fraction"] for r in rep}
        out["images"] = {r["device"]: r["images"] for r in rep}
        out["bwd_images"] = {r["device"]: r["bwd_images"] for r in rep}
        out["balance_efficiency"] = float(np.median(effs))
        out["balance_efficiency_steps"] = effs
    # --- small CaffeNet-like model, training images/s
    s2 = None
    if use_strategy:
        from keras_cct import CCTStrategy
        s2 = CCTStrategy(devices, split=spec["split"], rebalance=spec["split"] == "flops")
    model = _model(s2, batch)
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((batch * spec["steps"], 64, 64, 3)).astype("float32")
    ys = rng.integers(0, 10, len(xs))
    # The same input pipeline in every configuration: batches cached in memory, tf.data's
    # autotuning off. With TF confined to one core, autotuning's background threads compete
    # with the training step for that core (measured: fit on numpy arrays 64.7 ms/step, this
    # dataset 52.1, train_on_batch 52.9, CaffeNet-like model, TF alone on core 0).
    if backend == "tensorflow":
        import tensorflow as tf
        options = tf.data.Options()
        options.autotune.enabled = False
        data = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch).cache() \
            .with_options(options)
        model.fit(data.take(2), verbose=0)  # trace + warm up

        def epoch():
            model.fit(data, epochs=1, verbose=0)
    else:  # numpy batches (no tf.data outside TensorFlow)
        model.fit(xs[:2 * batch], ys[:2 * batch], batch_size=batch, verbose=0)  # warm up

        def epoch():
            model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    epoch_s = best_of(epoch, spec.get("epochs", 3), warmup=1)
    out["model_images_per_s"] = len(xs) / epoch_s
    if s2 is not None:
        out["model_fractions"] = {r["layer"] + "/" + r["device"]: r["fraction"]
                                  for r in s2.report()}
        out["model_bwd_fractions"] = {r["layer"] + "/" + r["device"]: r["bwd_fraction"]
                                      for r in s2.report()}
    out["layer_images_per_s"] = batch / out["layer_s"]
    return out


def _concurrent(devices, batch: int, hw: int, seconds: float,
                backend: str = "tensorflow") -> dict:
    """Both devices at once, each on half the batch of its own (no split, no join, no
    synchronisation): the throughput they deliver *together* on this machine, which is the
    hybrid's real ceiling (each slows the other down through the memory system they share)."""
    import threading

    import keras

    from keras_cct.devices.opencl.conv import conv2d_backward, conv2d_forward
    tf_dev, cl_dev = devices
    layer, _ = _layer(None, "flops", hw, batch // 2, False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch // 2, hw, hw, 96)).astype("float32")
    run, tx = _layer_step(layer, backend, batch // 2, hw)
    k = keras.ops.convert_to_numpy(layer.kernel)
    kw = dict(padding=CONV2["padding"], groups=CONV2["groups"])
    dy = rng.standard_normal((batch // 2, hw, hw, CONV2["filters"])).astype("float32")

    def cl_step():
        conv2d_forward(cl_dev.name, x, k, **kw)
        conv2d_backward(cl_dev.name, x, k, dy, **kw)

    run(tx)
    cl_step()  # warm up both
    done = {"cl": 0}
    stop = threading.Event()

    def cl_loop():
        while not stop.is_set():
            cl_step()
            done["cl"] += 1

    thread = threading.Thread(target=cl_loop)
    t0 = time.perf_counter()
    thread.start()
    tf_steps = 0
    while time.perf_counter() - t0 < seconds:
        run(tx)
        tf_steps += 1
    tf_s = time.perf_counter() - t0
    stop.set()
    thread.join()
    cl_s = time.perf_counter() - t0
    rates = {tf_dev.name: tf_steps * (batch // 2) / tf_s, cl_dev.name: done["cl"] * (batch // 2)
             / cl_s}
    return {"layer_images_per_s": sum(rates.values()), "concurrent_rates": rates,
            "model_images_per_s": float("nan")}


# ------------------------------------------------------------------------------ driver side

def _spawn(spec: dict) -> dict:
    return spawn_config("benchmarks.hybrid", spec, backend=spec.get("backend", "tensorflow"))


def _best(a, b):
    """Of two rounds of one configuration: the layer's figures (throughput, fractions,
    balance) from the round with the faster layer, the model's from the faster model."""
    if a is None:
        return b
    out = dict(a if a["layer_images_per_s"] >= b["layer_images_per_s"] else b)
    model = a if a["model_images_per_s"] >= b["model_images_per_s"] else b
    out.update({k: v for k, v in model.items() if k.startswith("model_")})
    return out


def plot(data, path: Path, own: str = "tf") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfg = data["configs"]
    names = [f"{own}1", "cl1", "hybrid", f"{own}2"]
    labels = [f"{own}, 1 core", "OpenCL, 1 core", "hybrid (flops split)", f"{own}, 2 cores"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "layer_images_per_s", "CaffeNet conv2, fwd+bwd"),
                           (axes[1], "model_images_per_s", "CaffeNet-like model, training")):
        vals = [cfg[n][key] for n in names]
        ax.bar(labels, vals, color=["C0", "C1", "C2", "C7"])
        ax.axhline(cfg[f"{own}1"][key] + cfg["cl1"][key], color="k", ls="--", lw=1,
                   label="ideal hybrid (sum of the two)")
        if key == "layer_images_per_s" and "both" in cfg:
            ax.axhline(cfg["both"][key], color="C3", ls=":", lw=1.5,
                       label="both at once, unsplit (sum)")
        ax.set_ylabel("images/s")
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=15)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _balance_cell(value: float):
    """A balance efficiency for the table: over 1 (the devices busier than the step was long)
    is a timing error, shown as such and never as a result."""
    if value is None or not np.isfinite(value):
        return "-"
    if value > 1.0:
        return f"({value:.2f}: over 1, a timing error, not a result)"
    return f"{value:.3f}"


def markdown(data: dict) -> str:
    """The results page of one run (``data`` as written to the JSON file)."""
    backend, batch, rounds = data["backend"], data["batch"], data["rounds"]
    configs, summary, specs, cpu = data["configs"], data["summary"], data["specs"], \
        data["machine"]["cpu"]
    own = OWN[backend]
    rows = []
    for name, c in configs.items():
        fr, bfr = c.get("fractions", {}), c.get("bwd_fractions", {})
        rows.append([name, specs[name]["devices"], c["layer_images_per_s"],
                     c["model_images_per_s"],
                     ", ".join(f"{k} {v:.2f}/{bfr[k]:.2f}" for k, v in fr.items()) or "-",
                     _balance_cell(c.get("balance_efficiency"))])
    name = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}[backend]
    md = (f"# Hybrid execution benchmark (CcT RQ4), {name}\n\n"
          f"Command: `{data['command']}`. "
          f"Batch {batch}; each configuration run {rounds} time(s) in turn, its best kept. "
          f"Machine: **{cpu['model']}**, {cpu['usable_cores']} usable cores, vector units: "
          f"{cpu['vector_units']}, matrix units: {cpu['matrix_units']}. "
          f"Each device confined to its own core: {name} ({own}1 and its share of the "
          "hybrid) pinned to core 0 with 1 intra-op thread, the OpenCL worker pinned to core 1 "
          "(`KERAS_CCT_WORKER_CPUS=1`, PoCL `POCL_MAX_PTHREAD_COUNT=1`); "
          f"`{own}2`: {name} alone on both cores.\n\n" +
          markdown_table(["config", "devices", "conv2 img/s (f+b)", "model img/s (train)",
                          "fractions (conv2, fwd/bwd)", "balance efficiency (f+b)"], rows) + "\n")
    for key, s in summary.items():
        md += (f"- {key}: hybrid / ({own} 1 core + OpenCL 1 core) = {s['hybrid_vs_ideal']:.2f} "
               f"(CcT: about 0.88); hybrid / {own} alone on 2 cores = "
               f"{s['hybrid_vs_all_cores']:.2f}; flops split / best fixed split "
               f"({s[f'best_fixed_split_{own}']:.1f} to {own}) = "
               f"{s['flops_vs_best_fixed']:.2f}\n")
    lay = summary["layer_images_per_s"]
    md += (f"- `both`: the two devices at once, each on {batch // 2} images of its own with no "
           f"split, join or synchronisation, deliver {lay['both_at_once_vs_ideal']:.2f} of the "
           f"sum of their solo throughputs (they slow each other down through the memory system "
           f"they share); the hybrid reaches {lay['hybrid_vs_both_at_once']:.2f} of that.\n")
    if any(c.get("balance_efficiency", 0) > 1.0 for c in configs.values()):
        md += ("- Balance efficiency (the devices' busy time over devices x the step's wall "
               "time) cannot exceed 1: values over 1 are a timing error of the shards' clocks "
               "(on JAX, host markers around work XLA schedules on its own), not results.\n")
    return md


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS, default="tensorflow",
                        help="the Keras backend of every configuration (default tensorflow)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=None,
                        help="run every configuration this many times, in turn, and keep each "
                             "one's best (default: 2, 1 with --quick)")
    parser.add_argument("--short", action="store_true",
                        help="a smoke test: tiny batch and layer counts, minutes of nothing "
                             "measured (checks that every configuration runs)")
    args = parser.parse_args(argv)
    from tqdm import tqdm
    backend, own = args.backend, OWN[args.backend]
    cpu = CPU[backend]
    batch = 4 if args.short else 16 if args.quick else 32
    quick = args.quick or args.short
    base = dict(batch=batch, repeats=1 if args.short else 2 if quick else 8,
                steps=1 if args.short else 3 if quick else 40,
                epochs=1 if quick else 3, settle=1 if args.short else 10,
                cl_threads=1, split="flops", backend=backend)
    fixed = [0.5] if args.short else [0.5, 0.6, 0.7] if quick else [0.4, 0.5, 0.6, 0.7, 0.8]
    specs = {f"{own}1": dict(base, devices=[cpu], tf_threads=1, pin=True),
             "cl1": dict(base, devices=["opencl:0:0"], tf_threads=1, pin=True),
             "hybrid": dict(base, devices=[cpu, "opencl:0:0"], tf_threads=1, pin=True),
             f"{own}2": dict(base, devices=[cpu], tf_threads=2, pin=False),
             "both": dict(base, devices=[cpu, "opencl:0:0"], tf_threads=1, pin=True,
                          concurrent=True,
                          seconds=0.5 if args.short else 3.0 if quick else 8.0)}
    for f in fixed:
        specs[f"fixed{f}"] = dict(base, devices=[cpu, "opencl:0:0"], tf_threads=1,
                                  split=[f, 1 - f], pin=True)
    # Rounds in turn (every configuration, then every one again): a slow spell of the machine
    # then hits all configurations alike instead of the one that happened to run in it.
    rounds = args.rounds or (1 if quick else 2)
    configs = {}
    jobs = [name for _ in range(rounds) for name in specs]
    for name in tqdm(jobs, desc="hybrid benchmark", unit="config"):
        configs[name] = _best(configs.get(name), _spawn(specs[name]))
    summary = {}
    for key in ("layer_images_per_s", "model_images_per_s"):
        ideal = configs[f"{own}1"][key] + configs["cl1"][key]
        best_fixed = max(fixed, key=lambda f: configs[f"fixed{f}"][key])
        summary[key] = {
            "hybrid_vs_ideal": configs["hybrid"][key] / ideal,
            "hybrid_vs_all_cores": configs["hybrid"][key] / configs[f"{own}2"][key],
            f"best_fixed_split_{own}": best_fixed,
            "flops_vs_best_fixed": configs["hybrid"][key] / configs[f"fixed{best_fixed}"][key],
        }
        if backend == "tensorflow":  # the names benchmarks/__main__.py reads
            summary[key]["hybrid_vs_tf2"] = summary[key]["hybrid_vs_all_cores"]
            summary[key]["best_fixed_split_tf"] = best_fixed
    both = configs["both"]
    summary["layer_images_per_s"]["hybrid_vs_both_at_once"] = \
        configs["hybrid"]["layer_images_per_s"] / both["layer_images_per_s"]
    summary["layer_images_per_s"]["both_at_once_vs_ideal"] = \
        both["layer_images_per_s"] / (configs[f"{own}1"]["layer_images_per_s"]
                                      + configs["cl1"]["layer_images_per_s"])
    cpu = cpu_info()
    flag = (f" --backend {backend}" if backend != "tensorflow" else "") + \
        (" --short" if args.short else " --quick" if args.quick else "")
    data = {"backend": backend, "batch": batch, "rounds": rounds, "configs": configs,
            "summary": summary, "specs": {k: v for k, v in specs.items()},
            "command": f"python -m benchmarks.hybrid{flag}",
            "machine": {"cpu": cpu, "versions": library_versions()}}
    md = markdown(data)
    stem = "hybrid" if backend == "tensorflow" else f"hybrid_{backend}"
    write_results(args.out, stem, data, md)
    plot(data, args.out / f"{stem}.png", own)
    print(md)
    return data


if __name__ == "__main__":
    main()
