"""``keras.ops`` forms of the per-backend primitives, for a backend without a module of its
own; the other modules start from these."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
from keras import ops

from keras_cct.lowering._backend import common
from keras_cct.lowering.geometry import ConvGeometry

NAME = "generic"
#: What ``mode="auto"`` picks for a depthwise convolution (one input channel per group, more
#: than one group), untimed: the backend's own depthwise op, or ``"depthwise"``
#: (:mod:`keras_cct.lowering.depthwise`) where that is far faster.
DEPTHWISE = "native"
#: Whether ``mode="auto"`` runs an ungrouped 1x1 convolution as the cost model's lowered type
#: (one GEMM), untimed, where the backend's convolution is known to lose to its own GEMM.
LOWER_1X1 = False
#: Lowerings that are compiled for each input shape on this backend (a first call at a new
#: batch size compiles again): ``mode="auto"`` then races them at the layer's own batch
#: (:func:`keras_cct.lowering.planner.race_batch`). Here none: ``keras.ops`` run eagerly.
COMPILED: tuple = ()
#: The most batch partitions a lowering is cut into (:func:`keras_cct.lowering.cost.partitions`
#: decides how many; None: no limit). Where one program is compiled for the whole step, each
#: partition is another copy of the lowering and its GEMMs in that program.
MAX_PARTITIONS: Optional[int] = None
#: Whether Winograd's transforms and GEMMs run in batch partitions (sized to the cache:
#: :func:`keras_cct.lowering.winograd.partition_images`) or on the whole batch at once.
WINOGRAD_PARTITIONS = True
#: Whether Winograd transforms every channel group of a grouped convolution at once (the
#: groups as images of their own, then side by side on the batched GEMM's axis:
#: :func:`keras_cct.lowering.winograd._groups_to_batch`), or each group as a convolution of its
#: own. At once, TensorFlow compiles about half the program (CaffeNet's conv2, conv4 and
#: conv5 at batch 32, each Winograd form's first call: 0.8-2.5 -> 0.5-1.5 s) and runs the
#: steps in 0.95-1.02x the time (2-core Intel Xeon, interleaved).
WINOGRAD_GROUPS_AT_ONCE = True
#: Whether max pooling runs as its window's slices with a saved index
#: (:mod:`keras_cct.lowering.pooling`) rather than the backend's own op. Not here: each slice
#: would be an op of its own.
WINDOWED_MAX_POOL = False
#: Whether ``mode="auto"`` times a race's winner other than ``"native"`` again beside it at a
#: larger batch whatever its lead (:func:`keras_cct.lowering.planner.confirm_batch`), not only
#: where the two are close: where a step at another batch size compiles and traces nothing,
#: so the second timing costs only its calls. Not here (a backend Keras compiles for).
CONFIRM_EVERY_WIN = False
__all__ = ["COMPILED", "CONFIRM_EVERY_WIN", "DEPTHWISE", "LOWER_1X1", "MAX_PARTITIONS", "NAME",
           "WINDOWED_MAX_POOL", "WINOGRAD_GROUPS_AT_ONCE", "WINOGRAD_PARTITIONS", "add_n",
           "as_tensor", "bmm", "constant", "conv_step", "custom_conv", "depthwise_conv",
           "device_name", "fused", "index_tensor", "layer_steps", "map_batch", "matmul",
           "matmul_nt", "matmul_tn", "native_conv", "segment_sum", "sgd_step", "split_batch",
           "take_rows", "wait"]


def as_tensor(x):
    """A plain tensor holding ``x``'s value (a variable is read, not passed as a variable)."""
    return ops.convert_to_tensor(x)


def custom_conv(forward, backward, x, kernel):
    """:func:`~keras_cct.lowering._backend.common.custom_conv` with this backend's tensors."""
    return common.custom_conv(forward, backward, x, kernel, as_tensor)


def constant(a: np.ndarray, like):
    """``a`` as a tensor of ``like``'s dtype (and device)."""
    return ops.convert_to_tensor(a, dtype=like.dtype)


