"""Caffe's per-channel layers: :class:`CaffeBatchNorm`, :class:`CaffeScale`, :class:`CaffeBias`,
:class:`CaffePReLU`."""

from __future__ import annotations

from typing import Optional, Tuple

import keras
from keras import ops

from keras_cct.caffe.net.layout import caffe_shape, from_caffe_layout, to_caffe_layout
from keras_cct.layers._norm import normalize_batch, normalize_with

_PKG = "keras_cct"

__all__ = ["CaffeBatchNorm", "CaffeScale", "CaffeBias", "CaffePReLU"]


# --------------------------------------------------------------------------------------------
# BatchNorm, Scale, Bias, PReLU


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeBatchNorm(keras.layers.Layer):
    """Caffe's BatchNorm (no affine part; Caffe follows it with a Scale layer).

    Variables, in Caffe's blob order: ``mean`` (C,), ``variance`` (C,), ``scale_factor`` (1,);
    the statistics used are ``mean / scale_factor`` and ``variance / scale_factor`` (0 when the
    factor is 0). With ``use_global_stats`` false and ``training=True`` the batch statistics are
    used (biased variance) and the blobs are updated as Caffe does:
    ``s = maf * s + 1; mean = maf * mean + batch_mean; var = maf * var + m/(m-1) * batch_var``.
    ``use_global_stats=None`` means Caffe's default: global statistics unless training.

    :meth:`absorb` hands it the :class:`CaffeScale` that follows it (the net builder does, see
    :mod:`keras_cct.caffe.net.fusion`): it then applies that layer's scale and bias in its own
    fused op, and the Scale layer passes its input on unchanged. Each layer keeps its own
    variables (Caffe's blobs); the pairing is not part of the config (a reloaded pair computes
    the same, unfused).
    """

    def __init__(self, eps: float = 1e-5, moving_average_fraction: float = 0.999,
                 use_global_stats: Optional[bool] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eps = float(eps)
        self.moving_average_fraction = float(moving_average_fraction)
        self.use_global_stats = use_global_stats
        self.absorbed: Optional["CaffeScale"] = None

    def absorb(self, scale: "CaffeScale", rank: int) -> None:
        """Apply ``scale``'s per-channel scale (and bias) here, in the normalization's own
        pass; ``scale`` becomes the identity. Only for a learned per-channel Scale of this
        layer's ``rank``-D output, which nothing else reads."""
        if not scale.per_channel(rank):
            raise ValueError(f"Scale '{scale.name}' is not a learned per-channel scale")
        # object.__setattr__: a plain reference; Keras would track a layer set as an attribute
        # as a sublayer (its variables counted twice) and refuses one on a built layer.
        object.__setattr__(scale, "absorbed_by", self)
        object.__setattr__(self, "absorbed", scale)

    def _affine(self):
        s = self.absorbed
        if s is None:
            return None, None
        return s.scale, (s.bias if s.bias_term else None)

    def build(self, input_shape):
        c = int(input_shape[-1])
        # Statistics stay float32 under a mixed policy (not autocast): they accumulate.
        self.mean = self.add_weight(name="mean", shape=(c,), initializer="zeros",
                                    trainable=False, autocast=False)
        self.variance = self.add_weight(name="variance", shape=(c,), initializer="zeros",
                                        trainable=False, autocast=False)
        self.scale_factor = self.add_weight(name="scale_factor", shape=(1,),
                                            initializer="zeros", trainable=False, autocast=False)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x, training=None):
        use_global = self.use_global_stats
        if use_global is None:
            use_global = not training
        if use_global:
            s = self.scale_factor[0]
            inv = ops.where(ops.equal(s, 0.0), ops.zeros_like(s), 1.0 / s)
            return normalize_with(x, self.mean * inv, self.variance * inv, self.eps,
                                  *self._affine())
        y, mean, unbiased_var = normalize_batch(x, self.eps, *self._affine())
        if training:
            maf = self.moving_average_fraction
            self.scale_factor.assign(self.scale_factor * maf + 1.0)
            self.mean.assign(self.mean * maf + mean)
            self.variance.assign(self.variance * maf + unbiased_var)
        return y

    def get_config(self):
        cfg = super().get_config()
        cfg.update(eps=self.eps, moving_average_fraction=self.moving_average_fraction,
                   use_global_stats=self.use_global_stats)
        return cfg


