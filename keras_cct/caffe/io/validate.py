"""Checks that run before anything is allocated or looped over: every malformed Caffe file is a
:class:`~keras_cct.errors.CaffeFormatError` naming the file, line or layer and the field.

* :func:`read_bounded` -- read a file only if it is a regular file of a sane size (never
  ``/dev/zero``, a folder or a FIFO).
* :func:`check_strings` -- every string field of a parsed binary message is UTF-8 (protobuf's
  upb runtime hands back ``bytes`` for proto2 strings that are not).
* :func:`check_solver` / :func:`check_solverstate` -- solver numbers in their valid ranges.
* :func:`remove_stale_temps` -- temporary snapshot files a killed run left behind.

The memory bound is ``KERAS_CCT_CAFFE_MAX_BYTES`` (bytes) when set, else a quarter of the
machine's physical memory: a blob larger than that, or a net whose weights together need more,
is refused with the bytes it would need (Caffe itself caps a blob at 2**31 - 1 values).
"""

from __future__ import annotations

import glob
import math
import os
import stat
from typing import Dict, List, Optional

from google.protobuf.descriptor import FieldDescriptor as FD

from keras_cct._system import physical_memory
from keras_cct.errors import CaffeFormatError

__all__ = ["max_bytes", "read_bounded", "check_strings", "check_solver", "check_solverstate",
           "remove_stale_temps", "gib", "MAX_ITER_SIZE"]

#: the largest ``iter_size`` accepted (mini-batches accumulated per iteration)
MAX_ITER_SIZE = 1024


