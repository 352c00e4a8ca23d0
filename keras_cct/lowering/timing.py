"""keras_cct's one timing harness: one compiled forward(+backward) step of a convolution
(:func:`make_step`, for the planner and the benchmarks) or of any Keras layer
(:func:`layer_steps`, for ``cct time`` and the benchmarks), per backend
(:mod:`keras_cct.lowering._backend`), and the timer (:func:`best_of`, :func:`block`). A
forward+backward step always includes the forward: its output (or the loss) is fetched, so
TensorFlow and XLA cannot prune it."""

from __future__ import annotations

import time
from typing import Callable, Dict, Hashable, Optional, Tuple, TypeVar, Union

import numpy as np

from keras_cct.lowering import _backend as B
from keras_cct.lowering.dispatch import conv2d_geo as _conv2d_geo
from keras_cct.lowering.geometry import ConvGeometry

K = TypeVar("K", bound=Hashable)


def best_of(step: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Best wall time (seconds) of ``repeats`` calls of ``step`` after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved_best(steps: Dict[K, Callable[[], object]], repeats: int, *,
                     min_timed_s: float = 0.0, max_rounds: int = 0,
                     drop_behind: Optional[float] = None) -> Dict[K, float]:
    """Best wall time (seconds) of each of ``steps`` (warmed up already) over ``repeats``
    rounds in which each is called once, the order rotated every round (side by side, so that
    a burst of load on a busy machine does not fall on one step only), and further rounds, up to
    ``max_rounds`` in all, while some step has less than ``min_timed_s`` seconds of timed calls.
    With ``drop_behind``, a step whose best time is more than that factor behind the fastest
    one's after a round is timed no more (its best so far is returned), and the rounds end when
    one is left."""
    names = tuple(steps)
    best = {name: float("inf") for name in names}
    timed = {name: 0.0 for name in names}
    rnd, running = 0, names
    while rnd < repeats or (rnd < max_rounds and
                            min(timed[name] for name in running) < min_timed_s):
        order = running[rnd % len(running):] + running[:rnd % len(running)]
        for name in order:
            t0 = time.perf_counter()
            steps[name]()
            dt = time.perf_counter() - t0
            best[name] = min(best[name], dt)
            timed[name] += dt
        rnd += 1
        if drop_behind is not None and len(running) > 1:
            lead = min(best[name] for name in running)
            running = tuple(name for name in running if best[name] <= drop_behind * lead)
            if len(running) == 1:
                break
    return best


def make_step(geo: ConvGeometry, lowering: Union[str, Callable], x: np.ndarray,
              kernel: np.ndarray, *, training: bool = True, jit_compile: bool = False,
              dtype: Optional[str] = None, bias: bool = False) -> Callable[[], None]:
    """A no-argument callable running ``lowering`` on ``x``/``kernel`` (and the gradients of
    ``loss = sum(y * r)`` with respect to each input, if ``training``).

    Every step fetches the loss as well as the gradients, so the forward pass is always part of
    the time (TensorFlow and XLA would otherwise drop a forward convolution whose output no
    gradient needs). ``lowering`` is a lowering name or any ``fn(x, kernel, geo)`` computing the
    convolution; ``dtype`` (e.g. ``"bfloat16"``) casts the float32 inputs on the backend;
    ``bias`` adds a bias as the layer does (:func:`~keras_cct.lowering.dispatch.conv2d_geo`)
    and differentiates it too: a layer with a bias is timed as it runs (on JAX, XLA schedules
    a step with a bias gradient differently: ResNet-50's conv1, native, 48 ms without and 32
    with).
    """
    if callable(lowering):
        conv_fn = lowering

        def conv2d_geo(xx, kk, g, _name, bb=None):
            y = conv_fn(xx, kk, g)
            return y if bb is None else y + bb
    else:
        conv2d_geo = _conv2d_geo

    # float32 drawn as such: float64 draws cast down took 0.85 s for VGG16 conv1_2's output
    # at 8 images (6.4M values) on an Intel Xeon -- per candidate, in the planner's first use
    rng = np.random.default_rng(1)
    r = rng.standard_normal((x.shape[0], geo.out_h, geo.out_w, geo.filters),
                            dtype=np.float32).astype(x.dtype, copy=False)
    args = [x, kernel]
    if bias:
        args.append(rng.standard_normal(geo.filters, dtype=np.float32).astype(x.dtype,
                                                                          copy=False))
    return B.conv_step(lambda xx, kk, bb=None: conv2d_geo(xx, kk, geo, lowering, bb), args, r,
                       training=training, jit_compile=jit_compile, dtype=dtype)


def layer_steps(layer, xs) -> Tuple[Callable, Callable]:
    """``(forward, forward_backward)`` for ``layer`` on the inputs ``xs`` (a list; one input is
    passed alone, several as a list): both take ``*xs``; ``forward_backward`` computes the
    output and its backward pass for the cotangent ``dy`` (fixed random, one per output; as
    PyTorch's ``y.backward(dy)``): the gradients with respect to the floating-point inputs and
    the layer's weights, returned (with the output on TensorFlow and JAX, where the forward
    would be pruned otherwise). Wrap a call in :func:`block` to wait for it."""
    y0 = layer(xs[0] if len(xs) == 1 else list(xs))
    outs = y0 if isinstance(y0, (list, tuple)) else [y0]
    rng = np.random.default_rng(0)
    dys = [rng.standard_normal(tuple(o.shape)).astype("float32") for o in outs]
    return B.layer_steps(layer, list(xs), dys)


def block(x) -> None:
    """Wait until every tensor in the structure ``x`` is computed, without computing anything
    more (a sum of each would add a pass over every gradient to the time: 151 MB for CaffeNet's
    fc6 weight gradient)."""
    import keras
    B.wait([t for t in keras.tree.flatten(x) if t is not None])
