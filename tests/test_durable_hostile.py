"""Attacks and bugs against a real nats-server and `streamproc run --mode durable` subprocesses.

Durable mode adds what core mode does not have: a chunk that is not settled comes back. Each test
pins that whatever happens to one message, its request ends with a clear error result, the chunk is
settled (never redelivered without bound) and the other requests of the same partition are answered.
"""

from __future__ import annotations

import os

import anyio
import msgspec
import pytest
from conftest import processor_subprocess
from durable_helpers import ack_pending, chunk_stream_messages, connect, durable_flags, publish_paced, stored_results
from helpers import (NON_UTF8_HEADERS, broken_codec_site, expert_pd_legs, free_port, inflating_pd_legs, peak_rss, publish_repeated_joins, raw_hpub,
                     raw_protocol, rid, scrape, wait_until)

from streamproc.core.wire import SEQ, Subjects, chunk_headers
from streamproc.nats.streams import CHUNKS_STREAM, partition_consumer_name

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()
MiB = 1 << 20


def legit_body(request_id: str, seq: int) -> bytes:
    return f'{{"text":"{request_id}:{seq}","meta_info":{{"id":"{request_id}"}}}}'.encode()


async def publish_agg(js, request_id: str, chunks: int, **header_overrides: str) -> None:
    """A streamed aggregated request, published durably (PubAck per chunk)."""
    for seq in range(chunks):
        headers = chunk_headers(request_id, "agg", seq, final=seq == chunks - 1)
        headers.update(header_overrides)
        await js.publish(SUBJECTS.chunk(request_id, "agg"), legit_body(request_id, seq), headers=headers)


async def answered_in_full(js, legit: list[str], chunks: int, timeout: float = 30.0) -> dict:
    """Wait until every legitimate request's results 0..chunks-1 are stored, final last; return them all."""
    stored: dict = {}

    async def done() -> bool:
        nonlocal stored
        stored = await stored_results(js, SUBJECTS)
        return all(len(stored.get(r, [])) == chunks for r in legit)

    await wait_until(done, timeout, "every legitimate request answered", every=0.3)
    for r in legit:
        results = stored[r]
        assert [x.seq for x in results] == list(range(chunks)) and results[-1].final
        assert [x.body for x in results] == [legit_body(r, s) for s in range(chunks)]
        assert all(x.error is None for x in results)
    return stored


async def test_a_chunk_on_its_max_deliver_th_delivery_is_terminated_and_its_request_ends_with_an_error(
        nats_url, tmp_path):
    """Two deliveries lost (as if two processors crashed on the chunk), then the third, with
    --max-deliver 3: the request ends with an internal error naming the cause, the chunk is
    terminated (gone from the work queue, never delivered again), counted, and the requests beside it
    in the same partition are answered."""
    flags = durable_flags(partitions=1, max_deliver=3)
    with processor_subprocess(nats_url, *flags):
        pass  # creates the streams and the partition's consumer
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.consumer_info(CHUNKS_STREAM, partition_consumer_name(0))
        assert info.config.max_deliver == 3  # the server's backstop is the same bound
        poison = rid("poison")
        await publish_agg(js, poison, 1)
        crashed = await js.pull_subscribe_bind(durable=partition_consumer_name(0), stream=CHUNKS_STREAM)
        for delivery in (1, 2):
            [msg] = await crashed.fetch(1, timeout=5)
            assert msg.metadata.num_delivered == delivery
            await msg.nak()  # a processor that dies on the chunk: it comes back
        await crashed.unsubscribe()

        port = free_port()
        with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, log_path):
            legit = [rid("ok") for _ in range(20)]
            for r in legit:
                await publish_agg(js, r, 3)
            stored = await answered_in_full(js, legit, 3)
            stored = await stored_results(js, SUBJECTS)
            [error] = stored[poison]
            assert error.final and error.error == "internal", error
            assert b"delivered 3 times without being settled (max_deliver 3): dropped as poison" in error.body
            await wait_until(lambda: scrape(port).get("streamproc_durable_terminated_total") == 1, 10,
                             "the poison chunk terminated")
            metrics = scrape(port)
            assert metrics["streamproc_durable_poisoned_total"] == 1
            assert metrics['streamproc_error_results_total{kind="internal"}'] == 1
            assert await chunk_stream_messages(js) == 0  # nothing left to redeliver
            info = await js.consumer_info(CHUNKS_STREAM, partition_consumer_name(0))
            assert info.num_ack_pending == 0 and info.num_redelivered == 0
            text = log_path.read_text()
            assert text.count("event=chunk_poisoned") == 1 and "deliveries=3" in text
            assert proc.poll() is None and peak_rss(proc.pid) < 200 * MiB
    finally:
        await nc.close()


async def test_a_message_whose_handling_raises_ends_its_request_and_is_settled_not_redelivered(
        nats_url, tmp_path):
    """A decode chunk naming a codec whose join raises and whose error_body then raises too
    (helpers.BrokenCodec) made the durable handler raise: the chunk
    was never acknowledged and came back every ack wait, for ever. Now the request ends with an
    internal error result, the chunk is acknowledged once that is stored, and the other requests
    of the partition are answered."""
    site = broken_codec_site(tmp_path)
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    port = free_port()
    with processor_subprocess(nats_url, *durable_flags(partitions=1), "--http-port", str(port),
                              env=env) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            victim = rid("victim")
            legit = [rid("ok") for _ in range(20)]
            for i, r in enumerate(legit):
                if i == 10:
                    for seq in range(2):  # a decode leg: its join session is the codec's (it raises)
                        await js.publish(SUBJECTS.chunk(victim, "decode"), b"{}", headers={
                            **chunk_headers(victim, "decode", seq, final=seq == 1), "Streamproc-Format": "broken"})
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3)
            stored = await stored_results(js, SUBJECTS)
            assert victim in stored, log_path.read_text()[-3000:]
            [error] = stored[victim]
            assert error.seq == 0 and error.final and error.error == "internal", error
            assert b"broken codec: every call raises" in error.body
            # Its second chunk arrives after the request ended: settled as late, nothing more published.
            await wait_until(lambda: scrape(port).get("streamproc_late_total", 0) >= 1, 10, "the late chunk")
            await anyio.sleep(2 * 2.0 + 0.5)  # two ack waits: anything unsettled would have come back
            assert await chunk_stream_messages(js) == 0
            info = await js.consumer_info(CHUNKS_STREAM, partition_consumer_name(0))
            assert info.num_ack_pending == 0 and info.num_redelivered == 0
            metrics = scrape(port)
            assert metrics["streamproc_internal_errors_total"] == 1
            assert metrics["streamproc_durable_redelivered_total"] == 0
            assert len((await stored_results(js, SUBJECTS))[victim]) == 1
            text = log_path.read_text()
            assert "event=message_failed" in text and proc.poll() is None
            assert peak_rss(proc.pid) < 200 * MiB
        finally:
            await nc.close()


