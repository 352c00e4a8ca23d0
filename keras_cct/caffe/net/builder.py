"""The network builder: a Caffe ``NetParameter`` -> a functional, channels-last ``keras.Model``.

:func:`build_net` walks the (upgraded, phase-filtered) layers in order, as Caffe's ``Net::Init``
does, keeping a map from blob names to Keras tensors (in-place layers simply rebind a name).
Keras layer names are Caffe layer names (``/`` -> ``__``, Keras forbids ``/``); convolutions
become :class:`keras_cct.HybridConv2D` with Caffe's explicit padding (the converters are in
:mod:`keras_cct.caffe.net.converters`); every other layer is a
Keras layer with Caffe's exact semantics from :mod:`keras_cct.caffe.net.layers`. Loss and
accuracy layers are not part of the model: they are returned as :class:`Head` records for the
training code, and the blobs they consume are model outputs.

:func:`load_net` is the user-facing importer (prototxt [+ caffemodel] -> ``keras.Model``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import keras

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.filter import filter_net, phase_value
from keras_cct.caffe.io.text import parse_net, read_net
from keras_cct.caffe.io.types import DATA_TYPES
from keras_cct.caffe.io.upgrade import NetSource, upgrade_net
from keras_cct.caffe.net.checks import check_input, check_layer
from keras_cct.caffe.net.converters import CONVERTERS, NO_BOTTOM, ONE_TOP, Ctx
from keras_cct.caffe.net.fusion import fuse_batch_norm_scale
from keras_cct.caffe.net.layout import caffe_shape, keras_shape
from keras_cct.caffe.net.losses import HEAD_TYPES, Head, head_of
from keras_cct.caffe.net.weights import keras_name, load_weights
from keras_cct.errors import CaffeFormatError, KerasCCTError

PathLike = Union[str, os.PathLike]
Shape = Tuple[Optional[int], ...]

__all__ = ["CaffeNet", "Head", "build_net", "load_net", "import_net", "SUPPORTED_TYPES",
           "DATA_TYPES", "HEAD_TYPES"]


@dataclass
class CaffeNet:
    """The result of :func:`build_net`.

    Attributes:
        model: functional ``keras.Model`` (channels-last; inputs in ``inputs`` order, outputs
            in ``outputs`` order).
        inputs: model input blob name -> channels-last shape, batch first (Caffe's batch size
            when the prototxt gives one, else ``None``).
        heads: the loss/accuracy layers (:class:`Head`), in net order.
        outputs: the Caffe blob name of each model output, in order.
        net_param: the upgraded, phase-filtered ``NetParameter`` the model was built from.
        phase: ``"TRAIN"`` or ``"TEST"``.
        caffe_names: Keras layer name -> Caffe layer name.
        output_layer_names: Keras name of each model output (== blob name unless that name
            belongs to another layer, then ``<blob>_blob``).
    """

    model: keras.Model
    inputs: Dict[str, Shape]
    heads: List[Head]
    outputs: List[str]
    net_param: object
    phase: str
    caffe_names: Dict[str, str] = field(default_factory=dict)
    output_layer_names: List[str] = field(default_factory=list)
    blobs: Dict[str, object] = field(default_factory=dict, repr=False)

    def caffe_input_shapes(self) -> Dict[str, Shape]:
        """Model inputs in Caffe's (N, C, H, W) order."""
        return {k: caffe_shape(v) for k, v in self.inputs.items()}

    def submodel(self, blob_names: Sequence[str]) -> keras.Model:
        """A model with the same inputs whose outputs are the named blobs (their final value,
        after any in-place layers), e.g. to extract features at ``"pool5"``."""
        missing = [b for b in blob_names if b not in self.blobs]
        if missing:
            raise KeyError(f"unknown blob(s) {missing}; known: {sorted(self.blobs)}")
        return keras.Model(self.model.inputs, [self.blobs[b] for b in blob_names])


SUPPORTED_TYPES: Tuple[str, ...] = tuple(sorted(set(CONVERTERS) | {"Input", "Split",
                                                                     "Silence"}
                                                | set(DATA_TYPES) | set(HEAD_TYPES)))


# --------------------------------------------------------------------------------------------
# build_net


