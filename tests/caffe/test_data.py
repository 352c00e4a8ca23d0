"""LMDB Datum round trip, convert_imageset, Caffe's DataTransformer and the data layers."""

from __future__ import annotations

import os

import cv2
import h5py
import numpy as np
import pytest
from google.protobuf import text_format

from keras_cct.caffe import proto
from keras_cct.caffe.train.data import DataTransformer, data_source
from keras_cct.caffe.io.lmdb_io import (DatumReader, convert_imageset, write_arrays,
                                        write_datums)
from keras_cct.caffe.io.binary import write_binaryproto
from keras_cct.errors import CaffeFormatError, DataError


def layer(text):
    return text_format.Parse(text, proto.LayerParameter())


def tparam(text):
    return text_format.Parse(text, proto.TransformationParameter())


@pytest.fixture
def images():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(7, 6, 5, 3), dtype=np.uint8), np.arange(7) % 3


@pytest.mark.parametrize("encode", ["", "png"])
def test_lmdb_round_trip(tmp_path, images, encode):
    x, y = images
    assert write_arrays(tmp_path / "db", x, y, encode=encode) == 7
    with DatumReader(tmp_path / "db") as r:
        assert len(r) == 7
        got = list(r.arrays())
    assert [k for k, _, _ in got] == [f"{i:08d}" for i in range(7)]
    np.testing.assert_array_equal(np.stack([a for _, a, _ in got]), x)
    assert [lab for _, _, lab in got] == list(y)
    # The raw record is Caffe's CHW byte layout.
    with DatumReader(tmp_path / "db") as r:
        k, d = r.first()
    if not encode:
        assert (d.channels, d.height, d.width) == (3, 6, 5)
        np.testing.assert_array_equal(np.frombuffer(d.data, np.uint8),
                                      x[0].transpose(2, 0, 1).ravel())
    else:
        assert d.encoded
        np.testing.assert_array_equal(cv2.imdecode(np.frombuffer(d.data, np.uint8),
                                                   cv2.IMREAD_COLOR), x[0])
    with pytest.raises(DataError, match="already exists"):
        write_arrays(tmp_path / "db", x, y)


def test_float_datum_round_trip(tmp_path):
    x = np.random.default_rng(1).normal(size=(3, 4, 4, 2)).astype(np.float32)
    write_arrays(tmp_path / "f", x, [0, 1, 2])
    with DatumReader(tmp_path / "f") as r:
        got = np.stack([a for _, a, _ in r.arrays()])
    np.testing.assert_array_equal(got, x)


def test_bad_records(tmp_path):
    bad = proto.Datum(channels=3, height=4, width=4, data=b"\x00" * 47, label=1)
    junk = proto.Datum(channels=3, height=4, width=4, data=b"not an image", encoded=True)
    write_datums(tmp_path / "bad", [("00000000_a", bad), ("00000001_b", junk)])
    with DatumReader(tmp_path / "bad") as r:
        it = r.arrays()
        with pytest.raises(DataError, match=r"bad.*00000000_a.*47 bytes.*3\*4\*4 = 48"):
            next(it)
    with DatumReader(tmp_path / "bad") as r:
        items = list(r.items())
    from keras_cct.caffe.io.lmdb_io import datum_to_array
    with pytest.raises(DataError, match="00000001_b.*does not decode"):
        datum_to_array(items[1][1], path="db", key=items[1][0])
    with pytest.raises(DataError, match="nowhere.*LMDB not found"):
        DatumReader(tmp_path / "nowhere")


def _img_folder(tmp_path):
    rng = np.random.default_rng(2)
    for cls in ("cat", "dog"):
        os.makedirs(tmp_path / "imgs" / cls)
        for i in range(3):
            cv2.imwrite(str(tmp_path / "imgs" / cls / f"{i}.png"),
                        rng.integers(0, 256, size=(9 + i, 8, 3), dtype=np.uint8))
    return tmp_path / "imgs"


