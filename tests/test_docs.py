"""The documentation site builds offline with ``mkdocs build --strict`` (broken links, missing
images or pages left out of the build fail it)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the docs extra")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                               "NO_PROXY": "*", "http_proxy": "http://0.0.0.0:9",
                               "https_proxy": "http://0.0.0.0:9"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("index.html", "quickstart/index.html", "guide/index.html",
                 "architecture/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    assert (site / "images" / "architecture.png").is_file()
    html = (site / "benchmarks" / "index.html").read_text()
    assert "cct bench" in html
    shutil.rmtree(site)
