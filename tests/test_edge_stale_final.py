"""A final result stored or published again with a seq below what the reader already has (results
0-9 delivered, then a final at seq 2): a writer with publish rights on the request's results subject,
or a broken processor, since no processor makes one (a request's seqs end at its final; a migrated
request's continue at the sealed attempt's ``result_seq``, docs/protocol.md). Until 2026-12-07
``SeqOrder`` took it for "a replayed final at or before the resume point" and every reader, the edge's
opens and resumes and the client helpers, ended clean (``[DONE]``, ``StopAsyncIteration``) with
results missing. Now the edge ends the stream with an ``internal`` error event and ``follow`` raises
``MalformedResult``, after what came before. The honest cases (a copy of the final already sent,
live or stored twice; a Last-Event-ID at or past the final seq) are served byte for byte as before.
Real nats-server, real `streamproc edge` subprocess over HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from edge_harness import expected_sse, running_edge
from helpers import connection, rid, wait_until

from streamproc import MalformedResult, follow
from streamproc.core.events import Result
from streamproc.core.wire import MSG_ID, result_headers
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

DONE = b"data: [DONE]\n\n"


def body(seq: int) -> bytes:
    return b'{"text":"%d"}' % seq


async def store(nc, subjects: Subjects, request_id: str, seqs: list[tuple[int, bool]], *,
                live: bool = False) -> None:
    """Stored through JetStream, each acknowledged (``live``: published on core NATS, flushed). A
    repeated seq goes without the processor's ``Nats-Msg-Id`` (``<request id>.<seq>``), which the
    results stream would deduplicate within its ``--duplicate-window``: a hostile writer sets another
    or none, and a processor's republish after the window is stored again."""
    js, seen = nc.jetstream(), set()
    for seq, final in seqs:
        headers = result_headers(Result(request_id, seq, body(seq), final))
        if seq in seen:
            del headers[MSG_ID]
        seen.add(seq)
        if live:
            await nc.publish(subjects.result(request_id), body(seq), headers=headers)
        else:
            await js.publish(subjects.result(request_id), body(seq), headers=headers)
    await nc.flush()


async def store_error(nc, subjects: Subjects, request_id: str, seq: int, error_body: bytes, error: str):
    """A processor's error result at ``seq`` stored through JetStream under its own ``Nats-Msg-Id``
    (``<request id>.<seq>.error``); returns the PubAck."""
    return await nc.jetstream().publish(subjects.result(request_id), error_body, headers=result_headers(
        Result(request_id, seq, error_body, True, error=error)))


def assert_stale_final(content: bytes, first: int, request_id: str) -> None:
    """Results ``first``..9 exactly as served before, then one error event naming the final, then [DONE]."""
    served = expected_sse([body(k) for k in range(first, 10)], start=first).removesuffix(DONE)
    assert content.startswith(served), content
    rest = content[len(served):]
    assert rest.count(b"data: ") == 2 and rest.endswith(DONE), rest
    assert f"a final result at seq 2 of request {request_id}".encode() in rest, rest


async def test_a_final_below_results_already_delivered_ends_every_reader_with_an_error_not_done(nats_server):
    subjects = Subjects("stalefinal")
    stored_id, live_id = rid("stored"), rid("live")
    hostile = [(seq, False) for seq in range(10)] + [(2, True)]
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--result-timeout", "10") as edge:
        async with connection(nats_server.url) as nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            await store(nc, subjects, stored_id, hostile)
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= 10, 15,
                             "stored")

            async def resume(after: int) -> bytes:
                response = await client.get(f"/v1/results/{stored_id}", headers={"Last-Event-ID": str(after)})
                assert response.status_code == 200, response.text
                return response.content

            opened = (await client.get(f"/v1/results/{stored_id}")).content
            resumed = await asyncio.gather(*(resume(after) for after in range(9)))
            async with client.stream("GET", f"/v1/results/{live_id}") as live:
                assert live.status_code == 200
                await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] >= 1, 15, "opened")
                await store(nc, subjects, live_id, hostile, live=True)
                live_content = await live.aread()

            assert_stale_final(opened, 0, stored_id)
            for after, content in enumerate(resumed):
                assert_stale_final(content, after + 1, stored_id)
            assert_stale_final(live_content, 0, live_id)
            assert edge.metrics()["streamproc_edge_stale_finals_total"] == 1 + 9 + 1
            # The client helper (streamproc.client.results), reading the same results from the stream.
            async with follow(nc, subjects, live_id, timeout=30, replay=True) as results:
                got = []
                with pytest.raises(MalformedResult, match="final result at seq 2"):
                    async for result in results:
                        got.append(result.seq)
                assert got == list(range(10))


