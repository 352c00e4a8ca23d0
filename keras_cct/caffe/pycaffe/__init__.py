"""pycaffe's API over keras_cct (``import keras_cct.caffe as caffe``): :class:`Net`, the
solvers (:func:`get_solver`, :class:`SGDSolver`, ...), :class:`Classifier`, :class:`Detector`,
``TRAIN`` / ``TEST`` and the mode functions. ``caffe.io`` is :mod:`keras_cct.caffe.io` (its
:class:`~keras_cct.caffe.io.transformer.Transformer` and image helpers need no Keras).

* :mod:`.net` -- :class:`Net` (blobs, params, forward/backward, save, copy_from).
* :mod:`.steps` -- a built net as runnable Caffe layers.
* :mod:`.blob` -- :class:`Blob`, the learnable blobs and the phase constants.
* :mod:`.grad` -- gradients on the current Keras backend (for ``backward``), dropout's state.
* :mod:`.batching` -- ``forward_all``'s batches; :mod:`.data` -- the data layers' sources.
* :mod:`.solver` -- the solvers over :class:`keras_cct.caffe.train.solver.Solver`.
* :mod:`.classifier` -- :class:`Classifier` (10-crop oversampling).
* :mod:`.detector` -- :class:`Detector` (windows with context padding).
* :mod:`.mode` -- ``set_mode_cpu`` / ``set_mode_gpu`` / ``set_device``.
"""
