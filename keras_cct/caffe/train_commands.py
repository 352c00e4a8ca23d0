"""``cct train``, ``cct test``, ``cct time`` and ``cct data``: Caffe's command line on Keras.

* ``cct train --solver S [--weights W.caffemodel | --snapshot S.solverstate]`` -- like
  ``caffe train``: Caffe's log lines, snapshots, resume. ``--devices a,b --split ...`` splits
  each convolution's batch across devices (:class:`~keras_cct.CCTStrategy`); ``--workers
  h:p,h:p --worker-index I`` trains data-parallel across processes
  (:mod:`keras_cct.strategy.cluster`), the solver's ``batch_size`` being the global batch.
  ``--weights a,b`` loads each in order (Caffe's ``CopyLayers``), ``--stage``/``--level`` set the
  TRAIN state, SIGINT/SIGHUP act as ``--sigint-effect``/``--sighup-effect`` say
  (:mod:`keras_cct.caffe.tools.signals`).
* Every flag of train/test/time also has Caffe's spellings (``-solver S``, ``--sigint_effect=
  stop``), so a Caffe command line works as pasted.
* ``cct test --model NET --weights W --iterations N`` -- like ``caffe test``.
* ``cct time --model NET --iterations N`` -- like ``caffe time``: per-layer forward and backward
  milliseconds, and the lowering each convolution uses.
* ``cct data SOURCE DB`` -- like ``convert_imageset``: an LMDB of Caffe Datums from a folder of
  images (``SOURCE/<class>/<image>``, or ``--list`` of ``path label`` lines relative to SOURCE)
  or from arrays in a ``.npz`` (``images``/``x`` and ``labels``/``y``); ``--mean`` also writes the
  mean image as a .binaryproto (``compute_image_mean``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

import numpy as np

from keras_cct._args import nonneg_int, positive_int
from keras_cct.caffe.cli_args import (add_python_layers_flag, caffe_flag, check_data_args,
                                      check_one_device, check_snapshot_folder, check_test_net,
                                      check_time_inputs, ignored_flags, load_npz, weight_files)
from keras_cct.caffe.cli_args import device_names as _device_names
from keras_cct.caffe.cli_args import parse_shapes as _parse_shapes
from keras_cct.caffe.io.lmdb_io import convert_imageset, write_arrays
from keras_cct.caffe.tools.signals import EFFECTS, SignalHandler
from keras_cct.caffe.train.data import merge_batches
from keras_cct.errors import DataError, KerasCCTError

# Keras (and what imports it: the nets, the solver, the strategies) is imported inside the
# commands that use it, not when `cct` starts and registers every sub-command.


def _set_lowering_and_device(model, lowering: Optional[str], devices: Optional[str]) -> None:
    """Apply ``--lowering`` / one ``--devices`` name to every HybridConv2D of ``model``.

    Several devices need a :class:`~keras_cct.CCTStrategy` built before the net (``cct train``
    does that); the commands that run one net on one device refuse them here."""
    if not lowering and not devices:
        return
    device = None
    if devices:
        check_one_device(devices)  # one name, of a device that exists
        name = _device_names(devices)[0]
        device = None if name in ("cpu", "auto", "keras") else name
    from keras_cct.lowering import check_lowering  # type: ignore[attr-defined]
    for layer in model.layers:
        if type(layer).__name__ != "HybridConv2D":
            continue
        if lowering:
            layer.lowering = check_lowering(lowering)
            getattr(layer, "_plans", {}).clear()
        if devices:
            layer.device = device


def keras_conv_model(model):
    """A copy of ``model`` whose HybridConv2D layers are ``keras.layers.Conv2D`` (explicit
    Caffe padding becomes a ``ZeroPadding2D`` in front: :func:`keras_cct.layers.convert.
    to_keras_conv`), for comparisons. Weights are not copied."""
    import keras
    from keras_cct.layers.convert import to_keras_conv

    def swap(layer):
        if type(layer).__name__ != "HybridConv2D":
            return layer.__class__.from_config(layer.get_config())
        return to_keras_conv(layer)

    return keras.models.clone_model(model, clone_function=swap)


def _parse_split(split: Optional[str], names: List[str]):
    """``--split``: ``"flops"``, ``"measure"`` or one fraction per device."""
    text = (split or "flops").strip()
    if text in ("flops", "measure"):
        return text
    try:
        fractions = [float(v) for v in text.split(",")]
    except ValueError:
        fractions = []
    if len(fractions) != len(names) or not all(np.isfinite(f) and f >= 0 for f in fractions) \
            or sum(fractions) <= 0:
        raise KerasCCTError(f"--split {split}: expected 'flops', 'measure' or one non-negative "
                            f"fraction per device ({len(names)}: {','.join(names)}), e.g. "
                            f"--split {','.join(['0.5'] * len(names))}")
    return fractions


def _cluster_args(args: argparse.Namespace):
    """``(workers, index, shares)`` from ``--workers/--worker-index/--worker-shares``, checked
    without touching TensorFlow (None without ``--workers``)."""
    from keras_cct.strategy.cluster import ClusterError, parse_workers, tf_config
    workers, index = args.workers, args.worker_index
    if workers is None and index is None:
        if args.worker_shares:
            raise ClusterError("--worker-shares needs --workers and --worker-index")
        return None
    if workers is None:
        raise ClusterError("--worker-index needs --workers host:port,host:port,... (every "
                           "worker's address, the same list on every worker)")
    if index is None:
        raise ClusterError(f"--workers {workers} needs --worker-index I (this worker's position "
                           f"in the list, from 0)")
    items = parse_workers(workers)
    tf_config(items, index)  # the index is in range
    shares = None
    if args.worker_shares:
        try:
            shares = [float(v) for v in args.worker_shares.split(",")]
        except ValueError:
            shares = []
        if len(shares) != len(items) or not all(np.isfinite(v) and v > 0 for v in shares):
            raise ClusterError(f"--worker-shares {args.worker_shares}: give one positive number "
                               f"per worker ({len(items)}), the same on every worker")
        shares = list(np.asarray(shares) / sum(shares))
    return items, index, shares


def _strategy_table(strategy, model) -> List[str]:
    """The CCTStrategy's split of ``model``'s convolutions at the end of training: one line per
    layer and device (the TEST nets' layers of the same names have their own plans and are
    left out)."""
    lines = ["CCTStrategy split of the TRAIN net (forward and backward fractions now; images "
             "and ms of the last step):",
             f"{'layer':>16} {'device':>14} {'fwd':>6} {'images':>6} {'ms':>8} "
             f"{'bwd':>6} {'images':>6} {'ms':>8}"]
    rows = strategy.report(layers=model.layers)
    for row in rows:
        state = "" if row["active"] else "  (dropped)"
        lines.append(f"{row['layer']:>16} {row['device']:>14} {row['fraction']:6.3f} "
                     f"{row['images']:6d} {row['last_ms']:8.2f} {row['bwd_fraction']:6.3f} "
                     f"{row['bwd_images']:6d} {row['last_bwd_ms']:8.2f}{state}")
    count = len(rows)
    if not count:
        lines.append("  (no convolution ran under the strategy)")
    return lines


def _is_tf_op_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a TensorFlow runtime error (a failed collective, a dead peer)."""
    errors = getattr(sys.modules.get("tensorflow"), "errors", None)
    return errors is not None and isinstance(exc, errors.OpError)


