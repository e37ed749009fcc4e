"""Migration over a real nats-server: simulated workers die at chunk k and the request continues elsewhere.

The serving layer's part is played by :class:`streamproc.migration.Migrator`; its ``send`` hands
the rebuilt native request to a fresh simulated worker, which derives what to produce from that
request alone (how many tokens were appended to the prompt), so the test also proves the request
is right. Every scenario ends with the client-visible stream compared, result by result, with the
uninterrupted aggregated run of the same ground truth.
"""

from __future__ import annotations

import random
import time

import anyio
import msgspec
import nats.errors
import pytest

from streamproc.catalog import codec_names, worker_for
from streamproc.client.migration import MigrationError, MigrationRefused, Migrator, Resumed, publish_request
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import follow
from streamproc.core.errors import ContractError
from streamproc.sim.migration import native_request
from streamproc.simulation import Truth, make_truth
from streamproc.wire import (
    ATTEMPT,
    MigrateError,
    MigrateErrorCode,
    MigrateRequest,
    Sealed,
    Subjects,
    Verdict,
    decode_migrate_reply,
    decode_migrate_request,
    encode_control,
)

from migration_helpers import SimulatedPool, assert_uninterrupted, emitted_in

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(30)]

FORMATS = [f for f in ("sglang", "sglang-zstd", "vllm") if f in codec_names()]
# Migration is specified for the core input; the durable (JetStream) input has its own delivery order.
MODE = "core"


def truth_for(rid: str, seed: int, **overrides: object) -> Truth:
    return make_truth(seed, request_id=rid, prompt_len=6, output_len=12, chunk_sizes=[2] * 6, **overrides)


# ------------------------------------------------------------------------ scenarios

@pytest.mark.parametrize("kind", ["in-process", "subprocess"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pd", [False, True], ids=["agg", "pd"])
async def test_a_worker_dying_at_chunk_k_resumes_elsewhere_and_the_client_sees_one_stream(
        kind, fmt, pd, client, start_processor):
    truth = truth_for(f"die-{fmt}-{pd}", 10)
    async with start_processor(kind, format=fmt, mode=MODE) as rp:
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=pd)
        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            for role, bodies in pool.legs(0):
                await pool.publish(role, bodies, 0, stop=None if role == "prefill" else 2)  # dies after chunk 2
            seen = [await stream.__anext__() for _ in range(2)]
            resumed = await Migrator(client, rp.subjects, format=fmt).migrate(
                truth.request_id, native_request(fmt, truth), send=pool.serve, reason="worker lost")
            results = seen + await stream.collect()
    assert (resumed.attempt, resumed.emitted_tokens, resumed.result_seq) == (1, 4, 2)
    assert_uninterrupted(fmt, truth, results)
    # The resumed attempt's final body reports the original prompt and the continued counts: stitched
    # where the attempt's own final body says otherwise (sglang's meta_info; a vLLM stream's usage chunk).
    # vLLM's default stream has no usage (no stream_options): its final body needs no rewrite.
    w = worker_for(fmt)
    own_final = w.agg(truth.resumed(resumed.emitted_tokens), stream=True)[-1]
    rewritten = w.canonical(own_final) != w.canonical(w.agg(truth, stream=True)[-1])
    untouched = Verdict.JOINED if pd else Verdict.PASSTHROUGH
    assert results[-1].verdict is (Verdict.STITCHED if rewritten else untouched), (fmt, rewritten)
    if fmt.startswith("sglang"):
        assert rewritten  # the check above is a stitch check for these formats
    assert {r.verdict for r in results} <= {Verdict.PASSTHROUGH, Verdict.JOINED, Verdict.STITCHED}


async def test_the_resumed_request_reaches_a_worker_over_nats_with_its_attempt(client, start_processor):
    fmt = "vllm"
    truth = truth_for("served", 16)
    async with start_processor("in-process", format=fmt, mode=MODE) as rp:
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=True)
        received = []

        async def worker_service(msg) -> None:  # a worker taking requests from the serving layer
            attempt = int(msg.headers[ATTEMPT])
            received.append(attempt)
            for role, bodies in pool.legs(emitted_in(truth, msg.data)):
                await pool.publish(role, bodies, attempt)

        sub = await client.subscribe("test.generate", cb=worker_service)
        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            (_, prefill), (_, decode) = pool.legs(0)
            await pool.publish("prefill", prefill, 0)
            await pool.publish("decode", decode, 0, stop=3)
            seen = [await stream.__anext__() for _ in range(3)]
            await Migrator(client, rp.subjects, format=fmt).migrate(
                truth.request_id, native_request(fmt, truth), send=publish_request(client, "test.generate"))
            results = seen + await stream.collect()
        await sub.unsubscribe()
    assert received == [1]
    assert_uninterrupted(fmt, truth, results)


