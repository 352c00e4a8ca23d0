"""keras_cct's typed errors across the host-callback boundaries of the Keras backends.

An OpenCL convolution runs inside a host callback (``tf.numpy_function``, ``jax.pure_callback``).
An exception raised there does not reach the caller as itself: TensorFlow turns it into a
``tf.errors.UnknownError`` and JAX into an ``XlaRuntimeError``, with the original only in the
message text. So the callbacks :func:`remember` each keras_cct error they raise, and the
boundaries keras_cct controls re-raise it, ``from`` the backend's error, when the backend's
error carries its message (:func:`reraise_typed`):

* the eager call of the op (:func:`keras_cct.ops.conv2d_on`, ``CCTStrategy.split_conv``) and
  of its gradient;
* Keras' compiled training, evaluation and prediction functions (``fit``, ``evaluate``,
  ``predict``, ``train_on_batch``, ...): :func:`install_keras_hook`, run the first time a
  device op is called or a ``CCTStrategy`` is made (not at import), wraps the functions that
  the backend trainer's ``make_train_function``,
  ``make_test_function`` and ``make_predict_function`` create. Only errors whose message holds
  a remembered keras_cct error are changed; everything else passes through untouched.

PyTorch needs none of this: its autograd functions raise the keras_cct error itself.
"""

from __future__ import annotations

import collections
import copy
import threading
from typing import Callable, Deque, Optional

from keras_cct.errors import KerasCCTError

_RECENT: Deque[KerasCCTError] = collections.deque(maxlen=64)
_LOCK = threading.Lock()
_INSTALLED = set()


def remember(exc: BaseException) -> BaseException:
    """Keep a copy of ``exc`` (when it is a keras_cct error) so that a boundary can re-raise
    it; returns ``exc``, for ``raise remember(exc)``. The copy has no traceback, so it keeps no
    frame (and no array of the failed request) alive."""
    if isinstance(exc, KerasCCTError) and str(exc):
        try:
            kept = copy.copy(exc)
        except Exception:  # noqa: BLE001 - an error that cannot be copied is not kept
            return exc
        with _LOCK:
            _RECENT.append(kept)
    return exc


def typed(exc: BaseException) -> Optional[KerasCCTError]:
    """The keras_cct error that ``exc`` (a backend's error) carries in its message: the most
    recent :func:`remember` ed one whose text it contains, as a fresh copy; None if none."""
    if isinstance(exc, KerasCCTError):
        return None
    text = str(exc) + "\n" + str(getattr(exc, "message", ""))
    with _LOCK:
        found = next((e for e in reversed(_RECENT) if str(e) in text), None)
    return None if found is None else copy.copy(found)


def reraise_typed(exc: BaseException) -> None:
    """Raise the keras_cct error that ``exc`` carries, ``from exc``; return if it carries none."""
    found = typed(exc)
    if found is not None:
        raise found from exc


def call_typed(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, a backend's error that carries a keras_cct error re-raised as
    that error."""
    try:
        return fn(*args, **kwargs)
    except KerasCCTError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised unless it carries a keras_cct error
        reraise_typed(exc)
        raise


class _TypedFunction:
    """A Keras trainer's step function whose errors are re-raised as keras_cct's
    (:func:`call_typed`); everything else is the wrapped function's."""

    def __init__(self, fn) -> None:
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        return call_typed(self.__wrapped__, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__wrapped__, name)


_TRAINERS = {"tensorflow": ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"),
             "jax": ("keras.src.backend.jax.trainer", "JAXTrainer")}
_FUNCTIONS = (("make_train_function", "train_function"),
              ("make_test_function", "test_function"),
              ("make_predict_function", "predict_function"))


def install_keras_hook() -> bool:
    """Make the current Keras backend's trainer wrap its step functions in
    :class:`_TypedFunction` (once); True when installed (TensorFlow and JAX; PyTorch raises
    the typed errors itself)."""
    import importlib

    import keras
    backend = keras.backend.backend()
    if backend in _INSTALLED:
        return True
    where = _TRAINERS.get(backend)
    if where is None:
        return False
    try:
        trainer = getattr(importlib.import_module(where[0]), where[1])
    except (ImportError, AttributeError):  # another Keras layout: errors stay the backend's
        return False
    for make, attr in _FUNCTIONS:
        original = getattr(trainer, make, None)
        if original is None or getattr(original, "_keras_cct_typed", False):
            continue

        def make_typed(self, *args, _original=original, _attr=attr, **kwargs):
            returned = _original(self, *args, **kwargs)
            fn = getattr(self, _attr, None)
            if fn is not None and not isinstance(fn, _TypedFunction):
                fn = _TypedFunction(fn)
                setattr(self, _attr, fn)
            return fn if returned is not None else returned

        make_typed._keras_cct_typed = True
        make_typed.__doc__ = original.__doc__
        make_typed.__name__ = make
        setattr(trainer, make, make_typed)
    _INSTALLED.add(backend)
    return True