def _train(args: argparse.Namespace) -> int:
    """``cct train``. Order matters with ``--workers``: every argument is checked first, then
    the cluster is configured before any TensorFlow operation, then the nets are built."""
    if args.weights and args.snapshot:
        raise KerasCCTError("give either --weights or --snapshot, not both "
                            "(caffe train refuses both too)")
    ignored_flags(args, "train")
    weights = weight_files(args.weights)
    signals = SignalHandler(args.sigint_effect, args.sighup_effect)
    names = _device_names(args.devices)
    if args.split is not None and len(names) < 2:
        raise KerasCCTError(f"--split {args.split} splits a batch across several --devices "
                            f"(e.g. --devices tf:cpu:0,opencl:0:0); give them or drop --split")
    split = _parse_split(args.split, names) if len(names) > 1 else None
    if args.devices is not None and len(names) < 2:
        check_one_device(args.devices)  # before the data readers start
    spec = _cluster_args(args)
    mwms, shares = None, None
    prefix = ""
    if spec is not None:
        from keras_cct.strategy import cluster
        workers, index, shares = spec
        mwms = cluster.configure(workers, index)  # before any other TensorFlow operation
        prefix = f"[worker {index}] " if index else ""
    strategy = None
    if len(names) > 1:
        from keras_cct.strategy.core import CCTStrategy
        try:
            strategy = CCTStrategy(names, split=split, rebalance=not args.no_rebalance)
        except KerasCCTError:
            raise
        except ValueError as exc:
            raise KerasCCTError(f"--devices {args.devices}: {exc}") from None
    from keras_cct.caffe.train.config import read_solver
    from keras_cct.caffe.train.solver import Solver
    config = read_solver(args.solver)
    # caffe train: -level sets the TRAIN state's level, -stage adds its stages
    config.param.train_state.level = args.level
    config.param.train_state.stage.extend(_stages(args.stage))
    solver = Solver(config, progress=args.progress, snapshot_prefix=args.snapshot_prefix,
                    strategy=strategy, cluster=mwms, shares=shares,
                    python_layers=args.python_layers)
    for w in weights:  # Caffe's CopyLayers: each file in order
        solver.log(f"Finetuning from {w}")
        solver.load_weights(w)
    check_snapshot_folder(solver)
    one_device = args.devices if len(names) == 1 else None
    for m in [solver.train_model.net] + [t.net for t in solver.test_nets]:
        _set_lowering_and_device(m, args.lowering, one_device)
    if args.lowering or one_device:  # recompile with the new layer settings
        with solver.scope():
            solver.train_model.compile(optimizer=solver.optimizer, jit_compile="auto")
    t0 = time.perf_counter()
    try:
        with signals:
            solver.set_action_function(signals.requested_action)
            solver.solve(resume_file=args.snapshot)
    except Exception as exc:
        if mwms is None or not _is_tf_op_error(exc):
            raise
        from keras_cct.strategy.cluster import ClusterError
        last = solver.snapshot_prefix + "_iter_N.solverstate"
        raise ClusterError(
            f"worker {spec[1]} stopped at iteration {solver.iter}: a collective with the other "
            f"workers failed ({type(exc).__name__}: {str(exc).strip().splitlines()[0]}); a "
            f"worker is gone or unreachable. Restart every worker with --snapshot {last} "
            f"(the last snapshot they all wrote)") from exc
    print(f"{prefix}Training: {solver.images_per_second:.1f} images/s "
          f"({solver.train_seconds:.2f}s of training, {time.perf_counter() - t0:.2f}s in all)",
          flush=True)
    if strategy is not None:
        for line in _strategy_table(strategy, solver.train_model.net):
            print(prefix + line, flush=True)
    return 0


