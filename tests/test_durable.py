"""Durable mode in-process over a real nats-server: partitions, streams, acks, recovery, hand-over, bounds.

Fault tests with real process kills and server restarts are in ``test_durable_faults.py``.
"""

from __future__ import annotations

import logging
import random
import time

import anyio
import pytest
from nats.js.api import DiscardPolicy, StorageType

from streamproc import config
from streamproc.sim import traffic
from streamproc.catalog import worker_for
from streamproc.sim.embedded import EmbeddedNats
from streamproc.core.partitions import PartitionScheme, fnv1a32, partition_of
from streamproc.nats.fast_client import FastClient
from streamproc.nats.processor import Processor, StartupError
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import ResultCollector, follow
from streamproc.nats.streams import (
    CHUNKS_STREAM,
    RESULTS_STREAM,
    ChunkStreamMismatch,
    ChunkStreamSpec,
    ensure_chunk_stream,
    ensure_results_stream,
    partition_consumer_name,
)
from streamproc.wire import Result, Subjects, Verdict, result_headers

from durable_helpers import (
    FORMAT,
    ack_pending,
    chunk_stream_messages,
    durable_settings,
    stored_results,
)
from helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


# ------------------------------------------------------------------------------ partitions

def test_fnv1a32_matches_the_published_test_vectors():
    assert fnv1a32(b"") == 0x811C9DC5
    assert fnv1a32(b"a") == 0xE40C292C
    assert fnv1a32(b"foobar") == 0xBF9CF968


@pytest.mark.parametrize("partitions", [8, 3])
async def test_partition_of_matches_where_the_server_stores_each_request(client, partitions):
    subjects = config.load({}, {"prefix": f"pm{partitions}"}).subjects
    js = client.jetstream()
    scheme = PartitionScheme(subjects, partitions)
    await ensure_chunk_stream(js, ChunkStreamSpec(f"PM{partitions}", scheme, 600, 60, StorageType.MEMORY))
    rng = random.Random(partitions)
    ids = [f"{rng.getrandbits(64):x}-{i}" for i in range(1000)] + ["a", "request-1", "Ω-unicode"]
    for rid in ids:
        for role in ("prefill", "decode"):
            await client.publish(subjects.chunk(rid, role), b"")
    await client.flush()

    async def all_stored() -> bool:
        return await chunk_stream_messages(js, f"PM{partitions}") == 2 * len(ids)

    await wait_until(all_stored, 10, "every chunk stored")
    info = await js.stream_info(f"PM{partitions}", subjects_filter=">")
    stored = info.state.subjects or {}
    assert sum(stored.values()) == 2 * len(ids)
    where: dict[str, set[int]] = {}
    for subject in stored:
        _, _, n, rid, _ = subject.split(".")
        where.setdefault(rid, set()).add(int(n))
    assert {rid: parts for rid, parts in where.items() if parts != {partition_of(rid, partitions)}} == {}
    assert len(where) == len(ids)  # both legs of each request in one partition, computed identically


# ---------------------------------------------------------------------------------- modes

async def test_auto_mode_is_durable_with_jetstream_and_core_without(nats_url, caplog):
    caplog.set_level(logging.INFO, logger="streamproc")
    async with Processor(config.load({}, {"nats_url": nats_url})) as p:
        assert p.mode == "durable"
    with EmbeddedNats(jetstream=False) as plain:
        async with Processor(config.load({}, {"nats_url": plain.url})) as p:
            assert p.mode == "core"
    assert "event=mode_selected mode=durable" in caplog.text
    assert "event=mode_selected mode=core" in caplog.text


async def test_durable_mode_without_jetstream_is_a_start_up_error():
    with EmbeddedNats(jetstream=False) as plain:
        with pytest.raises(StartupError, match="needs JetStream"):
            async with Processor(config.load({}, {"nats_url": plain.url, "mode": "durable"})):
                pass


