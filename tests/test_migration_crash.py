"""Migration through processor crashes: three durable `streamproc run` instances, workers lost
mid-stream (one or two migrations per request), and the instance owning the request SIGKILLed at
seeded random points: before the migrate, between the seal and the resumed attempt's first
chunk, and in the middle of the resumed attempt. Every seed hits each of the three at least once
(the first three requests' first migrations are assigned one each, and a drawn crash waits for
an owner to kill rather than skipping the kill mid-failover).

The verifier reads the results stream: every request ends with one final result, its stored
seqs are 0..n-1 with no gap or repeat, and the client's stream equals, result by result, the
uninterrupted aggregated run of the same ground truth (tokens, text, counts, prompt fields,
routed experts). ``STREAMPROC_SOAK=1`` runs more requests and kills.
"""

from __future__ import annotations

import os
import random
import re
import time
from types import SimpleNamespace

import anyio
import httpx
import nats.js.errors
import pytest
from edge_harness import running_edge
from httpx_sse import aconnect_sse

from streamproc import config
from streamproc.catalog import worker_for
from streamproc.client.migration import MigrationError, Migrator, Resumed
from streamproc.client.publisher import ChunkPublisher
from streamproc.core.partitions import PartitionScheme, partition_of
from streamproc.nats.durable.pulls import REDELIVERY_SLACK
from streamproc.nats.durable.recovery import Recovery
from streamproc.nats.durable.input import DurableInput
from streamproc.nats.processor import Processor
from streamproc.nats.streams import CHUNKS_STREAM, partition_consumer_name
from streamproc.simulation import make_truth
from streamproc.sim.migration import native_request
from streamproc.sim.embedded import EmbeddedNats
from streamproc.client.results import follow
from streamproc.codec import Emitted
from streamproc.wire import (
    MigrateErrorCode,
    MigrateRequest,
    Sealed,
    SealRecord,
    Subjects,
    decode_migrate_reply,
    encode_control,
)

from durable_helpers import Instance, connect, dead_owner_takes, durable_flags, wait_for_finals
from helpers import wait_until
from migration_helpers import SimulatedPool, ask_migrate, assert_uninterrupted, emitted_in
from proxy_helpers import HoldingProxy

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

SOAK = os.environ.get("STREAMPROC_SOAK") == "1"
PARTITIONS = 6
# The crash points issue 13 names: before the migrate, between the seal and the resumed attempt's
# first chunk, in the middle of the resumed attempt.
CRASH_POINTS = ("before_migrate", "after_seal", "mid_resume")
CRASHES = ("none", *CRASH_POINTS)


class Cluster:
    """Three `streamproc run` instances; kills the one that owns a request, restarts it later."""

    def __init__(self, url: str, fmt: str, tmp_path, rng: random.Random) -> None:
        flags = durable_flags(format=fmt, partitions=PARTITIONS, ack_wait=1.0, lease_ttl=1.5,
                              prefill_timeout=120, request_timeout=600, log_level="INFO")
        self.instances = [Instance(url, flags, tmp_path / f"instance-{k}.log") for k in range(3)]
        self.rng = rng
        self.kills: dict[str, int] = {}
        self._restarting: set[int] = set()
        self.leases = None

    async def start(self, nc) -> None:
        for i in self.instances:
            i.start()
        for i in self.instances:
            await i.started()
        self.leases = await nc.jetstream().key_value(f"{CHUNKS_STREAM}_LEASES")

    async def owner(self, rid: str) -> Instance | None:
        try:
            entry = await self.leases.get(f"p.{partition_of(rid, PARTITIONS)}")
        except Exception:  # no holder right now (mid failover)
            return None
        holder = (entry.value or b"").decode()
        for i in self.instances:
            if i.running and f"-{i.proc.pid}-" in holder:
                return i
        return None

    async def crash_owner(self, rid: str, point: str, tg) -> bool:
        """SIGKILL the instance owning ``rid``'s partition; mid-failover, wait for the next owner
        first, so every crash point drawn is a kill."""
        with anyio.fail_after(30):
            while (victim := await self.owner(rid)) is None:
                await anyio.sleep(0.05)
        victim.kill()
        self.kills[point] = self.kills.get(point, 0) + 1
        tg.start_soon(self._restart, victim)
        return True

    async def _restart(self, victim: Instance) -> None:
        await anyio.sleep(self.rng.uniform(0.3, 1.5))
        victim.start()
        kills = victim.kills
        try:
            await victim.started()
        except AssertionError:
            if victim.kills == kills:  # it exited on its own: a real failure
                raise
            # SIGKILLed again while starting (it already held a lease): that kill restarts it again

    def log(self) -> str:
        return "\n".join(i.log() for i in self.instances)

    def stop(self) -> None:
        for i in self.instances:
            i.stop()


