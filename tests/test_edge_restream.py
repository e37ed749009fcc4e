"""The JetStream results stream deleted, recreated or purged under a running `streamproc edge`.

Found by a review (2026-12-01): 20 open SSE streams got results 0-9, the results stream was deleted
(or deleted and recreated), then nothing reached them until ``--result-timeout``; results 10-19,
stored again in the recreated stream, never arrived, and ``/healthz`` stayed ok. The ring's ordered
consumer resumed from the last stream sequence it had delivered, which a recreated stream starts
again from 1. Each test here runs its own nats-server and edge (they delete the stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import anyio
import httpx
import nats.errors
import pytest
from edge_harness import publish_result, ring_read_all, running_edge, started_source, subscribed_subjects
from helpers import answered_with_the_cancel, connection, peak_rss, rid, wait_until
from httpx_sse import aconnect_sse
from nats.js.api import StorageType

from streamproc.core.defaults import EDGE_INBOX_PREFIX
from streamproc.core.errors import StoredResultsRefused
from streamproc.core.wire import ResultInfo
from streamproc.edge.feed import StreamGone
from streamproc.nats.streams import RESULTS_STREAM, ensure_results_stream
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(180)]

SUBJECTS = Subjects()
STREAMS = 20
# Far above how soon a stream must hear of its results stream's deletion (PROMPT): without the
# watch, a stream stayed silent until this.
RESULT_TIMEOUT = 60
PROMPT = 8.0  # seconds: the watch asks every second; a loaded 2-core machine stretches that
MiB = 1 << 20


@pytest.fixture
def own_server():
    with EmbeddedNats() as srv:
        yield srv


def body(seq: int) -> bytes:
    return b'{"text":"%d"}' % seq


class Reader:
    """One SSE client: every event's (id, data) as it arrives, and whether ``[DONE]`` came."""

    def __init__(self, request_id: str, after: int | None = None) -> None:
        self.request_id = request_id
        self.headers = {"Last-Event-ID": str(after)} if after is not None else {}
        self.events: list[tuple[str, str]] = []
        self.done = False
        self.status: int | None = None

    async def run(self, client: httpx.AsyncClient) -> None:
        async with aconnect_sse(client, "GET", f"/v1/results/{self.request_id}", headers=self.headers) as source:
            self.status = source.response.status_code
            async for event in source.aiter_sse():
                if event.data == "[DONE]":
                    self.done = True
                    return
                self.events.append((event.id, event.data))

    def results(self) -> list[int]:
        """The seqs of the result events received (the ``id:`` of each; an SSE parser gives an event
        without one the last id seen, so error events are told by their body)."""
        return [int(i) for i, data in self.events if "error" not in json.loads(data)]

    def error(self) -> dict | None:
        for _, data in self.events:
            doc = json.loads(data)
            if "error" in doc:
                return doc["error"]
        return None


async def publish_range(nc, readers: list[Reader], seqs: range, *, final_at: int | None = None) -> None:
    for reader in readers:
        for seq in seqs:
            await publish_result(nc, SUBJECTS, reader.request_id, seq, body(seq), final=seq == final_at)
    await nc.flush()


async def recreate(js) -> None:
    await ensure_results_stream(js, SUBJECTS, storage=StorageType.FILE)


async def replace_between_checks(nc) -> bool:
    """Delete the results stream and create it again just after the edge's watch asked about it, so
    the watch's next question (a second later) finds the new stream: done at an arbitrary moment, a
    question landing in the few milliseconds between the two would find no stream, and the test
    would see a deletion instead of a recreation. False when a question came in between all the same
    (a fresh-clone CI run saw that once: the streams ended as deleted); the caller then tries again."""
    edge_asks = EDGE_INBOX_PREFIX + "."  # the edge's requests (the test's own recreate() asks too)
    asked = await nc.subscribe(f"$JS.API.STREAM.INFO.{RESULTS_STREAM}")
    try:
        while not (await asked.next_msg(timeout=PROMPT)).reply.startswith(edge_asks):
            pass
        js = nc.jetstream()
        await js.delete_stream(RESULTS_STREAM)
        await recreate(js)
        await nc.flush()
        between = []
        with contextlib.suppress(nats.errors.TimeoutError):
            while True:
                between.append((await asked.next_msg(timeout=0.01)).reply)
        return not any(reply.startswith(edge_asks) for reply in between)
    finally:
        await asked.unsubscribe()


async def in_attempts(attempt, what: str, tries: int = 3) -> None:
    """Run ``attempt(n)`` until it returns True: False means :func:`replace_between_checks` saw the
    watch ask between the deletion and the creation (the streams see a deletion, another test's case)."""
    for n in range(tries):
        if await attempt(n):
            return
    pytest.fail(f"in {tries} attempts the edge's watch asked about the results stream while it was deleted ({what})")


