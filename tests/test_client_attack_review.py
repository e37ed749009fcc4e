"""An attacker's review of the client helpers (streamproc.client): what a frontend reading results,
a serving layer migrating and a worker publishing get when the other side of NATS misbehaves
(a forger with publish rights on a results subject, a buggy or hostile processor, an odd PubAck).
Real nats-server processes only; each test failed on the code it was written against."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import anyio
import nats
import pytest
from helpers import connection, pull_counted_size, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg

import streamproc
from streamproc.client import connection as client_module
from streamproc import ChunkPublisher, MigrationError, Migrator, StreamprocError, Subjects, follow
from streamproc.client.results import ResultCollector, ResultStream
from streamproc.core.defaults import CLIENT_BUFFER_BYTES
from streamproc.core.events import Result, Verdict
from streamproc.core.wire import result_headers
from streamproc.nats.streams import ensure_results_stream

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

SUBJECTS = Subjects()


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def forge(nc, request_id: str, seq: int, body: bytes = b"forged", final: bool = False) -> None:
    r = Result(request_id, seq, body, final, Verdict.PASSTHROUGH)
    await nc.publish(SUBJECTS.result(request_id), r.body, headers=result_headers(r))


def raw_hpub(url: str, subject: bytes, header_block: bytes, body: bytes = b"x") -> None:
    """Publish exact header bytes (what any NATS client may send; nats-py would not send these)."""
    host, port = url.rsplit("//", 1)[-1].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.recv(4096)
        size = len(header_block)
        s.sendall(b'CONNECT {"verbose":false,"headers":true,"protocol":1}\r\n'
                  + b"HPUB " + subject + b" %d %d\r\n" % (size, size + len(body)) + header_block + body
                  + b"\r\nPING\r\n")
        buf = b""
        while b"PONG" not in buf:
            buf += s.recv(4096)


# ----------------------------------------------------------------- ResultStream: memory and timeout

FLOOD = 1500  # results of 64 KiB: 94 MiB for one request
BODY = b"y" * 65536


@pytest.mark.parametrize("gapped", [True, False], ids=["never-seq-0", "in-order-unread"])
async def test_one_forged_request_cannot_make_a_result_stream_buffer_without_bound(client, nats_url, gapped):
    """A forger sends one request 94 MiB of results: either never seq 0 (everything waits behind the
    gap; ``SeqOrder`` counts results, 4096, not bytes: 4096 x max_payload is 4 GiB per request), or
    in order to a reader that is slow (its HTTP client is), so they pile up in ``_ready``, which has
    no bound at all. The edge bounds both by bytes (``--stream-buffer-bytes``, docs/edge.md); the
    client helper grew by the whole flood and waited for its timeout."""
    async with connection(nats_url) as forger:
        rid = f"flood-{gapped}"
        async with follow(client, SUBJECTS, rid, timeout=20) as results:
            before = rss_bytes()
            for seq in range(1 if gapped else 0, FLOOD + 1):
                await forge(forger, rid, seq, BODY)
            await forger.flush()
            await anyio.sleep(0.5)  # the reader's callback has taken what arrived
            grown = rss_bytes() - before
            outcome = "no error within 5 s"
            with anyio.move_on_after(5):
                try:
                    async for _ in results:
                        pass
                    outcome = "ended normally"
                except Exception as exc:  # noqa: BLE001 - the test reports what it was
                    outcome = f"{type(exc).__name__}: {exc}"
    assert grown < 32 << 20 and outcome.startswith("ResultsOverrun"), \
        f"one request's results grew the reader by {grown >> 20} MiB; then {outcome}"


async def test_the_timeout_ends_a_stream_whose_reader_is_slower_than_its_never_ending_results(client, nats_url):
    """``timeout`` "bounds the wait for the final one", but the deadline is checked only when nothing
    is buffered: results arriving every 20 ms for a reader taking 50 ms each (a slow client) keep
    the buffer non-empty, and a stream with timeout=1 was still yielding 3 s in (it ends only
    once the producer stops and the backlog is drained)."""
    rid = "trickle"
    async with connection(nats_url) as forger:
        async def trickle() -> None:
            for seq in range(400):
                await forge(forger, rid, seq)
                await anyio.sleep(0.02)

        outcome = "still yielding results 3 s into a 1 s timeout"
        async with anyio.create_task_group() as tasks:
            async with follow(client, SUBJECTS, rid, timeout=1.0) as results:
                tasks.start_soon(trickle)
                started = time.monotonic()
                try:
                    async for _ in results:
                        await anyio.sleep(0.05)
                        if time.monotonic() - started > 3:
                            break
                except TimeoutError:
                    outcome = f"TimeoutError after {time.monotonic() - started:.1f} s"
            tasks.cancel_scope.cancel()
    assert outcome.startswith("TimeoutError"), outcome


@pytest.mark.parametrize("connect", ["streamproc", "stock"])
async def test_a_forged_result_deafens_no_other_request_of_a_streamproc_connection(nats_url, connect, caplog):
    """README: the helpers take any nats-py client. One message on ``P.results.<victim>`` whose
    inline status text is not UTF-8 makes stock nats-py's ``_process_headers`` raise in its read
    loop, which stops reading for good (docs/operations.md): every other request followed on that
    connection timed out too, and the connection still said it was connected. The processor and
    the edge connect with ``RobustClient``; the helpers' users had no way to, nor a word about it.
    Now ``streamproc.connect`` gives them that client (the bystander is answered), and a helper
    given a stock client says so once."""
    nc = await (streamproc.connect(nats_url) if connect == "streamproc" else nats.connect(servers=[nats_url]))
    client_module._warned = False
    try:
        async with follow(nc, SUBJECTS, "victim", timeout=2) as victim, \
                follow(nc, SUBJECTS, "bystander", timeout=2) as bystander:
            raw_hpub(nats_url, SUBJECTS.result("victim").encode(), b"NATS/1.0 503 \xff\xfe\r\n\r\n")
            async with connection(nats_url) as processor:
                await forge(processor, "bystander", 0, final=True)
                await processor.flush()
            try:
                seen = [r.seq for r in await bystander.collect()]
            except TimeoutError as exc:
                seen = f"TimeoutError: {exc}"
            with pytest.raises(StreamprocError if connect == "streamproc" else TimeoutError):
                await victim.collect()
    finally:
        await nc.close()
    warned = "event=stock_nats_client" in caplog.text
    if connect == "streamproc":
        assert seen == [0] and not warned, seen
    else:  # stock nats-py still goes deaf (its read loop); the helper said so
        assert warned and "streamproc.connect()" in caplog.text


async def test_a_forged_join_header_is_not_echoed_whole_in_the_error(client, nats_url):
    """Every other header value a reader refuses is shown cut (``errors.shown``: "echoed whole, one
    chunk made an error result too large to publish and a log line of that size"); a forged
    ``Streamproc-Join`` of 500,000 characters came back whole in ``MalformedResult``'s text (Verdict's
    ValueError), in every log line and HTTP error a frontend makes of it."""
    async with follow(client, SUBJECTS, "join", timeout=2) as results, connection(nats_url) as forger:
        await forger.publish(SUBJECTS.result("join"), b"x",
                             headers={"Streamproc-Seq": "0", "Streamproc-Join": "J" * 500_000})
        await forger.flush()
        with pytest.raises(StreamprocError) as raised:
            await results.collect()
    assert len(str(raised.value)) < 1000, f"{len(str(raised.value))} characters"


# ----------------------------------------------------------------- ResultCollector

async def test_concurrent_wait_for_calls_on_one_collector_each_return_when_their_requests_end(client, nats_url):
    """``wait_for`` keeps the requests it waits for in the collector (``_missing``, ``_all_done``): a
    second call replaces the first's, so the first waited its whole timeout although its request had
    ended, then raised a TimeoutError naming the *other* call's request; the second, whose request
    never ended, then found nothing missing and raised ``KeyError`` instead of its TimeoutError."""
    async with ResultCollector(client, SUBJECTS) as collector, connection(nats_url) as processor:
        outcomes: dict[str, str] = {}

        async def wait(rid: str) -> None:
            started = time.monotonic()
            try:
                await collector.wait_for([rid], timeout=3)
                outcomes[rid] = f"answered after {time.monotonic() - started:.1f} s"
            except Exception as exc:  # noqa: BLE001 - the test reports what each call got
                outcomes[rid] = f"{type(exc).__name__} after {time.monotonic() - started:.1f} s: {exc}"

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(wait, "first")
            await anyio.sleep(0.1)
            tasks.start_soon(wait, "second")  # its request never ends
            await anyio.sleep(0.1)
            await forge(processor, "first", 0, final=True)
            await processor.flush()
        assert outcomes["first"].startswith("answered after 0.") and outcomes["second"].startswith(
            "TimeoutError") and "'second'" in outcomes["second"], outcomes


# ----------------------------------------------------------------- Migrator

REQUEST = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16}}).encode()


def sealed(**changes: object) -> bytes:
    reply = {"status": "sealed", "request_id": "r1", "attempt": 1, "emitted_tokens": 2,
             "emitted_token_ids": [5, 6], "result_seq": 3, "format": "sglang"}
    reply.update(changes)
    return json.dumps(reply).encode()


@pytest.mark.parametrize("reply", [
    b"not json",
    b"{}",
    json.dumps({"status": "error", "request_id": "r1", "code": "new_code", "message": "m"}).encode(),
    sealed(emitted_token_ids=["a"]),
    sealed(request_id="another-request"),
    sealed(attempt=-5),
    sealed(attempt=10**30),
    sealed(emitted_tokens=-1),
    sealed(emitted_token_ids=[-3]),
], ids=["not-json", "empty-object", "unknown-code", "bad-token-ids", "another-request", "negative-attempt",
        "attempt-over-max-seq", "negative-emitted-tokens", "negative-token-id"])
async def test_a_migrate_reply_that_is_not_a_seal_of_this_request_raises_a_streamproc_error(client, nats_url, reply):
    """A reply the Migrator cannot use (a buggy or newer processor, anyone answering on
    ``P.control.*.migrate``) raised ``msgspec.DecodeError``/``ValidationError`` (no ``StreamprocError``:
    the module doc promises ``MigrationError`` for an error reply and nats-py's exceptions for NATS
    failures), or was taken as the seal: a seal of another request (its token ids went into this
    one's resumed request), an attempt of -5 or 10**30 (``publish_request`` put
    ``Streamproc-Attempt: -5`` on the resumed request; every chunk of it is a contract error)."""
    async with connection(nats_url) as processor:
        async def answer(msg) -> None:
            await processor.publish(msg.reply, reply)

        await processor.subscribe(SUBJECTS.all_migrate, cb=answer)
        await processor.flush()
        migrator = Migrator(client, format="sglang", timeout=2, attempt_timeout=0.5)
        with pytest.raises(StreamprocError):
            resumed = await migrator.migrate("r1", REQUEST)
            pytest.fail(f"taken as this request's seal: {resumed}")


async def test_a_migrate_error_reply_with_a_huge_message_is_raised_cut(client, nats_url):
    """An error reply's ``message`` is the replier's text: 100,000 characters were echoed whole in
    ``MigrationError`` (and every log line made of it)."""
    reply = json.dumps({"status": "error", "request_id": "r1", "code": "finished", "message": "m" * 100_000})
    async with connection(nats_url) as processor:
        async def answer(msg) -> None:
            await processor.publish(msg.reply, reply.encode())

        await processor.subscribe(SUBJECTS.all_migrate, cb=answer)
        await processor.flush()
        with pytest.raises(MigrationError) as raised:
            await Migrator(client, format="sglang", timeout=2, attempt_timeout=0.5).migrate("r1", REQUEST)
    assert raised.value.code.value == "finished" and len(str(raised.value)) < 1100, len(str(raised.value))


# ----------------------------------------------------------------- ChunkPublisher

@pytest.mark.parametrize("ack", [b"not json", b"null", b"{}", b'{"error": "boom"}', b'{"error": null}', b'{"error": []}',
                                 b'{"stream": 5, "seq": "x"}'],
                         ids=["not-json", "null", "empty-object", "error-string", "error-null", "error-list",
                              "not-a-puback"])
async def test_a_durable_publish_answered_by_something_other_than_a_puback_raises_publish_refused(
        client, nats_url, ack):
    """A durable publish whose reply is not a PubAck (a service answering requests on the chunk
    subject, no stream) raised ``JSONDecodeError``/``TypeError`` from nats-py's parsing, which a
    worker's ``except PublishRefused`` does not catch, or returned as if the chunk were stored
    (``{"stream": 5, "seq": "x"}``): no stream holds it."""
    async with connection(nats_url) as responder:
        async def answer(msg) -> None:
            await responder.publish(msg.reply, ack)

        await responder.subscribe(SUBJECTS.all_chunks, cb=answer)
        await responder.flush()
        publisher = ChunkPublisher(client, SUBJECTS, durable=True, timeout=0.5, retries=1, backoff=0.05)
        with pytest.raises(StreamprocError):
            await publisher.publish("w1", "agg", 0, b"{}", final=True)
            pytest.fail("returned as if stored")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.binary(max_size=40), st.booleans()), max_size=40))
def test_a_result_streams_byte_count_is_what_it_holds(pushes):
    """The bound counts exactly what the stream holds (``ResultInfo.held_bytes``): the results ready
    for its loop and those ``SeqOrder`` keeps behind a missing seq, through repeats, gaps and a final
    result."""
    stream = ResultStream(None, SUBJECTS, "bytes", max_buffered_bytes=1 << 30)  # type: ignore[arg-type]
    for seq, body, final in pushes:
        result = Result("bytes", seq, body, final, Verdict.PASSTHROUGH)
        msg = Msg(None, subject=SUBJECTS.result("bytes"), data=body, headers=result_headers(result))  # type: ignore[arg-type]
        anyio.run(stream._on_msg, msg)
        assert stream._ready_bytes == sum(r.held_bytes for r in stream._ready)
        assert stream._waiting_bytes == sum(r.held_bytes for r in stream._order.pending.values())


async def store_history(client, nats_url: str, rid: str, n: int, body: bytes) -> None:
    """A finished request's ``n`` results, stored in the results stream (a late attach replays them)."""
    await ensure_results_stream(client.jetstream(), SUBJECTS)
    async with connection(nats_url) as producer:
        for seq in range(n):
            await forge(producer, rid, seq, body, final=seq == n - 1)
        await producer.flush()
    await anyio.sleep(0.5)