async def serve_request(n: int, seed: int, fmt: str, publisher: ChunkPublisher, migrator: Migrator,
                        cluster: Cluster, rng: random.Random, tg):
    """One request's life: attempt 0 lost after some chunks, 1 or 2 migrations, and for each
    migration a crash point of the owning processor drawn from ``CRASHES``."""
    truth = make_truth(seed * 1000 + n, request_id=f"mc{seed}-{n}", prompt_len=6, output_len=12,
                       chunk_sizes=[2] * 6)
    request = native_request(fmt, truth)
    rid = truth.request_id
    crashes = [rng.choice(CRASHES) for _ in range(rng.choice([1, 2]))]  # crashes[m - 1]: of migration m
    if n < len(CRASH_POINTS):  # the first requests' first migration covers every crash point, whatever the seed
        crashes[0] = CRASH_POINTS[n]
    attempt, emitted = 0, 0
    while True:
        pool = SimulatedPool(publisher, fmt, truth, pd=rng.random() < 0.5)
        legs = pool.legs(emitted)
        outputs = len(legs[-1][1])
        last = attempt == len(crashes) or outputs < 2
        stop = outputs if last else rng.randint(1, outputs - 1)  # the worker dies after `stop` output chunks
        crash = crashes[attempt - 1] if attempt else "none"
        if crash == "after_seal":  # sealed and recorded; the resumed attempt has sent nothing yet, on any leg
            await cluster.crash_owner(rid, crash, tg)
        for role, bodies in legs:
            if role == "prefill":
                await pool.publish(role, bodies, attempt)
                continue
            cut = rng.randint(1, stop) if crash == "mid_resume" else stop
            await pool.publish(role, bodies, attempt, stop=cut)
            if cut < stop or crash == "mid_resume":
                await anyio.sleep(rng.uniform(0.0, 0.3))
                await cluster.crash_owner(rid, crash, tg)
                await pool.publish(role, bodies, attempt, start=cut, stop=stop)
        if last:
            return truth
        if crashes[attempt] == "before_migrate":  # the worker and then its processor are lost
            await anyio.sleep(rng.uniform(0.0, 0.3))
            await cluster.crash_owner(rid, "before_migrate", tg)
        resumed: Resumed = await migrator.migrate(rid, request, expected_attempt=attempt, reason="worker lost")
        assert resumed.attempt == attempt + 1 and resumed.emitted_tokens >= emitted
        attempt, emitted = resumed.attempt, resumed.emitted_tokens
        # The rebuilt request says what the client was sent: the prompt plus exactly those tokens.
        assert emitted_in(truth, resumed.body) == emitted


async def run_scenario(seed: int, fmt: str, requests: int, tmp_path) -> tuple[list, dict, Cluster]:
    rng = random.Random(seed)
    with EmbeddedNats() as server:
        cluster = Cluster(server.url, fmt, tmp_path, rng)
        nc = await connect(server.url)
        truths = []
        try:
            await cluster.start(nc)
            publisher = ChunkPublisher(nc, Subjects(), durable=True)
            migrator = Migrator(nc, Subjects(), format=fmt, timeout=30, attempt_timeout=1.0)
            limit = anyio.Semaphore(3)
            async with anyio.create_task_group() as tg:
                async def one(n: int) -> None:
                    r = random.Random(seed * 7919 + n)
                    async with limit:
                        await anyio.sleep(r.uniform(0, 0.5))
                        truths.append(await serve_request(n, seed, fmt, publisher, migrator, cluster, r, tg))

                for n in range(requests):
                    tg.start_soon(one, n)
            stored = await wait_for_finals(nc.jetstream(), Subjects(), [t.request_id for t in truths], timeout=60)
        finally:
            await nc.close()
            cluster.stop()
    return truths, stored, cluster


@pytest.mark.timeout(300 if SOAK else 90)
@pytest.mark.parametrize("seed,fmt", [(3, "sglang"), (11, "vllm"), (19, "sglang-zstd")])
async def test_requests_migrating_while_their_processor_is_killed_keep_one_seamless_stream(seed, fmt, tmp_path):
    truths, stored, cluster = await run_scenario(seed, fmt, 30 if SOAK else 8, tmp_path)
    logs = cluster.log()
    assert "Traceback" not in logs
    for truth in truths:
        got = stored[truth.request_id]
        assert [r.seq for r in got] == list(range(len(got))), truth.request_id  # stored once each, no gap
        assert sum(r.final for r in got) == 1
        assert_uninterrupted(fmt, truth, got)
    assert all(cluster.kills.get(point, 0) >= 1 for point in CRASH_POINTS), cluster.kills
    # Killed owners' migrated requests were adopted by another instance from the stores.
    assert re.search(r"event=request_resumed .*attempt=[12]", logs), logs[-3000:]


# ----------------------------------------------------------------------------- through the edge

