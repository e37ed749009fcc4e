"""Recovery and migration of a durable input: what the stores say about a request this instance
does not hold, and the seal that outlives a migrate's instance.

A chunk of a request this instance does not know may continue one served elsewhere (a failover, a
hand-over, a migrate): :meth:`Recovery.recover` reads the request's last stored result and its seal
record (:meth:`Recovery.adopt`) and resumes it there. :meth:`Recovery.migrate` answers a migrate in
durable mode: adopt, read back stored bodies, seal, wait until stored, record the seal with
compare-and-set (:mod:`streamproc.nats.durable.migrations`), or answer ``unavailable`` and forget the
request here, so the retry starts from the stores. The decisions are the correlator's
(:mod:`streamproc.core.correlator`; ``resume_point`` and ``adoption`` in :mod:`streamproc.core.recovery`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Awaitable, Callable, NamedTuple

import anyio
from nats.aio.client import Client as NatsClient
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

from ...config import Settings
from ...core.correlator import Correlator, is_retry
from ...core.errors import HistoryOverBound, MissingResults
from ...core.events import (Decision, MigrateError, MigrateErrorCode, MigrateReply, MigrateRequest, Role, Sealed,
                            SealRecord)
from ...core.recovery import Adoption, adoption, previous_hold_left, resume_point, seal_overtaken
from ...core.partitions import PartitionScheme
from ...logs import LogLimiter, error_text
from .pulls import REDELIVERY_SLACK
from .migrations import UNREACHABLE, MigrationLedger
from .outbox_pump import OutboxPump

if TYPE_CHECKING:
    from .input import DurableStats
    from .partitions import Partition


LOOKUP_TIMEOUT = 2.0
HANDOVER_TIMEOUT = 2.0  # a released partition's results may take this long to be stored before hand-over


class Waiting(NamedTuple):
    """Chunks of a request this instance does not know that can still reach it (a migrate waits)."""

    why: str
    retry_after: float | None  # the most seconds until they must have come; None: no bound


class Recovery:
    """Requests taken over from the stores: recovery lookups of chunks, and migrates.

    ``ledger``, ``chunks_stream`` and ``results_stream`` are set once the input has opened them
    (:meth:`~streamproc.nats.durable.input.DurableInput.start`)."""

    def __init__(self, nc: NatsClient, settings: Settings, scheme: PartitionScheme, correlator: Correlator,
                 outbox_pump: OutboxPump, stats: DurableStats, clock: Callable[[], float], limited: LogLimiter, *,
                 partitions: dict[int, Partition], migrating: dict[int, int],
                 caught_up: Callable[[], Awaitable[None]], owns: Callable[[str], bool],
                 hand_over: Callable[[Callable[[str], bool]], None], note_sealed: Callable[[str], None]) -> None:
        self.nc = nc
        self.settings = settings
        self.scheme = scheme
        self.correlator = correlator
        self.outbox_pump = outbox_pump
        self.stats = stats
        self.limited = limited
        self._clock = clock
        self._jsm = nc.jsm(timeout=LOOKUP_TIMEOUT)
        self._partitions = partitions  # the owned partitions (a chunk of a request may still be on its way)
        self._migrating = migrating  # partition -> migrates being answered for it (a graceful hand-over waits)
        self.caught_up = caught_up
        self.owns = owns
        self._hand_over = hand_over
        self._note_sealed = note_sealed
        self.ledger: MigrationLedger | None = None
        # Stored result bodies are read back one request at a time: a request's whole output is held
        # while it is read, and migrates of different requests run concurrently (nats/control.py).
        self._history_reads = anyio.Lock()
        self.chunks_stream = ""
        self.results_stream = ""

    async def recover(self, rid: str, format: str | None, now: float, *, retry_in: Callable[[], str],
                       current: Callable[[], bool], role: Role | None = None) -> bool:
        """Resume after the last stored result of ``rid``; False if it cannot be read (the caller
        looks it up again, NAKs the chunk for a retry in 1 s, goes on without it, or the partition
        was handed over meanwhile and the hand-over NAKed it: ``retry_in()``, called when the
        failure is logged, after the reads, says which). Nothing is adopted unless ``current()``
        still holds once the stores are read (the partition was not handed over). ``role``: the chunk's
        (an aggregated request's stored bodies are never read back)."""
        self.stats.recoveries += 1
        urgent = getattr(self.nc, "urgent_writes", None)  # FastClient: no write coalescing meanwhile
        try:
            with urgent() if urgent is not None else contextlib.nullcontext():
                await self.adopt(rid, format, now, current=current, role=role)
        except Exception as exc:
            self.limited.log(logging.WARNING, "recovery_lookup_failed", request_id=rid,
                                      error=error_text(exc), retry_in=retry_in())
            return False
        return True

    async def adopt(self, rid: str, format: str | None, now: float, *, record: SealRecord | None = None,
                     read_record: bool = True, current: Callable[[], bool] | None = None,
                     role: Role | None = None) -> str | None:
        """Adopt ``rid`` from the stores: its last stored result (a leader read, never a possibly stale
        follower) and its seal record; a migrated request also gets its stored bodies, from which
        the correlator rebuilds the migration session. Raises when a store cannot be read. With
        ``current``, nothing is adopted unless it still holds after the reads. A migrated request
        whose stored bodies pass the read's bound (``HistoryOverBound``) is ended at once with a
        ``migration_refused`` error result (a retry would read them again, and fail again, until
        ``max_deliver``): the returned reason says so (None otherwise)."""
        assert self.ledger is not None
        ledger = self.ledger
        found: dict[str, object] = {}

        async def last_result() -> None:
            try:
                found["stored"] = await self._jsm.get_last_msg(self.results_stream, self.settings.subjects.result(rid))
            except NotFoundError:
                pass

        async def seal_record() -> None:
            found["record"] = (await ledger.read(rid))[0]

        if read_record:  # both reads at once: a recovery costs one round trip, not two
            async with anyio.create_task_group() as tg:
                tg.start_soon(last_result)
                tg.start_soon(seal_record)
            record = found.get("record")  # type: ignore[assignment]
        else:
            await last_result()
        stored = found.get("stored")
        point = resume_point(stored.headers) if stored is not None else None  # type: ignore[attr-defined]
        how = adoption(point, record is not None)
        if how is Adoption.AFRESH:
            return None
        next_seq, final = point if point is not None else (0, False)
        if how is Adoption.RESUME:
            history: list[bytes] | None = None
            lost: str | None = None
            if self.correlator.needs_published(rid, next_seq, final, format, role=role):
                # The codec's session counts across chunks, and those already published are settled
                # and never redelivered (docs/operations.md, "Taking over a request"). Other codecs
                # read nothing. Gone bodies cannot come back: the session omits, a retry would not help.
                try:
                    async with self._history_reads:
                        history = await ledger.history(rid, next_seq)
                except MissingResults as exc:
                    lost = error_text(exc)
                    self.limited.log(logging.WARNING, "published_results_lost", request_id=rid, detail=lost)
            if current is not None and not current():
                return None
            self.correlator.resume(rid, next_seq, final, now, format, history=history, lost=lost)
        else:
            assert record is not None
            try:
                async with self._history_reads:
                    history = await self.ledger.history(rid, next_seq)
            except HistoryOverBound as exc:
                if current is not None and not current():
                    return None
                return self._end_over_bound(rid, next_seq, len(record.seals), now, format, exc)
            if current is not None and not current():
                return None
            self.correlator.resume(rid, next_seq, False, now, format, seals=record.seals, history=history)
            self.stats.migrated_adopted += 1
            self._note_sealed(rid)
        self.stats.resumed += 1
        # Rate limited: one late chunk per old id (a hostile worker's flood) costs a lookup and this line.
        self.limited.log(logging.INFO, "request_resumed", request_id=rid, next_seq=next_seq, final=final,
                  attempt=record.attempt if record is not None else 0)
        return None

    def _end_over_bound(self, rid: str, next_seq: int, attempt: int, now: float, format: str | None,
                        exc: HistoryOverBound) -> str:
        """End a migrated request whose stored bodies pass the take-over's bound: its error result is
        queued before the chunk that looked it up is settled (as late), so that chunk is acknowledged
        once the error is stored, never redelivered for another read of the same bodies."""
        why = f"its stored output cannot be read back to rebuild its migration state: {exc.why}"
        self.limited.log(logging.WARNING, "migrated_request_over_bound", request_id=rid, detail=why)
        self._take(self.correlator.end_adopted(rid, next_seq, attempt, now, why, format), rid)
        return why

    def _take(self, decisions: list[Decision], rid: str) -> None:
        """An error result decided here, to the outbox as a chunk's would go (none once it closed: a stop
        hands the partition over, and the next owner decides again)."""
        if not self.outbox_pump.closed:
            self.outbox_pump.take(decisions, rid)

    async def migrate(self, rid: str, request: MigrateRequest,
                      seal: Callable[[], Awaitable[MigrateReply]]) -> MigrateReply:
        """A migrate in durable mode: the seal outlives this instance (:mod:`streamproc.nats.durable.migrations`).

        Read the seal record (a retry of the migrate that wrote it gets the same reply); adopt the
        request from the stores if this instance does not hold it (it moved here); read back the
        stored bodies it lacks; ``seal`` locally; wait until the results it published are stored;
        record the seal with compare-and-set; only then reply. Any store failure answers
        ``unavailable`` after forgetting the request here, so the retry starts from the stores."""
        n = self.scheme.of(rid)
        self._migrating[n] = self._migrating.get(n, 0) + 1  # a graceful hand-over waits for it
        try:
            return await self._migrate(rid, request, seal)
        finally:
            left = self._migrating.pop(n) - 1
            if left:
                self._migrating[n] = left

    async def _migrate(self, rid: str, request: MigrateRequest,
                       seal: Callable[[], Awaitable[MigrateReply]]) -> MigrateReply:
        assert self.ledger is not None
        correlator = self.correlator
        try:
            record, revision = await self.ledger.read(rid)
        except UNREACHABLE as exc:
            return self._unavailable(rid, f"the seal records cannot be read: {error_text(exc)}")
        if record is not None and request.id is not None and record.id == request.id:
            # Where this instance holds the request at the recorded attempt, it also says whether the
            # granted attempt made progress since (then the id is reused, not retried); a local state
            # at another attempt is stale (sealed elsewhere) and says nothing.
            held = correlator.attempt_of(rid) == record.sealed.attempt
            if is_retry(record.sealed, request.expected_attempt, None,
                        correlator.next_seq_of(rid) if held else None):
                return record.sealed  # the reply of a seal that was recorded but (maybe) never received
        await self.caught_up()
        recorded = record.attempt if record is not None else 0
        local = correlator.attempt_of(rid)
        if local is not None and local != recorded:  # sealed elsewhere since it was adopted here
            self.forget(rid)
        if not correlator.knows(rid):
            try:
                ended = await self.adopt(rid, None, self._clock(), record=record, read_record=False)
            except Exception as exc:
                return self._unavailable(rid, f"the request cannot be adopted: {error_text(exc)}")
            if ended is not None:  # ended with a migration_refused error result: a retry cannot succeed
                await self.outbox_pump.pump()
                return MigrateError(rid, MigrateErrorCode.REFUSED, ended, len(record.seals) if record else None)
        if not correlator.knows(rid):
            try:
                waiting = await self._chunks_waiting(rid)
            except UNREACHABLE as exc:
                return self._unavailable(rid, f"the chunk stream cannot be read: {error_text(exc)}")
            if waiting is not None:
                return self._unavailable(rid, waiting.why, retry_after=waiting.retry_after)
        missing = correlator.missing(rid) if request.refuse is None else 0  # a refusal needs no bodies
        if missing:
            await self.outbox_pump.wait_idle(HANDOVER_TIMEOUT, lambda r: r == rid)
            try:
                async with self._history_reads:
                    history = await self.ledger.history(rid, missing)
            except HistoryOverBound as exc:
                # Never answered unavailable: every retry would read the same bodies past the same bound.
                # Refused as the correlator refuses a migrate (the request ends with its error result).
                why = f"its stored output cannot be read back to seal it: {exc.why}"
                self.limited.log(logging.WARNING, "migrate_over_bound", request_id=rid, detail=why)
                if not correlator.knows(rid):  # forgotten meanwhile: a refusal would start it again at seq 0
                    return self._unavailable(rid, "its stored results changed while they were read")
                reply, decisions = correlator.migrate(rid, self._clock(), expected_attempt=request.expected_attempt,
                                                      refuse=why)
                self._take(decisions, rid)
                await self.outbox_pump.pump()
                return reply
            except UNREACHABLE as exc:
                return self._unavailable(rid, f"its stored results cannot be read: {error_text(exc)}")
            restored = correlator.restore(rid, history)
            del history  # not held across the seal's waits, while other requests' are read
            if not restored:
                return self._unavailable(rid, "its stored results changed while they were read")
        reply = await seal()
        if not isinstance(reply, Sealed):
            return reply
        if not await self.outbox_pump.wait_idle(HANDOVER_TIMEOUT, lambda r: r == rid):
            return self._unavailable(rid, "its published results were not stored in time", forget=True)
        seals = [*(record.seals if record is not None else ()), reply.result_seq]
        if len(seals) != reply.attempt:
            return self._unavailable(rid, f"attempt {reply.attempt} does not follow the recorded {recorded}",
                                     forget=True)
        if not self.owns(rid):  # the next owner read the seal records when it took the partition
            return self._unavailable(rid, "its partition moved to another instance", forget=True)
        overtaken = seal_overtaken(correlator, reply)
        if overtaken is not None:  # a result was given up meanwhile: the seal would say it was sent
            code, why = overtaken
            if code is MigrateErrorCode.FINISHED:
                return MigrateError(rid, code, why, None)
            return self._unavailable(rid, why, forget=True)
        try:
            await self.ledger.write(rid, SealRecord(seals, reply, request.id), revision)
        except KeyWrongLastSequenceError:
            self.stats.seal_conflicts += 1
            self.forget(rid)
            return MigrateError(rid, MigrateErrorCode.ATTEMPT_MISMATCH,
                                "another processor instance sealed this attempt first", None)
        except UNREACHABLE as exc:
            return self._unavailable(rid, f"the seal cannot be recorded: {error_text(exc)}", forget=True)
        self.stats.seals_recorded += 1
        self._note_sealed(rid)
        return reply

    async def _chunks_waiting(self, rid: str) -> Waiting | None:
        """Whether a chunk of ``rid`` that this instance does not hold can still be delivered to it
        (None if not), why, and by when at the latest.

        With no stored result and no seal record, a request this instance does not know may still have
        chunks a dead owner took and never acknowledged: until they come back, ``unknown`` would be a
        lie that lets the dead attempt's chunks be taken as a restarted attempt 0's. The chunk stream
        keeps a chunk until it is acknowledged (work-queue retention), so the last one under
        ``<head>.<rid>.*`` is read (a leader read; nats-server's ``LoadLastMsg`` takes wildcards). One
        there comes back if it was never delivered (beyond the consumer's ``delivered.stream_seq``) or
        while a previous owner's hold may still run out: those were delivered before this instance
        took the partition, so they return within ``ack_wait`` of that. Past that, a delivered one
        that is still there reached ``max_deliver`` untermed (its owner was killed on the last
        delivery) and is never delivered again (nats-server ``consumer.go`` ``needAck`` keeps it):
        nothing of it can reach a client, and ``unknown`` is the truth."""
        n = self.scheme.of(rid)
        try:
            stored = await self._jsm.get_last_msg(self.chunks_stream, f"{self.scheme.head(n)}{rid}.*")
        except NotFoundError:
            return None
        part = self._partitions.get(n)
        held_for = previous_hold_left(self.settings.ack_wait, REDELIVERY_SLACK,
                                      part.opened if part is not None else None, self._clock())
        if held_for > 0:
            return Waiting("chunks of it wait in the chunk stream, not yet handled here (taken by a previous "
                           "owner that did not acknowledge them: they come back after ack_wait, within "
                           f"{held_for:.3g} s)", held_for)
        assert part is not None
        info = await self._jsm.consumer_info(self.chunks_stream, part.consumer)
        if stored.seq > info.delivered.stream_seq:  # a backlog: no bound on when it is reached
            return Waiting("chunks of it wait in the chunk stream, not yet delivered here (a backlog)", None)
        self.stats.chunks_undeliverable_seen += 1
        self.limited.log(logging.WARNING, "chunks_undeliverable", request_id=rid, stream_seq=stored.seq,
                                  detail="delivered max_deliver times and never acknowledged: kept by the "
                                         "stream until chunks_max_age, never delivered again")
        return None

    def _unavailable(self, rid: str, why: str, *, forget: bool = False,
                     retry_after: float | None = None) -> MigrateError:
        self.stats.seals_unavailable += 1
        if forget:  # sealed here but not recorded: the stores still say the previous attempt
            self.forget(rid)
        # Rate limited: anyone allowed on the control subjects can ask for migrates at will
        self.limited.log(logging.WARNING, "migrate_unavailable", request_id=rid, detail=why)
        return MigrateError(rid, MigrateErrorCode.UNAVAILABLE, f"{why}; nothing moved, retry", None,
                            None if retry_after is None else round(retry_after, 3))

    def forget(self, rid: str) -> None:
        """Drop the request here without results; its chunks and a migrate recover it from the stores."""
        self._hand_over(lambda r: r == rid)
