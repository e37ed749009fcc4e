"""SIGTERM and SIGINT stop `run`, `edge` and `simulate` within 2 s in every state, connecting included.

Each command runs as a real subprocess. "Connecting" is a server that accepts TCP connections and
never speaks (nats-py waits for its INFO line), and a port where nothing listens (nats-py retries);
"running" is a real nats-server with the command doing its normal work (the edge with an open SSE
stream, simulate waiting for results no processor will publish).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from typing import Iterator

import httpx
import pytest

from conftest import CLI
from helpers import clean_env
from edge_harness import free_port, http_status
from streamproc.sim.embedded import EmbeddedNats

pytestmark = pytest.mark.nats

STOP_WITHIN = 2.0


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A TCP listener that never sends NATS's INFO: the client hangs in its connect."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"nats://127.0.0.1:{sock.getsockname()[1]}"


def closed_url() -> str:
    return f"nats://127.0.0.1:{free_port()}"


def command(name: str, url: str, port: int) -> list[str]:
    args = [*CLI, name, "--nats-url", url, "--connect-timeout", "60"]
    if name == "edge":
        args += ["--port", str(port), "--insecure-demo"]
    if name == "simulate":
        args += ["--verify", "--timeout", "60", "--requests", "2"]
    return args


def stop_time(proc: subprocess.Popen, signum: int) -> float:
    started = time.monotonic()
    proc.send_signal(signum)
    try:
        proc.wait(STOP_WITHIN + 3)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return float("inf")
    return time.monotonic() - started


def started(proc: subprocess.Popen, settle: float = 2.5) -> None:
    """Give the interpreter time to import and reach the state under test."""
    time.sleep(settle)
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("target", ["silent-server", "nothing-listening"])
@pytest.mark.parametrize("name", ["run", "edge", "simulate"])
def test_a_signal_stops_a_command_that_is_still_connecting(name, target, signum):
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(silent_server()) if target == "silent-server" else closed_url()
        proc = subprocess.Popen(command(name, url, free_port()), env=clean_env(None), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            started(proc)
            elapsed = stop_time(proc, signum)
            assert elapsed < STOP_WITHIN, f"{name} took {elapsed:.1f}s to stop while connecting"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stderr.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("name", ["run", "edge", "simulate"])
def test_a_signal_stops_a_running_command(name, signum):
    port = free_port()
    with EmbeddedNats(jetstream=False) as server:
        proc = subprocess.Popen(command(name, server.url, port), env=clean_env(None), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            started(proc)
            with contextlib.ExitStack() as stack:
                if name == "edge":  # an SSE client holds a stream open while the edge is told to stop
                    assert http_status(f"http://127.0.0.1:{port}/healthz") == 200
                    client = stack.enter_context(httpx.Client(timeout=10))
                    response = stack.enter_context(client.stream("GET", f"http://127.0.0.1:{port}/v1/results/open-1"))
                    assert response.status_code == 200
                    time.sleep(0.3)
                elapsed = stop_time(proc, signum)
            assert elapsed < STOP_WITHIN, f"{name} took {elapsed:.1f}s to stop while running"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stderr.close()
