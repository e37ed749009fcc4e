"""A ring open's replay by consumers (STREAM.MSG.GET refused) whose consumer finds nothing stored.

Such an open asks one STREAM.INFO first (``Replay._nothing_stored``); where that fails, or the
subject's results expire or are purged between it and the consumer being made, the consumer itself
finds nothing. Until 2026-12-06 a pull consumer's "no messages" was read as a result larger than the
bound (``Refused``: the feed fell back to an ordered consumer of its own from the stream's start,
outside the read budget), and a push consumer (pulls refused) was waited on ``REPLAY_TIMEOUT``
(5 s) and the stream ended as ``Lost``. Now the replay is done and every later result comes by
dispatch. Real nats-server; STREAM.INFO's failure is forced by making ``subject_split`` raise.
"""

from __future__ import annotations

import time

import nats.errors
import pytest
from edge_harness import publish_result, ring_read_all, started_source
from helpers import connection, rid, wait_until
from nats_auth import ACKS, MSG_GET, PULLS, edge_user_denied

from streamproc.core.wire import ResultInfo
from streamproc.edge import replay as replay_module
from streamproc.edge.feed import Ended, Gap
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = [pytest.mark.nats]

# The edge user may not publish $JS.API.STREAM.MSG.GET: stored histories are read with consumers alone.
NO_MSG_GET = edge_user_denied(MSG_GET)
# Nor CONSUMER.MSG.NEXT: push consumers held to the read budget by their max_ack_pending.
NO_MSG_GET_NOR_PULLS = edge_user_denied(MSG_GET, PULLS)
# Nor acknowledge a push consumer's deliveries.
NO_MSG_GET_PULLS_NOR_ACKS = edge_user_denied(MSG_GET, PULLS, ACKS)
CONFIGS = {"pulls": NO_MSG_GET, "pulls refused": NO_MSG_GET_NOR_PULLS,
           "pulls and acks refused": NO_MSG_GET_PULLS_NOR_ACKS}


async def unanswered(*args, **kwargs):
    raise nats.errors.TimeoutError


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("mode", list(CONFIGS))
async def test_a_ring_open_whose_consumer_finds_nothing_stored_gets_every_result_by_dispatch_in_the_budget(
        anyio_backend, mode, monkeypatch):
    """STREAM.INFO unanswered, an open with nothing stored yet (a client before its request starts)
    makes its consumer (in the read budget), which finds nothing: the replay is done at once, with
    no ordered consumer of the feed's own (``fall_back``) and no wait of REPLAY_TIMEOUT, and the
    results published later come by dispatch, each once, in order, and the stream ends."""
    subjects = Subjects("nothingfound")
    with EmbeddedNats(config=CONFIGS[mode]) as server:
        url = server.url.replace("nats://", "nats://edge:edge@")
        async with connection(url) as nc, started_source(url, subjects, ensure_results_stream=True) as source:
            other = rid("other")
            for seq in range(4):  # the ring has delivered something: upto > 0
                await publish_result(nc, subjects, other, seq, b'{"n":%d}' % seq)
            await nc.flush()
            await ring_read_all(source, nc)
            source.msg_get.refused("denied by the test's configuration")  # as found by an earlier open
            monkeypatch.setattr(replay_module, "subject_split", unanswered)
            request_id = rid("empty")
            feed = await source.open(request_id)
            assert feed.inbox is not None and feed.replay is not None and feed.replay.by_consumer
            started = time.monotonic()
            # the client waits for its request's first result: its replay's consumer finds nothing
            waited = await feed.next(1.0)
            assert waited is None and time.monotonic() - started < 2.0, (waited, time.monotonic() - started)
            assert feed.replay is None  # done: nothing stored up to what the ring delivered
            assert feed.inbox is not None and feed._sub is None  # not fallen back to a consumer of its own
            count = 6
            for seq in range(count):
                await publish_result(nc, subjects, request_id, seq, b'{"n":%d}' % seq, final=seq == count - 1)
            await nc.flush()
            published = time.monotonic()
            seqs, first_at = [], None
            while isinstance(item := await feed.next(10.0), ResultInfo):
                if first_at is None:
                    first_at = time.monotonic() - published
                seqs.append(item.seq)
            assert isinstance(item, Ended), (seqs, item)
            assert seqs == list(range(count))
            assert first_at is not None and first_at < 2.0, first_at
            # dispatched to the end: no ordered consumer of its own from the stream's start
            assert feed.inbox is not None and feed._sub is None
            assert source.metrics.duplicates_dropped == 0
            await feed.close()
            await wait_until(lambda: source.read_gate.out == 0, 5, "every charge given back")


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("mode", ["pulls", "pulls refused"])
async def test_results_purged_between_the_opens_stream_info_and_its_consumer_end_in_a_gap_not_a_fallback(
        anyio_backend, mode, monkeypatch):
    """The open's STREAM.INFO finds the request's results stored, and they are purged before its
    consumer is made (the same as expiring then): the consumer finds nothing, the replay is done at
    once, the feed stays dispatched (no ordered consumer from the stream's start), and the client,
    given the later results by dispatch, is told of the purged ones as a gap after --gap-timeout,
    not a fallback nor an error after 5 s."""
    subjects = Subjects("purgedrace")
    with EmbeddedNats(config=CONFIGS[mode]) as server:
        url = server.url.replace("nats://", "nats://edge:edge@")
        async with connection(url) as nc, started_source(url, subjects, ensure_results_stream=True,
                                                         gap_timeout=1.0) as source:
            request_id = rid("purged")
            for seq in range(4):
                await publish_result(nc, subjects, request_id, seq, b'{"n":%d}' % seq)
            await nc.flush()
            stream = source.fanout.stream
            js = nc.jetstream()
            await ring_read_all(source, nc)
            source.msg_get.refused("denied by the test's configuration")
            checked = replay_module.Replay._nothing_stored
            found: list[bool] = []

            async def purged_after_the_check(replay):
                nothing = await checked(replay)
                found.append(nothing)
                await js.purge_stream(stream, subject=replay.subject)
                return nothing

            monkeypatch.setattr(replay_module.Replay, "_nothing_stored", purged_after_the_check)
            feed = await source.open(request_id)
            started = time.monotonic()
            waited = await feed.next(0.5)
            assert found == [False]  # stored at the check
            assert waited is None and time.monotonic() - started < 2.0, (waited, time.monotonic() - started)
            assert feed.replay is None and feed.inbox is not None and feed._sub is None
            for seq in range(4, 8):
                await publish_result(nc, subjects, request_id, seq, b'{"n":%d}' % seq, final=seq == 7)
            await nc.flush()
            item = await feed.next(5.0)
            assert item == Gap(0, 4), item
            assert feed.inbox is not None and feed._sub is None
            await feed.close()
            await wait_until(lambda: source.read_gate.out == 0, 5, "every charge given back")
