"""A client that leaves frees its stream slot at once, also when the first cancel of its request's
task is lost.

Behind Uvicorn's httptools protocol the connection's loss cancels the request's task itself
(``direct.watch_disconnect``; ``direct.Departure``). Python 3.11's ``asyncio.wait_for`` returns the
awaited reply and drops a cancel that arrives in the same loop pass (a NATS request's reply: a
replay's ``STREAM.MSG.GET``, a consumer's creation): the request then held its slot until its final
result or ``--result-timeout``. ``Departure`` cancels again until the task took it. Real edge app in
this process, real nats-server; the request's wait is replaced by such a ``wait_for``, with its reply
and the connection's loss in one loop pass.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
from edge_harness import RawStream, served_edge, stop_served
from helpers import rid, wait_until
from starlette.responses import Response

from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

SUBJECTS = Subjects("departures")


@pytest.fixture
def anyio_backend():
    return "asyncio"


def reply_and_loss_in_one_pass(server, reply: asyncio.Future) -> None:
    """The awaited reply comes in, and in the same loop pass the client's connection is lost."""
    reply.set_result(None)
    (protocol,) = list(server.server_state.connections)
    protocol.transport.abort()
    type(protocol).connection_lost(protocol, None)  # what the abort's own callback does, one pass later


async def a_wait_whose_cancel_is_lost(server) -> None:
    loop = asyncio.get_running_loop()
    reply = loop.create_future()
    loop.call_later(0.1, reply_and_loss_in_one_pass, server, reply)
    await asyncio.wait_for(reply, 10)  # returns the reply; on Python 3.11 the cancel is gone with it
    await asyncio.sleep(5)  # the final result would come much later


async def assert_the_slot_is_freed_when_the_client_leaves(server, port: int, accept: str) -> None:
    edge = server.config.app.state.edge
    client = await RawStream.open(port, rid("gone"), accept=accept)
    await wait_until(lambda: edge.metrics.streams_active == 1, 5, "the request open")
    await wait_until(lambda: edge.metrics.streams_active == 0, 2, "the slot freed after the client left")
    assert edge.metrics.client_disconnects == 1
    client.close()


async def test_a_unary_client_that_leaves_frees_its_slot_even_when_a_cancel_is_lost(nats_url):
    server, port = await served_edge(nats_url, SUBJECTS)
    try:
        async def unary(feed) -> Response:
            await a_wait_whose_cancel_is_lost(server)
            return Response(b"{}")

        server.config.app.state.edge.unary = unary
        await assert_the_slot_is_freed_when_the_client_leaves(server, port, "application/json")
    finally:
        await stop_served(server)


async def test_an_sse_client_that_leaves_frees_its_slot_even_when_a_cancel_is_lost(nats_url):
    server, port = await served_edge(nats_url, SUBJECTS)
    try:
        edge = server.config.app.state.edge
        frames = edge.frames

        def lossy_frames(feed, **kwargs):
            async def stream():
                await a_wait_whose_cancel_is_lost(server)
                async for frame in frames(feed, **kwargs):
                    yield frame
            return stream()

        edge.frames = lossy_frames
        await assert_the_slot_is_freed_when_the_client_leaves(server, port, "text/event-stream")
    finally:
        await stop_served(server)


async def test_a_stream_with_a_request_pipelined_behind_it_frees_its_slot_when_the_client_leaves(nats_url):
    """Uvicorn tells only the connection's newest request of its loss (``connection_lost``: ``self.cycle``),
    which is the pipelined one once a complete head waits behind the stream: the stream itself never
    heard its client leave and wrote keep-alives into the lost connection, holding its slot, the
    client's share and its subscription for up to ``--result-timeout`` (330 s) of silence, or for
    good while results kept coming. The connection's loss now reaches the request in progress too."""
    server, port = await served_edge(nats_url, SUBJECTS, keepalive=0.2)
    try:
        edge = server.config.app.state.edge
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/results/%s HTTP/1.1\r\nHost: edge\r\n\r\n" % rid("behind").encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")  # complete: queued behind the stream
        await asyncio.sleep(0.3)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # a reset: the client is gone
        await wait_until(lambda: edge.metrics.streams_active == 0, 3, "the slot freed after the client left")
        assert edge.metrics.client_disconnects == 1 and edge.client_streams == {}
    finally:
        await stop_served(server)