def _stages(items) -> List[str]:
    """``-stage a,b`` (Caffe's comma-separated list; ``--stage`` may also repeat)."""
    return [s.strip() for item in items or () for s in item.split(",") if s.strip()]


def _caffe_net_args(args: argparse.Namespace, command: str) -> None:
    """``cct test/time``: Caffe's comma-separated stages, the flags they ignore."""
    args.stage = _stages(args.stage)
    ignored_flags(args, command)


def _test(args: argparse.Namespace) -> int:
    from keras_cct.caffe.train.model import build_phase_net, run_test
    _caffe_net_args(args, "test")
    check_test_net(args)
    check_one_device(args.devices)
    model, sources, _ = build_phase_net(args.model, phase=args.phase,
                                        stages=args.stage or (), level=args.level,
                                        weights=args.weights,
                                        python_layers=args.python_layers)
    _set_lowering_and_device(model.net, args.lowering, args.devices)
    if not model.heads:
        print("warning: the net has no loss or accuracy layer; nothing to report",
              file=sys.stderr)
    run_test(model, sources, args.iterations, log=lambda s: print(s, flush=True),
             compute_loss=True, per_batch=True, kind="caffe test")
    return 0


def time_model(model_path: str, *, phase: str = "TRAIN", stages=(), level: int = 0,
               weights=None, batch=None, random_data: bool = False, input_shapes=None,
               lowering=None, devices=None, conv: str = "hybrid",
               python_layers: bool = False):
    """``(CaffeTrainModel, batch)``: the net and the one batch ``cct time`` times, built as
    ``cct time`` builds them (the benchmarks reuse it). The model is not compiled."""
    from keras_cct.caffe.train.model import CaffeTrainModel, build_phase_net
    model, sources, net = build_phase_net(model_path, phase=phase, stages=stages or (),
                                          level=level, weights=weights, batch=batch,
                                          python_layers=python_layers,
                                          random_data=random_data,
                                          input_shapes=input_shapes)
    _set_lowering_and_device(model.net, lowering, devices)
    if conv == "keras":
        model = CaffeTrainModel(keras_conv_model(model.net), model.heads, model.output_blobs,
                                model.input_blobs, name=model.name)
    return model, next(merge_batches(sources))


