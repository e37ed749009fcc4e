"""A live JetStream stream whose client fell ``--stream-buffer-bytes`` behind (``Inbox.behind``,
``ResultSource.catch_up``): what must hold under the conditions its replay meets. Every result in
order and once, or an error event, never a silent skip or a hang; the edge holds a few bounds per
stream; the other streams keep their pace. Real nats-server, the edge's real ``ResultSource``
in-process (no client socket buffers hide how much the edge holds) and ``streamproc edge``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import signal
import sys
import time

import anyio
import httpx
import msgspec
import nats.errors
import pytest
from edge_harness import (expected_sse, publish_result, publish_results, ring_read_all, running_edge,
                          started_source)
from helpers import connection, rid, sampling, status_kib
from nats_auth import MSG_GET, PULLS, edge_user_denied
from proxy_helpers import HoldingProxy
from nats.js.api import StorageType, StreamConfig

from streamproc.core.read_budget import push_window
from streamproc.core.wire import ResultInfo
from streamproc.edge.feed import Ended, Gap, StreamGone
from streamproc.nats.streams import RESULTS_STREAM, ensure_results_stream
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Result, Subjects, result_headers

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

SUBJECTS = Subjects("behind")
BOUND = 64 * 1024  # the least --stream-buffer-bytes the edge takes
BODY = b'{"text":"' + b"x" * 8000 + b'"}'  # eight of them fill BOUND


def body(seq: int) -> bytes:
    return BODY + b"%d" % seq


async def until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def publish(nc, request_id: str, seqs, *, final_at: int | None = None) -> None:
    """Published at once, and stored on return: the last one waits for its PubAck, so
    :func:`ring_read_all` then knows the stream's last sequence (a flush alone let STREAM.INFO
    answer before the burst's tail was stored, and that tail reached a feed after its catch-up)."""
    seqs = list(seqs)
    for seq in seqs:
        await publish_result(nc, SUBJECTS, request_id, seq, body(seq), final=seq == final_at, acked=seq == seqs[-1])
    await nc.flush()


async def drain(feed, timeout: float = 5.0) -> tuple[list[int], object]:
    """The seqs a feed hands out until it returns anything but a result (returned with them)."""
    seqs = []
    while isinstance(item := await feed.next(timeout), ResultInfo):
        assert item.body == body(item.seq), item.seq
        seqs.append(item.seq)
    return seqs, item


async def behind(source, feed, nc, count: int, *, final_at: int | None = None) -> None:
    """Publish ``count`` results (``count`` / 8 bounds) that ``feed``'s client does not read: its
    inbox goes behind. One at a time until it did, each read by the ring before the next (a stream
    with a small ``max_msgs`` drops what its consumer has not pushed yet), the rest at once."""
    seq = 0
    while feed.inbox.behind is None:
        assert seq < count, "never went behind"
        await publish(nc, feed.request_id, [seq], final_at=final_at)
        seq += 1
        await until(lambda n=seq: feed.inbox.behind is not None or len(feed.inbox._items) == n)
    await publish(nc, feed.request_id, range(seq, count), final_at=final_at)
    await ring_read_all(source, nc)


async def into_catch_up(source, feed, taken: int = 12) -> list[int]:
    """Take ``taken`` results of a behind feed: what its inbox held (8), then the first of its
    catch-up's, so that its replay is reading the stream. Their seqs."""
    seqs = []
    while len(seqs) < taken:
        item = await feed.next(5.0)
        assert isinstance(item, ResultInfo), item
        seqs.append(item.seq)
    assert feed.replay is not None, (seqs, feed.inbox.behind, len(feed.inbox._items), source.metrics.replay_pauses)
    return seqs


async def waiting_for_a_replay_consumer(source, nc, *, final_at: int | None = None):
    """With ``--max-replay-consumers 1`` and ``STREAM.MSG.GET`` refused: a holder catch-up whose
    client reads no more keeps the one replay consumer, and a waiter, 64 results behind, has taken
    what its inbox held and now waits for that consumer. (holder, waiter, the waiter's seqs, the
    item after them)."""
    holder, waiter = await source.open(rid("holder")), await source.open(rid("waiter"))
    assert await holder.next(0.2) is None and await waiter.next(0.2) is None
    await behind(source, holder, nc, 64)
    await into_catch_up(source, holder)  # its consumer holds the slot; its client stops reading
    await behind(source, waiter, nc, 64, final_at=final_at)
    seqs, item = await drain(waiter, 0.5)  # what its inbox held; then it waits for a consumer
    return holder, waiter, seqs, item


@contextlib.asynccontextmanager
async def a_catch_up_waiting_for_the_one_replay_consumer(*, final_at: int | None = None):
    """:func:`waiting_for_a_replay_consumer` on an edge whose user may not ``STREAM.MSG.GET``, with
    ``--max-replay-consumers 1``: (source, publisher connection, holder, waiter, seqs, item)."""
    with EmbeddedNats(config=DENY_MSG_GET) as server:
        async with connection(with_user(server.url, "pub")) as nc:
            await ensure_results_stream(nc.jetstream(), SUBJECTS, storage=StorageType.FILE)
            async with started_source(with_user(server.url, "edge"), SUBJECTS, stream_buffer_bytes=BOUND,
                                      max_replay_consumers=1) as source:
                yield (source, nc, *await waiting_for_a_replay_consumer(source, nc, final_at=final_at))


async def test_a_result_larger_than_the_buffer_reaches_a_feed_waiting_for_it_at_once(nats_url, client):
    """A result larger than the bound by itself cannot enter an empty inbox: the feed goes behind
    with nothing queued. Its task, parked in ``Inbox.wait``, must be woken to catch up from the
    stream, not left asleep until its wait's timeout (the keep-alive interval)."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND) as source:
        request_id = rid("large")
        feed = await source.open(request_id)
        assert await feed.next(0.2) is None  # its replay's probe: nothing stored yet
        waiting = asyncio.ensure_future(feed.next(8.0))
        await asyncio.sleep(0.1)  # parked in Inbox.wait
        large = b'{"text":"' + b"L" * (BOUND + 1000) + b'"}'
        started = time.monotonic()
        await publish_result(client, SUBJECTS, request_id, 0, large, final=True)
        await client.flush()
        item = await waiting
        took = time.monotonic() - started
        assert isinstance(item, ResultInfo) and item.body == large, item
        assert took < 2.0, f"the large result waited {took:.1f} s in the edge"
        assert source.metrics.streams_behind == 1
        assert isinstance(await feed.next(1.0), Ended)
        await feed.close()


# An edge user of the permission set before STREAM.MSG.GET (which had no CONSUMER.MSG.NEXT either:
# its replays read with push consumers, stopped at the bound, as these tests were written for).
DENY_MSG_GET = edge_user_denied(MSG_GET, PULLS, publisher=True)


def with_user(url: str, user: str) -> str:
    return url.replace("nats://", f"nats://{user}:{user}@")


async def test_a_behind_feed_whose_msg_get_is_refused_reads_on_with_consumers_and_gets_every_result():
    """An edge user without ``$JS.API.STREAM.MSG.GET`` (an earlier permission set): on an empty
    results stream an open needs no MSG.GET, so the refusal is first met by the catch-up of a feed
    that fell behind. Its client, still slower than the results come, must get every result: an
    open's fallback (an ordered consumer from the stream's start, with the same bound) pushed it
    eight bounds at once and ended it with an overrun after the nine results its inbox held. The
    second feed's catch-up, after the refusal is known, asks no MSG.GET."""
    with EmbeddedNats(config=DENY_MSG_GET) as server:
        async with connection(with_user(server.url, "pub")) as nc:
            await ensure_results_stream(nc.jetstream(), SUBJECTS, storage=StorageType.FILE)
            async with started_source(with_user(server.url, "edge"), SUBJECTS, stream_buffer_bytes=BOUND) as source:
                feeds = [await source.open(rid(f"refused{i}")) for i in range(2)]
                count = 64  # eight bounds
                for feed in feeds:
                    assert feed.inbox is not None  # dispatched: nothing stored, no MSG.GET asked
                    assert await feed.next(0.2) is None
                    await behind(source, feed, nc, count, final_at=count - 1)
                for n, feed in enumerate(feeds):
                    seqs = []
                    while isinstance(item := await feed.next(5.0), ResultInfo):
                        seqs.append(item.seq)
                        await asyncio.sleep(0.005)  # a client slower than the stream is pushed
                    assert seqs == list(range(count)) and isinstance(item, Ended), (seqs, item)
                    assert source.msg_get.state == "refused"
                    assert source.metrics.streams_overrun == 0
                    await feed.close()
                # Each catch-up read at its client's pace with a push consumer held to the read budget by
                # its max_ack_pending (replay.py, _push_consumer): charged, and never a bound ahead of its
                # client (until 2026-12-06 an ordered push consumer paused at each bound instead).
                assert source.read_gate.budget.granted_total >= 2 * push_window(
                    source._largest_stored(), BOUND, source.read_gate.budget.limit, 0)[1]
                assert source.metrics.replay_pauses == 0 and source.read_gate.out == 0