async def test_an_sse_client_follows_a_request_across_a_migration_and_a_processor_kill(tmp_path):
    """The client attaches first; the worker dies after two chunks, the processor owning the
    request is SIGKILLed, the Migrator seals through the failover, a new worker finishes: the
    client reads one stream, seqs 0..n-1, the uninterrupted run's bodies, then ``[DONE]`` once."""
    fmt = "sglang"
    rng = random.Random(5)
    truth = make_truth(77, request_id="edge-crash", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    with EmbeddedNats() as server:
        cluster = Cluster(server.url, fmt, tmp_path, rng)
        nc = await connect(server.url)
        try:
            await cluster.start(nc)
            with running_edge(server.url, "--format", fmt) as edge:
                async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
                    events = []

                    async def follow_sse() -> None:
                        async with aconnect_sse(client, "GET", f"/v1/results/{truth.request_id}") as source:
                            async for event in source.aiter_sse():
                                events.append(event)

                    publisher = ChunkPublisher(nc, Subjects(), durable=True)
                    pool = SimulatedPool(publisher, fmt, truth, pd=False)
                    with anyio.fail_after(60):
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(follow_sse)
                            [(role, bodies)] = pool.legs(0)
                            await pool.publish(role, bodies, 0, stop=2)  # the worker dies after chunk 1
                            while len(events) < 2:
                                await anyio.sleep(0.05)
                            assert await cluster.crash_owner(truth.request_id, "before_migrate", tg)
                            migrator = Migrator(nc, Subjects(), format=fmt, timeout=30)
                            await migrator.migrate(truth.request_id, native_request(fmt, truth), send=pool.serve)
        finally:
            await nc.close()
            cluster.stop()
    assert events[-1].data == "[DONE]" and [e.data for e in events].count("[DONE]") == 1
    data = [e for e in events if e.event == "message"][:-1]
    w = worker_for(fmt)
    expected = w.agg(truth, stream=True)
    assert [int(e.id) for e in data] == list(range(len(expected)))
    assert [w.canonical(e.data.encode()) for e in data] == [w.canonical(b) for b in expected]
    assert cluster.kills == {"before_migrate": 1}


# ------------------------------------------------------------------------------ the seal record

async def test_a_seal_whose_reply_was_lost_is_answered_again_by_the_next_instance(client, start_processor):
    """The instance that recorded the seal is gone before its reply arrived: a retry of the same
    migrate (same id) gets the same seal from the next instance, a different one attempt_mismatch."""
    fmt = "sglang"
    truth = make_truth(78, request_id="lost-reply", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), fmt, truth, pd=False)
    first = MigrateRequest(expected_attempt=0, id="seal-1")
    async with start_processor("in-process", format=fmt, mode="durable", partitions=2) as rp:
        async with follow(client, rp.subjects, truth.request_id, timeout=15, replay=True) as stream:
            [(role, bodies)] = pool.legs(0)
            await pool.publish(role, bodies, 0, stop=3)
            [await stream.__anext__() for _ in range(3)]
        sealed = decode_migrate_reply((await client.request(rp.subjects.migrate(truth.request_id),
                                                            encode_control(first), timeout=5)).data)
    async with start_processor("in-process", format=fmt, mode="durable", partitions=2) as rp:
        # The first instance's member key lingers for a moment: until it is gone this one takes
        # only its share of the partitions, and a migrate for the others goes unanswered.
        await wait_until(lambda: rp.processor.input.owns(truth.request_id), 15, "the request's partition owned")
        again = decode_migrate_reply((await client.request(rp.subjects.migrate(truth.request_id),
                                                           encode_control(first), timeout=5)).data)
        other = decode_migrate_reply((await client.request(
            rp.subjects.migrate(truth.request_id), encode_control(MigrateRequest(expected_attempt=0, id="seal-2")),
            timeout=5)).data)
        async with follow(client, rp.subjects, truth.request_id, timeout=15, replay=True) as stream:
            await pool.serve(Resumed(truth.request_id, sealed.attempt, sealed.emitted_tokens, sealed.result_seq,
                                     Migrator(client, format=fmt).codec.resume_request(
                                         native_request(fmt, truth),
                                         Emitted(sealed.emitted_token_ids, sealed.state))))
            results = await stream.collect()
        stats = rp.processor.input.stats
    assert (stats.migrated_adopted, stats.seals_recorded) == (1, 0)  # adopted with its record; sealed nothing
    assert isinstance(sealed, Sealed) and (sealed.attempt, sealed.emitted_tokens, sealed.result_seq) == (1, 6, 3)
    assert again == sealed
    assert other.code is MigrateErrorCode.ATTEMPT_MISMATCH and other.attempt == 1
    assert_uninterrupted(fmt, truth, results)


async def test_a_seal_recorded_by_another_instance_is_followed_by_one_that_still_holds_the_request(
        client, start_processor):
    """Two instances served the request for a moment (a lease overlap): the other one sealed and
    recorded attempt 1. This one still holds attempt 0; the first chunk of attempt 1 makes it take
    the request again from the stores and stitch the attempt as the sealing instance would have."""
    fmt = "sglang"
    truth = make_truth(79, request_id="overlap", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), fmt, truth, pd=False)
    async with start_processor("in-process", format=fmt, mode="durable", partitions=2) as rp:
        async with follow(client, rp.subjects, truth.request_id, timeout=15, replay=True) as stream:
            [(role, bodies)] = pool.legs(0)
            await pool.publish(role, bodies, 0, stop=2)
            seen = [await stream.__anext__() for _ in range(2)]
            elsewhere = Sealed(truth.request_id, 1, 4, truth.output_ids[:4], 2, fmt, {"prompt_tokens": 6})
            durable = rp.processor.input
            await durable.ledger.write(truth.request_id, SealRecord([2], elsewhere, "other-instance"), None)
            await pool.serve(Resumed(truth.request_id, 1, 4, 2, Migrator(client, format=fmt).codec.resume_request(
                native_request(fmt, truth), Emitted(elsewhere.emitted_token_ids, elsewhere.state))))
            results = seen + await stream.collect()
        assert durable.stats.migrated_adopted == 1
    assert_uninterrupted(fmt, truth, results)


# ------------------------------------------------------------------ the first chunk of a sealed attempt

async def drained(js, partition: int, timeout: float = 30.0) -> None:
    """Wait until the partition's consumer has delivered every chunk and holds none unacknowledged."""
    name = partition_consumer_name(partition)

    async def settled() -> bool:
        info = await js.consumer_info(CHUNKS_STREAM, name)
        return info.num_pending == 0 and info.num_ack_pending == 0

    with anyio.fail_after(timeout):
        while not await settled():
            await anyio.sleep(0.1)


