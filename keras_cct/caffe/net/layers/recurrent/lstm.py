"""Caffe's recurrent layers: :class:`CaffeLSTM`, :class:`CaffeRNN` and :class:`CaffeLSTMUnit`.

Caffe's recurrent blobs are time-major: ``x`` is ``(T, N, ...)`` (T time steps of N independent
streams), ``cont`` is ``(T, N)`` (``cont[t, n] == 0`` starts a new sequence: the hidden state
coming into step ``t`` is zeroed), ``x_static`` is an optional ``(N, ...)`` input added at every
step. In Keras they are held in the package's layout (:mod:`keras_cct.caffe.net.layout`): Caffe's
axis 1 (here N) last, so ``x`` of Caffe shape ``(T, N, I)`` is the Keras tensor ``(T, I, N)``
and ``cont`` stays ``(T, N)``. The layers transpose to Caffe's order, run the recurrence with
``keras.ops.scan`` over the (possibly dynamic) time axis and transpose back; gradients come from
the backend's autodiff.

Variables are Caffe's blobs, same order and shapes (``caffe_type`` tells the weight converter),
so a caffemodel's LSTM/RNN blobs load as they are.

Caffe carries the hidden state from one forward pass to the next when ``expose_hidden`` is
false: the importer then pairs the layer (built with state inputs and outputs) with a
:class:`CaffeRecurrentState` holding ``h_T`` (, ``c_T``) for the next call. Called alone, these
layers start from zeros without ``expose_hidden``. As T is the Keras batch axis, give a model
whole sequences (``model(inputs)``, or ``predict`` with ``batch_size=T``).
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Sequence

import keras
from keras import ops

from keras_cct.caffe.net.layout import from_caffe_layout, to_caffe_layout

_PKG = "keras_cct"

__all__ = ["CaffeLSTM", "CaffeRNN", "CaffeLSTMUnit", "CaffeRecurrentState",
           "filler_initializer", "FILLER_TYPES"]

FILLER_TYPES = ("constant", "uniform", "gaussian", "xavier", "msra")
_NORMS = ("FAN_IN", "FAN_OUT", "AVERAGE")


def filler_initializer(filler: Optional[Mapping], shape: Sequence[int]):
    """A Keras initializer doing what Caffe's ``FillerParameter`` ``filler`` does for a blob of
    Caffe shape ``shape`` (fan in = count / shape[0], fan out = count / shape[1], as Caffe).

    ``filler`` is a dict of the FillerParameter's fields (``type``, ``value``, ``min``, ``max``,
    ``mean``, ``std``, ``variance_norm``); ``None`` is Caffe's default, constant 0.
    """
    f: Dict = {"type": "constant", "value": 0.0, "min": 0.0, "max": 1.0, "mean": 0.0,
               "std": 1.0, "variance_norm": "FAN_IN"}
    f.update(dict(filler or {}))
    kind = f["type"]
    if kind not in FILLER_TYPES:
        raise ValueError(f"filler type {kind!r} is not supported here (one of {FILLER_TYPES})")
    if kind == "constant":
        return keras.initializers.Constant(float(f["value"]))
    if kind == "uniform":
        return keras.initializers.RandomUniform(float(f["min"]), float(f["max"]))
    if kind == "gaussian":
        return keras.initializers.RandomNormal(float(f["mean"]), float(f["std"]))
    count = math.prod(int(d) for d in shape)
    fan_in = count / int(shape[0])
    fan_out = count / int(shape[1]) if len(shape) > 1 else float(count)
    n = {"FAN_IN": fan_in, "FAN_OUT": fan_out, "AVERAGE": (fan_in + fan_out) / 2}[
        f["variance_norm"]]
    if kind == "xavier":
        s = math.sqrt(3.0 / n)
        return keras.initializers.RandomUniform(-s, s)
    return keras.initializers.RandomNormal(0.0, math.sqrt(2.0 / n))  # msra


def _time_major(x, rank_tail: int):
    """A Keras-layout recurrent blob -> Caffe's (T, N, features) (features flattened)."""
    x = to_caffe_layout(x)
    return ops.reshape(x, (-1, x.shape[1], rank_tail))


def _flat_static(x, size: int):
    """A Keras-layout (N, ...) static input -> Caffe's (N, features)."""
    return ops.reshape(to_caffe_layout(x), (-1, size))


