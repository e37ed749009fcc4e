"""What the edge does per result against what it does per NATS read (docs/benchmarks.md, "Edge CPU per
event, sixth pass"): the fan-out reads each result from its raw header block (no nats-py-shaped
dict), and the direct writes of a read are stamped with one clock read, not one per SSE event; so is the
recent ring's last_seen ("seventh pass")."""

from __future__ import annotations

import asyncio
import time
import types

import pytest
from edge_harness import RawStream, publish_result, served_edge, stop_served
from helpers import rid, wait_until

import streamproc.core.reorder as reorder
import streamproc.edge.direct as direct
import streamproc.edge.fanout as fanout
import streamproc.nats.fast_client as fast_client
from streamproc.wire import Subjects

SUBJECTS = Subjects("perread")
pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]
STREAMS, RESULTS = 5, 8


async def fan_out(server, nc,
                  monkeypatch) -> tuple[int, int, int, int, list[tuple[float, float, float]], int]:
    """Results for streams whose tasks wait, flushed at once (a few per NATS read), each written by
    the fan-out itself: the results written so, ``parse_header_block`` calls, direct.py's clock reads,
    the fan-out's wall-clock reads, and per stream the ring's ``last_seen`` after the flush with the
    wall clock before the flush and after its last event was read, then after the final results (sent
    after that) with the same bounds for them; and the ``SeqOrder.next_in_line`` calls."""
    edge_server, port = await served_edge(server.url, SUBJECTS)
    try:
        edge = edge_server.config.app.state.edge
        ids = [rid(f"pr{i}") for i in range(STREAMS)]
        streams = [await RawStream.open(port, request_id) for request_id in ids]
        await wait_until(lambda: edge.metrics.streams_active == STREAMS, 5, "the streams open")
        await asyncio.sleep(0.2)  # each stream's task parked in its inbox's wait: results go direct

        parsed, clock, wall, in_line = [0], [0], [0], [0]
        parse = fast_client.parse_header_block
        next_in_line = reorder.SeqOrder.next_in_line

        def counted_next_in_line(order: reorder.SeqOrder, result) -> bool:
            in_line[0] += 1
            return next_in_line(order, result)

        def counted_parse(block: bytes):
            parsed[0] += 1
            return parse(block)

        def counted_monotonic() -> float:
            clock[0] += 1
            return time.monotonic()

        def counted_time() -> float:
            wall[0] += 1
            return time.time()

        monkeypatch.setattr(fast_client, "parse_header_block", counted_parse)
        monkeypatch.setattr(direct, "time", types.SimpleNamespace(monotonic=counted_monotonic))
        monkeypatch.setattr(fanout, "time", types.SimpleNamespace(time=counted_time))
        monkeypatch.setattr(reorder.SeqOrder, "next_in_line", counted_next_in_line)
        before = edge.metrics.results_written_directly
        started = time.time()
        for seq in range(RESULTS):
            for request_id in ids:
                await publish_result(nc, SUBJECTS, request_id, seq, b'{"n":%d}' % seq)
        await nc.flush()
        for stream in streams:
            await stream.read_until(b'id: %d\ndata: {"n":%d}\n\n' % (RESULTS - 1, RESULTS - 1))
        written = edge.metrics.results_written_directly - before
        read = time.time()
        monkeypatch.undo()
        seen = [(started, edge.source.recent._entries[request_id].last_seen, read) for request_id in ids]

        for request_id in ids:
            await publish_result(nc, SUBJECTS, request_id, RESULTS, b"end", final=True)
        await nc.flush()
        for stream in streams:
            data = await stream.read_to_close()
            assert data.split(b"\r\n\r\n", 1)[1].count(b"id: ") == RESULTS + 1
            stream.close()
        # The final results came in later reads: stamped anew, not with a stamp left from the flush above
        seen += [(read, edge.source.recent._entries[request_id].last_seen, time.time()) for request_id in ids]
        return written, parsed[0], clock[0], wall[0], seen, in_line[0]
    finally:
        await stop_served(edge_server)


async def test_the_fan_out_reads_results_from_their_raw_header_blocks_without_a_dict(server, nc, monkeypatch):
    written, parsed, *_ = await fan_out(server, nc, monkeypatch)
    assert written == STREAMS * RESULTS
    assert parsed == 0  # result_from_block read every header block


async def test_direct_writes_read_the_clock_once_per_nats_read_not_per_event(server, nc, monkeypatch):
    written, _, clock, *_ = await fan_out(server, nc, monkeypatch)
    assert written == STREAMS * RESULTS
    # A flush of 40 results reaches the edge in a few reads: one clock read for all streams of a read
    assert 1 <= clock < written / 2, (clock, written)


async def test_the_recent_ring_reads_the_clock_once_per_nats_read_and_anew_for_each_read(server, nc,
                                                                                          monkeypatch):
    """The ring's last_seen is the wall clock of the read that brought the result (Fanout.dispatch's
    per-read stamp, cleared at the read's end by ResultSource.run_after_read): taken fewer times than
    results (once per result before), and never older than the flush that published it, so a stamp
    left over from an earlier read (the final results' reads come after the flush's) fails the lower
    bound."""
    written, _, _, wall, seen, _ = await fan_out(server, nc, monkeypatch)
    assert written == STREAMS * RESULTS
    assert 1 <= wall < written / 2, (wall, written)
    for started, last_seen, read in seen:
        assert started <= last_seen <= read, (started, last_seen, read)


async def test_direct_writes_test_the_next_seq_inline_without_calling_next_in_line(server, nc, monkeypatch):
    """``DirectFrames.offer`` reads ``SeqOrder.next_in_line``'s test on the order's fields (one Python
    call per SSE event less: docs/benchmarks.md, "eighth pass"); 40 calls for 40 direct writes before."""
    written, *_, in_line = await fan_out(server, nc, monkeypatch)
    assert written == STREAMS * RESULTS
    assert in_line == 0