async def test_held_prefill_legs_never_stall_their_partition_the_longest_idle_are_shed(nats_url):
    """2,100 prefill legs whose decode leg never comes, into one partition at the default
    max_ack_pending (2,048): they used to fill it, and nothing else in the partition moved until
    --request-timeout (300 s). Now the partition sheds its longest-idle holders (overloaded) past 3/4
    of max_ack_pending, and requests published after the attack are answered at once."""
    from streamproc.catalog import worker_for
    from streamproc.sim.simulation import make_truth

    [prefill_body] = worker_for("sglang").prefill(make_truth(0, prompt_len=8, output_len=2), stream=False)
    port = free_port()
    with processor_subprocess(nats_url, *durable_flags(partitions=1), "--http-port", str(port)) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            held = [rid("held") for _ in range(2100)]
            for r in held:
                await js.publish(SUBJECTS.chunk(r, "prefill"), prefill_body,
                                 headers=chunk_headers(r, "prefill", 0, final=True))
            legit = [rid("ok") for _ in range(20)]
            started = anyio.current_time()
            for r in legit:
                await publish_agg(js, r, 3)
            stored = await answered_in_full(js, legit, 3, timeout=60)
            took = anyio.current_time() - started
            print(f"20 legitimate requests answered {took:.1f}s after the attack")
            assert took < 30, took  # --request-timeout is 300 s: nothing waited for it
            # Shedding keeps the partition at most 3/4 full: at least 2,100 - 1,536 legs end, whatever the timing.
            await wait_until(lambda: scrape(port).get("streamproc_shed_total", 0) >= 2100 - 2048 * 3 // 4, 20,
                             "the partition back under 3/4 of max_ack_pending")
            shed: list[str] = []

            async def every_shed_request_answered() -> bool:
                nonlocal stored, shed
                stored = await stored_results(js, SUBJECTS)
                shed = [r for r in held if r in stored]
                return len(shed) == scrape(port)["streamproc_shed_total"]

            await wait_until(every_shed_request_answered, 20, "an error result for every shed request", every=0.3)
            assert len(shed) >= 2100 - 2048 * 3 // 4
            for r in shed:
                [error] = stored[r]
                assert error.seq == 0 and error.final and error.error == "overloaded", error
            assert b"unacknowledged chunks (more than 3/4 of max_ack_pending 2048)" in stored[shed[0]][0].body
            assert "event=partition_shed" in log_path.read_text()
            assert peak_rss(proc.pid) < 200 * MiB
            assert proc.poll() is None
        finally:
            await nc.close()


@pytest.mark.parametrize("limits, problem", [
    ({"discard": "new", "max_msgs": 1000}, "discard is 'new' with max_msgs 1000: once reached, every result is refused"),
    ({"discard": "new", "max_bytes": 1 << 20}, "discard is 'new' with max_bytes 1048576"),
    ({"max_msg_size": 1024}, "max_msg_size is 1024 bytes, below the server's max_payload 1048576"),
    # no PubAck ever came: result seq 0 was re-sent for hours, nothing logged
    ({"no_ack": True}, "no_ack is true: the stream sends no PubAck, so no result is ever confirmed stored"),
    # discard old: only each request's last result was kept
    ({"max_msgs_per_subject": 1}, "max_msgs_per_subject is 1: past 1 messages on one subject the stream drops the "
                                  "older ones"),
    ({"max_msgs_per_subject": 100_000}, "max_msgs_per_subject is 100000"),
    ({"discard": "new", "max_msgs_per_subject": 5, "discard_new_per_subject": True},
     "max_msgs_per_subject is 5: past 5 messages on one subject the stream refuses the rest"),
    # discard old: such a stream PubAcks a large result, then evicts it and every other at once
    ({"max_bytes": 100_000}, ("max_bytes is 100000, below one result of the server's max_payload 1048576 as "
                              "stored (1048885 bytes): such a result is acknowledged, then evicted with every other")),
])
async def test_a_results_stream_that_cannot_store_results_is_refused_at_start_up(nats_url, run_cli, limits, problem):
    from nats.js.api import DiscardPolicy, StreamConfig

    from streamproc.core.defaults import DUPLICATE_WINDOW, RESULTS_MAX_AGE
    from streamproc.nats.streams import RESULTS_STREAM

    if "discard" in limits:
        limits = {**limits, "discard": DiscardPolicy(limits["discard"])}
    nc = await connect(nats_url)
    try:
        await nc.jetstream().add_stream(StreamConfig(
            name=RESULTS_STREAM, subjects=[SUBJECTS.all_results], max_age=RESULTS_MAX_AGE,
            duplicate_window=DUPLICATE_WINDOW, allow_direct=True, **limits))
    finally:
        await nc.close()
    proc = await anyio.to_thread.run_sync(lambda: run_cli("run", "--nats-url", nats_url, *durable_flags()))
    assert proc.returncode == 2, proc.stderr
    assert f"streamproc run: error: JetStream stream '{RESULTS_STREAM}' cannot store every result: {problem}" \
        in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("limits, problem", [
    ({"max_msgs": 100}, "discard is 'old' with max_msgs 100: once reached, the oldest seal records of requests "
                        "still served are evicted"),
    ({"no_ack": True}, "no_ack is true: no seal record write is ever confirmed"),
])
async def test_a_migrations_bucket_that_would_lose_seal_records_is_refused_at_start_up(nats_url, run_cli, limits,
                                                                                         problem):
    from nats.js.api import DiscardPolicy, StreamConfig

    from streamproc.nats.streams import CHUNKS_STREAM

    bucket = f"{CHUNKS_STREAM}_MIGRATIONS"
    nc = await connect(nats_url)
    try:  # a key-value bucket as nats-py creates one, with the odd limit
        await nc.jetstream().add_stream(StreamConfig(
            name=f"KV_{bucket}", subjects=[f"$KV.{bucket}.>"], max_msgs_per_subject=1, allow_rollup_hdrs=True,
            deny_delete=True, allow_direct=True, discard=DiscardPolicy.OLD, **limits))
    finally:
        await nc.close()
    proc = await anyio.to_thread.run_sync(lambda: run_cli("run", "--nats-url", nats_url, *durable_flags()))
    assert proc.returncode == 1, proc.stderr
    assert f"streamproc run: error: JetStream stream 'KV_{bucket}' does not match the requested migrations bucket: " \
        f"{problem}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


async def test_a_result_the_stream_never_stores_ends_its_request_with_an_error_after_bounded_retries(nats_url):
    """The results stream's max_msg_size lowered after start-up: one result can never be stored. It
    is given up at its first refusal (the same every time: err_code 10054), its chunk redelivered and
    given up again, and on the
    chunk's --max-deliver-th delivery the request ends with an error result (small enough to store)
    naming why; the chunk is terminated. Nothing retries for ever, and the partition goes on."""
    from streamproc.nats.streams import RESULTS_STREAM

    big = rid("big")
    port = free_port()
    flags = durable_flags(partitions=1, max_result_attempts=2, max_deliver=3)
    with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, _log):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            results = (await js.stream_info(RESULTS_STREAM)).config
            results.max_msg_size = 1024
            await js.update_stream(results)
            await js.publish(SUBJECTS.chunk(big, "agg"), b'{"text":"' + b"x" * 2000 + b'"}',
                             headers=chunk_headers(big, "agg", 0, final=True))
            legit = [rid("ok") for _ in range(10)]
            for r in legit:
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3)

            async def ended() -> bool:
                return big in await stored_results(js, SUBJECTS)

            await wait_until(ended, 60, "the request ended with an error result", every=0.3)
            [error] = (await stored_results(js, SUBJECTS))[big]
            assert error.seq == 0 and error.final and error.error == "internal", error
            assert (b"delivered 3 times without being settled (max_deliver 3): dropped as poison; "
                    b"result seq 0 was not stored after 1 attempts (it is larger than the results stream's max_msg_size)"
                    ) in error.body, error.body
            await wait_until(lambda: scrape(port).get("streamproc_durable_terminated_total") == 1, 10,
                             "the chunk terminated")
            metrics = scrape(port)
            assert metrics["streamproc_durable_results_given_up_total"] == 2  # deliveries 1 and 2
            assert metrics["streamproc_durable_poisoned_total"] == 1
            assert await chunk_stream_messages(js) == 0
            assert proc.poll() is None and peak_rss(proc.pid) < 200 * MiB
        finally:
            await nc.close()


