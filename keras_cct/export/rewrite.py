"""Export-time rewrite: every HybridConv2D becomes one plain TensorFlow ``Conv2D`` op.

The lowering a :class:`~keras_cct.HybridConv2D` uses (im2col, Type 2/3 lifting, ...) is a
training-time choice; a deployed model should hand the convolution to the runtime as a single
standard ``Conv`` so that onnxruntime (or any other runtime) uses its own best algorithm. The
rewrite swaps each HybridConv2D for an :class:`ExportConv2D` with the same name, arguments and
weights, whose ``call`` is one ``tf.nn.conv2d`` (explicit padding, groups and dilation as
attributes of that op), a bias add and the activation; tf2onnx maps it to one ONNX ``Conv``.

Why not ``keras.layers.Conv2D``: on the TensorFlow backend Keras runs a *grouped* Conv2D inside a
nested ``tf.function(jit_compile=True)`` that tf2onnx cannot convert (it leaves an unsupported
``StatefulPartitionedCall``), it forbids strides > 1 with dilation > 1 (Caffe allows it), and it
has no asymmetric padding. ``tf.nn.conv2d`` has all three. Grouped ``keras.layers.Conv2D`` layers
are rewritten too, for the same reason.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import keras
import numpy as np

from keras_cct.errors import ExportError
from keras_cct.layers.convert import conv_arguments
from keras_cct.layers.hybrid_conv2d import HybridConv2D
from keras_cct.lowering.geometry import normalize_pair, normalize_padding

Pads = Tuple[Tuple[int, int], Tuple[int, int]]


def export_error(message: str, layer: Optional[str] = None) -> ExportError:
    """An :class:`ExportError` whose ``layer`` attribute names the layer (or is None)."""
    err = ExportError(message)
    err.layer = layer  # type: ignore[attr-defined]
    return err


class ExportConv2D(keras.layers.Layer):
    """A 2-D convolution traced as a single TensorFlow ``Conv2D`` op (TensorFlow backend only).

    Used only inside :func:`keras_cct.export.export_onnx`; it is not registered for saving.

    Args:
        filters, kernel_size, strides, dilation_rate, groups, use_bias: as ``Conv2D``.
        padding: ``"valid"``, ``"same"`` or ``((top, bottom), (left, right))``.
        data_format: ``"channels_last"`` or ``"channels_first"``.
        activation: a callable or the name of a Keras activation (or None).
        weights: ``[kernel]`` or ``[kernel, bias]`` as numpy arrays, assigned at build time;
            kernel layout ``(kh, kw, in_channels // groups, filters)``.
    """

    def __init__(self, filters: int, kernel_size, *, strides=1, padding="valid",
                 data_format: str = "channels_last", dilation_rate=1, groups: int = 1,
                 activation=None, use_bias: bool = True,
                 weights: Optional[Sequence[np.ndarray]] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.kernel_size = normalize_pair(kernel_size, "kernel_size")
        self.strides = normalize_pair(strides, "strides")
        self.dilation_rate = normalize_pair(dilation_rate, "dilation_rate")
        self.padding = normalize_padding(padding)
        self.data_format = data_format
        self.groups = int(groups)
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self._initial_weights = None if weights is None else [np.asarray(w) for w in weights]

    def build(self, input_shape) -> None:
        axis = -1 if self.data_format == "channels_last" else 1
        channels = int(input_shape[axis])
        self.kernel = self.add_weight(
            name="kernel", shape=self.kernel_size + (channels // self.groups, self.filters),
            initializer="zeros", dtype=self.dtype)
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(self.filters,),
                                        initializer="zeros", dtype=self.dtype)
        if self._initial_weights is not None:
            self.set_weights(self._initial_weights)
            self._initial_weights = None

    def _tf_padding(self):
        if isinstance(self.padding, str):
            return self.padding.upper()
        (t, b), (l, r) = self.padding
        if self.data_format == "channels_last":
            return [[0, 0], [t, b], [l, r], [0, 0]]
        return [[0, 0], [0, 0], [t, b], [l, r]]

    def call(self, inputs):
        import tensorflow as tf

        fmt = "NHWC" if self.data_format == "channels_last" else "NCHW"
        y = tf.nn.conv2d(inputs, tf.cast(self.kernel, inputs.dtype), strides=self.strides,
                         padding=self._tf_padding(), data_format=fmt,
                         dilations=self.dilation_rate)
        if self.use_bias:
            y = tf.nn.bias_add(y, tf.cast(self.bias, y.dtype), data_format=fmt)
        if self.activation is not None:
            y = self.activation(y)
        return y

    def compute_output_shape(self, input_shape) -> Tuple:
        shape = tuple(input_shape)
        if self.data_format == "channels_first":
            shape = (shape[0], shape[2], shape[3], shape[1])
        out = [shape[0], None, None, self.filters]
        for i, (size, k, s, d) in enumerate(zip(shape[1:3], self.kernel_size, self.strides,
                                                self.dilation_rate)):
            if size is None:
                continue
            ek = (k - 1) * d + 1
            if self.padding == "same":
                out[1 + i] = -(-size // s)
            else:
                pad = 0 if self.padding == "valid" else sum(self.padding[i])
                out[1 + i] = (size + pad - ek) // s + 1
        if self.data_format == "channels_first":
            out = [out[0], out[3], out[1], out[2]]
        return tuple(out)


def needs_rewrite(layer) -> bool:
    """True for the layers the export replaces: HybridConv2D, and grouped ``keras`` Conv2D."""
    if isinstance(layer, HybridConv2D):
        return True
    return type(layer) is keras.layers.Conv2D and int(getattr(layer, "groups", 1)) > 1


def export_conv_for(layer) -> ExportConv2D:
    """The :class:`ExportConv2D` equal to ``layer`` (same name, arguments and weights)."""
    if not layer.built:
        raise export_error(f"layer '{layer.name}' ({type(layer).__name__}) was never built, "
                           f"so it has no weights to export (call the model on data or build "
                           f"it with an input shape first)", layer.name)
    args = conv_arguments(layer)
    padding = args["padding"]
    if isinstance(padding, str) and padding.lower() == "causal":
        raise export_error(f"layer '{layer.name}': padding='causal' is not supported by the "
                           f"export (use 'valid' with explicit padding)", layer.name)
    return ExportConv2D(args.pop("filters"), args.pop("kernel_size"), **args,
                        weights=layer.get_weights(), name=layer.name, dtype=layer.dtype_policy)


def _is_graph_model(model) -> bool:
    """Functional or Sequential (the models whose layer graph Keras knows)."""
    try:  # Keras has no public name for the class of keras.Model(inputs, outputs)
        from keras.src.models.functional import Functional
    except ImportError:  # pragma: no cover
        return isinstance(model, keras.Sequential) or hasattr(model, "_run_through_graph")
    return isinstance(model, (keras.Sequential, Functional))


def _find_rewrite_targets(layer, path: str = "") -> list:
    """Names (``outer/inner``) of the layers that need a rewrite, at any depth."""
    found = []
    if isinstance(layer, keras.Model):
        subs = layer.layers
    else:  # a custom layer that owns sub-layers
        subs = layer._flatten_layers(include_self=False, recursive=False)
    for sub in subs:
        name = f"{path}{sub.name}"
        if needs_rewrite(sub):
            found.append((name, sub))
        else:
            found.extend(_find_rewrite_targets(sub, name + "/"))
    return found


def rewrite_for_export(model: keras.Model) -> keras.Model:
    """A model equal to ``model`` in which every HybridConv2D (and grouped Conv2D) is an
    :class:`ExportConv2D`.

    The other layers are shared with ``model`` (same objects, same weights): only the
    convolutions are new. Nested Functional/Sequential models are rewritten recursively.

    Raises:
        ExportError: ``model`` is a subclassed model that contains a layer needing a rewrite
            (its call graph is Python code that cannot be rewired), or a layer is not built.
    """
    targets = _find_rewrite_targets(model)
    if not targets:
        return model
    if not _is_graph_model(model):
        name = targets[0][0]
        raise export_error(
            f"model '{model.name}' ({type(model).__name__}) is a subclassed model and its "
            f"layer '{name}' ({type(targets[0][1]).__name__}) must be rewritten into a plain "
            f"convolution for export, which needs the model's graph: build the model with the "
            f"Functional API or keras.Sequential", name)

    def clone(layer):
        if needs_rewrite(layer):
            return export_conv_for(layer)
        if _is_graph_model(layer) is False and _find_rewrite_targets(layer):
            raise export_error(
                f"layer '{layer.name}' ({type(layer).__name__}) is a subclassed layer that "
                f"contains a HybridConv2D, which the export cannot rewire; build it with the "
                f"Functional API or keras.Sequential", layer.name)
        return layer  # shared: same object, same weights

    try:
        return keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ExportError:
        raise
    except Exception as exc:  # Keras refuses to clone this graph
        raise export_error(f"model '{model.name}': rewriting its convolutions for export "
                           f"failed: {type(exc).__name__}: {exc}") from exc

