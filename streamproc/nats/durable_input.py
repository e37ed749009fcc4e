"""Durable input: JetStream pull consumers in, acknowledged results out, acks only after both.

The guarantees (``docs/operations.md`` has the full argument):

- **No input is lost.** A chunk is acknowledged only when everything it contributed to is stored:
  its own result's PubAck (decode and agg chunks), the request's final result (prefill chunks,
  which a decode chunk may need until then), or at once when it contributes to nothing
  (duplicates, late chunks) *and* no result of its request is still waiting for a PubAck. Chunks
  held longer than a moment get ``+WPI`` (in progress) before ``ack_wait`` runs out.
- **Results are stored once, in order.** Results carry ``Nats-Msg-Id: <request_id>.<seq>``. One
  result per request is in flight at a time (the next leaves when the previous one's PubAck is
  in), so a request's stored results are always ``0..k`` with no gap, whatever fails in between;
  a failed publish is retried with the same id until it is stored. A replay after a crash is
  collapsed by the stream's duplicate window and, beyond it, by the readers' seq check.
- **Recovery is exact.** An instance that sees a chunk of a request it does not know, when that
  chunk is not the first delivery of the request's first output chunk (or is, but the request has
  a seal record: the partition's seal list, read when it was taken), reads the last stored
  result of ``P.results.<request_id>`` (a leader read, never a possibly stale follower) and resumes
  the request after it. In steady state that happens once per P/D request whose prefill arrives
  first and for out-of-order first chunks; after a failover, for the requests that moved.

The rules behind these guarantees are pure and tested without a server: result queues, PubAck
handling, retries, settle order and the recovery decisions in :mod:`streamproc.core.outbox`, pull
credit in :mod:`streamproc.core.credit`. This module is their I/O: partitions, pull loops, the
recovery lookup, hand-over; :mod:`streamproc.nats.outbox_pump` moves results and acks.

Partitions (:mod:`streamproc.core.partitions`) are shared between instances through leases
(:mod:`streamproc.nats.leases`). Each owned partition has its own inbox subscription and a
credit-based pull loop; a watchdog re-issues pulls that the server forgot, resends overdue
results and extends the ack deadline of held chunks.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import Annotated, Awaitable, Callable, Iterable, Iterator

import anyio
import msgspec
from msgspec import Meta
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerInfo, StorageType, StreamConfig

from ..config import Settings
from ..core.codec import ErrorKind
from ..core.credit import PullCredit
from ..core.correlator import Work
from ..core.events import (
    Decision, MigrateReply, MigrateRequest, Result,
)
from ..core.handback import HandBack, in_stream_order
from ..core.lookups import Lookups
from ..core.outbox import GiveUp, Outbox, OutboxConfig, OutboxStats
from ..core.partitions import PartitionScheme
from ..logs import error_text, log_event
from .input import Pipeline, join_cpu_clock, run_join
from .durable_deliveries import Deliveries, Delivery
from .durable_pulls import REDELIVERY_SLACK, Pulls
from .durable_recovery import HANDOVER_TIMEOUT, Recovery
from .leases import LeaseChange, LeaseTable
from .migrations import SCAN_TIMEOUT, MigrationLedger
from .outbox_pump import OutboxPump
from .strays import StraySweeper, stray_consumer_config
from .subscription import handled_all
from .streams import (
    CHUNKS_STREAM,
    RESULTS_STREAM,
    ChunkStreamSpec,
    ensure_chunk_stream,
    ensure_consumer,
    ensure_results_stream,
    find_stream,
    partition_consumer_config,
    partition_consumer_name,
    server_has_fast_batches,
)

log = logging.getLogger("streamproc.durable")

WATCHDOG_EVERY = 0.25
# Least seconds between two lease checks before results are sent (_fence): well inside the lease's
# margin (10% of lease_ttl, which is at least 1 s).
FENCE_EVERY = 0.02
# A hand-over's NAKs wait until the server has dropped the closing subscription's pulls (core/handback.py):
# the consumer info request that makes it drop them is bounded by this, and so is the wait of a new
# _open of the same partition for them (under the lease lock: well inside a lease period).
FORGET_PULLS_TIMEOUT = 1.0
MAX_UNSTORED_CAUSES = 4096  # why a request's result was given up, kept for its poison error message


class DurableStats(OutboxStats):
    """Counters of the durable input (merged into ``Processor.snapshot()``); the outbox's are inherited."""

    partitions: Annotated[int, Meta(description="gauge: partitions this instance serves now")] = 0
    members: Annotated[int, Meta(description="gauge: live instances sharing the partitions")] = 0
    pulls: Annotated[int, Meta(description="pull requests sent to the partition consumers")] = 0
    lost_pulls: Annotated[int, Meta(description="pulls re-issued because the server stopped answering them")] = 0
    consumer_repairs: Annotated[int, Meta(description="partition consumers created again after they went "
                                                      "missing")] = 0
    redelivered: Annotated[int, Meta(description="messages delivered more than once")] = 0
    poisoned: Annotated[int, Meta(description="chunks on their max_deliver-th delivery: request ended, chunk"
                                              " terminated")] = 0
    strays: Annotated[int, Meta(description="chunks stored untransformed (a '*' or '>' token in the "
                                            "subject): terminated")] = 0
    inbox_strays: Annotated[int, Meta(description="messages on a pull inbox that are neither a delivery nor "
                                                  "a status: ignored")] = 0
    recoveries: Annotated[int, Meta(description="last-result lookups for requests this instance did not know")] = 0
    lookups_parked: Annotated[int, Meta(description="chunks that waited behind a lookup of their own request "
                                                    "in flight or queued (decided in order after it)")] = 0
    lookups_queued: Annotated[int, Meta(description="chunks that waited for a lookup slot (every one of the "
                                                    "partition's lookups in flight)")] = 0
    resumed: Annotated[int, Meta(description="lookups that found stored results (the request moved here)")] = 0
    migrated_adopted: Annotated[int, Meta(description="of those, requests with a seal record: session "
                                                      "rebuilt from stored bodies")] = 0
    seals_recorded: Annotated[int, Meta(description="seals written to the migrations bucket")] = 0
    seal_conflicts: Annotated[int, Meta(description="seals another instance recorded first (compare-and-set "
                                                    "lost)")] = 0
    seals_unavailable: Annotated[int, Meta(description="migrates answered `unavailable` (a store could not "
                                                       "be read or written)")] = 0
    chunks_undeliverable_seen: Annotated[int, Meta(description="migrates that found a chunk past "
                                                               "max_deliver, kept but never redelivered")] = 0
    leases_acquired: Annotated[int, Meta(description="partition leases this instance took")] = 0
    leases_released: Annotated[int, Meta(description="partition leases this instance gave up (a rebalance or"
                                                     " a stop)")] = 0
    leases_lost: Annotated[int, Meta(description="partition leases this instance lost (it could not renew "
                                                 "them in time)")] = 0


