"""CCTStrategy's split convolution on the PyTorch backend: eager, one ``torch.autograd.Function``.

Each call reads this step's shard sizes from the layer's fractions and cuts the batch into
contiguous shards. The OpenCL shards are launched first (queued on their devices' client
threads, which copy the data and talk to the worker), then the CUDA shards (CUDA launches are
asynchronous too), then the CPU shard computes in the calling thread with the layer's lowering,
on the host (when Keras computes on a GPU, its data is copied to the host before the CUDA shards
are queued, and its results back after); then the CUDA and OpenCL results are collected and
joined in order. The backward pass is split
again by fractions of its own (an eager backward has no forward graph to reuse: each PyTorch
shard lowers its input again) and overlaps the same way. Shards are timed (the CPU shard by the
clock around it, CUDA shards by CUDA events, OpenCL shards by their request's completion).
"""

from __future__ import annotations

import time

import numpy as np

from keras_cct.strategy import _opencl

PREFIX = "torch"
SUPPORTS_JIT = False  # eager: host round trips to the OpenCL workers


def check(strategy) -> None:
    """Nothing more to check: every PyTorch device and OpenCL device can take a shard."""


def _torch_device(device):
    import torch
    _, kind, index = device.name.split(":")
    return torch.device("cpu" if kind == "cpu" else f"cuda:{index}")


def _on(dev):
    """Keras' device scope for ``dev``: the lowerings' ``keras.ops`` put the tensors they make
    (and move the ones they convert) on Keras' device, the GPU when torch sees one."""
    import keras
    return keras.device(str(dev))


def timer(device, x, k, geo, lowering):
    """A function that runs ``x`` convolved with ``k`` once on backend ``device``."""
    import torch
    from keras_cct.lowering import conv2d_geo
    dev = _torch_device(device)
    tx, tk = torch.from_numpy(x).to(dev), torch.from_numpy(k).to(dev)

    def run():
        with torch.no_grad(), _on(dev):
            conv2d_geo(tx, tk, geo, lowering)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return run


def _to_host(tensors: list) -> list:
    """``tensors`` (None kept) on the CPU, where a CPU shard computes."""
    return [t if t is None or t.device.type == "cpu" else t.to("cpu") for t in tensors]


def _numpy(t) -> np.ndarray:
    """``t`` as a float32 array for an OpenCL shard (which computes in float32; numpy has no
    bfloat16)."""
    return np.ascontiguousarray(t.detach().cpu().float().numpy())


