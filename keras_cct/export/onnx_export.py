"""``export_onnx``: a Keras model (with HybridConv2D layers) to an ONNX file, via tf2onnx.

Pipeline: rewrite each HybridConv2D into one plain convolution (:mod:`keras_cct.export.rewrite`),
trace the model in a ``tf.function`` whose batch dimension is dynamic, convert it with
``tf2onnx.convert.from_function`` (``tf2onnx.convert.from_keras`` fails on Keras 3 models,
tf2onnx#2448), rename the graph's inputs and outputs to the Keras model's names, check the result
with ``onnx.checker`` and onnxruntime, and only then write the file (temporary file + rename).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import keras

from keras_cct._files import atomic_write
from keras_cct.errors import ExportError
from keras_cct.export.rewrite import export_error as _export_error
from keras_cct.lowering.pooling import backend_op

#: ONNX protobufs above this size cannot be serialized in one message.
_PROTOBUF_LIMIT = 2 ** 31 - 1


def _require_tensorflow() -> None:
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise _export_error(
            f"ONNX export needs the TensorFlow backend (it converts a TensorFlow graph with "
            f"tf2onnx), but Keras runs on '{backend}' in this process: save the model "
            f"(model.save('model.keras')) and export it from a TensorFlow process, e.g. "
            f"`KERAS_BACKEND=tensorflow cct export model.keras -o model.onnx`")
    try:
        import onnx  # noqa: F401
        import tensorflow  # noqa: F401
        import tf2onnx  # noqa: F401
    except ImportError as exc:
        raise _export_error(f"ONNX export needs tensorflow, tf2onnx and onnx ({exc}): "
                            f"pip install 'keras_cct[onnx]'") from exc


def _flat(structure) -> list:
    return list(keras.tree.flatten(structure))


def _unique(names: Sequence[str]) -> List[str]:
    out: List[str] = []
    for name in names:
        cand, i = name, 1
        while cand in out:
            cand, i = f"{name}_{i}", i + 1
        out.append(cand)
    return out


def _input_structure(model):
    """The structure the model is called with (a tensor, a list or a dict of KerasTensors)."""
    try:
        return model.input
    except (AttributeError, ValueError):
        pass
    inputs = list(getattr(model, "inputs", None) or [])
    if not inputs:
        raise _export_error(
            f"model '{model.name}' ({type(model).__name__}) has no known inputs: export needs "
            f"a Functional or Sequential model, or a model built with keras.Input")
    return inputs[0] if len(inputs) == 1 else inputs


def _output_names(model) -> List[str]:
    outputs = list(getattr(model, "outputs", None) or [])
    if not outputs:
        try:
            outputs = _flat(model.output)
        except (AttributeError, ValueError):
            outputs = []
    names = getattr(model, "output_names", None)
    if names is not None and len(names) == len(outputs):
        return list(names)
    found = []
    for i, t in enumerate(outputs):
        history = getattr(t, "_keras_history", None)
        op = getattr(history, "operation", None)
        found.append(op.name if op is not None else f"output_{i}")
    return found


def io_names(model: keras.Model) -> Tuple[List[str], List[str]]:
    """The names the ONNX graph's inputs and outputs get: the Keras model's input names and
    output layer names (for a net imported from Caffe, its blob names)."""
    inputs = [t.name for t in _flat(_input_structure(model))]
    return _unique(inputs), _unique(_output_names(model))


def _input_specs(model: keras.Model, batch_size: Optional[int]):
    import tensorflow as tf

    specs = []
    for i, t in enumerate(_flat(_input_structure(model))):
        shape = list(t.shape)
        shape[0] = batch_size
        specs.append(tf.TensorSpec(shape, tf.as_dtype(t.dtype), name=f"cct_input_{i}"))
    return specs


class _LogCapture(logging.Handler):
    """Collects tf2onnx's error messages (it logs unsupported ops instead of raising)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _convert(fn, specs, opset: Optional[int]):
    """Run tf2onnx on a traced function; returns (model_proto, tf2onnx error messages).

    tf2onnx deep-copies the whole graph (weights included) before each of its ~25 optimizer
    passes so that it can roll a failing pass back; for a CaffeNet-sized model that copying is
    a large part of the conversion time (21 s of 86 s in one profile). The first attempt turns the copies off (tf2onnx's
    ``TF2ONNX_CATCH_ERRORS`` switch); if a pass then fails, the conversion is redone with them.
    """
    import tf2onnx

    logger = logging.getLogger("tf2onnx")
    capture = _LogCapture()
    logger.addHandler(capture)
    old_propagate = logger.propagate
    logger.propagate = False  # keep tf2onnx's own error lines off the user's console
    try:
        key = "TF2ONNX_CATCH_ERRORS"
        if key in os.environ:  # the user's choice
            proto, _ = tf2onnx.convert.from_function(fn, input_signature=specs, opset=opset)
        else:
            os.environ[key] = "FALSE"
            try:
                proto, _ = tf2onnx.convert.from_function(fn, input_signature=specs,
                                                         opset=opset)
            except Exception:
                os.environ.pop(key, None)
                capture.messages.clear()
                proto, _ = tf2onnx.convert.from_function(fn, input_signature=specs,
                                                         opset=opset)
            finally:
                os.environ.pop(key, None)
    finally:
        logger.removeHandler(capture)
        logger.propagate = old_propagate
    return proto, capture.messages


