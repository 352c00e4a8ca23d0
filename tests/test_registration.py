"""``import keras_cct`` is enough for ``keras.saving.load_model`` to find keras_cct's layers (Keras
imports no package but its own while loading)."""

import subprocess
import sys

import keras
import numpy as np

from keras_cct.caffe.net.layers import CaffeLRN
from keras_cct.layers import HybridConv2D


def test_a_plain_import_registers_the_layers_for_load_model(tmp_path):
    inp = keras.Input((8, 8, 3))
    h = HybridConv2D(4, 3, padding=1, lowering="native")(inp)
    out = CaffeLRN(local_size=3)(h)
    model = keras.Model(inp, out)
    path = tmp_path / "m.keras"
    model.save(path)
    x = np.random.default_rng(0).standard_normal((2, 8, 8, 3)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", keras.ops.convert_to_numpy(model(x)))
    code = (
        "import sys, numpy as np, keras, keras_cct\n"
        f"d = {str(tmp_path)!r}\n"
        "m = keras.saving.load_model(d + '/m.keras')\n"
        "y = keras.ops.convert_to_numpy(m(np.load(d + '/x.npy')))\n"
        "np.testing.assert_allclose(y, np.load(d + '/y.npy'), rtol=1e-5, atol=1e-6)\n"
        "print(sorted(type(l).__name__ for l in m.layers))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CaffeLRN" in run.stdout and "HybridConv2D" in run.stdout
