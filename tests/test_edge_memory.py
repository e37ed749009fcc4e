"""Bounded edge memory (issue 11, item 4): slow or greedy clients cannot make the edge hold results.

Before: a reader that never reads made the edge buffer up to nats-py's 128 MiB pending limit per
stream, and a unary request accumulated a whole stream. Now each stream holds at most
``--stream-buffer-bytes`` (past it the stream is ended with an error event, and a write that blocks
for ``--write-timeout`` closes it), a unary answer at most ``--max-unary-bytes``. Real edge
subprocess, real nats-server, raw sockets that never read; RSS and VmHWM from /proc/<pid>/status.
The slow-reader rounds run in core mode and in JetStream mode (a results stream, ordered consumers).

RSS returns within 20 MiB of its baseline after the readers leave: what kept it up was the
results nats-py still queued for the unsubscribed slow streams, alive in reference cycles until a
full GC (pending.drop frees them at unsubscribe).
"""

from __future__ import annotations

import asyncio
import time

import anyio
import httpx
import msgspec
import pytest
from edge_harness import expected_sse, publish_result, publish_results, running_edge, slow_reader, unread_stream
from helpers import connection, rid, status_kib

from streamproc.wire import Subjects

pytestmark = [pytest.mark.nats]

MiB = 1024 * 1024
BODY = b'{"text":"' + b"x" * (64 * 1024 - 12) + b'"}'  # 64 KiB results
READERS = 16  # slow readers per round
RESULTS_PER_READER = 64  # 4 MiB published per reader and round (4 x its buffer): 64 MiB per round
BUFFER = 1 * MiB  # --stream-buffer-bytes under test


def subscriptions(edge) -> float:
    m = edge.metrics()
    return m["streamproc_edge_core_subscriptions_total"] + m["streamproc_edge_jetstream_replays_total"]


async def wait_for(predicate, timeout: float, what: str) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.1)


class Rounds(msgspec.Struct):
    baseline: int  # KiB
    after: int
    peak: int
    ended: float
    nats_disconnects: float
    results_seen: float  # by the recent ring


@pytest.fixture(scope="module")
def slow_reader_rounds(server) -> Rounds:
    """Three rounds of READERS clients that never read, in core mode, a legitimate client answered
    before, during and after each round; RSS and VmHWM of the edge process."""
    return anyio.run(_slow_reader_rounds, server, "core")


@pytest.fixture(scope="module")
def jetstream_slow_reader_rounds(server) -> Rounds:
    """The same rounds in JetStream mode: a results stream stores every result, and the readers'
    results come from the recent ring's ordered consumer; a reader past its buffer goes behind
    (it would read on from the stream) and, never reading, stalls on its write."""
    return anyio.run(_slow_reader_rounds, server, "jetstream")


async def _slow_reader_rounds(server, mode: str) -> Rounds:
    prefix = "memcore" if mode == "core" else "memjs"
    subjects = Subjects(prefix)
    args = ["--prefix", prefix, "--stream-buffer-bytes", str(BUFFER), "--write-timeout", "2",
            "--max-streams-per-client", "1000"]
    if mode == "jetstream":
        args.append("--ensure-results-stream")
    with running_edge(server.url, *args) as edge:
        pid = edge.proc.pid
        async with connection(server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            async def legitimate(tag: str) -> None:
                """A client that attaches first (core mode sees only later results), then is answered."""
                request_id = rid(f"legit-{tag}")
                subscribed = subscriptions(edge)

                async def publish() -> None:
                    await wait_for(lambda: subscriptions(edge) > subscribed, 15, "legitimate client subscribed")
                    await anyio.sleep(0.05)  # counted just before the subscription reaches the server
                    await publish_results(nc, subjects, request_id, [b'{"text":"a"}', b'{"text":"ab"}'])

                async with anyio.create_task_group() as tg:
                    tg.start_soon(publish)
                    response = await client.get(f"/v1/results/{request_id}")
                    tg.cancel_scope.cancel()
                assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n"), (
                    response.text, edge.log()[-3000:])

            await legitimate("warm-up")
            baseline = status_kib(pid, "VmRSS")
            for round_ in range(3):
                ids = [rid(f"slow{round_}") for _ in range(READERS)]
                subscribed = subscriptions(edge)
                readers = [slow_reader(edge.url, request_id) for request_id in ids]
                await wait_for(lambda: subscriptions(edge) >= subscribed + READERS, 15, "slow readers subscribed")
                await anyio.sleep(0.1)  # counted just before the last subscription reaches the server
                for seq in range(RESULTS_PER_READER):
                    for request_id in ids:
                        await publish_result(nc, subjects, request_id, seq, BODY,
                                             final=seq == RESULTS_PER_READER - 1)
                    await nc.flush()  # paced by a round trip per 1 MiB: slow readers, not a NATS flood
                await legitimate(f"during-{round_}")  # answered while the slow readers are stuck
                # Each slow stream overran its buffer or stalled on a write: the edge closed it.
                await wait_for(lambda: edge.metrics()["streamproc_edge_streams_active"] == 0, 30,
                               "slow streams closed by the edge")
                for sock in readers:
                    sock.close()
            await legitimate("after")
            await anyio.sleep(3.0)  # the edge trims its heap every 2 s after streams closed (edge/heap.py)
            after = status_kib(pid, "VmRSS")
            peak = status_kib(pid, "VmHWM")
            m = edge.metrics()
    ended = m["streamproc_edge_streams_overrun_total"] + m["streamproc_edge_streams_stalled_total"]
    published = 3 * READERS * RESULTS_PER_READER * len(BODY) // MiB
    print(f"\n{mode}: RSS baseline {baseline / 1024:.1f} MiB, after 3 rounds {after / 1024:.1f} MiB, "
          f"VmHWM {peak / 1024:.1f} MiB; {published} MiB published to {3 * READERS} readers that never read; "
          f"overrun {m['streamproc_edge_streams_overrun_total']:.0f}, "
          f"stalled {m['streamproc_edge_streams_stalled_total']:.0f}, NATS disconnects "
          f"{m['streamproc_edge_nats_disconnects_total']:.0f}, results seen by the recent ring "
          f"{m['streamproc_edge_results_seen_total']:.0f}")
    return Rounds(baseline, after, peak, ended, m["streamproc_edge_nats_disconnects_total"],
                  m["streamproc_edge_results_seen_total"])