def _prepare(net_param, source) -> Tuple[object, NetSource]:
    net = proto.NetParameter()
    net.CopyFrom(net_param)
    src: Optional[NetSource] = source if isinstance(source, NetSource) else None
    path = str(source) if isinstance(source, (str, os.PathLike)) else (
        src.path if src else "<net>")
    needs_upgrade = bool(len(net.layers) or len(net.input))
    if src is None and isinstance(source, (str, os.PathLike)) and Path(path).is_file():
        try:
            _, src_guess = parse_net(Path(path).read_text(encoding="utf-8"), path=path)
        except (KerasCCTError, OSError, UnicodeDecodeError):
            src_guess = None
        if needs_upgrade:
            upgrade_net(net, path=path)
        if src_guess is not None and len(src_guess.layer_lines) == len(net.layer):
            src = src_guess
    elif needs_upgrade:
        upgrade_net(net, path=path)
    if src is None or len(src.layer_lines) != len(net.layer):
        src = NetSource(path, [None] * len(net.layer))
    return net, src


def _shape_of(dims) -> Tuple[int, ...]:
    return tuple(int(d) for d in dims)


def _data_top_shapes(ctx: Ctx, lp, input_shapes: Mapping[str, Sequence[int]]
                     ) -> List[Tuple[int, ...]]:
    """Caffe shapes of a data layer's tops, from ``input_shapes`` or the layer's own fields."""
    shapes: List[Optional[Tuple[int, ...]]] = []
    batch = None
    t = lp.type
    if t == "MemoryData":
        p = lp.memory_data_param
        batch = int(p.batch_size)
        known = [(batch, int(p.channels), int(p.height), int(p.width)), (batch,)]
    elif t == "DummyData":
        p = lp.dummy_data_param
        known = []
        for i in range(len(lp.top)):
            if len(p.shape):
                known.append(_shape_of(p.shape[min(i, len(p.shape) - 1)].dim))
            elif len(p.num):
                j = min(i, len(p.num) - 1)
                known.append((p.num[j], p.channels[j], p.height[j], p.width[j]))
    else:
        pname = {"Data": "data_param", "ImageData": "image_data_param",
                 "HDF5Data": "hdf5_data_param", "WindowData": "window_data_param"}[t]
        p = getattr(lp, pname)
        batch = int(p.batch_size) if p.HasField("batch_size") else None
        known = []
        if t == "ImageData" and p.new_height and p.new_width:
            c = 3 if p.is_color else 1
            crop = lp.transform_param.crop_size
            h, w = (crop, crop) if crop else (p.new_height, p.new_width)
            known = [(batch or 1, c, h, w)]
    # All tops of a data layer share its batch: a batch given for one top in input_shapes
    # (e.g. data=32,3,227,227 for a layer with batch_size 256) is the batch of the others
    # (the label) too. DummyData's tops have their own shapes and are left alone.
    given = {_shape_of(input_shapes[top])[0] for top in lp.top if top in input_shapes}
    given.discard(0)
    if t != "DummyData" and len(given) > 1:
        named = ", ".join(f"{top}={','.join(map(str, input_shapes[top]))}"
                          for top in lp.top if top in input_shapes)
        raise ctx.error(f"{t} layer tops are given different batch sizes ({named})",
                        hint="the tops of a data layer share one batch size")
    if t != "DummyData" and given:
        batch = given.pop()
        known = [(batch,) + tuple(k[1:]) for k in known]
    for i, top in enumerate(lp.top):
        if top in input_shapes:
            shapes.append(_shape_of(input_shapes[top]))
        elif i < len(known):
            shapes.append(known[i])
        elif i == 1 and t != "DummyData":
            shapes.append((batch or 1,))  # the label blob: (N,)
        else:
            raise ctx.error(f"{t} layer top '{top}' has no known shape",
                            hint=f"pass input_shapes={{'{top}': (N, C, H, W)}} to build_net "
                                 f"(load_net / import_net: input_shape=)")
    return shapes  # type: ignore[return-value]


