"""CCTStrategy's split convolution on the TensorFlow backend.

1. A stateful host callback returns this step's shard sizes (integers summing to the batch)
   from the layer's current fractions, so fractions can change between steps (rebalancing, a
   dropped device) without retracing the training function.
2. ``tf.split`` cuts the batch into contiguous shards; each runs on its device -- TF devices under
   ``tf.device`` with their own lowering, OpenCL devices through their worker process -- and
   ``tf.concat`` joins them in order. Gradients are autodiff's exact sums over shards.
3. OpenCL shards are asynchronous, like GPU launches: one op queues the request on the device
   and returns a ticket, the TF shards start only after every launch, and another op collects
   the result. The backward pass does the same. Without this, a host thread that must wait for
   a core held by a TF shard would start its device late and the shards would run one after
   the other.
4. TF shards are timed by host markers around them, OpenCL shards by their request's completion.
"""

from __future__ import annotations

import functools
import time
from typing import Dict, List, Optional

import numpy as np

from keras_cct.errors import DeviceError
from keras_cct.ops import failures
from keras_cct.strategy import _opencl

PREFIX = "tf"
SUPPORTS_JIT = False  # host callbacks cannot be compiled by XLA in a TF graph


def require_tensorflow() -> None:
    import keras
    if keras.backend.backend() != "tensorflow":
        raise DeviceError(
            f"this needs the TensorFlow backend; the Keras backend is "
            f"{keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow.")


def check(strategy) -> None:
    """Nothing more to check: every TF device and OpenCL device can take a shard."""


def _tf_device_name(name: str) -> str:
    _, kind, index = name.split(":")
    return f"/{kind.upper()}:{index}"


def timer(device, x, k, geo, lowering):
    """A function that runs ``x`` convolved with ``k`` once on backend ``device``."""
    import tensorflow as tf
    from keras_cct.lowering import conv2d_geo
    from keras_cct.lowering._backend.tensorflow import quiet_retracing
    with tf.init_scope():
        with tf.device(_tf_device_name(device.name)):
            tx, tk = tf.constant(x), tf.constant(k)
        fn = tf.function(lambda a, b: conv2d_geo(a, b, geo, lowering), autograph=False)
        quiet_retracing(fn)  # one per layer and device

    def run():
        with tf.init_scope(), tf.device(_tf_device_name(device.name)):
            fn(tx, tk).numpy()
    return run


def split_conv(strategy, plan, x, kernel, geo, lowering: str, bias=None):
    """See :meth:`CCTStrategy.split_conv`."""
    import tensorflow as tf
    from keras_cct.lowering import _backend
    kernel = _backend.as_tensor(kernel)
    b = [] if bias is None else [_backend.as_tensor(bias)]
    need_dx = _records_gradient(x)
    tied = strategy._tied_backward(geo, lowering, need_dx, eager=tf.executing_eagerly())

    @tf.custom_gradient
    def op(x, kernel, *b):
        bias = b[0] if b else None
        params = [kernel] + list(b)
        saved: Dict[int, tuple] = {}  # tied: device -> (its conv's input, its output)

        def tf_forward(i, xi):
            yi = _shard_conv(xi, kernel, geo, lowering)
            saved[i] = (xi, yi)
            return [yi if bias is None else yi + bias]

        def tf_backward(i, xi, dyi):
            if tied:  # the forward's own gradient: its lowered data is reused
                xf, yf = saved[i]
                sources = ([xf] if need_dx else []) + [kernel]
                grads = tf.gradients(yf, sources, grad_ys=dyi)
            else:
                sources = ([xi] if need_dx else []) + [kernel]
                with tf.GradientTape() as tape:
                    tape.watch([xi, kernel])
                    yi = _shard_conv(xi, kernel, geo, lowering)
                grads = tape.gradient(yi, sources, output_gradients=dyi)
            # an empty shard's convolution (see _shard_conv) has no path to its sources
            grads = [tf.zeros_like(s) if g is None else g for g, s in zip(grads, sources)]
            return grads + ([tf.reduce_sum(dyi, axis=(0, 1, 2))] if b else [])

        def join_backward(parts):
            sums = [tf.add_n(p) for p in parts[1 if need_dx else 0:]]
            return [tf.concat(parts[0], axis=0) if need_dx else None] + sums

        (y,), sizes = _run_split(strategy, plan, "forward", geo, x, None, params, tf_forward,
                                 lambda parts: [tf.concat(parts[0], axis=0)], tied=tied)
        y.set_shape([x.shape[0], geo.out_h, geo.out_w, geo.filters])

        def grad(dy):
            outs, _ = _run_split(strategy, plan, "backward", geo, x, dy, params, tf_backward,
                                 join_backward, need_dx=need_dx, sizes=sizes if tied else None)
            for t, like in zip(outs, [x] + params):
                if t is not None:
                    t.set_shape(like.shape)
            return outs

        return y, grad

    return failures.call_typed(op, x, kernel, *b)  # eager: a device's error as itself