def new_instance_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


# ---------------------------------------------------------------------------------- partitions

class _AllSealed:
    """The seal list of a partition taken while the migrations bucket's keys could not be read:
    every request is on it, so each first chunk of a new request is looked up (exact, one round
    trip per request instead of none)."""

    __slots__ = ()

    def __contains__(self, request_id: object) -> bool:
        return True


ALL_SEALED = _AllSealed()


class _Partition:
    """One owned partition: its consumer, inbox subscription and pull credit."""

    __slots__ = ("n", "consumer", "filter", "cut", "inbox", "sub", "credit", "active", "pull_subject", "sealed",
                 "opened", "lookups", "freed", "waiting", "handback", "handed_back")

    def __init__(self, n: int, consumer: str, filter_subject: str, cut: int, stream: str, credit: PullCredit,
                 sealed: dict[str, float] | _AllSealed, opened: float, lookups: Lookups[Delivery]) -> None:
        self.n = n
        self.opened = opened  # our clock when this instance took the partition
        self.consumer = consumer
        self.filter = filter_subject
        self.cut = cut  # stored subject -> chunk subject: drop this many leading characters
        self.inbox = ""
        self.sub: Subscription | None = None
        self.credit = credit
        self.active = False
        self.pull_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        # Request ids of this partition with a seal record -> when the record expires (our clock),
        # in expiry order: read from the migrations bucket before the first pull, then our own seals.
        self.sealed = sealed
        # Recovery lookups in flight and the deliveries parked behind them; ``freed`` is set (and
        # replaced) whenever one ends or they are abandoned, for a callback waiting for room.
        self.lookups = lookups
        self.freed = anyio.Event()
        self.waiting = False  # the callback holds a delivery until parked bytes free (the watchdog's "behind")
        # Its NAKs once it is handed over (also the ones of deliveries that arrive while its subscription
        # drains), held until the server dropped its pulls, then sent in stream order (core/handback.py).
        self.handback: HandBack[Msg] = HandBack(_reply_of)
        self.handed_back = anyio.Event()

    def wake(self) -> None:
        freed, self.freed = self.freed, anyio.Event()
        freed.set()

    def abandon_lookups(self) -> list[Msg]:
        """The partition is handed over: every parked delivery, for a NAK (their lookups' outcomes are
        dropped when they end); a callback waiting for room wakes and NAKs its own."""
        out = [d.msg for d in self.lookups.abandon()]
        self.wake()
        return out


def _reply_of(msg: Msg) -> str | None:
    return getattr(msg, "reply", None)


