"""Recovery lookups as tasks (core/lookups.py, Deliveries.handlers): the deliveries parked behind
a lookup, attacked with real nats-server deliveries (in-process processor, lookups slowed or failed)."""

from __future__ import annotations

import anyio
import pytest

from streamproc.client.publisher import ChunkPublisher
from streamproc.core.outbox import Outbox
from streamproc.nats.durable.recovery import Recovery
from streamproc.nats.processor import Processor
from streamproc.nats.streams import CHUNKS_STREAM, partition_consumer_name

from streamproc.wire import Result, Verdict, result_headers

from conftest import processor_subprocess
from durable_helpers import (chunk_stream_messages, dead_owner_takes, durable_flags, durable_settings, stored_results,
                             wait_for_finals)
from helpers import wait_until
from proxy_helpers import HoldingProxy

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


def record_naks(monkeypatch) -> list[str]:
    """The ack subject of every delivery the outbox NAKs from now on (a NAK twice shows as a repeat)."""
    naked: list[str] = []
    nak = Outbox.nak

    def counted(self, tokens, delay=0.0):
        tokens = list(tokens)
        naked.extend(t.reply for t in tokens if t is not None)
        return nak(self, tokens, delay)

    monkeypatch.setattr(Outbox, "nak", counted)
    return naked


