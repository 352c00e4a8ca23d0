"""Caffe's element-wise layers: :class:`CaffeUnary` (AbsVal, Power, Exp, Log, BNLL, Clip,
Threshold) and :class:`CaffeEltwise`."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import keras
from keras import ops


_PKG = "keras_cct"

__all__ = ["CaffeUnary", "CaffeEltwise"]


# --------------------------------------------------------------------------------------------
# Element-wise


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeUnary(keras.layers.Layer):
    """One of Caffe's element-wise layers.

    ``op``: ``"AbsVal"``; ``"Power"`` ``(shift + scale x)^power``; ``"Exp"``
    ``base^(shift + scale x)`` (``base=-1`` means e); ``"Log"`` ``log_base(shift + scale x)``;
    ``"BNLL"`` ``log(1 + e^x)``; ``"Clip"`` to ``[min, max]``; ``"Threshold"``
    ``x > threshold``; ``"Swish"`` ``x * sigmoid(beta x)``.
    """

    OPS = ("AbsVal", "Power", "Exp", "Log", "BNLL", "Clip", "Threshold", "Swish")

    def __init__(self, op: str, power: float = 1.0, scale: float = 1.0, shift: float = 0.0,
                 base: float = -1.0, min: float = 0.0, max: float = 0.0,  # noqa: A002
                 threshold: float = 0.0, beta: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if op not in self.OPS:
            raise ValueError(f"CaffeUnary op must be one of {self.OPS}, got {op!r}")
        self.op = op
        self.power = float(power)
        self.scale = float(scale)
        self.shift = float(shift)
        self.base = float(base)
        self.min = float(min)
        self.max = float(max)
        self.threshold = float(threshold)
        self.beta = float(beta)

    def compute_output_shape(self, input_shape):
        return input_shape

    def _lin(self, x):
        y = x
        if self.scale != 1.0:
            y = y * self.scale
        if self.shift != 0.0:
            y = y + self.shift
        return y

    def call(self, x):
        op = self.op
        if op == "AbsVal":
            return ops.abs(x)
        if op == "Power":
            y = self._lin(x)
            return y if self.power == 1.0 else ops.power(y, self.power)
        if op == "Exp":
            y = self._lin(x)
            return ops.exp(y if self.base == -1.0 else y * math.log(self.base))
        if op == "Log":
            y = ops.log(self._lin(x))
            return y if self.base == -1.0 else y / math.log(self.base)
        if op == "BNLL":
            return ops.softplus(x)
        if op == "Clip":
            return ops.clip(x, self.min, self.max)
        if op == "Threshold":
            return ops.cast(ops.greater(x, self.threshold), x.dtype)
        return x * ops.sigmoid(self.beta * x)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(op=self.op, power=self.power, scale=self.scale, shift=self.shift,
                   base=self.base, min=self.min, max=self.max, threshold=self.threshold,
                   beta=self.beta)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeEltwise(keras.layers.Layer):
    """Caffe's Eltwise over its inputs: ``SUM`` (with optional per-input ``coeff``), ``PROD``,
    ``MAX``."""

    def __init__(self, operation: str = "SUM", coeff: Optional[Sequence[float]] = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        operation = operation.upper()
        if operation not in ("SUM", "PROD", "MAX"):
            raise ValueError(f"Eltwise operation must be SUM, PROD or MAX, got {operation!r}")
        if coeff and operation != "SUM":
            raise ValueError("Eltwise `coeff` is only allowed with operation SUM")
        self.operation = operation
        self.coeff = [float(c) for c in coeff] if coeff else None

    def compute_output_shape(self, input_shape):
        return input_shape[0]

    def call(self, inputs):
        xs = list(inputs)
        if self.coeff and len(self.coeff) != len(xs):
            raise ValueError(f"Eltwise '{self.name}': {len(self.coeff)} coeffs for "
                             f"{len(xs)} inputs")
        if self.operation == "SUM":
            coeff = self.coeff or [1.0] * len(xs)
            y = xs[0] * coeff[0] if coeff[0] != 1.0 else xs[0]
            for c, x in zip(coeff[1:], xs[1:]):
                y = y + (x * c if c != 1.0 else x)
            return y
        y = xs[0]
        for x in xs[1:]:
            y = y * x if self.operation == "PROD" else ops.maximum(y, x)
        return y

    def get_config(self):
        cfg = super().get_config()
        cfg.update(operation=self.operation, coeff=self.coeff)
        return cfg