def test_convert_imageset_folder_and_list(tmp_path):
    root = _img_folder(tmp_path)
    n = convert_imageset(root, None, tmp_path / "db", resize_height=6, resize_width=7)
    assert n == 6
    with DatumReader(tmp_path / "db") as r:
        got = list(r.arrays())
    assert got[0][0] == "00000000_cat/0.png" and got[3][2] == 1
    want = cv2.resize(cv2.imread(str(root / "dog" / "2.png")), (7, 6))
    np.testing.assert_array_equal(got[5][1], want)
    # a list file, gray, encoded
    (tmp_path / "list.txt").write_text("dog/1.png 4\ncat/2.png 9\n")
    convert_imageset(root, tmp_path / "list.txt", tmp_path / "db2", gray=True, encode="png")
    with DatumReader(tmp_path / "db2") as r:
        got = list(r.arrays())
    assert [g[2] for g in got] == [4, 9]
    np.testing.assert_array_equal(got[1][1][:, :, 0],
                                  cv2.imread(str(root / "cat" / "2.png"), cv2.IMREAD_GRAYSCALE))
    (tmp_path / "bad.txt").write_text("dog/1.png 4\ncat/missing.png 1\n")
    with pytest.raises(DataError, match=r"bad.txt:2.*image not found.*missing.png"):
        convert_imageset(root, tmp_path / "bad.txt", tmp_path / "db3")


def test_transformer_test_phase_exact(tmp_path):
    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, size=(8, 10, 3), dtype=np.uint8)
    mean = rng.uniform(0, 255, size=(1, 3, 8, 10)).astype(np.float32)  # Caffe NCHW
    write_binaryproto(tmp_path / "mean.binaryproto", mean)
    t = DataTransformer(tparam('scale: 0.5 crop_size: 4 mean_file: "mean.binaryproto"'),
                        "TEST", base_dirs=[tmp_path])
    want = (img.astype(np.float64) - mean[0].transpose(1, 2, 0))[2:6, 3:7, :] * 0.5
    np.testing.assert_allclose(t(img), want, rtol=1e-6)
    t2 = DataTransformer(tparam("scale: 0.25 mean_value: 10 mean_value: 20 mean_value: 30"),
                         "TEST")
    np.testing.assert_allclose(t2(img), (img - np.array([10., 20., 30.])) * 0.25, rtol=1e-6)
    with pytest.raises(CaffeFormatError, match="both mean_file and mean_value"):
        DataTransformer(tparam('mean_file: "m" mean_value: 1'), "TEST")
    with pytest.raises(DataError, match="mean_file has shape"):
        t(img[:6])


def test_transformer_train_random_crop_and_mirror():
    img = np.arange(6 * 7 * 2, dtype=np.float32).reshape(6, 7, 2)
    t = DataTransformer(tparam("crop_size: 3 mirror: true"), "TRAIN", seed=0)
    seen_offsets, mirrors = set(), set()
    for _ in range(200):
        out = t(img)
        match = None
        for h in range(4):
            for w in range(5):
                crop = img[h:h + 3, w:w + 3]
                for m, cand in ((0, crop), (1, crop[:, ::-1])):
                    if np.array_equal(out, cand):
                        match = (h, w, m)
        assert match is not None
        seen_offsets.add(match[:2])
        mirrors.add(match[2])
    assert len(seen_offsets) == 20 and mirrors == {0, 1}


def test_data_layer_batches_cycle_in_key_order(tmp_path, images):
    x, y = images
    write_arrays(tmp_path / "db", x, y)
    src = data_source(layer('name: "d" type: "Data" top: "data" top: "label" '
                            'data_param { source: "db" batch_size: 4 backend: LMDB } '
                            'transform_param { scale: 0.1 }'),
                      phase="TEST", base_dirs=[tmp_path])
    assert src.shapes == {"data": (6, 5, 3), "label": ()} and src.size == 7
    it = src.batches()
    b1, b2 = next(it), next(it)
    order = [0, 1, 2, 3, 4, 5, 6, 0]
    np.testing.assert_allclose(np.concatenate([b1["data"], b2["data"]]),
                               x[order].astype(np.float32) * np.float32(0.1), rtol=1e-6)
    np.testing.assert_array_equal(np.concatenate([b1["label"], b2["label"]]), y[order])
    ds = src.dataset()
    first = next(iter(ds.as_numpy_iterator()))
    np.testing.assert_array_equal(first["data"], b1["data"])


def test_data_layer_errors(tmp_path):
    with pytest.raises(DataError, match="nope.*LMDB not found"):
        data_source(layer('name: "d" type: "Data" top: "data" '
                          'data_param { source: "nope" batch_size: 2 backend: LMDB }'),
                    base_dirs=[tmp_path])
    with pytest.raises(CaffeFormatError, match="layer 'w'.*not a supported data layer"):
        data_source(layer('name: "w" type: "NoSuchData" top: "data"'))


