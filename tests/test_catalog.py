"""The codec catalog's memory of codecs that failed to load: a configuration error (a refused
``--format-option`` value, a missing module) is kept for the process's life, anything else (a
``MemoryError`` while importing, an ``OSError`` reading a file) is tried again, at most once per
``retry_after`` seconds of the catalog's clock. Real distributions on ``sys.path``, found through
their entry points as an installed codec is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from streamproc import catalog as discovery
from streamproc.catalog import CODEC_RETRY_SECONDS, Catalog
from streamproc.core.codec import CodecOptions
from streamproc.core.errors import CodecUnavailable
from conftest import CLI
from helpers import clean_env

# {fails}: Python run at import ("import"), or in the constructor ("build"), after it logs the attempt.
CODEC = '''
from pathlib import Path

from streamproc.codec import Codec

ATTEMPTS = Path({attempts!r})
ATTEMPTS.write_text(ATTEMPTS.read_text() + "import\\n" if ATTEMPTS.exists() else "import\\n")
{at_import}


class {cls}(Codec):
    name = {name!r}

    def __init__(self, options=None):
        ATTEMPTS.write_text(ATTEMPTS.read_text() + "build\\n")
        {at_build}
        super().__init__(options)

    def open_session(self):
        raise NotImplementedError

    def fold(self, bodies):
        return bodies[-1]

    def error_body(self, message, kind):
        return message.encode()
'''


class Site:
    """A directory on ``sys.path`` with one installed-looking distribution registering a codec."""

    def __init__(self, root: Path, name: str, *, at_import: str = "", at_build: str = "") -> None:
        self.name = name
        module = name.replace("-", "_")
        self.attempts = root / "attempts.log"
        (root / f"{module}.py").write_text(textwrap.dedent(CODEC).format(
            attempts=str(self.attempts), at_import=at_import, at_build=at_build, cls="FlakyCodec", name=name))
        info = root / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[streamproc.codecs]\n{name} = {module}:FlakyCodec\n")

    def log(self) -> list[str]:
        return self.attempts.read_text().split() if self.attempts.exists() else []


@pytest.fixture
def site(tmp_path, monkeypatch):
    def make(name: str, **failures: str) -> Site:
        made = Site(tmp_path, name, **failures)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name.replace("-", "_"), raising=False)
        discovery.refresh()
        return made

    yield make
    discovery.refresh()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rejected(catalog: Catalog, name: str, times: int = 1) -> str:
    for _ in range(times):
        with pytest.raises(CodecUnavailable) as info:
            catalog(name)
    return str(info.value)


def test_a_codec_whose_constructor_failed_on_a_transient_error_is_built_again_after_the_interval(site):
    """An ``OSError`` reading a file the constructor needs (not there yet): every request naming the
    codec within the interval fails at once without a build (a flood of chunks costs a dict lookup
    each, not a constructor), the first after it builds again, and the codec is used once it builds.
    It stayed unavailable for the process's life."""
    flaky = site("flaky-build", at_build="Path(str(ATTEMPTS) + '.data').read_bytes()")
    clock = Clock()
    catalog = Catalog(clock=clock)
    assert "FileNotFoundError" in rejected(catalog, flaky.name, times=1000)
    assert flaky.log() == ["import", "build"]
    clock.now += CODEC_RETRY_SECONDS - 0.5
    rejected(catalog, flaky.name, times=100)
    assert flaky.log() == ["import", "build"]
    clock.now += 0.5  # the interval has passed: the next request tries again (and fails again)
    rejected(catalog, flaky.name, times=100)
    assert flaky.log() == ["import", "build", "build"]
    Path(str(flaky.attempts) + ".data").write_bytes(b"present")
    rejected(catalog, flaky.name)  # that failure starts a new interval
    clock.now += CODEC_RETRY_SECONDS
    codec = catalog(flaky.name)
    assert codec.name == flaky.name and catalog(flaky.name) is codec
    assert flaky.log() == ["import", "build", "build", "build"]


def test_a_codec_whose_import_failed_on_a_transient_error_is_imported_again_after_the_interval(site):
    """A ``MemoryError`` while its module was imported (the first import only): imported again,
    once, after the interval."""
    flaky = site("flaky-import", at_import="if ATTEMPTS.read_text().count('import') == 1:\n    raise MemoryError")
    clock = Clock()
    catalog = Catalog(clock=clock)
    assert "MemoryError" in rejected(catalog, flaky.name, times=50)
    assert flaky.log() == ["import"]
    clock.now += CODEC_RETRY_SECONDS
    assert catalog(flaky.name).name == flaky.name
    assert flaky.log() == ["import", "import", "build"]


@pytest.mark.parametrize(("failure", "reason"), [
    ("build", "ValueError: format option 'x'"),  # a --format-option value it refuses
    ("type", "TypeError"),
    ("import", "ModuleNotFoundError"),  # a dependency that is not installed
])
def test_a_codec_that_failed_on_a_configuration_error_stays_unavailable_without_being_built_again(
        site, failure, reason):
    """These fail the same way every time: kept for the process's life, never built again."""
    failures = {
        "build": {"at_build": "raise ValueError(\"format option 'x': expected a or b\")"},
        "type": {"at_build": "raise TypeError('options')"},
        "import": {"at_import": "import streamproc_no_such_dependency"},
    }[failure]
    broken = site(f"misconfigured-{failure}", **failures)
    clock = Clock()
    catalog = Catalog(clock=clock)
    assert reason in rejected(catalog, broken.name)
    attempts = broken.log()
    for _ in range(3):
        clock.now += 10 * CODEC_RETRY_SECONDS
        assert reason in rejected(catalog, broken.name, times=10)
    assert broken.log() == attempts


def test_option_keys_no_installed_codec_reads_are_found_and_an_undeclared_codec_is_named(site):
    given = CodecOptions(format_options=(("streaming", "cumulative"), ("streming", "x"), ("zstd_level", "6")))
    keys = discovery.unread_option_keys(given)
    assert keys.unread == ["streming"] and keys.undeclared == []
    assert {"streaming", "zstd_level", "stream_routed_experts"} <= set(keys.read)
    legacy = site("legacy-options")  # a codec written before Codec.option_keys: it may read anything
    keys = discovery.unread_option_keys(given)
    assert keys.unread == ["streming"] and keys.undeclared == [legacy.name]


def test_with_an_undeclared_codec_installed_an_unread_option_key_is_a_warning_not_an_error(site, tmp_path):
    """The command line refuses a key no codec reads only when every installed codec says what it reads."""
    site("legacy-options")
    env = clean_env({"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    proc = subprocess.run([*CLI, "run", "--print-config", "--format-option", "streming=cumulative"],
                          capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "warning: flag --format-option: 'streming' is read by no installed codec" in proc.stderr
    assert "legacy-options do not declare theirs" in proc.stderr
