"""The cost model and the planner (model and measure modes, the on-disk cache)."""

import json
import warnings

import numpy as np
import pytest

from keras_cct.errors import LoweringError, PlannerCacheWarning
from keras_cct.lowering import choose, conv_geometry, cost, planner


def test_gemm_flops_of_type1_equal_the_direct_convolution():
    geo = conv_geometry((8, 27, 27, 96), (5, 5, 48, 256), padding=2, groups=2)
    direct = 2 * 8 * 27 * 27 * 5 * 5 * 48 * 256
    assert cost(geo, "type1", batch=8).gemm_flops == direct
    assert geo.flops(8) == direct


def test_counts_follow_the_definitions():
    # 10x10x4 input, 3x3 kernel, 6 filters, stride 1, pad 1 -> 10x10 output, 12x12 padded.
    geo = conv_geometry((2, 10, 10, 4), (3, 3, 4, 6), padding=1)
    c1, c2, c3 = (cost(geo, t, batch=2) for t in ("type1", "type2", "type3"))
    assert c1.lowering_elements == 2 * 10 * 10 * 9 * 4           # input replicated k*k times
    assert c1.lifting_reads == 0
    assert c2.lowering_elements == 2 * 10 * 12 * 3 * 4           # replicated k times along h
    assert c2.gemm_flops == 2 * (2 * 10 * 12) * (3 * 4) * (3 * 6)
    assert c2.lifting_reads == 3 * 2 * 10 * 10 * 6               # k-way lifting
    assert c3.gemm_flops == 2 * (2 * 12 * 12) * 4 * (9 * 6)      # 1x1 GEMM, k*k*o columns
    assert c3.lifting_reads == 9 * 2 * 10 * 10 * 6               # k*k-way shift-and-add
    assert c3.temp_bytes == 4 * (2 * 12 * 12 * 4 + 2 * 12 * 12 * 9 * 6)


@pytest.mark.parametrize("d, o, expected", [(3, 96, "type1"), (16, 256, "type1"),
                                            (1024, 16, "type3"), (512, 8, "type3")])
def test_model_mode_follows_ccts_rule(d, o, expected):
    # CcT: Type 1 when input channels < output channels, Type 3 when far more.
    assert choose((None, 28, 28, d), (3, 3, d, o), padding=1) == expected


def test_unknown_mode():
    with pytest.raises(LoweringError, match="`mode` must be"):
        choose((1, 8, 8, 4), (3, 3, 4, 4), mode="guess")


def _patch_timer(monkeypatch, fake):
    """The planner's timer answering ``fake(geo, lowering, batch=..., ...)`` per lowering."""
    monkeypatch.setattr(planner, "time_lowerings",
                        lambda geo, lows, **kw: {low: fake(geo, low, **kw) for low in lows})


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_measure_mode_times_each_candidate_once_and_caches(cache_dir, monkeypatch):
    timed = []
    fake = {"type1": 3.0, "type2": 1.0, "type3": 2.0, "native": 4.0, "winograd": 5.0,
            "winograd4": 6.0}

    def fake_time(geo, lowering, **kw):
        timed.append(lowering)
        return fake[lowering]

    _patch_timer(monkeypatch, fake_time)
    args = ((None, 9, 9, 4), (3, 3, 4, 4))
    assert choose(*args, mode="measure") == "type2"
    assert sorted(timed) == sorted(fake)
    assert choose(*args, mode="measure") == "type2"
    assert len(timed) == 6                               # served from the disk cache
    data = json.loads((cache_dir / "planner.json").read_text())
    (entry,) = data["entries"].values()
    assert entry["choice"] == "type2"
    # A different shape is a different key.
    choose((None, 10, 9, 4), (3, 3, 4, 4), mode="measure")
    assert len(timed) == 12


def test_corrupt_or_stale_cache_is_ignored(cache_dir, monkeypatch):
    _patch_timer(monkeypatch, lambda geo, low, **kw: float(low == "type1"))
    (cache_dir / "planner.json").write_text("{not json")
    with pytest.warns(PlannerCacheWarning, match="ignoring the planner cache"):
        assert choose((None, 8, 8, 2), (3, 3, 2, 2), mode="measure") in ("type2", "type3",
                                                                          "native")
    (cache_dir / "planner.json").write_text(json.dumps({"version": -1, "entries": {}}))
    with pytest.warns(PlannerCacheWarning):
        choose((None, 8, 8, 2), (3, 3, 2, 2), mode="measure")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # rewritten: now clean
        choose((None, 8, 8, 2), (3, 3, 2, 2), mode="measure")


def test_real_measurement_returns_a_working_lowering(cache_dir):
    best = choose((2, 8, 8, 4), (3, 3, 4, 4), padding=1, mode="measure")
    assert best in planner.ALL_LOWERINGS


