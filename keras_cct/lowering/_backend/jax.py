"""JAX forms of the per-backend primitives (see :mod:`keras_cct.lowering._backend`)."""

from __future__ import annotations

import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from keras_cct.lowering._backend import common, generic
from keras_cct.lowering._backend.generic import *  # noqa: F401,F403
from keras_cct.lowering.geometry import ConvGeometry

NAME = "jax"
__all__ = generic.__all__


def _host_callback_threads() -> None:
    """Gives XLA's CPU client at least two pool threads (``NPROC``, which XLA reads for the
    size of that pool, when the user has not set it), before the client exists.

    The pool is sized by the CPUs the process may use. With one (a process pinned to a core, a
    one-CPU container), a compiled step whose host callback reads its operands (CCTStrategy's
    OpenCL shards, the OpenCL op) waits for their transfer, which is queued behind the next
    step, which ``model.fit`` has already dispatched and which waits on the pool's only thread
    for this step: ``fit`` hung (seen with the process pinned to one core; 2 threads fixed it).
    Two threads on one core cost nothing measurable: the second only moves buffers. If the
    client already exists, this changes nothing."""
    if "NPROC" in os.environ:
        return
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity masks on this OS)
        cpus = os.cpu_count() or 1
    os.environ["NPROC"] = str(max(2, cpus))


_host_callback_threads()


def native_conv(x, kernel, geo: ConvGeometry):
    """``lax.conv_general_dilated`` with NHWC/HWIO dimension numbers and explicit padding;
    grouped convolutions in the split form (XLA's CPU grouped convolution measured 5x slower on
    CaffeNet's grouped layers)."""
    def conv(inp, k, groups=1):
        return lax.conv_general_dilated(
            inp, k, (geo.sh, geo.sw), [tuple(geo.pad[0]), tuple(geo.pad[1])],
            rhs_dilation=(geo.dh, geo.dw), dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups)

    if common.split_groups(geo):
        xs = jnp.split(x, geo.groups, axis=-1)
        ks = jnp.split(kernel, geo.groups, axis=-1)
        return jnp.concatenate([conv(a, b) for a, b in zip(xs, ks)], axis=-1)
    return conv(x, kernel, geo.groups)


def conv_step(conv: Callable, x: np.ndarray, kernel: np.ndarray, r: np.ndarray, *,
              training: bool, jit_compile: bool, dtype: Optional[str]) -> Callable[[], None]:
    """One ``jax.jit`` of ``value_and_grad`` (or of the forward), waited for."""
    jx, jk, jr = (jnp.asarray(a, dtype=dtype or a.dtype) for a in (x, kernel, r))

    def loss(xx, kk):
        return jnp.sum(conv(xx, kk) * jr)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)) if training else conv)
    return lambda: jax.block_until_ready(fn(jx, jk))


def device_name() -> Optional[str]:
    dev = jax.devices()[0]
    return None if dev.platform == "cpu" else f"{dev.platform}:{dev.device_kind}"


def layer_steps(layer, args: list, dys: list):
    """Two ``jax.jit``\ s of the layer's ``stateless_call``; the forward+backward one returns
    the output with the input and weight gradients (``jax.vjp``)."""
    single = len(args) == 1
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def apply(tv_, *a):
        y, _ = layer.stateless_call(tv_, ntv, a[0] if single else list(a))
        return y

    def forward_backward(*a):
        y, vjp = jax.vjp(apply, tv, *a)
        ct = [jnp.asarray(d) for d in dys]
        return y, vjp(type(y)(ct) if isinstance(y, (list, tuple)) else ct[0])

    return jax.jit(lambda *a: apply(tv, *a)), jax.jit(forward_backward)
