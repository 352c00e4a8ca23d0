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

# Modules that provide sub-commands, in the order they appear in ``cct --help``.
COMMAND_MODULES = (
    "keras_cct.caffe.commands",
    "keras_cct.caffe.train_commands",
    "keras_cct.export.commands",
    "keras_cct.devices.commands",
    "keras_cct.benchmarks_cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every available sub-command."""
    parser = argparse.ArgumentParser(
        prog="cct", description="keras_cct: Caffe con Troll for Keras 3")
    from keras_cct import __version__
    parser.add_argument("--version", action="version", version=f"keras_cct {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that concern is not built yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``cct`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from keras_cct.errors import KerasCCTError
    try:
        return int(args.func(args) or 0)
    except KerasCCTError as exc:
        print(f"cct {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