async def test_late_chunks_of_the_dead_attempt_after_the_seal_are_dropped(client, start_processor):
    fmt = "sglang"
    truth = truth_for("late", 11)
    async with start_processor("in-process", format=fmt, mode=MODE) as rp:
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=False)
        [(role, bodies)] = pool.legs(0)
        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            await pool.publish(role, bodies, 0, stop=3)
            seen = [await stream.__anext__() for _ in range(3)]
            migrator = Migrator(client, rp.subjects, format=fmt)
            resumed = await migrator.migrate(truth.request_id, native_request(fmt, truth))
            await pool.publish(role, bodies, 0, start=3)  # the "dead" worker was only partitioned
            await pool.serve(resumed)
            results = seen + await stream.collect()
        stats = rp.processor.stats
    assert_uninterrupted(fmt, truth, results)
    assert stats.sealed == len(bodies) - 3 and stats.migrations == 1


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_migrate_racing_with_the_final_chunk_never_repeats_or_loses_a_result(fmt, client, start_processor):
    outcomes = []
    async with start_processor("in-process", format=fmt, mode=MODE) as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        migrator = Migrator(client, rp.subjects, format=fmt)
        for i in range(8):
            truth = truth_for(f"race-{fmt}-{i}", 20 + i)
            pool = SimulatedPool(publisher, fmt, truth, pd=i % 2 == 1)
            async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
                legs = pool.legs(0)
                for role, bodies in legs:  # everything but the output leg's final chunk
                    await pool.publish(role, bodies, 0, stop=len(bodies) - (role != "prefill"))
                role, bodies = legs[-1]

                rng = random.Random(i)

                async def final_chunk() -> None:
                    await anyio.sleep(rng.random() * 0.006)
                    await pool.publish(role, bodies, 0, len(bodies) - 1)

                async def migrate() -> None:
                    await anyio.sleep(rng.random() * 0.002)
                    try:
                        await migrator.migrate(truth.request_id, native_request(fmt, truth), send=pool.serve)
                        outcomes.append("resumed")
                    except MigrationError as exc:
                        assert exc.code is MigrateErrorCode.FINISHED  # the final result won the race
                        outcomes.append("finished")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(migrate)
                    tg.start_soon(final_chunk)
                results = await stream.collect()
            assert_uninterrupted(fmt, truth, results)
    assert len(outcomes) == 8  # (which side wins varies with timing; both outcomes must be seamless)


