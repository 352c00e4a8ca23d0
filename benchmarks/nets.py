"""Whole Caffe nets, one training step (forward + backward + SGD update): keras_cct vs Keras'
Conv2D vs PyTorch, in images per second.

``python -m benchmarks.nets [--quick] [--nets caffenet:32,caffenet:128,vgg16:8,resnet50:16]
[--dtypes float32,bfloat16] [--rounds N] [--out DIR]``

Candidates, for each net, batch and dtype (all built first, then timed in interleaved rounds
of one step each, in one process; the best and the median of the rounds are kept):

* ``keras_cct``: the net as ``cct time --model NET --random-data --input-shape data=N,C,H,W``
  builds and times it (:func:`keras_cct.caffe.train_commands.time_model` and
  :func:`~keras_cct.caffe.train_commands.compile_for_timing`: HybridConv2D with the defaults as
  shipped, Caffe's SGD at learning rate 0 and momentum 0, which keeps no history, as
  PyTorch's below; ``train_on_batch`` on the one random batch), on the TensorFlow backend;
* ``keras_conv2d``: the same net with ``keras.layers.Conv2D`` (``cct time --conv keras``);
* ``torch_nchw`` / ``torch_cl``: the same .prototxt translated to ``torch.nn``
  (:mod:`benchmarks.torch_net`), NCHW in the plain (contiguous) and the channels_last memory
  format; ``torch.optim.SGD`` (lr 0, no momentum, as the Keras side). The faster of the two is
  "PyTorch best".

bfloat16: Keras runs under ``keras.mixed_precision.set_global_policy("mixed_bfloat16")``
(bfloat16 compute, float32 variables), PyTorch under ``torch.autocast("cpu", torch.bfloat16)``
(float32 parameters; the loss in float32).

Deploy nets (VGG16, ResNet-50, MobileNet) have no loss: they are made trainable the obvious way
(written to ``<out>/nets_prototxt/``): the final ``Softmax`` becomes a ``SoftmaxWithLoss`` on
a ``label`` Input, and ``BatchNorm``'s ``use_global_stats: true`` (inference) is dropped so that
training uses the batch statistics. The same rewritten file drives every candidate.

Also a per-layer profile of CaffeNet (float32): each Keras layer's forward and
forward+backward in isolation at its real shape (``cct time``'s per-layer timers) against the
PyTorch module at the same shape, summed per layer type.

Writes ``nets.json``, ``nets.md`` and ``nets.png`` (the page and the plot rendered by
:mod:`benchmarks.nets_report`) under ``--out`` (default ``docs/benchmarks/``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.common import onednn_versions, round_order
from benchmarks.nets_report import (CANDIDATES, DEFAULT_NETS, RELU_MOVED, markdown, plot,
                                    summarize)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "benchmarks"
MODELS = Path(os.environ.get("KERAS_CCT_CAFFE_MODELS", str(
    Path(__file__).resolve().parents[2] / "shared" / "caffe-models" / "prototxt-only")))
# name -> (prototxt relative to MODELS, image height/width)
NETS = {
    "caffenet": ("bvlc_reference_caffenet/train_val.prototxt", 227),
    "alexnet": ("bvlc_alexnet/train_val.prototxt", 227),
    "vgg16": ("vgg16/deploy.prototxt", 224),
    "resnet50": ("resnet50/ResNet-50-deploy.prototxt", 224),
    "mobilenet": ("mobilenet_caffe/mobilenet_deploy.prototxt", 224),
}


# ------------------------------------------------------------------------------ nets

def _net_file(name: str) -> Tuple[Path, int]:
    """The prototxt and image size of a net of :data:`NETS` or of a ``.prototxt`` path (its
    size from its Input shape or its data layer's crop_size)."""
    if name in NETS:
        rel, hw = NETS[name]
        src = MODELS / rel
        if not src.exists():
            raise FileNotFoundError(f"{src} is absent (the Caffe nets live in ../shared; set "
                                    f"KERAS_CCT_CAFFE_MODELS)")
        return src, hw
    from keras_cct.caffe.io.text import read_net
    src = Path(name)
    for lp in read_net(src).layer:
        if lp.type == "Input" and len(lp.input_param.shape):
            dims = lp.input_param.shape[0].dim
            if len(dims) == 4:
                return src, int(dims[2])
        if lp.transform_param.crop_size:
            return src, int(lp.transform_param.crop_size)
    raise ValueError(f"{src}: give the image size as {src}:BATCH:SIZE")


def train_prototxt(name: str, batch: int, out_dir: Path, hw: Optional[int] = None
                   ) -> Tuple[Path, Dict[str, tuple]]:
    """``(prototxt, input_shapes)`` of net ``name`` (of :data:`NETS`, or a .prototxt path)
    ready for a training step at ``batch``.

    A TRAIN-phase net with a loss (train_val) is used as it is (its Data layer's batch is set by
    ``--input-shape data=...``); a deploy net is rewritten (see the module docstring)."""
    from google.protobuf import text_format

    from keras_cct.caffe import proto
    from keras_cct.caffe.io.filter import filter_net
    from keras_cct.caffe.io.text import read_net
    src, size = _net_file(name)
    hw = hw or size
    shapes = {"data": (batch, 3, hw, hw)}
    net = read_net(src)
    train = filter_net(net, phase="TRAIN")
    if any(lp.type in ("SoftmaxWithLoss", "EuclideanLoss") for lp in train.layer):
        return src, shapes
    consumed = {b for lp in net.layer for b in lp.bottom}
    out = proto.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    loss_added = False
    for lp in net.layer:
        if lp.type == "Softmax" and not any(t in consumed for t in lp.top if t != lp.bottom[0]):
            loss = out.layer.add()
            loss.name, loss.type = "loss", "SoftmaxWithLoss"
            loss.bottom.extend([lp.bottom[0], "label"])
            loss.top.append("loss")
            loss_added = True
            continue
        new = out.layer.add()
        new.CopyFrom(lp)
        if new.type == "BatchNorm":
            new.batch_norm_param.ClearField("use_global_stats")
        if new.type == "Input":
            for s in new.input_param.shape:
                s.dim[0] = batch
    if not loss_added:
        raise ValueError(f"{src}: no final Softmax to turn into a loss")
    label = proto.LayerParameter(name="label", type="Input", top=["label"])
    label.input_param.shape.add().dim.append(batch)
    out.layer.insert(0, label)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{Path(name).stem}_b{batch}_train.prototxt"
    path.write_text(text_format.MessageToString(out))
    shapes["label"] = (batch,)
    return path, shapes


# ------------------------------------------------------------------------------ candidates

def _keras_candidate(path: Path, shapes: dict, dtype: str, conv: str) -> Callable[[], float]:
    """A training step of the net as ``cct time`` runs it; returns the loss."""
    import keras

    from keras_cct.caffe.train_commands import compile_for_timing, time_model
    keras.mixed_precision.set_global_policy("mixed_bfloat16" if dtype == "bfloat16"
                                            else "float32")
    try:
        model, batch = time_model(str(path), phase="TRAIN", random_data=True,
                                  input_shapes=shapes, conv=conv)
        compile_for_timing(model)
    finally:
        keras.mixed_precision.set_global_policy("float32")

    def step():
        logs = model.train_on_batch(batch)
        return float(np.ravel(logs)[0]) if logs is not None else 0.0
    step.model = model  # type: ignore[attr-defined]
    return step


def _torch_candidate(path: Path, shapes: dict, dtype: str, channels_last: bool
                     ) -> Callable[[], float]:
    import torch

    from benchmarks.torch_net import load_torch_net, random_inputs
    net = load_torch_net(path, shapes, phase="TRAIN")
    inputs = random_inputs(net)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
        inputs = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
                  for k, v in inputs.items()}
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.0, momentum=0.0)
    bf16 = dtype == "bfloat16"

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = net(inputs)
        loss.backward()
        opt.step()
        return float(loss.detach())
    step.net = net  # type: ignore[attr-defined]
    return step


