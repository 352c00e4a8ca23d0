"""The backends' on-disk caches of compiled XLA executables, turned on by keras_cct's backend
modules: TensorFlow's persistent XLA cache (``keras_cct.lowering._backend.tensorflow.
persistent_xla_cache``: Winograd's XLA clusters) and JAX's persistent compilation cache
(``keras_cct.lowering._backend.jax.persistent_compile_cache``: a jitted Winograd step). What
one process writes, the next loads (nothing new written), and both compute the convolution and
its gradients as a float64 numpy reference; ``$KERAS_CCT_XLA_CACHE=0`` and a user's own cache
folder leave them off. Each case runs fresh processes (the libraries read the setting once);
each backend's cases run with that backend's suite. The folder they share is trimmed to a size
bound (least recently used files first) whenever a backend turns its cache on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from tests import reference as ref

ROOT = Path(__file__).resolve().parents[2]
tf_only = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                             reason="TensorFlow's cache (its own processes): the TF suite")
jax_only = pytest.mark.skipif(keras.backend.backend() != "jax",
                              reason="JAX's cache (its own processes): the JAX suite")

#: One process: Winograd F(2x2) and F(4x4) forward and gradients on TensorFlow, the results and
#: TF_XLA_FLAGS as keras_cct left them printed as JSON.
TF_SCRIPT = """
import json, os, sys, warnings
import numpy as np
import tensorflow as tf
warnings.simplefilter("always")  # every warning printed, keras_cct's notice among them
from keras_cct.lowering.geometry import conv_geometry
from keras_cct.lowering.winograd import winograd_conv2d
from keras_cct.lowering._backend.tensorflow import logs_false_sigill
x, k, dy = (np.load(sys.argv[1])[n] for n in ("x", "k", "dy"))
geo = conv_geometry(x.shape, k.shape, padding=1)
out = {"flags": os.environ.get("TF_XLA_FLAGS", ""), "false_sigill": logs_false_sigill()}
tiles = (2, 4)
if os.environ.get("OTHER_TRACES_FIRST"):  # as a planner's race does in a first process only
    for i in range(5):
        tf.function(lambda a: a * (i + 1))(tf.constant(1.0))
    tiles = (4, 2)
for tile in tiles:
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