async def test_streams_get_the_configured_limits_and_a_differing_stream_is_refused_unchanged(client, nats_url):
    settings = durable_settings(nats_url, partitions=5, chunks_max_age=900, results_max_age=1800,
                                duplicate_window=30, stream_storage="memory")
    async with Processor(settings):
        js = client.jetstream()
        chunks = (await js.stream_info(CHUNKS_STREAM)).config
        results = (await js.stream_info(RESULTS_STREAM)).config
    assert chunks.subjects == ["streamproc.chunks.*.*"]
    assert chunks.subject_transform.dest == "streamproc.partition.{{partition(5,1)}}.{{wildcard(1)}}.{{wildcard(2)}}"
    assert (chunks.max_age, chunks.duplicate_window, chunks.storage) == (900, 30, StorageType.MEMORY)
    assert (results.max_age, results.duplicate_window, results.storage) == (1800, 30, StorageType.MEMORY)

    with pytest.raises(StartupError, match="partition") as info:
        async with Processor(durable_settings(nats_url, partitions=6, chunks_max_age=900, results_max_age=1800,
                                              duplicate_window=30, stream_storage="memory")):
            pass
    assert "never edits" in str(info.value)
    assert "partition(5,1)" in (await js.stream_info(CHUNKS_STREAM)).config.subject_transform.dest
    with pytest.raises(ChunkStreamMismatch, match="max_age"):
        await ensure_chunk_stream(js, ChunkStreamSpec(CHUNKS_STREAM, PartitionScheme(settings.subjects, 5),
                                                      60, 30, StorageType.MEMORY))


@pytest.mark.parametrize("change, problem", [
    ({"discard": "old"}, "discard is 'old', not 'new' (at a limit the stream would drop unprocessed chunks"),
    ({"max_msgs_per_subject": 1}, "max_msgs_per_subject is 1: past 1 messages on one subject the stream drops the "
                                  "older ones (a leg's chunks all share its subject"),
    ({"no_ack": True}, "no_ack is true: the stream sends no PubAck"),
    ({"allow_rollup_hdrs": True}, "allow_rollup_hdrs is true: one chunk with a 'Nats-Rollup: all' header would "
                                  "purge every unprocessed chunk"),
])
async def test_a_chunk_stream_that_would_lose_or_never_confirm_chunks_is_refused_unchanged(client, change, problem):
    """A pre-created chunk stream that drops a leg's unprocessed chunks (discard old, a per-subject
    limit), never sends PubAcks (no_ack) or lets any worker purge it (allow_rollup_hdrs: checked
    against nats-server, 9 chunks of three requests stored, one worker's chunk with ``Nats-Rollup:
    all`` PubAcked, 1 message left) is refused by name, not used."""
    subjects = Subjects(f"chunkodd{sorted(change)[0].replace('_', '')}")
    spec = ChunkStreamSpec(f"CHUNKS_ODD_{sorted(change)[0].upper()}", PartitionScheme(subjects, 2), 60, 30,
                           StorageType.MEMORY)
    js = client.jetstream()
    odd = spec.config()
    for name, value in change.items():
        setattr(odd, name, DiscardPolicy(value) if name == "discard" else value)
    await js.add_stream(odd)
    try:
        with pytest.raises(ChunkStreamMismatch) as info:
            await ensure_chunk_stream(js, spec)
        assert problem in str(info.value), str(info.value)
        await js.delete_stream(spec.name)
        await ensure_chunk_stream(js, spec)  # the spec's own stream is accepted
    finally:
        await js.delete_stream(spec.name)


# --------------------------------------------------------------------------- settlement

async def test_a_chunk_is_acknowledged_only_after_its_result_is_stored(client, nats_url):
    settings = durable_settings(nats_url)
    js = client.jetstream()
    async with Processor(settings) as p:
        await js.delete_stream(RESULTS_STREAM)  # results cannot be stored for now
        publisher = ChunkPublisher(client, settings.subjects)
        for i in range(6):
            await publisher.publish(f"held-{i}", "agg", 0, f"body-{i}".encode(), final=True)
        await wait_until(lambda: p.snapshot()["chunks"] == 6 and p.snapshot()["publish_errors"] > 0, 10,
                         "results tried and refused")
        await anyio.sleep(0.5)
        assert sum(await ack_pending(js, settings.partitions)) == 6
        assert await chunk_stream_messages(js) == 6  # nothing acknowledged, nothing lost
        assert p.snapshot()["acks"] == 0

        await ensure_results_stream(js, settings.subjects, duplicate_window=settings.duplicate_window)
        await wait_until(_empty(js), 15, "every chunk acknowledged once its retried result was stored")
        stored = await stored_results(js, settings.subjects)
    assert {rid: [(s.seq, s.body) for s in got] for rid, got in stored.items()} == {
        f"held-{i}": [(0, f"body-{i}".encode())] for i in range(6)}
    assert p.snapshot()["publish_retries"] > 0


