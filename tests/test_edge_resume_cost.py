"""A client resuming with ``Last-Event-ID`` against a real `streamproc edge` subprocess and
nats-server: what a resume makes the edge read from the results stream, and that the search it
starts with (replay.py, ``Replay._seek``) hands out exactly what a read from the start would."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from edge_harness import (expected_sse, publish_result, publish_results, running_edge, sent_to_connection,
                          settled_sent_to_connection)
from helpers import connection, peak_rss, rid, wait_until
from nats_auth import MSG_GET, edge_user_denied

from streamproc.nats.streams import find_stream
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

MiB = 1 << 20


async def stored(nc, subject: str, count: int) -> None:
    """Until the results stream holds ``count`` messages (the edge's ring, with ``--recent 0``, counts none)."""
    js = nc.jetstream()
    stream = await find_stream(js, subject)
    assert stream is not None

    async def holds() -> bool:
        return (await js.stream_info(stream)).state.messages >= count

    await wait_until(holds, 15, f"{count} results stored")


async def resumed(client: httpx.AsyncClient, request_id: str, after: int | str) -> bytes:
    response = await client.get(f"/v1/results/{request_id}", headers={"Last-Event-ID": str(after)})
    assert response.status_code == 200, response.text
    return response.content


async def _take(lines, count: int):
    """The first ``count`` lines of an SSE body (the stream stays open: the request goes on)."""
    for _ in range(count):
        yield await anext(lines)


@pytest.mark.parametrize("recent", [[], ["--recent", "0"]], ids=["ring", "recent-0"])
async def test_resumes_near_the_end_of_a_long_stored_history_do_not_read_it_each_time(nats_server, recent):
    """A resume read every stored result of its request from the first and dropped those at or
    before its Last-Event-ID: 20 resumes after the 999th of 1,000 16 KiB results had nats-server
    send the edge 315 MiB (20 x the 15.6 MiB history) for 20 events. A client may resume as often as
    it likes, so that was ~1,000 x amplification of what it was sent. Now a resume first searches
    for its Last-Event-ID's result (a MSG.GET per halving): each resumer still gets exactly the
    rest, a client opening another request meanwhile gets all of it, and the server sends the edge
    less than half the history for all 20 (5.4 MiB measured), with the edge's peak RSS bounded."""
    subjects = Subjects("resumecost")
    long_id, other_id = rid("long"), rid("other")
    body = b'{"text":"' + b"x" * (16 * 1024 - 12) + b'"}'
    results, resumes = 1000, 20
    history = results * len(body)
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream", *recent) as edge:
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, long_id, [body] * results, flush_every=8)
            await stored(nc, subjects.result(long_id), results)
            _, sent_before = await settled_sent_to_connection(nats_server.monitor_url, "streamproc-edge")
            baseline = peak_rss(edge.proc.pid)
            others = [b'{"text":"%d"}' % k for k in range(5)]
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client, \
                    client.stream("GET", f"/v1/results/{other_id}") as other:
                assert other.status_code == 200
                got = await asyncio.gather(*(resumed(client, long_id, results - 2) for _ in range(resumes)))
                await publish_results(nc, subjects, other_id, others)
                other_body = await other.aread()
            _, sent_after = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
            growth = peak_rss(edge.proc.pid) - baseline
    sent = sent_after - sent_before
    print(f"{resumes} resumes: the server sent the edge {sent / MiB:.1f} MiB of a {history / MiB:.1f} MiB history, "
          f"VmHWM +{growth / MiB:.0f} MiB")
    assert all(g == expected_sse([body], start=results - 1) for g in got)
    assert other_body == expected_sse(others)
    assert sent < history / 2, f"{sent / history:.2f} x the history sent for {resumes} resumes of its last result"
    assert growth < 32 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"


