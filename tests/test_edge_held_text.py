"""A forger on results subjects against the edge's per-stream bound (``--stream-buffer-bytes``) with
header values that are not ASCII. A held result was charged ``len()`` of its ``Streamproc-Error`` and
``traceparent`` strings, their characters; one character outside Latin-1 makes CPython keep every
character of a ``str`` in 2 or 4 bytes (PEP 393), so ``"\\U0001F600" + "a" * 50_000`` (50,004 bytes on
the wire) was charged ~50 kB and held ~200 kB: each stream held up to 4 x its bound. Real nats-server,
a real edge subprocess, many streams each held just under the bound (behind a missing seq, or for a
reader that reads nothing); the edge's peak RSS (VmHWM, /proc) growth against the documented bound
(N streams x ``--stream-buffer-bytes``) and against the same flood with ASCII values of the same wire
size."""

from __future__ import annotations

import asyncio

import anyio
import httpx
import pytest
from edge_harness import running_edge, stall_stream, unread_stream
from helpers import connection, rid, status_kib

from streamproc.core.wire import ERROR, SEQ, TRACEPARENT
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(300)]

MiB = 1024 * 1024
BOUND = 1 * MiB  # --stream-buffer-bytes under test
STREAMS = 24
PER_STREAM = 20  # 20 x ~50.1 kB charged: just under the bound, so no stream ends and all hold at once
SLACK = 16 * MiB  # the edge's own allocations over the flood (ASCII values: see the printed figures)
VALUES = {
    "ascii": "a" * 50_004,
    "astral": "\U0001F600" + "a" * 50_000,  # 4 + 50,000 bytes in UTF-8: 4 bytes a character in a str
    "bmp": "\u2713" + "a" * 50_001,  # 3 + 50,001: 2 bytes a character
    "invalid-utf8": None,  # one byte 0xff (U+FFFD once decoded: 2 bytes a character) + 50,003 ASCII
}
HEADERS = {"error": ERROR, "traceparent": TRACEPARENT}


async def publish_raw(nc, subject: str, seq: int, name: str, value: str | None) -> None:
    """One empty-body result whose header ``name`` carries ``value``; ``None``: a byte that is no UTF-8."""
    if value is None:  # nats-py encodes str headers as UTF-8: the raw block is sent as HPUB by hand
        block = b"NATS/1.0\r\n%s: %d\r\n%s: \xff%s\r\n\r\n" % (SEQ.encode(), seq, name.encode(),
                                                                   b"a" * 50_003)
        await nc._send_command(b"HPUB %s %d %d\r\n%s\r\n" % (subject.encode(), len(block), len(block), block))
    else:
        await nc.publish(subject, b"", headers={SEQ: str(seq), name: value})


def growth_bound() -> int:
    return STREAMS * BOUND + SLACK


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("value", VALUES)
async def test_many_streams_behind_a_missing_seq_hold_no_more_than_their_bound(nats_server, header, value):
    """24 streams, each with 20 empty results behind a seq 0 that never comes, each result's header
    value 50,004 bytes on the wire: each stream is charged just under its 1 MiB bound, so all hold."""
    subjects = Subjects("heldtext")
    with running_edge(nats_server.url, "--prefix", "heldtext", "--stream-buffer-bytes", str(BOUND),
                      "--gap-timeout", "120", "--max-streams-per-client", "1000") as edge:
        pid = edge.proc.pid
        ids = [rid("text") for _ in range(STREAMS)]
        async with connection(nats_server.url) as nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=120) as client:
            async with anyio.create_task_group() as tg:
                opened = 0

                async def read(request_id: str) -> None:
                    nonlocal opened
                    async with client.stream("GET", f"/v1/results/{request_id}") as response:
                        assert response.status_code == 200
                        opened += 1
                        async for _ in response.aiter_bytes():
                            pass

                for request_id in ids:
                    tg.start_soon(read, request_id)
                with anyio.fail_after(30):
                    while opened < STREAMS:
                        await anyio.sleep(0.05)
                await anyio.sleep(0.5)
                baseline = status_kib(pid, "VmRSS")
                for request_id in ids:
                    for seq in range(1, PER_STREAM + 1):
                        await publish_raw(nc, subjects.result(request_id), seq, HEADERS[header],
                                          VALUES[value])
                    await nc.flush()
                await anyio.sleep(2)
                peak = status_kib(pid, "VmHWM")
                metrics = edge.metrics()
                tg.cancel_scope.cancel()
        grew = (peak - baseline) << 10
        print(f"\nbehind a gap, {header} {value}: VmRSS before {baseline} KiB, VmHWM {peak} KiB, "
              f"grew {grew / MiB:.1f} MiB for {STREAMS} streams of a {BOUND / MiB:.0f} MiB bound")
        assert metrics["streamproc_edge_streams_overrun_total"] == 0  # each held just under its bound
        assert grew < growth_bound(), f"the edge grew by {grew / MiB:.1f} MiB"


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("value", ["ascii", "astral"])
async def test_many_stalled_readers_hold_no_more_than_their_bound(nats_server, header, value):
    """12 streams whose client reads nothing (writes paused): 16 empty results each wait in the
    stream's inbox, charged ~0.8 MiB of the 1 MiB bound. The rest is margin for the 16 kB results
    that stalled the stream: how many of them the transport took before its writes paused, and how
    many wait in the inbox, depends on the machine's load (up to 15 may wait without an overrun)."""
    streams = 12
    per_stream = 16
    subjects = Subjects("heldstall")
    with running_edge(nats_server.url, "--prefix", "heldstall", "--stream-buffer-bytes", str(BOUND),
                      "--write-timeout", "300", "--max-streams-per-client", "1000") as edge:
        pid = edge.proc.pid
        async with connection(nats_server.url) as nc:
            socks, seqs = [], []
            try:
                ids = [rid("stalled") for _ in range(streams)]
                for request_id in ids:
                    socks.append(await unread_stream(edge.port, request_id))
                # Stalled side by side: filling one stream's kernel queue takes ~20 s of paced publishes.
                stalled = await asyncio.gather(*(stall_stream(nc, subjects, request_id, edge.port, sock)
                                                 for request_id, sock in zip(ids, socks)))
                seqs = list(zip(ids, stalled))
                await anyio.sleep(0.5)
                baseline = status_kib(pid, "VmRSS")
                for request_id, seq in seqs:
                    for s in range(seq, seq + per_stream):
                        await publish_raw(nc, subjects.result(request_id), s, HEADERS[header], VALUES[value])
                    await nc.flush()
                await anyio.sleep(2)
                peak = status_kib(pid, "VmHWM")
                metrics = edge.metrics()
            finally:
                for sock in socks:
                    sock.close()
        grew = (peak - baseline) << 10
        print(f"\nstalled readers, {header} {value}: VmRSS before {baseline} KiB, VmHWM {peak} KiB, "
              f"grew {grew / MiB:.1f} MiB for {streams} streams of a {BOUND / MiB:.0f} MiB bound")
        assert metrics["streamproc_edge_streams_overrun_total"] == 0
        assert grew < streams * BOUND + SLACK, f"the edge grew by {grew / MiB:.1f} MiB"
