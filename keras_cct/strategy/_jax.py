"""CCTStrategy's split convolution on the JAX backend: host callbacks in the jit-compiled step.

XLA compiles static shapes, so a compiled step's shard sizes are fixed when it is traced (from
the layer's fractions then). In the step, in this order (data dependencies give it: each host
callback takes the previous one's output, and the JAX shard's input adds the start marker's
0.0):

1. a host callback starts the pass: it moves the fractions toward equal finish times (the
   shards' times of the last step) and notes when the fractions now ask for other sizes;
2. each OpenCL shard is *launched* by a host callback (queued on its device's client thread,
   which returns at once, like a GPU launch);
3. the JAX shard computes on the JAX device with the layer's lowering, between two host
   markers that time it;
4. host callbacks collect the OpenCL results (on the host, with the device dropped, if it
   failed), and the shards are joined in order.

Gradients go through ``jax.custom_vjp``: the backward pass is split the same way, by fractions
of its own, or *tied* to the forward's shards (``backward_split``), when the JAX shard's
gradient reuses its forward's lowered data (``jax.vjp`` residuals).

When a layer's fractions ask for other shard sizes than a compiled step has (rebalancing, a
dropped device) -- by at least one image, or batch/32 images of a larger batch -- Keras'
step function is traced again before the next step (the trainer's
``make_*_function`` is wrapped, see :func:`install_retrace`); rebalancing moves in bounded,
smoothed steps, and a compiled split runs 2, 4, 8, ... (at most 64) steps before it may be
traced again (:data:`RETRACE_FIRST_WAIT`), so a model compiles a handful of times while its
fractions settle, not once per step. Outside ``jit`` every call reads the
fractions afresh.

The compiled step computes the shard of JAX's default device (``jax:cpu:0``, or ``jax:gpu:0``
where JAX's default backend is a GPU). Other JAX devices' shards are launched like OpenCL
ones, from host callbacks: their arrays are put on the device with ``jax.device_put`` and a
function compiled for it runs there asynchronously (:class:`_Remote`). Under
``keras.distribution.DataParallel`` the compiled step's own shard is itself data-parallel
over the distribution's devices (docs/strategy.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Dict, Optional

import numpy as np

from keras_cct.strategy import _opencl

PREFIX = "jax"
SUPPORTS_JIT = True  # host callbacks run inside the compiled step

_GENERATION = [0]  # bumped when a compiled step's sizes no longer match the fractions
_LOCK = threading.Lock()
#: Steps a layer runs with the sizes it was compiled with before rebalancing may ask for a new
#: trace: 2 after the first trace, doubling with every retrace the strategy has made, at most
#: 64. Each retrace recompiles the whole training step (seconds on a CPU); retracing whenever
#: the fractions moved by an image recompiled nearly every step while rebalancing settled
#: (benchmarks/hybrid.py on JAX: 10 minutes in one configuration). A dropped device retraces
#: at once.
RETRACE_FIRST_WAIT = 2
RETRACE_MAX_WAIT = 64


def check(strategy) -> None:
    """JAX devices named once each; the step's own device (JAX's default one) computes its
    shard in the compiled step, any other through host callbacks (see :func:`_Remote`)."""
    install_retrace()


def _in_graph(strategy) -> Optional[int]:
    """The index of the device whose shard the compiled step computes itself: JAX's default
    device, when the strategy has it (the others are launched like OpenCL devices)."""
    from keras_cct.devices.registry import _backend_devices
    default = _backend_devices()[0].name
    return next((i for i, d in enumerate(strategy.devices) if d.name == default), None)


def _jax_device(name: str):
    """The JAX device called ``name`` (numbered as :func:`keras_cct.devices.list_devices`)."""
    import jax
    _, kind, index = name.split(":")
    found = jax.devices() + ([] if jax.default_backend() == "cpu" else jax.devices("cpu"))
    return [d for d in found if ("cpu" if d.platform == "cpu" else "gpu") == kind][int(index)]


class _Remote:
    """A shard on another JAX device, launched from a host callback like an OpenCL shard: its
    arrays are put on the device with ``jax.device_put`` and a function compiled for it is
    dispatched (asynchronously: JAX returns at once); :meth:`result` waits. A thread notes
    the shard's time when it is ready."""

    _fns: Dict[tuple, object] = {}

    def __init__(self, plan, phase: str, i: int, name: str, geo, lowering: str, arrays):
        import jax
        from keras_cct.lowering import conv2d_geo
        key = (phase, name, geo, lowering, len(arrays))
        fn = self._fns.get(key)
        if fn is None:
            def forward(x, k, *b):
                y = conv2d_geo(x, k, geo, lowering)
                return (y + b[0] if b else y,)

            def backward(x, dy, k, *b):
                _, vjp = jax.vjp(lambda a, kk: conv2d_geo(a, kk, geo, lowering), x, k)
                return tuple(vjp(dy)) + ((dy.sum(axis=(0, 1, 2)),) if b else ())
            fn = self._fns[key] = jax.jit(forward if phase == "forward" else backward)
        t0, dev = time.perf_counter(), _jax_device(name)
        self.out = fn(*[jax.device_put(a, dev) for a in arrays])
        self.ready = threading.Event()

        def wait():
            try:
                jax.block_until_ready(self.out)
                plan.record(phase, i, time.perf_counter() - t0)
            finally:
                self.ready.set()
        threading.Thread(target=wait, daemon=True, name=f"cct-{name}").start()

    def result(self) -> list:
        self.ready.wait()
        return [np.asarray(o, np.float32) for o in self.out]