# The heir may not create consumers on the migrations bucket's stream: it cannot list the seal
# records, and must fall back to looking up every new request's first chunk.
NO_LISTING = """authorization {
  users = [
    {user: sealer, password: sealer-pw}
    {user: heir, password: heir-pw, permissions: {
      publish: {allow: [">"], deny: ["$JS.API.CONSUMER.CREATE.KV_STREAMPROC_CHUNKS_MIGRATIONS",
                                     "$JS.API.CONSUMER.CREATE.KV_STREAMPROC_CHUNKS_MIGRATIONS.>"]}
      subscribe: {allow: [">"]}}}
  ]
}
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fmt,listing", [("sglang", "read"), ("vllm", "read"), ("sglang", "unreadable")])
async def test_the_first_output_chunk_of_a_sealed_attempt_reaching_a_new_owner_is_dropped(fmt, listing, tmp_path):
    """The seq-0 gap: a P/D request is sealed while only its prefill leg had reached a processor
    (seal at result seq 0, nothing published), the sealing instance is SIGKILLed, and only then
    does the lost decode worker's first output chunk (a first delivery) reach the new owner of the
    partition. The new owner must know the seal (it read the migrations bucket when it took the
    partition; ``unreadable``: it could not, so it looks every new request up), drop the dead
    attempt's chunks, and stitch the resumed attempt: one final result, seqs 0..n-1, the
    uninterrupted run's tokens."""
    partitions = 2
    truth = make_truth(80, request_id=f"gap-{fmt}", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    rid = truth.request_id
    # A short prefill timeout: a decode chunk taken for a fresh request would not wait long for a
    # prefill leg that was settled at the seal, and its result would be published.
    flags = durable_flags(format=fmt, partitions=partitions, ack_wait=1.0, lease_ttl=1.5, prefill_timeout=0.5)
    as_sealer = as_heir = []
    if listing == "unreadable":
        for user in ("sealer", "heir"):
            (tmp_path / user).write_text(f"{user}-pw")
        as_sealer = ["--nats-user", "sealer", "--nats-password-file", str(tmp_path / "sealer")]
        as_heir = ["--nats-user", "heir", "--nats-password-file", str(tmp_path / "heir")]
    with EmbeddedNats(config=NO_LISTING if listing == "unreadable" else None) as server:
        url = server.url if listing == "read" else server.url.replace("nats://", "nats://sealer:sealer-pw@")
        nc = await connect(url)
        sealer = Instance(server.url, [*flags, *as_sealer], tmp_path / "sealer.log")
        heir = Instance(server.url, [*flags, *as_heir], tmp_path / "heir.log")
        try:
            sealer.start()
            await sealer.started()
            pool = SimulatedPool(ChunkPublisher(nc, Subjects(), durable=True), fmt, truth, pd=True)
            [(_, prefill), (_, decode)] = pool.legs(0)
            await pool.publish("prefill", prefill, 0)
            seal = encode_control(MigrateRequest(expected_attempt=0, id="gap-seal"))
            with anyio.fail_after(20):
                while True:  # unavailable until the stored prefill leg has reached the sealer
                    reply = decode_migrate_reply((await nc.request(Subjects().migrate(rid), seal, timeout=5)).data)
                    if isinstance(reply, Sealed):
                        break
                    assert reply.code is MigrateErrorCode.UNAVAILABLE and "chunk stream" in reply.message, reply
                    await anyio.sleep(0.05)
            assert (reply.attempt, reply.emitted_tokens, reply.result_seq) == (1, 0, 0)
            sealer.kill()
            heir.start()
            await heir.started()
            leases = await nc.jetstream().key_value(f"{CHUNKS_STREAM}_LEASES")
            partition = partition_of(rid, partitions)

            async def heir_owns() -> bool:
                try:
                    entry = await leases.get(f"p.{partition}")
                except nats.js.errors.KeyNotFoundError:
                    return False
                return f"-{heir.proc.pid}-" in (entry.value or b"").decode()

            with anyio.fail_after(20):
                while not await heir_owns():
                    await anyio.sleep(0.1)
            # The lost decode worker was still publishing: its chunks' first delivery is at the heir.
            await pool.publish("decode", decode, 0)
            await drained(nc.jetstream(), partition)
            resumed = Migrator(nc, format=fmt).codec.resume_request(native_request(fmt, truth),
                                                                    Emitted(reply.emitted_token_ids, reply.state))
            await pool.serve(Resumed(rid, reply.attempt, reply.emitted_tokens, reply.result_seq, resumed))
            stored = await wait_for_finals(nc.jetstream(), Subjects(), [rid], timeout=30)
        finally:
            await nc.close()
            sealer.stop()
            heir.stop()
    got = stored[rid]
    assert [r.seq for r in got] == list(range(len(got))), [(r.seq, r.error) for r in got]
    assert sum(r.final for r in got) == 1
    assert_uninterrupted(fmt, truth, got)
    log = heir.log()
    assert "Traceback" not in log
    assert re.search(rf"event=request_resumed request_id={rid} .*attempt=1", log), log[-3000:]
    assert ("event=seal_list_unreadable" in log) == (listing == "unreadable"), log[-3000:]


async def test_a_seal_made_while_its_partition_is_handed_over_is_not_recorded(client, start_processor):
    """The next owner lists the seal records when it takes the partition, so a seal may be recorded
    only while its partition is owned: sealed here, then the partition handed over (gracefully:
    the hand-over waits a bounded time for the migrate in progress), the migrate is answered
    ``unavailable`` and nothing is recorded; the serving layer's retry goes to the next owner."""
    fmt = "sglang"
    truth = make_truth(81, request_id="handed-over", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    rid = truth.request_id
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), fmt, truth, pd=False)
    async with start_processor("in-process", format=fmt, mode="durable", partitions=2) as rp:
        durable, processor = rp.processor.input, rp.processor
        async with follow(client, rp.subjects, rid, timeout=15, replay=True) as stream:
            [(role, bodies)] = pool.legs(0)
            await pool.publish(role, bodies, 0, stop=2)
            [await stream.__anext__() for _ in range(2)]

        async def seal_then_hand_over():
            reply = await processor.exclusive(lambda now: processor.correlator.migrate(
                rid, now, expected_attempt=0, id="moving"))
            assert isinstance(reply, Sealed) and reply.result_seq == 2
            await durable.partitions.lose(durable.scheme.of(rid), graceful=True)  # what a surplus lease step does
            return reply

        reply = await durable.migrate(rid, MigrateRequest(expected_attempt=0, id="moving"), seal_then_hand_over)
        record = await durable.ledger.read(rid)
        stats = durable.stats
    assert reply.code is MigrateErrorCode.UNAVAILABLE and "moved to another instance" in reply.message, reply
    assert record == (None, None)
    assert (stats.seals_recorded, stats.seals_unavailable) == (0, 1)


