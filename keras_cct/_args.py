"""Checks of ``cct`` command-line arguments, shared by every sub-command.

* argparse ``type=`` validators for counts (:func:`positive_int`, :func:`nonneg_int`): a bad
  value exits with status 2 and argparse's one line, before TensorFlow is imported;
* :func:`check_output_file` / :func:`check_output_dir`: the place a command will write is a
  folder it can write, checked before any work is done (a typed :class:`KerasCCTError`, which
  ``cct`` prints as one line with status 1);
* :func:`check_input_shapes`: ``--input-shape NAME=...`` names an input the net has.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Iterable, Mapping, Optional

from keras_cct.errors import KerasCCTError


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (iterations, batch sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {value}")
    return value


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0 (indices, seeds, sizes where 0 means 'keep')."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _existing_ancestor(path: str) -> str:
    """The nearest folder above ``path`` (or ``path``'s parent) that exists."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return folder


def _probe_writable(folder: str, what: str, target: str) -> None:
    """Create and remove a file in ``folder`` (``os.access`` says yes to root even on a
    read-only file system)."""
    if not os.path.isdir(folder):
        raise KerasCCTError(f"{what} {target}: {folder} is a file, not a folder; choose a "
                            f"path in a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".cct-write-check.", dir=folder)
    except OSError as exc:
        raise KerasCCTError(f"{what} {target}: cannot write in {folder} "
                            f"({exc.strerror or exc}); choose a writable folder") from None
    os.close(fd)
    os.remove(tmp)


def check_output_file(path: str, what: str) -> None:
    """Raise a one-line :class:`KerasCCTError` unless the file ``path`` can be written:
    not a folder, and its folder (or the nearest existing one above it, which the writer
    creates) is a writable folder. ``what`` names the argument (e.g. ``"-o"``)."""
    if os.path.isdir(path):
        raise KerasCCTError(f"{what} {path}: is a folder; give a file name")
    _probe_writable(_existing_ancestor(path), what, path)


def check_output_dir(path: str, what: str) -> None:
    """Raise a one-line :class:`KerasCCTError` unless ``path`` is (or can be created as) a
    writable folder."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise KerasCCTError(f"{what} {path}: is a file, not a folder; give a folder path")
        _probe_writable(path, what, path)
    else:
        _probe_writable(_existing_ancestor(os.path.join(path, "x")), what, path)


def check_input_shapes(shapes: Mapping[str, tuple], known: Iterable[str],
                       what: str = "--input-shape") -> None:
    """Every name of ``--input-shape NAME=...`` must be an input (or data-layer top) of the
    net; the dims must be positive."""
    known = list(known)
    for name, dims in shapes.items():
        if name not in known:
            raise KerasCCTError(
                f"{what} {name}=...: the net has no input '{name}'; its inputs are "
                f"{', '.join(known) or '(none)'}")
        if any(d <= 0 for d in dims):
            raise KerasCCTError(f"{what} {name}={','.join(map(str, dims))}: every dimension "
                                f"must be positive")


def check_device_name(name: str, what: str = "--devices") -> Optional[str]:
    """The device one ``--devices NAME`` means: ``None`` for the Keras backend's (``cpu``,
    ``auto``, ``keras``), else an OpenCL device that exists (checked through the registry,
    which lists the available ones in its error)."""
    if name in ("cpu", "auto", "keras"):
        return None
    if not name.startswith("opencl:"):
        raise KerasCCTError(f"{what} {name}: unknown device; give an OpenCL device such as "
                            f"opencl:0:0 (see `cct devices`), or cpu for the Keras backend's")
    from keras_cct.devices.registry import get_device
    try:
        get_device(name)
    except KerasCCTError as exc:
        raise KerasCCTError(f"{what} {name}: {exc}") from None
    except ValueError as exc:  # a malformed name
        raise KerasCCTError(f"{what} {name}: {exc}") from None
    return name
