"""A ring open's replay by consumers (STREAM.MSG.GET refused) whose pulls end with nothing brought
under a ``408``/``409`` status that says nothing of what is stored.

nats-server ends a pull so when the consumer's waiting queue is full (``409 Exceeded MaxWaiting``),
its leader changes (``409 Leadership Change``), it shuts down (``409 Server Shutdown``) or the pull
expired (``408 Request Timeout``). Until 2026-12-06 the replay took such an ending for a result
larger than the bound (``Refused``) and its feed fell back to an ordered consumer from the stream's
start, outside the read budget. Now the pull goes again after a backoff, a bounded number of times,
and then the stream ends with an error event. A real nats-server cannot be made to send these at a
chosen pull: a proxy between the edge and it (:class:`proxy_helpers.PullAnswered`) turns the edge's
pulls into those statuses, which the real server delivers to the edge's inbox.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import pytest
from edge_harness import publish_result, ring_read_all, started_source
from helpers import connection, rid, sampling, wait_until
from nats_auth import MSG_GET, edge_user_denied
from proxy_helpers import HoldingProxy, PullAnswered

from streamproc.core.wire import ResultInfo
from streamproc.edge.feed import Ended, Lost
from streamproc.nats.replay_pull import REPLAY_BUSY_BACKOFF, REPLAY_BUSY_RETRIES
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

# The edge user may not publish $JS.API.STREAM.MSG.GET: stored histories are read with pull consumers alone.
NO_MSG_GET = edge_user_denied(MSG_GET)
BUSY = [b"409 Exceeded MaxWaiting", b"408 Request Timeout", b"409 Leadership Change", b"409 Server Shutdown"]


class OutsideConsumers:
    """Consumers of the stream made after :meth:`baseline` other than the replays' pull consumers:
    an ordered consumer of a fallen-back feed, outside the read budget (sampled while a test runs)."""

    def __init__(self, js, stream: str) -> None:
        self.js, self.stream = js, stream
        self.before: set[str] = set()
        self.seen: set[str] = set()

    async def names(self) -> set[str]:
        return {info.name for info in await self.js.consumers_info(self.stream)}

    async def baseline(self) -> None:
        self.before = await self.names()

    async def sample(self) -> None:
        self.seen |= {name for name in await self.names()
                      if name not in self.before and not name.startswith("streamproc_replay_")}


@asynccontextmanager
async def busy_edge(name: str, answered: PullAnswered, stored: int, config: str = NO_MSG_GET):
    """A results stream holding ``stored`` results of one request, read all by the ring of an edge
    source whose NATS traffic passes a proxy that answers its pulls as ``answered`` says; yields
    ``(nc, subjects, source, request_id, outside)``, ``outside``'s baseline taken."""
    subjects = Subjects(name)
    with EmbeddedNats(config=config) as server:
        proxy = HoldingProxy(int(server.url.rsplit(":", 1)[1]), lambda subject: False, rewrite=answered)
        async with proxy.running(), connection(server.url.replace("nats://", "nats://edge:edge@")) as nc:
            edge_url = proxy.url.replace("nats://", "nats://edge:edge@")
            async with started_source(edge_url, subjects, ensure_results_stream=True) as source:
                request_id = rid(name)
                for seq in range(stored):
                    await publish_result(nc, subjects, request_id, seq, b'{"n":%d}' % seq, acked=True)
                await ring_read_all(source, nc)
                outside = OutsideConsumers(nc.jetstream(), source.fanout.stream)
                await outside.baseline()
                yield nc, subjects, source, request_id, outside


