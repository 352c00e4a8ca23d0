"""``keras_cct.ops.conv2d_on`` on the current Keras backend: outputs and gradients against the
float64 reference, eager and compiled (tf.function / jax.jit), and its errors."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_cct.errors import DeviceError, LoweringError
from keras_cct.ops import conv2d_on
from tests import reference as R

pytestmark = pytest.mark.opencl
BACKEND = keras.backend.backend()


def _grads(fn, x, k, b, dy, compiled):
    """(y, dx, dk, db) of sum(fn(x, k, b) * dy) with the backend's autodiff."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def step(x, k, b):
            with tf.GradientTape() as tape:
                tape.watch([x, k, b])
                y = fn(x, k, b)
                loss = tf.reduce_sum(y * dy)
            return (y, *tape.gradient(loss, [x, k, b]))
        if compiled:
            step = tf.function(step)
        out = step(tf.constant(x), tf.Variable(k), tf.constant(b))
    elif BACKEND == "jax":
        import jax

        def loss(x, k, b):
            y = fn(x, k, b)
            return (y * dy).sum(), y
        g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
        if compiled:
            g = jax.jit(g)
        (_, y), grads = g(x, k, b)
        out = (y, *grads)
    else:
        import torch
        xt, kt, bt = (torch.tensor(a, requires_grad=True) for a in (x, k, b))
        y = fn(xt, kt, bt)
        (y * torch.tensor(dy)).sum().backward()
        out = (y.detach(), xt.grad, kt.grad, bt.grad)
    return [np.asarray(keras.ops.convert_to_numpy(t)) for t in out]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("lowering", ["auto", "type1", "type2", "type3"])
def test_conv2d_on_forward_and_gradients(opencl_device, lowering, compiled):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 9, 8, 4)).astype(np.float32)
    k = rng.standard_normal((3, 3, 2, 6)).astype(np.float32)
    b = rng.standard_normal((6,)).astype(np.float32)
    args = dict(strides=2, padding="same", dilation_rate=1, groups=2)
    ref = R.conv2d(x, k, b, 2, "same", 1, 2)
    dy = rng.standard_normal(ref.shape).astype(np.float32)

    def fn(x, k, b):
        return conv2d_on(opencl_device, x, k, b, lowering=lowering, **args)
    y, dx, dk, db = _grads(fn, x, k, b, dy, compiled)
    rdx, rdk, rdb = R.conv2d_grads(x, k, dy, 2, "same", 1, 2)
    assert R.rel_err(y, ref) <= 1e-5
    assert R.rel_err(dx, rdx) <= 1e-5
    assert R.rel_err(dk, rdk) <= 1e-5
    assert R.rel_err(db, rdb) <= 1e-5


def test_conv2d_on_without_bias(opencl_device):
    x = np.random.default_rng(4).standard_normal((1, 5, 6, 3)).astype(np.float32)
    k = np.random.default_rng(5).standard_normal((2, 3, 3, 4)).astype(np.float32)
    y = conv2d_on(opencl_device, keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(k),
                  padding=((1, 0), (2, 1)))
    assert R.rel_err(keras.ops.convert_to_numpy(y), R.conv2d(x, k, None, 1, ((1, 0), (2, 1)))) \
        <= 1e-5


def test_conv2d_on_errors(opencl_device):
    x = keras.ops.zeros((1, 5, 5, 3), dtype="float16")
    k = keras.ops.zeros((3, 3, 3, 2))
    with pytest.raises(DeviceError, match="float32 only"):
        conv2d_on(opencl_device, x, k)
    with pytest.raises(DeviceError, match="not an OpenCL device"):
        conv2d_on("tf:cpu:0", keras.ops.zeros((1, 5, 5, 3)), k)
    with pytest.raises(LoweringError, match="larger than the padded input"):
        conv2d_on(opencl_device, keras.ops.zeros((1, 2, 2, 3)), k)
    with pytest.raises(LoweringError, match="not available on OpenCL"):
        conv2d_on(opencl_device, keras.ops.zeros((1, 5, 5, 3)), k, lowering="native")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow graph ops")
def test_tf_ops_are_stateless_numpy_functions(opencl_device):
    """stateful=False (PyFuncStateless) lets TF run two such ops, or one and a TF op, at once."""
    import tensorflow as tf
    x = tf.zeros((1, 5, 5, 2))
    k = tf.Variable(tf.zeros((3, 3, 2, 4)))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = conv2d_on(opencl_device, x, k)
        return tape.gradient(y, [x, k])

    graph = step.get_concrete_function(x).graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("PyFuncStateless") == 2  # forward and backward
    assert "PyFunc" not in types
