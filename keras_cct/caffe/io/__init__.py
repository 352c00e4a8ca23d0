"""Caffe's files, with protobuf and numpy only (no Keras, no TensorFlow: importing this package
never imports them, so tools that only read or convert Caffe files stay light).

* :mod:`.proto` -- Caffe's protobuf message classes (built from the schema in :mod:`._schema`).
* :mod:`.text` -- .prototxt / solver text files (:func:`read_net`, :func:`parse_net`).
* :mod:`.binary` -- .caffemodel, .binaryproto and .solverstate files; blobs <-> numpy.
* :mod:`.upgrade` -- V0/V1 nets and ``input:`` fields to the current format (:class:`NetSource`).
* :mod:`.filter` -- Caffe's include/exclude phase, level and stage rules (:func:`filter_net`).
* :mod:`.lmdb_io` -- LMDB databases of ``Datum`` records, image lists (``convert_imageset``).
* :mod:`.validate` -- bounded reads, UTF-8 strings, solver ranges (before anything is allocated).
* :mod:`.types` -- lists of Caffe layer types (``DATA_TYPES``).
* :mod:`.transformer` -- pycaffe's ``caffe.io`` helpers: :class:`Transformer`,
  :func:`load_image` (Pillow), :func:`resize_image`, :func:`oversample`, blob and datum
  conversions in pycaffe's ``(C, H, W)`` order.
"""

from keras_cct.caffe.io import proto
from keras_cct.caffe.io.binary import (array_to_blob, blob_to_array, parse_caffemodel,
                                       read_binaryproto, read_caffemodel, read_solverstate,
                                       write_binaryproto, write_solverstate)
from keras_cct.caffe.io.filter import filter_net
from keras_cct.caffe.io.text import parse_net, read_net
from keras_cct.caffe.io.transformer import (Transformer, array_to_blobproto, array_to_datum,
                                            blobproto_to_array, datum_to_array, load_image,
                                            oversample, resize_image)
from keras_cct.caffe.io.upgrade import NetSource, upgrade_net

__all__ = ["proto", "read_net", "parse_net", "read_caffemodel", "parse_caffemodel",
           "read_binaryproto", "write_binaryproto", "read_solverstate", "write_solverstate",
           "blob_to_array", "array_to_blob", "filter_net", "upgrade_net", "NetSource",
           "Transformer", "load_image", "resize_image", "oversample", "blobproto_to_array",
           "array_to_blobproto", "datum_to_array", "array_to_datum"]
