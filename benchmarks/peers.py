"""The candidates of :mod:`benchmarks.convs`: one convolution as a user would run it, as one
training step on the current Keras backend (and PyTorch's own ``nn.Conv2d`` beside it).

A *shape* is a dict: ``h, w, c`` (input), ``o`` (filters), ``k = [kh, kw]``, ``s = [sh, sw]``,
``pad = [[top, bottom], [left, right]]`` (Caffe's explicit padding), ``d = [dh, dw]``,
``g`` (groups), ``bias``.

Every step computes ``y = f(x)``, ``loss = sum(y * r)`` for a fixed random ``r`` and the
gradients with respect to ``x`` and every weight, and returns the loss as a Python float with
the gradients as materialized outputs, so nothing can be pruned: TensorFlow runs it as one
``tf.function``, JAX as one ``jax.jit`` of ``value_and_grad``, PyTorch eagerly (Keras' torch
backend and the ``torch_*`` peers alike, gradients by ``torch.autograd.grad``).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np

#: HybridConv2D's explicit lowerings measured beside the default (winograd F(2x2,3x3) and
#: winograd4 F(4x4,3x3) or F(4x4,5x5): stride 1 only; skipped with the reason where they do not
#: apply).
LOWERINGS = ("type1", "type2", "type3", "native", "winograd", "winograd4", "depthwise")
#: Peers: what a user would run instead of keras_cct.
PEERS = ("keras_conv2d", "keras_split", "keras_depthwise", "torch_nchw", "torch_cl")
#: Controls, not peers: ``keras_conv2d_again`` is keras Conv2D built and timed a second time,
#: beside the first. Its speed against keras Conv2D's is this run's noise floor: the default
#: HybridConv2D's ``native`` runs the very op keras Conv2D runs, and on 4-30 ms layers of a busy
#: 2-core machine two copies of one op differed by up to 12% in a best of 10 rounds.
CONTROLS = ("keras_conv2d_again",)
#: Above this many groups the lowered types and Winograd (a Python loop over groups: one GEMM
#: each; Winograd on MobileNet's 1024-group layer took 12 minutes to trace) and the Keras split
#: form (one Conv2D per group) are not run: nobody would write them.
MAX_LOOP_GROUPS = 32


class Skip(Exception):
    """The candidate does not apply to this shape (the message says why)."""


def geometry(shp: dict, batch: int):
    from keras_cct.lowering import conv_geometry
    kh, kw = shp["k"]
    return conv_geometry((batch, shp["h"], shp["w"], shp["c"]),
                         (kh, kw, shp["c"] // shp["g"], shp["o"]), strides=tuple(shp["s"]),
                         padding=tuple(tuple(p) for p in shp["pad"]),
                         dilation_rate=tuple(shp["d"]), groups=shp["g"])


def is_depthwise(shp: dict) -> bool:
    return shp["g"] > 1 and shp["g"] == shp["c"]


def applies(name: str, shp: dict, batch: int) -> Optional[str]:
    """None if candidate ``name`` is run on ``shp``, else why not."""
    g = shp["g"]
    low = name[len("hybrid_"):] if name.startswith("hybrid_") else None
    from keras_cct.lowering.dispatch import NEEDS, WINOGRAD_TILE, available
    if low in WINOGRAD_TILE and low not in available(geometry(shp, batch)):
        return f"{low}: {NEEDS[low]} only"
    if low in ("type1", "type2", "type3", "winograd", "winograd4"):
        if g > MAX_LOOP_GROUPS:
            return f"{g} groups: a Python loop of {g} GEMMs (not run)"
        from keras_cct.lowering.planner import fits_in_memory
        if not low.startswith("winograd") and not fits_in_memory(geometry(shp, batch), low, batch):
            return "temporaries exceed the memory budget (keras_cct.lowering.planner)"
    if low == "depthwise" and not is_depthwise(shp):
        return "depthwise: one input channel per group only"
    if name == "keras_split":
        if g == 1:
            return "groups = 1"
        if g > MAX_LOOP_GROUPS:
            return f"{g} groups: one Conv2D per group (not run; see keras_depthwise)"
    if name == "keras_depthwise" and not is_depthwise(shp):
        return "not depthwise"
    return None


# ------------------------------------------------------------------------------ Keras models

def _keras_padding(shp: dict, batch: int, x):
    """(padding for Conv2D, input): "same"/"valid" where equivalent to Caffe's padding, else a
    ZeroPadding2D before a "valid" convolution (what a Keras user writes)."""
    import keras
    padding = geometry(shp, batch).keras_padding
    if padding is None:
        x = keras.layers.ZeroPadding2D(tuple(tuple(p) for p in shp["pad"]))(x)
        padding = "valid"
    return padding, x


def keras_model(name: str, shp: dict, batch: int):
    """(keras.Model, the convolution layer or None) for candidate ``name``: ``hybrid`` (all of
    HybridConv2D's defaults), ``hybrid_<lowering>``, ``keras_conv2d``, ``keras_split``,
    ``keras_depthwise``."""
    import keras
    from keras import ops
    o, g, k, s, d = shp["o"], shp["g"], tuple(shp["k"]), tuple(shp["s"]), tuple(shp["d"])
    inp = keras.Input((shp["h"], shp["w"], shp["c"]), batch_size=batch)
    if name == "hybrid" or name.startswith("hybrid_"):
        from keras_cct import HybridConv2D
        extra = {} if name == "hybrid" else {"lowering": name[len("hybrid_"):]}
        try:
            layer = HybridConv2D(o, k, strides=s, padding=tuple(tuple(p) for p in shp["pad"]),
                                 dilation_rate=d, groups=g, use_bias=shp["bias"], **extra)
        except ValueError as exc:  # e.g. a lowering name not wired into HybridConv2D yet
            raise Skip(f"HybridConv2D rejects it: {exc}") from None
        return keras.Model(inp, layer(inp)), layer
    padding, x = _keras_padding(shp, batch, inp)
    common = dict(strides=s, padding=padding, dilation_rate=d, use_bias=shp["bias"])
    if name == "keras_conv2d":
        layer = keras.layers.Conv2D(o, k, groups=g, **common)
        return keras.Model(inp, layer(x)), layer
    if name == "keras_split":
        parts = ops.split(x, g, axis=-1)  # tf.split on TensorFlow: one op
        ys = [keras.layers.Conv2D(o // g, k, **common)(p) for p in parts]
        return keras.Model(inp, keras.layers.Concatenate()(ys)), None
    if name == "keras_depthwise":
        layer = keras.layers.DepthwiseConv2D(k, depth_multiplier=o // shp["c"], **common)
        return keras.Model(inp, layer(x)), layer
    raise ValueError(f"unknown Keras candidate {name!r}")


def keras_step(model, x: np.ndarray, r: np.ndarray) -> Callable[[], float]:
    """One training step of a Keras model on the current backend (see the module's doc)."""
    import keras
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf
        tx, tr = tf.constant(x), tf.constant(r)
        weights = model.trainable_weights

        @tf.function
        def step(xx, rr):
            with tf.GradientTape() as tape:
                tape.watch(xx)
                y = model(xx, training=True)
                loss = tf.reduce_sum(tf.cast(y, tf.float32) * rr)
            return loss, tape.gradient(loss, [xx] + weights)

        return lambda: float(step(tx, tr)[0])
    if backend == "jax":
        import jax
        import jax.numpy as jnp
        jx, jr = jnp.asarray(x), jnp.asarray(r)
        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]

        def loss_fn(tv_, xx, rr):  # rr an argument: a constant would be folded into the backward
            y, _ = model.stateless_call(tv_, ntv, xx, training=True)
            return jnp.sum(y.astype(jnp.float32) * rr)

        fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))

        def run():
            loss, grads = jax.block_until_ready(fn(tv, jx, jr))
            return float(loss)

        return run
    if backend == "torch":
        import torch
        dev = keras.ops.zeros(()).device  # where Keras computes (a GPU when torch sees one)
        tx = torch.tensor(x, device=dev, requires_grad=True)
        tr = torch.tensor(r, device=dev)
        params = [v.value for v in model.trainable_variables]

        def run():
            y = model(tx, training=True)
            loss = (y.float() * tr).sum()
            torch.autograd.grad(loss, [tx] + params)
            return float(loss.detach())

        return run
    raise NotImplementedError(f"no training step for backend {backend!r}")


