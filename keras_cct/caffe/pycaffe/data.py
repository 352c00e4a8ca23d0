"""The data layers of a pycaffe :class:`~keras_cct.caffe.pycaffe.net.Net`: their batch
sources (:mod:`keras_cct.caffe.train.data`), shapes and batch size."""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from keras_cct.caffe.io.types import DATA_TYPES
from keras_cct.caffe.train.data import layer_batch, net_data_sources
from keras_cct.caffe.train.model import data_shapes

__all__ = ["data_layers", "data_sources"]


def data_sources(net_param, phase: str, path: Optional[str],
                 arrays: Optional[Mapping[str, np.ndarray]] = None) -> list:
    """The batch sources of the (phase-filtered) net's data layers, files looked up beside
    ``path``; ``arrays`` feed MemoryData layers (channels-last)."""
    base = [os.path.dirname(os.path.abspath(path))] if path else []
    return [s for s in net_data_sources(net_param, phase=phase, base_dirs=base, arrays=arrays)
            if s.type != "Input"]


def data_layers(net_param, phase: str, path: Optional[str], shapes: Mapping
                ) -> Tuple[Optional[List], Dict[str, Tuple[int, ...]], Optional[int]]:
    """``(sources, {top: Caffe shape}, batch)`` of the net's data layers: sources are opened
    only for layers whose shapes neither the prototxt nor ``shapes`` gives (MemoryData waits
    for ``set_input_arrays``)."""
    sources, found = None, {}
    if any(lp.type in DATA_TYPES and lp.type not in ("Input", "MemoryData") and not
           all(t in shapes for t in lp.top) for lp in net_param.layer):
        sources = data_sources(net_param, phase, path)
        found = data_shapes(sources)
    batch = next((int(x.batch_size) for x in sources or () if x.batch_size), None)
    if batch is None:
        batch = next((layer_batch(lp) for lp in net_param.layer
                      if lp.type in DATA_TYPES and layer_batch(lp)), None)
    return sources, found, batch
