"""Keras layers for Caffe's recurrent layers (LSTM, RNN, LSTMUnit) and opt-in Python layers,
with Caffe's exact semantics.

* :mod:`.lstm` -- :class:`CaffeLSTM`, :class:`CaffeRNN`, :class:`CaffeLSTMUnit` (time-major,
  ``cont`` resets, ``x_static``, ``expose_hidden``; Caffe's blobs as variables).
* :mod:`.python_layer` -- :class:`Layer` (pycaffe's base class), :class:`CaffePythonLayer` (a
  pycaffe layer run through a host callback, differentiable by its ``backward``).

Importing this package registers its layers for ``keras.saving.load_model``."""

from keras_cct.caffe.net.layers.recurrent.lstm import (FILLER_TYPES, CaffeLSTM, CaffeLSTMUnit,
                                                       CaffeRecurrentState, CaffeRNN,
                                                       filler_initializer)

__all__ = ["CaffeLSTM", "CaffeRNN", "CaffeLSTMUnit", "CaffeRecurrentState",
           "filler_initializer", "FILLER_TYPES"]
from keras_cct.caffe.net.layers.recurrent.python_layer import (Blob, CaffePythonLayer, Layer,
                                                               allow_python_layers,
                                                               python_layer_class)

__all__ += ["Layer", "Blob", "CaffePythonLayer", "python_layer_class", "allow_python_layers"]
