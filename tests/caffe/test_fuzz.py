"""The seeded Caffe-file fuzzer (tests/caffe/fuzz_caffe.py): a few hundred mutated inputs per
file kind; every one loads or raises a typed KerasCCTError -- no other exception, no input over
10 s, no peak-memory growth over 2 GiB. ``python -m tests.caffe.fuzz_caffe --long`` runs
thousands (docs/caffe.md, "Bad input")."""

from __future__ import annotations

import pytest

from tests.caffe import fuzz_caffe
from tests.conftest import need_shared

# per kind: (inputs, needs ../shared). The kinds whose seeds are only keras_cct-written files
# (binaryproto) run everywhere; the others read the real files in ../shared.
CASES = {"prototxt": (240, True), "caffemodel": (200, True), "solverstate": (200, False),
         "binaryproto": (300, False), "solver": (300, True)}


@pytest.mark.parametrize("kind", list(CASES))
def test_fuzzed_files_give_only_typed_errors(kind, tmp_path):
    n, shared = CASES[kind]
    if shared:
        need_shared("caffe-models")
    report = fuzz_caffe.fuzz(n, seed=1234, kinds=(kind,), build_every=4, work=tmp_path)
    counts = report.counts[kind]
    assert sum(counts.values()) == n
    assert counts["untyped"] == 0 and counts["hang"] == 0 and counts["alloc"] == 0, \
        report.text()
    # the mutations reach both outcomes: some inputs are refused, some still load
    assert counts["typed"] >= n // 10 and counts["loaded"] >= n // 20, report.text()


def test_mutations_are_seeded_and_varied():
    import random
    data = b'layer { name: "a" convolution_param { num_output: 20 kernel_size: 5 } }\n' * 3
    a = [fuzz_caffe._mutate_text(data, random.Random(7)) for _ in range(1)]
    b = [fuzz_caffe._mutate_text(data, random.Random(7)) for _ in range(1)]
    assert a == b
    rng = random.Random(0)
    outs = {fuzz_caffe._mutate_text(data, rng) for _ in range(50)}
    assert len(outs) > 30 and data not in outs
    assert any(b"999999999" in o or b"4294967296" in o for o in outs)
    assert any(len(o) < len(data) for o in outs)


def test_detectors_see_untyped_errors_hangs_and_allocations(tmp_path):
    """The fuzzer's outcomes can fail: a bare exception, a hang and a large allocation are
    each reported as such."""
    import time

    import numpy as np

    from keras_cct.errors import CaffeFormatError

    def run(check, **kw):
        seed = fuzz_caffe.Seed("x", "x", b"", check)
        kw = {"time_limit": 2.0, "alloc_limit": 2 << 30, **kw}
        return fuzz_caffe.run_one(seed, b"data", tmp_path / "f", **kw)[0]

    def typed(path):
        raise CaffeFormatError("bad", path=path)

    def bare(path):
        raise ValueError("bad")

    def big(path):
        a = np.ones(48 << 20)  # 384 MiB, touched
        assert a.sum() > 0
    assert run(lambda path: None) == "loaded"
    assert run(typed) == "typed"
    assert run(bare) == "untyped"
    assert run(lambda path: time.sleep(5), time_limit=0.3) == "hang"
    assert run(big, alloc_limit=128 << 20) == "alloc"
    assert run(big) == "loaded"