def _problems(proto, run_ort: bool = True) -> List[str]:
    """Why ``proto`` is not a model onnxruntime accepts (empty when it is)."""
    import onnx

    problems = []
    bad = sorted({f"{n.op_type} (node '{n.name}')" for n in proto.graph.node
                  if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)})
    if bad:
        problems.append("ops with no ONNX equivalent: " + ", ".join(bad))
        return problems
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:
        problems.append(f"onnx.checker: {str(exc).strip().splitlines()[0]}")
        return problems
    if run_ort:
        try:
            import onnxruntime as ort
        except ImportError:
            return problems
        try:
            ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception as exc:
            problems.append(f"onnxruntime refuses the model: {str(exc).strip()[:500]}")
    return problems


def _traced(call, specs, structure):
    import tensorflow as tf

    @tf.function(input_signature=specs, autograph=False)
    def fn(*args):
        inputs = keras.tree.pack_sequence_as(structure, list(args))
        return _flat(call(inputs))

    return fn


def _rename_io(proto, inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """Give the graph's inputs/outputs the Keras names; name the dynamic batch dim 'batch'."""
    graph = proto.graph
    initializers = {i.name for i in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in initializers]
    renames: Dict[str, str] = {}
    for vi, name in zip(real_inputs, inputs):
        renames[vi.name] = name
    for vi, name in zip(graph.output, outputs):
        renames[vi.name] = name
    taken = {n for node in graph.node for n in list(node.input) + list(node.output)}
    taken |= initializers
    clash = (taken - set(renames)) & set(renames.values())
    if clash:  # an internal tensor already has that name: move it aside first
        for node in graph.node:
            for seq in (node.input, node.output):
                for k, n in enumerate(seq):
                    if n in clash:
                        seq[k] = f"{n}__internal"
        for vi in graph.value_info:
            if vi.name in clash:
                vi.name = f"{vi.name}__internal"
    for node in graph.node:
        for seq in (node.input, node.output):
            for k, n in enumerate(seq):
                if n in renames:
                    seq[k] = renames[n]
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.name in renames:
            vi.name = renames[vi.name]
    for vi in list(real_inputs) + list(graph.output):
        dims = vi.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_value"):
            dims[0].dim_param = "batch"


def _layer_from_node_names(model, node_names: Sequence[str]) -> Optional[str]:
    """Best guess of the layer a TF node belongs to, from its name scope."""
    names = set()

    def collect(layer):
        for sub in getattr(layer, "layers", None) or []:
            names.add(sub.name)
            collect(sub)

    collect(model)
    for node in node_names:
        parts = node.split("/")
        for part in reversed(parts[:-1] if len(parts) > 1 else parts):
            for cand in (part, re.sub(r"_\d+$", "", part)):
                if cand in names:
                    return cand
    return None


def _probe_layers(model, opset: Optional[int], prefix: str = "") -> Optional[Tuple[str, str]]:
    """Convert each layer of a graph model on its own; the first that fails and why."""
    from keras_cct.export.rewrite import ExportConv2D, needs_rewrite

    for layer in getattr(model, "layers", None) or []:
        if isinstance(layer, keras.layers.InputLayer) or isinstance(layer, ExportConv2D) \
                or needs_rewrite(layer):
            continue
        try:
            structure = layer.input
        except (AttributeError, ValueError):
            continue
        name = f"{prefix}{layer.name}"
        try:
            import tensorflow as tf

            flat = _flat(structure)
            specs = [tf.TensorSpec([None] + list(t.shape)[1:], tf.as_dtype(t.dtype),
                                   name=f"cct_probe_{i}") for i, t in enumerate(flat)]
            fn = _traced(lambda x: layer(x, training=False), specs, structure)
            fn.get_concrete_function()
        except Exception:
            continue  # cannot run this layer alone: not evidence against it
        try:
            proto, messages = _convert(fn, specs, opset)
            problems = _problems(proto)
        except Exception as exc:
            problems, messages = [f"tf2onnx failed: {type(exc).__name__}: {exc}"], []
        if problems:
            if isinstance(layer, keras.Model):
                inner = _probe_layers(layer, opset, prefix=name + "/")
                if inner is not None:
                    return inner
            return name, "; ".join(problems + [m for m in messages if m not in problems][:3])
    return None


def _diagnose(model, proto, problems: List[str], messages: List[str],
              opset: Optional[int]) -> ExportError:
    found = _probe_layers(model, opset)
    if found is not None:
        name, why = found
        layer = _find_layer(model, name)
        kind = type(layer).__name__ if layer is not None else "layer"
        return _export_error(
            f"layer '{name}' ({kind}) cannot be exported to ONNX: {why}. Replace it with "
            f"standard Keras layers or ops that tf2onnx supports, or remove it from the "
            f"deployed model", layer=name)
    nodes = [m for m in messages]
    bad_nodes = []
    if proto is not None:
        import onnx

        bad_nodes = [n.name for n in proto.graph.node
                     if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)]
    guess = _layer_from_node_names(model, bad_nodes)
    where = f"layer '{guess}'" if guess else f"model '{model.name}'"
    detail = "; ".join(problems + nodes[:5])
    return _export_error(f"{where} cannot be exported to ONNX: {detail}", layer=guess)


