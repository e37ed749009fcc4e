"""A dispatched JetStream open's ``STREAM.MSG.GET`` probe, sent at the open and answered in the NATS
read loop (``edge/probes.py``) once MSG.GET is known to answer.

What must hold as when the stream's task asked: a result stored before the open is read before
every dispatched one, none twice; a probe that gets no answer makes that feed read with a consumer
of its own (nothing lost); a feed closed while its probe is out leaves nothing waiting. What
changes: an open with nothing stored costs its reader nothing (no ``nc.request``, no wake-up). The
edge's real ``ResultSource`` on a real nats-server.
"""

from __future__ import annotations

import asyncio

import pytest
from edge_harness import publish_result, started_source
from helpers import rid

from streamproc.core.wire import ResultInfo
from streamproc.edge import source as source_module
from streamproc.edge.feed import Lost
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

STORED = Subjects("probejs")


async def until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def confirmed(source, client) -> None:
    """MSG.GET answered once (the first open asks from its task, guarded: msg_get.py)."""
    await publish_result(client, STORED, rid("other"), 0, b"{}")  # something stored: opens probe
    await client.flush()
    await until(lambda: source.metrics.results_seen >= 1)
    first = await source.open(rid("first"))
    assert await first.next(0.3) is None  # its probe found nothing of its own
    await first.close()
    assert source.msg_get is not None and source.msg_get.confirmed


async def stored(source, client, name: str, results: int) -> str:
    """A new request with ``results`` results stored (seq 0 up) and seen by the ring: its id."""
    request_id = rid(name)
    seen = source.metrics.results_seen
    for seq in range(results):
        await publish_result(client, STORED, request_id, seq, b'{"seq":%d}' % seq)
    await client.flush()
    await until(lambda: source.metrics.results_seen >= seen + results)
    return request_id


async def test_an_open_with_nothing_stored_is_answered_in_the_read_loop_without_its_reader(
        nats_url, client, monkeypatch):
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        await confirmed(source, client)
        requests: list[str] = []
        real = source.nc.request

        def counting(subject, *args, **kwargs):
            requests.append(subject)
            return real(subject, *args, **kwargs)

        monkeypatch.setattr(source.nc, "request", counting)
        tokens: list[str] = []
        ask = source.probes.ask

        async def asking(*args, **kwargs):
            tokens.append(await ask(*args, **kwargs))
            return tokens[-1]

        monkeypatch.setattr(source.probes, "ask", asking)
        ids = [rid(f"new{i}") for i in range(5)]
        feeds = [await source.open(i) for i in ids]
        # one probe each, on reply subjects nobody else can guess (probes.py)
        assert len(set(tokens)) == 5 and all(len(t) == 24 and int(t, 16) >= 0 for t in tokens)
        await until(lambda: all(f.replay is None for f in feeds))  # nobody called next()
        assert requests == [] and source.probes is not None and source.probes._waiting == {}
        for i in ids:  # and they miss nothing published now
            for seq in range(2):
                await publish_result(client, STORED, i, seq, b'{"seq":%d}' % seq, final=seq == 1)
        await client.flush()
        for feed in feeds:
            got = [await feed.next(5.0) for _ in range(2)]
            assert [r.seq for r in got if isinstance(r, ResultInfo)] == [0, 1]
            assert feed.close_now() is None  # no replay left: nothing to await
        assert source.metrics.duplicates_dropped == 0


async def test_a_probe_that_finds_stored_results_wakes_its_reader_and_they_come_before_the_dispatched(
        nats_url, client):
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        await confirmed(source, client)
        request_id = await stored(source, client, "stored", 3)
        feed = await source.open(request_id)
        assert feed.replay is not None and feed.replay.asking
        waiting = asyncio.create_task(feed.next(5.0))  # parked before the answer is in
        for seq in range(3, 6):  # dispatched, maybe while the probe is out: after the stored ones
            await publish_result(client, STORED, request_id, seq, b'{"seq":%d}' % seq, final=seq == 5)
        await client.flush()
        first = await asyncio.wait_for(waiting, 2.0)
        rest = [await feed.next(5.0) for _ in range(5)]
        assert [r.body for r in (first, *rest)] == [b'{"seq":%d}' % seq for seq in range(6)]
        assert source.metrics.duplicates_dropped == 0
        await feed.close()