async def test_a_result_too_large_to_send_inside_a_batch_leaves_no_gap_after_it(nats_url):
    """A worker sends a streamed request's seq 1 at exactly ``max_payload`` (a short header block:
    its result's longer block cannot be sent) with seqs 2 and 3 right behind it: seqs 1-3 leave as
    one fast batch. Seq 1 cannot be sent, so its request is given up; seqs 2 and 3, already handed
    to the pump, must not leave alone (they were stored after the gap, and the request resumed past
    the missing seq 1 without an error). The request ends in order, with an error result at seq 1,
    and a request beside it is answered in full."""
    victim = rid("gap")
    flags = durable_flags(partitions=1, max_deliver=2, ack_wait=1.0)
    with processor_subprocess(nats_url, *flags) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            subject = SUBJECTS.chunk(victim, "agg").encode()
            block = b"NATS/1.0\r\nStreamproc-Seq:1\r\n\r\n"
            await raw_protocol(nats_url, [
                raw_hpub(subject, b"NATS/1.0\r\nStreamproc-Seq:0\r\n\r\n", b"zero"),
                raw_hpub(subject, block, b"x" * (nc.max_payload - len(block))),
                raw_hpub(subject, b"NATS/1.0\r\nStreamproc-Seq:2\r\n\r\n", b"two"),
                raw_hpub(subject, b"NATS/1.0\r\nStreamproc-Seq:3\r\nStreamproc-Final:true\r\n\r\n", b"three"),
            ])
            legit = [rid("ok")]
            await publish_agg(js, legit[0], 3)
            await answered_in_full(js, legit, 3)

            async def ended() -> bool:
                return any(r.final for r in (await stored_results(js, SUBJECTS)).get(victim, []))

            await wait_until(ended, 60, "the victim's request ended", every=0.3)
            await anyio.sleep(1.5)  # an ack_wait more: a redelivery would store what comes after
            stored = (await stored_results(js, SUBJECTS))[victim]
            log = log_path.read_text(errors="replace")
            assert [r.seq for r in stored] == [0, 1], (stored, log[-3000:])
            assert stored[0].body == b"zero" and stored[1].error == "internal" and stored[1].final, stored
            assert "result_given_up" in log and "seq=1" in log, log[-3000:]
            assert proc.poll() is None
        finally:
            await nc.close()


async def test_results_whose_puback_never_comes_are_logged_rate_limited(nats_url):
    """A results stream switched to no_ack after start-up answers no publish: result 0 was re-sent
    for hours and nothing was logged. Every overdue PubAck is now a rate-limited warning naming the
    request and its attempts so far, and counted."""
    from streamproc.nats.streams import RESULTS_STREAM

    port = free_port()
    with processor_subprocess(nats_url, *durable_flags(partitions=1), "--http-port", str(port)) as (proc, log):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            results = (await js.stream_info(RESULTS_STREAM)).config
            results.no_ack = True
            await js.update_stream(results)
            quiet = [rid("quiet") for _ in range(30)]
            for r in quiet:
                await publish_agg(js, r, 1)
            await wait_until(lambda: "event=result_puback_overdue" in log.read_text(), 20,
                             "an overdue PubAck logged")
            text = log.read_text()
            assert "seq=0 attempts=1 max_attempts=100" in text, text[-2000:]
            await wait_until(lambda: "event=log_suppressed suppressed_event=result_puback_overdue" in log.read_text(),
                             25, "the rest counted, not written")
            assert log.read_text().count(" event=result_puback_overdue") <= 20 * 2  # the burst per 10 s interval
            assert scrape(port)["streamproc_durable_pubacks_overdue_total"] >= 30
            assert proc.poll() is None
        finally:
            await nc.close()


async def test_joins_that_inflate_run_off_the_event_loop_in_durable_mode_too(nats_url):
    """The core-mode attack of tests/test_hostile.py against a durable processor: 20 P/D requests whose
    joins each decode 2 x 32 MiB of expert rows. Passthrough round trips (publish with PubAck ->
    result stored and received) measured while they run stay close to idle ones, and every heavy
    request is joined."""
    import time

    prefill, decode = inflating_pd_legs(prompt=2048)
    flags = durable_flags(partitions=1, format="sglang-zstd")
    with processor_subprocess(nats_url, *flags) as (proc, _log):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            arrived: dict[str, anyio.Event] = {}
            finals: dict[str, dict[str, str]] = {}

            async def on_result(msg) -> None:
                request_id = SUBJECTS.request_id_of_result(msg.subject)
                finals[request_id] = dict(msg.headers or {})
                arrived.setdefault(request_id, anyio.Event()).set()

            await nc.subscribe(SUBJECTS.all_results, cb=on_result)

            async def round_trips(tag: str, n: int) -> list[float]:
                out = []
                for k in range(n):
                    r = rid(f"{tag}{k}")
                    arrived[r] = anyio.Event()
                    start = time.perf_counter()
                    await publish_agg(js, r, 1)
                    with anyio.fail_after(10):
                        await arrived[r].wait()
                    out.append(time.perf_counter() - start)
                    await anyio.sleep(0.005)
                return sorted(out)

            p90_over_idle = []
            for attempt in range(2):  # a second paired round only when the first one's p90 misses (below)
                idle = await round_trips("idle", 40)
                heavy = [rid("heavy") for _ in range(20)]
                for r in heavy:
                    for role, body in (("prefill", prefill), ("decode", decode)):
                        await js.publish(SUBJECTS.chunk(r, role), body,
                                         headers=chunk_headers(r, role, 0, final=True, format="sglang-zstd"))
                busy = await round_trips("busy", 40)
                await wait_until(lambda: all(r in finals for r in heavy), 60, "every heavy request answered")
                print(f"round {attempt}: durable passthrough round trip idle p50 {idle[20] * 1e3:.1f} ms p90 "
                      f"{idle[36] * 1e3:.1f} ms max {idle[-1] * 1e3:.1f} ms; during joins p50 "
                      f"{busy[20] * 1e3:.1f} ms p90 {busy[36] * 1e3:.1f} ms max {busy[-1] * 1e3:.1f} ms")
                assert {finals[r].get("Streamproc-Join") for r in heavy} == {"joined"}
                # Inline, the round trip that arrives behind the joins waits for all of them: max 1.6 s
                # measured with offload_joins off in this test (p50 and p90 unchanged, so the max is what
                # tells). Off the loop the max was 16-63 ms; 0.5 s leaves room for a shared, loaded 2-core
                # machine. Asserted in every round measured.
                assert busy[-1] < 0.500 and busy[20] < idle[20] + 0.050, (idle, busy)
                p90_over_idle.append(busy[36] - idle[36])
                if p90_over_idle[-1] <= 0.024:
                    break
            # Paired p90 (a join step holding the GIL slows every round trip; main's old bytes.join splice
            # gave +18.3 to +30.8 ms). On 2 shared cores the durable round trip also crosses nats-server,
            # which competes for them: with the joins' thread at nice +10, p90 -12.5 to +23.7 ms over idle
            # in 30 runs (median +2.9; 7 above +5 ms, 3 above +15), main's code interleaved -7.3 to +31.0
            # (median +4.5; 14 above +5 ms), load average 4.4-11.9 (2026-12-01, docs/operations.md).
            # Bound: the tightest that held in all 30 (15 ms, the bound before, failed 3 of them), so
            # its margin over this code's worst round is ~1x: one of two paired rounds must hold it, as
            # in tests/test_hostile.py (a load-made miss is not repeated by the second round's
            # independent scheduling but at that rate squared). The old splice, which a single round
            # already let through in part, is caught directly by tests/test_join_gil_hold.py.
            assert min(p90_over_idle) <= 0.024, p90_over_idle
            assert peak_rss(proc.pid) < 300 * MiB
        finally:
            await nc.close()


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_deeply_nested_json_on_a_pd_leg_ends_as_invalid_chunk_not_internal(nats_url, leg):
    """100k-deep nested JSON made the codec's parser raise RecursionError, reported as `internal`."""
    from streamproc.catalog import worker_for
    from streamproc.sim.simulation import make_truth

    worker = worker_for("sglang")
    truth = make_truth(0, prompt_len=8, output_len=2)
    bodies = {"prefill": worker.prefill(truth, stream=False)[0], "decode": worker.decode(truth, stream=False)[-1]}
    bodies[leg] = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    with processor_subprocess(nats_url, *durable_flags(partitions=1)) as (proc, _log):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            deep = rid("deep")
            for role in ("prefill", "decode"):
                await js.publish(SUBJECTS.chunk(deep, role), bodies[role],
                                 headers=chunk_headers(deep, role, 0, final=True))
            legit = [rid("ok") for _ in range(5)]
            for r in legit:
                await publish_agg(js, r, 2)
            await answered_in_full(js, legit, 2)

            async def ended() -> bool:
                return deep in await stored_results(js, SUBJECTS)

            await wait_until(ended, 20, "the deep request ended", every=0.3)
            [error] = (await stored_results(js, SUBJECTS))[deep]
            assert error.final and error.error == "invalid_chunk", error
            assert b"nested too deeply to parse" in error.body, error.body
            assert await chunk_stream_messages(js) == 0 and proc.poll() is None
            assert peak_rss(proc.pid) < 200 * MiB
        finally:
            await nc.close()


