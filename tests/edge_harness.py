"""Helpers for the edge tests: the edge as a real subprocess (or, where a test must inspect what the
process holds, its app behind its own Uvicorn protocol in the test's process: ``served_edge``),
results published straight to NATS.

Not a test module (no ``test_`` prefix); the edge test modules import from it. Edge-only tests
publish results on ``P.results.<id>`` with the headers a processor would set, so every framing
rule can be pinned without depending on the processor; ``test_edge_processor.py`` adds the
processor in front.
"""

from __future__ import annotations

import asyncio
import time
import contextlib
import json
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import AsyncIterator, Iterator

from helpers import clean_env, free_port, wait_ready, wait_until
import httpx
import uvicorn
from nats.aio.client import Client as NatsClient

from streamproc.edge import settings as edge_settings
from streamproc.edge.app import create_app
from streamproc.edge.server import server_class, server_config
from streamproc.edge.metrics import EdgeMetrics
from streamproc.edge.source import ResultSource
from streamproc.metrics import parse as parse_metrics
from streamproc.sim.embedded import stop_process
from streamproc.wire import SEQ, Result, Subjects, Verdict, result_headers

EDGE = [sys.executable, "-m", "streamproc.edge"]


def demo_flag(command: str) -> list[str]:
    """``edge`` refuses to start without ``--auth-key-file`` unless told ``--insecure-demo``; CLI tests
    that are not about edge authentication (test_edge_auth.py is) pass it for the edge."""
    return ["--insecure-demo"] if command == "edge" else []


class EdgeProcess:
    """``python -m streamproc.edge`` on a free port; ``url`` once ``/healthz`` answers 200.

    Without an ``--auth-key-file`` among ``args`` (or in ``env``) the edge runs with
    ``--insecure-demo``: the tests of framing and limits are not about authentication
    (test_edge_auth.py is). With ``--tls-cert-file`` the URL is ``https://`` and ``ca_file``
    verifies it."""

    def __init__(
        self,
        nats_url: str,
        *args: str,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
        port: int | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.ssl = ssl.create_default_context(cafile=ca_file) if "--tls-cert-file" in args else None
        self.url = f"{'https' if self.ssl else 'http'}://127.0.0.1:{self.port}"
        self.argv = [*(command or EDGE), *args]
        if command is None:
            self.argv += ["--nats-url", nats_url, "--port", str(self.port)]
            if "--auth-key-file" not in args and "STREAMPROC_EDGE_AUTH_KEY_FILE" not in (env or {}):
                self.argv.append("--insecure-demo")
        self.env = clean_env(env)
        self._dir = tempfile.TemporaryDirectory(prefix="streamproc-edge-")
        self.log_path = Path(self._dir.name) / "edge.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, ready_timeout: float = 20.0) -> EdgeProcess:
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=self.env
            )
        try:
            wait_ready(lambda: http_status(f"{self.url}/healthz", self.ssl) == 200, self.proc, "edge", ready_timeout,
                       self.log)
        except AssertionError:
            self.stop()
            raise
        return self

    def stop(self) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        stop_process(proc, 10)
        return proc.returncode

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5, context=self.ssl) as response:
            return parse_metrics(response.read().decode())

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


@contextlib.contextmanager
def running_edge(nats_url: str, *args: str, **kwargs: object) -> Iterator[EdgeProcess]:
    edge = EdgeProcess(nats_url, *args, **kwargs)  # type: ignore[arg-type]
    try:
        yield edge.start()
    finally:
        edge.close()


@contextlib.asynccontextmanager
async def started_source(nats_url: str, subjects: Subjects, *, after_read=None,
                         **overrides: object) -> AsyncIterator[ResultSource]:
    """The edge's NATS side in this process (no HTTP), with the demo's settings and ``overrides``
    (``after_read``: as the edge's ``WriteBatch.flush``, run at the end of each NATS read)."""
    settings = edge_settings.load({}, {"nats_url": nats_url, "prefix": subjects.prefix, "insecure_demo": True,
                                       **overrides})
    source = ResultSource(settings, EdgeMetrics())
    source.after_read = after_read
    await source.start()
    try:
        yield source
    finally:
        await source.stop()


