"""Both distributions build without a warning from the build backend (SPDX license strings, every
package with data declared), and the wheel carries the live page."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ("import sys; from setuptools import build_meta; "
         "print(build_meta.build_wheel(sys.argv[1]))")


def build_warning_free(source: Path, tmp_path: Path) -> Path:
    out = tmp_path / "wheels"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-W", "error", "-c", BUILD, str(out)], cwd=source,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    return out / proc.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(180)
def test_streamproc_builds_without_warnings_and_ships_the_page(tmp_path):
    copy = tmp_path / "src"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "streamproc", copy / "streamproc", ignore=ignore)
    for codec in ("sglang", "vllm"):
        shutil.copytree(ROOT / "codecs" / codec, copy / "codecs" / codec, ignore=ignore)
    wheel = build_warning_free(copy, tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert {"streamproc/edge/page/index.html", "streamproc/edge/page/edge.js"} <= names
    assert "License-Expression: Apache-2.0" in metadata
    # `pip install 'streamproc[otel]'` (docs/operations.md#tracing)
    assert "Provides-Extra: otel" in metadata
    for package in ("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp"):
        assert f'Requires-Dist: {package}>=1.30; extra == "otel"' in metadata


@pytest.mark.timeout(180)
def test_external_codec_builds_without_warnings(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "codecs" / "sglang-zstd", copy,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    wheel = build_warning_free(copy, tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