async def test_a_migrate_does_not_overtake_chunks_the_processor_received_before_it(client, start_processor):
    fmt = "sglang"
    truths = [make_truth(30 + i, request_id=f"burst-{i}", prompt_len=4, output_len=40, chunk_sizes=[1] * 40)
              for i in range(5)]
    async with start_processor("in-process", format=fmt, mode=MODE) as rp:
        publish = rp.processor.input._publish

        async def congested_publish(*args, **kwargs):  # back-pressure: every result publish yields
            await anyio.sleep(0.0005)
            await publish(*args, **kwargs)

        rp.processor.input._publish = congested_publish
        publisher = ChunkPublisher(client, rp.subjects)
        migrator = Migrator(client, rp.subjects, format=fmt)
        for truth in truths:  # a burst, then at once the migrate: the seal must cover all of it
            pool = SimulatedPool(publisher, fmt, truth, pd=False)
            [(role, bodies)] = pool.legs(0)
            await pool.publish(role, bodies, 0, stop=30)
            resumed = await migrator.migrate(truth.request_id, native_request(fmt, truth))
            assert (resumed.emitted_tokens, resumed.result_seq) == (30, 30)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_migrating_a_request_whose_prefill_is_still_pending(fmt, client, start_processor):
    truth = truth_for(f"pending-{fmt}", 12, return_logprob=True)
    async with start_processor("in-process", format=fmt, mode=MODE) as rp:
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=True)
        (_, prefill), (_, decode) = pool.legs(0)
        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            await pool.publish("decode", decode, 0, stop=3)  # decode runs; the prefill worker is lost
            resumed = await Migrator(client, rp.subjects, format=fmt).migrate(
                truth.request_id, native_request(fmt, truth))
            await pool.publish("prefill", prefill, 0)  # the lost prefill shows up after the seal
            await pool.serve(resumed)
            results = await stream.collect()
        stats = rp.processor.stats
    # Every decode chunk waited for the prefill leg, so nothing had reached the client.
    assert (resumed.emitted_tokens, resumed.result_seq) == (0, 0)
    assert stats.sealed == len(prefill)
    assert_uninterrupted(fmt, truth, results)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_two_migrations_in_a_row(fmt, client, start_processor):
    truth = truth_for(f"twice-{fmt}", 13)
    async with start_processor("in-process", format=fmt, mode=MODE) as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        migrator = Migrator(client, rp.subjects, format=fmt)
        request = native_request(fmt, truth)
        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            first = SimulatedPool(publisher, fmt, truth, pd=False)
            [(role, bodies)] = first.legs(0)
            await first.publish(role, bodies, 0, stop=1)
            seen = [await stream.__anext__()]
            one = await migrator.migrate(truth.request_id, request, expected_attempt=0)
            second = SimulatedPool(publisher, fmt, truth, pd=True)  # the second home is a P/D pair
            (_, prefill), (_, decode) = second.legs(one.emitted_tokens)
            await second.publish("prefill", prefill, one.attempt)
            await second.publish("decode", decode, one.attempt, stop=2)
            seen += [await stream.__anext__() for _ in range(2)]
            two = await migrator.migrate(truth.request_id, request, expected_attempt=one.attempt)
            with pytest.raises(MigrationError) as stale:  # a migrator that missed the second migration
                await migrator.migrate(truth.request_id, request, expected_attempt=one.attempt)
            await first.serve(two)
            results = seen + await stream.collect()
    assert (one.attempt, one.emitted_tokens, two.attempt, two.emitted_tokens) == (1, 2, 2, 6)
    assert stale.value.code is MigrateErrorCode.ATTEMPT_MISMATCH and stale.value.reply.attempt == 2
    assert_uninterrupted(fmt, truth, results)


# Durable: with one instance it holds every partition's lease, so it alone answers each migrate.
@pytest.mark.parametrize("mode", [MODE, "durable"])
async def test_a_migrate_for_a_finished_or_unknown_request_gets_a_clear_error(mode, client, start_processor):
    fmt = "sglang"
    truth = truth_for("done", 14)
    async with start_processor("in-process", format=fmt, mode=mode) as rp:
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=False)
        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            await pool.serve(Resumed(truth.request_id, 0, 0, 0, native_request(fmt, truth)))
            results = await stream.collect()
        migrator = Migrator(client, rp.subjects, format=fmt)
        with pytest.raises(MigrationError) as finished:
            await migrator.migrate(truth.request_id, native_request(fmt, truth))
        with pytest.raises(MigrationError) as unknown:
            await migrator.migrate("never-seen", native_request(fmt, truth))
        malformed = decode_migrate_reply((await client.request(rp.subjects.migrate("done"), b"{nope",
                                                               timeout=5)).data)
    assert_uninterrupted(fmt, truth, results)
    assert finished.value.code is MigrateErrorCode.FINISHED
    assert unknown.value.code is MigrateErrorCode.UNKNOWN_REQUEST
    assert malformed.code is MigrateErrorCode.BAD_REQUEST


@pytest.mark.parametrize("kind", ["in-process", "subprocess"])
async def test_a_request_that_cannot_migrate_ends_at_once_with_a_migration_refused_error(
        kind, client, start_processor):
    fmt = "sglang"
    truth = truth_for("guided", 15)
    guided = native_request(fmt, truth, sampling_params={"max_new_tokens": 12, "json_schema": "{}"})
    async with start_processor(kind, format=fmt, mode=MODE) as rp:
        pool = SimulatedPool(ChunkPublisher(client, rp.subjects), fmt, truth, pd=False)
        [(role, bodies)] = pool.legs(0)
        async with follow(client, rp.subjects, truth.request_id, timeout=15) as stream:
            await pool.publish(role, bodies, 0, stop=2)
            with pytest.raises(MigrationRefused, match="guided decoding"):
                await Migrator(client, rp.subjects, format=fmt).migrate(truth.request_id, guided)
            results = await stream.collect()
        assert await client.request(rp.subjects.migrate(truth.request_id),
                                    encode_control(MigrateRequest()), timeout=5)  # still answering
    assert [r.seq for r in results] == [0, 1, 2]
    assert results[-1].final and results[-1].error == "migration_refused"
    assert b"guided decoding" in results[-1].body


