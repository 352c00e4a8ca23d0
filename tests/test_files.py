"""keras_cct._files: atomic writes leave either the old file or the new one, never a part."""

import os

import pytest

from keras_cct._files import atomic_path, atomic_write


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "out.bin"
    atomic_write(target, b"first")
    atomic_write(target, "second")
    assert target.read_bytes() == b"second"
    assert sorted(os.listdir(target.parent)) == ["out.bin"]
    mode = os.stat(target).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


def test_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "model.keras"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(target, suffix=".keras") as tmp:
            assert tmp.endswith(".keras") and os.path.dirname(tmp) == str(tmp_path)
            with open(tmp, "wb") as fh:
                fh.write(b"half")
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.keras"]