def test_measure_mode_skips_lowerings_that_cannot_fit(cache_dir, monkeypatch):
    timed = []
    _patch_timer(monkeypatch,
                 lambda geo, low, **kw: timed.append(low) or 1.0)
    monkeypatch.setenv("KERAS_CCT_MEMORY_BUDGET", str(200 << 20))
    # CaffeNet conv1 at batch 32: Type 3's lifted matrix alone is 32*227*227*121*96*4 bytes.
    choose((32, 227, 227, 3), (11, 11, 3, 96), strides=4, mode="measure")
    assert "type3" not in timed and "native" in timed


@pytest.mark.parametrize("mode", ["auto", "measure"])
def test_planner_never_returns_a_lowering_unavailable_for_the_shape(cache_dir, monkeypatch,
                                                                     mode):
    # Whatever the timings say, Winograd is not offered for 7x7, strided or dilated kernels,
    # F(2x2) not for 5x5 either, and F(4x4) not in bfloat16 (IMPRECISE).
    _patch_timer(monkeypatch,
                 lambda geo, low, **kw: 0.0 if low.startswith("winograd") else 1.0)
    for kernel, kw in (((7, 7, 64, 64), {}), ((3, 3, 64, 64), {"strides": 2}),
                       ((3, 3, 64, 64), {"dilation_rate": 2}), ((5, 5, 64, 64), {"strides": 2})):
        geo = conv_geometry((32, 27, 27, 64), kernel, padding=2, **kw)
        assert not {"winograd", "winograd4"} & set(planner.available(geo))
        assert not choose((32, 27, 27, 64), kernel, padding=2, mode=mode,
                          **kw).startswith("winograd")
    k5 = (5, 5, 64, 64)
    assert {"winograd", "winograd4"} & set(planner.available(
        conv_geometry((32, 27, 27, 64), k5, padding=2))) == {"winograd4"}
    assert choose((32, 27, 27, 64), k5, padding=2, mode=mode) == "winograd4"
    assert not choose((32, 27, 27, 64), k5, padding=2, mode=mode,
                      dtype="bfloat16").startswith("winograd")
    assert choose((32, 27, 27, 64), (3, 3, 64, 64), padding=1, mode=mode).startswith("winograd")
    assert choose((32, 27, 27, 64), (3, 3, 64, 64), padding=1, mode=mode,
                  dtype="bfloat16") == "winograd"


def test_auto_mode_with_candidates_outside_the_available_ones(cache_dir):
    # Asked for Winograd only on a 5x5 layer: the backend's own convolution, not an error.
    assert choose((None, 9, 9, 4), (5, 5, 4, 4), mode="auto",
                  candidates=["winograd"]) == "native"
    with pytest.raises(LoweringError, match="unknown lowerings"):
        choose((None, 9, 9, 4), (5, 5, 4, 4), mode="auto", candidates=["fft"])


def test_auto_mode_times_large_layers_at_a_smaller_batch():
    conv3 = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    assert planner.auto_batch(conv3, 32) == 6           # 0.9 GFLOP f+b per image
    assert planner.auto_batch(conv3, 4) == 4            # never more than the real batch
    vgg = conv_geometry((None, 224, 224, 64), (3, 3, 64, 64), padding=1)
    assert planner.auto_batch(vgg, 32) == 1             # 11 GFLOP f+b per image
    tiny = conv_geometry((None, 8, 8, 4), (3, 3, 4, 4), padding=1)
    assert planner.auto_batch(tiny, 64) == planner.AUTO_BATCH


def _fake_timer(monkeypatch, table):
    """time_lowering answering ``table[(lowering, batch)]`` (or ``table[lowering]``)."""
    timed = []

    def fake(geo, low, **kw):
        timed.append((low, kw["batch"]))
        return table.get((low, kw["batch"]), table.get(low, 10.0))

    _patch_timer(monkeypatch, fake)
    return timed


def test_auto_mode_keeps_native_unless_another_is_clearly_faster(cache_dir, monkeypatch):
    monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", False)  # a clear lead: no second look
    shape, kernel = (None, 13, 13, 256), (5, 5, 256, 256)     # native and type1 timed
    _fake_timer(monkeypatch, {"native": 1.0, "type1": 1.0 / (1 + planner.NATIVE_MARGIN / 2)})
    assert choose(shape, kernel, padding=2, mode="auto") == "native"
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(cache_dir / "second"))  # a race anew
    _fake_timer(monkeypatch, {"native": 1.0, "type1": 0.5})   # 2x: no second look
    assert choose(shape, kernel, padding=2, mode="auto", batch=64) == "type1"


def _winograd_partitions(monkeypatch):
    """Winograd in cache-sized batch partitions (TensorFlow's; JAX runs the whole batch)."""
    monkeypatch.setattr(planner.B, "WINOGRAD_PARTITIONS", True)
    monkeypatch.setattr(planner.B, "MAX_PARTITIONS", None)


