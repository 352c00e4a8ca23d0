"""keras_cct.caffe.io needs protobuf and numpy only: in a process where importing Keras,
TensorFlow, JAX or PyTorch fails, it imports and reads Caffe's files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from keras_cct.caffe.io import array_to_blob, proto

ROOT = Path(__file__).resolve().parents[2]

V1_NET = """
name: "tiny"
input: "data"
input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 4
layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv"
         convolution_param { num_output: 2 kernel_size: 3 } }
layers { name: "drop" type: DROPOUT bottom: "conv" top: "conv" include { phase: TRAIN } }
layers { name: "prob" type: SOFTMAX bottom: "conv" top: "prob" }
"""

CHILD = r"""
import json, sys

BLOCKED = ("keras", "tensorflow", "tf_keras", "jax", "jaxlib", "torch")


class Block:
    # a meta path finder that refuses the deep-learning libraries
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None


sys.meta_path.insert(0, Block())

import keras_cct.caffe.io as io
from keras_cct.caffe.io import lmdb_io, types, validate  # noqa: F401  (they import too)
import keras_cct.caffe  # the package's lazy names stay lazy

net, source = io.read_net(sys.argv[1], with_source=True)
test_net = io.filter_net(net, phase="TEST")
weights = io.read_caffemodel(sys.argv[2])
kernel = io.blob_to_array(weights.layer[0].blobs[0])
mean = io.blob_to_array(io.read_binaryproto(sys.argv[3]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({
    "types": [lp.type for lp in net.layer],
    "test_types": [lp.type for lp in test_net.layer],
    "lines": source.layer_lines,
    "input_shape": list(net.layer[0].input_param.shape[0].dim),
    "kernel_shape": list(kernel.shape),
    "kernel_sum": float(kernel.sum()),
    "mean_shape": list(mean.shape),
    "loaded": loaded,
}))
"""


def test_io_reads_caffe_files_without_keras(tmp_path):
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(V1_NET)
    kernel = np.arange(2 * 3 * 3 * 3, dtype=np.float32).reshape(2, 3, 3, 3)
    weights = proto.NetParameter(name="tiny")
    layer = weights.layer.add(name="conv", type="Convolution")
    array_to_blob(kernel, blob=layer.blobs.add())
    array_to_blob(np.zeros(2, np.float32), blob=layer.blobs.add())
    (tmp_path / "w.caffemodel").write_bytes(weights.SerializeToString())
    mean = array_to_blob(np.ones((1, 3, 4, 4), np.float32), legacy_shape=True)
    (tmp_path / "mean.binaryproto").write_bytes(mean.SerializeToString())

    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(prototxt),
         str(tmp_path / "w.caffemodel"), str(tmp_path / "mean.binaryproto")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == []
    assert got["types"] == ["Input", "Convolution", "Dropout", "Softmax"]  # V1 upgraded
    assert got["test_types"] == ["Input", "Convolution", "Softmax"]  # phase rule applied
    assert got["lines"] == [3, 5, 7, 8]
    assert got["input_shape"] == [2, 3, 4, 4]
    assert got["kernel_shape"] == [2, 3, 3, 3]
    assert got["kernel_sum"] == float(kernel.sum())
    assert got["mean_shape"] == [1, 3, 4, 4]


def test_blocking_keras_is_effective(tmp_path):
    """The same guard makes a Keras import fail (so the test above would notice one)."""
    child = CHILD.split("import keras_cct.caffe.io as io")[0] + "import keras_cct.caffe.net.layout\n"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(child)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "keras is blocked in this test" in out.stderr