async def test_honest_repeats_of_the_final_and_resumes_past_it_are_served_as_before(nats_server):
    """A copy of the final already sent (stored twice, published twice live: a processor's republish
    outside the duplicate window), a Last-Event-ID at, or past, the final seq: exactly as before."""
    subjects = Subjects("honestfinal")
    stored_id, live_id = rid("stored"), rid("live")
    honest = [(seq, seq == 4) for seq in range(5)] + [(4, True)]
    expected = expected_sse([body(k) for k in range(5)])
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--result-timeout", "10") as edge:
        async with connection(nats_server.url) as nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            await store(nc, subjects, stored_id, honest)
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= 5, 15,
                             "stored")
            assert (await client.get(f"/v1/results/{stored_id}")).content == expected
            for after in range(8):
                response = await client.get(f"/v1/results/{stored_id}", headers={"Last-Event-ID": str(after)})
                rest = [body(k) for k in range(after + 1, 5)]
                want = expected_sse(rest, start=after + 1) if after < 4 else DONE
                assert response.content == want, (after, response.content)
            async with client.stream("GET", f"/v1/results/{live_id}") as live:
                await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] >= 1, 15, "opened")
                await store(nc, subjects, live_id, honest, live=True)
                assert await live.aread() == expected
            async with follow(nc, subjects, live_id, timeout=30, replay=True) as results:
                assert [r.seq async for r in results] == list(range(5))
            assert edge.metrics()["streamproc_edge_stale_finals_total"] == 0


async def test_a_processor_s_error_result_below_results_delivered_reaches_every_reader(nats_server):
    """Core mode, a processor restarted mid-request: results 0-5 came from the old one; the new one
    never saw their chunks and ends the request with its ``timeout`` error result at seq 0
    (``Correlator._fail``: "a final error result at the next seq", its own next seq being 0). Since
    6c39a77 every reader reported a stale final ("another writer's"), the processor's error lost."""
    subjects = Subjects("errorbelow")
    stored_id, live_id = rid("stored"), rid("live")
    error_body = b'{"error":{"message":"no chunk for 300 s","type":"timeout"}}'

    async def publish(nc, request_id: str, *, live: bool) -> None:
        js = nc.jetstream()
        for seq in range(6):
            headers = result_headers(Result(request_id, seq, body(seq), False))
            if live:
                await nc.publish(subjects.result(request_id), body(seq), headers=headers)
            else:
                await js.publish(subjects.result(request_id), body(seq), headers=headers)
        headers = result_headers(Result(request_id, 0, error_body, True, error="timeout"))
        del headers[MSG_ID]  # past the duplicate window (request_timeout 300 s > the 2 min default)
        if live:
            await nc.publish(subjects.result(request_id), error_body, headers=headers)
        else:
            await js.publish(subjects.result(request_id), error_body, headers=headers)
        await nc.flush()

    def assert_error_end(content: bytes, first: int) -> None:
        served = expected_sse([body(k) for k in range(first, 6)], start=first).removesuffix(DONE)
        assert content.startswith(served), content
        rest = content[len(served):]
        assert error_body in rest and b"another writer" not in rest and rest.endswith(DONE), rest
        assert b"id: " not in rest, rest  # below the ids sent: Last-Event-ID stays at the last result's

    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--result-timeout", "10") as edge:
        async with connection(nats_server.url) as nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            await publish(nc, stored_id, live=False)
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= 6, 15, "stored")
            assert_error_end((await client.get(f"/v1/results/{stored_id}")).content, 0)
            for after in range(6):  # 5: the client had every result; the error is what it has not had
                response = await client.get(f"/v1/results/{stored_id}", headers={"Last-Event-ID": str(after)})
                assert_error_end(response.content, after + 1)
            async with client.stream("GET", f"/v1/results/{live_id}") as live:
                await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] >= 1, 15, "opened")
                await publish(nc, live_id, live=True)
                assert_error_end(await live.aread(), 0)
            assert edge.metrics()["streamproc_edge_stale_finals_total"] == 0
            async with follow(nc, subjects, live_id, timeout=30, replay=True) as results:
                got = [(r.seq, r.error) async for r in results]
            assert got == [(seq, None) for seq in range(6)] + [(0, "timeout")]


async def test_a_processor_s_error_below_results_stored_within_the_duplicate_window_is_stored_and_served(
        nats_server):
    """The same restarted processor's error at seq 0, within the results stream's duplicate window (a
    refused migrate's ``migration_refused`` comes at once; a ``--request-timeout`` under the 2 min window):
    published with the ``Nats-Msg-Id`` result 0 was stored under, the stream dropped it as a repeat, and
    readers of the stream waited out their result timeout. Its own id (``<rid>.0.error``): stored, served."""
    subjects = Subjects("errorwindow")
    request_id = rid("window")
    error_body = b'{"error":{"message":"migration refused","type":"migration_refused"}}'
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--result-timeout", "10") as edge:
        async with connection(nats_server.url) as nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            await store(nc, subjects, request_id, [(seq, False) for seq in range(6)])
            ack = await store_error(nc, subjects, request_id, 0, error_body, "migration_refused")
            assert not ack.duplicate, ack
            response = await client.get(f"/v1/results/{request_id}", headers={"Last-Event-ID": "5"})
            assert response.content == b"data: " + error_body + b"\n\n" + DONE, response.content


