"""PyTorch forms of the per-backend primitives (see :mod:`keras_cct.lowering._backend`)."""

from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from keras_cct.lowering._backend import generic
from keras_cct.lowering._backend.generic import *  # noqa: F401,F403
from keras_cct.lowering.geometry import ConvGeometry

NAME = "torch"
#: PyTorch runs eagerly: timing a race's winner again at a larger batch costs only its calls.
#: Its oneDNN convolutions pay per-call costs (weight reorders) that a race at a few images
#: weighs too much: VGG16's conv4_2 (14x14x512 -> 512) in bfloat16 on a 2-core Xeon with
#: AMX, forward+backward, ``"native"`` 18.5 ms at 2 images against Type 1's 9.3 (so Type 1
#: won by 2x, no close race to confirm), 23.3 against 27.5 at the layer's 8.
CONFIRM_EVERY_WIN = True
#: Winograd's PyTorch transforms (:mod:`keras_cct.lowering.winograd_torch`) run a group at a
#: time.
WINOGRAD_GROUPS_AT_ONCE = False
__all__ = generic.__all__


def constant(a: np.ndarray, like):
    return torch.as_tensor(a, dtype=like.dtype, device=like.device)


def index_tensor(indices, like):
    return torch.as_tensor(indices, dtype=torch.long, device=like.device)


def matmul(a, b):
    """``a @ b`` in the operands' own dtype (Keras' torch ``matmul`` demotes float64)."""
    return a @ b


def matmul_tn(a, b):
    return a.transpose(0, 1) @ b


def matmul_nt(a, b):
    return a @ b.transpose(0, 1)


def bmm(a, b, ta: bool = False, tb: bool = False):
    return (a.transpose(1, 2) if ta else a) @ (b.transpose(1, 2) if tb else b)


def take_rows(x, indices):
    return torch.index_select(x, 1, indices)


def segment_sum(data, segment_ids, num_segments: int):
    """In ``data``'s own dtype (Keras' torch ``segment_sum`` computes in float32)."""
    ids = torch.as_tensor(segment_ids, dtype=torch.long, device=data.device)
    out = torch.zeros((num_segments,) + tuple(data.shape[1:]), dtype=data.dtype,
                      device=data.device)
    return out.index_add(0, ids, data)


def native_conv(x, kernel, geo: ConvGeometry, bias=None):
    """``F.conv2d(groups=g)`` (oneDNN's grouped convolution) on the channels-last tensor viewed
    as NCHW: that view *is* PyTorch's ``channels_last`` memory format, so the input is not
    copied (``keras.ops.conv`` makes an NCHW copy and then a channels-last one) and the output
    comes back channels-last in place. ``bias`` goes into the op."""
    xc = x.permute(0, 3, 1, 2)
    (pt, pb), (pl, pr) = geo.pad
    if pt == pb and pl == pr:
        padding = (pt, pl)
    else:
        xc, padding = F.pad(xc, (pl, pr, pt, pb)), (0, 0)
    y = F.conv2d(xc, oihw_channels_last(kernel), bias, (geo.sh, geo.sw), padding,
                 (geo.dh, geo.dw), geo.groups)
    return y.permute(0, 2, 3, 1)


#: Bytes of a kernel's output channels (a row of the ``(kh kw cg, o)`` matrix) that
#: :func:`oihw_channels_last` transposes as a matrix when a multiple of them.
TRANSPOSE_ROW_BYTES = 1024


def oihw_channels_last(kernel):
    """The ``(kh, kw, cg, o)`` kernel as ``(o, cg, kh, kw)`` stored channels-last, i.e.
    ``(o, kh, kw, cg)``, as ``keras.ops.conv`` does: oneDNN reorders that layout to its own
    fast (the bare permuted view trained 3-10% slower on two wide layers: 7x7x512 -> 512 and
    -> 2048, batch 32). That copy is the ``(kh kw cg, o)`` matrix transposed. Where its rows
    are a multiple of :data:`TRANSPOSE_ROW_BYTES` (512 output channels in bfloat16, 256 in
    float32) and the kernel has more than one tap, it is copied as that matrix (PyTorch's
    blocked two-dimensional transpose), and its gradient comes back the same way: the
    four-dimensional copy reads the columns a power of two of bytes apart, and took 4.5 ms
    of a 3x3 512 -> 512 kernel in bfloat16 against 1.5 (2-core Xeon; forward+backward of
    VGG16's conv4_2 at batch 8 in bfloat16 18.1 -> 14.9 ms, 7x7x512 -> 512 at 16 19.4 ->
    14.7, 3x3 512 -> 1024 50.3 -> 37.4; float32 1.00-1.17x; other kernels 0.95-1.06x either
    way, and 1x1 kernels 0.95-1.09x with no consistent gain, so they keep the copy above)."""
    kh, kw, cg, o = kernel.shape
    if kh * kw > 1 and (o * kernel.element_size()) % TRANSPOSE_ROW_BYTES == 0:
        rows = kernel.reshape(kh * kw * cg, o).t().contiguous()
        return rows.view(o, kh, kw, cg).permute(0, 3, 1, 2)
    return kernel.permute(3, 2, 0, 1).contiguous(memory_format=torch.channels_last)


