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
  chunk is not the first delivery of the request's first output chunk, reads the last stored
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
from typing import Awaitable, Callable

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import StorageType
from nats.js.errors import NotFoundError

from ..config import Settings
from ..core.credit import PullCredit
from ..core.events import Decision
from ..core.outbox import GiveUp, Outbox, OutboxConfig, OutboxStats, delivery_count, needs_lookup, resume_point
from ..core.partitions import PartitionScheme
from ..core.wire import ContractError
from ..logs import error_text, log_event
from .input import Pipeline
from .leases import LeaseChange, LeaseTable
from .outbox_pump import OutboxPump
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
)

log = logging.getLogger("streamproc.durable")

PULL_EXPIRES = 10.0  # seconds a pull request lives on the server
HEARTBEAT = 1.0  # idle heartbeat the server sends for a waiting pull request
LOST_PULL_AFTER = 3 * HEARTBEAT  # no message and no heartbeat for this long: the server forgot our pulls
WATCHDOG_EVERY = 0.25
RETRY_AFTER_ERROR = 0.5  # seconds before a failed pull (or one the server refused) is tried again
LOOKUP_TIMEOUT = 2.0
HANDOVER_TIMEOUT = 2.0  # a released partition's results may take this long to be stored before hand-over

class DurableStats(OutboxStats):
    """Counters of the durable input (merged into ``Processor.snapshot()``); the outbox's are inherited."""

    partitions: int = 0  # gauge: partitions this instance serves now
    members: int = 0  # gauge: live instances sharing the partitions
    pulls: int = 0
    lost_pulls: int = 0  # pulls re-issued because the server stopped answering them
    consumer_repairs: int = 0
    redelivered: int = 0  # messages delivered more than once
    recoveries: int = 0  # last-result lookups for requests this instance did not know
    resumed: int = 0  # lookups that found stored results (the request moved here)
    leases_acquired: int = 0
    leases_released: int = 0
    leases_lost: int = 0


def new_instance_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


# ---------------------------------------------------------------------------------- partitions