# ------------------------------------------------------------- chunks still held by a dead owner

async def three_chunks_held_by_a_dead_owner(client, start_processor, seed: int, rid: str):
    """An aggregated sglang request whose worker died after three chunks, taken by an owner that died
    before acknowledging them (they come back after ack_wait 4 s). Returns (truth, pool, settings)."""
    truth = make_truth(seed, request_id=rid, prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), "sglang", truth, pd=False)
    settings = dict(format="sglang", mode="durable", partitions=1, ack_wait=4.0)
    async with start_processor("in-process", **settings):
        pass  # the chunk stream and the partition's durable consumer
    [(role, bodies)] = pool.legs(0)
    await pool.publish(role, bodies, 0, stop=3)  # the worker dies after three chunks
    assert len(await dead_owner_takes(client, 3)) == 3
    return truth, pool, settings


async def test_a_migrate_waits_for_the_chunks_a_dead_owner_took_and_never_stored(client, start_processor):
    """The owner took the lost worker's chunks and died before it stored a result: the chunks stay
    unacknowledged at the partition's consumer until ``ack_wait``, and the next owner has neither a
    stored result nor a seal record. Answering ``unknown_request`` would tell the serving layer to
    start over as attempt 0, and the dead attempt's chunks, redelivered later, would be taken as the
    new attempt's. The next owner answers ``unavailable`` while the request's chunks wait in the
    chunk stream; the Migrator's retry is sealed once they are redelivered and handled, and the
    client reads one stream."""
    fmt = "sglang"
    truth, pool, settings = await three_chunks_held_by_a_dead_owner(client, start_processor, 82, "held-by-the-dead")
    rid = truth.request_id
    async with start_processor("in-process", **settings) as rp:
        await wait_until(lambda: rp.processor.input.owns(rid), 15, "the request's partition owned")
        owned = time.monotonic()  # the partition was opened before this
        await anyio.sleep(1.0)
        asked = time.monotonic()
        first = await ask_migrate(client, rp.subjects, rid, expected_attempt=0)
        async with follow(client, rp.subjects, rid, timeout=15, replay=True) as stream:
            migrator = Migrator(client, rp.subjects, format=fmt, timeout=15)
            resumed = await migrator.migrate(rid, native_request(fmt, truth), expected_attempt=0, send=pool.serve)
            results = await stream.collect()
    assert first.code is MigrateErrorCode.UNAVAILABLE and "chunk stream" in first.message, first
    # The hold runs out ack_wait (+ slack) after the partition was taken, counted down from then.
    assert 0 < first.retry_after <= settings["ack_wait"] + REDELIVERY_SLACK - (asked - owned), first
    assert resumed.attempt == 1 and resumed.result_seq == 3, resumed
    assert emitted_in(truth, resumed.body) == resumed.emitted_tokens > 0
    assert [r.seq for r in results] == list(range(len(results))) and sum(r.final for r in results) == 1
    assert_uninterrupted(fmt, truth, results)


async def test_a_migrator_whose_timeout_is_below_the_processors_ack_wait_is_told_so(client, start_processor):
    """The same dead owner, and a Migrator with a 0.5 s timeout against an ack_wait of 4 s: it cannot
    outlast the hold, and its error says why and what to change, not only "unavailable"."""
    fmt = "sglang"
    truth, pool, settings = await three_chunks_held_by_a_dead_owner(client, start_processor, 85, "migrator-too-hasty")
    rid = truth.request_id
    async with start_processor("in-process", **settings) as rp:
        await wait_until(lambda: rp.processor.input.owns(rid), 15, "the request's partition owned")
        with pytest.raises(MigrationError) as hasty:
            await Migrator(client, rp.subjects, format=fmt, timeout=0.5).seal(rid, expected_attempt=0)
    reply = hasty.value.reply
    assert reply.code is MigrateErrorCode.UNAVAILABLE and reply.retry_after > 0.5, reply
    assert "of this Migrator's 0.5 s timeout were left: keep the timeout above the processor's ack_wait" \
        in str(hasty.value), str(hasty.value)


