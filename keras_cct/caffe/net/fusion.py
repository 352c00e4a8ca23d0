"""Fusing layer pairs of a built Caffe net where one backend op does the work of two.

Caffe has no affine part in ``BatchNorm``: nets follow each one with a ``Scale`` layer
(``bias_term: true``), in place, as ResNet and MobileNet do. Built as two Keras layers that is
a fused normalization (one pass each way) plus a multiply, an add and their gradients (four
more passes over the blob). :func:`fuse_batch_norm_scale` hands each such Scale to its
BatchNorm (:meth:`~keras_cct.caffe.net.layers.CaffeBatchNorm.absorb`), which applies the scale
and bias inside its fused op (TensorFlow's ``FusedBatchNormV3``, PyTorch's
``F.batch_norm``); the Scale layer passes its input on. Both layers, their names and their
variables (Caffe's blobs) stay where they were: weights load and save, solvers' ``lr_mult``
and per-layer reports see the net as written.

ResNet-50's training step at batch 16 on a 2-core Xeon (AMX-BF16): see docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

from keras_cct.caffe.net.layers import CaffeBatchNorm, CaffeScale

__all__ = ["fuse_batch_norm_scale"]


def fuse_batch_norm_scale(layers: Iterable, keep: Iterable) -> List[Tuple[str, str]]:
    """Fuse each learned per-channel ``CaffeScale`` into the ``CaffeBatchNorm`` it reads.

    A pair is fused only where nothing else can see the BatchNorm's own output: each layer is
    called once, the Scale is the BatchNorm's only consumer, and the BatchNorm's output is not
    in ``keep`` (the tensors that must keep their value: named blobs, model outputs).
    Returns the fused ``(batch_norm, scale)`` layer names."""
    keep_ids = {id(t) for t in keep}
    fused = []
    for scale in layers:
        if not isinstance(scale, CaffeScale) or len(scale._inbound_nodes) != 1:
            continue
        inputs = scale._inbound_nodes[0].input_tensors
        if len(inputs) != 1:
            continue
        x = inputs[0]
        bn = x._keras_history.operation
        if (not isinstance(bn, CaffeBatchNorm)
                or len(bn._inbound_nodes) != 1 or len(bn._outbound_nodes) != 1
                or id(x) in keep_ids or not scale.per_channel(len(x.shape))):
            continue
        bn.absorb(scale, len(x.shape))
        fused.append((bn.name, scale.name))
    return fused
