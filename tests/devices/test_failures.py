"""keras_cct.ops.failures: a keras_cct error raised inside a backend's host callback is
re-raised as itself; every other error passes through unchanged."""

import gc
import weakref

import keras
import numpy as np
import pytest

import keras_cct  # noqa: F401 - installs the hook on the Keras trainer
from keras_cct.errors import CaffeFormatError, DeviceError, WorkerError
from keras_cct.ops import failures


def test_typed_finds_the_remembered_error_in_a_backend_error():
    exc = WorkerError("OpenCL device opencl:7:7: the worker failed: boom 1234")
    assert failures.remember(exc) is exc
    backend_error = RuntimeError(f"UNKNOWN: WorkerError: {exc}\nTraceback ...")
    found = failures.typed(backend_error)
    assert type(found) is WorkerError and str(found) == str(exc) and found is not exc
    assert failures.typed(RuntimeError("UNKNOWN: something else")) is None
    assert failures.typed(exc) is None  # already typed
    with pytest.raises(WorkerError) as info:
        failures.call_typed(lambda: (_ for _ in ()).throw(backend_error))
    assert info.value.__cause__ is backend_error
    with pytest.raises(KeyError):  # not carrying one: unchanged
        failures.call_typed(lambda: {}["x"])


def test_located_errors_survive_the_copy():
    exc = CaffeFormatError("bad", path="a.prototxt", line=3, layer="conv1", hint="fix it")
    failures.remember(exc)
    found = failures.typed(RuntimeError(str(exc)))
    assert type(found) is CaffeFormatError and str(found) == str(exc)


def test_remembered_errors_keep_no_frames_alive():
    class Big:
        pass

    def fail(big):
        raise DeviceError("OpenCL device opencl:0:0: frames test 98765")

    big = Big()
    ref = weakref.ref(big)
    try:
        fail(big)
    except DeviceError as exc:
        failures.remember(exc)
    del big
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TF host callbacks")
def test_fit_passes_other_errors_through_unchanged():
    import tensorflow as tf

    class Fails(keras.layers.Layer):
        def call(self, x):
            def bad(a):
                raise ZeroDivisionError("not a keras_cct error")
            y = tf.numpy_function(bad, [x], tf.float32)
            y.set_shape(x.shape)
            return y

    assert failures.install_keras_hook()  # as a device layer or a CCTStrategy does
    model = keras.Sequential([keras.Input((2,)), Fails(), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.make_train_function()
    assert isinstance(model.train_function, failures._TypedFunction)
    with pytest.raises(tf.errors.UnknownError, match="not a keras_cct error"):
        model.fit(np.ones((4, 2), "float32"), np.ones((4, 1), "float32"), verbose=0)