async def test_decided_chunks_waiting_for_their_results_pubacks_keep_no_body(client, nats_url):
    """A decided chunk whose result is not stored yet waits in the outbox only for its ack; its token
    keeps nothing of the chunk's body. Late chunks of a finished request (settled behind its final
    result) and the chunk of that result itself, with nothing stored: their ``Msg`` bodies were
    ~1 MB each outside every budget for as long as PubAcks lagged (tests/test_durable_hostile.py,
    concurrent attackers, under CPU load: up to 19 MiB). Then the results stream is back and every
    chunk is acknowledged once its result is stored."""
    settings = durable_settings(nats_url)
    js = client.jetstream()
    body = b'{"text": "' + b"z" * 200_000 + b'"}'
    async with Processor(settings) as p:
        await js.delete_stream(RESULTS_STREAM)  # results cannot be stored for now
        publisher = ChunkPublisher(client, settings.subjects)
        await publisher.publish("bodiless", "agg", 0, b'{"text": "0"}', final=True)
        await wait_until(lambda: p.snapshot()["publish_errors"] > 0, 10, "the final result tried and refused")
        for seq in range(1, 11):  # late: settled behind the final result, which waits for its PubAck
            await publisher.publish("bodiless", "agg", seq, body)
        await wait_until(lambda: p.snapshot()["chunks"] == 11, 10, "every chunk decided")
        tokens = list(p._input.outbox.tokens())
        assert len(tokens) == 11
        held = sum(len(getattr(t, "data", b"") or b"") for t in tokens)
        assert held == 0, f"{held} bytes of chunk bodies kept by {len(tokens)} decided, unacknowledged chunks"
        assert p.snapshot()["acks"] == 0

        await ensure_results_stream(js, settings.subjects, duplicate_window=settings.duplicate_window)
        await wait_until(_empty(js), 15, "every chunk acknowledged once the result was stored")
        stored = await stored_results(js, settings.subjects)
    assert [(s.seq, s.body, s.final) for s in stored["bodiless"]] == [(0, b'{"text": "0"}', True)]


async def test_a_result_the_stream_keeps_refusing_is_given_up_its_input_redelivered_and_stored_later(
        client, nats_url, caplog):
    caplog.set_level(logging.INFO, logger="streamproc")
    settings = durable_settings(nats_url, max_result_attempts=2)
    js = client.jetstream()
    small, big = b'{"text": "0"}', b'{"text": "' + b"x" * 400 + b'"}'
    async with Processor(settings) as p:
        results = (await js.stream_info(RESULTS_STREAM)).config
        results.max_msg_size = 200  # seq 1 cannot be stored: every publish of it is refused
        await js.update_stream(results)
        publisher = ChunkPublisher(client, settings.subjects)
        await publisher.publish("refused", "agg", 0, small)
        await publisher.publish("refused", "agg", 1, big, final=True)
        await wait_until(lambda: p.snapshot()["results_given_up"] >= 2, 15,
                         "given up, NAKed, redelivered, recovered and given up again")
        assert await chunk_stream_messages(js) == 1  # seq 0 acknowledged; seq 1 never, nor lost
        # refused for its size, the same every time: given up at its first refusal, not after max_result_attempts
        assert ("event=result_given_up request_id=refused seq=1 attempts=1 reason=\"it is larger than the results "
                "stream's max_msg_size\"") in caplog.text

        results.max_msg_size = -1
        await js.update_stream(results)
        await wait_until(_empty(js), 15, "the redelivered chunk stored and acknowledged at last")
        stored = await stored_results(js, settings.subjects)
    assert [(s.seq, s.body) for s in stored["refused"]] == [(0, small), (1, big)]
    assert p.snapshot()["resumed"] >= 2  # each redelivery resumed after the stored seq 0


# --------------------------------------------------------------------------- fast batches

async def test_a_requests_results_queued_behind_a_stored_one_are_stored_in_order_through_fast_batches(
        client, nats_url):
    """Chunks published back to back queue their results behind the first one's PubAck; they
    leave as fast batches (a results stream created with allow_batched) and are stored once each,
    in seq order, every chunk acknowledged after its result."""
    settings = durable_settings(nats_url)
    js = client.jetstream()
    rids = [f"fb-{i}" for i in range(20)]
    async with Processor(settings) as p:
        assert (await js.stream_info(RESULTS_STREAM)).config.allow_batched is True
        publisher = ChunkPublisher(client, settings.subjects)
        for rid in rids:
            await publisher.publish_leg(rid, "agg", [f'{{"text": "{rid}-{s}"}}'.encode() for s in range(8)])
        await wait_until(_stored(js, 8 * len(rids)), 20, "every result stored")
        await wait_until(_empty(js), 10, "every chunk acknowledged")
        snapshot = p.snapshot()
        stored = await stored_results(js, settings.subjects)
    assert snapshot["result_batches"] > 0
    assert {rid: [(r.seq, r.body, r.final) for r in got] for rid, got in stored.items()} == {
        rid: [(s, f'{{"text": "{rid}-{s}"}}'.encode(), s == 7) for s in range(8)] for rid in rids}


