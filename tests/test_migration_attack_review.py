"""Attacks on migration (review session): races, hostile or buggy workers and frontends, against a
real nats-server. The first tests pin what held (a lost worker that keeps publishing while it is
migrated away, chains of migrations with every worker still live); the others each pin a defect
the attack found."""

from __future__ import annotations

import gc
import json
import random
import secrets
import tracemalloc

import anyio
import pytest

from streamproc.catalog import codec_class
from streamproc.core.defaults import FRONTEND_INBOX_PREFIX
from streamproc.core.errors import ContractError
from streamproc.client.migration import MigrationRefused, Migrator, Resumed
from streamproc.codec import Emitted
from streamproc.wire import MigrateErrorCode, MigrateRequest, Sealed, decode_migrate_reply, encode_control
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import follow
from streamproc.sim.migration import native_request
from streamproc.simulation import make_truth
from streamproc_sglang.upstream import Shape
from streamproc_sglang.worker import SGLangWorker

from helpers import connection, wait_until
from migration_helpers import SimulatedPool, assert_uninterrupted, without_attempt_values

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]


@pytest.mark.parametrize("mode", ["core", "durable"])
@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_a_migrate_while_the_old_worker_keeps_publishing_never_repeats_or_loses_a_result(mode, fmt, client, start_processor):
    async with start_processor("in-process", format=fmt, mode=mode) as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        migrator = Migrator(client, rp.subjects, format=fmt)
        for i in range(12):
            rng = random.Random(i)
            truth = make_truth(100 + i, request_id=f"fz-{mode}-{fmt}-{i}", prompt_len=6, output_len=24,
                               chunk_sizes=[1] * 24)
            old = SimulatedPool(publisher, fmt, truth, pd=rng.random() < 0.5)
            new = SimulatedPool(publisher, fmt, truth, pd=rng.random() < 0.5)
            async with follow(client, rp.subjects, truth.request_id, timeout=20) as stream:
                legs = old.legs(0)
                for role, bodies in legs:
                    await old.publish(role, bodies, 0, stop=3 if role != "prefill" else None)
                role, bodies = legs[-1]

                async def keep_publishing() -> None:
                    for seq in range(3, len(bodies) - 1):  # never the final
                        await old.publish(role, bodies, 0, start=seq, stop=seq + 1)
                        if rng.random() < 0.3:
                            await anyio.sleep(0.0005)

                async def migrate() -> None:
                    await anyio.sleep(rng.random() * 0.003)
                    await migrator.migrate(truth.request_id, native_request(fmt, truth), send=new.serve,
                                           expected_attempt=0)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(keep_publishing)
                    tg.start_soon(migrate)
                results = await stream.collect()
            assert_uninterrupted(fmt, truth, results)


async def three_migrations_while_every_lost_worker_publishes(client, rp, fmt: str, truth, rng: random.Random,
                                                             worker=None) -> list:
    """A request migrated three times, each abandoned worker still publishing a few more chunks
    while the next attempt starts; the results its client saw."""
    publisher = ChunkPublisher(client, rp.subjects)
    migrator = Migrator(client, rp.subjects, format=fmt)
    async with follow(client, rp.subjects, truth.request_id, timeout=30) as stream:

        async def run_worker(attempt: int, emitted: int, pd: bool, stop_after: int | None) -> None:
            pool = SimulatedPool(publisher, fmt, truth, pd=pd)
            if worker is not None:
                pool.worker = worker
            legs = pool.legs(emitted)
            for role, bodies in legs[:-1]:
                await pool.publish(role, bodies, attempt)
            role, bodies = legs[-1]
            n = len(bodies) if stop_after is None else min(stop_after, len(bodies) - 1)
            for seq in range(n):
                await pool.publish(role, bodies, attempt, start=seq, stop=seq + 1)
                if rng.random() < 0.3:
                    await anyio.sleep(0.0005)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_worker, 0, 0, rng.random() < 0.5, 4)
            attempt = 0
            for k in range(3):
                await anyio.sleep(rng.random() * 0.004)
                sealed = await migrator.seal(truth.request_id, expected_attempt=attempt)
                attempt = sealed.attempt
                tg.start_soon(run_worker, attempt, sealed.emitted_tokens, rng.random() < 0.5,
                              None if k == 2 else rng.randrange(1, 6))
        return await stream.collect()


