"""Training Caffe nets (imports :mod:`keras_cct.caffe.net` and :mod:`keras_cct.caffe.io`).

* :mod:`.optimizer` -- Caffe's learning-rate policies and update rules (``CaffeOptimizer``).
* :mod:`.config` -- a ``solver.prototxt`` read and checked (``SolverConfig``, ``read_solver``).
* :mod:`.data` -- Caffe's data layers as batch sources (LMDB, images, HDF5, arrays).
* :mod:`.prefetch` -- background reader threads (``prefetch``, ``stop_prefetchers``).
* :mod:`.model` -- a net with its loss heads as a Keras model (``CaffeTrainModel``,
  ``run_test``, ``build_phase_net``).
* :mod:`.solver` -- Caffe's solver (``Solver``, ``load_solver``): step, test, snapshot, restore.

This package's ``__init__`` imports nothing, so ``keras_cct.caffe.train.data`` alone does not
load Keras.
"""