async def test_a_result_refused_inside_a_batch_ends_it_there_and_nothing_after_it_is_stored_before_it(
        client, nats_url):
    """The results stream refuses seq 2 (too large for its max_msg_size): seqs 0-1 are stored and
    3-5, which left in the same batch, are not; seq 2 is retried alone until given up. Once the
    stream takes it, the redelivered chunks finish the request in order."""
    settings = durable_settings(nats_url, max_result_attempts=2)
    js = client.jetstream()
    bodies = [b'{"text": "%d"}' % s for s in range(6)]
    bodies[2] = b'{"text": "' + b"x" * 400 + b'"}'
    async with Processor(settings) as p:
        results = (await js.stream_info(RESULTS_STREAM)).config
        results.max_msg_size = 200
        await js.update_stream(results)
        await ChunkPublisher(client, settings.subjects).publish_leg("gap", "agg", bodies)
        await wait_until(lambda: p.snapshot()["results_given_up"] >= 1, 15, "seq 2 given up")
        early = await stored_results(js, settings.subjects)
        batches = p.snapshot()["result_batches"]
        results.max_msg_size = -1
        await js.update_stream(results)
        await wait_until(_stored(js, 6), 20, "the redelivered chunks' results stored at last")
        await wait_until(_empty(js), 10, "every chunk acknowledged")
        stored = await stored_results(js, settings.subjects)
    assert batches > 0
    assert [r.seq for r in early["gap"]] == [0, 1]
    assert [(r.seq, r.body) for r in stored["gap"]] == list(enumerate(bodies))


async def test_an_existing_results_stream_without_batches_is_used_one_result_at_a_time(client, nats_url, caplog):
    caplog.set_level(logging.INFO, logger="streamproc")
    settings = durable_settings(nats_url)
    js = client.jetstream()
    await ensure_results_stream(js, settings.subjects, duplicate_window=settings.duplicate_window)  # as before 2.14
    async with Processor(settings) as p:
        await ChunkPublisher(client, settings.subjects).publish_leg("one", "agg", [b"{}"] * 6)
        await wait_until(_stored(js, 6), 20, "every result stored")
        await wait_until(_empty(js), 10, "every chunk acknowledged")
        assert p.snapshot()["result_batches"] == 0
        stored = await stored_results(js, settings.subjects)
    assert [r.seq for r in stored["one"]] == list(range(6))
    assert "event=result_batches_off" in caplog.text and "allow_batched" in caplog.text


async def _requests_of_eight(client, settings, tag: str) -> tuple[list[str], float]:
    """20 requests of 8 results each, published at once; returns their ids and the seconds until
    every result is stored (PubAck'd: the chunk stream is empty)."""
    js = client.jetstream()
    publisher = ChunkPublisher(client, settings.subjects)
    rids = [f"{tag}-{i}" for i in range(20)]
    started = time.monotonic()
    for rid in rids:
        await publisher.publish_leg(rid, "agg", [b'{"text": "%s-%d"}' % (rid.encode(), s) for s in range(8)])
    # Counted on these requests' subjects: a count of the whole stream was met by other messages
    # still being stored (a fresh-clone CI run: the rogue batches' messages, stored after `before`
    # was read), and the chunk stream was "empty" before these core-published chunks reached it, so
    # the test read the results stream with 4 of 160 results in it.
    await wait_until(_stored_for(js, settings.subjects, rids, 160), 60, f"{tag}: every result stored")
    await wait_until(_empty(js), 20, f"{tag}: every chunk acknowledged")
    return rids, time.monotonic() - started


def _in_order(stored, rids: list[str]) -> dict[str, list[int]]:
    """The requests whose stored results are not seqs 0-7 once each, in order, with their bodies."""
    want = {rid: [(s, b'{"text": "%s-%d"}' % (rid.encode(), s)) for s in range(8)] for rid in rids}
    return {rid: [r.seq for r in stored.get(rid, [])] for rid in rids
            if [(r.seq, r.body) for r in stored.get(rid, [])] != want[rid]}


