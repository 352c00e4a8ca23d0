"""Checks that run before anything is allocated or looped over: every malformed Caffe file is a
:class:`~keras_cct.errors.CaffeFormatError` naming the file, line or layer and the field.

* :func:`read_bounded` -- read a file only if it is a regular file of a sane size (never
  ``/dev/zero``, a folder or a FIFO).
* :func:`check_strings` -- every string field of a parsed binary message is UTF-8 (protobuf's
  upb runtime hands back ``bytes`` for proto2 strings that are not).
* :func:`check_layer` / :func:`check_input` -- a layer's parameters (kernel, stride, pad,
  dilation, group, num_output, Reshape's shape, ...) and the bytes its weights and blobs would
  need, against :func:`max_bytes`, before the builder makes a Keras layer.
* :func:`check_solver` / :func:`check_solverstate` -- solver numbers in their valid ranges.
* :func:`skip_batches` -- the TRAIN batches from mini-batch N on without replaying N batches.
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
from typing import Dict, Iterator, List, Optional, Sequence

from keras_cct.errors import CaffeFormatError
from keras_cct._system import physical_memory

__all__ = ["max_bytes", "read_bounded", "check_strings", "check_layer", "check_input",
           "check_solver", "check_solverstate", "skip_batches", "remove_stale_temps",
           "MAX_ITER_SIZE", "field_lines"]

#: the largest ``iter_size`` accepted (mini-batches accumulated per iteration)
MAX_ITER_SIZE = 1024
_DTYPE_BYTES = 4  # float32


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


def _gib(n: int) -> str:
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
        raise CaffeFormatError(f"the {what} is {_gib(st.st_size)}, more than the "
                               f"{_gib(limit)} allowed", path=path,
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
    from google.protobuf.descriptor import FieldDescriptor as FD
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
# Layers


def _hw(values, h: int, w: int, has_hw: bool, default: int):
    if has_hw:
        return [("h", int(h)), ("w", int(w))]
    vals = [int(v) for v in values] if not isinstance(values, int) else [int(values)]
    return [("", v) for v in vals] or [("", default)]


def _positive(ctx, p, names, *, minimum: int, default: int) -> None:
    single, h, w = names
    has_hw = p.HasField(h) or p.HasField(w)
    vals = getattr(p, single)
    if isinstance(vals, int) and not p.HasField(single):
        vals = []
    for suffix, v in _hw(vals, getattr(p, h), getattr(p, w), has_hw, default):
        if v < minimum:
            field = f"{single.split('_')[0]}_{suffix}" if suffix else single
            rule = "> 0" if minimum == 1 else ">= 0"
            raise ctx.error(f"{field} is {v}: it must be {rule}", hint=f"fix {field}")


def _numel(dims) -> int:
    return math.prod(int(d) if d is not None else 1 for d in dims)


def _param_bytes(ctx, what: str, count: int) -> None:
    need = count * _DTYPE_BYTES
    limit = max_bytes()
    if need > limit:
        raise ctx.error(f"{what} would need {_gib(need)} ({count} values), more than the "
                        f"{_gib(limit)} allowed", hint="is the number right? (the bound is "
                        "KERAS_CCT_CAFFE_MAX_BYTES, default a quarter of the memory)")
    total = getattr(ctx, "_validate_param_bytes", 0) + need
    ctx._validate_param_bytes = total
    if total > limit:
        raise ctx.error(f"the weights up to this layer would need {_gib(total)}, more than "
                        f"the {_gib(limit)} allowed",
                        hint="check num_output and the input size")


def _blob_bytes(ctx, what: str, dims) -> None:
    batch = dims[0] if dims and dims[0] is not None else (getattr(ctx, "batch", None) or 1)
    count = _numel((batch,) + tuple(dims[1:]))
    need = count * _DTYPE_BYTES
    if need > max_bytes():
        shown = tuple(d if d is not None else batch for d in dims)
        raise ctx.error(f"{what} of Caffe shape {shown} would need {_gib(need)}, more than "
                        f"the {_gib(max_bytes())} allowed",
                        hint="check the dims (or lower the batch size)")


def check_input(ctx, top: str, cshape) -> None:
    """An input blob's Caffe shape: no negative dimension, a sane size."""
    if cshape and cshape[0] is not None and int(cshape[0]) < 0:
        raise ctx.error(f"input '{top}' has a negative batch size {cshape[0]}",
                        hint="use a batch size > 0")
    if any(int(d) < 0 for d in cshape[1:]):
        return  # the builder says which dimension is not positive
    _blob_bytes(ctx, f"input blob '{top}'", tuple(cshape))