def test_slow_readers_are_ended_while_others_are_answered_and_peak_memory_is_bounded(slow_reader_rounds):
    r = slow_reader_rounds
    assert r.ended >= 3 * READERS  # every slow stream was ended (overrun or stalled write), none lingers
    # Stated bound: 4 MiB per slow stream (its 1 MiB buffer, frames in flight, Uvicorn's 64 KiB
    # write buffer) + 20 MiB. Measured ~+56 MiB for 16 streams. Before: nats-py's 128 MiB pending
    # limit per stream and SeqOrder's 4096 results allowed every byte published to stay.
    assert r.peak - r.baseline <= (READERS * 4 * MiB + 20 * MiB) // 1024, (r.baseline, r.peak)


def test_edge_rss_returns_within_20_mib_of_baseline_after_three_rounds(slow_reader_rounds):
    r = slow_reader_rounds
    assert r.after - r.baseline <= 20 * 1024, (r.baseline, r.after)


def test_jetstream_slow_readers_are_ended_while_others_are_answered_and_peak_memory_is_bounded(
        jetstream_slow_reader_rounds):
    """JetStream mode: before, a dropped result made the reader's ordered consumer recreate itself
    for every later message, and the recent ring read every body a second time, so under the same
    rounds nats-server dropped the edge's connection as a slow consumer (64 MiB pending) and the
    legitimate client got 503 (its consumer lookup timed out). The legitimate client being answered
    in every round is asserted inside the fixture."""
    r = jetstream_slow_reader_rounds
    assert r.ended >= 3 * READERS
    assert r.nats_disconnects == 0  # the edge kept up: nats-server never cut it off
    # The headers-only ring still saw every result: 3 rounds x READERS x RESULTS_PER_READER + 5 legitimate x 2
    assert r.results_seen == 3 * READERS * RESULTS_PER_READER + 5 * 2, r.results_seen
    # Same stated bound as core mode: 4 MiB per slow stream + 20 MiB.
    assert r.peak - r.baseline <= (READERS * 4 * MiB + 20 * MiB) // 1024, (r.baseline, r.peak)


def test_jetstream_edge_rss_returns_within_20_mib_of_baseline_after_three_rounds(jetstream_slow_reader_rounds):
    r = jetstream_slow_reader_rounds
    assert r.after - r.baseline <= 20 * 1024, (r.baseline, r.after)


