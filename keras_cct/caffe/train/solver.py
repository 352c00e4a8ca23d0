"""Caffe's training loop on Keras: ``Solver`` (step, test, snapshot, restore, solve).

:class:`Solver` reproduces ``caffe::Solver``: it builds the TRAIN net and one TEST net per
``test_iter`` entry (``test_state`` stages) from the solver's net, feeds them from their data
layers (:mod:`keras_cct.caffe.train.data`), optimizes with :class:`~keras_cct.caffe.train.
optimizer.CaffeOptimizer` (Caffe's exact update rules, ``lr_mult``/``decay_mult`` from each layer's
``param {}``), and logs Caffe's lines::

    Iteration 100 (52.1 iter/s, 1.92s/100 iters), loss = 0.2143
        Train net output #0: loss = 0.1987 (* 1 = 0.1987 loss)
    Iteration 100, lr = 0.00992565
    Iteration 500, Testing net (#0)
        Test net output #0: accuracy = 0.9812
        Test net output #1: loss = 0.0593 (* 1 = 0.0593 loss)
    Snapshotting to binary proto file lenet_iter_500.caffemodel
    Snapshotting solver state to binary proto file lenet_iter_500.solverstate

Snapshots are Caffe's own files: ``PREFIX_iter_N.caffemodel`` (a binary ``NetParameter``, read by
Caffe and OpenCV) and ``PREFIX_iter_N.solverstate`` (``SolverState``: iteration, learned_net,
current_step, one history blob per learnable blob in Caffe's layout, then AdaDelta's/Adam's second
set). Both are written to a temporary file, flushed, then renamed, so an interrupted snapshot
leaves the previous one intact. Restoring loads the weights and the history and fast-forwards
the data sources, so a resumed run follows the same trajectory as an uninterrupted one (nets with
Dropout excepted: Keras' dropout random state is not part of Caffe's solverstate).

Devices and workers. ``Solver(strategy=CCTStrategy(...))`` builds the nets inside the strategy's
scope, so each convolution's batch is split across those devices (CcT's hybrid execution).
``Solver(cluster=mwms)`` (a ``MultiWorkerMirroredStrategy`` from
:func:`keras_cct.strategy.cluster.configure`) trains data-parallel across processes: every
worker reads the same global batches (the prototxt's ``batch_size`` is the *global* batch, so a
run reproduces a single-process run), trains on its slice, sized by the workers' measured
throughputs, and TensorFlow all-reduces the gradients; the loss is scaled by the slice's share
of the global batch, so the summed gradient is the global batch's mean gradient. Every worker
writes the same snapshots (identical weights, written atomically: a shared folder holds one
copy, separate machines one each); only worker 0 runs the test nets. ``clip_gradients`` clips
the global gradient's norm (one extra all-reduce). Not global across workers: BatchNorm's batch
and running statistics (per slice, per worker).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import keras
import numpy as np

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.binary import blob_to_array, read_solverstate, write_solverstate
from keras_cct.caffe.io.filter import filter_net
from keras_cct.caffe.io.text import read_net
from keras_cct.caffe.io.upgrade import upgrade_net
from keras_cct.caffe.io.validate import remove_stale_temps
from keras_cct.caffe.net.builder import build_net
from keras_cct.caffe.net.losses import Head, heads_of
from keras_cct.caffe.net.weights import (caffe_params, expected_blob_shapes,
                                         keras_arrays_to_blobs, keras_name,
                                         layer_blobs_to_keras, load_weights, save_weights)
from keras_cct.caffe.train.config import SolverConfig, read_solver, solver_config
from keras_cct.caffe.train.data import (DataSource, merge_batches, net_data_sources,
                                        resolve_path, skip_batches)
from keras_cct.caffe.train.model import (CaffeTrainModel, data_shapes, input_blobs,
                                         output_blobs, run_test)
from keras_cct.caffe.train.optimizer import CaffeOptimizer
from keras_cct.caffe.train.prefetch import prefetch
from keras_cct.errors import CaffeFormatError
from keras_cct.strategy import cluster as _cluster

__all__ = ["Solver", "load_solver", "snapshot_filename"]


def snapshot_filename(prefix: str, it: int, ext: str) -> str:
    """Caffe's ``PREFIX_iter_N.ext``."""
    return f"{prefix}_iter_{it}{ext}"


