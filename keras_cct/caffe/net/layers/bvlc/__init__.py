"""Keras layers for the rest of BVLC Caffe's layer types, with Caffe's exact semantics.

* :mod:`.reduce` -- :class:`CaffeArgMax`, :class:`CaffeReduction`, :class:`CaffeMVN`.
* :mod:`.select` -- :class:`CaffeTile`, :class:`CaffeBatchReindex`, :class:`CaffeFilter`.
* :mod:`.spatial` -- :class:`CaffeIm2col`, :class:`CaffeSPP`.
* :mod:`.embed` -- :class:`CaffeEmbed`, :class:`CaffeParameter` (learned blobs, ``caffe_type``).
* :mod:`.hdf5_output` -- :class:`CaffeHDF5Output`, :func:`write_hdf5_output`.

Importing this package registers its layers for ``keras.saving.load_model``."""

from keras_cct.caffe.net.layers.bvlc.reduce import CaffeArgMax, CaffeMVN, CaffeReduction
from keras_cct.caffe.net.layers.bvlc.select import CaffeBatchReindex, CaffeFilter, CaffeTile
from keras_cct.caffe.net.layers.bvlc.spatial import CaffeIm2col, CaffeSPP, spp_geometry
from keras_cct.caffe.net.layers.bvlc.embed import CaffeEmbed, CaffeParameter
from keras_cct.caffe.net.layers.bvlc.hdf5_output import CaffeHDF5Output, write_hdf5_output

__all__ = ["CaffeArgMax", "CaffeMVN", "CaffeReduction", "CaffeBatchReindex", "CaffeFilter",
           "CaffeTile", "CaffeIm2col", "CaffeSPP", "CaffeEmbed", "CaffeParameter",
           "CaffeHDF5Output", "write_hdf5_output", "spp_geometry"]
