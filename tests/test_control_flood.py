"""Found by an attack (2026-12-06): anyone allowed to publish on the control subjects can send
migrates at will, and only their log lines were rate limited. Measured against `streamproc run`
and a real nats-server:

- many migrates of one live request: 32 are sealed (``--max-migrations``), the 33rd is refused and
  ends the request (``migration_refused``), every later one is answered ``finished``; durable mode
  writes the seal record 32 times. Bounded already, pinned in the correlator tests.
- migrates of made-up ids, huge ids, non-UTF-8 subject tokens: answered ``unknown_request`` or
  dropped as a bad subject; in durable mode each answered one costs up to four JetStream reads
  (2,000 took 2.6 s), with no bound on how many a second.

Now a process-wide token bucket (``--max-migrate-rate``, core/migrate_rate.py) answers a migrate
past it at once with ``unavailable``, a ``retry_after`` and the reason, untouched, and counts it.
"""

from __future__ import annotations

import asyncio

import anyio
import nats
import pytest

from helpers import free_port, scrape
from migration_helpers import ask_migrate
from streamproc.client.migration import Migrator
from streamproc.core.errors import MigrationError
from streamproc.nats.durable.migrations import record_key
from streamproc.core.wire import FINAL, MigrateError, MigrateErrorCode, Sealed, chunk_headers, decode_migrate_reply
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]
SUBJECTS = Subjects("streamproc")
BODY = b'{"text":"a","output_ids":[1,2,3],"meta_info":{"id":"x"}}'


async def _honest_unary(nc, rid: str, timeout: float = 5) -> bool:
    """One request of one final chunk: whether its result came within ``timeout`` seconds."""
    sub = await nc.subscribe(SUBJECTS.result(rid))
    await nc.flush()
    await nc.publish(SUBJECTS.chunk(rid, "agg"), BODY, headers=chunk_headers(rid, "agg", 0, final=True))
    try:
        msg = await sub.next_msg(timeout=timeout)
        return msg.headers is not None and msg.headers.get(FINAL) == "true"
    except nats.errors.TimeoutError:
        return False
    finally:
        await sub.unsubscribe()