@pytest.mark.anyio
async def test_a_unary_answer_past_max_unary_bytes_is_refused_with_a_clear_error(server):
    with running_edge(server.url, "--prefix", "memunary", "--max-unary-bytes", str(256 * 1024)) as edge:
        subjects = Subjects("memunary")
        request_id = rid("big-unary")
        async with connection(server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            async with anyio.create_task_group() as tg:
                answer: list[httpx.Response] = []

                async def ask() -> None:
                    answer.append(await client.get(f"/v1/results/{request_id}?stream=false"))

                tg.start_soon(ask)
                await wait_for(lambda: edge.metrics()["streamproc_edge_streams_active"] == 1, 15, "subscribed")
                await publish_results(nc, subjects, request_id, [BODY] * 8)  # 512 KiB in all
        [response] = answer
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["type"] == "too_large" and "--max-unary-bytes" in error["message"]
        assert "text/event-stream" in error["message"]
        assert edge.metrics()["streamproc_edge_unary_too_large_total"] == 1
        small = rid("small-unary")
        async with connection(server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: publish_later(nc, subjects, small))
                ok = await client.get(f"/v1/results/{small}?stream=false")
        assert ok.status_code == 200 and ok.content == BODY


async def publish_later(nc, subjects: Subjects, request_id: str) -> None:
    await anyio.sleep(0.5)
    await publish_results(nc, subjects, request_id, [BODY])


@pytest.mark.anyio
async def test_results_piling_up_behind_a_missing_seq_end_the_stream_at_the_buffer_bound(server):
    """Before, up to 4096 results (SeqOrder) waited for a missing seq until --gap-timeout: 256 MiB
    of 64 KiB bodies per stream. Now past --stream-buffer-bytes the stream ends at once."""
    subjects = Subjects("memgap")
    with running_edge(server.url, "--prefix", "memgap", "--stream-buffer-bytes", str(256 * 1024),
                      "--gap-timeout", "60") as edge:
        request_id = rid("gap")
        async with connection(server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            subscribed = subscriptions(edge)

            async def publish_without_seq_0() -> None:
                await wait_for(lambda: subscriptions(edge) > subscribed, 15, "subscribed")
                await anyio.sleep(0.05)
                for seq in range(1, 9):  # 8 x 64 KiB waiting for seq 0
                    await publish_result(nc, subjects, request_id, seq, BODY)
                await nc.flush()

            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(publish_without_seq_0)
                response = await client.get(f"/v1/results/{request_id}")
            elapsed = time.monotonic() - started
        data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and "--stream-buffer-bytes" in data[-2], response.text[-500:]
        assert elapsed < 20, elapsed  # well before the 60 s gap timeout
        assert edge.metrics()["streamproc_edge_streams_overrun_total"] == 1


@pytest.mark.anyio
async def test_a_jetstream_reader_that_pauses_is_held_to_its_buffer_and_gets_every_result(server):
    """Back-pressure in JetStream mode (issue 11.4): 32 MiB of results, four times
    --stream-buffer-bytes, wait in the stream while the client reads nothing for 2 s. The edge holds
    its bound's worth, not the request: the reader's inbox goes behind at the bound and, once the
    client took what it holds, reads on from the stream (edge/fanout.py). Until 2026-12-04 this
    was a strict xfail: the stream overran after 190 of 512 results."""
    subjects = Subjects("memjs")  # the JetStream rounds' prefix: their results stream, if they made it
    count = 512  # 32 MiB of 64 KiB results
    with running_edge(server.url, "--prefix", "memjs", "--ensure-results-stream",
                      "--stream-buffer-bytes", str(8 * MiB)) as edge:
        request_id = rid("pause")
        pid = edge.proc.pid
        async with connection(server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
            baseline = status_kib(pid, "VmRSS")
            async with client.stream("GET", f"/v1/results/{request_id}") as response:
                assert response.status_code == 200
                await wait_for(lambda: edge.metrics()["streamproc_edge_jetstream_replays_total"] >= 1, 15, "attached")
                for seq in range(count):
                    await publish_result(nc, subjects, request_id, seq, BODY, final=seq == count - 1)
                    if seq % 16 == 15:
                        await nc.flush()
                await nc.flush()
                await anyio.sleep(2.0)  # the client reads nothing meanwhile
                paused_peak = status_kib(pid, "VmHWM")
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
            read_peak = status_kib(pid, "VmHWM")
        ids = [int(line[4:]) for line in body.decode().splitlines() if line.startswith("id: ")]
        assert ids == list(range(count)), (len(ids), ids[:5], ids[-5:], body[-300:])
        assert body.endswith(b"data: [DONE]\n\n")
        assert edge.metrics()["streamproc_edge_streams_overrun_total"] == 0
        assert edge.metrics()["streamproc_edge_streams_behind_total"] >= 1
        # Stated bound: the edge held at most 16 MiB of the 32 MiB while the client paused (measured below).
        print(f"\npaused JetStream reader: RSS baseline {baseline / 1024:.1f} MiB, VmHWM while paused "
              f"{paused_peak / 1024:.1f} MiB, after reading it all {read_peak / 1024:.1f} MiB; "
              f"{count * len(BODY) // MiB} MiB published")
        assert paused_peak - baseline <= 16 * 1024, (baseline, paused_peak)
        # While it catches up: its inbox, the replay's consumer and the reorder buffer, a bound each
        # at most, beside the 32 MiB it read.
        assert read_peak - baseline <= 24 * 1024, (baseline, read_peak)


@pytest.mark.anyio
async def test_a_write_blocked_for_write_timeout_closes_that_stream_only_and_the_edge_carries_on(server):
    """A reader that never reads, with a buffer large enough never to overrun: its stream's write
    blocks (Uvicorn's flow control) and is cut --write-timeout after it began; the stream counts as
    stalled, its slot is freed, and the next stream is answered in full."""
    subjects = Subjects("memstall")
    with running_edge(server.url, "--prefix", "memstall", "--write-timeout", "1",
                      "--stream-buffer-bytes", str(256 * MiB)) as edge:
        async with connection(server.url) as nc, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            stuck = rid("stuck")
            sock = slow_reader(edge.url, stuck)
            try:
                await wait_for(lambda: subscriptions(edge) >= 1, 15, "the slow reader subscribed")
                await anyio.sleep(0.1)
                for seq in range(64):  # 4 MiB, never final: far past the socket buffers, well under 256 MiB
                    await publish_result(nc, subjects, stuck, seq, BODY)
                await nc.flush()
                await wait_for(lambda: edge.metrics()["streamproc_edge_streams_active"] == 0, 20,
                               "the blocked stream closed")
                m = edge.metrics()
                assert m["streamproc_edge_streams_stalled_total"] == 1
                assert m["streamproc_edge_streams_overrun_total"] == 0
                assert "event=stream_stalled" in edge.log()
                after = rid("after")
                bodies = [b'{"text":"%d"}' % k for k in range(3)]
                async with client.stream("GET", f"/v1/results/{after}") as response:
                    assert response.status_code == 200
                    await wait_for(lambda: subscriptions(edge) >= 2, 15, "the next stream subscribed")
                    await anyio.sleep(0.05)
                    await publish_results(nc, subjects, after, bodies)
                    with anyio.fail_after(20):
                        assert await response.aread() == expected_sse(bodies)
            finally:
                sock.close()
        assert edge.proc.poll() is None


EXPERTS_SECRET = b"edge-memory-secret-0123456789abcdef-0123456789"


def padded_result_body(size: int) -> bytes:
    """A result body of ``size`` bytes without a routed-experts value (its view: ``present`` false)."""
    head, tail = b'{"meta_info":{"prompt_tokens":1,"completion_tokens":1},"pad":"', b'"}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_concurrent_experts_posts_of_one_client_get_429_and_another_client_is_still_answered(
        server, tmp_path):
    """Found by an attack (2026-12-03): each ``POST /v1/experts`` body (up to 32 MiB) was read whole
    before it waited for the one decode at a time, and nothing bounded how many were held: 16
    concurrent posts of one client took the edge's peak RSS up by 870-1,027 MiB. Now the bodies
    held are bounded per client (32 MiB) and edge-wide (64 MiB): the rest get a clear refusal."""
    from streamproc.client.capability import mint_capability
    from streamproc.edge.experts import MAX_BODY_BYTES

    key = tmp_path / "edge.key"
    key.write_bytes(EXPERTS_SECRET)
    hostile = mint_capability(EXPERTS_SECRET, rids=[rid("own")], subject="one-user")
    other = mint_capability(EXPERTS_SECRET, rids=[rid("other")], subject="another-user")
    big = padded_result_body(MAX_BODY_BYTES - 64 * 1024)
    with running_edge(server.url, "--auth-key-file", str(key), "--format", "sglang-zstd") as edge:
        baseline = status_kib(edge.proc.pid, "VmHWM") * 1024
        answers: list[httpx.Response] = []
        others: list[int] = []
        async with httpx.AsyncClient(base_url=edge.url, timeout=60,
                                     limits=httpx.Limits(max_connections=20)) as client:

            async def post() -> None:
                answers.append(await client.post("/v1/experts", content=big,
                                                 headers={"Authorization": f"Bearer {hostile}"}))

            async def meanwhile() -> None:
                for _ in range(5):
                    response = await client.post("/v1/experts", content=padded_result_body(4096),
                                                 headers={"Authorization": f"Bearer {other}"})
                    others.append(response.status_code)
                    await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                for _ in range(16):
                    tg.start_soon(post)
                tg.start_soon(meanwhile)
        growth = status_kib(edge.proc.pid, "VmHWM") * 1024 - baseline
        statuses = sorted(r.status_code for r in answers)
        print(f"statuses {statuses}; peak RSS growth {growth / MiB:.0f} MiB")
        # One 32 MiB body of the hostile client at a time (and its joined copy for a moment), a
        # decode's worth: under 160 MiB, where 16 held at once took up to 1 GiB.
        assert growth < 160 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"
        refused_total = edge.metrics()["streamproc_edge_experts_bodies_refused_total"]
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    refused = [r for r in answers if r.status_code == 429]
    for response in refused:
        assert response.json()["error"]["type"] == "too_many_uploads"
        assert response.headers["retry-after"] == "1"
    assert refused_total == len(refused)
    assert others == [200] * 5  # another client's posts are answered throughout


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_late_attaches_to_a_long_stored_history_hold_no_more_than_their_buffer_and_a_reader_gets_it_all(
        nats_server):
    """Found by an attack (2026-12-03): the edge joins the results waiting in a feed into one write,
    and while a stream replays what the results stream stored before its open, the next stored
    result counts as waiting. So each late attach gathered the request's whole stored history (48
    MiB here) before its first write, whether or not its client read: four streams that never read
    took the edge's peak RSS up by 253-284 MiB with --stream-buffer-bytes 1 MiB. A write now takes
    at most 64 KiB of waiting results (app.BATCH_BYTES)."""
    server = nats_server  # its own: the module's server has another prefix's results stream
    subjects = Subjects("replaybatch")
    request_id = rid("long-history")
    body = b'{"text":"' + b"x" * (256 * 1024 - 12) + b'"}'
    results = 192  # 48 MiB stored for one request
    # The full reader below (this test process) used to lose its stream when it fell a buffer behind
    # the replay (fresh-clone CI runs, with 1 MiB and with 4 MiB); the replay now pauses at the buffer
    # (replay.py), pinned with a slow reader by test_edge_hostile.py.
    buffer = 4 * MiB
    with running_edge(server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--stream-buffer-bytes", str(buffer)) as edge:
        async with connection(server.url) as nc:
            await publish_results(nc, subjects, request_id, [body] * results, flush_every=8)
            js = nc.jetstream()
            name = await js.find_stream_name_by_subject(subjects.result(request_id))
            deadline = time.monotonic() + 20
            while (await js.stream_info(name)).state.messages < results:
                assert time.monotonic() < deadline
                await anyio.sleep(0.1)
        await anyio.sleep(1.0)
        baseline = status_kib(edge.proc.pid, "VmHWM") * 1024
        readers = [slow_reader(edge.url, request_id) for _ in range(4)]  # open, never read
        try:
            await anyio.sleep(6.0)
            growth = status_kib(edge.proc.pid, "VmHWM") * 1024 - baseline
        finally:
            for sock in readers:
                sock.close()
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:  # a reader gets all of it
            response = await client.get(f"/v1/results/{request_id}")
        assert response.content == expected_sse([body] * results)
    print(f"peak RSS growth {growth / MiB:.0f} MiB")
    # Each stalled stream: its buffer, a write's worth and what its socket holds; 4x the buffer each and 32 MiB.
    assert growth < 4 * 4 * buffer + 32 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_experts_posts_that_declare_a_length_and_send_nothing_keep_no_other_client_out(server, tmp_path):
    """Found by a review (2026-12-03) of the bound above as first written: it took each post's
    declared length from the edge-wide budget before reading, so two capabilities that each declared
    32 MiB and sent nothing held all of it, and every other client's post got 503 for free. Only a
    client's own share is claimed by declared length now; the edge-wide bound counts bytes read."""
    import socket

    from streamproc.client.capability import mint_capability
    from streamproc.edge.experts import MAX_BODY_BYTES

    key = tmp_path / "edge.key"
    key.write_bytes(EXPERTS_SECRET)
    hostile = [mint_capability(EXPERTS_SECRET, rids=[rid("h")], subject=f"hostile-{i}") for i in range(3)]
    victim = mint_capability(EXPERTS_SECRET, rids=[rid("v")], subject="victim")
    with running_edge(server.url, "--auth-key-file", str(key), "--format", "sglang-zstd") as edge:
        host, port = edge.url.removeprefix("http://").split(":")
        socks = []
        try:
            for token in hostile:  # a head declaring a 32 MiB body, and not one byte of it
                sock = socket.create_connection((host, int(port)))
                sock.sendall(f"POST /v1/experts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                             f"Content-Length: {MAX_BODY_BYTES}\r\n\r\n".encode())
                socks.append(sock)
            await anyio.sleep(0.5)
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                response = await client.post("/v1/experts", content=padded_result_body(4096),
                                             headers={"Authorization": f"Bearer {victim}"})
        finally:
            for sock in socks:
                sock.close()
    assert response.status_code == 200, response.text


UNREAD_ANSWERS = 6  # unary answers asked for and never read, by one client (--max-streams-per-client 2)


@pytest.mark.anyio
async def test_unary_answers_a_client_takes_nothing_of_are_cut_after_write_timeout_and_a_slow_reader_is_served(
        nats_server):
    """A unary answer is written after its request gave back its stream slot, and only SSE writes had
    ``--write-timeout``: a client that asked for a 7 MiB answer and read nothing held its connection,
    ~4 MiB of kernel buffer and the rest of the body in the edge for good, as many times as it asked
    (six with --max-streams-per-client 2: the share counts streams, not answers being written). Now a
    response whose client takes nothing of it for --write-timeout closes its connection, whatever
    the route; a client that takes some within each period is sent all of it."""
    import socket

    subjects = Subjects("memunread")
    request_id = rid("unread-unary")
    bodies = [msgspec.json.encode({"text": "x" * 900_000, "i": i}) for i in range(8)]
    with running_edge(nats_server.url, "--prefix", "memunread", "--ensure-results-stream", "--write-timeout", "1",
                      "--max-streams-per-client", "2") as edge:  # its own server: a results stream of its prefix
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, request_id, bodies)
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            whole = await client.get(f"/v1/results/{request_id}?stream=false")
        assert whole.status_code == 200 and len(whole.content) > 7_000_000
        pid = edge.proc.pid
        baseline = status_kib(pid, "VmRSS")
        socks = []
        for _ in range(UNREAD_ANSWERS):
            sock = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
            sock.sendall(f"GET /v1/results/{request_id}?stream=false HTTP/1.1\r\nHost: edge\r\n\r\n".encode())
            socks.append(sock)
            await wait_for(lambda: edge.metrics()["streamproc_edge_unary_requests_total"] == len(socks) + 1
                           and edge.metrics()["streamproc_edge_streams_active"] == 0, 10, "the answer collected")
        slow = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
        slow.sendall(f"GET /v1/results/{request_id}?stream=false HTTP/1.1\r\nHost: edge\r\n\r\n".encode())
        received, end = b"", time.monotonic() + 60
        while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < len(whole.content):
            assert time.monotonic() < end, len(received)
            chunk = await anyio.to_thread.run_sync(slow.recv, 256 * 1024)
            assert chunk, f"the slow reader's answer was cut after {len(received)} bytes"
            received += chunk
            await anyio.sleep(0.25)  # takes some within every --write-timeout, never all that waits
        slow.close()
        assert edge.metrics()["streamproc_edge_streams_rejected_client_total"] == 0  # every answer a 200
        await wait_for(lambda: edge.metrics()["streamproc_edge_connections_open"] == 1, 10,
                       "the unread answers' connections closed")  # the scrape's own
        growth = status_kib(pid, "VmHWM") - baseline
        metrics = edge.metrics()
        for sock in socks:
            sock.close()
    assert received.partition(b"\r\n\r\n")[2] == whole.content
    assert metrics["streamproc_edge_connections_stalled_total"] == UNREAD_ANSWERS
    print(f"edge VmHWM {growth} kB over its VmRSS before the unread answers")
    # One copy of each answer waiting in the edge (the six unread ones and the slow reader's: what the
    # kernel did not take, in the transport's buffer) and 8 MiB for collecting one: 46 MiB measured
    # (load 0.2-2.4). While the last body part waited for the drain the answer kept its body too: 87.4
    # MiB, two copies of each, inside the 96 MiB this assert allowed before.
    bound = (UNREAD_ANSWERS + 1) * len(whole.content) // 1024 + 8 * 1024
    assert growth < bound, (growth, bound)


@pytest.mark.anyio
async def test_the_heap_is_trimmed_once_after_streams_were_released_and_not_while_idle():
    """malloc_trim walks the whole heap: an idle edge must not pay it every interval."""
    from streamproc.edge.heap import HeapTrimmer

    trimmer = HeapTrimmer(interval=0.02)
    if not trimmer.available:
        pytest.skip("no malloc_trim in this C library")
    async with anyio.create_task_group() as tg:
        tg.start_soon(trimmer.run)
        await anyio.sleep(0.2)
        assert trimmer.trims == 0
        trimmer.released()
        trimmer.released()
        await anyio.sleep(0.2)
        assert trimmer.trims == 1
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_slow_https_reader_of_a_large_unary_answer_gets_all_of_it(nats_server, tmp_path):
    """Over HTTPS a unary answer leaves the edge's TLS layer at once (its response ends before the
    client read it), so what is left waits in the socket's buffer and the kernel's send queue until
    the edge closes the connection (--head-timeout after the answer), and the TLS shutdown was cut
    after --write-timeout unless the socket's buffer shrank. With MiBs in the kernel's queue it does
    only when much of it is gone: a client taking 128 KiB every 0.25 s lost the last 1.4-1.6 MB of a
    7.2 MB answer. As over plain HTTP (the test above), what the kernel still holds (SIOCOUTQ) counts."""
    import socket

    from nats_auth import Certificates

    certs = Certificates(tmp_path)
    subjects = Subjects("memtls")
    request_id = rid("tls-unary")
    bodies = [msgspec.json.encode({"text": "x" * 900_000, "i": i}) for i in range(8)]
    with running_edge(nats_server.url, "--prefix", "memtls", "--ensure-results-stream", "--write-timeout", "1",
                      "--head-timeout", "2", "--tls-cert-file", str(certs.server),
                      "--tls-key-file", str(certs.server_key), ca_file=str(certs.ca)) as edge:
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, request_id, bodies)
        raw = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
        with edge.ssl.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(f"GET /v1/results/{request_id}?stream=false HTTP/1.1\r\nHost: edge\r\n\r\n".encode())
            received, end = b"", time.monotonic() + 60
            while True:
                assert time.monotonic() < end, len(received)
                chunk = await anyio.to_thread.run_sync(read_tls, sock, 128 * 1024)
                if not chunk:
                    break  # the edge closed the connection: all of the answer, or a cut
                received += chunk
                await anyio.sleep(0.25)  # ~0.5 MB/s: takes some within every --write-timeout, never all
        metrics = edge.metrics()
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"content-length: 7200017" in head, head
    answer, rest = body[:7200017], body[7200017:]
    assert len(answer) == 7200017, f"the answer was cut after {len(answer)} of 7200017 bytes"
    assert rest == b"" or rest.startswith(b"HTTP/1.1 408 "), rest[:80]  # the idle connection's end
    assert metrics["streamproc_edge_connections_stalled_total"] == 0


HALF_CLOSERS = 6  # HTTPS clients that half-close after their request and read nothing of the answer


@pytest.mark.anyio
async def test_https_clients_that_half_close_and_read_nothing_are_cut_after_write_timeout(nats_server, tmp_path):
    """Over HTTPS a client's EOF (TCP FIN, or its close_notify) ends asyncio's TLS shutdown at once:
    SSLProtocol cancels its timeout and closes the socket transport, which waits for its buffer to
    drain with no bound. A client that sent its request, half-closed and read nothing held its
    connection, its --max-connections slot and the answer's MiBs in the edge for good (seen: 4 of
    them still open 30 s later, --write-timeout 1). Now what is left has the --write-timeout
    watch: the half-closers are cut within seconds and another client is answered meanwhile."""
    import socket

    from nats_auth import Certificates

    certs = Certificates(tmp_path)
    subjects = Subjects("memfin")
    request_id = rid("tls-fin")
    bodies = [msgspec.json.encode({"text": "x" * 900_000, "i": i}) for i in range(8)]
    request = f"GET /v1/results/{request_id}?stream=false HTTP/1.1\r\nHost: edge\r\n\r\n".encode()
    with running_edge(nats_server.url, "--prefix", "memfin", "--ensure-results-stream", "--write-timeout", "1",
                      "--head-timeout", "30", "--tls-cert-file", str(certs.server),
                      "--tls-key-file", str(certs.server_key), ca_file=str(certs.ca)) as edge:
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, request_id, bodies)
        async with httpx.AsyncClient(base_url=edge.url, timeout=30, verify=edge.ssl) as client:
            whole = await client.get(f"/v1/results/{request_id}?stream=false")
        assert whole.status_code == 200 and len(whole.content) == 7200017
        pid = edge.proc.pid
        baseline = status_kib(pid, "VmRSS")

        def half_closed() -> socket.socket:
            """A client that asked, read the answer's head (so the answer is being written: a TLS layer
            that got the EOF first drops it) and half-closed: a FIN under the TLS session."""
            raw = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock = edge.ssl.wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1024)
            assert head.startswith(b"HTTP/1.1 200 "), head
            socket.socket.shutdown(sock, socket.SHUT_WR)
            return sock

        victims = [await anyio.to_thread.run_sync(half_closed) for _ in range(HALF_CLOSERS)]  # and never read
        async with httpx.AsyncClient(base_url=edge.url, timeout=30, verify=edge.ssl) as client:
            assert (await client.get("/healthz")).status_code == 200  # the others are answered
        # They take nothing: cut --write-timeout (1 s) after their shutdown completed; the old code held them
        await wait_for(lambda: edge.metrics()["streamproc_edge_connections_open"] == 1, 5,
                       "the half-closers' connections cut")  # the scrape's own
        growth = status_kib(pid, "VmHWM") - baseline
        for victim in victims:
            victim.close()
    print(f"edge VmHWM {growth} kB over its VmRSS before the half-closers")
    assert growth < 128 * 1024, growth