def max_bytes() -> int:
    """The largest single allocation a Caffe file may ask for (see the module docstring)."""
    env = os.environ.get("KERAS_CCT_CAFFE_MAX_BYTES")
    if env:
        try:
            return max(int(float(env)), 1)
        except ValueError:
            pass
    total = physical_memory() or 16 << 30
    return max(total // 4, 256 << 20)


def gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB" if n >= (1 << 30) else f"{n / (1 << 20):.3g} MiB"


def read_bounded(path: str, what: str, *, limit: Optional[int] = None) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``limit`` bytes
    (default :func:`max_bytes`)."""
    path = str(path)
    limit = max_bytes() if limit is None else limit
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CaffeFormatError(f"{what} file not found", path=path,
                               hint="check the path") from None
    except OSError as exc:
        raise CaffeFormatError(f"cannot read the {what}: {exc.strerror}", path=path) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise CaffeFormatError(f"the {what} is {kind}", path=path,
                               hint=f"give the path of a {what} file")
    if st.st_size > limit:
        raise CaffeFormatError(f"the {what} is {gib(st.st_size)}, more than the "
                               f"{gib(limit)} allowed", path=path,
                               hint="is it the right file? raise KERAS_CCT_CAFFE_MAX_BYTES "
                                    "if it is")
    try:
        with open(path, "rb") as f:
            return f.read(limit + 1)
    except OSError as exc:
        raise CaffeFormatError(f"cannot read the {what}: {exc.strerror}", path=path) from None


# --------------------------------------------------------------------------------------------
# Strings


def _repeated(fd) -> bool:
    rep = getattr(fd, "is_repeated", None)  # protobuf >= 6; `label` before (removed in 7)
    return bool(rep) if rep is not None else fd.label == 3


def _bad_string(msg, where: str) -> Optional[str]:
    for fd, value in msg.ListFields():
        if fd.type == FD.TYPE_STRING:
            values = value if _repeated(fd) else [value]
            for i, v in enumerate(values):
                if not isinstance(v, str):
                    idx = f"[{i}]" if _repeated(fd) else ""
                    return f"{where}{fd.name}{idx}"
        elif fd.type == FD.TYPE_MESSAGE:
            if fd.message_type.name == "BlobProto":
                continue  # numbers only
            if _repeated(fd):
                for i, sub in enumerate(value):
                    bad = _bad_string(sub, f"{where}{fd.name}[{i}].")
                    if bad:
                        return bad
            else:
                bad = _bad_string(value, f"{where}{fd.name}.")
                if bad:
                    return bad
    return None


def check_strings(msg, path: str, what: str) -> None:
    """Raise if a string field of ``msg`` (a parsed binary message) is not UTF-8."""
    bad = _bad_string(msg, "")
    if bad:
        layer = None
        head = bad.split(".")[0]
        if head.startswith(("layer[", "layers[")):
            seq = getattr(msg, head.split("[")[0])
            try:
                name = seq[int(head.split("[")[1].rstrip("]"))].name
                layer = name if isinstance(name, str) else None
            except (IndexError, ValueError):
                layer = None
        raise CaffeFormatError(f"the {what}'s field {bad} is not UTF-8 text", path=path,
                               layer=layer, hint="the file is corrupt; write it again")


# --------------------------------------------------------------------------------------------
# Solvers


_INT_RULES = {  # field: (minimum, maximum or None, what it means)
    "max_iter": (0, None), "iter_size": (1, MAX_ITER_SIZE), "snapshot": (0, None),
    "test_interval": (0, None), "display": (0, None), "average_loss": (1, None),
    "stepsize": (0, None), "current_step": (0, None),
}
_FLOAT_RULES = {  # field: (minimum, maximum, maximum included)
    "base_lr": (0.0, math.inf, True), "momentum": (0.0, 1.0, False),
    "momentum2": (0.0, 1.0, False), "rms_decay": (0.0, 1.0, False),
    "weight_decay": (0.0, math.inf, True), "gamma": (0.0, math.inf, True),
    "delta": (0.0, math.inf, True),
}


def check_solver(param, path: Optional[str], lines: Optional[Dict[str, List[int]]] = None
                 ) -> None:
    """Every number of a ``SolverParameter`` in its valid range (file and line named)."""
    lines = lines or {}

    def fail(name: str, msg: str, hint: str, index: int = 0):
        at = lines.get(name, [])
        line = at[min(index, len(at) - 1)] if at else None
        raise CaffeFormatError(f"{name}: {msg}", path=path, line=line, hint=hint)

    for name, (lo, hi) in _INT_RULES.items():
        if name in param.DESCRIPTOR.fields_by_name and param.HasField(name):
            v = int(getattr(param, name))
            if v < lo or (hi is not None and v > hi):
                rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                fail(name, f"{v} is out of range: it must be {rng}", f"fix {name}")
    for name, (lo, hi, incl) in _FLOAT_RULES.items():
        if param.HasField(name):
            v = float(getattr(param, name))
            ok = math.isfinite(v) and v >= lo and (v <= hi if incl else v < hi)
            if not ok:
                rng = f">= {lo:g}" if hi == math.inf else f"in [{lo:g}, {hi:g})"
                fail(name, f"{v:g} is out of range: it must be {rng}", f"fix {name}")
    for i, v in enumerate(param.test_iter):
        if v < 1:
            fail("test_iter", f"{v} is out of range: it must be > 0",
                 "give the number of test batches", i)
    for i, v in enumerate(param.stepvalue):
        if v < 0:
            fail("stepvalue", f"{v} is out of range: it must be >= 0", "fix stepvalue", i)
    # Caffe: any negative seed means "not set"; numpy's seeds stop at 2**32 - 1
    if param.HasField("random_seed") and param.random_seed > 2 ** 32 - 1:
        fail("random_seed", f"{param.random_seed} is out of range: it must be in "
             f"[0, {2 ** 32 - 1}] (or -1 for none)", "use a smaller seed")
    if param.HasField("clip_gradients") and not math.isfinite(param.clip_gradients):
        fail("clip_gradients", f"{param.clip_gradients} is not a number",
             "use a positive number, or -1 for none")


def check_solverstate(state, path: str) -> None:
    """A parsed ``SolverState``: UTF-8 ``learned_net``, iteration and step >= 0."""
    check_strings(state, path, "solverstate")
    if state.iter < 0:
        raise CaffeFormatError(f"iter is {state.iter}: it must be >= 0", path=path,
                               hint="the file is corrupt")
    if state.current_step < 0:
        raise CaffeFormatError(f"current_step is {state.current_step}: it must be >= 0",
                               path=path, hint="the file is corrupt")


# --------------------------------------------------------------------------------------------
# Snapshots


def remove_stale_temps(prefix: str) -> List[str]:
    """Remove the hidden temporary files (``.PREFIX_iter_N.<ext>.XXXX.tmp``) a killed run left
    beside its snapshots; returns their paths."""
    folder = os.path.dirname(os.path.abspath(prefix))
    base = os.path.basename(prefix)
    removed = []
    for path in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(base)}_iter_*.tmp*")):
        try:
            if os.path.isfile(path):
                os.remove(path)
                removed.append(path)
        except OSError:
            pass
    return removed