@pytest.mark.parametrize("mode", ["core", "durable"])
@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_three_migrations_in_a_row_with_every_lost_worker_still_publishing_keep_one_stream(mode, fmt, client, start_processor):
    async with start_processor("in-process", format=fmt, mode=mode) as rp:
        for i in range(6):
            truth = make_truth(200 + i, request_id=f"ch-{mode}-{fmt}-{i}", prompt_len=6, output_len=30,
                               chunk_sizes=[1] * 30)
            results = await three_migrations_while_every_lost_worker_publishes(client, rp, fmt, truth,
                                                                               random.Random(1000 + i))
            assert_uninterrupted(fmt, truth, results)


@pytest.mark.parametrize("streaming", ["cumulative", "incremental"])
@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_three_migrations_of_upstream_shaped_sglang_streams_keep_one_stream(streaming, mode, client, start_processor):
    fmt = "sglang"
    worker = SGLangWorker(shape=Shape(streaming=streaming))
    async with start_processor("in-process", format=fmt, mode=mode, format_option=f"streaming={streaming}") as rp:
        for i in range(6):
            truth = make_truth(300 + i, request_id=f"up-{streaming}-{mode}-{i}", prompt_len=6, output_len=30,
                               chunk_sizes=[1] * 30)
            results = await three_migrations_while_every_lost_worker_publishes(client, rp, fmt, truth,
                                                                               random.Random(2000 + i), worker)
            expected = worker.agg(truth, stream=True)
            assert [r.seq for r in results] == list(range(len(expected)))
            assert all(r.error is None for r in results), [r.body for r in results if r.error]
            # The resumed attempts' timings and retraction counts are omitted (stitch_incomplete);
            # everything else is the run's.
            assert [without_attempt_values(worker.canonical(r.body)) for r in results] == \
                [without_attempt_values(worker.canonical(b)) for b in expected]


# ------------------------------------------------------------------ memory held by seals

