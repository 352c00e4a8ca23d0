"""A Caffe net definition as a ``torch.nn.Module``: the PyTorch peer of the whole-net benchmark.

The same ``.prototxt`` drives keras_cct (``cct time``) and this translator: it is read with
keras_cct's own reader (:func:`keras_cct.caffe.prototxt.read_net`, V0/V1 nets upgraded) and
filtered by phase (:func:`~keras_cct.caffe.prototxt.filter_net`). Layer types (those of CaffeNet,
AlexNet, VGG, ResNet, GoogLeNet, MobileNet, SqueezeNet):

* ``Data``/``ImageData``/``HDF5Data``/``MemoryData``/``DummyData``/``Input`` and ``input:``
  fields: the net's inputs (NCHW arrays; labels ``(N,)``);
* ``Convolution`` (group, pad, stride, dilation, bias_term), ``InnerProduct`` (axis),
  ``ReLU`` (negative_slope; in place when Caffe's is), ``Sigmoid``, ``TanH``, ``Dropout``;
* ``Pooling`` MAX/AVE with Caffe's rounding (CEIL by default: PyTorch's ``ceil_mode`` has the
  same "the last window starts inside the padded image" rule, and the same AVE divisor counting
  padding but not the ceil overhang), global pooling;
* ``LRN`` ACROSS_CHANNELS (``torch.nn.LocalResponseNorm``: ``k + alpha/n * sum x^2``, Caffe's
  formula) and WITHIN_CHANNEL;
* ``BatchNorm`` (no affine, ``use_global_stats`` honoured; else batch statistics in training),
  ``Scale`` (per channel, bias_term), ``Bias``;
* ``Eltwise`` SUM (coeff)/PROD/MAX, ``Concat``, ``Flatten``, ``Split``, ``Silence``;
* ``Softmax``, ``SoftmaxWithLoss`` (mean over the batch: Caffe's VALID normalization without
  ignore_label), ``EuclideanLoss``; ``Accuracy`` is skipped (it has no gradient).

``forward(inputs)`` returns ``(loss, blobs)``: the loss-weighted sum of the loss layers (None
without one) and every blob by name.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

DATA_TYPES = ("Data", "ImageData", "HDF5Data", "MemoryData", "WindowData", "DummyData",
              "Input")


def _hw(p, single: str, h: str, w: str, default: Optional[int]) -> Tuple[int, int]:
    if p.HasField(h) or p.HasField(w):
        return int(getattr(p, h)), int(getattr(p, w))
    v = getattr(p, single)
    if isinstance(v, (int, float)):  # PoolingParameter: optional scalar
        if not p.HasField(single):
            if default is None:
                raise ValueError(f"{single} is required")
            return default, default
        return int(v), int(v)
    if len(v) == 0:  # ConvolutionParameter: repeated
        if default is None:
            raise ValueError(f"{single} is required")
        return default, default
    return (int(v[0]), int(v[0])) if len(v) == 1 else (int(v[0]), int(v[1]))


class _Scale(nn.Module):
    """Caffe's Scale (axis 1, one bottom): ``x * w[c] (+ b[c])``."""

    def __init__(self, channels: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None

    def forward(self, x):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = x * self.weight.view(shape)
        return y + self.bias.view(shape) if self.bias is not None else y


class _Bias(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        return x + self.bias.view((1, -1) + (1,) * (x.dim() - 2))


class _InnerProduct(nn.Module):
    def __init__(self, in_features: int, out: int, bias: bool, axis: int):
        super().__init__()
        self.axis = axis
        self.linear = nn.Linear(in_features, out, bias=bias)

    def forward(self, x):
        return self.linear(x.flatten(self.axis))


class _LRNWithin(nn.Module):
    """WITHIN_CHANNEL LRN: ``x / (1 + alpha/n^2 * sum_{n x n} x^2)^beta`` (zero padded)."""

    def __init__(self, size: int, alpha: float, beta: float):
        super().__init__()
        self.size, self.alpha, self.beta = size, alpha, beta

    def forward(self, x):
        s = F.avg_pool2d(x * x, self.size, 1, self.size // 2, count_include_pad=True)
        return x / (1 + self.alpha * s) ** self.beta


class _BatchNorm(nn.BatchNorm2d):
    """Caffe's BatchNorm: no affine part; ``use_global_stats`` true uses the running
    statistics even in training (as Caffe does)."""

    def __init__(self, channels: int, eps: float, fraction: float, global_stats: Optional[bool]):
        super().__init__(channels, eps=eps, momentum=1.0 - fraction, affine=False)
        self.global_stats = global_stats

    def forward(self, x):
        if self.global_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, None, None, False,
                                0.0, self.eps)
        return super().forward(x)


class TorchCaffeNet(nn.Module):
    """A phase of a Caffe net as a module (see the module docstring for the layer types).

    Args:
        net_param: a ``NetParameter`` (already phase-filtered, or ``phase`` filters it).
        input_shapes: Caffe shape per input top, e.g. ``{"data": (32, 3, 227, 227)}``; the
            batch of one top of a data layer is the batch of all its tops (the label).
        phase: ``"TRAIN"`` or ``"TEST"``; None when ``net_param`` is already filtered.
    """

    def __init__(self, net_param, input_shapes: Dict[str, Sequence[int]],
                 phase: Optional[str] = "TRAIN"):
        super().__init__()
        if phase is not None:
            from keras_cct.caffe.io.filter import filter_net
            net_param = filter_net(net_param, phase=phase)
        self.steps: List[Tuple[str, str, List[str], List[str], object]] = []
        self.input_shapes: Dict[str, Tuple[int, ...]] = {}
        self.losses: List[Tuple[str, float]] = []
        self.mods = nn.ModuleDict()
        shapes: Dict[str, Tuple[int, ...]] = {}
        given = {k: tuple(int(d) for d in v) for k, v in input_shapes.items()}
        for name in list(net_param.input):  # legacy input: fields (upgraded nets keep none)
            shapes[name] = given[name]
        for lp in net_param.layer:
            if lp.type in DATA_TYPES:
                self._add_inputs(lp, given, shapes)
            else:
                self._add_layer(lp, shapes)
        self.input_shapes = {k: shapes[k] for k in self.input_names}
        self.blob_shapes = shapes

    # ---------------------------------------------------------------------------- building
    @property
    def input_names(self) -> List[str]:
        return [t for kind, _, _, tops, _ in self.steps if kind == "input" for t in tops]

    def _add_inputs(self, lp, given, shapes) -> None:
        batch = next((given[t][0] for t in lp.top if t in given), None)
        for i, top in enumerate(lp.top):
            if top in given:
                shp = given[top]
            elif lp.type == "Input" and len(lp.input_param.shape):
                dims = lp.input_param.shape[min(i, len(lp.input_param.shape) - 1)].dim
                shp = tuple(int(d) for d in dims)
            elif i == 1 and batch is not None:
                shp = (batch,)  # the label of a Data layer
            else:
                raise ValueError(f"{lp.type} layer {lp.name!r}: give the shape of top {top!r}")
            if batch is not None and shp[0] != batch and lp.type != "Input":
                shp = (batch,) + tuple(shp[1:])
            shapes[top] = tuple(shp)
        self.steps.append(("input", lp.name, [], list(lp.top), None))

    def _add_layer(self, lp, shapes) -> None:
        t = lp.type
        bottoms, tops = list(lp.bottom), list(lp.top)
        xs = [shapes[b] for b in bottoms]
        key = f"m{len(self.steps)}"
        mod: Optional[nn.Module] = None
        out_shapes: List[Tuple[int, ...]]
        if t == "Convolution":
            p = lp.convolution_param
            k = _hw(p, "kernel_size", "kernel_h", "kernel_w", None)
            s = _hw(p, "stride", "stride_h", "stride_w", 1)
            pad = _hw(p, "pad", "pad_h", "pad_w", 0)
            d = (int(p.dilation[0]),) * 2 if len(p.dilation) == 1 else \
                tuple(int(v) for v in p.dilation) if len(p.dilation) == 2 else (1, 1)
            mod = nn.Conv2d(xs[0][1], int(p.num_output), k, s, pad, d, int(p.group),
                            bias=bool(p.bias_term))
            n, _, h, w = xs[0]
            oh = (h + 2 * pad[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
            ow = (w + 2 * pad[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
            out_shapes = [(n, int(p.num_output), oh, ow)]
        elif t == "InnerProduct":
            p = lp.inner_product_param
            axis = p.axis % len(xs[0])
            fan_in = 1
            for v in xs[0][axis:]:
                fan_in *= v
            mod = _InnerProduct(fan_in, int(p.num_output), bool(p.bias_term), axis)
            out_shapes = [tuple(xs[0][:axis]) + (int(p.num_output),)]
        elif t == "Pooling":
            p = lp.pooling_param
            from keras_cct.caffe import proto
            method = proto.PoolingParameter.PoolMethod.Name(p.pool)
            n, c, h, w = xs[0]
            if p.global_pooling:
                k, s, pad = (h, w), (1, 1), (0, 0)
            else:
                k = _hw(p, "kernel_size", "kernel_h", "kernel_w", None)
                s = _hw(p, "stride", "stride_h", "stride_w", 1)
                pad = _hw(p, "pad", "pad_h", "pad_w", 0)
            ceil = proto.PoolingParameter.RoundMode.Name(p.round_mode) == "CEIL"
            if method == "MAX":
                mod = nn.MaxPool2d(k, s, pad, ceil_mode=ceil)
            elif method == "AVE":
                mod = nn.AvgPool2d(k, s, pad, ceil_mode=ceil, count_include_pad=True)
            else:
                raise ValueError(f"Pooling {method} is not supported")
            out_shapes = [tuple(mod(torch.empty(1, 1, h, w)).shape[2:])]
            out_shapes = [(n, c) + out_shapes[0]]
        elif t == "ReLU":
            slope = float(lp.relu_param.negative_slope)
            inplace = bool(bottoms == tops)
            mod = nn.LeakyReLU(slope, inplace=inplace) if slope else nn.ReLU(inplace=inplace)
            out_shapes = xs
        elif t in ("Sigmoid", "TanH"):
            mod = nn.Sigmoid() if t == "Sigmoid" else nn.Tanh()
            out_shapes = xs
        elif t == "Dropout":
            mod = nn.Dropout(float(lp.dropout_param.dropout_ratio))
            out_shapes = xs
        elif t == "LRN":
            p = lp.lrn_param
            from keras_cct.caffe import proto
            region = proto.LRNParameter.NormRegion.Name(p.norm_region)
            if region == "ACROSS_CHANNELS":
                mod = nn.LocalResponseNorm(int(p.local_size), float(p.alpha), float(p.beta),
                                           float(p.k))
            else:
                mod = _LRNWithin(int(p.local_size), float(p.alpha), float(p.beta))
            out_shapes = xs
        elif t == "BatchNorm":
            p = lp.batch_norm_param
            ugs = bool(p.use_global_stats) if p.HasField("use_global_stats") else None
            mod = _BatchNorm(xs[0][1], float(p.eps), float(p.moving_average_fraction), ugs)
            out_shapes = xs
        elif t == "Scale":
            if len(bottoms) != 1 or lp.scale_param.axis != 1:
                raise ValueError("Scale: one bottom and axis 1 only")
            mod = _Scale(xs[0][1], bool(lp.scale_param.bias_term))
            out_shapes = xs
        elif t == "Bias":
            mod = _Bias(xs[0][1])
            out_shapes = xs
        elif t == "Eltwise":
            out_shapes = [xs[0]]
        elif t == "Concat":
            axis = lp.concat_param.axis % len(xs[0])
            total = sum(x[axis] for x in xs)
            out_shapes = [tuple(xs[0][:axis]) + (total,) + tuple(xs[0][axis + 1:])]
        elif t == "Flatten":
            n = xs[0][0]
            rest = 1
            for v in xs[0][1:]:
                rest *= v
            out_shapes = [(n, rest)]
        elif t == "Split":
            out_shapes = xs * len(tops)
        elif t in ("Softmax", "Accuracy", "Silence"):
            out_shapes = [xs[0]] * len(tops)
        elif t in ("SoftmaxWithLoss", "EuclideanLoss"):
            weight = float(lp.loss_weight[0]) if len(lp.loss_weight) else 1.0
            self.losses.append((tops[0] if tops else lp.name, weight))
            out_shapes = [()] * len(tops)
        else:
            raise ValueError(f"layer {lp.name!r}: type {t!r} is not supported by the PyTorch "
                             f"translator")
        if mod is not None:
            self.mods[key] = mod
        self.steps.append((t, key, bottoms, tops, lp))
        for top, shp in zip(tops, out_shapes):
            shapes[top] = tuple(int(v) for v in shp)

    # ---------------------------------------------------------------------------- running
    def forward(self, inputs: Dict[str, torch.Tensor]):
        blobs: Dict[str, torch.Tensor] = dict(inputs)
        loss = None
        for t, key, bottoms, tops, lp in self.steps:
            if t == "input":
                continue
            xs = [blobs[b] for b in bottoms]
            if key in self.mods:
                ys = [self.mods[key](xs[0])]
            elif t == "Eltwise":
                op = lp.eltwise_param.operation  # PROD 0, SUM 1, MAX 2
                if op == 1:
                    coeff = list(lp.eltwise_param.coeff) or [1.0] * len(xs)
                    y = xs[0] * coeff[0] if coeff[0] != 1 else xs[0]
                    for c, x in zip(coeff[1:], xs[1:]):
                        y = y + (x * c if c != 1 else x)
                elif op == 0:
                    y = xs[0]
                    for x in xs[1:]:
                        y = y * x
                else:
                    y = xs[0]
                    for x in xs[1:]:
                        y = torch.maximum(y, x)
                ys = [y]
            elif t == "Concat":
                ys = [torch.cat(xs, dim=lp.concat_param.axis)]
            elif t == "Flatten":
                ys = [xs[0].flatten(1)]
            elif t == "Split":
                ys = [xs[0]] * len(tops)
            elif t == "Softmax":
                ys = [F.softmax(xs[0], dim=lp.softmax_param.axis)]
            elif t in ("Accuracy", "Silence"):
                continue
            elif t == "SoftmaxWithLoss":
                logits = xs[0].float()  # (N, C, ...): the label holds N x ... classes
                label = xs[1].long().reshape((logits.shape[0],) + tuple(logits.shape[2:]))
                ys = [F.cross_entropy(logits, label)]
            elif t == "EuclideanLoss":
                d = (xs[0] - xs[1]).float()
                ys = [(d * d).sum() / (2 * d.shape[0])]
            else:  # pragma: no cover -- rejected when building
                raise ValueError(t)
            for top, y in zip(tops, ys):
                blobs[top] = y
            if t in ("SoftmaxWithLoss", "EuclideanLoss"):
                weight = float(lp.loss_weight[0]) if len(lp.loss_weight) else 1.0
                term = ys[0] * weight
                loss = term if loss is None else loss + term
        return loss, blobs


def load_torch_net(path, input_shapes: Dict[str, Sequence[int]], phase: str = "TRAIN"
                   ) -> TorchCaffeNet:
    """The net of ``path`` (a .prototxt, read with keras_cct's reader) as a module."""
    from keras_cct.caffe.io.text import read_net
    return TorchCaffeNet(read_net(path), input_shapes, phase=phase)


def random_inputs(net: TorchCaffeNet, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Uniform [0, 1) images and zero labels of the net's input shapes (as ``cct time
    --random-data`` feeds)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shp in net.input_shapes.items():
        if len(shp) == 1:
            out[name] = torch.zeros(shp, dtype=torch.long)
        else:
            out[name] = torch.rand(shp, generator=g)
    return out


def load_caffemodel(net: TorchCaffeNet, path) -> int:
    """Copy a .caffemodel's blobs into ``net`` by layer name (Caffe's layouts are PyTorch's:
    convolution ``(O, I/g, kh, kw)``, inner product ``(out, in)``); the number of layers
    filled."""
    import numpy as np
    from keras_cct.caffe.io.binary import blob_to_array, read_caffemodel
    blobs = {lp.name: [blob_to_array(b) for b in lp.blobs]
             for lp in read_caffemodel(path).layer if len(lp.blobs)}
    filled = 0
    with torch.no_grad():
        for t, key, _, _, lp in net.steps:
            if t == "input" or lp.name not in blobs or key not in net.mods:
                continue
            arrays, mod = blobs[lp.name], net.mods[key]
            if isinstance(mod, _InnerProduct):
                mod = mod.linear
            if isinstance(mod, _BatchNorm):
                f = float(np.ravel(arrays[2])[0]) if len(arrays) > 2 else 1.0
                f = 1.0 / f if f else 0.0
                mod.running_mean.copy_(torch.from_numpy(np.ravel(arrays[0]) * f))
                mod.running_var.copy_(torch.from_numpy(np.ravel(arrays[1]) * f))
            else:
                params = [mod.weight] + ([mod.bias] if getattr(mod, "bias", None) is not None
                                         else [])
                for p, a in zip(params, arrays):
                    p.copy_(torch.from_numpy(np.asarray(a, np.float32)).reshape(p.shape))
            filled += 1
    return filled