class Solver:
    """Caffe's solver over Keras models.

    Args:
        config: a :class:`~keras_cct.caffe.train.config.SolverConfig` (see ``read_solver``) or a
            ``SolverParameter``.
        weights: a .caffemodel to start from (``caffe train --weights``).
        arrays: ``{blob: array}`` replacing the TRAIN net's data layers (MemoryData/Input nets,
            tests); ``test_arrays`` likewise for the test nets (one dict for all).
        log: where log lines go (default: print to stdout).
        progress: show a tqdm progress bar between display lines.
        snapshot_prefix: overrides the solver's ``snapshot_prefix``.
        strategy: a :class:`~keras_cct.CCTStrategy`: the nets are built in its scope, so each
            HybridConv2D splits its batch across the strategy's devices.
        cluster: a ``MultiWorkerMirroredStrategy`` from :func:`keras_cct.strategy.cluster.
            configure`: train data-parallel with the other workers (see the module docstring).
        shares: each worker's share of a global batch (default: from the workers' measured
            throughputs, :func:`~keras_cct.strategy.cluster.worker_shares`).
    """

    def __init__(self, config, *, weights: Optional[str] = None,
                 arrays: Optional[Mapping[str, np.ndarray]] = None,
                 test_arrays: Optional[Mapping[str, np.ndarray]] = None,
                 log: Optional[Callable[[str], None]] = None,
                 progress: bool = False, snapshot_prefix: Optional[str] = None,
                 strategy=None, cluster=None, shares: Optional[Sequence[float]] = None,
                 python_layers: bool = False) -> None:
        if not isinstance(config, SolverConfig):
            config = solver_config(config)
        self.config = config
        self.python_layers = python_layers
        self.param = p = config.param
        self.path = config.path
        self.strategy = strategy
        self.cluster = cluster
        self.worker_index = 0
        if cluster is not None:
            resolver = getattr(cluster, "cluster_resolver", None)
            self.worker_index = int(resolver.task_id or 0) if resolver is not None else 0
        self.log = log or self._print
        self.progress = progress
        self.iter = 0
        if p.random_seed >= 0:
            keras.utils.set_random_seed(int(p.random_seed))
        self._seed = int(p.random_seed) if p.random_seed >= 0 else None
        self.net_param = self._read_net_param()
        self.snapshot_prefix = snapshot_prefix or p.snapshot_prefix or (
            os.path.splitext(self.path)[0] if self.path else "snapshot")
        for tmp in remove_stale_temps(self.snapshot_prefix):
            self.log(f"Removed {tmp}, left by an interrupted snapshot")

        # TRAIN net and its data
        self.train_param = self._filter(self.net_param, "TRAIN", list(p.train_state.stage),
                                        int(p.train_state.level))
        self.train_sources = net_data_sources(self.train_param, phase="TRAIN",
                                              base_dirs=config.base_dirs, seed=self._seed,
                                              arrays=arrays)
        with self.scope():
            self.train_net = self._build_net(self.train_param, "TRAIN",
                                             list(p.train_state.stage), self.train_sources,
                                             int(p.train_state.level))
            self.train_model = CaffeTrainModel(
                self.train_net.model, self._heads(self.train_net, self.train_param),
                output_blobs(self.train_net), input_blobs(self.train_net), name="train_net")
        # TEST nets
        self.test_params, self.test_sources, self.test_nets = [], [], []
        n_tests = len(p.test_iter)
        separate = self._separate_test_nets()
        if separate and len(separate) != n_tests:
            raise CaffeFormatError(f"the solver has {len(separate)} test nets but "
                                   f"{n_tests} test_iter values", path=self.path,
                                   hint="give one test_iter per test_net")
        for i in range(n_tests):
            stages = list(p.test_state[i].stage) if i < len(p.test_state) else []
            level = int(p.test_state[i].level) if i < len(p.test_state) else 0
            tp = self._filter(separate[i] if separate else self.net_param, "TEST", stages,
                              level)
            srcs = net_data_sources(tp, phase="TEST", base_dirs=config.base_dirs,
                                    seed=self._seed, arrays=test_arrays)
            with self.scope(train=False):
                tnet = self._build_net(tp, "TEST", stages, srcs, level)
            self.test_params.append(tp)
            self.test_sources.append(srcs)
            self.test_nets.append(CaffeTrainModel(tnet.model, self._heads(tnet, tp),
                                                  output_blobs(tnet), input_blobs(tnet),
                                                  name=f"test_net_{i}"))
        if weights:
            self.load_weights(weights)

        # optimizer
        specs = self._param_specs()
        self.schedule = config.schedule()
        with self.scope():  # a Keras optimizer binds to the distribution strategy it is made in
            self.optimizer: CaffeOptimizer = config.optimizer(specs)
            self.train_model.compile(optimizer=self.optimizer, jit_compile="auto")
            self.optimizer.build(self.train_model.trainable_variables)
        self.shares = None
        if cluster is not None:
            n_workers = _cluster._check_one_replica(cluster)
            if shares is not None:
                self.shares = _cluster._check_shares(shares)
                if self.shares.size != n_workers:
                    raise _cluster.ClusterError(
                        f"`shares` has {self.shares.size} entries for {n_workers} workers "
                        f"(give one per worker, the same on every worker)")
            else:
                self.shares = _cluster.worker_shares(cluster,
                                                     _cluster.local_throughput(strategy))
            self.log(f"Worker {self.worker_index} of {len(self.shares)}: share of each "
                     f"global batch {self.shares[self.worker_index]:.3f}")
        self._batches = self._train_batches(0)
        self._losses: List[float] = []
        self.smoothed_loss = 0.0
        self.images_per_second = 0.0
        self.train_seconds = 0.0
        self.last_test: Optional[Tuple[int, int, Dict[str, float]]] = None
        self._action_function: Optional[Callable[[], str]] = None
        self.requested_early_exit = False

    def scope(self, train: bool = True):
        """The context the nets are built and compiled in: the cluster's scope (TRAIN net only;
        test nets run on worker 0 alone, outside the collective) around the strategy's."""
        if self.cluster is not None and train:
            return _cluster.scope(self.cluster, self.strategy)
        if self.strategy is not None:
            return self.strategy.scope()
        return contextlib.nullcontext()

    @property
    def is_chief(self) -> bool:
        """Whether this process runs the test nets (worker 0, or the only process)."""
        return self.worker_index == 0

    def _print(self, line: str) -> None:
        """Default log: stdout, written around the progress bar when one is shown; lines of
        workers other than 0 start with ``[worker I]`` (worker 0's log reads like Caffe's)."""
        if self.worker_index:
            line = f"[worker {self.worker_index}] {line}"
        if self.progress:
            from tqdm import tqdm  # only with a progress bar
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    # -- construction helpers -----------------------------------------------------------------
    def _read_net_param(self):
        p = self.param
        if self.config.net_path:
            return read_net(self.config.net_path)
        net = proto.NetParameter()
        net.CopyFrom(p.net_param if p.HasField("net_param") else p.train_net_param)
        upgrade_net(net, path=self.path or "<solver>")
        return net

    def _separate_test_nets(self) -> list:
        """The solver's ``test_net`` files / ``test_net_param`` nets (Caffe's older style),
        upgraded; empty when the test nets come from ``net``."""
        p = self.param
        nets = []
        for name in p.test_net:
            path = resolve_path(name, self.config.base_dirs)
            if not os.path.exists(path):
                raise CaffeFormatError(f"the test net file {name!r} was not found",
                                       path=self.path, hint="fix `test_net:` in the solver")
            nets.append(read_net(path))
        for tnp in p.test_net_param:
            net = proto.NetParameter()
            net.CopyFrom(tnp)
            upgrade_net(net, path=self.path or "<solver>")
            nets.append(net)
        return nets

    @staticmethod
    def _filter(net_param, phase: str, stages: List[str], level: int = 0):
        return filter_net(net_param, phase=phase, stages=stages, level=level)

    def _build_net(self, net_param, phase, stages, sources: Sequence[DataSource],
                   level: int = 0):
        return build_net(net_param, phase=phase, stages=tuple(stages),
                         input_shapes=data_shapes(sources), level=level,
                         source=self.config.net_path, python_layers=self.python_layers)

    def _heads(self, net, net_param) -> List[Head]:
        return list(net.heads) or heads_of(net_param)

    def _param_specs(self) -> Dict[str, Tuple[float, float]]:
        """``{variable.path: (lr_mult, decay_mult)}`` from each layer's ``param {}``."""
        by_name = {keras_name(lp.name): lp for lp in self.train_param.layer}
        specs = {}
        for layer, variables in caffe_params(self.train_model.net):
            lp = by_name.get(layer.name)
            if lp is None:
                continue
            for i, v in enumerate(variables):
                if i < len(lp.param):
                    specs[v.path] = (float(lp.param[i].lr_mult), float(lp.param[i].decay_mult))
        return specs

    # -- weights ------------------------------------------------------------------------------
    def load_weights(self, path: str) -> None:
        """Load a .caffemodel into the train net (the test nets share it at each test)."""
        load_weights(self.train_net.model, path, strict=False, net_param=self.train_param)

    def _share_weights(self, test_model: CaffeTrainModel) -> None:
        src = {l.name: l for l in self.train_model.net.layers if l.weights}
        for layer in test_model.net.layers:
            if layer.weights and layer.name in src:
                # a copy: the JAX backend donates the train variables' buffers each step
                for dst, s in zip(layer.weights, src[layer.name].weights):
                    dst.assign(keras.ops.convert_to_numpy(s.value))

    # -- history <-> Caffe blobs -------------------------------------------------------------
    def _transpose_of(self, layer) -> bool:
        """Whether an InnerProduct layer stores its blob transposed (``transpose: true``)."""
        for lp in self.train_param.layer:
            if keras_name(lp.name) == layer.name and lp.type == "InnerProduct":
                return bool(lp.inner_product_param.transpose)
        return False

    def _slot_of(self) -> Dict[int, int]:
        return {id(v): i for i, v in enumerate(self.train_model.trainable_variables)}

    def history_blobs(self) -> List[np.ndarray]:
        """The optimizer history as Caffe's ``history_`` blobs (Caffe layout and order)."""
        slots = self._slot_of()
        sets = [self.optimizer.history]
        if self.optimizer.has_update_history:
            sets.append(self.optimizer.update_history)
        out = []
        for hist in sets:
            for layer, variables in caffe_params(self.train_model.net):
                arrays = []
                for v in variables:
                    i = slots.get(id(v))
                    arrays.append(np.zeros(v.shape, np.float32) if i is None else
                                  keras.ops.convert_to_numpy(hist[i]))
                out.extend(keras_arrays_to_blobs(layer, arrays,
                                                 transpose=self._transpose_of(layer)))
        return out

    def set_history_blobs(self, blobs: Sequence[np.ndarray], *, path: Optional[str] = None
                          ) -> None:
        """Set the optimizer history from Caffe ``history_`` blobs (checked first)."""
        params = caffe_params(self.train_model.net)
        n = sum(len(v) for _, v in params)
        sets = 2 if self.optimizer.has_update_history else 1
        if len(blobs) != n * sets:
            raise CaffeFormatError(
                f"the solver state has {len(blobs)} history blobs; this net has {n} learnable "
                f"blobs and the {self.optimizer.solver_type} solver keeps {sets} history "
                f"blob(s) for each ({n * sets} expected)", path=path,
                hint="resume with the net and solver type that wrote the snapshot")
        slots = self._slot_of()
        plan = []
        k = 0
        for s in range(sets):
            hist = self.optimizer.history if s == 0 else self.optimizer.update_history
            for layer, variables in params:
                tr = self._transpose_of(layer)
                exp = expected_blob_shapes(layer, transpose=tr)
                got = []
                for j, e in enumerate(exp):
                    arr = np.asarray(blobs[k + j], np.float32)
                    if arr.size != int(np.prod(e)) or (
                            arr.shape != tuple(e) and arr.shape != (1,) * (4 - len(e)) + tuple(e)):
                        raise CaffeFormatError(
                            f"history blob {k + j} has shape {arr.shape}, the net's blob {j} "
                            f"of layer '{layer.name}' is {tuple(e)}", path=path,
                            hint="the snapshot was written by a different net")
                    got.append(arr.reshape(e))
                k += len(exp)
                for v, value in zip(variables, layer_blobs_to_keras(layer, got, transpose=tr)):
                    i = slots.get(id(v))
                    if i is not None:
                        plan.append((hist[i], value))
        for var, value in plan:
            var.assign(value)

    # -- snapshot / restore -------------------------------------------------------------------
    def snapshot(self) -> Tuple[str, str]:
        """Write ``PREFIX_iter_N.caffemodel`` and ``.solverstate`` (each atomically)."""
        model_file = snapshot_filename(self.snapshot_prefix, self.iter, ".caffemodel")
        state_file = snapshot_filename(self.snapshot_prefix, self.iter, ".solverstate")
        os.makedirs(os.path.dirname(os.path.abspath(model_file)), exist_ok=True)
        self.log(f"Snapshotting to binary proto file {model_file}")
        save_weights(self.train_net.model, model_file, name=self.net_param.name or None)
        self.log(f"Snapshotting solver state to binary proto file {state_file}")
        current_step = sum(1 for v in self.param.stepvalue if self.iter >= v)
        write_solverstate(state_file, it=self.iter, learned_net=model_file,
                          history=self.history_blobs(), current_step=current_step)
        return model_file, state_file

    def restore(self, state_path: str) -> None:
        """Resume from a ``.solverstate``: its weights (``learned_net``), iteration and history;
        the data sources are fast-forwarded to that iteration. Everything is checked before
        anything changes."""
        state = read_solverstate(state_path)
        self.log(f"Restoring previous solver status from {state_path}")
        learned = None
        if state.learned_net:
            base = [os.path.dirname(os.path.abspath(state_path))]
            learned = resolve_path(state.learned_net, base)
            if not os.path.exists(learned):
                # snapshots are often renamed or moved in pairs: PREFIX_iter_N.solverstate
                # goes with PREFIX_iter_N.caffemodel beside it
                twin = os.path.splitext(state_path)[0] + ".caffemodel"
                if not os.path.exists(twin):
                    raise CaffeFormatError(
                        f"the weights it names ({state.learned_net}) were not found, nor "
                        f"{os.path.basename(twin)} beside it", path=state_path,
                        hint="put the snapshot's .caffemodel beside the .solverstate")
                self.log(f"{state.learned_net} not found; using {twin}")
                learned = twin
        blobs = [blob_to_array(b) for b in state.history]
        # validate history shapes before touching weights
        backup = [keras.ops.convert_to_numpy(v) for v in self.optimizer.variables]
        try:
            self.set_history_blobs(blobs, path=state_path)
            if learned:
                load_weights(self.train_net.model, learned, strict=True,
                             net_param=self.train_param)
        except Exception:
            for v, b in zip(self.optimizer.variables, backup):
                v.assign(b)
            raise
        self.iter = int(state.iter)
        iter_size = max(self.param.iter_size, 1)
        self.optimizer._iterations.assign(self.iter * iter_size)
        self._batches = self._train_batches(self.iter * iter_size)

    # -- training -----------------------------------------------------------------------------
    def set_action_function(self, func: Optional[Callable[[], str]]) -> None:
        """Caffe's ``SetActionFunction``: ``func()`` is called after each iteration and returns
        ``"stop"`` (end training there: :meth:`solve` then writes its final snapshot as after
        ``max_iter``), ``"snapshot"`` (write one now) or ``"none"``; ``cct train`` connects it
        to SIGINT/SIGHUP (:class:`keras_cct.caffe.tools.signals.SignalHandler`)."""
        self._action_function = func

    def _requested_action(self) -> str:
        return self._action_function() if self._action_function is not None else "none"

    def _train_batches(self, skip: int):
        """The TRAIN batches from mini-batch ``skip`` on, prefetched in a background thread
        (each source skips ``skip`` modulo its record period, so resuming at any iteration
        reads at most an epoch or so: see :func:`keras_cct.caffe.train.data.skip_batches`)."""
        old = getattr(self, "_batches", None)
        if old is not None and hasattr(old, "close"):
            old.close()
        if not skip:
            return prefetch(merge_batches(self.train_sources))
        return prefetch(skip_batches(self.train_sources, skip, log=self.log))

    def _train_batch(self) -> Dict[str, float]:
        batch = next(self._batches)
        if self.cluster is None:
            return self.train_model.train_on_batch(batch, return_dict=True)
        x, _, weight = _cluster.local_slice(batch, self.shares, self.worker_index)
        return self.train_model.train_on_batch(x, sample_weight=weight, return_dict=True)

    def _output_lines(self, model: CaffeTrainModel, values: Sequence[float], kind: str
                      ) -> List[str]:
        lines = []
        for i, (h, v) in enumerate(zip(model.heads, values)):
            msg = f"    {kind} net output #{i}: {h.top} = {v:.6g}"
            if h.loss_weight:
                msg += f" (* {h.loss_weight:g} = {h.loss_weight * v:.6g} loss)"
            lines.append(msg)
        return lines

    def step(self, iters: int) -> None:
        """Run ``iters`` iterations (Caffe's ``Solver::Step``)."""
        p = self.param
        iter_size = max(p.iter_size, 1)
        average_loss = max(p.average_loss, 1)
        start_iter = self.iter
        stop_iter = self.iter + iters
        self._losses = []
        self.smoothed_loss = 0.0
        bar = None
        if self.progress:
            from tqdm import tqdm  # only with a progress bar
            bar = tqdm(total=iters, leave=False, unit="iter", file=sys.stderr)
        t_last, it_last = time.perf_counter(), self.iter
        images = 0
        side_seconds = 0.0  # tests and snapshots, not training
        t_start = time.perf_counter()
        batch_size = sum(s.batch_size for s in self.train_sources[:1]) or 1
        while self.iter < stop_iter:
            if p.test_interval and self.iter % p.test_interval == 0 and self.is_chief and (
                    self.iter > 0 or p.test_initialization):
                t0 = time.perf_counter()
                self.test_all()
                side_seconds += time.perf_counter() - t0
                t_last += time.perf_counter() - t0
            display = p.display and self.iter % p.display == 0
            loss = 0.0
            outs = None
            for _ in range(iter_size):
                logs = self._train_batch()
                loss += float(logs["loss"])
                vals = [float(logs[f"out_{k}"]) for k in range(len(self.train_model.heads))]
                outs = vals if outs is None else [a + b for a, b in zip(outs, vals)]
                images += batch_size
            loss /= iter_size
            outs = [o / iter_size for o in (outs or [])]
            self._update_smoothed_loss(loss, start_iter, average_loss)
            if display:
                now = time.perf_counter()
                lapse = now - t_last
                n = self.iter - it_last
                rate = f" ({n / lapse:.4g} iter/s, {lapse:.3g}s/{p.display} iters)" if n else ""
                self.log(f"Iteration {self.iter}{rate}, loss = {self.smoothed_loss:.6g}")
                for line in self._output_lines(self.train_model, outs, "Train"):
                    self.log(line)
                self.log(f"Iteration {self.iter}, lr = {self.schedule.rate(self.iter):.6g}")
                t_last, it_last = now, self.iter
            self.iter += 1
            if bar is not None:
                bar.update(1)
            request = self._requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0) or request == "snapshot":
                t0 = time.perf_counter()
                self.snapshot()
                side_seconds += time.perf_counter() - t0
                t_last += time.perf_counter() - t0
            if request == "stop":
                self.requested_early_exit = True
                break
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t_start - side_seconds
        self.train_seconds += elapsed
        # training throughput: data, forward, backward and update; tests and snapshots excluded
        self.images_per_second = images / elapsed if elapsed > 0 else 0.0

    def _update_smoothed_loss(self, loss: float, start_iter: int, average_loss: int) -> None:
        if len(self._losses) < average_loss:
            self._losses.append(loss)
            size = len(self._losses)
            self.smoothed_loss = (self.smoothed_loss * (size - 1) + loss) / size
        else:
            idx = (self.iter - start_iter) % average_loss
            self.smoothed_loss += (loss - self._losses[idx]) / average_loss
            self._losses[idx] = loss

    def test(self, index: int = 0) -> Dict[str, float]:
        """Run test net ``index`` for its ``test_iter`` batches; returns ``{top: mean}`` and
        logs Caffe's ``Test net output`` lines."""
        p = self.param
        model = self.test_nets[index]
        self.log(f"Iteration {self.iter}, Testing net (#{index})")
        self._share_weights(model)
        scores = run_test(model, self.test_sources[index], int(p.test_iter[index]),
                          log=self.log, compute_loss=bool(p.test_compute_loss))
        self.last_test = (self.iter, index, scores)
        return scores

    def test_all(self) -> List[Dict[str, float]]:
        """Run every test net (Caffe's ``TestAll``)."""
        return [self.test(i) for i in range(len(self.test_nets))]

    def solve(self, resume_file: Optional[str] = None) -> None:
        """Train to ``max_iter`` (Caffe's ``Solver::Solve``), optionally resuming first."""
        p = self.param
        self.log(f"Solving {self.net_param.name}")
        self.log(f"Learning Rate Policy: {self.config.lr_policy}")
        if resume_file:
            self.restore(resume_file)
        self.requested_early_exit = False
        self.step(max(p.max_iter - self.iter, 0))
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if self.requested_early_exit:
            self.log("Optimization stopped early.")
            return
        if p.test_interval and self.iter % p.test_interval == 0 and self.is_chief:
            self.test_all()
        self.log("Optimization Done.")


def load_solver(path, **kwargs) -> Solver:
    """Read ``solver.prototxt`` and build the :class:`Solver` (its train and test nets sharing
    weights, the optimizer and the schedule).

    Keyword arguments go to :class:`Solver` (``weights=``, ``arrays=``, ``log=``, ...).
    """
    return Solver(read_solver(path), **kwargs)
