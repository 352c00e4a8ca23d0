"""Caffe's ``Python`` layers, opt in: a pycaffe layer class run inside a Keras model.

* :class:`Layer` -- pycaffe's ``caffe.Layer`` base class (``setup``, ``reshape``, ``forward``,
  ``backward``; ``param_str``, ``phase``, ``blobs``), also exported as ``keras_cct.caffe.Layer``;
  :class:`Blob` -- the ``bottom``/``top`` blobs it sees (``data``, ``diff``, ``reshape``,
  ``shape``, ``num``/``channels``/``height``/``width``, ``count``), numpy in Caffe's NCHW order.
* :func:`python_layer_class` -- imports ``python_param.module`` (from the prototxt's folder, then
  ``sys.path``, as pycaffe; a module doing ``import caffe`` gets a small stand-in holding
  :class:`Layer` when no real pycaffe is installed) and returns its ``layer`` class.
* :class:`CaffePythonLayer` -- the Keras layer: the forward pass calls the object's ``reshape``
  and ``forward`` through a host callback of the backend (``tf.numpy_function`` in a
  ``tf.custom_gradient``, ``jax.pure_callback`` in a ``jax.custom_vjp``, a
  ``torch.autograd.Function``), the gradient calls its ``backward`` (after a ``forward`` on the
  same inputs, so the object's state is the one its ``backward`` expects). The object's
  ``blobs`` (made in ``setup``) are the layer's variables, trained like any other.

Nothing is imported unless asked: the importer builds these layers only with
``python_layers=True``, and ``keras.saving.load_model`` rebuilds them only inside
:func:`allow_python_layers`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import threading
import types
from typing import Iterator, List, Optional, Sequence, Tuple

import keras
import numpy as np
from keras import ops

from keras_cct.caffe.io import proto
from keras_cct.caffe.net.layout import caffe_shape, from_caffe_layout, keras_shape, to_caffe_layout
from keras_cct.errors import CaffeFormatError

_PKG = "keras_cct"
TRAIN, TEST = proto.TRAIN, proto.TEST  # pycaffe's caffe.TRAIN / caffe.TEST

__all__ = ["Layer", "Blob", "CaffePythonLayer", "python_layer_class", "allow_python_layers"]


class Blob:
    """pycaffe's blob as a Python layer sees it: float32 ``data`` and ``diff`` in Caffe's order."""

    def __init__(self, shape: Sequence[int] = (), data: Optional[np.ndarray] = None) -> None:
        self.data = (np.zeros(tuple(int(d) for d in shape), np.float32) if data is None
                     else np.array(data, np.float32))
        self.diff = np.zeros_like(self.data)

    def reshape(self, *shape) -> None:
        """Caffe's ``Blob::Reshape``: new (zeroed) data and diff when the shape changes."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        if shape != self.data.shape:
            self.data = np.zeros(shape, np.float32)
            self.diff = np.zeros(shape, np.float32)

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def count(self) -> int:
        return int(self.data.size)

    def _axis(self, i: int) -> int:
        return int(self.data.shape[i]) if self.data.ndim > i else 1

    num = property(lambda self: self._axis(0))
    channels = property(lambda self: self._axis(1))
    height = property(lambda self: self._axis(2))
    width = property(lambda self: self._axis(3))


class BlobVec(list):
    """A layer's learnable blobs (pycaffe's ``layer.blobs``), with ``add_blob(*shape)``."""

    def add_blob(self, *shape) -> None:
        self.append(Blob(shape))