async def test_a_slow_loop_replaying_a_large_finished_request_gets_all_of_it(client, nats_url):
    """A late attach (replay=True) of a legitimate finished request whose stored results total
    25 MiB, read by a loop doing a little awaited work per result (a socket write). The ordered
    consumer pushes at JetStream's pace, not the loop's: the first version of the byte bound ended
    such a stream with ResultsOverrun at 16 MiB (found by a reviewer; the edge had met the same,
    docs/edge.md). Now the replay stops its consumer at the bound and reads on from the next stored
    result, and the reader holds about the bound, not the history."""
    rid, n = "big-replay-slow", 400
    await store_history(client, nats_url, rid, n, b"e" * 65536)
    before = rss_bytes()
    got = []
    async with follow(client, SUBJECTS, rid, timeout=60, replay=True, max_buffered_bytes=4 << 20) as results:
        async for result in results:
            got.append(result.seq)
            await anyio.sleep(0.0005)
    grown = rss_bytes() - before
    assert got == list(range(n))
    assert grown < 24 << 20, f"the reader grew by {grown >> 20} MiB for a 25 MiB history"


SLOW_REPLAY_READER = """
import json, sys, anyio, streamproc
from streamproc import Subjects, follow
async def main():
    url, rid, size, bound, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    nc = await streamproc.connect(url)
    before_msgs, before_bytes = nc.stats["in_msgs"], nc.stats["in_bytes"]
    seqs, wrong = [], 0
    options = {"max_buffered_bytes": bound} if bound else {}
    async with follow(nc, Subjects(), rid, timeout=120, replay=True, **options) as results:
        async for r in results:
            seqs.append(r.seq)
            wrong += r.body != bytes([r.seq % 251]) * size
            await anyio.sleep(pause)
    delivered = {"msgs": nc.stats["in_msgs"] - before_msgs, "bytes": nc.stats["in_bytes"] - before_bytes}
    await nc.close()
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"seqs": seqs, "wrong": wrong, "delivered": delivered, "vmhwm_kib": hwm}))
anyio.run(main)
"""