def exchange_until_closed(port: int, request: bytes) -> bytes:
    """``request`` on a new connection to the local ``port``: everything answered until the edge
    closes it (10 s between reads at most)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def http_status(url: str, context: ssl.SSLContext | None = None) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def subscribed_subjects(monitor_url: str) -> list[str]:
    """Every subject the NATS server holds a subscription for (its /subsz monitoring endpoint)."""
    with urllib.request.urlopen(f"{monitor_url}/subsz?subs=1&limit=100000", timeout=5) as response:
        listing = json.loads(response.read())
    return [s["subject"] for s in listing.get("subscriptions_list", [])]


def sent_to_connection(monitor_url: str, name: str) -> tuple[int, int]:
    """Messages and bytes the NATS server has sent the one connection named ``name`` (its /connz
    ``out_msgs``, ``out_bytes``): what the edge was delivered, counted where it is sent."""
    with urllib.request.urlopen(f"{monitor_url}/connz?limit=100000", timeout=5) as response:
        listing = json.loads(response.read())
    [conn] = [c for c in listing.get("connections", []) if c.get("name") == name]
    return conn["out_msgs"], conn["out_bytes"]


async def settled_sent_to_connection(monitor_url: str, name: str, quiet: float = 0.3,
                                     timeout: float = 15.0) -> tuple[int, int]:
    """:func:`sent_to_connection` once it stops growing (two reads ``quiet`` seconds apart agree): a
    baseline taken right after a bulk publish, while the edge's recent ring is still being sent what was
    stored, counts that delivery as the measured step's (under a loaded machine, ~200 16 KiB results)."""
    deadline = time.monotonic() + timeout
    last = sent_to_connection(monitor_url, name)
    while True:
        await asyncio.sleep(quiet)
        now = sent_to_connection(monitor_url, name)
        if now == last:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"the server kept sending {name!r} for {timeout} s: {last} -> {now}")
        last = now


async def read_slowly(response: httpx.Response) -> bytes:
    """An SSE body read 64 KiB at a time with a 10 ms pause after each read: ~6 MiB/s at most."""
    received = bytearray()
    async for chunk in response.aiter_raw(64 * 1024):
        received += chunk
        await asyncio.sleep(0.01)
    return bytes(received)


async def consumers_back_to(js, stream: str, count: int) -> None:
    """Wait (10 s at most) until ``stream`` has ``count`` consumers again: the temporary consumers
    the edge left went (their inactive threshold is 1 s, CONSUMER_LINGER)."""
    async with asyncio.timeout(10):
        while (await js.stream_info(stream)).state.consumer_count != count:
            await asyncio.sleep(0.1)


async def publish_result(
    nc: NatsClient,
    subjects: Subjects,
    request_id: str,
    seq: int,
    body: bytes,
    *,
    final: bool = False,
    verdict: Verdict | None = Verdict.PASSTHROUGH,
    error: str | None = None,
    acked: bool = False,
) -> None:
    """One result exactly as a processor publishes it. ``acked``: through JetStream, returning
    once the results stream stored it (and, nats-server storing one connection's messages in
    order, every result this connection published before it): a STREAM.INFO asked right after a
    core publish and flush may not count the last ones yet (seen 12 times in 30 bursts)."""
    result = Result(request_id, seq, body, final, verdict=verdict, error=error)
    if acked:
        await nc.jetstream().publish(subjects.result(request_id), body, headers=result_headers(result))
        return
    await nc.publish(subjects.result(request_id), body, headers=result_headers(result))


async def ring_read_all(source: ResultSource, nc: NatsClient, timeout: float = 10.0) -> None:
    """Until the edge's recent ring has dispatched every result its stream holds now: a feed opened
    before that gets the rest live by dispatch, and its replay reads less than is stored (a test
    that waited for "stored" alone failed in CI so, 1 run in 20-30 under load)."""
    last = (await nc.jetstream().stream_info(source.fanout.stream)).state.last_seq
    await wait_until(lambda: source.fanout.delivered() >= last, timeout, "the ring dispatched what is stored")


