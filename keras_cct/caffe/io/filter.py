"""Caffe's net-state filter (``Net::FilterNet``): the layers a net keeps in a phase, level and
set of stages, by their ``include`` / ``exclude`` rules."""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.upgrade import NetSource
from keras_cct.errors import CaffeFormatError

__all__ = ["filter_net", "state_meets_rule", "phase_value"]


def state_meets_rule(phase: int, level: int, stages: Iterable[str], rule) -> bool:
    """Whether a net state meets one ``NetStateRule`` (Caffe's ``StateMeetsRule``)."""
    stages = set(stages)
    if rule.HasField("phase") and rule.phase != phase:
        return False
    if rule.HasField("min_level") and level < rule.min_level:
        return False
    if rule.HasField("max_level") and level > rule.max_level:
        return False
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def phase_value(phase) -> int:
    if isinstance(phase, str):
        p = phase.upper()
        if p not in ("TRAIN", "TEST"):
            raise CaffeFormatError(f"phase must be 'TRAIN' or 'TEST', got {phase!r}")
        return proto.TRAIN if p == "TRAIN" else proto.TEST
    return int(phase)


def filter_net(net, *, phase="TEST", stages: Sequence[str] = (), level: int = 0,
               source: Optional[NetSource] = None):
    """The layers of ``net`` that a net in ``phase``/``stages``/``level`` keeps.

    Returns a new ``NetParameter`` and, when ``source`` is given, a matching ``NetSource``
    (``(net, source)``); otherwise just the net.
    """
    ph = phase_value(phase)
    out = proto.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    kept_lines: List[Optional[int]] = []
    for i, layer in enumerate(net.layer):
        if layer.include and layer.exclude:
            line = source.line_of(i) if source else None
            raise CaffeFormatError("a layer has both include and exclude rules",
                                   path=source.path if source else None, line=line,
                                   layer=layer.name, hint="keep only one of them")
        if layer.include:
            keep = any(state_meets_rule(ph, level, stages, r) for r in layer.include)
        else:
            keep = not any(state_meets_rule(ph, level, stages, r) for r in layer.exclude)
        if keep:
            out.layer.add().CopyFrom(layer)
            kept_lines.append(source.line_of(i) if source else None)
    out.state.phase = ph
    out.state.level = level
    del out.state.stage[:]
    out.state.stage.extend(stages)
    if source is not None:
        return out, NetSource(source.path, kept_lines)
    return out