@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_migrates_past_the_rate_are_refused_with_a_clear_answer_while_honest_requests_are_answered(
        nats_url, streamproc_run, mode):
    # The flood must outrun the bucket's refill: with a burst B refilled at R a second, F migrates
    # answered at r a second see a refusal only when B + R * F / r < F. At the default rate (500, B
    # 2,000) that needs r > 750 a second, which a loaded durable processor did not reach (no refusal in
    # 2 of 5 runs beside other tests); at 50 (B 200) it needs r > 52, far below any answer rate seen.
    rate = 50.0
    flood = 6_000
    port = free_port()
    live = f"live-{mode}"
    with streamproc_run("--mode", mode, "--partitions", "1", "--http-port", str(port),
                        "--http-host", "127.0.0.1", "--max-migrate-rate", f"{rate:g}") as (proc, log_path):
        attacker = await nats.connect(nats_url)
        honest = await nats.connect(nats_url)
        try:
            results = await honest.subscribe(SUBJECTS.result(live))
            await honest.flush()
            await honest.publish(SUBJECTS.chunk(live, "agg"), BODY, headers=chunk_headers(live, "agg", 0))
            await results.next_msg(timeout=10)
            answers: list = []
            answered: list[bool] = []

            async def attack() -> None:
                ids = [f"made-up-{i}" if i % 2 else "x" * 200 + str(i) for i in range(flood)]
                waits = [attacker.request(SUBJECTS.migrate(r), b"{}", timeout=60) for r in ids]
                replies = await asyncio.gather(*waits, return_exceptions=True)
                answers.extend(replies)

            async def bystanders() -> None:
                for i in range(20):
                    answered.append(await _honest_unary(honest, f"bystander-{mode}-{i}"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(attack)
                tg.start_soon(bystanders)
            lost = [a for a in answers if isinstance(a, Exception)]
            assert not lost, f"{len(lost)} of {flood} migrates unanswered, first: {lost[0]!r}"
            decoded = [decode_migrate_reply(a.data) for a in answers]
            throttled = [d for d in decoded if isinstance(d, MigrateError) and "migrate rate limit" in d.message]
            codes = {d.code for d in decoded}
            assert throttled, f"none of {flood} migrates of made-up ids was refused for the rate: {codes}"
            assert all(d.code is MigrateErrorCode.UNAVAILABLE and d.retry_after and d.retry_after > 0
                       for d in throttled), throttled[:1]
            assert codes <= {MigrateErrorCode.UNKNOWN_REQUEST, MigrateErrorCode.UNAVAILABLE}, codes
            assert scrape(port)["streamproc_control_migrates_throttled_total"] == len(throttled)
            assert all(answered), f"{answered.count(False)} of 20 honest requests unanswered during the flood"
            # The bucket is empty, but a live request's migrate is not charged to it (--max-migrations
            # bounds those): the genuine migrate right after the flood is sealed.
            reply = await ask_migrate(honest, SUBJECTS, live, id="honest")
            assert isinstance(reply, Sealed) and reply.attempt == 1, reply
            print(f"{mode}: {len(throttled)} of {flood} refused for the rate")
        finally:
            await attacker.close()
            await honest.close()
        log = log_path.read_text()
    assert "event=migrate_throttled" in log



async def test_migrators_refused_for_the_rate_ask_again_at_their_turn_not_in_a_storm(nats_url, streamproc_run):
    """300 Migrators at once against a processor answering 50 migrates a second of requests not
    active here (200 at once): each refused one is told when its turn comes (a slot reserved per
    refusal) and asks again then. Told only when the next token was due (2 ms at 500 a second) and
    asking again at its 10 ms floor, every refused Migrator retried ~100 times a second: a simulation
    of 3,000 at once made ~100,000 migrates, the flood the bucket is for."""
    port = free_port()
    count = 300
    with streamproc_run("--mode", "core", "--max-migrate-rate", "50", "--http-port", str(port),
                        "--http-host", "127.0.0.1") as (proc, log_path):
        nc = await nats.connect(nats_url)
        try:
            migrator = Migrator(nc, SUBJECTS, format="sglang", timeout=20, attempt_timeout=5)

            async def seal(rid: str) -> object:
                try:
                    return await migrator.seal(rid)
                except MigrationError as exc:
                    return exc.reply

            replies = await asyncio.gather(*(seal(f"herd-{i}") for i in range(count)))
            codes = {getattr(r, "code", r) for r in replies}
            assert codes == {MigrateErrorCode.UNKNOWN_REQUEST}, codes  # every one answered in the end
            throttled = scrape(port)["streamproc_control_migrates_throttled_total"]
            assert 0 < throttled < count, f"{throttled:.0f} refusals for {count} Migrators"
        finally:
            await nc.close()

def test_the_migrate_rate_answers_a_burst_then_its_rate_and_says_when_to_ask_again():
    from streamproc.core.migrate_rate import MigrateRate

    rate = MigrateRate(10.0, 20.0)
    assert [rate.take(100.0) for _ in range(20)] == [None] * 20
    assert rate.take(100.0) == pytest.approx(0.1) and rate.refused == 1
    assert rate.take(100.15) is None  # one refilled
    assert rate.take(99.0) is not None  # a clock stepping back refills nothing
    assert [rate.take(1000.0) for _ in range(21)].count(None) == 20  # refilled to the burst, never past it
    spread = MigrateRate(10.0, 20.0)  # refusals at once: each told a later turn, 0.1 s apart, at most 2 s ahead
    assert [spread.take(5.0) for _ in range(20)] == [None] * 20
    waits = [spread.take(5.0) for _ in range(25)]
    assert waits[:20] == pytest.approx([0.1 * (i + 1) for i in range(20)]) and waits[20:] == pytest.approx([2.0] * 5)
    unlimited = MigrateRate(0.0, 0.0)
    assert all(unlimited.take(0.0) is None for _ in range(10_000)) and unlimited.refused == 0


async def test_a_flood_of_migrates_faster_than_the_processor_reads_stays_within_its_memory_bound(
        nats_url, streamproc_run):
    """Found by the same attack: one connection publishing migrates of made-up ids as fast as it can
    (~120,000 a second) outruns any answer, refused or not; they queued in the control
    subscription's nats-py queue (524,288 messages, 128 MiB of bodies by default) and took the
    processor's VmHWM to 245 MiB. The queue now holds CONTROL_PENDING_MSGS; past it they are dropped
    (counted as dropped migrates, not as the input's slow-consumer drops) and bystanders are still
    answered."""
    from helpers import peak_rss

    port = free_port()
    with streamproc_run("--mode", "core", "--http-port", str(port), "--http-host", "127.0.0.1") as (proc, log_path):
        attacker = await nats.connect(nats_url, pending_size=64 * 1024 * 1024)
        honest = await nats.connect(nats_url)
        answered: list[bool] = []
        sent = 0
        try:
            async def attack() -> None:
                nonlocal sent
                with anyio.move_on_after(10):
                    while True:
                        for _ in range(500):
                            await attacker.publish(SUBJECTS.migrate(f"flood-{sent}"), b"{}",
                                                   reply=f"_INBOX.flood.{sent}")
                            sent += 1
                        await attacker.flush()

            async def bystanders() -> None:
                await anyio.sleep(2)  # the queue is full by now
                for i in range(5):
                    # Answered, not fast: reading the flood takes the processor's CPU (up to ~5 s seen).
                    answered.append(await _honest_unary(honest, f"flooded-{i}", timeout=20))

            async with anyio.create_task_group() as tg:
                tg.start_soon(attack)
                tg.start_soon(bystanders)
            peak = peak_rss(proc.pid)
            metrics = scrape(port)
        finally:
            await attacker.close()
            await honest.close()
    print(f"{sent} migrates in 10 s, VmHWM {peak // 1024} KiB")
    assert sent > 200_000, f"the flood was too slow to outrun the processor: {sent} migrates in 10 s"
    assert peak < 150 * 1024 * 1024, f"VmHWM {peak // 1024} KiB under a flood of {sent} migrates"
    assert all(answered), f"{answered.count(False)} of 5 bystander requests unanswered within 20 s during the flood"
    # The dropped migrates are counted as such, not as lost chunks (an alert on input loss stays quiet)
    assert metrics["streamproc_control_migrates_dropped_total"] > 0, metrics
    assert metrics["streamproc_slow_consumer_total"] == 0, metrics


async def test_migrates_answered_unavailable_log_a_burst_of_lines_then_a_suppressed_count(nats_url, streamproc_run):
    """A durable processor answers a migrate whose seal record it cannot read ``unavailable``. Its
    ``migrate_unavailable`` line went out once per migrate, outside the log limiter, so anyone allowed
    on the control subjects (and able to write such a record once) could flood the log at the migrate
    rate; now at most the limiter's burst of lines per event name (20 in 10 s)."""
    rids = [f"gone-{i}" for i in range(60)]
    with streamproc_run("--mode", "durable", "--partitions", "1") as (proc, log_path):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            names = [info.config.name for info in await js.streams_info()]
            buckets = [name.removeprefix("KV_") for name in names if name.endswith("_MIGRATIONS")]
            assert len(buckets) == 1, names
            kv = await js.key_value(buckets[0])
            for rid in rids:
                await kv.put(record_key(rid), b"not a seal record")
            answers = [await ask_migrate(nc, SUBJECTS, rid) for rid in rids]
            assert all(isinstance(a, MigrateError) and a.code is MigrateErrorCode.UNAVAILABLE for a in answers), \
                answers[:3]
        finally:
            await nc.close()
        lines = [line for line in log_path.read_text().splitlines() if "event=migrate_unavailable" in line]
    assert 1 <= len(lines) <= 20, f"{len(lines)} migrate_unavailable lines for {len(rids)} migrates"
