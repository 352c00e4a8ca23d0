"""HybridConv2D computing on an OpenCL device: same results as keras.layers.Conv2D (outputs and
gradients), trains with model.fit, and is not XLA-compiled."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_cct import HybridConv2D
from tests import reference as R

pytestmark = pytest.mark.opencl


def _grads(model, x, dy):
    """Output and gradients of sum(model(x) * dy) w.r.t. x and the trainable weights."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = model(xt)
            loss = tf.reduce_sum(y * dy)
        grads = tape.gradient(loss, [xt] + [w.value for w in model.trainable_weights])
        return [np.asarray(t) for t in [y] + grads]
    if backend == "jax":
        import jax

        def loss(xv, tv):
            y, _ = model.stateless_call(tv, [w.value for w in model.non_trainable_weights], xv)
            return (y * dy).sum(), y
        (_, y), (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            x, [w.value for w in model.trainable_weights])
        return [np.asarray(t) for t in [y, gx] + list(gw)]
    import torch
    xt = torch.tensor(x, requires_grad=True)
    y = model(xt)
    (y * torch.tensor(dy)).sum().backward()
    return [t.detach().numpy() for t in [y, xt.grad] + [w.value.grad for w in
                                                        model.trainable_weights]]


@pytest.mark.parametrize("config", [
    dict(filters=6, kernel_size=3, strides=2, padding="same", groups=2),
    dict(filters=5, kernel_size=(3, 2), padding="valid", dilation_rate=2),
    dict(filters=4, kernel_size=1, use_bias=False),
])
def test_hybrid_conv2d_on_opencl_matches_keras_conv2d(opencl_device, config):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 9, 10, 4)).astype(np.float32)
    ref = keras.Sequential([keras.Input((9, 10, 4)), keras.layers.Conv2D(**config)])
    ours = keras.Sequential([keras.Input((9, 10, 4)), HybridConv2D(**config, device=opencl_device)])
    ours.set_weights([w + 0.1 * rng.standard_normal(w.shape).astype(np.float32)
                      for w in ref.get_weights()])
    ref.set_weights(ours.get_weights())
    assert ours.layers[0].supports_jit is False
    y_ref = np.asarray(keras.ops.convert_to_numpy(ref(x)))
    dy = rng.standard_normal(y_ref.shape).astype(np.float32)
    got, want = _grads(ours, x, dy), _grads(ref, x, dy)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert R.rel_err(a, b) <= 1e-5
    # and against the float64 reference, independent of Keras
    k = ours.get_weights()[0]
    bias = ours.get_weights()[1] if config.get("use_bias", True) else None
    conf = ours.layers[0]
    assert R.rel_err(got[0], R.conv2d(x, k, bias, conf.strides, config.get("padding", "valid"),
                                      config.get("dilation_rate", 1),
                                      config.get("groups", 1))) <= 1e-5


def test_model_with_opencl_layer_trains(opencl_device):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8, 8, 2)).astype(np.float32)
    y = (x[:, 2:6, 2:6, 0].mean(axis=(1, 2)) > 0).astype(np.int32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 2)),
        HybridConv2D(8, 3, activation="relu", device=opencl_device),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(2),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(x, y, batch_size=16, epochs=8, verbose=0).history["loss"]
    assert hist[-1] < 0.8 * hist[0]
