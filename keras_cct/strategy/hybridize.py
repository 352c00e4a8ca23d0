"""hybridize: an existing Keras model with every Conv2D replaced by an equal HybridConv2D."""

from __future__ import annotations

import keras

from keras_cct.layers.convert import to_hybrid


def hybridize(model: keras.Model, strategy=None, *, lowering: str = "auto") -> keras.Model:
    """A copy of ``model`` in which every ``keras.layers.Conv2D`` is a HybridConv2D with the same
    configuration and weights, bound to ``strategy`` when one is given.

    Args:
        model: a functional or Sequential model (``keras.models.clone_model`` must accept it).
        strategy: a :class:`~keras_cct.CCTStrategy`, or None for plain HybridConv2D layers.
        lowering: the new layers' ``lowering``.
    """
    def clone(layer):
        if type(layer) is keras.layers.Conv2D:
            new = to_hybrid(layer, lowering=lowering)
            new._strategy = strategy
            return new
        return layer.__class__.from_config(layer.get_config())

    copy = keras.models.clone_model(model, clone_function=clone)
    copy.set_weights(model.get_weights())
    return copy
