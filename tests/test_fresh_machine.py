"""A fresh machine: `make test` and CI install the browser test's system packages through one
script, and where they cannot be installed the browser test skips loudly instead of failing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-system-deps"


def _path_without_browser(tmp_path: Path) -> str:
    """A PATH with python, bash and the usual tools but no chromium, chromedriver or apt-get."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "env", "id", "make", "cat", "echo"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    (bindir / "python").symlink_to(sys.executable)
    return str(bindir)


def test_make_test_and_ci_run_the_same_install_script() -> None:
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "scripts/install-system-deps" in test_recipe
    assert "scripts/install-system-deps" in (ROOT / ".ci" / "run").read_text()
    assert os.access(SCRIPT, os.X_OK)


def test_every_phony_make_target_has_a_recipe() -> None:
    """A name in ``.PHONY`` without a rule (``laws`` was one) makes ``make <name>`` succeed doing
    nothing, so a newcomer reading the Makefile believes a target exists that runs nothing."""
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    rules = set(re.findall(r"^([A-Za-z][\w-]*):", makefile, re.M))
    assert [name for name in phony if name not in rules] == []


def test_install_script_without_apt_explains_and_succeeds(tmp_path: Path) -> None:
    env = {"PATH": _path_without_browser(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "chromium" in proc.stderr and "chromium-driver" in proc.stderr
    assert "will be skipped" in proc.stderr


def test_install_script_is_silent_when_everything_is_there(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("make", "chromium", "chromedriver"):
        (bindir / tool).write_text("#!/bin/sh\n")
        (bindir / tool).chmod(0o755)
    env = {"PATH": f"{bindir}:{os.path.dirname(shutil.which('bash'))}"}
    proc = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_browser_test_skips_loudly_without_chromium(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": _path_without_browser(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_page_chromium.py",
         "tests/test_fresh_machine.py::test_make_test_and_ci_run_the_same_install_script"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped" in proc.stdout and "failed" not in proc.stdout and "error" not in proc.stdout
    summary = proc.stdout.split("browser test skipped", 1)[1]
    assert "BROWSER TEST SKIPPED: no chromium and chromedriver on PATH" in summary
    assert "scripts/install-system-deps" in summary
