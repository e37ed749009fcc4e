"""sglang-zstd is a real external distribution: a copy outside the repository builds, installs,
registers itself through the entry point and passes its own standalone tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "codecs" / "sglang-zstd"


@pytest.fixture(scope="module")
def installed_copy(tmp_path_factory):
    work = tmp_path_factory.mktemp("external")
    copy = work / "sglang-zstd"
    shutil.copytree(SOURCE, copy, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    wheels = work / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(wheels), str(copy)],
        check=True, cwd=work, timeout=120,
    )
    [wheel] = wheels.glob("streamproc_sglang_zstd-*.whl")
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True, cwd=work, timeout=120,
    )
    # Outside the repository: no repo conftest or pyproject applies, and the installed copy comes first.
    env = {**os.environ, "PYTHONPATH": str(target), "STREAMPROC_LAW_EXAMPLES": "64"}
    return copy, wheel, target, env


def test_the_wheel_registers_the_codec_and_worker_entry_points(installed_copy):
    _, wheel, _, _ = installed_copy
    with zipfile.ZipFile(wheel) as zf:
        [ep_file] = [n for n in zf.namelist() if n.endswith("entry_points.txt")]
        entry_points = zf.read(ep_file).decode()
    assert "[streamproc.codecs]" in entry_points and "sglang-zstd = streamproc_sglang_zstd:SGLangZstdCodec" in entry_points
    assert "[streamproc.workers]" in entry_points


def test_the_installed_copy_is_what_the_catalog_discovers(installed_copy):
    copy, _, target, env = installed_copy
    probe = (
        "import streamproc_sglang_zstd, streamproc.catalog as c; "
        "print(streamproc_sglang_zstd.__file__); print(c.codec_class('sglang-zstd').__module__); "
        "print(','.join(c.codec_names()))"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=copy.parent, capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    assert out[0].startswith(str(target))
    assert out[1].startswith("streamproc_sglang_zstd")
    assert "sglang-zstd" in out[2].split(",")


def test_the_standalone_tests_pass_from_the_copy(installed_copy):
    copy, _, _, env = installed_copy
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(copy / "tests")],
        env=env, cwd=copy.parent, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 5, summary
