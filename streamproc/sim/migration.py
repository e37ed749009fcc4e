"""A request that migrates mid-decode, as the demo shows it (issue 12 item 8).

A worker (pair) dies after publishing ``die_after`` output chunks; the serving layer's part is
played by :class:`~streamproc.client.migration.Migrator`, whose ``send`` hands the rebuilt native
request to a fresh simulated worker (pair) that serves it as attempt 1 to the end. Nothing is
trusted: the client's results must be, result by result, those of the uninterrupted aggregated
run of the same ground truth, and the migrator's rebuilt request must say exactly which tokens
were already sent (the same checks as tests/test_migration_nats.py).
"""

from __future__ import annotations

from typing import Literal

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient

from ..catalog import worker_for
from ..client.migration import MigrationError, MigrationRefused, Migrator, Resumed
from ..client.publisher import ChunkPublisher
from ..client.results import ResultCollector
from ..core.wire import ResultInfo, Role, Subjects, Verdict
from .simulation import SimulatedWorker, Truth, make_truth

# Every output chunk holds two tokens, so dying after two chunks means four tokens were sent.
OUTPUT_LEN = 12
CHUNK_TOKENS = 2
DIE_AFTER = 2


class MigratingRequest(msgspec.Struct):
    """One planned migration: the request, its truth, and how far its first worker got."""

    request_id: str
    kind: Literal["agg", "pd"]
    truth: Truth
    die_after: int = DIE_AFTER
    resumed: Resumed | None = None  # what the migrator sent on (set by :func:`run_migration`)
    error: str | None = None  # why the migrator failed, if it did


def plan_migrations(*, seed: int, id_prefix: str) -> list[MigratingRequest]:
    """One aggregated and one P/D streaming request, each migrating after ``DIE_AFTER`` chunks."""
    plans = []
    for i, kind in enumerate(("agg", "pd")):
        rid = f"{id_prefix}-migrated-{kind}"
        truth = make_truth(seed * 1_000_003 + 900_000 + i, request_id=rid, prompt_len=6, output_len=OUTPUT_LEN,
                           chunk_sizes=[CHUNK_TOKENS] * (OUTPUT_LEN // CHUNK_TOKENS))
        plans.append(MigratingRequest(rid, kind, truth))  # type: ignore[arg-type]
    return plans


def native_request(format: str, truth: Truth, **extra: object) -> bytes:
    """The original request the serving layer sent, in the engine's own shape (the format's
    simulated worker renders it: ``SimulatedWorker.request``)."""
    return worker_for(format).request(truth, **extra)


def _legs(worker: SimulatedWorker, m: MigratingRequest, emitted: int) -> list[tuple[Role, list[bytes]]]:
    """The legs a worker (pair) publishes for the request resumed after ``emitted`` tokens (0: the original)."""
    if m.kind == "pd":
        return [(Role.PREFILL, worker.prefill_resumed(m.truth, emitted, stream=True)),
                (Role.DECODE, worker.decode_resumed(m.truth, emitted, stream=True))]
    return [(Role.AGG, worker.agg_resumed(m.truth, emitted, stream=True))]


async def _publish(publisher: ChunkPublisher, m: MigratingRequest, role: Role, bodies: list[bytes], *,
                   attempt: int, format: str, stop: int | None = None) -> None:
    last = len(bodies) - 1
    for seq, body in enumerate(bodies[:stop]):
        await publisher.publish(m.request_id, role, seq, body, final=seq == last, attempt=attempt, format=format)


async def run_migration(nc: NatsClient, subjects: Subjects, m: MigratingRequest, *, format: str,
                        worker: SimulatedWorker, collector: ResultCollector, timeout: float,
                        control: NatsClient | None = None) -> None:
    """The first worker dies after ``die_after`` output chunks; once the client has their results the
    request is migrated and a fresh worker serves the rest. Sets ``m.resumed``; raises TimeoutError.

    ``nc`` publishes the workers' chunks; ``control`` (default ``nc``) is the serving layer's
    connection the migrate goes out on: under the shipped trust model they are different users."""
    publisher = ChunkPublisher(nc, subjects)
    for role, bodies in _legs(worker, m, 0):
        await _publish(publisher, m, role, bodies, attempt=0, format=format,
                       stop=None if role is Role.PREFILL else m.die_after)
    await nc.flush()
    with anyio.fail_after(timeout):  # mid-decode: the client has seen what the lost worker produced
        while len(collector.results.get(m.request_id, [])) < m.die_after:
            await anyio.sleep(0.01)

    async def serve(resumed: Resumed) -> None:
        """``send`` for the Migrator: a fresh worker (pair) serves the rebuilt request to the end."""
        emitted = worker.emitted_in(m.truth, resumed.body)
        if emitted is None:  # verify_migration reports it; serving a wrong request would prove nothing
            return
        for role, bodies in _legs(worker, m, emitted):
            await _publish(publisher, m, role, bodies, attempt=resumed.attempt, format=format)
        await nc.flush()

    try:
        m.resumed = await Migrator(control or nc, subjects, format=format, timeout=timeout).migrate(
            m.request_id, native_request(format, m.truth), send=serve, reason="demo: worker lost")
    except (MigrationError, MigrationRefused, nats.errors.Error) as exc:  # reported by verify_migration
        m.error = f"{type(exc).__name__}: {exc}"


def verify_migration(m: MigratingRequest, results: list[ResultInfo], worker: SimulatedWorker) -> list[str]:
    """Everything wrong with a migrated request's results (empty when they are right)."""
    problems = []
    if m.resumed is None:
        return [f"the migration failed: {m.error or 'never attempted'}"]
    sent = m.die_after * CHUNK_TOKENS
    if (m.resumed.attempt, m.resumed.emitted_tokens, m.resumed.result_seq) != (1, sent, m.die_after):
        problems.append(f"sealed at attempt {m.resumed.attempt}, {m.resumed.emitted_tokens} tokens, result seq "
                        f"{m.resumed.result_seq}; expected 1, {sent}, {m.die_after}")
    if worker.emitted_in(m.truth, m.resumed.body) != sent:
        problems.append("the rebuilt request does not continue after the tokens already sent")
    expected = worker.agg(m.truth, stream=True)  # the uninterrupted run: one stream, as if nothing happened
    if [r.seq for r in results] != list(range(len(expected))):
        problems.append(f"seqs {[r.seq for r in results]}, expected 0..{len(expected) - 1}")
    if [r.final for r in results] != [False] * (len(expected) - 1) + [True]:
        problems.append("the final flag is not on the last result only")
    errors = [f"{r.error}: {r.body[:200]!r}" for r in results if r.error]
    if errors:
        problems.append(f"error results: {errors[:3]}")
    elif [worker.canonical(r.body) for r in results] != [worker.canonical(b) for b in expected]:
        problems.append("bodies differ from the uninterrupted run")
    if results and worker.expert_view(results[-1].body) != (m.truth.experts, None):
        problems.append("the final result's expert rows are not the truth's")
    if not results or results[-1].verdict is not Verdict.STITCHED:
        problems.append(f"last verdict {results[-1].verdict if results else None}, expected stitched")
    return problems