def read_tls(sock, size: int) -> bytes:
    """Up to ``size`` bytes, less only at the connection's end (a TLS ``recv`` answers one record)."""
    data = b""
    while len(data) < size and (chunk := sock.recv(size - len(data))):
        data += chunk
    return data


@pytest.mark.anyio
async def test_unary_answers_one_client_has_not_taken_are_bounded_in_bytes_and_others_are_answered(nats_server):
    """A unary answer gives back its stream slot once built, and its bytes wait in the edge until the
    client takes them (--write-timeout cuts a client that takes nothing): one client asking for a
    7.2 MB answer over and over without reading, 4 connections at a time, got every answer (no
    429 once the first ones were built) and took the edge's VmHWM up by ~250 MiB in 5 s (measured),
    as many answers as --max-connections allows. Now the answers a client has not taken count
    against it, at most UNARY_ANSWERS_PER_CLIENT x --max-unary-bytes: past it a clear 429, and
    another client still gets the whole answer."""
    import socket

    from streamproc.edge.app import UNARY_ANSWERS_PER_CLIENT

    subjects = Subjects("memhoard")
    request_id = rid("hoard")
    bodies = [msgspec.json.encode({"text": "x" * 900_000, "i": i}) for i in range(8)]
    max_unary = 8 * MiB  # the budget: 4 x 8 MiB, four 7.2 MB answers
    request = f"GET /v1/results/{request_id}?stream=false HTTP/1.1\r\nHost: edge\r\n\r\n".encode()
    with running_edge(nats_server.url, "--prefix", "memhoard", "--ensure-results-stream",
                      "--max-unary-bytes", str(max_unary)) as edge:  # --write-timeout 30: the hoard stays
        async with connection(nats_server.url) as nc:
            await publish_results(nc, subjects, request_id, bodies)
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            whole = await client.get(f"/v1/results/{request_id}?stream=false")
        assert whole.status_code == 200 and len(whole.content) == 7200017
        pid = edge.proc.pid
        baseline = status_kib(pid, "VmRSS")
        socks = []
        for _ in range(12):  # 48 answers asked for, 4 at a time (more at once made nats-server cut the edge), none read
            for _ in range(4):
                sock = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(request)
                socks.append(sock)
            await anyio.sleep(0.4)
        await wait_for(lambda: edge.metrics()["streamproc_edge_streams_active"] == 0, 20, "every answer decided")
        assert "event=disconnected" not in edge.log(), edge.log()[-2000:]
        heads = []
        for sock in socks:
            head = b""
            while b"\r\n\r\n" not in head or (head.startswith(b"HTTP/1.1 429 ") and not head.endswith(b"}}")):
                head += await anyio.to_thread.run_sync(sock.recv, 4096)  # a refusal's body with its head
            heads.append(head)
        refused = [head for head in heads if head.startswith(b"HTTP/1.1 429 ")]
        answered = [head for head in heads if head.startswith(b"HTTP/1.1 200 ")]
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")  # another client (--insecure-demo: address)
        async with httpx.AsyncClient(base_url=edge.url, timeout=30, transport=transport) as client:
            other = await client.get(f"/v1/results/{request_id}?stream=false")
        growth = status_kib(pid, "VmHWM") - baseline
        for sock in socks:
            sock.close()
    print(f"{len(answered)} answered, {len(refused)} refused; edge VmHWM {growth} kB over its VmRSS")
    assert len(answered) + len(refused) == len(socks), [h[-300:] for h in heads if h not in refused + answered][:2]
    assert len(answered) <= UNARY_ANSWERS_PER_CLIENT + 2, len(answered)  # (a few may have left the edge already)
    assert refused and all(b'"type":"too_many_streams"' in head for head in refused), refused[:1]
    assert other.status_code == 200 and other.content == whole.content
    assert growth < 96 * 1024, growth


