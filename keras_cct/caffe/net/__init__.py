"""Caffe nets as Keras models (imports Keras; reads files through :mod:`keras_cct.caffe.io`).

* :mod:`.builder` -- ``NetParameter`` -> :class:`~.builder.CaffeNet` (``build_net``, ``load_net``,
  ``import_net``); :mod:`.converters` -- one converter per Caffe layer type;
  :mod:`.checks` -- a layer's parameters and memory checked before it is built.
* :mod:`.layers` -- Keras layers with Caffe's exact semantics, one module per family.
* :mod:`.layout` -- Caffe's NCHW blobs <-> Keras' channels-last tensors (``caffe_axis``, ...).
* :mod:`.losses` -- Caffe's loss and metric layers, the :class:`~.losses.Head` records and
  ``HEAD_TYPES``.
* :mod:`.weights` -- .caffemodel <-> Keras variables (``load_weights``, ``save_weights``).

This package's ``__init__`` imports nothing, so ``keras_cct.caffe.net.layout`` alone loads only
what it needs.
"""
