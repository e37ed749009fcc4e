"""Durable mode under real faults: processors SIGKILLed, nats-server restarted, a cluster node killed.

The kill-and-verify test follows Kafka Streams' exactly-once system test: a driver publishes
aggregated and P/D requests, interleaved and with duplicates, while processor instances are
killed and restarted at (seeded) random points; a verifier then reads every request's subject in
the results stream and checks it against the simulated workers' ground truth. CI runs fixed seeds;
``STREAMPROC_SOAK=1`` runs a longer soak.
"""

from __future__ import annotations

import os
import random
import signal
import time

import anyio
import nats.errors
import pytest

from streamproc.sim import traffic
from streamproc.catalog import worker_for
from streamproc.sim.embedded import EmbeddedNats, EmbeddedNatsCluster
from streamproc.nats.durable import partitions as durable_partitions
from streamproc.nats.processor import Processor
from streamproc.core.reorder import SeqOrder
from streamproc.nats.streams import RESULTS_STREAM
from streamproc.wire import MSG_ID, Subjects, chunk_headers

from durable_helpers import (
    FORMAT,
    Instance,
    accept_results_again,
    chunk_stream_messages,
    connect,
    durable_flags,
    durable_settings,
    refuse_new_results,
    stored_results,
    wait_for_finals,
)
from helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

SOAK = os.environ.get("STREAMPROC_SOAK") == "1"


# --------------------------------------------------------------------------- driver/verifier

async def drive(nc, subjects: Subjects, messages: list[traffic.Message], *, seconds: float, seed: int,
                acked: bool = False) -> int:
    """Publish ``messages`` in order, spread over ``seconds``. Repeats of a chunk are published half
    with their Nats-Msg-Id (collapsed by the chunk stream) and half without (they reach a processor).
    ``acked`` publishes through JetStream and retries until the chunk stream stored it, as a worker
    must while a cluster elects a new stream leader (a plain publish then is simply not captured).
    Returns how many repeats were published without an id."""
    rng = random.Random(seed)
    js = nc.jetstream(timeout=2)
    seen: set[tuple] = set()
    raw_repeats = 0
    started = time.monotonic()
    for i, m in enumerate(messages):
        key = (m.request_id, m.role, m.seq)
        headers = chunk_headers(m.request_id, m.role, m.seq, final=m.final, format=FORMAT)
        if key in seen and rng.random() < 0.5:
            del headers[MSG_ID]
            raw_repeats += 1
        seen.add(key)
        subject = subjects.chunk(m.request_id, m.role)
        if acked:
            await publish_until_stored(js, subject, m.body, headers)
        else:
            await nc.publish(subject, m.body, headers=headers)
        ahead = started + seconds * (i + 1) / len(messages) - time.monotonic()
        if ahead > 0:
            if not acked:
                await nc.flush()
            await anyio.sleep(ahead)
    if not acked:
        await nc.flush()
    return raw_repeats