def test_race_batch_where_a_candidate_is_compiled(monkeypatch):
    conv3 = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    conv5 = conv_geometry((None, 13, 13, 384), (3, 3, 192, 256), padding=1, groups=2)
    _winograd_partitions(monkeypatch)
    monkeypatch.setattr(planner.B, "COMPILED", ("winograd", "winograd4"))
    # Winograd in partitions: the fewest whole ones holding auto_batch's images. F(2x2) on
    # 13x13: 16 images of 2.0 MB (16*49*(256+384)*4 bytes) in 32 MB; auto_batch 6 (conv3) and
    # 13 (conv5): one partition, at batch 32 and at 128
    assert planner.auto_batch(conv3, 32) == 6 and planner.auto_batch(conv5, 128) == 13
    assert planner.race_batch(conv3, 32, ("native", "winograd")) == 16
    assert planner.race_batch(conv3, 128, ("native", "winograd")) == 16
    assert planner.race_batch(conv5, 128, ("native", "winograd")) == 16
    # F(4x4) first: 36*16*640*4 bytes an image, 22 images aimed at; the divisor of 32 nearest
    # by ratio is 16 (1.375 where 32 is 1.45), the partition the layer runs
    assert planner.race_batch(conv3, 32, ("native", "winograd4", "winograd")) == 16
    # conv4: 2.4 MB an image (16*49*768*4), 13 aimed at; of the divisors, 16 for 32 and 128
    # (1.23 by ratio, 8 1.63), 12 for 48 (1.08), 13 for 39; auto_batch's 8 images take one
    conv4 = conv_geometry((None, 13, 13, 384), (3, 3, 192, 384), padding=1, groups=2)
    assert planner.auto_batch(conv4, 32) == 8
    for batch, race in ((32, 16), (128, 16), (48, 12), (39, 13)):
        assert planner.race_batch(conv4, batch, ("native", "winograd")) == race
    # one image a partition (VGG16's conv3_1 at batch 8): auto_batch's 1
    vgg = conv_geometry((None, 56, 56, 128), (3, 3, 128, 256), padding=1)
    assert planner.race_batch(vgg, 8, ("native", "winograd")) == 1
    # a batch inside one partition: the layer's batch (7 GFLOP f+b)
    assert planner.race_batch(conv3, 8, ("native", "winograd")) == 8
    # no partitions: the layer's batch (29 GFLOP f+b at 32); above 48 GFLOP (115 at 128) the
    # smaller confirmation batch, a single race still
    monkeypatch.setattr(planner.B, "WINOGRAD_PARTITIONS", False)
    assert planner.race_batch(conv3, 32, ("native", "winograd")) == 32
    assert planner.race_batch(conv3, 128, ("native", "winograd")) == \
        planner.confirm_batch(conv3, 128) == 26
    # nothing compiled on the shortlist: the few images of auto_batch
    assert planner.race_batch(conv3, 32, ("native", "type1")) == planner.auto_batch(conv3, 32)
    monkeypatch.setattr(planner.B, "COMPILED", ())
    assert planner.race_batch(conv3, 32, ("native", "winograd")) == planner.auto_batch(conv3, 32)


def test_auto_order_takes_f4x4_first_on_large_planes():
    vgg = conv_geometry((None, 28, 28, 128), (3, 3, 128, 256), padding=1)
    caffenet = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    shortlist = ("type1", "winograd", "native", "winograd4")
    assert planner.auto_order(vgg, shortlist) == ["native", "winograd4", "winograd", "type1"]
    assert planner.auto_order(caffenet, shortlist) == ["native", "winograd", "winograd4",
                                                       "type1"]
    assert planner.auto_order(caffenet, ("native", "type2")) == ["native", "type2"]
    # a first layer: the cost model's type before space-to-depth (the budget may end the race
    # after two candidates; on JAX Type 1 won ResNet-50's and CaffeNet's conv1)
    first = conv_geometry((None, 224, 224, 3), (7, 7, 3, 64), strides=2, padding=3)
    assert planner.auto_order(first, ("space_to_depth", "type1", "native")) == [
        "native", "type1", "space_to_depth"]


def test_auto_mode_races_compiled_candidates_once(cache_dir, monkeypatch):
    """Where Winograd is compiled per shape (TensorFlow's XLA clusters), a close race is not
    timed again at another batch: each batch would compile the clusters again."""
    _winograd_partitions(monkeypatch)
    monkeypatch.setattr(planner.B, "COMPILED", ("winograd", "winograd4"))
    timed = _fake_timer(monkeypatch, {"native": 1.0, "winograd": 0.9, "winograd4": 2.0,
                                      "type1": 2.0, "type2": 2.0, "type3": 2.0})
    assert choose((None, 13, 13, 384), (3, 3, 192, 384), padding=1, groups=2, mode="auto",
                  batch=32) == "winograd"
    # one Winograd partition (13 images of 2.4 MB aimed at, 16 of the batch's 32: auto_batch's
    # 8 images, and a close race): no second race at the confirmation batch (26) either
    assert timed and all(b == 16 for _, b in timed)
    assert len([low for low, _ in timed if low == "native"]) == 1
    timed.clear()
    monkeypatch.setattr(planner.B, "WINOGRAD_PARTITIONS", False)  # the layer's batch
    assert choose((None, 13, 13, 384), (3, 3, 192, 256), padding=1, groups=2, mode="auto",
                  batch=32) == "winograd"
    assert timed and all(b == 32 for _, b in timed)
    assert len([low for low, _ in timed if low == "native"]) == 1


