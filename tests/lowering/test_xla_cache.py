"""TensorFlow's persistent XLA cache, turned on by keras_cct's TensorFlow backend module
(``keras_cct.lowering._backend.tensorflow.persistent_xla_cache``): Winograd's XLA clusters
written to disk in one process and loaded in the next compute the same convolution and
gradients as a float64 numpy reference; ``$KERAS_CCT_XLA_CACHE=0`` and a user's own cache
folder leave it off. Each case runs fresh processes (TensorFlow reads the flag once)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from tests import reference as ref

if keras.backend.backend() != "tensorflow":
    pytest.skip("the TensorFlow backend's cache (its own processes): run with the TF suite",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

#: One process: Winograd F(2x2) and F(4x4) forward and gradients on TensorFlow, the results and
#: TF_XLA_FLAGS as keras_cct left them printed as JSON.
SCRIPT = """
import json, os, sys
import numpy as np
import tensorflow as tf
from keras_cct.lowering.geometry import conv_geometry
from keras_cct.lowering.winograd import winograd_conv2d
x, k, dy = (np.load(sys.argv[1])[n] for n in ("x", "k", "dy"))
geo = conv_geometry(x.shape, k.shape, padding=1)
out = {"flags": os.environ.get("TF_XLA_FLAGS", "")}
for tile in (2, 4):
    tx, tk = tf.constant(x), tf.constant(k)
    with tf.GradientTape() as tape:
        tape.watch([tx, tk])
        y = winograd_conv2d(tx, tk, geo, tile=tile)
        loss = tf.reduce_sum(y * dy)
    dx, dk = tape.gradient(loss, [tx, tk])
    out[tile] = [y.numpy().tolist(), dx.numpy().tolist(), dk.numpy().tolist()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 9, 10, 6)).astype(np.float32)
    k = rng.standard_normal((3, 3, 6, 5)).astype(np.float32)
    dy = rng.standard_normal((2, 9, 10, 5)).astype(np.float32)
    path = tmp_path_factory.mktemp("xla") / "case.npz"
    np.savez(path, x=x, k=k, dy=dy)
    return path, x, k, dy


def _run(case_path, cache, **env):
    full = {k: v for k, v in os.environ.items()
            if k not in ("TF_XLA_FLAGS", "KERAS_CCT_XLA_CACHE", "KERAS_CCT_XLA_CACHE_SET")}
    full.update(KERAS_BACKEND="tensorflow", KERAS_CCT_CACHE_DIR=str(cache),
                PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", **env)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(case_path)], env=full,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(out, x, k, dy):
    x64, k64, dy64 = (a.astype(np.float64) for a in (x, k, dy))
    want = [ref.conv2d(x64, k64, padding=1), *ref.conv2d_grads(x64, k64, dy64, padding=1)[:2]]
    for tile, tol in (("2", 1e-5), ("4", 1e-4)):
        for got, ref_value in zip(out[tile], want):
            assert ref.rel_err(np.asarray(got), ref_value) < tol


def test_executables_written_once_and_loaded_in_a_later_process(case, tmp_path):
    path, x, k, dy = case
    first = _run(path, tmp_path)
    folders = list((tmp_path / "xla").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("tf-")
    assert f"--tf_xla_persistent_cache_directory={folders[0]}" in first["flags"]
    written = sorted(p.name for p in folders[0].iterdir())
    assert written, "no XLA executable was cached"
    _check(first, x, k, dy)
    second = _run(path, tmp_path)                # the same clusters: loaded, none compiled
    assert sorted(p.name for p in folders[0].iterdir()) == written
    _check(second, x, k, dy)


def test_off_when_asked_or_when_the_user_set_a_folder(case, tmp_path):
    path, x, k, dy = case
    out = _run(path, tmp_path / "a", KERAS_CCT_XLA_CACHE="0")
    assert "persistent_cache" not in out["flags"] and not (tmp_path / "a" / "xla").exists()
    _check(out, x, k, dy)
    mine = tmp_path / "mine"
    out = _run(path, tmp_path / "b",
               TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={mine}")
    assert out["flags"] == f"--tf_xla_persistent_cache_directory={mine}"
    assert not (tmp_path / "b" / "xla").exists() and any(mine.iterdir())


def test_a_child_process_uses_its_own_cache_folder(case, tmp_path):
    """TF_XLA_FLAGS as a parent's keras_cct left it (the marker beside it): a child with another
    $KERAS_CCT_CACHE_DIR (a benchmark's process with an empty cache) uses its own folder."""
    path, x, k, dy = case
    parent = tmp_path / "parent" / "xla" / "tf-x"
    out = _run(path, tmp_path / "child",
               TF_XLA_FLAGS=f"--tf_xla_min_cluster_size=4 --tf_xla_persistent_cache_directory={parent}",
               KERAS_CCT_XLA_CACHE_SET=str(parent))
    (mine,) = (tmp_path / "child" / "xla").iterdir()
    assert out["flags"] == f"--tf_xla_min_cluster_size=4 --tf_xla_persistent_cache_directory={mine}"
    assert any(mine.iterdir()) and not parent.exists()
    _check(out, x, k, dy)