async def publish_until_stored(js, subject: str, body: bytes, headers: dict, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await js.publish(subject, body, headers=dict(headers))
            return
        except (nats.errors.Error, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.2)


def ids(plans: list[traffic.PlannedRequest]) -> list[str]:
    return [p.request_id for p in plans]


def verify(plans: list[traffic.PlannedRequest], stored: dict, worker) -> None:
    """Per request: stored exactly once each, in seq order, no gap; after the reader's seq check
    complete and equal to the oracle (the simulated worker's bytes and the ground truth)."""
    raw_problems = {}
    problems = {}
    for p in plans:
        got = stored[p.request_id]
        seqs = [r.seq for r in got]
        if seqs != list(range(len(got))):
            raw_problems[p.request_id] = seqs
        order = SeqOrder()
        read = [item for r in got for item in order.push(r)]
        found = traffic.verify(p, read, worker)
        if found:
            problems[p.request_id] = found
    assert problems == {}
    assert raw_problems == {}  # the stream itself holds each result once, in order (Msg-Id + one in flight)


# ---------------------------------------------------------------------------- kill and verify

@pytest.mark.timeout(240 if SOAK else 120)
@pytest.mark.parametrize("seed", [7, 1234])
async def test_killed_and_restarted_processors_lose_nothing_and_duplicate_nothing(seed, tmp_path):
    rng = random.Random(seed)
    requests, seconds = (600, 90.0) if SOAK else (60, 9.0)
    worker = worker_for(FORMAT)
    plans = traffic.plan(FORMAT, requests=requests, mode="mixed", seed=seed, id_prefix=f"kv{seed}", worker=worker)
    messages = traffic.schedule(plans, seed=seed, shuffle=False, duplicates=0.15)
    flags = durable_flags(ack_wait=1.0, lease_ttl=1.5, prefill_timeout=120, request_timeout=600,
                          log_level="INFO")
    with EmbeddedNats() as server:
        instances = [Instance(server.url, flags, tmp_path / f"instance-{k}.log") for k in range(2)]
        for instance in instances:
            instance.start()
        for instance in instances:
            await instance.started()
        nc = await connect(server.url)
        subjects = Subjects()
        try:
            kills = 0

            async def chaos() -> None:
                nonlocal kills
                while True:
                    await anyio.sleep(rng.uniform(0.8, 2.0))
                    victim = instances[rng.randrange(len(instances))]
                    victim.kill()
                    kills += 1
                    await anyio.sleep(rng.uniform(0.0, 1.0))
                    victim.start()

            async with anyio.create_task_group() as tg:
                tg.start_soon(chaos)
                raw_repeats = await drive(nc, subjects, messages, seconds=seconds, seed=seed)
                tg.cancel_scope.cancel()
            for instance in instances:
                if not instance.running:
                    instance.start()
            stored = await wait_for_finals(nc.jetstream(), subjects, ids(plans), timeout=60)
            logs = "\n".join(i.log() for i in instances)
        finally:
            await nc.close()
            for instance in instances:
                instance.stop()
    assert kills >= 3 and raw_repeats > 5
    assert "Traceback" not in logs
    verify(plans, stored, worker)


# ------------------------------------------------------------------------ server restarts

@pytest.mark.timeout(90)
@pytest.mark.parametrize("kill", [False, True], ids=["graceful", "sigkill"])
async def test_processor_reconnects_after_a_nats_server_restart_and_finishes_every_request(kill):
    worker = worker_for(FORMAT)
    plans = traffic.plan(FORMAT, requests=60, mode="mixed", seed=21, id_prefix="rs", worker=worker)
    messages = traffic.schedule(plans, seed=21, shuffle=False)
    half = len(messages) // 2
    with EmbeddedNats() as server:
        settings = durable_settings(server.url, prefill_timeout=120)
        async with Processor(settings) as p:
            assert p.nc.options["max_reconnect_attempts"] == -1  # nats-py gives up after 60 by default
            nc = await connect(server.url)
            try:
                await drive(nc, settings.subjects, messages[:half], seconds=1.0, seed=21, acked=True)
                # Counted before the restart: the re-issue can happen before the wait below sees it.
                pulls_before = p.snapshot()["pulls"]
                await anyio.to_thread.run_sync(lambda: server.restart(kill=kill))
                await wait_until(lambda: nc.is_connected and p.nc.is_connected, 20, "both clients reconnected")
                # Acknowledged publishes: right after a restart JetStream may still be recovering,
                # and a plain publish it cannot store is not captured (a worker must use PubAcks).
                await drive(nc, settings.subjects, messages[half:], seconds=1.0, seed=22, acked=True)
                stored = await wait_for_finals(nc.jetstream(), settings.subjects, ids(plans), timeout=45)
            finally:
                await nc.close()
            snapshot = p.snapshot()
    assert snapshot["reconnects"] >= 1
    assert snapshot["pulls"] > pulls_before  # pulls re-issued: the server forgot the old ones (nats.py#504)
    verify(plans, stored, worker)


@pytest.mark.timeout(60)
async def test_after_a_nats_server_restart_new_chunks_are_pulled_at_once_not_at_the_next_watchdog_round(
        monkeypatch):
    # The watchdog's rounds 450 s apart (ack_wait / 8): only the reconnect's wake-up can re-issue
    # the pulls the restarted server forgot within this test's time. SIGKILL: a graceful shutdown
    # answers each waiting pull with a 409, and that is pulled again without the watchdog.
    monkeypatch.setattr(durable_partitions, "WATCHDOG_EVERY", 1000.0)
    worker = worker_for(FORMAT)
    before, after = (traffic.plan(FORMAT, requests=3, mode="aggregated", seed=seed, id_prefix=f"wk{seed}",
                                  worker=worker) for seed in (31, 32))
    with EmbeddedNats() as server:
        settings = durable_settings(server.url, ack_wait=3600)
        async with Processor(settings) as p:
            rounds = 0
            watch = p.input.partitions._watch

            async def counted() -> None:
                nonlocal rounds
                rounds += 1
                await watch()

            p.input.partitions._watch = counted  # the watchdog's rounds, counted
            nc = await connect(server.url)
            try:
                await drive(nc, settings.subjects, traffic.schedule(before, seed=31, shuffle=False), seconds=0.2,
                            seed=31, acked=True)
                await wait_for_finals(nc.jetstream(), settings.subjects, ids(before), timeout=20)
                pulls_before = p.snapshot()["pulls"]
                await anyio.to_thread.run_sync(lambda: server.restart(kill=True))
                await wait_until(lambda: nc.is_connected and p.nc.is_connected, 20, "both clients reconnected")
                await wait_until(lambda: p.snapshot()["pulls"] > pulls_before, 5, "pulls re-issued after the reconnect")
                await drive(nc, settings.subjects, traffic.schedule(after, seed=32, shuffle=False), seconds=0.2,
                            seed=32, acked=True)
                stored = await wait_for_finals(nc.jetstream(), settings.subjects, ids(after), timeout=10)
            finally:
                await nc.close()
    verify(after, stored, worker)
    assert 1 <= rounds <= 3, rounds  # one round per reconnect, then back to waiting: no spinning


# ------------------------------------------------------------------------------- cluster

@pytest.mark.timeout(120)
async def test_a_three_node_cluster_with_r3_streams_loses_nothing_when_a_node_dies():
    worker = worker_for(FORMAT)
    plans = traffic.plan(FORMAT, requests=60, mode="mixed", seed=31, id_prefix="cl", worker=worker)
    messages = traffic.schedule(plans, seed=31, shuffle=False, duplicates=0.1)
    half = len(messages) // 2
    with EmbeddedNatsCluster(3) as cluster:
        settings = durable_settings(cluster.urls, stream_replicas=3, prefill_timeout=120)
        async with Processor(settings) as p:
            js_info = await p.nc.jetstream().stream_info(RESULTS_STREAM)
            assert js_info.config.num_replicas == 3 and len(js_info.cluster.replicas or []) == 2
            nc = await connect(cluster.urls)
            try:
                await drive(nc, settings.subjects, messages[:half], seconds=1.5, seed=31, acked=True)
                connected = p.nc.connected_url.port
                victim = next(node for node in cluster.nodes if node.port == connected)
                await anyio.to_thread.run_sync(victim.kill)  # the node the processor talks to
                await drive(nc, settings.subjects, messages[half:], seconds=1.5, seed=32, acked=True)
                stored = await wait_for_finals(nc.jetstream(), settings.subjects, ids(plans), timeout=60)
            finally:
                await nc.close()
            snapshot = p.snapshot()
    assert snapshot["reconnects"] >= 1
    verify(plans, stored, worker)


async def test_a_partition_consumer_deleted_mid_run_costs_no_held_request_anything(nats_url, tmp_path):
    """Someone deletes a partition's consumer (``nats consumer rm``) while the processor holds 40 P/D
    requests' prefill legs (``--max-ack-pending 64``: shedding starts past 48 held chunks). The
    processor recreates the consumer (pull status ``409 Consumer Deleted``, then a repair), whose
    deliveries start again from the stream's first message: every held prefill chunk comes again,
    the same stored message under a new delivery, and is held with the original. The partition's
    held chunks were counted per token, 80, so the 10 requests waiting longest were ended
    ``overloaded`` although the server counts 40 unacknowledged messages (seen 2026-12-05: 10 of
    40, pd0 to pd9). Now the held chunks are counted once per stored message (stream sequence). Then
    the processor is killed and restarted (at the default ``--max-ack-pending``) before the decode
    legs come: every request is answered in full, joined, each result stored once, and the chunk
    stream is left empty."""
    from streamproc.nats.streams import CHUNKS_STREAM, partition_consumer_name
    from streamproc.sim.simulation import make_truth

    subjects = Subjects()
    worker = worker_for(FORMAT)
    legs = {}
    for k in range(40):
        truth = make_truth(k, request_id=f"pd{k}")
        legs[f"pd{k}"] = (worker.prefill(truth, stream=False), worker.decode(truth, stream=True))
    instance = Instance(nats_url, durable_flags(partitions=1, max_ack_pending=64), tmp_path / "run.log")
    instance.start()
    nc = await connect(nats_url)
    try:
        await instance.started()
        js = nc.jetstream()

        async def publish(rid: str, role: str, bodies: list[bytes]) -> None:
            for seq, body in enumerate(bodies):
                await js.publish(subjects.chunk(rid, role), body,
                                 headers=chunk_headers(rid, role, seq, final=seq == len(bodies) - 1))

        for rid, (prefill, _) in legs.items():
            await publish(rid, "prefill", prefill)
        consumer = partition_consumer_name(0)

        async def delivered_all() -> bool:
            info = await js.consumer_info(CHUNKS_STREAM, consumer)
            return info.num_ack_pending == len(legs) and info.num_pending == 0

        await wait_until(delivered_all, 20, "every prefill leg delivered and held")
        await js.delete_consumer(CHUNKS_STREAM, consumer)

        async def redelivered_all() -> bool:
            try:
                return await delivered_all()
            except nats.errors.Error:  # not recreated yet
                return False

        await wait_until(redelivered_all, 20, "the consumer recreated, every prefill leg delivered again", every=0.2)
        await anyio.sleep(2)  # watchdog rounds: where the held chunks were counted and shed
        assert "partition_shed" not in instance.log(), instance.log()[-3000:]
        instance.kill()
        # Restarted with room for the decode legs' joins too (40 held legs + decode chunks queued
        # behind the joins would pass 48 on a loaded machine): the rest checks that nothing is lost.
        instance.flags = durable_flags(partitions=1)
        instance.start()
        await instance.started()
        for rid, (_, decode) in legs.items():
            await publish(rid, "decode", decode)
        stored = await wait_for_finals(js, subjects, list(legs), 60)
        for rid, (_, decode) in legs.items():
            assert [(x.seq, x.error, str(x.verdict)) for x in stored[rid]] == [
                (seq, None, "joined") for seq in range(len(decode))], (rid, stored[rid], instance.log()[-3000:])

        async def drained() -> bool:
            return (await js.stream_info(CHUNKS_STREAM)).state.messages == 0

        await wait_until(drained, 20, "every chunk acknowledged")
    finally:
        await nc.close()
        instance.stop()


# ------------------------------------------------------- killed before an error in place of a result is stored

@pytest.mark.timeout(120)
async def test_a_processor_killed_before_the_error_in_place_of_an_unpublishable_result_is_stored_loses_nothing(
        tmp_path):
    """A chunk whose result is over ``max_payload`` is replaced by an ``internal`` error result, which
    keeps the chunk's token until it is stored. The processor is SIGKILLed while the results stream
    refuses everything (edited to discard ``new`` at its current ``max_msgs``: the error result and
    a bystander's result are both refused and retried), then the stream is repaired and a new
    processor started: the chunks come back, the oversized result is made and replaced again, and
    the client sees exactly one result for each request, the error once, the bystander's answer once,
    and the chunk stream drains (nothing acknowledged before its result was stored)."""
    with EmbeddedNats() as server:
        instance = Instance(server.url, durable_flags(partitions=1), tmp_path / "run.log")
        instance.start()
        nc = await connect(server.url)
        try:
            await instance.started()
            js = nc.jetstream()
            await refuse_new_results(nc, js, Subjects())  # every new result refused (10077), retried every 0.5 s

            headers = {"Streamproc-Seq": "0", "Streamproc-Final": "true"}
            block = len(b"NATS/1.0\r\n\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items())
            await nc.request(Subjects().chunk("oversized", "agg"), b"x" * (nc.max_payload - block),
                             headers=headers, timeout=5)
            await nc.request(Subjects().chunk("bystander", "agg"), b"{}",
                             headers=chunk_headers("bystander", "agg", 0, final=True), timeout=5)

            def replaced_and_refused() -> bool:
                text = instance.log()
                return ("replaced by an internal error result" in text and "request_id=oversized" in text
                        and "event=result_not_stored" in text)

            await wait_until(replaced_and_refused, 20, "the error result in place of the oversized one refused")
            instance.kill()
            assert (await js.stream_info(RESULTS_STREAM)).state.messages == 1  # nothing of either stored

            await accept_results_again(js)
            instance.start()
            await instance.started()
            stored = await wait_for_finals(js, Subjects(), ["oversized", "bystander"], 60)

            async def drained() -> bool:
                return await chunk_stream_messages(js) == 0

            await wait_until(drained, 20, "every chunk acknowledged")
            await anyio.sleep(3)  # an ack_wait more: a late redelivery would store a second result
            stored = await stored_results(js, Subjects())
            assert [(r.seq, r.final, r.error) for r in stored["oversized"]] == [(0, True, "internal")], stored
            assert b"max_payload" in stored["oversized"][0].body
            assert [(r.seq, r.final, r.error) for r in stored["bystander"]] == [(0, True, None)], stored
            assert [(r.seq, r.final) for r in stored["before"]] == [(0, True)]
            assert instance.kills == 1
            again = instance.log().rsplit("----- start 1\n", 1)[1]
            assert "replaced by an internal error result" in again, again[-3000:]  # made and replaced again
        finally:
            await nc.close()
            instance.stop()


# ------------------------------------------------------- a stop still retries what is refused

@pytest.mark.timeout(120)
async def test_a_graceful_stop_retries_a_refused_result_and_stores_it_before_the_drain_timeout(tmp_path):
    """A graceful stop cancels the watchdog, whose ticks are what send a refused result again (after
    ``retry_after_refusal``), an overdue one, or a fast batch's head that a member over
    ``max_payload`` ended; its wait for the results to be stored then retried nothing: a result
    refused once just before the stop waited out all of ``--drain-timeout`` and was handed over
    unstored, its chunk NAKed. Here the results stream refuses every new result
    (edited to discard ``new`` at its ``max_msgs``), the processor gets SIGTERM, and the stream is
    repaired half a second later: the stop stores the result, acknowledges its chunk and exits well
    before the drain timeout."""
    drain = 12.0
    with EmbeddedNats() as server:
        instance = Instance(server.url, durable_flags(partitions=1, drain_timeout=drain, lease_ttl=6), tmp_path / "run.log")
        instance.start()
        nc = await connect(server.url)
        try:
            await instance.started()
            js = nc.jetstream()
            await refuse_new_results(nc, js, Subjects())  # every new result refused (10077), retried every 0.5 s
            await nc.request(Subjects().chunk("held", "agg"), b"{}",
                             headers=chunk_headers("held", "agg", 0, final=True), timeout=5)
            await wait_until(lambda: "event=result_not_stored" in instance.log(), 20, "the result refused")

            assert instance.proc is not None
            started = time.monotonic()
            instance.proc.send_signal(signal.SIGTERM)
            await anyio.sleep(0.5)
            await accept_results_again(js)
            await wait_until(lambda: not instance.running, drain + 10, "the processor stopped")
            took = time.monotonic() - started

            log_text = instance.log()
            assert "stop_with_unstored_results" not in log_text, log_text[-3000:]
            assert took < drain / 2, took
            stored = await stored_results(js, Subjects())
            assert [(r.seq, r.final, r.error) for r in stored.get("held", [])] == [(0, True, None)], stored
            assert await chunk_stream_messages(js) == 0  # its chunk acknowledged by the stop, not handed over
        finally:
            await nc.close()
            instance.stop()


@pytest.mark.timeout(120)
async def test_a_graceful_stop_that_ends_with_results_unstored_says_so(tmp_path):
    """``stop_with_unstored_results`` (docs/operations.md) is the one line that says a stop handed
    results over unstored. Its wait ran inside a cancel scope of the same ``--drain-timeout`` that
    began earlier, so the scope always ended the wait first and the line was never logged. Here the
    results stream refuses every new result for good: the stop takes the drain timeout and says how
    many results it left."""
    drain = 2.0
    with EmbeddedNats() as server:
        instance = Instance(server.url, durable_flags(partitions=1, drain_timeout=drain, lease_ttl=6),
                            tmp_path / "run.log")
        instance.start()
        nc = await connect(server.url)
        try:
            await instance.started()
            js = nc.jetstream()
            await refuse_new_results(nc, js, Subjects())  # every new result refused, retried every 0.5 s
            await nc.request(Subjects().chunk("held", "agg"), b"{}",
                             headers=chunk_headers("held", "agg", 0, final=True), timeout=5)
            await wait_until(lambda: "event=result_not_stored" in instance.log(), 20, "the result refused")
            assert instance.proc is not None
            instance.proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: not instance.running, drain + 10, "the processor stopped")
            log_text = instance.log()
            assert "event=stop_with_unstored_results results=1" in log_text, log_text[-3000:]
            assert await chunk_stream_messages(js) == 1  # handed over: NAKed, not acknowledged
        finally:
            await nc.close()
            instance.stop()