def run_slow_reader(nats_url: str, rid: str, size: int, bound: int, pause: float) -> dict:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SLOW_REPLAY_READER, nats_url, rid, str(size), str(bound), str(pause)],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n, size, bound", [(400, 64 << 10, 4 << 20), (1000, 256 << 10, 0)],
                         ids=["400x64KiB-4MiB-bound", "1000x256KiB-default-bound"])
async def test_a_slow_replay_reader_is_delivered_each_stored_result_about_once(client, nats_url, n, size, bound):
    """A late attach (replay=True) read by a slow loop: the reader's byte bound must pace what the
    server sends, not what the reader keeps. The replay was an ordered (push) consumer that the
    bound only paused: JetStream kept pushing, the reader threw the messages away and read them
    again from a new consumer later (an attacker measured 1,718 deliveries for 400 results of 64 KiB
    at a 4 MiB bound, and 497 MiB sent for a 250 MiB history at the default bound). Counted on the
    reader's own connection (every message and byte the server sent it), in a subprocess, whose
    peak RSS (VmHWM) must stay near the bound, not the history."""
    rid = f"slow-replay-{n}"
    await ensure_results_stream(client.jetstream(), SUBJECTS)
    async with connection(nats_url) as producer:
        for seq in range(n):
            await forge(producer, rid, seq, bytes([seq % 251]) * size, final=seq == n - 1)
        await forge(producer, f"{rid}-base", 0, bytes([0]), final=True)  # the same reader on one tiny result
        await producer.flush()
    baseline = await anyio.to_thread.run_sync(run_slow_reader, nats_url, f"{rid}-base", 1, 0, 0.0)
    got = await anyio.to_thread.run_sync(run_slow_reader, nats_url, rid, size, bound, 0.002)
    history = n * size
    delivered = got["delivered"]
    print(f"{rid}: delivered {delivered['msgs']} messages, {delivered['bytes'] >> 20} MiB for {n} results "
          f"({history >> 20} MiB); VmHWM {got['vmhwm_kib'] >> 10} MiB (baseline {baseline['vmhwm_kib'] >> 10} MiB)")
    assert got["seqs"] == list(range(n)) and got["wrong"] == 0
    assert delivered["bytes"] <= history * 1.1, delivered
    assert delivered["msgs"] <= n * 1.1, delivered
    limit = (bound or CLIENT_BUFFER_BYTES) * 3
    assert (got["vmhwm_kib"] - baseline["vmhwm_kib"]) << 10 < limit, (got["vmhwm_kib"], baseline["vmhwm_kib"])