@pytest.mark.parametrize("last", [0, 3])
async def test_a_processor_s_error_at_the_seq_of_the_last_result_delivered_is_sent_without_an_id_and_resumed(
        nats_server, last):
    """The restarted processor's error at its own seq 0 when the old one had published result 0 alone
    (``last`` 0: it crashed after the request's first chunk), or at the last result's seq. Stored under its
    own id (``<rid>.<seq>.error``, 8ac2350) beside that result, it went out as ``id: <seq>`` a second time,
    so a client's Last-Event-ID could not tell the result from the error: a resume from it (the client
    left before the error's event came) ended clean, a failed request read as finished."""
    subjects = Subjects(f"errorattop{last}")
    request_id = rid("top")
    error_body = b'{"error":{"message":"no chunk for 30 s","type":"timeout"}}'
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--result-timeout", "10") as edge:
        async with connection(nats_server.url) as nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            await store(nc, subjects, request_id, [(seq, False) for seq in range(last + 1)])
            ack = await store_error(nc, subjects, request_id, last, error_body, "timeout")
            assert not ack.duplicate, ack
            opened = (await client.get(f"/v1/results/{request_id}")).content
            served = expected_sse([body(k) for k in range(last + 1)]).removesuffix(DONE)
            assert opened == served + b"data: " + error_body + b"\n\n" + DONE, opened
            for after in range(last + 1):
                resumed = await client.get(f"/v1/results/{request_id}", headers={"Last-Event-ID": str(after)})
                rest = expected_sse([body(k) for k in range(after + 1, last + 1)], start=after + 1)
                error_end = b"data: " + error_body + b"\n\n" + DONE
                assert resumed.content == rest.removesuffix(DONE) + error_end, (after, resumed.content)


async def test_a_resume_whose_search_meets_the_error_before_the_result_at_its_seq_hands_it_out(nats_server):
    """Result 1 stored, other requests' results, then the restarted processor's error at seq 1: a resume with
    Last-Event-ID 1 searches the stream for the result 1 (``Replay._seek``) and, halving, meets the error
    first (a final at the resume point). Read from there, the result 1 it had was never seen, so the error
    looked like the client's last event and the resume ended clean."""
    subjects = Subjects("errorseek")
    request_id, other = rid("seek"), rid("other")
    error_body = b'{"error":{"message":"no chunk for 30 s","type":"timeout"}}'
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--result-timeout", "10") as edge:
        async with connection(nats_server.url) as nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            await store(nc, subjects, request_id, [(0, False), (1, False)])
            await store(nc, subjects, other, [(seq, False) for seq in range(7)])  # stream seqs 3-9
            await store_error(nc, subjects, request_id, 1, error_body, "timeout")
            resumed = await client.get(f"/v1/results/{request_id}", headers={"Last-Event-ID": "1"})
            assert resumed.content == b"data: " + error_body + b"\n\n" + DONE, resumed.content


# A forger's final (not an error; no processor makes one) stored at the seq of a result the client had
# not final. "at_its_seq": results 0-5, the final at 5, then 6-9; the resume reads result 5 again, then
# the final at 5, and until 2026-12-07 ended clean ([DONE], 6-9 never sent): the same seq's non-final
# copy now rules the final out. "probed_first": results 0-4, the final at 4, 5-9, so the final is stream
# sequence 6 of 11, where the resume's binary search (Replay._seek) probes first: it took the final for
# the client's last result and read on from there, a clean end; it now looks below for a copy of the seq
# stored before it (as for an error there), reads that first, and the final is reported.
FORGED_FINALS = {"at_its_seq": 5, "probed_first": 4}  # the seq of the forged final


def forged_at(at: int) -> list[tuple[int, bool]]:
    """Results 0-9 as (seq, final), with a forged final at ``at`` stored right after the non-final one."""
    before = [(seq, False) for seq in range(at + 1)]
    return before + [(at, True)] + [(seq, seq == 9) for seq in range(at + 1, 10)]


@pytest.mark.parametrize("case", FORGED_FINALS)
async def test_a_final_stored_at_a_non_final_s_seq_ends_a_resume_there_with_an_error(nats_server, case):
    """A client that had results up to the forged final's seq resumes with ``Last-Event-ID`` of that
    seq: one error event naming the final at that seq, never a clean end with the later results missing."""
    at = FORGED_FINALS[case]
    hostile = forged_at(at)
    subjects = Subjects(f"forged{case.replace('_', '')}")
    request_id = rid(case)
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--result-timeout", "10") as edge:
        async with connection(nats_server.url) as nc, \
                httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            await store(nc, subjects, request_id, hostile)
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= 10, 15, "stored")
            response = await client.get(f"/v1/results/{request_id}", headers={"Last-Event-ID": str(at)})
            assert response.status_code == 200, response.text
            content = response.content
            assert content != DONE, f"a clean end with results {at + 1}-9 missing"
            assert content.count(b"data: ") == 2 and content.endswith(DONE), content
            assert f"a final result at seq {at} of request {request_id}".encode() in content, content
            assert edge.metrics()["streamproc_edge_stale_finals_total"] == 1