@pytest.mark.parametrize("recent", [[], ["--recent", "0"]], ids=["ring", "recent-0"])
async def test_resumes_ahead_of_a_running_requests_stored_results_do_not_read_them_each_time(nats_server, recent):
    """The same with Last-Event-IDs past everything stored of a request still running (1,000 results
    stored, no final): no stored result has that seq, and reading from the first (as a resume whose
    result is gone does) would cost the whole history each time. The search found every result at
    or before it, so the replay reads from the last one stored; each resumer gets exactly the
    results past its Last-Event-ID once they come, and the final one ends every stream."""
    subjects = Subjects("resumeahead")
    request_id = rid("ahead")
    body = b'{"text":"' + b"x" * (16 * 1024 - 12) + b'"}'
    results, resumes = 1000, 20
    history = results * len(body)
    tail = [b'{"text":"tail %d"}' % k for k in range(8)]
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream", *recent) as edge:
        async with connection(nats_server.url) as nc:
            for seq in range(results):
                await publish_result(nc, subjects, request_id, seq, body)
                if seq % 8 == 7:
                    await nc.flush()
            await nc.flush()
            await stored(nc, subjects.result(request_id), results)
            _, sent_before = await settled_sent_to_connection(nats_server.monitor_url, "streamproc-edge")
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                readers = [asyncio.ensure_future(resumed(client, request_id, results + 5)) for _ in range(resumes)]
                await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] == resumes, 10, "all open")
                await asyncio.sleep(1.0)  # their replays ran
                _, sent_mid = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
                for k, text in enumerate(tail):
                    await publish_result(nc, subjects, request_id, results + k, text, final=k == len(tail) - 1)
                await nc.flush()
                got = await asyncio.gather(*readers)
    sent = sent_mid - sent_before
    print(f"{resumes} resumes ahead: the server sent the edge {sent / MiB:.1f} MiB of a {history / MiB:.1f} MiB history")
    assert all(g == expected_sse(tail[6:], start=results + 6) for g in got)
    assert sent < history / 2, f"{sent / history:.2f} x the history sent for {resumes} resumes ahead of it"


async def test_a_resume_at_any_point_of_an_interleaved_history_gets_exactly_the_rest(nats_server):
    """The search reads by subject among another request's results stored in between (its probes
    land on them): every Last-Event-ID from before the first stored result to far past the final
    one gets the results after it and ``[DONE]``, nothing repeated or lost; one at or past the final
    seq gets ``[DONE]`` alone, as documented (docs/edge.md)."""
    subjects = Subjects("resumeall")
    request_id, noise_id = rid("mine"), rid("noise")
    bodies = [b'{"text":"%d"}' % k for k in range(37)]
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream") as edge:
        async with connection(nats_server.url) as nc:
            for seq, body in enumerate(bodies):
                await publish_result(nc, subjects, request_id, seq, body, final=seq == len(bodies) - 1)
                for k in range(seq % 3):
                    await publish_result(nc, subjects, noise_id, 3 * seq + k, b'{"noise":1}')
            await nc.flush()
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= 73, 15, "stored")
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                for after in range(len(bodies)):
                    assert await resumed(client, request_id, after) == expected_sse(bodies[after + 1:],
                                                                                    start=after + 1), after
                for after in (len(bodies), 10 ** 6, 999_999_999_999_999_999):
                    assert await resumed(client, request_id, after) == b"data: [DONE]\n\n", after


async def test_a_resume_whose_last_event_id_is_no_longer_stored_reads_from_the_start(nats_server):
    """Result 5 deleted from the stream (an operator, a limit): the search finds no copy of the
    client's Last-Event-ID and the replay reads from the start, as every resume did, so the results
    after it still come (a search that took the nearest earlier result as its mark would be right
    here too; one that took the nearest later one would skip result 6)."""
    subjects = Subjects("resumegone")
    request_id = rid("gone")
    bodies = [b'{"text":"%d"}' % k for k in range(12)]
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream") as edge:
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, request_id, bodies)
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= len(bodies), 15,
                             "stored")
            js = nc.jetstream()
            stream = await find_stream(js, subjects.result(request_id))
            assert stream is not None
            info = await js.stream_info(stream)
            await js.delete_msg(stream, info.state.first_seq + 5)
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                assert await resumed(client, request_id, 5) == expected_sse(bodies[6:], start=6)
                assert await resumed(client, request_id, 8) == expected_sse(bodies[9:], start=9)