def watch_counts(edge) -> tuple[float, float, float]:
    """The watch's counters: results streams found deleted, found (re)created, streams it ended."""
    metrics = edge.metrics()
    return (metrics["streamproc_edge_results_stream_deleted_total"],
            metrics["streamproc_edge_results_stream_recreated_total"], metrics["streamproc_edge_streams_gone_total"])


async def open_readers(tg, client: httpx.AsyncClient, edge, count: int, name: str) -> list[Reader]:
    readers = [Reader(rid(name)) for _ in range(count)]
    for reader in readers:
        tg.start_soon(reader.run, client)
    await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] >= count, 15, "the streams opened")
    return readers


@contextlib.asynccontextmanager
async def edge_on_a_results_stream(own_server):
    """A NATS connection, an edge that creates the results stream (the test's result timeout, no
    per-client limit in the way) and an HTTP client for it."""
    async with connection(own_server.url) as nc:
        with running_edge(own_server.url, "--ensure-results-stream", "--result-timeout", str(RESULT_TIMEOUT),
                          "--max-streams-per-client", "1000") as edge:
            async with httpx.AsyncClient(base_url=edge.url, timeout=RESULT_TIMEOUT + 30) as client:
                yield nc, edge, client


async def readers_with_ten_results(tg, client: httpx.AsyncClient, nc, edge, name: str) -> list[Reader]:
    """STREAMS open streams that have each got results 0-9 (stored in the results stream)."""
    readers = await open_readers(tg, client, edge, STREAMS, name)
    await publish_range(nc, readers, range(10))
    await wait_until(lambda: all(r.results() == list(range(10)) for r in readers), 15,
                     "results 0-9 reached every stream")
    return readers


async def test_streams_reading_a_deleted_results_stream_end_promptly_with_an_unavailable_error(own_server):
    async with edge_on_a_results_stream(own_server) as (nc, edge, client):
        js = nc.jetstream()
        async with anyio.create_task_group() as tg:
            readers = await readers_with_ten_results(tg, client, nc, edge, "deleted")

            await js.delete_stream(RESULTS_STREAM)
            deleted = time.monotonic()
            await wait_until(lambda: all(r.done for r in readers), PROMPT,
                             "every stream ended after its results stream was deleted")
            took = time.monotonic() - deleted
            print(f"{STREAMS} streams ended {took:.2f} s after the deletion")

            for reader in readers:
                assert reader.results() == list(range(10))
                error = reader.error()
                assert error is not None and error["type"] == "service_unavailable", reader.events
                assert f"results stream {RESULTS_STREAM} was deleted" in error["message"], error
            assert took < PROMPT
            health = httpx.get(f"{edge.url}/healthz")
            assert health.status_code == 200
            assert health.json()["status"] == "degraded", health.json()
            assert "deleted" in health.json()["results_stream"]

            # Without a results stream the edge serves live results, as it does when none exists.
            late = Reader(rid("after-delete"))
            tg.start_soon(late.run, client)
            await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] >= 1, 15, "late stream open")
            await publish_range(nc, [late], range(3), final_at=2)
            await wait_until(lambda: late.done, 15, "the late stream got its live results")
            assert late.results() == [0, 1, 2] and late.error() is None

        assert "results_stream_deleted" in edge.log()
        assert watch_counts(edge) == (1, 0, STREAMS)


async def test_streams_go_on_from_a_recreated_results_stream_in_order_without_duplicates(own_server):
    """The review's second case: deleted and created again at once (before the edge could see it
    missing). Results stored in the new stream reach the streams waiting for them; those already
    sent (seq 8 and 9 stored again) are not sent twice."""
    await in_attempts(lambda n: _recreated_under_the_ring_s_streams(own_server, n), "the ring's streams")


async def _recreated_under_the_ring_s_streams(own_server, attempt: int) -> bool:
    async with edge_on_a_results_stream(own_server) as (nc, edge, client):
        async with anyio.create_task_group() as tg:
            readers = await readers_with_ten_results(tg, client, nc, edge, f"recreated-{attempt}")

            if not await replace_between_checks(nc):
                tg.cancel_scope.cancel()
                return False
            await publish_range(nc, readers, range(8, 20), final_at=19)
            await wait_until(lambda: all(r.done for r in readers), PROMPT,
                             "every stream got its results from the recreated stream")

            for reader in readers:
                assert reader.results() == list(range(20)), reader.events
                assert reader.error() is None
            assert httpx.get(f"{edge.url}/healthz").json()["status"] == "ok"

            # A stream opened now reads the new stream (a late attach replays what it stores: 8-19).
            late = Reader(readers[0].request_id, after=7)
            tg.start_soon(late.run, client)
            await wait_until(lambda: late.done, 15, "a late reader of a request in the new stream")
            assert late.results() == list(range(8, 20)), late.events
        assert "results_stream_recreated" in edge.log()
        assert watch_counts(edge) == (0, 1, 0)  # the streams went on: none ended by the watch
    return True


