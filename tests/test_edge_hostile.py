"""Attacks on a real `streamproc edge` subprocess and nats-server: what one client or one results
publisher can make the edge do per request must not flood its log, and the others are answered."""

from __future__ import annotations

import asyncio
import functools
import socket
import time

import anyio
import httpx
import pytest
from edge_harness import (consumers_back_to, exchange_until_closed, expected_sse, publish_result, publish_results,
                          fill_send_queue, RawStream, read_slowly, running_edge, sent_to_connection,
                          slot_answers, unread_stream)
from helpers import connection, peak_rss, rid, wait_until
from nats.js.api import StreamConfig

from streamproc.core.defaults import DUPLICATE_WINDOW, RESULTS_MAX_AGE
from streamproc.core.wire import MAX_HEADER_LINES
from streamproc.nats import fast_client
from streamproc.nats.streams import RESULTS_STREAM, find_stream
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()
MiB = 1 << 20
FLOOD = 300
BURST = 20  # LogLimiter's default: lines per event name per 10 s interval


async def test_per_request_edge_warnings_are_rate_limited_and_other_streams_are_answered(nats_server):
    """300 malformed results on one client's stream and 300 requests whose subscription NATS refuses
    (the results stream allows one consumer, which a legitimate stream holds) wrote 600 WARNING
    lines, one each. Now each event writes its burst and one count of the rest per interval; every
    refused client gets a clear error event and the legitimate stream gets its results in full.

    The legitimate stream stays open (its final result comes after the flood), so its consumer holds
    the one slot throughout: once its stream ended, nats-server removed that consumer (1 s without
    interest, CONSUMER_LINGER), and the next victim's open got the slot, waited 120 s for results
    that never came, and held the test for as long (under load, when the flood outlasted the linger).

    Its own server: the module's server holds the results stream the ``edge`` fixture made, with no
    consumer limit, and adding this one-consumer stream there failed (name in use with a different
    configuration) whenever a test using ``edge`` ran before this one (the module in reverse order)."""
    async with connection(nats_server.url) as nc:
        await nc.jetstream().add_stream(StreamConfig(
            name=RESULTS_STREAM, subjects=[SUBJECTS.all_results], max_age=RESULTS_MAX_AGE,
            duplicate_window=DUPLICATE_WINDOW, allow_direct=True, max_consumers=1))
        with running_edge(nats_server.url, "--recent", "0") as edge:
            legit = rid("legit")
            bodies = [b'{"text":"%d"}' % k for k in range(3)]
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client, \
                    client.stream("GET", f"/v1/results/{legit}") as response:
                assert response.status_code == 200
                await wait_until(lambda: edge.metrics()["streamproc_edge_jetstream_replays_total"] == 1, 10,
                                 "the legitimate stream attached")
                for k in range(FLOOD):  # no Streamproc-Seq: breaks the wire contract
                    await nc.publish(SUBJECTS.result(legit), b'{"junk":%d}' % k)
                for seq, text in enumerate(bodies[:-1]):  # not final yet: the stream holds its consumer
                    await publish_result(nc, SUBJECTS, legit, seq, text)

                refused = []

                async def open_refused() -> None:
                    async with opening:
                        # A refusal is one JetStream API round trip (299 of them took 3 s at load 8):
                        # an open still waiting after 30 s was given a consumer, not refused.
                        with anyio.fail_after(30):
                            answer = await client.get(f"/v1/results/{rid('victim')}")
                        refused.append((answer.status_code, answer.text))

                # 25 at a time, so the 300 opens are not all queued behind one another in the edge.
                opening = anyio.Semaphore(25)
                async with anyio.create_task_group() as tg:
                    for _ in range(FLOOD):
                        tg.start_soon(open_refused)
                assert len(refused) == FLOOD
                await publish_result(nc, SUBJECTS, legit, len(bodies) - 1, bodies[-1], final=True)
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
            ids = [line for line in body.decode().splitlines() if line.startswith("id: ")]
            assert ids == ["id: 0", "id: 1", "id: 2"] and body.endswith(b"data: [DONE]\n\n"), body[-500:]
            # A JetStream stream answers before its consumer exists: the refusal is the stream's one
            # error event, naming the cause, then [DONE].
            assert {status for status, _ in refused} == {200}
            assert all(body.startswith('data: {"error":{"message":"the edge lost its subscription to request victim-')
                       and "cannot subscribe to results: " in body and "maximum consumers limit reached" in body
                       and body.endswith("data: [DONE]\n\n") for _, body in refused), refused[0]
            assert edge.metrics()["streamproc_edge_malformed_results_total"] == FLOOD

            def suppressed(event: str) -> bool:
                return f"event=log_suppressed suppressed_event={event} count={FLOOD - BURST}" in edge.log()

            # The rest is counted and reported when the interval is over, even though the flood stopped.
            await wait_until(lambda: suppressed("malformed_result") and suppressed("subscribe_failed"), 20,
                             "the suppressed counts reported")
            log = edge.log()
            assert log.count(" event=malformed_result") == BURST, log.count(" event=malformed_result")
            assert log.count(" event=subscribe_failed") == BURST, log.count(" event=subscribe_failed")
            assert edge.proc.poll() is None
            assert peak_rss(edge.proc.pid) < 150 * MiB