def fused(fn: Callable, batch_axes: Optional[Dict[int, int]] = None,
          key: Optional[str] = None) -> Callable:
    """``fn`` (tensors, or lists of tensors, in and out; no variables) in the form this backend
    runs fastest as one piece: here, ``fn`` itself. TensorFlow compiles it with XLA into one
    cluster, so that a chain of slices and additions (Winograd's transforms) makes one pass
    over memory instead of one per op; ``batch_axes`` (rank -> the axis that follows the
    batch, in arguments of that rank) lets it trace ``fn`` once for every batch size, and
    ``key`` (naming ``fn`` the same in every process) name that trace alike in every process,
    so that TensorFlow's persistent cache finds its compiled form."""
    return fn


def index_tensor(indices, like):
    """A 1-D int32 numpy ``indices`` as the index tensor :func:`take_rows` wants (on ``like``'s
    device), made once and reused for every partition."""
    return ops.convert_to_tensor(indices)


def matmul(a, b):
    """``a @ b`` for 2-D operands, in their own dtype."""
    return ops.matmul(a, b)


def matmul_tn(a, b):
    """``a.T @ b`` for 2-D ``a`` (k, m) and ``b`` (k, n), without materializing ``a.T``."""
    return ops.matmul(ops.transpose(a), b)


def matmul_nt(a, b):
    """``a @ b.T`` for 2-D ``a`` (m, k) and ``b`` (n, k), without materializing ``b.T``."""
    return ops.matmul(a, ops.transpose(b))


def bmm(a, b, ta: bool = False, tb: bool = False):
    """Batched ``op(a) @ op(b)`` of 3-D tensors, ``op`` a transpose of the last two axes when
    asked, without materializing the transpose where the backend allows."""
    a = ops.swapaxes(a, 1, 2) if ta else a
    b = ops.swapaxes(b, 1, 2) if tb else b
    return ops.matmul(a, b)


def add_n(tensors: List):
    """Sum of same-shape tensors."""
    total = tensors[0]
    for t in tensors[1:]:
        total = ops.add(total, t)
    return total


def take_rows(x, indices):
    """``x[:, indices, :]`` for a 3-D ``x`` and an :func:`index_tensor` (a gather of whole rows
    along axis 1)."""
    return ops.take(x, indices, axis=1)


def split_batch(x, parts: int, unit: int = 1) -> List:
    """``x`` cut along axis 0 into ``parts`` contiguous partitions (see
    :func:`~keras_cct.lowering._backend.common.batch_bounds`)."""
    if parts == 1:
        return [x]
    bounds = common.batch_bounds(x, parts, unit)
    return [x[bounds[i]:bounds[i + 1]] for i in range(parts)]


def map_batch(fn: Callable, tensors: List, images: int):
    """``fn`` over the batch of ``tensors`` (all of one batch size, along axis 0) a partition at
    a time: contiguous partitions of :func:`~keras_cct.lowering._backend.common.partition_size`
    images (aiming at ``images``; the last one the remainder where that size does not divide
    the batch). ``fn(*pieces) -> (batched, summed)``, two lists of tensors; returns ``batched``
    concatenated along axis 0 and ``summed`` added up over the partitions. Here the batch size
    must be static (a loop in Python); TensorFlow's form loops in the graph where it is not."""
    n = tensors[0].shape[0]
    size = common.partition_size(n, images)
    outs = [fn(*(t[i:i + size] for t in tensors)) for i in range(0, n, size)]
    parts = len(outs)
    batched = [ops.concatenate([o[0][i] for o in outs], axis=0) if parts > 1 else outs[0][0][i]
               for i in range(len(outs[0][0]))]
    return batched, [add_n([o[1][i] for o in outs]) for i in range(len(outs[0][1]))]


def segment_sum(data, segment_ids, num_segments: int):
    """Sum of the rows (axis 0) of ``data`` by a 1-D int32 numpy ``segment_ids``."""
    return ops.segment_sum(data, segment_ids, num_segments=num_segments)


