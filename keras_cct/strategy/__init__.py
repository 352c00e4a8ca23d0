"""CCTStrategy: split each mini-batch across devices in proportion to their FLOPS (CcT's hybrid
execution), run the shards concurrently, rebalance while training, survive a failing device.
:func:`hybridize` converts an existing model's Conv2D, DepthwiseConv2D and SeparableConv2D
layers.

The names are imported on first use (PEP 562): ``keras_cct.layers`` reads the active strategy
from :mod:`keras_cct.strategy.context` without importing :func:`hybridize`, which builds on
``keras_cct.layers`` (no layers <-> strategy import circle)."""

from keras_cct._lazy import lazy_attributes

_EXPORTS = {"CCTStrategy": "keras_cct.strategy.core",
            "hybridize": "keras_cct.strategy.hybridize"}

__all__ = ["CCTStrategy", "hybridize"]

__getattr__, __dir__ = lazy_attributes(globals(), _EXPORTS)
