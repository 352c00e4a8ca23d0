"""``cct convert`` and ``cct info``: Caffe nets from the command line.

* ``cct convert NET.prototxt [--weights W.caffemodel] -o model.keras`` -- import and save as a
  Keras model file (custom layers are registered, so ``keras.saving.load_model`` reads it back
  after ``import keras_cct``).
* ``cct info NET.prototxt`` -- a table of the net's layers: type, bottoms -> tops, output shape
  (Caffe's N, C, H, W order) and parameter count.
"""

from __future__ import annotations

import argparse
from typing import List, Tuple

from keras_cct._args import check_output_file
from keras_cct._files import atomic_path
from keras_cct.caffe.cli_args import add_python_layers_flag
from keras_cct.caffe.io.types import DATA_TYPES
from keras_cct.caffe.net.weights import keras_name
from keras_cct.errors import CaffeFormatError


def _shape_arg(text: str) -> Tuple[int, ...]:
    try:
        dims = tuple(int(v) for v in text.replace("x", ",").split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: use N,C,H,W (e.g. 1,3,224,224)")
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: dims must be positive")
    return dims


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("prototxt", help="the network definition (.prototxt)")
    p.add_argument("--input-shape", type=_shape_arg, default=None, metavar="N,C,H,W",
                   help="Caffe shape of the (first) input, when the prototxt gives none or to "
                        "change it")
    p.add_argument("--phase", choices=("TEST", "TRAIN"), default="TEST")
    p.add_argument("--stage", action="append", default=[], help="a net state stage (repeat)")
    add_python_layers_flag(p)


def register(subparsers) -> None:
    """Add ``convert`` and ``info`` to the ``cct`` sub-command parser."""
    p = subparsers.add_parser("convert", help="convert a Caffe net (+ weights) to a .keras file",
                              description=__doc__.splitlines()[0])
    _common(p)
    p.add_argument("--weights", default=None, help="trained weights (.caffemodel)")
    p.add_argument("-o", "--output", required=True, help="the .keras file to write")
    p.add_argument("--no-strict", action="store_true",
                   help="a layer missing from the weights is a warning, not an error")
    p.set_defaults(func=_convert)

    p = subparsers.add_parser("info", help="layer table of a Caffe net (shapes, parameters)")
    _common(p)
    p.set_defaults(func=_info)


def _import(args):
    # Keras loads here, not when `cct` starts (its sub-commands are registered at start-up)
    from keras_cct.caffe.net.builder import import_net
    return import_net(args.prototxt, getattr(args, "weights", None), phase=args.phase,
                      stages=args.stage, input_shape=args.input_shape,
                      strict=not getattr(args, "no_strict", False),
                      python_layers=args.python_layers)


def _convert(args) -> int:
    out = args.output
    if not out.endswith(".keras"):
        raise CaffeFormatError("the output must end in .keras", path=out,
                               hint="e.g. -o model.keras")
    check_output_file(out, "-o")  # before the (long) import
    net = _import(args)
    with atomic_path(out, suffix=".keras") as tmp:
        net.model.save(tmp)
    n_params = net.model.count_params()
    print(f"wrote {out}: {len(net.model.layers)} layers, {n_params:,} parameters; inputs "
          + ", ".join(f"{k} {v}" for k, v in net.inputs.items())
          + "; outputs " + ", ".join(net.outputs) + " (channels-last)")
    return 0


def info_rows(net) -> List[Tuple[str, str, str, str, int]]:
    """(layer, type, 'bottoms -> tops', Caffe output shape, parameters) for each layer."""
    from keras_cct.caffe.net.layout import caffe_shape  # imports Keras (loaded by then)
    rows = []
    names = {layer.name: layer for layer in net.model.layers}
    for lp in net.net_param.layer:
        layer = names.get(keras_name(lp.name))
        if lp.type == "Input" or lp.type in DATA_TYPES:
            shape = ", ".join(str(tuple(net.caffe_input_shapes().get(t, ())))
                              for t in lp.top if t in net.inputs)
            params = 0
        elif layer is not None:
            outs = layer.output if isinstance(layer.output, (list, tuple)) else [layer.output]
            shape = ", ".join(str(tuple(caffe_shape(o.shape))) for o in outs)
            params = layer.count_params()
        else:
            shape, params = "-", 0
        flow = f"{', '.join(lp.bottom) or '-'} -> {', '.join(lp.top) or '-'}"
        rows.append((lp.name, lp.type, flow, shape, params))
    return rows


def _info(args) -> int:
    net = _import(args)
    rows = info_rows(net)
    head = ("layer", "type", "bottom -> top", "output (N, C, H, W)", "params")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:4]) + f"  {{:>{widths[4]}}}"
    print(f"net: {net.net_param.name or '(unnamed)'}  phase: {net.phase}")
    print(fmt.format(*head))
    for r in rows:
        print(fmt.format(r[0], r[1], r[2], r[3], f"{r[4]:,}"))
    total = net.model.count_params()
    print(f"total parameters: {total:,}; outputs: {', '.join(net.outputs)}")
    for h in net.heads:
        print(f"head: {h.name} ({h.type}) <- {', '.join(h.bottoms)}")
    return 0