def build(kind: str, path: Path, shapes: dict, dtype: str) -> Callable[[], float]:
    if kind == "keras_cct":
        return _keras_candidate(path, shapes, dtype, "hybrid")
    if kind == "keras_conv2d":
        return _keras_candidate(path, shapes, dtype, "keras")
    if kind in ("torch_nchw", "torch_cl"):
        return _torch_candidate(path, shapes, dtype, kind == "torch_cl")
    raise ValueError(kind)


#: How :func:`measure` orders a round, as the report states it.
ORDER = "each round Keras' candidates or PyTorch's first, in turn, shuffled within each"


def measure(steps: Dict[str, Callable[[], float]], rounds: int, warmup: int = 1,
            gap: float = 0.05, progress=None) -> Dict[str, List[float]]:
    """Seconds of one step of each candidate, ``rounds`` interleaved rounds after ``warmup``
    untimed ones (``gap`` seconds of sleep between steps lets the other framework's spinning
    threads go to sleep). Each round's order is :func:`benchmarks.common.round_order`'s:
    Keras' candidates and PyTorch's in turn first, shuffled within each."""
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for r in range(warmup + rounds):
        for name in round_order(list(steps), r, "keras"):
            step = steps[name]
            time.sleep(gap)
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
            if progress is not None:
                progress.update(1)
    return times


