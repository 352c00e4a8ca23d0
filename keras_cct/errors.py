"""Typed errors of keras_cct.

Every error names where the problem is (file, line, layer or device) and says how to fix it.
All derive from :class:`KerasCCTError`; those about bad input also derive from ``ValueError``
so that ``except ValueError`` keeps working for callers that expect Keras' conventions.
"""

from __future__ import annotations

from typing import Optional


class KerasCCTError(Exception):
    """Base class of every keras_cct error."""


def _where(path: Optional[str], line: Optional[int], column: Optional[int],
           layer: Optional[str]) -> str:
    parts = []
    if path is not None:
        loc = str(path)
        if line is not None:
            loc += f":{line}"
            if column is not None:
                loc += f":{column}"
        parts.append(loc)
    if layer is not None:
        parts.append(f"layer '{layer}'")
    return ": ".join(parts)


class LocatedError(KerasCCTError):
    """An error that knows the file, line, column and/or layer it is about.

    Args:
        message: what is wrong.
        path: the file (prototxt, caffemodel, solver, dataset, ...).
        line: 1-based line number in a text file.
        column: 1-based column in a text file.
        layer: the layer (or record) name.
        hint: how to fix it.
    """

    def __init__(self, message: str, *, path: Optional[str] = None, line: Optional[int] = None,
                 column: Optional[int] = None, layer: Optional[str] = None,
                 hint: Optional[str] = None) -> None:
        self.message = message
        self.path = None if path is None else str(path)
        self.line = line
        self.column = column
        self.layer = layer
        self.hint = hint
        where = _where(self.path, line, column, layer)
        text = f"{where}: {message}" if where else message
        if hint:
            text += f" ({hint})"
        super().__init__(text)


class CaffeFormatError(LocatedError, ValueError):
    """A Caffe file (prototxt, caffemodel, binaryproto, solver, solverstate) is malformed or
    uses something keras_cct does not support."""


class DataError(LocatedError, ValueError):
    """A dataset (LMDB, HDF5, image list, image file) cannot be read or has a bad record."""


class LoweringError(KerasCCTError, ValueError):
    """A convolution's arguments cannot be lowered (bad shape, unknown lowering, ...)."""


class PlannerCacheWarning(UserWarning):
    """The planner's on-disk cache was unreadable or stale and was ignored, or a setting of
    keras_cct's caches (such as ``$KERAS_CCT_XLA_CACHE_MB``) was not understood."""


class XlaCacheLogWarning(UserWarning):
    """TensorFlow is about to log false alarms when it loads XLA executables from keras_cct's
    cache (see :func:`keras_cct.lowering._backend.tensorflow.persistent_xla_cache`)."""


class HybridizeWarning(UserWarning):
    """:func:`keras_cct.hybridize` found no layer to convert (no ``Conv2D``,
    ``DepthwiseConv2D`` or ``SeparableConv2D`` in the model's graph, nested models included):
    the copy computes as the model did, with Keras' own layers; or it kept convolutions it does
    not convert (a subclass of a Keras convolution, a convolution inside a wrapper layer)."""


class HybridizeError(LocatedError, ValueError):
    """:func:`keras_cct.hybridize` cannot convert a layer as it is (a depthwise or separable
    convolution that is not built yet, so its input channels are unknown)."""


class DeviceError(KerasCCTError, RuntimeError):
    """A device is unknown, unavailable, or failed while computing."""


class OpenCLError(DeviceError):
    """An OpenCL kernel failed to build or run; the message carries the OpenCL log."""


class WorkerError(DeviceError):
    """A device worker process died or answered with an error."""


class ExportError(LocatedError, RuntimeError):
    """A model cannot be exported; ``layer`` names the layer that cannot."""


class ClusterError(KerasCCTError, ValueError):
    """A multi-worker cluster description (workers, worker index, TF_CONFIG, shares) is wrong,
    or a peer of a running cluster was lost."""


class DeviceDroppedWarning(UserWarning):
    """A device failed during a step: its shard was recomputed elsewhere and it was dropped."""


class DeviceTimeoutError(DeviceError):
    """A device did not answer a request within its deadline (a hung driver, a stopped worker);
    its worker was killed. ``KERAS_CCT_DEVICE_TIMEOUT`` sets the deadline."""
