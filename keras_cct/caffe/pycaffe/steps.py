"""A built net as a list of Caffe layers (:class:`Step`), each runnable on its own: the Keras
graph between the layer's bottom blobs and its tops in the imported model, found through the
Keras layer that bears the Caffe layer's name (in-place layers rebind their blob, as the
builder does)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import keras

from keras_cct.caffe.io.types import DATA_TYPES
from keras_cct.caffe.net.layout import caffe_shape
from keras_cct.caffe.net.losses import HEAD_TYPES, Head, head_of
from keras_cct.caffe.net.weights import keras_name
from keras_cct.errors import CaffeFormatError

__all__ = ["Step", "make_steps"]


@dataclass
class Step:
    """One Caffe layer of a :class:`~keras_cct.caffe.pycaffe.Net`.

    Attributes:
        kind: ``"input"`` (Input layer), ``"data"`` (a data layer), ``"head"`` (a loss or
            metric layer, evaluated by ``head_value``), ``"split"``, ``"silence"`` or
            ``"layer"`` (run by ``fn``).
        fn: a ``keras.Model`` from the distinct bottoms (``fn_inputs``) to the tops.
        layer: the Keras layer named after the Caffe layer (holding its weights), if any.
    """

    name: str
    type: str
    lp: object
    kind: str
    bottoms: List[str]
    tops: List[str]
    fn: Optional[keras.Model] = None
    fn_inputs: List[str] = field(default_factory=list)
    layer: Optional[keras.layers.Layer] = None
    head: Optional[Head] = None


def _outputs_of(layer) -> list:
    nodes = getattr(layer, "_inbound_nodes", [])
    if len(nodes) != 1:
        return []
    return list(nodes[0].output_tensors)


def make_steps(model: keras.Model, net_param, input_blobs: Sequence[str],
               batch: Optional[int] = None
               ) -> Tuple[List[Step], "OrderedDict[str, Tuple[Optional[int], ...]]"]:
    """The :class:`Step` of each layer of ``net_param`` (phase-filtered, as built) and the
    Caffe shape of each blob in Caffe's order of first appearance (batch: ``batch``, else the
    prototxt's)."""
    tensors: Dict[str, object] = {}
    for name, t in zip(input_blobs, model.inputs):
        tensors[name] = t
    layers = {l.name: l for l in model.layers}
    steps: List[Step] = []
    shapes: "OrderedDict[str, Tuple[Optional[int], ...]]" = OrderedDict()
    declared: Dict[str, Tuple[int, ...]] = {}

    def note(top: str, shape) -> None:
        if top not in shapes:
            shapes[top] = tuple(shape)

    for lp in net_param.layer:
        t, name = lp.type, lp.name
        bottoms, tops = list(lp.bottom), list(lp.top)
        if t == "Input" or t in DATA_TYPES:
            kind = "input" if t == "Input" else "data"
            for j, top in enumerate(tops):
                if top not in tensors:
                    continue  # an input the model does not use
                shape = caffe_shape(tuple(tensors[top].shape))
                if t == "Input" and len(lp.input_param.shape):
                    dims = lp.input_param.shape[min(j, len(lp.input_param.shape) - 1)].dim
                    if len(dims) and dims[0] > 0:
                        declared[top] = tuple(int(d) for d in dims)
                note(top, shape)
            steps.append(Step(name, t, lp, kind, bottoms, [x for x in tops if x in tensors]))
            continue
        missing = [b for b in bottoms if b not in tensors and b not in shapes]
        if missing:
            raise CaffeFormatError(f"bottom blob(s) {missing} are not produced by the model",
                                   layer=name)
        if t in HEAD_TYPES:
            head = head_of(lp)
            for top in tops[:1]:
                note(top, ())
            steps.append(Step(name, t, lp, "head", bottoms, tops[:1], head=head))
            continue
        if t == "Split":
            for top in tops:
                tensors[top] = tensors[bottoms[0]]
                note(top, caffe_shape(tuple(tensors[top].shape)))
            steps.append(Step(name, t, lp, "split", bottoms, tops))
            continue
        if t == "Silence":
            steps.append(Step(name, t, lp, "silence", bottoms, []))
            continue
        layer = layers.get(keras_name(name))
        outs = _outputs_of(layer) if layer is not None else []
        if len(outs) != len(tops):
            raise CaffeFormatError(f"the {t} layer has no Keras layer of its name with "
                                   f"{len(tops)} output(s) in the model", layer=name,
                                   hint="the pycaffe Net needs one Keras layer per Caffe layer")
        fn_inputs = list(dict.fromkeys(bottoms))
        try:
            fn = keras.Model([tensors[b] for b in fn_inputs], outs, name=f"step_{keras_name(name)}")
        except ValueError as exc:
            raise CaffeFormatError(f"cannot run the {t} layer on its own: {exc}",
                                   layer=name) from None
        for top, out in zip(tops, outs):
            tensors[top] = out
            note(top, caffe_shape(tuple(out.shape)))
        steps.append(Step(name, t, lp, "layer", bottoms, tops, fn, fn_inputs, layer))
    n = batch
    if n is None:
        n = next((s[0] for s in declared.values()), None)
    if n is None:
        n = next((s[0] for s in shapes.values() if s and s[0] is not None), 1)
    out: "OrderedDict[str, Tuple[Optional[int], ...]]" = OrderedDict()
    for name, shape in shapes.items():
        if shape and shape[0] is None:
            shape = (n,) + tuple(shape[1:])
        out[name] = tuple(shape)
    return steps, out
