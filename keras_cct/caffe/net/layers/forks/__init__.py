"""Keras layers for layer types of the most-used Caffe forks (SSD, PSPNet/DeepLab, SegNet,
Faster R-CNN, SENet, MobileNet, ShuffleNet), with Caffe's exact semantics.

* :mod:`.detection` -- SSD's :class:`CaffePermute`, :class:`CaffeNormalize`,
  :class:`CaffePriorBox`; :mod:`.nms` -- :class:`CaffeDetectionOutput` (and :func:`detections`).
* :mod:`.resize` -- :class:`CaffeInterp` (PSPNet/DeepLab), :class:`CaffeUpsample` (SegNet, YOLO).
* :mod:`.misc` -- :class:`CaffeShuffleChannel`, :class:`CaffeAxpy`, :class:`CaffeROIPooling`.

ReLU6 is ``keras.layers.ReLU(max_value=6)`` and ConvolutionDepthwise a depthwise
:class:`~keras_cct.layers.HybridConv2D` (Caffe's ``(C, 1, kh, kw)`` blob as a grouped
convolution's): no layer class of their own.

Importing this package registers its layers for ``keras.saving.load_model``."""

from keras_cct.caffe.net.layers.forks.detection import (CaffeNormalize, CaffePermute,
                                                        CaffePriorBox, prior_boxes)
from keras_cct.caffe.net.layers.forks.nms import CaffeDetectionOutput, detections
from keras_cct.caffe.net.layers.forks.resize import CaffeInterp, CaffeUpsample
from keras_cct.caffe.net.layers.forks.misc import CaffeAxpy, CaffeROIPooling, CaffeShuffleChannel

__all__ = ["CaffePermute", "CaffeNormalize", "CaffePriorBox", "prior_boxes",
           "CaffeDetectionOutput", "detections", "CaffeInterp", "CaffeUpsample",
           "CaffeShuffleChannel", "CaffeAxpy", "CaffeROIPooling"]
