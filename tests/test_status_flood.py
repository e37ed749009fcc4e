"""Found by an attack (2026-12-03): the processor's status server (--http-port) against many connections."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import anyio
import nats
import pytest
from conftest import processor_subprocess
from helpers import clean_env, free_port, scrape, wait_ready

from streamproc.core.wire import FINAL, Subjects, chunk_headers
from streamproc.sim.embedded import stop_process

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]
SUBJECTS = Subjects()


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # a common service default is 1024; smaller = faster


async def test_a_connection_flood_on_the_status_port_does_not_stop_the_processor(nats_url):
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "streamproc.cli", "run", "--nats-url", nats_url,
                                     "--mode", "core", "--http-port", str(port)],
                                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                    env=clean_env(), preexec_fn=_limit_fds)
        try:
            wait_ready(lambda: "event=started" in log_path.read_text(), proc, "run", 20, log_path.read_text)
            socks = []
            for _ in range(400):  # more than the descriptors left; each held without a byte sent
                s = socket.socket()
                s.settimeout(2)
                try:
                    s.connect(("127.0.0.1", port))
                except OSError:
                    s.close()
                    break
                socks.append(s)
            await anyio.sleep(1.0)
            for s in socks:
                s.close()
            await anyio.sleep(6.0)  # every held connection has timed out (5 s) by now
            alive = proc.poll() is None
            log = log_path.read_text()
            assert alive, f"streamproc run exited with {proc.returncode} after a connection flood:\n{log[-3000:]}"
            # the processor still answers chunks and its status server still answers
            nc = await nats.connect(nats_url)
            try:
                sub = await nc.subscribe(SUBJECTS.result("after-flood"))
                await nc.flush()
                await nc.publish(SUBJECTS.chunk("after-flood", "agg"), b'{"text":"x"}',
                                 headers=chunk_headers("after-flood", "agg", 0, final=True))
                msg = await sub.next_msg(timeout=5)
                assert msg.headers[FINAL] == "true"
            finally:
                await nc.close()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
                assert response.status == 200, log[-3000:]
            metrics = scrape(port)  # what the flood cost is counted
            assert metrics["streamproc_http_connections_evicted_total"] + metrics["streamproc_http_accept_errors_total"] > 0
        finally:
            stop_process(proc, 10)


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_sixty_four_idle_connections_do_not_make_healthz_fail(nats_url):
    """Found by a review of the connection bound as first written: it closed every connection past 64
    unread, so 64 sockets that send nothing (re-opened every 5 s) made every /healthz and /readyz probe
    fail, and an orchestrator would restart a healthy processor. A new connection now closes the
    oldest instead."""
    import socket
    import urllib.error

    port = free_port()
    with processor_subprocess(nats_url, "--mode", "core", "--http-port", str(port), "--http-host", "127.0.0.1"):
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        try:
            await anyio.sleep(0.5)

            def probe() -> int | str:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as response:
                        return response.status
                except (urllib.error.URLError, ConnectionError, OSError) as exc:
                    return f"{type(exc).__name__}: {exc}"

            status = await anyio.to_thread.run_sync(probe)
        finally:
            for s in socks:
                s.close()
    assert status == 200, f"/healthz with 64 idle connections open: {status}"