@pytest.mark.parametrize("when", ["behind", "catching up"])
async def test_a_behind_feed_ends_with_stream_gone_when_its_results_stream_is_deleted(nats_url, client, when):
    """Deleted while the feed is behind (its inbox holds what it took) or while its catch-up reads
    the stream: :class:`StreamGone` soon after the watch sees it, not Lost, not a wait."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND) as source:
        feed = await source.open(rid("deleted"))
        assert await feed.next(0.2) is None
        await behind(source, feed, client, 64)
        seqs = await into_catch_up(source, feed) if when == "catching up" else []
        await client.jetstream().delete_stream(RESULTS_STREAM)
        started = time.monotonic()
        more, item = await drain(feed, 10.0)
        took = time.monotonic() - started
        assert isinstance(item, StreamGone), item
        assert seqs + more == list(range(len(seqs) + len(more)))  # in order, none twice
        assert took < 3.0, f"StreamGone came {took:.1f} s after the deletion"
        await feed.close()


@pytest.mark.parametrize("when", ["behind", "catching up"])
async def test_a_behind_feed_reads_a_recreated_results_stream_from_its_start(nats_url, client, when):
    """Deleted and created anew between two of the watch's checks, with the results stored again in
    the new stream (a processor republishing): the feed reads the new history from its start and
    its client gets every result once, in order."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND) as source:
        source._watch_task.cancel()  # the watch's check is run below, after both changes
        feed = await source.open(rid("recreated"))
        assert await feed.next(0.2) is None
        await behind(source, feed, client, 64)
        seqs = await into_catch_up(source, feed) if when == "catching up" else []
        js = client.jetstream()
        await js.delete_stream(RESULTS_STREAM)
        await ensure_results_stream(js, SUBJECTS, storage=StorageType.FILE)
        await publish(client, feed.request_id, range(80), final_at=79)
        await source._check_results_stream()
        assert source.metrics.results_stream_recreated == 1 and source.metrics.streams_gone == 0
        more, item = await drain(feed)
        assert isinstance(item, Ended), item
        assert seqs + more == list(range(80))
        assert source.metrics.streams_overrun == 0
        await feed.close()


async def limited_stream(nc, max_msgs: int) -> None:
    await nc.jetstream().add_stream(StreamConfig(name=RESULTS_STREAM, subjects=[SUBJECTS.all_results],
                                                 max_msgs=max_msgs, storage=StorageType.FILE))


async def test_results_expired_before_a_behind_feed_caught_up_are_a_gap_not_a_skip(nats_url, client):
    """``max_msgs`` 4: of 64 results published while the client read nothing, the stream keeps the
    last four when the feed catches up. The results between what its inbox held and those are
    gone: a :class:`Gap` after ``--gap-timeout``, never a silent skip to the stored ones."""
    await limited_stream(client, 4)
    async with started_source(nats_url, SUBJECTS, stream_buffer_bytes=BOUND, gap_timeout=1.0) as source:
        feed = await source.open(rid("expired"))
        assert await feed.next(0.2) is None
        await behind(source, feed, client, 64, final_at=63)
        held = len(feed.inbox._items)
        started = time.monotonic()
        seqs, item = await drain(feed)
        assert seqs == list(range(held)), (seqs, item)
        # Seen once in ~125 runs (not reproduced in 100 more): Overrun(limit=65536) here; the
        # metrics say which path ended it next time.
        assert isinstance(item, Gap) and item.missing == held and item.waiting == 4, (
            item, held, feed.order.next_seq, sorted(feed.order.pending), msgspec.to_builtins(source.metrics))
        assert time.monotonic() - started < 3.0
        await feed.close()


async def test_a_behind_feed_whose_every_later_result_expired_is_told_so_not_left_waiting(nats_url, client):
    """``max_msgs`` 4, and four results of another request published after the feed's 64: nothing
    of its request is stored when it catches up, final result included, and nothing more will
    come. The edge knows that the result it did not take is gone (its stream sequence is stored
    in ``Inbox.behind``): the client must hear of it within ``--gap-timeout``, not wait silently
    for ``--result-timeout``."""
    await limited_stream(client, 4)
    async with started_source(nats_url, SUBJECTS, stream_buffer_bytes=BOUND, gap_timeout=1.0,
                              result_timeout=30.0) as source:
        feed = await source.open(rid("allgone"))
        assert await feed.next(0.2) is None
        await behind(source, feed, client, 64, final_at=63)
        await publish(client, rid("other"), range(4))
        await ring_read_all(source, client)
        held = len(feed.inbox._items)
        seqs, item = await drain(feed, 3.0)
        assert seqs == list(range(held)), (seqs, item)
        assert isinstance(item, Gap) and item.missing == held, item
        await feed.close()


async def test_live_results_piling_up_behind_one_that_expired_before_the_catch_up_end_with_a_gap(nats_url, client):
    """The catch-up finds the result its client did not take expired (``Replay.lost``), and live
    results of the request keep coming: they wait in the reorder buffer behind the lost one until
    the bound, before ``--gap-timeout``. The stream ended with ``Overrun`` ("the client fell
    behind"), though the cause is known: the seq is gone, and a resume hits the same hole. A
    :class:`Gap` naming it, at the bound."""
    await limited_stream(client, 4)
    async with started_source(nats_url, SUBJECTS, stream_buffer_bytes=BOUND, gap_timeout=10.0) as source:
        feed = await source.open(rid("lostlive"))
        assert await feed.next(0.2) is None
        await behind(source, feed, client, 64)
        held = len(feed.inbox._items)
        seqs, item = await drain(feed, 1.0)  # what its inbox held, then the catch-up: the last four wait
        assert seqs == list(range(held)) and item is None, (seqs, item)
        assert feed.replay is None and feed.lost_stored and len(feed.order.pending) == 4

        async def live() -> None:  # each taken before the next comes (its inbox never goes behind)
            for seq in range(64, 80):
                await publish(client, feed.request_id, [seq], final_at=79)
                await asyncio.sleep(0.02)

        started = time.monotonic()
        publisher = asyncio.ensure_future(live())
        more, item = await drain(feed)
        assert more == [] and isinstance(item, Gap) and item.missing == held, (more, item, sorted(feed.order.pending))
        assert time.monotonic() - started < 3.0  # at the bound, not after --gap-timeout
        assert source.metrics.streams_overrun == 0
        await publisher
        await feed.close()