def compile_for_timing(model) -> None:
    """Compile ``model`` as ``cct time`` does for its training step: Caffe's SGD with a zero
    learning rate (the update runs, the weights stay)."""
    from keras_cct.caffe.train.optimizer import CaffeOptimizer
    model.compile(optimizer=CaffeOptimizer("SGD", learning_rate=0.0), jit_compile="auto")


def _time(args: argparse.Namespace) -> int:
    import keras  # lazily, as every Keras import of the cct commands

    from keras_cct.lowering.timing import block, layer_steps
    _caffe_net_args(args, "time")
    shapes = _parse_shapes(args.input_shape)
    random_data = check_time_inputs(args, shapes)  # a deploy net: random data, as caffe time
    check_one_device(args.devices)
    model, batch = time_model(args.model, phase=args.phase, stages=args.stage or (),
                              level=args.level,
                              weights=args.weights, batch=args.batch,
                              random_data=random_data, input_shapes=shapes,
                              lowering=args.lowering, devices=args.devices, conv=args.conv,
                              python_layers=args.python_layers)
    fmodel = model.net
    layers = [l for l in fmodel.layers if not isinstance(l, keras.layers.InputLayer)]
    feed = [batch[k] for k in model.input_blobs]
    values = []
    if args.layers:  # every layer's input values, from one forward pass
        probe = keras.Model(fmodel.inputs, [l.input for l in layers])
        values = probe.predict_on_batch(feed if len(feed) > 1 else feed[0])
    n = args.iterations
    print(f"*** Benchmark begins ({keras.backend.backend()} backend) ***", flush=True)
    print(f"Testing for {n} iterations.", flush=True)
    rows = []
    for layer, xin in zip(layers if args.layers else [], values):
        xs = [keras.ops.convert_to_tensor(v) for v in (xin if isinstance(xin, list) else [xin])]
        fwd, bwd = layer_steps(layer, xs)
        block(fwd(*xs))
        has_bwd = True
        try:
            block(bwd(*xs))
        except Exception:  # a layer without gradient (integer inputs): forward only
            has_bwd = False
        t0 = time.perf_counter()
        for _ in range(n):
            out = fwd(*xs)
        block(out)
        tf_ms = (time.perf_counter() - t0) * 1000 / n
        tb_ms = float("nan")
        if has_bwd:
            t0 = time.perf_counter()
            for _ in range(n):
                g = bwd(*xs)
            block(g)
            tb_ms = (time.perf_counter() - t0) * 1000 / n
        lowering = getattr(layer, "chosen_lowering", None)
        rows.append((layer.name, tf_ms, tb_ms, lowering))
    if rows:
        print("Average time per layer:", flush=True)
    for name, f, b, low in rows:
        extra = f"  [lowering: {low}]" if low else ""
        print(f"{name:>24}\tforward: {f:.4f} ms.{extra}", flush=True)
        print(f"{name:>24}\tforward-backward: {b:.4f} ms.", flush=True)
    # whole net, compiled: forward, and forward + backward + update (a training step)
    fmodel.predict_on_batch(feed if len(feed) > 1 else feed[0])  # compile
    t0 = time.perf_counter()
    for _ in range(n):
        out = fmodel.predict_on_batch(feed if len(feed) > 1 else feed[0])
    fwd_ms = (time.perf_counter() - t0) * 1000 / n
    compile_for_timing(model)
    if model.heads and any(h.loss_weight for h in model.heads):
        model.train_on_batch(batch)
        t0 = time.perf_counter()
        for _ in range(n):
            model.train_on_batch(batch)
        fb_ms = (time.perf_counter() - t0) * 1000 / n
        bs = len(feed[0])
        print(f"Average Forward pass: {fwd_ms:.4f} ms.", flush=True)
        print(f"Average Forward-Backward (training step): {fb_ms:.4f} ms "
              f"({bs * 1000 / fb_ms:.1f} images/s).", flush=True)
    else:
        print(f"Average Forward pass: {fwd_ms:.4f} ms.", flush=True)
        print("(no loss layer in this phase: use --phase TRAIN to time backward passes of "
              "the whole net)", flush=True)
    if rows:
        print(f"Total per-layer time: forward {sum(r[1] for r in rows):.4f} ms, backward "
              f"{np.nansum([r[2] for r in rows]):.4f} ms.", flush=True)
    print("*** Benchmark ends ***", flush=True)
    return 0


