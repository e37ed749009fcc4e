"""`streamproc edge --recent 0`: each stream's stored history is read first, its own ordered consumer
made past it (``ResultSource._read_stored``, ``_split_at_last``).

Where the edge user may not read stored results by subject (``$JS.API.STREAM.MSG.GET`` denied), the
history's read is refused at its first result and reads on with consumers alone, in the read budget
(replay.py ``by_consumer``; until 2026-12-06 the stream fell back to its consumer from where that read
was, outside the budget: ``fall_back``); a stream with no stored result of
its own has its consumer made past the stream's last sequence at once, which nats-py must not take
back to the start on a reset of its ordered consumer (``_attach``: ``_sseq``).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from edge_harness import expected_sse, publish_result, running_edge, started_source
from helpers import connection, rid
from nats_auth import MSG_GET, edge_user_denied

from streamproc.core.wire import ResultInfo
from streamproc.edge.source import core_subscription
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

# The edge user may do everything but read a stored result by subject.
NO_STORED_READS = edge_user_denied(MSG_GET)
OTHERS = 4  # another request's results stored first: the stream's last sequence is past 1
AFTER = 5  # results published once the stream is open


def body(seq: int) -> bytes:
    return b'{"text":"%d"}' % seq


async def read_all(client: httpx.AsyncClient, request_id: str, opened: asyncio.Event) -> bytes:
    async with client.stream("GET", f"/v1/results/{request_id}") as response:
        assert response.status_code == 200, await response.aread()
        opened.set()
        return b"".join([chunk async for chunk in response.aiter_raw()])


@pytest.mark.parametrize("stored", [0, 3, 40])
async def test_where_stored_reads_are_refused_every_result_arrives_once_in_order(stored):
    """``stored`` results of the request are in the stream before its open, 5 more are published
    after: the client gets seqs 0 to ``stored`` + 4 once each, in order, then ``[DONE]``. With a
    history, its read by subject is refused and the stream reads it with consumers alone instead
    (``stored_results_unreadable``); without one no read is asked and the consumer starts past the
    stream's last sequence (the other request's results are not its)."""
    subjects = Subjects("recent0refused")
    request_id, other = rid("refused"), rid("other")
    with EmbeddedNats(config=NO_STORED_READS) as server:
        url = server.url.replace("nats://", "nats://edge:edge@")
        with running_edge(url, "--prefix", subjects.prefix, "--ensure-results-stream", "--recent", "0") as edge:
            async with connection(url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
                for seq in range(OTHERS):
                    await publish_result(nc, subjects, other, seq, body(seq), acked=True)
                for seq in range(stored):
                    await publish_result(nc, subjects, request_id, seq, body(seq), acked=True)
                opened = asyncio.Event()
                reader = asyncio.create_task(read_all(client, request_id, opened))
                await asyncio.wait_for(opened.wait(), 30)
                await asyncio.sleep(0.5)  # its split asked and its consumer made: the rest are live
                total = stored + AFTER
                for seq in range(stored, total):
                    await publish_result(nc, subjects, request_id, seq, body(seq), final=seq == total - 1)
                await nc.flush()
                got = await asyncio.wait_for(reader, 60)
            log = edge.log()
    assert got == expected_sse([body(seq) for seq in range(total)])
    if stored:  # its history's read by subject was refused indeed: read with consumers alone
        assert "event=stored_results_unreadable" in log, log[-2000:]


async def test_a_consumer_made_past_the_history_does_not_replay_it_after_nats_py_resets_it(nats_server):
    """A stream's consumer is made from past the last sequence its history's read covered. nats-py's
    ordered consumer resumes after the last sequence it delivered, 0 until a first result: reset (a
    missed heartbeat) before any live result, it would push the subject's whole history again,
    outside the read budget (the client sees each once: repeats are dropped by seq)."""
    subjects = Subjects("recent0reset")
    request_id = rid("reset")
    async with connection(nats_server.url) as nc, \
            started_source(nats_server.url, subjects, recent=0, ensure_results_stream=True) as source:
        for seq in range(3):
            await publish_result(nc, subjects, request_id, seq, body(seq), acked=True)
        feed = await source.open(request_id)
        seqs = []
        for _ in range(3):  # the history, read in the read budget
            item = await feed.next(10.0)
            assert isinstance(item, ResultInfo), item
            seqs.append(item.seq)
        assert feed.attaching is not None
        await asyncio.wait_for(asyncio.shield(feed.attaching), 10)
        assert feed._sub is not None
        jsi = core_subscription(feed._sub)._jsi
        await jsi.reset_ordered_consumer(jsi._sseq + 1)  # what nats-py's heartbeat check does
        for seq in range(3, 5):
            await publish_result(nc, subjects, request_id, seq, body(seq), final=seq == 4)
        await nc.flush()
        for _ in range(2):
            item = await feed.next(10.0)
            assert isinstance(item, ResultInfo), item
            seqs.append(item.seq)
        assert seqs == [0, 1, 2, 3, 4]
        assert feed.order.duplicates == 0  # the history was not pushed again
        await feed.close()