def build_net(net_param, *, phase: str = "TEST", stages: Sequence[str] = (),
              input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
              source: Union[None, PathLike, NetSource] = None, level: int = 0,
              conv_impl: str = "hybrid", conv_options: Optional[Mapping] = None,
              python_layers: bool = False, fuse: bool = True,
              _drop_heads: bool = False) -> CaffeNet:
    """Build the Keras model of a Caffe net for one phase.

    Args:
        net_param: a ``NetParameter`` (any format; V0/V1 and ``input:`` fields are upgraded).
        phase: ``"TRAIN"`` or ``"TEST"``: selects layers by their include/exclude rules.
        stages: the net state's stages (for ``stage``/``not_stage`` rules).
        input_shapes: Caffe shape ``(N, C, H, W)`` (or ``(N, ...)``) per input blob name;
            overrides the prototxt, and is needed for data layers whose shape the prototxt does
            not give.
        source: the prototxt path (or a :class:`NetSource`), used in error messages.
        level: the net state's level.
        conv_impl: ``"hybrid"`` (:class:`keras_cct.HybridConv2D`, the default) or ``"keras"``
            (``keras.layers.Conv2D`` after a ``ZeroPadding2D`` named ``<layer>_pad``: the
            same net with Keras' own convolution, e.g. to compare speed; same weights).
        conv_options: extra keyword arguments for every convolution layer, e.g.
            ``{"lowering": "type1"}`` or ``{"device": "opencl:0:0"}`` for HybridConv2D.
        python_layers: build ``Python`` layers: import each ``python_param.module`` (from the
            prototxt's folder, then ``sys.path``) and run its class's methods. Off by default:
            a Python layer is then an error naming the module and class.
        fuse: apply each in-place ``Scale`` in the fused op of the ``BatchNorm`` before it
            (:mod:`keras_cct.caffe.net.fusion`; same layers, names and weights), and pool a
            ``ReLU``'s input where a MAX ``Pooling`` reads its output, the ReLU applied to the
            pooled values (the same values and gradients; the ReLU's output stays reachable as
            its blob, computed only where something reads it, and leaves the model's layer
            list). Off, every
            layer computes its own blob, as Caffe's layer-by-layer ``forward(end=...)`` shows
            it.

    Returns:
        :class:`CaffeNet`. Its model's outputs are the blobs the heads consume followed by the
        blobs no layer consumes (sorted by name, as Caffe orders its outputs).

    Raises:
        CaffeFormatError: naming the file, line and layer: unknown layer type (the supported
            ones are listed), a bottom no earlier layer produces, bad parameters, shapes.
    """
    input_shapes = dict(input_shapes or {})
    net, src = _prepare(net_param, source)
    ph = phase_value(phase)
    net, src = filter_net(net, phase=ph, stages=stages, level=level, source=src)
    if conv_impl not in ("hybrid", "keras"):
        raise ValueError(f"conv_impl must be 'hybrid' or 'keras', got {conv_impl!r}")
    ctx = Ctx(src, ph, conv_impl, conv_options, python_layers=python_layers, fuse=fuse)
    blobs: Dict[str, object] = {}
    available: List[str] = []
    input_tensors: List[object] = []
    inputs: Dict[str, Shape] = {}
    input_names: Dict[str, str] = {}
    heads: List[Head] = []
    head_blobs: Dict[str, object] = {}
    used_names: Dict[str, int] = {}
    consumed: set = set()
    caffe_names: Dict[str, str] = {}
    all_layer_names = {keras_name(lp.name) for lp in net.layer}

    def claim(kname: str, what: str) -> None:
        if kname in used_names:
            raise ctx.error(f"duplicate {what} name '{kname}' (also at layer #"
                            f"{used_names[kname] + 1})", hint="Keras needs unique layer names")
        used_names[kname] = ctx.index

    def add_input(top: str, cshape: Tuple[int, ...]) -> None:
        if top in blobs:
            raise ctx.error(f"input blob '{top}' is produced twice")
        if any(d <= 0 for d in cshape[1:]):
            raise ctx.error(f"input '{top}' has a non-positive dimension {cshape}")
        check_input(ctx, top, cshape)
        kshape = keras_shape(cshape)
        name = keras_name(top)
        if name in used_names or (name in all_layer_names and name != ctx.kname()):
            name = ctx.kname() if ctx.kname() not in used_names else f"{name}_input"
        claim(name, "input")
        t = keras.Input(shape=kshape[1:], name=name)
        blobs[top] = t
        available.append(top)
        input_tensors.append(t)
        inputs[top] = (cshape[0] if cshape[0] > 0 else None,) + tuple(kshape[1:])
        if ctx.batch is None and cshape[0] > 0:
            ctx.batch = int(cshape[0])
        input_names[top] = name

    for i, lp in enumerate(net.layer):
        ctx.index, ctx.lp = i, lp
        t = lp.type
        for b in lp.bottom:
            if b not in blobs:
                raise ctx.error(f"bottom blob '{b}' is not produced by any earlier layer",
                                hint="check the spelling, the layer order and the "
                                     "include/exclude phase rules")
        if t == "Input":
            shapes = lp.input_param.shape
            for j, top in enumerate(lp.top):
                if top in input_shapes:
                    cshape = _shape_of(input_shapes[top])
                elif len(shapes) == len(lp.top):
                    cshape = _shape_of(shapes[j].dim)
                elif len(shapes) == 1:
                    cshape = _shape_of(shapes[0].dim)
                else:
                    raise ctx.error(f"input '{top}' has no shape",
                                    hint=f"give input_param {{ shape {{ dim: ... }} }} or "
                                         f"input_shape=(N, C, H, W) for '{top}'")
                add_input(top, cshape)
            continue
        if t in DATA_TYPES:
            for top, cshape in zip(lp.top, _data_top_shapes(ctx, lp, input_shapes)):
                add_input(top, cshape)
            continue
        if t in HEAD_TYPES and _drop_heads:
            continue
        for b in lp.bottom:
            if b in available:
                available.remove(b)
            consumed.add(b)
        if t in HEAD_TYPES:
            heads.append(head_of(lp))
            for b in lp.bottom:
                head_blobs.setdefault(b, blobs[b])
            continue
        if t == "Split":
            for top in lp.top:
                blobs[top] = blobs[lp.bottom[0]]
                available.append(top)
            continue
        if t == "Silence":
            continue
        conv = CONVERTERS.get(t)
        if conv is None:
            raise ctx.error(f"unsupported layer type '{t}'",
                            hint=f"supported types: {', '.join(SUPPORTED_TYPES)}")
        if not len(lp.bottom) and t not in NO_BOTTOM:
            raise ctx.error(f"{t} layer has no bottom")
        if t in ONE_TOP and len(lp.top) != 1:
            raise ctx.error(f"{t} layer must have exactly one top, has {len(lp.top)}")
        claim(ctx.kname(), "layer")
        caffe_names[ctx.kname()] = lp.name
        xs = [blobs[b] for b in lp.bottom]
        if not lp.bottom and t in NO_BOTTOM and input_tensors:
            xs = [input_tensors[0]]  # a Keras layer needs an input: the net's first, unused
        check_layer(ctx, lp, xs)
        try:
            outs = conv(ctx, lp, xs)
        except CaffeFormatError:
            raise
        except (ValueError, KerasCCTError, TypeError) as exc:
            raise ctx.error(f"cannot build the {t} layer: {exc}") from None
        if len(outs) != len(lp.top):
            raise ctx.error(f"{t} layer produced {len(outs)} outputs for {len(lp.top)} tops")
        for top, out in zip(lp.top, outs):
            blobs[top] = out
            if top in available:
                available.remove(top)
            available.append(top)

    if not input_tensors:
        raise CaffeFormatError("the net has no inputs (no Input/data layer nor `input:`)",
                               path=src.path, hint="add an Input layer or input_shape")
    # outputs: blobs the heads consume, then the blobs no layer consumes (Caffe: sorted)
    out_names: List[str] = []
    out_tensors: List[object] = []
    for b, tensor in head_blobs.items():
        out_names.append(b)
        out_tensors.append(tensor)
    for b in sorted(set(available)):
        if b in head_blobs:
            continue
        if _drop_heads and b in inputs:
            continue  # an input nothing uses (a label in a TEST net): not an output
        out_names.append(b)
        out_tensors.append(blobs[b])
    if not out_tensors:
        raise CaffeFormatError("the net has no outputs", path=src.path)
    keep_inputs = [(top, t) for top, t in zip(inputs, input_tensors)]
    if _drop_heads:
        keep_inputs = [(top, t) for top, t in keep_inputs if top in consumed or
                       top in out_names]
    final_outputs: List[object] = []
    output_layer_names: List[str] = []
    for b, tensor in zip(out_names, out_tensors):
        producer = tensor._keras_history.operation.name
        want = keras_name(b)
        if producer == want:
            final_outputs.append(tensor)
            output_layer_names.append(want)
            continue
        name = want if want not in used_names else f"{want}_blob"
        while name in used_names:
            name += "_"
        used_names[name] = -1
        final_outputs.append(keras.layers.Identity(name=name)(tensor))
        output_layer_names.append(name)
    model_name = keras_name(net.name or "caffe_net")
    try:
        model = keras.Model(inputs=[t for _, t in keep_inputs], outputs=final_outputs,
                            name=model_name)
    except ValueError as exc:
        raise CaffeFormatError(f"cannot assemble the model: {exc}", path=src.path) from None
    if fuse:
        fuse_batch_norm_scale(model.layers, list(blobs.values()) + final_outputs +
                              list(head_blobs.values()))
    return CaffeNet(model=model, inputs={top: inputs[top] for top, _ in keep_inputs},
                    heads=heads, outputs=out_names, net_param=net,
                    phase="TRAIN" if ph == proto.TRAIN else "TEST", caffe_names=caffe_names,
                    output_layer_names=output_layer_names, blobs=dict(blobs))


