"""Readers and writers of Caffe's files: .prototxt, .caffemodel, .binaryproto, blobs.

* :func:`read_net` / :func:`parse_net` -- a network definition (text), upgraded to the current
  ``layer {}`` format (V0 ``layers { layer {} }`` and V1 ``layers { type: ENUM }`` nets, the
  ``input:``/``input_dim:``/``input_shape:`` fields become ``Input`` layers, data-layer transform
  fields move to ``transform_param``) exactly as Caffe's ``upgrade_proto.cpp`` does.
* :func:`read_caffemodel` -- trained weights (binary ``NetParameter``), upgraded the same way.
* :func:`read_binaryproto` / :func:`write_binaryproto` -- one ``BlobProto`` (mean files).
* :func:`blob_to_array` / :func:`array_to_blob` -- a ``BlobProto`` <-> numpy, with Caffe's
  legacy 4-D ``num/channels/height/width`` shapes.
* :func:`filter_net` -- Caffe's include/exclude phase, level and stage rules.

Every problem raises :class:`keras_cct.errors.CaffeFormatError` naming the file and the
line:column (text) or the layer (binary). Nothing a file contains is ever executed: text goes
through ``google.protobuf.text_format`` and binary through protobuf's parser only.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Tuple, Union

from google.protobuf import text_format

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.upgrade import NetSource, upgrade_net
from keras_cct.caffe.io.validate import check_strings, max_bytes, read_bounded
from keras_cct.errors import CaffeFormatError

PathLike = Union[str, os.PathLike]

__all__ = ["read_net", "parse_net", "read_text", "parse_text", "read_text_file",
           "top_level_blocks", "field_lines"]


def _strip_position(msg: str) -> str:
    return re.sub(r"^\s*\d+:\d+\s*:\s*", "", msg)


def read_text(path: PathLike, message_class=None, *, what: str = "prototxt"):
    """Parse the text-format protobuf file ``path`` into a new ``message_class`` message.

    Raises:
        CaffeFormatError: the file is missing or unreadable, or has a syntax error (with its
            line and column).
    """
    message_class = message_class or proto.NetParameter
    path = str(path)
    return parse_text(read_text_file(path, what), message_class, path, what)


def read_text_file(path: str, what: str) -> str:
    """A text file's contents (a regular file of at most 256 MiB or the memory bound; UTF-8:
    the largest real prototxts are well under 1 MiB)."""
    data = read_bounded(path, what, limit=min(max_bytes(), 256 << 20))
    try:
        return data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise CaffeFormatError(f"not a text {what} (byte {exc.start} is not UTF-8)", path=path,
                               hint="binary .caffemodel files go in `weights=`") from None


def parse_text(text: str, message_class, path: str, what: str):
    msg = message_class()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as exc:
        line = exc.GetLine() if hasattr(exc, "GetLine") else None
        col = exc.GetColumn() if hasattr(exc, "GetColumn") else None
        detail = _strip_position(str(exc))
        hint = "fix the syntax at that position"
        if "ceil_mode" in detail:
            hint = ("`ceil_mode` comes from a Caffe fork; BVLC Caffe uses "
                    "`round_mode: CEIL` (the default) or `round_mode: FLOOR`")
        elif "has no field named" in detail:
            hint = "the field is not part of BVLC Caffe's caffe.proto (a fork's extension?)"
        raise CaffeFormatError(f"{what} syntax error: {detail}", path=path, line=line,
                               column=col, hint=hint) from None
    check_strings(msg, path, what)  # escapes such as "\\303(" are not UTF-8
    return msg


def top_level_blocks(text: str) -> List[Tuple[str, int]]:
    """(field name, 1-based line) of every top-level field in a text-format message."""
    out: List[Tuple[str, int]] = []
    depth = 0
    line = 1
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c in "\"'":
            quote = c
            i += 1
            while i < n and text[i] != quote:
                if text[i] == "\\":
                    i += 1
                elif text[i] == "\n":
                    line += 1
                i += 1
            i += 1
        elif c in "{<":
            depth += 1
            i += 1
        elif c in "}>":
            depth -= 1
            i += 1
        elif depth == 0 and (c.isalpha() or c == "_"):
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            out.append((text[i:j], line))
            # skip the value of a scalar field (so that enum names are not taken as fields)
            k = j
            while k < n and text[k] in " \t\r":
                k += 1
            if k < n and text[k] == ":":
                k += 1
                while k < n and text[k] in " \t\r\n":
                    if text[k] == "\n":
                        line += 1
                    k += 1
                if k < n and text[k] not in "{<\"'":
                    while k < n and not text[k].isspace() and text[k] not in "{}<>#":
                        k += 1
            i = k
        else:
            i += 1
    return out


def parse_net(text: str, *, path: str = "<string>", upgrade: bool = True
              ) -> Tuple["proto.NetParameter", NetSource]:
    """Parse a network definition given as text; returns ``(net, source)``."""
    net = parse_text(text, proto.NetParameter, path, "prototxt")
    blocks = top_level_blocks(text)
    layer_lines = [ln for name, ln in blocks if name in ("layer", "layers")]
    input_lines = [ln for name, ln in blocks if name == "input"]
    source = NetSource(path, [])
    if upgrade:
        upgrade_net(net, path=path, source=source, layer_lines=layer_lines,
                    input_lines=input_lines)
    else:
        source.layer_lines = list(layer_lines)
    return net, source


def read_net(path: PathLike, *, upgrade: bool = True, with_source: bool = False):
    """Read a .prototxt network definition, upgraded to the current format.

    Args:
        path: the .prototxt file.
        upgrade: convert V0/V1 layers and ``input:`` fields (as Caffe does when it loads a net).
        with_source: also return a :class:`NetSource` (file and line of each layer).

    Returns:
        ``NetParameter`` (or ``(NetParameter, NetSource)``).

    Raises:
        CaffeFormatError: unreadable file or syntax error (file:line:column).
    """
    path = str(path)
    text = read_text_file(path, "prototxt")
    net, source = parse_net(text, path=path, upgrade=upgrade)
    return (net, source) if with_source else net




def field_lines(text: str) -> Dict[str, List[int]]:
    """Top-level field name -> the 1-based lines it appears on, in a text-format file."""
    out: Dict[str, List[int]] = {}
    for name, line in top_level_blocks(text):
        out.setdefault(name, []).append(line)
    return out
