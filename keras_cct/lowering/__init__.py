"""Lowered convolutions (CcT's Type 1, 2 and 3), their cost model and the planner.

Pure functions on channels-last tensors, written with ``keras.ops`` so they run on every Keras
backend: :func:`conv2d`, :func:`choose`, :func:`cost`, :func:`conv_geometry`.
"""

from keras_cct.lowering.conv import conv2d
from keras_cct.lowering.cost import Cost, Machine, cost, estimate_seconds
from keras_cct.lowering.dispatch import available, check_available, check_lowering, conv2d_geo
from keras_cct.lowering.geometry import ConvGeometry, conv_geometry
from keras_cct.lowering.names import (ALL_LOWERINGS, LOWERED_TYPES, LOWERING_NAMES,
                                      PLANNER_MODES)
from keras_cct.lowering.planner import choose, choose_for

__all__ = [
    "ALL_LOWERINGS", "LOWERED_TYPES", "LOWERING_NAMES", "PLANNER_MODES", "ConvGeometry", "Cost",
    "Machine", "available", "check_available", "check_lowering", "choose", "choose_for", "conv2d",
    "conv2d_geo", "conv_geometry", "cost", "estimate_seconds",
]