async def test_a_request_whose_joins_pass_the_decode_time_budget_ends_overloaded_others_are_answered(nats_url):
    """CPU amplification: a streamed P/D request whose 20 decode chunks each inflate 2 x 32 MiB of rows
    (~60 ms of CPU per join). With --max-decode-cpu 0.2 it is ended after a few joins, overloaded,
    instead of costing 1.2 s of CPU; the requests beside it are answered."""
    prefill, decode = inflating_pd_legs(prompt=2048)
    port = free_port()
    flags = durable_flags(partitions=1, format="sglang-zstd", max_decode_cpu=0.2)
    with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, _log):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            heavy = rid("heavy")
            await publish_repeated_joins(js.publish, heavy, prefill, decode, 20)
            legit = [rid("ok") for _ in range(10)]
            for r in legit:
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3)

            async def ended() -> bool:
                got = (await stored_results(js, SUBJECTS)).get(heavy, [])
                return bool(got) and got[-1].final

            await wait_until(ended, 30, "the heavy request ended", every=0.3)
            got = (await stored_results(js, SUBJECTS))[heavy]
            *joined, error = got
            print(f"{len(joined)} joins published before the budget ended the request")
            assert 1 <= len(joined) < 19, [(x.seq, x.verdict, x.error) for x in got]
            assert [x.seq for x in got] == list(range(len(got)))
            assert all(x.verdict is not None and x.verdict.value == "joined" for x in joined)
            assert error.final and error.error == "overloaded", error
            assert b"decode time budget exhausted" in error.body and b"max_decode_cpu 0.2 s" in error.body
            assert scrape(port)["streamproc_over_cpu_total"] == 1
            assert proc.poll() is None and peak_rss(proc.pid) < 300 * MiB  # as the core-mode join test
        finally:
            await nc.close()


async def test_the_decode_time_budget_counts_the_codecs_compression_threads_in_durable_mode(nats_url):
    """As in core mode: 12 joins of ~8 ms in the join thread and ~75 ms in the process (zstd level 6
    recompressing the rows on 2 threads) pass --max-decode-cpu 0.15 after a few joins; with the join
    thread's CPU alone all 12 were joined. The requests beside it are answered. (0.3 s let 11 of 12
    through on a fast machine, where a join took ~25 ms in the process: the core-mode test's note.)"""
    prefill, decode = expert_pd_legs(prompt=700)
    port = free_port()
    flags = durable_flags(partitions=1, format="sglang-zstd", max_decode_cpu=0.15,
                          format_option="zstd_level=6,zstd_threads=2")
    with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, _log):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            burn = rid("burn")
            await publish_repeated_joins(js.publish, burn, prefill, decode, 12)
            legit = [rid("ok") for _ in range(10)]
            for r in legit:
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3)

            async def ended() -> bool:
                got = (await stored_results(js, SUBJECTS)).get(burn, [])
                return bool(got) and got[-1].final

            await wait_until(ended, 60, "the burning request ended", every=0.3)
            *joined, error = (await stored_results(js, SUBJECTS))[burn]
            print(f"{len(joined)} joins published before the budget ended the request")
            assert len(joined) < 11 and all(x.verdict.value == "joined" for x in joined), [x.seq for x in joined]
            assert error.final and error.error == "overloaded", error
            assert b"decode time budget exhausted" in error.body
            assert scrape(port)["streamproc_over_cpu_total"] == 1
            assert proc.poll() is None
        finally:
            await nc.close()


async def test_existing_partition_consumers_get_the_current_max_deliver(nats_url):
    """Consumers made by an earlier version (max_deliver unlimited) or with another --max-deliver are
    updated at start-up, like ack_wait and max_ack_pending."""
    from nats.js.api import ConsumerConfig

    with processor_subprocess(nats_url, *durable_flags(partitions=1)):
        pass
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        name = partition_consumer_name(0)
        info = await js.consumer_info(CHUNKS_STREAM, name)
        assert info.config.max_deliver == 20  # the default
        old = ConsumerConfig.from_response(info.config.as_dict())
        old.max_deliver = -1  # as the previous version made it
        await js.add_consumer(CHUNKS_STREAM, old)
        assert (await js.consumer_info(CHUNKS_STREAM, name)).config.max_deliver == -1
        with processor_subprocess(nats_url, *durable_flags(partitions=1, max_deliver=7)):
            assert (await js.consumer_info(CHUNKS_STREAM, name)).config.max_deliver == 7
    finally:
        await nc.close()


STRAY_SUBJECTS = ["streamproc.chunks.*.prefill", "streamproc.chunks.*.agg", "streamproc.chunks.>.decode",
                  "streamproc.chunks.abc.*", "streamproc.chunks.abc.>", "streamproc.chunks.*.*"]


async def test_chunks_with_a_wildcard_token_are_stored_untransformed_then_swept_from_the_chunk_stream(nats_url):
    """nats-server takes a JetStream publish to ``P.chunks.*.prefill`` or ``P.chunks.>.x`` (PubAck, not
    "no responders") and stores it under that subject: the partition transform refuses a subject with
    a wildcard token. No partition consumer reads it, so it stayed in the work queue until max_age,
    counting against max_bytes. Now every instance sweeps them (terminated, counted, logged) and the
    requests beside them are answered."""
    from streamproc.client.publisher import ChunkPublisher
    from streamproc.nats.durable.strays import STRAY_CONSUMER

    flags = durable_flags(partitions=2)
    with processor_subprocess(nats_url, *flags):
        pass  # creates the streams
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        for bad in ("*", ">", "a*b"):  # the publisher helper never makes such a subject
            with pytest.raises(ValueError, match="invalid request id"):
                await ChunkPublisher(nc, durable=True).publish(bad, "agg", 0, b"{}", final=True)
        for k, subject in enumerate(STRAY_SUBJECTS):
            headers = chunk_headers(f"stray{k}", "agg", 0, final=True)
            ack = await js.publish(subject, b'{"text":"stray"}', headers=headers)
            assert ack.stream == CHUNKS_STREAM and not ack.duplicate
        state = (await js.stream_info(CHUNKS_STREAM, subjects_filter=">")).state
        assert state.subjects == {s: 1 for s in STRAY_SUBJECTS}  # stored as published, no partition

        port = free_port()
        with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, log_path):
            legit = [rid("ok") for _ in range(20)]
            for r in legit:
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3)
            await wait_until(lambda: scrape(port).get("streamproc_durable_strays_total") == len(STRAY_SUBJECTS),
                             20, "every stray swept\n" + log_path.read_text()[-3000:])
            assert scrape(port)["streamproc_unreadable_total"] == len(STRAY_SUBJECTS)
            assert await chunk_stream_messages(js) == 0  # nothing left against the stream's limits
            info = await js.consumer_info(CHUNKS_STREAM, STRAY_CONSUMER)
            assert info.config.filter_subject == "streamproc.chunks.>"
            assert info.num_ack_pending == 0 and info.num_redelivered == 0
            assert set(await stored_results(js, SUBJECTS)) == set(legit)  # nothing answered for a stray
            text = log_path.read_text()
            assert text.count("event=unreadable_message") == len(STRAY_SUBJECTS)
            assert "subject=streamproc.chunks.>.decode" in text and "stored it untransformed" in text
            assert "stray_sweep_failed" not in text
            # A stray published while the processor runs goes the same way.
            await js.publish("streamproc.chunks.*.agg", b"{}", headers=chunk_headers("late-stray", "agg", 0))
            await wait_until(lambda: scrape(port).get("streamproc_durable_strays_total") == len(STRAY_SUBJECTS) + 1,
                             20, "the later stray swept")

            async def empty() -> bool:
                return await chunk_stream_messages(js) == 0

            await wait_until(empty, 5, "the later stray gone")
            assert proc.poll() is None
            assert peak_rss(proc.pid) < 150 * MiB  # the core-mode bound: a swept stray holds nothing
    finally:
        await nc.close()


