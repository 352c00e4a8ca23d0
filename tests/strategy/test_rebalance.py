"""The split state's rebalancing on its own (no devices): simulated shard times per image,
fed back as the backends record them."""

from types import SimpleNamespace

import numpy as np

from keras_cct.strategy.core import PARK_AFTER, _LayerPlan


def _plan(fractions, min_fraction=0.02):
    strategy = SimpleNamespace(rebalance=True, smoothing=0.5, max_step=0.1,
                               min_fraction=min_fraction,
                               active=np.ones(len(fractions), bool))
    return _LayerPlan(strategy, "conv", np.asarray(fractions, np.float64))


def _run(plan, batch: int, seconds_per_image, steps: int, overhead=0.0):
    """``steps`` forward steps; device ``i`` takes ``overhead + n * seconds_per_image[i]``."""
    sizes = None
    for _ in range(steps):
        sizes = plan.next_sizes("forward", False, batch)
        for i, n in enumerate(sizes):
            if n > 0:
                plan.record("forward", i, overhead + n * seconds_per_image[i])
    return sizes


def test_a_device_slower_on_one_image_than_the_rest_on_the_batch_is_parked():
    """A CPU beside a GPU (measured on an H200 machine, CaffeNet conv2: 2.5 ms for the CPU's
    one image, 0.73 ms for the GPU's 63): the CPU gets no shard once the layer has warmed up."""
    plan = _plan([0.024, 0.976])
    sizes = _run(plan, 64, [2.5e-3, 0.73e-3 / 63], PARK_AFTER)
    assert sizes[0] >= 1  # not before the warm-up steps
    sizes = _run(plan, 64, [2.5e-3, 0.73e-3 / 63], 3)
    assert list(sizes) == [0, 64]
    assert plan.phases["forward"].fractions[0] == 0.0
    sizes = _run(plan, 64, [2.5e-3, 0.73e-3 / 63], 3)  # and stays parked
    assert list(sizes) == [0, 64]


def test_comparable_devices_are_balanced_not_parked():
    plan = _plan([0.5, 0.5])
    sizes = _run(plan, 32, [1e-3, 2e-3], 30)
    assert abs(int(sizes[0]) - round(32 * 2 / 3)) <= 1, sizes


def test_the_floor_is_one_image_when_min_fraction_would_give_more():
    """Balanced, the slow device's share is 2-3 images of 256 (under min_fraction's 5); the
    floor no longer forces 5 on it."""
    plan = _plan([0.02, 0.98])
    sizes = _run(plan, 256, [1 / 1560, 1 / 172e3], 40)
    assert 1 <= sizes[0] <= 3, sizes
