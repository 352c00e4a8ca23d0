"""CCTStrategy: split each mini-batch across devices in proportion to their FLOPS (CcT's hybrid
execution), run the shards concurrently, rebalance while training, survive a failing device.
:func:`hybridize` converts an existing model's Conv2D layers."""

from keras_cct.strategy.core import CCTStrategy
from keras_cct.strategy.hybridize import hybridize

__all__ = ["CCTStrategy", "hybridize"]
