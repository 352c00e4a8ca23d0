"""The ``cct`` command line: mirrors ``caffe train / test / time`` and adds keras_cct's tools.

Each concern registers its own sub-commands from a ``commands`` module in its folder
(``register(subparsers)``); this file only assembles them, so ``cct --help`` lists what the
installed package provides.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from keras_cct._version import __version__

# Modules that provide sub-commands, in the order they appear in ``cct --help``.
COMMAND_MODULES = (
    "keras_cct.caffe.commands",
    "keras_cct.caffe.train_commands",
    "keras_cct.caffe.tools.commands",
    "keras_cct.export.commands",
    "keras_cct.devices.commands",
    "keras_cct.benchmarks_cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every available sub-command."""
    parser = argparse.ArgumentParser(
        prog="cct", description="keras_cct: Caffe con Troll for Keras 3")
    parser.add_argument("--version", action="version", version=f"keras_cct {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _one_line(exc: BaseException) -> str:
    """An error message on one line (the first non-empty line of a multi-line text)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _prefetchers() -> list:
    """keras_cct's data-prefetch iterators running now."""
    data = sys.modules.get("keras_cct.caffe.train.prefetch")
    return data.running_prefetchers() if data is not None else []


def _stop_background_threads(keep: list) -> None:
    """Stop the data-prefetch threads a command started (they may hold h5py's or LMDB's locks,
    which would block the interpreter's shutdown); those running before it (``keep``: a
    caller's own, when ``main`` runs in-process) are left alone."""
    data = sys.modules.get("keras_cct.caffe.train.prefetch")
    if data is not None:
        data.stop_prefetchers(keep=keep)


_WATCHDOG_FILE = None


def _exit_watchdog(seconds: float) -> None:
    """Last resort after an error in the ``cct`` process itself: if the interpreter's shutdown
    does not finish within ``seconds`` (a library thread holding a lock), end the process with
    status 1. ``faulthandler``'s timer runs without the GIL, so it fires even while shutdown is
    stuck; the normal shutdown cancels it."""
    global _WATCHDOG_FILE
    import faulthandler
    import os
    try:
        _WATCHDOG_FILE = open(os.devnull, "w")  # its thread dump goes nowhere
        faulthandler.dump_traceback_later(seconds, exit=True, file=_WATCHDOG_FILE)
    except (OSError, RuntimeError, ValueError):  # pragma: no cover - no faulthandler support
        pass


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``cct`` console script.

    Errors are one line on stderr (``cct COMMAND: error: ...``) and a non-zero status: 2 for
    a bad command line (argparse), 1 for everything found later. No traceback is printed
    (``CCT_DEBUG=1`` re-raises unexpected exceptions to show one)."""
    import os
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from keras_cct.errors import KerasCCTError
    rc = 1
    before = _prefetchers()
    try:
        rc = int(args.func(args) or 0)
    except KerasCCTError as exc:
        print(f"cct {args.command}: error: {_one_line(exc)}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print(f"cct {args.command}: interrupted", file=sys.stderr, flush=True)
        rc = 130
    except Exception as exc:  # a guard: an unexpected error is still one line
        if os.environ.get("CCT_DEBUG"):
            raise
        typed = _typed_cause(exc)
        text = _one_line(typed) if typed is not None else \
            f"{type(exc).__name__}: {_one_line(exc)} (unexpected; CCT_DEBUG=1 shows the traceback)"
        print(f"cct {args.command}: error: {text}", file=sys.stderr, flush=True)
    finally:
        _stop_background_threads(before)
        sys.stdout.flush()
    if rc != 0 and argv is None:  # this process is `cct`: it must end, whatever holds a lock
        _exit_watchdog(5.0)
    return rc


def _typed_cause(exc: BaseException):
    """The keras_cct error an exception wraps (TensorFlow re-raises a layer's error as its own
    type, with the original as ``__cause__``/``__context__``), or None."""
    from keras_cct.errors import KerasCCTError
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KerasCCTError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
