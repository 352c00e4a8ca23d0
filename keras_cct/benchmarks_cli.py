"""``cct bench``: run the benchmark suite of the source checkout (CcT's RQ1-RQ5).

The benchmarks live in the ``benchmarks/`` folder next to the ``keras_cct`` package in a source
checkout; they are not part of the installed package. ``cct bench`` finds that folder and runs
``python -m benchmarks`` from it, or says how to get it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from keras_cct.errors import KerasCCTError


class BenchmarksNotFoundError(KerasCCTError, FileNotFoundError):
    """The ``benchmarks/`` folder of the source checkout is not next to the package."""


def benchmarks_root(package_dir: Optional[Path] = None) -> Path:
    """The source checkout holding ``benchmarks/__main__.py`` beside ``keras_cct/``.

    Raises:
        BenchmarksNotFoundError: keras_cct was installed from a wheel (or the folder was
            removed), so there is no ``benchmarks/`` next to it.
    """
    if package_dir is None:
        import keras_cct
        package_dir = Path(keras_cct.__file__).resolve().parent
    root = Path(package_dir).resolve().parent
    if not (root / "benchmarks" / "__main__.py").is_file():
        raise BenchmarksNotFoundError(
            f"{root / 'benchmarks' / '__main__.py'}: not found; the benchmarks are part of the "
            f"source checkout, not of the installed package (keras_cct is at {package_dir}). "
            "Clone the repository and install it editable (`pip install -e .`), then run "
            "`cct bench` (or `python -m benchmarks`) from there")
    return root


def run_bench(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks`` with the parsed options; returns its exit status."""
    if args.out is not None:
        from keras_cct._args import check_output_dir
        check_output_dir(args.out, "--out")
    root = benchmarks_root()
    argv = [sys.executable, "-m", "benchmarks"]
    if args.quick:
        argv.append("--quick")
    if args.out is not None:
        argv += ["--out", str(Path(args.out).resolve())]
    if args.parts:
        argv += ["--parts", args.parts]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run(argv, cwd=root, env=env).returncode


def register(subparsers) -> None:
    """Add ``cct bench`` to the ``cct`` command line."""
    p = subparsers.add_parser(
        "bench", help="run the benchmark suite (CcT's RQ1-RQ5: batching, lowerings, planner, "
                      "hybrid, FLOPS; and per-layer convolutions vs Keras and PyTorch)",
        description="Run keras_cct's benchmark suite from the source checkout: each part writes "
                    "JSON, a markdown table and a PNG plot, then a summary next to CcT's "
                    "published figures.")
    p.add_argument("--quick", action="store_true",
                   help="small batches and few repeats (a few minutes; not the real figures)")
    p.add_argument("--out", default=None,
                   help="results folder (default: docs/benchmarks/ of the checkout)")
    p.add_argument("--parts", default=None,
                   help="comma-separated subset of: batching, lowering, planner, hybrid, flops, "
                        "nets, convs")
    p.set_defaults(func=run_bench)
