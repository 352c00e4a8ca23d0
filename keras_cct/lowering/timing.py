"""One compiled forward(+backward) step of a convolution per backend, for the planner's
``mode="measure"`` and the benchmarks. Each call blocks until the result is computed."""

from __future__ import annotations

import time
from typing import Callable, Optional, Union

import keras
import numpy as np

from keras_cct.lowering.dispatch import conv2d_geo as _conv2d_geo
from keras_cct.lowering.geometry import ConvGeometry


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


def make_step(geo: ConvGeometry, lowering: Union[str, Callable], x: np.ndarray,
              kernel: np.ndarray, *, training: bool = True, jit_compile: bool = False,
              dtype: Optional[str] = None) -> Callable[[], None]:
    """A no-argument callable running ``lowering`` on ``x``/``kernel`` (and the gradients of
    ``loss = sum(y * r)`` with respect to both, if ``training``).

    Every step fetches the loss as well as both gradients, so the forward pass is always part of
    the time (TensorFlow and XLA would otherwise drop a forward convolution whose output no
    gradient needs). ``lowering`` is a lowering name or any ``fn(x, kernel, geo)`` computing the
    convolution; ``dtype`` (e.g. ``"bfloat16"``) casts the float32 inputs on the backend.
    """
    if callable(lowering):
        conv_fn = lowering

        def conv2d_geo(xx, kk, g, _name):
            return conv_fn(xx, kk, g)
    else:
        conv2d_geo = _conv2d_geo

    backend = keras.backend.backend()
    r = np.random.default_rng(1).standard_normal(
        (x.shape[0], geo.out_h, geo.out_w, geo.filters)).astype(x.dtype)
    if backend == "tensorflow":
        import tensorflow as tf
        tx, tk, tr = (tf.cast(tf.constant(a), dtype or a.dtype) for a in (x, kernel, r))

        @tf.function(jit_compile=jit_compile)
        def run(xx, kk, rr):
            if not training:
                return tf.reduce_sum(conv2d_geo(xx, kk, geo, lowering)[:1, :1, :1, :1])
            with tf.GradientTape() as tape:
                tape.watch([xx, kk])
                loss = tf.reduce_sum(conv2d_geo(xx, kk, geo, lowering) * rr)
            dx, dk = tape.gradient(loss, [xx, kk])
            return loss + tf.reduce_sum(dx[:1, :1, :1, :1]) + tf.reduce_sum(dk[:1, :1, :1, :1])

        return lambda: run(tx, tk, tr).numpy()
    if backend == "jax":
        import jax
        import jax.numpy as jnp
        jx, jk, jr = (jnp.asarray(a, dtype=dtype or a.dtype) for a in (x, kernel, r))

        def loss(xx, kk):
            return jnp.sum(conv2d_geo(xx, kk, geo, lowering) * jr)

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)) if training else
                     (lambda xx, kk: conv2d_geo(xx, kk, geo, lowering)))
        return lambda: jax.block_until_ready(fn(jx, jk))
    if backend == "torch":
        import torch
        tdtype = getattr(torch, dtype) if dtype else None
        tx = torch.tensor(x, dtype=tdtype, requires_grad=training)
        tk = torch.tensor(kernel, dtype=tdtype, requires_grad=training)
        tr = torch.tensor(r, dtype=tdtype)

        def step():
            if training:
                (conv2d_geo(tx, tk, geo, lowering) * tr).sum().backward()
                tx.grad = None
                tk.grad = None
            else:
                with torch.no_grad():
                    conv2d_geo(tx, tk, geo, lowering)

        return step
    raise NotImplementedError(f"no timing for backend {backend!r}")