def timer(device, x, k, geo, lowering):
    """A function that runs ``x`` convolved with ``k`` once on backend ``device``."""
    import jax
    from keras_cct.lowering import conv2d_geo
    fn = jax.jit(lambda a, b: conv2d_geo(a, b, geo, lowering))
    dev = _jax_device(device.name)
    xa, ka = jax.device_put(x, dev), jax.device_put(k, dev)
    return lambda: fn(xa, ka).block_until_ready()


def _stale(generation: int) -> bool:
    """Marks the compiled steps of ``generation`` stale; whether this call did (not another)."""
    with _LOCK:
        if _GENERATION[0] == generation:
            _GENERATION[0] += 1
            return True
        return False


def _retrace_wait(strategy) -> int:
    """Steps a compiled split runs before rebalancing may trace it again (see
    :data:`RETRACE_FIRST_WAIT`)."""
    return min(RETRACE_MAX_WAIT, RETRACE_FIRST_WAIT * 2 ** getattr(strategy, "_jax_retraces", 0))


def _callback(fn, result, *args):
    """``fn(*args)`` on the host, in order with its data dependencies, never dropped."""
    from jax.experimental import io_callback
    return io_callback(fn, result, *args, ordered=False)


def _gated(x, zero):
    """``x`` that XLA can compute only after ``zero`` (a host callback's 0.0): a data
    dependency, as an optimization barrier's unused outputs are pruned."""
    return x + zero.astype(x.dtype)


def _f32(arrays) -> list:
    """``arrays`` in float32, as the host-side shards (OpenCL, other JAX devices) take them."""
    return [a.astype(np.float32) for a in arrays]


def _split(x, sizes):
    out, o = [], 0
    for n in sizes:
        out.append(x[o:o + n])
        o += n
    return out


