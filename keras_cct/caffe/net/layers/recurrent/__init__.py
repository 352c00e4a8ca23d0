"""Keras layers for Caffe's recurrent layers (LSTM, RNN, LSTMUnit) and opt-in Python layers, with Caffe's exact semantics.

Importing this package registers its layers for ``keras.saving.load_model``."""