async def test_a_stopped_own_consumer_is_not_made_again_by_nats_py_nor_its_drops_counted_as_the_rings(nats_url, client):
    """``--recent 0``: a stream's own ordered consumer dropped a result, and the edge stopped it
    (``_fell_behind``) by unsubscribing the plain subscription the ``SlowConsumerError`` names,
    which left the JetStream subscription's heartbeat check running: within two heartbeat
    intervals (20 s) nats-py found it idle and made it again (``reset_ordered_consumer``), back in
    the connection's subscriptions, pushing the subject's history into a queue nobody reads.
    Every result it dropped there was counted as ``recent_dropped`` (47 here), and the consumer
    stayed for the edge's lifetime. Only the ring's subscription's drops are the ring's."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, recent=0,
                              stream_buffer_bytes=BOUND) as source:
        js = client.jetstream()
        base = (await js.stream_info(RESULTS_STREAM)).state.consumer_count
        feed = await source.open(rid("ownbehind"))
        await until(lambda: feed._sub is not None)
        await publish(client, feed.request_id, range(64), final_at=63)
        await until(lambda: feed.cut is not None)
        stopped, stopped_at = feed._sub, time.monotonic()
        seqs, item = await drain(feed)
        assert seqs == list(range(64)) and isinstance(item, Ended), (seqs, item)
        await feed.close()
        await asyncio.sleep(2.0)  # its two consumers linger 1 s (CONSUMER_LINGER)
        counts = set()
        while time.monotonic() - stopped_at < 22.0:  # nats-py's check: every 10 s, idle for one
            counts.add((await js.stream_info(RESULTS_STREAM)).state.consumer_count - base)
            await asyncio.sleep(0.5)
        assert counts == {0} and source.metrics.recent_dropped == 0, (counts, source.metrics.recent_dropped)
        # A drop reported for it late (still queued for the error callback) is nobody's now
        await source._on_error(nats.errors.SlowConsumerError(subject=SUBJECTS.result(feed.request_id), reply="",
                                                              sid=0, sub=stopped._sub))
        assert source.metrics.recent_dropped == 0


@pytest.mark.parametrize("when", ["behind", "catching up"])
async def test_a_behind_feed_gets_every_result_across_a_nats_server_restart(nats_server, when):
    """nats-server restarted (same store) while the feed is behind, or while its catch-up reads the
    stream: the edge reconnects and the client gets every result once, in order. (All are stored
    before the restart; results published after one: test_edge_restream.py.)"""
    async with connection(nats_server.url) as nc, \
            started_source(nats_server.url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND) as source:
        feed = await source.open(rid("restart"))
        assert await feed.next(0.2) is None
        await behind(source, feed, nc, 64, final_at=63)
        seqs = await into_catch_up(source, feed) if when == "catching up" else []
        await asyncio.to_thread(nats_server.restart)  # the clients see the disconnect meanwhile
        await until(lambda: source.metrics.nats_reconnects == 1, 10.0)
        more, item = await drain(feed, 10.0)
        assert isinstance(item, Ended), (item, len(seqs), len(more))
        assert seqs + more == list(range(64))
        assert source.metrics.streams_overrun == 0
        await feed.close()


async def test_a_slow_and_a_fast_client_of_one_request_and_a_resume_while_behind_each_get_it_all(nats_url, client):
    """Two feeds of one request, one never reading until the end (behind), one reading as results
    come; and a third opened with Last-Event-ID 20 while the first is behind: each its own results,
    in order, once."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND) as source:
        request_id = rid("twins")
        slow, fast = await source.open(request_id), await source.open(request_id)
        for feed in (slow, fast):
            assert await feed.next(0.2) is None
        got_fast = []
        for start in range(0, 64, 4):
            await publish(client, request_id, range(start, start + 4), final_at=63)
            for _ in range(4):
                item = await fast.next(5.0)
                assert isinstance(item, ResultInfo), item
                got_fast.append(item.seq)
        assert slow.inbox.behind is not None and fast.inbox.behind is None
        resumed = await source.open(request_id, after=20)
        got_resumed, end = await drain(resumed)
        assert isinstance(end, Ended) and got_resumed == list(range(21, 64))
        got_slow, end = await drain(slow)
        assert isinstance(end, Ended) and got_slow == list(range(64))
        assert got_fast == list(range(64)) and isinstance(await fast.next(1.0), Ended)
        # Dropped: only the resumed feed's 20, its Last-Event-ID's result, where its replay starts
        # (replay.py, Replay._seek: 0-20, its whole history before it, until 2026-12-07); the slow one's none.
        assert source.metrics.streams_behind == 1 and source.metrics.duplicates_dropped == 1
        for feed in (slow, fast, resumed):
            await feed.close()


def held(feed) -> int:
    """The bytes of results the edge holds for ``feed``: its inbox, its replay's consumer's
    pending queue, its reorder buffer and what that released but the stream did not take yet."""
    replay = feed.replay
    sub = replay.sub if replay is not None else None
    return (feed.inbox._bytes + (sub._sub._pending_size if sub is not None else 0) + feed._held_bytes
            + sum(len(r.body) for r in feed.ready))


