"""The timing harness for any Keras layer (``cct time``'s per-layer timers, the benchmarks):
its forward+backward step computes the real gradients for the output's cotangent."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_cct.lowering.timing import block, layer_steps

ROOT = Path(__file__).resolve().parents[2]


def _arrays(result) -> list:
    return [keras.ops.convert_to_numpy(t) for t in keras.tree.flatten(result) if t is not None]


def _holds(arrays: list, expected: np.ndarray) -> bool:
    return any(a.shape == expected.shape and np.allclose(a, expected, rtol=1e-4, atol=1e-5)
               for a in arrays)


def test_forward_backward_returns_the_gradients_for_the_cotangent():
    """A Dense layer ``y = x K + b``: for the harness' cotangent ``dy`` (its documented seed),
    ``dx = dy K^T``, ``dK = x^T dy``, ``db = sum(dy)``, written out in float64."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5)).astype("float32")
    layer = keras.layers.Dense(3)
    layer.build((4, 5))
    kernel = rng.standard_normal((5, 3)).astype("float32")
    bias = rng.standard_normal(3).astype("float32")
    layer.set_weights([kernel, bias])
    xt = keras.ops.convert_to_tensor(x)
    forward, forward_backward = layer_steps(layer, [xt])
    dy = np.random.default_rng(0).standard_normal((4, 3)).astype("float32")

    y = forward(xt)
    block(y)
    k64, x64, dy64 = kernel.astype("f8"), x.astype("f8"), dy.astype("f8")
    assert np.allclose(keras.ops.convert_to_numpy(y), x64 @ k64 + bias, rtol=1e-5, atol=1e-5)

    result = forward_backward(xt)
    block(result)
    got = _arrays(result)
    assert _holds(got, dy64 @ k64.T), "input gradient"
    assert _holds(got, x64.T @ dy64), "kernel gradient"
    assert _holds(got, dy64.sum(axis=0)), "bias gradient"


def test_block_waits_for_nested_results_and_skips_none():
    t = keras.ops.ones((3, 2))
    block([t, (None, [t * 2])])
    block(None)


def test_steps_run_the_code_as_written_not_rewritten_by_autograph():
    """TensorFlow's AutoGraph rewrites the source of every function a ``tf.function`` reaches
    (1.7 s for a Winograd step's first call); the harness traces as Keras' own train step
    does, without it. The lowering below records the file its code runs from: AutoGraph runs a
    rewritten copy from a generated file. On JAX and PyTorch nothing is rewritten."""
    import sys

    from keras_cct.lowering.geometry import conv_geometry
    from keras_cct.lowering.timing import make_step

    files = []

    def conv(x, kernel, geo):
        files.append(sys._getframe().f_code.co_filename)
        return keras.ops.conv(x, kernel, padding="valid")

    geo = conv_geometry((2, 6, 6, 3), (3, 3, 3, 4))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 6, 3)).astype("float32")
    k = rng.standard_normal((3, 3, 3, 4)).astype("float32")
    make_step(geo, conv, x, k)()
    assert files and set(files) == {__file__}


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="TensorFlow's frequent-retracing warning")
def test_a_race_over_many_shapes_does_not_warn_of_retracing(tmp_path):
    """TensorFlow warns that a function "triggered tf.function retracing" when functions made
    from one source are traced in most of its last calls -- every step of the planner's races,
    each traced once by design; a first ``fit`` of a model with several convolution shapes
    printed it. TensorFlow warns at most twice per source and process: a fresh process."""
    script = textwrap.dedent("""
        from keras_cct.lowering.geometry import conv_geometry
        from keras_cct.lowering.planner import time_lowerings
        for c in range(4, 10):
            time_lowerings(conv_geometry((2, 6, 6, c), (3, 3, c, 4)), ("native", "type1"),
                           batch=2, repeats=1)
        print("raced")
    """)
    env = dict(os.environ, KERAS_BACKEND="tensorflow", KERAS_CCT_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "raced" in proc.stdout, proc.stderr[-3000:]
    assert "triggered tf.function retracing" not in proc.stderr