def _conv_out(size, k, s, p, d) -> Optional[int]:
    if size is None:
        return None
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def _check_conv(ctx, lp, x, deconv: bool) -> None:
    from keras_cct.layers.caffe_layers import caffe_shape
    p = lp.convolution_param
    if p.HasField("num_output") and p.num_output < 1:
        raise ctx.error("num_output is 0: it must be > 0", hint="fix num_output")
    _positive(ctx, p, ("kernel_size", "kernel_h", "kernel_w"), minimum=1, default=1)
    _positive(ctx, p, ("stride", "stride_h", "stride_w"), minimum=1, default=1)
    for i, dil in enumerate(p.dilation):
        if dil < 1:
            raise ctx.error(f"dilation is {dil}: it must be > 0", hint="fix dilation")
    if p.group < 1:
        raise ctx.error("group is 0: it must be > 0", hint="fix group")
    if not p.HasField("num_output"):
        return  # the builder says it is required
    g = int(p.group)
    n_out = int(p.num_output)
    shape = caffe_shape(x.shape)
    c = shape[1] if len(shape) == 4 else None
    if n_out % g:
        raise ctx.error(f"num_output {n_out} is not a multiple of group {g}",
                        hint="fix num_output or group")
    if c is not None and c % g:
        raise ctx.error(f"the input's {c} channels are not a multiple of group {g}",
                        hint="fix group")
    k = [int(v) for v in p.kernel_size] or [1]
    kh, kw = (int(p.kernel_h), int(p.kernel_w)) if p.HasField("kernel_h") else (k[0], k[-1])
    count = n_out * (c or 1) // g * kh * kw + (n_out if p.bias_term else 0)
    _param_bytes(ctx, f"the weights (num_output {n_out} x {(c or 1) // g} input channels x "
                      f"kernel {kh}x{kw})", count)
    if len(shape) == 4:
        s = [int(v) for v in p.stride] or [1]
        sh, sw = (int(p.stride_h), int(p.stride_w)) if p.HasField("stride_h") else (s[0], s[-1])
        pd = [int(v) for v in p.pad] or [0]
        ph, pw = (int(p.pad_h), int(p.pad_w)) if p.HasField("pad_h") else (pd[0], pd[-1])
        d = [int(v) for v in p.dilation] or [1]
        if deconv:
            oh = None if shape[2] is None else sh * (shape[2] - 1) + d[0] * (kh - 1) + 1 - 2 * ph
            ow = None if shape[3] is None else sw * (shape[3] - 1) + d[-1] * (kw - 1) + 1 - 2 * pw
        else:
            oh = _conv_out(shape[2], kh, sh, ph, d[0])
            ow = _conv_out(shape[3], kw, sw, pw, d[-1])
        if (oh is not None and oh < 1) or (ow is not None and ow < 1):
            raise ctx.error(f"the output would be {oh}x{ow} for an input of "
                            f"{shape[2]}x{shape[3]}", hint="check kernel_size, pad and stride")
        _blob_bytes(ctx, f"the output blob (num_output {n_out})", (shape[0], n_out, oh, ow))


def _check_pooling(ctx, lp, x) -> None:
    p = lp.pooling_param
    if not p.global_pooling:
        _positive(ctx, p, ("kernel_size", "kernel_h", "kernel_w"), minimum=1, default=1)
    _positive(ctx, p, ("stride", "stride_h", "stride_w"), minimum=1, default=1)
    if not p.global_pooling:
        kh = int(p.kernel_h) if p.HasField("kernel_h") else int(p.kernel_size)
        kw = int(p.kernel_w) if p.HasField("kernel_w") else int(p.kernel_size)
        ph = int(p.pad_h) if p.HasField("pad_h") else int(p.pad)
        pw = int(p.pad_w) if p.HasField("pad_w") else int(p.pad)
        if (ph or pw) and (ph >= kh or pw >= kw) and (kh and kw):
            raise ctx.error(f"pad ({ph}, {pw}) must be smaller than the kernel ({kh}, {kw})",
                            hint="Caffe refuses it too; lower pad")


def _check_inner_product(ctx, lp, x) -> None:
    from keras_cct.layers.caffe_layers import caffe_shape
    p = lp.inner_product_param
    if p.HasField("num_output") and p.num_output < 1:
        raise ctx.error("num_output is 0: it must be > 0", hint="fix num_output")
    shape = caffe_shape(x.shape)
    axis = int(p.axis) + (len(shape) if p.axis < 0 else 0)
    if not 0 <= axis < len(shape):
        raise ctx.error(f"axis {p.axis} is out of range for a {len(shape)}-D input",
                        hint="fix inner_product_param.axis")
    k = _numel(shape[axis:])
    n_out = int(p.num_output)
    _param_bytes(ctx, f"the weights (num_output {n_out} x {k} inputs of Caffe shape "
                      f"{tuple(shape[axis:])})", n_out * k + (n_out if p.bias_term else 0))
    _blob_bytes(ctx, f"the output blob (num_output {n_out})", tuple(shape[:axis]) + (n_out,))


