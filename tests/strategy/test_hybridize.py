"""keras_cct.hybridize on every backend: Conv2D, DepthwiseConv2D and SeparableConv2D layers
become equal HybridConv2D layers; the Keras model is the reference (outputs, and weights after
training)."""

import keras
import numpy as np
import pytest

from keras_cct import HybridConv2D, hybridize
from tests import reference as ref
from tests.backend_grads import to_numpy


def _model():
    """MobileNet's pattern: a strided "same" Conv2D, depthwise layers (stride 2 on an even size,
    a depth multiplier, a bias and an activation), a 1x1 Conv2D, BatchNormalization."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw1")(h)
    h = keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2,
                                     activation="relu", name="dw2")(h)
    h = keras.layers.Conv2D(5, 1)(h)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inp, out)


def _compiled(model):
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _predict_and_train(model, hybrid, shape, seed: int) -> None:
    """Both models predict the same on a random batch of ``shape`` (3 classes); then three SGD
    steps each on it."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype("float32")
    y = rng.integers(0, 3, shape[0])
    assert ref.rel_err(to_numpy(hybrid.predict_on_batch(x)),
                       to_numpy(model.predict_on_batch(x))) <= 1e-5
    for m in (_compiled(model), _compiled(hybrid)):
        for _ in range(3):
            m.train_on_batch(x, y)


def test_depthwise_layers_become_grouped_hybrid_layers():
    """Every Conv2D and DepthwiseConv2D is a HybridConv2D (a depthwise one with one group per
    input channel, ``channels * depth_multiplier`` filters, its bias and activation); the
    predictions are the Keras model's, and so are the weights after three SGD steps (the
    depthwise kernels reshaped to Keras' layout)."""
    model = _model()
    hybrid = hybridize(model)
    convs = {layer.name: layer for layer in hybrid.layers if isinstance(layer, HybridConv2D)}
    assert len(convs) == 4
    assert not any(isinstance(layer, keras.layers.DepthwiseConv2D) for layer in hybrid.layers)
    dw1, dw2 = convs["dw1"], convs["dw2"]
    assert (dw1.groups, dw1.filters, dw1.use_bias) == (8, 8, False)
    assert (dw2.groups, dw2.filters, dw2.strides, dw2.use_bias) == (8, 16, (2, 2), True)
    assert dw2.activation is keras.activations.relu
    _predict_and_train(model, hybrid, (6, 12, 12, 3), seed=0)
    for a, b in zip(hybrid.get_weights(), model.get_weights()):
        if a.shape != b.shape:  # a depthwise kernel: (kh, kw, 1, c * m) against (kh, kw, c, m)
            assert a.shape == (b.shape[0], b.shape[1], 1, b.shape[2] * b.shape[3])
            a = a.reshape(b.shape)
        assert ref.rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("depthwise", [True, False])
def test_depthwise_conversion_can_be_turned_off(depthwise):
    """``depthwise=False`` converts the Conv2D layers only; the weights copy either way."""
    model = _model()
    hybrid = hybridize(model, depthwise=depthwise)
    kinds = [type(layer).__name__ for layer in hybrid.layers
             if isinstance(layer, (HybridConv2D, keras.layers.DepthwiseConv2D))]
    assert kinds == ["HybridConv2D"] * 4 if depthwise else [
        "HybridConv2D", "DepthwiseConv2D", "DepthwiseConv2D", "HybridConv2D"]
    x = np.random.default_rng(1).standard_normal((2, 12, 12, 3)).astype("float32")
    assert ref.rel_err(to_numpy(hybrid(x)), to_numpy(model(x))) <= 1e-5


@pytest.mark.parametrize("wrap", ["sequential", "functional"])
def test_models_nested_in_the_model_are_converted(wrap):
    """Transfer learning's usual form, ``Sequential([base, Dense])`` or a functional model
    calling ``base``: the base model's layers are converted too (they were left as Keras'
    before), with its weights; outputs and trained weights are the Keras model's."""
    base = _model()
    if wrap == "sequential":
        model = keras.Sequential([keras.Input((12, 12, 3)), base, keras.layers.Dense(2)])
    else:
        inp = keras.Input((12, 12, 3))
        model = keras.Model(inp, keras.layers.Dense(2)(base(inp)))
    hybrid = hybridize(model)
    convs = [layer for layer in hybrid._flatten_layers() if isinstance(layer, HybridConv2D)]
    assert len(convs) == 4
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 12, 12, 3)).astype("float32")
    y = rng.integers(0, 2, 4)
    assert ref.rel_err(to_numpy(hybrid(x)), to_numpy(model(x))) <= 1e-5
    for m in (_compiled(model), _compiled(hybrid)):
        m.train_on_batch(x, y)
    for a, b in zip(hybrid.get_weights(), model.get_weights()):
        assert ref.rel_err(a.reshape(b.shape), b) <= 1e-4


