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


def test_a_device_slowed_during_warm_up_keeps_an_image_and_recovers():
    """Two equal devices at batch 8; the first one's first steps are slow (compilation, a
    busy machine). Its fraction falls under one image (0.05 of 8), where it got no image,
    was never timed again and stayed there. It keeps one image and comes back to half the
    batch."""
    plan = _plan([0.5, 0.5])
    sizes = None
    for step in range(40):
        sizes = plan.next_sizes("forward", False, 8)
        assert sizes[0] >= 1, (step, sizes)
        for i, n in enumerate(sizes):
            slow = 1.0 if (i == 0 and step < PARK_AFTER) else 0.0
            plan.record("forward", i, slow + n * 1e-3)
    assert abs(int(sizes[0]) - 4) <= 1, sizes


def test_every_device_with_a_share_gets_an_image_while_the_batch_has_one_for_each():
    plan = _plan([0.01, 0.01, 0.98])
    assert list(plan.sizes("forward", 8)) == [1, 1, 6]
    assert list(plan.sizes("forward", 2)) == [1, 0, 1]  # batch 2 for 3 devices
    plan.phases["forward"].fractions = np.array([0.0, 0.02, 0.98])  # parked: none
    assert list(plan.sizes("forward", 8)) == [0, 1, 7]
