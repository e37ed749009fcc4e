"""A forger on a results subject against the edge's per-stream bound (``--stream-buffer-bytes``): what
a held result costs is more than its body. The edge charged bodies only, in a stream's inbox and in
its reorder buffer, so results with empty bodies and long header values (an error text, a
traceparent: any publisher picks their length) grew the edge without end and never ended the stream.
Real nats-server, a real edge subprocess, in each way a stream is fed: the ring's dispatch or a
subscription of its own (``--recent 0``, whose queue is nats-py's: its limits count bodies only),
core or durable (a results stream); its peak RSS (VmHWM, /proc) against its RSS before the flood."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest
from edge_harness import (expected_sse, fill_send_queue, publish_result, publish_results, running_edge, started_source,
                          stall_stream, unread_stream)
from helpers import connection, rid, status_kib, wait_until

from streamproc.core.defaults import RESULT_HELD_OVERHEAD
from streamproc.core.wire import ERROR, SEQ, TRACEPARENT
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(180)]

MiB = 1024 * 1024
BOUND = 1 * MiB  # --stream-buffer-bytes under test
LONG = "t" * 50_000
FLOOD = 2000  # 100 MB of header values, no body: 100 x the bound
GROWTH = 24 * MiB  # stated bound on the edge's VmHWM growth over the flood (before: ~96 MiB)
# How a stream is fed: the recent ring's dispatch (fanout.py) or a subscription / ordered consumer of
# its own (--recent 0), without or with a results stream (core, durable).
FEEDS = {
    "ring": (),
    "own-subscription": ("--recent", "0"),
    "durable-ring": ("--ensure-results-stream",),
    "durable-own-consumer": ("--ensure-results-stream", "--recent", "0"),
}


def text_bytes(text: str | None) -> int:
    """Bytes CPython keeps the characters of ``text`` in (PEP 393: 1, 2 or 4 a character by its widest)."""
    if not text:
        return 0
    widest = max(text)
    return len(text) * (1 if widest < "\u0100" else 2 if widest < "\U00010000" else 4)


async def flood(nc, subject: str, headers: list[dict[str, str]]) -> None:
    for k, h in enumerate(headers):
        await nc.publish(subject, b"", headers=h)
        if k % 50 == 49:
            await nc.flush()
    await nc.flush()


async def another_stream_is_answered(nc, subjects: Subjects, url: str) -> None:
    other = rid("other")
    bodies = [b'{"text":"%d"}' % k for k in range(3)]
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async with anyio.create_task_group() as tg:
            async def publish() -> None:
                await anyio.sleep(0.5)
                await publish_results(nc, subjects, other, bodies)

            tg.start_soon(publish)
            response = await client.get(f"/v1/results/{other}")
    assert response.content == expected_sse(bodies), response.text[-300:]


@pytest.mark.parametrize("feed", FEEDS)
async def test_empty_results_behind_a_missing_seq_end_the_stream_at_the_buffer_bound(nats_server, feed):
    """2,000 results with no body and a 50 kB ``Streamproc-Error`` each, behind a seq 0 that never
    comes: they wait in the stream's reorder buffer (under ``SeqOrder``'s 4,096). Before, 0 bytes were
    counted and the stream waited for --gap-timeout holding them all; now it ends with the overrun
    error at the bound, however it is fed (a results stream has the missing seq no more than the
    edge: the overrun, not a catch-up)."""
    server = nats_server
    subjects = Subjects("heldgap")
    with running_edge(server.url, "--prefix", "heldgap", "--stream-buffer-bytes", str(BOUND),
                      "--gap-timeout", "60", *FEEDS[feed]) as edge:
        pid = edge.proc.pid
        request_id = rid("gap")
        async with connection(server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
            baseline = status_kib(pid, "VmRSS")
            async with client.stream("GET", f"/v1/results/{request_id}") as response:
                assert response.status_code == 200
                await flood(nc, subjects.result(request_id),
                            [{SEQ: str(seq), ERROR: LONG} for seq in range(1, FLOOD + 1)])
                started = time.monotonic()
                with anyio.fail_after(30):  # well before the 60 s gap timeout
                    text = (b"".join([chunk async for chunk in response.aiter_bytes()])).decode()
                elapsed = time.monotonic() - started
            peak = status_kib(pid, "VmHWM")
            await another_stream_is_answered(nc, subjects, edge.url)
        data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        print(f"\nbehind a gap ({feed}): VmRSS before {baseline} KiB, VmHWM {peak} KiB, ended after {elapsed:.1f} s")
        assert data and data[-1] == "[DONE]" and "--stream-buffer-bytes" in data[-2], text[-500:]
        assert edge.metrics()["streamproc_edge_streams_overrun_total"] == 1
        assert (peak - baseline) << 10 < GROWTH, f"the edge grew by {(peak - baseline) >> 10} MiB"


@pytest.mark.parametrize("feed", FEEDS)
async def test_empty_results_queued_for_a_stalled_reader_are_held_to_the_buffer_bound(nats_server, feed):
    """A client that reads nothing: its stream's write is paused (its socket and the edge's transport
    full), so results in order wait in its inbox, or in nats-py's queue of its own subscription
    (``--recent 0``). 2,000 with no body and a 50 kB traceparent each: before, 0 bytes were counted
    and the inbox held them all (its count bound is 16,384; nats-py's queue's too, whose byte limit
    counts bodies only); now the stream is held to the bound: in core mode it ends with the overrun,
    with a results stream it goes behind (it reads on from the stream once its client reads)."""
    server = nats_server
    durable = "--ensure-results-stream" in FEEDS[feed]
    subjects = Subjects("heldinbox")
    with running_edge(server.url, "--prefix", "heldinbox", "--stream-buffer-bytes", str(BOUND),
                      "--write-timeout", "120", *FEEDS[feed]) as edge:
        pid = edge.proc.pid
        request_id = rid("stalled")
        async with connection(server.url) as nc:
            sock = await unread_stream(edge.port, request_id)
            try:
                seq = await stall_stream(nc, subjects, request_id, edge.port, sock)  # its task waits
                baseline = status_kib(pid, "VmRSS")
                assert edge.metrics()["streamproc_edge_streams_overrun_total"] == 0
                await flood(nc, subjects.result(request_id),
                            [{SEQ: str(s), TRACEPARENT: LONG} for s in range(seq, seq + FLOOD)])
                held = "streamproc_edge_streams_behind_total" if durable else "streamproc_edge_streams_overrun_total"
                try:
                    await wait_until(lambda: edge.metrics()[held] == 1, 20, "the stalled stream was held to its bound")
                    bounded = True
                except AssertionError:
                    bounded = False
                await anyio.sleep(1)  # what else would come in after the bound
                peak = status_kib(pid, "VmHWM")
                assert bounded, f"not held to its bound within 20 s; the edge grew by {(peak - baseline) >> 10} MiB"
                await another_stream_is_answered(nc, subjects, edge.url)
            finally:
                sock.close()
        print(f"\nstalled reader ({feed}): VmRSS before {baseline} KiB, VmHWM {peak} KiB")
        if not durable:
            assert "event=stream_overrun" in edge.log()
        else:
            assert edge.metrics()["streamproc_edge_streams_overrun_total"] == 0
        assert (peak - baseline) << 10 < GROWTH, f"the edge grew by {(peak - baseline) >> 10} MiB"


async def test_the_inbox_charges_a_result_its_held_bytes(nats_url):
    """The fan-out computes ``ResultInfo.held_bytes`` inline (no Python call per event): the two must
    agree, so the edge's charge stays below what nats-server counts for the same message, as pinned
    for ``held_bytes`` by tests/test_client_held_bytes.py (a replay's pull asks ``max_bytes`` by the
    room the bound has left)."""
    subjects = Subjects("heldcharge")
    async with started_source(nats_url, subjects, stream_buffer_bytes=BOUND) as source, \
            connection(nats_url) as nc:
        request_id = rid("charge")
        feed = await source.open(request_id)
        try:
            cases = [({SEQ: "1"}, b""), ({SEQ: "2", TRACEPARENT: "00-" + "a" * 52}, b"body"),
                     ({SEQ: "3", ERROR: "e" * 300}, b""), ({SEQ: "4", ERROR: "x", TRACEPARENT: "t" * 99}, b"{}"),
                     # not ASCII: a str keeps every character in 2 or 4 bytes (PEP 393)
                     ({SEQ: "5", ERROR: "\U0001F600" + "a" * 300}, b""),
                     ({SEQ: "6", TRACEPARENT: "\u2713" + "t" * 99}, b"{}"),
                     ({SEQ: "7", ERROR: "caf\u00e9 \u2713", TRACEPARENT: "00-\U0001F600"}, b"")]
            for headers, body in cases:
                await nc.publish(subjects.result(request_id), body, headers=headers)
            await nc.flush()
            inbox = feed.inbox
            assert inbox is not None
            await wait_until(lambda: len(inbox._items) == len(cases), 10, "dispatched")
            assert [size for _, size in inbox._items] == [result.held_bytes for result, _ in inbox._items]
            assert inbox._bytes == sum(result.held_bytes for result, _ in inbox._items)
            for result, size in inbox._items:  # the charge covers the characters' bytes the values hold
                assert size - len(result.body) - len(result.request_id) - RESULT_HELD_OVERHEAD >= \
                    text_bytes(result.error) + text_bytes(result.traceparent), result
        finally:
            await feed.close()


async def test_results_a_filled_gap_releases_to_a_stalled_reader_leave_the_flood_to_the_bound(nats_server):
    """``ResultFeed.ready`` (results in order a filled gap released, not handed out yet) is charged
    nothing: they were charged while they waited behind the gap (at most the bound), and the feed
    takes nothing more in while any is left, so what comes next waits in the inbox, charged there.
    Here 15 results of a 16 kB body and a 50 kB traceparent wait behind a missing seq (~0.99 MB,
    under the 1 MiB bound), the seq comes while the client reads nothing (its writes pause with
    them half out), then 2,000 empty results with a 50 kB traceparent: the stream ends with the
    overrun and the edge holds no more than those bounds."""
    subjects = Subjects("heldready")
    body = b'{"text":"%s"}' % (b"x" * 16000)
    with running_edge(nats_server.url, "--prefix", "heldready", "--stream-buffer-bytes", str(BOUND),
                      "--write-timeout", "120", "--gap-timeout", "60") as edge:
        pid = edge.proc.pid
        request_id = rid("ready")
        async with connection(nats_server.url) as nc:
            sock = await unread_stream(edge.port, request_id)
            try:
                gap = await fill_send_queue(nc, subjects, request_id, edge.port, sock)
                subject = subjects.result(request_id)
                for seq in range(gap + 1, gap + 16):
                    await nc.publish(subject, body, headers={SEQ: str(seq), TRACEPARENT: LONG})
                await nc.flush()
                await anyio.sleep(0.5)
                assert edge.metrics()["streamproc_edge_streams_overrun_total"] == 0  # held, under the bound
                baseline = status_kib(pid, "VmRSS")
                await nc.publish(subject, body, headers={SEQ: str(gap)})  # the gap fills: 16 in order
                await nc.flush()
                await anyio.sleep(0.5)
                sent = edge.metrics()["streamproc_edge_results_sent_total"]
                assert gap < sent < gap + 16, sent  # some released ones wait in _ready, behind the paused write
                await flood(nc, subject, [{SEQ: str(s), TRACEPARENT: LONG} for s in range(gap + 16, gap + 16 + FLOOD)])
                try:
                    await wait_until(lambda: edge.metrics()["streamproc_edge_streams_overrun_total"] == 1, 20,
                                     "the stalled stream overran")
                    bounded = True
                except AssertionError:
                    bounded = False
                await anyio.sleep(1)
                peak = status_kib(pid, "VmHWM")
                assert bounded, f"not held to its bound within 20 s; the edge grew by {(peak - baseline) >> 10} MiB"
                await another_stream_is_answered(nc, subjects, edge.url)
            finally:
                sock.close()
        print(f"\nreleased to a stalled reader: VmRSS before {baseline} KiB, VmHWM {peak} KiB")
        assert "event=stream_overrun" in edge.log()
        assert (peak - baseline) << 10 < GROWTH, f"the edge grew by {(peak - baseline) >> 10} MiB"


async def test_empty_results_collected_for_a_unary_answer_are_held_to_max_unary_bytes(nats_server):
    """A unary answer (``Accept: application/json``) holds every result until the final one and
    counted their bodies only against ``--max-unary-bytes``: 2,000 with no body and a 50 kB
    traceparent were all held, then answered. Each is charged what it holds
    (``ResultInfo.held_bytes``): refused ``too_large`` at the bound, the edge's growth bounded."""
    subjects = Subjects("heldunary")
    with running_edge(nats_server.url, "--prefix", "heldunary", "--max-unary-bytes", str(BOUND)) as edge:
        pid = edge.proc.pid
        request_id = rid("unary")
        async with connection(nats_server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
            baseline = status_kib(pid, "VmRSS")
            async with anyio.create_task_group() as tg:
                async def publish() -> None:
                    await anyio.sleep(0.5)
                    await flood(nc, subjects.result(request_id),
                                [{SEQ: str(seq), TRACEPARENT: LONG} for seq in range(FLOOD)])
                    await publish_result(nc, subjects, request_id, FLOOD, b'{"text":"end"}', final=True)
                    await nc.flush()

                tg.start_soon(publish)
                with anyio.fail_after(60):
                    response = await client.get(f"/v1/results/{request_id}", headers={"Accept": "application/json"})
            await anyio.sleep(0.5)
            peak = status_kib(pid, "VmHWM")
            await another_stream_is_answered(nc, subjects, edge.url)
        print(f"\nunary: VmRSS before {baseline} KiB, VmHWM {peak} KiB, answered {response.status_code}")
        assert response.status_code == 413 and "--max-unary-bytes" in response.text, response.text[:300]
        assert (peak - baseline) << 10 < GROWTH, f"the edge grew by {(peak - baseline) >> 10} MiB"


OWN = {feed: FEEDS[feed] for feed in ("own-subscription", "durable-own-consumer")}
TINY_HEADERS = {f"h{k:03d}": "" for k in range(120)}  # 120 header lines of 6 bytes, under MAX_HEADER_LINES


@pytest.mark.parametrize("feed", OWN)
async def test_results_with_many_tiny_headers_queued_for_a_stalled_reader_are_held_to_the_buffer_bound(
        nats_server, feed):
    """A result's headers are held as a dict and its strings, not as their characters: 120 empty
    headers are ~0.8 kB on the wire, 3.3 kB of dict in the queued ``Msg`` (the names are shared, the
    values the one empty string). Charged by characters (~0.6 kB a result with the subject and the
    fixed cost), 16,000 for a stalled reader were all queued in ``--recent 0``'s own subscription
    under its 8 MiB bound (VmHWM +46 MiB core, +133 MiB with a results stream); charged the objects'
    sizes (``pending.HeldQueue``), the stream is held at the bound."""
    server = nats_server
    durable = "--ensure-results-stream" in OWN[feed]
    subjects = Subjects("heldtiny")
    with running_edge(server.url, "--prefix", "heldtiny", "--write-timeout", "120", *OWN[feed]) as edge:
        pid = edge.proc.pid
        request_id = rid("tiny")
        async with connection(server.url) as nc:
            sock = await unread_stream(edge.port, request_id)
            try:
                seq = await stall_stream(nc, subjects, request_id, edge.port, sock)  # its task waits
                baseline = status_kib(pid, "VmRSS")
                await flood(nc, subjects.result(request_id),
                            [{SEQ: str(s), **TINY_HEADERS} for s in range(seq, seq + 16_000)])
                held = "streamproc_edge_streams_behind_total" if durable else "streamproc_edge_streams_overrun_total"
                await wait_until(lambda: edge.metrics()[held] == 1, 30, "the stalled stream was held to its bound")
                await anyio.sleep(1)
                peak = status_kib(pid, "VmHWM")
                await another_stream_is_answered(nc, subjects, edge.url)
            finally:
                sock.close()
        print(f"\ntiny headers, stalled reader ({feed}): VmRSS before {baseline} KiB, VmHWM {peak} KiB")
        assert (peak - baseline) << 10 < GROWTH, f"the edge grew by {(peak - baseline) >> 10} MiB"


@pytest.mark.parametrize("feed", OWN)
async def test_a_long_stream_read_promptly_never_overruns_its_own_queue(nats_server, feed):
    """What ``pending.HeldQueue`` adds to nats-py's pending bytes for each message it queues it takes
    off as the message leaves: 3,000 results of a 1 kB traceparent (~3.5 MB charged in all, 3.5 x
    the bound) read as they come end with every result sent, no overrun, nothing put behind."""
    subjects = Subjects("heldlong")
    request_id = rid("long")
    count = 3000
    bodies = [b'{"text":"%d"}' % k for k in range(count)]
    with running_edge(nats_server.url, "--prefix", "heldlong", "--stream-buffer-bytes", str(BOUND),
                      *OWN[feed]) as edge:
        async with connection(nats_server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
            async with client.stream("GET", f"/v1/results/{request_id}") as response:
                assert response.status_code == 200
                for seq, body in enumerate(bodies):
                    await nc.publish(subjects.result(request_id), body,
                                     headers={SEQ: str(seq), TRACEPARENT: "t" * 1000})
                    if seq % 100 == 99:
                        await nc.flush()
                        await anyio.sleep(0.02)  # read as they come: never near the bound at once
                await publish_result(nc, subjects, request_id, count, b'{"text":"end"}', final=True)
                with anyio.fail_after(60):
                    text = b"".join([chunk async for chunk in response.aiter_bytes()])
        assert text == expected_sse([*bodies, b'{"text":"end"}']), text[-300:]
        metrics = edge.metrics()
        assert metrics["streamproc_edge_streams_overrun_total"] == 0
        assert metrics["streamproc_edge_streams_behind_total"] == 0


async def test_a_unary_answer_refused_by_what_each_result_holds_says_what_counts(nats_server):
    """An honest answer whose bodies fit under ``--max-unary-bytes`` (16 results of 65,500 bytes and a
    final one: 1,048,014 of a 1,048,576 bound) but whose results hold more (request id, traceparent, 96 bytes each) is refused:
    the 413's text names what counts, so a client does not read 'exceed' against bodies that fit."""
    subjects = Subjects("heldwhy")
    request_id = rid("why")
    body = b'{"text":"%s"}' % (b"x" * (65_500 - 11))
    end = b'{"text":"end"}'
    with running_edge(nats_server.url, "--prefix", "heldwhy", "--max-unary-bytes", str(BOUND)) as edge:
        async with connection(nats_server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
            async with anyio.create_task_group() as tg:
                async def publish() -> None:
                    await anyio.sleep(0.5)
                    for seq in range(16):
                        await nc.publish(subjects.result(request_id), body,
                                         headers={SEQ: str(seq), TRACEPARENT: "00-" + "a" * 52})
                    await publish_result(nc, subjects, request_id, 16, end, final=True)
                    await nc.flush()

                tg.start_soon(publish)
                with anyio.fail_after(60):
                    response = await client.get(f"/v1/results/{request_id}", headers={"Accept": "application/json"})
    assert 16 * len(body) + len(end) < BOUND
    message = response.json()["error"]["message"]
    assert response.status_code == 413 and "--max-unary-bytes" in message, response.text[:300]
    assert "body, request id, traceparent and 96 bytes" in message, message
