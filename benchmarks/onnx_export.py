"""Benchmark: onnxruntime inference of exported models against Keras' ``model.predict``.

Imports Caffe's LeNet (trained weights) and BVLC CaffeNet (deploy.prototxt, random weights)
from ``../shared/caffe-models`` with :func:`keras_cct.caffe.load_net`; without that folder, or
with ``--built``, builds nets of the same shapes with HybridConv2D layers instead (CaffeNet's
grouped conv2/4/5 included, its LRN layers left out). Exports each with
:func:`keras_cct.export.export_onnx`, checks onnxruntime's output against Keras', then times
images/s of both. Writes ``docs/benchmarks/onnx_export.json`` and ``.md``.

Run (TensorFlow backend)::

    python benchmarks/onnx_export.py [--nets lenet caffenet] [--batch 64 16] [--steps 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import best_of

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"


def lenet(keras, H):
    """Caffe's LeNet (examples/mnist/lenet.prototxt) shapes."""
    inp = keras.Input((28, 28, 1), name="data")
    x = H(20, 5, name="conv1")(inp)
    x = keras.layers.MaxPooling2D(2, name="pool1")(x)
    x = H(50, 5, name="conv2")(x)
    x = keras.layers.MaxPooling2D(2, name="pool2")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(500, activation="relu", name="ip1")(x)
    x = keras.layers.Dense(10, name="ip2")(x)
    out = keras.layers.Softmax(name="prob")(x)
    return keras.Model(inp, out, name="lenet")


def caffenet(keras, H):
    """BVLC CaffeNet (bvlc_reference_caffenet/deploy.prototxt) shapes, without LRN."""
    inp = keras.Input((227, 227, 3), name="data")
    x = H(96, 11, strides=4, activation="relu", name="conv1")(inp)
    x = keras.layers.MaxPooling2D(3, 2, name="pool1")(x)
    x = H(256, 5, padding=2, groups=2, activation="relu", name="conv2")(x)
    x = keras.layers.MaxPooling2D(3, 2, name="pool2")(x)
    x = H(384, 3, padding=1, activation="relu", name="conv3")(x)
    x = H(384, 3, padding=1, groups=2, activation="relu", name="conv4")(x)
    x = H(256, 3, padding=1, groups=2, activation="relu", name="conv5")(x)
    x = keras.layers.MaxPooling2D(3, 2, name="pool5")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(4096, activation="relu", name="fc6")(x)
    x = keras.layers.Dense(4096, activation="relu", name="fc7")(x)
    x = keras.layers.Dense(1000, name="fc8")(x)
    out = keras.layers.Softmax(name="prob")(x)
    return keras.Model(inp, out, name="caffenet")


SHARED = ROOT.parent / "shared" / "caffe-models"
CAFFE_FILES = {
    "lenet": ("lenet_mnist/lenet.prototxt", "lenet_mnist/lenet_iter_10000.caffemodel"),
    "caffenet": ("prototxt-only/bvlc_reference_caffenet/deploy.prototxt", None),
}


def make_model(name: str, built: bool):
    """The net to time and where it came from."""
    import keras

    import keras_cct

    prototxt, weights = CAFFE_FILES[name]
    if not built and (SHARED / prototxt).exists():
        from keras_cct.caffe import load_net

        model = load_net(str(SHARED / prototxt), None if weights is None else
                         str(SHARED / weights))
        return model, f"load_net({prototxt}{', trained weights' if weights else ''})"
    model = {"lenet": lenet, "caffenet": caffenet}[name](keras, keras_cct.HybridConv2D)
    return model, "built with HybridConv2D (benchmarks/onnx_export.py)"


