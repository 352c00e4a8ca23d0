"""Caffe's layers that copy or pick items: :class:`CaffeTile`, :class:`CaffeBatchReindex` and
:class:`CaffeFilter` (on channels-last blobs, axes Caffe's).

``Filter``'s top has a data-dependent batch size: it runs eagerly (``model(x)``) on every
backend and inside compiled functions on TensorFlow and PyTorch; JAX cannot trace it (jit needs
static shapes), and the layer says so with a :class:`~keras_cct.errors.KerasCCTError`.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_cct.caffe.net.layout import caffe_axis
from keras_cct.errors import KerasCCTError

_PKG = "keras_cct"

__all__ = ["CaffeTile", "CaffeBatchReindex", "CaffeFilter"]


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeTile(keras.layers.Layer):
    """Caffe's ``Tile``: the blob repeated ``tiles`` times along Caffe axis ``axis`` (whole
    blocks, as ``numpy.tile``); the backward sums the copies."""

    def __init__(self, axis: int = 1, tiles: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        if int(tiles) < 1:
            raise ValueError(f"Tile tiles must be >= 1, got {tiles}")
        self.axis = int(axis)
        self.tiles = int(tiles)

    def compute_output_shape(self, input_shape):
        k = caffe_axis(self.axis, len(input_shape))
        out = list(input_shape)
        out[k] = None if out[k] is None else out[k] * self.tiles
        return tuple(out)

    def call(self, x):
        reps = [1] * len(x.shape)
        reps[caffe_axis(self.axis, len(x.shape))] = self.tiles
        return ops.tile(x, reps)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, tiles=self.tiles)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeBatchReindex(keras.layers.Layer):
    """Caffe's ``BatchReindex``: ``top[i] = data[permut[i]]`` for the inputs
    ``[data, permut]`` (``permut`` holds item indices as floats, truncated as Caffe's
    ``static_cast<int>``); the backward adds each top item's gradient into the item it came
    from (an index used twice gets both). No gradient reaches ``permut``."""

    def compute_output_shape(self, input_shape):
        data, permut = input_shape
        return (permut[0],) + tuple(data[1:])

    def call(self, inputs):
        data, permut = inputs
        idx = ops.cast(ops.reshape(ops.stop_gradient(permut), (-1,)), "int32")
        return ops.take(data, idx, axis=0)


def _is_traced(x) -> bool:
    if keras.backend.backend() != "jax":
        return False
    import jax
    return isinstance(x, jax.core.Tracer)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeFilter(keras.layers.Layer):
    """Caffe's ``Filter``: inputs ``[b_1, ..., b_k, selector]``; output ``k`` blobs holding the
    items of each ``b_i`` whose selector value is nonzero (in order). The backward copies each
    kept item's gradient back and gives the dropped items zero; none reaches the selector.

    The output batch size depends on the selector's values, see the module docstring for
    where that can run.
    """

    def compute_output_shape(self, input_shape):
        return [(None,) + tuple(s[1:]) for s in input_shape[:-1]]

    def call(self, inputs):
        *blobs, selector = inputs
        if _is_traced(selector):
            raise KerasCCTError(
                f"Filter layer '{self.name}' cannot run inside a JAX-compiled function "
                f"(predict/fit/jit): its output batch size depends on the selector's values. "
                f"Call the model eagerly (model(x)), or use the TensorFlow or PyTorch backend")
        sel = ops.reshape(ops.stop_gradient(selector), (-1,))
        idx = ops.nonzero(ops.not_equal(sel, 0))[0]
        return [ops.take(b, idx, axis=0) for b in blobs]