# --------------------------------------------------------------------------------------------
# load_net


def _input_shapes_arg(net, input_shape) -> Dict[str, Tuple[int, ...]]:
    if input_shape is None:
        return {}
    if isinstance(input_shape, Mapping):
        return {k: tuple(int(d) for d in v) for k, v in input_shape.items()}
    names = []
    for lp in net.layer:
        if lp.type == "Input" or lp.type in DATA_TYPES:
            names.extend(lp.top[:1])
    names.extend(net.input)
    if not names:
        raise CaffeFormatError("input_shape given but the net has no input")
    return {names[0]: tuple(int(d) for d in input_shape)}


def import_net(prototxt, weights=None, *, phase: str = "TEST", stages: Sequence[str] = (),
               input_shape=None, strict: bool = True, conv_impl: str = "hybrid",
               conv_options: Optional[Mapping] = None, python_layers: bool = False) -> CaffeNet:
    """Like :func:`load_net` but returns the :class:`CaffeNet` (model, inputs, outputs)."""
    if isinstance(prototxt, (str, os.PathLike)):
        net, source = read_net(prototxt, with_source=True)
    else:
        net, source = prototxt, None
    shapes = _input_shapes_arg(net, input_shape)
    built = build_net(net, phase=phase, stages=stages, input_shapes=shapes, source=source,
                      conv_impl=conv_impl, conv_options=conv_options,
                      python_layers=python_layers, _drop_heads=True)
    if weights is not None:
        load_weights(built, weights, strict=strict, net_param=built.net_param)
    return built


