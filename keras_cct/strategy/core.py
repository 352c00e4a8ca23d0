"""CCTStrategy: CcT's hybrid execution. Each convolution's mini-batch is split across devices in
proportion to their throughput and the shards run concurrently.

How a strategy-bound :class:`~keras_cct.HybridConv2D` computes (TensorFlow backend):

1. A stateful host callback returns this step's shard sizes (integers summing to the batch)
   from the layer's current fractions, so fractions can change between steps (rebalancing, a
   dropped device) without retracing the training function.
2. ``tf.split`` cuts the batch into contiguous shards; each runs on its device -- TF devices under
   ``tf.device`` with their own lowering, OpenCL devices through their worker process
   (``tf.numpy_function(stateful=False)`` inside a custom gradient, so TF overlaps it with the
   other shards) -- and ``tf.concat`` joins them in order. Gradients are autodiff's exact sums
   over shards: the split changes speed, never results.
3. Each shard's forward time is recorded (host markers around TF shards, the callback itself for
   OpenCL); with ``rebalance=True`` the fractions move toward equal finish times in smoothed,
   bounded steps.
4. If an OpenCL device fails during a step, its shard is recomputed on the host, the device is
   dropped with a :class:`~keras_cct.errors.DeviceDroppedWarning`, and training goes on.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from keras_cct.errors import DeviceDroppedWarning, DeviceError
from keras_cct.strategy import context

SPLITS = ("flops", "measure")


def _require_tensorflow() -> None:
    import keras
    if keras.backend.backend() != "tensorflow":
        raise DeviceError(
            f"CCTStrategy runs on the TensorFlow backend (it places shards with tf.device and "
            f"overlaps them in one TF graph); the Keras backend is "
            f"{keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow.")


def _tf_device_name(name: str) -> str:
    _, kind, index = name.split(":")
    return f"/{kind.upper()}:{index}"


def _backward_marker(plan: "_LayerPlan", i: int, event: str):
    """An identity whose gradient records backward ``event`` of shard ``i`` when the gradient
    passes through it (on the output: the shard's backward starts; on its input and kernel:
    a gradient of the shard is done)."""
    import tensorflow as tf

    def mark(_):
        plan.mark_backward(i, event)
        return np.int64(0)

    @tf.custom_gradient
    def identity(t):
        def grad(dt):
            done = tf.numpy_function(mark, [tf.reshape(dt, [-1])[:1]], tf.int64, stateful=True,
                                     name=f"cct_backward_{event}")
            with tf.control_dependencies([done]):
                return tf.identity(dt)
        return tf.identity(t), grad

    return identity


class _LayerPlan:
    """Split state of one layer: fractions over the strategy's devices and the last timings."""

    def __init__(self, strategy: "CCTStrategy", name: str, fractions: np.ndarray) -> None:
        self.strategy = strategy
        self.name = name
        self.lock = threading.Lock()
        self.fractions = np.asarray(fractions, np.float64)
        n = len(fractions)
        self.sizes = np.zeros(n, np.int64)
        self.last: List[Optional[float]] = [None] * n
        self.ms = np.full(n, np.nan)
        self.last_ms = np.full(n, np.nan)
        self.last_bwd: List[Optional[float]] = [None] * n
        self.last_bwd_ms = np.full(n, np.nan)
        self._bwd_start: List[Optional[float]] = [None] * n
        self.steps = 0

    # ---- called from TF's threads through host callbacks
    def next_sizes(self, batch) -> np.ndarray:
        batch = int(batch)
        with self.lock:
            self._rebalance()
            f = self.fractions * self.strategy.active
            if f.sum() <= 0:
                f = self.strategy.active.astype(np.float64)
            f = f / f.sum()
            bounds = np.round(np.cumsum(f) * batch).astype(np.int64)
            bounds[-1] = batch
            self.sizes = np.diff(np.concatenate([[0], bounds]))
            self.last = [None] * len(f)
            self.last_bwd = [None] * len(f)
            self.steps += 1
            return self.sizes.astype(np.int32)

    def record(self, i: int, seconds: float) -> None:
        with self.lock:
            self.last[i] = seconds
            ms = self.last_ms[i] = 1e3 * seconds
            self.ms[i] = ms if np.isnan(self.ms[i]) else 0.7 * self.ms[i] + 0.3 * ms

    def mark_backward(self, i: int, event: str) -> None:
        """A backward-pass event of shard ``i``: ``"start"`` (its output gradient arrived) or
        ``"end"`` (one of its input/kernel gradients is computed; the last one counts)."""
        now = time.perf_counter()
        with self.lock:
            if event == "start":
                self._bwd_start[i] = now
            elif self._bwd_start[i] is not None:
                self._set_backward(i, now - self._bwd_start[i])

    def record_backward(self, i: int, seconds: float) -> None:
        with self.lock:
            self._set_backward(i, seconds)

    def _set_backward(self, i: int, seconds: float) -> None:  # with self.lock held
        self.last_bwd[i] = seconds
        self.last_bwd_ms[i] = 1e3 * seconds

    def _rebalance(self) -> None:
        s = self.strategy
        if not s.rebalance:
            return
        busy = [i for i, n in enumerate(self.sizes) if n > 0 and s.active[i]]
        if len(busy) < 2 or any(self.last[i] is None or self.last[i] <= 0 for i in busy):
            return
        # training steps: balance forward + backward time (the devices' backward/forward
        # ratios differ); forward-only steps (predict) balance the forward
        seconds = [self.last[i] for i in busy]
        if all(self.last_bwd[i] is not None and self.last_bwd[i] > 0 for i in busy):
            seconds = [self.last[i] + self.last_bwd[i] for i in busy]
        rates = np.array([self.sizes[i] / t for i, t in zip(busy, seconds)])
        share = self.fractions[busy].sum()
        target = rates / rates.sum() * share
        step = np.clip(s.smoothing * (target - self.fractions[busy]), -s.max_step, s.max_step)
        f = self.fractions.copy()
        f[busy] = np.maximum(f[busy] + step, s.min_fraction)
        self.fractions = f / f.sum()