class _Partition:
    """One owned partition: its consumer, inbox subscription and pull credit."""

    __slots__ = ("n", "consumer", "filter", "cut", "inbox", "sub", "credit", "active", "pull_subject")

    def __init__(self, n: int, consumer: str, filter_subject: str, cut: int, stream: str, credit: PullCredit) -> None:
        self.n = n
        self.consumer = consumer
        self.filter = filter_subject
        self.cut = cut  # stored subject -> chunk subject: drop this many leading characters
        self.inbox = ""
        self.sub: Subscription | None = None
        self.credit = credit
        self.active = False
        self.pull_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"


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
        self._jsm = nc.jsm(timeout=LOOKUP_TIMEOUT)
        self._storage = StorageType(settings.stream_storage)
        self.chunks_stream = ""
        self.results_stream = ""
        self.leases: LeaseTable | None = None
        self.outbox = Outbox(OutboxConfig(max_attempts=settings.max_result_attempts,
                                          progress_every=settings.ack_wait / 4), self.stats)
        self.publisher = OutboxPump(nc, settings.subjects.result(""), self.outbox, clock=clock, notify=notify,
                                    give_up=self._given_up, publish=pipeline.publisher(nc.publish))
        self._partitions: dict[int, _Partition] = {}
        self._parse = pipeline.parse
        self._chunks_head = f"{settings.prefix}.chunks."
        # Outstanding credit reaches 1.5 batches; kept under nats-py's queue limit it can never make
        # the client drop deliveries (bytes can still overflow: the dropped() hook accounts for that).
        self._batch = max(1, min(settings.fetch_batch, settings.pending_msgs_limit * 2 // 3))
        self._pull_body = msgspec.json.encode({
            "batch": self._batch, "expires": int(PULL_EXPIRES * 1e9), "idle_heartbeat": int(HEARTBEAT * 1e9)})
        self._tasks: anyio.abc.TaskGroup | None = None
        self._reconnects = 0
        self._lease_lock = anyio.Lock()

    def owns(self, request_id: str) -> bool:
        """Whether this instance holds the lease of the request's partition (it alone answers for it)."""
        return self.scheme.of(request_id) in self._partitions

    # ---------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        s = self.settings
        js = self.nc.jetstream(timeout=10)
        subjects = s.subjects
        self.results_stream = await find_stream(js, subjects.all_results) or RESULTS_STREAM
        await ensure_results_stream(js, subjects, name=self.results_stream, max_age=s.results_max_age,
                                    duplicate_window=s.duplicate_window, storage=self._storage,
                                    replicas=s.stream_replicas)
        self.chunks_stream = await find_stream(js, self.scheme.source) or CHUNKS_STREAM
        await ensure_chunk_stream(js, ChunkStreamSpec(
            self.chunks_stream, self.scheme, s.chunks_max_age, s.duplicate_window, self._storage,
            s.stream_replicas, s.chunks_max_bytes))
        if self._batch < s.fetch_batch:
            log_event(log, logging.WARNING, "fetch_batch_reduced", fetch_batch=s.fetch_batch, used=self._batch,
                      detail="pending_msgs_limit is too small for the pull credit")
        await self.publisher.start()
        self.leases = LeaseTable(self.nc, f"{self.chunks_stream}_LEASES", s.partitions, self.instance,
                                 s.lease_ttl,
                                 replicas=s.stream_replicas, storage=self._storage, clock=self._clock)
        await self.leases.open()
        self._reconnects = self.nc.stats["reconnects"]
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        try:
            await self._rebalance()
            self._tasks.start_soon(self._lease_loop)
            self._tasks.start_soon(self._watchdog)
        except BaseException:
            self._tasks.cancel_scope.cancel()
            await self._tasks.__aexit__(None, None, None)
            raise
        log_event(log, logging.INFO, "durable_started", instance=self.instance, chunks_stream=self.chunks_stream,
                  results_stream=self.results_stream, partitions=s.partitions,
                  owned=",".join(map(str, sorted(self._partitions))) or "-")

    async def stop(self, timeout: float) -> None:
        """Hand everything over: stop reading, let results finish storing, NAK the rest, release leases."""
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            tasks.cancel_scope.cancel()
            await tasks.__aexit__(None, None, None)
        if self.nc.is_closed:
            return
        with anyio.move_on_after(timeout):
            for part in list(self._partitions.values()):
                await self._close_partition(part)
            if not await self.publisher.wait_idle(timeout):
                log_event(log, logging.WARNING, "stop_with_unstored_results", results=self.publisher.pending)
        self._hand_over(lambda rid: True)
        await self.publisher.pump()
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
        self.publisher.take(decisions, None)
        await self.publisher.pump()

    async def caught_up(self) -> None:
        """Return once every chunk delivered to any owned partition at the call has been handled
        (a control request must not overtake them)."""
        for part in list(self._partitions.values()):
            sub = part.sub
            await handled_all(sub, lambda: part.sub is sub)

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
            for n in change.acquired:
                try:
                    await self._open(n)
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

    async def _open(self, n: int) -> None:
        credit = PullCredit(self._batch, expires=PULL_EXPIRES, lost_after=LOST_PULL_AFTER,
                            retry_after=RETRY_AFTER_ERROR, now=self._clock())
        part = _Partition(n, partition_consumer_name(n), self.scheme.filter(n), len(self.scheme.head(n)),
                          self.chunks_stream, credit)
        await self._ensure_consumer(part)
        part.inbox = self.nc.new_inbox()
        part.sub = await self.nc.subscribe(part.inbox, cb=self._handler(part),
                                           pending_msgs_limit=self.settings.pending_msgs_limit,
                                           pending_bytes_limit=self.settings.pending_bytes_limit)
        part.active = True
        self._partitions[n] = part
        await self._pull(part)

    async def _ensure_consumer(self, part: _Partition) -> None:
        s = self.settings
        config = partition_consumer_config(part.consumer, part.filter, ack_wait=s.ack_wait,
                                           max_ack_pending=s.max_ack_pending)
        await ensure_consumer(self.nc.jetstream(timeout=10), self.chunks_stream, config)

    async def _lose(self, n: int, graceful: bool = False) -> None:
        """Stop serving partition ``n``: later arrivals are NAKed, held chunks NAKed, state dropped."""
        part = self._partitions.get(n)
        if part is not None:
            await self._close_partition(part)
        scheme = self.scheme

        def belongs(rid: str) -> bool:
            return scheme.of(rid) == n

        if graceful:  # let results already decided be stored, so the next owner's lookup sees them
            await self.publisher.wait_idle(HANDOVER_TIMEOUT, belongs)
        self._hand_over(belongs)
        await self.publisher.pump()

    async def _close_partition(self, part: _Partition) -> None:
        part.active = False
        self._partitions.pop(part.n, None)
        sub, part.sub = part.sub, None
        if sub is not None and not self.nc.is_closed:
            try:
                # Unsubscribing makes the server drop our waiting pulls; what was already
                # delivered runs through the handler, which NAKs it for the next owner.
                with anyio.move_on_after(5):
                    await sub.drain()
            except nats.errors.Error:
                pass

    def _hand_over(self, belongs: Callable[[str], bool]) -> None:
        # Requests whose results were given up before they were stored must be forgotten even when
        # the correlator holds them as finished: else, should the partition come back here, their
        # redelivered chunks would count as late (and be acked) instead of being recovered.
        tokens, unstored = self.outbox.abandon(belongs)
        tokens.extend(self.correlator.abandon(belongs, unstored))
        self.outbox.nak(tokens)

    def _given_up(self, g: GiveUp) -> None:
        """The outbox gave a result up and NAKed its request's queued tokens: forget the request here
        too (NAKing what the correlator held), so its redelivered chunks are recovered from what is stored."""
        rid = g.request_id
        self.outbox.nak(self.correlator.abandon(lambda r: r == rid, (rid,)))

    # ------------------------------------------------------------------------------- pulls

    async def _pull(self, part: _Partition) -> None:
        credit = part.credit
        credit.pulled(self._clock())
        self.stats.pulls += 1
        try:
            await self.nc.publish(part.pull_subject, self._pull_body, part.inbox)
        except Exception as exc:
            credit.pull_failed(self._clock())
            log_event(log, logging.DEBUG, "pull_failed", partition=part.n, error=error_text(exc))

    def _on_status(self, part: _Partition, msg: Msg) -> bool:
        """A status message on a pull inbox; True when a pull should go out now."""
        headers = msg.headers or {}
        code = headers.get("Status", "")
        description = headers.get("Description", "")
        pull = part.credit.status(code, headers.get("Nats-Pending-Messages"), description, self._clock())
        if code not in ("100", "408", "404"):
            log_event(log, logging.INFO, "pull_status", partition=part.n, status=code, description=description)
        return pull

    async def _watchdog(self) -> None:
        """Keep every partition's pulls alive; resend overdue results; extend held chunks' ack deadlines.

        A chunk gets its first +WPI at the second progress round after it was first seen held, i.e.
        within ``2 * (ack_wait / 4 + interval) <= 3/4 * ack_wait`` of delivery: before redelivery.
        """
        interval = min(WATCHDOG_EVERY, self.settings.ack_wait / 8)
        while True:
            await anyio.sleep(interval)
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
        if self.leases is not None:
            for n in self.leases.expired(now):
                self.stats.leases_lost += 1
                log_event(log, logging.WARNING, "lease_expired", partition=n, instance=self.instance)
                await self._lose(n)
        for part in list(self._partitions.values()):
            if not part.active:
                continue
            credit = part.credit
            silent_for = now - credit.last_seen
            watch = credit.watch(now, reconnected)
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
                await self._pull(part)
        self.publisher.tick(now, reconnected, self.correlator.unsettled)
        await self.publisher.pump()

    # ----------------------------------------------------------------------------- hot path

    def _handler(self, part: _Partition) -> Callable[[Msg], Awaitable[None]]:
        clock = self._clock
        parse = self._parse
        head = self._chunks_head
        cut = part.cut
        correlator = self.correlator
        receive = self.pipeline.receive
        knows = correlator.knows
        publisher = self.publisher
        take = publisher.take
        pump = publisher.pump
        outbox = self.outbox
        queue = outbox.take  # the outbox itself on the common path: one call less per message
        notify = self.pipeline.notify
        delivered = part.credit.delivered
        stats = self.stats

        async def on_message(msg: Msg) -> None:
            reply = msg.reply
            if not reply:
                if self._on_status(part, msg) and part.active:
                    await self._pull(part)
                return
            if not part.active:  # partition handed over: the next owner gets it at once
                outbox.nak((msg,))
                await pump()
                return
            now = clock()
            if delivered(now):
                await self._pull(part)
            if delivery_count(reply) > 1:  # every redelivery, of known requests too (a metric)
                stats.redelivered += 1
            try:
                chunk = parse(head + msg.subject[cut:], msg.headers, msg.data, msg)
            except ContractError as exc:
                take(self.pipeline.contract_error(exc, msg, acknowledged=True), exc.request_id)
                await pump()
                return
            rid = chunk.request_id
            if not knows(rid) and needs_lookup(chunk.seq, chunk.role, reply):
                if not await self._recover(rid, chunk.format, msg, now):
                    await pump()
                    return
            notices = queue(receive(chunk, now), rid, now)
            if notices:
                for n in notices:
                    notify(n)
            await pump()

        return on_message

    async def _recover(self, rid: str, format: str | None, msg: Msg, now: float) -> bool:
        """Resume after the last stored result of ``rid``; False (and a delayed NAK) if it cannot be read."""
        self.stats.recoveries += 1
        try:
            stored = await self._jsm.get_last_msg(self.results_stream, self.settings.subjects.result(rid))
        except NotFoundError:
            return True  # nothing stored: every chunk of it is still unacknowledged, start afresh
        except Exception as exc:
            log_event(log, logging.WARNING, "recovery_lookup_failed", request_id=rid, error=error_text(exc),
                      retry_in="1s")
            self.outbox.nak((msg,), delay=1.0)
            return False
        point = resume_point(stored.headers)
        if point is None:
            return True
        next_seq, final = point
        self.correlator.resume(rid, next_seq, final, now, format)
        self.stats.resumed += 1
        log_event(log, logging.INFO, "request_resumed", request_id=rid, next_seq=next_seq, final=final)
        return True
