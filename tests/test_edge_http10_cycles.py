"""An HTTP/1.0 stream (close-delimited, connections.close_delimited) that ended leaves no reference
cycle behind, plain and over HTTPS: the wrapper keeps the cycle in its closure and names it as its
``__self__`` (the stop's cut of a client that stopped reading), which must not tie the cycle, the
wrapper and the connection into garbage for the collector (tests/test_edge_cycles.py: chunked ones)."""

from __future__ import annotations

import asyncio
import collections
import gc
import socket
import ssl

import pytest
from edge_harness import publish_result, served_edge, stop_served
from helpers import rid, wait_until
from nats_auth import Certificates

from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

SUBJECTS = Subjects("cycles10")
STREAMS = 12


class Raw:
    """One HTTP/1.0 stream on a plain socket (asyncio's streams keep their own transports in cycles,
    which would be counted with the edge's); over TLS a blocking ``ssl.SSLSocket`` in a worker thread,
    ragged EOFs raised: a close-delimited body must end with TLS close_notify, else its truncation
    could not be told from its end (RFC 9112 section 6.3)."""

    def __init__(self, sock: socket.socket, tls: bool) -> None:
        self.sock, self.tls, self.data = sock, tls, b""

    @classmethod
    async def open(cls, port: int, request_id: str, tls: ssl.SSLContext | None) -> Raw:
        request = f"GET /v1/results/{request_id} HTTP/1.0\r\nAccept: text/event-stream\r\n\r\n".encode()
        if tls is not None:
            def connect() -> socket.socket:
                sock = tls.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                       server_hostname="127.0.0.1", suppress_ragged_eofs=False)
                sock.sendall(request)
                return sock
            raw = cls(await asyncio.to_thread(connect), True)
        else:
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, request)
            raw = cls(sock, False)
        head = await raw.read_until(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower(), head
        return raw

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


@pytest.mark.parametrize("https", [False, True], ids=["http", "https"])
async def test_http_1_0_streams_that_ended_leave_nothing_for_the_garbage_collector(nats_url, client, https,
                                                                                   tmp_path):
    extra: dict[str, object] = {}
    tls = None
    if https:
        certs = Certificates(tmp_path)
        extra = {"tls_cert_file": str(certs.server), "tls_key_file": str(certs.server_key)}
        tls = ssl.create_default_context(cafile=str(certs.ca))
    server, port = await served_edge(nats_url, SUBJECTS, **extra)
    try:
        warm = rid("warm10")
        stream = await Raw.open(port, warm, tls)
        await publish_result(client, SUBJECTS, warm, 0, b'{"t":"w"}', final=True)
        await stream.read_to_close()
        stream.sock.close()
        await asyncio.sleep(0.1)
        gc.collect()
        gc.disable()
        try:
            finished = [rid("done10") for _ in range(STREAMS)]
            left = [rid("left10") for _ in range(STREAMS)]
            opened = {r: await Raw.open(port, r, tls) for r in finished + left}
            for r in finished:  # ended by their final result: the body ends with the close
                await publish_result(client, SUBJECTS, r, 0, b'{"t":"a"}')
                await publish_result(client, SUBJECTS, r, 1, b'{"t":"b"}', final=True)
            for r in finished:
                body = await opened[r].read_to_close()  # close-delimited
                assert b'{"t":"a"}' in body and b'{"t":"b"}' in body and b"[DONE]" in body, body
                opened[r].sock.close()
            for r in left:  # ended by their client's disconnect
                await publish_result(client, SUBJECTS, r, 0, b'{"t":"a"}')
                await opened[r].read_until(b'{"t":"a"}')
                opened[r].sock.close()
            edge = server.config.app.state.edge
            await wait_until(lambda: edge.metrics.streams_active == 0, 5, "every stream ended")
            await asyncio.sleep(0.2)
            del opened, stream
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            found = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    finally:
        await stop_served(server)
    per_connection = {name: n for name, n in found.items() if n >= STREAMS}
    assert per_connection == {}, f"left in reference cycles: {dict(found.most_common(20))}"
