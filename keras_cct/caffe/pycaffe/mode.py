"""pycaffe's ``set_mode_cpu`` / ``set_mode_gpu`` / ``set_device``. Caffe picks its device per
process; keras_cct runs on the Keras backend's devices (and, for convolutions, on the devices a
:class:`keras_cct.CCTStrategy` names), so these calls only record the wish and, for a GPU, say
where the choice is really made."""

from __future__ import annotations

import warnings

__all__ = ["set_mode_cpu", "set_mode_gpu", "set_device", "mode"]

_STATE = {"mode": "CPU", "device": 0}


def set_mode_cpu() -> None:
    """Caffe's CPU mode: nothing to do (the Keras backend's default device computes)."""
    _STATE["mode"] = "CPU"


def set_mode_gpu() -> None:
    """Caffe's GPU mode. keras_cct does not switch devices per process: the Keras backend
    uses a GPU when it sees one (CUDA TensorFlow/JAX/PyTorch), and OpenCL devices are chosen
    per layer (``HybridConv2D(device=...)``) or with ``keras_cct.CCTStrategy``."""
    _STATE["mode"] = "GPU"
    warnings.warn("caffe.set_mode_gpu(): keras_cct computes on the Keras backend's devices "
                  "(a GPU when the backend sees one); to put convolutions on OpenCL devices "
                  "use keras_cct.CCTStrategy (see `cct devices`)", stacklevel=2)


def set_device(device_id: int) -> None:
    """Caffe's GPU id; recorded only (see :func:`set_mode_gpu`)."""
    if int(device_id) < 0:
        raise ValueError(f"device id must be >= 0, got {device_id}")
    _STATE["device"] = int(device_id)


def mode() -> str:
    """``"CPU"`` or ``"GPU"``: the last mode set."""
    return _STATE["mode"]