async def test_a_purged_results_stream_keeps_its_sequence_and_streams_go_on(own_server):
    """A purge empties the stream but keeps its sequence (and consumers): nothing to detect, the
    open streams get the results stored after it."""
    async with edge_on_a_results_stream(own_server) as (nc, edge, client):
        js = nc.jetstream()
        async with anyio.create_task_group() as tg:
            readers = await readers_with_ten_results(tg, client, nc, edge, "purged")
            await js.purge_stream(RESULTS_STREAM)
            await publish_range(nc, readers, range(10, 20), final_at=19)
            await wait_until(lambda: all(r.done for r in readers), PROMPT, "every stream ended")
            for reader in readers:
                assert reader.results() == list(range(20)) and reader.error() is None
        assert watch_counts(edge) == (0, 0, 0)


@pytest.mark.parametrize("reading", ["ring", "own-consumers"])
async def test_deleting_and_recreating_the_results_stream_in_a_loop_leaks_nothing_and_answers_every_stream(
        own_server, reading):
    """Hostile: the stream deleted and recreated 12 times while streams open and read, through the
    ring or (``--recent 0``) with an ordered consumer each. Every stream ends (its results, or an
    error event, then [DONE]); the edge survives with its subscriptions and the stream's consumers
    bounded, and serves a normal stream afterwards."""
    own = ("--recent", "0") if reading == "own-consumers" else ()
    async with connection(own_server.url) as nc:
        js = nc.jetstream()
        with running_edge(own_server.url, "--ensure-results-stream", "--result-timeout", str(RESULT_TIMEOUT),
                          "--max-streams-per-client", "1000", *own) as edge:
            pid = edge.proc.pid
            all_readers: list[Reader] = []
            async with httpx.AsyncClient(base_url=edge.url, timeout=RESULT_TIMEOUT + 30) as client, \
                    anyio.create_task_group() as tg:
                for cycle in range(12):
                    readers = [Reader(rid(f"churn{cycle}")) for _ in range(5)]
                    for reader in readers:
                        tg.start_soon(reader.run, client)
                    all_readers += readers
                    await anyio.sleep(0.2)
                    await publish_range(nc, readers, range(3), final_at=2)
                    await js.delete_stream(RESULTS_STREAM)
                    await anyio.sleep(0.05 if cycle % 2 else 1.5)  # sometimes seen missing, sometimes not
                    await recreate(js)
                    await publish_range(nc, readers, range(3), final_at=2)
                try:
                    await wait_until(lambda: all(r.done for r in all_readers), 2 * PROMPT, "every churned stream ended")
                except AssertionError:
                    print("silent:", [(r.request_id, r.status, r.events) for r in all_readers if not r.done])
                    print(edge.log())
                    raise
            for reader in all_readers:  # complete, or told why not: never silent, never out of order
                assert reader.results() == list(range(len(reader.results()))), reader.events
                assert reader.results() == [0, 1, 2] or reader.error() is not None, reader.events

            await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] == 0, 10, "streams released")
            await anyio.sleep(2.5)  # a last check by the watch, and the linger of released consumers
            info = await js.stream_info(RESULTS_STREAM)
            edge_subs = [s for s in subscribed_subjects(own_server.monitor_url) if s.startswith("_INBOX.")]
            print(f"after the churn: {info.state.consumer_count} consumers, {len(edge_subs)} inbox subscriptions")
            assert info.state.consumer_count <= 2, info.state  # the ring's, and at most one lingering
            assert len(edge_subs) <= 4, edge_subs
            assert peak_rss(pid) < 150 * MiB

            final = Reader(rid("after-churn"))
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client, anyio.create_task_group() as tg:
                tg.start_soon(final.run, client)
                await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] >= 1, 15, "opened")
                await publish_range(nc, [final], range(4), final_at=3)
            assert final.results() == [0, 1, 2, 3] and final.error() is None
            assert "Traceback" not in edge.log()
            deleted, recreated, gone = watch_counts(edge)
            told = sum(1 for r in all_readers if r.error() is not None and "results stream" in r.error()["message"])
            print(f"the watch: {deleted:g} deletions, {recreated:g} recreations, {gone:g} streams ended ({told} told so)")
            assert gone >= told
            if reading == "ring":  # the ring watches its stream always; a stream's own consumer only while open
                assert deleted >= 1 and recreated >= deleted


@contextlib.asynccontextmanager
async def edge_without_the_ring(own_server, *args: str):
    """As :func:`edge_on_a_results_stream` with ``--recent 0``: each stream reads with an ordered
    consumer of its own."""
    async with connection(own_server.url) as nc:
        with running_edge(own_server.url, "--ensure-results-stream", "--recent", "0", "--result-timeout",
                          str(RESULT_TIMEOUT), "--max-streams-per-client", "1000", *args) as edge:
            async with httpx.AsyncClient(base_url=edge.url, timeout=RESULT_TIMEOUT + 30) as client:
                yield nc, edge, client