@pytest.mark.parametrize("separator", ["\x0b", "\x0c"])
async def test_ids_with_vt_or_ff_get_400_and_such_result_subjects_never_cost_the_edge_its_connection(
        server, separator):
    """VT and FF are one subject token to nats-server but separators to stock nats-py's parser. A
    request id holding one is refused with 400 (the id rule), and results published under such a
    subject in the edge's namespace, which the edge's ``--recent`` subscription to ``P.results.>``
    receives, leave its connection up: the stream open across the attack and one opened after it are
    answered in full."""
    from urllib.parse import quote

    from streamproc.wire import Result, Verdict, result_headers

    subjects = Subjects(prefix="vtff")  # apart from the module's other test (a results stream on streamproc.>)
    escaped = quote(separator)
    assert escaped in ("%0B", "%0C")
    with running_edge(server.url, "--prefix", subjects.prefix, "--recent", "100") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            for path in (f"/v1/results/a{escaped}b", f"/v1/results/{escaped}", f"/v1/results/ok{escaped}"):
                refused = await client.get(path)
                assert refused.status_code == 400, (path, refused.status_code, refused.text)
                assert refused.json()["error"]["type"] == "invalid_request", refused.text
            async with connection(server.url) as nc:
                before, after = rid("before"), rid("after")
                bodies = [b'{"text":"%d"}' % k for k in range(3)]
                async with client.stream("GET", f"/v1/results/{before}") as response:
                    assert response.status_code == 200
                    await publish_result(nc, subjects, before, 0, bodies[0])  # not final
                    for k in range(50):
                        # Not digits after the separator: stock nats-py would read ``evil<VT>7`` as subject
                        # ``evil`` and sid 7 (a reply-to form), not fail.
                        evil = f"evil{separator}x{k}"
                        await nc.publish(f"{subjects.prefix}.results.{evil}", b'{"text":"evil"}',
                                         headers=result_headers(Result(evil, 0, b'{"text":"evil"}', True,
                                                                       verdict=Verdict.PASSTHROUGH)))
                    await nc.flush()
                    for seq in (1, 2):
                        await publish_result(nc, subjects, before, seq, bodies[seq], final=seq == 2)
                    await nc.flush()
                    with anyio.fail_after(20):  # a dropped connection lost results 1-2: the stream never ends
                        body = await response.aread()
                assert body == expected_sse(bodies), body[-500:]
                async with client.stream("GET", f"/v1/results/{after}") as response:
                    assert response.status_code == 200
                    await publish_results(nc, subjects, after, bodies)
                    with anyio.fail_after(20):
                        assert await response.aread() == expected_sse(bodies)
        log = edge.log()
        assert "event=disconnected" not in log and "ProtocolError" not in log, log[-3000:]
        assert edge.proc.poll() is None
        assert peak_rss(edge.proc.pid) < 150 * MiB


@pytest.mark.timeout(180)
async def test_a_client_reading_a_long_stored_history_slowly_gets_all_of_it_within_its_buffer(nats_server):
    """A fresh-clone CI run (2026-12-04) saw an HTTP client reading a 48 MiB stored history at full
    speed lose its stream to an `overloaded` error with a 4 MiB --stream-buffer-bytes: the late
    attach's consumer pushed faster than the client read. A client slower than NATS (here, one that
    sleeps after each read) now gets every result in order, the edge pulling no more than its
    buffer holds (it paused a push consumer at the buffer before 2026-12-05); its memory stays
    within a few buffers."""
    subjects = Subjects("slowhistory")
    request_id = rid("slow-history")
    body = b'{"text":"' + b"x" * (128 * 1024 - 12) + b'"}'
    results = 96  # 12 MiB stored
    buffer = 1 * MiB
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--stream-buffer-bytes", str(buffer)) as edge:
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, request_id, [body] * results, flush_every=8)
        await anyio.sleep(1.0)
        baseline = peak_rss(edge.proc.pid)
        async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client, \
                client.stream("GET", f"/v1/results/{request_id}") as response:
            assert response.status_code == 200
            received = await read_slowly(response)  # slower than the stream delivers
        growth = peak_rss(edge.proc.pid) - baseline
        metrics = edge.metrics()
    assert received == expected_sse([body] * results), received[-300:]
    assert metrics["streamproc_edge_streams_overrun_total"] == 0
    assert metrics["streamproc_edge_replay_pauses_total"] == 0  # never sent more than the buffer holds
    assert growth < 8 * buffer + 24 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"


@pytest.mark.timeout(180)
async def test_slow_late_readers_of_a_long_stored_history_are_sent_it_about_once(nats_server):
    """What nats-server sends the edge for late attaches that read slower than NATS delivers. The
    replay read a history with a push consumer stopped at nats-py's drop (a pause): what the server
    had sent past it was thrown away and read again. Measured on 2026-12-05 with 400 x 64 KiB
    stored and two clients reading 64 KiB per 10 ms: 1.19-1.30 x the history at a 4 MiB
    --stream-buffer-bytes, 1.64-1.68 x at the 1 MiB minimum (1.94 x with 1,000 x 256 KiB). Its
    pulls now ask for the room left in the bound: each result is sent about once (1.00-1.01 x),
    nothing pauses, no consumer is left behind, and the edge holds the same few bounds."""
    subjects = Subjects("slowcost")
    request_id = rid("slow-cost")
    body = b'{"text":"' + b"x" * (64 * 1024 - 12) + b'"}'
    results, readers = 400, 2  # 25 MiB stored
    history = results * len(body)
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--stream-buffer-bytes", str(MiB)) as edge:
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, request_id, [body] * results, flush_every=8)
            js = nc.jetstream()
            stream = await find_stream(js, subjects.result(request_id))
            assert stream is not None
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= results, 15, "stored")
            consumers = (await js.stream_info(stream)).state.consumer_count  # the ring's
            _, sent_before = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
            baseline = peak_rss(edge.proc.pid)

            async def late_reader() -> bytes:
                async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client, \
                        client.stream("GET", f"/v1/results/{request_id}") as response:
                    assert response.status_code == 200
                    return await read_slowly(response)

            received = await asyncio.gather(*(late_reader() for _ in range(readers)))
            _, sent_after = sent_to_connection(nats_server.monitor_url, "streamproc-edge")
            growth = peak_rss(edge.proc.pid) - baseline
            metrics = edge.metrics()
            await consumers_back_to(js, stream, consumers)  # no temporary consumer left behind
    sent = sent_after - sent_before
    print(f"server sent the edge {sent / MiB:.0f} MiB for {readers} x {history / MiB:.0f} MiB "
          f"({sent / (readers * history):.2f} x), {metrics['streamproc_edge_replay_pauses_total']:.0f} pauses, "
          f"VmHWM +{growth / MiB:.0f} MiB")
    assert all(r == expected_sse([body] * results) for r in received)
    assert metrics["streamproc_edge_streams_overrun_total"] == 0
    assert metrics["streamproc_edge_replay_pauses_total"] == 0  # never sent more than its bound holds
    assert sent <= 1.1 * readers * history, f"{sent / (readers * history):.2f} x the history sent per reader"
    assert growth < 8 * MiB + 24 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("reader", ["ring", "own-consumer"])