async def test_a_chunk_stream_byte_limit_below_one_maximal_chunk_is_refused_at_start_up(nats_url, run_cli):
    """--chunks-max-bytes 100 used to create a stream that refuses every chunk. Now start-up exits 2 in
    one line naming the flag, the value and the least usable limit, before anything is created; and
    that least limit is exact: one chunk of max_payload bytes (headers + body) under the longest
    stored subject fits in it, and not in one byte less."""
    from nats.js.api import StorageType
    from nats.js.errors import APIError, NotFoundError

    from streamproc.core.defaults import CHUNKS_MAX_AGE, DUPLICATE_WINDOW
    from streamproc.core.partitions import PartitionScheme
    from streamproc.core.wire import MAX_REQUEST_ID_LEN
    from streamproc.nats.streams import ChunkStreamSpec, chunk_stream_minimum

    max_payload = 1 << 20  # nats-server's default, as EmbeddedNats runs it
    scheme = PartitionScheme(SUBJECTS, 4)
    minimum = chunk_stream_minimum(scheme, max_payload)
    proc = await anyio.to_thread.run_sync(
        lambda: run_cli("run", "--nats-url", nats_url, *durable_flags(partitions=4, chunks_max_bytes=100)))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(
        f"streamproc run: error: --chunks-max-bytes 100 cannot hold one chunk of the server's max_payload "
        f"{max_payload}: use at least {minimum} "), proc.stderr
    nc = await connect(nats_url)
    try:
        assert nc.max_payload == max_payload
        js = nc.jetstream()
        with pytest.raises(NotFoundError):
            await js.stream_info(CHUNKS_STREAM)  # refused before anything was created

        spec = ChunkStreamSpec(CHUNKS_STREAM, scheme, CHUNKS_MAX_AGE, DUPLICATE_WINDOW, StorageType.FILE, 1, minimum - 1)
        await js.add_stream(spec.config())
        longest = "r" * MAX_REQUEST_ID_LEN
        headers = chunk_headers(longest, "prefill", 0, final=True)
        header_block = len(b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n")
        body = bytes(max_payload - header_block)  # the largest message the server takes
        with pytest.raises(APIError, match="maximum bytes exceeded"):
            await js.publish(SUBJECTS.chunk(longest, "prefill"), body, headers=headers)
        spec = msgspec.structs.replace(spec, max_bytes=minimum)
        await js.update_stream(spec.config())
        ack = await js.publish(SUBJECTS.chunk(longest, "prefill"), body, headers=headers)
        assert ack.seq == 1
        with processor_subprocess(nats_url, *durable_flags(partitions=4, chunks_max_bytes=minimum)) as (p, _log):
            assert p.poll() is None  # the least limit is accepted
    finally:
        await nc.close()


# ------------------------------------------------------------- core-mode attacks, durable versions
# tests/test_hostile.py runs each against a core-mode processor; here the chunks go through the chunk
# stream with PubAcks, so what core mode loses (a dropped connection) durable mode would redeliver.

POISON_SEQS = ["²", "٠", "１", "-1", "1e3", "0x1"]


async def test_poison_seqs_are_settled_at_their_first_delivery_with_invalid_chunk(nats_url):
    """A `Streamproc-Seq` of `²` passed str.isdigit() and int() raised: durable mode never acked the chunk
    and redelivered it every ack wait (2,048 of them stalled a partition); `٠` was taken as 0. Each
    now ends its request with one invalid_chunk result naming the header, and its chunk is settled at
    its first delivery: nothing is redelivered, nothing reaches max_deliver, the partition goes on."""
    port = free_port()
    with processor_subprocess(nats_url, *durable_flags(partitions=1), "--http-port", str(port)) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            legit = [rid("ok") for _ in range(30)]
            poisoned = {}
            for i, r in enumerate(legit):
                if i % 5 == 0:
                    bad = rid("bad")
                    poisoned[bad] = POISON_SEQS[i // 5]
                    await publish_agg(js, bad, 1, **{SEQ: poisoned[bad]})
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3)

            async def all_ended() -> bool:
                return set(poisoned) <= set(await stored_results(js, SUBJECTS))

            await wait_until(all_ended, 20, "every poisoned request ended", every=0.3)
            await anyio.sleep(2 * 2.0 + 0.5)  # two ack waits: anything unsettled would have come back
            stored = await stored_results(js, SUBJECTS)
            for bad, seq in poisoned.items():
                [error] = stored[bad]  # one result, never a second one from a redelivery
                assert error.seq == 0 and error.final and error.error == "invalid_chunk", (seq, error)
                assert SEQ.encode() in error.body, (seq, error.body)
            assert await chunk_stream_messages(js) == 0
            info = await js.consumer_info(CHUNKS_STREAM, partition_consumer_name(0))
            assert info.num_ack_pending == 0 and info.num_redelivered == 0
            metrics = scrape(port)
            assert metrics['streamproc_error_results_total{kind="invalid_chunk"}'] == len(poisoned)
            assert metrics["streamproc_durable_redelivered_total"] == 0
            assert metrics["streamproc_durable_poisoned_total"] == 0  # settled long before max_deliver
            text = log_path.read_text()
            assert "event=nats_error" not in text and "event=message_failed" not in text
            assert proc.poll() is None and peak_rss(proc.pid) < 150 * MiB  # the core-mode bound
        finally:
            await nc.close()


@pytest.mark.parametrize("separator", ["\x0b", "\x0c"])
async def test_ids_with_bytes_nats_py_splits_on_are_settled_and_the_connection_survives(nats_url, separator):
    """A request id holding VT/FF is one token to nats-server, and the chunk stream stores it; stock
    nats-py's parser split the delivered subject and dropped the processor's connection, and in
    durable mode the chunk came back every ack wait and dropped it again (3 of 2,000 legitimate
    requests answered). Now the processor reads it, counts it unreadable and settles it; every
    legitimate request is answered and the connection never drops."""
    port = free_port()
    with processor_subprocess(nats_url, *durable_flags(partitions=2), "--http-port", str(port)) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            legit = [rid("ok") for _ in range(200)]
            evil = 0
            for i, r in enumerate(legit):
                if i % 20 == 0:  # published raw: ChunkPublisher refuses such ids
                    evil += 1
                    await js.publish(f"streamproc.chunks.evil{separator}{i}.agg", b"{}",
                                     headers=chunk_headers(f"evil{i}", "agg", 0, final=True))
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3, timeout=60)
            await wait_until(lambda: scrape(port).get("streamproc_unreadable_total") == evil, 10,
                             "every evil chunk counted")
            await anyio.sleep(2 * 2.0 + 0.5)  # two ack waits: anything unsettled would have come back
            assert await chunk_stream_messages(js) == 0
            assert await ack_pending(js, 2) == [0, 0]
            metrics = scrape(port)
            assert metrics["streamproc_durable_redelivered_total"] == 0
            assert metrics["streamproc_unreadable_total"] == evil
            assert metrics["streamproc_durable_strays_total"] == 0  # stored partitioned: read by the partitions
            assert not any(r.startswith("evil") for r in await stored_results(js, SUBJECTS))  # never answered
            text = log_path.read_text()
            assert "event=disconnected" not in text and "ProtocolError" not in text, text[-2000:]
            assert "event=unreadable_message" in text
            assert proc.poll() is None and peak_rss(proc.pid) < 150 * MiB
        finally:
            await nc.close()


