"""Hostile ``Last-Event-ID`` resumes against a real `streamproc edge` subprocess and nats-server:
one client flooding resumes (each a binary search of STREAM.MSG.GETs, replay.py ``Replay._seek``)
while honest clients open streams, and a nats-server restart in the middle of resumes' searches."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
from edge_harness import expected_sse, publish_result, publish_results, running_edge, sent_to_connection
from helpers import connection, rid, status_kib, wait_until

from streamproc.client.capability import mint_capability
from streamproc.nats.streams import find_stream
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(240)]

SECRET = b"edge-resume-flood-secret-0123456789abcdef-0123"
PER_CLIENT = 32  # --max-streams-per-client (the default): the flooder's cap
FLOOD_WAVE = 300  # concurrent resumes the flooder opens per wave
FLOOD_SECONDS = 8.0
FIRST_EVENT_BOUND = 5.0  # s: p99 open-to-first-event of an honest open under the flood, at most (measured 0.6-1.5 s
# on 2 loaded cores; 2.6 s under a flood of plain opens of the same request, no Last-Event-ID)
SEARCH_MESSAGES = 24  # messages to the edge per stream answered, past the results it serves (~8 measured)
HWM_GROWTH = 64 * 1024  # KiB of VmHWM over the edge's peak before the flood (7-9 MiB measured)
RESTART_BUDGET = 64 * 1024  # --replay-read-budget (its least): resumes' MSG.GETs wait their turn, so the kill
# finds searches under way


def bearer(**claims: object) -> dict[str, str]:
    return {"Authorization": f"Bearer {mint_capability(SECRET, **claims)}"}


def events(body: bytes) -> list[bytes]:
    """An SSE body's events (the blocks between blank lines), comments dropped."""
    return [block for block in body.split(b"\n\n") if block and not block.startswith(b":")]


def check_resumed(body: bytes, bodies: list[bytes], after: int) -> str:
    """A resumed stream's body: results ``after + 1`` on, consecutive (no gap, no repeat), then
    ``[DONE]``, after all of them ("done") or after an error event saying why it ended ("error", the
    edge's ``data: {"error": ...}``). An error that a seq never arrived is a gap: every result is stored."""
    *got, last = events(body)
    assert last == b"data: [DONE]", f"after {after}: no [DONE] at the end: {body[-300:]!r}"
    want = events(expected_sse(bodies[after + 1:], start=after + 1))[:-1]
    if got == want:
        return "done"
    *results, error = got
    assert results == want[:len(results)], f"after {after}: a gap or a repeat: {body[:400]!r}"
    assert error.startswith(b'data: {"error":') and b"never arrived" not in error, f"after {after}: {error[:300]!r}"
    return "error"


