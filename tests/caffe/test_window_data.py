"""WindowData against a numpy transcription of Caffe's WindowDataLayer (window file parsing,
foreground/background split, context padding, square crops, the warp by OpenCV's bilinear
resize, mirror, mean and scale), on images the test writes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from google.protobuf import text_format

from keras_cct.caffe import proto
from keras_cct.caffe.io.binary import write_binaryproto
from keras_cct.caffe.train.data import data_source
from keras_cct.caffe.train.window_data import read_window_file
from keras_cct.errors import CaffeFormatError, DataError

cv2 = pytest.importorskip("cv2")
RNG = np.random.default_rng(11)


def _setup(tmp_path, boxes, size=(40, 50)):
    """One random PNG image and a window file with ``boxes`` (label, overlap, x1, y1, x2, y2)."""
    img = RNG.integers(0, 256, size=size + (3,), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "a.png"), img)
    lines = ["# 0", "a.png", "3", str(size[0]), str(size[1]), str(len(boxes))]
    lines += [" ".join(str(v) for v in b) for b in boxes]
    (tmp_path / "windows.txt").write_text("\n".join(lines) + "\n")
    return img


def _layer(tmp_path, batch=4, crop=8, fields="", transform=""):
    return text_format.Parse(
        f'name: "w" type: "WindowData" top: "data" top: "label" '
        f'window_data_param {{ source: "{tmp_path}/windows.txt" root_folder: "{tmp_path}/" '
        f'batch_size: {batch} {fields} }} transform_param {{ crop_size: {crop} {transform} }}',
        proto.LayerParameter())


def c_round(x):
    return int(math.copysign(math.floor(abs(float(x)) + 0.5), float(x)))


def np_window(img, box, crop, pad, square, mirror, mean_values=None, scale=1.0):
    """window_data_layer.cpp load_batch for one window (HWC, float32 arithmetic as Caffe)."""
    f = np.float32
    x1, y1, x2, y2 = box
    rows, cols = img.shape[:2]
    pad_h = pad_w = 0
    size = (crop, crop)
    if pad > 0 or square:
        cs = f(crop) / f(crop - 2 * pad)
        hh, hw = f(y2 - y1 + 1) / f(2), f(x2 - x1 + 1) / f(2)
        cx, cy = f(x1) + hw, f(y1) + hh
        if square:
            hh = hw = max(hh, hw)
        x1, x2 = c_round(cx - hw * cs), c_round(cx + hw * cs)
        y1, y2 = c_round(cy - hh * cs), c_round(cy + hh * cs)
        uh, uw = y2 - y1 + 1, x2 - x1 + 1
        px1, py1, px2 = max(0, -x1), max(0, -y1), max(0, x2 - cols + 1)
        py2 = max(0, y2 - rows + 1)
        x1, x2, y1, y2 = x1 + px1, x2 - px2, y1 + py1, y2 - py2
        sx, sy = f(crop) / f(uw), f(crop) / f(uh)
        w, h = c_round(f(x2 - x1 + 1) * sx), c_round(f(y2 - y1 + 1) * sy)
        pad_h = c_round(f(py1) * sy)
        pad_w = c_round(f(px2) * sx) if mirror else c_round(f(px1) * sx)
        size = (min(w, crop - pad_w), min(h, crop - pad_h))
    cut = cv2.resize(img[y1:y2 + 1, x1:x2 + 1], size, interpolation=cv2.INTER_LINEAR)
    if mirror:
        cut = cut[:, ::-1]
    out = np.zeros((crop, crop, 3), np.float32)
    vals = cut.astype(np.float32)
    if mean_values is not None:
        vals = vals - np.asarray(mean_values, np.float32)
    out[pad_h:pad_h + cut.shape[0], pad_w:pad_w + cut.shape[1]] = vals * np.float32(scale)
    return out


def test_plain_windows_bg_then_fg(tmp_path):
    img = _setup(tmp_path, [(3, 0.9, 5, 6, 12, 13), (1, 0.1, 20, 10, 27, 17),
                            (2, 0.4, 0, 0, 9, 9)])  # the last: neither fg nor bg
    src = data_source(_layer(tmp_path, batch=4, crop=8,
                             fields="fg_fraction: 0.5 scale: 0.5 bg_threshold: 0.3",
                             transform="mean_value: 10 mean_value: 20 mean_value: 30"),
                      seed=0)
    assert src.shapes == {"data": (8, 8, 3), "label": ()}
    batch = next(src.batches())
    np.testing.assert_array_equal(batch["label"], [0, 0, 3, 3])  # background first, label 0
    mean = np.array([10, 20, 30], np.float32)
    bg = (img[10:18, 20:28].astype(np.float32) - mean) * 0.5  # an 8x8 box: no resize
    fg = (img[6:14, 5:13].astype(np.float32) - mean) * 0.5
    np.testing.assert_array_equal(batch["data"], np.stack([bg, bg, fg, fg]))


@pytest.mark.parametrize("pad,mode,box", [(2, "warp", (5, 6, 20, 13)),
                                          (3, "square", (1, 2, 14, 30)),
                                          (0, "square", (30, 3, 49, 12)),
                                          (4, "warp", (0, 0, 49, 39))])
def test_context_pad_and_square(tmp_path, pad, mode, box):
    img = _setup(tmp_path, [(1, 1.0) + box])
    src = data_source(_layer(tmp_path, batch=2, crop=16,
                             fields=f'fg_fraction: 1 context_pad: {pad} crop_mode: "{mode}"'),
                      seed=0)
    data = next(src.batches())["data"]
    want = np_window(img, box, 16, pad, mode == "square", False)
    np.testing.assert_array_equal(data[0], want)
    np.testing.assert_array_equal(data[1], want)


def test_mirror_flips_window_and_padding(tmp_path):
    box = (0, 3, 20, 30)  # at the left edge: context padding on the left only
    img = _setup(tmp_path, [(1, 1.0) + box])
    src = data_source(_layer(tmp_path, batch=8, crop=16, fields="fg_fraction: 1 context_pad: 3",
                             transform="mirror: true"), seed=1)
    data = next(src.batches())["data"]
    plain = np_window(img, box, 16, 3, False, False)
    flipped = np_window(img, box, 16, 3, False, True)
    kinds = [0 if np.array_equal(d, plain) else 1 if np.array_equal(d, flipped) else -1
             for d in data]
    assert -1 not in kinds and set(kinds) == {0, 1}


def test_mean_file(tmp_path):
    img = _setup(tmp_path, [(1, 1.0, 5, 6, 12, 13)])
    mean = RNG.uniform(0, 255, size=(1, 3, 12, 12)).astype(np.float32)
    write_binaryproto(tmp_path / "mean.binaryproto", mean)
    src = data_source(_layer(tmp_path, batch=1, crop=8, fields="fg_fraction: 1",
                             transform=f'mean_file: "{tmp_path}/mean.binaryproto"'), seed=0)
    got = next(src.batches())["data"][0]
    off = (12 - 8) // 2  # Caffe: mean_off from the mean's width, for both axes
    want = img[6:14, 5:13].astype(np.float32) - mean[0].transpose(1, 2, 0)[off:off + 8,
                                                                           off:off + 8]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_window_file_errors(tmp_path):
    (tmp_path / "w.txt").write_text("# 0\na.png\n3\n10\n10\n2\n1 0.9 0 0 5 5\n1 0.9 0 0 5\n")
    with pytest.raises(DataError, match="class_index overlap") as e:
        read_window_file(str(tmp_path / "w.txt"))
    assert e.value.line == 8
    (tmp_path / "w.txt").write_text("# 0\na.png\n3\n10\n")
    with pytest.raises(DataError, match="ends"):
        read_window_file(str(tmp_path / "w.txt"))
    _setup(tmp_path, [(0, 0.9, 0, 0, 5, 5)])
    with pytest.raises(DataError, match="label 0"):
        data_source(_layer(tmp_path))
    _setup(tmp_path, [(1, 0.9, 0, 0, 5, 5)])
    with pytest.raises(DataError, match="background windows"):
        next(data_source(_layer(tmp_path)).batches())
    with pytest.raises(CaffeFormatError, match="crop_size"):
        data_source(_layer(tmp_path, crop=0))


def test_window_data_net_trains(tmp_path):
    """A WindowData net goes through the solver: its batches feed the model."""
    from keras_cct.caffe.train.solver import load_solver
    _setup(tmp_path, [(1, 0.9, 5, 6, 12, 13), (2, 0.8, 20, 10, 27, 17), (0, 0.1, 0, 0, 9, 9)])
    (tmp_path / "net.prototxt").write_text(
        'name: "w"\n'
        f'layer {{ name: "w" type: "WindowData" top: "data" top: "label" '
        f'window_data_param {{ source: "{tmp_path}/windows.txt" root_folder: "{tmp_path}/" '
        f'batch_size: 4 fg_fraction: 0.5 scale: 0.00390625 }} '
        f'transform_param {{ crop_size: 8 mirror: true }} }}\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
        'inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }\n'
        'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" '
        'top: "loss" }\n')
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 3 display: 1 '
        f'snapshot_after_train: false snapshot_prefix: "{tmp_path}/s" random_seed: 1')
    lines = []
    s = load_solver(str(tmp_path / "solver.prototxt"), log=lines.append)
    s.solve()
    losses = [float(ln.split("loss = ")[1]) for ln in lines
              if ln.startswith("Iteration") and "loss = " in ln]
    assert len(losses) == 3 and all(np.isfinite(losses))
