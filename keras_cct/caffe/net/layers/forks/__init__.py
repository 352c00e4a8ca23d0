"""Keras layers for layer types of the most-used Caffe forks (SSD, PSPNet/DeepLab, SegNet, Faster R-CNN, SENet, MobileNet, ShuffleNet), with Caffe's exact semantics.

Importing this package registers its layers for ``keras.saving.load_model``."""