async def readers_with_five_results(tg, client: httpx.AsyncClient, nc, edge, name: str) -> list[Reader]:
    """5 open streams that have each got results 0-4, and a watch that has seen their results stream."""
    readers = await open_readers(tg, client, edge, 5, name)
    await publish_range(nc, readers, range(5))
    await wait_until(lambda: all(r.results() == list(range(5)) for r in readers), 15,
                     "results 0-4 reached every stream")
    await anyio.sleep(1.5)  # the watch has seen the stream they read
    return readers


async def test_without_the_ring_streams_with_their_own_consumer_end_when_their_results_stream_is_deleted(
        own_server):
    """``--recent 0``: each stream reads with an ordered consumer of its own, which a deleted stream
    leaves silent; the watch ends them with the cause. ``/healthz`` names the missing stream (it said
    ok: only the ring's stream was reported) until a stream of its name exists again."""
    async with edge_without_the_ring(own_server) as (nc, edge, client):
        async with anyio.create_task_group() as tg:
            readers = await readers_with_five_results(tg, client, nc, edge, "own-delete")
            await nc.jetstream().delete_stream(RESULTS_STREAM)
            await wait_until(lambda: all(r.done for r in readers), PROMPT, "every stream ended")
            for reader in readers:
                assert reader.results() == list(range(5))
                error = reader.error()
                assert error is not None and error["type"] == "service_unavailable", reader.events
                assert f"results stream {RESULTS_STREAM} was deleted" in error["message"], error
        await anyio.sleep(2 * 1.0)  # the streams closed: the watch goes on asking about the missing one
        health = httpx.get(f"{edge.url}/healthz")
        assert health.status_code == 200
        assert health.json()["status"] == "degraded", health.json()
        assert "was deleted" in health.json()["results_streams_missing"][RESULTS_STREAM], health.json()
        assert "results_stream" not in health.json()  # the ring's: there is none
        assert watch_counts(edge) == (1, 0, 5)

        await recreate(nc.jetstream())
        await wait_until(lambda: httpx.get(f"{edge.url}/healthz").json()["status"] == "ok", PROMPT,
                         "/healthz ok once the stream exists again")
        assert watch_counts(edge) == (1, 1, 5)  # found again: counted as the ring's is


@pytest.mark.parametrize("stored_again", ["3-9", "6-9"])
async def test_without_the_ring_streams_with_their_own_consumer_go_on_from_a_recreated_results_stream(
        own_server, stored_again):
    """``--recent 0``, the stream deleted and created again at once: a stream's own ordered consumer
    would resume at the old stream's sequence (silent until its timeout), and the watch used to end
    them with the ``unavailable`` error. Now each gets a new one reading the new stream from its first
    sequence, as the ring's streams do: seqs sent already (3, 4 stored again) are dropped, and a seq
    the new stream lacks (5, when it stores 6-9 only) is a gap error after ``--gap-timeout``."""
    first = int(stored_again.split("-")[0])
    await in_attempts(lambda n: _recreated_under_open_streams(own_server, first, n), "streams without the ring")


async def _recreated_under_open_streams(own_server, first: int, attempt: int) -> bool:
    """One run of the test above; False when the watch asked between the deletion and the creation
    (:func:`replace_between_checks`): a deletion, which another test covers, not this one's case."""
    async with edge_without_the_ring(own_server, "--gap-timeout", "1") as (nc, edge, client):
        async with anyio.create_task_group() as tg:
            readers = await readers_with_five_results(tg, client, nc, edge, f"own-recreate-{first}-{attempt}")
            if not await replace_between_checks(nc):
                tg.cancel_scope.cancel()
                return False
            await publish_range(nc, readers, range(first, 10), final_at=9)
            await wait_until(lambda: all(r.done for r in readers), PROMPT, "every stream ended")
            for reader in readers:
                if first <= 5:
                    assert reader.results() == list(range(10)), reader.events
                    assert reader.error() is None, reader.events
                else:
                    assert reader.results() == list(range(5)), reader.events
                    error = reader.error()
                    assert error is not None and "result seq 5 of request" in error["message"], reader.events
        assert watch_counts(edge) == (0, 1, 0)  # seen recreated; no stream ended by the watch
        assert edge.metrics()["streamproc_edge_gaps_total"] == (0 if first <= 5 else 5)
        assert "Traceback" not in edge.log()
    return True


@contextlib.asynccontextmanager
async def a_feed_with_msg_get_refused(own_server, name: str):
    """An in-process source on a fresh results stream, and a dispatched feed it opened whose
    ``STREAM.MSG.GET`` went unanswered (``fall_back``; MSG.GET never answered, so refused from then
    on): that feed reads the ring's stream with an ordered consumer of its own (msg_get.py). (Since
    2026-12-06 an open made while MSG.GET is refused reads its history with consumers in the read
    budget and stays dispatched: tests/test_edge_replay_budget.py.)"""
    async with connection(own_server.url) as nc:
        await recreate(nc.jetstream())
        async with started_source(own_server.url, SUBJECTS) as source:
            assert source.msg_get is not None
            feed = await source.open(rid(name))
            assert feed.inbox is not None
            source.fall_back(feed, StoredResultsRefused("a test refuses it", denied=False))
            assert source.msg_get.state == "refused"
            assert feed.inbox is None and feed.stream == RESULTS_STREAM  # an ordered consumer of its own
            yield nc, source, feed


