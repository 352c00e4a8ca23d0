"""``cct export``: write a ``.keras`` model or a Caffe net (``.prototxt`` + ``.caffemodel``) as
ONNX, with each HybridConv2D exported as one ONNX ``Conv``."""

from __future__ import annotations

import argparse
from pathlib import Path

from keras_cct._args import check_output_file, positive_int
from keras_cct.errors import ExportError

#: ONNX opsets tf2onnx converts to (7: its oldest handlers; the newest comes from tf2onnx).
MIN_OPSET = 7


def register(subparsers) -> None:
    """Add the ``export`` sub-command to the ``cct`` parser."""
    p = subparsers.add_parser(
        "export", help="export a .keras model or a Caffe net to ONNX",
        description="Export a Keras model (.keras) or a Caffe net (.prototxt, with its "
                    ".caffemodel weights) to ONNX through tf2onnx. Needs the TensorFlow "
                    "backend (KERAS_BACKEND=tensorflow, Keras' default). The batch dimension "
                    "stays dynamic unless --batch-size is given; the ONNX inputs and outputs "
                    "are named like the model's (Caffe blob names for a Caffe net).")
    p.add_argument("model", help="MODEL.keras, or NET.prototxt (Caffe deploy definition)")
    p.add_argument("--weights", metavar="W.caffemodel",
                   help="trained Caffe weights for a .prototxt (without them the net keeps "
                        "its initial weights)")
    p.add_argument("-o", "--output", required=True, metavar="model.onnx",
                   help="the ONNX file to write (atomically: nothing is left on failure)")
    p.add_argument("--opset", type=int, default=None,
                   help="ONNX opset (default: tf2onnx's default, 15 for tf2onnx 1.17)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="fix the batch dimension (default: dynamic)")
    p.set_defaults(func=run)


#: Modules whose import registers keras_cct's serializable layers (so .keras files load).
_LAYER_MODULES = ("keras_cct.layers", "keras_cct.caffe.net.layers")


def _register_custom_objects() -> None:
    import importlib

    for name in _LAYER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a part that this install does not have
            pass


def load_model_file(path: str, weights: str | None = None):
    """The Keras model in ``path``: a ``.keras`` file, or a Caffe ``.prototxt`` (+ weights)."""
    import keras

    suffix = Path(path).suffix.lower()
    if not Path(path).exists():
        raise ExportError(f"{path}: no such file")
    if suffix in (".prototxt", ".pbtxt"):
        try:
            from keras_cct.caffe import load_net
        except ImportError as exc:
            raise ExportError(f"{path}: reading Caffe nets needs keras_cct.caffe.load_net, "
                              f"which is not available in this install ({exc})") from exc
        return load_net(path, weights) if weights else load_net(path)
    if weights:
        raise ExportError(f"{path}: --weights is only for a Caffe .prototxt (a .keras file "
                          f"holds its own weights)")
    if suffix not in (".keras", ".h5", ".hdf5"):
        raise ExportError(f"{path}: expected a .keras model or a Caffe .prototxt, got "
                          f"'{suffix or path}'")
    _register_custom_objects()
    try:
        return keras.saving.load_model(path, compile=False)
    except Exception as exc:
        raise ExportError(f"{path}: cannot load the Keras model: {type(exc).__name__}: "
                          f"{exc}") from exc


def _check_opset(opset: int) -> None:
    """``--opset`` is one tf2onnx converts to."""
    from tf2onnx import constants
    newest = max(constants.OPSET_TO_IR_VERSION)
    if not MIN_OPSET <= opset <= newest:
        raise ExportError(f"--opset {opset}: tf2onnx converts to opsets {MIN_OPSET} to "
                          f"{newest}; give one of those (or leave --opset out for "
                          f"{constants.PREFERRED_OPSET})")


def run(args: argparse.Namespace) -> int:
    """Run ``cct export``."""
    from keras_cct.export.onnx_export import _require_tensorflow, export_onnx

    _require_tensorflow()  # before loading: a clear message instead of a backend error
    if args.opset is not None:
        _check_opset(args.opset)
    check_output_file(args.output, "-o")
    model = load_model_file(args.model, args.weights)
    out = export_onnx(model, args.output, opset=args.opset, batch_size=args.batch_size)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return 0
