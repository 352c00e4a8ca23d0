"""TensorFlow forms of the per-backend primitives (see :mod:`keras_cct.lowering._backend`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_cct.errors import XlaCacheLogWarning
from keras_cct.lowering._backend import common, generic
from keras_cct.lowering._backend.generic import *  # noqa: F401,F403
from keras_cct.lowering.geometry import ConvGeometry

NAME = "tensorflow"
__all__ = generic.__all__
#: Winograd's transforms are XLA clusters (:func:`fused`), compiled per input shape.
COMPILED = ("winograd", "winograd4")


def _onednn_ops() -> bool:
    """Whether TensorFlow runs its oneDNN operations (on by default only on some x86 CPUs:
    those with AVX512-VNNI, AVX512-BF16 or AMX; ``TF_ENABLE_ONEDNN_OPTS`` decides otherwise).
    Where the check is missing from this TensorFlow, assume they are on."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return True


#: Max pooling by its window's slices, two XLA clusters (:mod:`keras_cct.lowering.pooling`),
#: where TensorFlow's oneDNN operations are off: its own ``MaxPoolGrad`` then recomputes each
#: window's maximum from the input (CaffeNet's pool1, pool2 and pool5 at batch 32,
#: forward+backward, 2-core AMD EPYC with AVX2, probes of one session: 56-70, 31-44 and
#: 7-13 ms as TensorFlow's ops, 24-39, 15-21 and 5-8 as clusters). oneDNN's pooling keeps its
#: indices.
WINDOWED_MAX_POOL = not _onednn_ops()

#: The folder keras_cct put in ``TF_XLA_FLAGS``, beside it in the environment: a child process
#: inherits both, and decides again from its own ``$KERAS_CCT_CACHE_DIR`` (a benchmark's
#: process with an empty cache must not load its parent's executables).
_XLA_CACHE_SET = "KERAS_CCT_XLA_CACHE_SET"
_XLA_CACHE_FLAG = "--tf_xla_persistent_cache_directory="