def _run_split(strategy, plan, phase: str, geo, x, dy, params, tf_compute, join,
               need_dx: bool = True, tied: bool = False, sizes=None):
    """One pass of a split convolution: shard sizes from ``plan`` (or ``sizes``), the OpenCL
    shards launched, the TF shards computed (``tf_compute(i, x_i[, dy_i])``, timed), the
    OpenCL results collected; returns ``join`` of the per-shard outputs (a list per output;
    the backward's are ``[dx, dkernel(, dbias)]``, without ``dx`` unless ``need_dx``) and the
    sizes."""
    import tensorflow as tf
    n = len(strategy.devices)
    if sizes is None:
        sizes = tf.numpy_function(functools.partial(plan.next_sizes, phase, tied),
                                  [tf.shape(x)[0]], tf.int32, stateful=True,
                                  name=f"cct_{phase}_sizes")
        sizes.set_shape((n,))
    xs = tf.split(x, sizes, num=n, axis=0)
    dys = [None] * n if dy is None else tf.split(dy, sizes, num=n, axis=0)
    launched = {i: _OpenCLShard(strategy, plan, phase, i, geo, xs[i], dys[i], params, need_dx)
                for i, d in enumerate(strategy.devices) if d.is_opencl}
    tickets = [shard.ticket for shard in launched.values()]
    outs: List[Optional[list]] = [None] * n
    for i, d in enumerate(strategy.devices):
        if i in launched:
            continue
        with tf.device(_tf_device_name(d.name)):
            with tf.control_dependencies(tickets):  # after every launch
                inputs = [tf.identity(xs[i])] + ([] if dy is None else [tf.identity(dys[i])])
            outs[i] = _timed(functools.partial(plan.record, phase, i), inputs,
                             lambda *t, i=i: tf_compute(i, *t))
    for i, shard in launched.items():
        outs[i] = shard.collect()
    return join([list(parts) for parts in zip(*outs)]), sizes


def _shard_conv(xi, kernel, geo, lowering: str):
    """The convolution of one TF shard, which may hold no image: TensorFlow's oneDNN
    convolution answers an empty batch with a tensor of its *input's* shape (and its gradient
    then fails), so the lowerings that run it get an empty output of the right shape there."""
    import tensorflow as tf
    from keras_cct.lowering import conv2d_geo
    if lowering not in ("native", "space_to_depth"):
        return conv2d_geo(xi, kernel, geo, lowering)
    return tf.cond(tf.shape(xi)[0] > 0, lambda: conv2d_geo(xi, kernel, geo, lowering),
                   lambda: tf.zeros((0, geo.out_h, geo.out_w, geo.filters), xi.dtype))


def _records_gradient(x) -> bool:
    """Whether a gradient tape records ``x``'s history, i.e. whether anything can ask for the
    gradient with respect to ``x`` (False for a network's input: then its convolution's input
    gradient, the whole col2im, is not computed). True when it cannot be told."""
    try:
        from tensorflow.python.eager import record
        return bool(record.should_record_backprop([x]))
    except Exception:  # noqa: BLE001 - a TF without this (private) helper: assume it is
        return True


def _timed(record, inputs, compute):
    """``compute(*inputs)`` between two host markers; ``record(seconds)`` gets the time."""
    import tensorflow as tf
    clock: Dict[str, float] = {}

    def start(_):
        clock["t0"] = time.perf_counter()
        return np.int64(0)

    def end(*_):
        if "t0" in clock:
            record(time.perf_counter() - clock.pop("t0"))
        return np.int64(0)

    t0 = tf.numpy_function(start, [tf.shape(inputs[0])[0]], tf.int64, stateful=True,
                           name="cct_shard_start")
    with tf.control_dependencies([t0]):
        inputs = [tf.identity(t) for t in inputs]
    outs = compute(*inputs)
    t1 = tf.numpy_function(end, [tf.reshape(o, [-1])[:1] for o in outs], tf.int64,
                           stateful=True, name="cct_shard_end")
    with tf.control_dependencies([t1]):
        return [tf.identity(o) for o in outs]


class _OpenCLShard:
    """One OpenCL shard of one pass, computed asynchronously: ``ticket`` (an int64 tensor)
    launches the request on the device (:func:`_opencl.launch`); :meth:`collect` waits for it
    (:func:`_opencl.collect`: on the host if the device failed)."""

    def __init__(self, strategy, plan, phase: str, i: int, geo, x, dy, params,
                 need_dx: bool = True) -> None:
        import tensorflow as tf
        self.strategy, self.plan, self.phase, self.i, self.geo = strategy, plan, phase, i, geo
        self.kw = dict(need_dx=need_dx, with_bias=len(params) == 2)
        self.dtype = x.dtype  # OpenCL computes in float32: 16-bit data is cast at the boundary
        self.inputs = [tf.cast(t, tf.float32) for t in
                       [x] + ([] if dy is None else [dy]) + list(params)]
        self.ticket = tf.numpy_function(self._launch, self.inputs, tf.int64, stateful=False,
                                        name=f"cct_opencl_launch_{phase}")

    def _launch(self, *arrays) -> np.int64:
        return self.strategy._put_ticket(_opencl.launch(
            self.strategy, self.plan, self.phase, self.i, self.geo, arrays, **self.kw))

    def _collect(self, ticket, *arrays):
        launched = self.strategy._take_ticket(int(ticket))
        return _opencl.collect(self.strategy, self.plan, self.phase, self.i, self.geo,
                               launched, arrays, **self.kw)

    def collect(self) -> list:
        import tensorflow as tf
        need_dx, with_bias = self.kw["need_dx"], self.kw["with_bias"]
        n_out = 1 if self.phase == "forward" else int(need_dx) + 1 + int(with_bias)
        outs = tf.numpy_function(self._collect, [self.ticket] + self.inputs,
                                 [tf.float32] * n_out, stateful=False,
                                 name=f"cct_opencl_shard_{self.phase}")
        outs = [tf.cast(t, self.dtype) for t in (
            outs if isinstance(outs, (list, tuple)) else [outs])]
        geo = self.geo
        if self.phase == "forward":
            outs[0].set_shape([None, geo.out_h, geo.out_w, geo.filters])
        else:
            x, _, *params = self.inputs
            for t, like in zip(outs, ([x] if need_dx else []) + params):
                t.set_shape(like.shape)
        return outs