async def test_a_reorder_backlog_is_cut_at_the_per_request_byte_cap_in_durable_mode(nats_url):
    """300 chunks of ~1 MB behind a withheld seq 0, stored in the chunk stream: the request ends at
    --max-buffered-bytes (32 MiB) with invalid_chunk, every chunk of it is settled (the rest as late),
    the requests beside it are answered, and the processor's peak RSS stays under the core-mode bound
    although up to 1.5 pull batches (384 MB) could be in flight to it."""
    payload = bytes(1_000_000)
    port = free_port()
    with processor_subprocess(nats_url, *durable_flags(partitions=1), "--http-port", str(port)) as (proc, _log):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            hoarder = rid("hoarder")
            legit = [rid("ok") for _ in range(30)]
            for seq in range(1, 301):
                await js.publish(SUBJECTS.chunk(hoarder, "agg"), payload, headers=chunk_headers(hoarder, "agg", seq))
                if seq % 10 == 0:
                    await publish_agg(js, legit[seq // 10 - 1], 3)
            await answered_in_full(js, legit, 3, timeout=60)

            async def ended() -> bool:
                return hoarder in await stored_results(js, SUBJECTS)

            await wait_until(ended, 30, "the hoarder ended", every=0.3)
            [error] = (await stored_results(js, SUBJECTS))[hoarder]  # nothing of the backlog was published
            assert error.seq == 0 and error.final and error.error == "invalid_chunk", error
            assert b"max_buffered_bytes" in error.body or b"buffered" in error.body, error.body

            async def drained() -> bool:
                return await chunk_stream_messages(js) == 0

            await wait_until(drained, 30, "every chunk of the hoarder settled", every=0.3)
            assert scrape(port)["streamproc_durable_poisoned_total"] == 0
            assert proc.poll() is None
            assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB
        finally:
            await nc.close()


async def test_many_requests_under_the_per_request_cap_are_stopped_by_the_global_budget_in_durable_mode(nats_url):
    """20 requests x 20 MB of backlog (400 MB in all, each under the 32 MiB cap), stored in the chunk
    stream of one partition: past the 96 MiB global budget the biggest holders end as overloaded at once (in
    stream order, as in core mode, unless chunks were redelivered: seen in 2 of about 25 runs on the
    loaded machine, cause not established); the requests beside
    them are answered; peak RSS stays under the core-mode bound. Pulls are bounded in bytes
    (``max_bytes``): with message credit alone up to 1.5 batches of 1 MB chunks could wait in
    nats-py's queue while the handler was slow (201-380 MiB in 4 of about 25 runs before)."""
    payload = bytes(1_000_000)
    port = free_port()
    # At the default ack wait: the tests' 2 s lets a loaded machine redeliver held chunks.
    flags = durable_flags(partitions=1, ack_wait=10.0)
    with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            hogs = [rid(f"hog{k}") for k in range(20)]
            legit = [rid("ok") for _ in range(20)]
            for k, hog in enumerate(hogs):
                for seq in range(1, 21):
                    await js.publish(SUBJECTS.chunk(hog, "agg"), payload, headers=chunk_headers(hog, "agg", seq))
                await publish_agg(js, legit[k], 3)
            await answered_in_full(js, legit, 3, timeout=60)
            ended: dict[str, str] = {}

            async def past_budget_ended() -> bool:
                nonlocal ended
                stored = await stored_results(js, SUBJECTS)
                ended = {h: stored[h][-1].error for h in hogs if h in stored}
                return len(ended) >= 15

            await wait_until(past_budget_ended, 30, "the hogs past the budget ended", every=0.3)
            assert set(ended.values()) == {"overloaded"}, ended
            # 5 x 20 MB fit in the budget, a sixth does not, whatever the order.
            assert len(ended) == 15, (len(ended), log_path.read_text()[-3000:])
            if scrape(port)["streamproc_durable_redelivered_total"] == 0:
                # Delivered in stream order (no recovery lookup failed and NAKed a hog's chunk under load):
                # the last five stay, exactly as in core mode.
                assert set(ended) == set(hogs[:15]), ended
            assert scrape(port)["streamproc_over_budget_total"] >= 15
            assert proc.poll() is None
            assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB
        finally:
            await nc.close()


async def test_the_global_budget_holds_under_concurrent_attackers_beside_legitimate_traffic_in_durable_mode(nats_url):
    """The two global-budget attacks above at once and heavier, over the default 8 partitions, from 7
    concurrent publisher tasks on 3 connections: 40 hogs x 20 MB of backlog behind a withheld seq 0 (800
    MB stored, 4 publishers), 16 P/D requests whose 12 KB prefill inflates to 64 MiB of rows, held open
    by a non-final decode chunk (one publisher), and 300 legitimate streamed requests of 3 chunks (two
    publishers) beside them. Every legitimate request is answered in full; at most 5 hogs stay open
    (5 x 20 MB is all the 96 MiB budget holds), every other ends overloaded; no inflating request is
    joined; the processor's peak RSS stays under the 200 MiB of the single-attack tests. What fills it:
    ~49 MiB of process at rest, the full 96 MiB budget (sampled: 95 MiB buffered), and chunks in flight,
    which the budget does not see. With 16 MiB of pull per partition they were 6.8-38 MiB (delivered,
    waiting in nats-py's subscription queues; 3 runs sampled) and peak RSS 164-202 MiB in 34 runs, 7 of
    them >= 182 MiB, one failure at 202 MiB; with 16 MiB shared by the partitions (nats/durable/pulls.py) at
    most 4.9 MiB in flight and 164-176 MiB in 22 runs (2026-12-01, 1, 4 and 8 partitions, load
    average 2-9 from other engineers' runs). The rest (docs/operations.md, "where the rest of the
    peak goes"; 12 runs sampled, VmHWM 162-176 MiB): ~20 MiB of shared libraries, 8.5-27 MiB of free
    glibc heap left resident by ended hogs' bodies, 22-29 MiB of Python objects and code."""
    payload = bytes(1_000_000)
    prefill, decode = inflating_pd_legs()
    port = free_port()
    flags = durable_flags(partitions=8, format="sglang-zstd", ack_wait=10.0)  # held chunks: no redelivery churn
    with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, log_path):
        conns = [await connect(nats_url) for _ in range(3)]
        try:
            hogs = [rid(f"hog{k}") for k in range(40)]
            inflaters = [rid("inflate") for _ in range(16)]
            legit = [rid("ok") for _ in range(300)]

            async def hog(js, mine: list[str]) -> None:
                for seq in range(1, 21):  # round robin over this publisher's hogs: all grow at once
                    for h in mine:
                        await js.publish(SUBJECTS.chunk(h, "agg"), payload, headers=chunk_headers(h, "agg", seq))

            async def inflate(js) -> None:
                for attacker in inflaters:
                    await js.publish(SUBJECTS.chunk(attacker, "prefill"), prefill,
                                     headers=chunk_headers(attacker, "prefill", 0, final=True, format="sglang-zstd"))
                    await js.publish(SUBJECTS.chunk(attacker, "decode"), decode,
                                     headers=chunk_headers(attacker, "decode", 0, format="sglang-zstd"))  # never final
                    await anyio.sleep(0.1)

            async def serve(js, mine: list[str]) -> None:
                for r in mine:
                    await publish_agg(js, r, 3)
                    await anyio.sleep(0.01)

            jss = [nc.jetstream() for nc in conns]
            async with anyio.create_task_group() as tg:
                for k in range(4):
                    tg.start_soon(hog, jss[k % 2], hogs[k::4])
                tg.start_soon(inflate, jss[2])
                tg.start_soon(serve, jss[2], legit[0::2])
                tg.start_soon(serve, jss[1], legit[1::2])
            await answered_in_full(jss[0], legit, 3, timeout=90)
            stored: dict = {}

            async def attackers_settled() -> bool:
                nonlocal stored
                stored = await stored_results(jss[0], SUBJECTS)
                return all(a in stored for a in inflaters) and sum(h in stored for h in hogs) >= 35

            await wait_until(attackers_settled, 60, "the inflaters answered and the hogs past the budget ended\n"
                             + log_path.read_text()[-3000:], every=0.5)
            ended = {h: stored[h][-1].error for h in hogs if h in stored}
            assert set(ended.values()) == {"overloaded"}, ended
            assert len(ended) >= 35, len(ended)
            outcomes = [stored[a][0].error or stored[a][0].verdict.value for a in inflaters]
            assert set(outcomes) <= {"omitted", "overloaded"}, outcomes
            metrics = scrape(port)
            print(f"hogs ended {len(ended)}/40, inflaters {sorted(outcomes)}, over_budget "
                  f"{metrics['streamproc_over_budget_total']:.0f}, redelivered "
                  f"{metrics['streamproc_durable_redelivered_total']:.0f}")
            assert proc.poll() is None
            assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB
        finally:
            for nc in conns:
                await nc.close()


async def test_decoded_prefill_rows_of_held_requests_are_charged_to_the_global_budget_in_durable_mode(nats_url):
    """Issue item 4 against a durable processor: 16 P/D requests whose 12 KB prefill inflates to 64 MiB
    of expert rows, each held open by a decode chunk that carries rows but is not final (their chunks
    stay unacknowledged in the chunk stream). 1,066 MiB before; now the decoded bytes are charged to
    --max-total-bytes (96 MiB): every decode past it is refused before it allocates (omitted or
    overloaded, never joined from 64 MiB), the requests beside them are answered in full, and the
    processor's peak RSS stays under 200 MiB."""
    prefill, decode = inflating_pd_legs()
    flags = durable_flags(partitions=1, format="sglang-zstd", ack_wait=10.0)  # held chunks: no redelivery churn
    with processor_subprocess(nats_url, *flags) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            attackers = [rid("inflate") for _ in range(16)]
            legit = [rid("ok") for _ in range(32)]
            for k, attacker in enumerate(attackers):
                await js.publish(SUBJECTS.chunk(attacker, "prefill"), prefill,
                                 headers=chunk_headers(attacker, "prefill", 0, final=True, format="sglang-zstd"))
                await js.publish(SUBJECTS.chunk(attacker, "decode"), decode,
                                 headers=chunk_headers(attacker, "decode", 0, format="sglang-zstd"))  # never final
                for r in legit[2 * k:2 * k + 2]:
                    await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3, timeout=90)
            stored: dict = {}

            async def every_attacker_answered() -> bool:
                nonlocal stored
                stored = await stored_results(js, SUBJECTS)
                return all(a in stored for a in attackers)

            await wait_until(every_attacker_answered, 60, "a seq-0 result for every attacker\n"
                             + log_path.read_text()[-3000:], every=0.5)
            outcomes = []
            for attacker in attackers:
                first = stored[attacker][0]
                assert first.seq == 0, first
                outcomes.append(first.error or (first.verdict.value if first.verdict else None))
                if first.verdict is not None and first.verdict.value == "omitted":
                    assert b'"routed_experts_unavailable_reason":"too_large"' in first.body, first.body[:500]
            print("attack outcomes:", outcomes)
            assert set(outcomes) <= {"omitted", "overloaded"} and "joined" not in outcomes, outcomes
            assert proc.poll() is None
            assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB
        finally:
            await nc.close()


