"""A Caffe net as a trainable Keras model: :class:`CaffeTrainModel` (the net plus its loss and
metric heads), :func:`run_test` (Caffe's ``Solver::Test`` and ``caffe test``) and
:func:`build_phase_net` (a net of one phase with its data sources, for ``cct test`` and
``cct time``)."""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import keras
import numpy as np

from keras_cct.caffe.io.filter import filter_net
from keras_cct.caffe.io.text import read_net
from keras_cct.caffe.net.builder import build_net
from keras_cct.caffe.net.losses import Head, head_value
from keras_cct.caffe.net.weights import load_weights
from keras_cct.caffe.train.data import DataSource, merge_batches, net_data_sources
from keras_cct.caffe.train.prefetch import prefetch
from keras_cct.errors import CaffeFormatError
from keras_cct.strategy.cluster import mean_loss_factor

__all__ = ["CaffeTrainModel", "run_test", "build_phase_net", "random_sources", "input_blobs",
           "output_blobs", "data_shapes"]


class CaffeTrainModel(keras.Model):
    """A Keras model that runs an imported net and computes its Caffe loss and metric heads.

    ``call`` returns ``{blob: tensor}`` for the net's outputs; ``compute_loss`` evaluates every
    head on those blobs and the input blobs (labels) and returns ``sum(loss_weight * value)``,
    recording each head's value as a metric named ``out_<k>``. Works with ``train_on_batch``
    on every Keras backend.

    Args:
        model: the functional net (inputs named by their Caffe blobs).
        heads: the :class:`Head` list.
        output_blobs: the blob name of each model output, in order.
    """

    def __init__(self, model: keras.Model, heads: Sequence[Head], output_blobs: Sequence[str],
                 input_blobs: Optional[Sequence[str]] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net = model
        self.heads = list(heads)
        self.output_blobs = list(output_blobs)
        self.input_blobs = list(input_blobs) if input_blobs is not None else [
            t._keras_history[0].name if hasattr(t, "_keras_history") else t.name
            for t in model.inputs]
        self.head_metrics = [keras.metrics.Mean(name=f"out_{i}")
                             for i in range(len(self.heads))]

    def call(self, inputs, training=False):
        feed = [inputs[name] for name in self.input_blobs]
        outs = self.net(feed if len(feed) > 1 else feed[0], training=training)
        if isinstance(outs, dict):
            return dict(outs)
        if not isinstance(outs, (list, tuple)):
            outs = [outs]
        return dict(zip(self.output_blobs, outs))

    def head_values(self, x, y_pred) -> List:
        blobs = dict(x)
        blobs.update(y_pred)
        values = []
        for h in self.heads:
            missing = [b for b in h.bottoms if b not in blobs]
            if missing:
                raise CaffeFormatError(f"bottom blob(s) {missing} of the {h.type} layer are "
                                       f"neither net outputs nor inputs", layer=h.name)
            values.append(head_value(h.type, h.param, [blobs[b] for b in h.bottoms]))
        return values

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """``sum(loss_weight * head)`` over the heads (each a mean over the batch, as in Caffe).

        ``sample_weight`` is only given by a multi-worker run: the weights of
        :func:`keras_cct.strategy.cluster.local_slice`, which scale this worker's mean to its
        share of the global batch's mean (see :func:`~keras_cct.strategy.cluster.
        mean_loss_factor`); the head metrics are scaled alike so that their average over the
        workers is the global batch's value.
        """
        values = self.head_values(x, y_pred)
        if sample_weight is not None:
            share = keras.ops.mean(keras.ops.cast(sample_weight, "float32"))
            values_seen = [v * share for v in values]
        else:
            values_seen = values
        total = 0.0
        for h, v, seen, m in zip(self.heads, values, values_seen, self.head_metrics):
            m.update_state(seen)
            if h.loss_weight:
                total = total + h.loss_weight * v
        return total if sample_weight is None else total * mean_loss_factor(sample_weight)


def input_blobs(net) -> List[str]:
    names = getattr(net, "inputs", None)
    if isinstance(names, dict) and len(names) == len(net.model.inputs):
        return list(names)
    return [t._keras_history[0].name if hasattr(t, "_keras_history") else t.name
            for t in net.model.inputs]


def output_blobs(net) -> List[str]:
    for attr in ("output_blobs", "outputs", "output_names"):
        names = getattr(net, attr, None)
        if names:
            names = list(names.keys()) if isinstance(names, dict) else list(names)
            if all(isinstance(n, str) for n in names):
                return names
    return list(net.model.output_names)


def data_shapes(sources: Sequence[DataSource]) -> Dict[str, Tuple[int, ...]]:
    """``{top: Caffe shape (N, C, H, W)}`` of the blobs ``sources`` produce (their arrays are
    channels-last)."""
    shapes = {}
    for s in sources:
        for top, shp in s.shapes.items():
            shp = tuple(shp)
            if len(shp) == 3:  # channels-last image -> Caffe's (N, C, H, W)
                shp = (shp[2], shp[0], shp[1])
            shapes[top] = (s.batch_size,) + shp
    return shapes


def run_test(model: CaffeTrainModel, sources: Sequence[DataSource], iterations: int, *,
             log: Callable[[str], None], compute_loss: bool = False, per_batch: bool = False,
             kind: str = "Test") -> Dict[str, float]:
    """Forward ``iterations`` batches through ``model`` and average each head's value over them
    (Caffe's ``Solver::Test`` and ``caffe test``)."""
    batches = prefetch(merge_batches(sources))
    sums = np.zeros(len(model.heads))
    loss = 0.0
    try:
        for i in range(iterations):
            batch = next(batches)
            feed = [batch[k] for k in model.input_blobs]
            outs = model.net.predict_on_batch(feed if len(feed) > 1 else feed[0])
            if not isinstance(outs, (list, tuple, dict)):
                outs = [outs]
            y_pred = dict(outs) if isinstance(outs, dict) else dict(zip(model.output_blobs,
                                                                        outs))
            vals = [float(keras.ops.convert_to_numpy(v))
                    for v in model.head_values(batch, y_pred)]
            if per_batch:
                for h, v in zip(model.heads, vals):
                    log(f"Batch {i}, {h.top} = {v:.6g}")
            sums += vals
            loss += sum(h.loss_weight * v for h, v in zip(model.heads, vals))
    finally:
        batches.close()
    n = max(iterations, 1)
    means = sums / n
    if compute_loss:
        log(f"{kind} loss: {loss / n:.6g}" if kind == "Test" else f"Loss: {loss / n:.6g}")
    for i, (h, v) in enumerate(zip(model.heads, means)):
        msg = f"    {kind} net output #{i}: {h.top} = {v:.6g}" if kind == "Test" else \
            f"{h.top} = {v:.6g}"
        if h.loss_weight:
            msg += f" (* {h.loss_weight:g} = {h.loss_weight * v:.6g} loss)"
        log(msg)
    return {h.top: float(m) for h, m in zip(model.heads, means)}


def random_sources(net, *, batch: Optional[int] = None, seed: int = 0,
                   skip: Sequence[str] = ()) -> List[DataSource]:
    """Sources of random data for the model inputs not fed by a data layer (deploy nets'
    ``Input`` layers, for ``cct time``): uniform [0, 1) images, labels 0."""
    rng = np.random.default_rng(seed)
    out = []
    for name, shape in net.inputs.items():
        if name in skip:
            continue
        bs = batch or shape[0] or 1
        sample = tuple(int(d) for d in shape[1:])
        arr = rng.random((bs,) + sample, dtype=np.float32)

        def gen(arr=arr, name=name):
            while True:
                yield {name: arr}
        out.append(DataSource(name, "Random", [name], bs, {name: sample}, None, gen))
    return out


def build_phase_net(net_path: str, *, phase: str = "TEST", stages: Sequence[str] = (),
                    level: int = 0, weights: Optional[str] = None, batch: Optional[int] = None,
                    random_data: bool = False, seed: Optional[int] = None,
                    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                    python_layers: bool = False):
    """A net of one phase with its data: ``(CaffeTrainModel, sources, CaffeNet)``.

    Data layers are read from their sources (looked up beside ``net_path`` too); with
    ``random_data`` (or for ``Input`` layers) the inputs get random arrays instead, of the
    Caffe shapes in ``input_shapes`` (``{top: (N, C, H, W)}``) where given.
    """
    net_param = read_net(net_path)
    fp = filter_net(net_param, phase=phase, stages=list(stages), level=level)
    base = [os.path.dirname(os.path.abspath(net_path))]
    sources: List[DataSource] = []
    shapes: Dict[str, Tuple[int, ...]] = {}
    if not random_data:
        sources = [s for s in net_data_sources(fp, phase=phase, base_dirs=base, seed=seed)
                   if s.type != "Input"]
        shapes = data_shapes(sources)
    shapes.update({k: tuple(v) for k, v in (input_shapes or {}).items()})
    net = build_net(net_param, phase=phase, stages=tuple(stages), level=level,
                    input_shapes=shapes or None, source=net_path, python_layers=python_layers)
    if weights:
        load_weights(net.model, weights, strict=False, net_param=net.net_param)
    fed = {t for s in sources for t in s.tops}
    sources = sources + random_sources(net, batch=batch, skip=fed)
    model = CaffeTrainModel(net.model, net.heads, output_blobs(net), input_blobs(net),
                            name=f"{phase.lower()}_net")
    return model, sources, net