async def test_streams_given_their_own_consumer_because_msg_get_went_unanswered_go_on_from_a_recreated_stream(
        own_server):
    """With the ring on, a stream gets an ordered consumer of its own on the ring's stream when its
    replay's MSG.GET goes unanswered (source.py, fall_back); a recreated stream used to end those
    with the ``unavailable`` error while the ring's streams went on. They go on the same way now."""
    await in_attempts(lambda n: _recreated_under_a_feed_with_msg_get_refused(own_server, n), "msg get refused")


async def _recreated_under_a_feed_with_msg_get_refused(own_server, attempt: int) -> bool:
    async with a_feed_with_msg_get_refused(own_server, f"refused-{attempt}") as (nc, source, feed):
        await publish_range(nc, [Reader(feed.request_id)], range(5))
        assert await feed_results(feed, 5) == list(range(5))
        if not await replace_between_checks(nc):
            await feed.close()
            return False
        await publish_range(nc, [Reader(feed.request_id)], range(3, 8), final_at=7)
        assert await feed_results(feed, 3) == [5, 6, 7]
        await feed.close()
        assert (source.metrics.results_stream_recreated, source.metrics.streams_gone) == (1, 0)
    return True


async def test_a_stream_info_answer_arriving_after_later_results_is_not_taken_for_a_new_history(own_server):
    """The watch's STREAM.INFO answer is computed when the server reads the request, but a consumer's
    pushes and an API reply reach the edge separately: the ring may have read results stored after
    the answer was computed. Its last sequence is then below what the ring delivered without the
    stream being new. Taken for a recreated stream, the ring reread the whole stream from its start
    (seen in a durable benchmark: 440 us per SSE event instead of 120, the streams' p99 2 s). Here the
    answer is held back, as a busy server does, until the ring has read results published after it."""
    async with connection(own_server.url) as nc:
        await recreate(nc.jetstream())
        async with started_source(own_server.url, SUBJECTS) as source:
            await publish_range(nc, [Reader(rid("before"))], range(3))
            await wait_until(lambda: source.fanout.delivered() >= 3, 10, "the ring read the first results")
            asked = source._stream_info

            async def answered_late(name):
                info = await asked(name)
                await publish_range(nc, [Reader(rid("after"))], range(3))
                assert info.state.last_seq == 3
                await wait_until(lambda: source.fanout.delivered() == 6, 10,  # all 3 (waiting for one raced the assert below)
                                 "the ring read the results stored after the answer was computed")
                return info

            source._stream_info = answered_late
            await source._check_results_stream()
            assert (source.metrics.results_stream_recreated, source.metrics.results_stream_deleted) == (0, 0)
            assert source.fanout.delivered() == 6  # not reread from the stream's start


async def feed_results(feed, count: int) -> list[int]:
    """The seqs of the next ``count`` items of an in-process feed (each must be a result)."""
    seqs = []
    for _ in range(count):
        item = await feed.next(PROMPT)
        assert isinstance(item, ResultInfo), item
        seqs.append(item.seq)
    return seqs


@contextlib.contextmanager
def watch_held(source, release: asyncio.Event):
    """The source's watch asks nothing about the streams read by consumers of their own until
    ``release`` is set (its ``_check_own_consumers`` waits for it)."""
    check = source._check_own_consumers

    async def checked_after_release():
        await release.wait()
        await check()

    source._check_own_consumers = checked_after_release
    try:
        yield
    finally:
        source._check_own_consumers = check


async def test_a_stream_of_its_own_deleted_before_the_watch_first_saw_it_leaves_the_watch_working(own_server):
    """A feed with an ordered consumer of its own (``--recent 0``) whose results stream is deleted
    before the watch's first STREAM.INFO about it: the watch once raised a KeyError there, which its
    loop (catching NATS, OS and timeout errors) let end the watch for the edge's life; a later
    deletion then left every stream silent until its timeout."""
    async with connection(own_server.url) as nc:
        js = nc.jetstream()
        await recreate(js)
        async with started_source(own_server.url, SUBJECTS, recent=0) as source:
            deleted = asyncio.Event()
            with watch_held(source, deleted):  # its first question waits for the deletion
                first = await source.open(rid("first"))
                await publish_range(nc, [Reader(first.request_id)], range(2))
                assert await feed_results(first, 2) == [0, 1]
                await js.delete_stream(RESULTS_STREAM)
                deleted.set()
                assert isinstance(await first.next(PROMPT), StreamGone)
                await first.close()

            # The watch goes on: a stream read later, then deleted, is told so.
            await recreate(js)
            second = await source.open(rid("second"))
            await publish_range(nc, [Reader(second.request_id)], range(2))
            assert await feed_results(second, 2) == [0, 1]
            await anyio.sleep(1.5)  # at least one more check of the watch
            assert not source._watch_task.done(), source._watch_task
            await js.delete_stream(RESULTS_STREAM)
            gone = await second.next(PROMPT)
            assert isinstance(gone, StreamGone) and "was deleted" in gone.reason, gone
            await second.close()
            assert (source.metrics.results_stream_deleted, source.metrics.streams_gone) == (2, 2)


