"""hybridize: an existing Keras model with every Conv2D, DepthwiseConv2D and SeparableConv2D
replaced by equal HybridConv2D layers."""

from __future__ import annotations

import warnings

import keras

from keras_cct.errors import HybridizeError, HybridizeWarning
from keras_cct.layers.convert import (depthwise_kernel_as_grouped, depthwise_to_hybrid,
                                      separable_to_hybrid, to_hybrid)


def hybridize(model: keras.Model, strategy=None, *, lowering: str = "auto",
              depthwise: bool = True) -> keras.Model:
    """A copy of ``model`` in which every ``keras.layers.Conv2D`` is a HybridConv2D with the same
    configuration and weights, bound to ``strategy`` when one is given.

    Models nested in ``model`` (``keras.Sequential([base, Dense(10)])``, or a functional model
    calling ``base``) are converted too. A model without any layer to convert is copied as it
    is, with a :class:`~keras_cct.errors.HybridizeWarning` (the layers of a subclassed model
    are not reached). ``Conv1D``, ``Conv3D`` and ``Conv2DTranspose`` layers stay Keras' own (a
    ``Conv1D`` is the one-dimensional convolution HybridConv2D runs for a one-row kernel on
    JAX: docs/guide.md).

    Args:
        model: a functional or Sequential model (``keras.models.clone_model`` must accept it).
        strategy: a :class:`~keras_cct.CCTStrategy`, or None for plain HybridConv2D layers.
        lowering: the new layers' ``lowering``.
        depthwise: also replace every ``keras.layers.DepthwiseConv2D`` by the equal grouped
            HybridConv2D (one group per input channel; the kernel reshaped, not changed), and
            every ``keras.layers.SeparableConv2D`` by a ``Sequential`` of that grouped layer
            and a 1x1 HybridConv2D (:func:`~keras_cct.layers.convert.separable_to_hybrid`).
            HybridConv2D runs TensorFlow's own depthwise op there, PyTorch's grouped
            convolution on the channels-last tensor (without Keras' NCHW copies), and on JAX
            shifted multiply-adds in place of XLA's grouped convolution (MobileNet's depthwise
            layers trained 1.5-2.3x as fast on PyTorch, 6.6-21x on JAX; docs/benchmarks.md).
            These layers must be built (their input channels known): build the model first.

    Raises:
        HybridizeError: a depthwise or separable layer to convert is not built.
    """
    converted, kept = [], []

    def clone(layer):
        if type(layer) is keras.layers.Conv2D:
            new = to_hybrid(layer, lowering=lowering)
        elif depthwise and type(layer) is keras.layers.DepthwiseConv2D:
            new = depthwise_to_hybrid(layer, _channels(layer), lowering=lowering)
        elif depthwise and type(layer) is keras.layers.SeparableConv2D:
            new = separable_to_hybrid(layer, _channels(layer), lowering=lowering)
        else:
            if _near_miss(layer):
                kept.append(f"{layer.name!r} ({type(layer).__name__})")
            return layer.__class__.from_config(layer.get_config())
        for conv in new.layers if isinstance(new, keras.Sequential) else (new,):
            conv._strategy = strategy
        converted.append(layer.name)
        return new

    copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    if not converted:
        kinds = "Conv2D, DepthwiseConv2D or SeparableConv2D" if depthwise else "Conv2D"
        warnings.warn(f"hybridize: model {model.name!r} has no {kinds} layer to convert (a "
                      f"subclassed model's or layer's own layers are not reached); the copy "
                      f"runs Keras' layers as before", HybridizeWarning, stacklevel=2)
    if kept:
        warnings.warn(f"hybridize: kept {', '.join(kept)} as Keras' layers: a subclass of a Keras "
                      f"convolution (its call may differ) and a convolution inside a wrapper "
                      f"(TimeDistributed, ...) are not converted", HybridizeWarning, stacklevel=2)
    weights = []
    for var, value in zip(copy.weights, model.get_weights()):
        if tuple(var.shape) != value.shape:  # a depthwise kernel, now grouped
            value = depthwise_kernel_as_grouped(value)
        weights.append(value)
    copy.set_weights(weights)
    return copy


#: the Keras layers hybridize converts (their exact types)
_CONVERTED = (keras.layers.Conv2D, keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D)


def _near_miss(layer) -> bool:
    """Whether ``layer`` is a convolution hybridize leaves as it is although it looks like one
    it converts: a subclass of one, or one inside a wrapper layer."""
    inner = getattr(layer, "layer", None) if isinstance(layer, keras.layers.Wrapper) else None
    return (isinstance(layer, _CONVERTED) and type(layer) not in _CONVERTED) or \
        isinstance(inner, _CONVERTED)


def _channels(layer) -> int:
    """The input channels of a built DepthwiseConv2D or SeparableConv2D (its depthwise kernel's
    third axis)."""
    if not layer.built:
        raise HybridizeError(
            f"{type(layer).__name__} is not built, so its input channels are unknown",
            layer=layer.name, hint="build the model first: model.build(input_shape), or call "
            "it on a batch; or pass depthwise=False to keep Keras' layer")
    kernel = layer.kernel if isinstance(layer, keras.layers.DepthwiseConv2D) else \
        layer.depthwise_kernel
    return int(kernel.shape[2])
