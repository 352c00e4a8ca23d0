"""Converters for layer types of the most-used Caffe forks (SSD, PSPNet/DeepLab, SegNet, Faster R-CNN, SENet, MobileNet, ShuffleNet): ``(ctx, layer_param, bottom tensors) -> list of top tensors``,
merged into :data:`keras_cct.caffe.net.converters.CONVERTERS`."""

from __future__ import annotations

from typing import Callable, Dict, Set

__all__ = ["CONVERTERS", "MULTI_TOP"]

CONVERTERS: Dict[str, Callable] = {}
MULTI_TOP: Set[str] = set()  # types whose layers may have several tops
