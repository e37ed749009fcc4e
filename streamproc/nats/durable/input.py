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
handling, retries and settle order in :mod:`streamproc.core.outbox`, the recovery decisions in
:mod:`streamproc.core.recovery`, pull credit in :mod:`streamproc.core.credit`, lookups in
:mod:`streamproc.core.lookups`, the hand-over's NAK order in :mod:`streamproc.core.handback`.
Their I/O is the other modules of this package, one concept each, which this one wires together
(streams, stores, task group, start and stop, joins run off the loop):

- :mod:`streamproc.nats.durable.partitions`: the partitions this instance owns, taken and given
  up through leases (:mod:`streamproc.nats.durable.leases`), hand-over, the fence, the watchdog;
- :mod:`streamproc.nats.durable.pulls`: each partition's pull requests and status messages;
- :mod:`streamproc.nats.durable.deliveries`: a partition's message handlers, where every delivery
  is decided, recovery lookups run as tasks, poison chunks end their request;
- :mod:`streamproc.nats.durable.recovery`: requests adopted from the stores, and migrates;
- :mod:`streamproc.nats.durable.outbox_pump`: results and acks moved;
- :mod:`streamproc.nats.durable.migrations`: seal records and stored bodies read back;
- :mod:`streamproc.nats.durable.strays`: chunks stored under a subject no partition reads.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import Annotated, Awaitable, Callable

import anyio
import msgspec
from msgspec import Meta
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription
from nats.js.api import StorageType, StreamConfig

from ...config import Settings
from ...core.codec import ErrorKind
from ...core.correlator import Work
from ...core.errors import over_max_payload
from ...core.events import Decision, MigrateReply, MigrateRequest
from ...core.outbox import GiveUp, Outbox, OutboxConfig, OutboxStats
from ...core.partitions import PartitionScheme
from ...logs import error_text, log_event
from ..input import Pipeline, join_cpu_clock, run_join
from .deliveries import Deliveries
from .partitions import WATCHDOG_EVERY, Partitions
from .pulls import Pulls
from .recovery import Recovery
from .leases import LeaseTable
from .config_watch import ConfigWatch
from .migrations import MigrationLedger, bucket_problems
from .outbox_pump import OutboxPump
from .strays import StraySweeper, stray_consumer_config
from ..streams import (
    CHUNKS_STREAM,
    RESULTS_STREAM,
    ChunkStreamSpec,
    ensure_chunk_stream,
    ensure_results_stream,
    find_stream,
    results_stream_check,
    server_has_fast_batches,
)

log = logging.getLogger("streamproc.durable")

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
    lookups_queued: Annotated[int, Meta(description="chunks that waited for a lookup slot (--max-lookups in "
                                                    "flight across the partitions)")] = 0
    lookup_retries: Annotated[int, Meta(description="failed lookups tried again with their chunks held, instead "
                                                    "of a NAK")] = 0
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
    consumers_retuned: Annotated[int, Meta(description="partition consumers whose ack_wait, max_ack_pending or "
                                                       "max_deliver were found edited under the running "
                                                       "processor, and set back")] = 0
    stream_config_changes: Annotated[int, Meta(description="problems found in the chunk or results stream or the "
                                                           "migrations bucket edited under the running "
                                                           "processor (each new set once)")] = 0
    lease_bucket_recreations: Annotated[int, Meta(description="times the lease bucket was found deleted (and "
                                                              "made again) under the running processor: no "
                                                              "partition taken for a lease ttl after")] = 0
    lease_bucket_changes: Annotated[int, Meta(description="times the lease bucket's max age was found edited "
                                                          "under the running processor (leases then held for "
                                                          "the shorter of it and --lease-ttl)")] = 0