def load_net(prototxt, weights=None, *, phase: str = "TEST", stages: Sequence[str] = (),
             input_shape=None, strict: bool = True, conv_impl: str = "hybrid",
             conv_options: Optional[Mapping] = None, python_layers: bool = False) -> keras.Model:
    """Import a Caffe network (and its trained weights) as a functional ``keras.Model``.

    Args:
        prototxt: the .prototxt path (or a ``NetParameter``).
        weights: an optional .caffemodel path (or ``NetParameter``); layers are matched by
            name and the caffemodel's extra layers (data, losses of the TRAIN net) ignored.
        phase, stages: the net state selecting layers by their include/exclude rules.
        input_shape: Caffe shape ``(N, C, H, W)`` of the (first) input, or a dict per input
            blob name; needed when the prototxt gives none (or to change the image size).
        strict: a weighted layer missing from ``weights`` is an error (else a warning).
        conv_impl, conv_options: how convolutions are built (see :func:`build_net`).
        python_layers: build ``Python`` layers by importing their modules (see
            :func:`build_net`); without it a Python layer is an error.

    Returns:
        A ``keras.Model`` with channels-last inputs (one per Caffe input, named by the blob)
        and outputs (the blobs no layer consumes, sorted by name as Caffe does, named by the
        blob); Keras layer names are Caffe layer names (``/`` -> ``__``). Loss and accuracy
        layers are dropped.

    Raises:
        CaffeFormatError: for any problem in either file, naming the file, the line (text) or
            the layer, and how to fix it. Nothing is returned half-built.
    """
    return import_net(prototxt, weights, phase=phase, stages=stages, input_shape=input_shape,
                      strict=strict, conv_impl=conv_impl, conv_options=conv_options,
                      python_layers=python_layers).model