async def test_a_client_reading_live_results_slowly_gets_all_of_them_within_its_buffer(nats_server, reader):
    """The live case (issue 11.4): results published faster than the client reads them, after it
    opened. Read through the ring's consumer, its inbox goes behind at the buffer; read through a
    consumer of its own (``--recent 0``), that consumer is stopped at the first result it drops.
    Either way the stream reads on from the results stream, so the client gets every result in
    order instead of an `overloaded` event, and the edge holds a few buffers, not the request."""
    subjects = Subjects("slowlive")
    request_id = rid(f"slow-live-{reader}")
    body = b'{"text":"' + b"x" * (128 * 1024 - 12) + b'"}'
    results = 96  # 12 MiB, published while the client reads
    buffer = 1 * MiB
    own = ("--recent", "0") if reader == "own-consumer" else ()
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--stream-buffer-bytes", str(buffer), *own) as edge:
        baseline = peak_rss(edge.proc.pid)
        async with connection(nats_server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=60) as client, \
                client.stream("GET", f"/v1/results/{request_id}") as response:
            assert response.status_code == 200
            await wait_until(lambda: edge.metrics()["streamproc_edge_jetstream_replays_total"] >= 1, 15, "opened")
            async with anyio.create_task_group() as tg:  # published while the client reads
                tg.start_soon(functools.partial(publish_results, nc, subjects, request_id, [body] * results,
                                                flush_every=8))
                received = await read_slowly(response)  # slower than the results come
        growth = peak_rss(edge.proc.pid) - baseline
        metrics = edge.metrics()
    assert received == expected_sse([body] * results), received[-300:]
    assert metrics["streamproc_edge_streams_overrun_total"] == 0
    assert metrics["streamproc_edge_streams_behind_total"] >= 1  # it did fall behind
    assert growth < 8 * buffer + 24 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"


# Messages no JetStream server sends, into the ring's inbox: (payload, headers, reply). nats-py 2.16
# reads a non-control message's reply as a $JS.ACK subject, a heartbeat's Nats-Last-Consumer as a
# number, and publishes an empty flow-control reply to a FlowControl request's reply and to a
# heartbeat's Nats-Consumer-Stalled value.
FORGED = {
    "non-ack reply": (b'{"forged":1}', None, "_INBOX.not.a.jetstream.ack"),
    "heartbeat, bad last consumer": (b"", {"Status": "100", "Description": "Idle Heartbeat",
                                           "Nats-Last-Consumer": "abc"}, None),
    "heartbeat, stalled at no subject": (b"", {"Status": "100", "Description": "Idle Heartbeat",
                                               "Nats-Consumer-Stalled": "not a subject"}, None),
    "heartbeat, stalled at a subject": (b"", {"Status": "100", "Description": "Idle Heartbeat",
                                              "Nats-Consumer-Stalled": "forged.reflected.stalled"}, None),
    "flow control to a subject": (b"", {"Status": "100", "Description": "FlowControl Request"},
                                  "forged.reflected.fc"),
    "flow control, short description": (b"", {"Status": "100", "Description": "Flow"}, "forged.reflected.flow"),
}
# nats-py strips a header name, so this one is sent as raw bytes (its publish refuses such a name)
SPACED_STALLED = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Consumer-Stalled : forged.reflected.spaced\r\n\r\n"