@pytest.mark.timeout(60)
async def test_fifty_behind_feeds_get_every_result_beside_a_fast_one_within_three_buffers_each(nats_url, client):
    """50 feeds whose live results (five buffers' worth each) come while their clients read
    nothing, then read slowly, all at once, and a feed read as its results come every 50 ms:
    each slow one gets every result, in order, once; the fast one's results keep their pace; the
    edge holds at most three buffers per feed (inbox, replay consumer, reorder buffer; sampled
    every 5 ms); its temporary consumers stay within --max-replay-consumers and are gone
    afterwards. (In-process: through HTTP, the kernel's send buffer of each client socket,
    autotuned to 3.9 MB here, takes a request this size before the edge holds any of it.)"""
    feeds_count, replay_consumers, results = 50, 8, 40
    large = b'{"text":"' + b"m" * (BOUND // 4 - 12) + b'"}'  # 16 KiB
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND,
                              max_replay_consumers=replay_consumers) as source:
        js = client.jetstream()
        base = (await js.stream_info(RESULTS_STREAM)).state.consumer_count
        slow_ids = [rid(f"many{i}") for i in range(feeds_count)]
        slow_feeds = [await source.open(i) for i in slow_ids]
        fast = await source.open(rid("fast"))
        assert await asyncio.gather(*(f.next(0.2) for f in (*slow_feeds, fast))) == [None] * (feeds_count + 1)
        peaks = {"feed": 0, "total": 0, "replays": 0, "consumers": 0}
        got: dict[str, list[int]] = {i: [] for i in slow_ids}
        lags: list[float] = []
        reading = asyncio.Event()

        async def sample() -> None:
            while True:
                sizes = [held(f) for f in slow_feeds]
                peaks["feed"] = max(peaks["feed"], *sizes)
                peaks["total"] = max(peaks["total"], sum(sizes))
                peaks["replays"] = max(peaks["replays"], len(source._replays))
                await asyncio.sleep(0.005)

        async def count_consumers() -> None:
            count = (await js.stream_info(RESULTS_STREAM)).state.consumer_count
            peaks["consumers"] = max(peaks["consumers"], count)

        async def slow(feed) -> None:
            await reading.wait()
            while isinstance(item := await feed.next(10.0), ResultInfo):
                assert item.body == large
                got[feed.request_id].append(item.seq)
                await asyncio.sleep(0.002)
            assert isinstance(item, Ended), item

        async def fast_reader() -> None:
            sent_at = {}
            for seq in range(40):
                sent_at[seq] = time.monotonic()
                await publish_result(client, SUBJECTS, fast.request_id, seq, b'{"seq":%d}' % seq, final=seq == 39)
                await client.flush()
                item = await fast.next(5.0)
                assert isinstance(item, ResultInfo) and item.seq == seq, item
                lags.append(time.monotonic() - sent_at[seq])
                await asyncio.sleep(0.05)

        samplers = [asyncio.ensure_future(sample())]
        started = time.monotonic()
        counting = sampling(count_consumers, 0.1)
        await counting.__aenter__()
        try:
            readers = [asyncio.ensure_future(slow(f)) for f in slow_feeds]
            for request_id in slow_ids:
                await publish_results(client, SUBJECTS, request_id, [large] * results, flush_every=8)
            # Stored on return (its PubAck), so ring_read_all knows the stream's last sequence: a
            # flush alone let STREAM.INFO answer before the burst's tail was stored.
            await publish_result(client, SUBJECTS, rid("marker"), 0, b'{"text":"end"}', final=True, acked=True)
            await ring_read_all(source, client)
            assert all(f.inbox.behind is not None for f in slow_feeds)
            reading.set()
            # The fast feed's pace while the 50 catch up (while the load is published, this process's
            # one loop also runs the publisher: that measured the harness, up to 1.3-2.0 s).
            fast_task = asyncio.ensure_future(fast_reader())
            await asyncio.gather(*readers, fast_task)
        finally:
            for task in samplers:
                task.cancel()
            await counting.__aexit__(None, None, None)
        took = time.monotonic() - started
        async with asyncio.timeout(10):  # the temporary consumers linger 1 s (CONSUMER_LINGER)
            while (await js.stream_info(RESULTS_STREAM)).state.consumer_count != base:
                await asyncio.sleep(0.1)
        print(f"\n{feeds_count} behind feeds: {took:.1f} s; held at most {peaks['feed'] / 1024:.0f} KiB per feed, "
              f"{peaks['total'] / 1024:.0f} KiB in all (bound {BOUND // 1024} KiB); replay consumers at most "
              f"{peaks['replays']} (server: {peaks['consumers']}, base {base}); fast lag max "
              f"{max(lags) * 1000:.0f} ms; by subject {source.metrics.replay_reads_by_subject}")
        assert all(seqs == list(range(results)) for seqs in got.values())
        assert source.metrics.streams_overrun == 0 and source.metrics.streams_behind >= feeds_count
        assert peaks["feed"] <= 3 * BOUND and peaks["total"] <= 3 * BOUND * feeds_count
        assert peaks["replays"] <= replay_consumers
        assert max(lags) < 1.0, lags
        for feed in (*slow_feeds, fast):
            await feed.close()


PAUSED_READERS = os.path.join(os.path.dirname(__file__), "paused_http_readers.py")