def test_a_close_race_is_timed_again_warm(cache_dir, monkeypatch):
    """``again_if_close``: native and the fastest other within CONFIRM_BELOW get a second set
    of rounds on the steps already made (nothing traced again), the best of both counting;
    far apart, or without it, no second set."""
    made, rounds = [], []
    monkeypatch.setattr(planner, "make_step",
                        lambda geo, low, *a, **k: made.append(low) or (lambda: None))

    def scripted(*answers):
        it = iter(answers)

        def fake(steps, repeats, **kw):
            rounds.append(tuple(steps))
            return dict(next(it))
        monkeypatch.setattr(planner, "interleaved_best", fake)

    geo = conv_geometry((None, 13, 13, 384), (3, 3, 192, 384), padding=1, groups=2)
    lows = ("native", "winograd", "type2")
    scripted({"native": 1.0, "winograd": 1.1, "type2": 3.0}, {"native": 0.9, "winograd": 0.6})
    times = planner.time_lowerings(geo, lows, batch=2, again_if_close=True)
    assert made == list(lows) and rounds == [lows, ("native", "winograd")]
    assert times == {"native": 0.9, "winograd": 0.6, "type2": 3.0}
    for again, first in ((True, {"native": 1.0, "winograd": 0.5}), (False, {"native": 1.0,
                                                                             "winograd": 0.9})):
        made.clear(), rounds.clear()
        scripted(first)
        assert planner.time_lowerings(geo, lows[:2], batch=2, again_if_close=again) == first
        assert rounds == [lows[:2]]
    # mode="auto" asks for it where a candidate is compiled (its clusters), not otherwise
    asked = []
    monkeypatch.setattr(planner, "time_lowerings", lambda geo, lows, **kw: asked.append(
        kw.get("again_if_close")) or {low: 1.0 for low in lows})
    for compiled, batch in ((("winograd",), 32), ((), 16), ((), 4)):  # a cache each
        monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(cache_dir / f"{batch}"))
        monkeypatch.setattr(planner.B, "COMPILED", compiled)
        planner._auto_choice(geo, ("native", "winograd"), "float32", True, batch)
    # uncompiled: at 16 the close race is confirmed at a larger batch instead; at 4 the race
    # is at the layer's whole batch, with no larger one to confirm at
    assert planner.auto_batch(geo, 16) < 16 and planner.auto_batch(geo, 4) == 4
    assert [a for a in asked if a is not None] == [True, False, True]


def test_auto_mode_times_a_close_winner_again_at_a_larger_batch(cache_dir, monkeypatch):
    monkeypatch.setattr(planner.B, "COMPILED", ())  # the backend's Winograd not compiled
    geo = conv_geometry((None, 56, 56, 64), (3, 3, 64, 128), padding=1)
    small, big = planner.auto_batch(geo, 32), planner.confirm_batch(geo, 32)
    assert small < big <= 32
    # Type 2 wins by 15% at `small` images and loses by 30% at `big`: native is kept.
    timed = _fake_timer(monkeypatch, {"native": 1.0, "type2": 0.85, ("type2", big): 1.3,
                                      "winograd": 2.0, "winograd4": 2.0})
    monkeypatch.setattr(planner, "_model_choice", lambda *a: "type2")
    assert choose((None, 56, 56, 64), (3, 3, 64, 128), padding=1, mode="auto") == "native"
    assert sorted(timed[-2:]) == [("native", big), ("type2", big)]
    # ...and is kept from the cache, untimed, afterwards.
    timed.clear()
    assert choose((None, 56, 56, 64), (3, 3, 64, 128), padding=1, mode="auto") == "native"
    assert timed == []


def test_auto_mode_times_a_close_race_again_when_native_leads(cache_dir, monkeypatch):
    """Winograd behind native by 10% at a few images and ahead by 20% at the layer's batch
    (CaffeNet conv4 in bfloat16 on TF: its fixed costs weigh more on a few images): the race
    at the larger batch decides (where Winograd is not compiled per shape)."""
    monkeypatch.setattr(planner.B, "COMPILED", ())
    geo = conv_geometry((None, 13, 13, 384), (3, 3, 192, 384), padding=1, groups=2)
    small, big = planner.auto_batch(geo, 32), planner.confirm_batch(geo, 32)
    assert small < big <= 32
    timed = _fake_timer(monkeypatch, {"native": 1.0, "winograd": 1.1, ("winograd", big): 0.8,
                                      "winograd4": 2.0, "type1": 2.0, "type2": 2.0,
                                      "type3": 2.0})
    assert choose((None, 13, 13, 384), (3, 3, 192, 384), padding=1, groups=2,
                  mode="auto") == "winograd"
    assert sorted(timed[-2:]) == [("native", big), ("winograd", big)]
    # a rival 1.5x behind is not timed again
    timed = _fake_timer(monkeypatch, {"native": 1.0, "winograd": 1.5, ("winograd", big): 0.8,
                                      "winograd4": 2.0, "type1": 2.0, "type2": 2.0,
                                      "type3": 2.0})
    assert choose((None, 13, 13, 384), (3, 3, 192, 384), padding=1, groups=2, mode="auto",
                  batch=64) == "native"
    assert all(b != planner.confirm_batch(geo, 64) for _, b in timed)


