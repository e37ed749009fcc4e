"""An HTTP/1.0 stream (close-delimited, connections.close_delimited) that ended leaves no reference
cycle behind, plain and over HTTPS: the wrapper keeps the cycle in its closure and names it as its
``__self__`` (the stop's cut of a client that stopped reading), which must not tie the cycle, the
wrapper and the connection into garbage for the collector (tests/test_edge_cycles.py: chunked ones)."""

from __future__ import annotations

import asyncio
import collections
import gc
import ssl

import pytest
from edge_harness import RawStream, publish_result, served_edge, stop_served
from helpers import rid, wait_until
from nats_auth import Certificates

from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

SUBJECTS = Subjects("cycles10")
STREAMS = 12


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
        stream = await RawStream.open(port, warm, tls=tls, http10=True)
        await publish_result(client, SUBJECTS, warm, 0, b'{"t":"w"}', final=True)
        await stream.read_to_close()
        stream.sock.close()
        await asyncio.sleep(0.1)
        gc.collect()
        gc.disable()
        try:
            finished = [rid("done10") for _ in range(STREAMS)]
            left = [rid("left10") for _ in range(STREAMS)]
            opened = {r: await RawStream.open(port, r, tls=tls, http10=True) for r in finished + left}
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
