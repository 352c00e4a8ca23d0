"""keras_cct.caffe.io's pycaffe helpers (Transformer, load_image, resize_image, oversample,
blob and datum conversions) against numpy written from pycaffe's io.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_cct.caffe.io import (Transformer, array_to_blobproto, array_to_datum,
                                blobproto_to_array, datum_to_array, load_image, oversample,
                                proto, resize_image)
from keras_cct.errors import DataError


def _bilinear(im, h, w):
    """Half-pixel bilinear resize with clamped edges, written out pixel by pixel."""
    H, W, K = im.shape
    out = np.zeros((h, w, K))
    for i in range(h):
        y = min(max((i + 0.5) * H / h - 0.5, 0), H - 1)
        y0 = int(np.floor(y))
        y1 = min(y0 + 1, H - 1)
        fy = y - y0
        for j in range(w):
            x = min(max((j + 0.5) * W / w - 0.5, 0), W - 1)
            x0 = int(np.floor(x))
            x1 = min(x0 + 1, W - 1)
            fx = x - x0
            out[i, j] = ((1 - fy) * ((1 - fx) * im[y0, x0] + fx * im[y0, x1])
                         + fy * ((1 - fx) * im[y1, x0] + fx * im[y1, x1]))
    return out


def test_resize_image_is_bilinear():
    rng = np.random.default_rng(0)
    im = rng.random((7, 9, 3))
    for h, w in [(7, 9), (14, 18), (5, 4), (11, 3)]:
        got = resize_image(im, (h, w))
        assert got.dtype == np.float32 and got.shape == (h, w, 3)
        np.testing.assert_allclose(got, _bilinear(im, h, w), rtol=1e-5, atol=1e-6)
    # doubling: an interior output pixel sits a quarter pixel from its nearest input pixel
    got = resize_image(im, (14, 18))
    np.testing.assert_allclose(got[3, 5], 0.75 * (0.75 * im[1, 2] + 0.25 * im[1, 3])
                               + 0.25 * (0.75 * im[2, 2] + 0.25 * im[2, 3]), rtol=1e-5)
    near = resize_image(im, (14, 18), interp_order=0)
    np.testing.assert_array_equal(near[::2, ::2], im.astype(np.float32))


def test_transformer_preprocess_and_deprocess_match_pycaffe_order():
    rng = np.random.default_rng(1)
    img = rng.random((8, 10, 3)).astype(np.float32)
    mean = np.array([0.4, 0.5, 0.6]) * 255
    t = Transformer({"data": (2, 3, 8, 10)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", mean)
    t.set_input_scale("data", 0.017)
    got = t.preprocess("data", img)
    # by hand: HWC RGB [0,1] -> CHW BGR [0,255] - mean (per channel, after the swap) -> scale
    want = np.empty((3, 8, 10))
    for c in range(3):
        want[c] = (img[:, :, 2 - c] * 255.0 - mean[c]) * 0.017
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(t.deprocess("data", got), img, rtol=1e-5, atol=1e-5)


def test_transformer_resizes_image_and_mean():
    rng = np.random.default_rng(2)
    img = rng.random((5, 6, 3)).astype(np.float32)
    mean = rng.random((3, 4, 4)) * 100 + 10
    t = Transformer({"data": (1, 3, 10, 12)})
    t.set_transpose("data", (2, 0, 1))
    t.set_mean("data", mean)
    got = t.preprocess("data", img)
    lo, hi = mean.min(), mean.max()
    mean_big = _bilinear(((mean - lo) / (hi - lo)).transpose(1, 2, 0), 10, 12) * (hi - lo) + lo
    want = _bilinear(img, 10, 12).transpose(2, 0, 1) - mean_big.transpose(2, 0, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_transformer_errors():
    t = Transformer({"data": (1, 3, 4, 4)})
    with pytest.raises(KeyError, match="not one of the net inputs"):
        t.set_raw_scale("image", 255)
    with pytest.raises(ValueError, match="must have 3 axes"):
        t.set_transpose("data", (1, 0))
    with pytest.raises(ValueError, match="must have 3 channels"):
        t.set_channel_swap("data", (1, 0))
    with pytest.raises(ValueError, match="mean has 2 channels"):
        t.set_mean("data", np.zeros(2))


def test_oversample_is_pycaffes_ten_crops():
    rng = np.random.default_rng(3)
    ims = rng.random((2, 8, 9, 3)).astype(np.float32)
    crops = oversample(ims, (4, 5))
    assert crops.shape == (20, 4, 5, 3)
    for n, im in enumerate(ims):
        starts = [(0, 0), (0, 4), (4, 0), (4, 4), (2, 2)]  # corners, then the centre
        for k, (i, j) in enumerate(starts):
            want = im[i:i + 4, j:j + 5]
            np.testing.assert_array_equal(crops[10 * n + k], want)
            np.testing.assert_array_equal(crops[10 * n + 5 + k], want[:, ::-1])


def test_load_image_color_and_gray(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(4)
    rgb = rng.integers(0, 256, (6, 7, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    got = load_image(tmp_path / "a.png")
    assert got.dtype == np.float32 and got.shape == (6, 7, 3)
    np.testing.assert_allclose(got, rgb / 255.0, rtol=1e-6)
    gray = rng.integers(0, 256, (6, 7), dtype=np.uint8)
    Image.fromarray(gray).save(tmp_path / "g.png")
    np.testing.assert_allclose(load_image(tmp_path / "g.png", color=False)[:, :, 0],
                               gray / 255.0, rtol=1e-6)
    tiled = load_image(tmp_path / "g.png")
    assert tiled.shape == (6, 7, 3)
    np.testing.assert_allclose(tiled[:, :, 1], gray / 255.0, rtol=1e-6)
    with pytest.raises(DataError, match="not found"):
        load_image(tmp_path / "missing.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match="cannot read the image"):
        load_image(tmp_path / "bad.png")


def test_blobproto_and_datum_round_trips():
    rng = np.random.default_rng(5)
    a = rng.normal(size=(2, 3, 4)).astype(np.float32)
    d = rng.normal(size=(2, 3, 4)).astype(np.float32)
    blob = array_to_blobproto(a, d)
    assert list(blob.shape.dim) == [2, 3, 4]
    np.testing.assert_array_equal(blobproto_to_array(blob), a)
    np.testing.assert_array_equal(blobproto_to_array(blob, return_diff=True), d)
    legacy = proto.BlobProto(num=1, channels=2, height=1, width=3)
    legacy.data.extend([1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(blobproto_to_array(legacy),
                                  np.arange(1, 7, dtype=np.float32).reshape(1, 2, 1, 3))
    img = rng.integers(0, 256, (3, 5, 4), dtype=np.uint8)  # (C, H, W) as pycaffe
    datum = array_to_datum(img, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 5, 4, 7)
    assert datum.data == img.tobytes()  # Caffe's byte order is C, H, W
    np.testing.assert_array_equal(datum_to_array(datum), img)
    f = rng.normal(size=(2, 3, 3)).astype(np.float32)
    np.testing.assert_array_equal(datum_to_array(array_to_datum(f)), f)


CHILD = r"""
import json, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("keras", "tensorflow", "jax", "jaxlib", "torch"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
import numpy as np
import keras_cct.caffe as caffe   # pycaffe's spelling; caffe.io needs no Keras

t = caffe.io.Transformer({"data": (1, 3, 4, 4)})
t.set_transpose("data", (2, 0, 1))
t.set_raw_scale("data", 255)
img = caffe.io.load_image(sys.argv[1])
x = t.preprocess("data", img)
print(json.dumps({"shape": list(x.shape), "sum": float(x.sum()),
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] == "keras")}))
"""


def test_caffe_io_runs_without_keras(tmp_path):
    from PIL import Image
    img = np.full((4, 4, 3), 10, np.uint8)
    Image.fromarray(img).save(tmp_path / "i.png")
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "i.png")], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["shape"] == [3, 4, 4] and out["loaded"] == []
    assert abs(out["sum"] - 48 * 10.0) < 1e-3