async def test_results_keep_their_pace_when_batches_are_turned_off_on_the_stream_at_runtime(
        client, nats_url, caplog):
    """An operator turns ``allow_batched`` off while the processor runs: nats-server refuses every
    batch whole (10205) and sends no PubAck. That says nothing about the results, so the refused
    batch's first result is sent again alone at once and results go one at a time for a while;
    before, every result waited retry_after_refusal (0.5 s) and then formed a new batch that was
    refused again: 20 requests x 8 results took 5.2 s instead of 0.06."""
    caplog.set_level(logging.INFO, logger="streamproc")
    settings = durable_settings(nats_url, max_result_attempts=3)
    js = client.jetstream()
    async with Processor(settings) as p:
        on, _ = await _requests_of_eight(client, settings, "on")
        assert p.snapshot()["result_batches"] > 0
        results = (await js.stream_info(RESULTS_STREAM)).config
        results.allow_batched = False
        await js.update_stream(results)
        off, took = await _requests_of_eight(client, settings, "off")
        snapshot = p.snapshot()
        stored = await stored_results(js, settings.subjects)
    assert _in_order(stored, on + off) == {}
    assert snapshot["results_given_up"] == 0 and snapshot["batch_pauses"] >= 1
    assert took < 2.0, took
    assert "event=result_batch_refused" in caplog.text and "one_at_a_time_for=5s" in caplog.text


async def test_results_keep_their_pace_while_other_publishers_hold_every_batch_slot(client, nats_url):
    """Another connection starts 1,000 batches on the results stream and never commits them
    (nats-server keeps at most 1,000 open per stream; the next start is refused, 10211): the
    processor's batches are refused whole, and its results still go, one at a time, at once."""
    settings = durable_settings(nats_url, max_result_attempts=3)
    js = client.jetstream()
    async with Processor(settings) as p:
        inbox = client.new_inbox()

        async def ignore(msg) -> None:
            pass

        await client.subscribe(inbox + ".>", cb=ignore)  # the rogue batches' flow acks and errors
        for i in range(1000):
            await client.publish(settings.subjects.result("rogue"), b"x", reply=f"{inbox}.rogue{i}.3.fail.1.0.$FI")
        await client.flush()
        rids, took = await _requests_of_eight(client, settings, "held")
        snapshot = p.snapshot()
        await js.purge_stream(RESULTS_STREAM, subject=settings.subjects.result("rogue"))  # not results
        stored = await stored_results(js, settings.subjects)
    assert _in_order(stored, rids) == {}
    assert snapshot["results_given_up"] == 0 and snapshot["batch_pauses"] >= 1
    assert took < 2.0, took


def _empty(js):
    async def check() -> bool:
        return await chunk_stream_messages(js) == 0
    return check


def _stored_for(js, subjects, rids: list[str], n: int):
    """True once the results stream holds ``n`` messages on the result subjects of ``rids``."""
    wanted = {subjects.result(rid) for rid in rids}

    async def check() -> bool:
        info = await js.stream_info(RESULTS_STREAM, subjects_filter=subjects.all_results)
        return sum(count for subject, count in (info.state.subjects or {}).items() if subject in wanted) >= n
    return check


def _stored(js, n: int):
    async def check() -> bool:
        return (await js.stream_info(RESULTS_STREAM)).state.messages >= n
    return check


async def test_a_waiting_prefill_chunk_is_kept_alive_and_acknowledged_with_the_final_result(client, nats_url):
    settings = durable_settings(nats_url, ack_wait=1.0)
    js = client.jetstream()
    worker = worker_for(FORMAT)
    truth = traffic.make_truth(5, request_id="pd-held", prompt_len=9, output_len=4)
    consumer = partition_consumer_name(partition_of("pd-held", settings.partitions))
    async with Processor(settings) as p:
        publisher = ChunkPublisher(client, settings.subjects)
        await publisher.publish_leg("pd-held", "prefill", worker.prefill(truth, stream=False))
        await anyio.sleep(3.5)  # three and a half ack waits
        info = await js.consumer_info(CHUNKS_STREAM, consumer)
        assert (info.num_ack_pending, info.num_redelivered) == (1, 0)
        assert p.snapshot()["in_progress"] >= 3
        async with follow(client, settings.subjects, "pd-held", timeout=10) as results:
            await publisher.publish_leg("pd-held", "decode", worker.decode(truth, stream=False))
            (final,) = await results.collect()
        assert final.verdict is Verdict.JOINED and worker.expert_view(final.body)[0] == truth.experts
        await wait_until(_empty(js), 5, "prefill acknowledged with the final result")


