"""Helpers of the Caffe import tests: random weights, OpenCV reference runs, Caffe layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

NETS = Path(__file__).resolve().parent / "nets"


def randomize(model, seed: int = 0) -> None:
    """He-scaled random weights (so deep nets keep O(1) activations); BatchNorm gets random
    statistics with a scale factor != 1 (it must be divided out)."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        ws = layer.get_weights()
        if not ws:
            continue
        cls = type(layer).__name__
        if cls == "CaffeBatchNorm":
            c = ws[0].shape[0]
            s = rng.uniform(0.5, 2.0)
            new = [rng.normal(0, 0.1, c) * s, rng.uniform(0.5, 1.5, c) * s, np.array([s])]
        else:
            new = []
            for i, w in enumerate(ws):
                if w.ndim >= 2:
                    if cls == "CaffeDeconvolution":
                        fan_in = w.shape[0] * w.shape[1] * w.shape[3]
                    else:
                        fan_in = int(np.prod(w.shape[:-1]))
                    new.append(rng.normal(0, np.sqrt(2.0 / fan_in), w.shape))
                elif cls == "CaffeScale" and i == 0:
                    new.append(rng.uniform(0.5, 1.5, w.shape))
                elif cls == "CaffePReLU":
                    new.append(rng.uniform(0.05, 0.5, w.shape))
                else:
                    new.append(rng.normal(0, 0.1, w.shape))
        layer.set_weights([np.asarray(a, np.float32) for a in new])


def producer_of(net_param, blob: str) -> str:
    """The Caffe layer that last writes ``blob`` (OpenCV names its output by that layer)."""
    name = None
    for lp in net_param.layer:
        if blob in lp.top:
            name = lp.name
    assert name is not None, blob
    return name


def opencv_forward(prototxt, caffemodel, x_nchw: Dict[str, np.ndarray], layers: Sequence[str]
                   ) -> List[np.ndarray]:
    """Run OpenCV's Caffe importer (fusion off) and return the outputs of ``layers``."""
    import cv2
    net = cv2.dnn.readNetFromCaffe(str(prototxt), str(caffemodel))
    net.enableFusion(False)
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    for name, x in x_nchw.items():
        net.setInput(np.ascontiguousarray(x, np.float32), name)
    return [np.asarray(v) for v in net.forward(list(layers))]