async def test_the_sealed_replies_a_processor_keeps_for_retries_are_charged_to_its_byte_budget(client, start_processor):
    """Each seal keeps its reply for a retry with the same id (a lost reply), every emitted token id
    included. Kept as a list of Python ints (36 bytes a token), outside the byte budget, it was 4 to
    5 times what the budget charged for the request's whole progress state (8 bytes a token): 10
    requests of 100,000 tokens held 52 MB after their seals with 1.6 MB more charged."""
    fmt, requests, tokens = "sglang", 10, 100_000
    async with start_processor("in-process", format=fmt, mode="core") as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        migrator = Migrator(client, rp.subjects, format=fmt)
        correlator = rp.processor.correlator
        rng = random.Random(7)
        bodies = {c: json.dumps({"text": "x", "output_ids": [rng.randrange(1000, 32000) for _ in range(10_000)],
                                 "meta_info": {"id": "x", "prompt_tokens": 5}}).encode()
                  for c in range(tokens // 10_000)}
        gc.collect()
        tracemalloc.start()
        try:
            for i in range(requests):
                for c, body in bodies.items():
                    await publisher.publish(f"big-{i}", "agg", c, body)
            await wait_until(lambda: correlator.stats.chunks == requests * len(bodies), 20, "every chunk handled")
            for i in range(requests):
                assert (await migrator.seal(f"big-{i}")).emitted_tokens == tokens
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        charged = correlator.charged_bytes
    # Everything allocated since the requests started and still held is what the budget charged for
    # them (slack: the clients' buffers, the requests' other state).
    assert held <= charged + 4_000_000, (held, charged)


# ------------------------------------------------------------------ a migrate id used twice

@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_a_migrate_reusing_an_earlier_migrates_id_is_not_answered_with_that_stale_seal(
        mode, client, start_processor):
    """A frontend that names every migrate of a request alike (here: by the request id) migrates it
    twice. The second migrate (expected_attempt 1: seal the attempt the first one granted, after it
    published 3 results) got the first one's reply again: "sealed, attempt 1, 4 emitted tokens,
    result_seq 2", though the client had 5 results (10 tokens) and nothing was sealed. The frontend
    then resumes from token 4 as attempt 1, beside the attempt-1 worker it gave up, whose chunks are
    still published."""
    fmt = "sglang"
    truth = make_truth(400, request_id=f"reuse-{mode}", prompt_len=6, output_len=24, chunk_sizes=[2] * 12)
    async with start_processor("subprocess", format=fmt, mode=mode) as rp:
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=False)

        async def migrate(expected: int) -> object:
            body = encode_control(MigrateRequest(expected_attempt=expected, id=truth.request_id))
            return decode_migrate_reply((await client.request(rp.subjects.migrate(truth.request_id), body,
                                                              timeout=5)).data)

        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            [(role, bodies)] = pool.legs(0)
            await pool.publish(role, bodies, 0, stop=2)
            seen = [await stream.__anext__() for _ in range(2)]
            one = await migrate(0)
            again = await migrate(0)  # a retry of it (its reply lost) still gets the same seal
            assert isinstance(one, Sealed) and again == one and (one.attempt, one.result_seq) == (1, 2)
            [(role, bodies)] = pool.legs(one.emitted_tokens)
            await pool.publish(role, bodies, one.attempt, stop=3)  # attempt 1 publishes 3, then is lost
            seen += [await stream.__anext__() for _ in range(3)]
            two = await migrate(1)
            assert isinstance(two, Sealed), two
            assert (two.attempt, two.emitted_tokens, two.result_seq) == (2, 10, 5), two
            await pool.publish(role, bodies, one.attempt, start=3)  # the given-up attempt 1 is sealed now
            await pool.serve(resumed_for(two, truth, fmt))
            results = seen + await stream.collect()
    assert_uninterrupted(fmt, truth, results)


def resumed_for(sealed: Sealed, truth, fmt: str):
    """The resumed request the Migrator would send for ``sealed``."""
    body = codec_class(fmt)().resume_request(native_request(fmt, truth),
                                             Emitted(sealed.emitted_token_ids, sealed.state))
    return Resumed(sealed.request_id, sealed.attempt, sealed.emitted_tokens, sealed.result_seq, body)


# ------------------------------------------------- a refusal of a request with nothing received yet

@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_a_request_that_cannot_move_whose_worker_died_before_its_first_chunk_still_ends_at_once(
        mode, client, start_processor):
    """Guided decoding cannot move, so the Migrator refuses it: "the client's stream ends at once"
    with a migration_refused error result. Its worker died before publishing anything: the
    processor answered unknown_request, published nothing and keeps no state (so no request timeout
    either), the Migrator ignored that answer and raised MigrationRefused as if the client had been
    told, and the client waited for a result that never came."""
    fmt = "sglang"
    truth = make_truth(500, request_id=f"guided-early-{mode}", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    guided = native_request(fmt, truth, sampling_params={"max_new_tokens": 12, "json_schema": "{}"})
    async with start_processor("subprocess", format=fmt, mode=mode) as rp:
        async with follow(client, rp.subjects, truth.request_id, timeout=5) as stream:
            with pytest.raises(MigrationRefused, match="guided decoding"):
                await Migrator(client, rp.subjects, format=fmt).migrate(truth.request_id, guided)
            results = await stream.collect()
        # The lost worker was slower than thought: its chunks are late now, not a new request.
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=False)
        async with follow(client, rp.subjects, truth.request_id, timeout=1) as late:
            [(role, bodies)] = pool.legs(0)
            await pool.publish(role, bodies, 0)
            with pytest.raises(TimeoutError):
                await late.collect()
        # A refusal naming an attempt above 0 is not for a request nothing reached: unknown, nothing
        # published, nothing kept (no request left to time out later).
        other = "guided-early-other-" + mode
        async with follow(client, rp.subjects, other, timeout=1) as nothing:
            body = encode_control(MigrateRequest(expected_attempt=3, refuse="x", id="r"))
            reply = decode_migrate_reply((await client.request(rp.subjects.migrate(other), body, timeout=5)).data)
            with pytest.raises(TimeoutError):
                await nothing.collect()
    assert [(r.seq, r.final, r.error) for r in results] == [(0, True, "migration_refused")]
    assert b"guided decoding" in results[0].body
    assert reply.code is MigrateErrorCode.UNKNOWN_REQUEST


# -------------------------------------- a malformed chunk of an attempt that was sealed already

@pytest.mark.parametrize("mode", ["core", "durable"])
@pytest.mark.parametrize("bad", [{"Streamproc-Seq": "three"}, {"Streamproc-Seq": "3", "Streamproc-Final": "yes"}],
                         ids=["bad-seq", "bad-final"])
async def test_a_malformed_chunk_of_a_sealed_attempt_is_dropped_not_the_end_of_the_resumed_request(
        mode, bad, client, start_processor):
    """Chunks of a sealed attempt are dropped (counted ``sealed``): the worker it was taken from is
    lost to the frontend and may still publish anything. A malformed one (its Streamproc-Seq or
    Streamproc-Final unreadable) was not: it failed the header checks before its attempt was looked
    at, and ended the resumed request with an invalid_chunk error result at seq 2, its stream cut
    short for a message of a worker it had left."""
    fmt = "sglang"
    truth = make_truth(700, request_id=f"sealed-garbage-{mode}-{len(bad)}", prompt_len=6, output_len=12,
                       chunk_sizes=[2] * 6)
    async with start_processor("subprocess", format=fmt, mode=mode) as rp:
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=False)
        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            [(role, bodies)] = pool.legs(0)
            await pool.publish(role, bodies, 0, stop=2)
            seen = [await stream.__anext__() for _ in range(2)]
            resumed = await Migrator(client, rp.subjects, format=fmt).migrate(truth.request_id,
                                                                              native_request(fmt, truth))
            subject = rp.subjects.chunk(truth.request_id, role)
            headers = {"Streamproc-Attempt": "0", **bad}
            if mode == "durable":
                await client.jetstream().publish(subject, bodies[3], headers=headers)
            else:
                await client.publish(subject, bodies[3], headers=headers)
            await client.flush()
            await anyio.sleep(0.3)  # the old worker's chunk first, then the resumed attempt
            await pool.serve(resumed)
            results = seen + await stream.collect()
    assert [(r.seq, r.error) for r in results if r.error] == [], [r.body for r in results if r.error]
    assert_uninterrupted(fmt, truth, results)