async def publish_results(
    nc: NatsClient,
    subjects: Subjects,
    request_id: str,
    bodies: list[bytes],
    *,
    verdict: Verdict | None = Verdict.PASSTHROUGH,
    flush_every: int = 0,
) -> None:
    """A request's results, the last one final; flushed every ``flush_every`` (a long history of
    large results would otherwise pile up in the client's buffer) and at the end."""
    for seq, body in enumerate(bodies):
        await publish_result(
            nc, subjects, request_id, seq, body, final=seq == len(bodies) - 1, verdict=verdict
        )
        if flush_every and seq % flush_every == flush_every - 1:
            await nc.flush()
    await nc.flush()


def expected_sse(bodies: list[bytes], *, start: int = 0) -> bytes:
    """The exact bytes the edge must send: ``id:`` + ``data:`` per result, then ``[DONE]``.

    A body holding CR or LF bytes (possible in opaque, non-JSON bodies) takes one ``data:`` line per
    line, as the SSE standard requires; every other body is one ``data:`` line of its exact bytes.
    """

    def frame(seq: int, body: bytes) -> bytes:
        lines = re.split(rb"\r\n|\r|\n", body)
        return b"id: %d\n" % seq + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"

    return b"".join(frame(start + i, body) for i, body in enumerate(bodies)) + b"data: [DONE]\n\n"


def sse_view(body: bytes) -> str:
    """What any conforming SSE client (a browser's EventSource included) sees as an event's data:
    the body decoded as UTF-8 (invalid bytes become U+FFFD), line breaks as LF. For a JSON body,
    which is UTF-8 and escapes line breaks inside strings, this is exactly the body."""
    return re.sub(r"\r\n|\r", "\n", body.decode("utf-8", errors="replace"))


