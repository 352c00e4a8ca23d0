"""The few primitives whose best form differs per Keras backend.

Everything else in :mod:`keras_cct.lowering` is written with ``keras.ops``. These exist because
``keras.ops.matmul`` has no transpose flags: on TensorFlow, ``ops.transpose`` of a lowered matrix
materializes a copy as large as the matrix itself, while ``tf.linalg.matmul(transpose_a=True)``
reads it in place. JAX (XLA) and PyTorch (strided views) need no copy either way.
"""

from __future__ import annotations

from typing import List

import keras
from keras import ops


def _name() -> str:
    return keras.backend.backend()


def as_tensor(x):
    """A plain tensor holding ``x``'s value (a variable is read, not passed as a variable)."""
    if _name() == "tensorflow":
        import tensorflow as tf
        return tf.identity(x) if isinstance(x, tf.Variable) or hasattr(x, "value") else \
            tf.convert_to_tensor(x)
    return ops.convert_to_tensor(x)


def custom_conv(forward, backward, x, kernel):
    """``forward(x, kernel) -> (y, saved)`` as a differentiable op on every backend, whose
    gradient is ``backward(dy, saved) -> (dx, dkernel)`` (``keras.ops.custom_gradient``).
    Variables enter as tensors: TF's custom_gradient would otherwise insist on handling their
    gradients itself."""
    @ops.custom_gradient
    def conv(x, kernel):
        y, saved = forward(x, kernel)

        def grad(*args, upstream=None):
            dy = upstream if upstream is not None else args[0]
            return backward(dy, saved)

        return y, grad

    return conv(as_tensor(x), as_tensor(kernel))


def matmul(a, b):
    """``a @ b`` for 2-D operands, in their own dtype (Keras' torch ``matmul`` demotes float64)."""
    if _name() == "torch":
        return a @ b
    return ops.matmul(a, b)


def matmul_tn(a, b):
    """``a.T @ b`` for 2-D ``a`` (k, m) and ``b`` (k, n), without materializing ``a.T``."""
    name = _name()
    if name == "tensorflow":
        import tensorflow as tf
        return tf.linalg.matmul(a, b, transpose_a=True)
    if name == "torch":
        return a.transpose(0, 1) @ b
    return ops.matmul(ops.transpose(a), b)


def matmul_nt(a, b):
    """``a @ b.T`` for 2-D ``a`` (m, k) and ``b`` (n, k), without materializing ``b.T``."""
    name = _name()
    if name == "tensorflow":
        import tensorflow as tf
        return tf.linalg.matmul(a, b, transpose_b=True)
    if name == "torch":
        return a @ b.transpose(0, 1)
    return ops.matmul(a, ops.transpose(b))


def add_n(tensors: List):
    """Sum of same-shape tensors (one kernel on TensorFlow, a fused chain elsewhere)."""
    if len(tensors) == 1:
        return tensors[0]
    if _name() == "tensorflow":
        import tensorflow as tf
        return tf.math.add_n(tensors)
    total = tensors[0]
    for t in tensors[1:]:
        total = ops.add(total, t)
    return total


def index_tensor(indices, like):
    """A 1-D int32 numpy ``indices`` as the index tensor :func:`take_rows` wants on this
    backend (on ``like``'s device), made once and reused for every partition."""
    name = _name()
    if name == "tensorflow":
        import tensorflow as tf
        return tf.constant(indices)
    if name == "torch":
        import torch
        return torch.as_tensor(indices, dtype=torch.long, device=like.device)
    return ops.convert_to_tensor(indices)


def take_rows(x, indices):
    """``x[:, indices, :]`` for a 3-D ``x`` and an :func:`index_tensor` (a gather of whole rows
    along axis 1; Keras' ``take`` adds a pass over ``indices`` for negative values)."""
    name = _name()
    if name == "tensorflow":
        import tensorflow as tf
        return tf.gather(x, indices, axis=1)
    if name == "torch":
        import torch
        return torch.index_select(x, 1, indices)
    return ops.take(x, indices, axis=1)


def batch_bounds(x, parts: int, unit: int = 1) -> List:
    """Start offsets (``parts + 1`` of them) along axis 0 of ``x`` that cut its ``n = len(x) /
    unit`` blocks of ``unit`` rows into ``parts`` contiguous, near-equal partitions (Python ints
    when the size is static, scalar tensors otherwise; an empty partition when ``n < parts``)."""
    n = x.shape[0]
    if n is None:
        n = ops.shape(x)[0]
    n = n // unit
    return [(n * i) // parts * unit for i in range(parts + 1)]


def split_batch(x, parts: int, unit: int = 1) -> List:
    """``x`` cut along axis 0 into ``parts`` contiguous partitions (see :func:`batch_bounds`)."""
    if parts == 1:
        return [x]
    bounds = batch_bounds(x, parts, unit)
    if _name() == "tensorflow" and not isinstance(bounds[1], int):
        import tensorflow as tf
        sizes = tf.stack([bounds[i + 1] - bounds[i] for i in range(parts)])
        return tf.split(x, sizes, num=parts, axis=0)
    return [x[bounds[i]:bounds[i + 1]] for i in range(parts)]


def segment_sum(data, segment_ids, num_segments: int):
    """Sum of the rows (axis 0) of ``data`` by a 1-D int32 numpy ``segment_ids``, in ``data``'s
    own dtype (Keras' torch ``segment_sum`` computes in float32)."""
    name = _name()
    if name == "tensorflow":
        import tensorflow as tf
        return tf.math.unsorted_segment_sum(data, segment_ids, num_segments)
    if name == "torch":
        import torch
        ids = torch.as_tensor(segment_ids, dtype=torch.long, device=data.device)
        out = torch.zeros((num_segments,) + tuple(data.shape[1:]), dtype=data.dtype,
                          device=data.device)
        return out.index_add(0, ids, data)
    return ops.segment_sum(data, segment_ids, num_segments=num_segments)