# ------------------------------------------------------------------------------ layer profile

def _group(caffe_type: str) -> str:
    return {"Convolution": "conv", "LRN": "LRN", "Pooling": "pooling",
            "InnerProduct": "InnerProduct", "ReLU": "ReLU", "Dropout": "Dropout",
            "SoftmaxWithLoss": "loss", "BatchNorm": "BatchNorm", "Scale": "Scale",
            "Eltwise": "Eltwise", "Concat": "Concat"}.get(caffe_type, caffe_type)


class _Training:
    """A layer called in training mode (Dropout drops, BatchNorm uses the batch), for
    the timing harness's per-layer steps (which call ``layer(x)`` as at inference)."""

    def __init__(self, layer):
        self.layer = layer
        self.trainable_weights = layer.trainable_weights
        self.trainable_variables = layer.trainable_variables
        self.non_trainable_variables = layer.non_trainable_variables

    def __call__(self, x):
        return self.layer(x, training=True)


def layer_profile(path: Path, shapes: dict, rounds: int, progress=None) -> List[dict]:
    """Per layer: ms of forward and of forward+backward in Keras (``cct time``'s timers on the
    keras_cct net) and in PyTorch (NCHW and channels_last) at the same shape, float32."""
    import keras
    import torch

    from benchmarks.torch_net import load_torch_net
    from keras_cct.caffe.train_commands import time_model
    from keras_cct.lowering.timing import block, layer_steps
    from keras_cct.caffe.net.weights import keras_name
    model, batch = time_model(str(path), phase="TRAIN", random_data=True, input_shapes=shapes)
    fmodel = model.net
    layers = [l for l in fmodel.layers if not isinstance(l, keras.layers.InputLayer)]
    feed = [batch[k] for k in model.input_blobs]
    probe = keras.Model(fmodel.inputs, [l.input for l in layers])
    values = probe.predict_on_batch(feed if len(feed) > 1 else feed[0])
    tnet = load_torch_net(path, shapes, phase="TRAIN")
    tnet.train()
    by_kname = {}
    for t, key, bottoms, tops, lp in tnet.steps:
        if t != "input" and key in tnet.mods:
            by_kname[keras_name(lp.name)] = (t, key, bottoms)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for layer, xin in zip(layers, values):
        if layer.name not in by_kname:
            continue
        ctype, key, bottoms = by_kname[layer.name]
        xs = [keras.ops.convert_to_tensor(v) for v in (xin if isinstance(xin, list) else [xin])]
        kf, kb = layer_steps(_Training(layer), xs)
        mod = tnet.mods[key]
        if hasattr(mod, "inplace"):
            mod.inplace = False  # a leaf input cannot be changed in place
        tshape = tnet.blob_shapes[bottoms[0]]
        cands = {}
        for fmt in ("nchw", "cl"):
            x = torch.randn(tshape, generator=gen)
            m = mod
            if fmt == "cl":
                if x.dim() != 4:
                    continue
                x = x.contiguous(memory_format=torch.channels_last)
                m = mod.to(memory_format=torch.channels_last)
            else:
                m = mod.to(memory_format=torch.contiguous_format)
            x.requires_grad_(True)
            y0 = m(x)
            dy = torch.randn(y0.shape, generator=gen)
            if fmt == "cl" and dy.dim() == 4:
                dy = dy.contiguous(memory_format=torch.channels_last)

            def tf_(m=m, x=x):
                with torch.no_grad():
                    m(x)

            def tb_(m=m, x=x, dy=dy):
                m.zero_grad(set_to_none=True)
                x.grad = None
                m(x).backward(dy)
            cands[f"torch_{fmt}_fwd"] = tf_
            cands[f"torch_{fmt}_fb"] = tb_
            # the module stays in the last format: the next format sets its own
        cands["keras_fwd"] = lambda kf=kf, xs=xs: block(kf(*xs))
        cands["keras_fb"] = lambda kb=kb, xs=xs: block(kb(*xs))
        times = measure(cands, rounds, warmup=1, gap=0.0)
        row = {"layer": layer.name, "type": ctype, "group": _group(ctype),
               "input_shape": list(tshape)}
        row.update({k: 1000 * min(v) for k, v in times.items()})
        row["keras_lowering"] = getattr(layer, "chosen_lowering", None)
        if getattr(layer, "relu", False):  # the ReLU before it, moved into the pooling
            row["keras_lowering"] = RELU_MOVED
        rows.append(row)
        if progress is not None:
            progress.update(1)
    return rows