class StoresAt:
    """The two reads ``Recovery._chunks_waiting`` makes: the request's last chunk in the chunk
    stream (at ``last_seq``) and how far the partition's consumer has delivered."""

    def __init__(self, last_seq: int, delivered: int) -> None:
        self.last_seq, self.delivered = last_seq, delivered

    async def get_last_msg(self, stream: str, subject: str):
        return SimpleNamespace(seq=self.last_seq)

    async def consumer_info(self, stream: str, consumer: str):
        return SimpleNamespace(delivered=SimpleNamespace(stream_seq=self.delivered))


def waiting_judge(stores: StoresAt, opened: float, now: float, ack_wait: float = 4.0) -> Recovery:
    """A Recovery reduced to what ``_chunks_waiting`` reads: one partition taken at ``opened``."""
    judge = Recovery.__new__(Recovery)
    judge.scheme = PartitionScheme(Subjects(), 1)
    judge._jsm, judge.chunks_stream = stores, CHUNKS_STREAM
    judge._partitions = {0: SimpleNamespace(opened=opened, consumer="c0")}
    judge.settings = SimpleNamespace(ack_wait=ack_wait)
    judge._clock = lambda: now
    judge.stats = SimpleNamespace(chunks_undeliverable_seen=0)
    judge.limited = SimpleNamespace(log=lambda *a, **k: None)
    return judge


async def test_what_a_migrate_waits_for_chunks_to_come_back_is_named_and_bounded_where_it_can_be():
    held = await waiting_judge(StoresAt(10, 10), opened=100.0, now=101.5)._chunks_waiting("r")
    assert held is not None and held.retry_after == pytest.approx(4.0 + REDELIVERY_SLACK - 1.5)
    assert "previous owner" in held.why
    # Past the hold, a chunk the consumer never delivered (a backlog) still comes, with no bound on when.
    backlog = await waiting_judge(StoresAt(10, 5), opened=100.0, now=200.0)._chunks_waiting("r")
    assert backlog is not None and backlog.retry_after is None and "backlog" in backlog.why, backlog
    # Past the hold, a delivered one still there reached max_deliver: it never comes.
    judge = waiting_judge(StoresAt(10, 10), opened=100.0, now=200.0)
    assert await judge._chunks_waiting("r") is None and judge.stats.chunks_undeliverable_seen == 1


@pytest.mark.parametrize("storage", ["file", "memory"])
async def test_chunks_past_max_deliver_are_unavailable_only_until_they_could_have_come_back(
        client, start_processor, storage):
    """A dead owner took the request's chunks on their max_deliver-th delivery and was killed before
    it terminated them: nats-server never delivers them again but keeps them in the work-queue
    stream (``consumer.go`` ``needAck``). Nothing of the request can reach a client, so once a
    previous owner's hold would have run out (``ack_wait`` after the next owner took the partition)
    the answer is ``unknown_request`` again, not ``unavailable`` until ``chunks_max_age``."""
    fmt = "sglang"
    truth = make_truth(83, request_id=f"past-max-deliver-{storage}", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    rid = truth.request_id
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), fmt, truth, pd=False)
    settings = dict(format=fmt, mode="durable", partitions=1, ack_wait=0.5, max_deliver=2, stream_storage=storage)
    async with start_processor("in-process", **settings):
        pass
    [(role, bodies)] = pool.legs(0)
    await pool.publish(role, bodies, 0, stop=3)
    first = await dead_owner_takes(client, 3)  # delivery 1, never acknowledged
    await anyio.sleep(0.8)
    last = await dead_owner_takes(client, 3)  # delivery 2 == max_deliver: the owner is killed here
    assert (len(first), [m.metadata.num_delivered for m in last]) == (3, [2, 2, 2])
    async with start_processor("in-process", **settings) as rp:
        await wait_until(lambda: rp.processor.input.owns(rid), 15, "the request's partition owned")
        early = await ask_migrate(client, rp.subjects, rid, expected_attempt=0)
        with pytest.raises(MigrationError) as later:
            await Migrator(client, rp.subjects, format=fmt, timeout=10).seal(rid, expected_attempt=0)
        stats = rp.processor.input.stats
        stored = (await client.jetstream().stream_info(CHUNKS_STREAM)).state.messages
    assert early.code is MigrateErrorCode.UNAVAILABLE and "chunk stream" in early.message, early
    assert later.value.code is MigrateErrorCode.UNKNOWN_REQUEST, later.value
    assert stats.chunks_undeliverable_seen >= 1 and stored == 3