@pytest.mark.parametrize("failing", ["pull", "new-consumer"])
async def test_a_replay_whose_next_step_fails_once_loses_and_repeats_nothing(client, nats_url, monkeypatch, failing):
    """A replay step that fails (NATS away for a moment, a cancellation) must not lose the result
    about to be handed out (a first version popped it before reading on: a reviewer's finding) nor
    restart the stream from its first result: the next step goes on from the same place. The steps
    that can fail: a pull (``$JS.API.CONSUMER.MSG.NEXT``), and making the consumer again, here after
    it was deleted under the reader (what the server does to one idle ``REPLAY_CONSUMER_IDLE``)."""
    rid, n = f"replay-step-fails-{failing}", 120
    await store_history(client, nats_url, rid, n, b"f" * 65536)
    failures: list[str] = []
    if failing == "pull":
        real_publish = client.publish
        pulls = []

        async def publish(subject, *args, **kwargs):
            if ".CONSUMER.MSG.NEXT." in subject:
                pulls.append(subject)
                if len(pulls) == 3 and not failures:
                    failures.append(subject)
                    raise nats.errors.TimeoutError
            return await real_publish(subject, *args, **kwargs)

        monkeypatch.setattr(client, "publish", publish)
    else:
        real_jetstream = client.jetstream

        def jetstream_failing_once(*args, **kwargs):
            context = real_jetstream(*args, **kwargs)
            real_add = context.add_consumer

            async def add_consumer(stream, config=None, **kw):
                if config is not None and config.opt_start_seq and not failures:  # a consumer made again
                    failures.append(config.opt_start_seq)
                    raise nats.errors.TimeoutError
                return await real_add(stream, config=config, **kw)

            context.add_consumer = add_consumer
            return context

        monkeypatch.setattr(client, "jetstream", jetstream_failing_once)
    got, raised = [], []
    async with connection(nats_url) as admin:
        js = admin.jetstream()
        async with follow(client, SUBJECTS, rid, timeout=60, replay=True, max_buffered_bytes=1 << 20) as results:
            while True:
                try:
                    async for result in results:
                        got.append(result.seq)
                        if failing == "new-consumer" and result.seq == 30:
                            for info in await replay_consumers(js, rid):
                                await js.delete_consumer(info.stream_name, info.name)
                        await anyio.sleep(0.001)
                    break
                except nats.errors.TimeoutError:
                    raised.append(len(got))
    assert failures and raised == [raised[0]], (failures, raised)
    assert got == list(range(n))


