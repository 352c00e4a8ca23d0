"""The OpenCL kernels (SGEMM, Type 1 and Type 3 convolutions, forward and backward) against the
float64 numpy reference of tests/reference.py, on random shapes."""

from __future__ import annotations

import numpy as np
import pytest

from keras_cct.devices.opencl import conv2d_backward, conv2d_forward, sgemm
from tests import reference as R

pytestmark = pytest.mark.opencl
TOL = 1e-5

# (batch, h, w, c), (kh, kw, o), strides, padding, dilation, groups
CASES = [
    ((2, 7, 9, 3), (3, 3, 5), 1, "valid", 1, 1),
    ((1, 8, 8, 4), (1, 1, 8), 1, "valid", 1, 1),
    ((3, 9, 11, 6), (3, 2, 12), 2, "same", 1, 2),
    ((2, 10, 9, 6), (2, 3, 9), (1, 3), ((1, 2), (0, 3)), (2, 1), 3),
    ((2, 13, 12, 4), (5, 5, 4), 3, 2, 1, 4),           # depthwise, stride 3, padding 2
    ((1, 12, 12, 8), (3, 3, 40), 1, "same", 2, 2),     # dilation 2, wide GEMM (edge + vector)
    ((2, 15, 15, 3), (11, 11, 16), 4, 0, 1, 1),        # CaffeNet conv1-like
    ((1, 6, 7, 2), (2, 2, 3), (2, 1), ((0, 1), (2, 0)), 1, 1),  # asymmetric padding, odd sizes
]