def new_instance_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def _drop_body(token: object) -> None:
    """A chunk's token entered the outbox (``Outbox(decided=...)``): its chunk is decided, and what is
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
                             decided=_drop_body)
        self.outbox_pump = OutboxPump(nc, settings.subjects.result(""), self.outbox, clock=clock, notify=notify,
                                    give_up=self._given_up, publish=pipeline.publisher(nc.publish),
                                    limited=pipeline.limited)
        self.pulls = Pulls(nc, settings, self.scheme, self.outbox, self.stats, clock, pipeline.limited)
        self.partitions = Partitions(nc, settings, self.scheme, self.correlator, self.outbox, self.outbox_pump,
                                     self.pulls, self.stats, clock, self.instance, tasks=lambda: self._tasks)
        self.outbox_pump.fence = self.partitions.fence  # before any result is sent (the partitions need the pump)
        self._unstored: dict[str, str] = {}  # request id -> why its last result was given up
        # Joins that decode sequence data run in one worker thread, as in core mode (codec instances
        # share decompression contexts, which are not thread safe); the loop keeps serving the rest.
        pipeline.correlator.offload_joins = True
        self._limiter = anyio.CapacityLimiter(1)
        self._join_clock = join_cpu_clock()  # the join thread and the codec's helper threads
        self._tasks: anyio.abc.TaskGroup | None = None
        partitions = self.partitions
        self.recovery = Recovery(nc, settings, self.scheme, self.correlator, self.outbox_pump, self.stats, clock,
                                 pipeline.limited, partitions=partitions.owned, migrating=partitions.migrating,
                                 caught_up=partitions.caught_up, owns=partitions.owns, hand_over=partitions.hand_over,
                                 note_sealed=partitions.note_sealed)
        self.deliveries = Deliveries(nc, settings, pipeline, self.outbox, self.outbox_pump, self.pulls, self.recovery,
                                     self.stats, clock, unstored=self._unstored, offload=self._offload,
                                     tasks=lambda: self._tasks)
        partitions.deliveries = self.deliveries  # a partition it opens gets its handlers

    def _stray(self) -> None:
        self.stats.strays += 1
        self.pipeline.io.unreadable += 1

    @property
    def reading(self) -> bool:
        """Whether this instance owns a partition (until then no chunk reaches it)."""
        return self.stats.partitions > 0

    def owns(self, request_id: str) -> bool:
        """Whether this instance holds the lease of the request's partition (it alone answers for it)."""
        return self.partitions.owns(request_id)

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
        chunks_spec = ChunkStreamSpec(self.chunks_stream, self.scheme, s.chunks_max_age, s.duplicate_window,
                                      self._storage, s.stream_replicas, s.chunks_max_bytes)
        await ensure_chunk_stream(js, chunks_spec, max_payload=self.nc.max_payload)
        results_check = results_stream_check(subjects, name=self.results_stream, max_age=s.results_max_age,
                                             duplicate_window=s.duplicate_window, storage=self._storage,
                                             replicas=s.stream_replicas, max_payload=self.nc.max_payload)
        if self.pulls.batch < s.fetch_batch:
            log_event(log, logging.WARNING, "fetch_batch_reduced", fetch_batch=s.fetch_batch, used=self.pulls.batch,
                      detail="pending_msgs_limit is too small for the pull credit")
        await self.outbox_pump.start()
        self.leases = LeaseTable(self.nc, f"{self.chunks_stream}_LEASES", s.partitions, self.instance,
                                 s.lease_ttl,
                                 replicas=s.stream_replicas, storage=self._storage, clock=self._clock)
        await self.leases.open()
        self.ledger = MigrationLedger(self.nc, f"{self.chunks_stream}_MIGRATIONS", self.results_stream,
                                      s.subjects.result(""), ttl=s.results_max_age, replicas=s.stream_replicas,
                                      storage=self._storage, max_buffered_bytes=s.max_buffered_bytes)
        await self.ledger.open()
        recovery = self.recovery
        recovery.ledger, recovery.chunks_stream, recovery.results_stream = (
            self.ledger, self.chunks_stream, self.results_stream)
        self.deliveries.chunks_stream = self.chunks_stream
        partitions = self.partitions
        partitions.leases, partitions.ledger, partitions.chunks_stream = self.leases, self.ledger, self.chunks_stream
        if hasattr(self.nc, "defer_linger"):  # FastClient only (fast_client.py): coalesce writes at light load
            self.nc.flush_interval = s.flush_interval  # type: ignore[attr-defined]
            self.nc.defer_linger = s.ack_linger
            self.nc.pause_reads = s.flush_interval > 0  # type: ignore[attr-defined]  # read once per interval too (FastClient._write_now)
            self.outbox_pump.stage_writes()
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        try:
            await partitions.start(self._tasks)
            self._tasks.start_soon(ConfigWatch(self.nc, {
                self.chunks_stream: chunks_spec.differences, self.results_stream: results_check,
                f"KV_{self.ledger.bucket}": bucket_problems}, self.stats, s.lease_ttl).run)
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
                  owned=",".join(map(str, sorted(partitions.owned))) or "-")

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
        partitions = self.partitions
        parts = partitions.unfinished()
        with anyio.move_on_after(timeout):
            for part in parts:
                await partitions.close(part)
            await self.outbox_pump.wait_idle(timeout, drive=WATCHDOG_EVERY)  # the watchdog is cancelled
        # Checked outside the scope: the wait's own timeout starts later, so the scope always ended it first.
        if self.outbox_pump.pending:
            log_event(log, logging.WARNING, "stop_with_unstored_results", results=self.outbox_pump.pending)
        partitions.hand_over(lambda rid: True, parts)
        await self.outbox_pump.pump()
        if self.outbox_pump.staged:
            self.outbox_pump.flush_staged()  # the NAKs go with the flush below, not with a later timer write
        with anyio.move_on_after(timeout):
            if self.leases is not None:
                await self.leases.leave()
            await self.nc.flush()
        await self.outbox_pump.stop()
        self.stats.partitions = 0

    async def dispatch(self, decisions: list[Decision]) -> None:
        """Results decided by the timer (timeouts) take the same acknowledged path."""
        if self.outbox_pump.closed:
            return
        self.outbox_pump.take(self._offload(decisions), None)
        await self.outbox_pump.pump()

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
        if self.outbox_pump.closed:
            return
        now = self._clock()
        try:
            decisions = self.pipeline.finish(work, now)
        except Exception as exc:  # noqa: BLE001  (a bug must cost this request, not the input's task group)
            log_event(log, logging.ERROR, "join_finish_failed", request_id=work.request_id, error=error_text(exc))
            decisions = self.correlator.reject(work.request_id, f"internal error: {error_text(exc)}", now,
                                               kind=ErrorKind.INTERNAL)
        self.outbox_pump.take(self._offload(decisions, received), None, received)
        await self.outbox_pump.pump()

    async def caught_up(self) -> None:
        """Return once every chunk delivered to any owned partition at the call has been handled
        (a control request must not overtake them)."""
        await self.partitions.caught_up()

    def dropped(self, sub: Subscription | None, reply: str | None) -> None:
        """nats-py dropped a delivered message (slow consumer): it used up pull credit, and comes back
        after ``ack_wait``. Without this the credit would stay spent until the pull expires."""
        if not reply:
            return  # a status message: no credit
        for part in self.partitions.owned.values():
            if part.sub is sub:
                part.credit.dropped()
                return

    def reconnected(self) -> None:
        """Run the watchdog's round now (:meth:`Partitions.reconnected`)."""
        self.partitions.reconnected()

    def _given_up(self, g: GiveUp) -> None:
        """The outbox gave a result up and NAKed its request's queued tokens: forget the request here
        too (NAKing what the correlator held), so its redelivered chunks are recovered from what is stored.
        One that ``ends`` its request (nothing more of it can be stored) ends it here too: what the
        correlator held is terminated, and its later chunks are dropped on arrival. One that can never
        leave as it is (``replace``: over the server's ``max_payload``) ends its request now with an
        ``internal`` error result in its place, which acknowledges the given-up tokens once stored, as
        core mode does: redelivered, the chunk only made the same result again."""
        rid = g.request_id
        if g.ends:
            self.outbox.term(self.correlator.unstorable(rid, self._clock()))
            return
        if g.replace:
            reason = over_max_payload(g.seq, getattr(self.nc, "max_payload", 0))
            # g.format: a finished request keeps no codec, and the chunk's headers are gone (_drop_body)
            self.outbox_pump.take(self.correlator.unpublishable(rid, g.seq, reason, self._clock(), g.format,
                                                                settles=g.tokens), None)
            return
        self.outbox.nak(self.correlator.abandon(lambda r: r == rid, (rid,)))
        # Why its chunks come back, for the error result should they come back max_deliver times.
        unstored = self._unstored
        unstored.pop(rid, None)
        unstored[rid] = f"result seq {g.seq} was not stored after {g.attempts} attempts ({g.reason})"
        if len(unstored) > MAX_UNSTORED_CAUSES:
            del unstored[next(iter(unstored))]

    async def migrate(self, rid: str, request: MigrateRequest,
                      seal: Callable[[], Awaitable[MigrateReply]]) -> MigrateReply:
        """A migrate in durable mode: :meth:`.recovery.Recovery.migrate`."""
        return await self.recovery.migrate(rid, request, seal)