class CCTStrategy:
    """Split every HybridConv2D's mini-batch across devices in proportion to their throughput.

    Args:
        devices: device names from :func:`keras_cct.devices.list_devices` (``"tf:cpu:0"``,
            ``"tf:gpu:0"``, ``"opencl:0:0"``, ``"opencl:0:0.1"``, ...) or
            :class:`~keras_cct.devices.Device` objects (e.g. from ``get_device(name, env=...)``
            to limit an OpenCL worker's threads). Default: every TF device plus every OpenCL
            GPU/accelerator; OpenCL CPU devices share the cores TF already uses, so they are
            used only when named.
        split: ``"flops"`` (fractions from each device's calibrated GFLOP/s), ``"measure"``
            (time each layer on each device once, when the layer is built), or a list of
            fractions, one per device.
        rebalance: time the shards while training runs and move the fractions toward equal
            finish times (a device that slows down gets less work).
        smoothing: fraction of the way to the balanced split moved per step.
        max_step: largest change of one device's fraction per step.
        min_fraction: floor of an active device's fraction while rebalancing (it keeps being
            measured).

    Use ``with strategy.scope():`` while building a model (HybridConv2D layers created inside
    use the strategy in ``fit``, ``evaluate`` and ``predict``), or
    :func:`keras_cct.hybridize` for an existing model. TensorFlow backend only.
    """

    def __init__(self, devices: Optional[Sequence[Union[str, object]]] = None,
                 split: Union[str, Sequence[float]] = "flops", rebalance: bool = True, *,
                 smoothing: float = 0.5, max_step: float = 0.1,
                 min_fraction: float = 0.02) -> None:
        _require_tensorflow()
        from keras_cct.devices import Device, get_device, list_devices
        if devices is None:
            found = list_devices(calibrate=False)
            devices = [d for d in found if not d.is_opencl or d.kind != "cpu"]
        resolved = [d if isinstance(d, Device) else get_device(d) for d in devices]
        if not resolved:
            raise DeviceError("CCTStrategy needs at least one device")
        names = [d.name for d in resolved]
        if len(set(names)) != len(names):
            raise DeviceError(f"CCTStrategy: a device is listed twice in {names}")
        self.devices = resolved
        if isinstance(split, str):
            if split not in SPLITS:
                raise ValueError(f"`split` must be one of {SPLITS} or a list of fractions, got "
                                 f"{split!r}")
        else:
            fr = np.asarray(list(split), np.float64)
            if fr.shape != (len(resolved),) or np.any(fr < 0) or fr.sum() <= 0:
                raise ValueError(f"`split` needs one non-negative fraction per device "
                                 f"({len(resolved)}: {names}), got {list(split)!r}")
            split = list(fr / fr.sum())
        self.split = split
        self.rebalance = bool(rebalance)
        self.smoothing, self.max_step, self.min_fraction = smoothing, max_step, min_fraction
        self.active = np.ones(len(resolved), bool)
        self._plans: Dict[int, _LayerPlan] = {}
        self._flops: Optional[np.ndarray] = None
        self._lock = threading.Lock()

    @property
    def device_names(self) -> List[str]:
        return [d.name for d in self.devices]

    @contextlib.contextmanager
    def scope(self) -> Iterator["CCTStrategy"]:
        """HybridConv2D layers created inside this context compute under the strategy."""
        context.push(self)
        try:
            yield self
        finally:
            context.pop(self)

    # ------------------------------------------------------------------------- fractions

    def flops_fractions(self) -> np.ndarray:
        """Fractions proportional to each device's calibrated SGEMM GFLOP/s."""
        if self._flops is None:
            from keras_cct.devices import calibrate
            g = np.array([d.gflops or calibrate(d) for d in self.devices], np.float64)
            self._flops = g / g.sum()
        return self._flops

    def _initial_fractions(self, layer, geo, lowering) -> np.ndarray:
        if isinstance(self.split, list):
            return np.asarray(self.split)
        if self.split == "flops":
            return self.flops_fractions()
        return self._measured_fractions(geo, lowering)

    def _measured_fractions(self, geo, lowering, batch: int = 8) -> np.ndarray:
        import tensorflow as tf
        from keras_cct.devices.opencl.conv import conv2d_forward
        from keras_cct.lowering import conv2d_geo
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, geo.in_h, geo.in_w, geo.channels)).astype(np.float32)
        k = rng.standard_normal((geo.kh, geo.kw, geo.cg, geo.filters)).astype(np.float32)
        seconds = []
        with tf.init_scope():
            for d in self.devices:
                if d.is_opencl:
                    def run(d=d):
                        conv2d_forward(d.name, x, k, strides=(geo.sh, geo.sw), padding=geo.pad,
                                       dilation_rate=(geo.dh, geo.dw), groups=geo.groups)
                else:
                    with tf.device(_tf_device_name(d.name)):
                        tx, tk = tf.constant(x), tf.constant(k)
                    fn = tf.function(lambda a, b: conv2d_geo(a, b, geo, lowering))

                    def run(d=d, fn=fn, tx=tx, tk=tk):
                        with tf.device(_tf_device_name(d.name)):
                            fn(tx, tk).numpy()
                run()
                best = float("inf")
                for _ in range(2):
                    t0 = time.perf_counter()
                    run()
                    best = min(best, time.perf_counter() - t0)
                seconds.append(best)
        rate = 1.0 / np.array(seconds)
        return rate / rate.sum()

    def _plan(self, layer, geo, lowering) -> _LayerPlan:
        key = id(layer)
        with self._lock:
            plan = self._plans.get(key)
        if plan is None:
            plan = _LayerPlan(self, layer.name, self._initial_fractions(layer, geo, lowering))
            with self._lock:
                self._plans[key] = plan
        return plan

    def fractions(self, layer) -> Dict[str, float]:
        """The current fractions of ``layer`` (a strategy-bound HybridConv2D), by device."""
        plan = self._plans[id(layer)]
        f = plan.fractions * self.active
        f = f / f.sum()
        return dict(zip(self.device_names, map(float, f)))

    def report(self, layers: Optional[Sequence[object]] = None) -> List[Dict[str, object]]:
        """Per layer and device: the fraction in use, the images of the last step, the forward
        milliseconds of its shard (``ms`` smoothed over steps, ``last_ms`` of the last step), the
        backward milliseconds of its last training step (``last_bwd_ms``, NaN before one), and
        whether the device is still active.

        Args:
            layers: only these strategy-bound layers, in this order (e.g. ``model.layers``:
                other layers, and layers that have not run, are skipped); None: every layer
                that has run under the strategy.
        """
        rows = []
        plans = list(self._plans.values()) if layers is None else [
            self._plans[id(layer)] for layer in layers if id(layer) in self._plans]
        for plan in plans:
            f = plan.fractions * self.active
            f = f / f.sum()
            for i, d in enumerate(self.devices):
                rows.append({"layer": plan.name, "device": d.name, "fraction": float(f[i]),
                             "images": int(plan.sizes[i]), "ms": float(plan.ms[i]),
                             "last_ms": float(plan.last_ms[i]),
                             "last_bwd_ms": float(plan.last_bwd_ms[i]),
                             "active": bool(self.active[i])})
        return rows

    def callback(self, verbose: int = 1):
        """A Keras callback that records (and with ``verbose`` prints) the fractions each
        epoch; its ``history`` holds one :meth:`report` per epoch."""
        from keras_cct.strategy.callbacks import FractionLogger
        return FractionLogger(self, verbose=verbose)

    # ------------------------------------------------------------------------- failures

    def _drop(self, i: int, layer_name: str, exc: BaseException) -> None:
        with self._lock:
            if not self.active[i]:
                return
            if self.active.sum() <= 1:
                raise exc
            self.active[i] = False
        warnings.warn(
            f"CCTStrategy: device {self.devices[i].name} failed in layer '{layer_name}' "
            f"({exc}); its shard was recomputed on the host and the device is dropped for the "
            f"rest of the run", DeviceDroppedWarning, stacklevel=2)

    # ------------------------------------------------------------------------- computing

    def split_conv(self, layer, x, kernel, geo, lowering: str, bias=None):
        """``x`` convolved with ``kernel`` (plus ``bias``, added by each shard on its own
        device so that the bias and its gradient are split too), its batch split across the
        devices."""
        import tensorflow as tf
        from keras_cct.lowering import _backend
        plan = self._plan(layer, geo, lowering)
        n = len(self.devices)
        sizes = tf.numpy_function(plan.next_sizes, [tf.shape(x)[0]], tf.int32, stateful=True,
                                  name="cct_shard_sizes")
        sizes.set_shape((n,))
        shards = tf.split(x, sizes, num=n, axis=0)
        kernel = _backend.as_tensor(kernel)
        bias = None if bias is None else _backend.as_tensor(bias)
        ys = []
        for i, (device, xi) in enumerate(zip(self.devices, shards)):
            if device.is_opencl:
                ys.append(self._opencl_shard(plan, i, xi, kernel, geo, bias))
            else:
                ys.append(self._tf_shard(plan, i, xi, kernel, geo, lowering, bias))
        y = tf.concat(ys, axis=0)
        # the shards' sizes are run-time values: give the result the input's static batch size
        y.set_shape([x.shape[0]] + list(y.shape[1:]))
        return y

    def _tf_shard(self, plan, i, xi, kernel, geo, lowering, bias=None):
        import tensorflow as tf
        from keras_cct.lowering import conv2d_geo
        clock: Dict[str, float] = {}

        def start(_):
            clock["t0"] = time.perf_counter()
            return np.int64(0)

        def end(_):
            if "t0" in clock:
                plan.record(i, time.perf_counter() - clock.pop("t0"))
            return np.int64(0)

        with tf.device(_tf_device_name(self.devices[i].name)):
            t0 = tf.numpy_function(start, [tf.shape(xi)[0]], tf.int64, stateful=True)
            with tf.control_dependencies([t0]):
                xi = tf.identity(xi)
            xi, kernel = (_backward_marker(plan, i, "end")(t) for t in (xi, kernel))
            yi = conv2d_geo(xi, kernel, geo, lowering)
            if bias is not None:
                yi = yi + _backward_marker(plan, i, "end")(bias)
            t1 = tf.numpy_function(end, [yi[:1, :1, :1, :1]], tf.int64, stateful=True)
            with tf.control_dependencies([t1]):
                yi = tf.identity(yi)
            return _backward_marker(plan, i, "start")(yi)

    def _opencl_shard(self, plan, i, xi, kernel, geo, bias=None):
        import tensorflow as tf
        from keras_cct.devices.opencl.conv import conv2d_backward, conv2d_forward
        from keras_cct.strategy import host
        name = self.devices[i].name
        kw = dict(strides=(geo.sh, geo.sw), padding=geo.pad, dilation_rate=(geo.dh, geo.dw),
                  groups=geo.groups)
        with_bias = bias is not None

        def forward(x, k, *b):
            t0 = time.perf_counter()
            if self.active[i]:
                try:
                    y = conv2d_forward(name, x, k, b[0] if b else None, **kw)
                    plan.record(i, time.perf_counter() - t0)
                    return y
                except DeviceError as exc:
                    self._drop(i, plan.name, exc)
            y = host.forward(x, k, geo)
            return y + b[0] if b else y

        def backward(x, k, dy):
            if self.active[i]:
                try:
                    t0 = time.perf_counter()
                    dx, dk, db = conv2d_backward(name, x, k, dy, with_bias=with_bias, **kw)
                    plan.record_backward(i, time.perf_counter() - t0)
                    return (dx, dk, db) if with_bias else (dx, dk)
                except DeviceError as exc:
                    self._drop(i, plan.name, exc)
            dx, dk = host.backward(x, k, dy, geo)
            return (dx, dk, dy.sum(axis=(0, 1, 2))) if with_bias else (dx, dk)

        @tf.custom_gradient
        def op(x, k, *b):
            y = tf.numpy_function(forward, [x, k, *b], tf.float32, stateful=False,
                                  name="cct_opencl_shard")
            y.set_shape([None, geo.out_h, geo.out_w, geo.filters])

            def grad(dy):
                outs = tf.numpy_function(backward, [x, k, dy],
                                         [tf.float32] * (3 if with_bias else 2),
                                         stateful=False, name="cct_opencl_shard_grad")
                for t, like in zip(outs, (x, k) + b):
                    t.set_shape(like.shape)
                return list(outs)

            return y, grad

        return op(xi, kernel, bias) if with_bias else op(xi, kernel)
