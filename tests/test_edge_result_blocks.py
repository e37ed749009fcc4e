"""Hostile and unusual result header blocks through a real `streamproc edge` subprocess: the fan-out
reads each result straight from its raw header block on the fast path (``result_from_block``) and
from nats-py's dict on the stock one (``result_from_message``); a stream must get the same events,
and ``streamproc_edge_malformed_results_total`` and the ``malformed_result`` lines the same counts,
whichever path and whether the edge reads results live (core) or through its ring (JetStream)."""

from __future__ import annotations

import anyio
import httpx
import pytest
from edge_harness import expected_sse, publish_result, running_edge
from helpers import connection, rid, wait_until

from streamproc.core.wire import FINAL, JOIN, MAX_HEADER_LINES, SEQ
from streamproc.edge.sse import KEEPALIVE
from streamproc.nats import fast_client
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()


def block(*lines: str | bytes) -> bytes:
    return b"NATS/1.0\r\n" + b"".join((ln.encode() if isinstance(ln, str) else ln) + b"\r\n" for ln in lines) + b"\r\n"


# Each breaks the wire contract: counted malformed once (one open stream), never served.
MALFORMED = [
    block(f"{SEQ}: +1"),
    block(f"{SEQ}: -1"),
    block(f"{SEQ}: \u00b2"),  # a unicode digit
    block(f"{SEQ}: \u0661"),
    block(f"{SEQ}: {'9' * 19}"),
    block(f"{SEQ}: 1_0"),
    block(f"{SEQ.lower()}: 1"),  # names are case-sensitive: no seq
    block(f"{SEQ}: 1", f"{FINAL}: TRUE"),
    block(f"{SEQ}: 1", f"{JOIN}: Joined"),
    block(f"{SEQ}: 1", f"{JOIN}: \xa0joined".encode("latin-1")),
    block(f"{SEQ}: 1", f"{SEQ}: x"),  # the last of a repeated name wins
    block(f"{SEQ}: 1\n{FINAL}: true"),  # a bare LF stays inside the value
    block(*[f"{SEQ}: 1"] * (MAX_HEADER_LINES + 1)),
]
# Unusual but within the contract: the last result, seq 1, final, no verdict.
LAST = block(f"{SEQ}: x", f" {SEQ}\t:\t001\x0b", f"{FINAL}:true ", f"{JOIN}:  ", "X-Other: \xff\xfe".encode("latin-1"))


@pytest.mark.parametrize("mode", ["core", "ring"])
@pytest.mark.parametrize("stock", [False, True], ids=["fast-path", "stock-nats-py"])
async def test_hostile_result_blocks_count_and_serve_the_same_on_the_fast_and_the_stock_path(nats_url, stock, mode):
    """Thirteen malformed blocks (signs, unicode and 19 digits in the seq, a name's case, ``TRUE``,
    ``Joined``, a repeated name, a bare LF, a block over ``MAX_HEADER_LINES``) are each counted and
    logged once and never served, and an odd but valid last one (tabs, VT, leading zeros, an empty
    verdict, latin-1 bytes) ends the stream, on either path, live and through the ring's ordered
    consumer. Coverage of a read that held: a raw read taking ``TRUE`` fails the two fast-path cases."""
    env = {fast_client.STOCK_CLIENT_ONLY_ENV: "1"} if stock else None
    args = ["--ensure-results-stream"] if mode == "ring" else []
    request_id = rid(f"blocks-{mode}")
    subject = SUBJECTS.result(request_id).encode()
    bodies = [b'{"text":"0"}', b'{"text":"1"}']
    with running_edge(nats_url, *args, env=env) as edge:
        async with connection(nats_url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            async with client.stream("GET", f"/v1/results/{request_id}") as response:
                await wait_until(lambda: edge.metrics()["streamproc_edge_streams_opened_total"] == 1, 10, "open")
                chunks = response.aiter_bytes()
                body = b""
                with anyio.fail_after(15):  # seq 0 until it is served: the stream reads live
                    while b"[DONE]" not in body and bodies[0] not in body:
                        await publish_result(nc, SUBJECTS, request_id, 0, bodies[0])
                        try:
                            with anyio.fail_after(0.5):
                                body += await chunks.__anext__()
                        except TimeoutError:
                            pass
                await nc.flush()
                for hdr in [*MALFORMED, LAST]:
                    payload = hdr + b'{"text":"forged"}' if hdr is not LAST else hdr + bodies[1]
                    nc._transport.write(b"HPUB %s %d %d\r\n%s\r\n" % (subject, len(hdr), len(payload), payload))
                await nc.flush()
                with anyio.fail_after(15):
                    async for chunk in chunks:
                        body += chunk
            metrics, log = edge.metrics(), edge.log()
    assert body.replace(KEEPALIVE, b"") == expected_sse(bodies), body
    assert metrics["streamproc_edge_malformed_results_total"] == len(MALFORMED), metrics
    assert log.count(" event=malformed_result") == len(MALFORMED), log[-3000:]