async def test_a_request_adopted_from_stored_results_is_sealed_at_once_while_later_chunks_wait_at_a_dead_owner(
        client, start_processor):
    """Results 0..2 stored; chunks 3..4 then taken by a dead owner and never acknowledged. The next
    owner adopts the request from the stores and seals it at result seq 3 at once (what the client
    was sent); the dead attempt's chunks, redelivered after ``ack_wait``, are dropped as sealed, and
    the client reads one stream equal to the uninterrupted run."""
    fmt = "sglang"
    truth = make_truth(84, request_id="adopted-then-sealed", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    rid = truth.request_id
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), fmt, truth, pd=False)
    settings = dict(format=fmt, mode="durable", partitions=1, ack_wait=1.0)
    [(role, bodies)] = pool.legs(0)
    async with start_processor("in-process", **settings) as rp:
        async with follow(client, rp.subjects, rid, timeout=15, replay=True) as stream:
            await pool.publish(role, bodies, 0, stop=3)
            [await stream.__anext__() for _ in range(3)]
    await pool.publish(role, bodies, 0, start=3, stop=5)
    assert len(await dead_owner_takes(client, 2)) == 2
    async with start_processor("in-process", **settings) as rp:
        await wait_until(lambda: rp.processor.input.owns(rid), 15, "the request's partition owned")
        sealed = await ask_migrate(client, rp.subjects, rid, expected_attempt=0, id="s1")
        assert isinstance(sealed, Sealed) and (sealed.attempt, sealed.result_seq) == (1, 3), sealed
        await wait_until(lambda: rp.processor.correlator.stats.sealed == 2, 15, "the dead attempt's chunks dropped")
        body = Migrator(client, format=fmt).codec.resume_request(
            native_request(fmt, truth), Emitted(sealed.emitted_token_ids, sealed.state))
        async with follow(client, rp.subjects, rid, timeout=15, replay=True) as stream:
            await pool.serve(Resumed(rid, sealed.attempt, sealed.emitted_tokens, sealed.result_seq, body))
            results = await stream.collect()
    assert emitted_in(truth, body) == sealed.emitted_tokens > 0
    assert [r.seq for r in results] == list(range(len(results))) and sum(r.final for r in results) == 1
    assert_uninterrupted(fmt, truth, results)


# ------------------------------------------------------------------ a stalled owner's lapsed lease

async def test_a_stalled_owner_sends_no_result_from_a_partition_whose_lease_may_have_run_out(client, start_processor):
    """A process stalled past its lease's margin (a GC pause, SIGSTOP, a starved host) must not, when
    it runs again, publish results before its watchdog notices: the next owner may already have read
    the stored results and sealed a migrate on them. Played in-process by moving the lease's
    ``valid_until`` into the past: the next chunk's result is not sent from the lapsed partition (the
    partition is fenced off as that result is about to leave: its request handed over, the chunk
    NAKed), and once the partition is taken again the request resumes from what is stored: one
    stream, nothing lost or repeated."""
    fmt = "sglang"
    truth = make_truth(85, request_id="stalled-owner", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    rid = truth.request_id
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), fmt, truth, pd=False)
    [(role, bodies)] = pool.legs(0)
    async with start_processor("in-process", format=fmt, mode="durable", partitions=1, lease_ttl=3.0) as rp:
        durable = rp.processor.input
        async with follow(client, rp.subjects, rid, timeout=20, replay=True) as stream:
            await pool.publish(role, bodies, 0, stop=2)
            results = [await stream.__anext__() for _ in range(2)]
            assert (durable.stats.leases_lost, durable.stats.leases_acquired) == (0, 1)
            await anyio.sleep(0.05)  # the stall (longer than the fence's check interval)...
            durable.leases.owned[0].valid_until = durable._clock() - 0.01  # ...outlived the lease
            await pool.publish(role, bodies, 0, start=2, stop=3)
            results.append(await stream.__anext__())
            # Result 2 left only after the partition was given up and taken again (not at once).
            assert (durable.stats.leases_lost, durable.stats.leases_acquired) == (1, 2), durable.stats
            await pool.publish(role, bodies, 0, start=3)
            results += await stream.collect()
    assert [r.seq for r in results] == list(range(len(results))) and sum(r.final for r in results) == 1
    assert_uninterrupted(fmt, truth, results)


async def _sent_while_the_step_waits(proxy, sent: list[int], publish, window: float) -> list[int]:
    """Once ``proxy`` holds the lease step's KV request: the result seqs that reach the server within
    ``window`` seconds of ``publish()`` (the request's next chunk); then the step may go on."""
    with anyio.fail_after(5):
        await proxy.held.wait()
    before = len(sent)
    await publish()
    with anyio.move_on_after(window):
        while len(sent) == before:
            await anyio.sleep(0.01)
    seen = sent[before:]
    proxy.release()
    return seen


async def test_a_lease_that_lapsed_as_a_lease_step_began_sends_no_result_while_the_step_waits_on_the_kv(
        client, nats_url):
    """A lease that may have run out when a lease step begins (the process stalled past its margin,
    and the lease loop, not a send or the watchdog, is the first to run again) must be given up
    before the step's KV writes are awaited: while they take their time (here the member heartbeat
    is held back by a proxy in front of the real server, a slow JetStream store to the processor),
    results keep being decided and sent, and the next owner may already have sealed a migrate on
    what was stored. So no result of the request leaves while the step waits, and once the
    partition is taken again the request resumes from what is stored: one stream."""
    fmt = "sglang"
    truth = make_truth(86, request_id="lapsed-at-step", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    rid = truth.request_id
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), fmt, truth, pd=False)
    [(role, bodies)] = pool.legs(0)
    member_heartbeat = f"$KV.{CHUNKS_STREAM}_LEASES.m.".encode()
    proxy = HoldingProxy(int(nats_url.rsplit(":", 1)[1]), lambda subject: subject.startswith(member_heartbeat))
    async with proxy.running():
        settings = config.load({}, {"nats_url": proxy.url, "format": fmt, "mode": "durable", "partitions": 1})
        async with Processor(settings) as processor:
            durable = processor.input
            assert isinstance(durable, DurableInput)
            sent: list[int] = []  # result seqs as they reach the server, straight from it

            async def on_result(msg) -> None:
                sent.append(int(msg.headers["Streamproc-Seq"]))

            sub = await client.subscribe(processor.subjects.result(rid), cb=on_result)
            await client.flush()
            async with follow(client, processor.subjects, rid, timeout=30, replay=True) as stream:
                await pool.publish(role, bodies, 0, stop=2)
                results = [await stream.__anext__() for _ in range(2)]
                assert (durable.stats.leases_lost, durable.stats.leases_acquired) == (0, 1)
                async with durable.partitions._lease_lock:  # the lease loop's next step waits here...
                    await wait_until(lambda: durable.partitions._lease_lock.statistics().tasks_waiting == 1, 10,
                                     "the lease loop's next step waiting for the lease lock")
                    proxy.arm()  # ...its member heartbeat will be slow...
                    durable.leases.owned[0].valid_until = durable._clock() - 0.01  # ...and the lease lapsed
                # The step is waiting on the KV; 1 s is well inside the heartbeat's timeout (lease_ttl / 4).
                sent_while_waiting = await _sent_while_the_step_waits(
                    proxy, sent, lambda: pool.publish(role, bodies, 0, start=2, stop=3), window=1.0)
                await pool.publish(role, bodies, 0, start=3)
                assert sent_while_waiting == [], (
                    f"results {sent_while_waiting} of a partition whose lease had lapsed were sent while the "
                    f"lease step waited on the KV")
                results += await stream.collect()
            await sub.unsubscribe()
            assert durable.stats.leases_lost == 1 and durable.stats.leases_acquired == 2, durable.stats
    assert [r.seq for r in results] == list(range(len(results))) and sum(r.final for r in results) == 1
    assert_uninterrupted(fmt, truth, results)