async def test_a_malformed_chunk_of_a_sealed_attempt_reaching_the_next_instance_is_dropped_too(client, start_processor):
    """Durable mode, the same after a failover: the instance that sealed the request is gone (here
    stopped), the next one does not hold the request. Every chunk of a request it does not hold is
    looked up in the stores first, but a malformed one was not: it was taken for a new request and
    answered with an invalid_chunk error result at seq 0 (a second seq 0 after the client's two
    results, seen by live subscribers; JetStream dropped it as a duplicate of Nats-Msg-Id
    ``<id>.0``), and the request was remembered as finished, so every chunk of the resumed attempt
    was dropped as late: the client got 2 results and never a final one."""
    fmt = "sglang"
    truth = make_truth(800, request_id="sealed-garbage-failover", prompt_len=6, output_len=12, chunk_sizes=[2] * 6)
    pool = SimulatedPool(ChunkPublisher(client, durable=True), fmt, truth, pd=False)
    [(role, bodies)] = pool.legs(0)
    async with follow(client, pool.publisher.subjects, truth.request_id, timeout=20) as stream:
        async with start_processor("subprocess", format=fmt, mode="durable") as rp:
            await pool.publish(role, bodies, 0, stop=2)
            seen = [await stream.__anext__() for _ in range(2)]
            resumed = await Migrator(client, rp.subjects, format=fmt).migrate(truth.request_id,
                                                                              native_request(fmt, truth))
        async with start_processor("subprocess", format=fmt, mode="durable") as rp:
            await client.jetstream().publish(rp.subjects.chunk(truth.request_id, role), bodies[3],
                                             headers={"Streamproc-Attempt": "0", "Streamproc-Seq": "three"})
            await anyio.sleep(0.5)
            await pool.serve(resumed)
            results = seen + await stream.collect()
    assert [(r.seq, r.error) for r in results if r.error] == [], [r.body for r in results if r.error]
    assert_uninterrupted(fmt, truth, results)


DEEP = b"[" * 100_000 + b"]" * 100_000  # msgspec raises RecursionError for it (in Any and skipped fields)


async def test_a_migrate_request_nested_too_deeply_is_answered_bad_request(start_processor, nats_url):
    """The processor's control handler caught msgspec's DecodeError and ValidationError only: a body
    whose unknown field was 100,000 arrays deep raised RecursionError in its callback, and the
    sender got no answer (a flat malformed body gets bad_request). Found by a reviewer."""
    async with start_processor("in-process", mode="core") as rp:
        async with connection(nats_url) as nc:
            subject = rp.subjects.migrate("deep-migrate")
            inbox = f"{FRONTEND_INBOX_PREFIX}.{secrets.token_hex(8)}"
            sub = await nc.subscribe(inbox)
            await nc.publish(subject, b'{"zz":' + DEEP + b"}", reply=inbox)
            answer = await sub.next_msg(timeout=5)
    assert b"bad_request" in answer.data, answer.data[:200]


async def test_a_migrate_reply_nested_too_deeply_is_a_contract_error(client):
    """``Migrator``: anything that is no migrate reply raises ContractError; a reply with a state
    100,000 arrays deep raised RecursionError."""
    async def answer(msg) -> None:
        await msg.respond(b'{"status":"sealed","request_id":"deep-reply","attempt":1,"emitted_tokens":0,'
                          b'"emitted_token_ids":[],"result_seq":0,"format":"f","state":{"a":' + DEEP + b"}}")

    await client.subscribe("streamproc.control.deep-reply.migrate", cb=answer)
    await client.flush()
    with pytest.raises(ContractError):
        await Migrator(client, format="sglang", timeout=2, attempt_timeout=0.5).refuse("deep-reply", "x")
