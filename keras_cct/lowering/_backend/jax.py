"""JAX forms of the per-backend primitives (see :mod:`keras_cct.lowering._backend`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # JAX 0.6 and later
    from jax.experimental.layout import Layout, with_layout_constraint
except ImportError:  # pragma: no cover - older JAX: transposed products stay as they are
    Layout = with_layout_constraint = None

from keras_cct.lowering._backend import common, generic
from keras_cct.lowering._backend.generic import *  # noqa: F401,F403
from keras_cct.lowering.geometry import ConvGeometry

NAME = "jax"
#: XLA's CPU convolution with ``feature_group_count = channels`` (keras Conv2D on JAX) is
#: 6.6-27x slower than the shifted multiply-adds of :func:`depthwise_conv` on MobileNet v1's
#: depthwise layers (forward+backward at batch 16, float32: conv2_1/dw 326 against 49 ms,
#: conv5_6/dw 89 against 4.5; docs/benchmarks/convs.md).
DEPTHWISE = "depthwise"
#: XLA's CPU convolution runs 1x1 layers 1.2-3x slower than the same product as one GEMM (all
#: 15 of ResNet-50's and 9 of MobileNet v1's 1x1 shapes, float32 and bfloat16, where the
#: planner timed both: docs/benchmarks/convs.md), so they are lowered without timing; the small
#: ones under the planner's ``AUTO_MIN_FLOPS`` too, which a step jitted whole runs with no
#: per-op cost (MobileNetV2's, DenseNet121's and EfficientNetB0's at batch 8, 0.2-61 MFLOP,
#: forward+backward on a 2-core Intel Xeon: 1.6-4.6x in bfloat16, 1.6-2.2x in float32).
LOWER_1X1 = True
#: XLA compiles a step's partitions unrolled, and its compile time grows faster than their
#: number: CaffeNet's conv1 by Type 1 at batch 32 (4.4 MB of lowered data per image, so one
#: image per partition), forward+backward in bfloat16, compiled in 11.0 s as 32 partitions,
#: 2.4 s as 8, 1.4 s as 4 and 0.96 s as one, and ran 284, 295, 300 and 300 ms (2-core Intel
#: Xeon). VGG16's 112x112x64 3x3 layer at batch 8 (8 partitions) ran 347 / 331 / 377 ms
#: as 8 / 4 / 1 partitions in bfloat16, 316 / 329 / 365 in float32.
MAX_PARTITIONS = 4
#: Winograd on the whole batch: XLA schedules a jitted step's transforms and GEMMs itself, and
#: in partitions they ran no faster (CaffeNet's conv2-conv5 at batch 64, forward+backward, four
#: partitions of 16 images against the whole batch, in two runs of ``python -m
#: benchmarks.partitions``: 0.94-1.08x; 2-core AMD EPYC, AVX2), while each partition is
#: another copy of the transforms for XLA to compile.
WINOGRAD_PARTITIONS = False
#: Each channel group's Winograd as a convolution of its own: all groups at once, XLA
#: compiled CaffeNet's grouped layers in about half the time (F(2x2) 1.0-1.9 -> 0.5-1.0 s), but
#: the jitted step ran 0.93-1.11x as long in float32 and 1.02-1.05x in bfloat16 (one batched
#: GEMM over the groups instead of one per group; 2-core Intel Xeon, interleaved).
WINOGRAD_GROUPS_AT_ONCE = False
__all__ = generic.__all__


def _host_callback_threads() -> None:
    """Gives XLA's CPU client at least two pool threads (``NPROC``, which XLA reads for the
    size of that pool, when the user has not set it), before the client exists.

    The pool is sized by the CPUs the process may use. With one (a process pinned to a core, a
    one-CPU container), a compiled step whose host callback reads its operands (CCTStrategy's
    OpenCL shards, the OpenCL op) waits for their transfer, which is queued behind the next
    step, which ``model.fit`` has already dispatched and which waits on the pool's only thread
    for this step: ``fit`` hung (seen with the process pinned to one core; 2 threads fixed it).
    Two threads on one core cost nothing measurable: the second only moves buffers. If the
    client already exists, this changes nothing."""
    if "NPROC" in os.environ:
        return
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity masks on this OS)
        cpus = os.cpu_count() or 1
    os.environ["NPROC"] = str(max(2, cpus))


_host_callback_threads()


def persistent_compile_cache() -> Optional[Path]:
    """Turn on JAX's persistent compilation cache (``jax_compilation_cache_dir``) in
    ``<cache_dir>/xla/jax-<jaxlib version>-<cpu>``
    (:func:`~keras_cct.lowering._backend.common.xla_cache_folder`) and return that folder; None
    where it is left off: ``$KERAS_CCT_XLA_CACHE=0``, a folder the user set already
    (``$JAX_COMPILATION_CACHE_DIR`` or ``jax.config``), or one that cannot be made.

    Keras compiles a JAX model's whole training step as one XLA program, in every process;
    with HybridConv2D's Winograd layers it takes longer to compile than with keras Conv2D
    (CaffeNet conv3-conv5 at batch 32 on an Intel Xeon, 2 cores: first step 2.7 s against
    1.9; 0.7 s loaded from the cache in a later process: ``benchmarks.first_step``). JAX keeps
    what took at least ``jax_persistent_cache_min_compile_time_secs`` (1 s unless set) to
    compile, keyed by the program, JAX's version and the compile options, and it applies to
    every compilation of the process once set. This runs when the module is imported, before
    keras_cct compiles anything."""
    if jax.config.jax_compilation_cache_dir:
        return None
    import jaxlib
    path = common.xla_cache_folder(f"jax-{jaxlib.__version__}")
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", str(path))
    return path


persistent_compile_cache()


#: Products of two bfloat16 operands are asked for a float32 result (``preferred_element_type``)
#: and cast back: XLA's CPU backend then hands them to its matrix library (YNNPACK, on the
#: CPU's bfloat16 units), where a bfloat16 result keeps them in XLA's own loops (Intel Xeon
#: with AMX-BF16, 2 cores, 4096x1152 by 1152x256: 257 GFLOP/s as bfloat16, 1,592 with a
#: float32 result; 36 batched 512x256 by 256x256: 107 against 451). The products are as exact
#: as before: a float32 accumulator either way, one rounding to bfloat16 at the end.
_LIBRARY_DTYPES = (jnp.bfloat16,)
_NN = (((1,), (0,)), ((), ()))
_BATCHED_NN = (((2,), (1,)), ((0,), (0,)))


def _to_library(a, b) -> bool:
    return a.dtype in _LIBRARY_DTYPES and b.dtype == a.dtype


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(a.dtype)


def _transposes_materialized() -> bool:
    """Whether :func:`_row_major` can pin a layout here (a JAX with
    ``jax.experimental.layout.with_layout_constraint``, on the CPU: elsewhere the backend's
    GEMM takes transposed operands itself)."""
    return with_layout_constraint is not None and jax.default_backend() == "cpu"


def _row_major(x):
    """``x`` stored row-major, as a copy where XLA would otherwise fold a transpose written in
    front of a product into the product's axes (which then leaves XLA's library)."""
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def _transposed(x):
    return _row_major(jnp.swapaxes(x, -1, -2))


def _library_product(a, b, ta: bool, tb: bool):
    """``op(a) @ op(b)`` over the last two axes (a leading axis batched) as one product XLA's
    library takes: neither operand transposed. XLA takes only that form (a product whose left
    operand is contracted on its first axis, as in every weight gradient, stays in its own
    loops at 61-228 GFLOP/s), so a transposed operand is copied transposed first
    (:func:`_row_major`), or the product is computed transposed, ``(op(b)^T @ op(a)^T)^T``,
    whichever copies fewer elements (weight gradients ``a^T @ b`` of ``(m, k)^T`` by ``(m, n)``
    on the Xeon above, bfloat16, GFLOP/s, as they were -> ``a`` copied -> the product
    transposed: 6272x1152 by 6272x256 157 -> 241 -> **374**, 6272x4608 by 6272x512 228 -> 174
    -> **423**, 1568x4608 by 1568x512 223 -> 341 -> **740**, 25088x576 by 25088x64 61 -> 64 ->
    **171**, 1568x256 by 1568x1024 216 -> **649** -> 136)."""
    dims = _BATCHED_NN if a.ndim == 3 else _NN
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if tb else b.shape[-1]
    direct = (m * k if ta else 0) + (k * n if tb else 0)
    swapped = (0 if tb else k * n) + (0 if ta else m * k) + m * n
    if direct <= swapped:
        return _dot(_transposed(a) if ta else a, _transposed(b) if tb else b, dims)
    left, right = (b if tb else _transposed(b)), (a if ta else _transposed(a))
    product = lax.dot_general(left, right, dims, preferred_element_type=jnp.float32)
    return jnp.swapaxes(_row_major(product).astype(a.dtype), -1, -2)


def matmul(a, b):
    """``a @ b`` for 2-D operands, in their own dtype (bfloat16 through XLA's library GEMM)."""
    if _to_library(a, b):
        return _dot(a, b, _NN)
    return generic.matmul(a, b)


def matmul_tn(a, b):
    """``a.T @ b`` for 2-D ``a`` (k, m) and ``b`` (k, n) (bfloat16 through XLA's library GEMM,
    :func:`_library_product`)."""
    if _to_library(a, b) and _transposes_materialized():
        return _library_product(a, b, True, False)
    return generic.matmul_tn(a, b)


def matmul_nt(a, b):
    """``a @ b.T`` for 2-D ``a`` (m, k) and ``b`` (n, k) (bfloat16 through XLA's library
    GEMM, which takes this form as it is)."""
    if _to_library(a, b):
        return _dot(a, b, (((1,), (1,)), ((), ())))
    return generic.matmul_nt(a, b)


def bmm(a, b, ta: bool = False, tb: bool = False):
    """Batched ``op(a) @ op(b)`` of 3-D tensors (bfloat16 through XLA's library GEMM,
    :func:`_library_product`, which copies a transposed operand where XLA allows it)."""
    if _to_library(a, b) and (not (ta or tb) or _transposes_materialized()):
        return _library_product(a, b, ta, tb)
    return generic.bmm(a, b, ta, tb)


def fused(fn: Callable, batch_axes: Optional[Dict[int, int]] = None,
          key: Optional[str] = None) -> Callable:
    """``fn`` with 16-bit float inputs computed in float32 and the results cast back
    (:func:`~keras_cct.lowering._backend.common.in_float32`; XLA already fuses the step it is
    part of; ``batch_axes`` is not needed: the step is traced per shape anyway)."""
    return common.in_float32(fn)


def native_conv(x, kernel, geo: ConvGeometry, bias=None):
    """``lax.conv_general_dilated`` with NHWC/HWIO dimension numbers; grouped convolutions in
    the split form (XLA's CPU grouped convolution measured 5x slower on CaffeNet's grouped
    layers); ``bias`` added after (XLA fuses the addition).

    Padding that Keras' ``"same"`` does not compute (Caffe's symmetric padding at a stride, as
    ResNet-50's and MobileNet's first layers have) is a ``jnp.pad`` and a ``VALID``
    convolution, what a Keras user writes (``ZeroPadding2D`` + ``Conv2D``); XLA then computes
    the kernel gradient on the padded input, not as a convolution padded on the unpadded one.
    Forward+backward with the bias, jax 0.10 on an Intel Xeon (AMX), 2 threads, interleaved,
    best of 10 (ms, padding in the convolution -> pad first): ResNet-50's conv1
    (4x224x224x3->64, 7x7 s2 p3) 47.3 -> 38.6 in float32, 52.8 -> 50.8 in bfloat16; MobileNet's
    conv1 (16x224x224x3->32, 3x3 s2 p1) 51.1 -> 40.4 and 70.2 -> 74.1; 3x3 s2 with 64 channels
    27.1 -> 28.3 and 28.4 -> 25.6. Padding "same" computes stays in the convolution, as in
    Keras' ``Conv2D(padding="same")``, also where it is uneven (a stride on an even size: one
    more row and column at the bottom and right). Padding first there made
    ``HybridConv2D(64, 7, strides=2, padding="same")`` on 4x224x224x3 0.80x keras Conv2D
    (56.2 against 45.2 ms, float32); in the convolution against first, ms: 46.2 / 56.7 there,
    3x3 s2 on 16x224x224x3 66.5 / 76.5 float32 and 92.6 / 83.2 bfloat16, 3x3 s2 on
    16x56x56x64 46.4 / 56.3 and 47.2 / 55.5.
    """
    y = _native_conv(x, kernel, geo)
    return y if bias is None else y + bias


def _native_conv(x, kernel, geo: ConvGeometry):
    padding = [tuple(geo.pad[0]), tuple(geo.pad[1])]
    if geo.pad != ((0, 0), (0, 0)) and not geo.pads_are_same:  # ZeroPadding2D + Conv2D
        x = jnp.pad(x, [(0, 0)] + padding + [(0, 0)])
        padding = [(0, 0), (0, 0)]
    form = one_dimensional(geo.kh, geo.kw, geo.sh, geo.sw, padding)

    def conv(inp, k, groups=1):
        if form is not None:
            return _conv_1d(inp, k, geo, padding, groups, form)
        return lax.conv_general_dilated(
            inp, k, (geo.sh, geo.sw), padding, rhs_dilation=(geo.dh, geo.dw),
            dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups)

    if common.split_groups(geo):
        xs = jnp.split(x, geo.groups, axis=-1)
        ks = jnp.split(kernel, geo.groups, axis=-1)
        return jnp.concatenate([conv(a, b) for a, b in zip(xs, ks)], axis=-1)
    return conv(x, kernel, geo.groups)


def one_dimensional(kh: int, kw: int, sh: int, sw: int, padding) -> Optional[str]:
    """The one-dimensional convolution :func:`native_conv` runs a kernel of one row or one
    column as, or None (a kernel of several rows and columns).

    XLA's CPU convolution over two spatial axes is 1.2-4.2x slower than over one, for the same
    work (forward+backward, jax 0.10, 2-core Intel Xeon with AMX, float32, ms, two-dimensional /
    one-dimensional: InceptionV3's 1x7 at 32x17x17x192 155.6 / 64.9 and its 7x1 283.4 / 67.8,
    1x3 at 32x8x8x384 34.4 / 27.9, 1x1 at 16x56x56x64 -> 256 264.9 / 102.9; bfloat16 alike):

    * ``"rows"``: a one-row kernel (``kh == 1``, no padding of the rows) is a convolution along
      the width of ``batch * height`` rows (a reshape; at a vertical stride, every ``sh``-th
      row first);
    * ``"columns"``: a one-column kernel at stride 1 (no padding of the columns) is a
      convolution along the flattened ``height * width`` axis with its taps ``width`` apart
      (``rhs_dilation``); the rows' padding becomes ``width`` times as many zeros there.
    """
    (pt, pb), (pl, pr) = padding
    if kh == 1 and pt == pb == 0:
        return "rows"
    if kw == 1 and sh == sw == 1 and pl == pr == 0:
        return "columns"
    return None


def _conv_1d(x, k, geo: ConvGeometry, padding, groups: int, form: str):
    """``x`` (NHWC) by the one-row or one-column kernel ``k`` (HWIO) as one convolution over
    one spatial axis (:func:`one_dimensional`)."""
    b, h, w, c = x.shape
    dims = ("NWC", "WIO", "NWC")
    if form == "rows":
        rows = x[:, ::geo.sh]
        y = lax.conv_general_dilated(
            rows.reshape(-1, w, c), k[0], (geo.sw,), [tuple(padding[1])],
            rhs_dilation=(geo.dw,), dimension_numbers=dims, feature_group_count=groups)
        return y.reshape(b, rows.shape[1], y.shape[1], y.shape[2])
    (pt, pb), _ = padding
    y = lax.conv_general_dilated(
        x.reshape(b, h * w, c), k[:, 0], (1,), [(pt * w, pb * w)],
        rhs_dilation=(geo.dh * w,), dimension_numbers=dims, feature_group_count=groups)
    return y.reshape(b, -1, w, y.shape[2])


def conv_step(conv: Callable, args: List[np.ndarray], r: np.ndarray, *, training: bool,
              jit_compile: bool, dtype: Optional[str]) -> Callable[[], None]:
    """One ``jax.jit`` of ``value_and_grad`` (or of the forward), waited for. ``r`` is an
    argument, not a constant of the step: XLA would constant-fold the backward's first steps
    (a Winograd lowering's output adjoint: over a second of compiling, and timings that are
    not a real backward's).

    With ``dtype``, the input is given in it and the weights (the kernel, the bias) in float32,
    cast in the step, as a Keras layer under a mixed-precision policy runs (its variables are
    float32, its input already the previous layer's compute dtype), and the loss is summed in
    float32, as a model's is. Weights given in bfloat16 made XLA's convolution step a different
    program: ResNet-50's conv1 (4x224x224x3, 7x7 stride 2, bias) timed 49.2 ms as ``"native"``
    against 43.2 for the same layer in a Keras model, behind Type 1 (46.7 in both), so the
    planner picked Type 1 where the model ran ``"native"`` faster (as now: 36.4 against
    36.8)."""
    jx = jnp.asarray(args[0], dtype=dtype or args[0].dtype)
    jws = [jnp.asarray(a) for a in args[1:]]
    jr = jnp.asarray(r)

    def run(x, ws):
        return conv(x, *(w.astype(dtype) if dtype else w for w in ws))

    def loss(ps, rr):
        return jnp.sum(run(*ps).astype(jnp.float32) * rr.astype(jnp.float32))

    if not training:
        fn = jax.jit(run)
        return lambda: jax.block_until_ready(fn(jx, jws))
    fn = jax.jit(jax.value_and_grad(loss))
    return lambda: jax.block_until_ready(fn((jx, jws), jr))


def device_name() -> Optional[str]:
    dev = jax.devices()[0]
    return None if dev.platform == "cpu" else f"{dev.platform}:{dev.device_kind}"


def wait(tensors: list) -> None:
    """JAX dispatches asynchronously: block until the arrays are ready."""
    jax.block_until_ready(tensors)


def layer_steps(layer, args: list, dys: list):
    """Two ``jax.jit`` calls of the layer's ``stateless_call``; the forward+backward one returns
    the output with the input and weight gradients (``jax.vjp``)."""
    single = len(args) == 1
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def apply(tv_, *a):
        y, _ = layer.stateless_call(tv_, ntv, a[0] if single else list(a))
        return y

    def forward_backward(ct, *a):  # the cotangents are arguments: no constant folding
        y, vjp = jax.vjp(apply, tv, *a)
        ct = [c.astype(o.dtype) for c, o in zip(ct, y if isinstance(y, (list, tuple)) else [y])]
        return y, vjp(type(y)(ct) if isinstance(y, (list, tuple)) else ct[0])

    cts = [jnp.asarray(d) for d in dys]
    fb = jax.jit(forward_backward)
    return jax.jit(lambda *a: apply(tv, *a)), lambda *a: fb(cts, *a)


#: :func:`depthwise_conv` works through the batch this many bytes of input at a time (whole
#: images; one ``lax.scan`` step each), so that a chunk's ``kh * kw`` slices are read from
#: cache, and so that XLA cannot fuse the taps into the reduction of a consumer (a loss, a
#: batch norm's statistics). Fused with the whole batch, XLA's CPU reduction fusion copied every
#: slice and every broadcast kernel tap to memory first: MobileNet conv2_1/dw at batch 16 took
#: 150 ms forward+backward under a sum, against 8 ms for the forward alone; its kernel
#: gradient summed over the whole batch at once took 76 ms, in chunks 31.
DEPTHWISE_CHUNK_BYTES = 4 << 20


def _depthwise_chunk(b: int, per_image: int) -> int:
    """The largest divisor of the batch ``b`` whose images fit :data:`DEPTHWISE_CHUNK_BYTES`."""
    chunk = max(1, min(b, DEPTHWISE_CHUNK_BYTES // max(per_image, 1)))
    while b % chunk:
        chunk -= 1
    return chunk


def _depthwise_forward(x, kernel, geo: ConvGeometry):
    """Sum of the taps of one chunk of images (padded and repeated here; XLA fuses the taps
    into one pass)."""
    y = None
    for i, j, t in generic.depthwise_taps(generic.depthwise_input(x, geo), geo):
        y = t * kernel[i, j, 0] if y is None else y + t * kernel[i, j, 0]
    return y


def _depthwise_backward(x, kernel, dy, geo: ConvGeometry):
    """One chunk's input gradient (autodiff's: the slices' transposes, fused) and its part of
    the kernel gradient (``kh * kw`` sums over the chunk of a tap's slice times ``dy``)."""
    _, pull = jax.vjp(lambda a: _depthwise_forward(a, kernel, geo), x)
    xp = generic.depthwise_input(x, geo)
    dk = jnp.stack([jnp.sum(t * dy, axis=(0, 1, 2))
                    for _, _, t in generic.depthwise_taps(xp, geo)])
    return pull(dy)[0], dk


def _chunked(x, chunk: int):
    return x.reshape((x.shape[0] // chunk, chunk) + x.shape[1:])


def _unchunked(x):
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def depthwise_conv(x, kernel, geo: ConvGeometry):
    """A depthwise convolution (:mod:`keras_cct.lowering.depthwise`): forward and backward
    each one ``lax.scan`` over cache-sized chunks of images (:data:`DEPTHWISE_CHUNK_BYTES`), in
    float32 or float64 (16-bit inputs are converted once, and the result back)."""
    if x.dtype.itemsize < 4:  # XLA's CPU loops convert 16-bit floats element by element for
        # every tap: one conversion each way is cheaper (MobileNet conv2_1/dw in bfloat16,
        # forward+backward at batch 16: 206 ms converting per tap, 59 ms converting once)
        return depthwise_conv(x.astype(jnp.float32), kernel.astype(jnp.float32),
                              geo).astype(x.dtype)
    b = x.shape[0]
    chunk = _depthwise_chunk(b, int(np.prod(x.shape[1:])) * x.dtype.itemsize)

    @jax.custom_vjp
    def conv(xx, kk):
        ys = lax.scan(lambda _, a: (None, _depthwise_forward(a, kk, geo)), None,
                      _chunked(xx, chunk))[1]
        return _unchunked(ys)

    def fwd(xx, kk):
        return conv(xx, kk), (xx, kk)

    def bwd(saved, dy):
        xx, kk = saved

        def step(total, a):
            dx, dk = _depthwise_backward(a[0], kk, a[1], geo)
            return total + dk, dx

        dk, dxs = lax.scan(step, jnp.zeros((geo.kh * geo.kw, kk.shape[-1]), kk.dtype),
                           (_chunked(xx, chunk), _chunked(dy, chunk)))
        return _unchunked(dxs), dk.reshape(kk.shape)

    conv.defvjp(fwd, bwd)
    return conv(x, kernel)
