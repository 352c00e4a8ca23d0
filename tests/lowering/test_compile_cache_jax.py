"""JAX's persistent compilation cache, turned on by keras_cct's JAX backend module
(``keras_cct.lowering._backend.jax.persistent_compile_cache``): a Winograd training step
compiled in one process is written to disk and loaded in the next (nothing new written), and
both compute the convolution and its gradients as a float64 numpy reference;
``$KERAS_CCT_XLA_CACHE=0`` and a user's own ``$JAX_COMPILATION_CACHE_DIR`` leave it off. Each
case runs fresh processes (JAX reads the setting at its first compilation)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from tests import reference as ref

if keras.backend.backend() != "jax":
    pytest.skip("the JAX backend's cache (its own processes): run with the JAX suite",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

#: One process: a jitted Winograd F(2x2) forward and gradients on JAX; the results and the
#: cache folder JAX was left with, printed as JSON.
SCRIPT = """
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


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 9, 10, 6)).astype(np.float32)
    k = rng.standard_normal((3, 3, 6, 5)).astype(np.float32)
    dy = rng.standard_normal((2, 9, 10, 5)).astype(np.float32)
    path = tmp_path_factory.mktemp("jaxcache") / "case.npz"
    np.savez(path, x=x, k=k, dy=dy)
    return path, x, k, dy


def _run(case_path, cache, **env):
    full = {k: v for k, v in os.environ.items()
            if k not in ("JAX_COMPILATION_CACHE_DIR", "KERAS_CCT_XLA_CACHE")}
    # every compilation kept, however short (JAX keeps those of 1 s or more unless told)
    full.update(KERAS_BACKEND="jax", KERAS_CCT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(case_path)], env=full,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(out, x, k, dy):
    x64, k64, dy64 = (a.astype(np.float64) for a in (x, k, dy))
    want = [ref.conv2d(x64, k64, padding=1), *ref.conv2d_grads(x64, k64, dy64, padding=1)[:2]]
    for got, ref_value in zip(out["out"], want):
        assert ref.rel_err(np.asarray(got), ref_value) < 1e-5


def _files(folder: Path) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_step_written_once_and_loaded_in_a_later_process(case, tmp_path):
    path, x, k, dy = case
    first = _run(path, tmp_path)
    (folder,) = (tmp_path / "xla").iterdir()
    assert folder.name.startswith("jax-") and first["dir"] == str(folder)
    written = _files(folder)
    assert written, "nothing was cached"
    _check(first, x, k, dy)
    second = _run(path, tmp_path)                # the same programs: loaded, none compiled
    assert second["dir"] == str(folder) and _files(folder) == written
    _check(second, x, k, dy)


def test_off_when_asked_or_when_the_user_set_a_folder(case, tmp_path):
    path, x, k, dy = case
    out = _run(path, tmp_path / "a", KERAS_CCT_XLA_CACHE="0")
    assert out["dir"] is None and not (tmp_path / "a" / "xla").exists()
    _check(out, x, k, dy)
    mine = tmp_path / "mine"
    out = _run(path, tmp_path / "b", JAX_COMPILATION_CACHE_DIR=str(mine))
    assert out["dir"] == str(mine) and not (tmp_path / "b" / "xla").exists()
    assert _files(mine)
    _check(out, x, k, dy)