def _data(args: argparse.Namespace) -> int:
    check_data_args(args)
    src = args.source
    if os.path.isfile(src) and src.endswith(".npz"):
        images, labels = load_npz(src)
        if args.gray and images.ndim == 4 and images.shape[-1] != 1:
            raise DataError("--gray applies to image files; the arrays are already decoded",
                            path=src)
        if args.resize_height or args.resize_width:
            import cv2  # optional: only to resize arrays
            try:
                images = np.stack([cv2.resize(im, (args.resize_width, args.resize_height))
                                   for im in images])
            except cv2.error as exc:
                raise DataError(f"OpenCV cannot resize these {images.dtype} images "
                                f"({str(exc).strip().splitlines()[-1]})", path=src,
                                hint="store uint8 or float32 images") from None
        order = np.arange(len(images))
        if args.shuffle:
            np.random.default_rng(args.seed).shuffle(order)
        n = write_arrays(args.db, images[order], np.asarray(labels)[order],
                         encode=args.encode, overwrite=args.overwrite)
    else:
        n = convert_imageset(src, args.list, args.db, resize_height=args.resize_height,
                             resize_width=args.resize_width, gray=args.gray,
                             shuffle=args.shuffle, encode=args.encode,
                             check_size=args.check_size, seed=args.seed,
                             overwrite=args.overwrite)
    print(f"Processed {n} files.", flush=True)
    if args.mean:
        from keras_cct.caffe.tools.mean import db_mean, write_mean
        mean, _ = db_mean(args.db)  # (1, C, H, W) as compute_image_mean
        write_mean(args.mean, mean)
        print(f"Wrote the mean image to {args.mean}", flush=True)
    return 0


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lowering", choices=["auto", "type1", "type2", "type3", "native"],
                   help="force one lowering for every convolution (default: the planner's)")
    p.add_argument("--devices", help="device for the convolutions, e.g. opencl:0:0 "
                                     "(default: the Keras backend's)")


def _add_ignored(p: argparse.ArgumentParser, names) -> None:
    """Caffe flags accepted (Caffe command lines work as pasted) but not used by this command:
    see :func:`keras_cct.caffe.cli_args.ignored_flags`."""
    for name in names:
        caffe_flag(p, name, dest=f"ignored_{name}", help=argparse.SUPPRESS)


def _net_flags(p: argparse.ArgumentParser, model_help: str, weights_help: Optional[str],
               iterations_help: str, phase: str) -> None:
    """``caffe test/time``'s flags (each also in Caffe's single-dash spelling); ``weights_help``
    None makes ``-weights`` optional."""
    caffe_flag(p, "model", required=True, help=model_help)
    caffe_flag(p, "weights", required=weights_help is not None,
               help=weights_help or "a .caffemodel (optional)")
    caffe_flag(p, "iterations", type=positive_int, default=50, help=iterations_help)
    caffe_flag(p, "phase", default=phase, choices=["TRAIN", "TEST"])
    caffe_flag(p, "stage", action="append", help="net stages (a,b or repeated)")
    caffe_flag(p, "level", type=int, default=0, help="the net state's level")
    add_python_layers_flag(p)
    _add_ignored(p, ("gpu",))


