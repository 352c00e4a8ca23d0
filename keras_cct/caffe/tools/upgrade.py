"""Caffe's ``upgrade_net_proto_text``, ``upgrade_net_proto_binary`` and
``upgrade_solver_proto_text``: old files rewritten in the current format.

* nets (text or binary .caffemodel): V0 ``layers { layer {} }`` and V1 ``layers { type: ENUM }``
  become ``layer { type: "Name" }`` (``blobs_lr``/``weight_decay`` -> ``param { lr_mult
  decay_mult }``), ``input:``/``input_dim:`` fields become ``Input`` layers, data-layer
  transform fields ``transform_param`` -- :func:`keras_cct.caffe.io.upgrade.upgrade_net`, the
  upgrade every reader of keras_cct applies;
* solvers: the ``solver_type: ENUM`` field becomes ``type: "Name"`` (Caffe's
  ``UpgradeSolverType``), and nets given inline (``net_param``...) are upgraded as above.

The output is written atomically (never half a file).
"""

from __future__ import annotations

import os
from typing import Tuple

from google.protobuf import text_format

from keras_cct._files import atomic_write
from keras_cct.caffe.io import proto
from keras_cct.caffe.io.binary import read_caffemodel
from keras_cct.caffe.io.text import parse_text, read_text_file
from keras_cct.caffe.io.upgrade import upgrade_net
from keras_cct.caffe.train.optimizer import SOLVER_TYPES
from keras_cct.errors import CaffeFormatError

__all__ = ["upgrade_solver", "upgrade_file", "KINDS"]

KINDS = ("auto", "net", "solver", "binary")


def upgrade_solver(param, *, path: str = "<solver>"):
    """Upgrade a ``SolverParameter`` in place (see the module docstring); returns it."""
    if param.HasField("solver_type"):
        legacy = SOLVER_TYPES[int(param.solver_type)]
        if param.HasField("type") and param.type.lower() != legacy.lower():
            raise CaffeFormatError(
                f"the solver sets both solver_type: {legacy.upper()} and type: "
                f"{param.type!r}", path=path, hint="keep one of them (Caffe refuses both)")
        param.type = legacy
        param.ClearField("solver_type")
    for name in ("net_param", "train_net_param"):
        if param.HasField(name):
            upgrade_net(getattr(param, name), path=path)
    for net in param.test_net_param:
        upgrade_net(net, path=path)
    return param


def _text_kind(text: str, path: str) -> Tuple[str, object]:
    """``("net" | "solver", message)`` of a text file: whichever schema parses it."""
    try:
        return "net", parse_text(text, proto.NetParameter, path, "prototxt")
    except CaffeFormatError as net_error:
        try:
            return "solver", parse_text(text, proto.SolverParameter, path, "solver")
        except CaffeFormatError:
            raise net_error from None


def upgrade_file(src: str, dst: str, *, kind: str = "auto") -> str:
    """Upgrade ``src`` into ``dst``; returns what it was (``net``, ``solver``, ``binary``).

    ``kind`` ``auto`` takes a ``.caffemodel`` (or any non-UTF-8 file) as a binary net, a text
    file as a net, else as a solver.

    Raises:
        CaffeFormatError: ``src`` unreadable or not a Caffe net/solver, or not upgradable.
    """
    if kind not in KINDS:
        raise CaffeFormatError(f"unknown kind {kind!r}", hint=f"use one of {', '.join(KINDS)}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise CaffeFormatError("the output is the input file", path=dst,
                               hint="write the upgraded file under another name")
    binary = kind == "binary" or (kind == "auto" and src.endswith(".caffemodel"))
    text = None
    if not binary:
        try:
            text = read_text_file(src, "prototxt")
        except CaffeFormatError as exc:
            if kind != "auto" or "UTF-8" not in exc.message:
                raise
            binary = True
    if binary:
        net = read_caffemodel(src, upgrade=True)
        atomic_write(dst, net.SerializeToString())
        return "binary"
    if kind == "solver":
        found, msg = "solver", parse_text(text, proto.SolverParameter, src, "solver")
    elif kind == "net":
        found, msg = "net", parse_text(text, proto.NetParameter, src, "prototxt")
    else:
        found, msg = _text_kind(text, src)
    if found == "net":
        upgrade_net(msg, path=src)
    else:
        upgrade_solver(msg, path=src)
    atomic_write(dst, text_format.MessageToString(msg))
    return found