def _process(script, case_path, cache, unset, stderr=False, **env):
    """``script`` in a fresh process (the variables ``unset`` removed, ``env`` added); its
    last printed line, parsed (and what it wrote to stderr, with ``stderr``)."""
    full = {k: v for k, v in os.environ.items() if k not in unset}
    full.update(KERAS_CCT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **env)
    proc = subprocess.run([sys.executable, "-c", script, str(case_path)], env=full,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return (out, proc.stderr) if stderr else out


def _run(case_path, cache, stderr=False, **env):
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return _process(TF_SCRIPT, case_path, cache,
                    ("TF_XLA_FLAGS", "KERAS_CCT_XLA_CACHE", "KERAS_CCT_XLA_CACHE_SET"),
                    stderr=stderr, KERAS_BACKEND="tensorflow", **env)


def _want(x, k, dy):
    """The convolution (padding 1) and its input and kernel gradients, in float64."""
    x64, k64, dy64 = (a.astype(np.float64) for a in (x, k, dy))
    return [ref.conv2d(x64, k64, padding=1), *ref.conv2d_grads(x64, k64, dy64, padding=1)[:2]]


def _check(out, x, k, dy):
    for tile, tol in (("2", 1e-5), ("4", 1e-4)):
        for got, ref_value in zip(out[tile], _want(x, k, dy)):
            assert ref.rel_err(np.asarray(got), ref_value) < tol


@tf_only
def test_executables_written_once_and_loaded_in_a_later_process(case, tmp_path):
    path, x, k, dy = case
    first, log = _run(path, tmp_path, stderr=True)
    folders = list((tmp_path / "xla").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("tf-")
    assert f"--tf_xla_persistent_cache_directory={folders[0]}" in first["flags"]
    written = sorted(p.name for p in folders[0].iterdir())
    assert written, "no XLA executable was cached"
    _check(first, x, k, dy)
    assert "XlaCacheLogWarning" not in log       # nothing to load: no notice
    # the same clusters: loaded, none compiled; TensorFlow's own log as a user sees it
    second, log = _run(path, tmp_path, stderr=True, TF_CPP_MIN_LOG_LEVEL="0")
    assert sorted(p.name for p in folders[0].iterdir()) == written
    _check(second, x, k, dy)
    # keras_cct's notice (once) comes exactly where TensorFlow logs its false SIGILL alarm on
    # a load, and before it: nothing was loaded before keras_cct's first cluster
    alarm = "Target machine feature +prefer-no-scatter is not  supported" in log
    assert alarm == second["false_sigill"]
    assert log.count("XlaCacheLogWarning") == (1 if alarm else 0)
    if alarm:
        assert log.index("XlaCacheLogWarning") < log.index("+prefer-no-scatter is not  supported")


@tf_only
def test_a_later_process_loads_clusters_an_earlier_one_traced_in_another_order(case,
                                                                                tmp_path):
    """TensorFlow names a traced function with a process-wide counter, and the persistent
    cache keys an executable by that name: the first process traced other functions first
    (and the tiles in the other order), yet the second compiles nothing -- keras_cct names
    each transform's trace from what it computes."""
    path, x, k, dy = case
    _check(_run(path, tmp_path, OTHER_TRACES_FIRST="1"), x, k, dy)
    folder = next((tmp_path / "xla").iterdir())
    written = sorted(p.name for p in folder.iterdir())
    assert written
    _check(_run(path, tmp_path), x, k, dy)
    assert sorted(p.name for p in folder.iterdir()) == written


@tf_only
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


@tf_only
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


# ---------------------------------------------------------------------- JAX

#: One process: a jitted Winograd F(2x2) forward and gradients on JAX; the results and the
#: cache folder JAX was left with, printed as JSON.
JAX_SCRIPT = """
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from keras_cct.lowering.geometry import conv_geometry
from keras_cct.lowering.winograd import winograd_conv2d
x, k, dy = (np.load(sys.argv[1])[n] for n in ("x", "k", "dy"))
geo = conv_geometry(x.shape, k.shape, padding=1)
def loss(xx, kk):
    y = winograd_conv2d(xx, kk, geo, tile=2)
    return jnp.sum(y * dy), y
(_, y), (dx, dk) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, k)
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir,
                  "out": [np.asarray(v).tolist() for v in (y, dx, dk)]}))
"""


def _run_jax(case_path, cache, **env):
    # every compilation kept, however short (JAX keeps those of 1 s or more unless told)
    return _process(JAX_SCRIPT, case_path, cache,
                    ("JAX_COMPILATION_CACHE_DIR", "KERAS_CCT_XLA_CACHE"), KERAS_BACKEND="jax",
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env)


def _check_jax(out, x, k, dy):
    for got, ref_value in zip(out["out"], _want(x, k, dy)):
        assert ref.rel_err(np.asarray(got), ref_value) < 1e-5


def _files(folder: Path) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@jax_only
def test_jax_step_written_once_and_loaded_in_a_later_process(case, tmp_path):
    path, x, k, dy = case
    first = _run_jax(path, tmp_path)
    (folder,) = (tmp_path / "xla").iterdir()
    assert folder.name.startswith("jax-") and first["dir"] == str(folder)
    written = _files(folder)
    assert written, "nothing was cached"
    _check_jax(first, x, k, dy)
    second = _run_jax(path, tmp_path)                # the same programs: loaded, none compiled
    assert second["dir"] == str(folder) and _files(folder) == written
    _check_jax(second, x, k, dy)


@jax_only
def test_jax_cache_off_when_asked_or_when_the_user_set_a_folder(case, tmp_path):
    path, x, k, dy = case
    out = _run_jax(path, tmp_path / "a", KERAS_CCT_XLA_CACHE="0")
    assert out["dir"] is None and not (tmp_path / "a" / "xla").exists()
    _check_jax(out, x, k, dy)
    mine = tmp_path / "mine"
    out = _run_jax(path, tmp_path / "b", JAX_COMPILATION_CACHE_DIR=str(mine))
    assert out["dir"] == str(mine) and not (tmp_path / "b" / "xla").exists()
    assert _files(mine)
    _check_jax(out, x, k, dy)


# ------------------------------------------------------------------ the folder's size bound

def _aged_files(folder: Path, sizes_kb, start: float = 1_000_000.0) -> list:
    """Files of ``sizes_kb`` KiB under ``folder``'s subfolders, the first the least recently
    used (access and modification times one hour apart)."""
    paths = []
    for i, kb in enumerate(sizes_kb):
        path = folder / ("tf-old-cpu" if i % 2 else "jax-new-cpu") / f"exe{i}.pb"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * (kb << 10))
        os.utime(path, (start + 3600 * i, start + 3600 * i))
        paths.append(path)
    return paths


def test_prune_deletes_least_recently_used_until_under_the_bound(tmp_path):
    from keras_cct.lowering._backend.common import prune_xla_cache
    paths = _aged_files(tmp_path, [40, 10, 30, 20, 50])  # 150 KiB, oldest first
    removed = prune_xla_cache(tmp_path, 80 << 10)
    assert removed == paths[:3]  # 150 - 40 - 10 - 30 = 70 KiB <= 80
    assert [p.exists() for p in paths] == [False, False, False, True, True]
    # a file read recently counts as used: its access time is what keeps it
    os.utime(paths[3], (3_000_000_000, os.stat(paths[3]).st_mtime))
    assert prune_xla_cache(tmp_path, 25 << 10) == [paths[4]]
    assert paths[3].exists()


def test_prune_no_limit_or_no_folder_deletes_nothing(tmp_path):
    from keras_cct.lowering._backend.common import prune_xla_cache
    paths = _aged_files(tmp_path, [10, 10])
    assert prune_xla_cache(tmp_path, 0) == []
    assert prune_xla_cache(tmp_path / "missing", 1) == []
    assert all(p.exists() for p in paths)


def test_cache_folder_trims_the_xla_folder_and_nothing_else(tmp_path, monkeypatch):
    """What a backend module runs at import: the bound from ``$KERAS_CCT_XLA_CACHE_MB``, on
    ``<cache_dir>/xla`` only (the planner's choices beside it are kept)."""
    from keras_cct.errors import PlannerCacheWarning
    from keras_cct.lowering._backend import common
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path))
    planner = tmp_path / "planner.json"
    planner.write_bytes(b"{}" * 100_000)
    os.utime(planner, (1.0, 1.0))
    paths = _aged_files(tmp_path / "xla", [512, 512, 512, 512])  # 2 MiB
    monkeypatch.setenv(common.XLA_CACHE_MB_ENV, "1.2")
    folder = common.xla_cache_folder("tf-9.9")
    assert folder.is_dir() and folder.parent == tmp_path / "xla"
    assert [p.exists() for p in paths] == [False, False, True, True] and planner.exists()
    monkeypatch.setenv(common.XLA_CACHE_MB_ENV, "0")
    common.xla_cache_folder("tf-9.9")
    assert paths[2].exists()
    monkeypatch.setenv(common.XLA_CACHE_MB_ENV, "lots")
    with pytest.warns(PlannerCacheWarning, match="KERAS_CCT_XLA_CACHE_MB"):
        assert common.xla_cache_bytes() == common.XLA_CACHE_MB << 20