async def replay_consumers(js, rid: str) -> list:
    """The consumers on the results stream that read ``rid``'s results (consumer info, server side)."""
    stream = await js.find_stream_name_by_subject(SUBJECTS.result(rid))
    return [info for info in await js.consumers_info(stream)
            if info.config.filter_subject == SUBJECTS.result(rid)]


@pytest.mark.parametrize("leaves", ["break", "cancelled", "ended"])
async def test_a_replay_reader_that_leaves_leaves_no_consumer_behind(client, nats_url, leaves):
    """A replay reads through a pull consumer, which (unlike an ordered push consumer) the server
    does not drop when its subscription goes: the stream deletes it however the reader leaves
    (``async with`` after a ``break``, a cancellation, the final result). Asked of the server."""
    rid, n = f"replay-leaves-{leaves}", 60
    await store_history(client, nats_url, rid, n, b"g" * 65536)
    js = client.jetstream()
    seen, during = [], []
    with anyio.move_on_after(5 if leaves == "cancelled" else 60):
        async with follow(client, SUBJECTS, rid, timeout=60, replay=True, max_buffered_bytes=1 << 20) as results:
            async for result in results:
                seen.append(result.seq)
                if result.seq == 10:
                    during = await replay_consumers(js, rid)
                    if leaves == "break":
                        break
                    if leaves == "cancelled":
                        await anyio.sleep(30)
    assert len(during) == 1, during  # one consumer while it reads
    assert seen == list(range(11 if leaves != "ended" else n))
    assert await replay_consumers(js, rid) == []


async def test_a_replay_of_a_stored_history_without_its_first_result_ends_at_the_bound(client, nats_url):
    """Results stored behind a seq that never comes (forged, or seq 0 aged out) cannot be handed
    out: the replay's pulls ask only for the room left, and once what waits behind the gap leaves
    none for the next result the stream ends with ResultsOverrun, promptly, not at its timeout."""
    rid, n = "replay-gap", 40
    await ensure_results_stream(client.jetstream(), SUBJECTS)
    async with connection(nats_url) as producer:
        for seq in range(1, n + 1):
            await forge(producer, rid, seq, b"z" * 65536)
        await producer.flush()
    started = time.monotonic()
    with pytest.raises(streamproc.ResultsOverrun):
        async with follow(client, SUBJECTS, rid, timeout=30, replay=True, max_buffered_bytes=1 << 20) as results:
            async for _ in results:
                raise AssertionError("nothing is in order")
    assert time.monotonic() - started < 10
    assert await replay_consumers(client.jetstream(), rid) == []