async def test_non_utf8_subjects_and_header_bytes_are_settled_and_the_connection_survives(nats_url):
    """The raw-socket attack of tests/test_hostile.py into the chunk stream: a core ``PUB`` whose id
    token is not UTF-8 and ``HPUB``s whose header blocks hold such bytes are stored (nats-server
    takes bytes; it drops a forged inline status line when storing); the processor reads them from
    its partition without its connection dropping, the
    unreadable subjects are counted and settled, every header victim is answered as its block allows
    and every chunk is settled (nothing redelivered); the legitimate requests are answered in full."""
    port = free_port()
    with processor_subprocess(nats_url, *durable_flags(partitions=2), "--http-port", str(port)) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            legit = [rid("ok") for _ in range(100)]
            victims: list[str] = []
            for i, r in enumerate(legit):
                if i % 10 == 0:
                    k = i // 10
                    victims.append(rid(f"hdr{k}"))
                    await raw_protocol(nats_url, [
                        b"PUB streamproc.chunks.bad\xff\xfe%d.agg 2\r\n{}\r\n" % k,
                        raw_hpub(f"streamproc.chunks.{victims[-1]}.agg".encode(),
                                 NON_UTF8_HEADERS[k % len(NON_UTF8_HEADERS)][0], b"{}"),
                    ])
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3, timeout=60)

            stored: dict = {}

            async def victims_answered() -> bool:
                nonlocal stored
                stored = await stored_results(js, SUBJECTS)
                return all(v in stored for v in victims)

            await wait_until(victims_answered, 20, "every header victim answered\n" + log_path.read_text()[-3000:],
                             every=0.3)
            await wait_until(lambda: scrape(port).get("streamproc_unreadable_total") == len(victims), 10,
                             "every non-UTF-8 subject counted unreadable")
            await anyio.sleep(2 * 2.0 + 0.5)  # two ack waits: anything unsettled would have come back
            stored = await stored_results(js, SUBJECTS)
            for k, v in enumerate(victims):
                [result] = stored[v]  # one result, never a second one from a redelivery
                block, expected = NON_UTF8_HEADERS[k % len(NON_UTF8_HEADERS)]
                if block.startswith(b"NATS/1.0 503"):
                    # nats-server stores the block without its inline status line (read back with
                    # $JS.API.STREAM.MSG.GET: "NATS/1.0\r\nStreamproc-Seq: 0..."): an ordinary chunk here.
                    expected = None
                assert result.final, result
                if expected is None:
                    assert result.error is None and result.body == b"{}", result
                else:
                    assert result.error == "invalid_chunk" and expected in result.body, result
            assert not any(r.startswith("bad") for r in stored)
            assert await chunk_stream_messages(js) == 0
            assert await ack_pending(js, 2) == [0, 0]
            assert scrape(port)["streamproc_durable_redelivered_total"] == 0
            text = log_path.read_text(errors="replace")
            assert "event=disconnected" not in text and "event=nats_error" not in text, text[-3000:]
            assert proc.poll() is None and peak_rss(proc.pid) < 150 * MiB
        finally:
            await nc.close()


