"""Converters for recurrent layers (LSTM, RNN, LSTMUnit) and opt-in Python layers:
``(ctx, layer_param, bottom tensors) -> list of top tensors``, merged into
:data:`keras_cct.caffe.net.converters.CONVERTERS`.

LSTM and RNN without ``expose_hidden`` carry their last hidden state to the next call, as
Caffe does (:class:`~keras_cct.caffe.net.layers.recurrent.CaffeRecurrentState`).

A ``Python`` layer is built only when the caller asked for it (``python_layers=True``, which
sets ``ctx.python_layers``); otherwise it is a :class:`~keras_cct.errors.CaffeFormatError`
naming the module and class the file wants to run and how to allow it."""

from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Set

from keras_cct.caffe.io import proto
from keras_cct.caffe.net.context import Ctx
from keras_cct.caffe.net.layers.recurrent import (FILLER_TYPES, CaffeLSTM, CaffeLSTMUnit,
                                                  CaffePythonLayer, CaffeRecurrentState,
                                                  CaffeRNN)
from keras_cct.caffe.net.layout import caffe_shape
from keras_cct.errors import CaffeFormatError

__all__ = ["CONVERTERS", "MULTI_TOP"]


def _filler(ctx: Ctx, lp, field: str) -> Optional[dict]:
    p = lp.recurrent_param
    if not p.HasField(field):
        return None
    f = getattr(p, field)
    if f.type not in FILLER_TYPES:
        raise ctx.error(f"recurrent_param.{field} type '{f.type}' is not supported",
                        hint=f"use one of {', '.join(FILLER_TYPES)} (or load trained weights)")
    return {"type": f.type, "value": f.value, "min": f.min, "max": f.max, "mean": f.mean,
            "std": f.std, "variance_norm": proto.FillerParameter.VarianceNorm.Name(f.variance_norm)}


def _recurrent(cls, states: int):
    def build(ctx: Ctx, lp, xs):
        p = lp.recurrent_param
        t = lp.type
        if p.num_output <= 0:
            raise ctx.error(f"{t} needs recurrent_param {{ num_output: ... }} > 0")
        exposed = states if p.expose_hidden else 0
        n_tops = 1 + exposed
        if len(lp.top) != n_tops:
            raise ctx.error(f"{t} has {len(lp.top)} tops, expected {n_tops}"
                            + (" (output, then the last hidden states)" if exposed else ""),
                            hint="expose_hidden adds the last hidden states as tops")
        if len(xs) not in (2 + exposed, 3 + exposed):
            raise ctx.error(f"{t} has {len(xs)} bottoms, expected x, cont[, x_static]"
                            + (" and the first hidden states" if exposed else ""))
        x, cont = xs[0], xs[1]
        xc, cc = caffe_shape(x.shape), caffe_shape(cont.shape)
        if len(xc) < 3:
            raise ctx.error(f"{t}'s x must be (T, N, ...), got Caffe shape {xc}")
        if len(cc) != 2 or cc[1] != xc[1]:
            raise ctx.error(f"{t}'s cont must be (T, N) = (T, {xc[1]}), got Caffe shape {cc}")
        static = len(xs) == 3 + exposed
        if static and caffe_shape(xs[2].shape)[0] not in (None, xc[1]):
            raise ctx.error(f"{t}'s x_static must have N = {xc[1]} rows, got Caffe shape "
                            f"{caffe_shape(xs[2].shape)}")
        for s in xs[2 + int(static):]:
            want = (1, xc[1], int(p.num_output))
            if caffe_shape(s.shape)[1:] != want[1:]:
                raise ctx.error(f"{t}'s hidden-state bottom must be {want}, got Caffe shape "
                                f"{caffe_shape(s.shape)}")
        # without expose_hidden, Caffe carries h_T (, c_T) to the next forward pass: the layer
        # gets state inputs/outputs, wired to a CaffeRecurrentState
        layer = cls(int(p.num_output), static_input=static, expose_hidden=True,
                    weight_filler=_filler(ctx, lp, "weight_filler"),
                    bias_filler=_filler(ctx, lp, "bias_filler"), name=ctx.kname())
        if p.expose_hidden:
            return list(layer(list(xs)))
        carry = CaffeRecurrentState(states, int(p.num_output), int(xc[1]),
                                    name=ctx.kname() + "_state")
        out = layer(list(xs) + list(carry(x)))
        return [carry(list(out))]
    return build


def _lstm_unit(ctx: Ctx, lp, xs):
    if len(xs) != 3 or len(lp.top) != 2:
        raise ctx.error("LSTMUnit needs 3 bottoms (c_prev, x, cont) and 2 tops (c, h)")
    c, x, cont = (caffe_shape(v.shape) for v in xs)
    if len(c) != 3 or len(x) != 3 or len(cont) != 2:
        raise ctx.error(f"LSTMUnit needs c_prev (1, N, H), x (1, N, 4H), cont (1, N); got "
                        f"Caffe shapes {c}, {x}, {cont}")
    if x[2] != 4 * c[2] or x[1] != c[1] or cont[1] != c[1]:
        raise ctx.error(f"LSTMUnit shapes disagree: c_prev {c}, x {x} (needs (1, N, 4H)), "
                        f"cont {cont}")
    return list(CaffeLSTMUnit(name=ctx.kname())(list(xs)))


def _python(ctx: Ctx, lp, xs):
    p = lp.python_param
    if not p.module or not p.layer:
        raise ctx.error("Python layer needs python_param { module: ... layer: ... }")
    what = f"{p.module}.{p.layer}"
    if not getattr(ctx, "python_layers", False):
        raise ctx.error(f"this Python layer would import and run Python code: module "
                        f"'{p.module}', class '{p.layer}' ({what})",
                        hint="if you trust the file and that module, allow it with "
                             "python_layers=True (load_net / import_net / build_net / "
                             "caffe.Net / load_solver) or --python-layers (cct)")
    path = ctx.source.path
    folder = os.path.dirname(os.path.abspath(path)) if path and os.path.isfile(path) else None
    try:
        layer = CaffePythonLayer(p.module, p.layer, param_str=p.param_str, phase=ctx.phase,
                                 search_path=folder, num_tops=len(lp.top),
                                 batch_hint=ctx.batch, name=ctx.kname())
        out = layer(list(xs))
    except ImportError as exc:
        raise ctx.error(f"cannot import the Python layer's module '{p.module}': {exc}",
                        hint="put the module beside the prototxt or on PYTHONPATH") from None
    except CaffeFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's setup/reshape may raise anything
        raise ctx.error(f"Python layer {what} failed to set up: "
                        f"{type(exc).__name__}: {exc}",
                        hint="its setup() and reshape() run on zero-filled bottoms of the "
                             "net's shapes") from None
    return list(out) if isinstance(out, (list, tuple)) else [out]


CONVERTERS: Dict[str, Callable] = {
    "LSTM": _recurrent(CaffeLSTM, 2), "RNN": _recurrent(CaffeRNN, 1),
    "LSTMUnit": _lstm_unit, "Python": _python,
}
MULTI_TOP: Set[str] = {"LSTM", "RNN", "LSTMUnit", "Python"}  # may have several tops