async def test_a_lease_a_step_finds_taken_over_sends_no_result_while_the_step_goes_on(client, nats_url):
    """An operator deleted the lease and another instance took it (a create, the key being free)
    while this one still counts it valid: its renewal fails (``KeyWrongLastSequenceError``). The
    partition must be given up from that moment: the step's later KV requests may take their time
    (here the member count, held back by a proxy in front of the real server), and the other
    instance may seal a migrate on what was stored meanwhile. So no result of the request leaves
    while the step goes on, and once the partition is free again and taken back the request
    resumes from what is stored: one stream."""
    fmt = "sglang"
    truth = make_truth(87, request_id="taken-over-at-step", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    rid = truth.request_id
    pool = SimulatedPool(ChunkPublisher(client, Subjects(), durable=True), fmt, truth, pd=False)
    [(role, bodies)] = pool.legs(0)
    bucket = f"{CHUNKS_STREAM}_LEASES"
    member_count = f"$JS.API.STREAM.INFO.KV_{bucket}".encode()
    proxy = HoldingProxy(int(nats_url.rsplit(":", 1)[1]), lambda subject: subject == member_count)
    async with proxy.running():
        settings = config.load({}, {"nats_url": proxy.url, "format": fmt, "mode": "durable", "partitions": 1,
                                    "lease_ttl": 3.0})
        async with Processor(settings) as processor:
            durable = processor.input
            assert isinstance(durable, DurableInput)
            sent: list[int] = []  # result seqs as they reach the server, straight from it

            async def on_result(msg) -> None:
                sent.append(int(msg.headers["Streamproc-Seq"]))

            sub = await client.subscribe(processor.subjects.result(rid), cb=on_result)
            await client.flush()
            kv = await client.jetstream().key_value(bucket)
            async with follow(client, processor.subjects, rid, timeout=30, replay=True) as stream:
                await pool.publish(role, bodies, 0, stop=2)
                results = [await stream.__anext__() for _ in range(2)]
                async with durable.partitions._lease_lock:  # the lease loop's next step waits here
                    await wait_until(lambda: durable.partitions._lease_lock.statistics().tasks_waiting == 1, 10,
                                     "the lease loop's next step waiting for the lease lock")
                    await kv.delete(durable.leases.key(0))
                    await kv.create(durable.leases.key(0), b"another-instance")
                    proxy.arm()  # the step's member count will be slow
                # The renewal failed; the step is waiting on the KV; 0.5 s is inside the member count's
                # timeout (lease_ttl / 4).
                sent_while_waiting = await _sent_while_the_step_waits(
                    proxy, sent, lambda: pool.publish(role, bodies, 0, start=2, stop=3), window=0.5)
                await pool.publish(role, bodies, 0, start=3)
                assert sent_while_waiting == [], (
                    f"results {sent_while_waiting} of a partition whose lease another instance holds were sent "
                    f"while the lease step went on")
                results += await stream.collect()
            await sub.unsubscribe()
            assert durable.stats.leases_lost == 1 and durable.stats.leases_acquired == 2, durable.stats
    assert [r.seq for r in results] == list(range(len(results))) and sum(r.final for r in results) == 1
    assert_uninterrupted(fmt, truth, results)


async def test_closing_a_given_up_partition_late_leaves_the_partition_taken_again_in_place(client, start_processor):
    """A partition given up (fenced, or its lease lost) is closed in the background while its
    subscription drains; if the instance takes the partition again meanwhile, the late close must
    not unregister the new one, which would leave a leased partition that nobody pulls."""
    async with start_processor("in-process", format="sglang", mode="durable", partitions=1) as rp:
        durable = rp.processor.input
        old = durable.partitions.owned[0]
        await durable.partitions.open(0, {})  # taken again before the old subscription's drain finished
        new = durable.partitions.owned[0]
        await durable.partitions.close(old)
        assert durable.partitions.owned.get(0) is new and new.active and not old.active
