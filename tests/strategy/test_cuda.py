"""CCTStrategy with a CUDA GPU on the PyTorch backend (CcT's hybrid: the CPU and the GPU share
each mini-batch): the split gives keras Conv2D's results, in the layer and through model.fit,
and ``split="flops"`` gives the GPU the larger share. Runs where torch sees a GPU; skipped
elsewhere (CI has none). TF32 is switched off so that float32 results compare at 1e-4."""

import keras
import numpy as np
import pytest

from keras_cct import CCTStrategy
from tests import reference as ref
from tests.strategy.test_backends import _data, _model, _pair

BACKEND = keras.backend.backend()


def _has_cuda() -> bool:
    if BACKEND != "torch":
        return False
    import torch
    return torch.cuda.is_available()


pytestmark = pytest.mark.skipif(not _has_cuda(),
                                reason="needs the PyTorch backend and a CUDA GPU")
DEVICES = ["torch:cpu", "torch:cuda:0"]
TOL = 1e-4


@pytest.fixture(autouse=True)
def full_float32():
    """cuDNN and cuBLAS multiply float32 in TF32 by default (10-bit mantissas)."""
    import torch
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _grads(layer, x: np.ndarray, dy: np.ndarray):
    """Output and gradients (input, then each weight) of ``sum(layer(x) * dy)``, computed where
    Keras computes (the GPU), as numpy."""
    import torch
    dev = keras.ops.zeros(()).device
    xt = torch.tensor(x, device=dev, requires_grad=True)
    for w in layer.trainable_weights:
        w.value.grad = None
    y = layer(xt)
    (y * torch.tensor(dy, device=y.device)).sum().backward()
    grads = [xt.grad] + [w.value.grad for w in layer.trainable_weights]
    return y.detach().cpu().numpy(), [g.cpu().numpy() for g in grads]


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_cpu_and_gpu_shards_give_conv2d_results(batch):
    s = CCTStrategy(DEVICES, split=[0.4, 0.6], rebalance=False)
    split, conv = _pair(s, (batch, 13, 13, 8), filters=12, kernel_size=3, padding="same",
                        groups=2)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 13, 13, 8)).astype("float32")
    dy = rng.standard_normal((batch, 13, 13, 12)).astype("float32")
    (y, g), (y0, g0) = _grads(split, x, dy), _grads(conv, x, dy)
    assert ref.rel_err(y, y0) <= TOL
    for a, b in zip(g, g0):
        assert a.shape == b.shape and ref.rel_err(a, b) <= TOL
    rows = s.report()
    assert [r["device"] for r in rows] == ["torch:cpu:0", "torch:cuda:0"]
    expected = list(np.diff(np.round(np.cumsum([0.4, 0.6]) * batch).astype(int), prepend=0))
    assert [r["images"] for r in rows] == expected


def test_flops_split_favours_the_gpu_and_fit_gives_conv2d_weights():
    s = CCTStrategy(DEVICES, split="flops", rebalance=True)
    fr = s.flops_fractions()
    assert fr[1] > fr[0], fr  # calibrated GFLOP/s: the GPU multiplies faster than the CPU
    x, y = _data(24)
    model, baseline = _model(s), _model()
    model.set_weights(baseline.get_weights())
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    baseline.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for u, v in zip(model.get_weights(), baseline.get_weights()):
        assert ref.rel_err(u, v) <= TOL
    rows = s.report()
    assert {r["device"] for r in rows} == {"torch:cpu:0", "torch:cuda:0"}
    images = {d: sum(r["images"] for r in rows if r["device"] == d)
              for d in ("torch:cpu:0", "torch:cuda:0")}
    assert images["torch:cuda:0"] > images["torch:cpu:0"], rows  # the last step's shards


def test_the_cpu_shard_computes_on_the_cpu(monkeypatch):
    """Keras computes on the GPU, so the layer's input lives there: the CPU's shard must be
    copied to the host and computed there (it once ran on the GPU, behind the GPU's shard)."""
    from keras_cct.strategy import _torch
    seen = []
    real = _torch._Shards._compute

    def compute(self, phase, xi, dyi, params, need_dx):
        seen.append((phase, xi.device.type, params[0].device.type))
        return real(self, phase, xi, dyi, params, need_dx)

    monkeypatch.setattr(_torch._Shards, "_compute", compute)
    s = CCTStrategy(DEVICES, split=[0.5, 0.5], rebalance=False)
    split, conv = _pair(s, (6, 9, 9, 4), filters=5, kernel_size=3, padding="same")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 9, 9, 4)).astype("float32")
    dy = rng.standard_normal((6, 9, 9, 5)).astype("float32")
    (y, g), (y0, g0) = _grads(split, x, dy), _grads(conv, x, dy)
    assert ref.rel_err(y, y0) <= TOL and all(ref.rel_err(a, b) <= TOL for a, b in zip(g, g0))
    for phase in ("forward", "backward"):
        assert sorted(dev for p, dev, _ in seen if p == phase) == ["cpu", "cuda"], seen
    assert all(xd == kd for _, xd, kd in seen), seen