async def test_a_killed_replay_readers_consumer_is_removed_by_the_server(client, nats_url):
    """A reader that vanishes without closing (its process killed mid-replay) cannot delete its
    consumer: the consumer's ``inactive_threshold`` (``REPLAY_CONSUMER_IDLE``, shortened here in the
    reader's process) has the server remove it."""
    import subprocess
    import sys

    rid, n = "replay-killed", 200
    await store_history(client, nats_url, rid, n, b"k" * 65536)
    script = SLOW_REPLAY_READER.replace("async def main():", "import streamproc.client.results\n"
                                        "streamproc.client.results.REPLAY_CONSUMER_IDLE = 2\nasync def main():", 1)
    proc = await anyio.open_process([sys.executable, "-c", script, nats_url, rid, "65536", str(1 << 20), "0.05"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        js = client.jetstream()
        await wait_until(lambda: _has_consumer(js, rid), 20, "the reader's consumer")
    finally:
        proc.kill()
        await proc.wait()
    await wait_until(lambda: _no_consumer(js, rid), 15, "the killed reader's consumer removed")


async def _has_consumer(js, rid: str) -> bool:
    return len(await replay_consumers(js, rid)) == 1


async def _no_consumer(js, rid: str) -> bool:
    return await replay_consumers(js, rid) == []


async def test_a_replay_reads_the_stored_history_then_follows_live_results(client, nats_url):
    """The replay's consumer is the live tail too: results published while a slow reader is still
    in the stored history, and after it caught up, come once each, in order, up to the final one."""
    rid, stored, live = "replay-then-live", 100, 100
    await ensure_results_stream(client.jetstream(), SUBJECTS)
    body = b"h" * 32768
    async with connection(nats_url) as producer:
        for seq in range(stored):
            await forge(producer, rid, seq, body)
        await producer.flush()
        got = []

        async def publish_live() -> None:
            for seq in range(stored, stored + live):
                await forge(producer, rid, seq, body, final=seq == stored + live - 1)
                await producer.flush()
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg, \
                follow(client, SUBJECTS, rid, timeout=60, replay=True, max_buffered_bytes=1 << 20) as results:
            tg.start_soon(publish_live)
            async for result in results:
                got.append(result.seq)
                await anyio.sleep(0.002)
    assert got == list(range(stored + live))
    assert await replay_consumers(client.jetstream(), rid) == []


# ----------------------------------------------------------------- connect(user_credentials=...)

CONNECT_WITH_CREDS = """
import sys, anyio, streamproc
from nats.aio.client import RawCredentials
async def main():
    creds = RawCredentials(open(sys.argv[2]).read()) if sys.argv[3] == "raw" else sys.argv[2]
    try:
        nc = await streamproc.connect(sys.argv[1], user_credentials=creds, connect_timeout=2,
                                      allow_reconnect=False)
    except Exception as exc:
        print(f"raised {type(exc).__name__}: {exc}")
        return
    await nc.close()
    print("connected")
anyio.run(main)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("given", ["path", "raw"])
def test_connect_with_a_creds_file_without_a_user_jwt_raises_instead_of_reading_for_ever(tmp_path, given):
    """README: a neighbour connects with ``streamproc.connect(...)``, nats-py's options included. With
    ``user_credentials`` naming a ``.creds`` file that holds the seed block and no JWT block (an
    nkey seed file taken for a creds file), nats-py 2.16's ``_read_creds_user_jwt`` loops on
    ``readline()`` at its end for ever, on the event loop, once the server sends its nonce: the
    connect never returned, whatever its ``connect_timeout`` (the same as ``--nats-creds-file``,
    tests/test_nats_auth.py). Run in a subprocess: that loop cannot be cancelled."""
    import subprocess
    import sys

    from nats_auth import Operator
    from streamproc.sim.embedded import EmbeddedNats

    operator = Operator()
    good = operator.creds(tmp_path / "good.creds")
    seed = good.read_text().split("-----BEGIN USER NKEY SEED-----\n")[1].split("\n")[0]
    broken = tmp_path / "seed.creds"
    broken.write_text(f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")
    with EmbeddedNats(jetstream=False, config=operator.server_config()) as server:
        outcomes = {}
        for name, path in (("good", good), ("broken", broken)):
            try:
                proc = subprocess.run([sys.executable, "-c", CONNECT_WITH_CREDS, server.url, str(path), given],
                                      capture_output=True, text=True, timeout=20)
                outcomes[name] = proc.stdout.strip() or proc.stderr[-500:]
            except subprocess.TimeoutExpired:
                outcomes[name] = "still connecting after 20 s (killed)"
    assert outcomes["good"] == "connected", outcomes
    assert outcomes["broken"].startswith("raised ConfigError: ") and "holds no user JWT" in outcomes["broken"], outcomes
    assert seed[2:] not in outcomes["broken"]


# ----------------------------------------------------------------- ChunkPublisher: bodies that are not bytes

@pytest.mark.parametrize("durable", [False, True])
async def test_a_body_of_wide_items_is_published_as_its_bytes_and_the_connection_survives(nats_url, durable):
    """``publish`` measured a body with ``len()``, and so did nats-py's PUB line: for a memoryview of
    4-byte items (an array or numpy buffer handed over without a copy) that is the item count, so the
    server read a 12-byte body as 3 bytes and the rest as protocol, and closed the connection; and a
    body of 4 x max_payload bytes passed the size check (its items fit), with the same end. Everything
    else on that connection (every other request's chunks, every subscription) went with it."""
    import array

    from streamproc.core.errors import PublishRefused

    problems: list[str] = []

    async def disconnected_cb() -> None:
        problems.append("disconnected")

    nc = await streamproc.connect(nats_url, disconnected_cb=disconnected_cb)
    try:
        if durable:
            await nc.jetstream().add_stream(name="CHUNKS_WIDE", subjects=["streamproc.chunks.>"])
        got: list[bytes] = []

        async def received(msg: Msg) -> None:
            got.append(msg.data)

        await nc.subscribe(SUBJECTS.chunk("wide", "agg"), cb=received)
        await nc.flush()
        publisher = ChunkPublisher(nc, durable=durable, timeout=1, retries=0)
        wide = array.array("i", [1, 2, 3])
        await publisher.publish("wide", "agg", 0, memoryview(wide))
        with pytest.raises(PublishRefused, match="max_payload") as info:
            await publisher.publish("wide", "agg", 1, memoryview(array.array("i", bytes(nc.max_payload))))
        assert not info.value.retryable
        with pytest.raises(TypeError, match="bytes"):
            await publisher.publish("wide", "agg", 1, "text, not bytes")  # type: ignore[arg-type]
        await publisher.publish("wide", "agg", 1, bytearray(b"after"), final=True)
        await nc.flush(2)
        await anyio.sleep(0.3)
        assert problems == [] and nc.is_connected
        assert got == [wide.tobytes(), b"after"]
    finally:
        await nc.close()


# ----------------------------------------------------------------- mint_capability

@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 1e300, 366 * 86_400 + 1, 0, -5])
def test_mint_capability_refuses_a_ttl_that_is_not_a_positive_bounded_number(ttl):
    """``streamproc token --ttl`` takes 0 < ttl <= 366 days; ``mint_capability``, the serving layer's
    call, checked ``ttl <= 0`` alone: NaN raised ``cannot convert float NaN to integer`` from
    ``round()``, inf an ``OverflowError``, and 1e300 minted a capability that never expires."""
    from streamproc import mint_capability

    with pytest.raises(ValueError, match=r"ttl must be more than 0 and at most 3\.16224e\+07 seconds"):
        mint_capability(b"k" * 32, rids=["req-1"], ttl=ttl)
    assert mint_capability(b"k" * 32, rids=["req-1"], ttl=366 * 86_400)  # the longest still minted


async def test_a_replay_pull_filled_to_its_exact_max_bytes_goes_on_at_once(client, nats_url):
    """nats-server ends a pull whose ``max_bytes`` the delivered messages use up exactly without a
    word (no 409, no 408 at its expiry: asked of the server below). A replay that waited for that
    pull's end status stalled until it took the pull for lost (``REPLAY_PULL_EXPIRES`` +
    ``REPLAY_PULL_LOST_AFTER``, 10 s) on a history whose first results fill the room exactly."""
    from nats.js.api import AckPolicy, ConsumerConfig

    bound = 1 << 20  # = the test server's max_payload: the first pull asks for exactly this
    js = client.jetstream()
    await ensure_results_stream(js, SUBJECTS)
    stream = await js.find_stream_name_by_subject(SUBJECTS.result("exact-p"))
    name = "streamproc_replay_" + "p" * 22  # as long as a replay consumer's name: its acks' reply subjects too
    async with connection(nats_url) as producer:  # a probe request as long, stored the same way, first
        await forge(producer, "exact-p", 0, b"a" * 500_000)
        await forge(producer, "exact-p", 1, b"b" * 900_000)
        await producer.flush()
    overhead = await pull_counted_size(js, client, stream, SUBJECTS.result("exact-p"), name, 1 << 20) - 500_000
    rid = "exact-r"
    async with connection(nats_url) as producer:
        await forge(producer, rid, 0, b"a" * 500_000)
        await forge(producer, rid, 1, b"b" * (bound - 500_000 - 2 * overhead))
        await forge(producer, rid, 2, b"c", final=True)
        await producer.flush()
    # the situation is real: a pull of `bound` bytes gets results 0 and 1 and then nothing at all
    other = "streamproc_replay_" + "q" * 22
    await js.add_consumer(stream, ConsumerConfig(name=other, filter_subject=SUBJECTS.result(rid),
                                                 ack_policy=AckPolicy.NONE))
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    await client.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{other}",
                         json.dumps({"batch": 10, "max_bytes": bound, "expires": 1_000_000_000}).encode(), reply=inbox)
    await anyio.sleep(2)
    probe = []
    with contextlib.suppress(nats.errors.TimeoutError):
        while True:
            probe.append(await sub.next_msg(timeout=0.1))
    await sub.unsubscribe()
    await js.delete_consumer(stream, other)
    assert [(m.headers or {}).get("Streamproc-Seq") for m in probe] == ["0", "1"], [m.headers for m in probe]
    started = time.monotonic()
    async with follow(client, SUBJECTS, rid, timeout=30, replay=True, max_buffered_bytes=bound) as results:
        got = [r.seq async for r in results]
    took = time.monotonic() - started
    assert got == [0, 1, 2]
    assert took < 3, f"the replay stalled {took:.1f} s after a pull that used up its max_bytes exactly"