async def test_opens_with_consumers_of_their_own_take_the_streams_identity_from_the_last_answer(own_server):
    """``--recent 0``: each open needs its results stream's creation time before its consumer is
    made; asked per open, a burst of opens cost a STREAM.INFO each (edge CPU per open x1.14-1.22 in
    an independent review). The last answer about the stream is used: no question of its own for
    the identity (the watch's own, once a second, aside). Since 2026-12-06 each open asks one
    STREAM.INFO for its split (its last sequence and its subject's count, ``_split_at_last``,
    decoded alone), whose answer is also that identity."""
    async with connection(own_server.url) as nc:
        await recreate(nc.jetstream())
        async with started_source(own_server.url, SUBJECTS, recent=0) as source:
            first = await source.open(rid("identity-first"))
            await wait_until(lambda: first._sub is not None, PROMPT, "the first consumer made")
            assert first.stream_created is not None
            asked = await nc.subscribe(f"$JS.API.STREAM.INFO.{RESULTS_STREAM}")
            await nc.flush()
            feeds = [await source.open(rid(f"identity-{i}")) for i in range(20)]
            await wait_until(lambda: all(f._sub is not None for f in feeds), PROMPT, "every consumer made")
            await nc.flush()
            questions = 0
            with contextlib.suppress(asyncio.TimeoutError, nats.errors.TimeoutError):
                while True:
                    await asked.next_msg(timeout=0.2)
                    questions += 1
            # the watch's, at most one a second; one per open, its split's (each asked before its consumer)
            assert questions <= 20 + 2, questions
            assert {f.stream_created for f in feeds} == {first.stream_created}
            await publish_range(nc, [Reader(f.request_id) for f in feeds[:3]], range(2), final_at=1)
            for feed in feeds[:3]:
                assert await feed_results(feed, 2) == [0, 1]
            for feed in [first, *feeds]:
                await feed.close()


async def test_a_stream_of_its_own_recreated_before_the_watch_first_asked_about_it_goes_on(own_server):
    """``--recent 0``: the results stream is deleted and created again after a feed's consumer was
    made but before the watch's next question. The watch, which learnt a stream's identity only
    when it asked, took the new stream for the one the consumer reads, and the feed stayed silent
    until its timeout (a flaky loop test found it). Each feed knows its stream's creation time
    from just before its consumer was made, so the watch tells the new stream apart."""
    async with connection(own_server.url) as nc:
        js = nc.jetstream()
        await recreate(js)
        async with started_source(own_server.url, SUBJECTS, recent=0) as source:
            release = asyncio.Event()
            with watch_held(source, release):
                feed = await source.open(rid("recreated-early"))
                await publish_range(nc, [Reader(feed.request_id)], range(3))
                assert await feed_results(feed, 3) == [0, 1, 2]
                await js.delete_stream(RESULTS_STREAM)
                await recreate(js)
                release.set()
                await publish_range(nc, [Reader(feed.request_id)], range(3, 6), final_at=5)
                assert await feed_results(feed, 3) == [3, 4, 5]
            await feed.close()
            assert (source.metrics.results_stream_recreated, source.metrics.streams_gone) == (1, 0)


async def test_a_deleted_ring_stream_read_by_a_consumer_of_its_own_is_counted_and_reported_once(own_server):
    """MSG.GET unanswered: a stream reads the ring's results stream with an ordered consumer of its own.
    Deleted, the ring's check ends it and reports the stream missing; the check of the streams read
    by consumers of their own must not count the same deletion again (it did, once per second
    while the ended stream's client had not gone yet) nor report it a second time in /healthz."""
    async with a_feed_with_msg_get_refused(own_server, "refused-deleted") as (nc, source, feed):
        await publish_range(nc, [Reader(feed.request_id)], range(2))
        assert await feed_results(feed, 2) == [0, 1]
        await nc.jetstream().delete_stream(RESULTS_STREAM)
        assert isinstance(await feed.next(PROMPT), StreamGone)
        await anyio.sleep(2.5)  # two more checks while the ended feed is still open
        assert source.results_stream_missing is not None and source.own_streams_missing == {}
        assert (source.metrics.results_stream_deleted, source.metrics.streams_gone) == (1, 1)
        await feed.close()