def persistent_xla_cache() -> Optional[Path]:
    """Turn on TensorFlow's on-disk cache of XLA executables (``TF_XLA_FLAGS``'
    ``--tf_xla_persistent_cache_directory``), in ``<cache_dir>/xla/tf-<version>-<cpu>``
    (:func:`~keras_cct.lowering._backend.common.xla_cache_folder`), and return that folder;
    None where it is left off: ``$KERAS_CCT_XLA_CACHE=0``, a cache folder the user set
    already, or one that cannot be made.

    Winograd's transforms run as XLA clusters (:func:`fused`), which TensorFlow compiles per
    shape in every process: CaffeNet conv4 at batch 32 (Intel Xeon, 2 cores) 0.3-0.5 s for
    each of its four, 0.05-0.1 s each loaded from the cache in a later process. TensorFlow
    reads the flag at its first XLA compilation, so this runs when the module is imported, and
    it applies to every XLA compilation of the process (a model's ``jit_compile`` too)."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    inherited = os.environ.pop(_XLA_CACHE_SET, None)
    if inherited:  # a parent's keras_cct set it: this process chooses its own
        flags = " ".join(f for f in flags.split() if f != _XLA_CACHE_FLAG + inherited)
        _set_env("TF_XLA_FLAGS", flags)
    if _XLA_CACHE_FLAG[2:] in flags:
        return None
    path = common.xla_cache_folder(f"tf-{tf.__version__}")
    if path is None or any(ch.isspace() for ch in str(path)):  # TF_XLA_FLAGS splits at spaces
        return None
    _set_env("TF_XLA_FLAGS", f"{flags} {_XLA_CACHE_FLAG}{path}".strip())
    os.environ[_XLA_CACHE_SET] = str(path)
    return path


#: TensorFlow versions whose XLA logs an error for every executable loaded from the persistent
#: cache on an AVX-512 CPU ("+prefer-no-scatter" / "+prefer-no-gather", tuning hints XLA adds
#: for AVX-512, compared with the host's CPU features in ``xla/service/cpu/cpu_aot_loader.cc``;
#: later XLA skips ``prefer-`` and ``fast-`` features). Seen with 2.21.0.
_FALSE_SIGILL_VERSIONS = ("2.21.",)


def logs_false_sigill() -> bool:
    """Whether this TensorFlow logs that false alarm on this CPU (:data:`_FALSE_SIGILL_VERSIONS`
    and AVX-512)."""
    from keras_cct._system import cpu_flags
    return tf.__version__.startswith(_FALSE_SIGILL_VERSIONS) and "avx512f" in cpu_flags()


@functools.lru_cache(maxsize=None)  # once per process
def notice_false_alarm() -> None:
    """Once per process, before keras_cct's first XLA cluster is traced: where TensorFlow will
    log its false SIGILL alarm for executables loaded from keras_cct's cache
    (:func:`logs_false_sigill`, and the folder holds some), say what it is, as an
    :class:`~keras_cct.errors.XlaCacheLogWarning` (a command that compiles nothing says
    nothing)."""
    folder = XLA_CACHE_FOLDER
    if folder is not None and logs_false_sigill() and folder.is_dir() and \
            any(folder.iterdir()):
        warnings.warn(
            f"TensorFlow {tf.__version__} logs 'Target machine feature +prefer-no-scatter is "
            "not supported on the host machine ... could lead to execution errors such as "
            "SIGILL' for each XLA executable it loads from keras_cct's cache on a CPU with "
            "AVX-512: a false alarm (its XLA compares LLVM's tuning hints, which XLA adds on "
            "AVX-512 CPUs, with the CPU's features; later XLA skips them). The executables in "
            f"{folder} were compiled on this CPU model. KERAS_CCT_XLA_CACHE=0 turns the cache "
            "off (and Winograd's transforms are compiled again in every process).",
            XlaCacheLogWarning, stacklevel=3)


def _set_env(name: str, value: str) -> None:
    if value:
        os.environ[name] = value
    else:
        os.environ.pop(name, None)


#: The folder :func:`persistent_xla_cache` turned on when this module was imported (None: off).
XLA_CACHE_FOLDER = persistent_xla_cache()


def as_tensor(x):
    """A plain tensor holding ``x``'s value (a variable is read, not passed as a variable).
    A Keras variable is read once: asking it for ``.value`` (as ``hasattr`` does) reads and,
    under a mixed-precision policy, casts it a second time in the traced step."""
    return tf.identity(x) if isinstance(x, (tf.Variable, keras.Variable)) else \
        tf.convert_to_tensor(x)


def custom_conv(forward, backward, x, kernel):
    """:func:`~keras_cct.lowering._backend.common.custom_conv` with variables read first."""
    return common.custom_conv(forward, backward, x, kernel, as_tensor)


def fused(fn: Callable, batch_axes: Optional[Dict[int, int]] = None,
          key: Optional[str] = None) -> Callable:
    """``fn`` as one XLA cluster (``tf.function(jit_compile=True)``), in graphs and eagerly,
    compiled once per input shape. TensorFlow would run each of its slices and additions as a
    separate op writing a full tensor (Winograd's transforms, CaffeNet conv3 forward+backward at
    batch 32 in float32: 52 ms as ops, 36-40 as clusters). 16-bit float inputs are computed in
    float32 inside and the results cast back: XLA's CPU loops convert every element for every
    operation otherwise (that layer in bfloat16: 43-51 ms computed in bfloat16, 22-27 in
    float32).

    With ``batch_axes`` (rank -> the axis of an argument of that rank whose size follows the
    batch), ``fn`` is traced once with those axes unknown and XLA compiles that one trace per
    real shape: the planner's race and the layer's own call (a model traced with an unknown
    batch, as ``fit`` does, or with a known one) then run the same clusters, and a shape the
    race compiled is not compiled again (CaffeNet conv3 under ``fit``, 70 images at batch 32: 7
    compilations, the race's 4 and the last batch's, where the model's own trace made 10).

    With ``key`` too (a string naming ``fn`` the same in every process), each trace is named
    from ``key`` and its argument types (:func:`_stable_name`) instead of TensorFlow's
    process-wide counter: the name is part of the key TensorFlow's persistent XLA cache stores
    an executable under, so a later process loads what an earlier one compiled although it
    traced other functions first (the planner's race, in the first process only)."""
    run = common.in_float32(fn)

    def kcct_fused(*args):
        notice_false_alarm()
        return run(*args)

    compiled = tf.function(kcct_fused, jit_compile=True, autograph=False)
    if not batch_axes:
        return compiled
    traced = set()

    def call(*args):
        specs = tf.nest.map_structure(lambda t: _batchless(t, batch_axes), args)
        flat = tuple((tuple(sp.shape.as_list()), sp.dtype.name)
                     for sp in tf.nest.flatten(specs))
        if flat not in traced:
            with _stable_name(key, flat):
                compiled.get_concrete_function(*specs)
            traced.add(flat)
        # never differentiated through (the callers write the adjoints out): a tape that saw
        # the call would run TensorFlow's forward variant of the cluster, which XLA computed
        # wrongly from the shape-relaxed trace (F(4x4)'s lifting under a GradientTape)
        return compiled(*tf.nest.map_structure(tf.stop_gradient, args))

    call.compiled = compiled
    return call


#: The name :func:`_stable_name` hands to the next trace on this thread, and the names given
#: in this process (a second function of the same key and types gets a suffix: TensorFlow
#: refuses two different functions of one name).
_NEXT_NAME = threading.local()
_NAMES_GIVEN: Dict[str, int] = {}


@contextlib.contextmanager
def _stable_name(key: Optional[str], flat_specs: tuple):
    """While tracing ``key``'s function for ``flat_specs``: name it
    ``__inference_kcct_<hash of both>`` where TensorFlow would add its process-wide counter
    (its private ``concrete_function._inference_name``; where that is missing, as it may be in
    another TensorFlow version, the function keeps TensorFlow's name)."""
    if key is None or not _install_stable_names():
        yield
        return
    digest = hashlib.sha256(repr((key, flat_specs)).encode()).hexdigest()[:20]
    name = f"__inference_kcct_{digest}"
    count = _NAMES_GIVEN.get(name, 0)
    _NAMES_GIVEN[name] = count + 1
    _NEXT_NAME.value = f"{name}_{count}" if count else name
    try:
        yield
    finally:
        _NEXT_NAME.value = None


@functools.lru_cache(maxsize=None)
def _install_stable_names() -> bool:
    """Wrap TensorFlow's ``_inference_name`` once so that a trace :func:`_stable_name` names
    (the function ``kcct_fused``) takes that name; every other trace is named as before."""
    try:
        from tensorflow.python.eager.polymorphic_function import concrete_function as cf
    except ImportError:
        return False
    original = getattr(cf, "_inference_name", None)
    if not callable(original):
        return False

    def inference_name(graph_name):
        name = getattr(_NEXT_NAME, "value", None)
        if name is not None and graph_name == "kcct_fused":
            _NEXT_NAME.value = None
            return name
        return original(graph_name)

    cf._inference_name = inference_name
    return True


def _batchless(t, batch_axes: Dict[int, int]) -> tf.TensorSpec:
    """``t``'s spec with the axis ``batch_axes`` names for its rank unknown."""
    shape = list(t.shape)
    if len(shape) in batch_axes:
        shape[batch_axes[len(shape)]] = None
    return tf.TensorSpec(shape, t.dtype)


def index_tensor(indices, like):
    return tf.constant(indices)


def matmul_tn(a, b):
    return tf.linalg.matmul(a, b, transpose_a=True)


def matmul_nt(a, b):
    """``a @ b.T``; for a short float32 ``a`` against a tall ``b`` (an InnerProduct's batch
    against its ``(O, K)`` weight) as ``(b @ a.T).T``, which oneDNN runs faster there: measured
    on an Intel Xeon (AMX) and 2 threads, forward (forward+backward) in ms, ``a @ b.T`` ->
    ``(b @ a.T).T``: 32x9216 by 4096x9216 22.6 (69.9) -> 14.0 (59.6), 32x4096 by 1000x4096
    3.0 (5.8) -> 1.6 (4.8), 128x9216 by 4096x9216 42.1 (132) -> 35.8 (125); a tie or a few
    percent slower from 512 rows of ``a`` on, or when ``b`` is short too (10 rows), and a tie
    in bfloat16, which keep the plain form."""
    rows_a, rows_b = a.shape[0], b.shape[0]
    if (a.dtype == tf.float32 and rows_a is not None and rows_b is not None
            and 16 * rows_a <= rows_b):
        return tf.transpose(tf.linalg.matmul(b, a, transpose_b=True))
    return tf.linalg.matmul(a, b, transpose_b=True)


def bmm(a, b, ta: bool = False, tb: bool = False):
    return tf.linalg.matmul(a, b, transpose_a=ta, transpose_b=tb)


def add_n(tensors: List):
    """Sum of same-shape tensors (one kernel)."""
    return tensors[0] if len(tensors) == 1 else tf.math.add_n(tensors)


def take_rows(x, indices):
    return tf.gather(x, indices, axis=1)


def split_batch(x, parts: int, unit: int = 1) -> List:
    """``x`` cut along axis 0 into ``parts`` contiguous partitions (one ``tf.split`` where the
    batch is not static)."""
    if parts == 1:
        return [x]
    bounds = common.batch_bounds(x, parts, unit)
    if not isinstance(bounds[1], int):
        sizes = tf.stack([bounds[i + 1] - bounds[i] for i in range(parts)])
        return tf.split(x, sizes, num=parts, axis=0)
    return [x[bounds[i]:bounds[i + 1]] for i in range(parts)]


#: Iterations of :func:`map_batch`'s loop TensorFlow may run at once: two let one partition's
#: XLA transforms overlap the next one's on a second core (CaffeNet conv3-conv5 at batch 128 in
#: float32, on a 2-core AMD EPYC, two runs each with near-equal padded partitions: 0.98-1.10x a
#: static batch's time, where one at a time ran 1.01-1.22x).
LOOP_PARALLEL = 2


def _partition_size(n, images: int):
    """:func:`~keras_cct.lowering._backend.common.partition_size` for a batch of ``n`` (a
    scalar tensor), in the graph: the same integers, so a loop's partitions have the size the
    planner's race compiled."""
    lo, hi = common.partition_bounds(images)
    images = max(1, int(images))
    scale = common.PARTITION_KEY_SCALE
    sizes = tf.range(lo, hi + 1, dtype=tf.int64)
    n64 = tf.cast(n, tf.int64)
    key = tf.maximum(images * scale // sizes, sizes * scale // images)
    fits = tf.logical_and(tf.equal(n64 % sizes, 0), sizes <= n64)
    best = tf.gather(sizes, tf.argmin(tf.where(fits, key, tf.int64.max)))
    near = tf.maximum((n64 + images - 1) // images, 1)
    size = tf.where(tf.reduce_any(fits), best, tf.maximum((n64 + near - 1) // near, 1))
    return tf.cast(size, n.dtype)


def map_batch(fn: Callable, tensors: List, images: int):
    """:func:`~keras_cct.lowering._backend.generic.map_batch`; where the batch size is not static
    (Keras' ``fit`` traces its step so), one ``tf.while_loop`` over partitions of one size
    (:func:`_partition_size`; one shape for every partition, which XLA's loops need), the
    tensors zero-padded to a whole number of them where that size does not divide the batch
    (``fn``'s ``summed`` outputs must not change with images of zeros). Padding copies both
    the inputs and the results (CaffeNet conv4 at batch 128, forward+backward: 588 ms in
    partitions of 13 with two images of zeros, 549 in the static batch's 13s)."""
    if tensors[0].shape[0] is not None:
        return generic.map_batch(fn, tensors, images)
    n = tf.shape(tensors[0])[0]
    size = _partition_size(n, images)
    parts = tf.maximum((n + size - 1) // size, 1)
    tensors = [tf.reshape(tf.pad(t, tf.concat([[[0, parts * size - n]],
                                               tf.zeros((len(t.shape) - 1, 2), tf.int32)], 0)),
                          [parts, size] + list(t.shape[1:])) for t in tensors]

    def run(i):  # an index, not a slice: XLA then knows every piece's size
        return fn(*(t[i] for t in tensors))

    batched, summed = run(0)  # the first partition outside the loop: the outputs' types
    arrays = [tf.TensorArray(b.dtype, size=parts, element_shape=b.shape).write(0, b)
              for b in batched]

    def body(i, arrays, summed):
        b, s = run(i)
        return (i + 1, [a.write(i, t) for a, t in zip(arrays, b)],
                [x + d for x, d in zip(summed, s)])

    _, arrays, summed = tf.while_loop(lambda i, *_: i < parts, body, (1, arrays, list(summed)),
                                      parallel_iterations=LOOP_PARALLEL)
    out = []
    for a, b in zip(arrays, batched):
        stacked = a.stack()
        flat = tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], 0))[:n]
        flat.set_shape(b.shape)
        out.append(flat)
    return out, list(summed)


def segment_sum(data, segment_ids, num_segments: int):
    return tf.math.unsorted_segment_sum(data, segment_ids, num_segments)


def native_conv(x, kernel, geo: ConvGeometry, bias=None):
    """``tf.nn.conv2d`` (oneDNN on x86 CPUs) with Caffe's explicit padding passed to the op (no
    padded copy). Grouped convolutions are TensorFlow's own grouped ``Conv2D`` (one oneDNN
    convolution) where it computes its gradients (:func:`grouped_conv2d_works`: float32 and
    bfloat16 with oneDNN), with explicit padding as a ``tf.pad`` first (TensorFlow's grouped
    kernel gradient fails on explicit padding); ``HybridConv2D(lowering="native")``
    forward+backward with the bias, TF 2.21 on an Intel Xeon (AMX), 2 threads, interleaved, best
    of 4 rounds (ms, split form -> grouped, float32 / bfloat16): CaffeNet conv2 at batch 32
    125.4 -> 122.9 / 28.9 -> 28.0, conv4 68.7 -> 67.6 / 18.4 -> 17.7, conv5 47.7 -> 46.0 / 13.4
    -> 12.9; 8x56x56x128 3x3 at 4 groups 26.1 -> 22.6 / 11.2 -> 8.1 and at 16 groups 24.2 ->
    13.8 / 19.0 -> 10.9; 8x28x28x256 at 8 groups, stride 2, padding 1 7.6 -> 6.1 / 7.0 -> 5.0.
    (keras Conv2D's grouped layers on TensorFlow's CPUs are an XLA cluster instead: 398 ms for
    conv5.) Elsewhere (oneDNN off, ``TF_ENABLE_ONEDNN_OPTS=0``, or float64: "Gradients for
    grouped convolutions are not supported on CPU"; dilated layers) the *split form*: one
    ``tf.split`` of the input and of the kernel, one convolution per group, one ``concat``
    (``tf.split`` is one op whose gradient is one ``concat``, where per-group slices cost a
    zero-filled scatter each in the backward). Depthwise convolutions (one input channel per
    group) use ``tf.nn.depthwise_conv2d``. ``bias`` is added by ``tf.nn.bias_add`` right after
    each convolution (in the split form each group's own slice), the pattern TensorFlow's oneDNN
    rewrite fuses into the convolution (``ONEDNN_VERBOSE`` shows the bias in the forward and
    backward-weights primitives); added after the ``concat`` it could not be fused (CaffeNet
    conv2, bfloat16, batch 32, against the Keras split whose Conv2D layers each add their bias:
    55.3 / 54.9 ms against 53.9 / 53.1 before, 55.3 / 55.0 / 55.3 against 54.0 / 55.6 / 54.8
    after). Strides with dilation (Caffe allows them, TensorFlow does not): stride 1, every s-th
    output kept. In bfloat16, explicit padding is a ``tf.pad`` before a ``VALID`` convolution:
    TF's bfloat16 Conv2D with explicit padding is not oneDNN's and trained 13-46x slower
    (forward+backward with the loss fetched, on a busy machine: MobileNet conv1 204 ms against
    15; CaffeNet conv1's shape given explicit zero padding 2,705 against 129), where in float32
    the explicit form was the faster one (that conv1 shape: 151 against 226 ms) except for 3x3
    kernels at stride 2 (:func:`_pad_first`). Pads that ``"SAME"`` computes, uneven ones too (a
    stride on an even size: the extra row and column at the bottom and right), are ``"SAME"``,
    as keras ``Conv2D(padding="same")`` passes them: explicit or padded first, those layers
    trained 0.76-0.86x as fast as keras Conv2D (forward+backward, float32, 3x3 stride 2 on
    16x224x224x3 -> 32, 16x56x56x64 -> 64 and -> 128)."""
    strides, dilation = (geo.sh, geo.sw), (geo.dh, geo.dw)
    subsample = max(strides) > 1 and max(dilation) > 1
    if subsample:
        strides = (1, 1)
    if geo.pad == ((0, 0), (0, 0)):
        padding = "VALID"
    elif geo.pads_are_same and not subsample:  # at stride 1, "SAME" would pad differently
        padding = "SAME"  # keras Conv2D(padding="same")'s op, uneven pads too
    else:
        padding = [[0, 0], list(geo.pad[0]), list(geo.pad[1]), [0, 0]]
    if not isinstance(padding, str) and (x.dtype != tf.float32 or _pad_first(geo)):
        x, padding = tf.pad(x, padding), "VALID"
    if geo.cg == 1 and geo.groups > 1:
        if not isinstance(padding, str):  # depthwise_conv2d has no explicit padding
            x, padding = tf.pad(x, padding), "VALID"
        k = tf.reshape(kernel, (geo.kh, geo.kw, geo.channels, geo.og))
        y = _plus(tf.nn.depthwise_conv2d(x, k, (1,) + strides + (1,), padding,
                                         dilations=dilation), bias)
    else:
        if max(dilation) > 1:
            # TF's CPU Conv2D has no dilated gradient; tf.nn.convolution dilates by
            # space_to_batch, and takes no explicit padding.
            if not isinstance(padding, str):
                x, padding = tf.pad(x, padding), "VALID"

            def conv(inp, k):
                return tf.nn.convolution(inp, k, strides, padding, dilations=dilation)
        else:
            def conv(inp, k):
                return tf.nn.conv2d(inp, k, strides, padding)

        if geo.groups > 1 and (max(dilation) > 1 or not grouped_conv2d_works(x.dtype.name)):
            xs = tf.split(x, geo.groups, axis=-1)
            ks = tf.split(kernel, geo.groups, axis=-1)
            bs = [None] * geo.groups if bias is None else tf.split(bias, geo.groups)
            y = tf.concat([_plus(conv(a, k), b) for a, k, b in zip(xs, ks, bs)], axis=-1)
        else:
            if geo.groups > 1 and not isinstance(padding, str):
                x, padding = tf.pad(x, padding), "VALID"
            y = _plus(conv(x, kernel), bias)
    if subsample:
        y = y[:, ::geo.sh, ::geo.sw, :]
    return y


@functools.lru_cache(maxsize=None)
def grouped_conv2d_works(dtype: str) -> bool:
    """Whether TensorFlow's ``Conv2D`` computes a grouped convolution's gradients here in
    ``dtype`` (once per process and dtype, on a tiny one): oneDNN's kernels (on by default on
    x86 CPUs; float32 and bfloat16) do; TensorFlow's others (``TF_ENABLE_ONEDNN_OPTS=0``,
    float64) raise "Gradients for grouped convolutions are not supported on CPU"."""
    with tf.init_scope():  # eagerly, also when asked while a function is traced
        x, k, dy = (tf.ones(s, dtype) for s in ((1, 5, 5, 4), (3, 3, 2, 2), (1, 3, 3, 2)))
        try:
            tf.raw_ops.Conv2DBackpropInput(input_sizes=[1, 5, 5, 4], filter=k, out_backprop=dy,
                                           strides=[1, 1, 1, 1], padding="VALID")
            tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=[3, 3, 2, 2], out_backprop=dy,
                                            strides=[1, 1, 1, 1], padding="VALID")
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
            return False
    return True


def _pad_first(geo: ConvGeometry) -> bool:
    """Whether a float32 convolution with explicit padding runs faster as a ``tf.pad`` and a
    ``VALID`` convolution: 3x3 kernels at stride 2. Forward+backward, TF 2.21 on an Intel Xeon
    with AMX, padding 1, interleaved, best of 10 (ms, explicit -> pad first): 8x56x56x64->128
    14.8 -> 11.9, 4x112x112x64->64 20.3 -> 13.6, MobileNet's conv1 (16x224x224x3->32) 23.6 ->
    19.4; not other kernels: 7x7 (ResNet-50's conv1) 28.0 -> 26.4, 5x5 29.4 -> 31.3, 11x11 at
    stride 4 73 -> 96."""
    return geo.kh == geo.kw == 3 and geo.sh == geo.sw == 2 and geo.dh == geo.dw == 1


def _plus(y, bias):
    return y if bias is None else tf.nn.bias_add(y, bias)


def conv_step(conv: Callable, args: List[np.ndarray], r: np.ndarray, *, training: bool,
              jit_compile: bool, dtype: Optional[str]) -> Callable[[], None]:
    """One ``tf.function`` (XLA with ``jit_compile``); the loss and the first element of each
    gradient are fetched, so nothing is pruned. Traced without AutoGraph, as Keras' own train
    step is (``do_not_convert``): AutoGraph rewrote the source of every keras_cct function the
    step reached on its first call (36 functions, 1.7 s for a Winograd step; the planner's
    first use of CaffeNet conv2 took 2.4 s, 0.3 s without)."""
    targs = [tf.cast(tf.constant(a), dtype or a.dtype) for a in args]
    tr = tf.cast(tf.constant(r), dtype or r.dtype)

    def first(t):
        return tf.reshape(t, [-1])[0]

    @tf.function(jit_compile=jit_compile, autograph=False)
    def run(rr, *ps):
        if not training:
            return first(conv(*ps))
        with tf.GradientTape() as tape:
            tape.watch(ps)
            loss = tf.reduce_sum(conv(*ps) * rr)
        return loss + tf.add_n([first(g) for g in tape.gradient(loss, list(ps))])

    quiet_retracing(run)
    return lambda: run(tr, *targs).numpy()


def quiet_retracing(fn) -> None:
    """Keep TensorFlow from warning that ``fn`` "triggered tf.function retracing": it counts
    the traces of every function made from the same source together, and the planner makes
    one step function per candidate and shape, each traced once (a model's first ``fit`` with
    five convolution shapes printed the warning twice)."""
    fn._omit_frequent_tracing_warning = True  # (TensorFlow's own switch for such functions)


def device_name() -> Optional[str]:
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and tf.config.list_logical_devices("GPU"):
        return "gpu:" + tf.config.experimental.get_device_details(gpus[0]).get(
            "device_name", "gpu")
    return None


def wait(tensors: list) -> None:
    """A CPU tensor returned by a ``tf.function`` or an eager op is computed already; GPU
    streams run on after the call returns, so wait for them when a tensor lives there."""
    if any("GPU" in t.device for t in tensors if hasattr(t, "device")):
        tf.test.experimental.sync_devices()


def layer_steps(layer, args: list, dys: list):
    """Two ``tf.function`` calls; the forward+backward one returns the output with the
    gradients (TF would otherwise prune a forward that no gradient needs), the output's
    cotangent given as ``output_gradients`` as PyTorch's ``y.backward(dy)`` does (a loss
    ``sum(y * dy)`` would add passes over the output to the backward)."""
    single = len(args) == 1

    @tf.function(autograph=False)
    def forward(*a):
        return layer(a[0] if single else list(a))

    @tf.function(autograph=False)
    def forward_backward(*a):
        with tf.GradientTape() as tape:
            tape.watch(a)
            y = layer(a[0] if single else list(a))
        ys = list(y) if isinstance(y, (list, tuple)) else [y]
        cts = [tf.cast(d, o.dtype) for o, d in zip(ys, dys)]
        return ys, tape.gradient(ys, list(a) + list(layer.trainable_weights),
                                 output_gradients=cts)

    quiet_retracing(forward)
    quiet_retracing(forward_backward)
    return forward, forward_backward


def sgd_step(variable, history, grad, rate, momentum, reg=None, decay: float = 0.0) -> bool:
    """:func:`~keras_cct.lowering._backend.generic.sgd_step` as one ``ResourceApplyMomentum``
    kernel on ``rate (g + decay reg)`` at a rate of 1 (its ``accum`` is then Caffe's history,
    unchanged); not under a ``tf.distribute`` strategy, whose variables are not plain
    resources. CaffeNet's 61M weights on a 2-core AVX2 EPYC: 223 ms a step as the optimizer's
    ops (two products, a sum, two assignments), 119 ms fused (momentum 0.9 and weight decay:
    253 and 144 ms; PyTorch's own ``SGD`` 132-163). Without a history (momentum 0: ``w -=
    rate (g + decay reg)``) one ``ResourceApplyGradientDescent``: 14 ms there, where
    ``ResourceApplyMomentum`` at momentum 0 took 109."""
    accum = None if history is None else getattr(history, "value", history)
    if tf.distribute.has_strategy() or not all(
            isinstance(v, tf.Variable) and hasattr(v, "handle")
            for v in (variable, accum) if v is not None):
        return False
    if reg is not None:
        grad = grad + decay * tf.convert_to_tensor(reg)
    if accum is None:
        tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=rate, delta=grad,
                                                use_locking=False)
        return True
    tf.raw_ops.ResourceApplyMomentum(var=variable.handle, accum=accum.handle,
                                     lr=tf.constant(1.0, variable.dtype), grad=rate * grad,
                                     momentum=momentum, use_locking=False)
    return True