async def test_a_replay_whose_consumer_fails_to_open_keeps_the_callers_deadline(client, monkeypatch):
    """``timeout`` is the caller's deadline for the final result: a reader that retries after the
    consumer's create failed (six times, 0.5 s each) still times out ``timeout`` after its first
    attempt, not ``timeout`` after the attempt that worked (each retry's subscribe() set it anew)."""
    rid = "replay-open-fails"
    await ensure_results_stream(client.jetstream(), SUBJECTS)  # nothing stored for rid: no final comes
    real_jetstream, failures = client.jetstream, []
    failed_until: list[float] = []  # when the last failed create ended

    def jetstream_failing(**kw):
        context = real_jetstream(**kw)
        real_add = context.add_consumer

        async def add_consumer(stream, config=None, **kw):
            if len(failures) < 6:
                failures.append(time.monotonic())
                await anyio.sleep(0.5)
                failed_until[:] = [time.monotonic()]
                raise nats.errors.TimeoutError
            return await real_add(stream, config=config, **kw)

        context.add_consumer = add_consumer
        return context

    monkeypatch.setattr(client, "jetstream", jetstream_failing)
    results = follow(client, SUBJECTS, rid, timeout=2, replay=True)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="within 2s") as timed_out:
        while True:
            try:
                async for _ in results:
                    raise AssertionError("nothing is stored")
            except nats.errors.TimeoutError:
                continue  # the create failed: try again
    ended = time.monotonic()
    took, past_creates = ended - started, ended - failed_until[0]
    assert type(timed_out.value) is TimeoutError
    assert len(failures) == 6
    # The 3 s of failed creates are past the 2 s deadline set at the first attempt: the next attempt
    # times out at once; a deadline set anew by the attempt that worked gives 2 s more. Timed from the
    # last failed create's end, not from the start (took < 3.8 s, 3.02-3.03 s beside two CPU burners:
    # the six 0.5 s sleeps' overshoot under load counted against the 0.8 s left).
    assert past_creates < 1.0, (
        f"timed out {past_creates:.2f} s after the failed creates ended ({took:.1f} s after the first "
        "attempt, timeout 2 s, 3 s of failed creates)")