async def test_results_the_old_consumer_queued_are_given_before_the_new_stream_s(own_server):
    """``--recent 0``: results 0-4 reached the edge from the old stream but its client had not taken
    them yet when the stream was recreated (the new one stores 5-7 only). The new consumer replaces
    the old one; what the old one queued is given first, not dropped (then seq 0 would be missing)."""
    await in_attempts(lambda n: _recreated_under_queued_results(own_server, n), "queued results")


async def _recreated_under_queued_results(own_server, attempt: int) -> bool:
    async with connection(own_server.url) as nc:
        js = nc.jetstream()
        await recreate(js)
        async with started_source(own_server.url, SUBJECTS, recent=0, gap_timeout=1.0) as source:
            feed = await source.open(rid(f"queued-{attempt}"))
            await wait_until(lambda: feed.stream_created is not None and feed._sub is not None, PROMPT,
                             "the feed's consumer made, its stream's identity known")
            await publish_range(nc, [Reader(feed.request_id)], range(5))
            await wait_until(lambda: feed._sub._sub._pending_queue.qsize() == 5, PROMPT, "0-4 queued, not taken")
            if not await replace_between_checks(nc):
                await feed.close()
                return False
            await wait_until(lambda: source.metrics.results_stream_recreated == 1, PROMPT, "the watch saw it recreated")
            await publish_range(nc, [Reader(feed.request_id)], range(5, 8), final_at=7)
            assert await feed_results(feed, 8) == list(range(8))
            await feed.close()
            assert source.metrics.streams_gone == 0
    return True


async def test_a_deleted_ring_consumer_is_made_again_within_seconds_and_its_streams_miss_nothing(own_server):
    """The ring's ordered consumer deleted on the server (an operator, another edge sharing this
    one's NATS user, a lost server): nats-py would notice only after two missed heartbeats (10 s;
    a live stream waited 18.4 s). The watch asks for it every second and makes it again from the
    last result the ring read: the results stored meanwhile come, in order, within a few seconds."""
    async with connection(own_server.url) as nc:
        js = nc.jetstream()
        await recreate(js)
        async with started_source(own_server.url, SUBJECTS) as source:
            feed = await source.open(rid("ringgone"))
            request_id = feed.request_id
            await publish_range(nc, [Reader(request_id)], range(2))
            assert await feed_results(feed, 2) == [0, 1]
            name = source._recent_sub._consumer
            await js.delete_consumer(RESULTS_STREAM, name)
            await publish_range(nc, [Reader(request_id)], range(2, 5), final_at=4)
            started = time.monotonic()
            assert await feed_results(feed, 3) == [2, 3, 4]
            waited = time.monotonic() - started
            assert waited < 4.0, f"the results stored after the deletion came {waited:.1f} s later"
            assert source.metrics.ring_consumers_lost == 1
            # A new one (named once its creation's answer is read: its deliveries may come first)
            await wait_until(lambda: source._recent_sub._consumer not in (None, name), PROMPT, "a new ring consumer")
            await feed.close()


async def ring_consumers(js) -> set[int]:
    """The results stream's consumer counts seen over 2 s, every 0.1 s (an orphan lingers 5 s:
    nats-server's inactive threshold for an ephemeral consumer that sets none, as the ring's)."""
    seen = set()
    for _ in range(20):
        seen.add((await js.stream_info(RESULTS_STREAM)).state.consumer_count)
        await asyncio.sleep(0.1)
    return seen


@pytest.mark.parametrize("first", ["watch", "nats-py"])
async def test_the_watch_and_nats_py_do_not_both_make_a_deleted_ring_consumer_again(own_server, first):
    """Both remake the ring's ordered consumer (``_JSI.reset_ordered_consumer``): the watch when
    CONSUMER.INFO says it is gone, nats-py's heartbeat check when a check interval (10 s) passed
    with no delivery. The second reset moves the subscription to a new inbox, and the consumer the
    first one made is left pushing to nobody (an orphan until its inactive threshold). ``watch``:
    nats-py's check falls after the watch's reset, before the new consumer's first heartbeat (5 s;
    the old one's were gone for the interval). ``nats-py``: the watch's check falls while nats-py's
    reset awaits the new consumer's name (the subscription still names the deleted one). The
    heartbeat check is run here at those moments (one pass of nats-py's own ``activity_check``)."""
    async with connection(own_server.url) as nc:
        js = nc.jetstream()
        await recreate(js)
        async with started_source(own_server.url, SUBJECTS) as source:
            source._watch_task.cancel()  # its checks are run below, at the moments that matter
            jsi = source._recent_sub._sub._jsi
            jsi._hbtask.cancel()
            feed = await source.open(rid(f"double-{first}"))
            await publish_range(nc, [Reader(feed.request_id)], range(2))
            assert await feed_results(feed, 2) == [0, 1]
            # Each time: the watch has seen the consumer, it is deleted, a check interval begins
            # (no delivery since). ``nats-py``: 20 times, as the watch's question races the new
            # consumer's answer (the old code remade it a second time in 1 run of 4).
            for _ in range(1 if first == "watch" else 20):
                await source._check_ring_consumer()
                name = source._recent_sub._consumer
                await js.delete_consumer(RESULTS_STREAM, name)
                jsi._active = False
                if first == "watch":
                    await source._check_ring_consumer()
                    assert source.metrics.ring_consumers_lost == 1
                else:
                    await jsi.reset_ordered_consumer(jsi._sseq + 1)  # what the heartbeat check does
                    await source._check_ring_consumer()
                    assert source.metrics.ring_consumers_lost == 0
                await wait_until(lambda n=name: source._recent_sub._consumer not in (None, n), PROMPT, "remade")
            if first == "watch":
                jsi._hbi = 0.5  # one pass of nats-py's heartbeat check, now (its first, after 1 s)
                check = asyncio.ensure_future(jsi.activity_check())
                await asyncio.sleep(1.5)
                check.cancel()
            assert await ring_consumers(js) == {1}
            await publish_range(nc, [Reader(feed.request_id)], range(2, 4), final_at=3)
            assert await feed_results(feed, 2) == [2, 3]
            await feed.close()


