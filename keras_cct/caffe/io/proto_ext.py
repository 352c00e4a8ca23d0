"""A user's own ``caffe.proto`` additions (a fork's fields this package does not know), merged
into :mod:`keras_cct.caffe.io.proto`'s schema at run time.

No protoc is needed: :func:`proto_to_listing` reads the subset of the proto2 language that
Caffe's schema files use -- ``message`` blocks with ``optional``/``repeated``/``required``
fields (scalar, message or enum types, ``[default = ...]`` and ``[packed = ...]`` options),
``enum`` blocks (top level or inside a message), comments, and ``syntax``/``package``/
``import``/``option`` lines (ignored). Nested messages, ``oneof``, ``map``, ``extend``,
``reserved`` and groups are not read (a :class:`~keras_cct.errors.CaffeFormatError` says so).

A message that already exists gets the file's new fields (a field whose name *and* number are
already there is skipped, so a whole fork ``caffe.proto`` can be given); a new message is added.

Example::

    from keras_cct.caffe.io import proto, proto_ext
    proto_ext.extend_schema("my_fork_additions.proto")
    net = proto.NetParameter()  # now knows the fork's fields
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple, Union

from keras_cct.caffe.io import proto
from keras_cct.errors import CaffeFormatError

__all__ = ["proto_to_listing", "extend_schema", "reset_schema"]

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\''
                    r'|[A-Za-z_][\w.]*|-?[\d.]+(?:[eE][+-]?\d+)?|[{}\[\];=,<>()]')
_IGNORED = {"syntax", "package", "import", "option"}
_UNSUPPORTED = {"oneof", "map", "extend", "reserved", "extensions", "group", "service"}


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _tokens(text: str) -> List[Tuple[str, int]]:
    out = []
    for lineno, line in enumerate(_strip_comments(text).splitlines(), 1):
        out.extend((m.group(0), lineno) for m in _TOKEN.finditer(line))
    return out


class _Reader:
    def __init__(self, text: str, path: Optional[str]) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.path = path

    def error(self, message: str) -> CaffeFormatError:
        line = self.toks[min(self.i, len(self.toks) - 1)][1] if self.toks else None
        return CaffeFormatError(message, path=self.path, line=line,
                                hint="give proto2 messages, fields and enums only (see "
                                     "keras_cct.caffe.io.proto_ext)")

    def peek(self) -> Optional[str]:
        return self.toks[self.i][0] if self.i < len(self.toks) else None

    def take(self, expected: Optional[str] = None) -> str:
        tok = self.peek()
        if tok is None:
            raise self.error("unexpected end of file")
        if expected is not None and tok != expected:
            raise self.error(f"expected {expected!r}, found {tok!r}")
        self.i += 1
        return tok

    def skip_statement(self) -> None:
        while self.take() != ";":
            pass


def _enum(r: _Reader, name: str, out: List[str]) -> None:
    out.append(f"enum {name}")
    r.take("{")
    while r.peek() != "}":
        if r.peek() in ("option", "reserved"):
            r.skip_statement()
            continue
        value = r.take()
        r.take("=")
        number = r.take()
        if r.peek() == "[":
            while r.take() != "]":
                pass
        r.take(";")
        out.append(f"    {value} = {int(number)}")
    r.take("}")


def _field(r: _Reader, label: str, out: List[str]) -> None:
    type_name, name = r.take(), r.take()
    r.take("=")
    number = int(r.take())
    opts = []
    if r.peek() == "[":
        r.take("[")
        while True:
            key = r.take()
            r.take("=")
            value = r.take()
            if key in ("default", "packed"):
                opts.append(f"{key} = {value}")
            if r.take() == "]":
                break
    r.take(";")
    suffix = f" [{', '.join(opts)}]" if opts else ""
    out.append(f"  {label} {type_name} {name} = {number}{suffix}")


def _message(r: _Reader, name: str, out: List[str]) -> None:
    out.append(f"message {name}")
    r.take("{")
    while r.peek() != "}":
        tok = r.take()
        if tok in ("optional", "repeated", "required"):
            _field(r, tok, out)
        elif tok == "enum":
            _enum(r, f"{name}.{r.take()}", out)
        elif tok == "option":
            r.skip_statement()
        elif tok == "message":
            raise r.error(f"nested message {r.peek()!r} in {name}: not supported (define it at "
                          "the top level)")
        elif tok in _UNSUPPORTED:
            raise r.error(f"{tok!r} in message {name} is not supported")
        elif tok == ";":
            continue
        else:
            raise r.error(f"cannot read {tok!r} in message {name} (proto2 fields need a label)")
    r.take("}")


def proto_to_listing(text: str, path: Optional[str] = None) -> str:
    """The schema listing (:mod:`keras_cct.caffe.io._schema`'s format) of proto2 ``text``."""
    r = _Reader(text, path)
    out: List[str] = []
    while r.peek() is not None:
        tok = r.take()
        if tok in _IGNORED:
            r.skip_statement()
        elif tok == "message":
            _message(r, r.take(), out)
        elif tok == "enum":
            _enum(r, r.take(), out)
        elif tok == ";":
            continue
        else:
            raise r.error(f"{tok!r} at the top level is not supported")
    return "\n".join(out) + "\n"


def _known_fields() -> Dict[str, Dict[str, Tuple[int, str]]]:
    """message -> field name -> (number, type: a scalar's name or the ``.caffe.`` path)."""
    scalars = {v: k for k, v in proto._SCALARS.items()}
    return {m.name: {f.name: (f.number, f.type_name or scalars.get(f.type, "?"))
                     for f in m.field}
            for m in proto.FILE_DESCRIPTOR_PROTO.message_type}


def _drop_known(listing: str) -> str:
    """Drops the fields (and enums) the current schema already has with the same number."""
    known = _known_fields()
    known_enums = {f"{m.name}.{e.name}" for m in proto.FILE_DESCRIPTOR_PROTO.message_type
                   for e in m.enum_type} | {e.name for e in proto.FILE_DESCRIPTOR_PROTO.enum_type}
    out, message, in_known_enum = [], None, False
    for line in listing.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "message":
            message, in_known_enum = words[1], False
        elif words[0] == "enum":
            in_known_enum = words[1] in known_enums or f"{message}.{words[1]}" in known_enums
            if in_known_enum:
                continue
        elif line.startswith("    "):  # an enum value
            if in_known_enum:
                continue
        else:
            in_known_enum = False
            type_name, name, number = words[1], words[2], int(words[4].rstrip(";"))
            have = known.get(message, {}).get(name)
            if have is not None and have[0] == number and (
                    have[1] == type_name or have[1].endswith("." + type_name)):
                continue
        out.append(line)
    return "\n".join(out) + "\n"


def extend_schema(source: Union[str, os.PathLike]) -> List[str]:
    """Adds a .proto file's (or text's) messages and fields to the Caffe schema.

    Args:
        source: a path to a .proto file, or proto2 text.

    Returns:
        The names of the messages it added to or created.

    Raises:
        CaffeFormatError: the file uses proto syntax outside the subset this reads, or a field
            clashes (same number or name, different definition) with one already known.
    """
    path = None
    text = str(source)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "{" not in source):
        path = os.fspath(source)
        with open(path, encoding="utf-8") as f:
            text = f.read()
    listing = _drop_known(proto_to_listing(text, path))
    try:
        proto._install(proto.SCHEMA_TEXTS + (listing,))
    except (RuntimeError, TypeError) as exc:
        raise CaffeFormatError(f"cannot add this schema: {exc}", path=path,
                               hint="rename or renumber the clashing field") from None
    return sorted({line.split()[1] for line in listing.splitlines()
                   if line.startswith("message ")})


def reset_schema() -> None:
    """Back to the built-in schema (BVLC's plus the forks' fields)."""
    proto._install(proto.SCHEMA_TEXTS[:2])