async def test_a_probe_without_an_answer_makes_that_feed_read_with_its_own_consumer_and_lose_nothing(
        nats_url, client, monkeypatch):
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        await confirmed(source, client)
        request_id = await stored(source, client, "silent", 2)
        monkeypatch.setattr(source_module, "REPLAY_TIMEOUT", 0.3)
        assert source.probes is not None
        monkeypatch.setattr(source.probes, "prefix", source.nc.new_inbox() + ".")  # answers go nowhere
        feed = await source.open(request_id)
        await publish_result(client, STORED, request_id, 2, b'{"seq":2}', final=True)
        await client.flush()
        got = [await feed.next(5.0) for _ in range(3)]
        assert [r.body for r in got] == [b'{"seq":%d}' % seq for seq in range(3)]
        assert source.metrics.streams_fallback == 1  # this feed only: MSG.GET did answer before
        assert source.msg_get.confirmed and source.probes._waiting == {}
        await feed.close()


async def test_a_feed_closed_while_its_probe_is_out_closes_at_once_and_leaves_nothing_waiting(nats_url, client):
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        await confirmed(source, client)
        feed = await source.open(rid("gone"))
        assert feed.replay is not None and feed.replay.asking
        assert feed.close_now() is None
        assert feed.closed and feed.replay is None and source.probes._waiting == {}
        await asyncio.sleep(0.2)  # its answer, if it comes, finds nobody
        assert source.probes._waiting == {}


async def test_a_connection_closed_while_a_probe_is_out_ends_that_stream_as_lost(nats_url, client, monkeypatch):
    """The reader waits for its probe's answer on its inbox; a closed connection there ends the
    stream with ``Lost`` (the response's lost event and ``[DONE]``), as the inbox's own wait does,
    instead of raising ``ConnectionClosedError`` out of ``next()`` (the review found it did)."""
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        await confirmed(source, client)
        monkeypatch.setattr(source.probes, "prefix", source.nc.new_inbox() + ".")  # its answer never comes
        feed = await source.open(rid("closing"))
        assert feed.replay is not None and feed.replay.asking
        waiting = asyncio.ensure_future(feed.next(3.0))
        await asyncio.sleep(0.1)  # parked in its inbox's wait
        await source.nc.close()
        item = await asyncio.wait_for(waiting, 3.0)
        assert isinstance(item, Lost), item
        await feed.close()


async def test_forged_answers_flooding_the_probe_inbox_settle_nothing_and_hold_nothing(nats_url, client):
    """Whoever may publish into the edge's inbox (a worker with a broad permission, a bug) cannot
    answer an open's probe for it: the reply tokens are 12 random bytes. A flood of "nothing stored"
    answers (MSG.GET's own 404) and junk under the probes' prefix, kept up while the opens' probes
    are out, is dropped in the read loop and holds no memory (nothing waits for an unknown token);
    every open with results stored still reads them all, before the dispatched one."""
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        await confirmed(source, client)
        probes = source.probes
        assert probes is not None
        ids = [await stored(source, client, "flooded", 3) for _ in range(10)]
        not_found = b'{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","error":{"code":404,"err_code":10037}}'
        forged = [(probes.prefix + token, body) for token in ("", "*", "0" * 24, "x" * 300, "a.b")
                  for body in (not_found, b"\xff\x00junk", b"")]
        opened = asyncio.Event()

        async def flood() -> None:
            while not opened.is_set():
                for subject, body in forged:
                    await client.publish(subject, body)
                await asyncio.sleep(0)

        flooding = asyncio.create_task(flood())
        feeds = []
        for request_id in ids:
            feeds.append(await source.open(request_id))
            await asyncio.sleep(0.002)  # the flood goes on while this one's probe is out
        opened.set()
        await flooding
        for request_id in ids:
            await publish_result(client, STORED, request_id, 3, b'{"seq":3}', final=True)
        await client.flush()
        for feed in feeds:
            got = [await feed.next(5.0) for _ in range(4)]
            assert [r.body for r in got if isinstance(r, ResultInfo)] == [b'{"seq":%d}' % seq for seq in range(4)]
            await feed.close()
        await until(lambda: probes._waiting == {})
        other = await source.open(rid("after"))  # the connection and its probes still serve everyone
        assert await other.next(0.3) is None
        await other.close()