def register(subparsers) -> None:
    """Add ``train``, ``test``, ``time`` and ``data`` to the ``cct`` parser."""
    p = subparsers.add_parser("train", help="train a Caffe net from its solver "
                                            "(like `caffe train`)")
    caffe_flag(p, "solver", required=True, help="the solver .prototxt")
    caffe_flag(p, "weights", help="the .caffemodel(s) to start from (fine-tuning): a,b loads "
                                  "each in order, as caffe train")
    caffe_flag(p, "snapshot", help="a .solverstate to resume from")
    caffe_flag(p, "snapshot-prefix", help="override the solver's snapshot_prefix")
    caffe_flag(p, "stage", action="append",
               help="stages of the TRAIN net state (a,b or repeated)")
    caffe_flag(p, "level", type=int, default=0, help="level of the TRAIN net state")
    caffe_flag(p, "sigint-effect", default="stop", choices=EFFECTS,
               help="on SIGINT (Ctrl-C): stop (default: end training; the final snapshot is "
                    "written as after max_iter), snapshot, or none")
    caffe_flag(p, "sighup-effect", default="snapshot", choices=EFFECTS,
               help="on SIGHUP: snapshot (default), stop, or none")
    _add_ignored(p, ("gpu", "model", "iterations"))
    add_python_layers_flag(p)
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.add_argument("--lowering", choices=["auto", "type1", "type2", "type3", "native"],
                   help="force one lowering for every convolution (default: the planner's)")
    p.add_argument("--devices", help="device(s) for the convolutions: one name (e.g. "
                                     "opencl:0:0), or several (e.g. tf:cpu:0,opencl:0:0) to "
                                     "split each convolution's batch across them with a "
                                     "CCTStrategy (default: the Keras backend's)")
    p.add_argument("--split", help="with several --devices: 'flops' (default, calibrated "
                                   "GFLOP/s), 'measure' (each layer timed once), or fractions "
                                   "such as 0.7,0.3")
    p.add_argument("--no-rebalance", dest="no_rebalance", action="store_true",
                   help="with several --devices: keep the initial fractions (default: move "
                        "them toward equal finish times while training)")
    p.add_argument("--workers", metavar="HOST:PORT,...",
                   help="train data-parallel with these worker processes (every worker's "
                        "address, the same list on every worker; TensorFlow backend)")
    p.add_argument("--worker-index", dest="worker_index", type=nonneg_int, metavar="I",
                   help="this worker's position in --workers, from 0 (worker 0 runs the "
                        "test nets)")
    p.add_argument("--worker-shares", dest="worker_shares", help=argparse.SUPPRESS)
    p.set_defaults(func=_train)

    p = subparsers.add_parser("test", help="score a trained Caffe net (like `caffe test`)")
    _net_flags(p, "the net .prototxt (with data layers)", "the trained .caffemodel",
               "batches to run (default 50)", "TEST")
    _add_device_args(p)
    p.set_defaults(func=_test)

    p = subparsers.add_parser("time", help="per-layer forward/backward times "
                                           "(like `caffe time`)")
    _net_flags(p, "the net .prototxt", None, "repetitions (default 50)", "TRAIN")
    p.add_argument("--batch", type=positive_int, help="batch size for inputs without a data layer")
    p.add_argument("--random-data", dest="random_data", action="store_true",
                   help="feed random arrays instead of reading the data layers' sources")
    p.add_argument("--input-shape", dest="input_shape", action="append", metavar="NAME=N,C,H,W",
                   help="Caffe shape of an input or data-layer top (repeatable), e.g. "
                        "data=64,3,227,227")
    p.add_argument("--conv", choices=["hybrid", "keras"], default="hybrid",
                   help="time the net with HybridConv2D (default) or keras.layers.Conv2D")
    p.add_argument("--no-layers", dest="layers", action="store_false",
                   help="skip the per-layer timings (whole-net passes only)")
    _add_device_args(p)
    p.set_defaults(func=_time)

    p = subparsers.add_parser("data", help="write an LMDB of Caffe Datums "
                                           "(like `convert_imageset`)")
    p.add_argument("source", help="a folder of images (FOLDER/<class>/<image>, or with --list) "
                                  "or a .npz of arrays (images/x and labels/y)")
    p.add_argument("db", help="the LMDB folder to create")
    p.add_argument("--list", help="a list file of 'path label' lines, relative to SOURCE")
    p.add_argument("--resize-height", dest="resize_height", type=nonneg_int, default=0,
                   help="resize every image to this height (with --resize-width; 0: keep)")
    p.add_argument("--resize-width", dest="resize_width", type=nonneg_int, default=0,
                   help="resize every image to this width (with --resize-height; 0: keep)")
    p.add_argument("--gray", action="store_true", help="load images as gray")
    p.add_argument("--shuffle", action="store_true", help="shuffle the records")
    p.add_argument("--seed", type=nonneg_int, default=0, help="shuffle seed")
    p.add_argument("--encode", default="", choices=["", "png", "jpg"],
                   help="store encoded images instead of raw pixels")
    p.add_argument("--check-size", dest="check_size", action="store_true",
                   help="require every image to have the same size")
    p.add_argument("--mean", help="also write the mean image to this .binaryproto")
    p.add_argument("--overwrite", action="store_true", help="replace an existing LMDB")
    p.set_defaults(func=_data)