@pytest.mark.parametrize("stock", [False, True], ids=["fast-path", "stock-nats-py"])
async def test_messages_forged_into_the_results_rings_inbox_are_dropped_and_the_edge_reads_on(nats_url, stock):
    """The edge reads a results stream through one ordered consumer, pushed to an inbox. Of the
    FORGED messages (a client that may publish to inboxes, as request-reply responders may), the
    first three raised out of nats-py's read loop, which then stopped reading: the edge stayed
    "connected" and served nothing more, to any stream, without an error; the others made the edge
    publish to a subject of the sender's choosing, with the edge's permissions (nats/robust.py, the
    seventh). Now they are dropped, logged rate-limited, and the streams go on, on the fast path
    and on nats-py's own; a stored result that merely looks like one (empty, its id saying
    FlowControl) is delivered."""
    prefix = Subjects("forged")
    env = {fast_client.STOCK_CLIENT_ONLY_ENV: "1"} if stock else None
    async with connection(nats_url) as nc:
        reflected: list[str] = []

        async def on_reflected(msg) -> None:
            reflected.append(msg.subject)

        await nc.subscribe("forged.reflected.>", cb=on_reflected)
        with running_edge(nats_url, "--prefix", prefix.prefix, "--ensure-results-stream", env=env) as edge:
            js = nc.jetstream()
            consumers: list = []

            async def ring_found() -> bool:
                consumers[:] = [c for c in await js.consumers_info(RESULTS_STREAM) if c.config.deliver_subject]
                return bool(consumers)

            with anyio.fail_after(10):
                while not await ring_found():
                    await anyio.sleep(0.1)
            inbox = consumers[0].config.deliver_subject
            warm = rid("warm")  # one result through the ring first (nats-py's heartbeat check needs one)
            await publish_results(nc, prefix, warm, [b'{"text":"warm"}'])
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= 1, 10, "the warm result")
            for _ in range(FLOOD // len(FORGED)):
                for payload, headers, reply in FORGED.values():
                    await nc.publish(inbox, payload, reply=reply or "", headers=headers)
            await nc.flush()  # (the raw frame written now would go ahead of what nats-py has queued)
            nc._transport.write(b"HPUB %s %d %d\r\n%s\r\n" % (inbox.encode(), len(SPACED_STALLED),
                                                               len(SPACED_STALLED), SPACED_STALLED))
            await nc.flush()
            # What JetStream does send is not dropped: a result with an empty body, of a request whose
            # id (in its Nats-Msg-Id) says FlowControl (a first version of the fix dropped it, and the
            # ordered consumer was remade for it until the stream's 1,000 consumers were taken)
            legit = rid("legit-FlowControl")
            bodies = [b'{"text":"0"}', b"", b'{"text":"2"}']
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                async with anyio.create_task_group() as tg:
                    async def publish_later() -> None:
                        await anyio.sleep(0.5)
                        await publish_results(nc, prefix, legit, bodies)

                    tg.start_soon(publish_later)
                    with anyio.fail_after(15):
                        response = await client.get(f"/v1/results/{legit}")
                assert response.status_code == 200 and response.content == expected_sse(bodies), response.text[-500:]
            await nc.flush()
            log = edge.log()
            counted = edge.metrics()["streamproc_edge_nats_foreign_messages_total"]
    assert counted == FLOOD // len(FORGED) * len(FORGED) + 1, counted  # each forged one, the spaced one too
    dropped = log.count("event=foreign_message_dropped")
    assert 1 <= dropped <= BURST, dropped  # the first ones, then one count of the rest per interval
    assert "Traceback" not in log and "encountered error" not in log, log[-2000:]
    assert reflected == []


async def test_error_kinds_a_results_publisher_chose_share_one_metric_label(nats_url):
    """The edge labels error results sent by their kind (``Streamproc-Error``): the publisher's text.
    One that may publish results (forged, or a newer processor) named 60 kinds and /metrics kept a
    label for each, for good. Now a kind this edge does not know is counted under ``other``."""
    kinds = [f"forged-kind-{k}" for k in range(60)] + ["timeout"]
    ids = [rid(f"kind{k}") for k in range(len(kinds))]
    with running_edge(nats_url, "--ensure-results-stream") as edge:
        async with connection(nats_url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            for request_id, kind in zip(ids, kinds):
                await publish_result(nc, SUBJECTS, request_id, 0, b'{"error":{"message":"x"}}', final=True,
                                     verdict=None, error=kind, acked=True)
            for request_id in ids:
                response = await client.get(f"/v1/results/{request_id}")
                assert response.status_code == 200 and b"[DONE]" in response.content, response.text
            metrics = edge.metrics()
    labels = {name: n for name, n in metrics.items() if name.startswith("streamproc_edge_error_results_total")}
    assert labels == {'streamproc_edge_error_results_total{kind="other"}': 60,
                      'streamproc_edge_error_results_total{kind="timeout"}': 1}, labels



async def test_a_result_with_more_header_lines_than_a_message_may_carry_is_malformed_live_or_stored(nats_url):
    """Whoever may publish results chooses their header blocks; each line costs the edge's reader a
    Python step (~110 ms for the ~95,000 that fit in ``max_payload``). A block of more than
    ``MAX_HEADER_LINES`` lines is not parsed: the result reads as unreadable, is counted as malformed
    and never reaches a client, whether the edge reads it stored (an open after it was published) or
    live; the real result of that seq, after it, is served."""
    forged = {"Streamproc-Seq": "1", "Streamproc-Final": "true",
              **{f"X-{i}": "v" for i in range(MAX_HEADER_LINES)}}
    bodies = [b'{"text":"0"}', b'{"text":"1"}']

    async def publish(nc, request_id: str) -> None:
        await publish_result(nc, SUBJECTS, request_id, 0, bodies[0], acked=True)
        await nc.jetstream().publish(SUBJECTS.result(request_id), b'{"text":"forged"}', headers=forged)
        await publish_result(nc, SUBJECTS, request_id, 1, bodies[1], final=True, acked=True)

    stored, live = rid("stored"), rid("live")
    with running_edge(nats_url, "--ensure-results-stream", "--recent", "0") as edge:
        async with connection(nats_url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            await publish(nc, stored)
            assert (await client.get(f"/v1/results/{stored}")).content == expected_sse(bodies)
            async with client.stream("GET", f"/v1/results/{live}") as response:
                await wait_until(lambda: edge.metrics()["streamproc_edge_jetstream_replays_total"] == 2, 10,
                                 "the live stream attached")
                await publish(nc, live)
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
            assert body == expected_sse(bodies), body
            assert edge.metrics()["streamproc_edge_malformed_results_total"] == 2
            assert edge.log().count("more than the %d a header block may hold" % MAX_HEADER_LINES) == 2, edge.log()[-2000:]


@pytest.mark.parametrize("error", ["kaputt \u20ac", "x" * 60_000, "\U0001F600" + "a" * 50],
                         ids=["non-latin-1", "60KB", "astral"])
async def test_an_error_kind_a_results_publisher_chose_is_never_echoed_whole(edge, nc, error):
    """A result's ``Streamproc-Error`` is its publisher's text. The unary answer put it whole in an
    HTTP header: one that is not latin-1 made it a bare 500 (Starlette's encode), a 60 KB one a
    60 KB response header; the SSE meta frame and /v1/recent carried it whole too (found by a
    reviewer). Now each shows a kind of this version or ``other``."""
    rid = f"errhdr-{len(error)}"
    body = b'{"error": {"message": "m"}}'
    await publish_result(nc, SUBJECTS, rid, 0, body, final=True, verdict=None, error=error, acked=True)
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
        unary = await client.get(f"/v1/results/{rid}?stream=false")
        streamed = await client.get(f"/v1/results/{rid}?verdicts=1")
        recent = (await client.get("/v1/recent")).json()
    assert unary.content == body and unary.headers["streamproc-error"] == "other", unary.status_code  # a kind-shaped word passes (test_edge_unary)
    assert b'"error":"other"' in streamed.content and error.encode() not in streamed.content
    entry = next(e for e in recent if e["request_id"] == rid)
    assert entry["error"] == "other", entry


async def test_a_long_path_request_id_or_last_event_id_is_echoed_cut_in_the_400_and_the_access_log(edge):
    """A client chooses the length of a request's path and headers up to ``--max-head-bytes`` (64 KiB).
    The 400 for an invalid request id repeated the whole id (and a bad ``Last-Event-ID`` the whole
    header), and Uvicorn's access log the whole path: a 3,000-character path made a 4,158-character
    log line (found by a reviewer). Each is now cut as the processor cuts a worker's value
    (``errors.shown``: its first 64 characters and its length); the access log keeps a path as long
    as any the edge serves whole, with its ``access_token`` redacted before it is cut."""
    long_id, long_path = "i" * 3000, "/v1/nothing/" + "p" * 3000
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
        too_long = await client.get(f"/v1/results/{long_id}")
        dotted = await client.get(f"/v1/results/x.{long_id}")
        resumed = await client.get(f"/v1/results/{rid('long-leid')}", headers={"Last-Event-ID": "e" * 3000})
        missing = await client.get(long_path, params={"access_token": "tok.sec.ret"})
        ordinary = await client.get("/healthz", params={"verdicts": "1", "access_token": "tok.sec.ret"})
    for refused, value in ((too_long, long_id), (dotted, f"x.{long_id}"), (resumed, "e" * 3000)):
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert f"... ({len(value)} characters)" in message and value[:65] not in message, message[:300]
        assert len(refused.content) < 1000, len(refused.content)
    assert missing.status_code == 404 and ordinary.status_code == 200
    with anyio.fail_after(5):
        while "(3036 characters)" not in edge.log() or "/healthz?verdicts=1" not in edge.log():
            await anyio.sleep(0.05)
    lines = [line for line in edge.log().splitlines() if "event=http_request" in line]
    assert max(map(len, lines)) < 1200, max(map(len, lines))
    [cut] = [line for line in lines if "(3036 characters)" in line]  # the path, its token <redacted>
    assert '"\'/v1/nothing/ppp' in cut and "p" * 65 not in cut and "tok.sec.ret" not in cut, cut
    [whole] = [line for line in lines if "/healthz?" in line]
    assert 'path="/healthz?verdicts=1&access_token=<redacted>"' in whole, whole  # short paths: as they were


async def test_forwarded_headers_from_a_loopback_client_neither_change_its_address_nor_its_stream_share(
        nats_server):
    """Uvicorn's ``proxy_headers`` (on by default, trusting ``FORWARDED_ALLOW_IPS``, 127.0.0.1,::1 unless
    set) took the client's address from ``X-Forwarded-For`` when the peer was loopback: a client on the
    edge's host opened 6 streams with ``--max-streams-per-client 2`` under --insecure-demo, one per
    address it named, and wrote any address into the access log's ``client=`` in every mode. The edge
    names no trusted proxy (docs/edge.md: clients behind one proxy share one share), so it reads none."""
    # its own server: the module's has a results stream whose consumers an earlier test used up
    with running_edge(nats_server.url, "--max-streams-per-client", "2", env={"FORWARDED_ALLOW_IPS": "*"}) as edge:
        statuses = []
        async with anyio.create_task_group() as tasks, httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            async def open_stream(i: int, opened: anyio.Event) -> None:
                headers = {"X-Forwarded-For": f"10.9.8.{i}", "Forwarded": f"for=10.9.7.{i}"}
                async with client.stream("GET", f"/v1/results/{rid('xff')}", headers=headers) as response:
                    statuses.append(response.status_code)
                    opened.set()
                    if response.status_code == 200:
                        await anyio.sleep_forever()
            for i in range(6):
                opened = anyio.Event()
                tasks.start_soon(open_stream, i, opened)
                with anyio.fail_after(10):
                    await opened.wait()
            tasks.cancel_scope.cancel()
        assert sorted(statuses) == [200, 200, 429, 429, 429, 429], statuses
        with anyio.fail_after(5):
            while (lines := [line for line in edge.log().splitlines() if "/v1/results/" in line]) == []:
                await anyio.sleep(0.05)
    assert not any("client=10.9." in line for line in lines), lines[-3:]


async def test_a_named_proxy_forwards_its_clients_addresses_and_no_other_peer_does(nats_server):
    """Behind a reverse proxy every client's connection is the proxy's: with --insecure-demo they all
    shared one --max-streams-per-client share and the access log named only the proxy, and since the
    edge reads no ``X-Forwarded-For`` (the test above) an operator could not say otherwise.
    ``--forwarded-allow-ips`` names the proxies whose ``X-Forwarded-For`` is the client's address."""
    with running_edge(nats_server.url, "--max-streams-per-client", "2", "--forwarded-allow-ips", "127.0.0.1,::1",
                      env={"FORWARDED_ALLOW_IPS": ""}) as edge:
        statuses: dict[str, list[int]] = {}
        async with anyio.create_task_group() as tasks, httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            async def open_stream(address: str, opened: anyio.Event) -> None:
                headers = {"X-Forwarded-For": f"198.51.100.9, {address}"}  # the proxy's appended hop is the client
                async with client.stream("GET", f"/v1/results/{rid('proxied')}", headers=headers) as response:
                    statuses.setdefault(address, []).append(response.status_code)
                    opened.set()
                    if response.status_code == 200:
                        await anyio.sleep_forever()
            for address in ["10.9.8.1", "10.9.8.2", "10.9.8.3"] * 2 + ["10.9.8.1"]:
                opened = anyio.Event()
                tasks.start_soon(open_stream, address, opened)
                with anyio.fail_after(10):
                    await opened.wait()
            tasks.cancel_scope.cancel()
        with anyio.fail_after(5):
            while len(lines := [line for line in edge.log().splitlines() if "/v1/results/" in line]) < 7:
                await anyio.sleep(0.05)
    assert statuses == {"10.9.8.1": [200, 200, 429], "10.9.8.2": [200, 200], "10.9.8.3": [200, 200]}, statuses
    assert all("client=10.9.8." in line for line in lines), lines[-3:]
    assert not any("198.51.100.9" in line for line in lines), lines[-3:]  # a hop the client wrote itself


async def test_an_address_forged_behind_a_named_proxy_is_written_cut_into_the_access_log(nats_server):
    """Behind a proxy ``--forwarded-allow-ips`` names, the client address is the first hop of
    ``X-Forwarded-For`` from the right that is not a named proxy: a value the client wrote itself
    when its own address is trusted too (a proxy network that holds clients), or a proxy passes the
    header on. Uvicorn keeps any string there, and the access log wrote it whole: a 60,000-character
    hop made a 60,142-character line per request (the path beside it is cut at 1,024 characters).
    It is cut as every hostile value is (``errors.shown``); quotes and ``key=value`` text stay one
    quoted field, and the next client is answered with its own address."""
    forged = {"long": "A" * 60_000, "fields": '1.2.3.4" status=500 level=error x="y',
              "hops": ", ".join(f"10.0.0.{i % 250}" for i in range(5000))}
    with running_edge(nats_server.url, "--forwarded-allow-ips", "127.0.0.1,::1") as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            for name, value in forged.items():
                answer = await client.get("/healthz", params={"forged": name}, headers={"X-Forwarded-For": value})
                assert answer.status_code == 200, (name, answer.status_code)
            ordinary = await client.get("/healthz", params={"forged": "none"},
                                        headers={"X-Forwarded-For": "198.51.100.7"})
            assert ordinary.status_code == 200
        with anyio.fail_after(5):
            while "forged=none" not in edge.log():
                await anyio.sleep(0.05)
        lines = {line.partition("forged=")[2].partition(" ")[0].strip('"'): line
                 for line in edge.log().splitlines() if "event=http_request" in line and "forged=" in line}
        assert edge.proc.poll() is None
        assert peak_rss(edge.proc.pid) < 150 * MiB
    assert max(map(len, lines.values())) < 600, {name: len(line) for name, line in lines.items()}
    assert "(60002 characters)" in lines["long"] and "A" * 65 not in lines["long"], lines["long"]
    import shlex
    fields = dict(field.partition("=")[::2] for field in shlex.split(lines["fields"]))  # logfmt's quoting
    assert fields["client"] == forged["fields"] + ":0", fields  # one quoted field: its status= and level= inert
    assert fields["status"] == "200" and fields["level"] == "info", fields
    assert "client=10.0.0.249:0 " in lines["hops"], lines["hops"]  # the last hop before the named proxy
    assert "client=198.51.100.7:0 " in lines["none"], lines["none"]


# Request heads llhttp refuses: each answered 400 by Uvicorn before the app sees it.
MALFORMED_HEADS = {
    "obs-fold": b"GET /v1/results/x HTTP/1.1\r\nHost: e\r\nAuthorization: Bearer\r\n a.b.c\r\n\r\n",
    "NUL in a value": b"GET /v1/results/x HTTP/1.1\r\nHost: e\r\nLast-Event-ID: 1\x002\r\n\r\n",
    "non-ASCII name": b"GET /v1/results/x HTTP/1.1\r\nHost: e\r\nX-\xe9: 1\r\n\r\n",
    "raw non-ASCII path": "GET /v1/results/a\u2603 HTTP/1.1\r\nHost: e\r\n\r\n".encode(),
    "negative Content-Length": b"POST /v1/experts HTTP/1.1\r\nHost: e\r\nContent-Length: -1\r\n\r\n",
    "Content-Length and chunked": b"POST /v1/experts HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "control byte in the method": b"G\x01T /healthz HTTP/1.1\r\nHost: e\r\n\r\n",
}


async def test_malformed_request_heads_get_a_400_each_and_a_limited_log_while_a_stream_flows(edge, nc):
    """Obs-fold, a NUL in a value, a non-ASCII header name or path, a bad Content-Length: llhttp refuses
    each head and Uvicorn answers ``400 Invalid HTTP request received.``, no traceback. But Uvicorn also
    logged a WARNING line for each (``msg="Invalid HTTP request received."``): any client that can reach
    the port, no token needed, wrote ~1,200 lines a second, past the LogLimiter that bounds every other
    line one request can cause (docs/edge.md, Limits). Now ``invalid_http_request`` (with the peer)
    is limited: 20 lines per 10 s, the rest counted. A stream open meanwhile gets all its results."""
    request_id = rid("malformed-heads")
    bodies = [b'{"text":"%d"}' % i for i in range(3)]
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        async with client.stream("GET", f"/v1/results/{request_id}") as stream:
            assert stream.status_code == 200
            await publish_result(nc, SUBJECTS, request_id, 0, bodies[0])
            for name, head in MALFORMED_HEADS.items():
                answer = await anyio.to_thread.run_sync(exchange_until_closed, edge.port, head)
                assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), (name, answer)
                assert answer.endswith(b"\r\n\r\nInvalid HTTP request received."), (name, answer)
            heads = list(MALFORMED_HEADS.values())
            for i in range(FLOOD - len(heads)):
                await anyio.to_thread.run_sync(exchange_until_closed, edge.port, heads[i % len(heads)])
            for seq in (1, 2):
                await publish_result(nc, SUBJECTS, request_id, seq, bodies[seq], final=seq == 2)
            assert await stream.aread() == expected_sse(bodies)
    log = edge.log()
    assert "Traceback" not in log
    lines = [line for line in log.splitlines() if "event=invalid_http_request" in line]
    assert len(lines) == BURST, (len(lines), lines[:3])
    assert "level=warning" in lines[0] and "client=127.0.0.1:" in lines[0], lines[0]
    assert log.count('msg="Invalid HTTP request received."') == 0


async def test_refused_request_heads_are_counted_in_the_metrics_past_the_log_limit(edge):
    """``invalid_http_request`` lines are limited (BURST per 10 s), and no metric counted refused heads:
    past the burst a client's flood of them was invisible but for one ``log_suppressed`` count. Each is
    ``streamproc_edge_invalid_http_requests_total`` now, a well-formed request not."""
    before = edge.metrics()["streamproc_edge_invalid_http_requests_total"]
    heads = list(MALFORMED_HEADS.values())
    sent = BURST + 2 * len(heads)
    for i in range(sent):
        answer = await anyio.to_thread.run_sync(exchange_until_closed, edge.port, heads[i % len(heads)])
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer
    fine = await anyio.to_thread.run_sync(exchange_until_closed, edge.port,
                                          b"GET /healthz HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n")
    assert fine.startswith(b"HTTP/1.1 200 "), fine
    assert edge.metrics()["streamproc_edge_invalid_http_requests_total"] - before == sent


async def test_garbage_sent_on_a_streaming_connection_ends_it_without_a_400_inside_the_sse_body(edge, nc):
    """Bytes llhttp refuses, sent on the connection of a running SSE stream, made Uvicorn write its
    ``400 Invalid HTTP request received.`` response at once: into the stream's chunked body, where the
    client read HTTP bytes as events. Now no second response is written inside a body in progress: the
    stream ends (its body cut after whole chunks), the connection closes, the refusal is counted and
    logged, and a stream on another connection gets all its results."""
    victim, bystander = rid("garbage-victim"), rid("garbage-bystander")
    bodies = [b'{"text":"%d"}' % i for i in range(3)]
    before = edge.metrics()
    other = await RawStream.open(edge.port, bystander)
    stream = await RawStream.open(edge.port, victim)
    try:
        await publish_result(nc, SUBJECTS, victim, 0, bodies[0])
        await publish_result(nc, SUBJECTS, bystander, 0, bodies[0])
        await stream.read_until(b"data: " + bodies[0])
        head, _, _ = stream.data.partition(b"\r\n\r\n")
        await asyncio.get_running_loop().sock_sendall(stream.sock, b"\x01\x02 not http\r\n\r\n")
        data = await stream.read_to_close()
        for seq in (1, 2):
            await publish_result(nc, SUBJECTS, bystander, seq, bodies[seq], final=seq == 2)
        await other.read_until(b"data: [DONE]\n\n")
    finally:
        stream.close()
        other.close()
    body = data.partition(b"\r\n\r\n")[2]
    assert b"HTTP/1.1" not in body and b"Invalid HTTP request" not in body, data
    assert b"transfer-encoding: chunked" in head.lower(), head
    events = b""  # the body's chunks, each whole
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        assert rest[n:n + 2] == b"\r\n", body
        events, body = events + rest[:n], rest[n + 2:]
    assert events.startswith(expected_sse(bodies[:1])[:-len(b"data: [DONE]\n\n")]), events
    assert b"[DONE]" not in events, events
    assert other.data.partition(b"\r\n\r\n")[2].count(b"data: ") == 4, other.data
    await wait_until(lambda: edge.metrics()["streamproc_edge_streams_active"] == before["streamproc_edge_streams_active"],
                     10, "the victim's stream ended")
    after = edge.metrics()
    assert after["streamproc_edge_invalid_http_requests_total"] - before["streamproc_edge_invalid_http_requests_total"] == 1
    log = edge.log()
    assert "event=invalid_http_request" in log and "Traceback" not in log


@pytest.mark.parametrize("between", [b"GET /healthz HTTP/1.1\r\nHost: e\r\n\r\n", b""],
                         ids=["a-request-pipelined-between", "nothing-between"])
async def test_garbage_behind_an_unanswered_request_closes_the_connection_without_a_400_read_as_its_answer(
        edge, nc, between):
    """A unary read waiting for its result, ``between`` pipelined behind it, then bytes llhttp refuses:
    Uvicorn wrote its ``400`` at once, which the client reads as the answer to its first request (the
    edge's 408/431 are not written there). Responses go out in order, so the connection is closed
    unanswered instead; the refusal is counted."""
    request_id = rid("garbage-behind-unanswered")
    before = edge.metrics()["streamproc_edge_invalid_http_requests_total"]
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", edge.port))
    stream = RawStream(sock)
    try:
        head = f"GET /v1/results/{request_id}?stream=false HTTP/1.1\r\nHost: e\r\n\r\n".encode()
        await loop.sock_sendall(sock, head + between)
        await anyio.sleep(0.3)  # the heads parsed, the first request waiting for its result
        await loop.sock_sendall(sock, b"\x01\x02 not http\r\n\r\n")
        data = await stream.read_to_close()
    finally:
        stream.close()
    assert data == b"", data
    assert edge.metrics()["streamproc_edge_invalid_http_requests_total"] - before == 1


async def test_a_streaming_connection_closed_for_garbage_whose_client_reads_nothing_is_aborted_after_the_write_timeout(
        server, nc):
    """Garbage behind a running SSE stream closes its connection (its stream told the client left). A
    client that also reads nothing had the answer's last bytes in the edge's transport, under the
    high-water mark (no pause, so no --write-timeout check armed): the closing connection waited for it
    for good, holding its --max-connections slot. It is aborted when its client takes nothing of them
    for --write-timeout."""
    request_id = rid("garbage-unread")
    with running_edge(server.url, "--write-timeout", "1") as edge:
        loop = asyncio.get_running_loop()
        sock = await unread_stream(edge.port, request_id)
        try:
            await fill_send_queue(nc, SUBJECTS, request_id, edge.port, sock)
            before = edge.metrics()["streamproc_edge_connections_open"]
            await loop.sock_sendall(sock, b"\x01\x02 not http\r\n\r\n")
            await wait_until(lambda: edge.metrics()["streamproc_edge_connections_open"] == before - 1, 10,
                             "the unread connection aborted")
        finally:
            sock.close()


async def test_a_keep_alive_timeout_close_after_an_answer_the_client_never_read_is_aborted_after_the_write_timeout(
        server, nc):
    """Uvicorn closes a keep-alive connection idle after its response (5 s): asyncio's close waits
    for the transport's buffer to drain. A client that read nothing of a finished stream, its last
    bytes in the edge under the high-water mark (no --write-timeout check armed), held the connection
    and its only --max-connections slot for good. It is aborted --write-timeout after the close."""
    request_id = rid("keepalive-unread")
    with running_edge(server.url, "--write-timeout", "1", "--max-connections", "1",
                      "--head-timeout", "60") as edge:  # Uvicorn's keep-alive timeout (5 s) closes first
        await wait_until(lambda: slot_answers(edge.port), 5, "the readiness check's connection gone")
        sock = await unread_stream(edge.port, request_id)
        try:
            seq = await fill_send_queue(nc, SUBJECTS, request_id, edge.port, sock)
            await publish_result(nc, SUBJECTS, request_id, seq, b'{"text":"end"}', final=True)  # stream ends
            ended = time.monotonic()
            await wait_until(lambda: slot_answers(edge.port), 5 + 1 + 4, "the slot free again")
            assert time.monotonic() - ended > 4, "closed before the keep-alive timeout"  # it was that close
        finally:
            sock.close()
        assert edge.metrics()["streamproc_edge_connections_stalled_total"] == 1


async def test_a_connection_closed_for_a_head_too_large_behind_a_stream_its_client_never_read_is_aborted(server, nc):
    """A head over --max-head-bytes pipelined behind a running stream closes the connection
    unanswered (close_with: a 431 would land inside the stream's body). A client that read nothing
    of the stream, its last bytes in the edge under the high-water mark, held the closing connection
    and its only --max-connections slot for good. It is aborted --write-timeout after the close."""
    request_id = rid("431-unread")
    with running_edge(server.url, "--write-timeout", "1", "--max-connections", "1",
                      "--max-head-bytes", "4096") as edge:
        loop = asyncio.get_running_loop()
        await wait_until(lambda: slot_answers(edge.port), 5, "the readiness check's connection gone")
        sock = await unread_stream(edge.port, request_id)
        try:
            await fill_send_queue(nc, SUBJECTS, request_id, edge.port, sock)
            await loop.sock_sendall(sock, b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * 8192)
            await wait_until(lambda: slot_answers(edge.port), 1 + 4, "the slot free again")
        finally:
            sock.close()
        assert edge.metrics()["streamproc_edge_connections_stalled_total"] == 1


async def test_a_connection_close_stream_its_client_never_read_is_aborted_after_the_write_timeout(server, nc):
    """A stream asked for with ``Connection: close`` is closed by Uvicorn at its end; a client that read
    none of it, its last bytes in the edge under the high-water mark, held the closing connection and
    its only --max-connections slot for good. It is aborted --write-timeout after the close."""
    request_id = rid("close-unread")
    with running_edge(server.url, "--write-timeout", "1", "--max-connections", "1") as edge:
        await wait_until(lambda: slot_answers(edge.port), 5, "the readiness check's connection gone")
        sock = await unread_stream(edge.port, request_id, "Connection: close\r\n")
        try:
            seq = await fill_send_queue(nc, SUBJECTS, request_id, edge.port, sock)
            await publish_result(nc, SUBJECTS, request_id, seq, b'{"text":"end"}', final=True)  # stream ends
            await wait_until(lambda: slot_answers(edge.port), 1 + 4, "the slot free again")
        finally:
            sock.close()
        assert edge.metrics()["streamproc_edge_connections_stalled_total"] == 1
