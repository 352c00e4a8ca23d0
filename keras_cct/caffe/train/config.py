"""Solver files: a ``solver.prototxt`` read and checked into a :class:`SolverConfig`, which makes
the learning-rate schedule and the :class:`~keras_cct.caffe.train.optimizer.CaffeOptimizer`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence, Tuple

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.text import field_lines, parse_text, read_text_file
from keras_cct.caffe.io.validate import check_solver
from keras_cct.caffe.train.data import resolve_path
from keras_cct.caffe.train.optimizer import (LR_POLICIES, SOLVER_TYPES, CaffeLRSchedule,
                                             CaffeOptimizer, caffe_learning_rate,
                                             canonical_solver_type)
from keras_cct.errors import CaffeFormatError

__all__ = ["SolverConfig", "read_solver", "solver_config"]



@dataclass
class SolverConfig:
    """A ``SolverParameter`` read and checked, with its file's location.

    Attributes:
        param: the ``SolverParameter`` message.
        path: the solver file (``None`` for one built in memory).
        solver_type: the canonical type (``type``, or the legacy ``solver_type`` enum).
        net_path: the resolved train/test net file (``None`` when the net is inline).
        base_dirs: folders searched for the files the solver and net name (besides the
            working directory): the solver's folder, the net's folder.
    """

    param: object
    path: Optional[str]
    solver_type: str
    net_path: Optional[str] = None
    base_dirs: List[str] = field(default_factory=list)

    @property
    def lr_policy(self) -> str:
        return self.param.lr_policy or "fixed"

    def schedule(self) -> CaffeLRSchedule:
        """The learning-rate schedule of this solver."""
        p = self.param
        return CaffeLRSchedule(self.lr_policy, base_lr=p.base_lr, gamma=p.gamma,
                               power=p.power, stepsize=p.stepsize, stepvalue=list(p.stepvalue),
                               max_iter=p.max_iter, iter_size=max(p.iter_size, 1))

    def optimizer(self, param_specs: Optional[Mapping[str, Tuple[float, float]]] = None
                  ) -> CaffeOptimizer:
        """A :class:`CaffeOptimizer` with this solver's rule, schedule and hyper-parameters."""
        p = self.param
        try:
            return CaffeOptimizer(
                self.solver_type, learning_rate=self.schedule(), momentum=p.momentum,
                momentum2=p.momentum2, delta=p.delta, rms_decay=p.rms_decay,
                weight_decay=p.weight_decay, regularization_type=p.regularization_type,
                clip_gradients=p.clip_gradients, iter_size=max(p.iter_size, 1),
                param_specs=param_specs)
        except CaffeFormatError as exc:
            raise CaffeFormatError(exc.message, path=self.path, hint=exc.hint) from None


def read_solver(path) -> SolverConfig:
    """Read and check a ``solver.prototxt``.

    Raises:
        CaffeFormatError: unreadable file, syntax error (file:line:column), a solver that names
            no net, an unknown ``type``/``solver_type`` or ``lr_policy``, conflicting types, a
            missing net file, a number out of its valid range (file:line and the field).
    """
    path = str(path)
    text = read_text_file(path, "solver")
    param = parse_text(text, proto.SolverParameter, path, "solver")
    return solver_config(param, path=path, lines=field_lines(text))


def solver_config(param, *, path: Optional[str] = None,
                  lines: Optional[Mapping[str, Sequence[int]]] = None) -> SolverConfig:
    """Check a ``SolverParameter`` (see :func:`read_solver`); ``lines`` maps each top-level
    field to the lines it is on (for error messages)."""
    check_solver(param, path, dict(lines or {}))
    # type / legacy solver_type (Caffe's UpgradeSolverType)
    if param.HasField("solver_type"):
        legacy = SOLVER_TYPES[int(param.solver_type)]
        if param.HasField("type") and canonical_solver_type(param.type, path=path) != legacy:
            raise CaffeFormatError(
                f"solver sets both type: {param.type!r} and solver_type: {legacy.upper()}",
                path=path, hint="keep only `type`")
        solver_type = legacy
    else:
        solver_type = canonical_solver_type(param.type or "SGD", path=path)
    policy = param.lr_policy or "fixed"
    if policy not in LR_POLICIES:
        raise CaffeFormatError(f"unknown lr_policy {policy!r}", path=path,
                               hint=f"use one of {', '.join(LR_POLICIES)}")
    try:
        for it in (0, max(int(param.max_iter), 0)):  # the first and the last iteration
            caffe_learning_rate(policy, it, base_lr=param.base_lr, gamma=param.gamma,
                                power=param.power, stepsize=param.stepsize,
                                stepvalue=list(param.stepvalue), max_iter=param.max_iter)
    except CaffeFormatError as exc:
        raise CaffeFormatError(exc.message, path=path, hint=exc.hint,
                               line=(list((lines or {}).get("lr_policy", [])) or [None])[0]
                               ) from None
    if solver_type in ("AdaGrad", "RMSProp") and param.momentum != 0:
        raise CaffeFormatError(f"momentum cannot be used with {solver_type}", path=path,
                               hint="remove `momentum` (Caffe refuses it too)")
    base_dirs = [os.path.dirname(os.path.abspath(path))] if path else []
    n_nets = sum([param.HasField("net"), param.HasField("net_param"),
                  param.HasField("train_net"), param.HasField("train_net_param")])
    if n_nets == 0:
        raise CaffeFormatError("the solver names no net", path=path,
                               hint="add `net: \"train_test.prototxt\"` (or net_param)")
    if n_nets > 1:
        raise CaffeFormatError("the solver names more than one train net", path=path,
                               hint="use only one of net, net_param, train_net, "
                                    "train_net_param")
    net_path = None
    name = param.net if param.HasField("net") else (
        param.train_net if param.HasField("train_net") else None)
    if name is not None:
        net_path = resolve_path(name, base_dirs)
        if not os.path.exists(net_path):
            raise CaffeFormatError(f"the net file {name!r} was not found (looked in the working "
                                   f"directory and {', '.join(base_dirs) or '-'})", path=path,
                                   hint="fix `net:` in the solver")
        base_dirs.append(os.path.dirname(os.path.abspath(net_path)))
    if param.test_interval and not len(param.test_iter) and (
            param.HasField("net") or param.HasField("net_param") or len(param.test_net)):
        raise CaffeFormatError("test_interval is set but test_iter is not", path=path,
                               hint="add `test_iter: N` (batches per test)")
    return SolverConfig(param, path, solver_type, net_path, base_dirs)
