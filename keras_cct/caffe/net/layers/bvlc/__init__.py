"""Keras layers for the rest of BVLC Caffe's layer types, with Caffe's exact semantics.

Importing this package registers its layers for ``keras.saving.load_model``."""