# ------------------------------------------------------------------------------ PyTorch peers

def torch_step(shp: dict, x: np.ndarray, r: np.ndarray, *, channels_last: bool,
               bfloat16: bool) -> Callable[[], float]:
    """``torch.nn.Conv2d(groups=g)`` forward+backward, eager, on NCHW tensors (contiguous, or
    ``channels_last`` for input and module); bfloat16 by ``torch.autocast`` (float32 params).
    On a GPU when torch sees one (:func:`benchmarks.common.torch_device`), as a PyTorch user
    would run it."""
    import contextlib

    import torch

    from benchmarks.common import torch_device
    dev = torch_device()
    (pt, pb), (pl, pr) = shp["pad"]
    conv = torch.nn.Conv2d(shp["c"], shp["o"], tuple(shp["k"]), stride=tuple(shp["s"]),
                           padding=0 if (pt, pb, pl, pr) == (0, 0, 0, 0) else (pt, pl),
                           dilation=tuple(shp["d"]), groups=shp["g"], bias=shp["bias"])
    pad = None
    if pt != pb or pl != pr:  # asymmetric: torch's Conv2d pads symmetrically only
        conv.padding = (0, 0)
        pad = (pl, pr, pt, pb)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    conv = conv.to(device=dev, memory_format=fmt)
    tx = torch.tensor(x.transpose(0, 3, 1, 2), device=dev).contiguous(
        memory_format=fmt).requires_grad_()
    tr = torch.tensor(r.transpose(0, 3, 1, 2), device=dev).contiguous(memory_format=fmt)
    params = list(conv.parameters())

    def run():
        ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if bfloat16 else \
            contextlib.nullcontext()
        with ctx:
            xx = torch.nn.functional.pad(tx, pad) if pad else tx
            y = conv(xx)
        loss = (y.float() * tr).sum()
        torch.autograd.grad(loss, [tx] + params)
        return float(loss.detach())

    return run