class _Shards:
    """The split of one call: the strategy, the layer's plan, geometry and lowering."""

    def __init__(self, strategy, plan, geo, lowering: str) -> None:
        self.strategy, self.plan, self.geo, self.lowering = strategy, plan, geo, lowering

    def run(self, phase: str, x, dy, params, need_dx: bool):
        """One pass: ``[y]`` (forward) or ``[dx or None, dkernel(, dbias)]`` (backward)."""
        import torch
        s, plan, geo = self.strategy, self.plan, self.geo
        with_bias = len(params) == 2
        sizes = [int(n) for n in plan.next_sizes(phase, False, x.shape[0])]
        busy = [i for i, n in enumerate(sizes) if n > 0]
        if len(busy) == 1 and not s.devices[busy[0]].is_opencl and \
                _torch_device(s.devices[busy[0]]) == x.device:
            # one device has the whole batch where it already is (the others parked): no
            # split, no events, no wait (a GPU's queue keeps running ahead of the host)
            with _on(x.device):
                return self._compute(phase, x, dy, params, need_dx)
        xs = torch.split(x, sizes)
        dys = [None] * len(sizes) if dy is None else torch.split(dy, sizes)
        kw = dict(need_dx=need_dx, with_bias=with_bias)
        np_params = [_numpy(p) for p in params] if any(
            d.is_opencl for d in s.devices) else []
        launched, arrays = {}, {}
        for i, d in enumerate(s.devices):  # OpenCL first: queued on the devices' threads
            if d.is_opencl and sizes[i] > 0:
                arrays[i] = [_numpy(xs[i])] + ([] if dy is None else [_numpy(dys[i])]) + \
                    np_params
                launched[i] = _opencl.launch(s, plan, phase, i, geo, arrays[i], **kw)
        outs = [None] * len(sizes)
        cuda = [i for i, d in enumerate(s.devices) if not d.is_opencl and d.kind != "cpu"
                and sizes[i] > 0]
        # The CPU shards' data, copied to the host before the CUDA shards are queued (when
        # Keras computes on a GPU, x lives there, and a copy queued after them would wait for
        # them to finish)
        host = {i: _to_host([xs[i], dys[i]] + list(params)) for i, d in enumerate(s.devices)
                if not d.is_opencl and i not in cuda and sizes[i] > 0}
        pending = {i: self._cuda_launch(phase, i, xs[i], dys[i], params, need_dx)
                   for i in cuda}  # asynchronous like OpenCL
        for i, (xi, dyi, *ps) in host.items():  # the CPU shard(s), timed by the clock
            t0 = time.perf_counter()
            with _on(xi.device):
                got = self._compute(phase, xi, dyi, ps, need_dx)
            plan.record(phase, i, time.perf_counter() - t0)
            # back where Keras computes (after the clock: a copy to a GPU waits for its queue)
            outs[i] = [None if t is None else t.to(x.device) for t in got]
        for i, (result, start, end) in pending.items():
            end.synchronize()
            plan.record(phase, i, start.elapsed_time(end) / 1e3)
            outs[i] = [None if t is None else t.to(x.device) for t in result]
        for i, launch in launched.items():
            got = _opencl.collect(s, plan, phase, i, geo, launch, arrays[i], **kw)
            if phase == "backward" and not need_dx:
                got = [None] + got
            outs[i] = [None if g is None else torch.from_numpy(np.ascontiguousarray(g)).to(
                x.device, x.dtype) for g in got]
        return self._join(phase, [o for o in outs if o is not None], x, params, need_dx)

    def _cuda_launch(self, phase, i, xi, dyi, params, need_dx):
        import torch
        dev = _torch_device(self.strategy.devices[i])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(dev), _on(dev):
            start.record()
            result = self._compute(phase, xi.to(dev, non_blocking=True),
                                   None if dyi is None else dyi.to(dev, non_blocking=True),
                                   [p.to(dev, non_blocking=True) for p in params], need_dx)
            end.record()
        return result, start, end

    def _compute(self, phase, xi, dyi, params, need_dx):
        """A PyTorch shard: forward ``[y]``, backward ``[dx or None, dkernel(, dbias)]``."""
        import torch
        from keras_cct.lowering import conv2d_geo
        kernel, b = params[0], params[1:]
        if phase == "forward":
            y = conv2d_geo(xi, kernel, self.geo, self.lowering)
            return [y + b[0] if b else y]
        with torch.enable_grad():
            xg = xi.detach().requires_grad_(need_dx)
            kg = kernel.detach().requires_grad_(True)
            y = conv2d_geo(xg, kg, self.geo, self.lowering)
            sources = ([xg] if need_dx else []) + [kg]
            grads = torch.autograd.grad(y, sources, dyi, allow_unused=True)
        grads = [torch.zeros_like(s) if g is None else g for g, s in zip(grads, sources)]
        return ([] if need_dx else [None]) + list(grads) + (
            [dyi.sum(dim=(0, 1, 2))] if b else [])

    def _join(self, phase, outs, x, params, need_dx):
        import torch
        if phase == "forward":
            return [torch.cat([o[0] for o in outs], dim=0)]
        dx = torch.cat([o[0] for o in outs], dim=0) if need_dx else None
        return [dx] + [sum(o[j] for o in outs) for j in range(1, 1 + len(params))]


def _function():
    import torch

    class SplitConv(torch.autograd.Function):
        """A convolution whose forward and backward are split across the strategy's devices."""

        @staticmethod
        def forward(ctx, shards, x, kernel, bias):  # noqa: D401
            params = [kernel] + ([] if bias is None else [bias])
            ctx.shards, ctx.with_bias = shards, bias is not None
            ctx.save_for_backward(x, *params)
            return shards.run("forward", x, None, params, True)[0]

        @staticmethod
        def backward(ctx, dy):
            x, *params = ctx.saved_tensors
            dx, dk, *db = ctx.shards.run("backward", x, dy.contiguous(), params,
                                         bool(ctx.needs_input_grad[1]))
            return None, dx, dk, (db[0] if ctx.with_bias else None)

    return SplitConv


_SPLIT = []


def split_conv(strategy, plan, x, kernel, geo, lowering: str, bias=None):
    """See :meth:`CCTStrategy.split_conv`."""
    import keras
    if not _SPLIT:
        _SPLIT.append(_function())
    x = keras.ops.convert_to_tensor(x)
    kernel = keras.ops.convert_to_tensor(kernel)
    bias = None if bias is None else keras.ops.convert_to_tensor(bias)
    return _SPLIT[0].apply(_Shards(strategy, plan, geo, lowering), x, kernel, bias)