def _check_reshape(ctx, lp, x) -> None:
    if not lp.HasField("reshape_param") or not lp.reshape_param.HasField("shape"):
        raise ctx.error("Reshape needs reshape_param { shape { dim: ... } }",
                        hint="give the new shape (0 copies a dimension, -1 infers one)")
    dims = [int(d) for d in lp.reshape_param.shape.dim]
    if any(d < -1 for d in dims):
        raise ctx.error(f"reshape_param.shape has a dimension < -1: {dims}",
                        hint="use 0 (copy), -1 (infer) or a positive size")
    if dims.count(-1) > 1:
        raise ctx.error(f"reshape_param.shape infers more than one dimension (-1): {dims}",
                        hint="use -1 at most once")
    if lp.reshape_param.num_axes < -1:
        raise ctx.error(f"reshape_param.num_axes is {lp.reshape_param.num_axes}: it must "
                        f"be >= -1", hint="fix num_axes")


def check_layer(ctx, lp, xs) -> None:
    """A layer's parameters, and the bytes its weights and output need, before it is built."""
    if not xs:
        return
    try:
        _check_layer(ctx, lp, xs[0])
    except CaffeFormatError:
        raise
    except (ValueError, TypeError, IndexError, ArithmeticError) as exc:
        raise ctx.error(f"cannot check the {lp.type} layer: {exc}") from None


def _check_layer(ctx, lp, x) -> None:
    t = lp.type
    if t in ("Convolution", "Deconvolution"):
        _check_conv(ctx, lp, x, t == "Deconvolution")
    elif t == "Pooling":
        _check_pooling(ctx, lp, x)
    elif t == "InnerProduct":
        _check_inner_product(ctx, lp, x)
    elif t == "Reshape":
        _check_reshape(ctx, lp, x)
    elif t == "LRN" and lp.lrn_param.local_size < 1:
        raise ctx.error("lrn_param.local_size is 0: it must be > 0 (and odd)",
                        hint="fix local_size")
    elif t == "Dropout":
        r = float(lp.dropout_param.dropout_ratio)
        if not 0.0 <= r < 1.0:
            raise ctx.error(f"dropout_ratio is {r}: it must be in [0, 1)",
                            hint="fix dropout_ratio")


# --------------------------------------------------------------------------------------------
# Solvers


def field_lines(text: str) -> Dict[str, List[int]]:
    """Top-level field name -> the 1-based lines it appears on, in a text-format file."""
    from keras_cct.caffe.prototxt import _top_level_blocks
    out: Dict[str, List[int]] = {}
    for name, line in _top_level_blocks(text):
        out.setdefault(name, []).append(line)
    return out


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
# Resuming and snapshots


#: records a resume may replay to put a source exactly where an uninterrupted run would be
EXACT_REPLAY_RECORDS = 200_000


def skip_batches(sources: Sequence, skip: int, log=None) -> Iterator[Dict]:
    """The merged batches of ``sources`` from mini-batch ``skip`` on, without replaying
    ``skip`` batches.

    A source of ``size`` records cut into batches of ``batch_size`` repeats its record order
    every ``size / gcd(size, batch_size)`` batches, so it skips ``skip`` modulo that period:
    when that replay reads at most ``max(size, EXACT_REPLAY_RECORDS)`` records, the next
    batch holds exactly the records of an uninterrupted run. Otherwise it replays
    ``r // batch_size`` batches (less than one epoch), ``r`` being the record an uninterrupted
    run would be at: the next batch starts up to ``batch_size - 1`` records early (logged).
    Random crops, mirrors and shuffles, drawn afresh, match an uninterrupted run only when
    nothing was left out. A source whose size is unknown (HDF5Data) skips at most 10,000
    batches (logged). (Caffe itself restarts its data layers at the first record.)
    """
    its = []
    for s in sources:
        size, bs = getattr(s, "size", None), max(int(getattr(s, "batch_size", 1) or 1), 1)
        if size:
            n = skip % (size // math.gcd(size, bs))
            if n * bs > max(size, EXACT_REPLAY_RECORDS):
                r = (skip * bs) % size
                n = r // bs
                if r % bs and log is not None:
                    log(f"{s.name}: resumed at record {r - r % bs} of {size}, {r % bs} "
                        f"before where the interrupted run was")
        else:
            n = min(skip, 10_000)
            if n < skip and log is not None:
                log(f"{s.name}: the data position on resume is approximate (its size is "
                    f"unknown; {n} of {skip} batches skipped)")
        it = s.batches()
        for _ in range(n):
            next(it)
        its.append(it)

    def merged():
        while True:
            out: Dict = {}
            for it in its:
                out.update(next(it))
            yield out
    return merged()


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
