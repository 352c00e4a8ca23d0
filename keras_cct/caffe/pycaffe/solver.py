"""pycaffe's solvers: :func:`get_solver` (the type the solver file names) and
:class:`SGDSolver`, :class:`NesterovSolver`, :class:`AdaGradSolver`, :class:`RMSPropSolver`,
:class:`AdaDeltaSolver`, :class:`AdamSolver` (that type, whatever the file says, as pycaffe's
classes do), over :class:`keras_cct.caffe.train.solver.Solver`.

``solver.net`` and ``solver.test_nets`` are :class:`~keras_cct.caffe.pycaffe.net.Net` views of
the solver's own Keras models: ``solver.net.params`` shows the trained weights after ``step``,
and edits to them are used by the next step; ``solver.net.forward()`` reads the next batch of
the TRAIN data layers (the same stream ``step`` reads).
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Union

from keras_cct.caffe.pycaffe.net import Net
from keras_cct.caffe.train.config import read_solver
from keras_cct.caffe.train.model import input_blobs
from keras_cct.caffe.train.solver import Solver
from keras_cct.errors import CaffeFormatError

PathLike = Union[str, os.PathLike]

__all__ = ["get_solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
           "AdaDeltaSolver", "AdamSolver"]


def _batch_of(sources) -> Optional[int]:
    return next((int(x.batch_size) for x in sources if x.batch_size), None)


class _PycaffeSolver:
    """A pycaffe solver: ``net``, ``test_nets``, ``iter``, ``step(n)``, ``solve()``,
    ``restore()``, ``snapshot()``; ``solver`` is the underlying
    :class:`~keras_cct.caffe.train.solver.Solver` (Caffe's log lines, snapshots, tests).

    Args:
        filename: the solver .prototxt.
        **kwargs: passed to :class:`~keras_cct.caffe.train.solver.Solver` (``log=``,
            ``arrays=``, ``weights=``, ...).
    """

    #: the solver type the class forces (``None``: the file's)
    solver_type: Optional[str] = None

    def __init__(self, filename: PathLike, **kwargs) -> None:
        path = os.fspath(filename)
        if not os.path.isfile(path):
            raise CaffeFormatError("the solver file was not found", path=path,
                                   hint="give the path of a solver .prototxt")
        config = read_solver(path)
        if self.solver_type is not None and config.solver_type != self.solver_type:
            config = dataclasses.replace(config, solver_type=self.solver_type)
        self.solver = s = Solver(config, **kwargs)
        self.net = Net.from_model(s.train_net.model, s.train_param,
                                  input_blobs(s.train_net), "TRAIN", path=path,
                                  batches=lambda: next(s._batches),
                                  batch=_batch_of(s.train_sources))
        self.test_nets: List[Net] = []
        for i, model in enumerate(s.test_nets):
            self.test_nets.append(Net.from_model(
                model.net, s.test_params[i], model.input_blobs, "TEST", path=path,
                batches=self._test_batches(i), before=lambda m=model: s._share_weights(m),
                batch=_batch_of(s.test_sources[i])))

    def _test_batches(self, i: int):
        state = {}

        def nxt():
            if "it" not in state:
                from keras_cct.caffe.train.data import merge_batches
                state["it"] = merge_batches(self.solver.test_sources[i])
            return next(state["it"])
        return nxt

    @property
    def iter(self) -> int:
        """The current iteration."""
        return self.solver.iter

    @property
    def type(self) -> str:
        """The solver type (``"SGD"``, ``"Adam"``, ...)."""
        return self.solver.config.solver_type

    def _around(self, fn, *args):
        self.net._push()
        try:
            return fn(*args)
        finally:
            self.net._pull()
            for t in self.test_nets:  # arrays handed out show the trained weights too
                if any(ps.arrays is not None for ps in t._param_sets.values()):
                    t._push()  # shares the train net's weights
                    t._pull()

    def step(self, iters: int) -> None:
        """Run ``iters`` iterations (tests and snapshots as the solver file says)."""
        if int(iters) < 0:
            raise ValueError(f"step takes a non-negative count, got {iters}")
        self._around(self.solver.step, int(iters))

    def solve(self, resume: Optional[PathLike] = None) -> None:
        """Train to ``max_iter``, first restoring ``resume`` (a .solverstate) if given."""
        self._around(self.solver.solve, os.fspath(resume) if resume else None)

    def restore(self, state: PathLike) -> None:
        """Restore a .solverstate (weights, iteration, history)."""
        self._around(self.solver.restore, os.fspath(state))

    def snapshot(self) -> None:
        """Write ``PREFIX_iter_N.caffemodel`` and ``.solverstate`` now."""
        self._around(self.solver.snapshot)

    def test_all(self):
        """Run every test net for its ``test_iter`` batches (Caffe's ``TestAll``)."""
        return self._around(self.solver.test_all)


def _solver_class(name: str, type_: str, doc: str):
    return type(name, (_PycaffeSolver,), {"solver_type": type_, "__doc__": doc,
                                          "__module__": __name__})


SGDSolver = _solver_class("SGDSolver", "SGD", "pycaffe's ``SGDSolver`` (momentum SGD).")
NesterovSolver = _solver_class("NesterovSolver", "Nesterov", "pycaffe's ``NesterovSolver``.")
AdaGradSolver = _solver_class("AdaGradSolver", "AdaGrad", "pycaffe's ``AdaGradSolver``.")
RMSPropSolver = _solver_class("RMSPropSolver", "RMSProp", "pycaffe's ``RMSPropSolver``.")
AdaDeltaSolver = _solver_class("AdaDeltaSolver", "AdaDelta", "pycaffe's ``AdaDeltaSolver``.")
AdamSolver = _solver_class("AdamSolver", "Adam", "pycaffe's ``AdamSolver``.")


def get_solver(filename: PathLike, **kwargs) -> _PycaffeSolver:
    """The solver of the type ``filename`` names (pycaffe's ``caffe.get_solver``)."""
    return _PycaffeSolver(filename, **kwargs)
