"""The one converter between :class:`~keras_cct.layers.HybridConv2D` and ``keras.layers.Conv2D``.

* :func:`conv_arguments` -- the convolution arguments of either layer (what every conversion
  reads: the ONNX export's plain convolution is made from them too).
* :func:`to_hybrid` -- a ``Conv2D`` as an equal HybridConv2D (``hybridize``).
* :func:`depthwise_to_hybrid` / :func:`depthwise_kernel_as_grouped` -- a ``DepthwiseConv2D``
  as the equal grouped HybridConv2D (one group per input channel), and its kernel in that
  layout (``hybridize``); :func:`separable_to_hybrid` -- a ``SeparableConv2D`` as that grouped
  layer followed by a 1x1 HybridConv2D.
* :func:`keras_conv_layers` / :func:`to_keras_conv` -- a convolution with explicit (Caffe)
  padding as Keras' own layers: a ``ZeroPadding2D`` in front of a ``padding="valid"``
  ``Conv2D`` (Conv2D has no explicit padding); used by the Caffe builder's ``conv_impl="keras"``
  and by ``cct time --conv keras``.

Both layers keep the kernel as ``(kh, kw, in_channels // groups, filters)``, so weights copy
either way unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional

import keras

from keras_cct.layers.hybrid_conv2d import HybridConv2D

__all__ = ["CONV_ARGUMENTS", "conv_arguments", "to_hybrid", "depthwise_to_hybrid",
           "separable_to_hybrid", "depthwise_kernel_as_grouped", "keras_conv_layers",
           "to_keras_conv"]

#: the arguments that define a convolution (the rest are initializers, regularizers, ...)
CONV_ARGUMENTS = ("filters", "kernel_size", "strides", "padding", "data_format",
                  "dilation_rate", "groups", "activation", "use_bias")


def conv_arguments(layer) -> Dict[str, Any]:
    """:data:`CONV_ARGUMENTS` of a ``Conv2D`` or HybridConv2D, read from its attributes
    (``padding``: ``"valid"``, ``"same"`` or HybridConv2D's ``((top, bottom), (left, right))``;
    ``activation``: the callable)."""
    args = {name: getattr(layer, name) for name in CONV_ARGUMENTS}
    args["groups"] = int(getattr(layer, "groups", 1))
    args["use_bias"] = bool(args["use_bias"])
    return args


def to_hybrid(layer: keras.layers.Conv2D, **overrides: Any) -> HybridConv2D:
    """A HybridConv2D with ``layer``'s configuration (its name, dtype and trainability too);
    ``overrides`` (e.g. ``lowering=``) are passed on. Weights are not copied."""
    return _hybrid_from(layer.get_config(), overrides)


def _hybrid_from(config: Dict[str, Any], overrides: Dict[str, Any],
                 renames: Optional[Dict[str, str]] = None) -> HybridConv2D:
    """A HybridConv2D from a Keras layer's config: the keys HybridConv2D takes (after
    ``renames``), then ``overrides``."""
    accepted = set(inspect.signature(HybridConv2D.__init__).parameters) | {"name", "dtype",
                                                                           "trainable"}
    renames = renames or {}
    kept = {renames.get(k, k): v for k, v in config.items()}
    kept = {k: v for k, v in kept.items() if k in accepted}
    return HybridConv2D(**{**kept, **overrides})


#: DepthwiseConv2D's argument names -> HybridConv2D's
_DEPTHWISE_NAMES = {"depthwise_initializer": "kernel_initializer",
                    "depthwise_regularizer": "kernel_regularizer",
                    "depthwise_constraint": "kernel_constraint"}


def depthwise_to_hybrid(layer: keras.layers.DepthwiseConv2D, channels: int,
                        **overrides: Any) -> HybridConv2D:
    """The HybridConv2D computing ``layer``, a depthwise convolution of ``channels`` input
    channels: ``groups=channels``, ``filters=channels * depth_multiplier`` (output channel
    ``c * depth_multiplier + m``, as Keras orders them), with its name, dtype, trainability,
    activation, bias, initializers and regularizers; ``overrides`` are passed on. Weights are not
    copied: the kernel goes through :func:`depthwise_kernel_as_grouped`. A kernel constraint is
    applied to the grouped layout ``(kh, kw, 1, channels * depth_multiplier)``."""
    return _hybrid_from(layer.get_config(), {**_grouped(layer, channels), **overrides},
                        _DEPTHWISE_NAMES)


def _grouped(layer, channels: int) -> Dict[str, int]:
    """The grouped convolution's ``filters`` and ``groups`` of a depthwise (or separable)
    ``layer`` on ``channels`` input channels."""
    return {"filters": int(channels) * int(layer.depth_multiplier), "groups": int(channels)}


#: SeparableConv2D's argument names -> its pointwise HybridConv2D's
_POINTWISE_NAMES = {"pointwise_initializer": "kernel_initializer",
                    "pointwise_regularizer": "kernel_regularizer",
                    "pointwise_constraint": "kernel_constraint"}


def separable_to_hybrid(layer: keras.layers.SeparableConv2D, channels: int,
                        **overrides: Any) -> keras.Sequential:
    """The two HybridConv2D layers computing ``layer``, a separable convolution of ``channels``
    input channels, as Keras computes it: the depthwise convolution (``groups=channels``,
    ``channels * depth_multiplier`` outputs, the strides, padding and dilation; no bias) and
    the 1x1 pointwise one (bias, activation and activity regularizer), in a ``Sequential``
    of ``layer``'s name (``<name>_depthwise``, ``<name>_pointwise``). Its weights are
    ``layer``'s in the same order: the depthwise kernel through
    :func:`depthwise_kernel_as_grouped`, the pointwise kernel and the bias unchanged; they are
    not copied here."""
    config = layer.get_config()
    name = config["name"]
    depthwise = _hybrid_from(
        {**config, "name": f"{name}_depthwise", "use_bias": False, "activation": None,
         "activity_regularizer": None, "bias_regularizer": None, "bias_constraint": None},
        {**_grouped(layer, channels), **overrides}, _DEPTHWISE_NAMES)
    pointwise = _hybrid_from(
        {**config, "name": f"{name}_pointwise", "kernel_size": (1, 1), "strides": (1, 1),
         "padding": "valid", "dilation_rate": (1, 1)}, {"groups": 1, **overrides},
        _POINTWISE_NAMES)
    return keras.Sequential([depthwise, pointwise], name=name)


def depthwise_kernel_as_grouped(kernel):
    """A ``DepthwiseConv2D`` kernel ``(kh, kw, channels, depth_multiplier)`` in the grouped
    layout ``(kh, kw, 1, channels * depth_multiplier)`` (a reshape: the same order)."""
    kh, kw, c, m = kernel.shape
    return kernel.reshape(kh, kw, 1, c * m)


def keras_conv_layers(filters: int, kernel_size, *, padding="valid", name: Optional[str] = None,
                      pad_name: Optional[str] = None, **kwargs: Any) -> List[keras.layers.Layer]:
    """Keras' own layers for a convolution: ``[Conv2D]``, or ``[ZeroPadding2D, Conv2D]`` when
    ``padding`` is explicit and not zero (an int, a pair, or ``((top, bottom), (left, right))``).

    Args:
        name: the Conv2D's name; ``pad_name``: the ZeroPadding2D's (default: Keras').
        kwargs: the other ``Conv2D`` arguments (strides, dilation_rate, groups, use_bias, ...).
    """
    if isinstance(padding, str):
        return [keras.layers.Conv2D(filters, kernel_size, padding=padding, name=name, **kwargs)]
    conv = keras.layers.Conv2D(filters, kernel_size, padding="valid", name=name, **kwargs)
    if padding in (0, (0, 0), ((0, 0), (0, 0))):
        return [conv]
    return [keras.layers.ZeroPadding2D(padding, name=pad_name), conv]


def to_keras_conv(layer: HybridConv2D) -> keras.layers.Layer:
    """A HybridConv2D as one Keras layer: a ``Conv2D`` of the same name, or, with explicit
    padding, a ``Sequential`` of that name holding a ``ZeroPadding2D`` and the ``Conv2D``
    (``<name>_conv``). Weights are not copied."""
    args = conv_arguments(layer)
    padding = args.pop("padding")
    args.pop("data_format")
    filters, kernel_size = args.pop("filters"), args.pop("kernel_size")
    explicit = not isinstance(padding, str) and padding != ((0, 0), (0, 0))
    layers = keras_conv_layers(filters, kernel_size, padding=padding,
                               name=f"{layer.name}_conv" if explicit else layer.name, **args)
    return layers[0] if len(layers) == 1 else keras.Sequential(layers, name=layer.name)
