"""Shared pytest fixtures: the ../shared models folder, CI strictness."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
IN_CI = os.environ.get("CI", "").lower() == "true"

if os.environ.get("KERAS_BACKEND") == "jax":
    # float64 checks need x64; keras' own float32 default is unaffected.
    import jax

    jax.config.update("jax_enable_x64", True)


def need_shared(*parts: str) -> Path:
    """Path under ../shared; skip (or fail under CI=true) when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        msg = (f"{path} is absent: the real Caffe models live in ../shared beside the checkout "
               "(only on the project's machines)")
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def shared_models() -> Path:
    return need_shared("caffe-models")