async def test_a_bug_in_a_lookup_task_costs_its_request_a_retry_not_the_processor(client, nats_url, monkeypatch,
                                                                                  caplog):
    """Lookups run as tasks of the durable input's task group: an exception escaping one (a bug; store
    errors are caught in ``Recovery.recover``) ended the group, every partition with it. Now the request's
    deliveries are NAKed for a retry, the error is logged, and the partition goes on."""
    settings = durable_settings(nats_url, partitions=1, ack_wait=2.0)
    recover = Recovery.recover
    calls = 0

    async def buggy_once(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ZeroDivisionError("a bug in the lookup path")
        return await recover(self, *args, **kwargs)

    monkeypatch.setattr(Recovery, "recover", buggy_once)
    publisher = ChunkPublisher(client, settings.subjects, durable=True)
    async with Processor(settings) as p:
        await wait_until(lambda: p.input.owns("x"), 10, "the partition owned")
        # Attempt 1 of an id nobody knows: decided only after a lookup (the first one hits the bug).
        await publisher.publish("buggy", "agg", 0, b'{"text": "b"}', final=True, attempt=1)
        await publisher.publish("plain", "agg", 0, b'{"text": "p"}', final=True)
        stored = await wait_for_finals(client.jetstream(), settings.subjects, ["buggy", "plain"], 20)
        assert p.input.owns("x")
    assert [r.seq for r in stored["plain"]] == [0] and not stored["plain"][0].error
    assert len(stored["buggy"]) == 1  # retried, then decided as any attempt-1 chunk of an unknown id
    assert calls >= 2
    assert any("lookup_task_failed" in r.getMessage() for r in caplog.records)


async def test_a_chunk_parked_on_its_last_delivery_is_decided_when_the_lookup_before_it_fails(
        client, nats_url, monkeypatch):
    """A request's chunk that needs a lookup (seq 2, first delivery) and, parked behind it, another
    of its chunks on its ``max_deliver``-th delivery (seq 1, taken before by an owner that died). The
    lookup fails: the first is NAKed for a retry, but a NAK of the second is its end, as nats-server
    never delivers it again (it stays in the work-queue stream, unacknowledged, until chunks_max_age).
    Decided on its own, as before lookups ran as tasks, it is looked up once more without a retry
    and dropped as poison (its request ends with an error result), and the chunk stream empties."""
    settings = durable_settings(nats_url, partitions=1, ack_wait=1.5, max_deliver=2)
    js = client.jetstream()
    async with Processor(settings):  # the streams and the partition's consumer
        pass
    rid = "parked-on-its-last-delivery"
    publisher = ChunkPublisher(client, settings.subjects)
    await publisher.publish(rid, "agg", 1, b'{"text": "1"}')
    assert len(await dead_owner_takes(client, 1)) == 1  # delivery 1 of seq 1: back after ack_wait
    await publisher.publish(rid, "agg", 2, b'{"text": "2"}', final=True)

    fail_the_first_lookup_once(monkeypatch, parked=1)  # once seq 1 parked behind it
    async with Processor(settings) as p:
        await wait_until(lambda: p.snapshot()["lookups_parked"] >= 1, 10, "seq 1 parked behind seq 2's lookup")
        try:
            await wait_until(_empty(js), 10, "every chunk acknowledged or terminated")
        finally:
            snap = p.snapshot()
    stored = await stored_results(js, settings.subjects)
    assert snap["poisoned"] >= 1, snap
    assert [(s.seq, s.final, s.error is not None) for s in stored[rid]][-1][1:] == (True, True), stored[rid]


def fail_the_first_lookup_once(monkeypatch, parked: int) -> None:
    """The processor's first recovery lookup fails (results stream unreadable) once ``parked`` chunks
    wait behind lookups; every later one runs as usual."""
    adopt = Recovery.adopt
    calls = 0

    async def failing_once(self, r, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            with anyio.fail_after(10):
                while self.stats.lookups_parked < parked:
                    await anyio.sleep(0.01)
            raise TimeoutError("results stream unreadable")
        return await adopt(self, r, *args, **kwargs)

    monkeypatch.setattr(Recovery, "adopt", failing_once)


def _empty(js):
    async def check() -> bool:
        return await chunk_stream_messages(js) == 0
    return check


async def _moved_requests(client, settings, prefix: str, count: int) -> tuple[list[str], list[bytes]]:
    """``count`` requests whose results 0..1 a dead instance stored; their chunks 2..7 (1 again among
    them, a duplicate) wait in the chunk stream: seq 2 of each needs a lookup, the rest park behind it."""
    js = client.jetstream()
    moved = [f"{prefix}-{i}" for i in range(count)]
    bodies = [f'{{"text": "{i}"}}'.encode() for i in range(8)]
    for rid in moved:
        for seq in (0, 1):
            result = Result(rid, seq, bodies[seq], False, Verdict.PASSTHROUGH)
            await js.publish(settings.subjects.result(rid), result.body, headers=result_headers(result))
    publisher = ChunkPublisher(client, settings.subjects)
    for rid in moved:
        for seq in (2, 3, 1, 4, 5, 6, 7):
            await publisher.publish(rid, "agg", seq, bodies[seq], final=seq == 7)
    await client.flush()
    return moved, bodies


def _assert_each_once_in_order(stored, moved, bodies) -> None:
    bad = {rid: [(s.seq, s.error) for s in stored.get(rid, [])] for rid in moved
           if [(s.seq, s.body, s.final, s.error) for s in stored.get(rid, [])]
           != [(i, bodies[i], i == 7, None) for i in range(8)]}
    assert not bad, f"{len(bad)} of {len(moved)}: {list(bad.items())[:3]}"


async def test_an_owner_that_stalls_past_its_lease_with_lookups_in_flight_adopts_nothing_and_hands_all_over(
        client, nats_url, monkeypatch, caplog):
    """Instance A (in-process) has 40 lookups in flight, their requests' later chunks parked behind
    them, when its whole process stalls past the lease (a GC pause, a starved host); B (a subprocess)
    takes the partition meanwhile. When A runs again its lookups end after the hand-over: nothing is
    adopted or decided, every parked delivery was NAKed once, and B stores each request's results
    once, in order; nothing raised in A."""
    import logging
    import time

    caplog.set_level(logging.INFO, logger="streamproc")
    # Every lookup in flight at once (40 slots, not the default's 8): the stall comes with all of them.
    settings = durable_settings(nats_url, partitions=1, ack_wait=2.0, lease_ttl=1.5, max_lookups=40)
    js = client.jetstream()
    adopt = Recovery.adopt
    calls = 0

    async def slow_then_stall(self, r, *args, **kwargs):
        nonlocal calls
        calls += 1
        n = calls
        await anyio.sleep(0.3)
        if n == 20:  # every lookup in flight, chunks parked: the whole process stalls for 3 s
            time.sleep(3.0)
        await anyio.sleep(0.3)
        return await adopt(self, r, *args, **kwargs)

    monkeypatch.setattr(Recovery, "adopt", slow_then_stall)
    naked = record_naks(monkeypatch)
    async with Processor(settings) as a:
        await wait_until(lambda: a.input.owns("x"), 10, "A owns the partition")
        # B is started and stopped in a thread: its start is waited for with time.sleep, which held
        # A's loop for as long as B took to start, past A's lease (served 1.35 s). A then lost its
        # partition before the requests came, and none of their chunks was parked behind A's lookups
        # (lookups_parked 0: 1 of 10 runs beside two CPU burners).
        b = processor_subprocess(nats_url, *durable_flags(partitions=1, ack_wait=2.0, lease_ttl=1.5))
        _, log_path = await anyio.to_thread.run_sync(b.__enter__)
        try:
            moved, bodies = await _moved_requests(client, settings, "stalled", 40)
            await wait_until(lambda: not a.input.owns("x"), 15, "A fenced off its partition")
            stored = await wait_for_finals(js, settings.subjects, moved, 30)
            await wait_until(_empty(js), 15, "every chunk acknowledged")
            snap = a.snapshot()
            stored = await stored_results(js, settings.subjects)
            b_log = log_path.read_text(errors="replace")
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(b.__exit__, None, None, None)
        await anyio.sleep(0.5)  # A's lookups still in flight end (after the hand-over)
        later = a.snapshot()
    _assert_each_once_in_order(stored, moved, bodies)
    twice = [r for r in set(naked) if naked.count(r) > 1]
    assert not twice, f"{len(twice)} of {len(set(naked))} deliveries NAKed more than once: {twice[:3]}"
    assert snap["lookups_parked"] >= 40, snap
    assert later["resumed"] == snap["resumed"] == 0, (snap, later)  # nothing adopted after the hand-over
    for text in (caplog.text, b_log):
        assert "Traceback" not in text and "_failed" not in text.replace("recovery_lookup_failed", ""), text[-3000:]


async def test_partitions_released_and_a_stop_with_lookups_in_flight_hand_every_parked_chunk_over_once(
        client, nats_url, monkeypatch, caplog):
    """Instance A (in-process) owns 4 partitions with 5 s lookups in flight and chunks parked behind
    them when B (a subprocess) joins: A releases two partitions (graceful hand-over) and is then
    stopped, lookups still in flight. Every parked delivery is NAKed once, no lookup task outlives
    the stop, A adopts and stores nothing, and B stores each request's results once, in order."""
    import logging

    caplog.set_level(logging.INFO, logger="streamproc")
    flags = dict(partitions=4, ack_wait=4.0, lease_ttl=1.5)
    settings = durable_settings(nats_url, **flags)
    js = client.jetstream()
    adopt = Recovery.adopt
    running = 0

    async def slow(self, r, *args, **kwargs):
        nonlocal running
        running += 1
        try:
            await anyio.sleep(5.0)
            return await adopt(self, r, *args, **kwargs)
        finally:
            running -= 1

    monkeypatch.setattr(Recovery, "adopt", slow)
    naked = record_naks(monkeypatch)
    async with Processor(settings) as a:
        await wait_until(lambda: a.snapshot()["partitions"] == 4, 10, "A owns every partition")
        moved, bodies = await _moved_requests(client, settings, "released", 60)
        await wait_until(lambda: a.snapshot()["lookups_parked"] >= 60, 10, "chunks parked behind lookups")
        in_flight = running
        b = processor_subprocess(nats_url, *durable_flags(**flags))
        proc, log_path = await anyio.to_thread.run_sync(b.__enter__)
        try:
            await wait_until(lambda: a.snapshot()["leases_released"] >= 1, 10, "A released partitions to B")
            assert running, "the lookups ended before the hand-over: make them slower"
            snap_before_stop = a.snapshot()
        except BaseException:
            b.__exit__(None, None, None)
            raise
    try:
        snap = a.snapshot()
        left = running
        stored = await wait_for_finals(js, settings.subjects, moved, 30)
        await wait_until(_empty(js), 15, "every chunk acknowledged")
        stored = await stored_results(js, settings.subjects)
        b_log = log_path.read_text(errors="replace")
    finally:
        b.__exit__(None, None, None)
    _assert_each_once_in_order(stored, moved, bodies)
    twice = [r for r in set(naked) if naked.count(r) > 1]
    assert not twice, f"{len(twice)} of {len(set(naked))} deliveries NAKed more than once: {twice[:3]}"
    assert left == 0, f"{left} of {in_flight} lookups still running after the stop"
    assert snap["resumed"] == 0 and snap["results"] == 0, (snap_before_stop, snap)
    assert len(naked) >= snap["recoveries"] + snap["lookups_parked"], (len(naked), snap)  # 420 = 60 + 360
    for text in (caplog.text, b_log):
        assert "Traceback" not in text and "exception" not in text.lower(), text[-3000:]


async def test_a_stop_in_the_middle_of_a_partitions_graceful_hand_over_still_naks_what_the_partition_held(
        client, nats_url, monkeypatch):
    """A (in-process, through a proxy in front of the real server) owns 2 partitions with 5 s lookups
    in flight and chunks parked behind them when a second member appears: A hands partition 1 over
    (graceful), and is stopped while that hand-over waits for the server to drop the partition's
    pulls (its consumer info, held back by the proxy). Under CPU load a stop came at that point:
    the stop cancelled the lease loop's hand-over, which had already taken the partition off the
    owned ones, so the deliveries it held were never NAKed (they came back only after ack_wait).
    Every delivery A held must be NAKed once."""
    flags = dict(partitions=2, ack_wait=4.0, lease_ttl=1.5)
    adopt = Recovery.adopt

    async def slow(self, r, *args, **kwargs):
        await anyio.sleep(5.0)
        return await adopt(self, r, *args, **kwargs)

    monkeypatch.setattr(Recovery, "adopt", slow)
    naked = record_naks(monkeypatch)
    forget_pulls = f"$JS.API.CONSUMER.INFO.{CHUNKS_STREAM}.{partition_consumer_name(1)}".encode()
    proxy = HoldingProxy(int(nats_url.rsplit(":", 1)[1]), lambda subject: subject == forget_pulls)
    async with proxy.running():
        settings = durable_settings(proxy.url, max_lookups=20, **flags)  # every request's lookup in flight
        async with Processor(settings) as a:
            await wait_until(lambda: a.snapshot()["partitions"] == 2, 10, "A owns both partitions")
            moved, _ = await _moved_requests(client, settings, "mid-hand-over", 20)
            assert {a.input.scheme.of(rid) for rid in moved} == {0, 1}
            await wait_until(lambda: a.snapshot()["lookups_parked"] >= 20 * 6, 10, "chunks parked behind lookups")
            proxy.arm()
            kv = await client.jetstream().key_value(f"{CHUNKS_STREAM}_LEASES")
            await kv.put("m.another-instance", b"another-instance")  # a second member: A's share is 1
            with anyio.fail_after(10):
                await proxy.held.wait()  # partition 1 handed over up to its pulls being forgotten
        snap = a.snapshot()
    twice = [r for r in set(naked) if naked.count(r) > 1]
    assert not twice, f"{len(twice)} of {len(set(naked))} deliveries NAKed more than once: {twice[:3]}"
    assert snap["leases_released"] == 1 and snap["resumed"] == 0, snap
    assert len(naked) == snap["recoveries"] + snap["lookups_parked"] == 20 * 7, (len(naked), snap)


async def test_a_migrate_that_comes_during_its_requests_lookup_seals_after_the_chunks_parked_behind_it(
        client, nats_url, monkeypatch):
    """A request served to result 1 by an instance that stopped; its chunks 2..4 reach the next one,
    whose lookup (slowed to 1.5 s) of seq 2 is in flight with 3 and 4 parked behind it when a migrate
    of the request comes. The migrate waits for them (``caught_up``): it seals at result seq 5, after
    what the client was sent, not at 2 with 2..4 then dropped as the sealed attempt's."""
    from migration_helpers import SimulatedPool
    from streamproc.core.events import Sealed
    from streamproc.simulation import make_truth
    from streamproc.wire import Subjects
    from migration_helpers import ask_migrate

    settings = durable_settings(nats_url, partitions=1, ack_wait=4.0)
    js = client.jetstream()
    rid = "migrated-mid-lookup"
    truth = make_truth(91, request_id=rid, prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), "sglang", truth, pd=False)
    [(role, bodies)] = pool.legs(0)
    async with Processor(settings):
        await pool.publish(role, bodies, 0, stop=2)
        await wait_until(lambda: _results(js, 2), 10, "results 0..1 stored")
    adopt = Recovery.adopt

    async def slow(self, r, *args, **kwargs):
        if kwargs.get("current") is not None:  # the chunk's lookup, not the migrate's own adoption
            await anyio.sleep(1.5)
        return await adopt(self, r, *args, **kwargs)

    monkeypatch.setattr(Recovery, "adopt", slow)
    async with Processor(settings) as p:
        await pool.publish(role, bodies, 0, start=2, stop=5)
        await wait_until(lambda: p.snapshot()["lookups_parked"] >= 2, 10, "chunks 3..4 parked behind 2's lookup")
        assert p.snapshot()["resumed"] == 0
        reply = await ask_migrate(client, settings.subjects, rid, expected_attempt=0)
        assert isinstance(reply, Sealed), reply
        await wait_until(_empty(js), 10, "every chunk acknowledged")
    stored = await stored_results(js, settings.subjects)
    assert [s.seq for s in stored[rid]] == [0, 1, 2, 3, 4], stored[rid]
    assert reply.result_seq == 5, reply


async def _results(js, n: int) -> bool:
    return (await js.stream_info("STREAMPROC_RESULTS")).state.messages >= n


async def test_chunks_parked_behind_failed_lookups_come_back_and_are_stored_once_in_order(
        client, nats_url, monkeypatch):
    """40 moved requests; each one's first lookup fails (the results stream unreadable) with its
    later chunks parked behind it: the request is queued again with them held (they used to be NAKed
    for a retry in 1 s, 7 deliveries spent per request), then looked up again and stored once each,
    in order, the stored duplicate among them acknowledged."""
    settings = durable_settings(nats_url, partitions=1, ack_wait=4.0)
    js = client.jetstream()
    async with Processor(settings):
        pass
    moved, bodies = await _moved_requests(client, settings, "failed-lookup", 40)
    adopt = Recovery.adopt
    failed: set[str] = set()

    async def fails_first(self, r, *args, **kwargs):
        await anyio.sleep(0.2)
        if r not in failed:
            failed.add(r)
            raise TimeoutError("results stream unreadable")
        return await adopt(self, r, *args, **kwargs)

    monkeypatch.setattr(Recovery, "adopt", fails_first)
    naked = record_naks(monkeypatch)
    async with Processor(settings) as p:
        await wait_until(_empty(js), 20, "every chunk acknowledged")
        snap = p.snapshot()
    stored = await stored_results(js, settings.subjects)
    _assert_each_once_in_order(stored, moved, bodies)
    assert snap["resumed"] == len(moved) and snap["lookups_parked"] >= len(moved), snap
    # One failure each, attempts left: looked up again with the chunks held, none NAKed or redelivered.
    assert snap.get("lookup_retries") == len(moved) and not naked and snap["redelivered"] == 0, (len(naked), snap)


# Seconds each flooding request's lookup takes (the results stream slow to answer) and flooding
# requests, each one chunk that needs a lookup: 32 lookups in flight and FLOOD - 32 more behind them.
FLOOD_LOOKUP_SECONDS = 1.0
FLOOD = 32 * 5
# A started request's next chunk, delivered behind the flood, must be answered within this. Before the
# lookups' queue the partition's callback waited for a lookup slot at flood chunk 33, and every chunk
# behind it with it: ~(FLOOD - 32) / 32 x FLOOD_LOOKUP_SECONDS, 4-5 s. With the queue: a few ms.
VICTIM_BOUND = 1.0


async def test_a_started_request_is_answered_at_once_while_a_flood_of_new_requests_waits_for_lookup_slots(
        client, nats_url, monkeypatch):
    """A request already served here (result 0 stored, the correlator holds it) sends its next chunk
    behind FLOOD chunks of new requests that each need a recovery lookup (``Streamproc-Attempt: 1`` on
    fresh ids, which anyone allowed to publish chunks can send), while lookups are slow: 32 run, the
    rest wait for a slot. The started request needs no lookup; it is answered within VICTIM_BOUND,
    and every flooding request still gets its result (here: invalid_chunk, an attempt nobody sealed)."""
    settings = durable_settings(nats_url, partitions=1, ack_wait=10.0)
    adopt = Recovery.adopt

    async def slow(self, r, *args, **kwargs):
        if r.startswith("flood-"):
            await anyio.sleep(FLOOD_LOOKUP_SECONDS)
        return await adopt(self, r, *args, **kwargs)

    monkeypatch.setattr(Recovery, "adopt", slow)
    publisher = ChunkPublisher(client, settings.subjects, durable=True)
    victim = "victim-started"
    answered: list[float] = []

    async def note(msg) -> None:
        answered.append(anyio.current_time())

    results = await client.subscribe(settings.subjects.result(victim), cb=note)
    async with Processor(settings) as p:
        await wait_until(lambda: p.input.owns("x"), 10, "the partition owned")
        await publisher.publish(victim, "agg", 0, b'{"text": "0"}')
        await wait_until(lambda: len(answered) == 1, 10, "the victim's first result")
        flood = [f"flood-{i}" for i in range(FLOOD)]
        for attacker in flood:
            await publisher.publish(attacker, "agg", 0, b'{"text": "f"}', final=True, attempt=1)
        await wait_until(lambda: p.snapshot()["recoveries"] >= 32, 10, "every lookup slot taken")
        started = anyio.current_time()
        await publisher.publish(victim, "agg", 1, b'{"text": "1"}', final=True)
        await wait_until(lambda: len(answered) == 2, 30, "the victim's second result", every=0.005)
        waited = answered[1] - started
        print(f"victim answered {waited:.3f} s after its chunk, behind {FLOOD} chunks needing a lookup")
        stored = await wait_for_finals(client.jetstream(), settings.subjects, flood, 30)
    await results.unsubscribe()
    assert waited < VICTIM_BOUND, f"the started request waited {waited:.2f} s behind {FLOOD} lookups"
    assert {rid: [(s.seq, s.error) for s in stored[rid]] for rid in flood} == {
        rid: [(0, "invalid_chunk")] for rid in flood}


async def test_a_chunk_parked_behind_two_lookups_of_its_request_is_counted_once(client, nats_url, monkeypatch):
    """Chunks 1 and 3 of a request, each on its ``max_deliver``-th delivery (taken before by an owner
    that died), park behind the lookup of its chunk 2 (a first delivery), which fails: chunk 2 is
    NAKed for a retry, and chunks 1 and 3, which a NAK would strand, are decided again in order:
    chunk 1 starts a lookup of its own and chunk 3 parks behind it, a second time. It was counted in
    ``lookups_parked`` at each parking: 3 for the 2 chunks that waited behind a lookup."""
    settings = durable_settings(nats_url, partitions=1, ack_wait=1.5, max_deliver=2)
    js = client.jetstream()
    async with Processor(settings):  # the streams and the partition's consumer
        pass
    rid = "parked-twice"
    publisher = ChunkPublisher(client, settings.subjects)
    await publisher.publish(rid, "agg", 1, b'{"text": "1"}')
    await publisher.publish(rid, "agg", 3, b'{"text": "3"}')
    assert len(await dead_owner_takes(client, 2)) == 2  # delivery 1 of seqs 1 and 3: back after ack_wait
    await publisher.publish(rid, "agg", 2, b'{"text": "2"}', final=True)
    fail_the_first_lookup_once(monkeypatch, parked=2)  # once 1 and 3 parked behind it
    async with Processor(settings) as p:
        await wait_until(_empty(js), 10, "every chunk acknowledged or terminated")
        snap = p.snapshot()
    assert snap["recoveries"] >= 2 and snap["poisoned"] >= 1, snap  # chunk 2's lookup, then chunk 1's
    assert snap["lookups_parked"] == 2, snap


async def test_a_lookup_that_fails_after_its_partition_was_handed_over_logs_handed_over_not_queued_again(
        client, nats_url, monkeypatch, caplog):
    """``event=recovery_lookup_failed`` says what follows the failure: ``retry_in=queued again`` (looked
    up again with its chunks held), ``1s`` (NAKed for a retry) or ``handed over``. Instance A owns both
    partitions, lookups in flight, when B (a subprocess) joins and A releases one; then every lookup's
    first read fails. The released partition's requests were NAKed by the hand-over, and B serves
    them: their lines said ``queued again`` (the label was chosen before the lookup ran), now
    ``handed over``; the kept partition's say ``queued again`` and are looked up again. Each request's
    results are stored once, in order."""
    import logging

    caplog.set_level(logging.INFO, logger="streamproc")
    flags = dict(partitions=2, ack_wait=4.0, lease_ttl=1.5)
    settings = durable_settings(nats_url, **flags)
    js = client.jetstream()
    adopt = Recovery.adopt
    failed: set[str] = set()

    async def fail_once_after_a_release(self, r, *args, **kwargs):
        if r not in failed:
            failed.add(r)
            with anyio.fail_after(20):
                while self.stats.leases_released < 1:
                    await anyio.sleep(0.01)
            raise TimeoutError("results stream unreadable")
        return await adopt(self, r, *args, **kwargs)

    monkeypatch.setattr(Recovery, "adopt", fail_once_after_a_release)
    async with Processor(settings) as a:
        await wait_until(lambda: a.snapshot()["partitions"] == 2, 10, "A owns both partitions")
        moved, bodies = await _moved_requests(client, settings, "handed", 8)
        await wait_until(lambda: a.snapshot()["recoveries"] >= 8, 10, "every request's lookup in flight")
        # B is started and stopped in a thread: its start is waited for with time.sleep, which held
        # A's loop (A serves on this one) for as long as B took to start, past A's leases (renewed
        # every 0.5 s, served 1.35 s). A then lost both partitions (lease_expired) instead of
        # releasing one to B, and "A released a partition" never came (7 of 8 runs beside two CPU
        # burners).
        b = processor_subprocess(nats_url, *durable_flags(**flags))
        await anyio.to_thread.run_sync(b.__enter__)
        try:
            await wait_until(lambda: a.snapshot()["leases_released"] >= 1, 15, "A released a partition to B")
            await wait_for_finals(js, settings.subjects, moved, 30)
            await wait_until(_empty(js), 15, "every chunk acknowledged")
            stored = await stored_results(js, settings.subjects)
            kept = {rid for rid in moved if a.input.owns(rid)}
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(b.__exit__, None, None, None)
    _assert_each_once_in_order(stored, moved, bodies)
    said = {r.streamproc_fields["request_id"]: r.streamproc_fields["retry_in"] for r in caplog.records
            if getattr(r, "streamproc_fields", {}).get("event") == "recovery_lookup_failed"}
    assert set(said) == set(moved), said
    assert said == {rid: "queued again" if rid in kept else "handed over" for rid in moved}
    assert 0 < len(kept) < len(moved), kept  # both outcomes shown