class Layer:
    """pycaffe's ``caffe.Layer``: subclass it and define ``setup(bottom, top)``,
    ``reshape(bottom, top)`` (reshape the tops), ``forward(bottom, top)`` and
    ``backward(top, propagate_down, bottom)``. ``bottom``/``top`` are lists of :class:`Blob`
    (NCHW numpy arrays); ``self.param_str`` is ``python_param.param_str``, ``self.phase`` 0
    (TRAIN) or 1 (TEST), ``self.blobs`` the learnable blobs (``self.blobs.add_blob(*shape)``)."""

    def __init__(self, layer_param=None) -> None:
        self.layer_param = layer_param
        self.param_str = ""
        self.phase = TEST
        self.blobs = BlobVec()

    def setup(self, bottom: List[Blob], top: List[Blob]) -> None:
        """Called once, with the bottoms' shapes known."""

    def reshape(self, bottom: List[Blob], top: List[Blob]) -> None:
        """Shape the tops (``top[i].reshape(*shape)``) before each forward pass."""

    def forward(self, bottom: List[Blob], top: List[Blob]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def backward(self, top: List[Blob], propagate_down: List[bool],
                 bottom: List[Blob]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no backward(): it cannot be "
                                  "trained through")


# --------------------------------------------------------------------------------------------
# import


_ALLOW = threading.local()


@contextlib.contextmanager
def allow_python_layers() -> Iterator[None]:
    """Within this block ``keras.saving.load_model`` may rebuild :class:`CaffePythonLayer` s
    (which import the modules their configs name)."""
    depth = getattr(_ALLOW, "depth", 0)
    _ALLOW.depth = depth + 1
    try:
        yield
    finally:
        _ALLOW.depth = depth


def _caffe_stand_in() -> types.ModuleType:
    mod = types.ModuleType("caffe", "keras_cct's stand-in for pycaffe's Python-layer API")
    mod.Layer, mod.TRAIN, mod.TEST = Layer, TRAIN, TEST
    return mod


def python_layer_class(module: str, layer: str, search_path: Optional[str] = None):
    """Imports ``module`` (``search_path`` first, then ``sys.path``) and returns its ``layer``.

    Raises:
        ImportError: the module cannot be imported. AttributeError: it has no ``layer``.
    """
    stand_in = "caffe" not in sys.modules and importlib.util.find_spec("caffe") is None
    added = bool(search_path) and search_path not in sys.path
    if added:
        sys.path.insert(0, search_path)
    if stand_in:
        sys.modules["caffe"] = _caffe_stand_in()
    try:
        mod = importlib.import_module(module)
    finally:
        if stand_in:
            sys.modules.pop("caffe", None)
        if added:
            sys.path.remove(search_path)
    cls = getattr(mod, layer, None)
    if cls is None:
        raise AttributeError(f"module '{module}' ({getattr(mod, '__file__', '?')}) has no "
                             f"'{layer}'")
    return cls


# --------------------------------------------------------------------------------------------
# the Keras layer


@keras.saving.register_keras_serializable(package=_PKG)
class CaffePythonLayer(keras.layers.Layer):
    """A pycaffe layer (``python_param``) inside a Keras model (see the module's doc).

    Args:
        module, layer: ``python_param.module`` and ``.layer``.
        param_str: ``python_param.param_str``, given to the object as ``self.param_str``.
        phase: 0 (TRAIN) or 1 (TEST), the object's ``self.phase``.
        search_path: a folder searched first for ``module`` (the prototxt's).
        num_tops: the number of tops.
        batch_hint: the batch size used to find the tops' shapes at build time.
    """

    caffe_type = "Python"

    def __init__(self, module: str, layer: str, param_str: str = "", phase: int = TEST,
                 search_path: Optional[str] = None, num_tops: int = 1,
                 batch_hint: Optional[int] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if int(num_tops) < 1:
            raise ValueError(f"num_tops must be >= 1, got {num_tops}")
        self.module, self.layer, self.param_str = str(module), str(layer), str(param_str)
        self.phase, self.search_path = int(phase), search_path
        self.num_tops, self.batch_hint = int(num_tops), batch_hint
        self.supports_jit = False  # a host callback: no XLA compilation
        self._host_lock = threading.RLock()
        cls = python_layer_class(self.module, self.layer, search_path)
        lp = proto.LayerParameter(name=self.name, type="Python")
        lp.python_param.module, lp.python_param.layer = self.module, self.layer
        lp.python_param.param_str = self.param_str
        self.impl = cls(lp)
        self.impl.param_str, self.impl.phase = self.param_str, self.phase
        if not isinstance(getattr(self.impl, "blobs", None), list):
            self.impl.blobs = BlobVec()
        self._set_up = False

    @classmethod
    def from_config(cls, config):
        if not getattr(_ALLOW, "depth", 0):
            raise CaffeFormatError(
                f"this model has a Caffe Python layer that imports and runs "
                f"{config.get('module')}.{config.get('layer')}",
                layer=config.get("name"), hint="load it inside `with keras_cct.caffe.net."
                "layers.recurrent.python_layer.allow_python_layers():` if you trust it")
        return cls(**config)

    # -- shapes --------------------------------------------------------------------------
    def _caffe_shapes(self, input_shape, batch: int) -> List[Tuple[int, ...]]:
        out = []
        for s in input_shape:
            s = tuple(batch if (i == 0 and d is None) else d for i, d in enumerate(s))
            if any(d is None for d in s):
                raise ValueError(f"Python layer bottoms need known shapes, got {s}")
            out.append(caffe_shape(s))
        return out

    def _top_shapes(self, bottom_shapes) -> List[Tuple[int, ...]]:
        """The tops' Caffe shapes for these bottom shapes (the object's ``reshape`` on zeros)."""
        with self._host_lock:
            bottom = [Blob(s) for s in bottom_shapes]
            top = [Blob() for _ in range(self.num_tops)]
            if not self._set_up:
                self.impl.setup(bottom, top)
                self._set_up = True
            self.impl.reshape(bottom, top)
            return [t.shape for t in top]

    def build(self, input_shape):
        input_shape = self._listed(input_shape)
        self._top_shapes(self._caffe_shapes(input_shape, self.batch_hint or 1))
        self._params = []
        for i, blob in enumerate(self.impl.blobs):
            value = np.array(blob.data, np.float32)
            self._params.append(self.add_weight(
                name=f"blob{i}", shape=value.shape,
                initializer=lambda shape, dtype=None, v=value: ops.convert_to_tensor(v, dtype)))

    @staticmethod
    def _listed(shapes):
        if shapes and not isinstance(shapes[0], (list, tuple)):
            return [tuple(shapes)]
        return [tuple(s) for s in shapes]

    def compute_output_shape(self, input_shape):
        input_shape = self._listed(input_shape)
        b = self.batch_hint or 1
        first = self._top_shapes(self._caffe_shapes(input_shape, b))
        second = self._top_shapes(self._caffe_shapes(input_shape, b + 1))
        batched = any(s[0] is None for s in input_shape)
        out = []
        for s1, s2 in zip(first, second):
            cs = tuple(None if (batched and d1 != d2) else d1 for d1, d2 in zip(s1, s2))
            out.append(keras_shape(cs))
        return out[0] if self.num_tops == 1 else out

    # -- the host side (numpy, Caffe order) ------------------------------------------------
    def _run(self, arrays, n_bottom: int, dys=None):
        bottoms, params = arrays[:n_bottom], arrays[n_bottom:]
        with self._host_lock:
            for blob, value in zip(self.impl.blobs, params):
                blob.data = np.array(value, np.float32)
                blob.diff = np.zeros_like(blob.data)
            bottom = [Blob(data=a) for a in bottoms]
            top = [Blob() for _ in range(self.num_tops)]
            if not self._set_up:
                self.impl.setup(bottom, top)
                self._set_up = True
            self.impl.reshape(bottom, top)
            self.impl.forward(bottom, top)
            if dys is None:
                return tuple(np.array(t.data, np.float32) for t in top)
            for t, dy in zip(top, dys):
                t.diff = np.array(dy, np.float32).reshape(t.shape)
            self.impl.backward(top, [True] * n_bottom, bottom)
            return tuple([np.array(b.diff, np.float32).reshape(b.shape) for b in bottom]
                         + [np.array(p.diff, np.float32) for p in self.impl.blobs])

    def _forward_np(self, n_bottom: int):
        return lambda *arrays: self._run(arrays, n_bottom)

    def _backward_np(self, n_bottom: int, n_args: int):
        return lambda *arrays: self._run(arrays[:n_args], n_bottom, arrays[n_args:])

    # -- the Keras side --------------------------------------------------------------------
    def call(self, inputs):
        xs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        args = [to_caffe_layout(ops.cast(x, "float32")) for x in xs]
        args += [ops.cast(p, "float32") for p in self._params]
        from keras_cct.caffe.net.layers.recurrent import _host
        outs = _host.call(self, args, len(xs))
        outs = [ops.cast(from_caffe_layout(o), self.compute_dtype) for o in outs]
        return outs[0] if self.num_tops == 1 else outs

    def static_top_shapes(self, bottoms) -> List[Tuple[Optional[int], ...]]:
        """The tops' Caffe shapes for these (Caffe-order) bottoms: None where unknown."""
        shapes = [tuple(b.shape) for b in bottoms]
        if all(d is not None for s in shapes for d in s):
            return self._top_shapes(shapes)
        keras_in = [keras_shape(s) for s in shapes]
        out = self.compute_output_shape(keras_in)
        out = [out] if self.num_tops == 1 else out
        return [caffe_shape(s) for s in out]

    def get_config(self):
        cfg = super().get_config()
        cfg.update(module=self.module, layer=self.layer, param_str=self.param_str,
                   phase=self.phase, search_path=self.search_path, num_tops=self.num_tops,
                   batch_hint=self.batch_hint)
        return cfg
