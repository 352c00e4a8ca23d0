"""Backend-independent helpers for tests: a layer's output and its gradients."""

from __future__ import annotations

from typing import List, Tuple

import keras
import numpy as np


def to_numpy(x) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(x))


def layer_grads(layer, x: np.ndarray, dy: np.ndarray) -> Tuple[np.ndarray, List[np.ndarray]]:
    """``(y, [dx, d(weight) for each trainable weight])`` for ``loss = sum(layer(x) * dy)``."""
    backend = keras.backend.backend()
    weights = layer.trainable_weights
    if backend == "tensorflow":
        import tensorflow as tf
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt)
            loss = tf.reduce_sum(y * tf.cast(dy, y.dtype))
        grads = tape.gradient(loss, [xt] + [w.value for w in weights])
        return to_numpy(y), [to_numpy(g) for g in grads]
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def loss(xx, tw):
            y, _ = layer.stateless_call(tw, [v.value for v in layer.non_trainable_weights], xx)
            return jnp.sum(y * dy.astype(y.dtype)), y

        (_, y), (dx, dws) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            jnp.asarray(x), [w.value for w in weights])
        return to_numpy(y), [to_numpy(dx)] + [to_numpy(g) for g in dws]
    if backend == "torch":
        import torch
        xt = torch.tensor(x, requires_grad=True)
        for w in weights:
            w.value.grad = None
        y = layer(xt)
        (y * torch.tensor(dy, dtype=y.dtype)).sum().backward()
        return to_numpy(y.detach()), [to_numpy(xt.grad)] + [to_numpy(w.value.grad) for w in weights]
    raise NotImplementedError(backend)