async def test_a_request_started_elsewhere_resumes_after_its_stored_results(client, nats_url):
    settings = durable_settings(nats_url)
    js = client.jetstream()
    bodies = [f'{{"text": "{i}"}}'.encode() for i in range(5)]
    async with Processor(settings) as p:
        for seq in (0, 1):  # what a crashed instance stored before it died
            result = Result("moved", seq, bodies[seq], False, Verdict.PASSTHROUGH)
            await js.publish(settings.subjects.result("moved"), result.body, headers=result_headers(result))
            # ... and one of a request whose chunks name another codec than the processor's default.
            await js.publish(settings.subjects.result("moved-vllm"), result.body, headers=result_headers(
                Result("moved-vllm", seq, bodies[seq], False, Verdict.PASSTHROUGH)))
        publisher = ChunkPublisher(client, settings.subjects)
        for seq in (2, 3, 4):
            await publisher.publish("moved", "agg", seq, bodies[seq], final=seq == 4)
            await publisher.publish("moved-vllm", "agg", seq, bodies[seq], final=seq == 4, format="vllm")
        await publisher.publish("moved", "agg", 1, bodies[1], attempt=0)  # a redelivered, already-stored one
        await wait_until(_stored(js, 10), 10, "the missing results stored")
        await wait_until(_empty(js), 10, "all chunks acknowledged")
        stored = await stored_results(js, settings.subjects)
        assert p.snapshot()["resumed"] == 2
    for rid in ("moved", "moved-vllm"):
        assert [(s.seq, s.body, s.final, s.error) for s in stored[rid]] == [
            (i, bodies[i], i == 4, None) for i in range(5)], rid


async def test_a_moved_requests_chunks_that_come_during_its_lookup_wait_for_it_and_are_stored_in_order(
        client, nats_url):
    """Recovery lookups of different requests run at once (up to 32 per partition); a request's own
    chunks delivered while its lookup is in flight park behind it and are decided after it, in
    delivery order. Every chunk is in the stream before the processor starts, so each request's chunks
    come in one pull, right behind the one that needs the lookup; 40 requests are more than the 32
    lookups a partition runs at once, so some wait for room too."""
    settings = durable_settings(nats_url, partitions=1)
    js = client.jetstream()
    moved = [f"parked-{i}" for i in range(40)]
    bodies = [f'{{"text": "{i}"}}'.encode() for i in range(8)]
    async with Processor(settings):  # the streams
        pass
    for rid in moved:
        for seq in (0, 1):  # what a crashed instance stored before it died
            result = Result(rid, seq, bodies[seq], False, Verdict.PASSTHROUGH)
            await js.publish(settings.subjects.result(rid), result.body, headers=result_headers(result))
    publisher = ChunkPublisher(client, settings.subjects)
    for rid in moved:  # each request's chunks back to back: seq 2 needs the lookup, the rest come behind it
        for seq in (2, 3, 1, 4, 5, 6, 7):  # seq 1 again: stored already, a duplicate once the lookup is in
            await publisher.publish(rid, "agg", seq, bodies[seq], final=seq == 7)
    await client.flush()
    async with Processor(settings) as p:
        await wait_until(_stored(js, 8 * len(moved)), 20, "the missing results stored")
        await wait_until(_empty(js), 20, "all chunks acknowledged")
        snap = p.snapshot()
    stored = await stored_results(js, settings.subjects)
    for rid in moved:  # in seq order, each once
        assert [(s.seq, s.body, s.final, s.error) for s in stored[rid]] == [
            (i, bodies[i], i == 7, None) for i in range(8)], rid
    assert snap["recoveries"] == snap["resumed"] == len(moved)  # one lookup each: the rest waited for it
    assert snap["lookups_parked"] >= len(moved), snap  # 240 (all) in 3 runs


# ------------------------------------------------------------------------------ hand-over

