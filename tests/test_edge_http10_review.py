"""HTTP/1.0 streams (close-delimited since 9c87462) at the edge's bounds: the stop, the access-token
no-store wrapper beside the access log's redaction."""

from __future__ import annotations

import re
import signal
import socket
import time

import anyio
import pytest

from edge_harness import EdgeProcess, publish_result
from helpers import connection
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = pytest.mark.nats

STOP_WITHIN = 2.0  # as tests/test_edge_shutdown.py


def loud_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if re.search(r"level=(warning|error|critical)", line) and "event=insecure_demo " not in line]


def stuck_http10_stream(port: int, request_id: str) -> tuple[socket.socket, bytes]:
    """An HTTP/1.0 SSE stream on a socket with a 4 KiB receive buffer that will stop reading once
    its head is in: the socket and that head (close-delimited: no Transfer-Encoding)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /v1/results/%s HTTP/1.0\r\nAccept: text/event-stream\r\n\r\n" % request_id.encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert b"transfer-encoding" not in head.lower(), head
    return sock, head


def test_sigterm_cuts_an_http_1_0_stream_whose_client_stopped_reading_as_quickly_as_an_http_1_1_one():
    """The stop's last frame waits FINAL_WRITE_TIMEOUT for a client that stopped reading, then cuts
    it (end_for_stop aborts the transport it finds behind ``send``). Behind close_delimited's wrapped
    ``send`` it found none: an HTTP/1.0 client that stopped reading held the stop past Uvicorn's
    graceful timeout, which logged "timeout graceful shutdown exceeded". A reading HTTP/1.0 client
    beside it gets the stop's error event and ``[DONE]``, unframed."""
    subjects = Subjects()
    with EmbeddedNats(jetstream=False) as server:
        edge = EdgeProcess(server.url, "--log-format", "logfmt").start()
        sock, head = stuck_http10_stream(edge.port, "stuck10")
        try:
            assert head.startswith(b"HTTP/1.1 200"), head

            async def flood_it() -> None:  # far more than the socket buffers and the transport's hold
                async with connection(server.url) as nc:
                    for seq in range(64):
                        await publish_result(nc, subjects, "stuck10", seq, b'{"pad": "%s"}' % (b"x" * 65536))
                    await nc.flush()

            reading = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
            reading.sendall(b"GET /v1/results/reads10 HTTP/1.0\r\nAccept: text/event-stream\r\n\r\n")
            anyio.run(flood_it)
            time.sleep(0.5)
            started = time.monotonic()
            edge.proc.send_signal(signal.SIGTERM)
            assert edge.proc.wait(STOP_WITHIN + 5) == 0
            elapsed = time.monotonic() - started
            log = edge.log()
            ended = b""
            while chunk := reading.recv(65536):
                ended += chunk
            reading.close()
        finally:
            sock.close()
            edge.close()
    assert elapsed < STOP_WITHIN, f"the edge took {elapsed:.2f}s to stop"
    # a reading HTTP/1.0 client beside it gets the stop's error event and [DONE], unframed, then the close
    head, _, body = ended.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"stopping" in body, ended
    assert body.endswith(b"data: [DONE]\n\n"), body
    assert loud_lines(log) == [], "\n".join(loud_lines(log))


def test_an_http_1_0_stream_whose_client_stopped_reading_is_cut_after_write_timeout_and_its_connection_closed():
    """--write-timeout holds for a close-delimited stream as for a chunked one: its write blocks
    (flow control), it is cut --write-timeout after it began, counted as stalled, its slot freed, and
    its connection does not stay open behind it (the protocol's progress check aborts it)."""
    subjects = Subjects()
    with EmbeddedNats(jetstream=False) as server:
        edge = EdgeProcess(server.url, "--log-format", "logfmt", "--write-timeout", "1",
                           "--stream-buffer-bytes", str(256 << 20)).start()
        sock, _ = stuck_http10_stream(edge.port, "stall10")
        try:

            async def flood_it() -> None:
                async with connection(server.url) as nc:
                    for seq in range(64):
                        await publish_result(nc, subjects, "stall10", seq, b'{"pad": "%s"}' % (b"x" * 65536))
                    await nc.flush()

            anyio.run(flood_it)
            deadline = time.monotonic() + 15
            while True:  # (the metrics request is itself a connection open)
                m = edge.metrics()
                if m["streamproc_edge_streams_active"] == 0 and m["streamproc_edge_connections_stalled_total"] == 1:
                    break
                assert time.monotonic() < deadline, {k: v for k, v in m.items() if "stall" in k or "active" in k}
                time.sleep(0.1)
            m = edge.metrics()
            assert m["streamproc_edge_streams_stalled_total"] == 1 and m["streamproc_edge_connections_open"] == 1, m
            log = edge.log()
            assert edge.proc.poll() is None
        finally:
            sock.close()
            edge.close()
    assert "event=stream_stalled" in log
    assert loud_lines(log) == [], "\n".join(loud_lines(log))
