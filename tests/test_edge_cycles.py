"""An SSE stream or unary request that ended leaves no reference cycle behind: its objects (the
connection's socket and transport, Uvicorn's request cycle, the feed, its inbox and reorder buffer)
are freed when it ends, not at the next garbage collection.

The edge raises the GC's gen-0 threshold to 50,000 (cli.collect_rarely): a cycle per stream made
every ~1,700 streams a collection that walked them all, ~27 ms each in a durable `latency.py` run
(each a pause of every stream), and kept closed connections' sockets and buffers until then
(docs/benchmarks.md, "Reference cycles per stream"). A real edge app behind the edge's own Uvicorn
protocol, in this process so that the collector's findings can be read; real nats-server; plain HTTP
and HTTPS (``--tls-cert-file``: asyncio's SSL protocol between the socket and Uvicorn).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import socket
import ssl
from typing import Iterator

import pytest
from edge_harness import RawStream, publish_result, served_edge, stop_served
from helpers import rid, wait_until
from nats_auth import Certificates

from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

SUBJECTS = Subjects("cycles")
STREAMS = 12  # per way of ending


@pytest.fixture
def anyio_backend():
    return "asyncio"


def https_settings(https: bool, directory) -> tuple[dict[str, object], ssl.SSLContext | None]:
    """The edge settings for HTTPS with test certificates in ``directory`` and a client context
    that trusts them; nothing and None for plain HTTP."""
    if not https:
        return {}, None
    certs = Certificates(directory)
    return ({"tls_cert_file": str(certs.server), "tls_key_file": str(certs.server_key)},
            ssl.create_default_context(cafile=str(certs.ca)))


def assert_nothing_per_connection(found: collections.Counter[str], connections: int) -> None:
    """No type left ``STREAMS`` times or more: nothing per connection (a one-off, an exception's
    traceback somewhere, is not what these tests pin)."""
    per_connection = {name: n for name, n in found.items() if n >= STREAMS}
    assert per_connection == {}, f"left in reference cycles by {connections} connections: {dict(found.most_common(20))}"


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """A full collection first, then none until the block ends (garbage_by_type reads what is left)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def garbage_by_type() -> collections.Counter[str]:
    """What the collector finds unreachable now (kept, then freed)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = collections.Counter(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


@pytest.mark.parametrize(("jetstream", "https"), [(False, False), (True, False), (False, True)],
                         ids=["core", "jetstream", "https"])
async def test_streams_that_ended_leave_nothing_for_the_garbage_collector(nats_url, client, jetstream, https,
                                                                          tmp_path):
    extra, tls = https_settings(https, tmp_path)  # --tls-cert-file: the edge's TLS layer over the socket transport
    if jetstream:
        extra["ensure_results_stream"] = True
    server, port = await served_edge(nats_url, SUBJECTS, **extra)
    try:
        warm = rid("warm")  # the first open's one-off objects (caches, the ring's consumer) apart
        stream = await RawStream.open(port, warm, tls=tls)
        await publish_result(client, SUBJECTS, warm, 0, b'{"t":"w"}', final=True, acked=jetstream)
        await stream.read_until(b"0\r\n\r\n")
        stream.close()
        await asyncio.sleep(0.1)
        with collector_off():  # nothing collected behind the test's back: what is left is counted below
            finished = [rid("done") for _ in range(STREAMS)]
            left = [rid("left") for _ in range(STREAMS)]
            opened = {r: await RawStream.open(port, r, tls=tls) for r in finished + left}
            for r in finished:  # ended by their final result, through the fan-out's direct writes first
                await publish_result(client, SUBJECTS, r, 0, b'{"t":"a"}', acked=jetstream)
                await publish_result(client, SUBJECTS, r, 1, b'{"t":"b"}', final=True, acked=jetstream)
            for r in finished:
                body = await opened[r].read_until(b"0\r\n\r\n")
                assert b'{"t":"a"}' in body and b'{"t":"b"}' in body, body
                opened[r].close()
            for r in left:  # ended by their client's disconnect
                await publish_result(client, SUBJECTS, r, 0, b'{"t":"a"}', acked=jetstream)
                await opened[r].read_until(b'{"t":"a"}')
                opened[r].close()
            edge = server.config.app.state.edge
            for _ in range(STREAMS):  # unary answers (results published after the open: no replay's
                r = rid("unary")      # consumer, whose nats-py objects are in cycles of their own)
                opened_before = edge.metrics.streams_opened
                unary = await RawStream.open(port, r, accept="application/json", tls=tls)
                await wait_until(lambda: edge.metrics.streams_active == 1 and edge.metrics.streams_opened > opened_before,
                                 5, "the unary request open")
                await publish_result(client, SUBJECTS, r, 0, b'{"t":"a"}', acked=jetstream)
                await publish_result(client, SUBJECTS, r, 1, b'{"t":"b"}', final=True, acked=jetstream)
                body = await unary.read_until(b'"t":"b"')
                assert body.startswith(b"HTTP/1.1 200 "), body
                unary.close()
            for _ in range(200):
                if edge.metrics.streams_active == 0:
                    break
                await asyncio.sleep(0.02)
            assert edge.metrics.streams_active == 0
            await asyncio.sleep(0.2)  # the connections' own teardown (connection_lost, transport close)
            del opened, stream
            found = garbage_by_type()
    finally:
        await stop_served(server)
    # Nothing per stream: the edge's objects (feed, inbox, reorder buffer, direct writer, disconnect
    # watch), Uvicorn's (request cycle, flow control) and asyncio's (transport, socket)
    assert_nothing_per_connection(found, 3 * STREAMS)


@pytest.mark.parametrize("https", [False, True], ids=["http", "https"])
async def test_connections_refused_or_timed_out_before_a_request_leave_nothing_either(nats_url, https, tmp_path):
    """A flood's connections: past ``--max-connections`` (refused: 503 over HTTP, closed at once over
    HTTPS), or admitted and closed at ``--head-timeout`` without a request head (over HTTPS: without
    a finished handshake). Uvicorn's protocol was made for each but, refused or never handshaken,
    not told of its loss, so it kept its parser (which holds it) and, over HTTPS, its TLS layer."""
    extra, _ = https_settings(https, tmp_path)
    server, port = await served_edge(nats_url, SUBJECTS, max_connections=STREAMS, head_timeout=0.5, **extra)
    try:
        with collector_off():
            # Connected while the loop does not run (the kernel completes them): the edge then accepts
            # several per pass and makes each one's protocols before any is told it is connected
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(10 * STREAMS)]
            metrics = server.config.app.state.edge.metrics
            await wait_until(lambda: metrics.connections_refused >= 9 * STREAMS, 5, "the connections past the limit refused")
            await asyncio.sleep(1.5)  # the admitted ones' deadline (0.5 s, swept every 0.125 s)
            for sock in socks:
                sock.close()
            await asyncio.sleep(0.3)
            del socks, sock
            found = garbage_by_type()
    finally:
        await stop_served(server)
    assert_nothing_per_connection(found, 10 * STREAMS)