def _find_layer(model, path: str):
    layer = model
    for part in path.split("/"):
        try:
            layer = layer.get_layer(part)
        except (ValueError, AttributeError):
            return None
    return layer


def to_onnx_proto(model: keras.Model, *, opset: Optional[int] = None,
                  batch_size: Optional[int] = None):
    """The checked ``onnx.ModelProto`` of ``model`` (what :func:`export_onnx` writes).

    See :func:`export_onnx` for the arguments and errors.
    """
    _require_tensorflow()
    from keras_cct.export.rewrite import rewrite_for_export

    if not isinstance(model, keras.Model):
        raise _export_error(f"expected a keras.Model, got {type(model).__name__}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise _export_error(f"batch_size must be None (dynamic) or a positive int, got "
                            f"{batch_size!r}")
    export_model = rewrite_for_export(model)
    structure = _input_structure(model)
    in_names, out_names = io_names(model)
    specs = _input_specs(model, batch_size)
    fn = _traced(lambda x: export_model(x, training=False), specs, structure)
    proto = None
    messages: List[str] = []
    with backend_op():  # Caffe's MAX pooling as TensorFlow's MaxPool, not an XLA cluster
        try:
            proto, messages = _convert(fn, specs, opset)
            problems = _problems(proto)
        except ExportError:
            raise
        except Exception as exc:
            problems = [f"tf2onnx failed: {type(exc).__name__}: {str(exc)[:500]}"]
        if problems:
            raise _diagnose(export_model, proto, problems, messages, opset)
    if len(out_names) != len(proto.graph.output):
        out_names = [f"output_{i}" for i in range(len(proto.graph.output))]
    _rename_io(proto, in_names, out_names)
    proto.graph.name = model.name
    from keras_cct._version import __version__

    meta = proto.metadata_props.add()
    meta.key, meta.value = "keras_cct_version", __version__
    problems = _problems(proto, run_ort=False)
    if problems:  # pragma: no cover - renaming keeps a valid graph valid
        raise _export_error(f"model '{model.name}': renaming inputs/outputs broke the graph: "
                            + "; ".join(problems))
    return proto


def export_onnx(model: keras.Model, path: Union[str, os.PathLike], *,
                opset: Optional[int] = None, batch_size: Optional[int] = None) -> Path:
    """Export a Keras model to an ONNX file in which each HybridConv2D is one ONNX ``Conv``.

    The model must be Functional or Sequential (or any graph model with known inputs) and
    Keras must run on the TensorFlow backend. Convolutions are rewritten to a plain
    convolution with the same weights (grouped, dilated and asymmetrically padded where the
    layer is), the model is converted with ``tf2onnx.convert.from_function``, and the result
    must pass ``onnx.checker`` and load in onnxruntime before anything is written.

    Args:
        model: the model to export.
        path: the ``.onnx`` file to write. Written atomically: on any failure no file (and no
            partial file) is left there, and an existing file is kept unchanged.
        opset: the ONNX opset (``None``: tf2onnx's default, 15 for tf2onnx 1.17).
        batch_size: ``None`` keeps the batch dimension dynamic (named ``batch``); an int fixes it.

    Returns:
        The path written.

    Raises:
        ExportError: the backend is not TensorFlow, or a layer cannot be exported (the message
            and the error's ``layer`` attribute name it), or the model is subclassed with a
            HybridConv2D inside, or the file is over protobuf's 2 GiB limit.
    """
    path = Path(path)
    proto = to_onnx_proto(model, opset=opset, batch_size=batch_size)
    size = proto.ByteSize()
    if size > _PROTOBUF_LIMIT:
        raise _export_error(f"model '{model.name}' is {size / 2**30:.1f} GiB, over ONNX's "
                            f"2 GiB protobuf limit; export a smaller model")
    atomic_write(path, proto.SerializeToString())
    return path