async def test_graceful_stop_leaves_the_backlog_to_the_next_instance_exactly_once(client, nats_url):
    settings = durable_settings(nats_url)
    js = client.jetstream()
    n = 3000
    async with Processor(settings):
        pass  # creates the streams, so chunks published now are kept
    publisher = ChunkPublisher(client, settings.subjects)
    for i in range(n):
        await publisher.publish(f"bl-{i}", "agg", 0, b"x" * 32, final=True)
    await client.flush()
    async with Processor(settings) as first:
        await anyio.sleep(0.05)
    handled_first = first.stats.chunks
    assert handled_first < n  # it really left a backlog
    async with Processor(settings) as second:
        await wait_until(_stored(js, n), 30, "backlog handled by the second instance")
        await wait_until(_empty(js), 10, "and acknowledged")
    stored = await stored_results(js, settings.subjects)
    assert len(stored) == n and all(len(v) == 1 and v[0].body == b"x" * 32 for v in stored.values())
    assert handled_first + second.stats.chunks >= n


async def test_instances_share_partitions_and_take_over_a_leaving_ones(client, nats_url):
    settings = durable_settings(nats_url, lease_ttl=1.0)
    worker = worker_for(FORMAT)
    async with Processor(settings) as a:
        leases_a = a._input.leases
        assert len(leases_a.owned) == 4
        async with Processor(settings) as b:
            leases_b = b._input.leases
            await wait_until(lambda: len(leases_a.owned) == 2 and len(leases_b.owned) == 2, 10,
                             "two instances hold two partitions each")
            assert set(leases_a.owned).isdisjoint(leases_b.owned)
            plans = traffic.plan(FORMAT, requests=40, mode="mixed", seed=11, id_prefix="share", worker=worker)
            async with ResultCollector(client, settings.subjects) as collector:
                await traffic.publish(client, settings.subjects, traffic.schedule(plans, seed=11), format=FORMAT)
                results = await collector.wait_for([pl.request_id for pl in plans], timeout=20)
            assert a.stats.chunks > 0 and b.stats.chunks > 0
        await wait_until(lambda: len(leases_a.owned) == 4, 5, "the survivor took the leaver's partitions")
        more = traffic.plan(FORMAT, requests=20, mode="mixed", seed=12, id_prefix="after", worker=worker)
        async with ResultCollector(client, settings.subjects) as collector:
            await traffic.publish(client, settings.subjects, traffic.schedule(more, seed=12), format=FORMAT)
            results.update(await collector.wait_for([pl.request_id for pl in more], timeout=20))
    problems = {pl.request_id: traffic.verify(pl, results[pl.request_id], worker) for pl in plans + more}
    assert {rid: found for rid, found in problems.items() if found} == {}


async def test_the_results_helper_replays_a_finished_request_for_a_late_reader(client, nats_url):
    settings = durable_settings(nats_url)
    bodies = [b'{"text": "late"}', b'{"text": " attach"}', b'{"text": "!"}']
    async with Processor(settings):
        async with follow(client, settings.subjects, "late", timeout=10) as live:
            await ChunkPublisher(client, settings.subjects).publish_leg("late", "agg", bodies)
            assert [r.body for r in await live.collect()] == bodies
        # The request is over; a reader attaching now still gets every result, in order, once.
        async with follow(client, settings.subjects, "late", timeout=10, replay=True) as replayed:
            got = await replayed.collect()
    assert [(r.seq, r.body, r.final) for r in got] == [(0, bodies[0], False), (1, bodies[1], False),
                                                       (2, bodies[2], True)]


# -------------------------------------------------------------------------- back-pressure

async def test_in_flight_chunks_stay_bounded_while_results_cannot_be_stored_and_none_is_dropped(
        client, nats_url):
    settings = durable_settings(nats_url, partitions=2, max_ack_pending=20, fetch_batch=10)
    js = client.jetstream()
    n = 600
    async with Processor(settings) as p:
        await js.delete_stream(RESULTS_STREAM)  # a stalled results side: nothing can be stored
        publisher = ChunkPublisher(client, settings.subjects)
        for i in range(n):
            await publisher.publish(f"bp-{i}", "agg", 0, b"y" * 100, final=True)
        await client.flush()
        await anyio.sleep(2.0)
        pending = await ack_pending(js, settings.partitions)
        assert all(0 < x <= 20 for x in pending), pending
        assert p.stats.chunks <= 2 * 20  # the processor holds at most max_ack_pending per partition
        assert p._input.outbox_pump.pending <= 2 * 20
        assert await chunk_stream_messages(js) == n  # the rest waits in the stream

        await ensure_results_stream(js, settings.subjects, duplicate_window=settings.duplicate_window)
        await wait_until(_stored(js, n), 60, "all chunks handled once results can be stored again")
        await wait_until(_empty(js), 10, "and acknowledged")
    stored = await stored_results(js, settings.subjects)
    assert len(stored) == n and all(len(v) == 1 for v in stored.values())