def conv_step(conv: Callable, args: List[np.ndarray], r: np.ndarray, *, training: bool,
              jit_compile: bool, dtype: Optional[str]) -> Callable[[], None]:
    """Eager: the loss's backward (or the forward under ``no_grad``), on the device Keras
    computes on (a GPU when torch sees one), waited for."""
    tdtype = getattr(torch, dtype) if dtype else None
    dev = _keras_device()
    targs = [torch.tensor(a, dtype=tdtype, device=dev, requires_grad=training) for a in args]
    tr = torch.tensor(r, dtype=tdtype, device=dev)
    wait = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step():
        if training:
            (conv(*targs) * tr).sum().backward()
            for t in targs:
                t.grad = None
        else:
            with torch.no_grad():
                conv(*targs)
        wait()

    return step


def _keras_device() -> "torch.device":
    """The device Keras' torch backend puts new tensors on."""
    import keras
    return keras.ops.zeros(()).device


def device_name() -> Optional[str]:
    return "cuda:" + torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def wait(tensors: list) -> None:
    """CPU kernels are done when the call returns; CUDA ones are waited for."""
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def layer_steps(layer, args: list, dys: list):
    """Eager: the forward under ``no_grad``; the forward+backward by ``torch.autograd.grad``
    of the outputs with the cotangents ``dys`` (as ``y.backward(dy)``) with respect to the
    floating-point inputs and the weights."""
    single = len(args) == 1
    cts: list = []

    def forward(*a):
        with torch.no_grad():
            return layer(a[0] if single else list(a))

    def forward_backward(*a):
        a = [t.detach().requires_grad_(True) if torch.is_floating_point(t) else t for t in a]
        y = layer(a[0] if single else list(a))
        ys = y if isinstance(y, (list, tuple)) else [y]
        if not cts:  # once, on the output's device and dtype (not a copy per call)
            cts.extend(torch.as_tensor(d, device=o.device, dtype=o.dtype)
                       for o, d in zip(ys, dys))
        params = [t for t in a if t.requires_grad] + [
            v.value for v in layer.trainable_variables]
        return torch.autograd.grad(ys, params, grad_outputs=cts, allow_unused=True)

    return forward, forward_backward


def sgd_step(variable, history, grad, rate, momentum, reg=None, decay: float = 0.0) -> bool:
    """:func:`~keras_cct.lowering._backend.generic.sgd_step` in place:
    ``h.mul_(m).addcmul_(g, rate)``, ``h.addcmul_(reg, rate decay)``, ``w.sub_(h)``. The
    optimizer's ops allocate a tensor the size of the weights for each product, sum and
    assignment: CaffeNet's 61M weights on a 2-core AVX2 EPYC took 478 ms a step that way and
    43 ms in place (momentum 0.9 and weight decay: 690 and 57 ms; PyTorch's own ``SGD``
    132-163). Without a history (momentum 0): ``w.addcmul_(reg, rate decay, value=-1)``
    (the weights before the step, as Caffe) and ``w.addcmul_(g, rate, value=-1)``: 19 ms
    there, against 47 through the history."""
    w = variable.value
    with torch.no_grad():
        if history is None:
            if reg is not None:
                w.addcmul_(getattr(reg, "value", reg), rate * decay, value=-1)
            w.addcmul_(grad, rate, value=-1)
            return True
        h = history.value
        h.mul_(momentum).addcmul_(grad, rate)
        if reg is not None:
            h.addcmul_(getattr(reg, "value", reg), rate * decay)
        w.sub_(h)
    return True
