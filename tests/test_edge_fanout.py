"""Streams fed from the recent ring's one subscription to every result (``edge/fanout.py``), and a
JetStream feed's results stored before it opened read from the stream (``edge/replay.py``).

What must hold as with a subscription per stream: every result published after the open reaches
the feed once, in seq order; a JetStream feed also gets what was stored before it; a client that
falls behind its bound is ended with an overrun while the others go on; a closed connection ends a
waiting feed with Lost. And what changes: no SUB, PING or consumer per open. The edge's real
``ResultSource`` on a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
from edge_harness import consumers_back_to, publish_result, publish_results, started_source, subscribed_subjects
from helpers import pull_counted_size, rid
from nats.js.api import StreamConfig

from streamproc.core.defaults import RESULT_HELD_OVERHEAD
from streamproc.core.wire import ResultInfo
from streamproc.edge.feed import Ended, Lost, Overrun
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

LIVE = Subjects("fanlive")  # no results stream: the ring's core subscription feeds the streams
STORED = Subjects("fanjs")  # the source creates a results stream: one ordered consumer feeds them


async def read(feed, n: int) -> list[ResultInfo]:
    items = [await feed.next(5.0) for _ in range(n)]
    assert all(isinstance(i, ResultInfo) for i in items), items
    return items


async def until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_core_opens_subscribe_nothing_and_every_later_result_reaches_each_feed_once(
        nats_url, nats_server, client):
    async with started_source(nats_url, LIVE) as source:
        assert source.fanout is not None and source.recent_mode == "core"
        before = sorted(subscribed_subjects(nats_server.monitor_url))
        ids = [rid(f"live{i}") for i in range(20)]
        feeds = await asyncio.gather(*(source.open(i) for i in ids))
        twin = await source.open(ids[0])  # a second client of the same request
        assert sorted(subscribed_subjects(nats_server.monitor_url)) == before  # no SUB per open
        assert source.metrics.streams_dispatched == 21 and source.metrics.core_subscriptions == 21
        for seq in (1, 0, 2):  # out of order on the wire: handed out in seq order
            for i in ids:
                await publish_result(client, LIVE, i, seq, b'{"%s":%d}' % (i.encode(), seq), final=seq == 2)
        await client.flush()
        for i, feed in zip(ids, feeds):
            assert [(r.seq, r.body) for r in await read(feed, 3)] == [
                (seq, b'{"%s":%d}' % (i.encode(), seq)) for seq in range(3)]
            assert await feed.next(0.05) is not None  # Ended: the final one was read
        assert [r.seq for r in await read(twin, 3)] == [0, 1, 2]
        assert source.metrics.duplicates_dropped == 0
        assert source.metrics.results_seen == 60  # the ring read each result once
        for feed in (*feeds, twin):
            await feed.close()
        assert source.metrics.streams_dispatched == 0 and source.fanout.feeds == {}


async def test_a_jetstream_feed_replays_what_was_stored_before_it_then_reads_live_without_doubles(
        nats_url, client):
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        assert source.fanout is not None and source.recent_mode == "jetstream"
        request_id = rid("late")
        for seq in range(3):  # stored and dispatched (to nobody) before the open
            await publish_result(client, STORED, request_id, seq, b'{"seq":%d}' % seq)
        await client.flush()
        await until(lambda: source.metrics.results_seen == 3)
        feed = await source.open(request_id)
        assert feed.mode == "jetstream" and feed.replay is not None
        assert feed.replay.upto >= 3  # the consumer had delivered them
        for seq in range(3, 6):  # after the registration: dispatched, beyond the replay's reach
            await publish_result(client, STORED, request_id, seq, b'{"seq":%d}' % seq, final=seq == 5)
        await client.flush()
        await until(lambda: source.metrics.results_seen == 6)
        got = await read(feed, 6)
        assert [r.body for r in got] == [b'{"seq":%d}' % seq for seq in range(6)]
        assert feed.replay is None  # done, after exactly the three stored before
        assert source.metrics.duplicates_dropped == 0 and source.metrics.jetstream_replays == 1
        await feed.close()


@pytest.mark.parametrize("stored", [1, 2, 300])
async def test_a_late_attach_reads_the_stored_history_in_order_and_leaves_no_consumer(nats_url, client, stored):
    """One stored result: the probe alone. More: a temporary ordered consumer reads the rest (two:
    it has nothing pending after the probe's one) and is gone once the history is read."""
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        js = client.jetstream()
        stream = source.fanout.stream
        consumers = (await js.stream_info(stream)).state.consumer_count
        request_id = rid(f"history{stored}")
        for seq in range(stored):
            await publish_result(client, STORED, request_id, seq, b'{"seq":%d}' % seq)
        await client.flush()
        await until(lambda: source.metrics.results_seen == stored)
        feed = await source.open(request_id)
        await publish_result(client, STORED, request_id, stored, b'{"seq":%d}' % stored, final=True)  # live
        await client.flush()
        got = await read(feed, stored + 1)
        assert [r.body for r in got] == [b'{"seq":%d}' % seq for seq in range(stored + 1)]
        assert feed.replay is None and source.metrics.duplicates_dropped == 0
        await feed.close()
        await consumers_back_to(js, stream, consumers)


async def test_a_jetstream_feed_opened_before_any_result_replays_nothing_and_misses_nothing(nats_url, client):
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        js = client.jetstream()
        consumers = (await js.stream_info(source.fanout.stream)).state.consumer_count  # the ring's one
        request_id = rid("early")
        feed = await source.open(request_id)
        for seq in range(4):
            await publish_result(client, STORED, request_id, seq, b'{"seq":%d}' % seq, final=seq == 3)
        await client.flush()
        assert [r.seq for r in await read(feed, 4)] == [0, 1, 2, 3]
        assert source.metrics.duplicates_dropped == 0
        assert feed.replay is None  # the probe found nothing: no consumer was created for this open
        assert (await js.stream_info(source.fanout.stream)).state.consumer_count == consumers
        await feed.close()


async def test_a_feed_past_its_byte_bound_ends_with_an_overrun_and_the_others_go_on(nats_url, client):
    bound = 64 * 1024
    async with started_source(nats_url, LIVE, stream_buffer_bytes=bound) as source:
        slow, fine = rid("slow"), rid("fine")
        slow_feed, fine_feed = await source.open(slow), await source.open(fine)
        body = b'{"text":"' + b"x" * 8000 + b'"}'
        for seq in range(12):  # ~96 KiB for a client that does not read
            await publish_result(client, LIVE, slow, seq, body)
            await publish_result(client, LIVE, fine, seq, b'{"seq":%d}' % seq, final=seq == 11)
            await client.flush()
            if seq % 4 == 3:
                await read(fine_feed, 4)  # this one keeps up
        assert isinstance(await slow_feed.next(1.0), Overrun)
        assert source.metrics.streams_overrun == 1
        assert slow_feed not in source.fanout.feeds.get(LIVE.result(slow), [])  # not fed any more
        await slow_feed.close()
        await fine_feed.close()
        assert source.metrics.streams_dispatched == 0


async def test_results_held_behind_a_missing_seq_up_to_exactly_the_bound_are_kept(nats_url, client):
    """--stream-buffer-bytes is what may wait in the reorder buffer: exactly that much is no overrun.
    Each result is charged what it holds (``ResultInfo.held_bytes``): its body, its id and a fixed cost
    here (no error, no traceparent)."""
    bound = 64 * 1024
    async with started_source(nats_url, LIVE, stream_buffer_bytes=bound) as source:
        request_id = rid("held")
        feed = await source.open(request_id)
        half = b"h" * (bound // 2 - len(request_id) - RESULT_HELD_OVERHEAD)
        for seq in (1, 2):  # each taken off the inbox, then held behind the missing seq 0
            await publish_result(client, LIVE, request_id, seq, half, final=seq == 2)
            await client.flush()
            assert await feed.next(0.3) is None
        await publish_result(client, LIVE, request_id, 0, b"{}")
        await client.flush()
        assert [r.seq for r in await read(feed, 3)] == [0, 1, 2]
        assert source.metrics.streams_overrun == 0
        await feed.close()
        over = await source.open(rid("held-over"))  # one byte more: the stream ends, counted
        half = b"h" * (bound // 2 - len(over.request_id) - RESULT_HELD_OVERHEAD)
        await publish_result(client, LIVE, over.request_id, 1, half)
        await client.flush()
        assert await over.next(0.3) is None  # off the inbox, held
        await publish_result(client, LIVE, over.request_id, 2, half + b"h", final=True)
        await client.flush()
        assert isinstance(await over.next(2.0), Overrun)
        assert source.metrics.streams_overrun == 1
        assert not over.order.pending  # the held results are given back at once, not at the close
        await over.close()


async def test_a_gap_that_closed_leaves_no_clock_running_for_the_next_one(nats_url, client):
    """--gap-timeout counts from when a seq went missing: a later gap gets its whole timeout."""
    async with started_source(nats_url, LIVE, gap_timeout=1.0) as source:
        request_id = rid("gaps")
        feed = await source.open(request_id)

        async def publish(seq: int) -> None:
            await publish_result(client, LIVE, request_id, seq, b'{"seq":%d}' % seq, final=seq == 4)
            await client.flush()

        for seq in (0, 2):
            await publish(seq)
        assert [r.seq for r in await read(feed, 1)] == [0]
        assert await feed.next(0.7) is None  # seq 1 missing for 0.7 s: within the timeout
        await publish(1)
        assert [r.seq for r in await read(feed, 2)] == [1, 2]
        await publish(4)
        assert await feed.next(0.7) is None  # seq 3 missing: its own 1 s, not what is left of seq 1's
        await publish(3)
        assert [r.seq for r in await read(feed, 2)] == [3, 4]
        await feed.close()


async def test_a_jetstream_feed_past_its_byte_bound_reads_on_from_the_stream_and_misses_nothing(nats_url, client):
    """Issue 11.4: with a results stream, what a slow client's inbox could not take is stored. The
    feed goes behind (takes nothing more), hands out what it holds, reads the rest from the stream
    and rejoins the dispatch: every result in order, no overrun, the others untouched."""
    bound = 64 * 1024
    async with started_source(nats_url, STORED, ensure_results_stream=True, stream_buffer_bytes=bound) as source:
        slow, fine = rid("slowjs"), rid("finejs")
        slow_feed, fine_feed = await source.open(slow), await source.open(fine)
        assert await slow_feed.next(0.2) is None  # its replay's probe: nothing stored yet
        body = b'{"text":"' + b"x" * 8000 + b'"}'
        for seq in range(24):  # ~190 KiB, three bounds, for a client that does not read yet
            await publish_result(client, STORED, slow, seq, body + b"%d" % seq)
            await publish_result(client, STORED, fine, seq, b'{"seq":%d}' % seq, final=seq == 23)
            await client.flush()
            if seq % 4 == 3:
                await read(fine_feed, 4)  # this one keeps up
        await until(lambda: source.metrics.results_seen == 48)
        assert source.metrics.streams_behind == 1 and slow_feed.inbox.behind is not None
        assert slow_feed in source.fanout.feeds[STORED.result(slow)]  # still registered, taking nothing
        got = await read(slow_feed, 24)
        assert [r.body for r in got] == [body + b"%d" % seq for seq in range(24)]
        # Caught up and live again: later results come from the dispatch.
        for seq in range(24, 27):
            await publish_result(client, STORED, slow, seq, body + b"%d" % seq, final=seq == 26)
        await client.flush()
        assert [r.seq for r in await read(slow_feed, 3)] == [24, 25, 26]
        assert slow_feed.inbox.behind is None and slow_feed.replay is None
        assert source.metrics.streams_overrun == 0 and source.metrics.duplicates_dropped == 0
        await slow_feed.close()
        await fine_feed.close()
        assert source.metrics.streams_dispatched == 0


async def test_a_jetstream_reader_slower_than_its_results_falls_behind_again_and_again_and_gets_them_all(
        nats_url, client):
    """A reader that keeps taking a result while two arrive: behind, caught up, behind again while
    catching up (its inbox refills past the replay's end), each time from the right sequence."""
    bound = 64 * 1024  # the least the edge takes: eight results
    async with started_source(nats_url, STORED, ensure_results_stream=True, stream_buffer_bytes=bound) as source:
        request_id = rid("slowerjs")
        feed = await source.open(request_id)
        assert await feed.next(0.2) is None
        body = b'{"text":"' + b"y" * 8000 + b'"}'
        count, got = 200, []
        for seq in range(count):
            await publish_result(client, STORED, request_id, seq, body + b"%d" % seq, final=seq == count - 1)
            if seq % 2:
                await client.flush()
                item = await feed.next(5.0)
                assert isinstance(item, ResultInfo), item
                got.append(item)
        await client.flush()
        while not isinstance(item := await feed.next(5.0), Ended):
            assert isinstance(item, ResultInfo), item
            got.append(item)
        assert [r.body for r in got] == [body + b"%d" % seq for seq in range(count)]
        assert source.metrics.streams_behind >= 2 and source.metrics.streams_overrun == 0
        await feed.close()


async def test_a_closed_connection_ends_a_waiting_feed_with_lost(nats_url):
    async with started_source(nats_url, LIVE) as source:
        feed = await source.open(rid("waiting"))
        waiting = asyncio.create_task(feed.next(30.0))
        await asyncio.sleep(0.05)
        await source.nc.close()
        item = await asyncio.wait_for(waiting, 5)
        assert isinstance(item, Lost) and "closed" in item.reason, item


async def test_an_after_read_hook_that_raises_is_logged_and_every_result_still_reaches_its_feed(
        nats_url, client, caplog):
    calls: list[int] = []

    def broken() -> None:  # where the edge writes its direct frames (WriteBatch.flush)
        calls.append(1)
        raise RuntimeError("bug")

    async with started_source(nats_url, LIVE, after_read=broken) as source:
        request_id = rid("hook")
        feed = await source.open(request_id)
        for seq in range(3):
            await publish_result(client, LIVE, request_id, seq, b'{"n":%d}' % seq, final=seq == 2)
        await client.flush()
        assert [r.seq for r in await read(feed, 3)] == [0, 1, 2]
        assert calls and source.nc.is_connected
    assert "after_read_failed" in caplog.text


@pytest.mark.parametrize("subjects", [LIVE, STORED], ids=["core-inline", "jetstream-queue"])
async def test_a_dispatch_that_raises_is_logged_and_the_connection_and_other_streams_go_on(
        nats_url, client, caplog, monkeypatch, subjects):
    """``Fanout.dispatch`` never raises into a read loop: FastClient's (core, inline) or nats-py's
    (JetStream, ``DispatchQueue``), where an exception would drop the edge's connection."""
    from streamproc.edge.recent import RecentRequests

    bad, good = rid("raises"), rid("fine")
    note = RecentRequests.note

    def broken(self, result, now):
        if result.request_id == bad:
            raise RuntimeError("bug")
        note(self, result, now)

    monkeypatch.setattr(RecentRequests, "note", broken)
    async with started_source(nats_url, subjects) as source:
        feed = await source.open(good)
        await publish_result(client, subjects, bad, 0, b'{"n":0}')
        await publish_result(client, subjects, good, 0, b'{"n":1}', final=True)
        await client.flush()
        assert [r.body for r in await read(feed, 1)] == [b'{"n":1}']
        assert source.nc.is_connected
    assert "dispatch_failed" in caplog.text


async def test_results_a_rebind_dispatches_outside_a_read_are_followed_by_the_after_read_hook(nats_url, client):
    """A rebind (the results stream recreated: ``ResultSource._reread``, in a task) dispatches what
    the new subscription queued before the fan-out took it. No NATS read ends after that, so the
    hook that writes the direct SSE frames (edge/direct.py WriteBatch) runs at once."""
    events: list[str] = []
    async with started_source(nats_url, LIVE, after_read=lambda: events.append("after_read")) as source:
        request_id = rid("rebind")
        feed = await source.open(request_id)
        queued = await client.subscribe(LIVE.result(request_id))  # no callback: its messages queue
        await client.flush()
        await publish_result(client, LIVE, request_id, 0, b'{"n":0}')
        await until(lambda: queued._pending_queue.qsize() == 1)
        events.clear()
        source.fanout.rebind(queued, None)
        assert events == ["after_read"]  # before anything else can run on the loop
        assert [r.body for r in await read(feed, 1)] == [b'{"n":0}']
        await feed.close()


async def test_on_the_stock_parser_the_source_leaves_the_after_read_hook_uninstalled(nats_url, client, monkeypatch):
    """FastClient on nats-py's own parser (a grammar it does not mirror) never calls ``read_done``:
    the source must not count on it, so the edge's WriteBatch schedules its own flush."""
    from streamproc.nats import fast_client

    monkeypatch.setattr(fast_client, "_parser_ok", (False, "a test"))
    async with started_source(nats_url, LIVE, after_read=lambda: None) as source:
        assert type(source.nc) is fast_client.FastClient and not source.nc.calls_read_done
        assert source.after_read_hooked is False and source.nc.read_done is None
        request_id = rid("stockparser")
        feed = await source.open(request_id)
        await publish_result(client, LIVE, request_id, 0, b'{"n":0}', final=True)
        await client.flush()
        assert [r.seq for r in await read(feed, 1)] == [0]
    monkeypatch.undo()  # the fast parser again: the hook is installed
    async with started_source(nats_url, LIVE, after_read=lambda: None) as source:
        assert source.after_read_hooked is True and source.nc.read_done == source.run_after_read


async def test_a_results_stream_created_after_start_up_is_read_with_a_consumer_per_stream(nats_url, client, caplog):
    """The edge decides at start-up how its ring reads; a stream that appears later is still used:
    each stream replays it through its own ordered consumer (the ``--recent 0`` path), said once."""
    late = Subjects("fanlate")
    async with started_source(nats_url, late) as source:
        assert source.recent_mode == "core"
        await client.jetstream().add_stream(StreamConfig(name="FANLATE", subjects=[late.all_results]))
        try:
            request_id = rid("stored")
            await publish_result(client, late, request_id, 0, b'{"seq":0}')
            await client.flush()
            source.streams.forget()  # the lookup's 2 s cache, without waiting for it
            with caplog.at_level("WARNING", logger="streamproc.edge"):
                feed = await source.open(request_id)
                again = await source.open(rid("other"))
            assert feed.mode == "jetstream" and feed.attaching is not None  # its own consumer
            await publish_result(client, late, request_id, 1, b'{"seq":1}', final=True)
            await client.flush()
            assert [r.seq for r in await read(feed, 2)] == [0, 1]  # the one stored before the open too
            assert caplog.text.count("results_stream_not_read_by_ring") == 1
            await feed.close()
            await again.close()
        finally:
            await client.jetstream().delete_stream("FANLATE")


async def test_a_late_reader_that_falls_behind_its_history_is_sent_no_more_than_its_bound_and_still_gets_all_of_it(
        nats_url, client):
    """A late attach's history used to come through a push consumer, as fast as nats-server sends
    (its flow-control window grows to 32 MiB), whatever the reader's pace; a reader that stopped
    while it poured in overran its bound (a fresh-clone CI run: an HTTP client at full speed, a 4
    MiB bound, a 48 MiB history), and then the replay paused at the bound, what the server had sent
    past it thrown away and read again. Now it pulls (CONSUMER.MSG.NEXT) no more than the room left
    in its bound: a reader that stops holds at most the bound, nothing is dropped or paused, the
    reader gets every result, and no consumer is left behind."""
    bound = 1024 * 1024
    async with started_source(nats_url, STORED, ensure_results_stream=True, stream_buffer_bytes=bound) as source:
        js = client.jetstream()
        consumers = (await js.stream_info(source.fanout.stream)).state.consumer_count
        request_id = rid("behind")
        body = b'{"text":"' + b"x" * (64 * 1024 - 12) + b'"}'
        await publish_results(client, STORED, request_id, [body] * 64, flush_every=8)  # 4 MiB stored
        await until(lambda: source.metrics.results_seen >= 64)
        feed = await source.open(request_id)
        assert [r.seq for r in await read(feed, 2)] == [0, 1]  # the probe's, then the consumer's first
        await asyncio.sleep(1.0)  # the reader stops: nothing more is asked for
        assert feed.replay is not None and feed.replay.pauses == 0 and feed.replay.pulled == 1
        assert feed.replay.sub is not None and feed.replay.sub._pending_size <= bound
        seqs, item = [0, 1], await feed.next(5.0)
        while isinstance(item, ResultInfo):
            seqs.append(item.seq)
            await asyncio.sleep(0.002)  # a reader slower than NATS: pauses again, loses nothing
            item = await feed.next(5.0)
        assert isinstance(item, Ended), item
        assert seqs == list(range(64))
        assert source.metrics.streams_overrun == 0 and source.metrics.replay_pauses == 0
        await feed.close()
        await consumers_back_to(js, source.fanout.stream, consumers)


async def test_a_stored_history_of_results_each_larger_than_the_bound_is_still_read_result_by_result(
        nats_url, client):
    """A result larger than --stream-buffer-bytes by itself is dropped by nats-py from any consumer,
    even into an empty queue: a pause must still move the reader on (the result after a pause
    comes by subject), or it would make a consumer per attempt, forever; and once a consumer
    dropped its very first result, the rest is read by subject (no consumer per result, each
    lingering its inactive threshold on the server)."""
    bound = 64 * 1024
    async with started_source(nats_url, STORED, ensure_results_stream=True, stream_buffer_bytes=bound) as source:
        js = client.jetstream()
        consumers = (await js.stream_info(source.fanout.stream)).state.consumer_count
        request_id = rid("huge")
        body = b'{"text":"' + b"x" * (100 * 1024) + b'"}'
        for seq in range(5):
            await publish_result(client, STORED, request_id, seq, body, final=seq == 4)
        await client.flush()
        await until(lambda: source.metrics.results_seen >= 5)
        feed = await source.open(request_id)
        seqs, item = [], await feed.next(5.0)
        while isinstance(item, ResultInfo):
            seqs.append(item.seq)
            item = await feed.next(5.0)
        assert isinstance(item, Ended), item
        assert seqs == [0, 1, 2, 3, 4] and source.metrics.streams_overrun == 0
        # One pause: the consumer made after the probe dropped its first; the rest came by subject.
        assert source.metrics.replay_pauses == 1, source.metrics.replay_pauses
        await feed.close()
        await consumers_back_to(js, source.fanout.stream, consumers)


async def test_late_attaches_past_max_replay_consumers_read_their_history_by_subject_and_lose_nothing(
        nats_url, client):
    """Each late attach made a consumer for its stored history, so clients (up to --max-streams of
    them) could make one edge use up the results stream's consumers, which the processors' migrate
    history and the other edges' rings need. Past --max-replay-consumers a history is read by
    subject instead: slower, complete, in order, no consumer."""
    async with started_source(nats_url, STORED, ensure_results_stream=True, max_replay_consumers=1) as source:
        js = client.jetstream()
        consumers = (await js.stream_info(source.fanout.stream)).state.consumer_count
        ids = [rid("holder"), rid("by-subject")]
        for request_id in ids:
            for seq in range(20):
                await publish_result(client, STORED, request_id, seq, b'{"n":%d}' % seq, final=seq == 19)
        await client.flush()
        await until(lambda: source.metrics.results_seen >= 40)
        holder = await source.open(ids[0])
        assert [r.seq for r in await read(holder, 3)] == [0, 1, 2]  # its consumer is made; it stops reading
        assert (await js.stream_info(source.fanout.stream)).state.consumer_count == consumers + 1
        other = await source.open(ids[1])
        assert [r.seq for r in await read(other, 20)] == list(range(20))
        assert isinstance(await other.next(1.0), Ended)
        assert source.metrics.replay_reads_by_subject == 19  # all but the probe's
        assert (await js.stream_info(source.fanout.stream)).state.consumer_count == consumers + 1
        assert [r.seq for r in await read(holder, 17)] == list(range(3, 20))
        await holder.close()
        await other.close()


async def test_opens_build_no_jetstream_context_each(nats_url, client, monkeypatch):
    """``nc.jetstream()`` built a ``JetStreamContext`` (a parser, an Event, a Semaphore) for every open,
    core and JetStream alike; the source makes one per connection (ResultSource.jetstream)."""
    from nats.js.client import JetStreamContext

    made = [0]
    init = JetStreamContext.__init__

    def counted(self, *args, **kwargs):
        made[0] += 1
        init(self, *args, **kwargs)

    for subjects, overrides in ((LIVE, {}), (STORED, {"ensure_results_stream": True})):
        async with started_source(nats_url, subjects, **overrides) as source:
            first = await source.open(rid("js-first"))  # the first may make the connection's one
            await first.close()
            monkeypatch.setattr(JetStreamContext, "__init__", counted)
            feeds = [await source.open(rid(f"js{i}")) for i in range(5)]
            for feed in feeds:
                await feed.close()
            monkeypatch.setattr(JetStreamContext, "__init__", init)
        assert made[0] == 0, subjects


async def test_a_dispatched_feed_closes_at_once_and_one_with_a_replay_left_returns_its_close_to_await(
        nats_url, client):
    """``ResultFeed.close_now``: a feed read from the fan-out with no replay left needs no round trip,
    so an SSE stream's end awaits nothing (no coroutine, no shielded scope); nor does one whose
    replay has no consumer (since 2026-12-05: its probe, if out, is forgotten); a JetStream feed
    whose replay reads its history with a temporary consumer still has that consumer to close."""
    async with started_source(nats_url, LIVE) as source:
        feed = await source.open(rid("now"))
        assert feed.close_now() is None
        assert feed.closed and LIVE.result(feed.request_id) not in source.fanout.feeds
    async with started_source(nats_url, STORED, ensure_results_stream=True) as source:
        request_id = rid("later")
        for seq in range(3):  # stored: the open replays them
            await publish_result(client, STORED, request_id, seq, b"{}")
        await client.flush()
        await until(lambda: source.metrics.results_seen == 3)
        early = await source.open(request_id)
        assert early.replay is not None and early.replay.sub is None
        assert early.close_now() is None
        assert early.closed and early.replay is None
        feed = await source.open(request_id)
        assert [r.seq for r in await read(feed, 2)] == [0, 1]  # the second through a temporary consumer
        assert feed.replay is not None and feed.replay.sub is not None
        rest = feed.close_now()
        assert rest is not None
        await rest
        assert feed.closed and feed.replay is None


async def test_a_replay_pull_filled_to_its_exact_max_bytes_goes_on_within_the_pull_silence(nats_url, client):
    """nats-server ends a pull whose ``max_bytes`` the delivered results use up exactly without a
    word (``consumer.nextWaiting`` sets its batch to 1 when its bytes reach 0: no 404, no 409; the
    same as the client's test_a_replay_pull_filled_to_its_exact_max_bytes_goes_on_at_once). A late
    attach whose first pull was filled so waited the replay timeout (5 s) for an end that never
    comes; now a pull silent for ``REPLAY_PULL_LOST_AFTER`` while nothing is queued is over, and the
    replay goes on from the next stored result."""
    bound = 1024 * 1024
    async with started_source(nats_url, STORED, ensure_results_stream=True, stream_buffer_bytes=bound) as source:
        js = client.jetstream()
        stream = source.fanout.stream
        suffix = f"{random.randrange(1 << 32):08x}"  # the probe's and the request's subjects as long
        probe, request_id = f"xp-{suffix}", f"xr-{suffix}"
        for seq, size in enumerate([10, 500_000, 900_000]):  # stored as the request's, first
            await publish_result(client, STORED, probe, seq, b"p" * size, final=seq == 2)
        await client.flush()
        name = "streamproc_replay_" + "p" * 22  # as long as the edge's replay consumer name (acks' subjects)
        counted = await pull_counted_size(js, client, stream, STORED.result(probe), name, 10_000)
        overhead = counted - 10
        # the probe (MSG.GET) reads result 0; the consumer's first pull, max_bytes = bound - 1 (an
        # empty queue), is used up exactly by results 1 and 2
        sizes = [10, 500_000, bound - 1 - 500_000 - 2 * overhead, 10]
        for seq, size in enumerate(sizes):
            await publish_result(client, STORED, request_id, seq, b"r" * size, final=seq == 3)
        await client.flush()
        await until(lambda: source.metrics.results_seen >= 7)
        started = asyncio.get_running_loop().time()
        feed = await source.open(request_id)
        seqs, item = [], await feed.next(10.0)
        while isinstance(item, ResultInfo):
            seqs.append(item.seq)
            item = await feed.next(10.0)
        took = asyncio.get_running_loop().time() - started
        assert isinstance(item, Ended), item
        assert seqs == [0, 1, 2, 3]
        assert feed.replay is None or feed.replay.pauses == 0
        assert took < 3.5, f"the replay stalled {took:.1f} s after a pull that used up its max_bytes exactly"
        await feed.close()


async def test_late_attaches_cancelled_while_their_replay_drops_its_consumer_give_the_slot_back(nats_url, client):
    """Uvicorn cancels an SSE handler's task when its client disconnects, also while the replay in
    its ``next()`` deletes its pull consumer (a round trip, up to REPLAY_TIMEOUT). The slot was
    given back only after that await: each such cancel held a ``--max-replay-consumers`` slot for
    the edge's life, and once they were all held every late attach read its history by subject.
    Here more clients than the cap leave at that moment; the next late attach still gets a
    consumer, and no slot stays held."""
    cap = 2
    async with started_source(nats_url, STORED, ensure_results_stream=True, max_replay_consumers=cap) as source:
        ids = [rid(f"leaves{i}") for i in range(12)] + [rid("after")]
        for request_id in ids:
            for seq in range(4):
                await publish_result(client, STORED, request_id, seq, b'{"n":%d}' % seq, final=seq == 3)
        await client.flush()
        await until(lambda: source.metrics.results_seen >= 4 * len(ids))
        left = 0
        for request_id in ids[:-1]:
            await replay_slots_back_to(source, 0)
            feed = await source.open(request_id)
            assert [r.seq for r in await read(feed, 3)] == [0, 1, 2]
            replay = feed.replay
            assert replay is not None and replay.consumer is not None, "its history is read by a pull consumer"
            reading = asyncio.ensure_future(feed.next(5.0))  # the last stored one: the replay drops its consumer
            while not reading.done() and replay.sub is not None:
                await asyncio.sleep(0)
            if not reading.done():  # the client leaves while the consumer is being deleted
                reading.cancel()
                left += 1
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            await feed.close()  # as the handler's shielded close does
        assert left > cap, f"only {left} clients left while their replay dropped its consumer"
        await replay_slots_back_to(source, 0)
        by_subject = source.metrics.replay_reads_by_subject
        feed = await source.open(ids[-1])
        assert [r.seq for r in await read(feed, 4)] == [0, 1, 2, 3]
        assert source.metrics.replay_reads_by_subject == by_subject  # a consumer, not MSG.GET per result
        await feed.close()
        await replay_slots_back_to(source, 0)


async def replay_slots_back_to(source, held: int) -> None:
    """Wait (5 s at most: a dropped consumer whose delete failed counts REPLAY_SLOT_LINGER) until
    ``source`` holds ``held`` --max-replay-consumers slots."""
    try:
        await until(lambda: source._replay_consumers_held() == held, 5.0)
    except TimeoutError:
        pytest.fail(f"{source._replay_consumers_held()} replay consumer slots held, not {held} "
                    f"(in use {len(source._replays)}, lingering {source._replays_lingering})")


def test_an_inbox_refuses_a_result_at_nats_pys_limits_and_while_behind():
    """nats-py 2.16 ``Client._process_msg`` drops a message once the pending bytes *reach* the byte
    limit (``>=``, the message counted) or the queue holds the message limit: the inbox does the same."""
    from streamproc.edge.fanout import Inbox

    one = ResultInfo("r", 0, False, None, None, b"{}")
    inbox = Inbox(None, bytes_limit=100, msgs_limit=1000)
    assert inbox.put(one, 60)
    assert not inbox.put(one, 40)  # 60 + 40 reaches 100
    assert inbox.put(one, 39)
    counted = Inbox(None, bytes_limit=0, msgs_limit=2)  # 0: no byte limit
    assert counted.put(one, 10**9) and counted.put(one, 1)
    assert not counted.put(one, 1)
    behind = Inbox(None, bytes_limit=100, msgs_limit=10)
    behind.behind = 7
    assert not behind.put(one, 1)
