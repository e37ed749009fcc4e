"""Small helpers every kind of test uses: unique request ids, free ports, a clean environment, waiting.

They live here once; the fixtures in ``conftest.py`` and the harnesses (``edge_harness.py``,
``durable_helpers.py``) build on them.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import time
from typing import AsyncIterator, Awaitable, Callable

import anyio
import nats

from streamproc import config


def rid(name: str) -> str:
    """A request id no other test uses, even on a server shared by a module's tests."""
    return f"{name}-{random.randrange(1 << 30):x}"


def free_port() -> int:
    """A local TCP port nothing listens on right now (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without STREAMPROC_* variables (they would leak into a subprocess)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(config.ENV_PREFIX)}
    env.update(extra or {})
    return env


@contextlib.asynccontextmanager
async def connection(url: str) -> AsyncIterator[nats.aio.client.Client]:
    """A plain nats-py connection, closed on exit."""
    nc = await nats.connect(url)
    try:
        yield nc
    finally:
        await nc.close()


def wait_ready(ready: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float,
               log: Callable[[], str] = str, every: float = 0.05) -> None:
    """Poll ``ready`` while ``proc`` runs; AssertionError with ``log()`` if it exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not ready after {timeout}s:\n{log()}")
        time.sleep(every)


async def wait_until(check: Callable[[], Awaitable[bool] | bool], timeout: float, what: str,
                     every: float = 0.05) -> None:
    """Poll ``check`` (sync or async) until it is true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await anyio.sleep(every)


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), for memory bounds under attack."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def peak_rss(pid: int) -> int:
    """Peak resident set size of a live process, in bytes (``VmHWM``)."""
    kib = status_kib(pid, "VmHWM")
    print(f"peak RSS of {pid}: {kib} kB")  # the figure, for `pytest -s`
    return kib * 1024