def test_auto_mode_times_any_winner_again_where_the_backend_asks(cache_dir, monkeypatch):
    """VGG16 conv4_2 in bfloat16 on PyTorch (2-core Xeon, AMX): Type 1 twice as fast as native
    at 2 images, slower at the layer's 8 (native's per-call costs weigh on a few images). With
    ``CONFIRM_EVERY_WIN`` (PyTorch's) a clear winner is timed again too; without, it is not."""
    monkeypatch.setattr(planner.B, "COMPILED", ())
    geo = conv_geometry((None, 14, 14, 512), (3, 3, 512, 512), padding=1)
    small, big = planner.auto_batch(geo, 8), planner.confirm_batch(geo, 8)
    assert small < big == 8
    fake = {"native": 1.0, "type1": 0.5, ("type1", big): 1.2, ("native", big): 1.0,
            "winograd": 0.9, "winograd4": 2.0, "type2": 2.0, "type3": 2.0}
    for every, choice in ((True, "native"), (False, "type1")):
        monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", every)
        monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(cache_dir / str(every)))
        timed = _fake_timer(monkeypatch, fake)
        monkeypatch.setattr(planner, "_model_choice", lambda *a: "type1")
        assert planner.choose_for(geo, mode="auto", dtype="bfloat16", batch=8) == choice
        assert (sorted(timed[-2:]) == [("native", big), ("type1", big)]) == every


def test_auto_mode_leaves_winograd_out_for_few_input_channels(cache_dir, monkeypatch):
    timed = []
    _patch_timer(monkeypatch, lambda geo, low, **kw: timed.append(low) or 1.0)
    # VGG16 conv1_1: 3 input channels -- the transforms cost more than the GEMM they shrink
    choose((None, 112, 112, 3), (3, 3, 3, 64), padding=1, mode="auto")
    assert timed and not any(t.startswith("winograd") for t in timed)
    timed.clear()
    choose((None, 56, 56, planner.WINOGRAD_MIN_CHANNELS), (3, 3, 16, 64), padding=1,
           mode="auto")
    assert "winograd" in timed
    # ...and a user may still ask for it by name
    assert choose((None, 112, 112, 3), (3, 3, 3, 64), padding=1, mode="auto",
                  candidates=["winograd"]) == "winograd"


def _slow_steps(monkeypatch, warmup_s, call_s):
    """``make_step`` replaced: each candidate's first call (its compilation) takes
    ``warmup_s[lowering]`` seconds of a fake clock, every later call ``call_s[lowering]``."""
    clock = {"now": 0.0}
    started = []
    monkeypatch.setattr(planner.time, "perf_counter", lambda: clock["now"])

    def make_step(geo, low, x, k, **kw):
        started.append((low, x.shape[0]))
        calls = []

        def step():
            clock["now"] += warmup_s.get(low, 0.1) if not calls else call_s[low]
            calls.append(1)
        return step

    monkeypatch.setattr(planner, "make_step", make_step)
    return started


def test_auto_mode_starts_no_candidate_once_its_budget_is_spent(cache_dir, monkeypatch):
    """The first use of a shape stays near AUTO_BUDGET_S: counted from the backend's own
    convolution's compilation (which keras Conv2D pays as well), no further candidate is
    compiled once it is spent; what was compiled is timed and may still win."""
    monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", False)  # the race alone
    geo = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    budget = planner.AUTO_BUDGET_S
    started = _slow_steps(monkeypatch, {"native": 5.0, "winograd4": 0.7 * budget,
                                        "winograd": 0.4 * budget},
                          {"native": 0.010, "winograd4": 0.004, "winograd": 0.005,
                           "type1": 0.001})
    assert planner.choose_for(geo, mode="auto", batch=32) == "winograd4"
    assert [low for low, _ in started] == ["native", "winograd", "winograd4"]
    entry = next(iter(planner._read_cache().values()))
    assert entry["not_timed"] == ["type1"] and entry["choice"] == "winograd4"
    # a larger budget times them all (and type1, the fastest, wins)
    monkeypatch.setenv("KERAS_CCT_PLAN_BUDGET", "100")
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(cache_dir / "second"))  # a race anew
    started.clear()
    assert planner.choose_for(geo, mode="auto", batch=16) == "type1"
    assert {low for low, _ in started} == {"native", "winograd4", "winograd", "type1"}