def bench(name: str, batch: int, steps: int, repeats: int, workdir: Path,
          built: bool = False) -> dict:
    import onnxruntime as ort

    import keras_cct
    from keras_cct.export import export_onnx
    from tests.reference import rel_err

    model, origin = make_model(name, built)
    path = workdir / f"{name}.onnx"
    t0 = time.perf_counter()
    export_onnx(model, path)
    export_s = time.perf_counter() - t0
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    n = batch * steps
    x = np.random.default_rng(0).random((n,) + tuple(model.inputs[0].shape[1:]), dtype=np.float32)

    feed = model.inputs[0].name

    def run_ort():
        return np.concatenate([sess.run(None, {feed: x[i:i + batch]})[0]
                               for i in range(0, n, batch)])

    err = rel_err(run_ort(), model.predict(x, batch_size=batch, verbose=0))
    keras_s = best_of(lambda: model.predict(x, batch_size=batch, verbose=0), repeats)
    ort_s = best_of(run_ort, repeats)
    lowerings = {layer.name: layer.chosen_lowering for layer in model.layers
                 if isinstance(layer, keras_cct.HybridConv2D)}
    return {
        "net": name, "source": origin, "batch": batch, "images": n, "params": int(model.count_params()),
        "onnx_mb": round(path.stat().st_size / 1e6, 2), "export_s": round(export_s, 2),
        "rel_err_onnx_vs_keras": err,
        "keras_predict_img_s": round(n / keras_s, 1),
        "onnxruntime_img_s": round(n / ort_s, 1),
        "speedup": round(keras_s / ort_s, 2),
        "keras_lowerings": lowerings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["lenet", "caffenet"])
    parser.add_argument("--batch", nargs="+", type=int, default=[64, 16],
                        help="one batch size per net")
    parser.add_argument("--steps", type=int, default=4, help="batches per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--built", action="store_true",
                        help="build the nets with HybridConv2D instead of importing them")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()

    import keras
    import onnxruntime as ort
    import tensorflow as tf
    import tf2onnx

    batches = dict(zip(args.nets, args.batch + args.batch[-1:] * len(args.nets)))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench(n, batches[n], args.steps, args.repeats, Path(tmp), args.built) for n in args.nets]
    env = {"keras": keras.__version__, "tensorflow": tf.__version__,
           "tf2onnx": tf2onnx.__version__, "onnxruntime": ort.__version__,
           "backend": keras.backend.backend(), "cpus": os.cpu_count(),
           "machine": platform.processor() or platform.machine(),
           "load_avg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
           "command": "python benchmarks/onnx_export.py " + " ".join(
               ["--nets", *args.nets, "--batch", *map(str, args.batch),
                "--steps", str(args.steps), "--repeats", str(args.repeats)]
               + (["--built"] if args.built else [])),
           "timing": f"{args.steps} batches per run, best of {args.repeats} runs after one "
                     f"warm-up run"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "onnx_export.json").write_text(json.dumps({"env": env, "results": rows}, indent=2))
    lines = ["# ONNX export: onnxruntime vs Keras `model.predict`", "",
             f"`{env['command']}` - Keras {env['keras']} ({env['backend']}), TF "
             f"{env['tensorflow']}, tf2onnx {env['tf2onnx']}, onnxruntime {env['onnxruntime']}"
             f" (CPUExecutionProvider), {env['cpus']} CPUs (1-min load average before/after: "
             f"{env['load_avg_1min_before_after']}, other jobs share the machine); "
             f"{env['timing']}.", "",
             "| net | batch | images/run | params | ONNX MB | export s | rel. err | Keras img/s | "
             "onnxruntime img/s | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['net']} | {r['batch']} | {r['images']} | {r['params']:,} | {r['onnx_mb']} | "
                     f"{r['export_s']} | {r['rel_err_onnx_vs_keras']:.1e} | "
                     f"{r['keras_predict_img_s']} | {r['onnxruntime_img_s']} | "
                     f"{r['speedup']}x |")
    lines += ["", "Sources: " + "; ".join(f"{r['net']}: {r['source']}" for r in rows) + ".",
              "Keras lowerings chosen by the planner: " + "; ".join(
                  f"{r['net']}: " + ", ".join(f"{k}={v}" for k, v in r["keras_lowerings"].items())
                  for r in rows) + "."]
    (out / "onnx_export.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