async def loop_stalls(ticks: list[tuple[float, float]]) -> None:
    """This loop's stalls: each 5 ms sleep's (start, end, minus the 5 ms it asked for)."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(0.005)
        end = time.monotonic()
        ticks.append((start, end, end - start - 0.005))


@pytest.mark.timeout(90)
async def test_fifty_paused_http_clients_of_live_results_get_them_all_and_the_edge_holds_three_buffers_each(
        nats_server):
    """50 SSE clients read nothing while 5 MiB of live results each arrive (more than a client
    socket's kernel send buffer, 3.9 MB here, takes), then read them; a client beside them gets a
    result every 50 ms. Each paused client gets every byte it should; the fast one keeps its pace
    while they catch up;
    the edge's VmHWM grows by less than three --stream-buffer-bytes per stream (measured +24 MiB
    against that 38 MiB, 23.6-24.1 MiB in nine runs beside two CPU burners: the growth is the buffers',
    not the machine's pace); its temporary consumers are gone afterwards."""
    subjects = Subjects("behindhttp")
    clients, buffer, per_request = 50, 256 * 1024, 80  # 80 x 64 KiB = 5 MiB each
    body64 = b'{"text":"' + b"h" * (64 * 1024 - 12) + b'"}'
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--stream-buffer-bytes", str(buffer), "--max-streams-per-client", "1000") as edge:
        pid = edge.proc.pid
        async with connection(nats_server.url) as nc, connection(nats_server.url) as fast_nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
            js = nc.jetstream()
            base = (await js.stream_info(RESULTS_STREAM)).state.consumer_count
            ids, lags, ticks = [rid(f"paused{i}") for i in range(clients)], [], []
            # The 50 readers run in their own process: run in this loop, their reads stalled it up to
            # 234 ms beside two CPU burners, and the fast one's lag measured those stalls, not the edge.
            readers = await asyncio.create_subprocess_exec(
                sys.executable, PAUSED_READERS, edge.url, *ids,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            assert readers.stdin is not None and readers.stdout is not None
            go = asyncio.Event()
            fast_id = rid("fasthttp")

            async def fast() -> None:
                async with http.stream("GET", f"/v1/results/{fast_id}") as response:
                    lines = response.aiter_lines()
                    for seq in range(60):
                        sent, late = time.monotonic(), go.is_set()
                        # its own connection: not queued behind the bulk publishes
                        await publish_result(fast_nc, subjects, fast_id, seq, b'{"seq":%d}' % seq, final=seq == 59)
                        await fast_nc.flush()
                        while not (line := await anext(lines)).startswith("id: "):
                            pass
                        assert line == f"id: {seq}"
                        got = time.monotonic()
                        # What this loop itself stalled meanwhile (the OS ran something else) is not
                        # the edge's: only stalls wholly inside the wait count, so none is over-counted.
                        stalled = sum(late_by for start, end, late_by in ticks if sent <= start and end <= got)
                        lags.append((late, got - sent, stalled))
                        await asyncio.sleep(0.05)

            try:
                async with asyncio.timeout(20):
                    assert await readers.stdout.readline() == b"connected\n"
                    while edge.metrics()["streamproc_edge_streams_active"] < clients:
                        await asyncio.sleep(0.05)
                baseline = status_kib(pid, "VmRSS")
                ticking = asyncio.ensure_future(loop_stalls(ticks))
                fast_task = asyncio.ensure_future(fast())
                for request_id in ids:
                    await publish_results(nc, subjects, request_id, [body64] * per_request, flush_every=8)
                async with asyncio.timeout(20):  # the ring read them all: what follows is the catch-ups' doing
                    while edge.metrics()["streamproc_edge_results_seen_total"] < clients * per_request:
                        await asyncio.sleep(0.05)
                go.set()
                readers.stdin.write(b"go\n")
                await readers.stdin.drain()
                digests, _ = await asyncio.gather(readers.stdout.readline(), fast_task)
                ticking.cancel()
                assert await readers.wait() == 0
            finally:
                if readers.returncode is None:
                    readers.kill()
                    await readers.wait()
            peak = status_kib(pid, "VmHWM")
            metrics = edge.metrics()
            async with asyncio.timeout(10):  # the temporary consumers linger 1 s (CONSUMER_LINGER)
                while (await js.stream_info(RESULTS_STREAM)).state.consumer_count != base:
                    await asyncio.sleep(0.1)
        expected = hashlib.sha256(expected_sse([body64] * per_request)).hexdigest()
        digests = json.loads(digests)
        assert len(digests) == clients and sum(d != expected for d in digests) == 0, digests
        growth = peak - baseline
        catching = [lag - stalled for late, lag, stalled in lags if late]
        print(f"\n{clients} paused HTTP clients: VmRSS {baseline / 1024:.1f} MiB, VmHWM +{growth / 1024:.1f} MiB "
              f"(3 x buffer x clients = {3 * buffer * clients / 2**20:.0f} MiB); behind "
              f"{metrics['streamproc_edge_streams_behind_total']:.0f}; fast lag max while the 250 MiB were "
              f"published {max(lag for late, lag, _ in lags if not late) * 1000:.0f} ms, while the clients caught "
              f"up {max(catching) * 1000:.0f} ms (median {sorted(catching)[len(catching) // 2] * 1000:.0f} ms; "
              f"this loop's own stalls taken out, at most {max(s for late, _, s in lags if late) * 1000:.0f} ms; "
              f"raw lag max {max(lag for late, lag, _ in lags if late) * 1000:.0f} ms)")
        assert metrics["streamproc_edge_streams_overrun_total"] == 0
        assert metrics["streamproc_edge_streams_behind_total"] >= clients // 2
        assert growth < 3 * buffer * clients // 1024, growth
        # While the results are published the ring reads them all, in stream order, the fast one's
        # among them (a pace set by the server and two shared cores); while 50 streams catch up from
        # the stream beside it, the fast one keeps its pace: nine in ten of its results within 0.5 s,
        # half within 0.1 s, none after 2 s. Not the slowest one within 0.5 s: on a loaded machine
        # (two CPU burners) one or two of ~52 took 0.53-0.76 s while the median stayed at 1 ms, and 3
        # of 6 runs failed on that outlier alone. A fast stream queued behind the catch-ups would
        # wait most of their several seconds, at the median as at the top.
        catching.sort()
        assert len(lags) == 60 and len(catching) >= 20, lags
        assert catching[len(catching) // 2] < 0.1 and catching[len(catching) * 9 // 10] < 0.5, catching
        assert catching[-1] < 2.0, catching


async def test_a_result_without_an_ack_subject_that_a_jetstream_feed_cannot_take_puts_it_behind_from_the_start(
        nats_url, client):
    """A result dispatched with no ``$JS.ACK`` reply (a core delivery, as the ring's old core
    subscription makes until a reread unsubscribes it) that a JetStream feed's full inbox cannot
    take: the feed catches up from the stream's start, as ``_on_inbox_full`` means to. nats-py
    raises ``NotJSMessageError`` (not a ValueError) for such a reply: it escaped the dispatch,
    the feed was neither behind nor overrun, and the result was gone silently for it."""
    await limited_stream(client, 1000)
    async with started_source(nats_url, SUBJECTS, stream_buffer_bytes=BOUND) as source:
        feed = await source.open(rid("noack"))
        assert await feed.next(0.2) is None
        subject = SUBJECTS.result(feed.request_id)
        for seq in range(8):
            await publish(client, feed.request_id, [seq])
            await until(lambda n=seq + 1: len(feed.inbox._items) == n)
        assert feed.inbox.behind is None
        await publish(client, feed.request_id, [8], final_at=8)  # stored; the ring's copy finds no room
        await until(lambda: feed.inbox.behind is not None)
        feed.inbox.behind = None  # as if that copy had come without its ack subject instead:
        source.fanout.dispatch(subject, "", result_headers(Result(feed.request_id, 8, body(8), True)), body(8))
        assert feed.inbox.behind == 1 and not feed.overrun
        seqs, item = await drain(feed)
        assert seqs == list(range(9)) and isinstance(item, Ended), (seqs, item)
        await feed.close()


@pytest.mark.timeout(90)
async def test_catch_ups_without_msg_get_past_max_replay_consumers_wait_for_a_consumer_and_get_it_all():
    """``STREAM.MSG.GET`` refused: a catch-up reads with temporary consumers alone, and made them
    without asking ``--max-replay-consumers`` (12 paused clients made 12 at once; a hostile set
    of them as many as --max-streams). Past the cap such a catch-up cannot read by subject: it
    waits for a consumer (``replay_consumer_waits``). The results stream never holds more than
    the ring's and the cap's consumers (sampled every 20 ms, the lingering ones of stopped
    replays counted), every slow client gets every result in order, and a client beside them
    gets each of its results within a second."""
    feeds_count, cap, count = 12, 3, 32  # four bounds each
    with EmbeddedNats(config=DENY_MSG_GET) as server:
        async with connection(with_user(server.url, "pub")) as nc:
            await ensure_results_stream(nc.jetstream(), SUBJECTS, storage=StorageType.FILE)
            js = nc.jetstream()
            async with started_source(with_user(server.url, "edge"), SUBJECTS, stream_buffer_bytes=BOUND,
                                      max_replay_consumers=cap) as source:
                base = (await js.stream_info(RESULTS_STREAM)).state.consumer_count  # the ring's
                slow_feeds = [await source.open(rid(f"capped{i}")) for i in range(feeds_count)]
                fast = await source.open(rid("fastcap"))
                assert await asyncio.gather(*(f.next(0.2) for f in (*slow_feeds, fast))) == [None] * (feeds_count + 1)
                for feed in slow_feeds:
                    await publish(nc, feed.request_id, range(count), final_at=count - 1)
                await ring_read_all(source, nc)
                assert all(f.inbox.behind is not None for f in slow_feeds)
                peak, lags = [0], []

                async def count_consumers() -> None:
                    peak[0] = max(peak[0], (await js.stream_info(RESULTS_STREAM)).state.consumer_count - base)

                async def slow(feed) -> tuple[list[int], object]:
                    seqs = []
                    while isinstance(item := await feed.next(10.0), ResultInfo):
                        seqs.append(item.seq)
                        await asyncio.sleep(0.005)
                    return seqs, item

                async def fast_reader() -> None:
                    for seq in range(20):
                        sent = time.monotonic()
                        await publish_result(nc, SUBJECTS, fast.request_id, seq, b'{"seq":%d}' % seq,
                                             final=seq == 19)
                        await nc.flush()
                        item = await fast.next(5.0)
                        assert isinstance(item, ResultInfo) and item.seq == seq, item
                        lags.append(time.monotonic() - sent)
                        await asyncio.sleep(0.05)

                async with sampling(count_consumers, 0.02):
                    *ends, _ = await asyncio.gather(*(slow(f) for f in slow_feeds), fast_reader())
                for seqs, item in ends:
                    assert seqs == list(range(count)) and isinstance(item, Ended), (seqs, item)
                print(f"\n{feeds_count} catch-ups without MSG.GET, cap {cap}: server consumers at most "
                      f"{peak[0]} beside the ring's; waits {source.metrics.replay_consumer_waits}; pauses "
                      f"{source.metrics.replay_pauses}; fast lag max {max(lags) * 1000:.0f} ms")
                assert peak[0] <= cap, peak
                assert source.metrics.replay_consumer_waits > 0 and source.metrics.streams_overrun == 0
                # A freed consumer wakes one waiting catch-up, not all of them (430 looks for 36
                # consumers here, when every free woke all 12), and a wait is counted once per
                # consumer waited for, not per look: at most one per consumer the catch-ups made.
                needed = feeds_count + source.metrics.replay_pauses
                assert source.metrics.replay_consumer_waits <= needed, (source.metrics.replay_consumer_waits, needed)
                assert max(lags) < 1.0, lags
                for feed in (*slow_feeds, fast):
                    await feed.close()


@pytest.mark.timeout(60)
async def test_a_catch_up_waiting_for_a_replay_consumer_hears_at_once_that_its_stream_is_gone():
    """``STREAM.MSG.GET`` refused and the one replay consumer (``--max-replay-consumers 1``) held by
    another catch-up whose client reads no more: a second catch-up waits for it. The results
    stream is deleted meanwhile: the waiting one ends with :class:`StreamGone` when the watch sees
    it, not when its wait's timeout (the keep-alive interval) runs out."""
    async with a_catch_up_waiting_for_the_one_replay_consumer() as (source, nc, holder, waiter, seqs, item):
        assert seqs == list(range(len(seqs))) and item is None, (seqs, item)
        assert source.metrics.replay_consumer_waits > 0 and waiter.replay is not None
        await nc.jetstream().delete_stream(RESULTS_STREAM)
        started = time.monotonic()
        item = await waiter.next(10.0)
        took = time.monotonic() - started
        assert isinstance(item, StreamGone) and took < 3.0, (item, took)
        for feed in (holder, waiter):
            await feed.close()


@pytest.mark.timeout(60)
async def test_a_catch_up_waiting_for_a_replay_consumer_counts_one_wait_however_often_it_looks_again():
    """``replay_consumer_waits`` counts waiting episodes (one per consumer a catch-up had to wait
    for), not looks: a client that gets keep-alives while its catch-up waits makes it look again
    at each one (it counted 11 here, one per ``next``)."""
    async with a_catch_up_waiting_for_the_one_replay_consumer(final_at=63) as (source, nc, holder, waiter, seqs, item):
        assert item is None, (seqs, item)
        for _ in range(10):  # keep-alives: it looks again each time
            assert await waiter.next(0.05) is None
        assert source.metrics.replay_consumer_waits == 1
        await holder.close()  # its consumer is freed (once the server dropped it)
        rest, item = await drain(waiter, 10.0)
        assert seqs + rest == list(range(64)) and isinstance(item, Ended), (seqs, rest, item)
        # One more wait at most per consumer it needed after a pause (the paused one lingers).
        assert source.metrics.replay_consumer_waits <= 1 + source.metrics.replay_pauses, (
            source.metrics.replay_consumer_waits, source.metrics.replay_pauses)
        await waiter.close()


ALLOW_MSG_GET = edge_user_denied(PULLS, publisher=True)


async def grant_msg_get(server: EmbeddedNats) -> None:
    """The edge user may publish ``STREAM.MSG.GET`` from now on: nats-server reloads its
    configuration file without it denied (SIGHUP), as an operator granting it would."""
    (server.log_path.parent / "server.conf").write_text(ALLOW_MSG_GET)
    os.kill(server.pid, signal.SIGHUP)
    await until(lambda: "Reloaded server configuration" in server.log_path.read_text(), 10.0)


@pytest.mark.timeout(120)
async def test_a_catch_up_waiting_for_a_replay_consumer_gets_the_next_one_freed_before_later_late_attaches():
    """A catch-up that may read with consumers alone (it fell behind while ``STREAM.MSG.GET`` was
    refused) waits for one past ``--max-replay-consumers``. Late attaches that may read by subject
    (the permission was granted since) keep coming, each with a history it would read with a
    consumer if one were free. The slot freed next is the waiting catch-up's: no late attach opened
    after it began to wait reads with a consumer before it got one (they read by subject), it gets
    its first result within a bound, and the consumers never exceed the cap. Before, a woken
    catch-up lost the slot to whichever late attach asked first (every late attach reading by
    subject asks at each result), went back to the queue, and waited for the next one freed."""
    cap, history, workers = 1, 40, 6
    with EmbeddedNats(config=DENY_MSG_GET) as server:
        async with connection(with_user(server.url, "pub")) as nc:
            js = nc.jetstream()
            await ensure_results_stream(js, SUBJECTS, storage=StorageType.FILE)
            async with started_source(with_user(server.url, "edge"), SUBJECTS, stream_buffer_bytes=BOUND,
                                      max_replay_consumers=cap) as source:
                base = (await js.stream_info(RESULTS_STREAM)).state.consumer_count  # the ring's
                holder, waiter = await source.open(rid("holder")), await source.open(rid("waiter"))
                assert await holder.next(0.2) is None and await waiter.next(0.2) is None
                late_ids = [rid(f"late{i}") for i in range(workers * 4)]  # each attached again and again
                for request_id in late_ids:  # stored histories, read by late attaches below
                    await publish_results(nc, SUBJECTS, request_id, [b'{"n":%d}' % n for n in range(history)],
                                          flush_every=history)
                await behind(source, holder, nc, 64)
                await into_catch_up(source, holder)  # its consumer holds the slot; its client stops reading
                await behind(source, waiter, nc, 64, final_at=63)
                seqs, item = await drain(waiter, 0.5)  # what its inbox held; then it waits for a consumer
                assert item is None and source.metrics.replay_consumer_waits >= 1, (seqs, item)
                await grant_msg_get(server)
                source.msg_get.reprobe = 0.0  # the next open tries MSG.GET again
                peak, held_peak = [0], [0]
                late: list[tuple[float, float, bool]] = []  # (opened, done, read with a consumer)
                stop = asyncio.Event()

                async def count_consumers() -> None:
                    peak[0] = max(peak[0], (await js.stream_info(RESULTS_STREAM)).state.consumer_count - base)
                    held_peak[0] = max(held_peak[0], source._replay_consumers_held())

                async def late_attaches(ids: list[str]) -> None:
                    for request_id in itertools.cycle(ids):
                        if stop.is_set():
                            return
                        opened = time.monotonic()
                        feed = await source.open(request_id)
                        replay = feed.replay
                        assert replay is not None
                        got = []
                        while isinstance(item := await feed.next(10.0), ResultInfo):
                            got.append(item.seq)
                        assert got == list(range(history)) and isinstance(item, Ended), (got, item)
                        late.append((opened, time.monotonic(), replay.taken > 0))
                        await feed.close()

                async def slow_waiter() -> tuple[list[int], object, list[float]]:
                    """Its client is slower than a consumer pushes (until 2026-12-06 it paused at each
                    bound's worth and needed a new consumer each time, competing with the late
                    attaches for it; its push consumer is held to max_ack_pending since). It
                    is sent a keep-alive every 0.25 s while it waits, which its client takes 50 ms
                    to read (an SSE stream's loop, app.py)."""
                    got, gaps, last = [], [], time.monotonic()
                    while True:
                        item = await waiter.next(0.25)
                        if item is None:
                            if time.monotonic() - last > 10.0:  # starved: given up
                                gaps.append(time.monotonic() - last)
                                break
                            await asyncio.sleep(0.05)
                            continue
                        if not isinstance(item, ResultInfo):
                            break
                        got.append(item.seq)
                        gaps.append(time.monotonic() - last)
                        await asyncio.sleep(0.005)
                        last = time.monotonic()
                    return got, item, gaps

                counting = sampling(count_consumers, 0.02)
                await counting.__aenter__()
                loads = [asyncio.ensure_future(late_attaches(late_ids[i::workers])) for i in range(workers)]
                try:
                    await until(lambda: len(late) >= workers, 10.0)  # the load is on: late attaches read by subject
                    assert source.msg_get.state == "allowed"
                    assert not any(used for _, _, used in late), late
                    started = time.monotonic()
                    await holder.close()  # its consumer is freed once the server dropped it (~1.5 s)
                    rest, end, gaps = await slow_waiter()
                    took = time.monotonic() - started
                    stolen = [done for opened, done, used in late if used]  # done before the catch-up's end
                    stop.set()
                    await asyncio.gather(*loads)
                finally:
                    stop.set()
                    for task in loads:
                        task.cancel()
                    await counting.__aexit__(None, None, None)
                print(f"\ncatch-up waiting beside {workers} late attaches: done after {took:.2f} s, its longest wait "
                      f"for a result {max(gaps):.2f} s, pauses {source.metrics.replay_pauses}; late attaches "
                      f"{len(late)}, with a consumer {sum(u for _, _, u in late)} (done before the catch-up's "
                      f"end: {len(stolen)}); by subject {source.metrics.replay_reads_by_subject}; consumers at "
                      f"most {peak[0]} beside the ring's (held {held_peak[0]}); waits "
                      f"{source.metrics.replay_consumer_waits}")
                assert not stolen, "late attaches read with consumers the catch-up waited for"
                # Each wait: the consumer before it lingers on the server (REPLAY_SLOT_LINGER, 1.5 s).
                assert max(gaps) < 6.0, gaps
                assert seqs + rest == list(range(64)) and isinstance(end, Ended), (seqs, rest, end)
                # Since 2026-12-06 its push consumer is held to max_ack_pending and acknowledged as it
                # reads: it reads on with the one consumer it got, no pause, no new consumer to wait for.
                assert source.metrics.replay_pauses == 0
                assert peak[0] <= cap and held_peak[0] <= cap, (peak, held_peak)
                assert source.metrics.replay_reads_by_subject > 0
                await waiter.close()


async def test_a_feed_closed_while_a_replay_slot_is_kept_for_it_gives_the_slot_back(nats_url):
    """A catch-up can be queued for a replay consumer by a replay the results stream's recreation
    already took from it (``_stop_replays`` then its MSG.GET times out): a slot freed later is kept
    for that feed, which then closes by the fast path (no replay left). The slot went with it, and
    the cap was one lower for the edge's life (found by review; this sets up that end state). A
    slot is now kept only for a feed waiting in ``next()`` for it: here the feed is, when another
    task closes it."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND,
                              max_replay_consumers=1) as source:
        feed = await source.open(rid("late"))
        assert await feed.next(0.5) is None and feed.replay is None  # its probe found nothing stored
        source._replays_creating += 1  # another replay's consumer holds the one slot
        assert source._may_replay_with_consumer(feed, True) is False  # queued for it
        waiting = await parked(source, feed)
        source._replay_consumer_made()  # that consumer failed: its slot is kept for the feed
        assert feed.slot_reserved
        await feed.close()
        await asyncio.wait_for(waiting, 1.0)
        assert source._replay_consumers_held() == 0, (source._slots_reserved, feed.slot_reserved)
        assert not source._slot_waiters


async def queued_for_a_replay_consumer(source, *names: str) -> list:
    """With ``--max-replay-consumers 1`` held by another replay's consumer being made: a feed per
    name (nothing stored), queued for a consumer in that order."""
    feeds = [await source.open(rid(name)) for name in names]
    for feed in feeds:
        assert await feed.next(0.5) is None and feed.replay is None  # its probe found nothing stored
    source._replays_creating += 1  # another replay's consumer holds the one slot
    for feed in feeds:
        assert source._may_replay_with_consumer(feed, True) is False
    assert list(source._slot_waiters) == feeds
    return feeds


async def parked(source, feed) -> asyncio.Future:
    """``feed``'s reader waiting in ``next()`` for a replay consumer (``replay_slot``)."""
    waiting = asyncio.ensure_future(source.replay_slot(feed, 10.0))
    await until(lambda: feed.slot_waiter is not None)
    return waiting


async def test_a_replay_slot_freed_while_the_first_waiting_catch_up_writes_goes_to_one_waiting_for_it(nats_url):
    """The catch-up first in the queue for a replay consumer is not in ``next()`` when one is freed:
    its handler is writing (a keep-alive or a batch to a slow client, up to ``--write-timeout``).
    The slot goes to the next catch-up that is waiting in ``next()``, and the first keeps its place.
    Before, the slot was kept for the first, idle until its handler looked again, while the other
    waited (its wait timed out here)."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND,
                              max_replay_consumers=1) as source:
        busy, waiting = await queued_for_a_replay_consumer(source, "busy", "waiting")
        wait = await parked(source, waiting)
        source._replay_consumer_made()  # that consumer failed: its slot is free
        await asyncio.wait_for(wait, 1.0)
        assert waiting.slot_reserved and not busy.slot_reserved
        assert list(source._slot_waiters) == [busy]  # its place is kept
        assert source._may_replay_with_consumer(waiting, True)  # its replay makes the consumer
        source._replay_consumer_made()  # which fails: the slot is free again, nobody waits in next()
        late = await source.open(rid("late"))
        assert source._may_replay_with_consumer(late, False) is False  # free for the queue: by subject
        assert source._may_replay_with_consumer(busy, True)  # the first looks again: it is its
        assert not source._slot_waiters
        source._replay_consumer_made()
        assert source._replay_consumers_held() == 0
        for feed in (busy, waiting, late):
            await feed.close()


async def test_a_catch_up_woken_with_a_replay_slot_whose_next_is_cancelled_gives_the_slot_on_and_keeps_its_place(
        nats_url):
    """A catch-up's ``next()`` can be cancelled while it waits for a replay consumer (its client
    left; or a caller's timeout around ``next()``, after which it may read again). Cancelled after a
    freed slot was kept for it and it was woken, but before it ran: the slot goes to the next one
    waiting in ``next()``, and it keeps its place first in the queue. Before, the slot stayed kept
    for a feed nobody read until its close (the other's wait timed out here)."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True, stream_buffer_bytes=BOUND,
                              max_replay_consumers=1) as source:
        gone, waiting = await queued_for_a_replay_consumer(source, "cancelled", "waiting")
        first, second = await parked(source, gone), await parked(source, waiting)
        source._replay_consumer_made()  # the slot is freed: kept for the first, which is woken
        assert gone.slot_reserved
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 1.0)
        assert waiting.slot_reserved and not gone.slot_reserved
        assert list(source._slot_waiters) == [gone]
        assert source._may_replay_with_consumer(waiting, True)
        source._replay_consumer_made()
        assert source._may_replay_with_consumer(gone, True)  # it reads again: the next slot is its
        source._replay_consumer_made()
        assert source._replay_consumers_held() == 0
        for feed in (gone, waiting):
            await feed.close()


@pytest.mark.timeout(60)
async def test_a_catch_up_whose_next_was_cancelled_while_it_waited_for_a_replay_consumer_reads_on_when_asked_again():
    """The edge's own handlers close a feed as soon as its ``next()`` is cancelled (the client
    left), but a caller may bound ``next()`` with a timeout of its own and read again: the catch-up
    keeps its place meanwhile, gets the consumer freed later, and every result."""
    async with a_catch_up_waiting_for_the_one_replay_consumer(final_at=63) as (source, nc, holder, waiter, seqs, item):
        assert item is None, (seqs, item)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(waiter.next(10.0), 0.3)  # cancelled while it waits
        assert waiter in source._slot_waiters and waiter.slot_waiter is None
        await holder.close()  # its consumer is freed once the server dropped it
        await until(lambda: source._replay_consumers_held() == 0 or waiter.slot_reserved, 10.0)
        rest, item = await drain(waiter, 10.0)
        assert seqs + rest == list(range(64)) and isinstance(item, Ended), (seqs, rest, item)
        await waiter.close()
        assert source._replay_consumers_held() <= source._replays_lingering, source._slots_reserved


DENY_PULLS = edge_user_denied(PULLS, publisher=True)
ALLOW_ALL = edge_user_denied(publisher=True)


@pytest.mark.timeout(60)
async def test_late_attaches_read_by_subject_while_pulls_are_refused_and_pull_once_granted():
    """An edge user may not publish CONSUMER.MSG.NEXT (the permission set before 2026-12-05): the
    first pull of a late attach is refused (the connection's -ERR), and that replay, and the next
    ones, read each result by subject (STREAM.MSG.GET, charged to the read budget: a push consumer's
    flow control is not held to it, and many had the edge's connection cut; before 2026-12-06 they
    read with push consumers, paused at the bound), every result in order. Once the permission is
    granted (a reload), the next re-probe pulls, and a slow late attach then is sent no more than
    its bound holds: no pause."""
    count = 40
    body = b'{"text":"' + b"x" * (16 * 1024 - 12) + b'"}'  # 640 KiB stored, ten bounds
    with EmbeddedNats(config=DENY_PULLS) as server:
        async with connection(with_user(server.url, "pub")) as nc:
            await ensure_results_stream(nc.jetstream(), SUBJECTS, storage=StorageType.FILE)
            async with started_source(with_user(server.url, "edge"), SUBJECTS, stream_buffer_bytes=BOUND) as source:
                request_id = rid("pulls-refused")
                await publish_results(nc, SUBJECTS, request_id, [body] * count, flush_every=8)
                await until(lambda: source.metrics.results_seen >= count)

                async def late_attach() -> tuple[int, int]:
                    feed = await source.open(request_id)
                    pauses = source.metrics.replay_pauses
                    seqs = []
                    while isinstance(item := await feed.next(5.0), ResultInfo):
                        seqs.append(item.seq)
                        await asyncio.sleep(0.005)  # slower than NATS
                    assert seqs == list(range(count)) and isinstance(item, Ended), (seqs, item)
                    pulled = feed.replay.pulled if feed.replay is not None else 0
                    await feed.close()
                    return source.metrics.replay_pauses - pauses, pulled  # paused, pulls sent

                assert await late_attach() == (0, 1)  # its one pull refused, then by subject: no pause
                assert source.pulls.state == "refused"
                asked = source.read_gate.budget.granted_total
                assert await late_attach() == (0, 0)  # no pull tried again before the re-probe, no push consumer
                assert source.read_gate.budget.granted_total - asked >= (count - 1) * len(body)  # each by MSG.GET
                (server.log_path.parent / "server.conf").write_text(ALLOW_ALL)
                os.kill(server.pid, signal.SIGHUP)
                await until(lambda: "Reloaded server configuration" in server.log_path.read_text(), 10.0)
                source.pulls.reprobe = 0.0
                paused, pulled = await late_attach()
                assert paused == 0 and pulled > 0  # pulled: never more than the bound
                assert source.pulls.state == "allowed"
                assert source.metrics.streams_overrun == 0


DENY_DELETES = """
authorization {
  users = [
    {user: edge, password: edge, permissions: {publish: {deny: ["$JS.API.CONSUMER.DELETE.>"]}}}
    {user: pub, password: pub}
  ]
}
"""


@pytest.mark.timeout(60)
async def test_a_replay_consumer_the_edge_could_not_delete_counts_against_the_cap_until_the_server_drops_it():
    """A pull consumer whose delete failed (refused here; a lost answer alike) stays on the server
    until its inactive threshold. It had 60 s (REPLAY_CONSUMER_IDLE) and was counted against
    --max-replay-consumers for 1.5 s (REPLAY_SLOT_LINGER): the server held more consumers than the
    cap for up to a minute. The edge's consumers now have a short threshold, and one not deleted is
    counted until the server has dropped it."""
    from streamproc.edge.source import REPLAY_PULL_SLOT_LINGER

    with EmbeddedNats(config=DENY_DELETES) as server:
        async with connection(with_user(server.url, "pub")) as nc:
            js = nc.jetstream()
            await ensure_results_stream(js, SUBJECTS)
            async with started_source(with_user(server.url, "edge"), SUBJECTS, max_replay_consumers=1) as source:
                request_id = rid("undeleted")
                await publish(nc, request_id, range(5), final_at=4)
                await until(lambda: source.metrics.results_seen >= 5)
                stream = source.fanout.stream
                consumers = (await js.stream_info(stream)).state.consumer_count
                feed = await source.open(request_id)
                seqs, item = await drain(feed, 15.0)  # its delete is refused: waits out the replay timeout
                assert seqs == list(range(5)) and isinstance(item, Ended), (seqs, item)
                await feed.close()
                assert (await js.stream_info(stream)).state.consumer_count == consumers + 1  # not deleted
                started = time.monotonic()
                while (await js.stream_info(stream)).state.consumer_count > consumers:  # the server still has it
                    assert source._replay_consumers_held() >= 1, (
                        f"the slot was free {time.monotonic() - started:.1f} s after the drop while the "
                        "server still held the consumer")
                    assert time.monotonic() - started < REPLAY_PULL_SLOT_LINGER + 2.0, "the server kept it"
                    await asyncio.sleep(0.2)
                await until(lambda: source._replay_consumers_held() == 0, REPLAY_PULL_SLOT_LINGER + 1.0)


async def test_a_replay_consumer_deleted_before_its_first_pull_is_made_again_without_calling_pulls_refused(nats_url):
    """A pull consumer deleted between its creation and its first pull (another user of the edge's
    account, a stream recreated) answers that pull ``503`` no responders, as a missing
    CONSUMER.MSG.NEXT import does. Once a pull was answered the permission is known: the replay
    makes its consumer again and every result comes, and the edge does not log
    ``replay_pulls_refused`` nor fall back to push consumers for every later replay."""
    count = 40  # five bounds stored: read by a pull consumer
    pulls = b"$JS.API.CONSUMER.MSG.NEXT."
    proxy = HoldingProxy(int(nats_url.rsplit(":", 1)[1]), lambda subject: subject.startswith(pulls))
    async with proxy.running(), connection(nats_url) as nc:
        js = nc.jetstream()
        stream = await ensure_results_stream(js, SUBJECTS, storage=StorageType.FILE)
        async with started_source(proxy.url, SUBJECTS, stream_buffer_bytes=BOUND) as source:
            request_id = rid("deleted-before-pull")
            await publish(nc, request_id, range(count), final_at=count - 1)
            await until(lambda: source.metrics.results_seen >= count)

            async def late_attach() -> list[int]:
                feed = await source.open(request_id)
                seqs, item = await drain(feed, 10.0)
                assert isinstance(item, Ended), (seqs, item)
                await feed.close()
                return seqs

            assert await late_attach() == list(range(count))  # pulled: the permission is known
            assert source.pulls.state == "allowed"
            proxy.arm()
            attach = asyncio.ensure_future(late_attach())
            with anyio.fail_after(10):
                await proxy.held.wait()  # its consumer made, its first pull held back
            await js.delete_consumer(stream.config.name, proxy.held_subject.rsplit(b".", 1)[1].decode())
            proxy.release()  # reaches the server with no consumer to answer it: 503
            assert await asyncio.wait_for(attach, 15) == list(range(count))
            assert source.pulls.state == "allowed", source.pulls.reason