async def test_the_migrator_waits_for_a_processor_that_is_not_listening_yet(client, nats_url):
    """No responders is retried within the timeout: a processor restarting is not a failure."""
    from streamproc import config
    from streamproc.nats.processor import Processor

    settings = config.load({}, {"nats_url": nats_url, "mode": MODE})
    migrator = Migrator(client, settings.subjects, format="sglang", timeout=5)

    async def start_late():
        await anyio.sleep(0.5)
        async with Processor(settings):
            await anyio.sleep(2)

    async with anyio.create_task_group() as tg:
        tg.start_soon(start_late)
        with pytest.raises(MigrationError) as unknown:
            await migrator.seal("nobody-yet")
    assert unknown.value.code is MigrateErrorCode.UNKNOWN_REQUEST


async def test_the_migrator_gives_up_on_no_responders_at_its_timeout(client, nats_url):
    from streamproc.wire import Subjects

    migrator = Migrator(client, Subjects(), format="sglang", timeout=0.3)
    with pytest.raises(nats.errors.NoRespondersError):
        await migrator.seal("nobody")


class ControlResponder:
    """Plays the processor on ``P.control.<rid>.migrate``: answers each migrate with the next reply
    of ``replies`` (the last one repeated) and keeps every request it was sent."""

    def __init__(self, replies) -> None:
        self.replies = list(replies)
        self.requests: list[MigrateRequest] = []
        self.asked_at: list[float] = []  # time.monotonic() at each request's arrival

    async def answer(self, msg) -> None:
        self.asked_at.append(time.monotonic())
        self.requests.append(decode_migrate_request(msg.data))
        reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
        await msg.respond(encode_control(reply))


async def test_the_migrator_retries_an_unavailable_seal_with_the_same_attempt_and_id(client):
    """Durable mode answers ``unavailable`` when the owner could not record the seal (its partition
    moving): nothing was sealed, so the Migrator asks again, and the retry must be the same migrate
    (same ``expected_attempt``, same ``id``), or a seal recorded meanwhile would read as a race."""
    fmt = "sglang"
    truth = truth_for("unavailable-once", 91)
    sealed = Sealed(truth.request_id, 3, 4, truth.output_ids[:4], 5, fmt, {"prompt_tokens": 6})
    responder = ControlResponder([
        MigrateError(truth.request_id, MigrateErrorCode.UNAVAILABLE, "the partition moved to another instance", 2),
        sealed,
    ])
    subjects = Subjects()
    await client.subscribe(subjects.migrate(truth.request_id), cb=responder.answer)
    await client.flush()
    migrator = Migrator(client, subjects, format=fmt, timeout=5)
    resumed = await migrator.migrate(truth.request_id, native_request(fmt, truth), expected_attempt=2,
                                     reason="worker lost")
    assert len(responder.requests) == 2
    first, retry = responder.requests
    assert retry == first and first.expected_attempt == 2 and first.id and first.reason == "worker lost"
    assert (resumed.request_id, resumed.attempt, resumed.emitted_tokens, resumed.result_seq) == (
        truth.request_id, 3, 4, 5)
    assert emitted_in(truth, resumed.body) == 4  # rebuilt from the seal the retry got


async def test_a_persistent_unavailable_ends_the_migrate_with_that_error_at_the_timeout(client):
    """No owner can record the seal for the whole ``timeout``: the Migrator keeps retrying the same
    migrate, then raises :class:`MigrationError` with code ``unavailable`` (the last reply), not
    earlier and not much later."""
    rid = "unavailable-always"
    responder = ControlResponder([MigrateError(rid, MigrateErrorCode.UNAVAILABLE, "cannot record the seal", 0)])
    subjects = Subjects()
    await client.subscribe(subjects.migrate(rid), cb=responder.answer)
    await client.flush()
    timeout = 1.0
    migrator = Migrator(client, subjects, format="sglang", timeout=timeout)
    started = time.monotonic()
    with anyio.fail_after(timeout + 30), pytest.raises(MigrationError) as failed:  # a hang, not a timing
        await migrator.seal(rid, expected_attempt=0)
    elapsed = time.monotonic() - started
    assert failed.value.code is MigrateErrorCode.UNAVAILABLE and "cannot record the seal" in str(failed.value)
    assert "ack_wait" not in str(failed.value)  # no retry_after: nothing to say about the timeout
    # Not earlier: it gives up once the time left is below its next pause (back-off capped at 0.25 s),
    # whatever the load (a slow machine only makes it later).
    assert timeout - 0.3 <= elapsed, elapsed
    # Not later: it asks no more once the timeout has run out. A wall bound on ``elapsed`` (it was
    # timeout + 0.5 s, 0.85-0.88 s measured on a loaded 2-core machine) fails on a stalled scheduler;
    # counted, the bound holds under any load. Its deadline was set before its first ask arrived, so
    # it is no later than that arrival plus the timeout; a pause begun before the deadline may end
    # past it (one ask late), and the reply to that ask ends the call. Retrying on past the timeout
    # asks again every 0.25 s.
    first = responder.asked_at[0]
    late = [round(t - first - timeout, 3) for t in responder.asked_at if t - first > timeout]
    assert len(late) <= 1, (elapsed, late)
    assert len(responder.requests) >= 4, len(responder.requests)
    assert {(r.expected_attempt, r.id) for r in responder.requests} == {(0, responder.requests[0].id)}