def _data(case, seed):
    (n, h, w, c), (kh, kw, o), strides, padding, dilation, groups = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    k = rng.standard_normal((kh, kw, c // groups, o)).astype(np.float32)
    b = rng.standard_normal((o,)).astype(np.float32)
    kwargs = dict(strides=strides, padding=padding, dilation_rate=dilation, groups=groups)
    return x, k, b, kwargs


@pytest.mark.parametrize("lowering", ["type1", "type2", "type3"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_conv_forward_backward_matches_reference(opencl_device, case, lowering):
    x, k, b, kw = _data(CASES[case], case)
    ref_args = (kw["strides"], kw["padding"], kw["dilation_rate"], kw["groups"])
    y = conv2d_forward(opencl_device, x, k, b, lowering=lowering, **kw)
    ref = R.conv2d(x, k, b, *ref_args)
    assert y.shape == ref.shape
    assert R.rel_err(y, ref) <= TOL
    dy = np.random.default_rng(100 + case).standard_normal(ref.shape).astype(np.float32)
    dx, dk, db = conv2d_backward(opencl_device, x, k, dy, lowering=lowering, **kw)
    rdx, rdk, rdb = R.conv2d_grads(x, k, dy, *ref_args)
    assert R.rel_err(dx, rdx) <= TOL
    assert R.rel_err(dk, rdk) <= TOL
    assert R.rel_err(db, rdb) <= TOL


def test_batch_partitions_give_the_same_result(opencl_device, monkeypatch):
    """Several batch partitions (dW and db accumulated across them) equal one partition."""
    import keras_cct.devices.opencl.conv as conv
    x, k, b, kw = _data(((5, 9, 9, 4), (3, 3, 6), 1, 1, 1, 2), 7)
    dy = np.random.default_rng(8).standard_normal((5, 9, 9, 6)).astype(np.float32)
    ref = R.conv2d(x, k, b, 1, 1, 1, 2)
    rdx, rdk, rdb = R.conv2d_grads(x, k, dy, 1, 1, 1, 2)
    monkeypatch.setattr(conv, "CHUNK_BYTES", 1)  # one image per partition
    monkeypatch.setattr(conv, "MIN_ROWS_BACKWARD", 0)
    for lowering in ("type1", "type2", "type3"):
        assert R.rel_err(conv2d_forward(opencl_device, x, k, b, lowering=lowering, **kw),
                         ref) <= TOL
        dx, dk, db = conv2d_backward(opencl_device, x, k, dy, lowering=lowering, **kw)
        assert max(R.rel_err(dx, rdx), R.rel_err(dk, rdk), R.rel_err(db, rdb)) <= TOL


def test_no_bias(opencl_device):
    x, k, _, kw = _data(CASES[2], 3)
    y = conv2d_forward(opencl_device, x, k, None, **kw)
    assert R.rel_err(y, R.conv2d(x, k, None, 2, "same", 1, 2)) <= TOL
    dy = np.ones_like(y)
    dx, dk, db = conv2d_backward(opencl_device, x, k, dy, with_bias=False, **kw)
    assert db is None
    assert R.rel_err(dk, R.conv2d_grads(x, k, dy, 2, "same", 1, 2)[1]) <= TOL


@pytest.mark.parametrize("lowering", ["type1", "type2", "type3"])
def test_backward_without_the_input_gradient(opencl_device, lowering):
    """need_dx=False (a network's first layer) skips dx; dW and db are unchanged, and the
    future of ``wait=False`` gives the same."""
    x, k, _, kw = _data(CASES[1], 5)
    ref_args = (kw["strides"], kw["padding"], kw["dilation_rate"], kw["groups"])
    dy = np.random.default_rng(9).standard_normal(
        R.conv2d(x, k, None, *ref_args).shape).astype(np.float32)
    _, rdk, rdb = R.conv2d_grads(x, k, dy, *ref_args)
    dx, dk, db = conv2d_backward(opencl_device, x, k, dy, lowering=lowering, need_dx=False,
                                 **kw)
    assert dx is None
    assert R.rel_err(dk, rdk) <= TOL and R.rel_err(db, rdb) <= TOL
    future = conv2d_backward(opencl_device, x, k, dy, lowering=lowering, wait=False, **kw)
    dx2, dk2, db2 = future.result(timeout=60)
    assert R.rel_err(dx2, R.conv2d_grads(x, k, dy, *ref_args)[0]) <= TOL
    np.testing.assert_array_equal(dk2, dk)


@pytest.mark.parametrize("m,k,n", [(64, 48, 96), (37, 19, 45), (8, 1, 32), (130, 257, 33)])
@pytest.mark.parametrize("trans_a", [False, True])
def test_sgemm_matches_numpy(opencl_device, m, k, n, trans_a):
    rng = np.random.default_rng(m * n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = sgemm(opencl_device, np.ascontiguousarray(a.T) if trans_a else a, b, trans_a=trans_a)
    assert R.rel_err(c, a.astype(np.float64) @ b) <= TOL


def test_copying_path_of_discrete_devices(opencl_device):
    """KERAS_CCT_OPENCL_COPY=1 makes the worker mirror the arena in device memory with explicit
    copies (what a discrete GPU gets) instead of zero-copy host buffers: same results."""
    from keras_cct.devices.opencl.client import WorkerClient, parse_opencl_name
    import keras_cct.devices.opencl.conv as conv
    client = WorkerClient(parse_opencl_name(opencl_device), {"KERAS_CCT_OPENCL_COPY": "1"},
                          name=opencl_device)
    x, k, b, kw = _data(CASES[3], 5)
    ref_args = (kw["strides"], kw["padding"], kw["dilation_rate"], kw["groups"])
    ref = R.conv2d(x, k, b, *ref_args)
    dy = np.random.default_rng(6).standard_normal(ref.shape).astype(np.float32)
    rdx, rdk, rdb = R.conv2d_grads(x, k, dy, *ref_args)
    g = conv._plan(x.shape, k.shape, kw["strides"], kw["padding"], kw["dilation_rate"],
                   kw["groups"], "type1")[1]
    try:
        for lowering in ("type1", "type2", "type3"):
            _, out = client.call("conv_forward", {"x": x, "w": k, "b": b},
                                 {"y": (ref.shape, np.float32)}, g=g, lowering=lowering)
            assert R.rel_err(out["y"], ref) <= TOL
            _, out = client.call("conv_backward", {"x": x, "w": k, "dy": dy},
                                 {"dx": (x.shape, np.float32), "dw": (k.shape, np.float32),
                                  "db": (b.shape, np.float32)}, g=g, lowering=lowering)
            assert R.rel_err(out["dx"], rdx) <= TOL
            assert R.rel_err(out["dw"], rdk) <= TOL
            assert R.rel_err(out["db"], rdb) <= TOL
        assert client.request("info")["unified"] is False
    finally:
        client.stop()


def test_clblast_gemm_path(opencl_device):
    """With KERAS_CCT_OPENCL_GEMM=clblast every GEMM (grouped, transposed, with bias, accumulated)
    goes through CLBlast: same results as the own kernel's."""
    import importlib.util
    if importlib.util.find_spec("pyclblast") is None:  # not imported here: it loads pyopencl
        pytest.skip("pyclblast is not installed")
    from keras_cct.devices.opencl.client import WorkerClient, parse_opencl_name
    import keras_cct.devices.opencl.conv as conv
    client = WorkerClient(parse_opencl_name(opencl_device), {"KERAS_CCT_OPENCL_GEMM": "clblast"},
                          name=opencl_device)
    x, k, b, kw = _data(CASES[2], 9)
    ref_args = (kw["strides"], kw["padding"], kw["dilation_rate"], kw["groups"])
    ref = R.conv2d(x, k, b, *ref_args)
    dy = np.random.default_rng(10).standard_normal(ref.shape).astype(np.float32)
    rdx, rdk, rdb = R.conv2d_grads(x, k, dy, *ref_args)
    g = conv._plan(x.shape, k.shape, kw["strides"], kw["padding"], kw["dilation_rate"],
                   kw["groups"], "type1")[1]
    try:
        assert client.request("info")["gemm"] == "clblast"
        for lowering in ("type1", "type2", "type3"):
            _, out = client.call("conv_forward", {"x": x, "w": k, "b": b},
                                 {"y": (ref.shape, np.float32)}, g=g, lowering=lowering,
                                 chunk_bytes=1)
            assert R.rel_err(out["y"], ref) <= TOL
            _, out = client.call("conv_backward", {"x": x, "w": k, "dy": dy},
                                 {"dx": (x.shape, np.float32), "dw": (k.shape, np.float32),
                                  "db": (b.shape, np.float32)}, g=g, lowering=lowering,
                                 chunk_bytes=1)
            assert max(R.rel_err(out["dx"], rdx), R.rel_err(out["dw"], rdk),
                       R.rel_err(out["db"], rdb)) <= TOL
    finally:
        client.stop()


def test_auto_lowering_choice():
    from keras_cct.devices.opencl.conv import choose_lowering
    from keras_cct.lowering.geometry import conv_geometry
    assert choose_lowering(conv_geometry((1, 13, 13, 384), (3, 3, 384, 64), padding=1)) == "type3"
    assert choose_lowering(conv_geometry((1, 13, 13, 64), (3, 3, 64, 384), padding=1)) == "type1"
    assert choose_lowering(conv_geometry((1, 13, 13, 384), (3, 3, 384, 64), strides=2)) == "type1"
    assert choose_lowering(conv_geometry((1, 8, 8, 4), (1, 1, 4, 64))) == "type3"
