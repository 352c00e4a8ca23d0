"""``cct devices``: the table of devices keras_cct can compute on, with measured GFLOP/s."""

from __future__ import annotations

import argparse
import json


def _fmt_bytes(n) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return str(n)


def run(args: argparse.Namespace) -> int:
    """Print the device table (or JSON)."""
    from keras_cct.devices.registry import list_devices, opencl_platforms
    devices = list_devices(calibrate=not args.no_calibrate, sub_devices=args.sub_devices,
                           refresh=args.refresh)
    if args.json:
        print(json.dumps([{"name": d.name, "kind": d.kind, "backend": d.backend,
                           "description": d.description, "compute_units": d.compute_units,
                           "memory": d.memory, "gflops": d.gflops} for d in devices], indent=1))
        return 0
    rows = [("device", "kind", "units", "memory", "GFLOP/s", "description")]
    for d in devices:
        rows.append((d.name, d.kind, str(d.compute_units or "-"), _fmt_bytes(d.memory),
                     "-" if d.gflops is None else f"{d.gflops:.1f}", d.description))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    info = opencl_platforms()
    if info.get("error"):
        print(f"\nOpenCL: none available ({info['error']}). Install pyopencl and an OpenCL "
              "platform (e.g. `apt-get install pocl-opencl-icd`).")
    for plat in info.get("platforms", []):
        for dev in plat["devices"]:
            if dev["build_error"]:
                print(f"\nopencl:{plat['index']}:{dev['index']} ({dev['name']}) is listed by "
                      f"its platform but cannot build kernels: {dev['build_error']}")
    return 0


def register(subparsers) -> None:
    """Add ``cct devices`` to the ``cct`` parser."""
    p = subparsers.add_parser(
        "devices", help="list devices (backend and OpenCL) with measured GFLOP/s",
        description="List the Keras backend's devices and every working OpenCL device with "
                    "their SGEMM throughput (measured once, then cached on disk).")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not measure; show cached GFLOP/s only")
    p.add_argument("--sub-devices", action="store_true",
                   help="also list OpenCL sub-devices (device fission, one compute unit each)")
    p.add_argument("--refresh", action="store_true",
                   help="re-discover and re-measure instead of reading the caches")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