def test_a_model_without_convolutions_warns():
    """Nothing to convert (here a model of Dense layers): the copy computes as the model, and a
    HybridizeWarning says that nothing was converted."""
    from keras_cct.errors import HybridizeWarning
    inp = keras.Input((5,))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(4)(inp)))
    with pytest.warns(HybridizeWarning, match="has no Conv2D, DepthwiseConv2D or SeparableConv2D layer"):
        copy = hybridize(model)
    x = np.random.default_rng(0).standard_normal((2, 5)).astype("float32")
    assert ref.rel_err(to_numpy(copy(x)), to_numpy(model(x))) <= 1e-6


def _separable_model():
    """Xception's pattern: separable layers with a depth multiplier, a stride on an even size
    ("same"), a dilation, an activation, with and without a bias."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((12, 12, 4))
    h = keras.layers.SeparableConv2D(6, 3, strides=2, padding="same", depth_multiplier=2,
                                     activation="relu", name="sep1")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.SeparableConv2D(5, 3, dilation_rate=2, use_bias=False, name="sep2")(h)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inp, out)


def test_separable_layers_become_a_grouped_and_a_pointwise_hybrid_layer():
    """Every SeparableConv2D is a Sequential of the same name: the grouped HybridConv2D of its
    depthwise part (strides, padding, dilation; no bias) and a 1x1 HybridConv2D (bias,
    activation). The predictions are the Keras model's, and so are all weights after three
    SGD steps."""
    model = _separable_model()
    hybrid = hybridize(model)
    assert not any(isinstance(layer, keras.layers.SeparableConv2D)
                   for layer in hybrid._flatten_layers())
    sep1 = hybrid.get_layer("sep1")
    dw, pw = sep1.layers
    assert isinstance(dw, HybridConv2D) and isinstance(pw, HybridConv2D)
    assert (dw.groups, dw.filters, dw.strides, dw.use_bias) == (4, 8, (2, 2), False)
    assert (pw.kernel_size, pw.filters, pw.use_bias) == ((1, 1), 6, True)
    assert dw.activation is keras.activations.linear
    assert pw.activation is keras.activations.relu
    assert hybrid.get_layer("sep2").layers[0].dilation_rate == (2, 2)
    _predict_and_train(model, hybrid, (6, 12, 12, 4), seed=3)
    weights, want = hybrid.get_weights(), model.get_weights()
    assert len(weights) == len(want)
    for a, b in zip(weights, want):
        assert ref.rel_err(a.reshape(b.shape), b) <= 1e-4


def test_an_unbuilt_depthwise_or_separable_layer_is_a_clear_error():
    """Its input channels are unknown: a HybridizeError names the layer and says to build the
    model (or to keep Keras' layer); a built model converts."""
    from keras_cct.errors import HybridizeError
    for layer in (keras.layers.SeparableConv2D(4, 3, name="sep"),
                  keras.layers.DepthwiseConv2D(3, name="sep")):
        model = keras.Sequential([layer])
        with pytest.raises(HybridizeError, match="layer 'sep'.*not built.*model.build"):
            hybridize(model)
        assert len(hybridize(model, depthwise=False).layers) == 1
        model.build((None, 8, 8, 2))
        assert isinstance(hybridize(model).layers[0], (HybridConv2D, keras.Sequential))


def test_subclassed_and_wrapped_convolutions_are_kept_with_a_warning():
    """A subclass of Conv2D may compute otherwise, and TimeDistributed's inner layer is not
    reached by the clone: both stay Keras' layers, named in a HybridizeWarning; the Conv2D
    beside them is converted and the copy computes as the model."""
    from keras_cct.errors import HybridizeWarning

    class MyConv(keras.layers.Conv2D):
        pass

    keras.utils.set_random_seed(6)
    inp = keras.Input((3, 8, 8, 2))
    h = keras.layers.TimeDistributed(keras.layers.Conv2D(3, 3), name="td")(inp)
    h = keras.layers.Reshape((3 * 6, 6, 3))(h)
    h = MyConv(4, 3, name="mine")(h)
    out = keras.layers.Conv2D(2, 1, name="plain")(h)
    model = keras.Model(inp, out)
    with pytest.warns(HybridizeWarning, match="kept 'td' \\(TimeDistributed\\), 'mine' "
                                              "\\(MyConv\\)"):
        hybrid = hybridize(model)
    assert [type(layer).__name__ for layer in hybrid.layers[1:]] == [
        "TimeDistributed", "Reshape", "MyConv", "HybridConv2D"]
    x = np.random.default_rng(5).standard_normal((2, 3, 8, 8, 2)).astype("float32")
    assert ref.rel_err(to_numpy(hybrid(x)), to_numpy(model(x))) <= 1e-5