# ------------------------------------------------------------------------------ all candidates

def candidate_names(shp: dict) -> Tuple[str, ...]:
    return ("hybrid",) + tuple(f"hybrid_{low}" for low in LOWERINGS) + PEERS + CONTROLS


def inputs(shp: dict, batch: int) -> Tuple[np.ndarray, np.ndarray]:
    geo = geometry(shp, batch)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, shp["h"], shp["w"], shp["c"])).astype("float32")
    r = rng.standard_normal((batch, geo.out_h, geo.out_w, shp["o"])).astype("float32")
    return x, r


def build(name: str, shp: dict, batch: int, x: np.ndarray, r: np.ndarray,
          bfloat16: bool) -> Tuple[Callable[[], float], Dict[str, object]]:
    """(step, info) for candidate ``name``; raises :class:`Skip` where it does not apply.
    ``info["pick"]`` is the default HybridConv2D's chosen lowering, ``info["lowering"]`` an
    explicit one's."""
    why = applies(name, shp, batch)
    if why:
        raise Skip(why)
    if name in ("torch_nchw", "torch_cl"):
        return torch_step(shp, x, r, channels_last=name == "torch_cl", bfloat16=bfloat16), {}
    model, layer = keras_model("keras_conv2d" if name == "keras_conv2d_again" else name, shp,
                               batch)
    info = {}
    if name == "hybrid":
        info["pick"] = layer.chosen_lowering
    elif name.startswith("hybrid_"):  # judged by the work it does (Winograd: fewer products)
        info["lowering"] = name[len("hybrid_"):]
    return keras_step(model, x, r), info