def _shed_body(token: object) -> None:
    """A chunk's token entered the outbox (``Outbox(shed=...)``): its chunk is decided, and what is
    left to do with its ``Msg`` (ack, NAK, +WPI, +TERM, the hand-over's stream order) reads only its
    ack subject (``reply``). The body goes: a decided chunk whose result waits for its PubAck, or
    whose ack waits to be written, kept it alive through its ``Msg`` outside every budget, for as
    long as PubAcks lag (in the concurrent attackers test under two CPU hogs, up to 19 MiB of
    ~1 MB bodies of late chunks settled behind their requests' overloaded results, and up to 34 MiB
    in tokens whose ack or NAK waited to be written; docs/operations.md, "Bounds and back-pressure",
    "Decided chunks keep no body"). What still needs
    the bytes holds them itself: a buffered chunk's ``Chunk.body`` (charged to the byte budget), a
    passthrough result's body (the same bytes object, held by the outbox queue: its cap)."""
    try:
        token.data = b""  # type: ignore[attr-defined]
    except AttributeError:  # not a Msg (tests' tokens): nothing to drop
        pass


class DurableInput:
    """The durable input of :class:`~streamproc.nats.processor.Processor` (``--mode durable``): an
    :class:`~streamproc.nats.input.Input`. It needs no dispatch gate: decisions from any task enter
    the outbox's per-request queues synchronously, so a request's results keep their order."""

    def __init__(self, nc: NatsClient, settings: Settings, pipeline: Pipeline, *,
                 instance: str | None = None) -> None:
        self.nc = nc
        self.settings = settings
        self.pipeline = pipeline
        self.correlator = pipeline.correlator
        clock, notify = pipeline.clock, pipeline.notify
        self.instance = instance or new_instance_id()
        self.stats = DurableStats()
        self.scheme = PartitionScheme(settings.subjects, settings.partitions)
        self._clock = clock
        self._notify = notify
        self._storage = StorageType(settings.stream_storage)
        self.chunks_stream = ""
        self.results_stream = ""
        self.leases: LeaseTable | None = None
        self.ledger: MigrationLedger | None = None
        self.outbox = Outbox(OutboxConfig(max_attempts=settings.max_result_attempts,
                                          progress_every=settings.ack_wait / 4), self.stats,
                             handed_latency=pipeline.result_latency,  # one chunk -> result metric, both modes
                             shed=_shed_body)
        self.publisher = OutboxPump(nc, settings.subjects.result(""), self.outbox, clock=clock, notify=notify,
                                    give_up=self._given_up, publish=pipeline.publisher(nc.publish),
                                    limited=pipeline.limited, fence=self._fence)
        self._partitions: dict[int, _Partition] = {}
        self._lapsed: list[_Partition] = []  # given up by _fence, subscriptions not closed yet
        # Partition number -> the handed-over partition whose NAKs wait for its pulls to be gone (_fence's):
        # a new _open of the number waits for them first (core/handback.py).
        self._handing_back: dict[int, _Partition] = {}
        self._fenced_at = 0.0
        self.pulls = Pulls(nc, settings, self.scheme, self.outbox, self.stats, clock, pipeline.limited)
        # Held chunks count towards a partition's max_ack_pending: past 3/4 of it the partition sheds
        # its longest-idle holders (overloaded) down to 1/2, so new chunks are always delivered.
        self._held_cap = max(1, settings.max_ack_pending * 3 // 4)
        self._held_target = settings.max_ack_pending // 2
        self._unstored: dict[str, str] = {}  # request id -> why its last result was given up
        # Joins that decode sequence data run in one worker thread, as in core mode (codec instances
        # share decompression contexts, which are not thread safe); the loop keeps serving the rest.
        pipeline.correlator.offload_joins = True
        self._limiter = anyio.CapacityLimiter(1)
        self._join_clock = join_cpu_clock()  # the join thread and the codec's helper threads
        self._tasks: anyio.abc.TaskGroup | None = None
        self._reconnects = 0
        self._wake = anyio.Event()  # set on a reconnect: the watchdog's next round runs at once
        self._lease_lock = anyio.Lock()
        self._migrating: dict[int, int] = {}  # partition -> migrates being answered for it
        self.recovery = Recovery(nc, settings, self.scheme, self.correlator, self.publisher, self.stats, clock,
                                 pipeline.limited, partitions=self._partitions, migrating=self._migrating,
                                 caught_up=self.caught_up, owns=self.owns, hand_over=self._hand_over,
                                 note_sealed=self._note_sealed)
        self.deliveries = Deliveries(nc, settings, pipeline, self.outbox, self.publisher, self.pulls, self.recovery,
                                     self.stats, clock, unstored=self._unstored, offload=self._offload,
                                     tasks=lambda: self._tasks)

    def _stray(self) -> None:
        self.stats.strays += 1
        self.pipeline.io.unreadable += 1

    def owns(self, request_id: str) -> bool:
        """Whether this instance holds the lease of the request's partition (it alone answers for it)."""
        return self.scheme.of(request_id) in self._partitions

    # ---------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        s = self.settings
        js = self.nc.jetstream(timeout=10)
        subjects = s.subjects
        self.results_stream = await find_stream(js, subjects.all_results) or RESULTS_STREAM
        info = await ensure_results_stream(js, subjects, name=self.results_stream, max_age=s.results_max_age,
                                           duplicate_window=s.duplicate_window, storage=self._storage,
                                           replicas=s.stream_replicas, max_payload=self.nc.max_payload,
                                           batched=s.result_batch > 1 and server_has_fast_batches(self.nc))
        self._batch_results(info.config)
        self.chunks_stream = await find_stream(js, self.scheme.source) or CHUNKS_STREAM
        await ensure_chunk_stream(js, ChunkStreamSpec(
            self.chunks_stream, self.scheme, s.chunks_max_age, s.duplicate_window, self._storage,
            s.stream_replicas, s.chunks_max_bytes), max_payload=self.nc.max_payload)
        if self.pulls.batch < s.fetch_batch:
            log_event(log, logging.WARNING, "fetch_batch_reduced", fetch_batch=s.fetch_batch, used=self.pulls.batch,
                      detail="pending_msgs_limit is too small for the pull credit")
        await self.publisher.start()
        self.leases = LeaseTable(self.nc, f"{self.chunks_stream}_LEASES", s.partitions, self.instance,
                                 s.lease_ttl,
                                 replicas=s.stream_replicas, storage=self._storage, clock=self._clock)
        await self.leases.open()
        self.ledger = MigrationLedger(self.nc, f"{self.chunks_stream}_MIGRATIONS", self.results_stream,
                                      s.subjects.result(""), ttl=s.results_max_age, replicas=s.stream_replicas,
                                      storage=self._storage)
        await self.ledger.open()
        recovery = self.recovery
        recovery.ledger, recovery.chunks_stream, recovery.results_stream = (
            self.ledger, self.chunks_stream, self.results_stream)
        self.deliveries.chunks_stream = self.chunks_stream
        if hasattr(self.nc, "defer_linger"):  # FastClient only (fast_client.py): coalesce writes at light load
            self.nc.flush_interval = s.flush_interval
            self.nc.defer_linger = s.ack_linger
            self.nc.pause_reads = s.flush_interval > 0  # read once per interval too (FastClient._write_now)
            self.publisher.stage_writes()
        self._reconnects = self.nc.stats["reconnects"]
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        try:
            await self._rebalance()
            self._tasks.start_soon(self._lease_loop)
            self._tasks.start_soon(self._watchdog)
            self._tasks.start_soon(StraySweeper(
                self.nc, self.chunks_stream,
                stray_consumer_config(s.subjects.all_chunks, ack_wait=s.ack_wait, max_deliver=s.max_deliver),
                self.pipeline.limited, self._stray).run)
        except BaseException:
            self._tasks.cancel_scope.cancel()
            await self._tasks.__aexit__(None, None, None)
            raise
        log_event(log, logging.INFO, "durable_started", instance=self.instance, chunks_stream=self.chunks_stream,
                  results_stream=self.results_stream, partitions=s.partitions,
                  owned=",".join(map(str, sorted(self._partitions))) or "-")

    def _batch_results(self, config: StreamConfig) -> None:
        """Let the outbox send a request's queued results as fast batches when the results stream
        allows them. Only for one replica: a replicated stream stores a batch through its Raft log,
        where a leader change rebuilds the batch's state, and no test here covers that."""
        limit = self.settings.result_batch
        if limit <= 1:
            return
        why = ("the results stream does not allow batches (allow_batched; nats-server 2.14+)"
               if not config.allow_batched else
               "the results stream is replicated" if (config.num_replicas or 1) > 1 else None)
        if why is not None:
            log_event(log, logging.INFO, "result_batches_off", stream=self.results_stream, reason=why,
                      detail="each result waits for its predecessor's PubAck")
            return
        self.outbox.config = msgspec.structs.replace(self.outbox.config, batch_limit=limit)

    async def stop(self, timeout: float) -> None:
        """Hand everything over: stop reading, let results finish storing, NAK the rest, release leases."""
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            tasks.cancel_scope.cancel()
            await tasks.__aexit__(None, None, None)
        if self.nc.is_closed:
            return
        # The owned partitions and the lapsed ones whose hand-over the cancelled tasks left unfinished.
        parts = list({id(p): p for p in (*self._partitions.values(), *self._handing_back.values())}.values())
        with anyio.move_on_after(timeout):
            for part in parts:
                await self._close_partition(part)
            if not await self.publisher.wait_idle(timeout):
                log_event(log, logging.WARNING, "stop_with_unstored_results", results=self.publisher.pending)
        self._hand_over(lambda rid: True, parts)
        await self.publisher.pump()
        if self.publisher.staged:
            self.publisher.flush_staged()  # the NAKs go with the flush below, not with a later timer write
        with anyio.move_on_after(timeout):
            if self.leases is not None:
                await self.leases.leave()
            await self.nc.flush()
        await self.publisher.stop()
        self.stats.partitions = 0

    async def dispatch(self, decisions: list[Decision]) -> None:
        """Results decided by the timer (timeouts) take the same acknowledged path."""
        if self.publisher.closed:
            return
        self.publisher.take(self._offload(decisions), None)
        await self.publisher.pump()

    def _offload(self, decisions: list[Decision], received: float | None = None) -> list[Decision]:
        """Start the :class:`Work` among ``decisions`` off the loop; the rest go to the outbox.
        ``received``: when the chunk that made them arrived (None: the timer, a control request)."""
        for d in decisions:
            if d.__class__ is Work:
                break
        else:
            return decisions
        tasks = self._tasks
        rest = []
        for d in decisions:
            if d.__class__ is not Work:
                rest.append(d)
            elif tasks is not None:
                tasks.start_soon(self._run, d, received)
            # else: stopping; the request's chunks are handed over (NAKed) with it
        return rest

    async def _run(self, work: Work, received: float | None = None) -> None:
        """Run a join in the worker thread, then apply it. No gate is needed: the outcome enters the
        outbox's per-request queue synchronously, behind the request's earlier results. ``received``:
        when the chunk whose result this work makes arrived (its latency counts the join, as in core
        mode)."""
        await anyio.to_thread.run_sync(run_join, work, self._join_clock, limiter=self._limiter)
        if self.publisher.closed:
            return
        now = self._clock()
        try:
            decisions = self.pipeline.finish(work, now)
        except Exception as exc:  # noqa: BLE001  (a bug must cost this request, not the input's task group)
            log_event(log, logging.ERROR, "join_finish_failed", request_id=work.request_id, error=error_text(exc))
            decisions = self.correlator.reject(work.request_id, f"internal error: {error_text(exc)}", now,
                                               kind=ErrorKind.INTERNAL)
        self.publisher.take(self._offload(decisions, received), None, received)
        await self.publisher.pump()

    async def caught_up(self) -> None:
        """Return once every chunk delivered to any owned partition at the call has been handled
        (a control request must not overtake them)."""
        for part in list(self._partitions.values()):
            sub = part.sub
            await handled_all(sub, lambda: part.sub is sub)
            # ... and decided: the ones parked behind a recovery lookup are, once it ends (woken by
            # each lookup's end; a lookup cancelled by a stop wakes nobody, hence the poll).
            lookups = part.lookups
            waiting = lookups.requests()
            while waiting and not lookups.closed:
                with anyio.move_on_after(0.05):
                    await part.freed.wait()
                waiting = [rid for rid in waiting if rid in lookups]

    def dropped(self, sub: Subscription | None, reply: str | None) -> None:
        """nats-py dropped a delivered message (slow consumer): it used up pull credit, and comes back
        after ``ack_wait``. Without this the credit would stay spent until the pull expires."""
        if not reply:
            return  # a status message: no credit
        for part in self._partitions.values():
            if part.sub is sub:
                part.credit.dropped()
                return

    # -------------------------------------------------------------------------- partitions

    async def _rebalance(self) -> None:
        assert self.leases is not None
        async with self._lease_lock:
            change: LeaseChange = await self.leases.step()
            self.stats.members = self.leases.members
            for n in change.lost:
                self.stats.leases_lost += 1
                log_event(log, logging.WARNING, "lease_lost", partition=n, instance=self.instance)
                await self._lose(n)
            for n in change.surplus:
                self.stats.leases_released += 1
                log_event(log, logging.INFO, "lease_released", partition=n, instance=self.instance,
                          members=self.leases.members)
                await self._lose(n, graceful=True)
                await self.leases.release(n)
            sealed: dict[int, dict[str, float]] | None = None
            if change.acquired:  # once per step, before any acquired partition is pulled from
                try:
                    sealed = await self._seal_snapshot()
                except Exception as exc:  # noqa: BLE001  (correct without it, only slower)
                    log_event(log, logging.WARNING, "seal_list_unreadable", error=error_text(exc),
                              detail="every first chunk of a new request on the partitions taken now is looked up")
            for n in change.acquired:
                try:
                    await self._open(n, sealed.get(n, {}) if sealed is not None else ALL_SEALED)
                except Exception as exc:  # e.g. the consumer's stream is electing a leader: try again later
                    log_event(log, logging.WARNING, "partition_open_failed", partition=n, error=error_text(exc))
                    await self._lose(n)
                    await self.leases.release(n)
                    continue
                self.stats.leases_acquired += 1
                log_event(log, logging.INFO, "lease_acquired", partition=n, instance=self.instance,
                          members=self.leases.members)
            self.stats.partitions = len(self._partitions)

    async def _lease_loop(self) -> None:
        interval = self.settings.lease_ttl / 3
        while True:
            await anyio.sleep(interval)
            try:
                await self._rebalance()
            except Exception as exc:  # never let lease trouble kill the processor; expiry is checked apart
                log_event(log, logging.WARNING, "lease_step_failed", error=error_text(exc))

    async def _seal_snapshot(self) -> dict[int, dict[str, float]]:
        """The requests with a seal record, per partition, each with its record's expiry on our clock.

        Read whenever partitions are taken, before their first pull: the previous owner (maybe
        dead) may have sealed a request whose sealed attempt's first output chunk reaches this
        instance only now, and the hot path looks such a chunk up only if its request is listed.
        Later seals of an owned partition are this instance's own (:meth:`_note_sealed`)."""
        assert self.ledger is not None
        now, ttl = self._clock(), self.settings.results_max_age or float("inf")
        out: dict[int, dict[str, float]] = {}
        of = self.scheme.of
        # Bounded well inside a lease period: the lease lock is held meanwhile, renewals wait for it.
        for rid, age in await self.ledger.sealed(timeout=min(SCAN_TIMEOUT, self.settings.lease_ttl / 3)):
            out.setdefault(of(rid), {})[rid] = now + ttl - age
        return out

    def _note_sealed(self, rid: str) -> None:
        """``rid`` has a seal record now: its partition's later first chunks of it are looked up.
        Entries stay in expiry order; the expired ones (their records are gone too) are dropped."""
        part = self._partitions.get(self.scheme.of(rid))
        if part is None or not isinstance(part.sealed, dict):
            return
        sealed = part.sealed
        now = self._clock()
        sealed.pop(rid, None)
        sealed[rid] = now + (self.settings.results_max_age or float("inf"))
        while sealed:
            old, expiry = next(iter(sealed.items()))
            if expiry >= now:
                break
            del sealed[old]

    async def _open(self, n: int, sealed: dict[str, float] | _AllSealed) -> None:
        old = self._handing_back.get(n)
        if old is not None:
            # This instance's own lapsed subscription of the partition is still being handed over: its
            # NAKs first, or our first pulls would take later chunks before them (core/handback.py).
            with anyio.move_on_after(2 * FORGET_PULLS_TIMEOUT):
                await old.handed_back.wait()
        now = self._clock()
        credit = self.pulls.credit(now)
        part = _Partition(n, partition_consumer_name(n), self.scheme.filter(n), len(self.scheme.head(n)),
                          self.chunks_stream, credit, sealed, now,
                          self.deliveries.lookups())
        info = await self._ensure_consumer(part)
        if info.num_ack_pending or info.num_redelivered:
            # Chunks delivered before and not acknowledged (a previous owner's, NAKed or held) come back
            # within ack_wait: careful pulls until then (core/credit.py). None: a fresh start or a clean
            # backlog reads at full batches from the first pull.
            credit.expect_redeliveries(now + self.settings.ack_wait + REDELIVERY_SLACK)
        part.inbox = self.nc.new_inbox()
        on_message, on_message_inline = self.deliveries.handlers(part)
        part.sub = await self.nc.subscribe(part.inbox, cb=on_message,
                                           pending_msgs_limit=self.settings.pending_msgs_limit,
                                           pending_bytes_limit=self.settings.pending_bytes_limit)
        if self.publisher.inline:  # the common chunk handled in the read loop (on_message_inline)
            self.nc.deliver_inline(part.sub, on_message_inline)
        part.active = True
        self._partitions[n] = part
        await self.pulls.pull(part)

    async def _ensure_consumer(self, part: _Partition) -> ConsumerInfo:
        s = self.settings
        config = partition_consumer_config(part.consumer, part.filter, ack_wait=s.ack_wait,
                                           max_ack_pending=s.max_ack_pending, max_deliver=s.max_deliver)
        return await ensure_consumer(self.nc.jetstream(timeout=10), self.chunks_stream, config)

    async def _lose(self, n: int, graceful: bool = False) -> None:
        """Stop serving partition ``n``: later arrivals are NAKed, held chunks NAKed, state dropped."""
        part = self._partitions.get(n)
        if part is not None:
            await self._close_partition(part)
        parts = (part,) if part is not None else ()  # (a lapsed one is _close_lapsed's)
        scheme = self.scheme

        def belongs(rid: str) -> bool:
            return scheme.of(rid) == n

        if graceful:  # let results already decided be stored, so the next owner's lookup sees them
            await self.publisher.wait_idle(HANDOVER_TIMEOUT, belongs)
            # and seals already past their ownership check be recorded before the next owner reads them
            with anyio.move_on_after(HANDOVER_TIMEOUT):
                while self._migrating.get(n):
                    await anyio.sleep(0.01)
        self._hand_over(belongs, parts)
        await self.publisher.pump()

    async def _close_partition(self, part: _Partition) -> None:
        """Stop reading partition ``part``: its subscription drained and its pulls gone from the server.
        Its NAKs (parked deliveries, deliveries that arrive meanwhile) are held in ``part.handback``;
        the caller sends them with the hand-over's (:meth:`_hand_over`), in stream order."""
        part.active = False
        self.outbox.nak(part.handback.hold(part.abandon_lookups()))
        if self._partitions.get(part.n) is part:  # not a later _open of the same partition (taken again)
            del self._partitions[part.n]
        sub, part.sub = part.sub, None
        if sub is not None and not self.nc.is_closed:
            try:
                # UNSUB, a round trip (everything delivered before it has arrived), then what arrived
                # runs through the handler, whose NAKs part.handback holds.
                with anyio.move_on_after(5):
                    await sub.drain()
            except nats.errors.Error:
                pass
            await self._forget_pulls(part)

    async def _forget_pulls(self, part: _Partition) -> None:
        """Make the server drop the pulls of ``part``'s drained subscription before its NAKs go out.

        After the UNSUB they stay in the consumer's waiting queue until something looks at them; were
        a NAK the first to, ``loopAndGatherMsgs`` would take that redelivery from the front of the
        redelivery queue, ``nextWaiting`` drop the uninterested pulls and return none, and the
        redelivery go to the back (``addToRedeliverQueue``): a gap in its request. A consumer info
        request drops them (``infoWithSnapAndReply`` calls ``o.processWaiting(false)``, which removes
        the waiting requests without interest; nats-server 2.10 to 2.15)."""
        with anyio.move_on_after(FORGET_PULLS_TIMEOUT):
            try:
                await self.nc.jetstream(timeout=FORGET_PULLS_TIMEOUT).consumer_info(self.chunks_stream, part.consumer)
            except Exception as exc:  # noqa: BLE001  (then the first redelivery may go to the back: logged)
                log_event(log, logging.DEBUG, "forget_pulls_failed", partition=part.n, error=error_text(exc))

    def _fence(self, every: float = FENCE_EVERY) -> None:
        """Stop serving, at once, every partition whose lease may have run out: called before results
        leave (``OutboxPump``'s fence, at most every ``every`` seconds: one clock read per send
        otherwise) and by the watchdog (``every`` 0).

        Between two watchdog rounds a process that stalled past the lease's margin (a GC pause,
        SIGSTOP, a starved host) would, when it runs again, publish the results its PubAcks release,
        while the next owner may already have read the stored results and sealed a migrate on them:
        a stale attempt's result stored after the seal, under the id the resumed attempt's result
        then collides with. The partition's requests are handed over here (queued results dropped,
        nothing of it decided any more) and its subscription is closed in a task (or by the
        watchdog's next round), which then NAKs its inputs and what arrived meanwhile, in stream
        order, once the server has dropped its pulls (core/handback.py)."""
        leases = self.leases
        if leases is None:
            return
        now = self._clock()
        if now - self._fenced_at < every:
            return
        self._fenced_at = now
        expired = leases.expired(now)
        for n in expired:
            self.stats.leases_lost += 1
            log_event(log, logging.WARNING, "lease_expired", partition=n, instance=self.instance)
            part = self._partitions.pop(n, None)
            scheme = self.scheme
            tokens = self._abandon(lambda rid, n=n: scheme.of(rid) == n)
            if part is None:
                self.outbox.nak(in_stream_order(tokens, _reply_of))
                continue
            # Results dropped now; the NAKs wait until its subscription is closed (_close_lapsed).
            part.active = False
            self.outbox.nak(part.handback.hold([*part.abandon_lookups(), *tokens]))  # held: nothing NAKed yet
            self._lapsed.append(part)
            self._handing_back[n] = part
        if expired:
            self.stats.partitions = len(self._partitions)
            if self._tasks is not None:
                self._tasks.start_soon(self._close_lapsed)

    async def _close_lapsed(self) -> None:
        """Close the subscriptions of the partitions :meth:`_fence` gave up (their waiting pulls go too),
        then send their NAKs."""
        while self._lapsed:
            part = self._lapsed.pop()
            await self._close_partition(part)
            self.outbox.nak(self._handed_back(part))
        await self.publisher.pump()

    def _abandon(self, belongs: Callable[[str], bool]) -> list[Msg]:
        """Drop the queued results of the requests ``belongs`` picks and forget them; their chunks, to NAK."""
        # Requests whose results were given up before they were stored must be forgotten even when
        # the correlator holds them as finished: else, should the partition come back here, their
        # redelivered chunks would count as late (and be acked) instead of being recovered.
        tokens, unstored = self.outbox.abandon(belongs)
        tokens.extend(self.correlator.abandon(belongs, unstored))
        return tokens

    def _hand_over(self, belongs: Callable[[str], bool], parts: Iterable[_Partition] = ()) -> None:
        """NAK the chunks of the requests ``belongs`` picks, with what ``parts`` (closed: their pulls
        gone) held, in stream order (core/handback.py)."""
        tokens = self._abandon(belongs)
        for part in parts:
            tokens.extend(self._handed_back(part))
        self.outbox.nak(in_stream_order(tokens, _reply_of))

    def _handed_back(self, part: _Partition) -> list[Msg]:
        """What ``part`` held, to NAK now (its pulls are gone); what it is given later is NAKed at once."""
        out = part.handback.release()
        if self._handing_back.get(part.n) is part:
            del self._handing_back[part.n]
        part.handed_back.set()
        return out

    def _given_up(self, g: GiveUp) -> None:
        """The outbox gave a result up and NAKed its request's queued tokens: forget the request here
        too (NAKing what the correlator held), so its redelivered chunks are recovered from what is stored."""
        rid = g.request_id
        self.outbox.nak(self.correlator.abandon(lambda r: r == rid, (rid,)))
        # Why its chunks come back, for the error result should they come back max_deliver times.
        unstored = self._unstored
        unstored.pop(rid, None)
        unstored[rid] = f"result seq {g.seq} was not stored after {g.attempts} attempts ({g.reason})"
        if len(unstored) > MAX_UNSTORED_CAUSES:
            del unstored[next(iter(unstored))]

    # ------------------------------------------------------------------------------- pulls
    async def _watchdog(self) -> None:
        """Keep every partition's pulls alive; resend overdue results; extend held chunks' ack deadlines.

        A chunk gets its first +WPI at the second progress round after it was first seen held, i.e.
        within ``2 * (ack_wait / 4 + interval) <= 3/4 * ack_wait`` of delivery: before redelivery.
        """
        interval = min(WATCHDOG_EVERY, self.settings.ack_wait / 8)
        while True:
            with anyio.move_on_after(interval):
                await self._wake.wait()
            self._wake = anyio.Event()
            try:
                await self._watch()
            except Exception as exc:
                log_event(log, logging.WARNING, "watchdog_failed", error=error_text(exc))

    async def _watch(self) -> None:
        if not self.nc.is_connected:
            return  # nothing can be sent; a reconnect is noticed on the first round after it
        now = self._clock()
        reconnects = self.nc.stats["reconnects"]
        reconnected = reconnects != self._reconnects
        self._reconnects = reconnects
        self._fence(every=0)
        await self._close_lapsed()
        for part in list(self._partitions.values()):
            if not part.active:
                continue
            credit = part.credit
            silent_for = now - credit.last_seen
            sub = part.sub
            # Deliveries waiting for the callback: the server answers, the partition is behind.
            behind = part.waiting or (sub is not None and sub.pending_msgs > 0)
            watch = credit.watch(now, reconnected, behind)
            if watch.lost:
                self.stats.lost_pulls += 1
                log_event(log, logging.INFO, "pull_lost", partition=part.n, silent_for=f"{silent_for:.1f}s")
            if watch.repair:
                self.stats.consumer_repairs += 1
                try:
                    await self._ensure_consumer(part)
                except Exception as exc:
                    log_event(log, logging.WARNING, "consumer_repair_failed", partition=part.n, error=error_text(exc))
                    continue
            if watch.pull:
                await self.pulls.pull(part)
        self._shed_held(now)
        self.publisher.tick(now, reconnected, self._unsettled)
        await self.publisher.pump()

    def _unsettled(self) -> Iterator[object]:
        """Every delivery still held: the correlator's, and those parked behind recovery lookups."""
        yield from self.correlator.unsettled()
        for part in list(self._partitions.values()):
            for d in part.lookups.tokens():
                yield d.msg

    def reconnected(self) -> None:
        """Run the watchdog's round now rather than up to an interval later: after an outage the
        server has forgotten our pulls, and the results readied meanwhile wait for that round (it
        sends them, and everything in flight, again)."""
        self._wake.set()

    def _shed_held(self, now: float) -> None:
        """Held prefill legs (and reorder backlogs) never stall a partition: the server delivers
        nothing more to a partition once ``max_ack_pending`` chunks are unacknowledged, so past 3/4
        of it the requests holding chunks longest without progress are ended (``overloaded``) until
        the partition holds 1/2; their chunks are acknowledged when the error results are stored."""
        cap = self._held_cap
        scheme = self.scheme
        for n, held in self.correlator.held_tokens(scheme.of).items():
            if held <= cap or n not in self._partitions:
                continue
            reason = (f"processor overloaded: partition {n} holds {held} unacknowledged chunks (more than 3/4 of "
                      f"max_ack_pending {self.settings.max_ack_pending}); the requests waiting longest were ended")
            decisions = self.correlator.shed(lambda rid, n=n: scheme.of(rid) == n, held - self._held_target, now,
                                             reason)
            log_event(log, logging.WARNING, "partition_shed", partition=n, held=held,
                      requests=sum(1 for d in decisions if isinstance(d, Result)))
            self.publisher.take(decisions, None)

    async def migrate(self, rid: str, request: MigrateRequest,
                      seal: Callable[[], Awaitable[MigrateReply]]) -> MigrateReply:
        """A migrate in durable mode: :meth:`.durable_recovery.Recovery.migrate`."""
        return await self.recovery.migrate(rid, request, seal)
