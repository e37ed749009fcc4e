"""A replay's pull requests and the statuses that end them (:mod:`streamproc.nats.replay_pull`),
against a real nats-server: what each request the client and the edge build makes the server do,
and what ``pull_status`` reads from each way the server ends a pull (nats-server 2.x
``consumer.go``: ``404 No Messages``, ``408 Request Timeout``, ``409 Message Size Exceeds MaxBytes``,
``409 Exceeded MaxWaiting``, ``409 Exceeded MaxRequestMaxBytes``, ``409 Batch Completed``,
``409 Consumer Deleted``, ``100`` idle heartbeats; ``503`` no responders from the core server)."""

from __future__ import annotations

import dataclasses
import json
import time

import anyio
import pytest
from helpers import rid

from streamproc import Subjects, follow
from streamproc.core.events import Result, Verdict
from streamproc.core.wire import result_headers
from streamproc.nats.replay_pull import (REPLAY_CONSUMER_IDLE, REPLAY_EDGE_CONSUMER_IDLE, encode, pull_request,
                                         pull_status, pull_subject, replay_consumer_config, replay_consumer_name)
from streamproc.nats.streams import ensure_results_stream

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

STREAM = "REPLAYPULLTEST"
RESULT = 20_000  # bytes of each stored message


class Consumer:
    """A replay consumer made as the client and the edge make theirs, and its delivery inbox."""

    def __init__(self, client, subject: str, raw: dict | None = None, **changes) -> None:
        self.client, self.subject, self.changes = client, subject, changes
        self.raw = raw or {}  # fields nats-py's ConsumerConfig lacks (max_bytes: MaxRequestMaxBytes)
        self.inbox = client.new_inbox()
        self.name = replay_consumer_name(self.inbox)
        self.words: list[tuple[float, object]] = []  # (arrival, pull_status of the message or its data)
        self.arrived = anyio.Event()

    async def __aenter__(self) -> Consumer:
        config = dataclasses.replace(replay_consumer_config(self.name, self.subject, 1), **self.changes)
        if self.raw:
            request = {"stream_name": STREAM, "config": {**config.as_dict(), **self.raw}}
            answer = await self.client.request(f"$JS.API.CONSUMER.CREATE.{STREAM}.{self.name}",
                                               json.dumps(request).encode(), timeout=5)
            assert "error" not in json.loads(answer.data), answer.data
        else:
            await self.client.jetstream().add_consumer(STREAM, config=config)

        async def got(msg) -> None:
            kind = pull_status(msg.headers)
            self.words.append((time.monotonic(), kind if kind is not None else msg.data))
            self.arrived.set()

        self.sub = await self.client.subscribe(self.inbox, cb=got)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.sub.unsubscribe()

    async def pull(self, request: dict, name: str | None = None) -> float:
        self.arrived = anyio.Event()
        await self.client.publish(pull_subject("$JS.API", STREAM, name or self.name), encode(request),
                                  reply=self.inbox)
        return time.monotonic()

    async def words_within(self, seconds: float) -> list[object]:
        """What arrived (statuses as ``pull_status`` reads them, deliveries as their bytes), after ``seconds``."""
        await anyio.sleep(seconds)
        words, self.words = [word for _, word in self.words], []
        return words

    async def first_word_within(self, seconds: float) -> tuple[float, object] | None:
        with anyio.move_on_after(seconds):
            while not self.words:
                await self.arrived.wait()
                self.arrived = anyio.Event()
            word, self.words = self.words[0], self.words[1:]
            return word
        return None


async def stored(client, count: int) -> str:
    """A subject of the test stream with ``count`` messages of RESULT bytes stored."""
    js = client.jetstream()
    await js.add_stream(name=STREAM, subjects=["replaypulltest.>"], storage="memory")
    subject = f"replaypulltest.{rid('s')}"
    for n in range(count):
        await js.publish(subject, bytes([65 + n]) * RESULT)
    return subject


