"""``cct mean``, ``cct features``, ``cct upgrade``, ``cct draw``, ``cct plot-log`` and
``cct device_query``: the rest of Caffe's tools (each also answers to its Caffe name).

* ``cct mean DB mean.binaryproto`` (``compute_image_mean``; ``--list`` for an image list);
* ``cct features NET.caffemodel NET.prototxt fc7,conv5 fc7_db,conv5_db 10 lmdb``
  (``extract_features``, Caffe's argument order; or ``--weights --model --blobs --output
  --batches --db-type``, ``npz`` writing one .npz);
* ``cct upgrade OLD NEW`` (``upgrade_net_proto_text``/``_binary``, ``upgrade_solver_proto_text``);
* ``cct draw NET.prototxt net.png [--rankdir TB] [--phase TRAIN]`` (``draw_net.py``);
* ``cct plot-log train.log [--output-dir D]`` (``parse_log.py`` CSVs + training curves PNG);
* ``cct device_query [-gpu N]`` (``caffe device_query``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

from keras_cct._args import check_output_file, nonneg_int, positive_int
from keras_cct.caffe.cli_args import caffe_flag
from keras_cct.errors import DataError, KerasCCTError


def _mean(args: argparse.Namespace) -> int:
    from keras_cct.caffe.tools.mean import db_mean, list_mean, write_mean
    if args.backend != "lmdb":
        raise KerasCCTError(f"-backend {args.backend}: only LMDB is read (convert a LevelDB "
                            f"with `cct data`, or give --list of images)")
    if not os.path.exists(args.source):
        raise DataError("not found", path=args.source,
                        hint="give an LMDB folder (or an image list with --list)")
    if args.output:
        check_output_file(args.output, "the mean file")
    if args.list:
        mean, n = list_mean(args.source, root=args.root, gray=args.gray,
                            resize_height=args.resize_height, resize_width=args.resize_width,
                            progress=args.progress)
    else:
        if os.path.isfile(args.source) and not args.source.endswith(".mdb"):
            raise DataError("is a file, not an LMDB folder", path=args.source,
                            hint="give the LMDB folder, or --list for a file of 'path label' "
                                 "lines")
        mean, n = db_mean(args.source, progress=args.progress)
    print(f"Processed {n} files.")
    if args.output:  # compute_image_mean without OUTPUT_FILE prints the channel means only
        write_mean(args.output, mean)
        print(f"Write to {args.output}")
    for c in range(mean.shape[1]):
        print(f"mean_value channel [{c}]: {float(mean[0, c].mean()):.6g}")
    return 0


def _split(text) -> List[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _features(args: argparse.Namespace) -> int:
    from keras_cct.caffe.tools.features import check_outputs, extract_features, save_features
    pos = list(args.caffe_args or [])
    if len(pos) > 8:
        raise KerasCCTError(f"{len(pos)} positional arguments; Caffe's order is "
                            f"pretrained_net_param feature_extraction_proto_file blob1[,blob2] "
                            f"dataset1[,dataset2] num_mini_batches db_type [CPU/GPU] [DEVICE_ID]")
    names = ("weights", "model", "blobs", "output", "batches", "db_type")
    if len(pos) > 6:  # Caffe's [CPU/GPU] [DEVICE_ID]
        print(f"cct features: note: {' '.join(pos[6:])} ignored: keras_cct runs on the Keras "
              f"backend's device (see `cct devices`)", file=sys.stderr, flush=True)
    for name, value in zip(names, pos):
        if getattr(args, name) is not None:
            raise KerasCCTError(f"--{name.replace('_', '-')} given twice (as a flag and as a "
                                f"positional argument)")
        setattr(args, name, value)
    for name in names[:5]:
        if getattr(args, name) is None:
            raise KerasCCTError(f"missing {name}: give `cct features WEIGHTS MODEL BLOBS "
                                f"DATASETS NUM_BATCHES [DB_TYPE]` or --{name.replace('_', '-')}")
    try:
        batches = positive_int(str(args.batches))
    except argparse.ArgumentTypeError as exc:
        raise KerasCCTError(f"num_mini_batches: {exc}") from None
    blobs, outputs = _split(args.blobs), _split(args.output)
    db_type = (args.db_type or ("npz" if outputs and outputs[0].endswith(".npz") else "lmdb"))
    db_type = db_type.lower()
    if args.model.endswith(".caffemodel") and not args.weights.endswith(".caffemodel"):
        raise KerasCCTError(f"{args.weights} {args.model}: the weights come first in Caffe's "
                            f"order (pretrained_net_param, then feature_extraction_proto_file)")
    for path, what in ((args.model, "the net prototxt"), (args.weights, "the weights")):
        if not os.path.isfile(path):
            raise DataError(f"{what} not found", path=path,
                            hint="Caffe's order: WEIGHTS.caffemodel then NET.prototxt")
    check_outputs(outputs, blobs, db_type, overwrite=args.overwrite)
    feats = extract_features(args.model, args.weights, blobs, batches, stages=args.stage or (),
                             progress=args.progress)
    save_features(feats, outputs, db_type, overwrite=args.overwrite)
    for (blob, arr), out in zip(feats.items(), outputs * len(feats) if db_type == "npz"
                                else outputs):
        print(f"Extracted features of {len(arr)} query images for feature blob {blob} "
              f"{tuple(arr.shape[1:])} -> {out}")
    print("Successfully extracted the features!")
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    from keras_cct.caffe.tools.upgrade import upgrade_file
    check_output_file(args.output, "the output")
    kind = upgrade_file(args.input, args.output, kind=args.kind)
    what = {"net": "net (text)", "binary": "net (binary)", "solver": "solver"}[kind]
    print(f"Wrote upgraded {what} to {args.output}")
    return 0


def _draw(args: argparse.Namespace) -> int:
    from keras_cct.caffe.io.text import read_net
    from keras_cct.caffe.tools.draw import draw_net
    check_output_file(args.output, "the picture")
    net = read_net(args.prototxt)
    print(f"Drawing net to {args.output}")
    engine = draw_net(net, args.output, rankdir=args.rankdir, phase=args.phase,
                      engine=args.engine, dpi=args.dpi, label_edges=not args.no_edge_labels)
    print(f"Wrote {args.output} ({engine})")
    return 0


def _plot_log(args: argparse.Namespace) -> int:
    from keras_cct.caffe.tools.logs import parse_log, plot_log, write_csv
    out_dir = args.output_dir or os.path.dirname(os.path.abspath(args.log))
    base = os.path.join(out_dir, os.path.basename(args.log))
    png = args.png or base + ".png"
    for path in (base + ".train", base + ".test", png):
        check_output_file(path, "--output-dir")
    train, test = parse_log(args.log)
    for suffix, rows in ((".train", train), (".test", test)):
        if write_csv(base + suffix, rows, args.delimiter):
            print(f"Wrote {base + suffix} ({len(rows)} rows)")
        else:
            print(f"Not writing {base + suffix}; no lines to write")
    plot_log(train, test, png, x="Seconds" if args.x == "seconds" else "NumIters",
             title=os.path.basename(args.log))
    print(f"Wrote {png}")
    return 0


def _fmt_memory(n) -> str:
    return "-" if not n else f"{n} bytes ({n / (1 << 30):.1f} GiB)"


def _device_query(args: argparse.Namespace) -> int:
    from keras_cct.devices.registry import list_devices
    devices = list_devices(calibrate=False)
    ids = list(range(len(devices)))
    if args.gpu not in (None, "all"):
        try:
            ids = [int(v) for v in args.gpu.split(",")]
        except ValueError:
            raise KerasCCTError(f"-gpu {args.gpu}: give device ids such as 0 or 0,1, or all"
                                ) from None
        bad = [i for i in ids if not 0 <= i < len(devices)]
        if bad:
            raise KerasCCTError(f"-gpu {args.gpu}: no device {bad[0]}; keras_cct sees "
                                f"{len(devices)}: " + ", ".join(
                                    f"{i}={d.name}" for i, d in enumerate(devices)))
    for i in ids:
        d = devices[i]
        print(f"Querying device ID = {i}")
        for label, value in (("Device id", i), ("Name", d.name),
                             ("Description", d.description or "-"), ("Kind", d.kind),
                             ("Backend", d.backend),
                             ("Compute units", d.compute_units or "-"),
                             ("Total memory", _fmt_memory(d.memory)),
                             ("SGEMM GFLOP/s (cached)",
                              "-" if d.gflops is None else f"{d.gflops:.1f}")):
            print(f"{label + ':':<31}{value}")
    return 0


def register(subparsers) -> None:
    """Add the tools' sub-commands to the ``cct`` parser."""
    p = subparsers.add_parser("mean", aliases=["compute_image_mean"],
                              help="mean image of an LMDB or image list -> .binaryproto "
                                   "(like compute_image_mean)")
    p.add_argument("source", help="the LMDB folder (or, with --list, a file of 'path label' "
                                  "lines)")
    p.add_argument("output", nargs="?", default=None,
                   help="the .binaryproto to write (none: print the channel means only)")
    caffe_flag(p, "backend", default="lmdb", help="the DB type (lmdb)")
    p.add_argument("--list", action="store_true",
                   help="SOURCE is an image list (images read with OpenCV, as ImageData)")
    p.add_argument("--root", default="", help="with --list: the folder the paths are relative to")
    p.add_argument("--gray", action="store_true", help="with --list: load images as gray")
    p.add_argument("--resize-height", dest="resize_height", type=nonneg_int, default=0)
    p.add_argument("--resize-width", dest="resize_width", type=nonneg_int, default=0)
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.set_defaults(func=_mean)

    p = subparsers.add_parser("features", aliases=["extract_features"],
                              help="blobs of a net over its data -> LMDB or .npz "
                                   "(like extract_features)")
    p.add_argument("caffe_args", nargs="*", metavar="ARG",
                   help="Caffe's order: WEIGHTS MODEL BLOB1[,BLOB2] DATASET1[,DATASET2] "
                        "NUM_BATCHES [lmdb|npz]")
    caffe_flag(p, "weights", help="the trained .caffemodel")
    caffe_flag(p, "model", help="the net .prototxt (its TEST data layers are read)")
    caffe_flag(p, "blobs", help="blob names, comma separated")
    caffe_flag(p, "output", help="one LMDB per blob (comma separated), or one .npz")
    caffe_flag(p, "batches", help="number of mini-batches")
    caffe_flag(p, "db-type", help="lmdb (default) or npz")
    caffe_flag(p, "stage", action="append", help="a net stage (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.set_defaults(func=_features)

    p = subparsers.add_parser("upgrade", aliases=["upgrade_net_proto_text",
                                                  "upgrade_net_proto_binary",
                                                  "upgrade_solver_proto_text"],
                              help="V0/V1 nets and old solvers -> the current format")
    p.add_argument("input", help="the old .prototxt, .caffemodel or solver")
    p.add_argument("output", help="the file to write")
    p.add_argument("--kind", default="auto", choices=["auto", "net", "solver", "binary"],
                   help="what the input is (default: .caffemodel is binary, text is tried as a "
                        "net, then as a solver)")
    p.set_defaults(func=_upgrade)

    p = subparsers.add_parser("draw", aliases=["draw_net"],
                              help="the net as a picture (PNG/SVG/PDF, like draw_net.py)")
    p.add_argument("prototxt", help="the net .prototxt")
    p.add_argument("output", help="the picture (.png, .svg or .pdf)")
    caffe_flag(p, "rankdir", default="LR", choices=["LR", "TB", "RL", "BT"],
               help="direction of the graph layout (default LR)")
    caffe_flag(p, "phase", default="ALL", choices=["ALL", "TRAIN", "TEST"],
               help="draw the layers of this phase (default ALL)")
    p.add_argument("--engine", default="auto", choices=["auto", "pydot", "matplotlib"],
                   help="pydot + Graphviz when installed (auto), else matplotlib")
    p.add_argument("--dpi", type=positive_int, default=100)
    p.add_argument("--no-edge-labels", dest="no_edge_labels", action="store_true",
                   help="no batch/num_output labels on the edges")
    p.set_defaults(func=_draw)

    p = subparsers.add_parser("plot-log", aliases=["parse_log"],
                              help="train/test CSVs and training curves of a `cct train` or "
                                   "Caffe log (like parse_log.py)")
    p.add_argument("log", help="the log file")
    p.add_argument("output_dir", nargs="?", default=None,
                   help="where LOG.train, LOG.test and LOG.png go (default: beside the log)")
    caffe_flag(p, "output-dir", dest="output_dir_flag", default=None,
               help=argparse.SUPPRESS)
    p.add_argument("--delimiter", default=",", help="CSV delimiter (default ,)")
    p.add_argument("--png", default=None, help="the curves' picture (default LOG.png)")
    p.add_argument("--x", default="iters", choices=["iters", "seconds"],
                   help="x axis of the curves")
    p.set_defaults(func=lambda a: _plot_log(_output_dir(a)))

    p = subparsers.add_parser("device_query", aliases=["device-query"],
                              help="the devices keras_cct sees (like caffe device_query)")
    caffe_flag(p, "gpu", default=None, help="device id(s), e.g. 0 or 0,1 or all")
    p.set_defaults(func=_device_query)


def _output_dir(args: argparse.Namespace) -> argparse.Namespace:
    if args.output_dir_flag is not None:
        if args.output_dir is not None:
            raise KerasCCTError("the output folder given twice (positional and --output-dir)")
        args.output_dir = args.output_dir_flag
    return args
