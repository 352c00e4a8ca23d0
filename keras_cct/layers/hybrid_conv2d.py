"""HybridConv2D: ``keras.layers.Conv2D`` computed by Caffe con Troll's lowerings."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import keras
from keras import activations, constraints, initializers, ops, regularizers
from keras.layers import InputSpec

from keras_cct.errors import LoweringError
from keras_cct.lowering import (PLANNER_MODES, check_available, check_lowering, choose_for,
                                conv2d_geo, conv_geometry)
from keras_cct.lowering.dispatch import computed_in
from keras_cct.lowering.geometry import (ConvGeometry, normalize_pair, normalize_padding,
                                         padding_to_config)
from keras_cct.lowering.precision import arithmetic_dtype
from keras_cct.ops import failures
from keras_cct.strategy import context as strategy_context


def _symbolic() -> bool:
    """Whether Keras is tracing output shapes (``compute_output_spec``), not running."""
    try:
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    except ImportError:  # a Keras without symbolic scopes: plan as for a real call
        return False
    return in_symbolic_scope()


@keras.saving.register_keras_serializable(package="keras_cct")
class HybridConv2D(keras.layers.Layer):
    """2-D convolution computed as lowering + GEMM + lifting; a drop-in for ``Conv2D``.

    Takes the same arguments as ``keras.layers.Conv2D`` and has the same weights (``kernel`` of
    shape ``(kh, kw, in_channels // groups, filters)``, then ``bias``), so weights copy between
    the two. On top of Conv2D:

    Args:
        padding: ``"valid"``, ``"same"``, or explicit zero padding as in Caffe: an int,
            ``(pad_h, pad_w)``, or ``((top, bottom), (left, right))``.
        lowering: ``"auto"`` (chosen per input shape by the planner), ``"type1"`` (im2col),
            ``"type2"``, ``"type3"`` (1x1 GEMM + shift-and-add lifting), ``"winograd"`` /
            ``"winograd4"`` (F(2x2, 3x3) / F(4x4, 3x3) for 3x3 kernels at stride 1, and
            F(4x4, 5x5) for 5x5 ones; the latter not picked by the planner in 16-bit floats),
            ``"space_to_depth"`` (a strided convolution as a stride-1 one on rearranged
            input, for first layers),
            ``"depthwise"`` (one input channel per group, as shifted multiply-adds: the
            default for depthwise layers on JAX) or ``"native"`` (the backend's own
            convolution in its fastest form: see :mod:`keras_cct.lowering.native`).
        planner: how ``"auto"`` chooses: ``"auto"`` (the default: the backend's own convolution
            against the cost model's best lowering, Winograd and space-to-depth, timed once per
            shape and cached on disk; the fastest of them as timed), ``"model"`` (CcT's rule through the cost
            model, nothing timed) or ``"measure"`` (time every lowering once for this shape).
        device: ``None`` (compute with the current Keras backend's device) or an OpenCL device
            name such as ``"opencl:0:0"`` (see :func:`keras_cct.devices.list_devices`).

    A layer created inside ``with CCTStrategy(...).scope():`` (and without ``device``) splits
    each batch across the strategy's devices.

    Dilation may be combined with strides (Caffe allows it; Conv2D does not).
    """

    def __init__(self, filters: int, kernel_size, strides=(1, 1), padding="valid",
                 data_format: Optional[str] = None, dilation_rate=(1, 1), groups: int = 1,
                 activation=None, use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, kernel_constraint=None, bias_constraint=None,
                 lowering: str = "auto", planner: str = "auto", device: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        if not isinstance(filters, int) or isinstance(filters, bool) or filters <= 0:
            raise ValueError(f"`filters` must be a positive int, got {filters!r}")
        if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
            raise ValueError(f"`groups` must be a positive int, got {groups!r}")
        if filters % groups:
            raise ValueError(f"`groups`={groups} must divide `filters`={filters}")
        self.filters = filters
        self.groups = groups
        self.kernel_size = normalize_pair(kernel_size, "kernel_size")
        self.strides = normalize_pair(strides, "strides")
        self.dilation_rate = normalize_pair(dilation_rate, "dilation_rate")
        self.padding = normalize_padding(padding)
        data_format = data_format or keras.config.image_data_format()
        if data_format not in ("channels_last", "channels_first"):
            raise ValueError(f"`data_format` must be 'channels_last' or 'channels_first', got "
                             f"{data_format!r}")
        self.data_format = data_format
        self.activation = activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = initializers.get(kernel_initializer)
        self.bias_initializer = initializers.get(bias_initializer)
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        self.bias_regularizer = regularizers.get(bias_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)
        self.bias_constraint = constraints.get(bias_constraint)
        self.lowering = check_lowering(lowering)
        if planner not in PLANNER_MODES:
            raise ValueError(f"`planner` must be one of {PLANNER_MODES}, got {planner!r}")
        self.planner = planner
        self.device = device
        if device is not None:
            self._check_device(device)
            failures.install_keras_hook()  # the device's typed error out of fit / predict
        self.input_spec = InputSpec(ndim=4)
        self._plans: Dict[Tuple, Tuple[ConvGeometry, str, str]] = {}
        self._batch_hint: Optional[int] = None
        self._built_shape: Optional[Tuple] = None
        self._strategy = strategy_context.current() if device is None else None

    # ------------------------------------------------------------------------------ building

    @staticmethod
    def _check_device(device: str) -> None:
        if not isinstance(device, str) or not device.startswith("opencl:"):
            raise ValueError(f"`device` must be None or an OpenCL device name such as "
                             f"'opencl:0:0' (see keras_cct.devices.list_devices()), got "
                             f"{device!r}")

    @property
    def supports_jit(self) -> bool:  # OpenCL devices and strategies use host callbacks
        strategy = getattr(self, "_strategy", None)  # JAX's run in the compiled step
        return self.device is None and (strategy is None or strategy.supports_jit)

    @supports_jit.setter
    def supports_jit(self, value) -> None:  # keras.layers.Layer assigns it in __init__
        pass

    def _channels_last_shape(self, input_shape) -> Tuple:
        shape = tuple(input_shape)
        if self.data_format == "channels_first":
            shape = (shape[0], shape[2], shape[3], shape[1])
        return shape

    def build(self, input_shape) -> None:
        shape = self._channels_last_shape(input_shape)
        channels = shape[-1]
        if channels is None:
            raise ValueError(f"layer '{self.name}': the channel dimension of the input must be "
                             f"known, got input shape {tuple(input_shape)}")
        if channels % self.groups:
            raise ValueError(f"layer '{self.name}': `groups`={self.groups} must divide the "
                             f"input channels ({channels}); input shape {tuple(input_shape)}")
        axis = -1 if self.data_format == "channels_last" else 1
        self.input_spec = InputSpec(ndim=4, axes={axis: channels})
        kernel_shape = self.kernel_size + (channels // self.groups, self.filters)
        if isinstance(shape[0], int):
            self._batch_hint = shape[0]  # a static batch: what "auto" plans for without one
        if shape[1] is not None and shape[2] is not None:
            self._geometry(shape)  # validates kernel vs padded input now, not at the first call
            self._built_shape = tuple(shape[1:])
        self.kernel = self.add_weight(
            name="kernel", shape=kernel_shape, initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer, constraint=self.kernel_constraint,
            trainable=True, dtype=self.dtype)
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias", shape=(self.filters,), initializer=self.bias_initializer,
                regularizer=self.bias_regularizer, constraint=self.bias_constraint,
                trainable=True, dtype=self.dtype)

    def _geometry(self, shape: Tuple) -> ConvGeometry:
        """The validated geometry for a channels-last input shape (the batch is not part of it)."""
        kernel_shape = self.kernel_size + (shape[-1] // self.groups, self.filters)
        try:
            return conv_geometry((None,) + tuple(shape[1:]), kernel_shape, strides=self.strides,
                                 padding=self.padding, dilation_rate=self.dilation_rate,
                                 groups=self.groups)
        except LoweringError as exc:
            raise ValueError(f"layer '{self.name}': {exc}") from None

    def _plan(self, shape: Tuple) -> Tuple[ConvGeometry, str, str]:
        """Geometry, lowering and arithmetic dtype (:func:`~keras_cct.lowering.precision.
        arithmetic_dtype`: float32 for 16-bit inputs on a machine that computes those slower)
        for a channels-last input shape, cached per spatial shape and batch. ``"auto"`` is
        planned for the batch the layer runs at: a concrete batch in the shape (JAX and PyTorch
        always have one; rankings at 8 images and at 32 differ), else the static batch the layer
        was built with, else the planner's default. A symbolic call (Keras computing output
        shapes) plans nothing: any lowering gives the same shape."""
        batch = shape[0] if isinstance(shape[0], int) else None
        key = (tuple(shape[1:]), batch if batch is not None else self._batch_hint)
        plan = self._plans.get(key)
        if plan is None:
            geo = self._geometry(shape)
            lowering = self.lowering
            if lowering != "auto":
                try:
                    check_available(geo, lowering)
                except LoweringError as exc:
                    raise ValueError(f"layer '{self.name}': {exc}") from None
            if _symbolic():  # a stand-in batch (Keras traces shapes with made-up sizes)
                return geo, "native" if lowering == "auto" else lowering, None
            arith = arithmetic_dtype(self.compute_dtype)
            if lowering == "auto":
                lowering = choose_for(geo, mode=self.planner, dtype=arith, batch=key[1],
                                      bias=self.use_bias)
            plan = self._plans[key] = (geo, lowering, arith)
        return plan

    @property
    def chosen_lowering(self) -> Optional[str]:
        """The lowering used for the most recently planned input shape (planned on first asking
        if the layer is built but has not run yet; None before build)."""
        if not self._plans:
            if self._built_shape is None:
                return None
            self._plan((self._batch_hint,) + self._built_shape)
        return list(self._plans.values())[-1][1]

    # ------------------------------------------------------------------------------ calling

    def call(self, inputs):
        x = inputs
        if self.data_format == "channels_first":
            x = ops.transpose(x, (0, 2, 3, 1))
        geo, lowering, arith = self._plan(tuple(x.shape))
        if self.device is not None:
            from keras_cct.ops import conv2d_on
            y = conv2d_on(self.device, x, self.kernel, self.bias, strides=self.strides,
                          padding=geo.pad, dilation_rate=self.dilation_rate, groups=self.groups)
        elif self._strategy is not None:  # each device adds the bias to its own shard
            y = computed_in(arith, lambda a, k, b: self._strategy.split_conv(
                self, a, k, geo, lowering, bias=b), x, self.kernel,
                self.bias if self.use_bias else None)
        else:
            y = conv2d_geo(x, self.kernel, geo, lowering,
                           bias=self.bias if self.use_bias else None, compute_dtype=arith)
        if self.data_format == "channels_first":
            y = ops.transpose(y, (0, 3, 1, 2))
        if self.activation is not None:
            y = self.activation(y)
        return y

    def compute_output_shape(self, input_shape) -> Tuple:
        shape = self._channels_last_shape(input_shape)
        if shape[1] is None or shape[2] is None:
            out = (shape[0], None, None, self.filters)
        else:
            geo = self._geometry(shape)
            out = (shape[0], geo.out_h, geo.out_w, self.filters)
        if self.data_format == "channels_first":
            out = (out[0], out[3], out[1], out[2])
        return out

    # ------------------------------------------------------------------------------ config

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update({
            "filters": self.filters,
            "kernel_size": self.kernel_size,
            "strides": self.strides,
            "padding": padding_to_config(self.padding),
            "data_format": self.data_format,
            "dilation_rate": self.dilation_rate,
            "groups": self.groups,
            "activation": activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": initializers.serialize(self.kernel_initializer),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "activity_regularizer": regularizers.serialize(self.activity_regularizer),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
            "lowering": self.lowering,
            "planner": self.planner,
            "device": self.device,
        })
        return config