def split_conv(strategy, plan, x, kernel, geo, lowering: str, bias=None):
    """See :meth:`CCTStrategy.split_conv`."""
    import jax
    import jax.numpy as jnp
    from keras_cct.lowering import conv2d_geo
    x = jnp.asarray(x)
    dtype = x.dtype  # the host's shards compute in float32: 16-bit data is cast at the boundary
    params = [jnp.asarray(getattr(kernel, "value", kernel))] + (
        [] if bias is None else [jnp.asarray(getattr(bias, "value", bias))])
    batch = int(x.shape[0])
    n = len(strategy.devices)
    with_bias = bias is not None
    tied = strategy._tied_backward(geo, lowering, True)
    generation = _GENERATION[0]
    own = _in_graph(strategy)
    fwd_sizes = [int(v) for v in plan.sizes("forward", batch)]
    bwd_sizes = fwd_sizes if tied else [int(v) for v in plan.sizes("backward", batch)]
    i32 = jax.ShapeDtypeStruct((), np.int32)
    f32 = jax.ShapeDtypeStruct((), np.float32)

    traced_at = plan.steps  # (this code runs when the step is traced)

    def begin(phase, sizes, after=()):
        """The pass's first host callback (after ``after``: the backward waits for the
        forward's output, so its launches never queue behind the forward's shards, even when
        its ``dy`` is known early, as with a fixed ``dy`` in a benchmark)."""
        def start(*_):
            wanted = plan.next_sizes(phase, tied, batch, fixed=sizes)
            # (a few images' wobble does not recompile a big batch; see RETRACE_FIRST_WAIT)
            if np.abs(wanted - np.asarray(sizes)).max() >= max(1, batch // 32) and \
                    plan.steps - traced_at >= _retrace_wait(strategy):
                if _stale(generation):
                    strategy._jax_retraces = getattr(strategy, "_jax_retraces", 0) + 1
            return np.int32(0)
        return _callback(start, i32, jnp.int32(batch), *after)

    def timed(phase, i, deps, compute, *inputs):
        """``compute(*inputs)`` started after ``deps`` (host callbacks' outputs), between two
        host markers; returns its outputs and the end marker's (a float32 0)."""
        clock = {}

        def start(*_):
            clock["t0"] = time.perf_counter()
            return np.float32(0)

        def end(*_):
            if "t0" in clock:
                plan.record(phase, i, time.perf_counter() - clock.pop("t0"))
            return np.float32(0)

        zero = _callback(start, f32, *deps)
        outs = compute(*[_gated(t, zero) for t in inputs])
        flat = jax.tree_util.tree_leaves(outs)  # all of it computed before the end marker
        return outs, _callback(end, f32, *[jnp.sum(o) for o in flat])

    def launched(phase, sizes, arrays_of, out_shapes, token, jax_compute, need_dx=True):
        """Launch the OpenCL shards and those of other JAX devices (after ``token``),
        compute the step's own shard (``jax_compute(i, deps)``, after the launches), collect
        (after it); returns the per-device outputs."""
        outs = [None] * n
        tickets = {}
        kw = dict(need_dx=need_dx, with_bias=with_bias)
        for i, d in enumerate(strategy.devices):
            if i != own and sizes[i] > 0:
                def launch(_, *arrays, i=i, d=d):
                    shard = _opencl.launch(strategy, plan, phase, i, geo, arrays, **kw) \
                        if d.is_opencl else _Remote(plan, phase, i, d.name, geo, lowering, arrays)
                    return np.int32(strategy._put_ticket(shard))
                tickets[i] = _callback(launch, i32, token, *_f32(arrays_of(i)))
        done = [token] + list(tickets.values())
        if own is not None and sizes[own] > 0:
            outs[own], end = jax_compute(own, done)
            done = [end]
        for i, ticket in tickets.items():
            def collect(ticket, _, *arrays, i=i):
                shard = strategy._take_ticket(int(ticket))
                if isinstance(shard, _Remote):
                    got = shard.result()[0 if need_dx or phase == "forward" else 1:]
                else:
                    got = _opencl.collect(strategy, plan, phase, i, geo, shard, arrays, **kw)
                if not strategy.active[i]:  # dropped: the step is traced again without it
                    _stale(generation)
                return tuple(np.asarray(g, np.float32) for g in got)
            outs[i] = [o.astype(dtype) for o in _callback(
                collect, out_shapes(i), ticket, done[0], *_f32(arrays_of(i)))]
        return outs

    def forward(x, *params):
        kernel, b = params[0], params[1:]
        token = begin("forward", fwd_sizes)
        xs = _split(x, fwd_sizes)
        residual = [None] * n

        def jax_compute(i, deps):
            def conv(xi):
                yi, vjp = jax.vjp(lambda a, k: conv2d_geo(a, k, geo, lowering), xi, kernel)
                residual[i] = vjp if tied else None
                return yi + b[0] if b else yi
            return timed("forward", i, deps, conv, xs[i])

        outs = launched("forward", fwd_sizes, lambda i: [xs[i]] + list(params),
                      lambda i: (jax.ShapeDtypeStruct(
                          (fwd_sizes[i], geo.out_h, geo.out_w, geo.filters), np.float32),),
                      token, jax_compute)
        y = jnp.concatenate([o if not isinstance(o, list) else o[0]
                             for o in outs if o is not None], axis=0)
        return y, residual

    def backward(x, dy, params, residual, need_dx, forward_done):
        """``(dx, dkernel(, dbias))``; ``dx`` is zeros (no device computes it) unless
        ``need_dx``."""
        kernel, b = params[0], params[1:]
        token = begin("backward", bwd_sizes, after=(forward_done,))
        xs, dys = _split(x, bwd_sizes), _split(dy, bwd_sizes)

        def jax_compute(i, deps):
            def grads(xi, dyi):
                if residual[i] is not None:  # (an unused dx is pruned by XLA)
                    dxi, dki = residual[i](dyi)
                elif need_dx:
                    _, vjp = jax.vjp(lambda a, k: conv2d_geo(a, k, geo, lowering), xi, kernel)
                    dxi, dki = vjp(dyi)
                else:
                    _, vjp = jax.vjp(lambda k: conv2d_geo(xi, k, geo, lowering), kernel)
                    (dki,) = vjp(dyi)
                return ([dxi] if need_dx else []) + [dki] + (
                    [jnp.sum(dyi, axis=(0, 1, 2))] if b else [])
            return timed("backward", i, deps, grads, xs[i], dys[i])

        outs = launched("backward", bwd_sizes, lambda i: [xs[i], dys[i]] + list(params),
                      lambda i: tuple(jax.ShapeDtypeStruct(s, np.float32) for s in (
                          ([(bwd_sizes[i],) + tuple(x.shape[1:])] if need_dx else []) +
                          [p.shape for p in params])),
                      token, jax_compute, need_dx)
        outs = [o for o in outs if o is not None]
        dx = jnp.concatenate([o[0] for o in outs], axis=0) if need_dx else jnp.zeros_like(x)
        first = int(need_dx)
        return (dx,) + tuple(sum(o[first + j] for o in outs) for j in range(len(params)))

    @jax.custom_vjp
    def op(x, *params):
        return forward(x, *params)[0]

    traced = {}  # whether the input is differentiated, from the forward to the backward

    def op_fwd(x, *params):  # symbolic_zeros: CustomVJPPrimal(value, perturbed) arguments
        traced["need_dx"] = bool(x.perturbed)  # False for a network's input: no col2im
        x, params = x.value, tuple(p.value for p in params)
        y, residual = forward(x, *params)
        return y, (x, params, residual, y[:1, :1, :1, :1])

    def op_bwd(res, dy):
        x, params, residual, forward_done = res
        return backward(x, dy, params, residual, traced.get("need_dx", True), forward_done)

    op.defvjp(op_fwd, op_bwd, symbolic_zeros=True)
    return op(x, *params)


# -- retracing a compiled step whose sizes went stale ----------------------------------------
_FUNCTIONS = (("make_train_function", "train_function"),
              ("make_test_function", "test_function"),
              ("make_predict_function", "predict_function"))


class _Retracing:
    """A Keras trainer's step function that is made again (so traced again, with the sizes
    the fractions now ask for) when a strategy's compiled sizes went stale since it was made."""

    def __init__(self, trainer, make: str, attr: str, fn) -> None:
        self.trainer, self.make, self.attr, self.__wrapped__ = trainer, make, attr, fn
        self.generation = _GENERATION[0]

    def __call__(self, *args, **kwargs):
        if self.generation != _GENERATION[0]:
            with _state_attached(self.trainer, self.attr, args[0] if args else None):
                self._remake()
            fn = getattr(self.trainer, self.attr)
            if fn is not self:
                return fn(*args, **kwargs)
        return self.__wrapped__(*args, **kwargs)

    def _remake(self) -> None:
        """Make the step function again. Keras jits the trainer's bound ``train_step`` /
        ``test_step``, which JAX's trace cache knows (equal bound methods, equal shapes: the
        old trace would come back); a new function object is traced afresh."""
        trainer = self.trainer
        step = {"train_function": "train_step", "test_function": "test_step"}.get(self.attr)
        if step is not None:
            method = getattr(type(trainer), step)
            object.__setattr__(trainer, step, lambda *a, **k: method(trainer, *a, **k))
        try:
            getattr(trainer, self.make)(force=True)
        finally:
            if step is not None:
                object.__delattr__(trainer, step)

    def __getattr__(self, name):
        return getattr(self.__wrapped__, name)


#: The groups of variables in each step function's ``state``, in Keras' order
#: (``JAXTrainer._get_jax_state``).
_STATE_GROUPS = {"train_function": ("trainable", "non_trainable", "optimizer", "metrics"),
                 "test_function": ("trainable", "non_trainable", "metrics"),
                 "predict_function": ("trainable", "non_trainable")}


@contextlib.contextmanager
def _state_attached(trainer, attr: str, state):
    """The step's ``state`` attached to the trainer's variables while the step function is
    made again. Within ``fit`` / ``evaluate`` / ``predict`` Keras detaches the variables'
    values (``_purge_model_variables``) and passes them as ``state``; under a
    ``keras.distribution`` the step function is made from the variables' shardings, which a
    detached variable has not (its ``value`` calls a dropped initializer)."""
    attached = []
    groups = _STATE_GROUPS.get(attr, ())
    if isinstance(state, (tuple, list)) and len(state) == len(groups):
        optimizer = getattr(trainer, "optimizer", None)
        variables = {"trainable": trainer.trainable_variables,
                     "non_trainable": trainer.non_trainable_variables,
                     "optimizer": optimizer.variables if optimizer is not None else [],
                     "metrics": trainer.metrics_variables}
        for group, values in zip(groups, state):
            for v, value in zip(variables[group], values or ()):
                if v._value is None:
                    v._value = value
                    attached.append(v)
    try:
        yield
    finally:
        for v in attached:
            v._value = None


_INSTALLED = []


def install_retrace() -> None:
    """Wrap the JAX trainer's step functions in :class:`_Retracing` (once)."""
    if _INSTALLED:
        return
    from keras.src.backend.jax.trainer import JAXTrainer
    for make, attr in _FUNCTIONS:
        original = getattr(JAXTrainer, make)

        def made(self, *args, _original=original, _make=make, _attr=attr, **kwargs):
            returned = _original(self, *args, **kwargs)
            fn = getattr(self, _attr, None)
            if fn is not None and not isinstance(fn, _Retracing):
                setattr(self, _attr, _Retracing(self, _make, _attr, fn))
            return returned

        made.__name__, made.__doc__ = make, original.__doc__
        setattr(JAXTrainer, make, made)
    _INSTALLED.append(True)