async def test_a_slow_processor_reads_no_faster_than_it_works_and_the_backlog_waits_in_the_stream(
        client, nats_url):
    settings = durable_settings(nats_url, partitions=2, fetch_batch=20, max_ack_pending=30)
    js = client.jetstream()
    n = 1500
    processor = Processor(settings)
    receive = processor.pipeline.receive  # what the inputs call (the correlator's own, tracing off)

    def slow_receive(chunk, now):  # 2 ms of "work" per chunk, blocking like a CPU-bound codec would
        time.sleep(0.002)
        return receive(chunk, now)

    processor.pipeline.receive = slow_receive  # type: ignore[method-assign]
    async with processor:
        publisher = ChunkPublisher(client, settings.subjects)
        for i in range(n):
            await publisher.publish(f"slow-{i}", "agg", 0, b"w" * 100, final=True)
        await client.flush()
        peak_pending = 0
        for _ in range(10):
            await anyio.sleep(0.1)
            pending = await ack_pending(js, settings.partitions)
            peak_pending = max(peak_pending, *pending)
            held = processor.stats.chunks - processor.snapshot()["acks"]
            assert held <= 2 * 30, held  # never more than max_ack_pending per partition in hand
        assert 0 < peak_pending <= 30  # the rest of the backlog waits in the stream, not in memory
        await wait_until(_stored(js, n), 30, "the slow processor got through the backlog")
        await wait_until(_empty(js), 10, "and acknowledged it")
    stored = await stored_results(js, settings.subjects)
    assert len(stored) == n and all(len(v) == 1 for v in stored.values())


async def test_client_side_slow_consumer_drops_are_redelivered_and_every_request_completes(client, nats_url,
                                                                                            monkeypatch):
    # Credit is kept under the message limit, so only the byte limit can make nats-py drop. Drops
    # happen only to messages queued for the callback task: with inline dispatch the common chunk
    # never waits in the queue (only the declined ones do: recovery lookups, a backlogged write
    # buffer), so this pins the queued path, which is the one that can drop, on every message.
    monkeypatch.setattr(FastClient, "deliver_inline", lambda self, sub, handler, raw_headers=False: None)
    settings = durable_settings(nats_url, partitions=1, fetch_batch=100, pending_bytes_limit=4096, ack_wait=1.0)
    js = client.jetstream()
    n = 400
    async with Processor(settings) as p:
        publisher = ChunkPublisher(client, settings.subjects)
        for i in range(n):
            await publisher.publish(f"sc-{i}", "agg", 0, b"z" * 64, final=True)
        await client.flush()
        await wait_until(_stored(js, n), 45, "every dropped delivery came back and was handled")
        await wait_until(_empty(js), 10, "and acknowledged")
        assert p.snapshot()["slow_consumer"] > 0  # nats-py really dropped deliveries
    stored = await stored_results(js, settings.subjects)
    assert len(stored) == n and all(len(v) == 1 for v in stored.values())


async def test_the_timer_wakes_at_most_once_per_grain_while_finished_requests_expire_one_by_one(client, nats_url):
    # Every finished request expires finished_grace after it finished: with one finishing every 5 ms
    # a timer that slept until each next deadline woke ~200 times a second (a wakeup per request).
    settings = durable_settings(nats_url, partitions=1, finished_grace=0.3)
    n = 300
    async with Processor(settings) as p:
        publisher = ChunkPublisher(client, settings.subjects)

        async def publish() -> None:
            for i in range(n):
                await publisher.publish(f"tw-{i}", "agg", 0, b"{}", final=True)
                await anyio.sleep(0.005)

        async with anyio.create_task_group() as tg:
            tg.start_soon(publish)
            await anyio.sleep(0.6)  # expiries have begun, one every ~5 ms
            runs = p.io.timer_runs
            await anyio.sleep(1.0)
            runs = p.io.timer_runs - runs
        assert runs <= 30, runs  # TIMER_GRAIN 0.05: 20 a second, not one per expiry
        # and the finished requests were forgotten all the same (a late chunk is a new request again)
        await wait_until(lambda: not p.correlator.knows("tw-0"), 5, "the first request expired")