async def test_a_pull_for_the_one_that_did_not_fit_brings_it_alone_whatever_the_room(client):
    """A pull offering less room than the next stored message ends with the status read as
    ``too_big`` and brings nothing; the pull for that one alone (``room`` None) brings exactly it,
    whatever its size, and no more: a reader that holds nothing is passed its bound by one result at
    most. A sized pull then brings what its room holds."""
    subject = await stored(client, 4)
    async with Consumer(client, subject) as consumer:
        await consumer.pull(pull_request(RESULT // 2, no_wait=True))
        assert await consumer.words_within(1.0) == ["too_big"]
        await consumer.pull(pull_request(None, no_wait=True))
        assert await consumer.words_within(1.0) == [b"A" * RESULT]
        await consumer.pull(pull_request(2 * RESULT + 1000, no_wait=True))
        words = await consumer.words_within(1.0)
        assert words[:2] == [b"B" * RESULT, b"C" * RESULT] and words[2:] in ([], ["too_big"]), words


async def test_pull_status_reads_each_way_nats_server_ends_a_pull(client):
    """A ``no_wait`` pull with nothing stored ends at once, ``ended`` (``404 No Messages``: it does
    not wait on the server, nor is it taken for a consumer gone); a pull that waits with an idle
    heartbeat hears ``heartbeat`` within a few of them, long before its expiry, then ends ``busy``
    (``408 Request Timeout``: says nothing of what is stored); a pull past the consumer's waiting pulls
    is ``busy`` (``409 Exceeded MaxWaiting``), not ``too_big`` nor ``ended``; a waiting pull whose consumer is deleted, and a pull of a consumer
    that does not exist, are ``gone``."""
    subject = await stored(client, 0)
    async with Consumer(client, subject, max_waiting=1) as consumer:
        sent = await consumer.pull(pull_request(1 << 20, no_wait=True))
        word = await consumer.first_word_within(2.0)
        assert word is not None and word[1] == "ended", word  # at once: it did not wait for an expiry
        assert word[0] - sent < 1.0, word[0] - sent

        sent = await consumer.pull(pull_request(1 << 20, expires=3.0, heartbeat=0.2))
        word = await consumer.first_word_within(1.5)
        assert word is not None and word[1] == "heartbeat", word
        other = Consumer(client, subject)  # a second waiting pull, on another inbox: past max_waiting
        async with other:
            await other.pull(pull_request(1 << 20, expires=3.0), name=consumer.name)
            assert await other.words_within(1.0) == ["busy"]
        words = await consumer.words_within(3.5 - (time.monotonic() - sent))
        assert set(words[:-1]) == {"heartbeat"} and words[-1] == "busy", words

        await consumer.pull(pull_request(1 << 20, expires=5.0))
        await anyio.sleep(0.3)
        await client.jetstream().delete_consumer(STREAM, consumer.name)
        assert await consumer.words_within(1.0) == ["gone"]
        await consumer.pull(pull_request(1 << 20, no_wait=True))
        assert await consumer.words_within(1.0) == ["gone"]  # 503: no consumer answers its pulls


async def test_a_pull_past_the_consumers_max_request_max_bytes_is_refused_not_taken_for_a_result_too_big(client):
    """A consumer with ``max_bytes`` (MaxRequestMaxBytes) refuses a pull asking more with ``409
    Exceeded MaxRequestMaxBytes of N``, read as ``refused`` (before 2026-12-06: ``too_big``, as if
    the next result were larger than the room); the pull for one result alone (no max_bytes) is not
    refused, and a pull whose batch fills before its max_bytes ends with ``409 Batch Completed``
    after its last result, read as ``completed``."""
    subject = await stored(client, 3)
    async with Consumer(client, subject, raw={"max_bytes": 4 * RESULT}) as consumer:
        await consumer.pull(pull_request(8 * RESULT, no_wait=True))
        assert await consumer.words_within(1.0) == ["refused"]
        await consumer.pull(pull_request(None, no_wait=True))
        assert await consumer.words_within(1.0) == [b"A" * RESULT]
        await consumer.pull(pull_request(4 * RESULT, batch=1, no_wait=True))
        assert await consumer.words_within(1.0) == [b"B" * RESULT, "completed"]


async def test_a_replay_consumer_is_held_by_the_server_for_its_idle_time_not_the_servers_default(client):
    """The server drops an ephemeral consumer after 5 s without a pull unless it is told otherwise:
    a replay's consumer carries ``REPLAY_CONSUMER_IDLE`` (the client's, 60 s) or
    ``REPLAY_EDGE_CONSUMER_IDLE`` (the edge's), so a reader slower than 5 s a pull keeps its consumer."""
    subject = await stored(client, 1)
    js = client.jetstream()
    for idle in (REPLAY_CONSUMER_IDLE, REPLAY_EDGE_CONSUMER_IDLE):
        name = replay_consumer_name(client.new_inbox())
        await js.add_consumer(STREAM, config=replay_consumer_config(name, subject, 1, idle))
        info = await js.consumer_info(STREAM, name)
        assert info.config.inactive_threshold == idle, (idle, info.config)


async def test_two_replays_at_once_on_one_connection_each_read_their_own_history(client, nats_url):
    """Each replay's consumer is named after its own delivery inbox (its last token): two replays
    that one connection (a frontend, the edge) runs at once have two consumers, and each reads its
    request's whole history, once, in order."""
    subjects = Subjects()
    await ensure_results_stream(client.jetstream(), subjects)
    histories = {rid("both-a"): 30, rid("both-b"): 20}
    for request_id, n in histories.items():
        for seq in range(n):
            r = Result(request_id, seq, f"{request_id}:{seq}".encode(), seq == n - 1, Verdict.PASSTHROUGH)
            await client.publish(subjects.result(request_id), r.body, headers=result_headers(r))
    await client.flush()
    await anyio.sleep(0.3)
    got: dict[str, list[bytes]] = {}

    async def replay(request_id: str) -> None:
        async with follow(client, subjects, request_id, timeout=15, replay=True) as results:
            got[request_id] = [result.body async for result in results]

    async with anyio.create_task_group() as tg:
        for request_id in histories:
            tg.start_soon(replay, request_id)
    assert got == {request_id: [f"{request_id}:{seq}".encode() for seq in range(n)]
                   for request_id, n in histories.items()}