def slow_reader(url: str, request_id: str) -> socket.socket:
    """An HTTP client that asks for a stream and then never reads a byte (tiny receive window)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /v1/results/{request_id} HTTP/1.1\r\nHost: edge\r\n\r\n".encode())
    return sock


async def served_edge(nats_url: str, subjects: Subjects, **extra: object):
    """A real edge app (``--insecure-demo``) behind the edge's own Uvicorn protocol, in this process
    (what the process holds can be inspected); answers the server and its port."""
    settings = edge_settings.load({}, {"nats_url": nats_url, "prefix": subjects.prefix, "insecure_demo": True,
                                       "host": "127.0.0.1", "port": 0, **extra})
    app = create_app(settings, tracing=None)
    config = server_config(app, settings)  # as every edge: its protocol, bounds, TLS, client address
    server = server_class()(config)  # the edge's own (its accept pacing and TLS layer)
    config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup()
    return server, server.servers[0].sockets[0].getsockname()[1]


async def stop_served(server: uvicorn.Server) -> None:
    server.should_exit = True
    for listening in server.servers:
        listening.close()
    await server.shutdown()


class RawStream:
    """One SSE stream on a plain socket (asyncio's streams keep their own transports in cycles, which
    would be counted with the edge's). With ``tls`` (a client context) the socket is a blocking
    ``ssl.SSLSocket`` driven from a worker thread, for the same reason."""

    def __init__(self, sock: socket.socket, tls: bool = False) -> None:
        self.sock = sock
        self.tls = tls
        self.data = b""

    @classmethod
    async def open(cls, port: int, request_id: str, accept: str = "text/event-stream",
                   tls: ssl.SSLContext | None = None, http10: bool = False) -> RawStream:
        """The request sent; an SSE stream's head read (a unary answer's comes with its body). With
        ``http10`` an HTTP/1.0 request, whose stream comes close-delimited (no chunks) and, over TLS,
        is read with ragged EOFs raised: its end must be TLS close_notify, else a truncation could
        not be told from the end (RFC 9112 section 6.3)."""
        version_line = "HTTP/1.0\r\n" if http10 else "HTTP/1.1\r\nHost: edge\r\n"
        request = f"GET /v1/results/{request_id} {version_line}Accept: {accept}\r\n\r\n".encode()
        if tls is not None:
            def connect() -> socket.socket:
                sock = tls.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                       server_hostname="127.0.0.1", suppress_ragged_eofs=not http10)
                sock.sendall(request)
                return sock
            stream = cls(await asyncio.to_thread(connect), tls=True)
        else:
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, request)
            stream = cls(sock)
        if accept == "text/event-stream":
            await stream.read_until(b"\r\n\r\n")
            assert stream.data.startswith(b"HTTP/1.1 200 "), stream.data
            assert not http10 or b"transfer-encoding" not in stream.data.lower(), stream.data
        return stream

    async def recv(self) -> bytes:
        if self.tls:
            return await asyncio.to_thread(self.sock.recv, 65536)
        return await asyncio.get_running_loop().sock_recv(self.sock, 65536)

    async def read_until(self, marker: bytes) -> bytes:
        async with asyncio.timeout(10):
            while marker not in self.data:
                chunk = await self.recv()
                assert chunk, self.data
                self.data += chunk
        return self.data

    async def read_to_close(self) -> bytes:
        async with asyncio.timeout(10):
            while chunk := await self.recv():
                self.data += chunk
        return self.data

    def close(self) -> None:
        self.sock.close()


def send_queue(port: int, peer_port: int) -> int | None:
    """Bytes the kernel holds unsent on the edge's side of the connection from ``peer_port``
    (/proc/net/tcp)."""
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            local, remote, _, queues = line.split()[1:5]
            if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) == peer_port:
                return int(queues.split(":")[0], 16)
    return None


async def unread_stream(port: int, request_id: str, headers: str = "") -> socket.socket:
    """A non-blocking socket that asked the local edge at ``port`` for ``request_id``'s SSE stream
    (``headers``: more header lines, each ending in CRLF) and will read none of it (a 4 KiB receive
    buffer: the edge's side fills soon). Returns once the response head came: the edge sends it after
    the stream's feed is open, so results published from then on reach it (before, in core mode, a
    result could go before the subscription and the stream wait for it for good)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, f"GET /v1/results/{request_id} HTTP/1.1\r\nHost: e\r\n{headers}\r\n".encode())
    head = b""
    async with asyncio.timeout(10):
        while b"\r\n\r\n" not in head:
            chunk = await loop.sock_recv(sock, 4096)
            assert chunk, f"the edge closed before its response head: {head!r}"
            head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


async def fill_send_queue(nc: NatsClient, subjects: Subjects, request_id: str, port: int,
                          sock: socket.socket) -> int:
    """Publish 16 kB results of ``request_id`` (its stream read by nobody on ``sock``) until the kernel's
    send queue on the edge's side stops growing: what is published after stays in the edge's transport,
    under its high-water mark (no pause_writing, so no progress check armed). The next seq."""
    last, flat, seq = -1, 0, 0
    peer = sock.getsockname()[1]
    while flat < 2:
        await publish_result(nc, subjects, request_id, seq, b'{"text":"%s"}' % (b"x" * 16000))
        seq += 1
        await asyncio.sleep(0.1)
        queued = send_queue(port, peer)
        flat = flat + 1 if queued and queued == last else 0  # (0 or None: nothing written yet)
        last = queued
        assert seq < 2000, last
    return seq



async def stall_stream(nc: NatsClient, subjects: Subjects, request_id: str, port: int, sock: socket.socket) -> int:
    """:func:`fill_send_queue`, then 8 more 16 kB results (bare ``Streamproc-Seq``): past the edge's
    transport's high-water mark, so the stream's writes pause and its task waits; what comes next is
    held by the edge. The next seq."""
    seq = await fill_send_queue(nc, subjects, request_id, port, sock)
    for _ in range(8):
        await nc.publish(subjects.result(request_id), b'{"text":"%s"}' % (b"x" * 16000), headers={SEQ: str(seq)})
        seq += 1
    await nc.flush()
    await asyncio.sleep(0.5)
    return seq

def slot_answers(port: int) -> bool:
    """A new connection to the local edge gets its ``/healthz`` answered (not the 503 of
    --max-connections)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.startswith(b"HTTP/1.1 200")