class _AxisParamLayer(keras.layers.Layer):
    """Shared by Scale and Bias: a parameter of Caffe shape ``blob.shape[axis:axis+num_axes]``,
    learned or given as the second input."""

    def __init__(self, axis: int = 1, num_axes: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)
        self.num_axes = int(num_axes)

    def _param_shape(self, caffe_in: Tuple) -> Tuple[int, ...]:
        rank = len(caffe_in)
        a = self.axis + rank if self.axis < 0 else self.axis
        end = rank if self.num_axes == -1 else a + self.num_axes
        if not (0 <= a <= rank and a <= end <= rank):
            raise ValueError(f"'{self.name}': axis {self.axis} / num_axes {self.num_axes} do "
                             f"not fit a {rank}-D blob")
        return tuple(int(d) for d in caffe_in[a:end])

    def _channel_fast_path(self, rank: int, pshape: Tuple) -> bool:
        a = self.axis + rank if self.axis < 0 else self.axis
        return a == 1 and len(pshape) == 1

    def _apply(self, x, p, op):
        rank = len(x.shape)
        a = self.axis + rank if self.axis < 0 else self.axis
        if a == 1 and len(p.shape) == 1:          # per channel: last axis in Keras' layout
            return op(x, p)
        if len(p.shape) == 0:
            return op(x, p)
        xc = to_caffe_layout(x)
        shape = [1] * a + list(p.shape) + [1] * (rank - a - len(p.shape))
        if a == 0:
            shape[0] = -1
        y = op(xc, ops.reshape(p, shape))
        return from_caffe_layout(y)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(axis=self.axis, num_axes=self.num_axes)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeScale(_AxisParamLayer):
    """Caffe's Scale: ``y = x * scale (+ bias)``; ``scale`` learned (one input) or the second
    input (Caffe order, channels-last held). Variables: ``scale`` then ``bias``."""

    def __init__(self, axis: int = 1, num_axes: int = 1, bias_term: bool = False,
                 **kwargs) -> None:
        super().__init__(axis, num_axes, **kwargs)
        self.bias_term = bool(bias_term)
        self.absorbed_by: Optional[CaffeBatchNorm] = None  # see CaffeBatchNorm.absorb

    def per_channel(self, rank: int) -> bool:
        """Whether this is a built, learned scale of one value per channel (the last axis in
        Keras' layout) of a ``rank``-D input."""
        scale = getattr(self, "scale", None)
        return scale is not None and self._channel_fast_path(rank, tuple(scale.shape))

    def build(self, input_shape):
        two = isinstance(input_shape, (list, tuple)) and len(input_shape) == 2 and \
            isinstance(input_shape[0], (list, tuple))
        first = input_shape[0] if two else input_shape
        if two:
            if self.axis != 0:
                raise ValueError(f"Scale '{self.name}' with two inputs: only axis 0 is "
                                 "supported (the second input includes the batch axis)")
            if self.bias_term:
                raise ValueError(f"Scale '{self.name}' with two inputs: bias_term is not "
                                 "supported (its bias would have a batch axis)")
        else:
            pshape = self._param_shape(caffe_shape(first))
            self.scale = self.add_weight(name="scale", shape=pshape, initializer="ones")
            if self.bias_term:
                self.bias = self.add_weight(name="bias", shape=pshape, initializer="zeros")

    def compute_output_shape(self, input_shape):
        two = isinstance(input_shape, (list, tuple)) and len(input_shape) == 2 and \
            isinstance(input_shape[0], (list, tuple))
        return input_shape[0] if two else input_shape

    def call(self, inputs):
        if isinstance(inputs, (list, tuple)):
            x, s = inputs
            y = self._apply_two(x, s)
        else:
            x = inputs
            if self.absorbed_by is not None:  # applied in the BatchNorm's fused op
                return x
            y = self._apply(x, self.scale, ops.multiply)
        if self.bias_term:
            y = self._apply(y, self.bias, ops.add)
        return y

    def _apply_two(self, x, s):
        # axis 0: s (Caffe shape (N, d1, ..)) scales Caffe dims [0, s.rank) of x.
        rank, k = len(x.shape), len(s.shape)
        if k > rank:
            raise ValueError(f"Scale '{self.name}': the scale input has more axes than x")
        sc = to_caffe_layout(s)
        sb = ops.reshape(sc, [-1] + [int(d) for d in sc.shape[1:]] + [1] * (rank - k))
        return from_caffe_layout(to_caffe_layout(x) * sb)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(bias_term=self.bias_term)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeBias(_AxisParamLayer):
    """Caffe's Bias: ``y = x + bias`` (learned, Caffe shape ``shape[axis:axis+num_axes]``)."""

    def build(self, input_shape):
        pshape = self._param_shape(caffe_shape(input_shape))
        self.bias = self.add_weight(name="bias", shape=pshape, initializer="zeros")

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return self._apply(x, self.bias, ops.add)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffePReLU(keras.layers.Layer):
    """Caffe's PReLU: ``y = max(0, x) + a * min(0, x)``, ``a`` per channel (C,) or shared (1,)."""

    def __init__(self, channel_shared: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.channel_shared = bool(channel_shared)

    def build(self, input_shape):
        c = 1 if self.channel_shared else int(input_shape[-1])
        self.alpha = self.add_weight(name="alpha", shape=(c,),
                                     initializer=keras.initializers.Constant(0.25))

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return ops.maximum(x, 0.0) + self.alpha * ops.minimum(x, 0.0)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(channel_shared=self.channel_shared)
        return cfg


