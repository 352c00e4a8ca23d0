"""Caffe's solvers as Keras objects: learning-rate policies, update rules, solver files.

* :class:`CaffeLRSchedule` -- Caffe's ``lr_policy`` (fixed, step, exp, inv, multistep, poly,
  sigmoid) as a ``keras.optimizers.schedules.LearningRateSchedule`` evaluated on Caffe's
  iteration count (starting at 0).
* :class:`CaffeOptimizer` -- a ``keras.optimizers.Optimizer`` whose update is exactly Caffe's
  ``ApplyUpdate``: clip the gradients by their global L2 norm (``clip_gradients``), normalize by
  ``iter_size``, add the weight decay (L2 or L1, times each blob's ``decay_mult``), then the rule of
  ``type`` (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam) with the local learning rate
  ``rate * lr_mult``; the weights move by ``-update`` (Caffe puts the learning rate *inside* the
  momentum history: ``h = m*h + lr*g; w -= h``).
(Reading a ``solver.prototxt`` into these: :mod:`keras_cct.caffe.train.config`.)

The optimizer keeps Caffe's history blobs (``history`` and, for AdaDelta and Adam, the second set
``update_history``) so that ``.solverstate`` files round-trip. One exception: SGD at momentum 0
updates ``w -= lr*g`` and leaves its history as it is (zero, or what a restored snapshot held),
where Caffe writes the last update into it. Caffe never reads that history at momentum 0, so the
weights are Caffe's, step for step, and a snapshot resumed at momentum 0 (here or in Caffe)
continues the same; the update then makes no pass over the history (CaffeNet's 61M weights on
TensorFlow, a 2-core AMD EPYC: 109 -> 14 ms a step). Only a snapshot resumed with a nonzero
momentum would differ, in its first step.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import keras
import numpy as np
from keras import ops

from keras_cct.errors import CaffeFormatError
from keras_cct.lowering import _backend

LR_POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")
#: Caffe's solver types, in the order of its legacy ``solver_type`` enum
SOLVER_TYPES = ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam")
_TYPE_BY_LOWER = {t.lower(): t for t in SOLVER_TYPES}


def canonical_solver_type(name: str, *, path: Optional[str] = None) -> str:
    """Caffe's spelling of a solver type (``"sgd"`` -> ``"SGD"``, ``"ADAM"`` -> ``"Adam"``)."""
    canon = _TYPE_BY_LOWER.get(str(name).lower())
    if canon is None:
        raise CaffeFormatError(f"unknown solver type {name!r}", path=path,
                               hint=f"use one of {', '.join(SOLVER_TYPES)}")
    return canon


def caffe_learning_rate(policy: str, it: int, *, base_lr: float, gamma: float = 0.0,
                        power: float = 0.0, stepsize: int = 0, stepvalue: Sequence[int] = (),
                        max_iter: int = 0, path: Optional[str] = None) -> float:
    """Caffe's ``SGDSolver::GetLearningRate`` at iteration ``it`` (float64, then float32).

    Raises:
        CaffeFormatError: an unknown policy, a missing stepsize/max_iter, or a rate that is not
            a real number at ``it`` (``gamma``/``power`` so large that it overflows)."""
    try:
        return _learning_rate(policy, it, base_lr=base_lr, gamma=gamma, power=power,
                              stepsize=stepsize, stepvalue=stepvalue, max_iter=max_iter,
                              path=path)
    except (OverflowError, ValueError, ZeroDivisionError) as exc:
        if isinstance(exc, CaffeFormatError):
            raise
        raise CaffeFormatError(f"lr_policy {policy!r}: the learning rate at iteration {it} is "
                               f"not a number ({exc})", path=path,
                               hint="check base_lr, gamma and power") from None