async def test_backlogs_holding_the_global_budget_are_ended_to_make_room_in_durable_mode(nats_url):
    """Four 25 MB backlogs behind a withheld seq 0 hold the 96 MiB budget; legitimate requests that need a
    buffer (P/D with a 200 KB prefill leg waiting for its decode leg, an out-of-order chunk) came after
    and were refused overloaded. Now the biggest backlog is ended to make room; they are answered in full."""
    payload = bytes(1_000_000)
    with processor_subprocess(nats_url, *durable_flags(partitions=1, ack_wait=10.0)) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            hogs = [rid(f"hog{k}") for k in range(4)]
            for hog in hogs:
                for seq in range(1, 26):
                    await js.publish(SUBJECTS.chunk(hog, "agg"), payload, headers=chunk_headers(hog, "agg", seq))
            probe = rid("probe")  # behind the backlogs in the partition: they are all buffered once it is answered
            await publish_agg(js, probe, 1)
            await answered_in_full(js, [probe], 1, timeout=60)
            assert not set(hogs) & set(await stored_results(js, SUBJECTS))  # 100 MB fit: none ended yet
            pds, ooos = [rid("pd") for _ in range(5)], [rid("ooo") for _ in range(5)]
            for r in pds:
                pre = f'{{"text":"","meta_info":{{"id":"{r}","pad":"{"x" * 200_000}"}}}}'.encode()
                await js.publish(SUBJECTS.chunk(r, "prefill"), pre, headers=chunk_headers(r, "prefill", 0, final=True))
            for r in ooos:
                await js.publish(SUBJECTS.chunk(r, "agg"), legit_body(r, 1), headers=chunk_headers(r, "agg", 1, final=True))
            await anyio.sleep(0.5)
            for r in pds:
                await js.publish(SUBJECTS.chunk(r, "decode"), legit_body(r, 0),
                                 headers=chunk_headers(r, "decode", 0, final=True))
            for r in ooos:
                await js.publish(SUBJECTS.chunk(r, "agg"), legit_body(r, 0), headers=chunk_headers(r, "agg", 0))
            await answered_in_full(js, pds, 1, timeout=60)
            stored = await answered_in_full(js, ooos, 2, timeout=60)
            ended = {h: stored[h][-1] for h in hogs if h in stored}
            assert ended, "no backlog was ended to make room"
            for result in ended.values():
                assert result.error == "overloaded" and b"ended to make room" in result.body, result
            assert peak_rss(proc.pid) < 200 * MiB, peak_rss(proc.pid) / MiB
            assert proc.poll() is None
        finally:
            await nc.close()


async def test_messages_on_a_pull_inbox_that_are_no_delivery_or_status_are_ignored_and_counted(nats_url):
    """Only JetStream should publish to a partition's pull inbox, but what arrives there is not taken
    on trust: a message without a ``Status`` header was read as a status (pull credit reset, pulls
    held back, a lost pull masked), and one with a reply that is no ack subject was parsed as a
    chunk, outside the chunk stream and its permissions. Both are now counted and ignored."""
    flags = durable_flags(partitions=1)
    port = free_port()
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        inboxes: set[str] = set()

        async def heartbeat(msg) -> None:  # the server's idle heartbeats name the pull inbox
            if (msg.headers or {}).get("Status") == "100":
                inboxes.add(msg.subject)

        await nc.subscribe("_INBOX.streamproc.>", cb=heartbeat)
        with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, log_path):
            await wait_until(lambda: bool(inboxes), 20, "an idle heartbeat on the pull inbox")
            inbox = next(iter(inboxes))
            forged = rid("forged")
            await nc.publish(inbox, b"")  # no headers at all
            await nc.publish(inbox, b"{}", headers={"Description": "No Responders"})  # no Status
            await nc.publish(inbox, legit_body(forged, 0), reply="not.an.ack",
                             headers=chunk_headers(forged, "agg", 0, final=True))
            await nc.flush()
            await wait_until(lambda: scrape(port).get("streamproc_durable_inbox_strays_total") == 3, 20,
                             "three inbox strays counted\n" + log_path.read_text()[-3000:])
            legit = [rid("ok") for _ in range(5)]
            for r in legit:
                await publish_agg(js, r, 3)
            await answered_in_full(js, legit, 3)
            assert forged not in await stored_results(js, SUBJECTS)  # the forged chunk made no result
            metrics = scrape(port)
            assert metrics["streamproc_durable_consumer_repairs_total"] == 0  # "No Responders" is no miss
            assert metrics.get("streamproc_unreadable_total", 0) == 0
            assert "event=inbox_stray" in log_path.read_text()
            assert proc.poll() is None
    finally:
        await nc.close()


async def test_requests_adopted_as_finished_by_a_lookup_are_forgotten_after_the_grace_and_held_within_max_finished(
        nats_url):
    """A late chunk of a request this instance does not know costs a recovery lookup, and one that
    finds the final result stored adopts the id as finished (``Correlator.resume``). A hostile worker
    can do that for every old id it knows, one ~10-byte chunk each, so the adopted ids must be
    remembered like any finished id: for ``--finished-grace`` and within ``--max-finished`` (and
    ``--max-finished-bytes``), then forgotten (the next late chunk pays a lookup again).

    The worker here gives each round's chunks a fresh ``Nats-Msg-Id``, as a hostile one would: with
    the same id (``chunk_headers``' default, ``<id>.<role>.<attempt>.<seq>``) nats-server drops the
    repeats within ``--duplicate-window`` (2 min) and the processor never sees them, which looks as
    if the adopted ids were remembered past the grace (seen: 200 ids sent 4 times 2.5 s apart with
    ``--finished-grace 1``, 200 lookups and 200 late chunks in all; with fresh ids 800 and 800).
    Measured with ``--partitions 2`` (2-core machine): 100,000 distinct adopted ids of 200 characters
    in ~55 s, VmRSS 49 -> 86 MiB at the defaults (the 32 MiB charge stops it at ~92,000 ids), 49 ->
    52 MiB with ``--max-finished 1000``. One partition: its lookups are made in arrival order, so
    the ids adopted last are the ones sent last."""
    n, cap = 300, 100
    ids = [rid(f"adopt{i}") for i in range(n)]
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()

        async def drained() -> bool:
            return await chunk_stream_messages(js) == 0

        async def stored() -> int:
            return (await js.stream_info("STREAMPROC_RESULTS")).state.messages

        async def late_round(name: str, which: list[str], port: int) -> float:
            """One late chunk (seq 1) per id, each with a fresh Nats-Msg-Id; the lookups made by now."""
            messages = []
            for r in which:
                headers = chunk_headers(r, "agg", 1, final=True)
                headers["Nats-Msg-Id"] += f".{name}"
                messages.append((SUBJECTS.chunk(r, "agg"), b'{"text":"late"}', headers))
            await publish_paced(nc, messages, window=64)
            await wait_until(drained, 30, f"round {name}'s late chunks settled", every=0.1)
            return scrape(port)["streamproc_durable_recoveries_total"]

        grace = 1.0
        port = free_port()
        flags = durable_flags(partitions=1, finished_grace=grace)
        with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, log_path):
            before = await stored()
            await publish_paced(nc, [(SUBJECTS.chunk(r, "agg"), b"{}", chunk_headers(r, "agg", 0, final=True))
                                     for r in ids], window=64)
            await wait_until(lambda: _at_least(stored, before + n), 30, "every request's result stored")
            await anyio.sleep(grace + 1.5)  # its own finished ids forgotten
            assert await late_round("a", ids, port) == n  # each adopted as finished by a lookup
            # Each adoption is logged rate limited (LogLimiter: 20 lines per event and 10 s), not once per chunk.
            resumed = log_path.read_text(errors="replace").count("event=request_resumed ")
            assert 1 <= resumed <= 60, f"{resumed} request_resumed lines for {n} late chunks"
            await anyio.sleep(grace + 1.5)
            assert await late_round("b", ids, port) == 2 * n, "adopted ids remembered past --finished-grace"
            assert scrape(port)["streamproc_late_total"] == 2 * n
            assert proc.poll() is None
        port = free_port()
        flags = durable_flags(partitions=1, finished_grace=60.0, max_finished=cap)
        with processor_subprocess(nats_url, *flags, "--http-port", str(port)) as (proc, _):
            assert await late_round("c", ids, port) == n  # a fresh instance knows none of them
            # The ids adopted last are remembered (within the grace and the cap): no lookup.
            assert await late_round("d", ids[-cap // 5:], port) == n
            looked_up = await late_round("e", ids, port) - n  # at once, well within the grace
            assert n - cap <= looked_up <= n, f"{looked_up} lookups: adopted ids held past --max-finished {cap}"
            assert scrape(port)["streamproc_late_total"] == 2 * n + cap // 5
            assert proc.poll() is None
        assert await stored() == before + n  # a late chunk gets no new result
    finally:
        await nc.close()


async def _at_least(count, target: int) -> bool:
    return await count() >= target