def test_auto_mode_ends_the_race_before_a_second_winograd_that_would_overrun_the_budget(
        cache_dir, monkeypatch):
    """A second Winograd is not started, nor anything after it, where its compilation, as long
    as it took in the races already cached for this backend, device, dtype and grouping,
    would end past the budget; the first alternative is started whatever its record says."""
    monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", False)  # the race alone
    budget = planner.AUTO_BUDGET_S
    started = _slow_steps(monkeypatch, {"native": 5.0, "winograd": 0.3 * budget,
                                        "winograd4": 0.9 * budget, "type1": 0.05 * budget},
                          {"native": 0.010, "winograd4": 0.004, "winograd": 0.005,
                           "type1": 0.003})
    first = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    # nothing recorded yet: started in order until the budget is spent
    assert planner.choose_for(first, mode="auto", batch=32) == "winograd4"
    assert [low for low, _ in started] == ["native", "winograd", "winograd4"]
    entry = next(iter(planner._read_cache().values()))
    assert entry["start"]["seconds"] == pytest.approx(
        {"native": 5.0, "winograd": 0.3 * budget, "winograd4": 0.9 * budget})
    where = planner._start_where(first, "float32")
    assert planner.expected_start_s(planner._read_cache(), where)["winograd4"] == \
        pytest.approx(0.9 * budget)
    # another ungrouped shape: F(4x4) would end at 1.2 budgets -- the race ends before it
    started.clear()
    second = conv_geometry((None, 13, 13, 384), (3, 3, 384, 384), padding=1)
    assert planner.choose_for(second, mode="auto", batch=32) == "winograd"
    assert [low for low, _ in started] == ["native", "winograd"]
    [entry] = [e for e in planner._read_cache().values() if e["choice"] == "winograd"]
    assert entry["not_timed"] == ["winograd4", "type1"]
    # a grouped layer has no record: a second Winograd is expected to take as long as the
    # first did in this race (0.3 budgets), and starts
    started.clear()
    grouped = conv_geometry((None, 13, 13, 384), (3, 3, 192, 384), padding=1, groups=2)
    planner.choose_for(grouped, mode="auto", batch=32)
    assert [low for low, _ in started][:3] == ["native", "winograd", "winograd4"]
    # and the first alternative starts whatever its record says (F(4x4) first from 28x28)
    monkeypatch.setenv("KERAS_CCT_PLAN_BUDGET", str(0.5 * budget))
    started.clear()
    third = conv_geometry((None, 28, 28, 128), (3, 3, 128, 256), padding=1)
    planner.choose_for(third, mode="auto", batch=8)
    assert [low for low, _ in started] == ["native", "winograd4"]

def test_auto_mode_without_a_record_expects_a_second_winograd_to_start_as_the_first_did(
        cache_dir, monkeypatch):
    """On an empty cache, a second Winograd is not started where the first one's start in this
    race, added to the time spent, overruns the budget (their compilations take about as long:
    TensorFlow, CaffeNet's conv3 at 16 images, 0.93 and 0.95 s); a recorded start, where there
    is one, is what counts."""
    monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", False)  # the race alone
    budget = planner.AUTO_BUDGET_S
    warmup = {"native": 5.0, "winograd": 0.6 * budget, "winograd4": 0.1 * budget}
    started = _slow_steps(monkeypatch, warmup, {"native": 0.010, "winograd4": 0.004,
                                                "winograd": 0.005, "type1": 0.006})
    geo = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    assert planner.choose_for(geo, mode="auto", batch=32) == "winograd"
    assert [low for low, _ in started] == ["native", "winograd"]
    [entry] = planner._read_cache().values()
    assert entry["not_timed"] == ["winograd4", "type1"]
    # a record of F(4x4)'s start (0.1 budgets, from another shape's race) is what counts
    where = planner._start_where(geo, "float32")
    entries = planner._read_cache()
    entries["other"] = {"start": {"where": where, "seconds": {"winograd4": 0.1 * budget}}}
    planner._write_cache(entries)
    started.clear()
    wider = conv_geometry((None, 13, 13, 384), (3, 3, 384, 384), padding=1)
    assert planner.choose_for(wider, mode="auto", batch=32) == "winograd4"
    assert [low for low, _ in started][:3] == ["native", "winograd", "winograd4"]


def _calls(monkeypatch, call_s):
    """``make_step`` replaced as in :func:`_slow_steps`, counting each candidate's calls."""
    counts = {}
    clock = {"now": 0.0}
    monkeypatch.setattr(planner.time, "perf_counter", lambda: clock["now"])

    def make_step(geo, low, x, k, **kw):
        counts[low] = 0

        def step():
            clock["now"] += call_s[low]
            counts[low] += 1
        return step

    monkeypatch.setattr(planner, "make_step", make_step)
    return counts


def test_race_gives_short_calls_more_rounds(monkeypatch):
    """Three rounds at least; more while a candidate has under min_timed_s of timed calls,
    at most max_rounds (the warm-up call is not timed)."""
    geo = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    counts = _calls(monkeypatch, {"native": 0.002, "winograd": 0.004})
    times = planner.time_lowerings(geo, ("native", "winograd"), batch=2, repeats=3,
                                   min_timed_s=0.049, max_rounds=40)
    # native needs 25 timed calls of 2 ms to pass 0.049 s (winograd 13 of 4 ms)
    assert counts == {"native": 1 + 25, "winograd": 1 + 25}
    assert times == pytest.approx({"native": 0.002, "winograd": 0.004})
    counts = _calls(monkeypatch, {"native": 0.002, "winograd": 0.004})
    planner.time_lowerings(geo, ("native", "winograd"), batch=2, repeats=3,
                           min_timed_s=0.05, max_rounds=10)
    assert counts == {"native": 11, "winograd": 11}
    counts = _calls(monkeypatch, {"native": 0.030, "winograd": 0.040})
    planner.time_lowerings(geo, ("native", "winograd"), batch=2, repeats=3,
                           min_timed_s=0.05, max_rounds=10)
    assert counts == {"native": 4, "winograd": 4}
    # the planner's constants allow more rounds than AUTO_REPEATS
    assert planner.AUTO_MIN_TIMED_S > 0 and planner.AUTO_MAX_ROUNDS > planner.AUTO_REPEATS


