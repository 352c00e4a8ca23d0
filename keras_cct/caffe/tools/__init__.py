"""Caffe's other tools on keras_cct, as ``cct`` sub-commands (registered by :mod:`.commands`).

* :mod:`.mean` -- ``compute_image_mean``: the mean image of an LMDB or an image list.
* :mod:`.features` -- ``extract_features``: blobs of a net over its data, to an LMDB or .npz.
* :mod:`.upgrade` -- ``upgrade_net_proto_text/_binary``, ``upgrade_solver_proto_text``.
* :mod:`.draw` -- ``python/draw_net.py``: the net as a picture (pydot, else matplotlib).
* :mod:`.logs` -- ``tools/extra/parse_log.py`` and ``plot_training_log.py``.
* :mod:`.signals` -- ``caffe train``'s ``-sigint_effect`` / ``-sighup_effect``.
"""