def _learning_rate(policy: str, it: int, *, base_lr: float, gamma: float, power: float,
                   stepsize: int, stepvalue: Sequence[int], max_iter: int,
                   path: Optional[str]) -> float:
    if policy == "fixed":
        rate = base_lr
    elif policy == "step":
        if stepsize <= 0:
            raise CaffeFormatError("lr_policy 'step' needs stepsize > 0", path=path)
        rate = base_lr * math.pow(gamma, it // stepsize)
    elif policy == "exp":
        rate = base_lr * math.pow(gamma, it)
    elif policy == "inv":
        rate = base_lr * math.pow(1.0 + gamma * it, -power)
    elif policy == "multistep":
        current_step = sum(1 for v in stepvalue if it >= v)
        rate = base_lr * math.pow(gamma, current_step)
    elif policy == "poly":
        if max_iter <= 0:
            raise CaffeFormatError("lr_policy 'poly' needs max_iter > 0", path=path)
        rate = base_lr * math.pow(1.0 - float(it) / max_iter, power)
    elif policy == "sigmoid":
        rate = base_lr * (1.0 / (1.0 + math.exp(-gamma * (it - stepsize))))
    else:
        raise CaffeFormatError(f"unknown lr_policy {policy!r}", path=path,
                               hint=f"use one of {', '.join(LR_POLICIES)}")
    return float(np.float32(rate))


@keras.saving.register_keras_serializable(package="keras_cct")
class CaffeLRSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Caffe's ``lr_policy`` as a Keras schedule.

    Args:
        policy: one of :data:`LR_POLICIES`.
        base_lr, gamma, power, stepsize, stepvalue, max_iter: the solver fields of that name.
        iter_size: Caffe's ``iter_size``; the optimizer's raw step counter counts every
            mini-batch, so the schedule divides it by ``iter_size`` to get Caffe's iteration.
    """

    def __init__(self, policy: str = "fixed", base_lr: float = 0.01, gamma: float = 0.0,
                 power: float = 0.0, stepsize: int = 0, stepvalue: Sequence[int] = (),
                 max_iter: int = 0, iter_size: int = 1) -> None:
        if policy not in LR_POLICIES:
            raise CaffeFormatError(f"unknown lr_policy {policy!r}",
                                   hint=f"use one of {', '.join(LR_POLICIES)}")
        # Validate parameters once (raises on step without stepsize, poly without max_iter).
        caffe_learning_rate(policy, 0, base_lr=base_lr, gamma=gamma, power=power,
                            stepsize=stepsize, stepvalue=stepvalue, max_iter=max_iter)
        self.policy = policy
        self.base_lr = float(base_lr)
        self.gamma = float(gamma)
        self.power = float(power)
        self.stepsize = int(stepsize)
        self.stepvalue = tuple(int(v) for v in stepvalue)
        self.max_iter = int(max_iter)
        self.iter_size = max(int(iter_size), 1)

    def rate(self, it: int) -> float:
        """The learning rate at Caffe iteration ``it`` as a Python float (for logging)."""
        return caffe_learning_rate(self.policy, int(it), base_lr=self.base_lr, gamma=self.gamma,
                                   power=self.power, stepsize=self.stepsize,
                                   stepvalue=self.stepvalue, max_iter=self.max_iter)

    def __call__(self, step):
        it = ops.cast(ops.floor_divide(ops.cast(step, "int64"), self.iter_size), "float32")
        base = ops.cast(self.base_lr, "float32")
        gamma = ops.cast(self.gamma, "float32")
        p = self.policy
        if p == "fixed":
            return base + 0.0 * it
        if p == "step":
            return base * ops.power(gamma, ops.floor(it / float(self.stepsize)))
        if p == "exp":
            return base * ops.power(gamma, it)
        if p == "inv":
            return base * ops.power(1.0 + gamma * it, -self.power)
        if p == "multistep":
            count = 0.0 * it
            for v in self.stepvalue:
                count = count + ops.cast(ops.greater_equal(it, float(v)), "float32")
            return base * ops.power(gamma, count)
        if p == "poly":
            return base * ops.power(1.0 - it / float(self.max_iter), self.power)
        # sigmoid
        return base * ops.sigmoid(gamma * (it - float(self.stepsize)))

    def get_config(self) -> dict:
        return {"policy": self.policy, "base_lr": self.base_lr, "gamma": self.gamma,
                "power": self.power, "stepsize": self.stepsize, "stepvalue": list(self.stepvalue),
                "max_iter": self.max_iter, "iter_size": self.iter_size}


@keras.saving.register_keras_serializable(package="keras_cct")
class CaffeOptimizer(keras.optimizers.Optimizer):
    """Caffe's solvers' update rules, exactly, as a Keras optimizer.

    For each step Caffe (``SGDSolver::ApplyUpdate``) does, with ``rate`` the policy's learning
    rate: if ``clip_gradients >= 0`` and the global L2 norm of the (summed over ``iter_size``)
    gradients exceeds it, scale them all by ``clip_gradients / norm``; divide by ``iter_size``;
    add ``weight_decay * decay_mult * w`` (L2) or ``... * sign(w)`` (L1); compute the update with
    ``local_rate = rate * lr_mult``; ``w -= update``.

    Args:
        solver_type: one of :data:`SOLVER_TYPES` (any case).
        learning_rate: a float or a schedule (usually :class:`CaffeLRSchedule`).
        momentum: ``momentum`` (SGD, Nesterov, AdaDelta; beta1 of Adam).
        momentum2: beta2 of Adam.
        delta: the epsilon of AdaGrad, RMSProp, AdaDelta and Adam.
        rms_decay: RMSProp's decay.
        weight_decay: Caffe's ``weight_decay``.
        regularization_type: ``"L2"`` or ``"L1"``.
        clip_gradients: global L2-norm threshold; negative disables it.
        iter_size: accumulate gradients over this many mini-batches per update.
        param_specs: ``{variable.path: (lr_mult, decay_mult)}``; missing entries use (1, 1).
    """

    def __init__(self, solver_type: str = "SGD", learning_rate=0.01, momentum: float = 0.0,
                 momentum2: float = 0.999, delta: float = 1e-8, rms_decay: float = 0.99,
                 weight_decay: float = 0.0, regularization_type: str = "L2",
                 clip_gradients: float = -1.0, iter_size: int = 1,
                 param_specs: Optional[Mapping[str, Tuple[float, float]]] = None,
                 name: str = "caffe_solver", **kwargs) -> None:
        iter_size = max(int(iter_size), 1)
        kwargs.pop("gradient_accumulation_steps", None)
        super().__init__(learning_rate=learning_rate, name=name,
                         gradient_accumulation_steps=iter_size if iter_size > 1 else None,
                         **kwargs)
        self.solver_type = canonical_solver_type(solver_type)
        if self.solver_type in ("AdaGrad", "RMSProp") and momentum != 0:
            raise CaffeFormatError(
                f"momentum cannot be used with {self.solver_type} (Caffe refuses it too)",
                hint="remove `momentum` from the solver or set it to 0")
        reg = str(regularization_type).upper()
        if reg not in ("L1", "L2"):
            raise CaffeFormatError(f"unknown regularization_type {regularization_type!r}",
                                   hint="use 'L2' or 'L1'")
        self.caffe_momentum = float(momentum)
        self.momentum2 = float(momentum2)
        self.delta = float(delta)
        self.rms_decay = float(rms_decay)
        self.caffe_weight_decay = float(weight_decay)
        self.regularization_type = reg
        self.clip_gradients = float(clip_gradients)
        self.iter_size = iter_size
        self.param_specs: Dict[str, Tuple[float, float]] = {
            k: (float(v[0]), float(v[1])) for k, v in dict(param_specs or {}).items()}

    # -- state ---------------------------------------------------------------------------------
    @property
    def has_update_history(self) -> bool:
        """AdaDelta and Adam keep a second set of history blobs (Caffe's ``update_history``)."""
        return self.solver_type in ("AdaDelta", "Adam")

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        # The backend may hand update_step its native variable (no .path): resolve specs now.
        self._specs_by_index = [self.spec_for(v) for v in variables]
        self.history = self.add_optimizer_variables(variables, "history")
        self.update_history = (self.add_optimizer_variables(variables, "update_history")
                               if self.has_update_history else [])

    def spec_for(self, variable) -> Tuple[float, float]:
        """``(lr_mult, decay_mult)`` of a variable, looked up by its path (``"conv1/kernel"``);
        a path nested in a model's scope (``"model/conv1/kernel"``) matches by its last two
        parts."""
        path = str(getattr(variable, "path", ""))
        spec = self.param_specs.get(path)
        if spec is None:
            spec = self.param_specs.get("/".join(path.split("/")[-2:]), (1.0, 1.0))
        return spec

    def history_arrays(self) -> List[np.ndarray]:
        """Caffe's ``history_`` as numpy arrays: one per variable, then the update history."""
        return [np.asarray(keras.ops.convert_to_numpy(v)) for v in
                list(self.history) + list(self.update_history)]

    def set_history_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        """Set the history from arrays ordered like :meth:`history_arrays` (needs ``build``)."""
        slots = list(self.history) + list(self.update_history)
        if len(arrays) != len(slots):
            raise CaffeFormatError(
                f"solver state has {len(arrays)} history blobs, the {self.solver_type} solver "
                f"of this net needs {len(slots)}",
                hint="resume with the solver type and net that wrote the snapshot")
        for slot, arr in zip(slots, arrays):
            arr = np.asarray(arr, dtype=slot.dtype)
            if tuple(arr.shape) != tuple(slot.shape):
                raise CaffeFormatError(
                    f"history blob for {slot.path} has shape {arr.shape}, expected "
                    f"{tuple(slot.shape)}", hint="the snapshot was written by a different net")
            slot.assign(arr)

    # -- the update ----------------------------------------------------------------------------
    def _clip_gradients(self, grads):
        # Keras hands over the mean over iter_size; Caffe clips the sum, then divides.
        if self.clip_gradients < 0:
            return grads
        grads, replicas = self._global_gradients(list(grads))
        present = [g for g in grads if g is not None]
        if not present:
            return grads
        sumsq = ops.sum(ops.stack([ops.sum(ops.square(ops.cast(g, "float32")))
                                   for g in present]))
        norm = ops.sqrt(sumsq) * float(self.iter_size)
        scale = ops.where(ops.greater(norm, self.clip_gradients),
                          self.clip_gradients / ops.maximum(norm, 1e-30), 1.0) / replicas
        return [None if g is None else g * ops.cast(scale, g.dtype) for g in grads]

    @staticmethod
    def _global_gradients(grads):
        """Under a multi-replica TF strategy (e.g. several workers), the all-reduced (summed)
        gradients and the replica count; else ``grads`` and 1. Clipping needs the norm of the
        global gradient, and Keras all-reduces only after clipping: the clipped sum is divided
        by the replica count so that Keras' own all-reduce gives it back."""
        if keras.backend.backend() != "tensorflow":
            return grads, 1
        import tensorflow as tf  # this backend only (and it is loaded already)
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync <= 1:
            return grads, 1
        idx = [i for i, g in enumerate(grads) if g is not None]
        reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in idx])
        for i, r in zip(idx, reduced):
            grads[i] = r
        return grads, ctx.num_replicas_in_sync

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        index = self._get_variable_index(variable)
        lr_mult, decay_mult = self._specs_by_index[index]
        g = ops.cast(gradient, dtype)
        local_decay = self.caffe_weight_decay * decay_mult
        reg = None
        if local_decay:
            reg = variable if self.regularization_type == "L2" else ops.sign(variable)
        local_rate = ops.cast(learning_rate, dtype) * ops.cast(lr_mult, dtype)
        t = self.solver_type
        # SGD at momentum 0 never reads its history again: w -= rate g, and the history is
        # left as it is (zero unless a snapshot set it; see the module docstring)
        plain = t == "SGD" and self.caffe_momentum == 0.0
        h = None if plain else self.history[index]
        m = ops.cast(self.caffe_momentum, dtype)
        delta = ops.cast(self.delta, dtype)
        if t == "SGD" and _backend.sgd_step(variable, h, g, local_rate, m, reg, local_decay):
            return  # in place, where the backend has a fused form
        if reg is not None:
            g = g + ops.cast(local_decay, dtype) * reg
        if plain:
            update = local_rate * g
        elif t == "SGD":
            new_h = m * h + local_rate * g
            self.assign(h, new_h)
            update = new_h
        elif t == "Nesterov":
            new_h = m * h + local_rate * g
            update = (1.0 + m) * new_h - m * h
            self.assign(h, new_h)
        elif t == "AdaGrad":
            new_h = h + ops.square(g)
            self.assign(h, new_h)
            update = local_rate * (g / (ops.sqrt(new_h) + delta))
        elif t == "RMSProp":
            d = ops.cast(self.rms_decay, dtype)
            new_h = d * h + (1.0 - d) * ops.square(g)
            self.assign(h, new_h)
            update = local_rate * (g / (ops.sqrt(new_h) + delta))
        elif t == "AdaDelta":
            u = self.update_history[index]
            new_h = m * h + (1.0 - m) * ops.square(g)
            step = g * ops.sqrt((u + delta) / (new_h + delta))
            new_u = m * u + (1.0 - m) * ops.square(step)
            self.assign(h, new_h)
            self.assign(u, new_u)
            update = local_rate * step
        else:  # Adam
            v = self.update_history[index]
            b1 = m
            b2 = ops.cast(self.momentum2, dtype)
            tt = ops.cast(self.iterations + 1, dtype)
            correction = ops.sqrt(1.0 - ops.power(b2, tt)) / (1.0 - ops.power(b1, tt))
            new_m = b1 * h + (1.0 - b1) * g
            new_v = b2 * v + (1.0 - b2) * ops.square(g)
            self.assign(h, new_m)
            self.assign(v, new_v)
            update = local_rate * correction * (new_m / (ops.sqrt(new_v) + delta))
        self.assign_sub(variable, update)

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("gradient_accumulation_steps", None)
        config.update({
            "solver_type": self.solver_type, "momentum": self.caffe_momentum,
            "momentum2": self.momentum2, "delta": self.delta, "rms_decay": self.rms_decay,
            "weight_decay": self.caffe_weight_decay,
            "regularization_type": self.regularization_type,
            "clip_gradients": self.clip_gradients, "iter_size": self.iter_size,
            "param_specs": {k: list(v) for k, v in self.param_specs.items()},
        })
        return config