def test_race_drops_candidates_far_behind(monkeypatch):
    """With drop_behind, a candidate that far behind the leader after a round is timed no more
    (its best kept); one left ends the race; candidates within the factor run every round."""
    geo = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    calls = {"native": 0.306, "winograd": 0.192, "winograd4": 0.158}
    counts = _calls(monkeypatch, calls)
    times = planner.time_lowerings(geo, tuple(calls), batch=8, repeats=3, drop_behind=1.5)
    assert counts == {"native": 1 + 1, "winograd": 1 + 3, "winograd4": 1 + 3}
    assert times == pytest.approx(calls)
    counts = _calls(monkeypatch, {"native": 0.1, "winograd": 0.2})
    planner.time_lowerings(geo, ("native", "winograd"), batch=8, repeats=3, drop_behind=1.5)
    assert counts == {"native": 1 + 1, "winograd": 1 + 1}
    counts = _calls(monkeypatch, calls)                   # without it: every round for all
    planner.time_lowerings(geo, tuple(calls), batch=8, repeats=3)
    assert counts == {low: 1 + 3 for low in calls}
    # one candidate alone still gets its rounds
    counts = _calls(monkeypatch, {"native": 0.1})
    planner.time_lowerings(geo, ("native",), batch=8, repeats=3, drop_behind=1.5)
    assert counts == {"native": 1 + 3}
    assert planner.AUTO_DROP_BEHIND > 1


def test_auto_mode_lowers_1x1_layers_untimed_where_the_backend_says(cache_dir, monkeypatch):
    """On JAX (LOWER_1X1), an ungrouped 1x1 convolution is the cost model's lowered type
    without timing; elsewhere it is timed against the backend's own."""
    from keras_cct.lowering import _backend as B
    timed = []
    _patch_timer(monkeypatch, lambda geo, low, **kw: timed.append(low) or 1.0)
    pick = choose((None, 56, 56, 64), (1, 1, 64, 256), mode="auto")
    small = choose((None, 5, 5, 160), (1, 1, 160, 960), mode="auto", batch=8)  # 61 MFLOP
    assert conv_geometry((8, 5, 5, 160), (1, 1, 160, 960)).flops(8) < planner.AUTO_MIN_FLOPS
    if B.LOWER_1X1:
        assert pick in planner.LOWERED_TYPES and small in planner.LOWERED_TYPES
        assert timed == []
    else:
        assert "native" in timed and small == "native"


def test_auto_mode_takes_the_pick_of_the_same_race_at_another_batch_untimed(cache_dir,
                                                                            monkeypatch):
    """A shape raced at fit's batch is not raced again at a batch whose race would time the
    same images (fit's last partial batch, predict or evaluate at another batch): a race at
    few images, not confirmed, serves every batch that races at those images; a confirmed one
    every batch that confirms at the same larger batch too. Other batches are raced."""
    monkeypatch.setattr(planner.B, "COMPILED", ())
    monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", False)
    geo = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    small, big = planner.auto_batch(geo, 32), planner.confirm_batch(geo, 32)
    assert 4 < small < 8 < big < 32 and planner.confirm_batch(geo, 48) == big
    # a clear lead at `small` images: no confirmation
    timed = _fake_timer(monkeypatch, {"native": 2.0, "winograd": 1.0})
    assert planner.choose_for(geo, mode="auto", batch=32) == "winograd"
    assert {b for _, b in timed} == {small}
    timed.clear()
    assert [planner.choose_for(geo, mode="auto", batch=b) for b in (8, 31, 64)] == \
        ["winograd"] * 3
    assert timed == []
    assert planner.choose_for(geo, mode="auto", batch=4) == "winograd"  # fewer, a clear pick
    assert timed == []
    assert planner.choose_for(geo, mode="auto", batch=2) == "winograd"  # below FEWER_FROM
    assert {b for _, b in timed} == {2}
    # a close race, confirmed at `big`: the same race for 48 images, not for 8
    monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(cache_dir / "close"))
    timed = _fake_timer(monkeypatch, {"native": 1.0, "winograd": 0.9, ("winograd", big): 0.8})
    assert planner.choose_for(geo, mode="auto", batch=32) == "winograd"
    assert ("winograd", big) in timed
    timed.clear()
    assert planner.choose_for(geo, mode="auto", batch=48) == "winograd"
    assert timed == []
    assert planner.choose_for(geo, mode="auto", batch=8) == "winograd"
    assert {("native", 8), ("winograd", 8)} <= set(timed)  # confirmed at 8
    # another dtype or bias is its own race
    timed.clear()
    assert planner.choose_for(geo, mode="auto", batch=32, bias=True) == "winograd"
    assert timed