def profile_by_group(rows: List[dict]) -> List[dict]:
    groups: Dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(r["group"], {"group": r["group"], "layers": 0})
        g["layers"] += 1
        for k in ("keras_fwd", "keras_fb", "torch_nchw_fwd", "torch_nchw_fb", "torch_cl_fwd",
                  "torch_cl_fb"):
            g[k] = g.get(k, 0.0) + r.get(k, r.get(k.replace("cl", "nchw"), 0.0))
    out = list(groups.values())
    for g in out:
        best = min(g["torch_nchw_fb"], g["torch_cl_fb"])
        g["torch_best_fb"] = best
        g["keras_vs_torch_fb"] = g["keras_fb"] / best if best else float("nan")
    return out


# ------------------------------------------------------------------------------ machine

def machine_info() -> dict:
    import keras
    import tensorflow as tf
    import torch

    import platform
    info: Dict[str, object] = {"cpu": platform.processor() or platform.machine(),
                               "cores": os.cpu_count(), "python": platform.python_version(),
                               "backend": keras.backend.backend()}
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and "model" not in info:
                info["cpu"] = info["model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    info.pop("model", None)
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8")
    info["isa"] = [f for f in wanted if f in flags]
    info["env"] = {k: v for k, v in os.environ.items()
                   if k.startswith(("MALLOC_", "OMP_", "KMP_", "ONEDNN_", "DNNL_", "TF_NUM_",
                                    "TF_ENABLE_ONEDNN")) or k == "LD_PRELOAD"}
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    info["tensorflow"] = tf.__version__
    info["onednn"] = onednn_versions()
    info["keras"] = keras.__version__
    try:
        from importlib.metadata import version
        info["keras_cct"] = version("keras_cct")
    except Exception:  # noqa: BLE001 -- informative only
        pass
    try:
        info["torch_mkldnn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001
        pass
    return info


# ------------------------------------------------------------------------------ compute dtypes

def _conv_dtypes(steps: Dict[str, Callable]) -> Dict[str, str]:
    """The compute dtype of each Keras candidate's convolutions (bfloat16 under
    mixed_bfloat16)."""
    out = {}
    for kind, step in steps.items():
        model = getattr(step, "model", None)
        if model is None:
            continue
        convs = [l for l in model.net._flatten_layers()
                 if type(l).__name__ in ("HybridConv2D", "Conv2D")]
        out[kind] = ",".join(sorted({str(l.compute_dtype) for l in convs}))
    return out


# ------------------------------------------------------------------------------ main

def parse_nets(text: str) -> List[Tuple[str, int, Optional[int]]]:
    """``NET[:BATCH[:SIZE]]`` items, NET one of :data:`NETS` or a .prototxt path."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, rest = item.partition(":")
        b, _, hw = rest.partition(":")
        if name not in NETS and not name.endswith(".prototxt"):
            raise SystemExit(f"unknown net {name!r}; choose from {', '.join(NETS)} or give a "
                             f".prototxt")
        out.append((name, int(b) if b else 32, int(hw) if hw else None))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nets", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="CaffeNet at batch 8 only, 2 rounds, short profile (< 2 min)")
    parser.add_argument("--nets", help=f"net:batch list (default {DEFAULT_NETS}); nets: "
                                       f"{', '.join(NETS)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; --quick 2)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the CaffeNet per-layer-type profile")
    parser.add_argument("--profile-batch", dest="profile_batch", type=int,
                        help="batch of the profile (default: the first CaffeNet batch)")
    parser.add_argument("--torch-threads", dest="torch_threads", type=int,
                        help="PyTorch's intra-op threads (default: every core this process may "
                             "use, as TensorFlow)")
    parser.add_argument("--no-mmap", dest="no_mmap", action="store_true",
                        help="rerun this process with glibc's MALLOC_MMAP_MAX_=0 and a large "
                             "MALLOC_TRIM_THRESHOLD_ (big gradients such as fc6's are then not "
                             "fresh page-faulted mappings every step; affects both frameworks)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default docs/benchmarks/)")
    args = parser.parse_args(argv)
    if args.no_mmap and os.environ.get("MALLOC_MMAP_MAX_") != "0":
        env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="1000000000000",
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
                       "PYTHONPATH", "").split(os.pathsep) if p]))
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.nets"] + list(
            argv if argv is not None else sys.argv[1:]), env)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    if keras.backend.backend() != "tensorflow":
        raise SystemExit("benchmarks.nets runs the Keras side on the TensorFlow backend "
                         "(KERAS_BACKEND=tensorflow)")
    import torch
    from tqdm import tqdm

    out = (args.out or DEFAULT_OUT).resolve()
    nets = parse_nets(args.nets or ("caffenet:8" if args.quick else DEFAULT_NETS))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            raise SystemExit(f"unknown dtype {d!r} (float32, bfloat16)")
    rounds = args.rounds or (2 if args.quick else 5)
    cands = [c.strip() for c in args.candidates.split(",") if c.strip()]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(args.torch_threads or threads)  # as TensorFlow: every core
    command = "python -m benchmarks.nets" + (" " + " ".join(argv if argv is not None
                                                           else sys.argv[1:])).rstrip()
    data = {"command": command, "when": time.strftime("%Y-%m-%d %H:%M %Z"), "rounds": rounds,
            "order": ORDER,
            "machine": machine_info(), "results": [], "notes": []}
    proto_dir = Path(tempfile.mkdtemp(prefix="cct_nets_"))
    groups = [(n, b, hw, d) for n, b, hw in nets for d in dtypes]
    pnet, pb, phw = nets[0]  # the profile: the first net (CaffeNet in the default list)
    pbatch = args.profile_batch or pb
    total = len(groups) * (rounds + 1) * len(cands)
    with tqdm(total=total, desc="nets", unit="step") as bar:
        for name, batch, hw, dtype in groups:
            bar.set_postfix_str(f"{name} b{batch} {dtype}: building")
            path, shapes = train_prototxt(name, batch, proto_dir, hw)
            steps, failed = {}, {}
            for kind in cands:
                try:
                    steps[kind] = build(kind, path, shapes, dtype)
                except Exception as exc:  # noqa: BLE001 -- reported in the table
                    failed[kind] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    tqdm.write(f"{name} b{batch} {dtype} {kind}: {failed[kind]}", file=sys.stderr)
            bar.set_postfix_str(f"{name} b{batch} {dtype}")
            times: Dict[str, List[float]] = {}
            for kind in list(steps):  # a first step that fails drops the candidate
                try:
                    steps[kind]()
                except Exception as exc:  # noqa: BLE001
                    failed[kind] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    tqdm.write(f"{name} b{batch} {dtype} {kind}: {failed[kind]}", file=sys.stderr)
                    del steps[kind]
            bar.update(len(cands) + rounds * len(failed))  # the warm-up steps, the failed
            times = measure(steps, rounds, warmup=0, progress=bar)
            res = {"net": Path(name).stem if name not in NETS else name, "batch": batch,
                   "size": shapes["data"][2], "dtype": dtype, "prototxt": str(path),
                   "candidates": summarize(times, batch), "failed": failed,
                   "keras_conv_compute_dtype": _conv_dtypes(steps)}
            data["results"].append(res)
            c = res["candidates"]
            tb = max([c[k]["images_per_s"] for k in ("torch_nchw", "torch_cl") if k in c],
                     default=None)
            if "keras_cct" in c and tb:
                tqdm.write(f"{name} b{batch} {dtype}: keras_cct {c['keras_cct']['images_per_s']:.1f}"
                           f" img/s, PyTorch best {tb:.1f}, keras Conv2D "
                           f"{c.get('keras_conv2d', {}).get('images_per_s', float('nan')):.1f}")
            del steps
            keras.backend.clear_session()
            gc.collect()
        if args.profile and "float32" in dtypes:
            bar.set_postfix_str(f"profile {pnet} b{pbatch}")
            path, shapes = train_prototxt(pnet, pbatch, proto_dir, phw)
            prounds = args.rounds or (3 if args.quick else 5)
            rows = layer_profile(path, shapes, prounds)
            data["profile"] = {"net": Path(pnet).stem if pnet not in NETS else pnet,
                               "batch": pbatch, "rounds": prounds,
                               "layers": rows, "groups": profile_by_group(rows)}
    data["notes"].append("Keras' mixed_bfloat16 policy runs through `cct time`'s path "
                         "(load_net builds every layer under the global policy).")
    data["notes"].append(
        "Measure on a quiet machine: PyTorch's OpenMP threads spin at their barriers, so with "
        "other processes on the cores a 2-thread PyTorch step can be several times slower than "
        "a 1-thread one (seen: CaffeNet b8 1.5-3 s vs 0.4-0.5 s at load 6 on 2 cores), which "
        "TensorFlow's thread pool does not suffer as much; `--torch-threads` sets the count.")
    data["notes"].append(
        "PyTorch allocates each weight gradient afresh every step; with glibc's malloc the big "
        "ones (fc6: 151 MB) are new mmap'ed pages each time (page faults). `--no-mmap` "
        "(MALLOC_MMAP_MAX_=0, both frameworks) or LD_PRELOAD of jemalloc/tcmalloc, the usual "
        "PyTorch CPU setup, removes that; seen: CaffeNet b8 1-thread PyTorch step "
        "0.63-0.69 s -> 0.31-0.53 s on the loaded machine.")
    out.mkdir(parents=True, exist_ok=True)
    (out / "nets.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "nets.md").write_text(markdown(data))
    plot(data, out / "nets.png")
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
