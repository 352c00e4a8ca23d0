"""pycaffe's ``caffe.Net`` over an imported Keras model.

A :class:`Net` runs the model Caffe layer by Caffe layer: each Caffe layer is the small Keras
graph between its bottom blobs and its tops in the imported model (same Keras layers, so same
weights and numbers as :func:`keras_cct.caffe.load_net`), which makes ``forward(start=,
end=)``, in-place layers and blob diffs follow Caffe exactly. Blobs are numpy arrays in Caffe's
NCHW layout; the loss and accuracy layers the Keras model leaves out are evaluated with
:func:`keras_cct.caffe.net.losses.head_value`.

Parameters: ``net.params[name][i].data`` is a numpy array in Caffe's layout, read from the Keras
variables on first use; changes to it are written back to the Keras weights before the next
``forward``, ``backward``, ``save`` or solver step (write-back, checked by comparison), and the
arrays are refreshed in place after a solver step or ``copy_from``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import keras
import numpy as np

from keras_cct.caffe.io.filter import filter_net
from keras_cct.caffe.io.text import read_net
from keras_cct.caffe.net.builder import build_net
from keras_cct.caffe.net.layout import from_caffe_layout, to_caffe_layout
from keras_cct.caffe.net.losses import head_value
from keras_cct.caffe.net.weights import caffe_type_of, keras_name, load_weights, save_weights
from keras_cct.caffe.pycaffe.blob import (TEST, Blob, ParamBlob, ParamSet, phase_name,
                                         store)
from keras_cct.caffe.pycaffe.batching import Collected, batches_of
from keras_cct.caffe.pycaffe.grad import gradients, rng_state, set_rng_state
from keras_cct.caffe.pycaffe.steps import Step, make_steps
from keras_cct.caffe.pycaffe.data import data_layers, data_sources
from keras_cct.caffe.train.data import merge_batches
from keras_cct.errors import CaffeFormatError

PathLike = Union[str, os.PathLike]

__all__ = ["Net", "NetLayer"]


class _Weighted:
    """What :func:`~keras_cct.caffe.net.weights.save_weights` reads of a built net."""

    def __init__(self, model, caffe_names: Dict[str, str], net_param) -> None:
        self.model, self.caffe_names, self.net_param = model, caffe_names, net_param


class NetLayer:
    """One layer of a :class:`Net` (pycaffe's ``net.layers[i]`` / ``net.layer_dict[name]``):
    ``name``, ``type``, ``blobs`` (its learnable blobs), ``bottoms``, ``tops``."""

    def __init__(self, step: Step, blobs: List[ParamBlob]) -> None:
        self.name = step.name
        self.type = step.type
        self.blobs = blobs
        self.bottoms = list(step.bottoms)
        self.tops = list(step.tops)

    def __repr__(self) -> str:
        return f"<NetLayer {self.name!r} type={self.type}>"


def _parse_args(args, weights, phase):
    """pycaffe's ``Net(proto, phase)``, ``Net(proto, weights, phase)`` and keyword forms."""
    args = list(args)
    if len(args) > 2:
        raise TypeError(f"Net takes (prototxt[, weights][, phase]), got {len(args) + 1} "
                        f"positional arguments")
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool):
            if phase is not None:
                raise TypeError("phase given twice")
            phase = a
        elif isinstance(a, (str, os.PathLike)):
            if weights is not None:
                raise TypeError("weights given twice")
            weights = a
        else:
            raise TypeError(f"unexpected Net argument {a!r}")
    return weights, phase_name(TEST if phase is None else phase)