@pytest.mark.parametrize("status", BUSY, ids=[s.decode() for s in BUSY])
async def test_pulls_ended_busy_are_sent_again_in_the_budget_and_every_stored_result_arrives_once(status):
    """The replay's first pulls end with the status and nothing brought: the pull goes again after a
    backoff, and the stored results come by that consumer, then the later ones by dispatch, each
    once and in order; no consumer outside the budget is made, and the budget ends at zero."""
    answered = PullAnswered(status, times=REPLAY_BUSY_RETRIES - 1)
    stored = 6
    async with busy_edge("pullbusy", answered, stored) as (nc, subjects, source, request_id, outside):
        source.msg_get.refused("denied by the test's configuration")  # as found by an earlier open
        async with sampling(outside.sample, 0.02):
            feed = await source.open(request_id)
            assert feed.replay is not None and feed.replay.by_consumer
            seqs = []
            while len(seqs) < stored and isinstance(item := await feed.next(10.0), ResultInfo):
                seqs.append(item.seq)
            assert seqs == list(range(stored)), (seqs, item)
            for seq in range(stored, stored + 2):
                await publish_result(nc, subjects, request_id, seq, b'{"n":%d}' % seq,
                                     final=seq == stored + 1)
            while isinstance(item := await feed.next(10.0), ResultInfo):
                seqs.append(item.seq)
            assert isinstance(item, Ended), (seqs, item)
        await outside.sample()  # once more while the feed is open (a consumer of its own lives as long)
        assert seqs == list(range(stored + 2))
        assert outside.seen == set()  # no ordered consumer from the stream's start
        assert feed.inbox is not None and feed._sub is None  # dispatched to the end, never fallen back
        assert answered.answered == REPLAY_BUSY_RETRIES - 1  # every busy pull was sent again
        assert source.metrics.duplicates_dropped == 0
        await feed.close()
        await wait_until(lambda: source.read_gate.out == 0, 5, "every charge given back")


async def test_pulls_that_keep_ending_busy_end_the_stream_with_an_error_not_a_consumer_outside_the_budget():
    """Every pull of the replay ends ``409 Exceeded MaxWaiting``: after REPLAY_BUSY_RETRIES pulls sent
    again (about 1.5 s of backoff) the stream ends with an error event (``Lost``), as for a history
    it cannot read; no ordered consumer from the stream's start is made, and the budget ends at zero."""
    answered = PullAnswered(b"409 Exceeded MaxWaiting")
    async with busy_edge("pullbusyever", answered, 4) as (nc, subjects, source, request_id, outside):
        source.msg_get.refused("denied by the test's configuration")
        async with sampling(outside.sample, 0.02):
            feed = await source.open(request_id)
            started = time.monotonic()
            item = await feed.next(10.0)
            took = time.monotonic() - started
            assert isinstance(item, Lost), item
            assert "409 Exceeded MaxWaiting" in item.reason, item.reason
            assert f"{REPLAY_BUSY_RETRIES + 1} pulls in a row" in item.reason, item.reason
        await outside.sample()
        backoff = REPLAY_BUSY_BACKOFF * (2 ** REPLAY_BUSY_RETRIES - 1)
        assert backoff <= took < backoff + 3.0, took
        assert answered.answered == REPLAY_BUSY_RETRIES + 1  # the first pull and its retries
        assert outside.seen == set()
        assert feed._sub is None
        await feed.close()
        await wait_until(lambda: source.read_gate.out == 0, 5, "every charge given back")


async def test_pulls_that_keep_ending_busy_after_msg_get_answered_at_the_open_read_the_rest_by_subject():
    """An open made while MSG.GET is not yet known to answer (an edge just started: ``by_consumer``
    None) asks MSG.GET first, which answers: its pull consumer's pulls then all end ``409 Exceeded
    MaxWaiting``. Past REPLAY_BUSY_RETRIES the rest of the history comes by subject, in the budget,
    as where MSG.GET was known to answer at the open (docs/edge.md), not an error event: MSG.GET
    answered this very replay."""
    answered = PullAnswered(b"409 Exceeded MaxWaiting")
    stored = 4
    async with busy_edge("pullbusyget", answered, stored, config=edge_user_denied()) as (
            nc, subjects, source, request_id, outside):
        assert source.msg_get is not None and not source.msg_get.confirmed  # nothing asked it yet
        async with sampling(outside.sample, 0.02):
            feed = await source.open(request_id)
            assert feed.replay is not None and feed.replay.by_consumer is None
            seqs = []
            while len(seqs) < stored and isinstance(item := await feed.next(10.0), ResultInfo):
                seqs.append(item.seq)
            assert seqs == list(range(stored)), (seqs, item)
            assert source.msg_get.confirmed
            await publish_result(nc, subjects, request_id, stored, b'{"n":%d}' % stored, final=True)
            while isinstance(item := await feed.next(10.0), ResultInfo):
                seqs.append(item.seq)
            assert isinstance(item, Ended), (seqs, item)
        await outside.sample()
        assert seqs == list(range(stored + 1))
        assert answered.answered == REPLAY_BUSY_RETRIES + 1  # one consumer's pull and its retries
        assert outside.seen == set()
        assert feed._sub is None
        await feed.close()
        await wait_until(lambda: source.read_gate.out == 0, 5, "every charge given back")