def native_conv(x, kernel, geo: ConvGeometry, bias=None):
    """The convolution by ``keras.ops.conv`` (explicit padding as a pad), plus ``bias``."""
    padding = geo.keras_padding
    if padding is None:
        (pt, pb), (pl, pr) = geo.pad
        x = ops.pad(x, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
        padding = "valid"
    y = ops.conv(x, kernel, strides=(geo.sh, geo.sw), padding=padding,
                 dilation_rate=(geo.dh, geo.dw))
    return y if bias is None else ops.add(y, bias)


def depthwise_taps(xp, geo: ConvGeometry):
    """``(i, j, slice)`` for every tap of a depthwise kernel: the window of the padded
    channels-last ``xp`` that tap (i, j) multiplies, at the output's size."""
    oh, ow = geo.out_h, geo.out_w
    for i in range(geo.kh):
        for j in range(geo.kw):
            r, c = i * geo.dh, j * geo.dw
            yield i, j, xp[:, r:r + (oh - 1) * geo.sh + 1:geo.sh,
                           c:c + (ow - 1) * geo.sw + 1:geo.sw, :]


def depthwise_input(x, geo: ConvGeometry):
    """``x`` padded by Caffe's padding, each channel repeated by the channel multiplier."""
    m = geo.filters // geo.channels
    if m > 1:
        x = ops.repeat(x, m, axis=-1)
    (pt, pb), (pl, pr) = geo.pad
    return ops.pad(x, [[0, 0], [pt, pb], [pl, pr], [0, 0]])


def depthwise_conv(x, kernel, geo: ConvGeometry):
    """A depthwise convolution (:mod:`keras_cct.lowering.depthwise`) as ``kh * kw`` shifted
    multiply-adds in ``keras.ops``; gradients by autodiff. 16-bit inputs are summed in
    float32."""
    dtype = ops.dtype(x)
    wide = dtype in ("float16", "bfloat16")
    xp = depthwise_input(x, geo)
    y = None
    for i, j, t in depthwise_taps(xp, geo):
        term = t * kernel[i, j, 0]
        term = ops.cast(term, "float32") if wide else term
        y = term if y is None else y + term
    return ops.cast(y, dtype) if wide else y


def conv_step(conv: Callable, args: List[np.ndarray], r: np.ndarray, *, training: bool,
              jit_compile: bool, dtype: Optional[str]) -> Callable[[], None]:
    """A no-argument callable running ``conv(*args)`` (``args``: the input, the kernel and
    maybe a bias; and, if ``training``, the gradients of ``sum(y * r)`` with respect to each,
    fetched with the loss)."""
    raise NotImplementedError("no timing step for this Keras backend")


def device_name() -> Optional[str]:
    """The accelerator Keras computes on (``None``: the CPU)."""
    return None


def layer_steps(layer, args: list, dys: list):
    """``(forward, forward_backward)`` callables of ``layer`` on ``args`` (one tensor, or a
    list of them, passed as such): see :func:`keras_cct.lowering.timing.layer_steps`."""
    raise NotImplementedError("no layer timing for this Keras backend")


def wait(tensors: list) -> None:
    """Return once every tensor of ``tensors`` is computed (here: by fetching a sum of each;
    the backends wait without computing anything)."""
    for t in tensors:
        ops.convert_to_numpy(ops.sum(t))


def sgd_step(variable, history, grad, rate, momentum, reg=None, decay: float = 0.0) -> bool:
    """Caffe's SGD step ``h = m h + rate (g + decay reg); w -= h`` on the variables ``variable``
    (``w``) and ``history`` (``h``) in place, where the backend has a fused form (``reg``: the
    weights for L2, their signs for L1, None without weight decay); ``history`` None (momentum
    0, where Caffe's history is never read again): ``w -= rate (g + decay reg)``, the history
    untouched. Returns whether it did.
    Here it does not: the optimizer's ops run (:class:`~keras_cct.caffe.train.optimizer.
    CaffeOptimizer`; on JAX the compiled step fuses them)."""
    return False