def test_auto_mode_takes_a_compiled_race_of_enough_images_for_another_batch(cache_dir,
                                                                           monkeypatch):
    """Where the shortlist is compiled (raced at the layer's own batch), a race of at least
    AUTO_BATCH images serves every other batch raced at that many (an evaluate at 16 after a fit
    at 32, a fit at 64); a batch raced at fewer images is raced again."""
    monkeypatch.setattr(planner.B, "COMPILED", ("winograd", "winograd4"))
    monkeypatch.setattr(planner.B, "WINOGRAD_PARTITIONS", False)
    monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", False)
    geo = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    shortlist = ("native", "winograd")
    assert [planner.race_batch(geo, b, shortlist) for b in (32, 16, 64, 2)] == [32, 16, 26, 2]
    timed = _fake_timer(monkeypatch, {"native": 2.0, "winograd": 1.0, ("native", 2): 0.5})
    assert planner.choose_for(geo, mode="auto", batch=32, candidates=shortlist) == "winograd"
    assert {b for _, b in timed} == {32}
    timed.clear()
    assert [planner.choose_for(geo, mode="auto", batch=b, candidates=shortlist)
            for b in (16, 64)] == ["winograd"] * 2
    assert timed == []
    assert planner.choose_for(geo, mode="auto", batch=2, candidates=shortlist) == "native"
    assert {b for _, b in timed} == {2}


def test_auto_mode_takes_a_clear_pick_of_more_images_for_a_few(cache_dir, monkeypatch):
    """A batch raced at FEWER_FROM images or more, fewer than a cached race timed (a predict
    of a few images after fit), takes that race's pick where it is "native" or led "native" by
    CONFIRM_BELOW; after a close race, or below FEWER_FROM, it is raced."""
    monkeypatch.setattr(planner.B, "COMPILED", ())
    monkeypatch.setattr(planner.B, "CONFIRM_EVERY_WIN", False)
    geo = conv_geometry((None, 13, 13, 128), (3, 3, 128, 128), padding=1)
    assert planner.auto_batch(geo, 32) == planner.AUTO_BATCH == 16 and planner.FEWER_FROM == 4
    assert geo.flops(3) > planner.AUTO_MIN_FLOPS  # raced, however few the images
    for fast, close in (("winograd", False), ("native", False), ("winograd", True)):
        monkeypatch.setenv("KERAS_CCT_CACHE_DIR", str(cache_dir / f"{fast}{close}"))
        rival = 1.0 / (planner.CONFIRM_BELOW - 0.1) if close else 0.5
        table = {"native": 1.0, "winograd": rival if fast == "winograd" else 2.0,
                 ("native", 32): 1.0, ("winograd", 32): 0.5}
        timed = _fake_timer(monkeypatch, table)
        assert planner.choose_for(geo, mode="auto", batch=32, candidates=("native", "winograd"))
        timed.clear()
        pick = planner.choose_for(geo, mode="auto", batch=4, candidates=("native", "winograd"))
        assert (timed == []) == (not close), (fast, close)
        assert pick == fast
        timed.clear()
        planner.choose_for(geo, mode="auto", batch=3, candidates=("native", "winograd"))
        assert {b for _, b in timed} == {3}


def test_auto_mode_times_a_layer_with_its_bias_and_caches_it_apart(cache_dir, monkeypatch):
    """A layer with a bias is raced with it (XLA schedules such a step differently); the
    choice is cached per bias, so a layer without one is timed on its own."""
    geo = conv_geometry((None, 13, 13, 256), (3, 3, 256, 384), padding=1)
    seen = []

    def fake(g, low, **kw):
        seen.append(kw.get("bias"))
        faster = "winograd" if kw.get("bias") else "native"
        return 1.0 if low == faster else 2.0

    _patch_timer(monkeypatch, fake)
    assert planner.choose_for(geo, mode="auto", batch=32, bias=True) == "winograd"
    assert seen and all(seen)
    seen.clear()
    assert planner.choose_for(geo, mode="auto", batch=32, bias=False) == "native"
    assert seen and not any(seen)
    seen.clear()
    assert planner.choose_for(geo, mode="auto", batch=32, bias=True) == "winograd"
    assert seen == []  # from the cache


@pytest.mark.parametrize("bias", [False, True])
def test_timing_steps_run_with_and_without_a_bias(bias):
    """make_step's step (the planner's race) runs every kind of lowering with a bias too."""
    from keras_cct.lowering.timing import make_step
    rng = np.random.default_rng(0)
    geo = conv_geometry((2, 9, 9, 8), (3, 3, 8, 16), padding=1)
    x = rng.standard_normal((2, 9, 9, 8)).astype("float32")
    k = rng.standard_normal((3, 3, 8, 16)).astype("float32")
    for low in ("native", "type1", "winograd"):
        step = make_step(geo, low, x, k, bias=bias)
        step()
        step()