async def test_a_replay_reader_cancelled_inside_a_pulls_publish_sends_no_second_pull(client, nats_url, monkeypatch):
    """A reader cancelled inside ``nc.publish`` of a pull (the PUB queued, the pull out) took the
    pull for not sent: iterating the same stream again sent a second one, both waited on the server,
    and a burst of live results filled both, twice the byte bound: ResultsOverrun. The suspension
    inside publish is injected (the real publish first, then a wait), on a real connection."""
    rid, n, size = "replay-cancelled-pull", 24, 65536
    await ensure_results_stream(client.jetstream(), SUBJECTS)  # a live tail: the pull waits on the server
    real_publish, inside = client.publish, anyio.Event()

    async def publish(subject, payload=b"", reply="", headers=None):
        await real_publish(subject, payload, reply=reply, headers=headers)
        if ".CONSUMER.MSG.NEXT." in subject and not inside.is_set():
            await client.flush()  # the pull is on the server
            inside.set()
            await anyio.sleep(30)  # cancelled here

    monkeypatch.setattr(client, "publish", publish)
    got = []
    async with follow(client, SUBJECTS, rid, timeout=30, replay=True, max_buffered_bytes=1 << 20) as results:
        async with anyio.create_task_group() as tg:
            tg.start_soon(results.__anext__)
            await inside.wait()
            tg.cancel_scope.cancel()
        async with anyio.create_task_group() as tg:
            async def first() -> None:
                got.append((await results.__anext__()).seq)

            tg.start_soon(first)
            await anyio.sleep(0.5)  # its pull waits on the server
            async with connection(nats_url) as producer:
                for seq in range(n):  # 1.5 MiB: more than one pull's room (1 MiB)
                    await forge(producer, rid, seq, b"p" * size, final=seq == n - 1)
                await producer.flush()
        await anyio.sleep(1.0)  # everything the pulls asked for has arrived
        got.extend([r.seq async for r in results])
    assert got == list(range(n))


async def test_a_replay_whose_consumers_are_deleted_again_and_again_ends_instead_of_renewing_for_ever(
        client, nats_url):
    """Another user of the same rights (the edges that share the one ``edge`` user can) deletes the
    replay's consumer as soon as it exists. The reader made a new one, pulled, found it gone, without
    limit (``timeout=None``: for ever, a consumer create and delete per round). Now, as at the edge,
    a consumer made again ``REPLAY_RENEWALS_MAX`` times in a row without an answer ends the stream."""
    from streamproc.nats.replay_pull import REPLAY_RENEWALS_MAX

    rid = "replay-deleted-again"
    await ensure_results_stream(client.jetstream(), SUBJECTS)
    async with connection(nats_url) as producer:
        await forge(producer, rid, 0, b"first")  # stored, not final: the reader then waits for more
        await producer.flush()
    js = client.jetstream()
    stream = await js.find_stream_name_by_subject(SUBJECTS.result(rid))
    deleted: set[str] = set()

    async def delete_every_consumer() -> None:
        while True:
            for info in await replay_consumers(js, rid):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_consumer(stream, info.name)
                    deleted.add(info.name)
            await anyio.sleep(0.002)

    with anyio.fail_after(20):
        results = follow(client, SUBJECTS, rid, timeout=None, replay=True)
        assert (await results.__anext__()).body == b"first"  # its consumer answered
        async with anyio.create_task_group() as tg:
            tg.start_soon(delete_every_consumer)
            with pytest.raises(TimeoutError) as ended:
                await results.__anext__()
            tg.cancel_scope.cancel()
    assert "made again" in str(ended.value), ended.value
    assert len(deleted) <= REPLAY_RENEWALS_MAX + 1, deleted
    assert await replay_consumers(js, rid) == []
