"""The few primitives whose best form differs per Keras backend, one module per backend, chosen
once when :mod:`keras_cct.lowering` is imported (as ``keras/src/backend`` chooses its own):
:mod:`.tensorflow`, :mod:`.jax`, :mod:`.torch`, and :mod:`.generic` (``keras.ops`` only, for any
other backend; the others start from it).

Every module offers the same names:

* tensors: ``as_tensor``, ``constant``, ``index_tensor``;
* products without materialized transposes (``keras.ops.matmul`` has no transpose flags; on
  TensorFlow ``ops.transpose`` of a lowered matrix copies it, where
  ``tf.linalg.matmul(transpose_a=True)`` reads it in place): ``matmul``, ``matmul_tn``,
  ``matmul_nt``, ``bmm``;
* ``add_n``, ``take_rows``, ``split_batch``, ``segment_sum``;
* ``map_batch``: a function over a batch a partition at a time, its results concatenated or
  summed (TensorFlow: a loop in the graph where the batch size is not static);
* ``fused``: a function of tensors in the form the backend runs as one piece (TensorFlow: one
  XLA cluster; 16-bit floats computed in float32 on TensorFlow and JAX), for Winograd's
  transforms;
* ``native_conv``: the backend's own convolution in its fastest form
  (:mod:`keras_cct.lowering.native`);
* ``conv_step``: one compiled forward(+backward) step, for the planner's timing
  (:mod:`keras_cct.lowering.timing`);
* ``layer_steps`` and ``wait``: any Keras layer's forward and forward+backward steps, and
  waiting for their results without computing more (:mod:`keras_cct.lowering.timing`);
* ``device_name``: the accelerator Keras computes on, or None for the CPU;
* ``sgd_step``: Caffe's SGD update in place where the backend has a fused form
  (:class:`~keras_cct.caffe.train.optimizer.CaffeOptimizer`);
* ``NAME``: the backend's name.

:mod:`.common` holds what every backend shares (``custom_conv``, ``batch_bounds``, the split
form of grouped convolutions).
"""

import keras

from keras_cct.lowering._backend.common import (MAX_SPLIT_GROUPS,  # noqa: F401
                                                batch_bounds, split_groups)

_NAME = keras.backend.backend()
if _NAME == "tensorflow":
    from keras_cct.lowering._backend.tensorflow import *  # noqa: F401,F403
elif _NAME == "jax":
    from keras_cct.lowering._backend.jax import *  # noqa: F401,F403
elif _NAME == "torch":
    from keras_cct.lowering._backend.torch import *  # noqa: F401,F403
else:
    from keras_cct.lowering._backend.generic import *  # noqa: F401,F403