@pytest.mark.anyio
async def test_a_flood_of_opens_of_ids_nobody_answers_is_held_to_max_streams_in_bounded_memory_and_times_out(
        nats_server):
    """An attacker opens --max-streams streams of distinct ids no worker will ever answer (the longest
    ids the wire allows, late attaches in durable mode) and reads nothing. Measured 2026-12-06: 1,000
    such streams raised the edge's VmHWM by 17-21 MiB (~20 KiB a stream). The one past the limit gets
    503, each stream ends with its timeout error and ``[DONE]`` at --idle-stream-timeout, and the
    slots are free again. Coverage, found by an attack (passes on the code it was written against). Its own
    server: the module's shared one holds a results stream of another prefix under the same name."""
    streams = 1000
    with running_edge(nats_server.url, "--prefix", "memflood", "--ensure-results-stream", "--max-streams", str(streams),
                      "--max-streams-per-client", str(streams), "--idle-stream-timeout", "6",
                      "--keepalive", "60") as edge:
        baseline = status_kib(edge.proc.pid, "VmHWM")
        ids = [f"{n:04d}-" + "x" * 251 for n in range(streams)]  # 256 characters: MAX_REQUEST_ID_LEN
        sockets = [await unread_stream(edge.port, request_id) for request_id in ids]
        try:
            grown = (status_kib(edge.proc.pid, "VmHWM") - baseline) * 1024
            async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
                refused = await client.get(f"/v1/results/{rid('one-too-many')}")
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded", refused.text
            assert grown < 64 * MiB, f"VmHWM grew {grown / MiB:.0f} MiB for {streams} waiting streams"
            ends = [await read_to_close(sock, 20) for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        assert all(end.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") for end in ends), ends[0][-300:]  # the last chunk
        assert all(b"within 6.0s" in end for end in ends), ends[0][-300:]
        await wait_for(lambda: edge.metrics()["streamproc_edge_streams_active"] == 0, 10, "every slot freed")
        async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
            async with client.stream("GET", f"/v1/results/{rid('after-flood')}") as again:
                assert again.status_code == 200
    print(f"VmHWM +{grown / MiB:.1f} MiB for {streams} streams")


async def read_to_close(sock, timeout: float) -> bytes:
    """Everything the edge sends on ``sock`` until it closes the connection."""
    loop = asyncio.get_running_loop()
    data = b""
    with anyio.fail_after(timeout):
        while chunk := await loop.sock_recv(sock, 65536):
            data += chunk
    return data
