"""Opening a result stream: what an open costs and what it guarantees (issue 14, target 2).

A core-mode open answers its client only once nats-server has its subscription; the opens of one
event-loop pass share one PING for that (``edge/barrier.py``). ``GET /v1/results/{id}`` is
dispatched before Starlette's middleware and router (``EdgeApp``); everything else is Starlette's.
Real nats-server, the edge's real ``ResultSource`` or a real ``streamproc edge`` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import AsyncIterator

import httpx
import nats.errors
import pytest
from edge_harness import publish_result, subscribed_subjects
from helpers import rid

from streamproc.core.wire import ResultInfo
from streamproc.edge import settings as edge_settings
from streamproc.edge.metrics import EdgeMetrics
from streamproc.edge.source import ResultSource
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

SUBJECTS = Subjects("open")  # no results stream: core subscriptions, the path with a PING per open


@contextlib.asynccontextmanager
async def started_source(nats_url: str) -> AsyncIterator[ResultSource]:
    settings = edge_settings.load({}, {"nats_url": nats_url, "prefix": SUBJECTS.prefix, "insecure_demo": True,
                                       "recent": 0})
    source = ResultSource(settings, EdgeMetrics())
    await source.start()
    try:
        yield source
    finally:
        await source.stop()


async def assert_live(client, feeds) -> None:
    """A result published right after the opens returned reaches each feed: each subscription was
    on the server when its open returned."""
    for i, feed in enumerate(feeds):
        await publish_result(client, SUBJECTS, feed.request_id, 0, b'{"n":%d}' % i, final=True)
    await client.flush()
    for i, feed in enumerate(feeds):
        item = await feed.next(5.0)
        assert isinstance(item, ResultInfo), (feed.request_id, item)
        assert item.body == b'{"n":%d}' % i


async def test_opens_of_one_loop_pass_share_one_ping_and_each_is_live(nats_url, client):
    async with started_source(nats_url) as source:
        await source.open(rid("first"))  # the stream lookup's first round trip, out of the way
        rounds = source.barrier.rounds
        feeds = await asyncio.gather(*(source.open(rid(f"together{i}")) for i in range(30)))
        assert source.barrier.rounds - rounds == 1  # one PING for the 30 opens, not 30
        assert source.metrics.core_subscriptions == 31
        await assert_live(client, feeds)
        one = await source.open(rid("alone"))  # a later open gets its own round
        assert source.barrier.rounds - rounds == 2
        await assert_live(client, [one])


async def test_an_open_cancelled_while_waiting_leaves_the_round_to_the_others(nats_url, nats_server, client):
    async with started_source(nats_url) as source:
        await source.open(rid("first"))
        ids = [rid(f"cancel{i}") for i in range(3)]
        tasks = [asyncio.create_task(source.open(i)) for i in ids]
        while not source.barrier._waiters or len(source.barrier._waiters) < 3:  # all three wait on the round
            await asyncio.sleep(0)
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(done[1], asyncio.CancelledError)
        await assert_live(client, [done[0], done[2]])
        subjects = subscribed_subjects(nats_server.monitor_url)
        assert SUBJECTS.result(ids[1]) not in subjects  # the cancelled open left nothing subscribed
        assert SUBJECTS.result(ids[0]) in subjects


async def test_an_open_without_a_pong_fails_after_the_timeout_and_the_next_one_works(nats_url, nats_server,
                                                                                     client):
    async with started_source(nats_url) as source:
        await source.open(rid("first"))
        source.barrier.timeout = 0.5
        os.kill(nats_server.pid, signal.SIGSTOP)  # the server stops answering, the connection stays up
        try:
            started = time.monotonic()
            with pytest.raises(nats.errors.FlushTimeoutError):
                await source.open(rid("frozen"))
            assert 0.4 < time.monotonic() - started < 3
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        source.barrier.timeout = 10
        await assert_live(client, [await source.open(rid("after"))])


async def test_results_paths_the_direct_route_does_not_take_answer_as_starlette_did(edge):
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as http:
        for path in ("/v1/results/a/b", "/v1/results/"):
            assert (await http.get(path)).status_code == 404, path
        response = await http.post("/v1/results/x")
        assert response.status_code == 405
        assert "GET" in response.headers["allow"]
        response = await http.get("/v1/results/a.b")  # the direct route: the same 400 as before
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request"
