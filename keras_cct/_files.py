"""Writing files so that a reader never sees half of one: every file keras_cct writes (snapshots,
converted models, ONNX files, caches) is written to a temporary file beside it, flushed to disk,
then renamed over the target; on an error the temporary file is removed and the old file, if
any, is left as it was."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Dict, Iterator, Type, Union

PathLike = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def atomic_path(path: PathLike, *, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path beside ``path`` for the caller to write (with any library);
    when the block ends without an exception it replaces ``path``, otherwise it is removed.

    Args:
        path: the file to (re)place; its folder is created if missing.
        suffix: ending the temporary name needs (e.g. ``".keras"`` for ``model.save``).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp" + suffix,
                               dir=str(target.parent))
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; give the usual mode
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write(path: PathLike, data: Union[bytes, str]) -> None:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)


def cache_dir() -> Path:
    """Folder of keras_cct's on-disk caches (the planner's choices, the devices' calibration):
    ``$KERAS_CCT_CACHE_DIR`` or ``~/.cache/keras_cct``."""
    env = os.environ.get("KERAS_CCT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "keras_cct"


def read_cache_entries(path: Path, version: int, what: str,
                       warning: Type[Warning]) -> Dict[str, dict]:
    """The ``entries`` mapping of a JSON cache file ``{"version": ..., "entries": {...}}``
    (empty where the file is missing); a file of another version or layout, or unreadable, is
    ignored with a ``warning`` naming it and ``what`` it holds (it is rewritten later)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != version:
            raise ValueError("unexpected layout or version")
        entries = data.get("entries", {})
        if not isinstance(entries, dict):
            raise ValueError("entries is not a mapping")
        return entries
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path}: ignoring {what} ({exc}); it will be rewritten", warning,
                      stacklevel=4)
        return {}


def write_cache_entries(path: Path, version: int, entries: Dict[str, dict], what: str,
                        warning: Type[Warning]) -> None:
    """Write a JSON cache file (:func:`read_cache_entries`' layout) atomically; a folder that
    cannot be written (a read-only home) costs a ``warning``, never an error."""
    try:
        atomic_write(path, json.dumps({"version": version, "entries": entries}))
    except OSError as exc:
        warnings.warn(f"{path}: could not save {what} ({exc})", warning, stacklevel=4)
