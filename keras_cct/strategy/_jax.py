"""CCTStrategy on the JAX backend: not yet (the split op is being written)."""

from keras_cct.errors import DeviceError

PREFIX = "jax"
SUPPORTS_JIT = False


def check(strategy) -> None:
    raise DeviceError("CCTStrategy does not run on the JAX backend yet; use the tensorflow or "
                      "torch Keras backend")