async def first_event_seconds(client: httpx.AsyncClient, request_id: str, headers: dict[str, str],
                              bodies: list[bytes]) -> float:
    """An honest open of a stored request: the seconds to its first event; all of it must come."""
    started = time.perf_counter()
    async with client.stream("GET", f"/v1/results/{request_id}", headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        chunks = response.aiter_bytes()
        first = await anext(chunks)
        spent = time.perf_counter() - started
        body = first + b"".join([chunk async for chunk in chunks])
    assert body == expected_sse(bodies), body[:300]
    return spent


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def flood(url: str, flooder: dict[str, str], flood_id: str, flood_bodies: list[bytes],
                statuses: dict[int, int], served: dict[str, int], stop: threading.Event) -> None:
    """The flooder, on a thread and event loop of its own (sharing the honest clients' loop, its
    300 connections' parsing would be timed as the edge's): waves of :data:`FLOOD_WAVE` resumes,
    half of them of ids with nothing stored, until ``stop``."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def resume() -> None:
            absent = random.random() < 0.5
            request_id = rid("flood-none") if absent else flood_id
            after = random.randrange(len(flood_bodies) - 1)
            async with client.stream("GET", f"/v1/results/{request_id}",
                                     headers={**flooder, "Last-Event-ID": str(after)}) as response:
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code == 429:
                    refusal = json.loads(await response.aread())
                    assert refusal["error"]["type"] == "too_many_streams", refusal
                    assert f"has {PER_CLIENT} result streams open (--max-streams-per-client)" in \
                        refusal["error"]["message"], refusal
                    return
                assert response.status_code == 200, (response.status_code, await response.aread())
                if absent:
                    served["absent"] += 1
                    return  # dropped once answered: its slot is free for the next
                body = await response.aread()
            assert body == expected_sse(flood_bodies[after + 1:], start=after + 1), (after, body[:300])
            served["done"] += 1
            served["events"] += len(flood_bodies) - after - 1

        while not stop.is_set():
            await asyncio.gather(*(resume() for _ in range(FLOOD_WAVE)))


async def test_a_resume_flood_is_limited_per_client_while_honest_opens_get_their_first_event_promptly(
        nats_server, tmp_path):
    """One client (one capability) opens waves of 300 concurrent resumes for 8 s: for its own
    request of 3,000 stored results at random Last-Event-IDs (each a search of the stream) and for
    ids of its own prefix with nothing stored, each dropped once answered. Its opens past
    ``--max-streams-per-client`` get 429 ``too_many_streams`` at once; every one it got is exactly
    the rest. Meanwhile honest clients' opens of a stored request get their first event with a p99
    under :data:`FIRST_EVENT_BOUND` and every result, and a live stream gets every result published
    during the flood; the edge's VmHWM grows less than :data:`HWM_GROWTH`; and nats-server sends the
    edge each result served once plus fewer than :data:`SEARCH_MESSAGES` messages per stream served
    (a search reading from the start, as resumes did before beb8ba1, sends ~2 x: fails it)."""
    subjects = Subjects("resumeflood")
    key = tmp_path / "edge.key"
    key.write_bytes(SECRET + b"\n")
    flood_id, honest_id, live_id = rid("flood-big"), rid("legit-stored"), rid("legit-live")
    flood_bodies = [b'{"text":"%d %s"}' % (k, b"x" * 900) for k in range(3000)]
    honest_bodies = [b'{"text":"honest %d"}' % k for k in range(50)]
    live_bodies = [b'{"text":"live %d"}' % k for k in range(100)]
    flooder = bearer(rid_prefix="flood-", subject="mallory")
    honest = bearer(rid_prefix="legit-", subject="alice")
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--auth-key-file", str(key)) as edge:
        pid = edge.proc.pid
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, flood_id, flood_bodies, flush_every=64)
            await publish_results(nc, subjects, honest_id, honest_bodies)
            js = nc.jetstream()
            stream = await find_stream(js, subjects.result(flood_id))
            assert stream is not None

            async def stored() -> bool:
                return (await js.stream_info(stream)).state.messages >= len(flood_bodies) + len(honest_bodies)

            await wait_until(stored, 15, "stored")
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=edge.url, timeout=60, limits=limits) as client:
                quiet = [await first_event_seconds(client, honest_id, honest, honest_bodies) for _ in range(20)]
                baseline = status_kib(pid, "VmHWM")
                statuses: dict[int, int] = {}
                served = {"done": 0, "absent": 0, "events": 0}
                messages_before, sent_before = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
                stop = threading.Event()

                flooding = asyncio.ensure_future(asyncio.to_thread(
                    asyncio.run, flood(edge.url, flooder, flood_id, flood_bodies, statuses, served, stop)))
                try:
                    await asyncio.sleep(1.0)  # the flood under way
                    async with client.stream("GET", f"/v1/results/{live_id}", headers=honest) as live:
                        assert live.status_code == 200
                        loaded: list[float] = []
                        deadline = time.monotonic() + FLOOD_SECONDS
                        for k, body in enumerate(live_bodies):
                            await publish_result(nc, subjects, live_id, k, body, final=k == len(live_bodies) - 1)
                            if k % 5 == 4:
                                loaded.append(await first_event_seconds(client, honest_id, honest, honest_bodies))
                        await nc.flush()
                        live_body = await live.aread()
                        while time.monotonic() < deadline:
                            loaded.append(await first_event_seconds(client, honest_id, honest, honest_bodies))
                finally:
                    stop.set()
                    await flooding
                growth = status_kib(pid, "VmHWM") - baseline
                messages_after, sent_after = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
    # What the edge was sent for the flood and the honest clients, against the results they were
    # served: each served result once, plus a search (~log2 of the stream) and an open's asks per
    # stream answered 200; a refused open asks nothing.
    opens = statuses.get(200, 0) + len(loaded) + 1
    events_served = served["events"] + len(loaded) * len(honest_bodies) + len(live_bodies)
    messages = messages_after - messages_before
    print(f"honest open-to-first-event p99: {p99(quiet) * 1000:.0f} ms quiet, {p99(loaded) * 1000:.0f} ms "
          f"under the flood ({len(loaded)} opens); flood statuses {statuses}, served {served}; "
          f"VmHWM +{growth} KiB; the edge was sent {messages} messages ({(sent_after - sent_before) / 2**20:.1f} MiB) "
          f"for {events_served} results served in {opens} streams")
    assert live_body == expected_sse(live_bodies)
    assert p99(loaded) < FIRST_EVENT_BOUND, f"p99 {p99(loaded):.2f} s under the flood, {p99(quiet):.3f} s quiet"
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.get(429, 0) > 0 and served["done"] > 0 and served["absent"] > 0, (statuses, served)
    assert messages < events_served + SEARCH_MESSAGES * opens, (messages, events_served, opens)
    assert growth < HWM_GROWTH, f"VmHWM grew by {growth} KiB"


async def test_resumes_searching_across_a_nats_server_restart_end_with_the_rest_or_an_error(nats_server):
    """nats-server killed and restarted (same port, same store) while 40 clients keep resuming a
    request of 2,000 stored 4 KiB results interleaved with another's, at random Last-Event-IDs (each
    a search, then a read): every resumed client gets exactly the results after its Last-Event-ID
    and ``[DONE]``, or those of them it got before an error event (no gap, no repeat), or a 503
    saying why; after the restart a resume gets exactly the rest again."""
    subjects = Subjects("resumerestart")
    request_id, noise_id = rid("mine"), rid("noise")
    bodies = [b'{"text":"%d %s"}' % (k, b"y" * 4000) for k in range(2000)]
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--max-streams-per-client", "1000", "--replay-read-budget", str(RESTART_BUDGET)) as edge:
        async with connection(nats_server.url) as nc:
            for seq, body in enumerate(bodies):
                await publish_result(nc, subjects, request_id, seq, body, final=seq == len(bodies) - 1)
                await publish_result(nc, subjects, noise_id, seq, b'{"noise":1}')
                if seq % 64 == 63:
                    await nc.flush()
            await nc.flush()
            js = nc.jetstream()
            stream = await find_stream(js, subjects.result(request_id))
            assert stream is not None

            async def stored() -> bool:
                return (await js.stream_info(stream)).state.messages >= 2 * len(bodies)

            await wait_until(stored, 15, "stored")
        outcomes: dict[str, int] = {}
        kill = [float("inf")]  # when nats-server was killed
        across = {"open at the kill": 0, "first event after the kill": 0}
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=edge.url, timeout=90, limits=limits) as client:

            async def resume(after: int) -> None:
                opened = time.monotonic()
                async with client.stream("GET", f"/v1/results/{request_id}",
                                         headers={"Last-Event-ID": str(after)}) as response:
                    body = b""
                    async for chunk in response.aiter_bytes():
                        if b"id: " not in body and b"id: " in chunk and opened < kill[0] < time.monotonic():
                            across["first event after the kill"] += 1
                        body += chunk
                if opened < kill[0] and kill[0] < time.monotonic():
                    across["open at the kill"] += 1
                if response.status_code == 503:
                    refusal = json.loads(body)
                    assert refusal["error"]["type"] == "unavailable" and refusal["error"]["message"], refusal
                    outcome = "503"
                else:
                    assert response.status_code == 200, (response.status_code, body[:300])
                    outcome = check_resumed(body, bodies, after)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

            async def resumer() -> None:
                while not stop.is_set():
                    await resume(random.randrange(len(bodies) - 1))

            running = [asyncio.ensure_future(resumer()) for _ in range(40)]
            await asyncio.sleep(1.5)  # searches and reads under way
            before = dict(outcomes)
            kill[0] = time.monotonic()
            await asyncio.to_thread(nats_server.restart, kill=True)
            await asyncio.sleep(3.0)  # resumes opened while the edge reconnects, and after
            stop.set()
            await asyncio.wait_for(asyncio.gather(*running), 120)
            print(f"resumes before the restart: {before}; in all: {outcomes}; {across}")
            assert across["first event after the kill"] > 0, across  # the kill found searches under way
            await wait_until(lambda: edge.metrics().get("streamproc_edge_streams_active") == 0, 30, "all ended")
            for after in (0, 1000, 1998):
                async with client.stream("GET", f"/v1/results/{request_id}",
                                         headers={"Last-Event-ID": str(after)}) as response:
                    assert response.status_code == 200
                    assert await response.aread() == expected_sse(bodies[after + 1:], start=after + 1), after