def test_image_data_layer(tmp_path):
    root = _img_folder(tmp_path)
    (tmp_path / "list.txt").write_text("cat/0.png 0\ndog/2.png 1\n")
    src = data_source(layer(f'name: "img" type: "ImageData" top: "data" top: "label" '
                            f'image_data_param {{ source: "list.txt" batch_size: 3 '
                            f'root_folder: "{root}/" new_height: 5 new_width: 4 }}'),
                      phase="TEST", base_dirs=[tmp_path])
    b = next(src.batches())
    want = [cv2.resize(cv2.imread(str(root / p)), (4, 5)) for p in
            ("cat/0.png", "dog/2.png", "cat/0.png")]
    np.testing.assert_array_equal(b["data"], np.stack(want).astype(np.float32))
    np.testing.assert_array_equal(b["label"], [0, 1, 0])
    (tmp_path / "bad.txt").write_text("cat/0.png 0\ncat/zzz.png 1\n")
    src = data_source(layer(f'name: "img" type: "ImageData" top: "data" top: "label" '
                            f'image_data_param {{ source: "bad.txt" batch_size: 2 '
                            f'root_folder: "{root}/" }}'), base_dirs=[tmp_path])
    with pytest.raises(DataError, match=r"bad.txt:2.*zzz.png"):
        next(src.batches())


def test_hdf5_data_layer(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, 2, 3, 4)).astype(np.float32)  # Caffe NCHW
    y = np.arange(5, dtype=np.float32)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"], f["label"] = x, y
    (tmp_path / "files.txt").write_text("a.h5\n")
    src = data_source(layer('name: "h" type: "HDF5Data" top: "data" top: "label" '
                            'hdf5_data_param { source: "files.txt" batch_size: 3 }'),
                      base_dirs=[tmp_path])
    assert src.shapes == {"data": (3, 4, 2), "label": ()}
    it = src.batches()
    b1, b2 = next(it), next(it)
    np.testing.assert_array_equal(b1["data"], x[:3].transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(b2["label"], [3, 4, 0])
    with pytest.raises(DataError, match="no dataset 'target'"):
        data_source(layer('name: "h" type: "HDF5Data" top: "data" top: "target" '
                          'hdf5_data_param { source: "files.txt" batch_size: 3 }'),
                    base_dirs=[tmp_path])


def test_hdf5_bad_files(tmp_path):
    with pytest.raises(DataError, match=r"nolist.txt.*cannot read the HDF5 file list"):
        data_source(layer('name: "h" type: "HDF5Data" top: "data" '
                          'hdf5_data_param { source: "nolist.txt" batch_size: 1 }'),
                    base_dirs=[tmp_path])
    (tmp_path / "broken.h5").write_bytes(b"this is not an HDF5 file")
    (tmp_path / "files.txt").write_text("broken.h5\n")
    with pytest.raises(DataError, match=r"broken.h5.*layer 'h'.*cannot read the HDF5 file"):
        data_source(layer('name: "h" type: "HDF5Data" top: "data" '
                          'hdf5_data_param { source: "files.txt" batch_size: 1 }'),
                    base_dirs=[tmp_path])


def test_image_that_does_not_decode(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG but truncated")
    (tmp_path / "list.txt").write_text("a.png 3\n")
    with pytest.raises(DataError, match=r"list.txt:1.*does not decode.*a.png"):
        data_source(layer(f'name: "img" type: "ImageData" top: "data" top: "label" '
                          f'image_data_param {{ source: "list.txt" batch_size: 1 '
                          f'root_folder: "{tmp_path}/" }}'), base_dirs=[tmp_path])


def test_missing_image_list(tmp_path):
    with pytest.raises(DataError, match=r"nolist.txt.*cannot read the image list"):
        data_source(layer('name: "img" type: "ImageData" top: "data" top: "label" '
                          'image_data_param { source: "nolist.txt" batch_size: 1 }'),
                    base_dirs=[tmp_path])
    (tmp_path / "list.txt").write_text("a.png 1\nb.png two\n")
    with pytest.raises(DataError, match=r"list.txt:2.*expected 'path label'"):
        data_source(layer('name: "img" type: "ImageData" top: "data" top: "label" '
                          'image_data_param { source: "list.txt" batch_size: 1 }'),
                    base_dirs=[tmp_path])