async def test_the_migrator_asks_again_when_the_processor_said_it_would_answer(client):
    """Unavailable with ``retry_after`` counting down to a moment just before the Migrator's timeout:
    its back-off (0.25 s) would end past the timeout, so it asks again at the moment the processor
    named and is sealed; it does not give up early and blame its timeout."""
    rid = "answers-at-1.92"
    sealed = Sealed(rid, 1, 0, [], 0, "sglang", {})
    asked: list[float] = []

    async def answer(msg) -> None:
        now = time.monotonic()
        asked.append(now)
        ready_at = asked[0] + 1.92  # the Migrator's back-off would ask at about 1.84, then give up
        reply = sealed if now >= ready_at else MigrateError(rid, MigrateErrorCode.UNAVAILABLE, "chunks wait", 0,
                                                             ready_at - now)
        await msg.respond(encode_control(reply))

    subjects = Subjects()
    await client.subscribe(subjects.migrate(rid), cb=answer)
    await client.flush()
    got = await Migrator(client, subjects, format="sglang", timeout=2.0).seal(rid, expected_attempt=0)
    assert got == sealed and asked[-1] - asked[0] < 2.0


async def test_a_retry_after_beyond_the_timeout_is_named_in_the_migrators_error(client):
    rid = "answers-in-a-minute"
    responder = ControlResponder([MigrateError(rid, MigrateErrorCode.UNAVAILABLE, "chunks wait", 0, 60.0)])
    subjects = Subjects()
    await client.subscribe(subjects.migrate(rid), cb=responder.answer)
    await client.flush()
    with pytest.raises(MigrationError) as failed:
        await Migrator(client, subjects, format="sglang", timeout=0.5).seal(rid, expected_attempt=0)
    assert "the processor needed up to 60 s more" in str(failed.value), str(failed.value)
    assert "keep the timeout above the processor's ack_wait" in str(failed.value)


async def test_a_negative_retry_after_is_an_error_not_a_busy_retry_loop(client):
    """Whatever answers on the migrate subject may be hostile: a negative ``retry_after`` would make
    the Migrator ask again at once, over and over until its timeout. The reply is refused as
    malformed instead, at its first arrival."""
    rid = "hostile-retry-after"
    answered = 0

    async def answer(msg) -> None:
        nonlocal answered
        answered += 1
        await msg.respond(b'{"status":"error","request_id":"%s","code":"unavailable","message":"m",'
                          b'"retry_after":-1}' % rid.encode())

    subjects = Subjects()
    await client.subscribe(subjects.migrate(rid), cb=answer)
    await client.flush()
    with pytest.raises(ContractError, match="retry_after"):
        await Migrator(client, subjects, format="sglang", timeout=2.0).seal(rid, expected_attempt=0)
    assert answered == 1


def test_a_v1_reader_without_retry_after_decodes_an_unavailable_reply_that_carries_it():
    """``retry_after`` was added within protocol v1: a reader built before it (the same Struct
    without the field) must still decode the reply, ignoring it."""

    class OldMigrateError(msgspec.Struct, frozen=True, tag="error", tag_field="status"):
        request_id: str
        code: MigrateErrorCode
        message: str
        attempt: int | None = None

    body = encode_control(MigrateError("r", MigrateErrorCode.UNAVAILABLE, "chunks wait", None, 4.5))
    assert b'"retry_after":4.5' in body
    old = msgspec.json.decode(body, type=OldMigrateError | Sealed)
    assert (old.code, old.message) == (MigrateErrorCode.UNAVAILABLE, "chunks wait")
    assert decode_migrate_reply(body).retry_after == 4.5
