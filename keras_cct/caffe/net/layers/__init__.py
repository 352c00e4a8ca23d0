"""Keras layers with Caffe's exact semantics, for networks imported from Caffe.

Layout convention: a Caffe blob of shape ``(N, C, d1, ..., dk)`` is held in Keras as the
channels-last tensor ``(N, d1, ..., dk, C)``; blobs of rank <= 2 are unchanged. Every layer here
takes Caffe's own parameters (axes are *Caffe* axes) and maps them onto that layout, so that an
imported net computes exactly what Caffe computes:

* :class:`CaffePooling2D` -- MAX/AVE/global pooling with Caffe's output size (CEIL or FLOOR
  ``round_mode``, the "last window must start inside the image" rule with padding), MAX over the
  valid part of each window, AVE divided by the window size clipped to the *padded* image.
* :class:`CaffeLRN` -- ACROSS_CHANNELS (with ``k``) and WITHIN_CHANNEL local response norm.
* :class:`CaffeBatchNorm` -- mean/variance divided by the scale-factor blob; Caffe's moving
  average update and unbiased variance in training.
* :class:`CaffeScale`, :class:`CaffeBias` -- axis/num_axes broadcasting, learned or 2nd input.
* :class:`CaffePReLU`, :class:`CaffeInnerProduct` (Caffe's C-major flatten order, ``axis``,
  ``transpose``), :class:`CaffeDeconvolution`, :class:`CaffeUnary` (AbsVal, Power, Exp, Log,
  BNLL, Clip, Threshold), :class:`CaffeEltwise`, :class:`CaffeSlice`, :class:`CaffeConcat`,
  :class:`CaffeSoftmax`, :class:`CaffeFlatten`, :class:`CaffeReshape`, :class:`CaffeCrop`.

Weights are stored so that each layer's variables come in Caffe's blob order; the importer
converts blob layouts (see :mod:`keras_cct.caffe.net.weights`). All layers are registered
serializable (package ``keras_cct``) and round-trip through ``get_config``.

One module per family: :mod:`.pooling`, :mod:`.normalization`, :mod:`.weighted`,
:mod:`.elementwise`, :mod:`.shape`; the layout helpers are :mod:`keras_cct.caffe.net.layout`.
Importing this package registers every layer for ``keras.saving.load_model``.
"""

from keras_cct.caffe.net.layout import (caffe_axis, caffe_shape, from_caffe_layout, keras_shape,
                                        to_caffe_layout)
from keras_cct.caffe.net.layers.pooling import pool_output_size, CaffePooling2D, CaffeLRN
from keras_cct.caffe.net.layers.normalization import (CaffeBatchNorm, CaffeBias, CaffePReLU,
                                                      CaffeScale)
from keras_cct.caffe.net.layers.weighted import CaffeInnerProduct, CaffeDeconvolution
from keras_cct.caffe.net.layers.elementwise import CaffeUnary, CaffeEltwise
from keras_cct.caffe.net.layers.shape import (CaffeConcat, CaffeCrop, CaffeFlatten, CaffeReshape,
                                              CaffeSlice, CaffeSoftmax)

__all__ = [
    "caffe_axis", "to_caffe_layout", "from_caffe_layout", "caffe_shape", "keras_shape",
    "pool_output_size", "CaffePooling2D", "CaffeLRN", "CaffeBatchNorm", "CaffeScale",
    "CaffeBias", "CaffePReLU", "CaffeInnerProduct", "CaffeDeconvolution", "CaffeUnary",
    "CaffeEltwise", "CaffeSlice", "CaffeConcat", "CaffeSoftmax", "CaffeFlatten", "CaffeReshape",
    "CaffeCrop",
]

# the three families added later register their layers on import, as the ones above
from keras_cct.caffe.net.layers import bvlc as _bvlc, forks as _forks, recurrent as _recurrent  # noqa: E402,F401
