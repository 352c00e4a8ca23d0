"""CCTStrategy: CcT's hybrid execution. Each convolution's mini-batch is split across devices in
proportion to their throughput and the shards run concurrently.

How a strategy-bound :class:`~keras_cct.HybridConv2D` computes (TensorFlow backend):

1. A stateful host callback returns this step's shard sizes (integers summing to the batch)
   from the layer's current fractions, so fractions can change between steps (rebalancing, a
   dropped device) without retracing the training function.
2. ``tf.split`` cuts the batch into contiguous shards; each runs on its device -- TF devices under
   ``tf.device`` with their own lowering, OpenCL devices through their worker process -- and
   ``tf.concat`` joins them in order. Gradients are autodiff's exact sums over shards: the split
   changes speed, never results.
3. OpenCL shards are asynchronous, like GPU launches: one op queues the request on the device
   (the client's device thread copies the data and talks to the worker) and returns a ticket,
   the TF shards start only after every launch, and another op collects the result. The
   backward pass does the same (the OpenCL gradients are launched before the TF shards'
   gradients start). Without this, a host thread that must wait for a core held by a TF shard
   would start its device late and the shards would run one after the other.
4. Each shard's forward and backward times are recorded (host markers around TF shards, the
   request's own completion for OpenCL); with ``rebalance=True`` the fractions move toward
   equal finish times in smoothed, bounded steps.
5. If an OpenCL device fails during a step (it dies, or stalls past its deadline), its shard is
   recomputed on the host, the device dropped (``DeviceDroppedWarning``), training goes on.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from keras_cct.errors import DeviceDroppedWarning, DeviceError
from keras_cct.ops import failures
from keras_cct.strategy import context, host

SPLITS = ("flops", "measure")
BACKWARD_SPLITS = ("auto", "own", "forward")


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


PHASES = ("forward", "backward")


class _Phase:
    """Split state of one pass (forward or backward) of one layer: fractions over the
    strategy's devices, the images of the last step, and the devices' times."""

    def __init__(self, fractions: np.ndarray) -> None:
        n = len(fractions)
        self.fractions = np.asarray(fractions, np.float64)
        self.sizes = np.zeros(n, np.int64)
        self.last: List[Optional[float]] = [None] * n  # seconds of the last step
        self.ms = np.full(n, np.nan)                    # smoothed over steps
        self.last_ms = np.full(n, np.nan)


class _LayerPlan:
    """Split state of one layer. The forward and the backward pass are split separately:
    all their inputs are in host memory, so the backward's shards need not be the forward's,
    and each pass is balanced on its own times (a device's backward/forward time ratio
    differs from another's, so one split cannot balance both passes) -- unless the split is
    *tied* (see :meth:`CCTStrategy.split_conv`)."""

    def __init__(self, strategy: "CCTStrategy", name: str, fractions: np.ndarray) -> None:
        self.strategy = strategy
        self.name = name
        self.lock = threading.Lock()
        self.phases = {p: _Phase(fractions) for p in PHASES}
        self.steps = 0

    # ---- called from TF's threads through host callbacks
    def next_sizes(self, phase: str, tied: bool, batch) -> np.ndarray:
        """This step's shard sizes of ``phase`` (integers summing to ``batch``), after moving
        its fractions toward equal finish times. ``tied``: the backward reuses the forward's
        shards (and its lowered data), so the forward is balanced on forward + backward time
        and the backward phase mirrors it."""
        batch = int(batch)
        with self.lock:
            ph = self.phases[phase]
            bwd = self.phases["backward"]
            self._rebalance(ph, bwd if tied and phase == "forward" else None)
            f = ph.fractions * self.strategy.active
            if f.sum() <= 0:
                f = self.strategy.active.astype(np.float64)
            f = f / f.sum()
            bounds = np.round(np.cumsum(f) * batch).astype(np.int64)
            bounds[-1] = batch
            ph.sizes = np.diff(np.concatenate([[0], bounds]))
            ph.last = [None] * len(f)
            if phase == "forward":
                self.steps += 1
                if tied:
                    bwd.fractions, bwd.sizes = ph.fractions.copy(), ph.sizes.copy()
                    bwd.last = [None] * len(f)
            return ph.sizes.astype(np.int32)

    def record(self, phase: str, i: int, seconds: float) -> None:
        with self.lock:
            ph = self.phases[phase]
            ph.last[i] = seconds
            ms = ph.last_ms[i] = 1e3 * seconds
            ph.ms[i] = ms if np.isnan(ph.ms[i]) else 0.7 * ph.ms[i] + 0.3 * ms

    def _rebalance(self, ph: _Phase, also: Optional[_Phase] = None) -> None:  # lock held
        """Move ``ph``'s fractions toward equal finish times of its last step (plus those of
        ``also`` on the same shards, when it has them all)."""
        s = self.strategy
        if not s.rebalance:
            return
        busy = [i for i, n in enumerate(ph.sizes) if n > 0 and s.active[i]]
        if len(busy) < 2 or any(ph.last[i] is None or ph.last[i] <= 0 for i in busy):
            return
        seconds = [ph.last[i] for i in busy]
        if also is not None and all(also.last[i] is not None and also.last[i] > 0
                                    for i in busy):
            seconds = [t + also.last[i] for t, i in zip(seconds, busy)]
        rates = np.array([ph.sizes[i] / t for i, t in zip(busy, seconds)])
        share = ph.fractions[busy].sum()
        target = rates / rates.sum() * share
        step = np.clip(s.smoothing * (target - ph.fractions[busy]), -s.max_step, s.max_step)
        f = ph.fractions.copy()
        f[busy] = np.maximum(f[busy] + step, s.min_fraction)
        ph.fractions = f / f.sum()


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
        backward_split: ``"own"`` (the backward pass has a split of its own, balanced on
            backward times; TensorFlow shards lower their input again), ``"forward"`` (the
            backward reuses the forward's shards and lowered data; one split balanced on
            forward + backward time) or ``"auto"``: ``"forward"`` for a layer whose lowering
            costs more than half the backward work it would be redone for (by
            :func:`keras_cct.lowering.cost.cost`: e.g. a first layer on 3 channels, which needs
            no input gradient), else ``"own"``. Eager execution always uses ``"own"``.

    Use ``with strategy.scope():`` while building a model (HybridConv2D layers created inside
    use the strategy in ``fit``, ``evaluate`` and ``predict``), or
    :func:`keras_cct.hybridize` for an existing model. TensorFlow backend only.
    """

    def __init__(self, devices: Optional[Sequence[Union[str, object]]] = None,
                 split: Union[str, Sequence[float]] = "flops", rebalance: bool = True, *,
                 smoothing: float = 0.5, max_step: float = 0.1,
                 min_fraction: float = 0.02, backward_split: str = "auto") -> None:
        _require_tensorflow()
        failures.install_keras_hook()  # a device's typed error out of fit / evaluate / predict
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
        if backward_split not in BACKWARD_SPLITS:
            raise ValueError(f"`backward_split` must be one of {BACKWARD_SPLITS}, got "
                             f"{backward_split!r}")
        self.backward_split = backward_split
        self.active = np.ones(len(resolved), bool)
        self._plans: Dict[int, _LayerPlan] = {}
        self._flops: Optional[np.ndarray] = None
        self._lock = threading.Lock()
        self._tickets: Dict[int, object] = {}
        self._next_ticket = itertools.count(1)

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

    def fractions(self, layer, phase: str = "forward") -> Dict[str, float]:
        """The current fractions of ``layer`` (a strategy-bound HybridConv2D), by device, of
        its ``"forward"`` or ``"backward"`` pass."""
        if phase not in PHASES:
            raise ValueError(f"`phase` must be one of {PHASES}, got {phase!r}")
        f = self._plans[id(layer)].phases[phase].fractions * self.active
        f = f / f.sum()
        return dict(zip(self.device_names, map(float, f)))

    def report(self, layers: Optional[Sequence[object]] = None) -> List[Dict[str, object]]:
        """Per layer and device: the forward fraction in use (``fraction``), the images of the
        last forward (``images``), the forward milliseconds of its shard (``ms`` smoothed over
        steps, ``last_ms`` of the last step); the same for the backward pass of training steps
        (``bwd_fraction``, ``bwd_images``, ``bwd_ms``, ``last_bwd_ms``; NaN before one); and
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
            fwd, bwd = (plan.phases[p] for p in PHASES)
            ff, fb = (ph.fractions * self.active for ph in (fwd, bwd))
            ff, fb = ff / ff.sum(), fb / fb.sum()
            for i, d in enumerate(self.devices):
                rows.append({"layer": plan.name, "device": d.name, "fraction": float(ff[i]),
                             "images": int(fwd.sizes[i]), "ms": float(fwd.ms[i]),
                             "last_ms": float(fwd.last_ms[i]),
                             "bwd_fraction": float(fb[i]), "bwd_images": int(bwd.sizes[i]),
                             "bwd_ms": float(bwd.ms[i]), "last_bwd_ms": float(bwd.last_ms[i]),
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
            if self.active.sum() <= 1:  # nowhere else to go: the caller gets the error
                raise failures.remember(exc)
            self.active[i] = False
        warnings.warn(
            f"CCTStrategy: device {self.devices[i].name} failed in layer '{layer_name}' "
            f"({exc}); its shard was recomputed on the host and the device is dropped for the "
            f"rest of the run", DeviceDroppedWarning, stacklevel=2)

    # ------------------------------------------------------------------------- computing

    def _put_ticket(self, value: object) -> np.int64:
        """Keep a launched request (its future, an exception, or None) until it is taken."""
        ticket = next(self._next_ticket)
        self._tickets[ticket] = value
        return np.int64(ticket)

    def _take_ticket(self, ticket: int) -> object:
        return self._tickets.pop(ticket, None)

    def split_conv(self, layer, x, kernel, geo, lowering: str, bias=None):
        """``x`` convolved with ``kernel`` (plus ``bias``, added by each shard on its own
        device so that the bias and its gradient are split too), its batch split across the
        devices; the backward pass has a split of its own (see :class:`_LayerPlan`) or, when
        *tied* (``backward_split``), the forward's shards and its lowered data.

        OpenCL shards are launched first (queued on their devices, which return at once,
        like a GPU launch), then the TF shards compute, then the OpenCL results are
        collected; so the devices overlap whatever the host's thread scheduling.
        """
        import tensorflow as tf
        from keras_cct.lowering import _backend
        plan = self._plan(layer, geo, lowering)
        kernel = _backend.as_tensor(kernel)
        b = [] if bias is None else [_backend.as_tensor(bias)]

        need_dx = _records_gradient(x)
        tied = self._tied_backward(geo, lowering, need_dx)

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

            (y,), sizes = self._run_split(plan, "forward", geo, x, None, params, tf_forward,
                                          lambda parts: [tf.concat(parts[0], axis=0)],
                                          tied=tied)
            y.set_shape([x.shape[0], geo.out_h, geo.out_w, geo.filters])

            def grad(dy):
                outs, _ = self._run_split(plan, "backward", geo, x, dy, params, tf_backward,
                                          join_backward, need_dx=need_dx,
                                          sizes=sizes if tied else None)
                for t, like in zip(outs, [x] + params):
                    if t is not None:
                        t.set_shape(like.shape)
                return outs

            return y, grad

        return failures.call_typed(op, x, kernel, *b)  # eager: a device's error as itself

    def _tied_backward(self, geo, lowering: str, need_dx: bool) -> bool:
        """Whether the backward reuses the forward's shards (``backward_split``)."""
        import tensorflow as tf
        from keras_cct.lowering.cost import Machine, cost
        from keras_cct.lowering.engine import MODES
        if tf.executing_eagerly():  # no graph to take the forward's gradient from
            return False
        if self.backward_split != "auto":
            return self.backward_split == "forward"
        if lowering not in MODES:
            return False  # the backend's convolution: its gradient lowers nothing
        c, m = cost(geo, lowering, batch=1), Machine()
        relower = c.lowering_elements / m.move_elements_per_s
        backward = c.gemm_flops / m.gemm_flops_per_s  # the kernel gradient's GEMM
        if need_dx:
            backward += c.gemm_flops / m.gemm_flops_per_s + \
                c.backward_movement / m.move_elements_per_s
        return relower > 0.5 * backward

    def _run_split(self, plan: _LayerPlan, phase: str, geo, x, dy, params, tf_compute, join,
                   need_dx: bool = True, tied: bool = False, sizes=None):
        """One pass of a split convolution: shard sizes from ``plan`` (or ``sizes``), the
        OpenCL shards launched, the TF shards computed (``tf_compute(i, x_i[, dy_i])``,
        timed), the OpenCL results collected; returns ``join`` of the per-shard outputs (a
        list per output; the backward's are ``[dx, dkernel(, dbias)]``, without ``dx`` unless
        ``need_dx``) and the sizes."""
        import tensorflow as tf
        n = len(self.devices)
        if sizes is None:
            sizes = tf.numpy_function(functools.partial(plan.next_sizes, phase, tied),
                                      [tf.shape(x)[0]], tf.int32, stateful=True,
                                      name=f"cct_{phase}_sizes")
            sizes.set_shape((n,))
        xs = tf.split(x, sizes, num=n, axis=0)
        dys = [None] * n if dy is None else tf.split(dy, sizes, num=n, axis=0)
        launched = {i: _OpenCLShard(self, plan, phase, i, geo, xs[i], dys[i], params, need_dx)
                    for i, d in enumerate(self.devices) if d.is_opencl}
        tickets = [shard.ticket for shard in launched.values()]
        outs: List[Optional[list]] = [None] * n
        for i, d in enumerate(self.devices):
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
    """One OpenCL shard of one pass of a split convolution, computed asynchronously.

    ``ticket`` (an int64 tensor) launches the request on the device; :meth:`collect` waits
    for it and returns the outputs (forward: ``[y]``; backward: ``[dx, dkernel(, dbias)]``).
    If the device fails, the shard is recomputed on the host (:mod:`keras_cct.strategy.host`)
    and the device dropped.
    """

    def __init__(self, strategy: CCTStrategy, plan: _LayerPlan, phase: str, i: int, geo,
                 x, dy, params, need_dx: bool = True) -> None:
        import tensorflow as tf
        self.strategy, self.plan, self.phase, self.i, self.geo = strategy, plan, phase, i, geo
        self.need_dx = need_dx
        self.name = strategy.devices[i].name
        self.with_bias = len(params) == 2
        self.inputs = [x] + ([] if dy is None else [dy]) + list(params)
        self.kw = dict(strides=(geo.sh, geo.sw), padding=geo.pad,
                       dilation_rate=(geo.dh, geo.dw), groups=geo.groups)
        self.ticket = tf.numpy_function(self._launch, self.inputs, tf.int64, stateful=False,
                                        name=f"cct_opencl_launch_{phase}")

    def _launch(self, *arrays) -> np.int64:
        """Queue the request on the device; returns the ticket :meth:`_collect` takes. An
        inactive device, or one that refuses the request, gets none (the collector then
        computes on the host)."""
        from keras_cct.devices.opencl import conv
        s = self.strategy
        t0 = time.perf_counter()
        future: object = None
        if s.active[self.i]:
            try:
                if self.phase == "forward":
                    x, k, *b = arrays
                    future = conv.conv2d_forward(self.name, x, k, b[0] if b else None,
                                                 wait=False, **self.kw)
                else:
                    x, dy, k = arrays[:3]
                    future = conv.conv2d_backward(self.name, x, k, dy, wait=False,
                                                  with_bias=self.with_bias,
                                                  need_dx=self.need_dx, **self.kw)
                future.add_done_callback(lambda f: f.exception() is None and self.plan.record(
                    self.phase, self.i, time.perf_counter() - t0))
            except DeviceError as exc:
                future = exc
        return s._put_ticket(future)

    def _collect(self, ticket, *arrays):
        s = self.strategy
        future = s._take_ticket(int(ticket))
        try:
            if isinstance(future, BaseException):
                raise future
            if future is not None:
                out = future.result()
                return [out] if self.phase == "forward" else self._backward_outputs(*out)
        except DeviceError as exc:
            s._drop(self.i, self.plan.name, exc)
        # on the host
        if self.phase == "forward":
            x, k, *b = arrays
            y = host.forward(x, k, self.geo)
            return [y + b[0] if b else y]
        x, dy, k = arrays[:3]
        dx, dk = host.backward(x, k, dy, self.geo)
        return self._backward_outputs(dx, dk, dy.sum(axis=(0, 1, 2)))

    def _backward_outputs(self, dx, dk, db) -> list:
        return ([dx] if self.need_dx else []) + [dk] + ([db] if self.with_bias else [])

    def collect(self) -> list:
        import tensorflow as tf
        n_out = 1 if self.phase == "forward" else (
            int(self.need_dx) + 1 + int(self.with_bias))
        outs = tf.numpy_function(self._collect, [self.ticket] + self.inputs,
                                 [tf.float32] * n_out, stateful=False,
                                 name=f"cct_opencl_shard_{self.phase}")
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        geo = self.geo
        if self.phase == "forward":
            outs[0].set_shape([None, geo.out_h, geo.out_w, geo.filters])
        else:
            x, _, *params = self.inputs
            for t, like in zip(outs, ([x] if self.need_dx else []) + params):
                t.set_shape(like.shape)
        return outs