class Net:
    """pycaffe's ``caffe.Net``: ``Net(prototxt, phase)``, ``Net(prototxt, weights, phase)`` or
    ``Net(prototxt, weights=..., phase=...)``.

    Args:
        network_file: the .prototxt.
        weights: a .caffemodel (or Caffe HDF5 weights) to load; layers are matched by name.
        phase: ``caffe.TEST`` (default) or ``caffe.TRAIN``: selects layers by their rules; in
            TRAIN, Dropout drops and BatchNorm uses batch statistics.
        level, stages: the rest of Caffe's ``NetState``.
        input_shapes: ``{blob: (N, C, H, W)}`` overriding the prototxt's input shapes.
        python_layers: run the net's ``Python`` layers, importing their modules as pycaffe
            does. Off by default, as everywhere in keras_cct (nothing is imported from a
            file's say-so alone): such a net is refused with an error naming the module and
            class; pass ``python_layers=True`` for files and modules you trust.

    Raises:
        CaffeFormatError: the files are missing or malformed (naming file, line and layer).
    """

    def __init__(self, network_file: PathLike, *args, weights: Optional[PathLike] = None,
                 phase=None, level: int = 0, stages: Sequence[str] = (),
                 input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                 python_layers: bool = False) -> None:
        weights, phase = _parse_args(args, weights, phase)
        path = os.fspath(network_file)
        if not os.path.isfile(path):
            raise CaffeFormatError("the net file was not found", path=path,
                                   hint="give the path of a .prototxt")
        full, source = read_net(path, with_source=True)
        net_param, _ = filter_net(full, phase=phase, stages=list(stages), level=level,
                                  source=source)
        shapes = dict(input_shapes or {})
        self._sources, data_shapes_, self._batch = data_layers(net_param, phase, path, shapes)
        shapes = {**data_shapes_, **shapes}
        built = build_net(full, phase=phase, stages=tuple(stages), level=level,
                          input_shapes=shapes, source=source, python_layers=python_layers,
                          fuse=False)
        if weights is not None:
            load_weights(built.model, os.fspath(weights), strict=False,
                         net_param=built.net_param)
        self._rebuild_args = (full, source, phase, tuple(stages), level, python_layers)
        self._setup(built.model, built.net_param, list(built.inputs), phase, path)

    @classmethod
    def from_model(cls, model: keras.Model, net_param, input_blobs: Sequence[str],
                   phase: str = "TEST", *, path: Optional[str] = None,
                   batches: Optional[Callable[[], Mapping[str, np.ndarray]]] = None,
                   before: Optional[Callable[[], None]] = None,
                   batch: Optional[int] = None) -> "Net":
        """A Net over an already built model (the solver's train and test nets).

        Args:
            model, net_param: the functional model and the phase-filtered ``NetParameter`` it
                was built from.
            input_blobs: the blob name of each model input, in order.
            batches: returns the next batch ``{top: channels-last array}`` of the data layers.
            before: called before every computation (e.g. to share the train net's weights).
            batch: the blobs' batch size (default: the prototxt's, else 1).
        """
        self = cls.__new__(cls)
        self._rebuild_args = None
        self._batch = batch
        self._setup(model, net_param, list(input_blobs), phase_name(phase), path)
        self._batches = batches
        self._before = before
        return self

    # -- construction -------------------------------------------------------------------------
    def _setup(self, model, net_param, input_blobs: List[str], phase: str,
               path: Optional[str]) -> None:
        self._model = model
        self._net_param = net_param
        self._phase = phase
        self._path = path
        self._batches = getattr(self, "_batches", None)
        self._before = getattr(self, "_before", None)
        self._sources = getattr(self, "_sources", None)
        self._steps, self._shapes = make_steps(model, net_param, input_blobs,
                                               getattr(self, "_batch", None))
        self._index = {s.name: i for i, s in enumerate(self._steps)}
        self._seed_states: Optional[list] = None
        old = getattr(self, "blobs", None)
        self.blobs: "OrderedDict[str, Blob]" = OrderedDict()
        for name, shape in self._shapes.items():
            if old is not None and name in old and old[name].shape == tuple(shape):
                self.blobs[name] = old[name]
            else:
                self.blobs[name] = Blob(shape)
        for s in self._steps:
            if s.head is not None and s.tops and old is None:
                self.blobs[s.tops[0]].diff[...] = s.head.loss_weight  # Caffe's loss weights
        transposed = {keras_name(lp.name) for lp in net_param.layer
                      if lp.type == "InnerProduct" and lp.inner_product_param.transpose}
        self._param_sets: "OrderedDict[str, ParamSet]" = OrderedDict()
        self.params: "OrderedDict[str, List[ParamBlob]]" = OrderedDict()
        self.layers: List[NetLayer] = []
        for s in self._steps:
            blobs: List[ParamBlob] = []
            if s.layer is not None and caffe_type_of(s.layer) is not None:
                ps = ParamSet(s.layer, transpose=s.layer.name in transposed)
                self._param_sets[s.name] = ps
                blobs = [ParamBlob(ps, i) for i in range(len(ps.diffs))]
                self.params[s.name] = blobs
            self.layers.append(NetLayer(s, blobs))
        self.layer_dict: "OrderedDict[str, NetLayer]" = OrderedDict(
            (l.name, l) for l in self.layers)
        self._layer_names = [s.name for s in self._steps]
        self._blob_names = list(self.blobs)
        weights = {s.tops[0]: s.head.loss_weight for s in self._steps
                   if s.head is not None and s.tops}
        self.blob_loss_weights = OrderedDict((b, float(weights.get(b, 0.0)))
                                             for b in self.blobs)
        self.top_names = OrderedDict((s.name, list(s.tops)) for s in self._steps)
        self.bottom_names = OrderedDict((s.name, list(s.bottoms)) for s in self._steps)
        self.inputs = [t for s in self._steps if s.kind == "input" for t in s.tops]
        available: List[str] = []
        for s in self._steps:
            for b in s.bottoms:
                if b in available:
                    available.remove(b)
            for t in s.tops:
                if t not in available:
                    available.append(t)
        self.outputs = sorted(available)

    @property
    def phase(self) -> int:
        """``caffe.TRAIN`` (0) or ``caffe.TEST`` (1)."""
        return 0 if self._phase == "TRAIN" else 1

    @property
    def model(self) -> keras.Model:
        """The Keras model (channels-last) this net runs."""
        return self._model

    def _layer_index(self, name: str, what: str) -> int:
        if name not in self._index:
            raise CaffeFormatError(f"{what}={name!r} is not a layer of this net", path=self._path,
                                   hint=f"layers: {', '.join(self._layer_names)}")
        return self._index[name]

    def _blob(self, name: str, what: str) -> Blob:
        if name not in self.blobs:
            raise CaffeFormatError(f"{what} {name!r} is not a blob of this net", path=self._path,
                                   hint=f"blobs: {', '.join(self.blobs)}")
        return self.blobs[name]

    # -- weights ------------------------------------------------------------------------------
    def _push(self) -> None:
        """Write changed ``params`` arrays to the Keras variables (and run ``before``)."""
        for ps in self._param_sets.values():
            ps.push()
        if self._before is not None:
            self._before()

    def _pull(self) -> None:
        """Re-read the Keras variables into the ``params`` arrays already handed out."""
        for ps in self._param_sets.values():
            ps.pull()

    def copy_from(self, weights: PathLike) -> None:
        """Load a .caffemodel (layers matched by name; others untouched), as pycaffe's."""
        self._push()
        load_weights(self._model, os.fspath(weights), strict=False, net_param=self._net_param)
        self._pull()

    def share_with(self, other: "Net") -> None:
        """Copy the weights of the layers ``other`` has by the same name (pycaffe's
        ``share_with``, by copy)."""
        other._push()
        self._push()
        mine = {l.name: l for l in self._model.layers if l.weights}
        for layer in other._model.layers:
            if layer.weights and layer.name in mine:
                mine[layer.name].set_weights(layer.get_weights())
        self._pull()

    def save(self, filename: PathLike) -> None:
        """Write the weights as a .caffemodel (a path ending in ``.h5``: Caffe's HDF5
        layout), each layer under its Caffe name."""
        self._push()
        save_weights(_Weighted(self._model, {keras_name(s.name): s.name for s in self._steps},
                               self._net_param),
                     os.fspath(filename), name=self._net_param.name or None)

    def save_hdf5(self, filename: PathLike) -> None:
        """Write the weights in Caffe's HDF5 layout (``/data/<layer>/<i>``)."""
        self._push()
        save_weights(_Weighted(self._model, {keras_name(s.name): s.name for s in self._steps},
                               self._net_param), os.fspath(filename), format="hdf5")

    def clear_param_diffs(self) -> None:
        """Zero every parameter diff (Caffe accumulates them across ``backward`` calls)."""
        for ps in self._param_sets.values():
            for d in ps.diffs:
                d[...] = 0.0

    # -- shapes -------------------------------------------------------------------------------
    def reshape(self) -> None:
        """Propagate the input blobs' shapes (after ``net.blobs[in].reshape(...)``) to every
        blob; a new image size rebuilds the Keras model (weights kept)."""
        built = {s.tops[0]: self._shapes[s.tops[0]] for s in self._steps if s.kind == "input"}
        changed = {b: self.blobs[b].shape for b in built
                   if tuple(self.blobs[b].shape[1:]) != tuple(built[b][1:])}
        if changed:
            if self._rebuild_args is None:
                raise CaffeFormatError(
                    f"the input shape of this net cannot change ({changed})", path=self._path,
                    hint="only the batch size may change for a solver's net")
            self._push()
            full, source, phase, stages, level, python_layers = self._rebuild_args
            shapes = {b: self.blobs[b].shape for b in built}
            self._batch = next(iter(shapes.values()))[0]
            fresh = build_net(full, phase=phase, stages=stages, level=level,
                              input_shapes=shapes, source=source, python_layers=python_layers,
                              fuse=False)
            old = {l.name: l for l in self._model.layers if l.weights}
            for layer in fresh.model.layers:
                if layer.weights and layer.name in old:
                    layer.set_weights(old[layer.name].get_weights())
            self._setup(fresh.model, fresh.net_param, list(fresh.inputs), self._phase,
                        self._path)
        n = {b: self.blobs[b].shape[0] for b in built}
        batch = next(iter(n.values()), None)
        for name, shape in self._shapes.items():
            if name in built or batch is None or not shape:
                continue
            blob = self.blobs[name]
            want = (batch,) + tuple(shape[1:]) if shape[0] is not None else tuple(shape)
            if blob.shape != want and all(d is not None for d in want):
                blob.reshape(*want)

    # -- forward ------------------------------------------------------------------------------
    def _range(self, start: Optional[str], end: Optional[str]):
        lo = self._layer_index(start, "start") if start is not None else 0
        hi = self._layer_index(end, "end") if end is not None else len(self._steps) - 1
        if lo > hi:
            raise CaffeFormatError(f"start layer {start!r} comes after end layer {end!r}",
                                   path=self._path)
        return lo, hi

    def _set_inputs(self, kwargs: Mapping[str, np.ndarray], names: Sequence[str],
                    field: str) -> None:
        if set(kwargs) != set(names):
            raise CaffeFormatError(f"{field} arguments {sorted(kwargs)} do not match the net's "
                                   f"{'inputs' if field == 'input' else 'outputs'} "
                                   f"{sorted(names)}", path=self._path)
        for name, value in kwargs.items():
            blob = self.blobs[name]
            value = np.asarray(value, np.float32)
            if value.shape != blob.shape:
                raise CaffeFormatError(
                    f"{field} {name!r} has shape {value.shape}, the blob {blob.shape}",
                    path=self._path, hint=f"net.blobs[{name!r}].reshape(*shape) first, or "
                                          f"use forward_all for any batch size")
            getattr(blob, "diff" if field == "diff" else "data")[...] = value

    def _feed_data_layers(self, lo: int, hi: int) -> None:
        data_steps = [s for s in self._steps[lo:hi + 1] if s.kind == "data"]
        if not data_steps:
            return
        batch = self._next_batch()
        for s in data_steps:
            for t in s.tops:
                if t in batch:
                    store(self.blobs[t], to_caffe_layout(np.asarray(batch[t], np.float32)))

    def set_input_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Feed the MemoryData layer (pycaffe's ``set_input_arrays``): ``data`` ``(N, C, H,
        W)`` and ``labels`` ``(N,)``, ``N`` a multiple of its batch size; each ``forward()``
        takes the next batch (cycling)."""
        mem = [s for s in self._steps if s.type == "MemoryData"]
        if not mem:
            raise CaffeFormatError("set_input_arrays needs a MemoryData layer; this net has "
                                   "none", path=self._path)
        lp = mem[0].lp
        data = np.asarray(data, np.float32)
        labels = np.asarray(labels, np.float32).reshape(-1)
        batch = int(lp.memory_data_param.batch_size)
        if data.ndim != 4 or len(labels) != len(data) or not len(data) or len(data) % batch:
            raise CaffeFormatError(
                f"set_input_arrays got data {data.shape} and {len(labels)} labels",
                path=self._path, layer=lp.name,
                hint=f"give (N, C, H, W) data and N labels, N a multiple of the batch size "
                     f"{batch}")
        arrays = dict(zip(lp.top, [from_caffe_layout(data), labels]))
        self._sources = data_sources(self._net_param, self._phase, self._path, arrays)
        self._source_iter = merge_batches(self._sources)

    def _next_batch(self) -> Mapping[str, np.ndarray]:
        if self._batches is not None:
            return self._batches()
        if self._sources is None:
            self._sources = data_sources(self._net_param, self._phase, self._path)
        if not hasattr(self, "_source_iter"):
            self._source_iter = merge_batches(self._sources)
        return next(self._source_iter)

    def _run(self, lo: int, hi: int, cur: Dict[str, object], eps: Optional[Dict] = None,
             skip_heads: Iterable[str] = ()) -> Dict[str, object]:
        """Run steps ``lo..hi`` on the channels-last tensors in ``cur`` (updated and returned);
        ``eps[blob]`` is added to a blob's first value written in the range."""
        training = self._phase == "TRAIN"
        written = set()
        for s in self._steps[lo:hi + 1]:
            if s.kind in ("input", "data", "silence"):
                continue
            if s.kind == "split":
                outs = [cur[s.bottoms[0]]] * len(s.tops)
            elif s.kind == "head":
                if s.name in skip_heads:
                    continue
                outs = [head_value(s.type, s.lp, [cur[b] for b in s.bottoms])]
            else:
                res = s.fn([cur[b] for b in s.fn_inputs], training=training)
                outs = list(res) if isinstance(res, (list, tuple)) else [res]
            for top, out in zip(s.tops, outs):
                if eps is not None and top in eps and top not in written:
                    out = out + eps[top]
                written.add(top)
                cur[top] = out
        return cur

    def _reads(self, lo: int, hi: int) -> List[str]:
        """The blobs steps ``lo..hi`` read before writing them (their values come from
        ``blobs``), inputs and data tops of the range included."""
        written, reads = set(), []
        for s in self._steps[lo:hi + 1]:
            if s.kind in ("input", "data"):
                for t in s.tops:
                    if t not in reads and t not in written:
                        reads.append(t)
                continue
            for b in s.bottoms:
                if b not in written and b not in reads:
                    reads.append(b)
            written.update(s.tops)
        return reads

    def forward(self, blobs: Optional[Sequence[str]] = None, start: Optional[str] = None,
                end: Optional[str] = None, **kwargs) -> Dict[str, np.ndarray]:
        """Run layers ``start..end`` (names; default: all), as pycaffe's ``forward``.

        Args:
            blobs: extra blob names to return.
            **kwargs: arrays for every input blob (Caffe layout, the blob's shape).

        Returns:
            ``{name: blob data}`` for the net's outputs (or ``end``'s tops) and ``blobs``.
        """
        extra = list(blobs or [])
        for b in extra:
            self._blob(b, "blobs=")
        lo, hi = self._range(start, end)
        outputs = set(self.top_names[end] + extra) if end is not None else set(
            self.outputs + extra)
        if kwargs:
            self._set_inputs(kwargs, self.inputs, "input")
        if lo == 0:
            self._feed_data_layers(lo, hi)
        self.reshape()
        self._push()
        self._seed_states = rng_state(self._model) if self._phase == "TRAIN" else None
        cur = {b: keras.ops.convert_to_tensor(from_caffe_layout(self.blobs[b].data))
               for b in self._reads(lo, hi)}
        cur = self._run(lo, hi, cur)
        written = {t for s in self._steps[lo:hi + 1] if s.kind not in ("input", "data")
                   for t in s.tops}
        for name, value in cur.items():
            if name in written:
                store(self.blobs[name], to_caffe_layout(np.asarray(
                    keras.ops.convert_to_numpy(value), np.float32)))
        return {o: self.blobs[o].data for o in outputs}

    def forward_all(self, blobs: Optional[Sequence[str]] = None, **kwargs
                    ) -> Dict[str, np.ndarray]:
        """Forward inputs of any batch size in batches of the input blob's (the last padded
        with zeros, its padding dropped), as pycaffe's ``forward_all``; a scalar output (a
        loss) gives one value per batch."""
        if not kwargs:
            raise CaffeFormatError("forward_all needs the input arrays", path=self._path,
                                   hint=f"forward_all({self.inputs[0] if self.inputs else 'data'}"
                                        f"=array)")
        n, batches = batches_of(kwargs, self.blobs[self.inputs[0]].shape[0] or 1)
        outs = Collected()
        for batch in batches:
            outs.add(self.forward(blobs=blobs, **batch))
        return outs.arrays(n)

    # -- backward -----------------------------------------------------------------------------
    def backward(self, diffs: Optional[Sequence[str]] = None, start: Optional[str] = None,
                 end: Optional[str] = None, **kwargs) -> Dict[str, np.ndarray]:
        """Back-propagate from layer ``start`` (default: the last) down to ``end`` (default:
        the first), as pycaffe's ``backward``: fills the ``diff`` of every blob in the range
        and adds the parameter gradients to the params' ``diff`` (Caffe accumulates them; see
        :meth:`clear_param_diffs`). The loss layers' top diffs are their ``loss_weight``.

        Args:
            diffs: extra blob names whose diffs to return.
            **kwargs: top diffs for every output blob (the blob's shape).

        Returns:
            ``{name: blob diff}`` for the inputs (or ``end``'s bottoms) and ``diffs``.
        """
        extra = list(diffs or [])
        for b in extra:
            self._blob(b, "diffs=")
        hi = self._layer_index(start, "start") if start is not None else len(self._steps) - 1
        lo = self._layer_index(end, "end") if end is not None else 0
        if lo > hi:
            raise CaffeFormatError(f"backward runs from start={start!r} down to end={end!r}: "
                                   f"start must come after end", path=self._path)
        outputs = set(self.bottom_names[end] + extra) if end is not None else set(
            self.inputs + extra)
        if kwargs:
            self._set_inputs(kwargs, self.outputs, "diff")
        self._push()
        self._backward(lo, hi)
        return {o: self.blobs[o].diff for o in outputs}

    def _backward(self, lo: int, hi: int) -> None:
        reads = self._reads(lo, hi)
        written: List[str] = []
        last_reader: Dict[str, int] = {}
        last_writer: Dict[str, int] = {}
        for i, s in enumerate(self._steps[lo:hi + 1]):
            if s.kind in ("input", "data"):
                continue
            for b in s.bottoms:
                last_reader[b] = i
            for t in s.tops:
                last_writer[t] = i
                if t not in written and t not in reads:
                    written.append(t)
        # blobs whose last value in the range leaves it: seeded with their stored diff
        seeds = [b for b, w in last_writer.items()
                 if last_reader.get(b, -1) <= w and np.any(self.blobs[b].diff)]
        skip = {s.name for s in self._steps[lo:hi + 1]
                if s.kind == "head" and not any(t in seeds for t in s.tops)}
        steps = self._steps[lo:hi + 1]
        variables, owners = [], []
        for s in steps:
            ps = self._param_sets.get(s.name)
            if ps is not None:
                owners.append((ps, len(variables), len(ps.layer.weights)))
                variables.extend(ps.layer.weights)
        values = [from_caffe_layout(self.blobs[b].data) for b in reads]
        values += [np.zeros(from_caffe_layout(np.empty(self.blobs[b].shape, np.float32)).shape,
                            np.float32) for b in written]
        seed_values = [keras.ops.convert_to_tensor(from_caffe_layout(self.blobs[b].diff))
                       for b in seeds]
        # the layers run again: their state (BatchNorm's running statistics) is put back after
        state = [(v, keras.ops.convert_to_numpy(v.value)) for s in steps if s.fn is not None
                 for v in s.fn.non_trainable_variables]
        saved = None
        if self._seed_states is not None:
            saved = rng_state(self._model)
            set_rng_state(self._model, self._seed_states)  # the forward's dropout masks

        def objective(xs):
            cur = dict(zip(reads, xs[:len(reads)]))
            eps = dict(zip(written, xs[len(reads):]))
            cur = self._run(lo, hi, cur, eps=eps, skip_heads=skip)
            total = 0.0
            for b, d in zip(seeds, seed_values):
                total = total + keras.ops.sum(keras.ops.cast(cur[b], "float32") * d)
            return total

        try:
            gx, gw = gradients(objective, values, variables)
        finally:
            for v, value in state:
                v.assign(value)
            if saved is not None:
                set_rng_state(self._model, saved)
        for b, g in zip(reads + written, gx):
            blob = self.blobs[b]
            blob.diff[...] = to_caffe_layout(g).reshape(blob.shape)
        for ps, start, n in owners:
            ps.add_grads(gw[start:start + n])

    def forward_backward_all(self, blobs: Optional[Sequence[str]] = None,
                             diffs: Optional[Sequence[str]] = None, **kwargs):
        """Forward and backward over inputs of any batch size (pycaffe's); returns ``(blobs,
        diffs)``: the outputs and the input diffs, joined over the batches."""
        if not kwargs:
            raise CaffeFormatError("forward_backward_all needs the input arrays",
                                   path=self._path)
        n, batches = batches_of(kwargs, self.blobs[self.inputs[0]].shape[0] or 1)
        fw, bw = Collected(), Collected()
        for batch in batches:
            fw.add(self.forward(blobs=blobs, **batch))
            bw.add(self.backward(diffs=diffs))
        return fw.arrays(n), bw.arrays(n)
