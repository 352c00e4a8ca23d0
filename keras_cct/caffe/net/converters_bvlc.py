"""Converters for the rest of BVLC Caffe's layer types: ``(ctx, layer_param, bottom tensors) -> list of top tensors``,
merged into :data:`keras_cct.caffe.net.converters.CONVERTERS`."""

from __future__ import annotations

from typing import Callable, Dict, Set

__all__ = ["CONVERTERS", "MULTI_TOP"]

CONVERTERS: Dict[str, Callable] = {}
MULTI_TOP: Set[str] = set()  # types whose layers may have several tops
