"""Gradients of a scalar function of tensors and Keras variables, on the current backend
(TensorFlow's ``GradientTape``, ``jax.grad`` under a ``keras.StatelessScope``, or
``torch.autograd.grad``), and a model's random state (to replay dropout masks), for
:meth:`keras_cct.caffe.pycaffe.net.Net.backward`."""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import keras
import numpy as np

__all__ = ["gradients", "rng_state", "set_rng_state"]


def _seed_variables(model) -> list:
    return [l.seed_generator.state for l in model.layers
            if getattr(l, "seed_generator", None) is not None]


def rng_state(model) -> list:
    """The random state of ``model``'s layers (Dropout): each seed generator's state and, on
    PyTorch, the global generator that unseeded Keras dropout draws from."""
    state = [keras.ops.convert_to_numpy(v.value) for v in _seed_variables(model)]
    if keras.backend.backend() == "torch":
        import torch  # unseeded dropout uses torch's global generator
        state.append(torch.random.get_rng_state())
    return state


def set_rng_state(model, state: list) -> None:
    """Put back a state from :func:`rng_state` (the same dropout masks are drawn again)."""
    variables = _seed_variables(model)
    for v, st in zip(variables, state):
        v.assign(st)
    if keras.backend.backend() == "torch" and len(state) > len(variables):
        import torch
        torch.random.set_rng_state(state[-1])


def gradients(fn: Callable[[List], object], values: Sequence[np.ndarray],
              variables: Sequence) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """``(d fn / d values, d fn / d variables)`` as numpy arrays (zeros where ``fn`` does not
    depend on one).

    Args:
        fn: takes the list of ``values`` as backend tensors and returns a scalar tensor; it may
            read ``variables`` (Keras variables) through Keras layers.
        values: float32 arrays.
        variables: Keras variables.
    """
    backend = keras.backend.backend()
    values = [np.asarray(v, np.float32) for v in values]
    if backend == "tensorflow":
        gv, gw = _tf(fn, values, variables)
    elif backend == "jax":
        gv, gw = _jax(fn, values, variables)
    elif backend == "torch":
        gv, gw = _torch(fn, values, variables)
    else:
        raise NotImplementedError(f"Net.backward needs the tensorflow, jax or torch backend, "
                                  f"not {backend!r}")
    out_v = [np.zeros_like(v) if g is None else np.asarray(keras.ops.convert_to_numpy(g),
                                                            np.float32)
             for v, g in zip(values, gv)]
    out_w = [np.zeros(tuple(w.shape), np.float32) if g is None else
             np.asarray(keras.ops.convert_to_numpy(g), np.float32)
             for w, g in zip(variables, gw)]
    return out_v, out_w


def _tf(fn, values, variables):
    import tensorflow as tf  # the TensorFlow backend's own tape
    xs = [tf.convert_to_tensor(v) for v in values]
    ws = [v.value for v in variables]
    with tf.GradientTape(persistent=False, watch_accessed_variables=False) as tape:
        tape.watch(xs)
        tape.watch(ws)
        y = fn(xs)
    grads = tape.gradient(y, xs + ws)
    return grads[:len(xs)], grads[len(xs):]


def _jax(fn, values, variables):
    import jax  # the JAX backend: a pure function of the values and the variables

    def pure(xs, ws):
        with keras.StatelessScope(state_mapping=list(zip(variables, ws))):
            return fn(list(xs))

    ws = [v.value for v in variables]
    gx, gw = jax.grad(pure, argnums=(0, 1))(list(values), ws)
    return list(gx), list(gw)


def _torch(fn, values, variables):
    import torch  # the PyTorch backend's autograd
    from keras.src.backend.torch.core import get_device
    xs = [torch.tensor(v, device=get_device(), requires_grad=True) for v in values]
    ws = [v.value for v in variables]
    y = fn(xs)
    targets = xs + [w for w in ws if w.requires_grad]
    grads = torch.autograd.grad(y, targets, allow_unused=True) if targets else []
    gx = list(grads[:len(xs)])
    it = iter(grads[len(xs):])
    gw = [next(it) if w.requires_grad else None for w in ws]
    return gx, gw