async def test_after_a_nats_server_restart_a_live_stream_hears_of_new_results_within_seconds(nats_server):
    """nats-server restarted (same store): the ring's ephemeral consumer is gone with it, and
    nats-py's ordered consumer would make it again only after two missed heartbeats (a live
    stream's next result came ~18 s after the restart in a test on 2a2bb51). The watch finds it
    gone and makes it again once the edge has reconnected."""
    async with connection(nats_server.url) as nc, \
            started_source(nats_server.url, SUBJECTS, ensure_results_stream=True) as source:
        feed = await source.open(rid("restarted"))
        assert await feed.next(0.2) is None  # its replay's probe: nothing stored yet
        await publish_range(nc, [Reader(feed.request_id)], range(1))
        assert await feed_results(feed, 1) == [0]
        await asyncio.to_thread(nats_server.restart)
        await wait_until(lambda: source.metrics.nats_reconnects == 1 and nc.is_connected, PROMPT, "reconnected")
        await publish_range(nc, [Reader(feed.request_id)], range(1, 3), final_at=2)
        started = time.monotonic()
        assert await feed_results(feed, 2) == [1, 2]
        waited = time.monotonic() - started
        assert waited < 4.0, f"the results published after the restart came {waited:.1f} s later"
        assert source.metrics.ring_consumers_lost >= 1
        await feed.close()


async def test_a_replay_stopped_while_its_consumer_is_made_leaves_no_consumer_behind(nats_url):
    """The watch stops the fan-out's replays when it finds a new history (``_stop_replays``), from
    its own task: a replay whose temporary consumer was being created then got that consumer after
    its close. The feed went on without it (its ``replay`` is None), so nothing closed it: the
    subscription stayed (the server pushing to it), and ``_replays`` kept it, counted against
    ``--max-replay-consumers`` for the edge's lifetime."""
    subjects = Subjects("stopmade")
    async with connection(nats_url) as client, \
            started_source(nats_url, subjects, ensure_results_stream=True) as source:
        request_id = rid("made")
        for seq in range(3):
            await publish_result(client, subjects, request_id, seq, b'{"seq":%d}' % seq)
        await client.flush()
        await ring_read_all(source, client)
        feed = await source.open(request_id)
        first = await feed.next(5.0)  # the probe's, by subject
        assert isinstance(first, ResultInfo) and first.seq == 0, first
        reading = asyncio.ensure_future(feed.next(0.5))  # the next stored one: a consumer is made for it
        async with asyncio.timeout(5):
            while source._replays_creating == 0:
                await asyncio.sleep(0)
        source._stop_replays()  # what the watch does on a new history, while that consumer is made
        assert await reading is None  # nothing more from the stopped replay (the ring's reread brings it)
        await asyncio.sleep(0.2)
        assert not source._replays and source._replays_creating == 0
        await feed.close()


async def test_a_watch_check_whose_answer_swallowed_the_stop_cancelling_it_ends_quietly(nats_url):
    """``stop()`` cancels the results-stream watch while it may await a STREAM.INFO answer. nats-py
    awaits that with ``asyncio.wait_for``, which on Python 3.11 returns the answer when it came in
    the same loop pass as the cancel, swallowing it: the watch ran on into its next check with the
    connection gone (``assert self.nc is not None``), an exception in a task that failed the test
    closing the source (1 run of 3 of the replay-consumer tests beside two CPU burners). Here the
    check swallows the cancel itself; the watch must end, without an exception, and not run on."""
    async with started_source(nats_url, SUBJECTS, ensure_results_stream=True) as source:
        watch = source._watch_task
        assert watch is not None
        checking = asyncio.Event()

        source._check_results_stream = lambda: answered_with_the_cancel(checking)
        await asyncio.wait_for(checking.wait(), 10)
    await asyncio.wait_for(asyncio.wait({watch}), 5)
    assert watch.exception() is None, repr(watch.exception())
