"""CCTStrategy: CcT's hybrid execution. Each convolution's mini-batch is split across devices in
proportion to their throughput and the shards run concurrently.

This module holds what every Keras backend shares: the split state of each layer (fractions
of each pass, rebalancing toward equal finish times, the report) and the strategy's API. The
split op itself -- cutting the batch, launching the OpenCL shards first, computing the
backend's shards, collecting and joining -- is one small module per backend, chosen once:
:mod:`._tf` (``tf.device`` and host callbacks in the TF graph), :mod:`._jax` (host callbacks
in the jit-compiled step, ``jax.custom_vjp``) and :mod:`._torch` (eager, an
``autograd.Function``); the OpenCL shard on numpy arrays, shared by all three, is
:mod:`._opencl`.

The split changes speed, never results: each shard adds the bias on its own device, input
gradients are joined, kernel and bias gradients summed. If an OpenCL device fails during a
step (it dies, or stalls past its deadline), its shard is recomputed on the host, the device
dropped (``DeviceDroppedWarning``), and training goes on.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import threading
import time
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from keras_cct.errors import DeviceDroppedWarning, DeviceError
from keras_cct.ops import failures
from keras_cct.strategy import context

SPLITS = ("flops", "measure")
BACKWARD_SPLITS = ("auto", "own", "forward")
_BACKENDS = {"tensorflow": "_tf", "jax": "_jax", "torch": "_torch"}


def backend_module():
    """The split op of the current Keras backend (:mod:`._tf`, :mod:`._jax`, :mod:`._torch`)."""
    import keras
    name = keras.backend.backend()
    if name not in _BACKENDS:
        raise DeviceError(f"CCTStrategy runs on the tensorflow, jax and torch Keras backends, "
                          f"not {name!r}")
    return importlib.import_module(f"keras_cct.strategy.{_BACKENDS[name]}")


PHASES = ("forward", "backward")
#: steps of a layer before rebalancing may park a device (first calls compile and warm up)
PARK_AFTER = 5


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

    def sizes(self, phase: str, batch: int) -> np.ndarray:
        """Shard sizes of ``phase`` from its current fractions (integers summing to
        ``batch``; an inactive device gets none)."""
        with self.lock:
            return self._sizes(self.phases[phase], int(batch))

    def _sizes(self, ph: _Phase, batch: int) -> np.ndarray:  # lock held
        f = ph.fractions * self.strategy.active
        if f.sum() <= 0:
            f = self.strategy.active.astype(np.float64)
        bounds = np.round(np.cumsum(f / f.sum()) * batch).astype(np.int64)
        bounds[-1] = batch
        sizes = np.diff(np.concatenate([[0], bounds]))
        if not self.strategy.rebalance:  # a fixed split: the fractions as given, rounded
            return sizes.astype(np.int32)
        # rebalancing, a device with a share keeps at least one image, so it keeps being
        # measured (a share under one image -- min_fraction at a small batch, or a rounding
        # -- left it without a time, stuck there); the image comes from the largest shard
        starved = np.flatnonzero((f > 0) & (sizes == 0))
        for i in starved[np.argsort(-f[starved], kind="stable")]:
            j = int(np.argmax(sizes))
            if sizes[j] <= 1:
                break
            sizes[j] -= 1
            sizes[i] += 1
        return sizes.astype(np.int32)

    # ---- called from the backend's threads through host callbacks
    def next_sizes(self, phase: str, tied: bool, batch, fixed=None) -> np.ndarray:
        """This step's shard sizes of ``phase`` (integers summing to ``batch``), after moving
        its fractions toward equal finish times. ``tied``: the backward reuses the forward's
        shards (and its lowered data), so the forward is balanced on forward + backward time
        and the backward phase mirrors it. ``fixed``: the sizes this step runs with (a
        compiled step's static shapes, JAX); the return value is the sizes the fractions now
        ask for."""
        batch = int(batch)
        with self.lock:
            ph = self.phases[phase]
            bwd = self.phases["backward"]
            self._rebalance(ph, bwd if tied and phase == "forward" else None)
            wanted = self._sizes(ph, batch)
            ph.sizes = wanted.astype(np.int64) if fixed is None else np.array(fixed, np.int64)
            n = len(ph.sizes)
            ph.last = [None] * n
            if phase == "forward":
                self.steps += 1
                if tied:
                    bwd.fractions, bwd.sizes = ph.fractions.copy(), ph.sizes.copy()
                    bwd.last = [None] * n
            return wanted

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
        batch = int(ph.sizes.sum())
        f = ph.fractions.copy()
        if self.steps > PARK_AFTER:
            # a device whose one image takes longer than the others' whole batch can only
            # slow the step down (a CPU beside a GPU: 2.5 ms for one image of CaffeNet's
            # conv2 against 0.7 ms for 63 on an H200): parked, no shard of this pass
            slow = rates * batch < rates.sum() - rates
            if slow.any() and not slow.all():
                f[np.asarray(busy)[slow]] = 0.0
                busy, rates = list(np.asarray(busy)[~slow]), rates[~slow]
        share = f[busy].sum()
        target = rates / rates.sum() * share
        step = np.clip(s.smoothing * (target - f[busy]), -s.max_step, s.max_step)
        # the floor: min_fraction, or one image if that is less (_sizes gives every device
        # with a share at least one image, whatever the fraction)
        floor = min(s.min_fraction, 1.0 / max(batch, 1))
        f[busy] = np.maximum(f[busy] + step, floor)
        ph.fractions = f / f.sum()


class CCTStrategy:
    """Split every HybridConv2D's mini-batch across devices in proportion to their throughput.

    Args:
        devices: device names from :func:`keras_cct.devices.list_devices` (``"tf:cpu:0"``,
            ``"tf:gpu:0"``, ``"jax:cpu:0"``, ``"torch:cpu"``, ``"torch:cuda:0"``,
            ``"opencl:0:0"``, ``"opencl:0:0.1"``, ...) or :class:`~keras_cct.devices.Device`
            objects (e.g. from ``get_device(name, env=...)`` to limit an OpenCL worker's
            threads). Default: every device of the Keras backend plus every OpenCL
            GPU/accelerator; OpenCL CPU devices share the cores the backend already uses, so
            they are used only when named.
        split: ``"flops"`` (fractions from each device's calibrated GFLOP/s), ``"measure"``
            (time each layer on each device once, when the layer is built), or a list of
            fractions, one per device.
        rebalance: time the shards while training runs and move the fractions toward equal
            finish times (a device that slows down gets less work).
        smoothing: fraction of the way to the balanced split moved per step.
        max_step: largest change of one device's fraction per step.
        min_fraction: floor of an active device's fraction while rebalancing, or one image
            of the batch if that is less. Every active device keeps at least one image of
            each step (while the batch has one for each), so it keeps being measured and its
            share can grow again after a slow step. A device whose one image takes longer
            than the other devices' whole batch (a CPU beside a GPU) is parked for that
            layer's pass once it has run a few steps: it gets no more shards there.
        backward_split: ``"own"`` (the backward pass has a split of its own, balanced on
            backward times; TensorFlow shards lower their input again), ``"forward"`` (the
            backward reuses the forward's shards and lowered data; one split balanced on
            forward + backward time) or ``"auto"``: ``"forward"`` for a layer whose lowering
            costs more than half the backward work it would be redone for (by
            :func:`keras_cct.lowering.cost.cost`: e.g. a first layer on 3 channels, which needs
            no input gradient), else ``"own"``. Eager execution always uses ``"own"``.

    Use ``with strategy.scope():`` while building a model (HybridConv2D layers created inside
    use the strategy in ``fit``, ``evaluate`` and ``predict``), or
    :func:`keras_cct.hybridize` for an existing model. TensorFlow, JAX and PyTorch backends
    (see docs/strategy.md for what each supports).
    """

    def __init__(self, devices: Optional[Sequence[Union[str, object]]] = None,
                 split: Union[str, Sequence[float]] = "flops", rebalance: bool = True, *,
                 smoothing: float = 0.5, max_step: float = 0.1,
                 min_fraction: float = 0.02, backward_split: str = "auto") -> None:
        self._impl = backend_module()
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
        self._impl.check(self)

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
        from keras_cct.devices.opencl.conv import conv2d_forward
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, geo.in_h, geo.in_w, geo.channels)).astype(np.float32)
        k = rng.standard_normal((geo.kh, geo.kw, geo.cg, geo.filters)).astype(np.float32)
        seconds = []
        for d in self.devices:
            if d.is_opencl:
                def run(d=d):
                    conv2d_forward(d.name, x, k, strides=(geo.sh, geo.sw), padding=geo.pad,
                                   dilation_rate=(geo.dh, geo.dw), groups=geo.groups)
            else:
                run = self._impl.timer(d, x, k, geo, lowering)
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
        if plan is None:  # the layer's first call: often while the backend traces a step
            fractions = _outside_trace(self._initial_fractions, layer, geo, lowering)
            plan = _LayerPlan(self, layer.name, fractions)
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

    @property
    def supports_jit(self) -> bool:
        """Whether a model under this strategy can be compiled by the backend (JAX: its host
        callbacks run in the jit-compiled step; TF: no, they cannot be compiled by XLA)."""
        return self._impl.SUPPORTS_JIT

    def split_conv(self, layer, x, kernel, geo, lowering: str, bias=None):
        """``x`` convolved with ``kernel`` (plus ``bias``, added by each shard on its own
        device so that the bias and its gradient are split too), its batch split across the
        devices; the backward pass has a split of its own (see :class:`_LayerPlan`) or, when
        *tied* (``backward_split``), the forward's shards and its lowered data.

        OpenCL shards are launched first (queued on their devices, which return at once,
        like a GPU launch), then the backend's shards compute, then the OpenCL results are
        collected; so the devices overlap whatever the host's thread scheduling.
        """
        return self._impl.split_conv(self, self._plan(layer, geo, lowering), x, kernel, geo,
                                     lowering, bias)

    def _tied_backward(self, geo, lowering: str, need_dx: bool, eager: bool = False) -> bool:
        """Whether the backward reuses the forward's shards (``backward_split``)."""
        from keras_cct.lowering.cost import Machine, cost
        from keras_cct.lowering.engine import MODES
        if eager:  # no graph to take the forward's gradient from
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


def _outside_trace(fn, *args):
    """``fn(*args)`` in a thread of its own: the backends' tracing state (a TF graph, a JAX
    trace) is per thread, so calibration and ``split="measure"`` timings run eagerly there
    even when the layer is first called inside a compiled step."""
    result: Dict[str, object] = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            result["error"] = exc

    thread = threading.Thread(target=run, name="cct-fractions")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