@pytest.mark.parametrize("recent", [[], ["--recent", "0"]], ids=["ring", "recent-0"])
async def test_a_resume_of_a_request_with_nothing_stored_asks_the_stream_once_like_an_open(nats_server, recent):
    """A resume (``Last-Event-ID: 3``) of a request with nothing stored, in a stream of 4,096 other
    results: the search halved the whole stream (a MSG.GET per halving: 15 messages to the edge, each holding a
    share of the read budget in turn) where an open has 3, so any client naming any
    request id had the edge ask 5 x what an honest open asks (failed before: 15 vs 3). Its first MSG.GET (the subject's
    first stored result) finds nothing, and that ends it."""
    subjects = Subjects("resumenone")
    noise_id = rid("noise")
    noise = 4096
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream", *recent) as edge:
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, noise_id, [b'{"n":1}'] * noise, flush_every=64)
            await stored(nc, subjects.result(noise_id), noise)
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:

                async def answers(headers: dict[str, str]) -> int:
                    before, _ = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
                    async with client.stream("GET", f"/v1/results/{rid('absent')}", headers=headers) as response:
                        assert response.status_code == 200
                        await asyncio.sleep(1.0)  # its replay ran
                        after, _ = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
                    return after - before

                opened = await answers({})
                resumed_ = await answers({"Last-Event-ID": "3"})
    print(f"an open: {opened} messages to the edge, a resume: {resumed_}")
    assert resumed_ <= opened + 1, f"a resume of nothing stored: {resumed_} messages, an open {opened}"


async def test_a_resume_after_a_requests_first_result_stops_searching_where_it_found_it(nats_server):
    """``Last-Event-ID: 0`` (an EventSource that reconnects after its first event) for a running
    request whose results 0 and 1 are stored at the start of a stream of 4,096 others: the search
    found result 0 with its first MSG.GET and went on halving the rest of the stream for a later
    copy of it (one more MSG.GET per halving), which, results being stored in seq order, is never
    there: 20 messages to the edge where an open of the request had 8. Found, it is where the
    replay starts: the client gets result 1, once, for as many as the open."""
    subjects = Subjects("resumefirst")
    request_id, noise_id = rid("first"), rid("noise")
    noise = 4096
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream") as edge:
        async with connection(nats_server.url) as nc:
            for seq in range(2):
                await publish_result(nc, subjects, request_id, seq, b'{"text":"%d"}' % seq)
            await publish_results(nc, subjects, noise_id, [b'{"n":1}'] * noise, flush_every=64)
            await stored(nc, subjects.result(noise_id), noise + 2)
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= noise + 2, 15, "seen")
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:

                async def cost(headers: dict[str, str], first: int) -> int:
                    before, _ = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
                    async with client.stream("GET", f"/v1/results/{request_id}", headers=headers) as response:
                        assert response.status_code == 200
                        lines = [line async for line in _take(response.aiter_lines(), 3 * (2 - first))]
                        assert lines == sum((["id: %d" % k, 'data: {"text":"%d"}' % k, ""]
                                             for k in range(first, 2)), [])
                        await asyncio.sleep(1.0)  # its replay ended
                        after, _ = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
                    return after - before

                opened = await cost({}, 0)
                resumed_ = await cost({"Last-Event-ID": "0"}, 1)
    print(f"an open of it: {opened} messages to the edge, a resume after result 0: {resumed_}")
    assert resumed_ <= opened, f"a resume after result 0: {resumed_} messages to the edge, an open {opened}"


@pytest.mark.parametrize("recent", [[], ["--recent", "0"]], ids=["ring", "recent-0"])
async def test_resumes_where_msg_get_is_denied_read_from_the_start_and_get_exactly_the_rest(recent):
    """The edge's user may not publish ``$JS.API.STREAM.MSG.GET``: the search's first MSG.GET is
    refused, and a resume reads from the first stored result with consumers, as documented
    (docs/edge.md): each Last-Event-ID, the first request of the edge among them, gets the
    results after it and ``[DONE]``, nothing repeated or lost."""
    subjects = Subjects("resumedenied")
    request_id = rid("denied")
    bodies = [b'{"text":"%d"}' % k for k in range(12)]
    with EmbeddedNats(config=edge_user_denied(MSG_GET, publisher=True)) as server:
        url = server.url.replace("nats://", "nats://%s:%s@")
        with running_edge(url % ("edge", "edge"), "--prefix", subjects.prefix, "--ensure-results-stream",
                          *recent) as edge:
            async with connection(url % ("pub", "pub")) as nc:
                await publish_results(nc, subjects, request_id, bodies)
                await stored(nc, subjects.result(request_id), len(bodies))
                async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                    for after in (5, 0, 10, 11, 3):
                        assert await resumed(client, request_id, after) == (
                            expected_sse(bodies[after + 1:], start=after + 1) if after < 11
                            else b"data: [DONE]\n\n"), after
            assert edge.metrics()["streamproc_edge_streams_fallback_total"] >= 1  # MSG.GET was refused