def _scan(step, init, xs):
    """``(last state, stacked h)`` of ``step`` over the time axis: ``keras.ops.scan`` (T may be
    dynamic: it is the Keras batch axis), a plain Python loop on PyTorch (eager, T known;
    Keras' scan there is such a loop too, with more bookkeeping). The steps return their
    states as outputs (TF's scan wants the carry's structure), h first."""
    if keras.backend.backend() != "torch":
        last, ys = ops.scan(step, init, xs)
        return last, ys[0]
    carry, hs = init, []
    for t in range(int(xs.shape[0])):
        carry, _ = step(carry, xs[t])
        hs.append(carry[0])
    return carry, ops.stack(hs)


class _Recurrent(keras.layers.Layer):
    """The parts LSTM and RNN share: config, input unpacking, the scan, output layouts."""

    gates = 1  # rows of W_x per hidden unit
    num_states = 1

    def __init__(self, num_output: int, static_input: bool = False, expose_hidden: bool = False,
                 weight_filler: Optional[Mapping] = None,
                 bias_filler: Optional[Mapping] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if int(num_output) <= 0:
            raise ValueError(f"num_output must be positive, got {num_output}")
        self.num_output = int(num_output)
        self.static_input = bool(static_input)
        self.expose_hidden = bool(expose_hidden)
        for name, filler in (("weight_filler", weight_filler), ("bias_filler", bias_filler)):
            try:
                filler_initializer(filler, (1, 1))  # validates the type now
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        self.weight_filler = dict(weight_filler or {})
        self.bias_filler = dict(bias_filler or {})

    @property
    def n_inputs(self) -> int:
        return 2 + int(self.static_input) + (self.num_states if self.expose_hidden else 0)

    def _split(self, inputs):
        inputs = list(inputs)
        if len(inputs) != self.n_inputs:
            raise ValueError(f"{type(self).__name__} expects {self.n_inputs} inputs (x, cont"
                             f"{', x_static' if self.static_input else ''}"
                             f"{', hidden states' if self.expose_hidden else ''}), "
                             f"got {len(inputs)}")
        x, cont = inputs[0], inputs[1]
        x_static = inputs[2] if self.static_input else None
        states = inputs[2 + int(self.static_input):]
        return x, cont, x_static, states

    def _weight(self, name: str, shape, filler):
        return self.add_weight(name=name, shape=tuple(shape),
                               initializer=filler_initializer(filler, shape))

    def build(self, input_shape):
        x_shape, cont_shape, static_shape, _ = self._split(input_shape)
        if len(x_shape) < 3:
            raise ValueError(f"x must have at least 2 Caffe axes (T, N, ...), got Keras shape "
                             f"{tuple(x_shape)}")
        if len(cont_shape) != 2:
            raise ValueError(f"cont must be 2-D (T, N), got shape {tuple(cont_shape)}")
        n_x = math.prod(int(d) for d in x_shape[1:-1])
        h, g = self.num_output, self.gates * self.num_output
        self._n_x = n_x
        self.w_x = self._weight(self._names[0], (g, n_x), self.weight_filler)
        self.b_x = self._weight(self._names[1], (g,), self.bias_filler)
        self.w_static = None
        if self.static_input:
            self._n_static = math.prod(int(d) for d in static_shape[1:])
            self.w_static = self._weight(self._names[2], (g, self._n_static),
                                         self.weight_filler)
        self.w_h = self._weight(self._names[3], (g, h), self.weight_filler)
        self._build_output()

    def _build_output(self):
        pass

    def _state_shape(self, x_shape):
        return (1, self.num_output, x_shape[-1])

    def compute_output_shape(self, input_shape):
        x_shape = self._split(input_shape)[0]
        out = (x_shape[0], self.num_output, x_shape[-1])
        if not self.expose_hidden:
            return out
        return [out] + [self._state_shape(x_shape)] * self.num_states

    def call(self, inputs):
        x, cont, x_static, states = self._split(inputs)
        dtype = self.compute_dtype
        x = _time_major(ops.cast(x, dtype), self._n_x)
        cont = ops.cast(cont, dtype)
        xw = ops.matmul(x, ops.transpose(self.w_x)) + self.b_x  # (T, N, G)
        if self.static_input:
            s = _flat_static(ops.cast(x_static, dtype), self._n_static)
            xw = xw + ops.matmul(s, ops.transpose(self.w_static))[None]
        if self.expose_hidden:
            init = tuple(to_caffe_layout(ops.cast(s, dtype))[0] for s in states)
        else:
            zero = ops.zeros_like(xw[0, :, :self.num_output])
            init = (zero,) * self.num_states
        w_h = ops.transpose(self.w_h)

        def step(carry, inp):
            return self._step(carry, inp[:, :-1], inp[:, -1:], w_h)

        # one sequence to scan (Keras' TF scan fails on several with a dynamic length)
        last, hs = _scan(step, init, ops.concatenate([xw, ops.cast(cont, xw.dtype)[..., None]],
                                                     axis=-1))
        ys = self._outputs(hs)
        out = from_caffe_layout(ys)
        if not self.expose_hidden:
            return out
        return [out] + [from_caffe_layout(s[None]) for s in last]

    def get_config(self):
        cfg = super().get_config()
        cfg.update(num_output=self.num_output, static_input=self.static_input,
                   expose_hidden=self.expose_hidden, weight_filler=self.weight_filler,
                   bias_filler=self.bias_filler)
        return cfg


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeLSTM(_Recurrent):
    """Caffe's LSTM layer (``recurrent_param``): inputs ``[x, cont]`` (+ ``x_static``) (+
    ``h_0, c_0`` with ``expose_hidden``), outputs ``h`` (Caffe ``(T, N, H)``) (+ ``h_T, c_T``,
    Caffe ``(1, N, H)``, with ``expose_hidden``).

    Variables, Caffe's blobs in order: ``W_xc (4H, I)``, ``b_c (4H,)``, [``W_xc_static (4H,
    S)``], ``W_hc (4H, H)``; gate rows in Caffe's order i, f, o, g. Each step::

        gates = W_xc x_t + b_c [+ W_xc_static x_static] + W_hc (cont_t * h_{t-1})
        i, f, o = sigmoid(...), g = tanh(...)
        c_t = cont_t * f * c_{t-1} + i * g ;  h_t = o * tanh(c_t)
    """

    caffe_type = "LSTM"
    gates = 4
    num_states = 2
    _names = ("W_xc", "b_c", "W_xc_static", "W_hc")

    def _step(self, carry, xw_t, cont_t, w_h):
        h_prev, c_prev = carry
        gates = xw_t + ops.matmul(cont_t * h_prev, w_h)
        c, h = lstm_unit(c_prev, gates, cont_t, self.num_output)
        return (h, c), (h, c)

    def _outputs(self, hs):
        return hs


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeRNN(_Recurrent):
    """Caffe's RNN layer (``recurrent_param``): inputs ``[x, cont]`` (+ ``x_static``) (+
    ``h_0`` with ``expose_hidden``), outputs ``o`` (Caffe ``(T, N, H)``) (+ ``h_T``).

    Variables, Caffe's blobs in order: ``W_xh (H, I)``, ``b_h (H,)``, [``W_xh_static (H, S)``],
    ``W_hh (H, H)``, ``W_ho (H, H)``, ``b_o (H,)``. Each step::

        h_t = tanh(W_xh x_t + b_h [+ W_xh_static x_static] + W_hh (cont_t * h_{t-1}))
        o_t = tanh(W_ho h_t + b_o)
    """

    caffe_type = "RNN"
    gates = 1
    num_states = 1
    _names = ("W_xh", "b_h", "W_xh_static", "W_hh")

    def _build_output(self):
        h = self.num_output
        self.w_o = self._weight("W_ho", (h, h), self.weight_filler)
        self.b_o = self._weight("b_o", (h,), self.bias_filler)

    def _step(self, carry, xw_t, cont_t, w_h):
        (h_prev,) = carry
        h = _tanh(xw_t + ops.matmul(cont_t * h_prev, w_h))
        return (h,), (h,)

    def _outputs(self, hs):
        return _tanh(ops.matmul(hs, ops.transpose(self.w_o)) + self.b_o)


def _tanh_of_backend():
    """``tanh`` in its input's dtype, chosen once for the Keras backend. Keras' JAX
    ``ops.tanh`` returns float32 for a float64 input (Keras 3.15: its result type of float64
    and a Python float is float32), which broke the float64 scan's carry and gradient checks;
    ``jnp.tanh`` keeps the dtype."""
    if keras.backend.backend() == "jax":
        import jax.numpy as jnp
        return jnp.tanh
    return ops.tanh


_tanh = _tanh_of_backend()


def lstm_unit(c_prev, gates, cont, hidden: int):
    """Caffe's LSTMUnit on (N, H) cells, (N, 4H) gate inputs (rows i, f, o, g) and (N, 1)
    continuation flags: ``(c, h)``."""
    i = ops.sigmoid(gates[:, :hidden])
    f = cont * ops.sigmoid(gates[:, hidden:2 * hidden])
    o = ops.sigmoid(gates[:, 2 * hidden:3 * hidden])
    g = _tanh(gates[:, 3 * hidden:])
    c = f * c_prev + i * g
    return c, o * _tanh(c)


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeLSTMUnit(keras.layers.Layer):
    """Caffe's LSTMUnit layer: inputs ``[c_prev, x, cont]`` of Caffe shapes ``(1, N, H)``,
    ``(1, N, 4H)`` (the gate inputs, rows i, f, o, g) and ``(1, N)``; outputs ``[c, h]``, both
    ``(1, N, H)`` (Keras layout ``(1, H, N)``). No weights."""

    def build(self, input_shape):
        c_shape, x_shape, cont_shape = input_shape
        if len(c_shape) != 3 or len(x_shape) != 3 or len(cont_shape) != 2:
            raise ValueError("LSTMUnit needs c_prev (1, N, H), x (1, N, 4H) and cont (1, N), "
                             f"got Keras shapes {c_shape}, {x_shape}, {cont_shape}")
        if x_shape[1] is not None and c_shape[1] is not None and x_shape[1] != 4 * c_shape[1]:
            raise ValueError(f"LSTMUnit's x has {x_shape[1]} channels, expected 4 x "
                             f"{c_shape[1]} (4 gates per cell)")

    def compute_output_shape(self, input_shape):
        return [tuple(input_shape[0]), tuple(input_shape[0])]

    def call(self, inputs):
        c_prev, x, cont = inputs
        dtype = self.compute_dtype
        hidden = c_prev.shape[1]
        c_prev = ops.reshape(to_caffe_layout(ops.cast(c_prev, dtype)), (-1, hidden))
        x = ops.reshape(to_caffe_layout(ops.cast(x, dtype)), (-1, 4 * hidden))
        cont = ops.reshape(ops.cast(cont, dtype), (-1, 1))
        c, h = lstm_unit(c_prev, x, cont, hidden)
        return [from_caffe_layout(c[None]), from_caffe_layout(h[None])]


@keras.saving.register_keras_serializable(package=_PKG)
class CaffeRecurrentState(keras.layers.Layer):
    """The hidden state Caffe carries from one forward pass to the next in a recurrent layer
    without ``expose_hidden`` (``RecurrentLayer::Forward`` copies ``h_T`` (, ``c_T``) into
    ``h_0`` (, ``c_0``); Caffe starts from zeros). Called twice in a net: on ``x`` it returns
    the stored states (Keras layout ``(1, H, N)``, no gradient: Caffe does not backpropagate
    across batches); on ``[y, h_T(, c_T)]`` it stores the new states and returns ``y``.
    :meth:`reset_states` zeroes them (Caffe's ``RecurrentLayer::Reset``). Not Caffe blobs:
    nothing is saved in a caffemodel."""

    def __init__(self, num_states: int, num_output: int, streams: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_states, self.num_output = int(num_states), int(num_output)
        self.streams = int(streams)
        self.states = [self.add_weight(name=f"state{i}", shape=self._shape, initializer="zeros",
                                       trainable=False) for i in range(self.num_states)]

    @property
    def _shape(self):
        return (1, self.num_output, self.streams)

    def build(self, input_shape):
        pass

    def compute_output_shape(self, input_shape):
        if isinstance(input_shape, (list, tuple)) and isinstance(input_shape[0], (list, tuple)):
            return tuple(input_shape[0])
        return [self._shape] * self.num_states

    def call(self, inputs):
        if isinstance(inputs, (list, tuple)):
            y, *last = inputs
            for var, value in zip(self.states, last):
                var.assign(ops.stop_gradient(ops.cast(value, var.dtype)))
            return y
        # a copy: the write below updates the variable in place (PyTorch's backward needs the
        # value read)
        return [ops.stop_gradient(ops.copy(ops.cast(ops.convert_to_tensor(v), self.compute_dtype)))
                for v in self.states]

    def reset_states(self) -> None:
        for var in self.states:
            var.assign(ops.zeros(self._shape, var.dtype))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(num_states=self.num_states, num_output=self.num_output,
                   streams=self.streams)
        return cfg
